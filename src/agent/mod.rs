//! The agent: one event loop wiring ingest, processor, checkpoints and publisher.
//!
//! ```text
//!  mqtt thread ──Event──▶ loop: append to log ─(group commit: fsync)─▶ PUBACK in order
//!                                 │                                     │
//!                                 │            processor.apply(record) ◀┘
//!                                 │            publish at once, in order (inputs durable)
//!                                 │            checkpoint (one sled tx + fsync): unsettled
//!                                 └──────────▶ results into the outbox; delete on PUBACK
//! ```
//!
//! The loop never waits on the MQTT thread: acks and publishes are queued without blocking
//! (the MQTT module polls rumqttc in its own thread). Timers use the monotonic clock; the
//! wall clock is read to stamp `received_at_ms` on new records (invariant 3), through a
//! [`ReceiptClock`](crate::clock::ReceiptClock) that never goes backwards (see
//! [`crate::clock`]).
//!
//! ## Rooms
//!
//! The decisions live in parts that do no IO; they are told the time and what happened,
//! and answer what to do. This file is the loop that carries the answers out against the
//! log, the store and the broker.
//!
//! - `ingest`: group commit (unsynced acks and records), ack order, held input and
//!   backpressure, times of receipt, the `too_large` stand-in.
//! - `publisher`: results before their checkpoint, the cursor and inflight window; what a
//!   PUBACK settles.
//! - `checkpointer`: when to checkpoint, retention's cutoff, relief for held input,
//!   savepoint scheduling and the savepoint floor, when to look at sled's files.
//! - `reload`: SIGHUP as a pure diff of two configs, then applied. `boundary`: pipeline
//!   changes take effect at a checkpoint boundary. `fsync`: the checkpoint's fsync beside
//!   the loop; retention and the quarantine wait for it.
//! - `uplink`: with `[uplink]`, results go out on a second connection (its events arrive
//!   on the same channel); the link's state and the backlog's drain rate.
//! - `backfill`: slices of the retained log for `start = "earliest"` pipelines, and the
//!   log they need kept from retention.
//! - `start`: recovery and wiring; `retention`: log segments deleted; `drain`: shutdown;
//!   `savepoints`: savepoints carried out; `figures`: metrics and the `STATUS=` line;
//!   `memory`: heap trimming; `error`: [`AgentError`].

mod backfill;
mod behind;
mod boundary;
mod checkpointer;
mod drain;
mod error;
mod figures;
mod fsync;
mod ingest;
mod memory;
mod publisher;
mod reload;
mod retention;
mod savepoints;
mod start;
mod uplink;

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::{Duration, Instant};

use crate::clock::Clock;
use crate::config::Config;
use crate::fsio::Durability;
use crate::log::{Log, LogError};
use crate::metrics::Metrics;
use crate::model::Record;
use crate::mqtt::{AckToken, Event, Events, Incoming, Mqtt, MqttError, Want};
use crate::pipeline::engine::Outcome;
use crate::processor::Processor;

use behind::Behind;
use behind::outbox_full;
use checkpointer::{Checkpointer, Relief};
pub use error::AgentError;
use error::failpoint;
use figures::Refresh;
use ingest::Ingest;
use memory::Trim;
use publisher::Publisher;

/// The most that inputs held under backpressure may take, in bytes (topic, payload and
/// bookkeeping). Past it an input is let go, unacknowledged: the broker keeps it, and once
/// backpressure ends the agent reconnects so that the broker sends it again (issue 16: with
/// no bound, mosquitto 2.0.11 pushed 485k queued messages, 680 MiB, at an agent whose outbox
/// was full). A QoS 0 input let go is gone, as QoS 0 allows: the broker keeps nothing for
/// it, and holding QoS 0 without bound is what the bound is against.
pub(crate) const HELD_LIMIT: usize = 4 << 20;

/// How long backpressure must stay off before the agent reconnects for inputs it let go:
/// every reconnect makes the broker re-send all it has not had acknowledged, and a
/// backpressure that comes and goes would otherwise ask for that again and again.
const REDELIVER_SETTLE: Duration = Duration::from_secs(2);

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
    pub(crate) fn requested(&self) -> u8 {
        self.0.load(Ordering::SeqCst)
    }
}

/// The system's wall clock in ms since the epoch, for callers outside the agent (benches).
/// The agent itself reads time only through the [`Clock`] it was started with.
pub fn wall_ms() -> u64 {
    crate::clock::SystemClock.wall_ms()
}

/// Figures the loop keeps (issue 6 exports them).
#[derive(Debug, Clone, Default)]
pub(crate) struct Stats {
    pub received: u64,
    pub acked: u64,
    pub log_commits: u64,
    pub checkpoints: u64,
    pub published: u64,
    pub pubacked: u64,
    /// Results published before the checkpoint that commits them (issue 14).
    pub published_early: u64,
    /// Results acknowledged before their checkpoint, so never written to the outbox.
    pub settled_early: u64,
    pub reconnects: u64,
    /// Inputs over `log.max_payload`, logged as `too_large` stand-ins.
    pub oversize: u64,
    /// Inputs let go under backpressure (see [`HELD_LIMIT`]).
    pub held_let_go: u64,
}

pub struct Agent {
    cfg: Config,
    log: Log,
    proc: Processor,
    mqtt: Mqtt,
    events: Events,
    ingest: Ingest<AckToken, Incoming>,
    /// Inputs were let go under backpressure: reconnect once it has stayed off for
    /// [`REDELIVER_SETTLE`] and the acks before them are out.
    redeliver: bool,
    /// When backpressure last went off (`None` while on).
    backpressure_off_at: Option<Instant>,
    publisher: Publisher,
    checkpointer: Checkpointer,
    /// The checkpoint's fsync, beside the loop.
    fsync: fsync::Fsync,
    /// Free space under the log and the store: below the reserve, stop acking (invariant 7).
    space: crate::disk::SpaceGuard,
    stats: Stats,
    dead_letter_log: crate::logging::RateLimit,
    /// Figures for `/metrics` (issue 6); gauges refreshed every `metrics::REFRESH_INTERVAL`.
    metrics: Arc<Metrics>,
    metrics_refreshed: Refresh,
    trim: Trim,
    sync: Durability,
    /// The box's clocks, passed in so tests can step them.
    clock: Box<dyn Clock>,
    /// Warnings for processed segments deleted inside retention (a log short of room).
    eviction_log: crate::logging::RateLimit,
    /// `[uplink]`: the connection results go out on instead of `mqtt` (issue 13).
    uplink: Option<uplink::Uplink>,
    /// Backfills (`start = "earliest"`) in progress, if any.
    backfill: backfill::Backfilling,
    /// Processing behind the log while the outbox is at its bound (`behind`).
    behind: Behind,
}

impl Agent {
    /// Now, on the monotonic clock. Every timer and time of day the agent uses comes from
    /// the one [`Clock`] it was started with, so a test can drive them all.
    fn now(&self) -> Instant {
        self.clock.monotonic()
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
            let timeout = self.next_deadline().saturating_duration_since(self.now());
            match self
                .events
                .wait(self.want(), timeout.min(Duration::from_millis(100)))
            {
                Ok(()) => {
                    // Group commit: everything already waiting joins this fsync, up to one
                    // queue's worth per pass (so timed checkpoints and publishing still
                    // run under steady input). The broker normally has at most its inflight
                    // window unacknowledged, but mosquitto 2.0.11 was seen sending far more
                    // (tests/it/e2e.rs): one fsync per `ingest_batch` then could not keep up,
                    // the MQTT thread stalled on a full channel, its pings went unsent and
                    // the broker dropped the connection and redelivered everything.
                    for _ in 0..self.cfg.mqtt.channel_capacity {
                        match self.events.try_recv() {
                            Ok(ev) => self.on_event(ev)?,
                            Err(_) => break,
                        }
                    }
                    if self.ingest.batch_full(self.cfg.mqtt.ingest_batch) {
                        self.commit_log()?;
                    }
                }
                Err(_) => return Err(AgentError::MqttGone),
            }
            self.tick(false)?;
            self.backfill_step()?;
            self.behind_step()?;
            if crate::signals::take_reload() {
                self.reload();
            }
            beat.beat(self.now(), || self.status_line());
        }
        self.drain(shutdown)
    }

    /// What is worth waking for before the next timer: the messages that fill the group
    /// commit under way (without one, the first message, which starts its timer), or half a
    /// publish window of acknowledgements (results may wait for that room). Fewer wait for
    /// the timer and are then taken all at once; while publishes are in flight the timer is
    /// at most a commit interval away (`next_deadline`), so an acknowledgement waits no
    /// longer than a message does. Connection events always wake the loop.
    fn want(&self) -> Want {
        Want {
            messages: self.ingest.messages_wanted(self.cfg.mqtt.ingest_batch),
            acks: usize::from(self.cfg.outbox.inflight / 2).max(1),
        }
    }

    /// Enough applied since the last checkpoint to take one now (`checkpoint.max_records`,
    /// `checkpoint.max_keys`).
    fn checkpoint_size_due(&self) -> bool {
        Checkpointer::size_due(
            self.proc.pending_records(),
            self.proc.pending_keys(),
            &self.cfg.checkpoint,
        )
    }

    /// The next timer: the group commit's or the checkpoint's, at most 100 ms away (a commit
    /// interval while publishes are in flight on a live connection).
    fn next_deadline(&self) -> Instant {
        if self.backfill.active() {
            return self.now(); // a backfill slice is waiting: do not wait for input
        }
        if self.behind.active() && outbox_full(&self.cfg.outbox, &self.proc).is_none() {
            return self.now(); // records wait in the log and the outbox has room
        }
        let acks_may_wait = !self.publisher.idle() && self.publisher.is_connected();
        let far = self.now()
            + if acks_may_wait {
                self.cfg.log.commit_interval // see `want`
            } else {
                Duration::from_millis(100)
            };
        let a = self
            .ingest
            .deadline(self.cfg.log.commit_interval)
            .unwrap_or(far);
        let b = self
            .checkpointer
            .deadline(self.cfg.checkpoint.interval)
            .unwrap_or(far);
        a.min(b)
    }

    fn on_event(&mut self, ev: Event) -> Result<(), AgentError> {
        match ev {
            Event::Message(m) => {
                self.stats.received += 1;
                if let Some(m) = self.ingest.arrive(m) {
                    self.append(m)?;
                }
            }
            Event::PubAcked { output_id } => self.pubacked(&output_id)?,
            Event::Uplink(ev) => self.on_uplink_event(*ev)?,
            // Issues 26 and 29: not wired yet (the broker's own count of dropped inputs;
            // the outcomes only an MQTT 5 sink gives).
            Event::BrokerDrops(_) | Event::PubRefused { .. } | Event::TooLarge { .. } => {}
            Event::Connected { session_present } => {
                log::info!(
                    "mqtt: connected to {}:{} (session present: {session_present})",
                    self.cfg.mqtt.host,
                    self.cfg.mqtt.port
                );
                self.input_link(true);
            }
            Event::Disconnected { reason, .. } => {
                if self.input_link(false) {
                    self.stats.reconnects += 1;
                }
                // Acks still queued for that connection are dropped by the MQTT module; the
                // broker redelivers those messages (DUP=1) and dedup by event ID drops them.
                log::warn!("mqtt: disconnected: {reason}");
            }
        }
        Ok(())
    }

    /// The broker acknowledged a result: delete its outbox entry.
    fn pubacked(&mut self, output_id: &str) -> Result<(), AgentError> {
        // Outputs from `fresh` on are not in the store yet: nothing to delete.
        let fresh = self
            .proc
            .pending_outputs()
            .first()
            .map_or(u64::MAX, |o| o.0);
        for (seq, id) in self.publisher.acked(output_id) {
            if seq >= fresh {
                // At the broker, its checkpoint not yet committed (tests/it/crash.rs).
                failpoint("publish.acked_before_checkpoint")?;
            } else {
                failpoint("outbox.before_delete")?;
                self.proc.store().outbox_delete(seq, &id)?;
                failpoint("outbox.after_delete")?;
            }
            self.stats.pubacked += 1;
        }
        Ok(())
    }

    /// Append one message; returns false (and holds it) when the log or the disk is full.
    fn append(&mut self, m: Incoming) -> Result<bool, AgentError> {
        // A nearly full disk is backpressure too: an ENOSPC would poison the log and stop
        // the agent. 64 bytes cover the frame header and the record's other fields.
        let bytes = (m.topic.len() + m.payload.len()) as u64 + 64;
        let at = self.now();
        if let Some(free) = self.space.check(at, bytes)? {
            let why = format!(
                "the disk is nearly full: {free} bytes free under {}, below the reserve of {} \
                 bytes (2 × log.segment_size)",
                self.space.lowest_dir().display(),
                self.space.reserve()
            );
            self.set_backpressure(true, &why);
            self.ingest.hold_again(m);
            return Ok(false);
        }
        let (now, note) = self
            .ingest
            .stamp(self.clock.wall_ms(), self.clock.monotonic());
        if let Some(note) = note {
            start::log_clock_note(&self.cfg, &note);
        }
        let stand_in = ingest::stand_in(&m.payload, m.qos, self.cfg.log.max_payload);
        let appended = match &stand_in {
            Some((p, qos)) => self.log.append_stand_in(now, &m.topic, p, *qos, m.retain),
            None => self.log.append(now, &m.topic, &m.payload, m.qos, m.retain),
        };
        let offset = match appended {
            Ok(off) => off,
            Err(LogError::Full { .. }) => {
                self.set_backpressure(true, "the replay log is full");
                self.ingest.hold_again(m);
                return Ok(false);
            }
            Err(e) => return Err(e.into()),
        };
        let (payload, qos) = match stand_in {
            Some(s) => {
                self.stats.oversize += 1;
                s
            }
            None => (m.payload, m.qos),
        };
        let rec = Record {
            offset,
            received_at_ms: now,
            topic: m.topic,
            payload,
            qos,
            retain: m.retain,
        };
        let now = self.now();
        self.ingest.appended(rec, m.token, now);
        Ok(true)
    }

    fn set_backpressure(&mut self, on: bool, why: &str) {
        if self.ingest.set_backpressure(on) {
            self.backpressure_off_at = (!on).then(|| self.now());
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
            let began = self.now();
            self.log.commit()?;
            self.stats.log_commits += 1;
            let took = self.now().saturating_duration_since(began);
            self.metrics.update(|f| {
                f.log_commits += 1;
                f.log_commit.observe(took);
            });
        }
        failpoint("ingest.before_puback")?;
        self.send_acks()?;
        failpoint("ingest.after_puback")?;
        self.redeliver_let_go();
        // The records go on to processing; acks the MQTT module had no room for wait for
        // the next commit interval.
        let now = self.now();
        let mut applied = false;
        for rec in self.ingest.committed(now) {
            if !self.apply_live(rec.offset) {
                continue; // in the log: processed behind it (`behind`)
            }
            for outcome in self.proc.apply(&rec)? {
                if let Outcome::DeadLetter { reason } = outcome {
                    self.log_dead_letter(&rec, reason);
                }
            }
            let now = self.now();
            self.checkpointer.applied(now);
            applied = true;
        }
        if applied {
            // Upserts too leave at log-commit latency, one per key touched in this commit.
            self.proc.flush_upserts();
            // Before any checkpoint: its fsync must not delay results that need none.
            self.publish()?;
        }
        if self.checkpoint_size_due() {
            self.checkpoint()?;
        }
        Ok(())
    }

    /// Inputs were let go under backpressure and it has ended: once every ack before them is
    /// with the MQTT module, reconnect, so that the broker sends them again.
    fn redeliver_let_go(&mut self) {
        let settled = self
            .backpressure_off_at
            .is_some_and(|t| self.now() >= t + REDELIVER_SETTLE);
        if self.redeliver && settled && !self.ingest.acks_waiting() {
            self.redeliver = false;
            self.mqtt.reconnect();
        }
    }

    /// Acks go to the MQTT module in receipt order, as many as its queue takes. The rest wait
    /// here, still in order, for the next commit timer: a full queue (the broker sending
    /// faster than rumqttc takes requests) is load, not a reason to exit (found by
    /// tests/it/e2e.rs, where mosquitto 2.0.11 outran `max_inflight_messages`).
    fn send_acks(&mut self) -> Result<(), AgentError> {
        for t in self.ingest.acks_to_send(self.mqtt.ack_room()) {
            self.mqtt.ack(t)?;
            self.stats.acked += 1;
        }
        Ok(())
    }

    /// One journal line per dead letter, at most 10 per minute; the rest are counted and
    /// reported as suppressed (they are all in the store: `cairn inspect dead-letters`).
    fn log_dead_letter(&mut self, rec: &Record, reason: &str) {
        self.dead_letter_log
            .warn(self.clock.monotonic(), "dead letter", "suppressed", || {
                format!(
                    "dead letter: offset {} topic `{}` reason {reason} (see `cairn inspect \
                     dead-letters`)",
                    rec.offset, rec.topic
                )
            });
    }

    fn checkpoint(&mut self) -> Result<(), AgentError> {
        // At most one fsync outstanding: the previous checkpoint's first.
        self.settle_fsync(true)?;
        let began = self.now();
        let settled_below = self.publisher.settled_below();
        let done = self
            .proc
            .checkpoint_settled(self.clock.wall_ms(), settled_below);
        if let Err(e) = &done {
            self.metrics.update(|f| f.checkpoint_failures += 1);
            // Fatal by design: the engine is now ahead of the store; a restart replays.
            log::error!(
                "checkpoint failed: {e}; exiting so that recovery replays from the last checkpoint"
            );
        }
        let done = done?;
        let committed = done.is_some();
        if let Some((info, settled)) = done {
            self.stats.checkpoints += 1;
            self.stats.settled_early += settled;
            log::debug!("checkpoint {} at offset {}", info.id, info.next_offset);
            let took = self.now().saturating_duration_since(began);
            let floor = backfill::retention_floor(&self.proc.store().progress()?, &self.cfg);
            self.fsync.begin(info.next_offset, floor)?;
            self.after_checkpoint(took, &info);
        }
        self.checkpointer.checkpointed();
        // After a commit, retention runs once it is durable (`settle_fsync`); with nothing
        // to commit, it still runs by time.
        if !committed {
            self.retention()?;
        }
        Ok(())
    }

    /// A finished checkpoint fsync (`wait`: wait for the one in progress): the quarantine
    /// forgets what it settled, and retention may delete what it covers.
    fn settle_fsync(&mut self, wait: bool) -> Result<(), AgentError> {
        let settled = self.fsync.settle(wait);
        if let Err(e) = &settled {
            self.metrics.update(|f| f.checkpoint_failures += 1);
            log::error!(
                "checkpoint failed: {e}; exiting so that recovery replays from the last checkpoint"
            );
        }
        if let Some(next) = settled? {
            self.proc.synced(next);
            self.retention()?;
        }
        Ok(())
    }
}

impl Agent {
    /// The timers, in the order of the diagram: log commit, checkpoint, held input, publish;
    /// then the figures and the heap.
    fn tick(&mut self, force: bool) -> Result<(), AgentError> {
        self.settle_fsync(force)?;
        let now = self.now();
        if self
            .ingest
            .commit_due(now, self.cfg.log.commit_interval, force)
        {
            self.commit_log()?;
        }
        if self
            .checkpointer
            .due(now, self.cfg.checkpoint.interval, force)
        {
            self.checkpoint()?;
        }
        self.relieve_backpressure()?;
        self.redeliver_let_go();
        self.publish()?;
        self.refresh_metrics(force)?;
        self.refresh_uplink();
        let work = self.stats.checkpoints + self.stats.pubacked;
        if self.trim.take(now, work) {
            memory::return_free_memory();
            // And what the MQTT threads' allocation caches hold (`crate::alloc`).
            self.mqtt.rest();
            if let Some(u) = &self.uplink {
                u.mqtt.rest();
            }
        }
        Ok(())
    }

    fn relieve_backpressure(&mut self) -> Result<(), AgentError> {
        let relief = Checkpointer::relief(self.ingest.has_held(), || {
            (self.log.short_of_room(), self.proc.pending_records())
        });
        match relief {
            Relief::Nothing => {}
            Relief::Checkpoint => self.checkpoint()?,
            Relief::Retention => self.retention()?,
        }
        while let Some(m) = self.ingest.next_held() {
            if !self.append(m)? {
                return Ok(()); // the log is still full: held again
            }
        }
        self.set_backpressure(false, "");
        let let_go = self.ingest.take_let_go();
        if let_go > 0 {
            // The broker re-sends unacknowledged messages only on a new connection. The
            // MQTT thread writes the acks queued before this request first.
            self.stats.held_let_go += let_go;
            log::info!(
                "backpressure ended with {let_go} input(s) let go past the {HELD_LIMIT}-byte bound \
                 of held ones; once it has stayed off for {REDELIVER_SETTLE:?} the agent \
                 reconnects, so that the broker sends them again"
            );
            self.redeliver = true;
        }
        Ok(())
    }

    /// Send, in order and within the inflight window, the durable outbox entries from the
    /// cursor, then the outputs still waiting for their checkpoint (their inputs are durable
    /// in the log: see `publisher`).
    fn publish(&mut self) -> Result<(), AgentError> {
        let room = self
            .publisher
            .room(self.cfg.outbox.inflight, || self.results().inflight());
        if room == 0 {
            return Ok(());
        }
        let cursor = self.publisher.cursor();
        let mut batch: Vec<_> = self
            .proc
            .store()
            .outbox_from(cursor)
            .take(room)
            .map(|e| e.map(|(seq, out)| (seq, out, false)))
            .collect::<Result<_, _>>()?;
        // Then outputs still waiting for their checkpoint, from the cursor on: all newer
        // than any outbox entry.
        let pending = self.proc.pending_outputs();
        let from = pending.partition_point(|(seq, _)| *seq < cursor);
        let left = room - batch.len();
        batch.extend(
            pending[from..]
                .iter()
                .take(left)
                .map(|(s, o)| (*s, o.clone(), true)),
        );
        for (seq, out, fresh) in batch {
            failpoint("outbox.before_publish")?;
            let topic = self.result_topic(&out.topic);
            match self
                .results()
                .publish(out.id.clone(), &topic, out.payload, out.retain)
            {
                Ok(()) => {
                    self.publisher.sent(out.id, seq);
                    self.stats.published += 1;
                    if fresh && self.stats.published_early == 0 {
                        log::info!(
                            "publish: results now leave before their checkpoint (first: {})",
                            self.stats.published
                        );
                    }
                    self.stats.published_early += u64::from(fresh);
                    failpoint("outbox.after_publish")?;
                }
                Err(MqttError::InflightFull { .. }) => break,
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }
}
