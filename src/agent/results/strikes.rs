//! A publish the broker refuses by closing the connection (issue 27): when to give it up.
//!
//! mosquitto closes the connection on a publish it takes as malformed (a topic with a
//! Unicode non-character, a packet over its `max_packet_size` from a 3.1.1 client). The
//! connection re-sends the publish on the next connection and is closed again, forever,
//! and everything behind it waits. The broker handles our publishes in order and closes at
//! the one it refuses, so that one is the oldest unacknowledged publish of the connection
//! that ended ([`crate::mqtt::Event::Disconnected`]'s `unacked`).
//!
//! **The rule.** A drop is a *strike* against output ID `X` when `X` is the oldest
//! unacknowledged publish of the connection that ended, and the connection ended less than
//! [`STRIKE_WITHIN`] after `X` was last put on the wire: after our publish of it, or after
//! the connection began (a re-sent publish goes out right after the CONNACK). After
//! [`STRIKES_MAX`] strikes in a row against the same `X`, it is set aside: given up on that
//! connection, a dead letter (`refused_by_disconnect`) for that destination, settled there
//! so the outbox moves on. Any other drop (a different oldest publish, nothing
//! unacknowledged, or one that came later than [`STRIKE_WITHIN`]) and `X`'s acknowledgement
//! clear the count; a failed connect attempt changes nothing.
//!
//! **Why an ordinary flap does not drop a result.** Under steady load the oldest
//! unacknowledged publish is always recent, so one network flap may well strike it. But
//! after the reconnect that publish is re-sent first and acknowledged within a round trip,
//! which clears the count; a lost result needs three drops in a row, each within
//! [`STRIKE_WITHIN`] of sending the very same publish, with no acknowledgement of it in
//! between. A dead link shows as a keep-alive timeout (seconds to minutes after the last
//! send) or a refused connect, neither of which strikes. `tests/it/sinks.rs` checks both
//! sides: a refused publish is set aside while the others flow, and broker restarts
//! under load set nothing aside.

use std::time::Duration;

/// Strikes in a row against one publish before it is set aside.
pub(crate) const STRIKES_MAX: u32 = 3;

/// A drop counts against a publish only this soon after it was put on the wire. mosquitto
/// closes within one round trip (1-2 ms on loopback); two seconds leaves room for a slow
/// satellite link while staying far below any keep-alive timeout.
pub(crate) const STRIKE_WITHIN: Duration = Duration::from_secs(2);

#[derive(Debug, Default)]
pub(crate) struct Strikes {
    /// The publish struck last and how many times in a row.
    against: Option<(String, u32)>,
}

impl Strikes {
    /// A connection ended with `unacked` (oldest first), having been up `up_for` (`None`:
    /// a failed connect attempt); `since_sent(id)`: how long ago we published `id`, if we
    /// did. The output ID to set aside now, if this was its last strike.
    pub(crate) fn dropped(
        &mut self,
        unacked: &[String],
        up_for: Option<Duration>,
        since_sent: impl FnOnce(&str) -> Option<Duration>,
    ) -> Option<String> {
        let up_for = up_for?; // a failed attempt: neither a strike nor a clean connection
        let Some(front) = unacked.first() else {
            self.against = None;
            return None;
        };
        let on_wire = since_sent(front).map_or(up_for, |s| s.min(up_for));
        if on_wire >= STRIKE_WITHIN {
            self.against = None;
            return None;
        }
        let n = match &self.against {
            Some((id, n)) if id == front => n + 1,
            _ => 1,
        };
        if n >= STRIKES_MAX {
            self.against = None;
            return Some(front.clone());
        }
        self.against = Some((front.clone(), n));
        None
    }

    /// `output_id` was acknowledged (or otherwise settled): no strike stands against it.
    pub(crate) fn cleared(&mut self, output_id: &str) {
        if self.against.as_ref().is_some_and(|(id, _)| id == output_id) {
            self.against = None;
        }
    }

    /// Strikes now standing against `output_id`.
    #[cfg(test)]
    fn count(&self, output_id: &str) -> u32 {
        match &self.against {
            Some((id, n)) if id == output_id => *n,
            _ => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: fn(u64) -> Duration = Duration::from_millis;

    fn ids(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn the_same_publish_at_the_front_of_three_quick_drops_in_a_row_is_set_aside() {
        let mut s = Strikes::default();
        let unacked = ids(&["p/bad/1", "p/ok/1"]);
        // First send on a connection up for an hour: dropped 1 ms after our publish.
        assert_eq!(
            s.dropped(&unacked, Some(MS(3_600_000)), |_| Some(MS(1))),
            None
        );
        // Re-sent after each CONNACK: the connections last 2 ms.
        assert_eq!(s.dropped(&unacked, Some(MS(2)), |_| Some(MS(900))), None);
        assert_eq!(s.count("p/bad/1"), 2);
        assert_eq!(
            s.dropped(&unacked, Some(MS(2)), |_| Some(MS(1_800))),
            Some("p/bad/1".into())
        );
        assert_eq!(s.count("p/bad/1"), 0, "set aside: counted from zero again");
    }

    #[test]
    fn a_flap_under_load_does_not_add_up_against_different_publishes() {
        let mut s = Strikes::default();
        for i in 0..10 {
            let unacked = ids(&[&format!("p/k/{i}")]);
            assert_eq!(s.dropped(&unacked, Some(MS(40)), |_| Some(MS(1))), None);
        }
    }

    #[test]
    fn an_acknowledgement_a_slow_drop_or_an_empty_drop_clears_the_count() {
        let mut s = Strikes::default();
        let bad = ids(&["x"]);
        s.dropped(&bad, Some(MS(5)), |_| None);
        s.dropped(&bad, Some(MS(5)), |_| None);
        s.cleared("x");
        assert_eq!(s.count("x"), 0);
        s.dropped(&bad, Some(MS(5)), |_| None);
        s.dropped(&bad, Some(MS(5)), |_| None);
        // A keep-alive timeout long after the send: not the broker refusing it.
        assert_eq!(
            s.dropped(&bad, Some(MS(60_000)), |_| Some(MS(45_000))),
            None
        );
        assert_eq!(s.count("x"), 0);
        s.dropped(&bad, Some(MS(5)), |_| None);
        assert_eq!(s.dropped(&[], Some(MS(5)), |_| None), None);
        assert_eq!(s.count("x"), 0, "our own reconnect, nothing outstanding");
    }

    #[test]
    fn a_failed_connect_attempt_neither_strikes_nor_clears() {
        let mut s = Strikes::default();
        let bad = ids(&["x"]);
        s.dropped(&bad, Some(MS(5)), |_| None);
        s.dropped(&bad, Some(MS(5)), |_| None);
        for _ in 0..5 {
            assert_eq!(s.dropped(&[], None, |_| None), None);
        }
        assert_eq!(s.dropped(&bad, Some(MS(5)), |_| None), Some("x".into()));
    }
}
