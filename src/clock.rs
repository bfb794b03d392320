//! Time of receipt: the `received_at_ms` stamped on each new log record.
//!
//! # Guarantees
//!
//! - **Never backwards.** Each stamp is at least the one before it, in this run and across
//!   restarts (the first stamp after a start is at least the newest one already in the log
//!   or the checkpoint). Windows by time of receipt and the dedup window are measured with
//!   these stamps (invariants 3 and 5), so a clock stepped back cannot make new events
//!   `late` or reopen what was closed.
//! - **Real rate when the clock is behind.** When the wall clock steps back, stamps go on
//!   from the last one at the rate of the monotonic clock (`CLOCK_MONOTONIC`, which never
//!   steps), so windows keep closing at their real pace; when the wall clock catches up,
//!   stamps follow it again.
//! - **Forward steps are followed, and said.** A wall clock stepped forwards (NTP fixing a
//!   box that booted with a stale time) is followed: it is the best time there is. If it
//!   runs more than [`STEP_REPORT_MS`] ahead of what the monotonic clock counted, the
//!   caller gets a [`Note::SteppedForward`] to put in the journal, because the dedup window
//!   and log retention then expire entries that are younger in real time.
//!
//! # Mechanism
//!
//! [`ReceiptClock`] keeps an anchor, (stamp, monotonic instant), and stamps
//! `max(wall, anchor stamp + monotonic time since the anchor)`, re-anchoring whenever the
//! wall clock wins. It is pure: the caller passes the wall time and the instant, so tests
//! step either at will. The agent takes the wall time from a [`Clock`]; built with the
//! `failpoints` feature, [`from_env`] lets a process-level test step it through a file.
//!
//! Tested by the unit tests below and `tests/it/field.rs`
//! `a_clock_stepped_back_a_day_does_not_make_new_events_late_and_stamps_stay_monotonic`,
//! `a_clock_stepped_forwards_is_followed_and_reported`.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// A wall clock ahead of the monotonic count by more than this is a step worth a journal
/// line; smaller differences are NTP's ordinary corrections.
pub(crate) const STEP_REPORT_MS: u64 = 60_000;

/// The box's clocks. The wall clock may step either way; the monotonic one never does.
pub(crate) trait Clock: Send {
    /// Milliseconds since the Unix epoch, as the box's clock says now.
    fn wall_ms(&self) -> u64;
    /// Now, on a clock that never steps.
    fn monotonic(&self) -> Instant {
        Instant::now()
    }
}

/// The system's clocks.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct SystemClock;

impl Clock for SystemClock {
    fn wall_ms(&self) -> u64 {
        system_wall_ms()
    }
}

/// The system's wall clock now: the one place the crate reads it (`tests/it/layering.rs`
/// holds every other file to that). Processing never reads it (invariant 3); the agent reads
/// it through a [`Clock`], so a test can step it; the rest (journal timestamps, savepoint
/// and metrics times, names and seeds that only need to differ) read it here.
pub(crate) fn system_now() -> SystemTime {
    SystemTime::now()
}

/// [`system_now`] in milliseconds since the Unix epoch (0 before it).
pub(crate) fn system_wall_ms() -> u64 {
    system_now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// [`system_now`] in nanoseconds since the Unix epoch (0 before it): for names and seeds
/// that only need to differ between processes, never for anything processing decides.
pub(crate) fn system_wall_ns() -> u128 {
    system_now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

/// The clock the agent uses: the system's. Built with the `failpoints` feature, a test can
/// set `CAIRN_TEST_CLOCK_OFFSET_FILE` to a file holding a signed number of milliseconds
/// added to the wall clock (re-read at every call, so a test steps the clock by rewriting
/// it; a missing or unreadable file means 0).
pub(crate) fn from_env() -> Box<dyn Clock> {
    #[cfg(feature = "failpoints")]
    if let Some(path) = std::env::var_os("CAIRN_TEST_CLOCK_OFFSET_FILE") {
        return Box::new(OffsetFileClock(path.into()));
    }
    Box::new(SystemClock)
}

/// The test hook of [`from_env`].
#[cfg(feature = "failpoints")]
#[derive(Debug)]
struct OffsetFileClock(std::path::PathBuf);

#[cfg(feature = "failpoints")]
impl Clock for OffsetFileClock {
    fn wall_ms(&self) -> u64 {
        let offset: i64 = std::fs::read_to_string(&self.0)
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0);
        system_wall_ms().saturating_add_signed(offset)
    }
}

/// Something about the clock the journal should say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Note {
    /// At start, the wall clock is behind the newest stamp already recorded.
    BehindRecorded { wall_ms: u64, recorded_ms: u64 },
    /// The wall clock stepped back by `by_ms` (more than [`STEP_REPORT_MS`]).
    SteppedBack { by_ms: u64 },
    /// The wall clock caught up with the stamps again after being behind.
    CaughtUp,
    /// The wall clock stepped forwards by `by_ms` beyond the monotonic count; stamps now
    /// continue from `to_ms` instead of `expected_ms`.
    SteppedForward {
        by_ms: u64,
        expected_ms: u64,
        to_ms: u64,
    },
}

/// Stamps times of receipt; see the module docs.
#[derive(Debug, Clone)]
pub(crate) struct ReceiptClock {
    anchor_ms: u64,
    anchor_at: Instant,
    /// Stamps run ahead of the wall clock (it stepped back, or started behind).
    ahead: bool,
}

impl ReceiptClock {
    /// Start after a restart: `recorded_ms` is the newest stamp in the log or checkpoint.
    /// The downtime is unknown to the monotonic clock, so the first anchor is the later of
    /// the wall clock and `recorded_ms`: no forward step is reported for the time the agent
    /// was down, and no stamp goes below what is recorded.
    pub fn start(recorded_ms: u64, wall_ms: u64, now: Instant) -> (ReceiptClock, Option<Note>) {
        let ahead = wall_ms < recorded_ms;
        let clock = ReceiptClock {
            anchor_ms: wall_ms.max(recorded_ms),
            anchor_at: now,
            ahead,
        };
        let note = ahead.then_some(Note::BehindRecorded {
            wall_ms,
            recorded_ms,
        });
        (clock, note)
    }

    /// The time of receipt a record received now would get, without taking it: what
    /// retention measures segment ages against, so they age in the same time as the stamps.
    pub fn peek(&self, wall_ms: u64, now: Instant) -> u64 {
        let elapsed = now.saturating_duration_since(self.anchor_at);
        let elapsed_ms = u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX);
        wall_ms.max(self.anchor_ms.saturating_add(elapsed_ms))
    }

    /// The stamp for a record received now: `max(wall, anchor + monotonic elapsed)`.
    pub fn stamp(&mut self, wall_ms: u64, now: Instant) -> (u64, Option<Note>) {
        let elapsed = now.saturating_duration_since(self.anchor_at);
        let elapsed_ms = u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX);
        let expected = self.anchor_ms.saturating_add(elapsed_ms);
        if wall_ms >= expected {
            let by_ms = wall_ms - expected;
            let note = if by_ms > STEP_REPORT_MS {
                Some(Note::SteppedForward {
                    by_ms,
                    expected_ms: expected,
                    to_ms: wall_ms,
                })
            } else if self.ahead {
                Some(Note::CaughtUp)
            } else {
                None
            };
            self.anchor_ms = wall_ms;
            self.anchor_at = now;
            self.ahead = false;
            return (wall_ms, note);
        }
        // Behind: keep the anchor, so stamps advance at the monotonic rate from it.
        let by_ms = expected - wall_ms;
        let note = (!self.ahead && by_ms > STEP_REPORT_MS).then_some(Note::SteppedBack { by_ms });
        if by_ms > STEP_REPORT_MS {
            self.ahead = true;
        }
        (expected, note)
    }
}

/// `1d2h3m4s`-style, for journal lines (to the nearest second; under a second as `ms`).
pub(crate) fn human_ms(ms: u64) -> String {
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let mut rest = ms / 1000 + u64::from(ms % 1000 >= 500);
    let mut out = String::new();
    for (unit, secs) in [("d", 86_400), ("h", 3_600), ("m", 60), ("s", 1)] {
        if rest >= secs {
            out.push_str(&format!("{}{unit}", rest / secs));
            rest %= secs;
        }
    }
    out
}

/// `ms` since the epoch as RFC 3339 UTC.
pub(crate) fn utc_ms(ms: u64) -> String {
    utc_timestamp(UNIX_EPOCH + Duration::from_millis(ms))
}

/// `2024-05-01T12:34:56.789Z`: RFC 3339 in UTC, millisecond precision, without a time zone
/// database (an edge box may lack one, and UTC is what the journal and brokers use anyway).
pub(crate) fn utc_timestamp(t: SystemTime) -> String {
    let since = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = since.as_secs();
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, m, d) = civil_from_days(days as i64);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60,
        since.subsec_millis()
    )
}

/// Days since 1970-01-01 to (year, month, day) in the proleptic Gregorian calendar
/// (Howard Hinnant's `civil_from_days`).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_are_rfc3339_utc() {
        let t = UNIX_EPOCH + Duration::from_millis(1_709_210_096_789); // a leap day
        assert_eq!(utc_timestamp(t), "2024-02-29T12:34:56.789Z");
        assert_eq!(utc_timestamp(UNIX_EPOCH), "1970-01-01T00:00:00.000Z");
        let t = UNIX_EPOCH + Duration::from_secs(951_868_800); // 2000-03-01, after a 400-year leap day
        assert_eq!(utc_timestamp(t), "2000-03-01T00:00:00.000Z");
    }

    const DAY: u64 = 86_400_000;
    const T0: u64 = 1_800_000_000_000;

    fn at(base: Instant, ms: u64) -> Instant {
        base + Duration::from_millis(ms)
    }

    #[test]
    fn a_clock_stepped_back_keeps_stamps_rising_at_the_monotonic_rate() {
        let base = Instant::now();
        let (mut c, note) = ReceiptClock::start(0, T0, base);
        assert_eq!(note, None);
        assert_eq!(c.stamp(T0 + 1000, at(base, 1000)).0, T0 + 1000);
        // The wall clock steps back a day, 1 s later.
        let (s, note) = c.stamp(T0 + 2000 - DAY, at(base, 2000));
        assert_eq!(
            s,
            T0 + 2000,
            "a second after the last stamp, not a day before it"
        );
        assert!(matches!(note, Some(Note::SteppedBack { by_ms }) if by_ms == DAY));
        // Ten minutes on, the stamps have moved ten minutes, and no note repeats.
        let (s, note) = c.stamp(T0 + 602_000 - DAY, at(base, 602_000));
        assert_eq!((s, note), (T0 + 602_000, None));
        // The wall clock is set right again: stamps follow it, with a note that it caught up.
        let (s, note) = c.stamp(T0 + 603_000, at(base, 603_000));
        assert_eq!((s, note), (T0 + 603_000, Some(Note::CaughtUp)));
    }

    #[test]
    fn small_steps_back_are_absorbed_silently_and_stamps_never_fall() {
        let base = Instant::now();
        let (mut c, _) = ReceiptClock::start(0, T0, base);
        let mut last = 0;
        for (i, wobble) in [0i64, -500, 300, -59_000, 10, 0].iter().enumerate() {
            let ms = 100 * i as u64;
            let (s, note) = c.stamp(T0.saturating_add_signed(ms as i64 + wobble), at(base, ms));
            assert!(s >= last, "stamp {s} fell below {last}");
            assert_eq!(note, None);
            last = s;
        }
    }

    #[test]
    fn a_forward_step_is_followed_and_reported_with_what_it_skipped() {
        let base = Instant::now();
        let (mut c, _) = ReceiptClock::start(0, T0, base);
        let year = 365 * DAY;
        let (s, note) = c.stamp(T0 + 5_000 + year, at(base, 5_000));
        assert_eq!(s, T0 + 5_000 + year);
        assert_eq!(
            note,
            Some(Note::SteppedForward {
                by_ms: year,
                expected_ms: T0 + 5_000,
                to_ms: T0 + 5_000 + year
            })
        );
        // Up to the threshold is ordinary drift.
        let (_, note) = c.stamp(T0 + 6_000 + year + STEP_REPORT_MS, at(base, 6_000));
        assert_eq!(note, None);
    }

    #[test]
    fn after_a_restart_stamps_start_at_or_above_the_recorded_ones() {
        let base = Instant::now();
        // The box restarts with its clock a day behind what the log holds.
        let (mut c, note) = ReceiptClock::start(T0, T0 - DAY, base);
        assert_eq!(
            note,
            Some(Note::BehindRecorded {
                wall_ms: T0 - DAY,
                recorded_ms: T0
            })
        );
        assert_eq!(c.stamp(T0 - DAY, base).0, T0);
        assert_eq!(c.stamp(T0 - DAY + 50, at(base, 50)).0, T0 + 50);
        // A restart after downtime with a good clock is not a step.
        let (mut c, note) = ReceiptClock::start(T0, T0 + DAY, base);
        assert_eq!(note, None);
        assert_eq!(c.stamp(T0 + DAY + 10, at(base, 10)), (T0 + DAY + 10, None));
    }

    #[test]
    fn durations_read_as_people_write_them() {
        assert_eq!(human_ms(250), "250ms");
        assert_eq!(human_ms(DAY + 3_723_000), "1d1h2m3s");
        assert_eq!(
            human_ms(DAY - 2),
            "1d",
            "a step measured a moment late is still a day"
        );
        assert_eq!(utc_ms(0), "1970-01-01T00:00:00.000Z");
    }
}
