//! The one log-slice reader (issue 28): every way processing takes records back from the
//! log (the replay at start, catch-up behind the log while the outbox was at its bound, and
//! backfills for `start = "earliest"`) goes through [`Processor::read_slice`].
//!
//! A slice reads one *lane* from its position to its end, applies up to `max` records, and
//! keeps its reader for the next slice (a reader opened again would scan its segment from
//! the start):
//!
//! | lane | from | to | applied as |
//! |---|---|---|---|
//! | live | the live `next_offset` | the log's durable end | every matching live pipeline |
//! | backfill `p` | pipeline `p`'s cursor | the live `next_offset` | pipeline `p` alone |
//!
//! Records read back are the very records that were logged (time of receipt, topic,
//! payload, stand-ins alike), so processing them later gives what processing them on
//! arrival would have: processing is deterministic and the order is the log's. When to take
//! a slice (the outbox bound, a nearly full disk) is the caller's: the agent's `work` part,
//! or the `hold` the replay at start is given.
//!
//! **Backfill** (issue 15): a pipeline new to the store with `start = "earliest"` first takes
//! the retained log behind the live position; once its cursor reaches the live position it
//! joins live processing, and until then live records skip it. Its cursor ([`Backfill`]) is
//! part of the progress each checkpoint commits with the state and outputs it reached, so a
//! restart resumes at the last committed cursor. Its dedup window runs on its own clock (the
//! newest time of receipt it took), so duplicates inside the backfilled range are judged as
//! they were received. The agent keeps the log from the lowest durable cursor on.
//!
//! **Catch-up** (issue 16): while the outbox is at its bound the agent still logs, fsyncs
//! and acknowledges input and leaves the records in the log; once results leave, slices
//! take them from the live position to the log's durable end. The log is the buffer, not the
//! broker's queue and not memory.

use std::time::Instant;

use super::{ProcessError, Processor, ReplayStats};
use crate::log::{Log, LogReader};
use crate::model::{Backfill, Offset, Record};
use crate::pipeline::engine::{Outcome, Target};

/// What a slice reads for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Lane {
    /// Records behind the log's durable end, for every live pipeline.
    Live,
    /// Records behind the live position, for the backfilling pipeline at this index.
    Backfill(usize),
}

/// The readers kept between slices: one per lane at most.
#[derive(Default)]
pub(super) struct Readers {
    live: Option<LogReader>,
    backfill: Option<(usize, LogReader)>,
}

impl Readers {
    fn take(&mut self, lane: Lane) -> Option<LogReader> {
        match lane {
            Lane::Live => self.live.take(),
            Lane::Backfill(p) => match self.backfill.take() {
                Some((q, r)) if q == p => Some(r),
                _ => None,
            },
        }
    }

    fn put(&mut self, lane: Lane, r: LogReader) {
        match lane {
            Lane::Live => self.live = Some(r),
            Lane::Backfill(p) => self.backfill = Some((p, r)),
        }
    }

    /// Forget the backfill reader (no pipeline backfills).
    fn drop_backfill(&mut self) {
        self.backfill = None;
    }
}

/// How a slice ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum End {
    /// `max` records taken; the lane has more.
    Max,
    /// The lane's end is reached.
    Reached,
    /// A new reader found nothing although the lane says there is more: a repair removed
    /// the rest of the log. Nothing is left to take.
    Short,
    /// The caller's `hold` said to stop, and why.
    Held(String),
}

/// What one slice of backfill did, for the journal and `cairn status`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackfillSlice {
    pub pipeline: String,
    /// Records taken in this slice (matching the pipeline's topics or not).
    pub taken: u64,
    /// Records still behind the live position (at most: a repair may have left gaps).
    pub left: u64,
    /// The pipeline caught up: it processes live records from now on.
    pub joined: bool,
}

/// What one slice of catch-up did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CatchUp {
    /// Records applied in this slice.
    pub taken: u64,
    /// The live position reached the log's durable end: records arriving from now on can be
    /// applied as they are committed.
    pub caught_up: bool,
}

impl Processor {
    /// Where `lane` reads from and up to where, on `log`; `None` for a pipeline that does
    /// not backfill.
    fn lane_span(&self, lane: Lane, log: &Log) -> Option<(Offset, Offset)> {
        let live = self.next_offset();
        match lane {
            Lane::Live => Some((live, log.durable_next())),
            Lane::Backfill(p) => {
                let b: Backfill = self.engine.progress().pipelines.get(p)?.backfill?;
                Some((b.next.max(log.first_offset()), live))
            }
        }
    }

    /// Take up to `max` records of `lane` from `log` and apply them, stopping early once the
    /// batch holds as many state keys or results as [`Processor::set_batch_bound`] allows
    /// (ended as [`End::Max`]: the lane has more); `hold` is asked before each record and
    /// may stop the slice, `outcome` hears what each record gave. The slice's reader is kept
    /// for the next one on the same lane.
    pub(crate) fn read_slice(
        &mut self,
        log: &Log,
        lane: Lane,
        max: u64,
        hold: &mut dyn FnMut(&Processor) -> Option<String>,
        outcome: &mut dyn FnMut(&Record, Outcome),
    ) -> Result<(u64, End), ProcessError> {
        let target = match lane {
            Lane::Live => Target::Live,
            Lane::Backfill(p) => Target::Backfill(p),
        };
        let mut taken = 0;
        let mut fresh = false;
        let mut reader = self.readers.take(lane);
        let end = loop {
            if taken >= max || self.batch_full() {
                break End::Max;
            }
            let Some((from, to)) = self.lane_span(lane, log) else {
                reader = None;
                break End::Reached;
            };
            if from >= to {
                break End::Reached;
            }
            if let Some(why) = hold(self) {
                break End::Held(why);
            }
            if reader.is_none() {
                self.note_gap(lane, log);
                reader = Some(log.read_from(from)?);
                fresh = true;
            }
            match reader.as_mut().and_then(|r| r.next()) {
                // This reader's view of the log ends here; records made durable since are
                // seen by a new one.
                None if fresh => {
                    reader = None;
                    break End::Short;
                }
                None => reader = None,
                Some(Err(e)) => return Err(e.into()),
                // Taken already (live records applied on arrival meanwhile).
                Some(Ok(rec)) if rec.offset < from => fresh = false,
                Some(Ok(rec)) if rec.offset >= to => {
                    reader = None;
                    break End::Reached;
                }
                Some(Ok(rec)) => {
                    fresh = false;
                    for o in self.apply_at(target, &rec)? {
                        outcome(&rec, o);
                    }
                    taken += 1;
                }
            }
        };
        if let Some(r) = reader {
            self.readers.put(lane, r);
        }
        Ok((taken, end))
    }

    /// A backfill whose cursor the log no longer reaches goes on from the oldest record
    /// there, and says which it missed.
    fn note_gap(&self, lane: Lane, log: &Log) {
        let Lane::Backfill(p) = lane else {
            return;
        };
        let pp = &self.engine.progress().pipelines[p];
        let first = log.first_offset();
        if let Some(b) = pp.backfill.filter(|b| b.next > 0 && b.next < first) {
            crate::event!(warn, "backfill_records_gone", pipeline = pp.name;
                "pipeline `{}`: the log no longer holds records [{}, {first}) of its backfill \
                 (a savepoint restored, or `cairn verify --repair`); it goes on from offset \
                 {first}",
                pp.name,
                b.next
            );
        }
    }

    /// Apply up to `max` durable records from the live position on, read back from `log`;
    /// `outcome` hears what each gave.
    pub fn catch_up(
        &mut self,
        log: &Log,
        max: u64,
        outcome: &mut dyn FnMut(&Record, Outcome),
    ) -> Result<CatchUp, ProcessError> {
        let (taken, end) = self.read_slice(log, Lane::Live, max, &mut |_| None, outcome)?;
        if end == End::Short {
            crate::event!(warn, "processing_log_short";
                "processing: the log ends at offset {} although its durable end is {}; going \
                 on from there",
                self.next_offset(),
                log.durable_next()
            );
        }
        Ok(CatchUp {
            taken,
            caught_up: matches!(end, End::Reached | End::Short)
                || self.next_offset() >= log.durable_next(),
        })
    }

    /// Take up to `max` records behind the live position for the first configured
    /// pipeline still backfilling. `None` when none is. The records count as applied: the
    /// caller checkpoints as for live ones.
    pub fn backfill_slice(
        &mut self,
        log: &Log,
        max: u64,
    ) -> Result<Option<BackfillSlice>, ProcessError> {
        let Some((p, _)) = self.engine.backfills().next() else {
            self.readers.drop_backfill();
            return Ok(None);
        };
        let (taken, end) =
            self.read_slice(log, Lane::Backfill(p), max, &mut |_| None, &mut |_, _| {})?;
        let name = self.engine.progress().pipelines[p].name.clone();
        let live = self.next_offset();
        // The engine ends a backfill itself at the record before the live position.
        let joined = matches!(end, End::Reached | End::Short)
            || self.engine.progress().pipelines[p].backfill.is_none();
        if joined {
            self.engine.finish_backfill(p);
            self.readers.drop_backfill();
            crate::event!(info, "backfill_done", pipeline = name;
                "pipeline `{name}`: backfill done; it processes live records from log offset \
                 {live} on"
            );
        }
        let now = self.engine.progress().pipelines[p].backfill;
        Ok(Some(BackfillSlice {
            pipeline: name,
            taken,
            left: now.map_or(0, |b| live.saturating_sub(b.next.max(log.first_offset()))),
            joined,
        }))
    }

    /// Re-apply every durable record from the checkpoint's `next_offset`, committing every
    /// `max_records`, or sooner where the batch's bound says so ([`Processor::set_batch_bound`]).
    /// `progress` is called after each checkpoint (for STATUS lines).
    pub fn replay(
        &mut self,
        log: &Log,
        max_records: u64,
        now_ms: &dyn Fn() -> u64,
        progress: &mut dyn FnMut(&ReplayStats),
    ) -> Result<ReplayStats, ProcessError> {
        self.replay_held(log, max_records, now_ms, progress, &mut |_| None)
    }

    /// [`Processor::replay`] that stops where `hold` says processing must wait (the outbox
    /// at its bound, a nearly full disk: invariant 7, replay included). What it applied is
    /// checkpointed unless `hold` said so because the disk is nearly full
    /// ([`Hold::commit`]); the rest of the log is left for catch-up.
    pub(crate) fn replay_held(
        &mut self,
        log: &Log,
        max_records: u64,
        now_ms: &dyn Fn() -> u64,
        progress: &mut dyn FnMut(&ReplayStats),
        hold: &mut dyn FnMut(&Processor) -> Option<Hold>,
    ) -> Result<ReplayStats, ProcessError> {
        let started = Instant::now();
        let from = self.next_offset();
        if from < log.first_offset() && log.durable_next() > log.first_offset() {
            return Err(ProcessError::LogGap {
                needed: from,
                first: log.first_offset(),
            });
        }
        let mut stats = ReplayStats {
            from,
            to: from,
            ..Default::default()
        };
        let deferred = std::mem::replace(&mut self.defer_sync, false);
        let mut held: Option<Hold> = None;
        loop {
            let max = max_records.saturating_sub(self.pending_records()).max(1);
            let (taken, end) = self.read_slice(
                log,
                Lane::Live,
                max,
                &mut |p| {
                    held = hold(p);
                    held.as_ref().map(|h| h.why.clone())
                },
                &mut |_, _| {},
            )?;
            stats.records += taken;
            stats.to = self.next_offset();
            let commit = held.as_ref().is_none_or(|h| h.commit);
            let full = self.pending_records() >= max_records || self.batch_full();
            let mut checkpointed = false;
            if full && commit && self.pending_records() > 0 {
                self.checkpoint(now_ms())?;
                checkpointed = true;
                stats.checkpoints += 1;
                stats.millis = started.elapsed().as_millis() as u64;
                progress(&stats);
            }
            // A slice that took nothing and freed nothing would be taken again as it was.
            if end != End::Max || (taken == 0 && !checkpointed) {
                break;
            }
        }
        if held.as_ref().is_none_or(|h| h.commit) && self.checkpoint(now_ms())?.is_some() {
            stats.checkpoints += 1;
        }
        self.defer_sync = deferred;
        stats.held = held.map(|h| h.why);
        stats.millis = started.elapsed().as_millis() as u64;
        Ok(stats)
    }
}

/// Why processing must wait (see [`Processor::replay_held`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Hold {
    pub(crate) why: String,
    /// Whether what was applied may still be checkpointed (not on a nearly full disk).
    pub(crate) commit: bool,
}
