//! Work behind the log: the slices that take records back from the log, and the one rule
//! for when processing takes one. What a slice does is the processor's one log-slice reader
//! (`processor/slice.rs`); this part decides when, which, and how big.
//!
//! - **Catch-up** (issue 16): when processing must wait (the outbox at its bound, or
//!   checkpoints waiting for disk room), input is still logged, fsynced and acknowledged, and
//!   its records stay in the log: processing falls *behind*. Once it may go on, catch-up
//!   slices take them back, from the live position to the log's durable end, and then
//!   records are applied as they are committed again. The replay at start is the first
//!   catch-up: it stops at the same bound, and what it leaves is taken here.
//! - **Backfill** (issue 15): slices of the retained log for `start = "earliest"`
//!   pipelines, between live work. They wait at the same bound as everything else (issue 26:
//!   a backfill with the uplink down filled the outbox to 15 times its bound while live
//!   processing waited).
//!
//! The rule ([`Work::next`]): nothing while processing must wait; else catch-up first (live
//! input is late), then backfill. One slice per turn of the loop, at most [`SLICE_MAX`]
//! records, so acks, checkpoints and publishing keep their pace beside it.
//!
//! Before, a full outbox stopped acknowledging: the broker queued (mosquitto drops past
//! `max_queued_messages`), inputs it pushed anyway were held in memory and then let go, and
//! each end of backpressure needed a reconnect for the broker to send them again (measured:
//! a backlog drained at ~12k inputs/s with `max_entries = 20000`, most of it sent twice).
//! Now only a full log or a full disk stops acknowledging (invariant 7).

use std::time::{Duration, Instant};

use crate::log::Log;
use crate::model::{Offset, PipelineProgress, Progress};
use crate::pipeline::engine::Outcome;
use crate::processor::{ProcessError, Processor};

/// Records per slice at most: small enough that acks, checkpoints and publishing keep their
/// pace beside it.
pub(crate) const SLICE_MAX: u64 = 512;
/// How often the journal hears how a backfill goes.
const REPORT_INTERVAL: Duration = Duration::from_secs(10);

/// Which slice processing takes next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Next {
    /// Nothing waits in the log.
    Idle,
    /// Work waits in the log, but processing must wait (why).
    Wait(&'static str),
    /// Live records wait in the log: take them.
    CatchUp,
    /// A pipeline backfills: take its next records.
    Backfill,
}

/// What a slice did, for the loop to carry on with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Took {
    pub(crate) kind: Next,
    pub(crate) taken: u64,
    /// A record of a catch-up slice became a dead letter.
    pub(crate) dead_letters: bool,
}

pub(crate) struct Work {
    /// Live records wait in the log.
    behind: bool,
    /// When processing last fell behind (for the journal line that says it caught up).
    since: Option<Instant>,
    /// One journal line a minute at most for waiting: with a small bound, a drain fills the
    /// outbox again and again.
    journal: crate::logging::RateLimit,
    /// A backfill may be in progress: at start every backfill a checkpoint recorded is, and
    /// the first slice finds out which.
    backfilling: bool,
    reported: Option<Instant>,
}

impl Work {
    /// `behind`: the replay at start stopped before the log's end.
    pub(crate) fn new(behind: bool, now: Instant) -> Work {
        Work {
            behind,
            since: behind.then_some(now),
            journal: crate::logging::RateLimit::new(1, Duration::from_secs(60)),
            backfilling: true,
            reported: None,
        }
    }

    /// The rule: which slice to take now, given why processing must wait (`hold`), if it
    /// must.
    pub(crate) fn next(&self, hold: Option<&'static str>) -> Next {
        if !self.behind && !self.backfilling {
            return Next::Idle;
        }
        match hold {
            Some(why) => Next::Wait(why),
            None if self.behind => Next::CatchUp,
            None => Next::Backfill,
        }
    }

    /// Whether a slice is ready: the loop then does not wait for input.
    pub(crate) fn ready(&self, hold: Option<&'static str>) -> bool {
        matches!(self.next(hold), Next::CatchUp | Next::Backfill)
    }

    /// Records per slice: [`SLICE_MAX`], or fewer if a checkpoint is due sooner.
    pub(crate) fn slice_max(max_records: u64) -> u64 {
        SLICE_MAX.min(max_records.max(1))
    }

    /// Whether the committed record at `offset` may be applied now, the live position being
    /// `next`. No when processing is behind (the record is in the log; a slice takes it) or
    /// must wait (`hold`: processing falls behind here). A record the slices already took
    /// is skipped.
    pub(crate) fn live(
        &mut self,
        offset: Offset,
        next: Offset,
        hold: Option<&'static str>,
        now: Instant,
    ) -> bool {
        if offset < next || self.behind {
            return false;
        }
        if offset == next && hold.is_none() {
            return true;
        }
        self.fall_behind(hold.unwrap_or("a gap in the log"), now);
        false
    }

    fn fall_behind(&mut self, why: &str, now: Instant) {
        self.behind = true;
        self.since = Some(now);
        self.waits(why, now);
    }

    /// Processing waits with work in the log: say so, at most once a minute.
    pub(crate) fn waits(&mut self, why: &str, now: Instant) {
        self.journal.warn(
            now,
            "processing_waits",
            "processing behind the log",
            "times",
            || {
                crate::event!(warn, "processing_waits", reason = why;
                    "processing waits ({why}): input is still logged and acknowledged, and \
                     what waits in the log (live records, backfills) is processed from it \
                     once results leave"
                )
            },
        );
    }

    /// Take the slice the rule says, if any: up to `max` records. Whether a live record
    /// became a dead letter is in the answer (the caller journals them from the engine).
    pub(crate) fn step(
        &mut self,
        proc: &mut Processor,
        log: &Log,
        (max, hold): (u64, Option<&'static str>),
        now: Instant,
    ) -> Result<Took, ProcessError> {
        let kind = self.next(hold);
        let mut dead_letters = false;
        let taken = match kind {
            Next::Idle => 0,
            Next::Wait(why) => {
                self.waits(why, now);
                0
            }
            Next::CatchUp => self.catch_up(proc, log, max, now, &mut dead_letters)?,
            Next::Backfill => self.backfill(proc, log, max, now)?,
        };
        Ok(Took {
            kind,
            taken,
            dead_letters,
        })
    }

    fn catch_up(
        &mut self,
        proc: &mut Processor,
        log: &Log,
        max: u64,
        now: Instant,
        dead_letters: &mut bool,
    ) -> Result<u64, ProcessError> {
        let slice = proc.catch_up(log, max, &mut |_, outcome| {
            *dead_letters |= matches!(outcome, Outcome::DeadLetter { .. });
        })?;
        if slice.caught_up {
            self.behind = false;
            let waited = self.since.take().map(|t| now.saturating_duration_since(t));
            crate::event!(info, "processing_caught_up";
                "processing caught up with the log at offset {}{}",
                proc.next_offset(),
                waited.map_or(String::new(), |w| format!(
                    " ({:.1} s after it fell behind)",
                    w.as_secs_f64()
                ))
            );
        }
        Ok(slice.taken)
    }

    fn backfill(
        &mut self,
        proc: &mut Processor,
        log: &Log,
        max: u64,
        now: Instant,
    ) -> Result<u64, ProcessError> {
        let Some(slice) = proc.backfill_slice(log, max)? else {
            self.backfilling = false;
            return Ok(0);
        };
        let due = self.reported.is_none_or(|t| now >= t + REPORT_INTERVAL);
        if due && !slice.joined {
            self.reported = Some(now);
            crate::event!(info, "backfill_progress", pipeline = slice.pipeline;
                "backfill: pipeline `{}`: {} records left before it joins live processing",
                slice.pipeline,
                slice.left
            );
        }
        Ok(slice.taken)
    }
}

/// Records pipeline `pp` has still to take before it joins live processing (`first`: the
/// log's first offset, where a backfill's cursor may lie below it).
pub(crate) fn records_left(progress: &Progress, pp: &PipelineProgress, first: Offset) -> u64 {
    pp.backfill.map_or(0, |b| {
        progress.next_offset.saturating_sub(b.next.max(first))
    })
}

/// `, backfilling N records` for the `STATUS=` line while a backfill runs.
pub(crate) fn backfill_status(proc: &Processor, log: &Log) -> String {
    let engine = proc.engine();
    let first = log.first_offset();
    let live = engine.progress().next_offset;
    let left: u64 = engine
        .backfills()
        .map(|(_, b)| live.saturating_sub(b.next.max(first)))
        .sum();
    if left == 0 {
        String::new()
    } else {
        format!(", backfilling {left} records")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Backfill;

    #[test]
    fn no_slice_is_taken_while_processing_must_wait_and_catch_up_goes_before_backfill() {
        let t0 = Instant::now();
        let mut w = Work::new(false, t0);
        // At start a backfill may be in progress.
        assert_eq!(w.next(None), Next::Backfill);
        assert_eq!(
            w.next(Some("outbox.max_entries")),
            Next::Wait("outbox.max_entries")
        );
        assert!(
            !w.ready(Some("outbox.max_size")),
            "a full outbox stops backfills too"
        );
        // A live record at the bound: processing falls behind, and catch-up comes first.
        assert!(!w.live(5, 5, Some("outbox.max_entries"), t0));
        assert_eq!(w.next(None), Next::CatchUp);
        assert_eq!(
            w.next(Some("the disk is nearly full")),
            Next::Wait("the disk is nearly full")
        );
        w.behind = false;
        w.backfilling = false;
        assert_eq!(
            w.next(Some("outbox.max_entries")),
            Next::Idle,
            "nothing waits"
        );
        assert!(!w.ready(None));
    }

    #[test]
    fn a_live_record_is_applied_only_in_order_with_room_and_not_while_behind() {
        let t0 = Instant::now();
        let mut w = Work::new(false, t0);
        assert!(w.live(7, 7, None, t0), "the next one, with room");
        assert!(!w.live(6, 7, None, t0), "taken already");
        assert!(!w.behind);
        assert!(
            !w.live(9, 7, None, t0),
            "a gap: fall behind and read the log"
        );
        assert!(w.behind);
        assert!(
            !w.live(7, 7, None, t0),
            "behind: the log has it, a slice takes it"
        );
        let mut w = Work::new(true, t0);
        assert_eq!(
            w.next(None),
            Next::CatchUp,
            "the replay at start stopped short"
        );
        assert!(!w.live(3, 3, None, t0));
    }

    #[test]
    fn a_slice_is_at_most_slice_max_and_never_more_than_a_checkpoint_takes() {
        assert_eq!(Work::slice_max(100_000), SLICE_MAX);
        assert_eq!(Work::slice_max(50), 50);
        assert_eq!(Work::slice_max(0), 1);
    }

    #[test]
    fn records_left_count_from_the_cursor_or_the_logs_first_offset() {
        let pp = |next: Option<Offset>| PipelineProgress {
            backfill: next.map(|next| Backfill { next, clock_ms: 0 }),
            ..Default::default()
        };
        let progress = Progress {
            next_offset: 1_000,
            ..Default::default()
        };
        assert_eq!(records_left(&progress, &pp(Some(300)), 0), 700);
        assert_eq!(records_left(&progress, &pp(Some(300)), 400), 600);
        assert_eq!(records_left(&progress, &pp(None), 0), 0);
    }
}
