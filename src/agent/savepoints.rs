//! The checkpointer's decisions about savepoints, carried out: after a checkpoint, for a
//! log short of room, and on a new interval. The files themselves are the store's
//! (`store::savepoint`).

use std::time::Duration;

use crate::store::{CheckpointInfo, SavepointInfo};

use super::Agent;
use super::figures::{note_savepoint_files, pipeline_figures};

impl Agent {
    /// Right after a commit the store is exactly that checkpoint and nothing else writes to
    /// it until this thread goes on: the one moment a savepoint is consistent.
    pub(super) fn after_checkpoint(&mut self, took: Duration, info: &CheckpointInfo) {
        let outbox_end = self.proc.engine().progress().outbox_seq;
        self.metrics
            .note_outbox_committed(outbox_end, info.committed_at_ms);
        let pipelines = pipeline_figures(self.proc.engine().progress(), self.log.first_offset());
        let bounds = self.proc.store().bound_figures();
        self.metrics.update(|f| {
            super::figures::set_bound_figures(f, &bounds);
            // One update: a scrape sees the count, duration and offsets of one checkpoint,
            // and the pipeline figures with it (the ledger sizes change only at a commit).
            f.pipelines = pipelines;
            f.checkpoints += 1;
            f.checkpoint.observe(took);
            f.checkpoint_id = info.id;
            f.checkpoint_next_offset = info.next_offset;
            f.checkpoint_at_ms = info.committed_at_ms;
            f.log_next_offset = self.log.next_offset();
        });
        if self.checkpointer.savepoint_due_now(self.now()) {
            // A failed savepoint costs no data (the checkpoint is durable, retention keeps
            // the log back to the previous savepoint): it is reported, and tried again next
            // interval.
            let _ = self.take_savepoint();
        }
    }

    /// Write a savepoint of the durable checkpoint, prune to `keep`, make it the floor, and
    /// schedule the next periodic one. The store holds exactly the last committed
    /// checkpoint whenever this thread is not inside a commit, so any call here is
    /// consistent.
    pub(super) fn take_savepoint(&mut self) -> Result<SavepointInfo, crate::store::StoreError> {
        let (dir, keep) = (self.cfg.savepoint_dir(), self.cfg.savepoint.keep);
        let began = self.now();
        self.checkpointer
            .savepoint_started(began, self.cfg.savepoint.interval);
        let written = self.proc.store().write_savepoint(&dir, &self.sync);
        match &written {
            Ok(sp) => {
                log::info!(
                    "savepoint: checkpoint {} at offset {} ({} bytes) in {} ms",
                    sp.checkpoint_id,
                    sp.next_offset,
                    sp.bytes,
                    self.now().saturating_duration_since(began).as_millis()
                );
                self.metrics.update(|f| f.savepoints += 1);
                self.checkpointer.savepoint_written(sp.clone());
                if let Err(e) = crate::store::prune_savepoints(&dir, keep) {
                    log::error!("savepoint: cannot prune {} to {keep}: {e}", dir.display());
                }
                match crate::store::list_savepoints(&dir) {
                    Ok(all) => note_savepoint_files(&self.metrics, &all),
                    Err(e) => log::warn!("savepoint: cannot list {}: {e}", dir.display()),
                }
            }
            Err(e) => {
                log::error!("savepoint: failed: {e}");
                self.metrics.update(|f| f.savepoint_failures += 1);
            }
        }
        written
    }

    /// The newest savepoint holds a log that is short of room. Replace it with a savepoint
    /// of the durable checkpoint, so the old segments can go and the store can still be
    /// rebuilt from what is left; if that fails, let the floor go (loudly) rather than stop
    /// acknowledging input. Either way the savepoint floor never stalls ingest.
    pub(super) fn savepoint_for_room(&mut self) {
        let held = self.checkpointer.savepoint_floor();
        match self.take_savepoint() {
            Ok(sp) => {
                log::warn!(
                    "savepoint: the one at offset {held} held a replay log short of room; took \
                     a new one at offset {} so older segments can go (size log.max_size to \
                     hold a savepoint interval of input to avoid these)",
                    sp.next_offset
                );
                self.metrics.update(|f| f.savepoints_for_room += 1);
            }
            Err(_) => {
                log::error!(
                    "savepoint: the one at offset {held} holds a replay log short of room and \
                     a new one could not be written (see above): deleting processed segments \
                     below it anyway. It can no longer be restored; until a savepoint succeeds \
                     a damaged store cannot be rebuilt"
                );
                self.checkpointer.release_floor();
                self.metrics.update(|f| f.savepoint_floor_released += 1);
            }
        }
    }

    /// `[savepoint] interval` changed by SIGHUP: on, the first is due as at start (now, if
    /// the newest is older than the interval); off, none is scheduled.
    pub(super) fn reschedule_savepoints(&mut self) {
        let (wall_ms, now) = (self.clock.wall_ms(), self.now());
        self.checkpointer
            .reschedule(self.cfg.savepoint.interval, wall_ms, now);
        match self.cfg.savepoint.interval {
            Some(every) => log::info!(
                "reload: savepoints every {every:?}, keep {}; the next is due in {:?} (taken \
                 at the first checkpoint after that)",
                self.cfg.savepoint.keep,
                self.checkpointer
                    .next_savepoint()
                    .map(|t| t.saturating_duration_since(now))
                    .unwrap_or_default()
            ),
            None => log::info!("reload: periodic savepoints off"),
        }
    }
}
