//! The loop's figures copied into [`Metrics`] for `/metrics`, the `STATUS=` line, the
//! watchdog, dead-letter journal lines, the broker's own count of dropped messages, and the
//! watch on sled's files. Metrics are written here and only read by the server thread, so
//! one scrape sees one consistent moment.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::log::Log;
use crate::metrics::Metrics;
use crate::model::DeadLetter;
use crate::mqtt::{BrokerDrops, DropTally};
use crate::notify::Heartbeat;
use crate::processor::Processor;
use crate::store::CheckpointInfo;

use super::error::AgentError;
use super::ingest::Ingest;
use super::keeper::{STORE_BLOAT_FACTOR, Schedule};
use super::memory::Trim;
use super::results::Results;

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

/// The loop's figures and what reports them: `/metrics`, the `STATUS=` line and the
/// watchdog (`heartbeat`), the dead-letter journal lines, and heap trimming.
pub(crate) struct Figures {
    /// Figures for `/metrics` (issue 6); gauges refreshed every `metrics::REFRESH_INTERVAL`.
    pub(crate) metrics: Arc<Metrics>,
    refreshed: Refresh,
    pub(crate) trim: Trim,
    /// `WATCHDOG=1` and `STATUS=` for systemd: beaten every turn of the loop, and during a
    /// long savepoint write.
    pub(crate) heartbeat: Heartbeat,
    dead_letter_log: crate::logging::RateLimit,
    /// The broker's count of dropped messages (issue 26): the last total, and at most one
    /// journal line a minute about a rise.
    broker_drops: DropTally,
    broker_drops_log: crate::logging::RateLimit,
    /// The loop's turns, copied to `metrics` at each refresh (not locked every turn).
    turns: crate::metrics::Histogram,
}

/// What the figures are copied from: the loop's parts, read-only, and the schedule (its
/// store watch).
pub(crate) struct View<'a> {
    pub(crate) log: &'a Log,
    pub(crate) proc: &'a Processor,
    pub(crate) ingest: &'a Ingest,
    pub(crate) results: &'a Results,
    pub(crate) schedule: &'a mut Schedule,
    pub(crate) now: Instant,
    pub(crate) wall_ms: u64,
}

impl Figures {
    pub(crate) fn new(metrics: Arc<Metrics>, now: Instant) -> Figures {
        Figures {
            metrics,
            refreshed: Refresh::default(),
            trim: Trim::new(now),
            heartbeat: Heartbeat::from_env(),
            dead_letter_log: crate::logging::RateLimit::new(10, Duration::from_secs(60)),
            broker_drops: DropTally::default(),
            broker_drops_log: crate::logging::RateLimit::new(1, Duration::from_secs(60)),
            turns: crate::metrics::Histogram::default(),
        }
    }

    /// One turn of the loop took `took` (`cairn_loop_turn_duration_seconds`). A walk of
    /// the outbox after every commit made turns of 14-29 ms that no figure showed; it took a
    /// throwaway build to find them (issue 33, `docs/performance.md`).
    pub(crate) fn turn(&mut self, took: Duration) {
        self.turns.observe(took);
    }

    /// What the broker says of the messages it dropped instead of queueing or delivering
    /// them (`$SYS/broker/publish/messages/dropped`, issue 26): a sender was told they were
    /// delivered, and an input among them never reaches the log. The figure goes to
    /// `/metrics` and `status`; a rise, and a count already above zero when the agent first
    /// sees it (drops while the agent was away are the usual case), to the journal, naming
    /// the fix. The count is the broker's, for every client: it cannot say which were ours.
    pub(crate) fn broker_drops(&mut self, now: Instant, d: BrokerDrops) {
        match d {
            BrokerDrops::Total(total) => {
                self.metrics.update(|f| {
                    f.broker_dropped = Some(total);
                    f.broker_dropped_available = true;
                });
                let rise = match self.broker_drops.increase(total) {
                    Some(more) => more,
                    None => total, // the first figure: everything since the broker started
                };
                if rise > 0 {
                    self.broker_drops_log.warn(
                        now,
                        "broker_dropped",
                        "broker drops",
                        "rises of the count",
                        || {
                            crate::event!(warn, "broker_dropped";
                                "broker: it dropped {rise} more message(s) instead of queueing or \
                                 delivering them ({total} since it started, for all its clients): \
                                 their senders were told they were delivered, and inputs among \
                                 them never reach Cairn. Apply the queue settings of \
                                 config/mosquitto.conf (max_queued_messages, max_queued_bytes) \
                                 to the broker and restart it"
                            )
                        },
                    );
                }
            }
            BrokerDrops::Available { version } => {
                self.metrics.update(|f| f.broker_dropped_available = true);
                crate::event!(info, "broker_drops_watched";
                    "broker: watching its count of dropped messages ($SYS, {})",
                    crate::text::Shown(&version)
                );
            }
            BrokerDrops::Unavailable { reason } => {
                self.metrics.update(|f| f.broker_dropped_available = false);
                crate::event!(warn, "broker_drops_unwatchable";
                    "broker: its count of dropped messages cannot be watched ({}): messages it \
                     drops before they reach Cairn would go unseen. With mosquitto, let the \
                     agent's user read $SYS/broker/publish/messages/dropped (config/mosquitto.acl \
                     does) and keep sys_interval above 0",
                    crate::text::Shown(&reason)
                );
            }
        }
    }

    /// One journal line per dead letter, at most 10 per minute; the rest are counted and
    /// reported as suppressed (they are all in the store: `cairn inspect dead-letters`).
    pub(crate) fn dead_letter(&mut self, now: Instant, d: &DeadLetter) {
        self.dead_letter_log
            .warn(now, "dead_letter", "dead letter", "suppressed", || {
                crate::event!(warn, "dead_letter", pipeline = d.pipeline, reason = d.reason,
                    offset = d.offset;
                    "dead letter: offset {} topic `{}` reason {}, pipeline `{}` (see `cairn \
                     inspect dead-letters`)",
                    d.offset,
                    crate::text::Shown(&d.topic),
                    d.reason,
                    crate::text::Shown(&d.pipeline)
                )
            });
    }

    /// [`Figures::dead_letter`] for each dead letter of the log records from `from` on that
    /// `proc` made since its last checkpoint (they are the last of its batch).
    pub(crate) fn dead_letters_from(&mut self, now: Instant, proc: &Processor, from: u64) {
        let all = proc.engine().pending_dead_letters();
        let first = all
            .iter()
            .rposition(|d| d.offset < from)
            .map_or(0, |i| i + 1);
        for d in &all[first..] {
            self.dead_letter(now, d);
        }
    }

    /// Copy the loop's figures (every tick, so one scrape sees one consistent moment); the
    /// ones that walk a tree or a directory at most every REFRESH_INTERVAL.
    pub(crate) fn refresh(&mut self, force: bool, v: View<'_>) -> Result<(), AgentError> {
        if self.refreshed.take(v.now, force) {
            let store = v.proc.store();
            let first_seq = store.outbox_from(0).next().transpose()?.map(|(s, _)| s);
            self.metrics
                .set_outbox(store.outbox_len() as u64, first_seq, v.wall_ms);
            // Not sled's `size_on_disk()`: it is slow enough to stall the loop (measured:
            // the e2e tests fell behind); the files' sizes are what an operator wants anyway.
            let store_bytes = crate::metrics::dir_size_bytes(store.dir());
            let segments = v.log.segments().len() as u64;
            let resident = crate::metrics::resident_memory_bytes();
            self.metrics.update(|f| {
                f.store_bytes = store_bytes;
                f.log_segments = segments;
                f.resident_memory_bytes = resident;
            });
            self.watch_store(v.proc, v.schedule, store_bytes, v.now)?;
        }
        let progress = v.proc.engine().progress();
        let (log, i, r) = (v.log, &v.ingest.counts, &v.results.counts);
        let sp = v.schedule.newest_savepoint();
        let connected = v.results.input_connected();
        let backpressure = v.ingest.queue.backpressure();
        let behind = records_behind(log, v.proc);
        let turns = &self.turns;
        self.metrics.update(|f| {
            f.loop_turn.clone_from(turns);
            f.received = i.received;
            f.acked = i.acked;
            f.oversize_refused = i.oversize;
            f.held_let_go = i.held_let_go;
            f.published = r.published;
            f.pubacked = r.pubacked;
            f.published_early = r.published_early;
            f.reconnects = i.reconnects;
            f.connected = connected;
            f.backpressure = backpressure;
            f.records_behind = behind;
            f.log_size_bytes = log.size_bytes();
            f.log_max_bytes = log.options().max_size;
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
    /// schedule decides when an estimate is worth its walk of the trees.
    fn watch_store(
        &self,
        proc: &Processor,
        schedule: &mut Schedule,
        store_bytes: u64,
        now: Instant,
    ) -> Result<(), AgentError> {
        if !schedule.store_estimate_due(store_bytes, now) {
            return Ok(());
        }
        let live = proc.store().live_bytes()?;
        self.metrics.update(|f| f.store_live_bytes = live);
        if schedule.store_estimated(store_bytes, live, now) {
            crate::event!(warn, "store_bloated";
                "store: sled's files take {store_bytes} bytes, more than {STORE_BLOAT_FACTOR}× \
                 the {live} bytes of live data (sled reclaims space lazily). If disk space is \
                 tight: stop the agent, run `cairn savepoint create` and then `cairn savepoint \
                 restore --latest`, which rebuilds a compact store (the old one is kept as \
                 store.old-N: delete it once the agent runs)"
            );
        }
        Ok(())
    }

    /// A checkpoint committed (`took` to commit): its figures, in one update, so a scrape
    /// sees the count, duration and offsets of one checkpoint, and the pipeline figures with
    /// it (the ledger sizes change only at a commit).
    pub(crate) fn checkpointed(
        &self,
        took: Duration,
        info: &CheckpointInfo,
        outbox_end: Option<u64>,
        proc: &Processor,
        log: &Log,
    ) {
        if let Some(end) = outbox_end {
            self.metrics
                .note_outbox_committed(end, info.committed_at_ms);
        }
        let pipelines = pipeline_figures(proc.engine().progress(), log.first_offset());
        let bounds = proc.store().bound_figures();
        self.metrics.update(|f| {
            set_bound_figures(f, &bounds);
            f.pipelines = pipelines;
            f.checkpoints += 1;
            f.checkpoint.observe(took);
            f.checkpoint_id = info.id;
            f.checkpoint_next_offset = info.next_offset;
            f.checkpoint_at_ms = info.committed_at_ms;
            f.log_next_offset = log.next_offset();
        });
    }
}

/// Records logged and not processed yet.
pub(crate) fn records_behind(log: &Log, proc: &Processor) -> u64 {
    log.durable_next().saturating_sub(proc.next_offset())
}

/// The `STATUS=` line `systemctl status` shows.
pub(crate) fn status_line(
    log: &Log,
    proc: &Processor,
    ingest: &Ingest,
    results: &Results,
) -> String {
    format!(
        "running: received {}, acked {}, processed up to offset {}, checkpoint {}, outbox {}{}{}{}",
        ingest.counts.received,
        ingest.counts.acked,
        proc.next_offset(),
        proc.engine().progress().checkpoint_id,
        proc.store().outbox_len(),
        match records_behind(log, proc) {
            0 => String::new(),
            n => format!(", {n} records behind (outbox full)"),
        },
        super::work::backfill_status(proc, log),
        match (results.connected(), results.has_uplink()) {
            (true, _) => "",
            (false, true) => ", uplink disconnected",
            (false, false) => ", broker disconnected",
        }
    )
}

/// Each pipeline's figures for `/metrics`, from the engine's progress (`first_offset`: the
/// log's, where a backfill's cursor may lie below it).
pub(crate) fn pipeline_figures(
    progress: &crate::model::Progress,
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
                backfill_left: super::work::records_left(progress, p, first_offset),
            };
            (p.name.clone(), figures)
        })
        .collect()
}

/// The store's own bounds for `/metrics`.
pub(crate) fn set_bound_figures(f: &mut crate::metrics::Figures, b: &crate::store::BoundFigures) {
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
}
