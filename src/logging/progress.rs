//! Progress of long commands (`verify`, `savepoint create|restore`, `inspect` over a large
//! store), for an operator watching a terminal.
//!
//! A facade like `log`'s: the loops that take long (the log scan, the savepoint check and
//! build, the inspection copy) report [`step`]s, which cost one atomic read while nothing
//! listens, and the command installs a reporter ([`install`]) only when stderr is a
//! terminal: piped or under systemd, nothing is drawn. The agent never installs one. So the
//! library needs no progress parameter on every function between the command and the loop,
//! and the loops stay free of terminal code.

use std::sync::OnceLock;

/// What a step counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    Bytes,
    Entries,
}

/// One report: `done` of `total` (if known) `unit`s of the phase `what`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Step {
    pub what: &'static str,
    pub done: u64,
    pub total: Option<u64>,
    pub unit: Unit,
}

/// Receives the steps; draws them, or not.
pub trait Reporter: Send + Sync {
    fn step(&self, step: Step);
    /// The phase is over: its line goes (before the command prints its result).
    fn done(&self);
}

static REPORTER: OnceLock<Box<dyn Reporter>> = OnceLock::new();

/// Listen to the steps from now on (once per process; a second call is ignored).
pub fn install(r: Box<dyn Reporter>) {
    let _ = REPORTER.set(r);
}

/// Report progress of a long phase (nothing happens without a reporter).
pub fn step(what: &'static str, done: u64, total: Option<u64>, unit: Unit) {
    if let Some(r) = REPORTER.get() {
        r.step(Step {
            what,
            done,
            total,
            unit,
        });
    }
}

/// The current phase is over.
pub fn done() {
    if let Some(r) = REPORTER.get() {
        r.done();
    }
}
