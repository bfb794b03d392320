//! The loop's figures copied into [`Metrics`] for `/metrics`, the `STATUS=` line, and the
//! watch on sled's files. Metrics are written here and only read by the server thread, so
//! one scrape sees one consistent moment.

use std::time::Instant;

use crate::metrics::Metrics;
use crate::store::SavepointInfo;

use super::checkpointer::STORE_BLOAT_FACTOR;
use super::{Agent, AgentError};

/// When the figures that walk a tree or a directory were last refreshed.
#[derive(Debug, Default)]
pub(crate) struct Refresh {
    last: Option<Instant>,
}

impl Refresh {
    /// Due every [`crate::metrics::REFRESH_INTERVAL`], and when `force`d (shutdown); taking
    /// it starts the next interval.
    pub(crate) fn take(&mut self, now: Instant, force: bool) -> bool {
        let due = force
            || self
                .last
                .is_none_or(|t| now >= t + crate::metrics::REFRESH_INTERVAL);
        if due {
            self.last = Some(now);
        }
        due
    }
}

impl Agent {
    /// The figures `/metrics` serves.
    pub fn metrics(&self) -> &std::sync::Arc<Metrics> {
        &self.metrics
    }

    /// Copy the loop's figures (every tick, so one scrape sees one consistent moment); the
    /// ones that walk a tree or a directory at most every REFRESH_INTERVAL.
    pub(super) fn refresh_metrics(&mut self, force: bool) -> Result<(), AgentError> {
        let now = self.now();
        if self.metrics_refreshed.take(now, force) {
            let store = self.proc.store();
            let first_seq = store.outbox_from(0).next().transpose()?.map(|(s, _)| s);
            self.metrics
                .set_outbox(store.outbox_len() as u64, first_seq, self.clock.wall_ms());
            // Not sled's `size_on_disk()`: it is slow enough to stall the loop (measured:
            // the e2e tests fell behind); the files' sizes are what an operator wants anyway.
            let store_bytes = crate::metrics::dir_size_bytes(store.dir());
            let segments = self.log.segments().len() as u64;
            self.metrics.update(|f| {
                f.store_bytes = store_bytes;
                f.log_segments = segments;
            });
            self.watch_store(store_bytes, now)?;
        }
        let progress = self.proc.engine().progress();
        let (log, stats) = (&self.log, &self.stats);
        let sp = self.checkpointer.newest_savepoint();
        let (connected, backpressure) = (self.input_connected(), self.ingest.backpressure());
        let behind = self.records_behind();
        self.metrics.update(|f| {
            f.received = stats.received;
            f.acked = stats.acked;
            f.oversize_refused = stats.oversize;
            f.held_let_go = stats.held_let_go;
            f.published = stats.published;
            f.pubacked = stats.pubacked;
            f.published_early = stats.published_early;
            f.reconnects = stats.reconnects;
            f.connected = connected;
            f.backpressure = backpressure;
            f.records_behind = behind;
            f.log_size_bytes = log.size_bytes();
            f.log_first_offset = log.first_offset();
            f.log_next_offset = log.next_offset();
            f.records_unmatched = progress.unmatched;
            f.pipelines = pipeline_figures(progress, log.first_offset());
            f.savepoint = sp.map(|s| (s.checkpoint_id, s.next_offset, s.created_at_ms));
            let needed = sp.map_or(f.checkpoint_next_offset, |s| s.next_offset);
            f.source_replayable = log.first_offset() <= needed;
        });
        Ok(())
    }

    /// When sled's files grow far past the live data (sled reclaims space lazily, and a
    /// store can keep growing after the state stopped), say so and what to do. The
    /// checkpointer decides when an estimate is worth its walk of the trees.
    fn watch_store(&mut self, store_bytes: u64, now: Instant) -> Result<(), AgentError> {
        if !self.checkpointer.store_estimate_due(store_bytes, now) {
            return Ok(());
        }
        let live = self.proc.store().live_bytes()?;
        self.metrics.update(|f| f.store_live_bytes = live);
        if self.checkpointer.store_estimated(store_bytes, live, now) {
            log::warn!(
                "store: sled's files take {store_bytes} bytes, more than {STORE_BLOAT_FACTOR}× \
                 the {live} bytes of live data (sled reclaims space lazily). If disk space is \
                 tight: stop the agent, run `cairn savepoint create` and then `cairn savepoint \
                 restore --latest`, which rebuilds a compact store (the old one is kept as \
                 store.old-N: delete it once the agent runs)"
            );
        }
        Ok(())
    }

    /// The `STATUS=` line `systemctl status` shows.
    pub(super) fn status_line(&self) -> String {
        format!(
            "running: received {}, acked {}, processed up to offset {}, checkpoint {}, outbox {}{}{}{}",
            self.stats.received,
            self.stats.acked,
            self.proc.next_offset(),
            self.proc.engine().progress().checkpoint_id,
            self.proc.store().outbox_len(),
            match self.records_behind() {
                0 => String::new(),
                n => format!(", {n} records behind (outbox full)"),
            },
            self.backfill_status(),
            match (self.publisher.is_connected(), self.uplink.is_some()) {
                (true, _) => "",
                (false, true) => ", uplink disconnected",
                (false, false) => ", broker disconnected",
            }
        )
    }
}

/// Each pipeline's figures for `/metrics`, from the engine's progress (`first_offset`: the
/// log's, where a backfill's cursor may lie below it).
pub(super) fn pipeline_figures(
    progress: &crate::pipeline::engine::Progress,
    first_offset: crate::model::Offset,
) -> std::collections::BTreeMap<String, crate::metrics::PipelineFigures> {
    progress
        .pipelines
        .iter()
        .map(|p| {
            let c = &p.counters;
            let figures = crate::metrics::PipelineFigures {
                keys: p.keys,
                dedup_entries: p.dedup_entries,
                applied: c.applied,
                duplicates: c.duplicates,
                dead_letters: c.dead_letters,
                outputs: c.outputs,
                filtered: c.filtered,
                backfill_left: super::backfill::records_left(progress, p, first_offset),
            };
            (p.name.clone(), figures)
        })
        .collect()
}

/// The savepoint directory's gauges: it is bounded by `[savepoint] keep`.
pub(super) fn note_savepoint_files(metrics: &Metrics, all: &[SavepointInfo]) {
    let bytes = all.iter().map(|s| s.bytes).sum();
    metrics.update(|f| {
        f.savepoint_files = all.len() as u64;
        f.savepoint_bytes = bytes;
    });
}

/// The store's own bounds for `/metrics`.
pub(super) fn set_bound_figures(f: &mut crate::metrics::Figures, b: &crate::store::BoundFigures) {
    f.dead_letters_stored = b.dead_letters.stored;
    f.dead_letters_pruned_age = b.dead_letters.pruned_age;
    f.dead_letters_pruned_count = b.dead_letters.pruned_count;
    f.ledger_index_bytes = b.ledger_index_bytes;
    f.ledger_unindexed_chunks = b.ledger_unindexed_chunks;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn slow_figures_refresh_at_most_every_interval_unless_forced() {
        let t0 = Instant::now();
        let every = crate::metrics::REFRESH_INTERVAL;
        let mut r = Refresh::default();
        assert!(r.take(t0, false), "the first tick refreshes");
        assert!(!r.take(t0 + every / 2, false));
        assert!(r.take(t0 + every / 2, true), "forced at shutdown");
        assert!(
            !r.take(t0 + every, false),
            "the forced one restarted the interval"
        );
        assert!(r.take(t0 + every + every / 2 + Duration::from_millis(1), false));
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
