//! Schedule: when to commit what was processed, what retention may delete, when a
//! savepoint is due, and when sled's files deserve a look.
//!
//! No IO: the loop commits, deletes segments, writes savepoints and measures the store; this
//! part decides from the times, counts and sizes it is given.

use std::time::{Duration, Instant};

use crate::config::CheckpointConfig;
use crate::store::SavepointInfo;

/// Below this the store's size is not worth a walk of its trees.
pub(crate) const STORE_WATCH_MIN_BYTES: u64 = 64 << 20;
/// sled's files beyond this multiple of the live data get a warning.
pub(crate) const STORE_BLOAT_FACTOR: u64 = 4;
const STORE_ESTIMATE_INTERVAL: Duration = Duration::from_secs(600);
const STORE_WARN_INTERVAL: Duration = Duration::from_secs(3600);

pub(crate) struct Schedule {
    /// When the oldest record applied since the last checkpoint was applied.
    first_unchecked: Option<Instant>,
    /// The newest savepoint: retention keeps the log back to its `next_offset`.
    newest_savepoint: Option<SavepointInfo>,
    next_savepoint: Option<Instant>,
    /// sled's files against the live data.
    store_watch: StoreWatch,
}

/// The last estimate of the store's live data, and when the journal was last told.
#[derive(Debug, Default)]
struct StoreWatch {
    live_bytes: Option<u64>,
    estimated: Option<Instant>,
    warned: Option<Instant>,
}

/// What to do for input held by backpressure before trying it again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Relief {
    /// Nothing is held.
    Nothing,
    /// Applied but uncheckpointed records hold segments of a log short of room: checkpoint
    /// now rather than at the timer (the checkpoint runs retention, which frees them).
    Checkpoint,
    /// Retention is time-based too: with everything checkpointed and no new input, no
    /// checkpoint would ever run it again.
    Retention,
}

impl Schedule {
    /// At start: the newest savepoint on disk, and the interval periodic ones come at
    /// (`wall_ms` and `now` are the clocks at start; a savepoint's age is by the wall clock).
    pub(crate) fn new(
        newest_savepoint: Option<SavepointInfo>,
        every: Option<Duration>,
        wall_ms: u64,
        now: Instant,
    ) -> Schedule {
        let next_savepoint = savepoint_due(every, newest_savepoint.as_ref(), wall_ms, now);
        Schedule {
            first_unchecked: None,
            newest_savepoint,
            next_savepoint,
            store_watch: StoreWatch::default(),
        }
    }

    /// A record was applied at `now`: a checkpoint is due `checkpoint.interval` after the
    /// first such.
    pub(crate) fn applied(&mut self, now: Instant) {
        self.first_unchecked.get_or_insert(now);
    }

    /// Whether the timed checkpoint is due (or `force`d, at shutdown), if anything was
    /// applied since the last one.
    pub(crate) fn due(&self, now: Instant, interval: Duration, force: bool) -> bool {
        self.first_unchecked
            .is_some_and(|t| force || now >= t + interval)
    }

    /// When the checkpoint timer fires, if anything was applied.
    pub(crate) fn deadline(&self, interval: Duration) -> Option<Instant> {
        self.first_unchecked.map(|t| t + interval)
    }

    /// A checkpoint ran (or found nothing to commit): the timer starts again at the next
    /// applied record.
    pub(crate) fn checkpointed(&mut self) {
        self.first_unchecked = None;
    }

    /// Too many records applied, state keys written or results made since the last
    /// commit: checkpoint now. The keys bound the memory the checkpoint's transaction takes
    /// (a copy of a sled leaf per key); the records, the overlay and what replay redoes; the
    /// results (`max_records` of them too), the outputs held until the checkpoint and what
    /// the outbox's bound counts. Without that, 16 pipelines at 4,000 records/s made
    /// 64,000 results a second: they filled `outbox.max_entries` before `max_records` or
    /// the interval came, peak RSS 60.9 MiB, and processing waited for the timed
    /// checkpoint, 3.4 s behind the log (issue 33).
    pub(crate) fn size_due(records: u64, keys: u64, results: u64, cfg: &CheckpointConfig) -> bool {
        records >= cfg.max_records || keys >= cfg.max_keys || results >= cfg.max_records
    }

    /// What to do for held input: see [`Relief`]. `room` tells whether the log is short of
    /// room and how many applied records are not yet checkpointed; it is asked only when
    /// something is held.
    pub(crate) fn relief(held: bool, room: impl FnOnce() -> (bool, u64)) -> Relief {
        if !held {
            return Relief::Nothing;
        }
        match room() {
            (true, pending) if pending > 0 => Relief::Checkpoint,
            _ => Relief::Retention,
        }
    }

    /// Segments whose newest time of receipt is below this are outside `log.retention`
    /// (`now_ms` from the receipt clock, so segment ages never go back with the wall clock).
    pub(crate) fn retention_cutoff(now_ms: u64, retention: Duration) -> u64 {
        let keep_ms = u64::try_from(retention.as_millis()).unwrap_or(u64::MAX);
        now_ms.saturating_sub(keep_ms)
    }

    /// Retention keeps the log back to here: the newest savepoint's `next_offset`.
    pub(crate) fn savepoint_floor(&self) -> u64 {
        self.newest_savepoint
            .as_ref()
            .map_or(u64::MAX, |s| s.next_offset)
    }

    pub(crate) fn newest_savepoint(&self) -> Option<&SavepointInfo> {
        self.newest_savepoint.as_ref()
    }

    pub(crate) fn next_savepoint(&self) -> Option<Instant> {
        self.next_savepoint
    }

    /// A periodic savepoint is due (taken right after a checkpoint, the one moment the
    /// store is exactly that checkpoint).
    pub(crate) fn savepoint_due_now(&self, now: Instant) -> bool {
        self.next_savepoint.is_some_and(|t| now >= t)
    }

    /// A savepoint is being written at `now`: whether it succeeds or not, the next periodic
    /// one is an interval later (a failed one is tried again next interval, not in a loop).
    pub(crate) fn savepoint_started(&mut self, now: Instant, every: Option<Duration>) {
        self.next_savepoint = every.map(|i| now + i);
    }

    /// The savepoint was written: it is the new floor.
    pub(crate) fn savepoint_written(&mut self, sp: SavepointInfo) {
        self.newest_savepoint = Some(sp);
    }

    /// The floor held a log short of room and no new savepoint could replace it: let it
    /// go, so retention can delete below it.
    pub(crate) fn release_floor(&mut self) {
        self.newest_savepoint = None;
    }

    /// `[savepoint] interval` changed: schedule as at start.
    pub(crate) fn reschedule(&mut self, every: Option<Duration>, wall_ms: u64, now: Instant) {
        self.next_savepoint = savepoint_due(every, self.newest_savepoint.as_ref(), wall_ms, now);
    }

    /// Whether to estimate the store's live data now (it walks the trees): only when the
    /// files are large, have outgrown the last estimate, and the last is old enough.
    pub(crate) fn store_estimate_due(&self, store_bytes: u64, now: Instant) -> bool {
        let w = &self.store_watch;
        let outgrown = w
            .live_bytes
            .is_none_or(|l| store_bytes > l.saturating_mul(STORE_BLOAT_FACTOR));
        store_bytes >= STORE_WATCH_MIN_BYTES
            && outgrown
            && w.estimated
                .is_none_or(|t| now >= t + STORE_ESTIMATE_INTERVAL)
    }

    /// The live data was estimated at `live` bytes; `true` if the journal should be told
    /// that the files have outgrown it (at most every `STORE_WARN_INTERVAL`).
    pub(crate) fn store_estimated(&mut self, store_bytes: u64, live: u64, now: Instant) -> bool {
        let w = &mut self.store_watch;
        w.live_bytes = Some(live);
        w.estimated = Some(now);
        let bloated = store_bytes > live.saturating_mul(STORE_BLOAT_FACTOR);
        let warn = bloated && w.warned.is_none_or(|t| now >= t + STORE_WARN_INTERVAL);
        if warn {
            w.warned = Some(now);
        }
        warn
    }
}

/// When the next periodic savepoint is due: `every` after the newest one, at once if there
/// is none or it is older (wall clock: that is all a file's age can be measured by).
fn savepoint_due(
    every: Option<Duration>,
    newest: Option<&SavepointInfo>,
    wall_ms: u64,
    now: Instant,
) -> Option<Instant> {
    every.map(|every| {
        let age = newest.map_or(every, |s| {
            Duration::from_millis(wall_ms.saturating_sub(s.created_at_ms))
        });
        now + every.saturating_sub(age)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: Duration = Duration::from_secs(60);

    fn savepoint(next_offset: u64, created_at_ms: u64) -> SavepointInfo {
        SavepointInfo {
            path: "sp".into(),
            format_version: 1,
            checkpoint_id: 1,
            next_offset,
            entries: 0,
            created_at_ms,
            bytes: 0,
            seq: 0,
        }
    }

    #[test]
    fn a_checkpoint_is_due_an_interval_after_the_first_applied_record() {
        let t0 = Instant::now();
        let mut c = Schedule::new(None, None, 0, t0);
        assert!(!c.due(t0 + MIN, MIN, true), "nothing applied");
        c.applied(t0);
        c.applied(t0 + MIN / 2);
        assert_eq!(c.deadline(MIN), Some(t0 + MIN));
        assert!(!c.due(t0 + MIN / 2, MIN, false));
        assert!(c.due(t0, MIN, true), "forced at shutdown");
        assert!(c.due(t0 + MIN, MIN, false));
        c.checkpointed();
        assert_eq!(c.deadline(MIN), None);
    }

    #[test]
    fn max_records_applied_or_made_or_max_keys_written_make_a_checkpoint_due_at_once() {
        let cfg = CheckpointConfig {
            interval: MIN,
            max_records: 100,
            max_keys: 10,
        };
        assert!(!Schedule::size_due(99, 9, 99, &cfg));
        assert!(Schedule::size_due(100, 9, 99, &cfg), "records");
        assert!(Schedule::size_due(99, 10, 99, &cfg), "keys");
        assert!(Schedule::size_due(99, 9, 100, &cfg), "results");
    }

    #[test]
    fn held_input_with_a_log_short_of_room_checkpoints_else_runs_retention() {
        let unasked = || unreachable!("nothing held: the log is not asked");
        assert_eq!(Schedule::relief(false, unasked), Relief::Nothing);
        assert_eq!(Schedule::relief(true, || (true, 5)), Relief::Checkpoint);
        assert_eq!(Schedule::relief(true, || (true, 0)), Relief::Retention);
        assert_eq!(Schedule::relief(true, || (false, 5)), Relief::Retention);
    }

    #[test]
    fn retention_cuts_off_by_the_receipt_clock_and_never_below_zero() {
        assert_eq!(Schedule::retention_cutoff(100_000, MIN), 40_000);
        assert_eq!(Schedule::retention_cutoff(1_000, MIN), 0);
        assert_eq!(Schedule::retention_cutoff(1_000, Duration::MAX), 0);
    }

    #[test]
    fn the_savepoint_floor_is_the_newest_savepoint_until_released() {
        let t0 = Instant::now();
        let mut c = Schedule::new(None, None, 0, t0);
        assert_eq!(c.savepoint_floor(), u64::MAX, "no savepoint holds anything");
        c.savepoint_written(savepoint(500, 0));
        assert_eq!(c.savepoint_floor(), 500);
        assert_eq!(c.newest_savepoint().map(|s| s.next_offset), Some(500));
        c.release_floor();
        assert_eq!(c.savepoint_floor(), u64::MAX);
    }

    #[test]
    fn the_first_savepoint_is_due_by_the_age_of_the_newest_and_then_every_interval() {
        let t0 = Instant::now();
        let hour = 60 * MIN;
        let none = Schedule::new(None, Some(hour), 10_000_000, t0);
        assert_eq!(none.next_savepoint(), Some(t0), "none yet: at once");
        let young = Schedule::new(
            Some(savepoint(1, 10_000_000 - 60_000)),
            Some(hour),
            10_000_000,
            t0,
        );
        assert_eq!(young.next_savepoint(), Some(t0 + hour - MIN));
        let mut old = Schedule::new(Some(savepoint(1, 0)), Some(hour), 10_000_000, t0);
        assert!(
            old.savepoint_due_now(t0),
            "older than the interval: at once"
        );
        old.savepoint_started(t0, Some(hour));
        assert!(!old.savepoint_due_now(t0 + MIN));
        assert!(old.savepoint_due_now(t0 + hour));
        old.reschedule(None, 10_000_000, t0);
        assert_eq!(old.next_savepoint(), None, "interval off: none scheduled");
        assert!(!Schedule::new(None, None, 0, t0).savepoint_due_now(t0));
    }

    #[test]
    fn the_store_is_estimated_only_when_large_outgrown_and_not_lately() {
        let t0 = Instant::now();
        let big = STORE_WATCH_MIN_BYTES;
        let mut c = Schedule::new(None, None, 0, t0);
        assert!(
            !c.store_estimate_due(big - 1, t0),
            "small: not worth a walk"
        );
        assert!(c.store_estimate_due(big, t0));
        assert!(
            c.store_estimated(big, big / 8, t0),
            "8× the live data: warn"
        );
        let later = t0 + STORE_ESTIMATE_INTERVAL;
        assert!(!c.store_estimate_due(big, t0 + MIN), "estimated lately");
        assert!(c.store_estimate_due(big, later));
        assert!(!c.store_estimated(big, big / 8, later), "warned lately");
        assert!(!c.store_estimated(big, big, later), "not bloated");
        assert!(
            !c.store_estimate_due(big, later + STORE_ESTIMATE_INTERVAL),
            "not outgrown"
        );
        assert!(c.store_estimate_due(big * 5, later + STORE_ESTIMATE_INTERVAL));
    }
}
