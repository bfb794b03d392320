//! Failpoints at each durability boundary (issue 5), compiled in only with the `failpoints`
//! cargo feature. Without it every call below is an inlined no-op.
//!
//! Armed by `CAIRN_FAILPOINTS`, a comma-separated list of `name=action[@n]`:
//! - `abort` kills the process on the spot (SIGABRT: no destructors, no flush), like a crash;
//! - `error` fails the operation with an I/O error, which the agent treats as fatal;
//! - `on` turns on a deliberately unsafe behaviour (names starting with `unsafe.`), used to
//!   show that the crash harness detects the loss it would cause;
//! - `pause:MS` holds the thread that passes the point for MS milliseconds, then goes on:
//!   to show what other threads do meanwhile (the loop while a checkpoint commits beside
//!   it, `tests/it/commit_beside.rs`);
//! - `panic:N` panics where the code passes the point with the value `N` (a log offset):
//!   unlike `@n`, which counts hits in one process, a value names the same record in every
//!   run, so a restart that replays it panics again, as a real bug would;
//! - `@n` fires on the n-th hit only (1-based; default 1); `@n+` on the n-th and every later.
//!
//! | name | where |
//! |---|---|
//! | `log.before_fsync`, `log.after_fsync` | around each log segment fdatasync (the seam) |
//! | `log.segment_roll` | a new segment file exists, its directory entry is not yet synced |
//! | `log.segment_delete` | a segment was unlinked, the directory not yet synced |
//! | `retention.after_delete` | retention deleted segments (dir synced), the next checkpoint not yet run |
//! | `ingest.before_puback`, `ingest.after_puback` | around the acks of a committed batch |
//! | `checkpoint.before_commit`, `checkpoint.after_commit` | around a checkpoint's transaction (on the commit thread, beside the live loop) |
//! | `checkpoint.ledger_written` | a checkpoint's ledger chunks are written, its transaction not yet run |
//! | `store.flush_chunks` (`on`) | flush sled's buffers once the ledger chunks are written (as its flusher may) |
//! | `checkpoint.before_fsync`, `checkpoint.after_fsync` | around the fsync of sled's `db` |
//! | `backfill.after_slice` | a backfill slice was applied, not yet checkpointed |
//! | `outbox.before_publish`, `outbox.after_publish` | around handing a result to MQTT (from the outbox, or before its checkpoint) |
//! | `publish.acked_before_checkpoint` | the broker acknowledged a result whose checkpoint is not committed yet |
//! | `outbox.before_delete`, `outbox.after_delete` | around deleting an entry on PUBACK |
//! | `unsafe.ack_before_fsync` (`on`) | PUBACK a batch *before* its log fsync |
//! | `unsafe.skip_store_fsync` (`on`) | skip the fsync after `sled::Db::flush()` |
//! | `start.plan_committed` | the start plan (new generations, a restored outbox moved) is committed, the restore marker not yet removed |
//! | `engine.panic_at_offset` (`panic:N`) | applying the log record at offset N, live or in replay |
//!
//! ## Why our own and not the `fail` crate
//!
//! Decided for issue 12 (checked against `fail` 0.5, 2026-11-30). `fail` has the same shape
//! (a `failpoints` feature, points that compile to nothing without it, an environment
//! variable), but its actions are `off`, `return`, `sleep`, `panic`, `print`, `pause`,
//! `yield` and `delay`, and the crash harness needs what it lacks:
//! - **A crash, not a panic.** `abort` must end the process with no unwinding, no
//!   destructors and no buffered write flushed, as a power cut does. `fail`'s `panic`
//!   unwinds, and the quarantine's `catch_unwind` (`processor.rs`) would catch it as a
//!   processing failure instead: the test would measure the wrong thing.
//! - **A value, not a hit count.** `panic:N` fires where the code passes the value `N` (a
//!   log offset), so the record keeps panicking across restarts and replay. `fail` counts
//!   hits within one process; with `return(N)` each call site would have to parse and
//!   compare the string itself.
//! - **`@n` and `@n+`** would become chains such as `(n-1)*off->1*panic` for every test
//!   to build (and to get wrong by one).
//!
//! The crate would save us the parser and the table, about 100 lines, and cost a second
//! syntax in `CAIRN_FAILPOINTS` for every crash test to learn.

use std::io;

#[cfg(feature = "failpoints")]
mod armed {
    use std::collections::HashMap;
    use std::io;
    use std::sync::{Mutex, OnceLock};

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Action {
        Abort,
        Error,
        On,
        /// Panic when passed with this value.
        Panic(u64),
        /// Hold the passing thread this many milliseconds.
        Pause(u64),
    }

    #[derive(Debug)]
    struct Point {
        action: Action,
        at: u64,
        and_later: bool,
        hits: u64,
    }

    fn table() -> &'static Mutex<HashMap<String, Point>> {
        static TABLE: OnceLock<Mutex<HashMap<String, Point>>> = OnceLock::new();
        TABLE.get_or_init(|| {
            let spec = std::env::var("CAIRN_FAILPOINTS").unwrap_or_default();
            let mut map = HashMap::new();
            for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
                let (name, rest) = item.split_once('=').unwrap_or((item, "abort"));
                let (action, at) = rest.split_once('@').unwrap_or((rest, "1"));
                let action = match action {
                    "abort" => Action::Abort,
                    "error" => Action::Error,
                    "on" => Action::On,
                    other => {
                        let value = |prefix: &str| other.strip_prefix(prefix)?.parse().ok();
                        match (value("panic:"), value("pause:")) {
                            (Some(n), _) => Action::Panic(n),
                            (_, Some(ms)) => Action::Pause(ms),
                            _ => panic!("CAIRN_FAILPOINTS: unknown action `{other}` for `{name}`"),
                        }
                    }
                };
                let and_later = at.ends_with('+');
                let at: u64 = at
                    .trim_end_matches('+')
                    .parse()
                    .expect("CAIRN_FAILPOINTS: bad @n");
                map.insert(
                    name.to_string(),
                    Point {
                        action,
                        at,
                        and_later,
                        hits: 0,
                    },
                );
            }
            Mutex::new(map)
        })
    }

    fn fire(name: &str) -> Option<Action> {
        let mut t = table().lock().unwrap_or_else(|e| e.into_inner());
        let p = t.get_mut(name)?;
        p.hits += 1;
        let due = p.hits == p.at || (p.and_later && p.hits >= p.at);
        due.then_some(p.action)
    }

    pub fn hit(name: &str) -> io::Result<()> {
        match fire(name) {
            Some(Action::Abort) => {
                eprintln!("failpoint {name}: abort");
                std::process::abort();
            }
            Some(Action::Error) => {
                eprintln!("failpoint {name}: error");
                Err(io::Error::other(format!("failpoint {name}")))
            }
            Some(Action::Pause(ms)) => {
                eprintln!("failpoint {name}: pause {ms} ms");
                std::thread::sleep(std::time::Duration::from_millis(ms));
                eprintln!("failpoint {name}: pause over");
                Ok(())
            }
            Some(Action::On) | Some(Action::Panic(_)) | None => Ok(()),
        }
    }

    pub(crate) fn panic_at(name: &str, value: u64) {
        let armed = {
            let t = table().lock().unwrap_or_else(|e| e.into_inner());
            t.get(name)
                .is_some_and(|p| p.action == Action::Panic(value))
        };
        // Outside the lock: the panic must not poison the table for the run that follows.
        if armed {
            panic!("failpoint {name}: panic at {value}");
        }
    }

    pub(crate) fn enabled(name: &str) -> bool {
        let t = table().lock().unwrap_or_else(|e| e.into_inner());
        t.get(name).is_some_and(|p| p.action == Action::On)
    }
}

/// Pass a failpoint: may abort the process or return an injected I/O error.
#[cfg(feature = "failpoints")]
pub fn hit(name: &str) -> io::Result<()> {
    armed::hit(name)
}

/// Is the (unsafe) behaviour `name` switched on?
#[cfg(feature = "failpoints")]
pub(crate) fn enabled(name: &str) -> bool {
    armed::enabled(name)
}

/// Panic if `name` is armed with `panic:value` (a stand-in for a bug we have not found).
#[cfg(feature = "failpoints")]
pub(crate) fn panic_at(name: &str, value: u64) {
    armed::panic_at(name, value)
}

#[cfg(not(feature = "failpoints"))]
#[inline(always)]
pub(crate) fn panic_at(_name: &str, _value: u64) {}

#[cfg(not(feature = "failpoints"))]
#[inline(always)]
pub fn hit(_name: &str) -> io::Result<()> {
    Ok(())
}

#[cfg(not(feature = "failpoints"))]
#[inline(always)]
pub(crate) fn enabled(_name: &str) -> bool {
    false
}
