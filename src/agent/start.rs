//! Start: recover (truncate the log's torn tail, load the checkpoint, replay), then serve
//! metrics and connect. Each step in the order the journal reports it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::clock::{Clock, Note, ReceiptClock};
use crate::config::Config;
use crate::fsio::Durability;
use crate::log::{Log, LogOptions};
use crate::metrics::Metrics;
use crate::mqtt::{Events, Mqtt};
use crate::processor::{ProcessError, Processor, ReplayStats};
use crate::quarantine::Quarantine;
use crate::store::Store;

use super::behind::Behind;
use super::boundary;
use super::checkpointer::Checkpointer;
use super::figures::{Refresh, note_savepoint_files};
use super::ingest::Ingest;
use super::memory::{TRIM_INTERVAL, Trim, return_free_memory};

/// What a held message takes besides its topic and payload: the message, its ack token
/// and its queue slot, rounded up.
const HELD_OVERHEAD: usize = 96;
use super::publisher::Publisher;
use super::uplink::Uplink;
use super::{Agent, AgentError, Stats};

impl Agent {
    /// Recover (truncate the torn tail, load the checkpoint, replay), then connect.
    pub fn start(cfg: Config, sync: Durability) -> Result<Agent, AgentError> {
        Agent::start_with_reset(cfg, sync, &[])
    }

    /// As [`Agent::start`], first resetting the named pipelines' state (see
    /// [`Processor::open_with_reset`]).
    pub(crate) fn start_with_reset(
        cfg: Config,
        sync: Durability,
        reset: &[String],
    ) -> Result<Agent, AgentError> {
        Agent::start_with_clock(cfg, sync, reset, crate::clock::from_env())
    }

    /// As [`Agent::start_with_reset`], stamping times of receipt from `clock`.
    pub(crate) fn start_with_clock(
        cfg: Config,
        sync: Durability,
        reset: &[String],
        clock: Box<dyn Clock>,
    ) -> Result<Agent, AgentError> {
        let dir = cfg.storage.data_dir.clone();
        Agent::recover(cfg, sync, reset, clock).map_err(|e| e.explain_disk_full(&dir))
    }

    fn recover(
        cfg: Config,
        sync: Durability,
        reset: &[String],
        clock: Box<dyn Clock>,
    ) -> Result<Agent, AgentError> {
        let started = clock.monotonic();
        // Before the log and the store make it with the default mode (issue 10: 0700).
        crate::fsio::create_data_dir(&cfg.storage.data_dir, &sync).map_err(|source| {
            crate::log::LogError::Io {
                op: "create the data directory",
                path: cfg.storage.data_dir.clone(),
                source,
            }
        })?;
        let log = open_log(&cfg, &sync)?;
        let mut proc = open_processor(&cfg, &sync, reset, &log, started, clock.as_ref())?;
        if log.next_offset() < proc.next_offset() {
            return Err(AgentError::Process(ProcessError::LogBehind {
                checkpoint: proc.next_offset(),
                log_next: log.next_offset(),
            }));
        }
        let stats = replay(&cfg, &log, &mut proc, started, clock.as_ref())?;
        let receipt = start_receipt(&cfg, &log, &proc, clock.as_ref());
        let replay_time = clock.monotonic().saturating_duration_since(started);
        let metrics = start_metrics(&cfg, &proc, &stats, replay_time)?;
        super::uplink::note_waiting_outbox(&metrics, proc.store())?;
        let savepoints = crate::store::list_savepoints(&cfg.savepoint_dir())?;
        note_savepoint_files(&metrics, &savepoints);
        let checkpointer = Checkpointer::new(
            savepoints.last().cloned(),
            cfg.savepoint.interval,
            clock.wall_ms(),
            clock.monotonic(),
        );
        // From here on the checkpoint's fsync runs beside the loop (`fsync`).
        proc.defer_sync();
        let opened = proc.store().progress()?;
        let fsync = super::fsync::Fsync::start(
            proc.store().syncer(),
            opened.next_offset,
            super::backfill::retention_floor(&opened, &cfg),
        )
        .map_err(|source| crate::store::StoreError::Io {
            path: cfg.store_dir(),
            source,
        })?;
        let (mqtt, uplink, events) = subscribe(&cfg)?;
        let first_seq = proc
            .store()
            .outbox_from(0)
            .next()
            .transpose()?
            .map(|(s, _)| s)
            .unwrap_or(0);
        // Two segments: room to roll one and finish the batch in flight, and for the store
        // to checkpoint what was already ingested (see `disk`).
        let space = crate::disk::SpaceGuard::new(
            vec![cfg.log_dir(), cfg.store_dir()],
            2 * cfg.log.segment_size,
        );
        Ok(Agent {
            cfg,
            log,
            proc,
            mqtt,
            events,
            ingest: Ingest::new(receipt, super::HELD_LIMIT, |m| {
                m.topic.len() + m.payload.len() + HELD_OVERHEAD
            }),
            redeliver: false,
            backpressure_off_at: None,
            publisher: Publisher::new(first_seq),
            checkpointer,
            fsync,
            space,
            stats: Stats::default(),
            dead_letter_log: crate::logging::RateLimit::new(10, Duration::from_secs(60)),
            metrics,
            metrics_refreshed: Refresh::default(),
            trim: Trim::new(clock.monotonic()),
            sync,
            clock,
            eviction_log: crate::logging::RateLimit::new(3, Duration::from_secs(60)),
            uplink,
            backfill: super::backfill::Backfilling::new(),
            behind: Behind::new(),
        })
    }
}

/// Open the replay log, dropping a torn tail (never acknowledged: invariant 1).
fn open_log(cfg: &Config, sync: &Durability) -> Result<Log, AgentError> {
    let (log, rec) = Log::open(
        LogOptions {
            dir: cfg.log_dir(),
            segment_size: cfg.log.segment_size,
            max_size: cfg.log.max_size,
            max_payload: cfg.log.max_payload,
        },
        sync.clone(),
    )?;
    if rec.torn_bytes_dropped > 0 {
        log::warn!(
            "recovery: dropped torn log tail: {} bytes, {} records (never acknowledged)",
            rec.torn_bytes_dropped,
            rec.torn_records_dropped
        );
    }
    Ok(log)
}

/// Open the store, settle the log tail under the pipelines of the last run if they changed
/// (see `boundary`), record the pipelines this run uses, and open the processor.
fn open_processor(
    cfg: &Config,
    sync: &Durability,
    reset: &[String],
    log: &Log,
    started: Instant,
    clock: &dyn Clock,
) -> Result<Processor, AgentError> {
    let mut store = Store::open_with(
        &cfg.store_dir(),
        cfg.storage.cache_size,
        sync.clone(),
        cfg.store_bounds(),
    )?;
    if let Some(old) = boundary::last_run(cfg) {
        if boundary::must_settle(&store, &old, &cfg.pipelines)? {
            log::info!(
                "pipelines changed since the last run ({}): replaying the log tail under the \
                 old definitions and checkpointing first, so that no result that may have gone \
                 out is computed again differently",
                boundary::changed_names(&old, &cfg.pipelines)
            );
            let old_cfg = Config {
                pipelines: old,
                ..cfg.clone()
            };
            let mut proc = with_quarantine(
                &old_cfg,
                sync,
                Processor::open(store, old_cfg.pipelines.clone())?,
            )?;
            if log.next_offset() > proc.next_offset() {
                replay(&old_cfg, log, &mut proc, started, clock)?;
            }
            store = proc.into_store();
        }
    }
    let generations = cfg.storage.data_dir.join(crate::generations::FILE_NAME);
    let proc = Processor::open_with(store, cfg.pipelines.clone(), reset, Some(&generations))?;
    boundary::record(cfg, sync).map_err(|source| crate::log::LogError::Io {
        op: "record the running pipelines",
        path: cfg.storage.data_dir.join(boundary::FILE_NAME),
        source,
    })?;
    with_quarantine(cfg, sync, proc)
}

/// Attach the quarantine file to `proc`.
fn with_quarantine(
    cfg: &Config,
    sync: &Durability,
    mut proc: Processor,
) -> Result<Processor, AgentError> {
    let data_dir = &cfg.storage.data_dir;
    let quarantine =
        Quarantine::open(data_dir, sync.clone()).map_err(|source| ProcessError::Quarantine {
            file: data_dir.join(crate::quarantine::FILE_NAME),
            source,
        })?;
    proc.set_quarantine(quarantine)?;
    if let Some(q) = proc.quarantine().filter(|q| !q.is_empty()) {
        log::warn!(
            "recovery: {} names log records whose processing panicked before; each is \
             retried up to {} times, then set aside as a dead letter with reason `internal`",
            q.path().display(),
            crate::quarantine::MAX_ATTEMPTS
        );
    }
    Ok(proc)
}

/// Re-apply the log from the checkpoint's `next_offset`.
fn replay(
    cfg: &Config,
    log: &Log,
    proc: &mut Processor,
    started: Instant,
    clock: &dyn Clock,
) -> Result<ReplayStats, AgentError> {
    let mut trimmed = clock.monotonic();
    let wall_ms = || clock.wall_ms();
    let stats = proc.replay(log, cfg.checkpoint.max_records, &wall_ms, &mut |s| {
        let now = clock.monotonic();
        if now.saturating_duration_since(trimmed) >= TRIM_INTERVAL {
            trimmed = now;
            return_free_memory();
        }
        log::info!(
            "recovery: replayed {} records up to offset {}",
            s.records,
            s.to
        );
        // A long replay is progress, not a hang: keep systemd's timeouts at bay.
        crate::notify::still_starting(&format!(
            "recovery: replayed {} records up to offset {}",
            s.records, s.to
        ));
    })?;
    log::info!(
        "recovery: done in {} ms: log offsets [{}, {}), replayed {} records from offset {}, checkpoint {}",
        clock
            .monotonic()
            .saturating_duration_since(started)
            .as_millis(),
        log.first_offset(),
        log.next_offset(),
        stats.records,
        stats.from,
        proc.engine().progress().checkpoint_id
    );
    Ok(stats)
}

/// The newest time of receipt recorded: the log's (its records) or the checkpoint's
/// (records retention already deleted). Stamps never go below it.
fn start_receipt(cfg: &Config, log: &Log, proc: &Processor, clock: &dyn Clock) -> ReceiptClock {
    let recorded = log
        .segments()
        .iter()
        .map(|s| s.max_received_at_ms)
        .chain([proc.engine().progress().log_clock_ms])
        .max()
        .unwrap_or(0);
    let (receipt, note) = ReceiptClock::start(recorded, clock.wall_ms(), clock.monotonic());
    if let Some(note) = note {
        log_clock_note(cfg, &note);
    }
    receipt
}

/// The recovery figures, and the `/metrics` server if one is configured.
fn start_metrics(
    cfg: &Config,
    proc: &Processor,
    stats: &ReplayStats,
    replay_time: Duration,
) -> Result<Arc<Metrics>, AgentError> {
    let metrics = Metrics::new();
    let durable = proc.store().progress()?;
    let last_at = proc.store().checkpoints().next_back().transpose()?;
    let bounds = proc.store().bound_figures();
    metrics.update(|f| {
        super::figures::set_bound_figures(f, &bounds);
        f.replay_records = stats.records;
        f.replay_seconds = replay_time.as_secs_f64();
        f.checkpoint_id = durable.checkpoint_id;
        f.checkpoint_next_offset = durable.next_offset;
        f.checkpoint_at_ms = last_at.map_or(0, |c| c.committed_at_ms);
    });
    if let Some(addr) = &cfg.metrics.listen {
        let err = |source| AgentError::Metrics {
            addr: addr.clone(),
            source,
        };
        let at = addr
            .parse()
            .map_err(|e| err(std::io::Error::new(std::io::ErrorKind::InvalidInput, e)))?;
        // Never fails on a held port: the server retries the bind and logs it (issue 27).
        crate::metrics::serve(at, metrics.clone()).map_err(err)?;
    }
    Ok(metrics)
}

/// Connect, subscribed to every pipeline's topic filters (each once); and to the uplink
/// broker, publish-only, if there is one.
fn subscribe(cfg: &Config) -> Result<(Mqtt, Option<Uplink>, Events), AgentError> {
    let mut filters: Vec<String> = cfg
        .pipelines
        .iter()
        .flat_map(|p| p.topics.clone())
        .collect();
    filters.sort();
    filters.dedup();
    let inflight = cfg.outbox.inflight;
    Ok(match &cfg.uplink {
        None => {
            let (mqtt, events) = Mqtt::start(&cfg.mqtt, filters, inflight)?;
            (mqtt, None, events)
        }
        Some(u) => {
            let (mqtt, up, events) =
                Mqtt::start_with_uplink(&cfg.mqtt, filters, &u.mqtt, inflight)?;
            (mqtt, Some(Uplink::new(u, up)), events)
        }
    })
}

/// Put a clock note in the journal, with what it means for this configuration.
pub(super) fn log_clock_note(cfg: &Config, note: &Note) {
    use crate::clock::{human_ms, utc_ms};
    match *note {
        Note::BehindRecorded {
            wall_ms,
            recorded_ms,
        } => log::warn!(
            "clock: the wall clock ({}) is behind the newest time of receipt already recorded \
             ({}): it was set back, or the box booted with a stale clock. New records are \
             stamped from {} on at the monotonic clock's rate until the wall clock catches up, \
             so times of receipt never go backwards",
            utc_ms(wall_ms),
            utc_ms(recorded_ms),
            utc_ms(recorded_ms)
        ),
        Note::SteppedBack { by_ms } => log::warn!(
            "clock: the wall clock stepped back by {}; times of receipt go on from the last one \
             at the monotonic clock's rate until it catches up, so windows by time of receipt \
             and the dedup window keep their real pace",
            human_ms(by_ms)
        ),
        Note::CaughtUp => {
            log::info!(
                "clock: the wall clock caught up with the times of receipt; following it again"
            )
        }
        Note::SteppedForward {
            by_ms,
            expected_ms,
            to_ms,
        } => log_clock_forward(cfg, by_ms, expected_ms, to_ms),
    }
}

/// A forward step ages everything recorded at once: say what that does to dedup and
/// retention under this configuration.
fn log_clock_forward(cfg: &Config, by_ms: u64, expected_ms: u64, to_ms: u64) {
    use crate::clock::{human_ms, utc_ms};
    let dedup = cfg
        .pipelines
        .iter()
        .min_by_key(|p| p.dedup_window_ms)
        .map(|p| {
            format!(
                "dedup entries first seen before {} (pipeline `{}`, dedup_window {}; \
                 each pipeline by its own window) stop catching duplicates",
                utc_ms(to_ms.saturating_sub(p.dedup_window_ms)),
                p.name,
                human_ms(p.dedup_window_ms)
            )
        })
        .unwrap_or_else(|| "dedup entries age by as much".into());
    let retention = u64::try_from(cfg.log.retention.as_millis()).unwrap_or(u64::MAX);
    log::warn!(
        "clock: the wall clock stepped forwards by {} beyond what the monotonic clock \
         counted since the last record; times of receipt follow it (now {} instead of \
         {}). The dedup window and log retention are measured in time of receipt, so \
         everything recorded so far ages by {} at once: {}, and log segments received \
         before {} (log.retention {}) are deleted once checkpointed. If the clock was \
         wrong before, this is the correction; if it is wrong now, fix it: times of \
         receipt never go back, so records keep the later time until it catches up",
        human_ms(by_ms),
        utc_ms(to_ms),
        utc_ms(expected_ms),
        human_ms(by_ms),
        dedup,
        utc_ms(to_ms.saturating_sub(retention)),
        human_ms(retention)
    );
}
