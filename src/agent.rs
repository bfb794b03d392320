//! The agent: one event loop wiring ingest, processor, checkpoints and publisher.
//!
//! ```text
//!  mqtt thread ──Event──▶ loop: append to log ─(group commit: fsync)─▶ PUBACK in order
//!                                 │                                     │
//!                                 │            processor.apply(record) ◀┘
//!                                 │            checkpoint (one sled tx + fsync)
//!                                 └──────────▶ publish durable outbox entries; delete on PUBACK
//! ```
//!
//! The loop never waits on the MQTT thread: acks and publishes are queued without blocking
//! (the MQTT module polls rumqttc in its own thread). Timers use the monotonic clock; the
//! wall clock is read only to stamp `received_at_ms` on new records (invariant 3).

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::config::Config;
use crate::fsio::Durability;
use crate::log::{Log, LogError, LogOptions};
use crate::metrics::Metrics;
use crate::model::Record;
use crate::mqtt::{AckToken, Event, Incoming, Mqtt, MqttError};
use crate::pipeline::engine::Outcome;
use crate::processor::{ProcessError, Processor};
use crate::store::{CheckpointInfo, SavepointInfo, Store};

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("replay log: {0}")]
    Log(#[from] LogError),
    #[error("{0}")]
    Process(#[from] ProcessError),
    #[error("store: {0}")]
    Store(#[from] crate::store::StoreError),
    #[error("mqtt: {0}")]
    Mqtt(#[from] MqttError),
    #[error("the MQTT thread stopped unexpectedly")]
    MqttGone,
    #[error("metrics: cannot listen on {addr}: {source}")]
    Metrics {
        addr: String,
        source: std::io::Error,
    },
    #[error("{0}")]
    Failpoint(std::io::Error),
    #[error(transparent)]
    Disk(#[from] crate::disk::DiskError),
    #[error(
        "{source}. The filesystem under {} is out of space (bytes or inodes): free space there \
         and start the agent again. Nothing acknowledged is lost: it is in the log, and the \
         broker redelivers what was not acknowledged",
        .dir.display()
    )]
    DiskFull {
        dir: PathBuf,
        source: Box<AgentError>,
    },
}

impl AgentError {
    /// The OS error underneath, if this failure came from one.
    fn io_error(&self) -> Option<&std::io::Error> {
        match self {
            AgentError::Log(LogError::Io { source, .. })
            | AgentError::Process(ProcessError::Log(LogError::Io { source, .. })) => Some(source),
            AgentError::Store(e) | AgentError::Process(ProcessError::Store(e)) => e.io_error(),
            _ => None,
        }
    }

    /// An ENOSPC that got past the space guard is still fatal (a failed write may have
    /// poisoned the log), but the operator is told what it was and what to do.
    fn explain_disk_full(self, dir: &Path) -> AgentError {
        if self.io_error().is_some_and(crate::disk::is_disk_full) {
            AgentError::DiskFull {
                dir: dir.to_path_buf(),
                source: Box::new(self),
            }
        } else {
            self
        }
    }
}

/// Pass a failpoint (a no-op unless built with the `failpoints` feature).
fn failpoint(name: &str) -> Result<(), AgentError> {
    crate::failpoint::hit(name).map_err(AgentError::Failpoint)
}

/// Shutdown requests: 0 none, 1 drain and exit, 2 or more exit now.
#[derive(Debug, Clone, Default)]
pub struct Shutdown(Arc<AtomicU8>);

impl Shutdown {
    pub fn new() -> Shutdown {
        Shutdown::default()
    }
    /// Count one more request (a signal).
    pub fn request(&self) -> u8 {
        self.0.fetch_add(1, Ordering::SeqCst) + 1
    }
    pub fn requested(&self) -> u8 {
        self.0.load(Ordering::SeqCst)
    }
}

pub fn wall_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Figures the loop keeps (issue 6 exports them).
#[derive(Debug, Clone, Default)]
pub struct Stats {
    pub received: u64,
    pub acked: u64,
    pub log_commits: u64,
    pub checkpoints: u64,
    pub published: u64,
    pub pubacked: u64,
    pub reconnects: u64,
    pub oversize: u64,
}

pub struct Agent {
    cfg: Config,
    log: Log,
    proc: Processor,
    mqtt: Mqtt,
    events: Receiver<Event>,
    /// Appended but not yet committed: their acks and records, in receipt order.
    unsynced_acks: VecDeque<AckToken>,
    unsynced_recs: Vec<Record>,
    first_unsynced: Option<Instant>,
    /// Messages received while the log or the outbox is full; not appended, not acked.
    held: VecDeque<Incoming>,
    backpressure: bool,
    /// Free space under the log and the store: below the reserve, stop acking (invariant 7).
    space: crate::disk::SpaceGuard,
    first_unchecked: Option<Instant>,
    /// Next outbox sequence to publish, and what is on the wire.
    publish_cursor: u64,
    inflight: HashMap<String, u64>,
    connected: bool,
    pub stats: Stats,
    dead_letter_log: crate::logging::RateLimit,
    /// Figures for `/metrics` (issue 6); gauges refreshed every `metrics::REFRESH_INTERVAL`.
    metrics: Arc<Metrics>,
    metrics_refreshed: Option<Instant>,
    /// When freed heap was last handed back to the system, and the work done by then
    /// (checkpoints + acknowledged results): an idle agent has nothing to give back.
    trimmed: (Instant, u64),
    sync: Durability,
    /// The newest savepoint: retention keeps the log back to its `next_offset`.
    newest_savepoint: Option<SavepointInfo>,
    next_savepoint: Option<Instant>,
}

impl Agent {
    /// Recover (truncate the torn tail, load the checkpoint, replay), then connect.
    pub fn start(cfg: Config, sync: Durability) -> Result<Agent, AgentError> {
        Agent::start_with_reset(cfg, sync, &[])
    }

    /// As [`Agent::start`], first resetting the named pipelines' state (see
    /// [`Processor::open_with_reset`]).
    pub fn start_with_reset(
        cfg: Config,
        sync: Durability,
        reset: &[String],
    ) -> Result<Agent, AgentError> {
        let dir = cfg.storage.data_dir.clone();
        Agent::recover(cfg, sync, reset).map_err(|e| e.explain_disk_full(&dir))
    }

    fn recover(cfg: Config, sync: Durability, reset: &[String]) -> Result<Agent, AgentError> {
        let started = Instant::now();
        // Before the log and the store make it with the default mode (issue 10: 0700).
        crate::fsio::create_data_dir(&cfg.storage.data_dir, &sync).map_err(|source| {
            crate::log::LogError::Io {
                op: "create the data directory",
                path: cfg.storage.data_dir.clone(),
                source,
            }
        })?;
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
        let store = Store::open_with(
            &cfg.store_dir(),
            cfg.storage.cache_size,
            sync.clone(),
            cfg.store_bounds(),
        )?;
        let mut proc = Processor::open_with_reset(store, cfg.pipelines.clone(), reset)?;
        if log.next_offset() < proc.next_offset() {
            return Err(AgentError::Process(ProcessError::LogBehind {
                checkpoint: proc.next_offset(),
                log_next: log.next_offset(),
            }));
        }
        let mut trimmed = Instant::now();
        let stats = proc.replay(&log, cfg.checkpoint.max_records, &wall_ms, &mut |s| {
            if trimmed.elapsed() >= TRIM_INTERVAL {
                trimmed = Instant::now();
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
            started.elapsed().as_millis(),
            log.first_offset(),
            log.next_offset(),
            stats.records,
            stats.from,
            proc.engine().progress().checkpoint_id
        );
        let metrics = Metrics::new();
        let durable = proc.store().progress()?;
        let last_at = proc.store().checkpoints().next_back().transpose()?;
        let bounds = proc.store().bound_figures();
        metrics.update(|f| {
            set_bound_figures(f, &bounds);
            f.replay_records = stats.records;
            f.replay_seconds = started.elapsed().as_secs_f64();
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
            crate::metrics::serve(at, metrics.clone()).map_err(err)?;
            log::info!("metrics: serving http://{addr}/metrics");
        }
        let newest_savepoint = crate::store::list_savepoints(&cfg.savepoint_dir())?.pop();
        let next_savepoint = cfg.savepoint.interval.map(|every| {
            let age = newest_savepoint.as_ref().map_or(every, |s| {
                Duration::from_millis(wall_ms().saturating_sub(s.created_at_ms))
            });
            Instant::now() + every.saturating_sub(age)
        });
        let mut filters: Vec<String> = cfg
            .pipelines
            .iter()
            .flat_map(|p| p.topics.clone())
            .collect();
        filters.sort();
        filters.dedup();
        let (mqtt, events) = Mqtt::start(&cfg.mqtt, filters, cfg.outbox.inflight)?;
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
            unsynced_acks: VecDeque::new(),
            unsynced_recs: Vec::new(),
            first_unsynced: None,
            held: VecDeque::new(),
            backpressure: false,
            space,
            first_unchecked: None,
            publish_cursor: first_seq,
            inflight: HashMap::new(),
            connected: false,
            stats: Stats::default(),
            dead_letter_log: crate::logging::RateLimit::new(10, Duration::from_secs(60)),
            metrics,
            metrics_refreshed: None,
            trimmed: (Instant::now(), 0),
            sync,
            newest_savepoint,
            next_savepoint,
        })
    }

    /// Run until `shutdown` is requested; then drain and return.
    pub fn run(self, shutdown: &Shutdown) -> Result<(), AgentError> {
        let dir = self.cfg.storage.data_dir.clone();
        self.run_loop(shutdown)
            .map_err(|e| e.explain_disk_full(&dir))
    }

    fn run_loop(mut self, shutdown: &Shutdown) -> Result<(), AgentError> {
        let mut beat = crate::notify::Heartbeat::from_env();
        while shutdown.requested() == 0 {
            let timeout = self
                .next_deadline()
                .saturating_duration_since(Instant::now());
            match self
                .events
                .recv_timeout(timeout.min(Duration::from_millis(100)))
            {
                Ok(ev) => {
                    self.on_event(ev)?;
                    // Group commit: everything already waiting joins this fsync, up to one
                    // channel's worth per pass (so timed checkpoints and publishing still
                    // run under steady input). The broker normally has at most its inflight
                    // window unacknowledged, but mosquitto 2.0.11 was seen sending far more
                    // (tests/e2e.rs): one fsync per `ingest_batch` then could not keep up,
                    // the MQTT thread stalled on a full channel, its pings went unsent and
                    // the broker dropped the connection and redelivered everything.
                    for _ in 1..self.cfg.mqtt.channel_capacity {
                        match self.events.try_recv() {
                            Ok(ev) => self.on_event(ev)?,
                            Err(_) => break,
                        }
                    }
                    if self.unsynced_acks.len() >= self.cfg.mqtt.ingest_batch {
                        self.commit_log()?;
                    }
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return Err(AgentError::MqttGone),
            }
            self.tick(false)?;
            if crate::signals::take_reload() {
                self.reload();
            }
            beat.beat(Instant::now(), || self.status_line());
        }
        self.drain(shutdown)
    }

    /// SIGHUP: re-read the config file and apply what is safe to change while running (log
    /// level, limits, intervals). Anything else (broker connection, storage, pipelines, log
    /// framing) is reported and left for a restart. A config with problems changes nothing.
    fn reload(&mut self) {
        crate::notify::reloading();
        match crate::config::load(&self.cfg.source) {
            Err(e) => log::error!("reload: {e}; keeping the running configuration"),
            Ok(new) => {
                let old = &self.cfg;
                let mut restart = Vec::new();
                if new.mqtt != old.mqtt {
                    restart.push("[mqtt]");
                }
                if new.storage != old.storage {
                    restart.push("[storage]");
                }
                if new.metrics != old.metrics {
                    restart.push("[metrics]");
                }
                if new.pipelines != old.pipelines {
                    restart.push("[[pipeline]]");
                }
                if new.log.segment_size != old.log.segment_size
                    || new.log.max_payload != old.log.max_payload
                {
                    restart.push("log.segment_size/log.max_payload");
                }
                if new.outbox.inflight != old.outbox.inflight {
                    restart.push("outbox.inflight");
                }
                crate::logging::set_level(new.logging.level);
                self.log.set_max_size(new.log.max_size);
                let cfg = &mut self.cfg;
                cfg.logging = new.logging.clone();
                cfg.log.max_size = new.log.max_size;
                cfg.log.retention = new.log.retention;
                cfg.log.commit_interval = new.log.commit_interval;
                cfg.checkpoint = new.checkpoint.clone();
                cfg.outbox.max_entries = new.outbox.max_entries;
                cfg.outbox.drain_timeout = new.outbox.drain_timeout;
                cfg.savepoint = new.savepoint.clone();
                if restart.is_empty() {
                    log::info!("reload: applied {}", self.cfg.source.display());
                } else {
                    log::warn!(
                        "reload: applied the safe changes; {} changed too and need a restart (systemctl restart cairn)",
                        restart.join(", ")
                    );
                }
            }
        }
        crate::notify::ready();
    }

    /// One journal line per dead letter, at most 10 per minute; the rest are counted and
    /// reported as suppressed (they are all in the store: `cairn inspect dead-letters`).
    fn log_dead_letter(&mut self, rec: &Record, reason: &str) {
        let verdict = self.dead_letter_log.check(Instant::now());
        if verdict.suppressed > 0 {
            log::warn!(
                "dead letter: {} more suppressed in the last minute",
                verdict.suppressed
            );
        }
        if verdict.allowed {
            log::warn!(
                "dead letter: offset {} topic `{}` reason {reason} (see `cairn inspect dead-letters`)",
                rec.offset,
                rec.topic
            );
        }
    }

    /// The `STATUS=` line `systemctl status` shows.
    fn status_line(&self) -> String {
        format!(
            "running: received {}, acked {}, processed up to offset {}, checkpoint {}, outbox {}{}",
            self.stats.received,
            self.stats.acked,
            self.proc.next_offset(),
            self.proc.engine().progress().checkpoint_id,
            self.proc.store().outbox_len(),
            if self.connected {
                ""
            } else {
                ", broker disconnected"
            }
        )
    }

    fn next_deadline(&self) -> Instant {
        let far = Instant::now() + Duration::from_millis(100);
        let a = self
            .first_unsynced
            .map(|t| t + self.cfg.log.commit_interval)
            .unwrap_or(far);
        let b = self
            .first_unchecked
            .map(|t| t + self.cfg.checkpoint.interval)
            .unwrap_or(far);
        a.min(b)
    }

    fn on_event(&mut self, ev: Event) -> Result<(), AgentError> {
        match ev {
            Event::Message(m) => {
                self.stats.received += 1;
                if self.backpressure {
                    self.held.push_back(m);
                } else {
                    self.ingest(m)?;
                }
            }
            Event::PubAcked { output_id } => {
                if let Some(seq) = self.inflight.remove(&output_id) {
                    failpoint("outbox.before_delete")?;
                    self.proc.store().outbox_delete(seq, &output_id)?;
                    failpoint("outbox.after_delete")?;
                    self.stats.pubacked += 1;
                }
            }
            Event::Connected { session_present } => {
                log::info!(
                    "mqtt: connected to {}:{} (session present: {session_present})",
                    self.cfg.mqtt.host,
                    self.cfg.mqtt.port
                );
                self.connected = true;
            }
            Event::Disconnected { reason } => {
                if self.connected {
                    self.stats.reconnects += 1;
                }
                self.connected = false;
                // Acks still queued for that connection are dropped by the MQTT module; the
                // broker redelivers those messages (DUP=1) and dedup by event ID drops them.
                log::warn!("mqtt: disconnected: {reason}");
            }
        }
        Ok(())
    }

    /// Append one message; returns false (and holds it) when the log is full.
    fn ingest(&mut self, m: Incoming) -> Result<bool, AgentError> {
        // A nearly full disk is backpressure too: an ENOSPC would poison the log and stop
        // the agent. 64 bytes cover the frame header and the record's other fields.
        let bytes = (m.topic.len() + m.payload.len()) as u64 + 64;
        if let Some(free) = self.space.check(Instant::now(), bytes)? {
            let why = format!(
                "the disk is nearly full: {free} bytes free under {}, below the reserve of {} \
                 bytes (2 × log.segment_size)",
                self.space.lowest_dir().display(),
                self.space.reserve()
            );
            self.set_backpressure(true, &why);
            self.held.push_front(m);
            return Ok(false);
        }
        let now = wall_ms();
        let appended = match self.log.append(now, &m.topic, &m.payload, m.qos, m.retain) {
            Ok(off) => Some(off),
            Err(LogError::PayloadTooLarge { len, max }) => {
                // Refused, with a clear error; acked so the broker does not redeliver it forever.
                self.stats.oversize += 1;
                log::warn!(
                    "ingest: refused a {len}-byte payload on `{}` (max_payload is {max})",
                    m.topic
                );
                None
            }
            Err(LogError::Full { .. }) => {
                self.set_backpressure(true, "the replay log is full");
                self.held.push_front(m);
                return Ok(false);
            }
            Err(e) => return Err(e.into()),
        };
        if let Some(offset) = appended {
            self.unsynced_recs.push(Record {
                offset,
                received_at_ms: now,
                topic: m.topic,
                payload: m.payload,
                qos: m.qos,
                retain: m.retain,
            });
        }
        self.unsynced_acks.push_back(m.token);
        self.first_unsynced.get_or_insert_with(Instant::now);
        Ok(true)
    }

    fn set_backpressure(&mut self, on: bool, why: &str) {
        if on != self.backpressure {
            self.backpressure = on;
            if on {
                log::warn!("backpressure on: {why}; not acknowledging, the broker queues");
            } else {
                log::info!("backpressure off: acknowledging again");
            }
        }
    }

    /// Invariant 1: fsync, then PUBACK in receipt order, then process.
    fn commit_log(&mut self) -> Result<(), AgentError> {
        // A deliberately unsafe build acks first, to show the crash harness catches it.
        let unsafe_early_ack = crate::failpoint::enabled("unsafe.ack_before_fsync");
        if unsafe_early_ack {
            self.send_acks()?;
            // Hold the window open as a slow flash write would, so that a cut in the harness
            // lands inside it often enough to be seen, rather than once in a few hundred.
            std::thread::sleep(Duration::from_millis(25));
        }
        if self.log.pending() > 0 {
            let began = Instant::now();
            self.log.commit()?;
            self.stats.log_commits += 1;
            let took = began.elapsed();
            self.metrics.update(|f| {
                f.log_commits += 1;
                f.log_commit.observe(took);
            });
        }
        failpoint("ingest.before_puback")?;
        self.send_acks()?;
        failpoint("ingest.after_puback")?;
        // Acks the MQTT module had no room for: retry at the next commit interval.
        self.first_unsynced = (!self.unsynced_acks.is_empty()).then(Instant::now);
        for rec in std::mem::take(&mut self.unsynced_recs) {
            for outcome in self.proc.apply(&rec)? {
                if let Outcome::DeadLetter { reason } = outcome {
                    self.log_dead_letter(&rec, reason);
                }
            }
            self.first_unchecked.get_or_insert_with(Instant::now);
        }
        if self.proc.pending_records() >= self.cfg.checkpoint.max_records {
            self.checkpoint()?;
        }
        Ok(())
    }

    /// Acks go to the MQTT module in receipt order, as many as its queue takes. The rest wait
    /// here, still in order, for the next commit timer: a full queue (the broker sending
    /// faster than rumqttc takes requests) is load, not a reason to exit (found by
    /// tests/e2e.rs, where mosquitto 2.0.11 outran `max_inflight_messages`).
    fn send_acks(&mut self) -> Result<(), AgentError> {
        let n = self.mqtt.ack_room().min(self.unsynced_acks.len());
        for t in self.unsynced_acks.drain(..n) {
            self.mqtt.ack(t)?;
            self.stats.acked += 1;
        }
        Ok(())
    }

    fn checkpoint(&mut self) -> Result<(), AgentError> {
        let began = Instant::now();
        let done = self.proc.checkpoint(wall_ms());
        if let Err(e) = &done {
            self.metrics.update(|f| f.checkpoint_failures += 1);
            // Fatal by design: the engine is now ahead of the store; a restart replays.
            log::error!(
                "checkpoint failed: {e}; exiting so that recovery replays from the last checkpoint"
            );
        }
        if let Some(info) = done? {
            self.stats.checkpoints += 1;
            log::debug!("checkpoint {} at offset {}", info.id, info.next_offset);
            self.after_checkpoint(began.elapsed(), &info);
        }
        self.first_unchecked = None;
        self.retention()?;
        Ok(())
    }

    /// Delete log segments wholly before the durable checkpoint and older than retention.
    fn retention(&mut self) -> Result<(), AgentError> {
        // Never below the newest savepoint: restoring it needs the log from its offset on.
        let checkpointed = self.proc.next_offset().min(self.savepoint_floor());
        let cutoff = wall_ms().saturating_sub(self.cfg.log.retention.as_millis() as u64);
        let mut below = self.log.first_offset();
        for s in self.log.segments() {
            if s.next_offset <= checkpointed && s.max_received_at_ms <= cutoff {
                below = s.next_offset;
            } else {
                break;
            }
        }
        if below > self.log.first_offset() {
            self.log.truncate_before(below)?;
        }
        Ok(())
    }

    fn tick(&mut self, force: bool) -> Result<(), AgentError> {
        let now = Instant::now();
        if self
            .first_unsynced
            .is_some_and(|t| force || now >= t + self.cfg.log.commit_interval)
        {
            self.commit_log()?;
        }
        if self
            .first_unchecked
            .is_some_and(|t| force || now >= t + self.cfg.checkpoint.interval)
        {
            self.checkpoint()?;
        }
        self.relieve_backpressure()?;
        self.publish()?;
        self.refresh_metrics(force)?;
        let work = self.stats.checkpoints + self.stats.pubacked;
        if now >= self.trimmed.0 + TRIM_INTERVAL && work != self.trimmed.1 {
            self.trimmed = (now, work);
            return_free_memory();
        }
        Ok(())
    }

    fn outbox_full(&self) -> bool {
        self.proc.store().outbox_len() as u64 >= self.cfg.outbox.max_entries
    }

    fn relieve_backpressure(&mut self) -> Result<(), AgentError> {
        if self.outbox_full() {
            self.set_backpressure(true, "the outbox is full");
            return Ok(());
        }
        if !self.held.is_empty() {
            // Retention is time-based too: with everything checkpointed and no new input,
            // no checkpoint would ever run it again, and a full log would stay full.
            self.retention()?;
        }
        while let Some(m) = self.held.pop_front() {
            if !self.ingest(m)? {
                return Ok(()); // the log is still full: held again
            }
        }
        self.set_backpressure(false, "");
        Ok(())
    }

    /// Send durable outbox entries, in order, within the inflight window.
    fn publish(&mut self) -> Result<(), AgentError> {
        if !self.connected {
            return Ok(());
        }
        let room = (self.cfg.outbox.inflight as usize).saturating_sub(self.mqtt.inflight());
        if room == 0 {
            return Ok(());
        }
        let batch: Vec<_> = self
            .proc
            .store()
            .outbox_from(self.publish_cursor)
            .take(room)
            .collect::<Result<_, _>>()?;
        for (seq, out) in batch {
            failpoint("outbox.before_publish")?;
            match self
                .mqtt
                .publish(out.id.clone(), &out.topic, out.payload, out.retain)
            {
                Ok(()) => {
                    self.inflight.insert(out.id, seq);
                    self.publish_cursor = seq + 1;
                    self.stats.published += 1;
                    failpoint("outbox.after_publish")?;
                }
                Err(MqttError::InflightFull { .. }) => break,
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    /// First signal: stop taking input, make everything durable, give the outbox a bounded
    /// time, exit. A second signal ends the wait at once; nothing is lost either way.
    fn drain(mut self, shutdown: &Shutdown) -> Result<(), AgentError> {
        crate::notify::stopping();
        crate::notify::status("stopping: draining");
        let mut beat = crate::notify::Heartbeat::from_env();
        log::info!(
            "shutdown: draining (log commit, checkpoint, outbox for up to {:?})",
            self.cfg.outbox.drain_timeout
        );
        self.tick(true)?;
        let deadline = Instant::now() + self.cfg.outbox.drain_timeout;
        while !self.inflight.is_empty() || self.publish_cursor_behind()? {
            if shutdown.requested() >= 2 || Instant::now() >= deadline {
                break;
            }
            match self.events.recv_timeout(Duration::from_millis(20)) {
                Ok(Event::Message(_)) => {} // not acked: the broker redelivers after restart
                Ok(ev) => self.on_event(ev)?,
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => break,
            }
            self.publish()?;
            beat.beat(Instant::now(), || "stopping: publishing the outbox".into());
        }
        let left = self.proc.store().outbox_len();
        self.proc.store().sync()?;
        log::info!("shutdown: done; {left} outbox entries left for the next start");
        self.metrics.stop_server();
        self.mqtt.shutdown();
        Ok(())
    }

    fn publish_cursor_behind(&self) -> Result<bool, AgentError> {
        Ok(self
            .proc
            .store()
            .outbox_from(self.publish_cursor)
            .next()
            .transpose()?
            .is_some())
    }
}

// ---- metrics and savepoints (issue 6) ----
impl Agent {
    /// The figures `/metrics` serves.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    fn savepoint_floor(&self) -> u64 {
        self.newest_savepoint
            .as_ref()
            .map_or(u64::MAX, |s| s.next_offset)
    }

    /// Right after a commit the store is exactly that checkpoint and nothing else writes to
    /// it until this thread goes on: the one moment a savepoint is consistent.
    fn after_checkpoint(&mut self, took: Duration, info: &CheckpointInfo) {
        let outbox_end = self.proc.engine().progress().outbox_seq;
        self.metrics
            .note_outbox_committed(outbox_end, info.committed_at_ms);
        let pipelines = pipeline_figures(self.proc.engine().progress());
        let bounds = self.proc.store().bound_figures();
        self.metrics.update(|f| {
            set_bound_figures(f, &bounds);
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
        if self.next_savepoint.is_none_or(|t| Instant::now() < t) {
            return;
        }
        let (dir, keep) = (self.cfg.savepoint_dir(), self.cfg.savepoint.keep);
        let began = Instant::now();
        let written = self
            .proc
            .store()
            .write_savepoint(&dir, &self.sync)
            .and_then(|sp| crate::store::prune_savepoints(&dir, keep).map(|_| sp));
        // A failed savepoint costs no data (the checkpoint is durable, retention keeps the
        // log back to the previous savepoint): report it and try again next interval.
        match written {
            Ok(sp) => {
                log::info!(
                    "savepoint: checkpoint {} at offset {} ({} bytes) in {} ms",
                    sp.checkpoint_id,
                    sp.next_offset,
                    sp.bytes,
                    began.elapsed().as_millis()
                );
                self.metrics.update(|f| f.savepoints += 1);
                self.newest_savepoint = Some(sp);
            }
            Err(e) => {
                log::error!("savepoint: failed: {e}");
                self.metrics.update(|f| f.savepoint_failures += 1);
            }
        }
        self.next_savepoint = self.cfg.savepoint.interval.map(|i| Instant::now() + i);
    }

    /// Copy the loop's figures (every tick, so one scrape sees one consistent moment); the
    /// ones that walk a tree or a directory at most every REFRESH_INTERVAL.
    fn refresh_metrics(&mut self, force: bool) -> Result<(), AgentError> {
        let now = Instant::now();
        let store = self.proc.store();
        if force
            || self
                .metrics_refreshed
                .is_none_or(|t| now >= t + crate::metrics::REFRESH_INTERVAL)
        {
            self.metrics_refreshed = Some(now);
            let first_seq = store.outbox_from(0).next().transpose()?.map(|(s, _)| s);
            self.metrics
                .set_outbox(store.outbox_len() as u64, first_seq, wall_ms());
            // Not sled's `size_on_disk()`: it is slow enough to stall the loop (measured:
            // the e2e tests fell behind); the files' sizes are what an operator wants anyway.
            let store_bytes = crate::metrics::dir_size_bytes(store.dir());
            let segments = self.log.segments().len() as u64;
            self.metrics.update(|f| {
                f.store_bytes = store_bytes;
                f.log_segments = segments;
            });
        }
        let progress = self.proc.engine().progress();
        let (log, stats) = (&self.log, &self.stats);
        let sp = self.newest_savepoint.as_ref();
        self.metrics.update(|f| {
            f.received = stats.received;
            f.acked = stats.acked;
            f.oversize_refused = stats.oversize;
            f.published = stats.published;
            f.pubacked = stats.pubacked;
            f.reconnects = stats.reconnects;
            f.connected = self.connected;
            f.backpressure = self.backpressure;
            f.log_size_bytes = log.size_bytes();
            f.log_first_offset = log.first_offset();
            f.log_next_offset = log.next_offset();
            f.records_unmatched = progress.unmatched;
            f.pipelines = pipeline_figures(progress);
            f.savepoint = sp.map(|s| (s.checkpoint_id, s.next_offset, s.created_at_ms));
            let needed = sp.map_or(f.checkpoint_next_offset, |s| s.next_offset);
            f.source_replayable = log.first_offset() <= needed;
        });
        Ok(())
    }
}

/// The store's own bounds for `/metrics`.
fn set_bound_figures(f: &mut crate::metrics::Figures, b: &crate::store::BoundFigures) {
    f.dead_letters_stored = b.dead_letters.stored;
    f.dead_letters_pruned_age = b.dead_letters.pruned_age;
    f.dead_letters_pruned_count = b.dead_letters.pruned_count;
    f.ledger_index_bytes = b.ledger_index_bytes;
    f.ledger_unindexed_chunks = b.ledger_unindexed_chunks;
}

/// Each pipeline's figures for `/metrics`, from the engine's progress.
fn pipeline_figures(
    progress: &crate::pipeline::engine::Progress,
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
            };
            (p.name.clone(), figures)
        })
        .collect()
}

/// How often freed heap is handed back to the system.
const TRIM_INTERVAL: Duration = Duration::from_secs(10);

/// Hand freed heap back to the system. glibc keeps what a burst freed (a replay, a drained
/// outbox) mapped for reuse; on an edge box the peak then looks like the steady state.
/// Measured (issue 7): steady RSS after replaying 1M events fell from 86.8 MiB to the
/// figure in the README. A no-op elsewhere than glibc.
fn return_free_memory() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim only walks the allocator's own free lists; it takes no pointers
    // and is safe to call at any time from any thread.
    unsafe {
        libc::malloc_trim(0);
    }
}
