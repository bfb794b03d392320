//! The agent: one event loop that owns its parts, hands each the IO it needs, and carries
//! out what they return (the sans-IO shape of quinn-proto and rustls).
//!
//! ```text
//!  mqtt thread ──Event──▶ loop: ingest appends to the log ─(group commit: fsync)─▶ PUBACK
//!                                 │                                        │ in order
//!                                 │            processor.apply(record) ◀───┘ (or the log
//!                                 │            holds it: work takes it back later)
//!                                 │            results: publish at once, in order
//!                                 │            keeper: checkpoint (sled tx + fsync beside)
//!                                 └──────────▶ results: what a PUBACK settles, deleted
//! ```
//!
//! The loop never waits on the MQTT thread: acks and publishes are queued without blocking
//! (the MQTT module polls rumqttc in its own thread). Timers use the monotonic clock; the
//! wall clock is read through the one [`Clock`] the agent was started with (times of
//! receipt through a [`crate::clock::ReceiptClock`] that never goes backwards).
//!
//! ## Parts
//!
//! Each part is a room: it owns its state, decides without reaching into the loop, and is
//! handed the IO it needs (the log, the processor, a connection) as arguments. No part
//! imports this file or calls back into it; the loop is the one `impl Agent`, and a new
//! concern is a new part (`tests/it/layering.rs` checks both).
//!
//! - `ingest`: group commit, acks in receipt order, held input and backpressure, the
//!   free-space guard, times of receipt.
//! - `results/`: the outbox room: what waits, each sink's cursor, what a PUBACK settles,
//!   the outbox bound, the uplink and its topic prefix (`results/mqtt.rs`).
//! - `work`: when catch-up or backfill takes a slice of the log (the one reader is the
//!   processor's, `processor/slice.rs`).
//! - `keeper/`: when a checkpoint is due, its commit and fsync beside the loop (the
//!   processor reads the one in flight as a layer), retention, savepoints,
//!   checkpoints waiting for disk room.
//! - `figures`: `/metrics`, the `STATUS=` line and the watchdog, dead-letter lines.
//! - `host`: Cairn as a Sparkplug B host: its STATE (will, online, offline before a clean
//!   stop) and rebirth requests for what the live loop's processing reported.
//! - `start`: recovery (the start plan is the processor's, `processor/plan.rs`);
//!   SIGHUP carries out `config::reload`'s plan (`Agent::reload`); `memory`: heap
//!   trimming; `error`: [`AgentError`].

mod error;
mod figures;
mod held_ids;
mod host;
mod ingest;
mod keeper;
mod memory;
mod results;
mod start;
mod work;

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::{Duration, Instant};

use crate::clock::Clock;
use crate::config::Config;
use crate::fsio::Durability;
use crate::log::Log;
use crate::metrics::Metrics;
use crate::model::Record;
use crate::mqtt::{Event, Events, Mqtt, Want};
use crate::pipeline::engine::Outcome;
use crate::processor::Processor;

pub use error::AgentError;
use error::failpoint;
use figures::{Figures, View};
use host::Host;
use ingest::Ingest;
use keeper::{CHECKPOINT_BYTES_PER_WRITE, Keeper, Relief, Schedule};
use results::Results;
pub(crate) use results::pipeline_of;
use work::{Next, Work};

/// Results a connected sink may still have to send before upserts are held back
/// (`Agent::flush_upserts`): at least four inflight windows.
const UPSERT_SLACK: u64 = 1024;

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

pub struct Agent {
    cfg: Config,
    log: Log,
    proc: Processor,
    /// The input connection (`[mqtt]`), and the one channel both connections' events
    /// arrive on.
    mqtt: Mqtt,
    events: Events,
    ingest: Ingest,
    results: Results,
    work: Work,
    keeper: Keeper,
    figures: Figures,
    /// Sparkplug B: STATE and rebirth requests.
    host: Host,
    /// The box's clocks, passed in so tests can step them.
    clock: Box<dyn Clock>,
}

impl Agent {
    /// Recover (truncate the torn tail, carry out the start plan, replay), then connect.
    pub fn start(cfg: Config, sync: Durability) -> Result<Agent, AgentError> {
        Agent::start_with_reset(cfg, sync, &[])
    }

    /// As [`Agent::start`], first resetting the named pipelines' state (see
    /// [`Processor::open_with`]).
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
        let mut s = start::recover(&cfg, &sync, reset, clock.as_ref())
            .map_err(|e| e.explain_disk_full(&dir))?;
        // What the replay at start reported was reported (or not) by the run that saw it
        // live: rebirth requests are for the live loop's.
        drop(s.proc.take_notices());
        Ok(Agent {
            cfg,
            log: s.log,
            proc: s.proc,
            mqtt: s.mqtt,
            events: s.events,
            ingest: s.ingest,
            results: s.results,
            work: s.work,
            keeper: s.keeper,
            figures: s.figures,
            host: s.host,
            clock,
        })
    }

    /// The figures `/metrics` serves.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.figures.metrics
    }

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
        while shutdown.requested() == 0 {
            let timeout = self.next_deadline().saturating_duration_since(self.now());
            let waited = (self.events).wait(self.want(), timeout.min(Duration::from_millis(100)));
            let woke = self.now();
            match waited {
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
                    if self.ingest.queue.batch_full(self.cfg.mqtt.ingest_batch) {
                        self.commit_log()?;
                    }
                }
                Err(_) => return Err(AgentError::MqttGone),
            }
            self.tick(false)?;
            // Upserts held back while a sink was behind, once it has caught up.
            if self.proc.upserts_waiting() && self.flush_upserts() {
                self.publish()?;
            }
            self.work_step()?;
            if crate::signals::take_reload() {
                self.reload();
            }
            let now = self.now();
            let (log, proc, ingest, results) = (&self.log, &self.proc, &self.ingest, &self.results);
            self.figures
                .heartbeat
                .beat(now, || figures::status_line(log, proc, ingest, results));
            self.figures.turn(now.saturating_duration_since(woke));
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
            messages: self
                .ingest
                .queue
                .messages_wanted(self.cfg.mqtt.ingest_batch),
            acks: usize::from(self.cfg.outbox.inflight / 2).max(1),
        }
    }

    /// Why processing must wait now, if it must: the outbox at its bound, or checkpoints
    /// waiting for disk room.
    fn hold(&self) -> Option<&'static str> {
        // Until the replay's debt is paid nothing leaves, so the outbox bound cannot hold.
        let full = match self.proc.owes_send_horizon() {
            true => None,
            false => Results::full(&self.cfg.outbox, &self.proc),
        };
        full.or(self
            .keeper
            .waiting_for_disk()
            .then_some("the disk is nearly full"))
    }

    /// The next timer: the group commit's or the checkpoint's, at most 100 ms away (a commit
    /// interval while publishes are in flight on a live connection); now, if a slice of the
    /// log is ready.
    fn next_deadline(&self) -> Instant {
        if self.work.ready(self.hold()) {
            return self.now();
        }
        let acks_may_wait = !self.results.idle() && self.results.connected();
        let far = self.now()
            + if acks_may_wait {
                self.cfg.log.commit_interval // see `want`
            } else {
                Duration::from_millis(100)
            };
        let a = self
            .ingest
            .queue
            .deadline(self.cfg.log.commit_interval)
            .unwrap_or(far);
        let b = self
            .keeper
            .schedule
            .deadline(self.cfg.checkpoint.interval)
            .unwrap_or(far);
        a.min(b)
    }

    fn on_event(&mut self, ev: Event) -> Result<(), AgentError> {
        match ev {
            Event::Message(m) => {
                self.host.saw(&m.topic, &m.payload, &self.mqtt);
                if let Some(m) = self.ingest.arrive(m, self.clock.monotonic()) {
                    self.ingest
                        .append(&mut self.log, m, &self.cfg, self.clock.as_ref())?;
                }
            }
            Event::PubAcked { output_id } => {
                if !self.host.acked(&output_id) {
                    self.results.acked(0, &output_id, &self.proc)?
                }
            }
            Event::Uplink(ev) => {
                let at = (self.clock.wall_ms(), self.now());
                if let Some(i) = self.results.uplink_index() {
                    self.results.on_sink_event(
                        i,
                        *ev,
                        &self.mqtt,
                        &self.proc,
                        &self.cfg.outbox,
                        at,
                    )?
                }
            }
            Event::Sink(n, ev) => {
                let at = (self.clock.wall_ms(), self.now());
                let i = self.results.sink_index(n);
                self.results
                    .on_sink_event(i, *ev, &self.mqtt, &self.proc, &self.cfg.outbox, at)?
            }
            // The input connection speaks 3.1.1: no such outcomes; only a thread sink's
            // events carry `SinkRejected` (always inside `Event::Sink`).
            Event::PubRefused { .. } | Event::TooLarge { .. } | Event::SinkRejected { .. } => {}
            Event::BrokerDrops(d) => {
                let now = self.now();
                self.figures.broker_drops(now, d);
            }
            Event::Connected { session_present } => {
                crate::event!(info, "input_connected";
                    "mqtt: connected to {}:{} (session present: {session_present})",
                    self.cfg.mqtt.host,
                    self.cfg.mqtt.port
                );
                self.results.input_link(true);
                self.host.link(true, &self.mqtt);
            }
            Event::Disconnected {
                reason,
                unacked,
                up_for,
            } => {
                let at = (self.clock.wall_ms(), self.now());
                self.results
                    .dropped(0, &unacked, up_for, &self.mqtt, &self.proc, at)?;
                if self.results.input_link(false) {
                    self.ingest.counts.reconnects += 1;
                }
                self.host.link(false, &self.mqtt);
                // Acks still queued for that connection are dropped by the MQTT module; the
                // broker redelivers those messages (DUP=1) and dedup by event ID drops them.
                crate::event!(warn, "input_disconnected"; "mqtt: disconnected: {reason}");
            }
        }
        Ok(())
    }

    /// Invariant 1: fsync, then PUBACK in receipt order (ingest), then process: each record
    /// now, or left in the log for `work` when processing must wait.
    fn commit_log(&mut self) -> Result<(), AgentError> {
        let records = self.ingest.commit(
            &mut self.log,
            &self.mqtt,
            &self.figures.metrics,
            self.clock.as_ref(),
        )?;
        let mut applied = false;
        for rec in records {
            let hold = self.hold();
            let now = self.now();
            if !self
                .work
                .live(rec.offset, self.proc.next_offset(), hold, now)
            {
                continue; // in the log: processed from there later (`work`)
            }
            self.apply(&rec)?;
            applied = true;
            // A commit may hold a whole queue's worth (`run_loop`): checked only after it,
            // `checkpoint.max_keys` bounded nothing with many pipelines, each record writing
            // one key per pipeline (16 pipelines: ~10,000 keys a checkpoint, peak RSS 109
            // MiB; issue 33).
            if self.checkpoint_size_due() {
                self.proc.flush_upserts();
                self.publish()?;
                self.checkpoint()?;
            }
        }
        if applied {
            // Upserts too leave at log-commit latency, one per key touched in this commit.
            self.flush_upserts();
            // Before any checkpoint: its fsync must not delay results that need none.
            self.publish()?;
        }
        if self.checkpoint_size_due() {
            self.checkpoint()?;
        }
        Ok(())
    }

    /// Apply one live record.
    fn apply(&mut self, rec: &Record) -> Result<(), AgentError> {
        let outcomes = self.proc.apply(rec)?;
        let now = self.now();
        if outcomes
            .iter()
            .any(|o| matches!(o, Outcome::DeadLetter { .. }))
        {
            self.figures.dead_letters_from(now, &self.proc, rec.offset);
        }
        self.keeper.schedule.applied(now);
        self.sparkplug_notices();
        Ok(())
    }

    /// What Sparkplug sessions reported while the live loop processed: to the host part.
    fn sparkplug_notices(&mut self) {
        let notices = self.proc.take_notices();
        if !notices.is_empty() {
            let (now, wall_ms) = (self.now(), self.clock.wall_ms());
            self.host.notices(notices, &self.mqtt, now, wall_ms);
        }
    }

    /// One slice of the log, if the `work` part's rule says so; then publish what it gave,
    /// and checkpoint if enough records wait for one (the timer covers the rest).
    fn work_step(&mut self) -> Result<(), AgentError> {
        let now = self.now();
        let hold = self.hold();
        let max = Work::slice_max(self.cfg.checkpoint.max_records);
        // A slice also stops at `checkpoint.max_keys` keys or `max_records` results (a reload
        // may have changed them).
        let c = &self.cfg.checkpoint;
        self.proc.set_batch_bound(c.max_keys, c.max_records);
        self.proc.set_send_slack(self.cfg.checkpoint.max_records);
        let from = self.proc.next_offset();
        let took = self
            .work
            .step(&mut self.proc, &self.log, (max, hold), now)?;
        if took.dead_letters {
            self.figures.dead_letters_from(now, &self.proc, from);
        }
        if took.taken > 0 {
            self.keeper.schedule.applied(now);
            self.sparkplug_notices();
        }
        match took.kind {
            Next::Backfill => {
                // Applied, not checkpointed: a crash here resumes at the last committed cursor.
                failpoint("backfill.after_slice")?;
            }
            Next::CatchUp if took.taken > 0 => {
                self.flush_upserts();
                self.publish()?;
            }
            _ => return Ok(()),
        }
        if self.checkpoint_size_due() {
            self.checkpoint()?;
        }
        Ok(())
    }

    /// Enough applied since the last checkpoint to take one now (`checkpoint.max_records`
    /// applied or results made, `checkpoint.max_keys`).
    fn checkpoint_size_due(&self) -> bool {
        Schedule::size_due(
            self.proc.pending_records(),
            self.proc.pending_keys(),
            self.proc.results_since_checkpoint(),
            &self.cfg.checkpoint,
        )
    }

    /// Take a checkpoint of everything applied (leaving out what the results' sinks have
    /// settled) and hand its commit and fsync to the keeper's thread: the loop goes on
    /// meanwhile (`keeper/commit.rs`). On a disk below the free-space reserve the checkpoint
    /// waits instead, and processing with it.
    fn checkpoint(&mut self) -> Result<(), AgentError> {
        // At most one checkpoint in flight: the previous one's first.
        self.settle_commit(true)?;
        let began = self.now();
        let writes = (self.proc.pending_results() as u64).saturating_add(self.proc.pending_keys());
        let bytes = writes.saturating_mul(CHECKPOINT_BYTES_PER_WRITE);
        if self.proc.pending_records() > 0 {
            if let Some(free) = self.ingest.room_for(began, bytes)? {
                let (dir, reserve) = self.ingest.space();
                let dir = dir.to_path_buf();
                self.keeper.disk_refused(began, free, &dir, reserve);
                return Ok(());
            }
            self.keeper.disk_room(began);
        }
        // Each sink's settled position goes into this checkpoint's transaction.
        self.proc
            .store()
            .stage_sink_positions(&self.results.positions())?;
        let results = &self.results;
        let begun = self
            .proc
            .begin_checkpoint(&|seq, out| results.settled(seq, out));
        let begun = self.failed_checkpoint(begun.map_err(AgentError::from))?;
        match begun {
            Some((cp, settled)) => {
                let floor = keeper::retention_floor(&cp.progress, &self.cfg);
                let taken = (self.clock.wall_ms(), began, settled);
                // sled's transaction locks the whole store while it runs: the loop stays
                // off it meanwhile (`keeper/commit.rs`).
                self.proc.store().hold_outbox_deletes(true)?;
                self.results.prefetch(&self.proc, cp.batch.outputs.len())?;
                let sent = self.keeper.commit(cp, floor, taken);
                self.failed_checkpoint(sent.map_err(AgentError::from))?;
            }
            // After a commit, retention runs once it is durable (`settle_commit`); with
            // nothing to commit, it still runs by time.
            None => self.retention()?,
        }
        self.keeper.schedule.checkpointed();
        Ok(())
    }

    /// A checkpoint that failed is fatal by design: the engine is then ahead of the store,
    /// and a restart replays. Counted and said before the agent exits.
    fn failed_checkpoint<T>(&self, r: Result<T, AgentError>) -> Result<T, AgentError> {
        if let Err(e) = &r {
            self.figures.metrics.update(|f| f.checkpoint_failures += 1);
            crate::event!(error, "checkpoint_failed";
                "checkpoint failed: {e}; exiting so that recovery replays from the last checkpoint"
            );
        }
        r
    }

    /// The checkpoint in flight, if it is done (`wait`: wait for it): committed and
    /// durable. The processor drops it as a read layer, the results room counts what it
    /// left waiting, the quarantine forgets what it settled, retention may delete what it
    /// covers, and a savepoint is taken if one is due.
    fn settle_commit(&mut self, wait: bool) -> Result<(), AgentError> {
        let done = self.keeper.commit_done(wait).map_err(AgentError::from);
        let Some((info, began, settled)) = self.failed_checkpoint(done)? else {
            return Ok(());
        };
        self.proc.store().hold_outbox_deletes(false)?;
        // Outputs acknowledged by every sink while their checkpoint committed went into the
        // outbox all the same: they leave it now.
        let acked: Vec<(u64, String)> = self.proc.inflight().map_or_else(Vec::new, |cp| {
            (cp.batch.outputs.iter())
                .filter(|(seq, out)| self.results.settled(*seq, out))
                .map(|(seq, out)| (*seq, out.id.clone()))
                .collect()
        });
        let outbox_end = self.proc.inflight().map(|cp| cp.progress.outbox_seq);
        let outputs = self
            .proc
            .inflight()
            .map_or(&[][..], |cp| &cp.batch.outputs[..]);
        self.results.checkpointed(settled, &self.proc, outputs)?;
        if let Some(cp) = self.proc.checkpoint_committed(&info) {
            self.keeper.release(cp);
        }
        self.proc.synced(info.next_offset);
        for (seq, id) in acked {
            self.proc.store().outbox_delete(seq, &id)?;
        }
        log::debug!("checkpoint {} at offset {}", info.id, info.next_offset);
        let took = self.now().saturating_duration_since(began);
        self.figures
            .checkpointed(took, &info, outbox_end, &self.proc, &self.log);
        self.retention()?;
        // No checkpoint is in flight and the store is exactly the one just made durable:
        // the one moment a savepoint is consistent. A failed one costs no data (the
        // checkpoint is durable, retention keeps the log back to the previous savepoint):
        // it is reported, and tried again next interval.
        let now = self.now();
        if self.keeper.schedule.savepoint_due_now(now) {
            let (figures, clock) = (&mut self.figures, &self.clock);
            let _ = self.keeper.take_savepoint(
                self.proc.store(),
                &self.cfg,
                &figures.metrics,
                now,
                &mut |n| {
                    figures.heartbeat.beat(clock.monotonic(), || {
                        format!("running: writing a savepoint ({n} entries so far)")
                    })
                },
            );
        }
        Ok(())
    }

    /// The keeper's retention, with the log, the store and the receipt clock.
    fn retention(&mut self) -> Result<(), AgentError> {
        if self.keeper.commit_in_flight() {
            // Retention may write a savepoint, which reads the store as one checkpoint: it
            // runs once the one in flight is done (`settle_commit` runs it then).
            return self.settle_commit(true);
        }
        let now = self.now();
        let receipt_ms = self.ingest.queue.receipt_now(self.clock.wall_ms(), now);
        let (figures, clock) = (&mut self.figures, &self.clock);
        self.keeper.retention(
            &mut self.log,
            self.proc.store(),
            &self.cfg,
            &figures.metrics,
            (receipt_ms, now),
            &mut |n| {
                figures.heartbeat.beat(clock.monotonic(), || {
                    format!("running: writing a savepoint ({n} entries so far)")
                })
            },
        )
    }

    /// The timers, in the order of the diagram: log commit, checkpoint, held input, publish;
    /// then the figures and the heap.
    fn tick(&mut self, force: bool) -> Result<(), AgentError> {
        self.settle_commit(force)?;
        let now = self.now();
        if self
            .ingest
            .queue
            .commit_due(now, self.cfg.log.commit_interval, force)
        {
            self.commit_log()?;
        }
        if self
            .keeper
            .schedule
            .due(now, self.cfg.checkpoint.interval, force)
        {
            self.checkpoint()?;
        }
        self.relieve_backpressure()?;
        self.ingest.redeliver_let_go(&self.mqtt, now);
        self.publish()?;
        self.host.tick(&self.mqtt);
        let sparkplug = self.host.figures.clone();
        self.figures.metrics.update(|f| f.sparkplug = sparkplug);
        let view = View {
            log: &self.log,
            proc: &self.proc,
            ingest: &self.ingest,
            results: &self.results,
            schedule: &mut self.keeper.schedule,
            now,
            wall_ms: self.clock.wall_ms(),
        };
        self.figures.refresh(force, view)?;
        let at = (self.clock.wall_ms(), now);
        self.results
            .refresh(&self.figures.metrics, &self.proc, &self.cfg.outbox, at);
        let work = self.keeper_work();
        if self.figures.trim.take(now, work) {
            memory::return_free_memory();
            // And what the MQTT threads' allocation caches hold (`crate::alloc`).
            self.mqtt.rest();
            self.results.rest();
        }
        if self.figures.trim.take_code(now, work) {
            match memory::reclaim_code_pages() {
                Ok(bytes) => log::debug!("asked the kernel to reclaim {bytes} bytes of code"),
                Err(e) => log::debug!("code pages not reclaimed: {e}"),
            }
        }
        Ok(())
    }

    /// Work done so far, for heap trimming: checkpoints and acknowledged results.
    fn keeper_work(&self) -> u64 {
        let f = self.figures.metrics.snapshot();
        f.checkpoints + self.results.counts.pubacked
    }

    /// Held input: first what the keeper's schedule says relieves it, then try it again.
    fn relieve_backpressure(&mut self) -> Result<(), AgentError> {
        let relief = Schedule::relief(self.ingest.queue.has_held(), || {
            (self.log.short_of_room(), self.proc.pending_records())
        });
        match relief {
            Relief::Nothing => return Ok(()),
            Relief::Checkpoint => self.checkpoint()?,
            Relief::Retention => self.retention()?,
        }
        self.ingest
            .retry_held(&mut self.log, &self.cfg, self.clock.as_ref())
    }

    /// Emit the upserts touched since the last flush, unless a connected sink is more than
    /// [`UPSERT_SLACK`] results behind: then they wait (each key's newest state replacing
    /// the last) until it has caught up, or the checkpoint, which emits them all. Returns
    /// whether it flushed.
    ///
    /// Flushed at every log commit whatever the sinks, a backlog drained over 16 pipelines
    /// emitted ~10 upserts per input, faster than a broker takes them: the sink then sent
    /// nearly every one (12.4 results per input published, processing waiting on the
    /// outbox's bound for 2/3 of the drain), where held back they replace each other (issue
    /// 33). Which versions are emitted was already a matter of when flushes fall; what an
    /// ID carries is not.
    fn flush_upserts(&mut self) -> bool {
        let slack = UPSERT_SLACK.max(4 * u64::from(self.cfg.outbox.inflight));
        if self.results.behind(self.proc.next_output_seq(), slack) {
            return false;
        }
        self.proc.flush_upserts();
        true
    }

    /// The results room sends what it can.
    fn publish(&mut self) -> Result<(), AgentError> {
        let now = self.now();
        self.results
            .publish(&self.proc, &self.mqtt, self.cfg.outbox.inflight, now)
    }

    /// SIGHUP: re-read the config file and carry out the plan `config::reload::plan` makes
    /// from the running and the new config: the keys whose table row says a SIGHUP applies
    /// them are copied and used; every other change is reported for a restart. A config
    /// with problems changes nothing. Pipelines never change here: a pipeline change takes
    /// effect at a checkpoint boundary, which the restart's start plan gives.
    fn reload(&mut self) {
        crate::notify::reloading();
        match crate::config::load(&self.cfg.source) {
            Err(e) => {
                crate::event!(error, "reload_failed"; "reload: {e}; keeping the running configuration")
            }
            Ok(new) => {
                let plan = crate::config::reload::plan(&self.cfg, &new);
                plan.apply(&mut self.cfg, &new);
                crate::logging::set_level(self.cfg.logging.level);
                self.log.set_max_size(self.cfg.log.max_size);
                if plan.applies("savepoint.interval") {
                    let (wall_ms, now) = (self.clock.wall_ms(), self.now());
                    self.keeper.reschedule_savepoints(&self.cfg, wall_ms, now);
                }
                if plan.restart.is_empty() {
                    crate::event!(info, "reload_applied";
                        "reload: {} ({})",
                        plan.describe(),
                        self.cfg.source.display()
                    );
                } else {
                    crate::event!(warn, "reload_needs_restart"; "reload: {}", plan.describe());
                }
            }
        }
        crate::notify::ready();
    }

    /// Shutdown. First signal: stop taking input, make everything durable, give the outbox
    /// a bounded time, exit. A second signal ends the wait at once; nothing is lost either
    /// way.
    fn drain(mut self, shutdown: &Shutdown) -> Result<(), AgentError> {
        crate::notify::stopping();
        crate::notify::status("stopping: draining");
        // First, so that edge nodes with this Primary Host start buffering at once.
        self.host.stop(&self.mqtt);
        crate::event!(info, "shutdown_draining";
            "shutdown: draining (log commit, checkpoint, outbox for up to {:?})",
            self.cfg.outbox.drain_timeout
        );
        self.tick(true)?;
        let deadline = self.now() + self.cfg.outbox.drain_timeout;
        while !self.results.idle() || self.results.unsent(&self.proc)? || !self.host.settled() {
            if shutdown.requested() >= 2 || self.now() >= deadline {
                break;
            }
            match self.events.recv_timeout(Duration::from_millis(20)) {
                Ok(Event::Message(_)) => {} // not acked: the broker redelivers after restart
                Ok(ev) => self.on_event(ev)?,
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
            }
            self.publish()?;
            self.host.tick(&self.mqtt);
            let now = self.now();
            self.figures
                .heartbeat
                .beat(now, || "stopping: publishing the outbox".into());
        }
        self.settle_commit(true)?;
        let left = self.proc.store().outbox_len();
        self.proc.store().sync()?;
        let c = &self.results.counts;
        crate::event!(info, "shutdown_done";
            "shutdown: done; {left} outbox entries left for the next start; {} results \
             published before their checkpoint, {} of them acknowledged before it",
            c.published_early,
            c.settled_early
        );
        self.figures.metrics.stop_server();
        self.results.shutdown();
        self.mqtt.shutdown();
        Ok(())
    }
}
