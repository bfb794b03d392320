//! A sink's cursor: what goes out next, in which order, and what an acknowledgement settles.
//!
//! Results leave at log-commit latency (issue 14): every output the processor emits derives
//! from log records that are already fsynced (records are applied only after their group
//! commit), so replay after any crash recomputes it with the same ID and the same payload.
//! A sink therefore sends, in sequence order and at most `outbox.inflight` on the
//! wire, first the durable outbox entries at or after its cursor, then the outputs still
//! waiting for their checkpoint (*fresh* ones, read from the processor's memory). A backfill
//! of upserts is the exception: it is not replayed at start, and its flushes fall elsewhere
//! after a restart, so while one runs the caller hands over no fresh outputs
//! (`Results::publish`).
//!
//! **Settled.** A PUBACK settles its output, and with it every later output already
//! acknowledged: an output is settled once it and everything sent before it were
//! acknowledged, so the settled outputs are exactly the sequences below [`settled_below`]
//! (a contiguous prefix). A checkpoint leaves settled outputs out of the outbox; a settled
//! durable entry is deleted from it. Out-of-order PUBACKs (possible only across a reconnect)
//! wait for the gap before them.
//!
//! Why a prefix and not every acknowledged output: after a crash the outbox is re-sent in
//! order, then replay's outputs follow. If an output could be dropped from the outbox while
//! an older one of its key stayed there, the restart would re-send the older version *after*
//! the newer one went out, and a retained topic would go back a version. With a prefix,
//! everything re-sent is newer, per key, than everything settled, so the last message per
//! key after a restart is the newest one there is (`tests/it/crash.rs` checks it).
//!
//! **After a restart.** Recovery replays the log tail before the agent connects, so nothing
//! is published until replay has committed its results into the outbox. There, a newer
//! upsert of a key supersedes an older one still waiting (`store/outbox.rs`): replay's
//! results and the entries left from before the crash are coalesced per key, and only the
//! newest version of each key goes out. `changelog` results are all re-sent, in order,
//! with their IDs: a consumer drops the IDs it has seen, and the last message per key is
//! still the newest.
//!
//! No IO: the sink reads the outbox and the processor's fresh outputs, publishes, and
//! deletes; this keeps the cursor (the next sequence to send), what is on the wire under
//! which output ID, and whether the destination is there at all. Every sink has one (today
//! the MQTT sink, `results/mqtt.rs`); an entry can go once every sink it is routed to has
//! settled it.
//!
//! [`settled_below`]: Cursor::settled_below

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use crate::model::Output;

/// One result to send: its sequence, the output, and whether it is *fresh* (read from the
/// processor's memory, its checkpoint still to come).
pub(crate) type Next = (u64, Output, bool);

/// Most entries one [`next_routed`] call looks at, routed to the sink or not: a sink that
/// takes few pipelines' results skips the others a bounded stretch at a time.
pub(crate) const SCAN_MAX: usize = 4096;

/// What goes out next for one sink, at most `room`: the durable outbox entries from
/// `cursor` on, in sequence order (`outbox` yields them so), then the outputs still waiting
/// for their checkpoint from `cursor` on (`pending`, in sequence order, all newer than any
/// entry); only those `routed` (by output ID) to this sink, looking at most [`SCAN_MAX`]
/// entries; also the sequence after the last one looked at (the cursor
/// may move there once the batch is sent: what it passed over is not this sink's).
pub(crate) fn next_routed<E>(
    cursor: u64,
    room: usize,
    outbox: impl Iterator<Item = Result<(u64, Output), E>>,
    pending: crate::processor::Pending<'_>,
    routed: impl Fn(&str) -> bool,
) -> Result<(Vec<Next>, u64), E> {
    let mut batch = Vec::new();
    let (mut next, mut looked) = (cursor, 0usize);
    if room == 0 {
        return Ok((batch, next));
    }
    for e in outbox {
        let (seq, out) = e?;
        looked += 1;
        next = seq + 1;
        if routed(&out.id) {
            batch.push((seq, out, false));
            if batch.len() >= room {
                return Ok((batch, next));
            }
        }
        if looked >= SCAN_MAX {
            return Ok((batch, next));
        }
    }
    // From where the outbox ended: a checkpoint that has just committed is in both until
    // the loop hears that it is done.
    for (seq, out) in pending.from(next) {
        looked += 1;
        next = seq + 1;
        if routed(&out.id) {
            batch.push((*seq, out.clone(), true));
            if batch.len() >= room {
                break;
            }
        }
        if looked >= SCAN_MAX {
            break;
        }
    }
    Ok((batch, next))
}

pub(crate) struct Cursor {
    /// The next sequence to publish.
    cursor: u64,
    /// Sequence → (output ID, acknowledged, when sent), for each publish not yet settled.
    inflight: BTreeMap<u64, (String, bool, Instant)>,
    /// Output ID → sequence, to find a PUBACK's entry.
    by_id: HashMap<String, u64>,
    connected: bool,
}

impl Cursor {
    /// Start at the oldest entry the outbox holds: after a restart, everything in it is
    /// sent again (same IDs, same payloads; the receivers dedup).
    pub(crate) fn new(first_seq: u64) -> Cursor {
        Cursor {
            cursor: first_seq,
            inflight: BTreeMap::new(),
            by_id: HashMap::new(),
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

    /// Output `seq` went out as `output_id` at `now`.
    pub(crate) fn sent(&mut self, output_id: String, seq: u64, now: Instant) {
        debug_assert!(seq >= self.cursor, "sent in sequence order");
        self.by_id.insert(output_id.clone(), seq);
        self.inflight.insert(seq, (output_id, false, now));
        self.cursor = seq + 1;
    }

    /// Entries before `seq` not sent yet are not this sink's (not routed to it): the
    /// cursor moves past them, and they count as settled here.
    pub(crate) fn skip_to(&mut self, seq: u64) {
        self.cursor = self.cursor.max(seq);
    }

    /// The destination refused `output_id`: it and everything sent after it go again
    /// from it, in order (acknowledgements still on their way for those are ignored; a
    /// re-send carries the same ID and payload). `false` if it is not awaiting an answer.
    pub(crate) fn rewind(&mut self, output_id: &str) -> bool {
        let Some(&seq) = self.by_id.get(output_id) else {
            return false;
        };
        for (_, (id, _, _)) in self.inflight.split_off(&seq) {
            self.by_id.remove(&id);
        }
        self.cursor = seq;
        true
    }

    /// Everything sent and not settled goes again, from the oldest, in order: for a
    /// destination that keeps nothing across its own reconnects (a database or stream
    /// sink's thread answers a lost batch only by saying it is down), unlike an MQTT
    /// session that re-sends its unacknowledged publishes itself. Acknowledgements still on
    /// their way are harmless: a re-send carries the same ID and payload.
    pub(crate) fn rewind_unsettled(&mut self) {
        if let Some(id) = self
            .inflight
            .first_key_value()
            .map(|(_, (id, _, _))| id.clone())
        {
            self.rewind(&id);
        }
    }

    /// How long ago `output_id` was sent, if it awaits its acknowledgement.
    pub(crate) fn since_sent(&self, output_id: &str, now: Instant) -> Option<Duration> {
        let seq = self.by_id.get(output_id)?;
        let (_, _, at) = self.inflight.get(seq)?;
        Some(now.saturating_duration_since(*at))
    }

    /// The sequence `output_id` went out with, if it awaits its acknowledgement.
    pub(crate) fn seq_of(&self, output_id: &str) -> Option<u64> {
        self.by_id.get(output_id).copied()
    }

    /// The broker acknowledged `output_id`: the outputs this settles, in order, as
    /// (sequence, ID), to delete from the outbox where they are in it. Empty for an ID not
    /// ours or already acknowledged, and while an earlier publish still awaits its PUBACK.
    pub(crate) fn acked(&mut self, output_id: &str) -> Vec<(u64, String)> {
        let Some(seq) = self.by_id.remove(output_id) else {
            return Vec::new();
        };
        if let Some(e) = self.inflight.get_mut(&seq) {
            e.1 = true;
        }
        let mut settled = Vec::new();
        while let Some(e) = self.inflight.first_entry() {
            if !e.get().1 {
                break;
            }
            let (seq, (id, _, _)) = e.remove_entry();
            settled.push((seq, id));
        }
        settled
    }

    /// Every output with a lower sequence is settled: sent, and acknowledged together with
    /// everything sent before it. A checkpoint leaves these out of the outbox.
    pub(crate) fn settled_below(&self) -> u64 {
        self.inflight
            .first_key_value()
            .map_or(self.cursor, |(&seq, _)| seq)
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
    use crate::processor::Pending;

    #[test]
    fn rewinding_the_unsettled_sends_again_from_the_oldest_unsettled_even_past_acked_ones() {
        let now = Instant::now();
        let mut c = Cursor::new(10);
        for (seq, id) in [(10, "a"), (11, "b"), (12, "c"), (13, "d")] {
            c.sent(id.into(), seq, now);
        }
        assert_eq!(ids(c.acked("a")), vec![10]);
        // `c` acknowledged, `b` never will be (its batch was lost with the connection).
        assert!(c.acked("c").is_empty());
        c.rewind_unsettled();
        assert_eq!(c.cursor(), 11, "from `b` on, `c` included");
        assert_eq!(c.settled_below(), 11);
        assert!(c.idle());
        // Nothing in flight: nothing to rewind, the cursor stays.
        c.rewind_unsettled();
        assert_eq!(c.cursor(), 11);
    }

    fn ids(v: Vec<(u64, String)>) -> Vec<u64> {
        v.into_iter().map(|(s, _)| s).collect()
    }

    fn out(id: &str) -> Output {
        Output {
            id: id.into(),
            topic: format!("t/{id}"),
            payload: vec![],
            retain: false,
            latest_only: false,
        }
    }

    #[test]
    fn the_outbox_goes_first_then_fresh_results_from_the_cursor_within_the_room() {
        let outbox = vec![(3, out("a")), (4, out("b"))];
        let pending = vec![(5, out("c")), (6, out("d")), (7, out("e"))];
        let sent = |cursor, room, outbox: &[(u64, Output)]| {
            let it = outbox.iter().cloned().map(Ok::<_, ()>);
            next_routed(cursor, room, it, Pending::new(&[], &pending), |_| true)
                .unwrap()
                .0
                .into_iter()
                .map(|(s, o, fresh)| (s, o.id, fresh))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            sent(3, 4, &outbox),
            [
                (3, "a".into(), false),
                (4, "b".into(), false),
                (5, "c".into(), true),
                (6, "d".into(), true)
            ]
        );
        assert_eq!(
            sent(3, 1, &outbox),
            [(3, "a".into(), false)],
            "the room bounds it"
        );
        // Past the outbox: fresh results from the cursor, none sent twice.
        assert_eq!(
            sent(6, 5, &[]),
            [(6, "d".into(), true), (7, "e".into(), true)]
        );
        assert_eq!(sent(8, 5, &[]), [], "nothing newer than the cursor");
        assert_eq!(sent(3, 0, &outbox), [], "no room: nothing");
    }

    #[test]
    fn a_checkpoint_in_flight_is_sent_from_memory_and_once_when_it_is_also_in_the_outbox() {
        let inflight = vec![(5, out("c")), (7, out("e"))];
        let applied = vec![(8, out("f"))];
        let pending = Pending::new(&inflight, &applied);
        let sent = |cursor, outbox: &[(u64, Output)]| {
            let it = outbox.iter().cloned().map(Ok::<_, ()>);
            next_routed(cursor, 10, it, pending, |_| true)
                .unwrap()
                .0
                .into_iter()
                .map(|(s, _, fresh)| (s, fresh))
                .collect::<Vec<_>>()
        };
        // Committing: in memory only (6 was settled before and left out).
        assert_eq!(
            sent(4, &[(4, out("b"))]),
            [(4, false), (5, true), (7, true), (8, true)]
        );
        // Committed, the loop not yet told: in the outbox too, and sent once.
        assert_eq!(
            sent(5, &[(5, out("c")), (7, out("e"))]),
            [(5, false), (7, false), (8, true)]
        );
        assert_eq!(pending.first_seq(), Some(5));
        assert_eq!(pending.find(7).map(|o| o.id.as_str()), Some("e"));
        assert_eq!(pending.find(6), None);
        assert_eq!(pending.len(), 3);
    }

    #[test]
    fn a_sink_takes_only_its_pipelines_results_and_skips_the_others() {
        let outbox = [(3, out("x/1")), (4, out("y/1")), (5, out("x/2"))];
        let pending = vec![(6, out("y/2")), (7, out("x/3"))];
        let it = outbox.iter().cloned().map(Ok::<_, ()>);
        let (batch, next) = next_routed(3, 10, it, Pending::new(&[], &pending), |id| {
            id.starts_with('y')
        })
        .unwrap();
        let got: Vec<u64> = batch.iter().map(|b| b.0).collect();
        assert_eq!(got, [4, 6]);
        assert_eq!(
            next, 8,
            "everything looked at: the cursor may move past x's"
        );
        let it = outbox.iter().cloned().map(Ok::<_, ()>);
        let (batch, next) = next_routed(3, 1, it, Pending::new(&[], &pending), |id| {
            id.starts_with('y')
        })
        .unwrap();
        assert_eq!((batch.len(), next), (1, 5), "full after 4");
    }

    #[test]
    fn nothing_is_sent_while_disconnected_whatever_the_window() {
        let mut p = Cursor::new(0);
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
        let mut p = Cursor::new(40);
        assert_eq!(p.cursor(), 40);
        p.sent("a".into(), 40, Instant::now());
        p.sent("b".into(), 41, Instant::now());
        assert_eq!(p.cursor(), 42);
        assert!(!p.idle());
        assert_eq!(p.acked("a"), vec![(40, "a".to_string())]);
        assert_eq!(p.acked("a"), vec![], "a second PUBACK deletes nothing");
        assert_eq!(p.acked("x"), vec![], "not ours");
        assert_eq!(p.acked("b"), vec![(41, "b".to_string())]);
        assert!(p.idle());
        assert_eq!(p.cursor(), 42, "acks do not move the cursor");
    }

    #[test]
    fn a_refusal_sends_it_and_everything_after_it_again_in_order() {
        let mut p = Cursor::new(0);
        let now = Instant::now();
        for (i, id) in ["a", "b", "c", "d"].iter().enumerate() {
            p.sent(id.to_string(), i as u64, now);
        }
        assert_eq!(ids(p.acked("a")), vec![0]);
        assert_eq!(ids(p.acked("c")), Vec::<u64>::new(), "waits for b");
        assert!(p.rewind("b"));
        assert_eq!(p.cursor(), 1, "b goes again, then c and d");
        assert_eq!(p.settled_below(), 1);
        assert_eq!(
            ids(p.acked("d")),
            Vec::<u64>::new(),
            "an old ack is ignored"
        );
        assert!(!p.rewind("b"), "not awaiting an answer any more");
        p.sent("b".into(), 1, now);
        assert_eq!(ids(p.acked("b")), vec![1]);
        p.skip_to(7);
        assert_eq!(p.cursor(), 7);
        assert_eq!(
            p.settled_below(),
            7,
            "entries not routed here count as settled"
        );
    }

    #[test]
    fn a_restart_begins_at_the_oldest_entry_and_sends_it_again() {
        let p = Cursor::new(7);
        assert_eq!(p.cursor(), 7);
        assert_eq!(p.settled_below(), 7, "nothing below the outbox is waiting");
        assert!(p.idle());
        assert!(!p.is_connected());
    }

    #[test]
    fn only_a_prefix_of_acknowledged_outputs_is_settled_whatever_the_ack_order() {
        let mut p = Cursor::new(0);
        for (i, id) in ["a", "b", "c", "d"].iter().enumerate() {
            p.sent(id.to_string(), i as u64, Instant::now());
        }
        assert_eq!(p.settled_below(), 0);
        // Out of order (a reconnect): c and b wait for a.
        assert_eq!(ids(p.acked("c")), Vec::<u64>::new());
        assert_eq!(ids(p.acked("b")), Vec::<u64>::new());
        assert_eq!(p.settled_below(), 0, "b and c are acked but a is not");
        assert_eq!(
            ids(p.acked("a")),
            vec![0, 1, 2],
            "a settles b and c with it"
        );
        assert_eq!(p.settled_below(), 3);
        assert_eq!(ids(p.acked("d")), vec![3]);
        assert_eq!(p.settled_below(), 4, "nothing in flight: up to the cursor");
        assert!(p.idle());
    }

    #[test]
    fn a_checkpoint_keeps_every_output_at_or_above_the_settled_prefix() {
        // The checkpoint's outputs are seqs 5..10; 5..7 were sent and acknowledged, 7 and 8
        // are on the wire, 9 was not sent. The outbox gets exactly 7, 8 and 9.
        let mut p = Cursor::new(5);
        for s in 5..9 {
            p.sent(format!("o{s}"), s, Instant::now());
        }
        p.acked("o5");
        p.acked("o6");
        p.acked("o8");
        let kept: Vec<u64> = (5..10).filter(|s| *s >= p.settled_below()).collect();
        assert_eq!(kept, vec![7, 8, 9]);
        // After the checkpoint, 7's PUBACK settles 7 and 8: both are outbox entries now.
        assert_eq!(ids(p.acked("o7")), vec![7, 8]);
        assert_eq!(p.cursor(), 9, "9 is read from the outbox next");
    }
}
