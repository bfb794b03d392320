//! Backfill carried out (issue 15): slices of the retained log for pipelines started with
//! `start = "earliest"`, interleaved with live work in the loop, and the log they still
//! need kept from retention. What a slice does is the processor's (`processor/backfill.rs`).
//!
//! Retention's rule gains one bound: no segment at or after the lowest durable backfill
//! cursor of a configured pipeline goes, whatever its age, even when the log is short of
//! room. A full log then holds input back (backpressure, as for unprocessed records) until
//! the backfill has moved past the oldest segments; the journal says so. A dormant
//! pipeline's cursor holds nothing (it would hold the log for ever); if it comes back, it
//! goes on from the oldest record still there, and says which records it missed.

use std::time::{Duration, Instant};

use crate::config::Config;
use crate::model::{Offset, PipelineProgress};
use crate::pipeline::engine::Progress;

use super::error::failpoint;
use super::{Agent, AgentError};

/// Records per slice at most: small enough that acks, checkpoints and publishing keep their
/// pace beside it.
const SLICE_MAX: u64 = 512;
/// How often the journal hears how a backfill goes.
const REPORT_INTERVAL: Duration = Duration::from_secs(10);

/// The loop's view of backfills: whether one may be in progress, and when it last told.
#[derive(Debug)]
pub(super) struct Backfilling {
    active: bool,
    reported: Option<Instant>,
    held_reported: Option<Instant>,
}

impl Backfilling {
    /// At start every backfill a checkpoint recorded is in progress: the first slice finds
    /// out which.
    pub(super) fn new() -> Backfilling {
        Backfilling {
            active: true,
            reported: None,
            held_reported: None,
        }
    }

    /// Whether a slice may have work: the loop then does not wait for input.
    pub(super) fn active(&self) -> bool {
        self.active
    }
}

/// The lowest offset retention must keep for `progress` (the durable checkpoint's): its
/// live `next_offset`, or a configured pipeline's backfill cursor below it.
pub(super) fn retention_floor(progress: &Progress, cfg: &Config) -> Offset {
    progress
        .pipelines
        .iter()
        .filter(|pp| cfg.pipelines.iter().any(|s| s.name == pp.name))
        .filter_map(|pp| pp.backfill.map(|b| b.next))
        .fold(progress.next_offset, Offset::min)
}

/// Records pipeline `pp` has still to take before it joins live processing.
pub(super) fn records_left(progress: &Progress, pp: &PipelineProgress, first: Offset) -> u64 {
    pp.backfill.map_or(0, |b| {
        progress.next_offset.saturating_sub(b.next.max(first))
    })
}

impl Agent {
    /// One slice of backfill, if a pipeline backfills; then a checkpoint if enough records
    /// wait for one (the timer covers the rest, as for live records).
    pub(super) fn backfill_step(&mut self) -> Result<(), AgentError> {
        if !self.backfill.active {
            return Ok(());
        }
        let max = SLICE_MAX.min(self.cfg.checkpoint.max_records.max(1));
        let Some(slice) = self.proc.backfill_slice(&self.log, max)? else {
            self.backfill.active = false;
            return Ok(());
        };
        let now = self.now();
        if slice.taken > 0 {
            self.checkpointer.applied(now);
        }
        // Applied, not checkpointed: a crash here resumes at the last committed cursor.
        failpoint("backfill.after_slice")?;
        if self.checkpoint_size_due() {
            self.checkpoint()?;
        }
        let due = self
            .backfill
            .reported
            .is_none_or(|t| now >= t + REPORT_INTERVAL);
        if due && !slice.joined {
            self.backfill.reported = Some(now);
            log::info!(
                "backfill: pipeline `{}`: {} records left before it joins live processing",
                slice.pipeline,
                slice.left
            );
        }
        Ok(())
    }

    /// `, backfilling N records` for the `STATUS=` line while a backfill runs.
    pub(super) fn backfill_status(&self) -> String {
        let engine = self.proc.engine();
        let first = self.log.first_offset();
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

    /// Retention found the log short of room but a backfill holds its oldest segments:
    /// say so (at most every [`REPORT_INTERVAL`]); ingest stops acknowledging until the
    /// backfill moves on.
    pub(super) fn note_backfill_holds_log(&mut self, floor: Offset, live: Offset) {
        if floor >= live || !self.log.short_of_room() {
            return;
        }
        let now = self.now();
        if self
            .backfill
            .held_reported
            .is_some_and(|t| now < t + REPORT_INTERVAL)
        {
            return;
        }
        self.backfill.held_reported = Some(now);
        log::warn!(
            "retention: the log is short of room (log.max_size {} bytes), but a backfill still \
             needs it from offset {floor} on, so those segments stay: input is held back \
             (backpressure) until the backfill has moved past the oldest ones",
            self.cfg.log.max_size
        );
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::model::Backfill;

    fn config() -> Config {
        let table = |name: &str| {
            format!(
                "[[pipeline]]\nname = \"{name}\"\ntopics = [\"m/#\"]\nevent_id = \"/id\"\n\
                 key = \"/k\"\naggregate = \"count\"\noutput_topic = \"{name}/{{key}}\"\n"
            )
        };
        let text = format!(
            "[mqtt]\nclient_id = \"t\"\n[storage]\ndata_dir = \".\"\n{}{}",
            table("a"),
            table("b")
        );
        crate::config::parse_str(&text, Path::new("t.toml")).unwrap()
    }

    fn progress(cursors: &[(&str, Option<Offset>)]) -> Progress {
        Progress {
            next_offset: 1_000,
            pipelines: cursors
                .iter()
                .map(|(name, next)| PipelineProgress {
                    name: name.to_string(),
                    backfill: next.map(|next| Backfill { next, clock_ms: 0 }),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn retention_keeps_the_log_from_the_lowest_configured_backfill_cursor() {
        let cfg = config();
        let none = progress(&[("a", None), ("b", None)]);
        assert_eq!(retention_floor(&none, &cfg), 1_000);
        let two = progress(&[("a", Some(700)), ("b", Some(300))]);
        assert_eq!(retention_floor(&two, &cfg), 300);
        // A dormant pipeline's backfill would hold the log for ever: it holds nothing.
        let dormant = progress(&[("a", Some(700)), ("gone", Some(5))]);
        assert_eq!(retention_floor(&dormant, &cfg), 700);
        assert_eq!(records_left(&two, &two.pipelines[1], 0), 700);
        assert_eq!(records_left(&two, &two.pipelines[1], 400), 600);
        assert_eq!(records_left(&none, &none.pipelines[0], 0), 0);
    }
}
