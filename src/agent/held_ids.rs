//! The packet ids under which the broker holds inputs for us on this connection, not yet
//! acknowledged.
//!
//! MQTT 3.1.1 (§2.3.1) has a server give each new QoS 1 PUBLISH a packet id that is not in
//! use. Mosquitto 2.0.11 (Debian 12's) does not check: it gives each message queued for a
//! session the next value of a 16-bit counter (`mosquitto__mid_generate`, called when the
//! message is queued), so a session with more than 65,535 messages unacknowledged has two in
//! flight under one id. A PUBACK then removes the *first* in flight with that id
//! (`db__message_delete_outgoing`). Acks in receipt order remove the right one. But an input
//! let go under backpressure is not acknowledged on this connection, and the ack of a later
//! input under the same id would remove the let-go one from the broker: never logged, never
//! sent again, lost. So an input that arrives under an id still held here is let go too (the
//! reconnect brings it again), and no ack ever goes out under an id twice while the first
//! is unanswered.
//!
//! An agent far behind (a full log, a long restart) is where a session passes 65,535
//! messages; the soak of 2026-12-06 ended ~170 s behind at ~400 inputs/s.

/// Words of the bitmap: one bit per packet id.
const WORDS: usize = (u16::MAX as usize + 1) / 64;

pub(crate) struct HeldIds {
    /// The connection the bits belong to; a new one starts with none held.
    epoch: u64,
    /// Empty until the first input (8 KiB then).
    bits: Vec<u64>,
    /// Whether a reused id was reported on this connection.
    reported: bool,
}

/// What [`HeldIds::arrive`] found.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Arrival {
    /// The id was free: it is held now, until [`HeldIds::acked`].
    Held,
    /// The broker sent this input under an id an earlier unacknowledged one holds; `first`
    /// is whether that is the first such input on this connection.
    Reused { first: bool },
}

impl HeldIds {
    pub(crate) fn new() -> HeldIds {
        HeldIds {
            epoch: 0,
            bits: Vec::new(),
            reported: false,
        }
    }

    /// An input arrived under `(epoch, packet id)` ([`crate::mqtt::AckToken::held_as`]).
    pub(crate) fn arrive(&mut self, (epoch, pkid): (u64, u16)) -> Arrival {
        if epoch < self.epoch {
            // From a connection already gone: its ack is dropped (`AckToken`), and the ids of
            // the one now up stay as they are.
            return Arrival::Held;
        }
        if epoch > self.epoch {
            // A new connection: the old one's ids mean nothing now.
            self.epoch = epoch;
            self.bits.fill(0);
            self.reported = false;
        }
        if self.bits.is_empty() {
            self.bits.resize(WORDS, 0);
        }
        let (word, bit) = (usize::from(pkid) / 64, 1u64 << (pkid % 64));
        if self.bits[word] & bit != 0 {
            let first = !std::mem::replace(&mut self.reported, true);
            return Arrival::Reused { first };
        }
        self.bits[word] |= bit;
        Arrival::Held
    }

    /// The ack under `(epoch, packet id)` went to the MQTT module: acks are written in the
    /// order they are handed over, so the broker reads this one before any later one under
    /// the same id.
    pub(crate) fn acked(&mut self, (epoch, pkid): (u64, u16)) {
        if epoch == self.epoch && !self.bits.is_empty() {
            self.bits[usize::from(pkid) / 64] &= !(1u64 << (pkid % 64));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Arrival, HeldIds};

    #[test]
    fn an_id_is_held_until_its_ack_and_a_second_input_under_it_is_refused() {
        let mut ids = HeldIds::new();
        assert_eq!(ids.arrive((1, 7)), Arrival::Held);
        assert_eq!(ids.arrive((1, 8)), Arrival::Held);
        assert_eq!(ids.arrive((1, 7)), Arrival::Reused { first: true });
        assert_eq!(
            ids.arrive((1, 7)),
            Arrival::Reused { first: false },
            "reported once a connection"
        );
        ids.acked((1, 7));
        assert_eq!(ids.arrive((1, 7)), Arrival::Held, "free once acknowledged");
        assert_eq!(ids.arrive((1, 8)), Arrival::Reused { first: false });
    }

    #[test]
    fn a_new_connection_holds_nothing_and_an_old_ones_ack_frees_nothing() {
        let mut ids = HeldIds::new();
        assert_eq!(ids.arrive((1, 65_535)), Arrival::Held);
        assert_eq!(ids.arrive((1, 1)), Arrival::Held);
        assert_eq!(ids.arrive((2, 65_535)), Arrival::Held, "a new connection");
        ids.acked((1, 65_535));
        assert_eq!(
            ids.arrive((2, 65_535)),
            Arrival::Reused { first: true },
            "the old connection's ack freed nothing"
        );
        assert_eq!(ids.arrive((2, 1)), Arrival::Held);
    }

    #[test]
    fn an_input_from_a_connection_already_gone_leaves_the_new_ones_ids_alone() {
        let mut ids = HeldIds::new();
        assert_eq!(ids.arrive((5, 9)), Arrival::Held);
        assert_eq!(
            ids.arrive((4, 9)),
            Arrival::Held,
            "its ack is dropped anyway"
        );
        assert_eq!(ids.arrive((5, 9)), Arrival::Reused { first: true });
    }

    #[test]
    fn every_id_has_its_own_bit() {
        let mut ids = HeldIds::new();
        for pkid in 0..=u16::MAX {
            assert_eq!(ids.arrive((3, pkid)), Arrival::Held, "{pkid}");
        }
        for pkid in (0..=u16::MAX).step_by(2) {
            ids.acked((3, pkid));
        }
        for pkid in 0..=u16::MAX {
            let want = if pkid % 2 == 0 {
                Arrival::Held
            } else {
                Arrival::Reused { first: pkid == 1 }
            };
            assert_eq!(ids.arrive((3, pkid)), want, "{pkid}");
        }
    }
}
