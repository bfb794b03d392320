//! Ingest: what was received and where it stands on the way to a PUBACK.
//!
//! A message is appended to the log, then waits here (its record and its ack) until the
//! group commit's fsync; only then are acks handed to the MQTT module, in receipt order
//! (invariant 1), and the records to the processor. While backpressure is on, messages are
//! held here unappended and unacknowledged, so the broker keeps them (invariant 7).
//!
//! No IO: the loop in `agent/mod.rs` appends, fsyncs and acks, and tells this part what
//! happened and what time it is. Generic over the ack token and the held message, so the
//! tests can drive it without a broker.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crate::clock::{Note, ReceiptClock};
use crate::model::{QOS_TOO_LARGE, Record, TooLarge};

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

pub(crate) struct Ingest<A, M> {
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
    /// Messages let go since the last [`Ingest::take_let_go`] because the held ones had
    /// reached `held_limit`.
    let_go: u64,
    backpressure: bool,
    /// Times of receipt: never backwards, across clock steps and restarts.
    receipt: ReceiptClock,
}

impl<A, M> Ingest<A, M> {
    /// `held_limit`: the bytes (by `size_of`) that messages held under backpressure may take;
    /// one message is always held, whatever its size.
    pub(crate) fn new(receipt: ReceiptClock, held_limit: usize, size_of: fn(&M) -> usize) -> Self {
        Ingest {
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
    /// connection (see [`Ingest::take_let_go`]). A broker is meant to stop at its inflight
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

    /// How many messages were let go since the last call (see [`Ingest::arrive`]): the
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

    fn ingest() -> Ingest<u32, &'static str> {
        Ingest::new(
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
        let mut i: Ingest<u32, &'static str> =
            Ingest::new(ReceiptClock::start(0, 1_000, Instant::now()).0, 5, |m| {
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
