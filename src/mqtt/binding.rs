//! Packet-id binding for our own QoS 1 publishes: a pure state machine, no IO.
//!
//! rumqttc's `publish()` does not return the packet id it will use (DESIGN §4). The event
//! loop tells us afterwards, in order: `Outgoing::Publish(pkid)` when a PUBLISH goes on the
//! wire, `Incoming::PubAck(pkid)` when the broker acknowledges it. So we keep our output IDs
//! in the order we handed them to rumqttc, and the next *new* `Outgoing::Publish` binds the
//! front one.
//!
//! The guarantees, each checked by a unit test below:
//! - An output ID is bound to at most one pkid, and resolved (returned by [`Publishes::on_puback`])
//!   at most once (`a_retransmit_does_not_consume_the_fifo`).
//! - A retransmission (`Outgoing::Publish` for a pkid that is still bound) never consumes the
//!   FIFO (`a_retransmit_does_not_consume_the_fifo`).
//! - On every new connection, with the broker's session or without it, every publish that
//!   rumqttc held is queued again, in the original order, ahead of anything not yet handed
//!   over (`a_lost_session_requeues_in_order`): rumqttc's own re-send follows packet ids, not
//!   publish order (`worker.rs`, `on_connack`). Nothing is dropped while the process lives;
//!   [`Publishes::len`] is unchanged by it.
//! - A collision (rumqttc's `AwaitAck`: a broker that acks out of order, or a window that
//!   wrapped onto an id in flight because a SUBSCRIBE took one) parks the front entry until
//!   rumqttc sends it under that pkid (`a_collision_binds_the_parked_entry`).

use std::collections::{HashMap, VecDeque};

/// One of our publishes, kept until the broker acknowledges it (so it can be re-sent).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct OutPublish {
    /// Position in `publish()` order; restores that order on a new connection.
    pub seq: u64,
    pub output_id: String,
    pub topic: String,
    pub payload: Vec<u8>,
    pub retain: bool,
}

/// Where a publish given up by the caller was inside rumqttc ([`Publishes::remove_handed`]):
/// what must go from rumqttc's retransmission queue with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Handed {
    /// Written under this packet id.
    Bound(u16),
    /// The `n`th (from 0) of the publishes handed to rumqttc without a packet id yet.
    Unbound(usize),
    /// rumqttc's parked collision.
    Collided,
}

/// What an `Outgoing::Publish(pkid)` meant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Sent {
    /// A first transmission: the pkid now names this output ID.
    Bound(String),
    /// rumqttc re-sent a pkid that is still bound (after a reconnect with a session).
    Retransmit,
    /// Nothing was waiting for a pkid: a bug in this module or in rumqttc.
    Unexpected,
}

#[derive(Debug, Default)]
pub(crate) struct Publishes {
    next_seq: u64,
    /// Accepted by `publish()`, not yet handed to rumqttc.
    to_send: VecDeque<OutPublish>,
    /// Handed to rumqttc, no pkid seen yet; front = oldest.
    unbound: VecDeque<OutPublish>,
    /// Taken by rumqttc but parked on a pkid collision (`Outgoing::AwaitAck(pkid)`).
    collided: Option<(u16, OutPublish)>,
    /// On the wire (or queued for retransmission inside rumqttc), awaiting PUBACK.
    bound: HashMap<u16, OutPublish>,
}

impl Publishes {
    /// Publishes accepted and not yet acknowledged, wherever they are.
    pub fn len(&self) -> usize {
        self.to_send.len()
            + self.unbound.len()
            + self.bound.len()
            + self.collided.is_some() as usize
    }

    pub fn accept(&mut self, output_id: String, topic: String, payload: Vec<u8>, retain: bool) {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.to_send.push_back(OutPublish {
            seq,
            output_id,
            topic,
            payload,
            retain,
        });
    }

    /// The next publish to hand to rumqttc, if any.
    pub(crate) fn next_to_hand(&self) -> Option<&OutPublish> {
        self.to_send.front()
    }

    /// Takes [`Self::next_to_hand`] out for good: it will not be sent (too large for the
    /// broker, or ruled out by its CONNACK), and the caller hears so.
    pub(crate) fn take_next(&mut self) -> Option<OutPublish> {
        self.to_send.pop_front()
    }

    /// Forgets a publish not handed to rumqttc yet; whether it was there.
    pub(crate) fn remove_queued(&mut self, output_id: &str) -> bool {
        let at = self.to_send.iter().position(|p| p.output_id == output_id);
        at.and_then(|at| self.to_send.remove(at)).is_some()
    }

    /// Forgets a publish handed to rumqttc; where it was, so that the caller takes it out of
    /// rumqttc too (only while the connection is down: then rumqttc holds it in its queue
    /// for the next one). `None` if it is not there (acknowledged meanwhile, or queued).
    pub(crate) fn remove_handed(&mut self, output_id: &str) -> Option<Handed> {
        let bound = self.bound.iter().find(|(_, p)| p.output_id == output_id);
        if let Some(pkid) = bound.map(|(pkid, _)| *pkid) {
            self.bound.remove(&pkid);
            return Some(Handed::Bound(pkid));
        }
        if let Some(n) = self.unbound.iter().position(|p| p.output_id == output_id) {
            self.unbound.remove(n);
            return Some(Handed::Unbound(n));
        }
        if self
            .collided
            .as_ref()
            .is_some_and(|(_, p)| p.output_id == output_id)
        {
            self.collided = None;
            return Some(Handed::Collided);
        }
        None
    }

    /// Publishes handed to rumqttc and not acknowledged (written or about to be).
    pub(crate) fn handed_len(&self) -> usize {
        self.len() - self.to_send.len()
    }

    /// rumqttc accepted [`Self::next_to_hand`] into its request channel.
    pub(crate) fn handed(&mut self) {
        if let Some(p) = self.to_send.pop_front() {
            self.unbound.push_back(p);
        }
    }

    /// rumqttc wrote a PUBLISH with this pkid.
    pub(crate) fn on_outgoing(&mut self, pkid: u16) -> Sent {
        if self.bound.contains_key(&pkid) {
            return Sent::Retransmit;
        }
        let next = match self.collided.take() {
            Some((parked, p)) if parked == pkid => Some(p),
            other => {
                self.collided = other;
                self.unbound.pop_front()
            }
        };
        match next {
            Some(p) => {
                let id = p.output_id.clone();
                self.bound.insert(pkid, p);
                Sent::Bound(id)
            }
            None => Sent::Unexpected,
        }
    }

    /// rumqttc took the front publish but parked it: `pkid` is still in use.
    pub(crate) fn on_await_ack(&mut self, pkid: u16) {
        if self.collided.is_none()
            && let Some(p) = self.unbound.pop_front()
        {
            self.collided = Some((pkid, p));
        }
    }

    /// The broker acknowledged `pkid`; returns the output ID it carried.
    pub(crate) fn on_puback(&mut self, pkid: u16) -> Option<String> {
        self.bound.remove(&pkid).map(|p| p.output_id)
    }

    /// A new connection: every publish rumqttc held is taken from it (the broker forgot
    /// them with our session, or rumqttc would re-send them out of order). Queue them all
    /// again, oldest first, ahead of those not handed over yet. Returns how many.
    pub(crate) fn requeue_all(&mut self) -> usize {
        let mut lost: Vec<OutPublish> = self.bound.drain().map(|(_, p)| p).collect();
        lost.extend(self.unbound.drain(..));
        lost.extend(self.collided.take().map(|(_, p)| p));
        lost.sort_by_key(|p| p.seq);
        let n = lost.len();
        for p in lost.into_iter().rev() {
            self.to_send.push_front(p);
        }
        n
    }

    /// Output IDs of the publishes written to the broker and not acknowledged, oldest
    /// first (in [`Self::accept`] order).
    pub(crate) fn unacked(&self) -> Vec<String> {
        let mut written: Vec<&OutPublish> = self.bound.values().collect();
        written.sort_by_key(|p| p.seq);
        written.into_iter().map(|p| p.output_id.clone()).collect()
    }

    /// Publishes inside rumqttc that were never given a pkid (for a consistency check).
    pub(crate) fn unbound_len(&self) -> usize {
        self.unbound.len() + self.collided.is_some() as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(n: usize) -> Publishes {
        let mut p = Publishes::default();
        for i in 0..n {
            p.accept(format!("o{i}"), "t".into(), vec![], false);
        }
        p
    }

    fn hand_all(p: &mut Publishes) {
        while p.next_to_hand().is_some() {
            p.handed();
        }
    }

    #[test]
    fn binds_in_publish_order_and_resolves_once() {
        let mut p = with(3);
        hand_all(&mut p);
        assert_eq!(p.on_outgoing(7), Sent::Bound("o0".into()));
        assert_eq!(p.on_outgoing(8), Sent::Bound("o1".into()));
        assert_eq!(p.on_puback(7).as_deref(), Some("o0"));
        assert_eq!(p.on_puback(7), None);
        assert_eq!(p.on_outgoing(7), Sent::Bound("o2".into()));
        assert_eq!(p.len(), 2);
    }

    #[test]
    fn a_retransmit_does_not_consume_the_fifo() {
        let mut p = with(3);
        hand_all(&mut p);
        assert_eq!(p.on_outgoing(1), Sent::Bound("o0".into()));
        assert_eq!(p.on_outgoing(2), Sent::Bound("o1".into()));
        // reconnect with session: rumqttc re-sends 1 and 2, then the new one
        assert_eq!(p.on_outgoing(1), Sent::Retransmit);
        assert_eq!(p.on_outgoing(2), Sent::Retransmit);
        assert_eq!(p.on_outgoing(3), Sent::Bound("o2".into()));
        assert_eq!(p.on_puback(2).as_deref(), Some("o1"));
        assert_eq!(p.on_puback(1).as_deref(), Some("o0"));
        assert_eq!(p.on_puback(3).as_deref(), Some("o2"));
        assert_eq!(p.len(), 0);
        assert_eq!(p.on_outgoing(4), Sent::Unexpected);
    }

    #[test]
    fn a_lost_session_requeues_in_order() {
        let mut p = with(5);
        for _ in 0..4 {
            p.handed();
        }
        assert_eq!(p.on_outgoing(9), Sent::Bound("o0".into()));
        assert_eq!(p.on_outgoing(10), Sent::Bound("o1".into()));
        assert_eq!(p.on_puback(9).as_deref(), Some("o0"));
        // o1 bound, o2 and o3 handed but unbound, o4 not handed
        assert_eq!(p.requeue_all(), 3);
        assert_eq!(p.len(), 4);
        let order: Vec<_> = p.to_send.iter().map(|x| x.output_id.clone()).collect();
        assert_eq!(order, ["o1", "o2", "o3", "o4"]);
        hand_all(&mut p);
        assert_eq!(p.on_outgoing(1), Sent::Bound("o1".into()));
        assert_eq!(p.on_puback(10), None, "the old pkid means nothing any more");
    }

    #[test]
    fn unacked_lists_what_was_written_and_not_acknowledged_oldest_first() {
        let mut p = with(4);
        for _ in 0..3 {
            p.handed();
        }
        // Packet ids say nothing of the order: they wrap.
        assert_eq!(p.on_outgoing(9), Sent::Bound("o0".into()));
        assert_eq!(p.on_outgoing(1), Sent::Bound("o1".into()));
        assert_eq!(p.on_outgoing(5), Sent::Bound("o2".into()));
        assert_eq!(p.unacked(), ["o0", "o1", "o2"]);
        assert_eq!(p.on_puback(1).as_deref(), Some("o1"));
        // o3 is accepted but not written: not in the list.
        assert_eq!(p.unacked(), ["o0", "o2"]);
        p.requeue_all();
        assert!(p.unacked().is_empty(), "queued again, not written yet");
    }

    #[test]
    fn a_publish_given_up_is_found_wherever_it_waits_and_forgotten() {
        let mut p = with(5);
        for _ in 0..4 {
            p.handed();
        }
        assert_eq!(p.on_outgoing(7), Sent::Bound("o0".into()));
        // o0 written, o1..o3 handed without a packet id, o4 queued.
        assert!(p.remove_queued("o4"));
        assert!(!p.remove_queued("o4"));
        assert_eq!(p.remove_handed("o0"), Some(Handed::Bound(7)));
        assert_eq!(p.remove_handed("o2"), Some(Handed::Unbound(1)));
        assert_eq!(p.remove_handed("o2"), None);
        assert_eq!(p.len(), 2);
        // The binding goes on with the others, in order.
        assert_eq!(p.on_outgoing(8), Sent::Bound("o1".into()));
        assert_eq!(p.on_outgoing(9), Sent::Bound("o3".into()));
        assert_eq!(p.on_puback(7), None, "its packet id names nothing now");
    }

    #[test]
    fn a_collision_binds_the_parked_entry() {
        let mut p = with(3);
        hand_all(&mut p);
        assert_eq!(p.on_outgoing(1), Sent::Bound("o0".into()));
        assert_eq!(p.on_outgoing(2), Sent::Bound("o1".into()));
        p.on_await_ack(1); // o2 wants pkid 1, still in use
        assert_eq!(p.unbound_len(), 1);
        assert_eq!(p.on_puback(1).as_deref(), Some("o0"));
        assert_eq!(p.on_outgoing(1), Sent::Bound("o2".into()));
        assert_eq!(p.len(), 2);
    }
}
