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
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::config::Config;
use crate::fsio::Durability;
use crate::log::{Log, LogError, LogOptions};
use crate::model::Record;
use crate::mqtt::{AckToken, Event, Incoming, Mqtt, MqttError};
use crate::processor::{ProcessError, Processor};
use crate::store::Store;

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
    first_unchecked: Option<Instant>,
    /// Next outbox sequence to publish, and what is on the wire.
    publish_cursor: u64,
    inflight: HashMap<String, u64>,
    connected: bool,
    pub stats: Stats,
}

impl Agent {
    /// Recover (truncate the torn tail, load the checkpoint, replay), then connect.
    pub fn start(cfg: Config, sync: Durability) -> Result<Agent, AgentError> {
        let started = Instant::now();
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
        let store = Store::open(&cfg.store_dir(), cfg.storage.cache_size, sync)?;
        let mut proc = Processor::open(store, cfg.pipelines.clone())?;
        if log.next_offset() < proc.next_offset() {
            return Err(AgentError::Process(ProcessError::LogGap {
                needed: proc.next_offset(),
                first: log.next_offset(),
            }));
        }
        let stats = proc.replay(&log, cfg.checkpoint.max_records, &wall_ms, &mut |s| {
            log::info!(
                "recovery: replayed {} records up to offset {}",
                s.records,
                s.to
            )
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
            first_unchecked: None,
            publish_cursor: first_seq,
            inflight: HashMap::new(),
            connected: false,
            stats: Stats::default(),
        })
    }

    pub fn processor(&self) -> &Processor {
        &self.proc
    }

    /// Run until `shutdown` is requested; then drain and return.
    pub fn run(mut self, shutdown: &Shutdown) -> Result<(), AgentError> {
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
                    // Take whatever else is already waiting before paying for an fsync.
                    while self.unsynced_acks.len() < self.cfg.mqtt.ingest_batch {
                        match self.events.try_recv() {
                            Ok(ev) => self.on_event(ev)?,
                            Err(_) => break,
                        }
                    }
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return Err(AgentError::MqttGone),
            }
            self.tick(false)?;
        }
        self.drain(shutdown)
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
                    self.proc.store().outbox_delete(seq, &output_id)?;
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
        if self.unsynced_acks.len() >= self.cfg.mqtt.ingest_batch {
            self.commit_log()?;
        }
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
        if self.log.pending() > 0 {
            self.log.commit()?;
            self.stats.log_commits += 1;
        }
        for t in self.unsynced_acks.drain(..) {
            self.mqtt.ack(t)?;
            self.stats.acked += 1;
        }
        self.first_unsynced = None;
        for rec in std::mem::take(&mut self.unsynced_recs) {
            self.proc.apply(&rec)?;
            self.first_unchecked.get_or_insert_with(Instant::now);
        }
        if self.proc.pending_records() >= self.cfg.checkpoint.max_records {
            self.checkpoint()?;
        }
        Ok(())
    }

    fn checkpoint(&mut self) -> Result<(), AgentError> {
        if let Some(info) = self.proc.checkpoint(wall_ms())? {
            self.stats.checkpoints += 1;
            log::debug!("checkpoint {} at offset {}", info.id, info.next_offset);
        }
        self.first_unchecked = None;
        self.retention()?;
        Ok(())
    }

    /// Delete log segments wholly before the durable checkpoint and older than retention.
    fn retention(&mut self) -> Result<(), AgentError> {
        let checkpointed = self.proc.next_offset();
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
            match self
                .mqtt
                .publish(out.id.clone(), &out.topic, out.payload, out.retain)
            {
                Ok(()) => {
                    self.inflight.insert(out.id, seq);
                    self.publish_cursor = seq + 1;
                    self.stats.published += 1;
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
        }
        let left = self.proc.store().outbox_len();
        self.proc.store().sync()?;
        log::info!("shutdown: done; {left} outbox entries left for the next start");
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
