//! Ingest: what was received and where it stands on the way to a PUBACK.
//!
//! A message is appended to the log, then waits here (its record and its ack) until the
//! group commit's fsync; only then are acks handed to the MQTT module, in receipt order
//! (invariant 1), and the records to processing. While backpressure is on (the log full,
//! the disk nearly full), messages are held here unappended and unacknowledged, so the
//! broker keeps them (invariant 7), up to [`HELD_LIMIT`] bytes; past it they are let go and
//! asked for again by a reconnect once backpressure has stayed off.
//!
//! [`Queue`] decides without IO (the tests drive it without a broker: it is generic over
//! the ack token and the held message); [`Ingest`] carries its decisions out with the log
//! and the input connection the loop hands it, and keeps the free-space guard
//! ([`crate::disk`]) that checkpoints consult too.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crate::clock::{Clock, Note, ReceiptClock};
use crate::config::Config;
use crate::disk::SpaceGuard;
use crate::log::{Log, LogError};
use crate::metrics::Metrics;
use crate::model::{QOS_TOO_LARGE, Record, TooLarge};
use crate::mqtt::{AckToken, Incoming, Mqtt};

use super::error::{AgentError, failpoint};
use super::held_ids::{Arrival, HeldIds};

/// The most that inputs held under backpressure may take, in bytes (topic, payload and
/// bookkeeping). Past it an input is let go, unacknowledged: the broker keeps it, and once
/// backpressure ends the agent reconnects so that the broker sends it again (issue 16: with
/// no bound, mosquitto 2.0.11 pushed 485k queued messages, 680 MiB, at an agent whose outbox
/// was full). A QoS 0 input let go is gone, as QoS 0 allows: the broker keeps nothing for
/// it, and holding QoS 0 without bound is what the bound is against.
pub(crate) const HELD_LIMIT: usize = 4 << 20;

/// What a held message takes besides its topic and payload: the message, its ack token
/// and its queue slot, rounded up.
const HELD_OVERHEAD: usize = 96;

/// How long backpressure must stay off before the agent reconnects for inputs it let go:
/// every reconnect makes the broker re-send all it has not had acknowledged, and a
/// backpressure that comes and goes would otherwise ask for that again and again.
const REDELIVER_SETTLE: Duration = Duration::from_secs(2);

/// What ingest counts, for `/metrics` and the `STATUS=` line.
#[derive(Debug, Clone, Default)]
pub(crate) struct Counts {
    pub(crate) received: u64,
    pub(crate) acked: u64,
    pub(crate) log_commits: u64,
    /// Inputs over `log.max_payload`, logged as `too_large` stand-ins.
    pub(crate) oversize: u64,
    /// Inputs let go under backpressure (see [`HELD_LIMIT`]), or under a packet id the
    /// broker reused while an earlier input held it (see [`super::held_ids`]).
    pub(crate) held_let_go: u64,
    pub(crate) reconnects: u64,
}

/// The ingest part: the [`Queue`], the free-space guard, and what backpressure left to do.
pub(crate) struct Ingest {
    pub(crate) queue: Queue<AckToken, Incoming>,
    /// Free space under the log and the store: below the reserve, stop acking (invariant 7)
    /// and let checkpoints wait.
    space: SpaceGuard,
    /// Inputs were let go under backpressure: reconnect once it has stayed off for
    /// [`REDELIVER_SETTLE`] and the acks before them are out.
    redeliver: bool,
    /// When backpressure last went off (`None` while on).
    backpressure_off_at: Option<Instant>,
    /// The packet ids of inputs received on this connection and not yet acknowledged.
    held_ids: HeldIds,
    pub(crate) counts: Counts,
}

impl Ingest {
    /// `receipt`: the receipt clock as recovery left it; `space`: the guard over the log's
    /// and the store's directories.
    pub(crate) fn new(receipt: ReceiptClock, space: SpaceGuard) -> Ingest {
        Ingest {
            queue: Queue::new(receipt, HELD_LIMIT, |m| {
                m.topic.len() + m.payload.len() + HELD_OVERHEAD
            }),
            space,
            redeliver: false,
            backpressure_off_at: None,
            held_ids: HeldIds::new(),
            counts: Counts::default(),
        }
    }

    /// A message arrived: `Some` to append now, `None` if held (or let go).
    pub(crate) fn arrive(&mut self, m: Incoming, now: Instant) -> Option<Incoming> {
        self.counts.received += 1;
        if let Some(id) = m.token.held_as()
            && let Arrival::Reused { first } = self.held_ids.arrive(id)
        {
            // Its ack would remove the earlier input under this id from the broker (see
            // `held_ids`): let it go; the reconnect brings both again.
            self.counts.held_let_go += 1;
            self.redeliver = true;
            if !self.queue.backpressure() {
                self.backpressure_off_at.get_or_insert(now);
            }
            if first {
                crate::event!(warn, "mqtt_packet_id_reused";
                    "the broker sent an input under packet id {} while an earlier one it holds \
                     for us, unacknowledged, has it (mosquitto 2.0.11 reuses ids past 65,535 \
                     unacknowledged messages): let go, and the agent reconnects so that \
                     the broker sends both again; acknowledging it would drop the earlier one",
                    id.1
                );
            }
            return None;
        }
        self.queue.arrive(m)
    }

    /// Append one message; false (and it is held) when the log or the disk is full.
    pub(crate) fn append(
        &mut self,
        log: &mut Log,
        m: Incoming,
        cfg: &Config,
        clock: &dyn Clock,
    ) -> Result<bool, AgentError> {
        // A nearly full disk is backpressure too: an ENOSPC would poison the log and stop
        // the agent. 64 bytes cover the frame header and the record's other fields.
        let bytes = (m.topic.len() + m.payload.len()) as u64 + 64;
        let at = clock.monotonic();
        if let Some(free) = self.space.check(at, bytes)? {
            let why = format!(
                "the disk is nearly full: {free} bytes free under {}, below the reserve of {} \
                 bytes (2 × log.segment_size)",
                self.space.lowest_dir().display(),
                self.space.reserve()
            );
            self.set_backpressure(true, &why, at);
            self.queue.hold_again(m);
            return Ok(false);
        }
        let (now, note) = self.queue.stamp(clock.wall_ms(), clock.monotonic());
        if let Some(note) = note {
            log_clock_note(cfg, &note);
        }
        let stand_in = stand_in(&m.payload, m.qos, cfg.log.max_payload);
        let appended = match &stand_in {
            Some((p, qos)) => log.append_stand_in(now, &m.topic, p, *qos, m.retain),
            None => log.append(now, &m.topic, &m.payload, m.qos, m.retain),
        };
        let offset = match appended {
            Ok(off) => off,
            Err(LogError::Full { .. }) => {
                self.set_backpressure(true, "the replay log is full", at);
                self.queue.hold_again(m);
                return Ok(false);
            }
            Err(e) => return Err(e.into()),
        };
        let (payload, qos) = match stand_in {
            Some(s) => {
                self.counts.oversize += 1;
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
        self.queue.appended(rec, m.token, clock.monotonic());
        Ok(true)
    }

    fn set_backpressure(&mut self, on: bool, why: &str, now: Instant) {
        if self.queue.set_backpressure(on) {
            self.backpressure_off_at = (!on).then_some(now);
            if on {
                crate::event!(warn, "backpressure_on"; "backpressure on: {why}; not acknowledging, the broker queues");
            } else {
                crate::event!(info, "backpressure_off"; "backpressure off: acknowledging again");
            }
        }
    }

    /// Invariant 1: fsync, then PUBACK in receipt order; the committed records come back for
    /// processing.
    pub(crate) fn commit(
        &mut self,
        log: &mut Log,
        mqtt: &Mqtt,
        metrics: &Metrics,
        clock: &dyn Clock,
    ) -> Result<Vec<Record>, AgentError> {
        // A deliberately unsafe build acks first, to show the crash harness catches it.
        let unsafe_early_ack = crate::failpoint::enabled("unsafe.ack_before_fsync");
        if unsafe_early_ack {
            self.send_acks(mqtt)?;
            // Hold the window open as a slow flash write would, so that a cut in the harness
            // lands inside it often enough to be seen, rather than once in a few hundred.
            std::thread::sleep(Duration::from_millis(25));
        }
        if log.pending() > 0 {
            let began = clock.monotonic();
            log.commit()?;
            self.counts.log_commits += 1;
            let took = clock.monotonic().saturating_duration_since(began);
            metrics.update(|f| {
                f.log_commits += 1;
                f.log_commit.observe(took);
            });
        }
        failpoint("ingest.before_puback")?;
        self.send_acks(mqtt)?;
        failpoint("ingest.after_puback")?;
        let now = clock.monotonic();
        self.redeliver_let_go(mqtt, now);
        // The records go on to processing; acks the MQTT module had no room for wait for
        // the next commit interval.
        Ok(self.queue.committed(now))
    }

    /// Acks go to the MQTT module in receipt order, as many as its queue takes. The rest wait
    /// here, still in order, for the next commit timer: a full queue (the broker sending
    /// faster than rumqttc takes requests) is load, not a reason to exit (found by
    /// tests/it/e2e.rs, where mosquitto 2.0.11 outran `max_inflight_messages`).
    fn send_acks(&mut self, mqtt: &Mqtt) -> Result<(), AgentError> {
        for t in self.queue.acks_to_send(mqtt.ack_room()) {
            if let Some(id) = t.held_as() {
                self.held_ids.acked(id);
            }
            mqtt.ack(t)?;
            self.counts.acked += 1;
        }
        Ok(())
    }

    /// Inputs were let go under backpressure and it has ended: once every ack before them is
    /// with the MQTT module, reconnect, so that the broker sends them again.
    pub(crate) fn redeliver_let_go(&mut self, mqtt: &Mqtt, now: Instant) {
        let settled = self
            .backpressure_off_at
            .is_some_and(|t| now >= t + REDELIVER_SETTLE);
        if self.redeliver && settled && !self.queue.acks_waiting() {
            self.redeliver = false;
            mqtt.reconnect();
        }
    }

    /// Try the held messages again, oldest first (the caller has done what
    /// [`super::keeper::Relief`] asked); backpressure ends once all are in the log.
    pub(crate) fn retry_held(
        &mut self,
        log: &mut Log,
        cfg: &Config,
        clock: &dyn Clock,
    ) -> Result<(), AgentError> {
        while let Some(m) = self.queue.next_held() {
            if !self.append(log, m, cfg, clock)? {
                return Ok(()); // still no room: held again
            }
        }
        self.set_backpressure(false, "", clock.monotonic());
        let let_go = self.queue.take_let_go();
        if let_go > 0 {
            // The broker re-sends unacknowledged messages only on a new connection. The
            // MQTT thread writes the acks queued before this request first.
            self.counts.held_let_go += let_go;
            crate::event!(info, "held_inputs_let_go";
                "backpressure ended with {let_go} input(s) let go past the {HELD_LIMIT}-byte bound \
                 of held ones; once it has stayed off for {REDELIVER_SETTLE:?} the agent \
                 reconnects, so that the broker sends them again"
            );
            self.redeliver = true;
        }
        Ok(())
    }

    /// Whether `bytes` more may be written to the store now (a checkpoint): `Some(free)`
    /// when that would leave less than the reserve.
    pub(crate) fn room_for(&mut self, now: Instant, bytes: u64) -> Result<Option<u64>, AgentError> {
        Ok(self.space.check(now, bytes)?)
    }

    /// The guard's reserve and the directory with the least room, for the journal.
    pub(crate) fn space(&self) -> (&std::path::Path, u64) {
        (self.space.lowest_dir(), self.space.reserve())
    }
}

/// Put a clock note in the journal, with what it means for this configuration.
pub(crate) fn log_clock_note(cfg: &Config, note: &Note) {
    use crate::clock::{human_ms, utc_ms};
    match *note {
        Note::BehindRecorded {
            wall_ms,
            recorded_ms,
        } => crate::event!(warn, "clock_behind";
            "clock: the wall clock ({}) is behind the newest time of receipt already recorded \
             ({}): it was set back, or the box booted with a stale clock. New records are \
             stamped from {} on at the monotonic clock's rate until the wall clock catches up, \
             so times of receipt never go backwards",
            utc_ms(wall_ms),
            utc_ms(recorded_ms),
            utc_ms(recorded_ms)
        ),
        Note::SteppedBack { by_ms } => crate::event!(warn, "clock_stepped_back";
            "clock: the wall clock stepped back by {}; times of receipt go on from the last one \
             at the monotonic clock's rate until it catches up, so windows by time of receipt \
             and the dedup window keep their real pace",
            human_ms(by_ms)
        ),
        Note::CaughtUp => {
            crate::event!(info, "clock_caught_up";
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
    crate::event!(warn, "clock_stepped_forward";
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

/// Slots a queue here keeps once it is empty again. A burst can grow one far beyond that:
/// mosquitto 2.0.11 sends a queued backlog without waiting for acks, and draining 1M queued
/// inputs left 16 MiB of ack tokens' room behind, a quarter of the agent's RSS at rest
/// (issue 16).
const KEEP_EMPTY: usize = 4096;

/// Give back an empty queue's room beyond [`KEEP_EMPTY`].
fn shrink_if_empty<T>(q: &mut VecDeque<T>) {
    if q.is_empty() && q.capacity() > KEEP_EMPTY {
        *q = VecDeque::new();
    }
}

pub(crate) struct Queue<A, M> {
    /// Appended but not yet committed: their acks and records, in receipt order.
    unsynced_acks: VecDeque<A>,
    unsynced_recs: Vec<Record>,
    /// When the oldest of them (or an ack with no room in the MQTT queue) began to wait.
    first_unsynced: Option<Instant>,
    /// Messages received while the log or the disk is full; not appended, not
    /// acked.
    held: VecDeque<M>,
    /// Their bytes, by `size_of`, and the most they may take.
    held_bytes: usize,
    held_limit: usize,
    size_of: fn(&M) -> usize,
    /// Messages let go since the last [`Queue::take_let_go`] because the held ones had
    /// reached `held_limit`.
    let_go: u64,
    backpressure: bool,
    /// Times of receipt: never backwards, across clock steps and restarts.
    receipt: ReceiptClock,
}

impl<A, M> Queue<A, M> {
    /// `held_limit`: the bytes (by `size_of`) that messages held under backpressure may take;
    /// one message is always held, whatever its size.
    pub(crate) fn new(receipt: ReceiptClock, held_limit: usize, size_of: fn(&M) -> usize) -> Self {
        Queue {
            unsynced_acks: VecDeque::new(),
            unsynced_recs: Vec::new(),
            first_unsynced: None,
            held: VecDeque::new(),
            held_bytes: 0,
            held_limit,
            size_of,
            let_go: 0,
            backpressure: false,
            receipt,
        }
    }

    /// A message arrived. Under backpressure it is held (behind those held before it, so
    /// receipt order is kept) and `None` comes back; otherwise it is the loop's to append.
    ///
    /// Once the held messages take `held_limit` bytes, a newer one is let go: neither
    /// appended nor acknowledged, so the broker still has it and sends it again on the next
    /// connection (see [`Queue::take_let_go`]). A broker is meant to stop at its inflight
    /// window, but mosquitto 2.0.11 sends a queued backlog without waiting for acks: with
    /// the outbox full, the agent held 485k messages, 680 MiB (issue 16).
    pub(crate) fn arrive(&mut self, m: M) -> Option<M> {
        if !self.backpressure {
            return Some(m);
        }
        let size = (self.size_of)(&m);
        if !self.held.is_empty() && self.held_bytes.saturating_add(size) > self.held_limit {
            self.let_go += 1;
            return None;
        }
        self.held_bytes = self.held_bytes.saturating_add(size);
        self.held.push_back(m);
        None
    }

    /// The log or the disk had no room for `m`: it goes back to the front of the queue.
    pub(crate) fn hold_again(&mut self, m: M) {
        self.held_bytes = self.held_bytes.saturating_add((self.size_of)(&m));
        self.held.push_front(m);
    }

    /// The oldest held message, to try appending again.
    pub(crate) fn next_held(&mut self) -> Option<M> {
        let m = self.held.pop_front();
        if let Some(m) = &m {
            self.held_bytes = self.held_bytes.saturating_sub((self.size_of)(m));
        }
        shrink_if_empty(&mut self.held);
        m
    }

    /// How many messages were let go since the last call (see [`Queue::arrive`]): the
    /// broker re-sends them only on a new connection.
    pub(crate) fn take_let_go(&mut self) -> u64 {
        std::mem::take(&mut self.let_go)
    }

    pub(crate) fn has_held(&self) -> bool {
        !self.held.is_empty()
    }

    /// Turn backpressure on or off; `true` when that is a change (the loop says so once in
    /// the journal, not for every message).
    pub(crate) fn set_backpressure(&mut self, on: bool) -> bool {
        let changed = on != self.backpressure;
        self.backpressure = on;
        changed
    }

    pub(crate) fn backpressure(&self) -> bool {
        self.backpressure
    }

    /// The time of receipt for a new record, from the box's clocks.
    pub(crate) fn stamp(&mut self, wall_ms: u64, monotonic: Instant) -> (u64, Option<Note>) {
        self.receipt.stamp(wall_ms, monotonic)
    }

    /// The receipt clock's reading now, without stamping (for ageing log segments).
    pub(crate) fn receipt_now(&self, wall_ms: u64, monotonic: Instant) -> u64 {
        self.receipt.peek(wall_ms, monotonic)
    }

    /// `rec` is in the log (not yet fsynced); `ack` goes out after the next commit.
    pub(crate) fn appended(&mut self, rec: Record, ack: A, now: Instant) {
        self.unsynced_recs.push(rec);
        self.unsynced_acks.push_back(ack);
        self.first_unsynced.get_or_insert(now);
    }

    /// How many new messages are worth waking the loop for: those that fill the group
    /// commit under way, or the first one when none is (it starts the commit's timer, and a
    /// lone message must not wait for anything else), or any one while messages are held.
    pub(crate) fn messages_wanted(&self, ingest_batch: usize) -> usize {
        if self.first_unsynced.is_none() || self.backpressure || !self.held.is_empty() {
            return 1;
        }
        ingest_batch.saturating_sub(self.unsynced_acks.len()).max(1)
    }

    /// A full group: commit now rather than at the timer.
    pub(crate) fn batch_full(&self, ingest_batch: usize) -> bool {
        self.unsynced_acks.len() >= ingest_batch
    }

    /// Whether the group commit is due: `interval` after the first message began to wait,
    /// or at once when `force`d (shutdown), and only if something waits.
    pub(crate) fn commit_due(&self, now: Instant, interval: Duration, force: bool) -> bool {
        self.first_unsynced
            .is_some_and(|t| force || now >= t + interval)
    }

    /// When the group commit timer fires, if anything waits.
    pub(crate) fn deadline(&self, interval: Duration) -> Option<Instant> {
        self.first_unsynced.map(|t| t + interval)
    }

    /// The acks to hand to the MQTT module now, oldest first, at most `room` (what its queue
    /// takes); the rest keep their place.
    pub(crate) fn acks_to_send(
        &mut self,
        room: usize,
    ) -> std::collections::vec_deque::Drain<'_, A> {
        let n = room.min(self.unsynced_acks.len());
        self.unsynced_acks.drain(..n)
    }

    /// Whether acks wait here: appended and not yet committed, or left over for lack of room.
    pub(crate) fn acks_waiting(&self) -> bool {
        !self.unsynced_acks.is_empty()
    }

    /// The log commit is done and the acks that had room are out: the records go to the
    /// processor. Acks left over (a full MQTT queue) are retried one commit interval from
    /// `now`.
    pub(crate) fn committed(&mut self, now: Instant) -> Vec<Record> {
        self.first_unsynced = (!self.unsynced_acks.is_empty()).then_some(now);
        shrink_if_empty(&mut self.unsynced_acks);
        std::mem::take(&mut self.unsynced_recs)
    }
}

/// What the log keeps for a payload over `max_payload`: a small stand-in (size, limit and a
/// prefix) with the `too_large` flag on its QoS byte, which processing turns into a
/// `too_large` dead letter (invariant 8: refused input is durable before its PUBACK, like any
/// other). `None`: the payload fits and is kept as it is.
pub(crate) fn stand_in(payload: &[u8], qos: u8, max_payload: u64) -> Option<(Vec<u8>, u8)> {
    (payload.len() as u64 > max_payload)
        .then(|| (TooLarge::encode(payload, max_payload), qos | QOS_TOO_LARGE))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ingest() -> Queue<u32, &'static str> {
        Queue::new(
            ReceiptClock::start(0, 1_000, Instant::now()).0,
            usize::MAX,
            |m| m.len(),
        )
    }

    fn rec(offset: u64) -> Record {
        Record {
            offset,
            received_at_ms: 1_000,
            topic: "t".into(),
            payload: vec![],
            qos: 1,
            retain: false,
        }
    }

    #[test]
    fn acks_leave_in_receipt_order_and_only_as_many_as_there_is_room_for() {
        let mut i = ingest();
        let t0 = Instant::now();
        for n in 0..5 {
            i.appended(rec(n), n as u32, t0);
        }
        assert_eq!(i.acks_to_send(2).collect::<Vec<_>>(), vec![0, 1]);
        assert_eq!(i.acks_to_send(10).collect::<Vec<_>>(), vec![2, 3, 4]);
        assert_eq!(i.acks_to_send(10).count(), 0);
    }

    #[test]
    fn the_group_commit_is_due_an_interval_after_the_first_message_waits() {
        let mut i = ingest();
        let t0 = Instant::now();
        let every = Duration::from_millis(5);
        assert!(!i.commit_due(t0 + every * 10, every, true), "nothing waits");
        assert_eq!(i.deadline(every), None);
        i.appended(rec(0), 0, t0);
        i.appended(rec(1), 1, t0 + every);
        assert_eq!(i.deadline(every), Some(t0 + every), "timed from the first");
        assert!(!i.commit_due(t0, every, false));
        assert!(i.commit_due(t0, every, true), "forced at shutdown");
        assert!(i.commit_due(t0 + every, every, false));
    }

    #[test]
    fn the_loop_wakes_for_a_first_message_and_then_for_what_fills_the_group() {
        let mut i = ingest();
        let t0 = Instant::now();
        assert_eq!(
            i.messages_wanted(20),
            1,
            "nothing waits: the first one starts the timer"
        );
        i.appended(rec(0), 0, t0);
        i.appended(rec(1), 1, t0);
        assert_eq!(i.messages_wanted(20), 18, "what fills the group");
        assert_eq!(i.messages_wanted(2), 1, "full: never zero");
        i.set_backpressure(true);
        assert_eq!(i.messages_wanted(20), 1, "under backpressure, each one");
        i.set_backpressure(false);
        let _ = i.acks_to_send(10).count();
        let _ = i.committed(t0);
        assert_eq!(
            i.messages_wanted(20),
            1,
            "committed: the next one starts a new group"
        );
    }

    #[test]
    fn a_full_batch_commits_without_waiting_for_the_timer() {
        let mut i = ingest();
        let t0 = Instant::now();
        i.appended(rec(0), 0, t0);
        assert!(!i.batch_full(2));
        i.appended(rec(1), 1, t0);
        assert!(i.batch_full(2));
    }

    #[test]
    fn after_a_commit_the_records_go_on_and_acks_without_room_wait_one_more_interval() {
        let mut i = ingest();
        let (t0, t1) = (Instant::now(), Instant::now() + Duration::from_secs(1));
        let every = Duration::from_millis(5);
        for n in 0..3 {
            i.appended(rec(n), n as u32, t0);
        }
        assert_eq!(i.acks_to_send(1).count(), 1);
        let recs = i.committed(t1);
        assert_eq!(recs.iter().map(|r| r.offset).collect::<Vec<_>>(), [0, 1, 2]);
        assert_eq!(i.deadline(every), Some(t1 + every), "two acks still wait");
        assert_eq!(i.acks_to_send(5).count(), 2);
        assert!(i.committed(t1).is_empty());
        assert_eq!(i.deadline(every), None, "nothing waits");
    }

    #[test]
    fn a_queue_a_burst_grew_gives_its_room_back_once_empty() {
        let mut i = ingest();
        let t0 = Instant::now();
        for n in 0..100_000 {
            i.appended(rec(n), n as u32, t0);
        }
        assert_eq!(i.acks_to_send(usize::MAX).count(), 100_000);
        assert_eq!(i.committed(t0).len(), 100_000);
        assert!(i.unsynced_acks.capacity() <= KEEP_EMPTY);
        i.set_backpressure(true);
        for _ in 0..100_000 {
            i.arrive("m");
        }
        while i.next_held().is_some() {}
        assert!(i.held.capacity() <= KEEP_EMPTY);
    }

    #[test]
    fn under_backpressure_messages_are_held_in_order_and_a_refused_one_goes_first() {
        let mut i = ingest();
        assert_eq!(i.arrive("a"), Some("a"), "no backpressure: append now");
        assert!(i.set_backpressure(true), "a change");
        assert!(!i.set_backpressure(true), "not a change");
        assert_eq!(i.arrive("b"), None);
        assert_eq!(i.arrive("c"), None);
        i.hold_again("a");
        assert!(i.has_held());
        assert!(i.backpressure());
        let order: Vec<_> = std::iter::from_fn(|| i.next_held()).collect();
        assert_eq!(order, ["a", "b", "c"]);
        assert!(i.set_backpressure(false));
        assert_eq!(i.arrive("d"), Some("d"));
    }

    #[test]
    fn held_messages_past_the_limit_are_let_go_and_counted_and_one_is_always_held() {
        let mut i: Queue<u32, &'static str> =
            Queue::new(ReceiptClock::start(0, 1_000, Instant::now()).0, 5, |m| {
                m.len()
            });
        i.set_backpressure(true);
        assert_eq!(i.arrive("toolong"), None, "held: nothing else is");
        assert_eq!(i.arrive("a"), None, "let go: over the limit");
        assert_eq!(i.take_let_go(), 1);
        assert_eq!(i.take_let_go(), 0, "taken");
        assert_eq!(i.next_held(), Some("toolong"));
        for m in ["ab", "cd", "e", "f", "g"] {
            i.arrive(m);
        }
        assert_eq!(i.take_let_go(), 2, "ab cd e fill 5 bytes");
        i.hold_again("xyz");
        let order: Vec<_> = std::iter::from_fn(|| i.next_held()).collect();
        assert_eq!(order, ["xyz", "ab", "cd", "e"]);
        assert_eq!(i.held_bytes, 0, "every byte given back");
        assert_eq!(i.arrive("abcde"), None, "the whole limit again");
        assert_eq!(i.take_let_go(), 0);
    }

    #[test]
    fn times_of_receipt_never_go_back_when_the_wall_clock_does() {
        let mut i = ingest();
        let t0 = Instant::now();
        let (a, _) = i.stamp(10_000_000, t0);
        let (b, note) = i.stamp(2_000, t0 + Duration::from_millis(10));
        assert!(b >= a, "{b} < {a}");
        assert!(note.is_some(), "a step back is reported");
        assert!(i.receipt_now(0, t0 + Duration::from_millis(10)) >= b);
    }

    #[test]
    fn only_a_payload_over_the_limit_becomes_a_flagged_stand_in() {
        assert_eq!(stand_in(&[7; 10], 1, 10), None);
        let (p, qos) = stand_in(&[7; 11], 1, 10).unwrap();
        assert_eq!(qos, 1 | QOS_TOO_LARGE);
        assert_eq!(p, TooLarge::encode(&[7; 11], 10));
    }
}
