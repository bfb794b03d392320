//! The keeper: what makes processed work durable and what it lets go of. The checkpoint's
//! schedule (`schedule.rs`), its transaction and fsync on a thread beside the loop
//! (`commit.rs`), retention of log segments, savepoints, and the free-space wait of store
//! writes.
//!
//! The loop takes a checkpoint from the processor (it holds the processor and the results'
//! settled prefix) and hands the rest here: the commit and fsync, what retention may then
//! delete, whether a savepoint is due. Retention and savepoints are carried out here, with the log and the store the
//! loop hands over.
//!
//! **Store writes under the free-space guard** (issue 26): a checkpoint on a disk with less
//! than the reserve free (`disk`'s guard, the one ingest uses) waits instead of failing with
//! `ENOSPC` and crash-looping the agent, and processing waits with it; the journal says so
//! once a minute. It commits once the guard measures room again.

mod commit;
pub(crate) mod schedule;

use std::time::{Duration, Instant};

use crate::config::Config;
use crate::fsio::Durability;
use crate::log::Log;
use crate::metrics::Metrics;
use crate::model::{Offset, Progress};
use crate::store::{CheckpointInfo, SavepointInfo, Store, StoreError};

use super::error::{AgentError, failpoint};
pub(crate) use commit::Committer;
pub(crate) use schedule::{Relief, STORE_BLOAT_FACTOR, Schedule};

/// How often the journal hears that a backfill holds the log, or that checkpoints wait for
/// disk room.
const REPORT_INTERVAL: Duration = Duration::from_secs(10);

/// What one checkpoint is assumed to write per result and per state key, for the free-space
/// guard (a page share, an outbox entry, a ledger entry: far below it). The guard's reserve
/// (2 × `log.segment_size`) is what really keeps room; this only counts a large commit early.
pub(crate) const CHECKPOINT_BYTES_PER_WRITE: u64 = 512;

pub(crate) struct Keeper {
    pub(crate) schedule: Schedule,
    commit: Committer,
    /// The checkpoint in flight: when the loop took it, and how many outputs it left out as
    /// settled.
    in_flight: Option<(Instant, u64)>,
    sync: Durability,
    /// Warnings for processed segments deleted inside retention (a log short of room).
    eviction_log: crate::logging::RateLimit,
    backfill_held_reported: Option<Instant>,
    /// Checkpoints wait for disk room (since when), and the journal's line about it.
    disk_wait: Option<Instant>,
    disk_log: crate::logging::RateLimit,
}

impl Keeper {
    pub(crate) fn new(schedule: Schedule, commit: Committer, sync: Durability) -> Keeper {
        Keeper {
            schedule,
            commit,
            in_flight: None,
            sync,
            eviction_log: crate::logging::RateLimit::new(3, Duration::from_secs(60)),
            backfill_held_reported: None,
            disk_wait: None,
            disk_log: crate::logging::RateLimit::new(1, Duration::from_secs(60)),
        }
    }

    /// Start the checkpoint commit thread over `store`, whose durable checkpoint is
    /// `progress`.
    pub(crate) fn start_committer(
        store: std::sync::Arc<Store>,
        progress: &Progress,
        cfg: &Config,
    ) -> std::io::Result<Committer> {
        let floor = retention_floor(progress, cfg);
        Committer::start(store, progress.next_offset, floor)
    }

    /// A finished checkpoint (`wait`: wait for the one in flight): committed and durable;
    /// with when the loop took it and how many outputs it left out as settled.
    pub(crate) fn commit_done(
        &mut self,
        wait: bool,
    ) -> Result<Option<(CheckpointInfo, Instant, u64)>, StoreError> {
        let Some(info) = self.commit.settle(wait)? else {
            return Ok(None);
        };
        let (began, settled) = self.in_flight.take().expect("a checkpoint was in flight");
        Ok(Some((info, began, settled)))
    }

    /// The loop is done with a committed, durable checkpoint: freed beside it.
    pub(crate) fn release(&self, cp: std::sync::Arc<crate::pipeline::engine::Checkpoint>) {
        self.commit.release(cp);
    }

    /// Whether a checkpoint is being committed beside the loop.
    pub(crate) fn commit_in_flight(&self) -> bool {
        self.commit.in_flight()
    }

    /// Commit `cp` beside the loop and make it durable (it needs the log from `floor`).
    /// `taken`: the wall-clock time it records, when the loop took it, and how many outputs
    /// it left out as settled.
    pub(crate) fn commit(
        &mut self,
        cp: std::sync::Arc<crate::pipeline::engine::Checkpoint>,
        floor: Offset,
        (at_ms, began, settled): (u64, Instant, u64),
    ) -> Result<(), StoreError> {
        self.commit.begin(cp, at_ms, floor)?;
        self.in_flight = Some((began, settled));
        Ok(())
    }

    /// The free-space guard refused a checkpoint (`free` bytes left under `dir`): it waits,
    /// and so does processing ([`Keeper::waiting_for_disk`]).
    pub(crate) fn disk_refused(
        &mut self,
        now: Instant,
        free: u64,
        dir: &std::path::Path,
        reserve: u64,
    ) {
        self.disk_wait.get_or_insert(now);
        self.disk_log.warn(now, "checkpoint_waits_for_disk", "checkpoint waits", "times", || {
            crate::event!(warn, "checkpoint_waits_for_disk";
                "checkpoint waits: the disk is nearly full ({free} bytes free under {}, below \
                 the reserve of {reserve} bytes): processing waits too, and input is held back, \
                 until there is room; nothing is lost (it is in the log)",
                dir.display()
            )
        });
    }

    /// A checkpoint found room again.
    pub(crate) fn disk_room(&mut self, now: Instant) {
        if let Some(since) = self.disk_wait.take() {
            crate::event!(info, "checkpoint_disk_room_again";
                "checkpoint: the disk has room again; checkpoints resume ({:.1} s after they \
                 began to wait)",
                now.saturating_duration_since(since).as_secs_f64()
            );
        }
    }

    /// Whether checkpoints wait for disk room: processing then waits too.
    pub(crate) fn waiting_for_disk(&self) -> bool {
        self.disk_wait.is_some()
    }

    /// Delete log segments by the rule in the `log` module docs ("Retention"): never what
    /// no durable checkpoint covers or a backfill still needs; outside `retention` and below
    /// the newest savepoint while there is room; oldest processed first, whatever their age,
    /// when there is not. `receipt_ms`: the receipt clock now, which never goes back (by a
    /// wall clock stepped back, segments would be kept for as long as it stays behind).
    pub(crate) fn retention(
        &mut self,
        log: &mut Log,
        store: &Store,
        cfg: &Config,
        metrics: &Metrics,
        (receipt_ms, now): (u64, Instant),
        beat: &mut dyn FnMut(u64),
    ) -> Result<(), AgentError> {
        // Durable progress only, never the engine's applied offset nor a checkpoint whose
        // fsync has not finished: after a crash the replay starts at the durable checkpoint,
        // so everything from there must stay; and never what a backfill still needs.
        let durable = self.commit.floor();
        self.note_backfill_holds_log(log, cfg, durable, now);
        let cutoff = Schedule::retention_cutoff(receipt_ms, cfg.log.retention);
        let floor = self.schedule.savepoint_floor();
        let mut plan = log.plan_retention(durable, floor, cutoff);
        if plan.floor_blocks {
            self.savepoint_for_room(store, cfg, metrics, now, beat);
            let floor = self.schedule.savepoint_floor();
            plan = log.plan_retention(durable, floor, cutoff);
        }
        if plan.below <= log.first_offset() {
            return Ok(());
        }
        log.truncate_before(plan.below)?;
        // Segments are gone, the next checkpoint has not run: a crash here must replay
        // from the committed checkpoint without a gap (tests/it/retention.rs).
        failpoint("retention.after_delete")?;
        if plan.evicted > 0 {
            metrics.update(|f| f.log_segments_evicted += plan.evicted as u64);
            let max_size = cfg.log.max_size;
            self.eviction_log.warn(
                now,
                "log_segments_evicted",
                "retention",
                "evictions",
                || {
                    crate::event!(warn, "log_segments_evicted", offset = plan.below;
                        "retention: the log is short of room (log.max_size {max_size} bytes): \
                         deleted {} processed segment(s) still inside log.retention, up to \
                         offset {}. Nothing is lost (all of it is checkpointed); raise \
                         log.max_size to keep more history",
                        plan.evicted, plan.below
                    )
                },
            );
        }
        Ok(())
    }

    /// Retention found the log short of room but a backfill holds its oldest segments:
    /// say so (at most every [`REPORT_INTERVAL`]); ingest stops acknowledging until the
    /// backfill moves on.
    fn note_backfill_holds_log(&mut self, log: &Log, cfg: &Config, floor: Offset, now: Instant) {
        if floor >= self.commit.durable() || !log.short_of_room() {
            return;
        }
        if self
            .backfill_held_reported
            .is_some_and(|t| now < t + REPORT_INTERVAL)
        {
            return;
        }
        self.backfill_held_reported = Some(now);
        crate::event!(warn, "retention_held_by_backfill", offset = floor;
            "retention: the log is short of room (log.max_size {} bytes), but a backfill still \
             needs it from offset {floor} on, so those segments stay: input is held back \
             (backpressure) until the backfill has moved past the oldest ones",
            cfg.log.max_size
        );
    }

    /// Write a savepoint of the durable checkpoint, prune to `keep`, make it the floor, and
    /// schedule the next periodic one. The store holds exactly the last committed
    /// checkpoint whenever the loop is not inside a commit, so any call here is consistent.
    /// `beat` hears the entries written so far, now and then: the loop feeds the service
    /// manager's watchdog from it during a long write.
    pub(crate) fn take_savepoint(
        &mut self,
        store: &Store,
        cfg: &Config,
        metrics: &Metrics,
        now: Instant,
        beat: &mut dyn FnMut(u64),
    ) -> Result<SavepointInfo, StoreError> {
        let (dir, keep) = (cfg.savepoint_dir(), cfg.savepoint.keep);
        self.schedule.savepoint_started(now, cfg.savepoint.interval);
        let began = std::time::Instant::now();
        let written = store.write_savepoint_with(&dir, &self.sync, beat);
        match &written {
            Ok(sp) => {
                crate::event!(info, "savepoint_written";
                    "savepoint: checkpoint {} at offset {} ({} bytes) in {} ms",
                    sp.checkpoint_id,
                    sp.next_offset,
                    sp.bytes,
                    began.elapsed().as_millis()
                );
                metrics.update(|f| f.savepoints += 1);
                self.schedule.savepoint_written(sp.clone());
                if let Err(e) = crate::store::prune_savepoints(&dir, keep) {
                    crate::event!(error, "savepoint_prune_failed"; "savepoint: cannot prune {} to {keep}: {e}", dir.display());
                }
                match crate::store::list_savepoints(&dir) {
                    Ok(all) => note_savepoint_files(metrics, &all),
                    Err(e) => {
                        crate::event!(warn, "savepoint_list_failed"; "savepoint: cannot list {}: {e}", dir.display())
                    }
                }
            }
            Err(e) => {
                crate::event!(error, "savepoint_failed"; "savepoint: failed: {e}");
                metrics.update(|f| f.savepoint_failures += 1);
            }
        }
        written
    }

    /// The newest savepoint holds a log that is short of room. Replace it with a savepoint
    /// of the durable checkpoint, so the old segments can go and the store can still be
    /// rebuilt from what is left; if that fails, let the floor go (loudly) rather than stop
    /// acknowledging input. Either way the savepoint floor never stalls ingest.
    fn savepoint_for_room(
        &mut self,
        store: &Store,
        cfg: &Config,
        metrics: &Metrics,
        now: Instant,
        beat: &mut dyn FnMut(u64),
    ) {
        let held = self.schedule.savepoint_floor();
        match self.take_savepoint(store, cfg, metrics, now, beat) {
            Ok(sp) => {
                crate::event!(warn, "savepoint_for_room";
                    "savepoint: the one at offset {held} held a replay log short of room; took \
                     a new one at offset {} so older segments can go (size log.max_size to \
                     hold a savepoint interval of input to avoid these)",
                    sp.next_offset
                );
                metrics.update(|f| f.savepoints_for_room += 1);
            }
            Err(_) => {
                crate::event!(error, "savepoint_floor_released";
                    "savepoint: the one at offset {held} holds a replay log short of room and \
                     a new one could not be written (see above): deleting processed segments \
                     below it anyway. It can no longer be restored; until a savepoint succeeds \
                     a damaged store cannot be rebuilt"
                );
                self.schedule.release_floor();
                metrics.update(|f| f.savepoint_floor_released += 1);
            }
        }
    }

    /// `[savepoint] interval` changed by SIGHUP: on, the first is due as at start (now, if
    /// the newest is older than the interval); off, none is scheduled.
    pub(crate) fn reschedule_savepoints(&mut self, cfg: &Config, wall_ms: u64, now: Instant) {
        self.schedule
            .reschedule(cfg.savepoint.interval, wall_ms, now);
        match cfg.savepoint.interval {
            Some(every) => crate::event!(info, "reload_savepoints";
                "reload: savepoints every {every:?}, keep {}; the next is due in {:?} (taken \
                 at the first checkpoint after that)",
                cfg.savepoint.keep,
                self.schedule
                    .next_savepoint()
                    .map(|t| t.saturating_duration_since(now))
                    .unwrap_or_default()
            ),
            None => crate::event!(info, "reload_savepoints"; "reload: periodic savepoints off"),
        }
    }
}

/// The lowest offset retention must keep for `progress` (the durable checkpoint's): its
/// live `next_offset`, or a configured pipeline's backfill cursor below it. A dormant
/// pipeline's cursor holds nothing (it would hold the log for ever); if it comes back, it
/// goes on from the oldest record still there, and says which records it missed.
pub(crate) fn retention_floor(progress: &Progress, cfg: &Config) -> Offset {
    progress
        .pipelines
        .iter()
        .filter(|pp| cfg.pipelines.iter().any(|s| s.name == pp.name))
        .filter_map(|pp| pp.backfill.map(|b| b.next))
        .fold(progress.next_offset, Offset::min)
}

/// The savepoint directory's gauges: it is bounded by `[savepoint] keep`.
pub(crate) fn note_savepoint_files(metrics: &Metrics, all: &[SavepointInfo]) {
    let bytes = all.iter().map(|s| s.bytes).sum();
    metrics.update(|f| {
        f.savepoint_files = all.len() as u64;
        f.savepoint_bytes = bytes;
    });
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::model::{Backfill, PipelineProgress};

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
    }

    #[test]
    fn the_savepoint_gauges_count_every_file_and_its_bytes() {
        let m = Metrics::new();
        let sp = |bytes| SavepointInfo {
            path: "sp".into(),
            format_version: 1,
            checkpoint_id: 1,
            next_offset: 0,
            entries: 0,
            created_at_ms: 0,
            bytes,
            seq: 0,
        };
        note_savepoint_files(&m, &[sp(10), sp(32)]);
        let f = m.snapshot();
        assert_eq!((f.savepoint_files, f.savepoint_bytes), (2, 42));
    }
}
