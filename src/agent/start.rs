//! Start: recover, then serve metrics and connect. Each step in the order the journal
//! reports it:
//!
//! 1. open the log, dropping a torn tail (never acknowledged: invariant 1);
//! 2. open the store and carry out the start plan (`processor::plan`: what the last run
//!    left against the config, decided once), settling the log tail under the last run's
//!    pipelines first if the plan says so;
//! 3. replay the log from the checkpoint, up to the outbox bound and while the disk has
//!    room (invariant 7, replay included): what is left is the `work` part's catch-up once
//!    results leave. Past the bound up to the send horizon, though, where results of the
//!    run before may have left (`Processor::results_wait_for_checkpoint`); then record the
//!    horizon for this run;
//! 4. the parts of the loop, the metrics server, the connections.
//!
//! Free functions: the loop (`agent/mod.rs`) assembles itself from [`Started`].

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::clock::{Clock, ReceiptClock};
use crate::config::Config;
use crate::disk::SpaceGuard;
use crate::fsio::Durability;
use crate::log::{Log, LogOptions};
use crate::metrics::Metrics;
use crate::mqtt::{Events, Mqtt};
use crate::processor::{Hold, ProcessError, Processor, ReplayStats, StartFrom};
use crate::store::Store;

use super::error::AgentError;
use super::figures::Figures;
use super::host::Host;
use super::ingest::{Ingest, log_clock_note};
use super::keeper::{Keeper, Schedule, note_savepoint_files};
use super::memory::{TRIM_INTERVAL, return_free_memory};
use super::results::Results;
use super::results::dbsink::ThreadConn;
use super::results::mqtt::{Conn, MqttSink, note_waiting_outbox};
use super::work::Work;

/// What recovery hands the loop.
pub(crate) struct Started {
    pub(crate) log: Log,
    pub(crate) proc: Processor,
    pub(crate) mqtt: Mqtt,
    pub(crate) events: Events,
    pub(crate) ingest: Ingest,
    pub(crate) results: Results,
    pub(crate) work: Work,
    pub(crate) keeper: Keeper,
    pub(crate) figures: Figures,
    pub(crate) host: Host,
}

/// Recover and connect (see the module docs).
pub(crate) fn recover(
    cfg: &Config,
    sync: &Durability,
    reset: &[String],
    clock: &dyn Clock,
) -> Result<Started, AgentError> {
    let started = clock.monotonic();
    // Before the log and the store make it with the default mode (issue 10: 0700).
    crate::fsio::create_data_dir(&cfg.storage.data_dir, sync).map_err(|source| {
        crate::log::LogError::Io {
            op: "create the data directory",
            path: cfg.storage.data_dir.clone(),
            source,
        }
    })?;
    let log = open_log(cfg, sync)?;
    let store = Store::open_with(
        &cfg.store_dir(),
        cfg.storage.cache_size,
        sync.clone(),
        cfg.store_bounds(),
    )?;
    // A store of an older layout is rewritten before anything reads its states: later, a
    // checkpoint committing beside the loop would move states it reads (`store/rows.rs`).
    store.upgrade_layout()?;
    // Two segments: room to roll one and finish the batch in flight, and for the store
    // to checkpoint what was already ingested (see `disk`).
    let mut space = SpaceGuard::new(
        vec![cfg.log_dir(), cfg.store_dir()],
        2 * cfg.log.segment_size,
    );
    let from = StartFrom {
        data_dir: &cfg.storage.data_dir,
        sync,
        reset,
    };
    let mut proc =
        Processor::start::<AgentError>(store, cfg.pipelines.clone(), from, &mut |old| {
            if log.next_offset() <= old.next_offset() {
                return Ok(None);
            }
            Ok(replay(cfg, &log, old, &mut space, started, clock)?.held)
        })?;
    if log.next_offset() < proc.next_offset() {
        return Err(AgentError::Process(ProcessError::LogBehind {
            checkpoint: proc.next_offset(),
            log_next: log.next_offset(),
        }));
    }
    let stats = replay(cfg, &log, &mut proc, &mut space, started, clock)?;
    // Before anything is sent: what the replay still owes, and how far results may leave
    // before their checkpoint.
    proc.owe_send_horizon(log.durable_next());
    proc.set_send_slack(cfg.checkpoint.max_records);
    proc.record_send_horizon()?;
    let receipt = start_receipt(cfg, &log, &proc, clock);
    let replay_time = clock.monotonic().saturating_duration_since(started);
    let metrics = start_metrics(cfg, &proc, &stats, replay_time)?;
    note_waiting_outbox(&metrics, proc.store())?;
    let savepoints = crate::store::list_savepoints(&cfg.savepoint_dir())?;
    note_savepoint_files(&metrics, &savepoints);
    let schedule = Schedule::new(
        savepoints.last().cloned(),
        cfg.savepoint.interval,
        clock.wall_ms(),
        clock.monotonic(),
    );
    // From here on checkpoints commit beside the loop (`keeper`).
    let opened = proc.store().progress()?;
    let committer =
        Keeper::start_committer(proc.shared_store(), &opened, cfg).map_err(|source| {
            crate::store::StoreError::Io {
                path: cfg.store_dir(),
                source,
            }
        })?;
    let first_seq = proc
        .store()
        .outbox_from(0)
        .next()
        .transpose()?
        .map(|(s, _)| s)
        .unwrap_or(0);
    let host = Host::new(&cfg.sparkplug, clock.wall_ms());
    let positions = proc.store().sink_positions()?;
    let (mqtt, sinks, events) = subscribe(cfg, first_seq, &positions, &host)?;
    let mut results = Results::new(cfg, sinks);
    let forgot = results.start(&proc)?;
    if forgot > 0 {
        crate::event!(info, "outbox_settled_at_start";
            "recovery: {forgot} outbox entries were settled by every sink before the stop: deleted"
        );
    }
    let now = clock.monotonic();
    Ok(Started {
        log,
        proc,
        mqtt,
        events,
        ingest: Ingest::new(receipt, space),
        results,
        work: Work::new(stats.held.is_some(), now),
        keeper: Keeper::new(schedule, committer, sync.clone()),
        figures: Figures::new(metrics, now),
        host,
    })
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
        crate::event!(warn, "recovery_torn_tail";
            "recovery: dropped torn log tail: {} bytes, {} records (never acknowledged)",
            rec.torn_bytes_dropped,
            rec.torn_records_dropped
        );
    }
    Ok(log)
}

/// Re-apply the log from the checkpoint's `next_offset`, up to where processing must wait:
/// the outbox at its bound (nothing is connected yet to take results away) or a disk below
/// the free-space guard's reserve (then what was applied is not checkpointed either).
fn replay(
    cfg: &Config,
    log: &Log,
    proc: &mut Processor,
    space: &mut SpaceGuard,
    started: Instant,
    clock: &dyn Clock,
) -> Result<ReplayStats, AgentError> {
    let mut trimmed = clock.monotonic();
    let wall_ms = || clock.wall_ms();
    let mut disk_error = None;
    let mut past_bound = false;
    let mut hold = |p: &Processor| {
        if let Some(why) = Results::full(&cfg.outbox, p) {
            if !p.replay_owes_send_horizon() {
                return Some(Hold {
                    why: why.to_string(),
                    commit: true,
                });
            }
            if !std::mem::replace(&mut past_bound, true) {
                crate::event!(warn, "recovery_past_outbox_bound";
                    "recovery: the outbox is at its bound ({why}) at offset {}, but results of \
                     the run before may have left from records up to offset {}: replaying on \
                     to there first, so that none goes out below a version already sent",
                    p.next_offset(),
                    p.durable_send_horizon()
                );
            }
        }
        // 0 bytes: the reserve is what keeps room for the checkpoints; here only whether
        // the disk is below it.
        match space.check(clock.monotonic(), 0) {
            Ok(None) => None,
            Ok(Some(free)) => Some(Hold {
                why: format!("the disk is nearly full: {free} bytes free"),
                commit: false,
            }),
            Err(e) => {
                disk_error = Some(e);
                Some(Hold {
                    why: "the free space cannot be measured".into(),
                    commit: false,
                })
            }
        }
    };
    proc.set_batch_bound(cfg.checkpoint.max_keys, cfg.checkpoint.max_records);
    let stats = proc.replay_held(
        log,
        cfg.checkpoint.max_records,
        &wall_ms,
        &mut |s| {
            let now = clock.monotonic();
            if now.saturating_duration_since(trimmed) >= TRIM_INTERVAL {
                trimmed = now;
                return_free_memory();
            }
            crate::event!(info, "recovery_progress";
                "recovery: replayed {} records up to offset {}",
                s.records,
                s.to
            );
            // A long replay is progress, not a hang: keep systemd's timeouts at bay.
            crate::notify::still_starting(&format!(
                "recovery: replayed {} records up to offset {}",
                s.records, s.to
            ));
        },
        &mut hold,
    )?;
    if let Some(e) = disk_error {
        return Err(e.into());
    }
    crate::event!(info, "recovery_done";
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
    if let Some(why) = &stats.held {
        crate::event!(warn, "recovery_processing_waits";
            "recovery: processing waits ({why}) at offset {}: the {} records after it stay in \
             the log and are processed from there once results leave",
            proc.next_offset(),
            log.durable_next().saturating_sub(proc.next_offset())
        );
    }
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
    // The store is open (and locked): a socket left at the path is a dead agent's.
    let socket = crate::metrics::local_socket(&cfg.storage.data_dir);
    if let Err(e) = crate::metrics::serve_local(&socket, metrics.clone()) {
        crate::event!(warn, "status_socket_failed";
            "status: cannot serve {}: {e}; the agent goes on, and `cairn status` shows only \
             what the data directory says (or `[metrics] listen`'s figures, if set)",
            socket.display()
        );
    }
    Ok(metrics)
}

/// Connect, subscribed to every pipeline's topic filters (each once) and, as a Sparkplug
/// Primary Host, to its own STATE with its will registered; and to each sink's broker,
/// publish-only: the uplink, and every `[[sink]]`. Each sink's cursor starts at the oldest
/// outbox entry (`first_seq`), or past what its last durable position (`positions`) says
/// it settled.
fn subscribe(
    cfg: &Config,
    first_seq: u64,
    positions: &[(String, u64)],
    host: &Host,
) -> Result<(Mqtt, Vec<MqttSink>, Events), AgentError> {
    use crate::config::{LOCAL_SINK, SinkKind, SinkProtocol, UPLINK_SINK};
    use crate::mqtt::Protocol;
    let mut filters: Vec<String> = cfg
        .pipelines
        .iter()
        .flat_map(|p| p.topics.clone())
        .chain(host.subscription())
        .collect();
    filters.sort();
    filters.dedup();
    let inflight = cfg.outbox.inflight;
    let mut input = cfg.mqtt.clone();
    input.will = host.will();
    let links: Vec<Option<(&crate::config::MqttConfig, Protocol)>> = cfg
        .sinks
        .iter()
        .map(|s| match &s.kind {
            SinkKind::Mqtt(m) => Some((
                &m.mqtt,
                match m.protocol {
                    SinkProtocol::V5 => Protocol::V5,
                    SinkProtocol::V311 => Protocol::V311,
                },
            )),
            // Their clients run on threads of their own (`results/dbsink.rs`).
            SinkKind::Postgres(_) | SinkKind::JetStream(_) => None,
        })
        .collect();
    let (mqtt, up, links, events, tx) = Mqtt::start_all(
        &input,
        filters,
        cfg.uplink.as_ref().map(|u| &u.mqtt),
        &links,
        inflight,
    )?;
    let start = |name: &str| {
        positions
            .iter()
            .find(|(n, _)| n == name)
            .map_or(first_seq, |&(_, p)| p.max(first_seq))
    };
    let mut sinks = vec![MqttSink::new(
        LOCAL_SINK,
        start(LOCAL_SINK),
        Conn::Input,
        None,
    )];
    if let (Some(u), Some(up)) = (&cfg.uplink, up) {
        sinks.push(MqttSink::new(
            UPLINK_SINK,
            start(UPLINK_SINK),
            Conn::Own(crate::mqtt::Link::V311(up)),
            Some((&u.mqtt, &u.topic_prefix)),
        ));
    }
    for (n, (s, link)) in cfg.sinks.iter().zip(links).enumerate() {
        // Every `[[sink]]` has its place in `sinks`: `Event::Sink(n, ..)` counts on it.
        let sink = match (&s.kind, link) {
            (SinkKind::Mqtt(m), Some(link)) => MqttSink::new(
                &s.name,
                start(&s.name),
                Conn::Own(link),
                Some((&m.mqtt, &m.topic_prefix)),
            ),
            (kind, _) => {
                let tx = tx.for_sink(u16::try_from(n).unwrap_or(u16::MAX));
                let conn = ThreadConn::start(&s.name, kind, cfg.sink_tables(&s.name), tx)
                    .map_err(|e| AgentError::Mqtt(crate::mqtt::MqttError::Config(e)))?;
                MqttSink::new(&s.name, start(&s.name), Conn::Thread(conn), None)
            }
        };
        sinks.push(sink);
    }
    Ok((mqtt, sinks, events))
}
