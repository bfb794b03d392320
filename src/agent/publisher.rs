//! Publisher: the outbox window. Durable outbox entries go out in sequence order, at most
//! `outbox.inflight` on the wire; an entry is deleted only on its PUBACK (invariant 6: the
//! outbox holds only what a durable checkpoint wrote, so nothing undurable is ever sent).
//!
//! No IO: the loop reads the outbox, publishes and deletes; this part keeps the cursor (the
//! next sequence to send), what is on the wire under which output ID, and whether the
//! broker is there at all.

use std::collections::HashMap;

pub(crate) struct Publisher {
    /// The next outbox sequence to publish.
    cursor: u64,
    /// Output ID → outbox sequence, for each publish awaiting its PUBACK.
    inflight: HashMap<String, u64>,
    connected: bool,
}

impl Publisher {
    /// Start at the oldest entry the outbox holds: after a restart, everything in it is
    /// sent again (same IDs, same payloads; the receivers dedup).
    pub(crate) fn new(first_seq: u64) -> Publisher {
        Publisher {
            cursor: first_seq,
            inflight: HashMap::new(),
            connected: false,
        }
    }

    /// How many entries may be sent now: none while disconnected, else what the window
    /// (`window` publishes) has left beside the `on_wire` the MQTT module still holds.
    pub(crate) fn room(&self, window: u16, on_wire: impl FnOnce() -> usize) -> usize {
        if !self.connected {
            return 0;
        }
        (window as usize).saturating_sub(on_wire())
    }

    /// Where the next batch starts.
    pub(crate) fn cursor(&self) -> u64 {
        self.cursor
    }

    /// Entry `seq` went out as `output_id`.
    pub(crate) fn sent(&mut self, output_id: String, seq: u64) {
        self.inflight.insert(output_id, seq);
        self.cursor = seq + 1;
    }

    /// The broker acknowledged `output_id`: the outbox sequence to delete, if it was ours
    /// (a PUBACK for an ID already acknowledged, e.g. after a resend, deletes nothing).
    pub(crate) fn acked(&mut self, output_id: &str) -> Option<u64> {
        self.inflight.remove(output_id)
    }

    /// Nothing awaits a PUBACK.
    pub(crate) fn idle(&self) -> bool {
        self.inflight.is_empty()
    }

    pub(crate) fn connected(&mut self) {
        self.connected = true;
    }

    /// The connection is down; `true` if it was up (a reconnect to count).
    pub(crate) fn disconnected(&mut self) -> bool {
        std::mem::replace(&mut self.connected, false)
    }

    pub(crate) fn is_connected(&self) -> bool {
        self.connected
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_is_sent_while_disconnected_whatever_the_window() {
        let mut p = Publisher::new(0);
        assert_eq!(
            p.room(10, || unreachable!("not asked while disconnected")),
            0
        );
        p.connected();
        assert_eq!(p.room(10, || 3), 7);
        assert_eq!(p.room(10, || 12), 0, "never negative");
        assert!(p.disconnected(), "was up: a reconnect");
        assert!(!p.disconnected(), "already down: not counted twice");
        assert_eq!(p.room(10, || 0), 0);
    }

    #[test]
    fn the_cursor_follows_what_was_sent_and_a_puback_names_the_entry_to_delete() {
        let mut p = Publisher::new(40);
        assert_eq!(p.cursor(), 40);
        p.sent("a".into(), 40);
        p.sent("b".into(), 41);
        assert_eq!(p.cursor(), 42);
        assert!(!p.idle());
        assert_eq!(p.acked("b"), Some(41));
        assert_eq!(p.acked("b"), None, "a second PUBACK deletes nothing");
        assert_eq!(p.acked("x"), None, "not ours");
        assert_eq!(p.acked("a"), Some(40));
        assert!(p.idle());
        assert_eq!(p.cursor(), 42, "acks do not move the cursor");
    }

    #[test]
    fn a_restart_begins_at_the_oldest_entry_and_sends_it_again() {
        let p = Publisher::new(7);
        assert_eq!(p.cursor(), 7);
        assert!(p.idle());
        assert!(!p.is_connected());
    }
}
