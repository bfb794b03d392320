//! Backfill (`start = "earliest"`, issue 15): a pipeline new to the store first takes the
//! retained log behind the live position, in log order, in slices the agent interleaves
//! with live processing; once its cursor reaches the live position it joins live
//! processing. Until then live records skip it (it reads them from the log later).
//!
//! Exactly once across crashes: the pipeline's cursor ([`Backfill`]) is part of the
//! progress each checkpoint commits in one transaction with the state, dedup entries and
//! outputs it reached, so a restart resumes at the last committed cursor and everything
//! after it is applied once onto state that does not hold it yet. Its dedup window runs on
//! its own clock (the newest time of receipt it took), so duplicates inside the backfilled
//! range are judged as they were received. The agent keeps the log from the lowest durable
//! cursor on (`agent/backfill.rs`).

use super::*;
use crate::model::Backfill;
use crate::pipeline::spec::Start;

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

/// A pipeline that starts empty: with `start = "earliest"`, it backfills.
pub(super) fn begin(spec: &PipelineSpec, pp: &mut PipelineProgress) {
    if spec.start == Start::Earliest {
        pp.backfill = Some(Backfill::default());
        log::info!(
            "pipeline `{}` starts empty with start = \"earliest\": it processes the retained \
             log first, then joins live processing",
            spec.name
        );
    }
}

/// A pipeline the store already holds: `start` does not apply; a backfill resumes.
pub(super) fn note_stored(spec: &PipelineSpec, stored: &PipelineProgress) {
    match (stored.backfill, spec.start) {
        (Some(b), _) => log::info!(
            "pipeline `{}`: resuming its backfill at log offset {}",
            spec.name,
            b.next
        ),
        (None, Start::Earliest) => log::info!(
            "pipeline `{}`: start = \"earliest\" ignored: the pipeline has stored state (start \
             applies only to a pipeline new to the store, or reset)",
            spec.name
        ),
        (None, Start::Latest) => {}
    }
}

impl Processor {
    /// Take up to `max` records behind the live position for the first configured
    /// pipeline still backfilling. `None` when none is. The records count as applied: the
    /// caller checkpoints as for live ones.
    pub fn backfill_slice(
        &mut self,
        log: &Log,
        max: u64,
    ) -> Result<Option<BackfillSlice>, ProcessError> {
        let Some((p, _)) = self.engine.backfills().next() else {
            self.backfill_reader = None;
            return Ok(None);
        };
        let name = self.engine.progress().pipelines[p].name.clone();
        let mut taken = 0;
        let mut fresh = false;
        while taken < max {
            let live = self.next_offset();
            let Some(b) = self.engine.progress().pipelines[p].backfill else {
                break;
            };
            let first = log.first_offset();
            if b.next.max(first) >= live {
                self.engine.finish_backfill(p);
                break;
            }
            if !matches!(self.backfill_reader, Some((q, _)) if q == p) {
                if b.next > 0 && b.next < first {
                    log::warn!(
                        "pipeline `{name}`: the log no longer holds records [{}, {first}) of \
                         its backfill (a savepoint restored, or `cairn verify --repair`); it \
                         goes on from offset {first}",
                        b.next
                    );
                }
                self.backfill_reader = Some((p, log.read_from(b.next.max(first))?));
                fresh = true;
            }
            let next = self.backfill_reader.as_mut().and_then(|(_, r)| r.next());
            match next {
                // The reader's view of the log ends here: look again, unless a new reader
                // finds nothing either (a repair removed the rest).
                None if fresh => {
                    self.backfill_reader = None;
                    self.engine.finish_backfill(p);
                    break;
                }
                None => self.backfill_reader = None,
                Some(Err(e)) => {
                    self.backfill_reader = None;
                    return Err(e.into());
                }
                Some(Ok(rec)) if rec.offset >= live => {
                    self.backfill_reader = None;
                    self.engine.finish_backfill(p);
                    break;
                }
                Some(Ok(rec)) => {
                    fresh = false;
                    self.apply_at(Target::Backfill(p), &rec)?;
                    taken += 1;
                }
            }
        }
        let now = self.engine.progress().pipelines[p].backfill;
        let live = self.next_offset();
        if now.is_none() {
            self.backfill_reader = None;
            log::info!(
                "pipeline `{name}`: backfill done; it processes live records from log offset \
                 {live} on"
            );
        }
        Ok(Some(BackfillSlice {
            pipeline: name,
            taken,
            left: now.map_or(0, |b| live.saturating_sub(b.next.max(log.first_offset()))),
            joined: now.is_none(),
        }))
    }
}
