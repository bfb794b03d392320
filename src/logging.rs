//! Logging to stderr, shaped for where stderr goes.
//!
//! - **Under systemd** (stderr is the journal stream named by `$JOURNAL_STREAM`): each line
//!   starts with its syslog priority, `<3>` error, `<4>` warn, `<6>` info, `<7>` debug and
//!   trace, so `journalctl -p warning` and the colours work; and a line carries no timestamp
//!   of its own, since the journal stamps every entry itself (two clocks on one line only
//!   disagree). A message of several lines gets the prefix on each, or the journal would file
//!   the continuation lines at its default priority.
//! - **Anywhere else**: the usual human format, `[TIMESTAMP LEVEL target] message`, with an
//!   RFC 3339 UTC timestamp.
//!
//! `RUST_LOG` sets the level in both cases (default `info`).
//!
//! [`RateLimit`] keeps a flood of similar lines (one per dead letter, say) from drowning the
//! journal, which rate-limits per service and would then drop the lines that matter too.

use std::io::Write;
use std::time::{Duration, Instant};

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
    if b.try_init().is_ok() && !rust_log_set() {
        log::set_max_level(log::LevelFilter::Info);
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
        log::info!("log level is now {level}");
    }
}

/// A line that ends the process (`cairn: MESSAGE` on stderr), outside the logger so it shows
/// even with `RUST_LOG=off`; under the journal each line carries the error priority.
pub fn fatal(message: &str) {
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
    /// interval"` when a count is due, and `line()` when this one may go out. Returns the
    /// verdict.
    pub fn warn(
        &mut self,
        now: Instant,
        what: &str,
        kind: &str,
        line: impl FnOnce() -> String,
    ) -> Verdict {
        let v = self.check(now);
        if v.suppressed > 0 {
            log::warn!(
                "{what}: {} more {kind} in the last {:?}",
                v.suppressed,
                self.interval
            );
        }
        if v.allowed {
            log::warn!("{}", line());
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
        let line = || String::from("l");
        let first = r.warn(t0, "x", "more", line);
        let rest: Vec<_> = (0..2).map(|_| r.warn(t0, "x", "more", line)).collect();
        let later = r.warn(t0 + Duration::from_secs(60), "x", "more", line);
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
