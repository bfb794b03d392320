//! `Store::commit`: one checkpoint as one sled transaction plus a real fsync (the module
//! docs of `store` say why each step is there). The steps, in order: build every tree's
//! write batch (checking each value's bound), run the transaction, then bring the in-memory
//! ledger index and outbox up to what the trees now hold, and fsync.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use sled::Transactional;

use super::ledger::{self, Chunk};
use super::outbox;
use super::{
    BACKFILL_KEY, CHECKPOINT_HISTORY, CheckpointInfo, DEAD_PRUNE_MAX, DEAD_STATS_KEY,
    DeadLetterStats, FORMAT_KEY, Mem, PROGRESS_KEY, PROMOTE_MAX, STORE_FORMAT, Store, StoreError,
    backfill_record, bounded, dead_letter_value, decode, encode, index_room, io_err, pkey,
    pkey_dead,
};
use crate::model::{DeadLetter, Output, Progress};
use crate::pipeline::engine::{Batch, Checkpoint};

/// Ledger chunks a commit drops: (pipeline, key suffix, chunk).
type ChunkChanges = Vec<(String, Vec<u8>, Chunk)>;

/// Ledger chunks a commit adds: (pipeline, key suffix, chunk, bytes of its key and value).
type ChunksAdded = Vec<(String, Vec<u8>, Chunk, u64)>;

/// Every tree's writes for one checkpoint, built before the transaction.
struct Writes {
    state: sled::Batch,
    sparkplug: sled::Batch,
    dedup: sled::Batch,
    outbox: sled::Batch,
    dead: sled::Batch,
    checkpoints: sled::Batch,
    progress: Vec<u8>,
    /// The backfill cursors (see `BACKFILL_KEY`).
    backfill: Vec<u8>,
    /// `None` when the counts did not change.
    dead_stats: Option<Vec<u8>>,
}

impl Store {
    /// Commit one checkpoint atomically and durably (see the module docs).
    pub fn commit(
        &self,
        cp: &Checkpoint,
        committed_at_ms: u64,
    ) -> Result<CheckpointInfo, StoreError> {
        let info = self.commit_unsynced(cp, committed_at_ms)?;
        let fp = |name| crate::failpoint::hit(name).map_err(io_err(&self.dir));
        fp("checkpoint.before_fsync")?;
        self.sync()?;
        fp("checkpoint.after_fsync")?;
        Ok(info)
    }

    /// [`Store::commit`] without the fsync: the checkpoint is visible and atomic, and
    /// durable once a [`super::Syncer`] (or [`Store::sync`]) has run after it. Until then a
    /// crash leaves the previous checkpoint, as if this one had not begun.
    pub fn commit_unsynced(
        &self,
        cp: &Checkpoint,
        committed_at_ms: u64,
    ) -> Result<CheckpointInfo, StoreError> {
        let prev = self.progress()?;
        assert!(
            cp.progress.next_offset >= prev.next_offset,
            "checkpoint would move next_offset back"
        );
        assert_eq!(
            cp.progress.checkpoint_id,
            prev.checkpoint_id + 1,
            "checkpoint ids are consecutive"
        );
        let b = &cp.batch;
        let state = state_batch(b)?;
        let sparkplug = sparkplug_batch(b)?;
        let mut mem = self.lock();
        let mem = &mut *mem;
        let (dedup, added, dropped) = self.ledger_batch(mem, b, cp.progress.checkpoint_id)?;
        let out_chunks = outbox_chunks(mem, b);
        let (outbox, out_bytes) = outbox_batch(&out_chunks)?;
        let (dead, dead_stats) = self.dead_letter_batch(&b.dead_letters, &cp.progress, mem.dead)?;
        let info = CheckpointInfo {
            id: cp.progress.checkpoint_id,
            prev_offset: prev.next_offset,
            next_offset: cp.progress.next_offset,
            records: b.records,
            outputs: b.outputs.len() as u64,
            dead_letters: b.dead_letters.len() as u64,
            committed_at_ms,
        };
        let checkpoints = checkpoints_batch(&info)?;
        let progress = progress_with_ledger_sizes(mem, &cp.progress, &added, &dropped);
        let writes = Writes {
            state,
            sparkplug,
            dedup,
            outbox,
            dead,
            checkpoints,
            progress: bounded("meta", PROGRESS_KEY, encode(&progress))?,
            backfill: backfill_record(&progress)?,
            dead_stats: (dead_stats != mem.dead)
                .then(|| bounded("meta", DEAD_STATS_KEY, encode(&dead_stats)))
                .transpose()?,
        };
        self.transaction(&writes)?;
        mem.dead = dead_stats;
        self.update_memory(mem, added, dropped, out_chunks, out_bytes)?;
        Ok(info)
    }

    /// The ledger: this checkpoint's entries as new chunks, wholly expired chunks out.
    fn ledger_batch(
        &self,
        mem: &mut Mem,
        b: &Batch,
        checkpoint_id: u64,
    ) -> Result<(sled::Batch, ChunksAdded, ChunkChanges), StoreError> {
        let mut by_pipeline: HashMap<&str, Vec<(String, u64)>> = HashMap::new();
        for ((p, id), seen) in &b.dedup {
            by_pipeline
                .entry(p.as_str())
                .or_default()
                .push((id.clone(), *seen));
        }
        let mut dedup = sled::Batch::default();
        let mut added: ChunksAdded = Vec::new();
        for (p, entries) in by_pipeline {
            for (suffix, chunk) in ledger::make_chunks(entries, checkpoint_id) {
                let key = pkey(p, &suffix);
                let value = bounded("dedup", &key, encode(&chunk))?;
                let bytes = (key.len() + value.len()) as u64;
                dedup.insert(key, value);
                added.push((p.to_string(), suffix, chunk, bytes));
            }
        }
        let mut dropped: ChunkChanges = Vec::new();
        for (p, cutoff) in &b.dedup_expired_at_or_before {
            let Some(l) = mem.ledgers.get(p) else {
                continue;
            };
            for suffix in l.expired(*cutoff, ledger::EXPIRE_CHUNKS_MAX) {
                let key = pkey(p, &suffix);
                let chunk = self.ledger_chunk(&mut mem.chunks, &key)?;
                dedup.remove(key);
                dropped.push((p.clone(), suffix, Chunk::clone(&chunk)));
            }
        }
        Ok((dedup, added, dropped))
    }

    /// All trees in one sled transaction: a checkpoint is wholly visible or not at all.
    fn transaction(&self, w: &Writes) -> Result<(), StoreError> {
        let trees = [
            &self.meta,
            &self.state,
            &self.dedup,
            &self.outbox,
            &self.dead,
            &self.checkpoints,
            &self.sparkplug,
        ];
        trees[..]
            .transaction(|tx| {
                tx[1].apply_batch(&w.state)?;
                tx[6].apply_batch(&w.sparkplug)?;
                tx[2].apply_batch(&w.dedup)?;
                tx[3].apply_batch(&w.outbox)?;
                tx[4].apply_batch(&w.dead)?;
                tx[5].apply_batch(&w.checkpoints)?;
                tx[0].insert(PROGRESS_KEY, w.progress.as_slice())?;
                tx[0].insert(BACKFILL_KEY, w.backfill.as_slice())?;
                // The progress record is written in this build's layout: say so with it.
                tx[0].insert(FORMAT_KEY, &STORE_FORMAT.to_be_bytes())?;
                if let Some(v) = &w.dead_stats {
                    tx[0].insert(DEAD_STATS_KEY, v.as_slice())?;
                }
                Ok::<(), sled::transaction::ConflictableTransactionError<()>>(())
            })
            .map_err(|e| match e {
                sled::transaction::TransactionError::Storage(e) => StoreError::Sled(e),
                sled::transaction::TransactionError::Abort(()) => unreachable!("never aborts"),
            })
    }

    /// After the transaction: the ledger index and the outbox in memory follow the trees.
    fn update_memory(
        &self,
        mem: &mut Mem,
        added: ChunksAdded,
        dropped: ChunkChanges,
        out_chunks: Vec<(u64, Vec<(u64, Output)>)>,
        out_bytes: Vec<u64>,
    ) -> Result<(), StoreError> {
        // The trees hold it now (durable after the fsync that follows; if that fails the
        // process stops, and this memory with it).
        let bound = self.bounds.ledger_index_max_bytes;
        let mut freed = BTreeSet::new();
        for (p, suffix, chunk) in dropped {
            mem.chunks.forget(&pkey(&p, &suffix));
            if let Some(l) = mem.ledgers.get_mut(&p) {
                l.remove_chunk(&self.hasher, &suffix, &chunk);
            }
            freed.insert(p);
        }
        // Room freed by expiry goes first to chunks the bound left out of the index.
        for p in freed {
            self.promote(mem, &p)?;
        }
        for (p, suffix, chunk, bytes) in added {
            let room = index_room(&mem.ledgers, &p, bound);
            let l = mem.ledgers.entry(p.clone()).or_default();
            let was_full = l.unindexed_len() > 0;
            if !l.add_chunk(&self.hasher, suffix.clone(), &chunk, bytes, room) && !was_full {
                log::warn!(
                    "store: the dedup ledger index reached storage.ledger_index_max ({bound} \
                     bytes): new chunks of pipeline {p} are not indexed, and every lookup reads \
                     them (exact, but slower); raise the bound or shorten dedup_window"
                );
            }
            mem.chunks.put(pkey(&p, &suffix), Arc::new(chunk));
        }
        let mut emptied = Vec::new();
        for ((first, entries), bytes) in out_chunks.into_iter().zip(out_bytes) {
            emptied.extend(mem.outbox.add_chunk(first, Arc::new(entries), bytes));
        }
        // Chunks whose every entry a newer upsert superseded. Not fsynced, like deletions on
        // PUBACK: after a crash loading marks the same entries superseded again.
        for first in emptied {
            self.remove_outbox_chunk(first)?;
        }
        Ok(())
    }

    /// The dead letters of one commit, and the oldest ones pruned (see the module docs):
    /// the write batch and the counts it leaves.
    fn dead_letter_batch(
        &self,
        letters: &[DeadLetter],
        progress: &Progress,
        before: DeadLetterStats,
    ) -> Result<(sled::Batch, DeadLetterStats), StoreError> {
        let mut stats = before;
        let mut fresh = BTreeMap::new();
        for d in letters {
            let key = pkey_dead(d.offset, &d.pipeline);
            let value = bounded("dead", &key, dead_letter_value(&key, d))?;
            // Replay after a crash never meets a letter the tree holds (it starts after the
            // checkpoint), but a count must not drift if it ever did.
            if !fresh.contains_key(&key) && !self.dead.contains_key(&key)? {
                stats.stored += 1;
            }
            fresh.insert(key, value);
        }
        let mut batch = sled::Batch::default();
        // Age, measured on the log clock (record time), so replay prunes exactly the same.
        let cutoff = progress
            .log_clock_ms
            .saturating_sub(self.bounds.dead_letters_max_age_ms);
        let mut gone = 0usize;
        for kv in self.dead.iter().take(DEAD_PRUNE_MAX) {
            let (k, v) = kv?;
            let d: DeadLetter = decode("dead letter", &v)?;
            if d.received_at_ms >= cutoff {
                break;
            }
            batch.remove(k);
            gone += 1;
        }
        stats.stored -= gone as u64;
        stats.pruned_age += gone as u64;
        // Count: the oldest of the tree's remaining letters and this batch's.
        let excess = stats
            .stored
            .saturating_sub(self.bounds.dead_letters_max_entries);
        // At most what this batch adds plus DEAD_PRUNE_MAX, so a lowered bound is reached
        // over a few commits instead of in one huge transaction.
        let excess = usize::try_from(excess)
            .unwrap_or(usize::MAX)
            .min(fresh.len() + DEAD_PRUNE_MAX);
        if excess > 0 {
            let mut oldest: Vec<Vec<u8>> = self
                .dead
                .iter()
                .keys()
                .skip(gone)
                .take(excess)
                .map(|k| k.map(|k| k.to_vec()))
                .collect::<Result<_, _>>()?;
            oldest.extend(fresh.keys().cloned());
            oldest.sort();
            oldest.dedup();
            for k in oldest.into_iter().take(excess) {
                if fresh.remove(&k).is_none() {
                    batch.remove(k);
                }
            }
            stats.stored -= excess as u64;
            stats.pruned_count += excess as u64;
        }
        for (k, v) in fresh {
            batch.insert(k, v);
        }
        Ok((batch, stats))
    }

    /// Index again, oldest first, the chunks of `pipeline` that the memory bound left out,
    /// as far as the room expiry freed allows.
    fn promote(&self, mem: &mut Mem, pipeline: &str) -> Result<(), StoreError> {
        let bound = self.bounds.ledger_index_max_bytes;
        let Some(l) = mem.ledgers.get(pipeline) else {
            return Ok(());
        };
        if l.unindexed_len() == 0 {
            return Ok(());
        }
        for suffix in l.unindexed(PROMOTE_MAX) {
            let chunk = self.ledger_chunk(&mut mem.chunks, &pkey(pipeline, &suffix))?;
            let room = index_room(&mem.ledgers, pipeline, bound);
            let Some(l) = mem.ledgers.get_mut(pipeline) else {
                break;
            };
            if !l.promote(&self.hasher, &suffix, &chunk, room) {
                break;
            }
            if l.unindexed_len() == 0 {
                log::info!(
                    "store: the dedup ledger index of pipeline {pipeline} is within \
                     storage.ledger_index_max again"
                );
            }
        }
        Ok(())
    }
}

/// The state tree's writes: a key's new state, or its removal.
fn state_batch(b: &Batch) -> Result<sled::Batch, StoreError> {
    let mut state = sled::Batch::default();
    for ((p, skey), v) in &b.state {
        let key = pkey(p, skey);
        match v {
            Some(s) => {
                let value = bounded("state", &key, encode(s))?;
                state.insert(key, value);
            }
            None => state.remove(key),
        }
    }
    Ok(state)
}

/// The Sparkplug session entries' writes (each bounded by the session module's limits on
/// names and IDs, checked again here like every value).
fn sparkplug_batch(b: &Batch) -> Result<sled::Batch, StoreError> {
    let mut batch = sled::Batch::default();
    for ((p, k), v) in &b.sparkplug {
        let key = pkey(p, k);
        match v {
            Some(e) => {
                let value = bounded("sparkplug", &key, encode(e))?;
                batch.insert(key, value);
            }
            None => batch.remove(key),
        }
    }
    Ok(batch)
}

/// The outbox: IDs already waiting are not inserted again (invariant 6).
fn outbox_chunks(mem: &Mem, b: &Batch) -> Vec<(u64, Vec<(u64, Output)>)> {
    let mut fresh = Vec::with_capacity(b.outputs.len());
    let mut seen_ids = HashSet::new();
    for (seq, out) in &b.outputs {
        if mem.outbox.admits(&out.id) && seen_ids.insert(out.id.as_str()) {
            fresh.push((*seq, out.clone()));
        }
    }
    outbox::make_chunks(fresh)
}

/// The outbox writes, and the bytes (key and value) of each chunk for `outbox.max_size`.
fn outbox_batch(
    out_chunks: &[(u64, Vec<(u64, Output)>)],
) -> Result<(sled::Batch, Vec<u64>), StoreError> {
    let mut outbox = sled::Batch::default();
    let mut bytes = Vec::with_capacity(out_chunks.len());
    for (first, entries) in out_chunks {
        let key = first.to_be_bytes();
        let value = bounded("outbox", &key, encode(entries))?;
        bytes.push((key.len() + value.len()) as u64);
        outbox.insert(&key, value);
    }
    Ok((outbox, bytes))
}

/// This checkpoint's record, and the one that falls out of the kept history.
fn checkpoints_batch(info: &CheckpointInfo) -> Result<sled::Batch, StoreError> {
    let mut checkpoints = sled::Batch::default();
    let key = info.id.to_be_bytes();
    checkpoints.insert(&key, bounded("checkpoints", &key, encode(info))?);
    if info.id > CHECKPOINT_HISTORY {
        checkpoints.remove(&(info.id - CHECKPOINT_HISTORY).to_be_bytes());
    }
    Ok(checkpoints)
}

/// The progress record, with the ledger sizes this checkpoint leaves recorded with it.
fn progress_with_ledger_sizes(
    mem: &Mem,
    progress: &Progress,
    added: &ChunksAdded,
    dropped: &ChunkChanges,
) -> Progress {
    let mut progress = progress.clone();
    for pp in &mut progress.pipelines {
        let mut n = mem.ledgers.get(&pp.name).map_or(0, |l| l.entries());
        for (p, _, c, _) in added {
            if *p == pp.name {
                n += c.entries.len() as u64;
            }
        }
        for (p, _, c) in dropped {
            if *p == pp.name {
                n -= c.entries.len() as u64;
            }
        }
        pp.dedup_entries = n;
    }
    progress
}
