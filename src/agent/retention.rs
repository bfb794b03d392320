//! Retention carried out: which log segments go, by the rule in the `log` module docs; the
//! decisions (cutoff, savepoint floor) come from `checkpointer`, the durable floor from
//! `fsync`.

use super::{Agent, AgentError, Checkpointer, failpoint};

impl Agent {
    /// Delete log segments by the rule in the `log` module docs ("Retention"): never what
    /// no committed checkpoint covers; outside `retention` and below the newest savepoint
    /// while there is room; oldest processed first, whatever their age, when there is not.
    pub(super) fn retention(&mut self) -> Result<(), AgentError> {
        // Durable progress only, never the engine's applied offset nor a checkpoint whose
        // fsync has not finished: after a crash the replay starts at the durable checkpoint,
        // so everything from there must stay; and never what a backfill still needs (see
        // `backfill`).
        let durable = self.fsync.floor();
        self.note_backfill_holds_log(durable, self.fsync.durable());
        // Segment ages are times of receipt: measure them with the receipt clock, which never
        // goes back (by a wall clock stepped back, segments would be kept for as long as it
        // stays behind).
        let now_ms = self
            .ingest
            .receipt_now(self.clock.wall_ms(), self.clock.monotonic());
        let cutoff = Checkpointer::retention_cutoff(now_ms, self.cfg.log.retention);
        let floor = self.checkpointer.savepoint_floor();
        let mut plan = self.log.plan_retention(durable, floor, cutoff);
        if plan.floor_blocks {
            self.savepoint_for_room();
            let floor = self.checkpointer.savepoint_floor();
            plan = self.log.plan_retention(durable, floor, cutoff);
        }
        if plan.below <= self.log.first_offset() {
            return Ok(());
        }
        self.log.truncate_before(plan.below)?;
        // Segments are gone, the next checkpoint has not run: a crash here must replay
        // from the committed checkpoint without a gap (tests/it/retention.rs).
        failpoint("retention.after_delete")?;
        if plan.evicted > 0 {
            self.metrics
                .update(|f| f.log_segments_evicted += plan.evicted as u64);
            let max_size = self.cfg.log.max_size;
            self.eviction_log
                .warn(self.clock.monotonic(), "retention", "evictions", || {
                    format!(
                        "retention: the log is short of room (log.max_size {max_size} bytes): \
                         deleted {} processed segment(s) still inside log.retention, up to \
                         offset {}. Nothing is lost (all of it is checkpointed); raise \
                         log.max_size to keep more history",
                        plan.evicted, plan.below
                    )
                });
        }
        Ok(())
    }
}
