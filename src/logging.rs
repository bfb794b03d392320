//! Logging, shaped for where it goes.
//!
//! - **Under systemd, natively** (stderr is the journal stream, see [`stderr_is_journal`],
//!   and journald's native socket takes our datagrams): each line is one journal entry sent
//!   over the native protocol (`logging/journal.rs`), with fields beside the message:
//!   `PRIORITY`, `SYSLOG_IDENTIFIER=cairn`, `CODE_FILE`/`CODE_LINE`, and the line's
//!   `CAIRN_EVENT` (a stable name per kind of line) with `CAIRN_PIPELINE`, `CAIRN_SINK`,
//!   `CAIRN_REASON`, `CAIRN_OFFSET`, `CAIRN_KEY` where they apply. So `journalctl -u cairn
//!   CAIRN_EVENT=dead_letter CAIRN_REASON=late` finds what it says. A line the socket refuses
//!   goes to stderr as below, so nothing is lost.
//! - **Under systemd, through stderr** (the journal stream, but no native socket): each line
//!   starts with its syslog priority, `<3>` error, `<4>` warn, `<6>` info, `<7>` debug and
//!   trace, so `journalctl -p warning` and the colours work; and a line carries no timestamp
//!   of its own, since the journal stamps every entry itself (two clocks on one line only
//!   disagree). A message of several lines gets the prefix on each, or the journal would file
//!   the continuation lines at its default priority.
//! - **Anywhere else**: the usual human format, `[TIMESTAMP LEVEL target] message`, with an
//!   RFC 3339 UTC timestamp.
//!
//! **The rule for "under systemd"**: `$JOURNAL_STREAM` names the device and inode of the
//! stream systemd connected to our stderr, and fd 2 is that stream (see
//! [`stderr_is_journal`]). Then the native socket is tried (`/run/systemd/journal/socket`,
//! or `$CAIRN_JOURNAL_SOCKET`). `$INVOCATION_ID` alone is not taken as a sign: systemd sets
//! it for every unit, also one whose stderr it pointed elsewhere on purpose
//! (`StandardError=file:..`, `systemd-run --pipe` handing us the caller's terminal), and
//! there the lines belong where stderr goes. And the socket alone is not either: it exists
//! on every systemd box, also for `cairn verify` typed at a terminal, whose lines belong on
//! that terminal.
//!
//! **Call sites** use [`event!`](crate::event): `crate::event!(warn, "dead_letter", pipeline =
//! p, reason = r; "dead letter: {}", what)`. The macro puts the event name and the fields on
//! the `log` record as key-values (the `log` crate's `kv` feature), so levels, `RUST_LOG`
//! and the stderr formats stay `log`'s and env_logger's; what it adds over writing the
//! key-values by hand is that the event name is required and comes first, and that a field
//! outside the fixed set is a compile error, not a silently new journal field.
//! `tests/it/journal.rs` fails on a `warn!`, `error!` or `info!` in `src/` without an
//! event name, and `tests/it/docs.rs` on an event name that `docs/` does not list.
//!
//! `RUST_LOG` sets the level in every case (default `info`).
//!
//! [`RateLimit`] keeps a flood of similar lines (one per dead letter, say) from drowning the
//! journal, which rate-limits per service and would then drop the lines that matter too.

use std::io::Write;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

mod journal;
pub mod progress;

/// A log line with its stable event name and the fields it concerns:
///
/// ```text
/// crate::event!(warn, "dead_letter", pipeline = name, reason = why, offset = rec.offset;
///     "dead letter: offset {} reason {why}", rec.offset);
/// ```
///
/// The level is `error`, `warn`, `info`, `debug` or `trace`; the event name a literal in
/// `snake_case`; each field one of `pipeline`, `sink`, `key`, `offset` (what the line is
/// about), `reason` (why: a dead letter's, say) and `suppressed` (the event a "K more" line
/// stands for), with a value that implements `Display`, sent as the journal field
/// `CAIRN_<FIELD>`; after the `;`, the message as for `format!`. See the module docs
/// of `logging` for where the line goes.
#[macro_export]
macro_rules! event {
    ($level:ident, $event:literal $(, $key:ident = $value:expr)* $(,)? ; $($arg:tt)+) => {{
        $( $crate::__event_field!($key); )*
        ::log::$level!(event = $event $(, $key:% = $value)* ; $($arg)+)
    }};
}

/// The fields [`event!`](crate::event) accepts: any other name fails to compile here.
#[doc(hidden)]
#[macro_export]
macro_rules! __event_field {
    (pipeline) => {};
    (sink) => {};
    (reason) => {};
    (offset) => {};
    (key) => {};
    (suppressed) => {};
}

/// The native journal, when the rule in the module docs says we run under it.
static JOURNAL: OnceLock<Option<journal::Journal>> = OnceLock::new();

fn native_journal() -> Option<&'static journal::Journal> {
    JOURNAL
        .get_or_init(|| {
            if !stderr_is_journal() {
                return None;
            }
            let path = std::env::var_os("CAIRN_JOURNAL_SOCKET")
                .filter(|p| !p.is_empty())
                .map_or_else(|| PathBuf::from(journal::SOCKET), PathBuf::from);
            journal::Journal::connect(&path).ok()
        })
        .as_ref()
}

/// Send one entry to the journal socket at `socket` (for the test against a real journald:
/// an entry over the datagram limit takes the memfd way).
#[doc(hidden)]
pub fn send_entry(socket: &std::path::Path, fields: &[(&str, &[u8])]) -> std::io::Result<()> {
    journal::Journal::connect(socket)?.send(fields)
}

/// env_logger for filtering and for stderr; the native journal in front of it when we run
/// under one.
struct Logger {
    inner: env_logger::Logger,
    journal: Option<&'static journal::Journal>,
}

impl log::Log for Logger {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        self.inner.enabled(metadata)
    }

    fn log(&self, record: &log::Record<'_>) {
        if !self.inner.matches(record) {
            return;
        }
        if let Some(j) = self.journal
            && send_native(j, record).is_ok()
        {
            return;
        }
        // A progress line on the terminal goes first, or the line would follow it on the
        // same line; the next step draws it again.
        progress::done();
        self.inner.log(record)
    }

    fn flush(&self) {
        self.inner.flush()
    }
}

/// The record's key-values as journal fields (`CAIRN_<KEY>`).
struct Fields(Vec<(String, String)>);

impl<'kvs> log::kv::VisitSource<'kvs> for Fields {
    fn visit_pair(
        &mut self,
        key: log::kv::Key<'kvs>,
        value: log::kv::Value<'kvs>,
    ) -> Result<(), log::kv::Error> {
        let name = format!("CAIRN_{}", key.as_str().to_ascii_uppercase());
        if journal::valid_name(&name) {
            self.0.push((name, value.to_string()));
        }
        Ok(())
    }
}

/// The journal entry for one record (see the module docs for its fields).
fn entry_fields(record: &log::Record<'_>) -> Vec<(String, String)> {
    let mut fields = vec![
        ("MESSAGE".to_string(), record.args().to_string()),
        ("PRIORITY".to_string(), priority(record.level()).to_string()),
        ("SYSLOG_IDENTIFIER".to_string(), "cairn".to_string()),
    ];
    if let Some(file) = record.file() {
        fields.push(("CODE_FILE".to_string(), file.to_string()));
    }
    if let Some(line) = record.line() {
        fields.push(("CODE_LINE".to_string(), line.to_string()));
    }
    let mut kv = Fields(Vec::new());
    let _ = record.key_values().visit(&mut kv);
    fields.extend(kv.0);
    fields
}

fn send_native(j: &journal::Journal, record: &log::Record<'_>) -> std::io::Result<()> {
    let fields = entry_fields(record);
    let refs: Vec<(&str, &[u8])> = fields
        .iter()
        .map(|(n, v)| (n.as_str(), v.as_bytes()))
        .collect();
    j.send(&refs)
}

/// Install the logger. Calling it twice is harmless (the second call does nothing).
pub(crate) fn init() {
    let mut b = env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info"));
    if !rust_log_set() {
        // Let everything through env_logger; `log::set_max_level` is the one knob, so the
        // configured `[logging] level` can change on SIGHUP (see [`set_level`]).
        b.filter_level(log::LevelFilter::Trace);
    }
    b.target(env_logger::Target::Stderr);
    if stderr_is_journal() {
        b.format(|buf, record| {
            let prefix = format!("<{}>", priority(record.level()));
            let text = format!(
                "[{:<5} {}] {}",
                record.level(),
                record.target(),
                record.args()
            );
            for line in text.lines() {
                writeln!(buf, "{prefix}{line}")?;
            }
            Ok(())
        });
    } else {
        b.format(|buf, record| {
            writeln!(
                buf,
                "[{} {:<5} {}] {}",
                crate::clock::utc_timestamp(crate::clock::system_now()),
                record.level(),
                record.target(),
                record.args()
            )
        });
    }
    let inner = b.build();
    let filter = inner.filter();
    let logger = Logger {
        inner,
        journal: native_journal(),
    };
    if log::set_boxed_logger(Box::new(logger)).is_ok() {
        log::set_max_level(if rust_log_set() {
            filter
        } else {
            log::LevelFilter::Info
        });
    }
}

fn rust_log_set() -> bool {
    std::env::var_os("RUST_LOG").is_some_and(|v| !v.is_empty())
}

/// Apply the configured level (at start and on SIGHUP). `RUST_LOG`, when set, wins: it can
/// say more (per-module filters) than one level.
pub(crate) fn set_level(level: log::LevelFilter) {
    if rust_log_set() {
        return;
    }
    if log::max_level() != level {
        log::set_max_level(level);
        crate::event!(info, "log_level"; "log level is now {level}");
    }
}

/// A line that ends the process (`cairn: MESSAGE` on stderr), outside the logger so it shows
/// even with `RUST_LOG=off`; under the journal each line carries the error priority (and,
/// natively, the event name `fatal`).
pub fn fatal(message: &str) {
    if let Some(j) = native_journal() {
        let text = format!("cairn: {message}");
        let sent = j.send(&[
            ("MESSAGE", text.as_bytes()),
            ("PRIORITY", b"3"),
            ("SYSLOG_IDENTIFIER", b"cairn"),
            ("CAIRN_EVENT", b"fatal"),
        ]);
        if sent.is_ok() {
            return;
        }
    }
    let journal = stderr_is_journal();
    let mut err = std::io::stderr().lock();
    for (i, line) in message.lines().enumerate() {
        let prefix = if journal { "<3>" } else { "" };
        let head = if i == 0 { "cairn: " } else { "" };
        let _ = writeln!(err, "{prefix}{head}{line}");
    }
}

/// The syslog priority of a `log` level (`sd-daemon(3)`: `SD_ERR` .. `SD_DEBUG`).
pub fn priority(level: log::Level) -> u8 {
    match level {
        log::Level::Error => 3,
        log::Level::Warn => 4,
        log::Level::Info => 6,
        log::Level::Debug | log::Level::Trace => 7,
    }
}

/// Whether stderr is the journal stream systemd set up for us.
///
/// `$JOURNAL_STREAM` is `DEVICE:INODE` of that stream. It is inherited by anything we start
/// and survives `2>file` in a shell started from a unit, so `systemd.exec(5)` asks programs to
/// compare it with what stderr actually is; we do, and trust the variable alone only when
/// stderr cannot be examined.
pub(crate) fn stderr_is_journal() -> bool {
    let Some(value) = std::env::var_os("JOURNAL_STREAM") else {
        return false;
    };
    let Some((dev, ino)) = value.to_str().and_then(parse_journal_stream) else {
        return false;
    };
    use std::os::unix::fs::MetadataExt;
    match std::fs::metadata("/proc/self/fd/2") {
        Ok(m) => m.dev() == dev && m.ino() == ino,
        Err(_) => true,
    }
}

/// `"DEVICE:INODE"`, both decimal, as systemd writes `$JOURNAL_STREAM`.
pub(crate) fn parse_journal_stream(value: &str) -> Option<(u64, u64)> {
    let (dev, ino) = value.trim().split_once(':')?;
    Some((dev.parse().ok()?, ino.parse().ok()?))
}

/// At most `max_lines` lines per `interval`; the rest are counted, and the count is reported
/// once, in a "K more" line, when the next interval lets a line through.
///
/// Intervals are fixed windows that start at the first line after the previous one ended.
/// The clock is a parameter, so tests need no sleeping.
#[derive(Debug, Clone)]
pub(crate) struct RateLimit {
    max_lines: u32,
    interval: Duration,
    window_start: Option<Instant>,
    in_window: u32,
    suppressed: u64,
}

/// What [`RateLimit::check`] decided for one line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Verdict {
    /// Log this line.
    pub allowed: bool,
    /// Lines suppressed in the previous interval, to report now (and only now).
    pub suppressed: u64,
}

impl RateLimit {
    pub fn new(max_lines: u32, interval: Duration) -> RateLimit {
        RateLimit {
            max_lines,
            interval,
            window_start: None,
            in_window: 0,
            suppressed: 0,
        }
    }

    /// One more line at `now`: may it be logged, and is a suppression count due?
    pub fn check(&mut self, now: Instant) -> Verdict {
        let mut report = 0;
        if self.window_start.is_none_or(|s| now >= s + self.interval) {
            report = std::mem::take(&mut self.suppressed);
            self.window_start = Some(now);
            self.in_window = 0;
        }
        let allowed = self.in_window < self.max_lines;
        if allowed {
            self.in_window += 1;
        } else {
            self.suppressed += 1;
        }
        Verdict {
            allowed,
            suppressed: report,
        }
    }

    /// [`RateLimit::check`], then the warnings it allows: `"{what}: K more {kind} in the last
    /// interval"` (event `lines_suppressed`, with `suppressed = event`) when a count is due,
    /// and `line()`, which logs this line with [`event!`](crate::event) under `event`, when
    /// this one may go out. Returns the verdict.
    pub fn warn(
        &mut self,
        now: Instant,
        event: &'static str,
        what: &str,
        kind: &str,
        line: impl FnOnce(),
    ) -> Verdict {
        let v = self.check(now);
        if v.suppressed > 0 {
            crate::event!(warn, "lines_suppressed", suppressed = event;
                "{what}: {} more {kind} in the last {:?}", v.suppressed, self.interval);
        }
        if v.allowed {
            line();
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warn_rate_limits_as_check_does() {
        // Its lines go to `log` (off in tests, which also skips building them); what it
        // decided is the verdict.
        let t0 = Instant::now();
        let mut r = RateLimit::new(1, Duration::from_secs(60));
        let line = || {};
        let first = r.warn(t0, "x", "x", "more", line);
        let rest: Vec<_> = (0..2).map(|_| r.warn(t0, "x", "x", "more", line)).collect();
        let later = r.warn(t0 + Duration::from_secs(60), "x", "x", "more", line);
        assert_eq!((first.allowed, first.suppressed), (true, 0));
        assert!(rest.iter().all(|v| !v.allowed), "one line per interval");
        assert_eq!(
            (later.allowed, later.suppressed),
            (true, 2),
            "the count comes once"
        );
    }

    #[test]
    fn a_burst_is_cut_to_the_limit_and_the_rest_is_reported_once() {
        let t0 = Instant::now();
        let mut rl = RateLimit::new(3, Duration::from_secs(10));
        let allowed: Vec<bool> = (0..10).map(|_| rl.check(t0).allowed).collect();
        assert_eq!(
            allowed,
            [
                true, true, true, false, false, false, false, false, false, false
            ]
        );
        let next = rl.check(t0 + Duration::from_secs(10));
        assert_eq!(
            next,
            Verdict {
                allowed: true,
                suppressed: 7
            }
        );
        assert_eq!(rl.check(t0 + Duration::from_secs(11)).suppressed, 0);
    }

    #[test]
    fn a_records_event_and_fields_become_cairn_journal_fields_beside_the_message() {
        let kvs: &[(&str, &str)] = &[
            ("event", "dead_letter"),
            ("reason", "late"),
            ("offset", "7"),
        ];
        let args = format_args!("dead letter: offset 7");
        let record = log::Record::builder()
            .args(args)
            .level(log::Level::Warn)
            .file(Some("src/x.rs"))
            .line(Some(12))
            .key_values(&kvs)
            .build();
        let fields = entry_fields(&record);
        let get = |n: &str| fields.iter().find(|(k, _)| k == n).map(|(_, v)| v.as_str());
        assert_eq!(get("MESSAGE"), Some("dead letter: offset 7"));
        assert_eq!(get("PRIORITY"), Some("4"));
        assert_eq!(get("SYSLOG_IDENTIFIER"), Some("cairn"));
        assert_eq!(get("CODE_FILE"), Some("src/x.rs"));
        assert_eq!(get("CODE_LINE"), Some("12"));
        assert_eq!(get("CAIRN_EVENT"), Some("dead_letter"));
        assert_eq!(get("CAIRN_REASON"), Some("late"));
        assert_eq!(get("CAIRN_OFFSET"), Some("7"));
        assert_eq!(get("CAIRN_KEY"), None, "only the fields the line has");
    }

    #[test]
    fn journal_stream_is_device_colon_inode() {
        assert_eq!(parse_journal_stream("8:12345"), Some((8, 12345)));
        assert_eq!(parse_journal_stream("8-12345"), None);
        assert_eq!(parse_journal_stream("x:1"), None);
    }

    #[test]
    fn levels_map_to_syslog_priorities() {
        assert_eq!(priority(log::Level::Error), 3);
        assert_eq!(priority(log::Level::Warn), 4);
        assert_eq!(priority(log::Level::Info), 6);
        assert_eq!(priority(log::Level::Debug), 7);
        assert_eq!(priority(log::Level::Trace), 7);
    }
}
