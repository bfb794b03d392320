//! What waits for one sink: the outbox entries routed to it that it has not settled, with
//! their payload bytes and the oldest of them (issue 29), for `status`, `/metrics` and the
//! journal. Figures only: nothing here decides what is sent, settled or deleted, and
//! nothing here is read by processing.
//!
//! **Exact, and cheap.** The sets are kept as the outbox changes rather than counted by a
//! walk of the outbox: O(log n) per entry and per sink it is routed to, and one walk at
//! start. An entry waits for sink `i` from its checkpoint (or from the start, for what
//! the outbox already held) until the first of:
//!
//! - sink `i` settles it: its cursor's settled prefix passes it ([`Waiting::settled_below`]:
//!   an acknowledgement, or a dead letter for that sink such as `too_large_for_sink` or
//!   `refused_by_disconnect`, which settles it there);
//! - it leaves the outbox for every sink: a newer upsert of its key supersedes it
//!   ([`Waiting::gone`], from what the store reports of its commits), or it is set aside
//!   for good once no other sink waits for it (then every sink has settled it already).
//!
//! `cairn outbox drop` runs on the stopped agent; the next start counts again from the
//! outbox as it is (`Results::start`), so a crash, a kill or a drop never leaves a count
//! behind: each sink's set is rebuilt from the durable outbox and the durable settled
//! positions, the same two things that decide what the sink sends.
//!
//! Results still waiting for their checkpoint are not outbox entries yet: they count from
//! the commit (at most `checkpoint.interval` later) unless the sink settled them first.

use std::collections::BTreeMap;

/// One sink's waiting entries: sequence → payload bytes.
#[derive(Debug, Default)]
pub(crate) struct Waiting {
    entries: BTreeMap<u64, u32>,
    bytes: u64,
}

impl Waiting {
    /// Entry `seq` (`payload` bytes) waits for this sink.
    pub(crate) fn add(&mut self, seq: u64, payload: usize) {
        let size = u32::try_from(payload).unwrap_or(u32::MAX);
        if let Some(old) = self.entries.insert(seq, size) {
            self.bytes -= u64::from(old);
        }
        self.bytes += u64::from(size);
    }

    /// Entry `seq` left the outbox; nothing if it was not waiting here.
    pub(crate) fn gone(&mut self, seq: u64) {
        if let Some(size) = self.entries.remove(&seq) {
            self.bytes -= u64::from(size);
        }
    }

    /// Everything below `seq` is settled for this sink (its cursor's settled prefix).
    pub(crate) fn settled_below(&mut self, seq: u64) {
        while let Some(e) = self.entries.first_entry() {
            if *e.key() >= seq {
                break;
            }
            self.bytes -= u64::from(e.remove());
        }
    }

    pub(crate) fn clear(&mut self) {
        *self = Waiting::default();
    }

    pub(crate) fn len(&self) -> u64 {
        self.entries.len() as u64
    }

    /// Payload bytes of the waiting entries.
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The sequence of the oldest waiting entry.
    pub(crate) fn oldest(&self) -> Option<u64> {
        self.entries.first_key_value().map(|(&s, _)| s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_wait_until_settled_or_gone_and_the_bytes_follow() {
        let mut w = Waiting::default();
        for (seq, n) in [(3, 10), (5, 20), (9, 30)] {
            w.add(seq, n);
        }
        assert_eq!((w.len(), w.bytes(), w.oldest()), (3, 60, Some(3)));
        w.add(5, 20);
        assert_eq!((w.len(), w.bytes()), (3, 60), "added twice counts once");
        w.settled_below(5);
        assert_eq!((w.len(), w.bytes(), w.oldest()), (2, 50, Some(5)));
        w.gone(9);
        w.gone(9);
        w.gone(4);
        assert_eq!((w.len(), w.bytes(), w.oldest()), (1, 20, Some(5)));
        w.settled_below(100);
        assert_eq!((w.len(), w.bytes(), w.oldest()), (0, 0, None));
        w.add(200, usize::MAX);
        assert_eq!(w.bytes(), u64::from(u32::MAX), "a size past u32 is capped");
        w.clear();
        assert_eq!((w.len(), w.bytes()), (0, 0));
    }
}
