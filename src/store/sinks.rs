//! What the result sinks keep in the store beside the outbox (issues 27 and 29):
//!
//! - **Each sink's settled position** (`meta` record [`SINKS_KEY`], `Vec<(sink, seq)>`):
//!   every outbox sequence below it is settled for that sink. Staged by the agent and
//!   written with the next checkpoint, in its transaction, so after a crash each sink is
//!   re-sent only what its last durable checkpoint did not know settled. Older builds
//!   ignore the record (their one sink starts at the oldest entry, as before).
//! - **Setting one entry aside for good** ([`Store::outbox_set_aside`]): a result a
//!   destination keeps refusing, or one the operator drops (`cairn outbox drop`). Unlike an
//!   acknowledgement, which deletes a chunk only once nothing in it waits, this rewrites the
//!   chunk at once without that entry (as runs of consecutive entries, the chunk layout), so
//!   a restart does not bring the entry back.
//! - **A dead letter for a destination** ([`Store::add_sink_dead_letter`]): in the
//!   dead-letter tree, beside processing's, keyed so that it never meets one of them.

use super::*;

/// The sinks' settled positions, `Vec<(name, seq)>` (see the module docs).
pub(crate) const SINKS_KEY: &[u8] = b"sinks";

impl Store {
    /// The sinks' settled positions as the last durable checkpoint wrote them (empty for a
    /// store no sink position was ever written to).
    pub(crate) fn sink_positions(&self) -> Result<Vec<(String, u64)>, StoreError> {
        match self.meta.get(SINKS_KEY)? {
            Some(v) => decode("sink positions", &v),
            None => Ok(Vec::new()),
        }
    }

    /// The positions the next checkpoint writes (see the module docs).
    pub(crate) fn stage_sink_positions(
        &self,
        positions: &[(String, u64)],
    ) -> Result<(), StoreError> {
        let v = bounded("meta", SINKS_KEY, encode(&positions))?;
        self.lock().sinks = Some(v);
        Ok(())
    }

    /// The staged positions, taken by a commit.
    pub(super) fn take_sink_positions(&self, mem: &mut Mem) -> Option<Vec<u8>> {
        mem.sinks.take()
    }

    /// The waiting outbox entry with this output ID, if there is one: a scan, for the
    /// operator's `cairn outbox drop`.
    pub(crate) fn outbox_find(&self, id: &str) -> Result<Option<(u64, Output)>, StoreError> {
        for e in self.outbox_from(0) {
            let (seq, out) = e?;
            if out.id == id {
                return Ok(Some((seq, out)));
            }
        }
        Ok(None)
    }

    /// Set the waiting entry `seq` (output `id`) aside for good: deleted at once from the
    /// tree, its chunk rewritten without it. Not fsynced here (the next checkpoint's or the
    /// caller's sync makes it durable; until then a crash brings it back, to be refused and
    /// set aside again). `false` if it was not waiting.
    pub(crate) fn outbox_set_aside(&self, seq: u64, id: &str) -> Result<bool, StoreError> {
        let mut mem = self.lock();
        if mem.outbox.next_from(seq).map(|(s, _)| s) != Some(seq) {
            return Ok(false);
        }
        let Some((first, _)) = mem.outbox.waiting_runs(seq) else {
            return Ok(false);
        };
        let chunk = self.outbox_chunk(&mut mem, first)?;
        if let Some(emptied) = mem.outbox.ack(seq, id) {
            self.remove_outbox_chunk(&mut mem, emptied)?;
            return Ok(true);
        }
        let (first, runs) = mem
            .outbox
            .waiting_runs(seq)
            .ok_or_else(|| StoreError::Corrupt(format!("outbox chunk of {seq} vanished")))?;
        let mut batch = sled::Batch::default();
        batch.remove(&first.to_be_bytes());
        let mut fresh = Vec::with_capacity(runs.len());
        for (s, n) in runs {
            let from = usize::try_from(s - first).map_err(|_| bad_chunk())?;
            let to = usize::try_from(s - first + n).map_err(|_| bad_chunk())?;
            let entries: Vec<(u64, Output)> = chunk.get(from..to).ok_or_else(bad_chunk)?.to_vec();
            let key = s.to_be_bytes();
            let value = bounded("outbox", &key, encode(&entries))?;
            let bytes = (key.len() + value.len()) as u64;
            batch.insert(&key, value);
            fresh.push((s, Arc::new(entries), bytes));
        }
        self.outbox.apply_batch(batch)?;
        mem.outbox.replace_chunk(first, fresh);
        Ok(true)
    }

    /// Record `d` as a dead letter of sink `sink` for outbox entry `seq`: with the count in
    /// the same transaction. `d.offset` is where the log stood (so the tree's order stays
    /// the order of age, which pruning relies on); the key adds the sink and the sequence,
    /// so it never meets a letter processing made at that offset.
    pub(crate) fn add_sink_dead_letter(
        &self,
        d: &DeadLetter,
        sink: &str,
        seq: u64,
    ) -> Result<(), StoreError> {
        let mut key = pkey_dead(d.offset, &d.pipeline);
        key.push(0);
        key.extend_from_slice(sink.as_bytes());
        key.push(0);
        key.extend_from_slice(&seq.to_be_bytes());
        let value = bounded("dead", &key, dead_letter_value(&key, d))?;
        let mut mem = self.lock();
        let mut stats = mem.dead;
        if !self.dead.contains_key(&key)? {
            stats.stored += 1;
        }
        let stats_value = bounded("meta", DEAD_STATS_KEY, encode(&stats))?;
        [&self.meta, &self.dead]
            .transaction(|tx| {
                tx[1].insert(key.as_slice(), value.as_slice())?;
                tx[0].insert(DEAD_STATS_KEY, stats_value.as_slice())?;
                Ok::<(), sled::transaction::ConflictableTransactionError<()>>(())
            })
            .map_err(|e| match e {
                sled::transaction::TransactionError::Storage(e) => StoreError::Sled(e),
                sled::transaction::TransactionError::Abort(()) => unreachable!("never aborts"),
            })?;
        mem.dead = stats;
        Ok(())
    }
}
