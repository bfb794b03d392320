//! `Store::commit`: one checkpoint as one sled transaction plus a real fsync (the module
//! docs of `store` say why each step is there). The steps, in order: build every tree's
//! write batch (checking each value's bound), write the ledger's new chunks (uncommitted
//! until the transaction: [`Store::write_chunks`]), run the transaction, then bring the in-memory
//! ledger index and outbox up to what the trees now hold, and fsync. The index's share of
//! that (sweeping out expired entries, merging in the new ones) takes milliseconds, and it
//! is done in slices, each a short hold of the store's lock handed to a waiting lookup
//! when it ends: the commit runs beside the agent's loop, whose lookups take the same lock.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use sled::Transactional;

use super::ledger::{self, Added, NewChunk};
use super::outbox;
use super::{
    BACKFILL_KEY, CHECKPOINT_HISTORY, CheckpointInfo, DEAD_PRUNE_MAX, DEAD_STATS_KEY,
    DeadLetterStats, FORMAT_KEY, LEDGER_GROUPS_KEY, LEDGER_WINDOWS_KEY, Mem, PROGRESS_KEY,
    PROMOTE_MAX, SEND_HORIZON_KEY, STORE_FORMAT, Store, StoreError, backfill_record, bounded,
    dead_letter_value, decode, encode, io_err, pkey, pkey_dead,
};
use crate::model::{DeadLetter, Output, Progress};
use crate::pipeline::engine::{Batch, Checkpoint};

/// About how many entries of index pages a commit merges its new entries into per hold of
/// the store's lock: 512 KiB of pages, a few hundred µs (see [`Store::index_added`]).
const INDEX_WALK: usize = 131_072;
/// Most index entries the sweep walks per hold of the store's lock (a few hundred µs; see
/// [`Store::sweep_and_promote`]).
const SWEEP_SLICE: usize = 32 * 1024;

/// A ledger group a commit drops: every entry in it has expired.
struct Dropped {
    pipeline: String,
    pid: u32,
    seq: u64,
    hashes: Vec<u64>,
}

/// The ledger's new chunks of one commit (see [`Store::ledger_fresh`]).
pub(super) struct Fresh {
    /// Encoded: key, value. Written before the transaction (see [`Store::write_chunks`]).
    pub(super) chunks: Vec<(Vec<u8>, Vec<u8>)>,
    added: Vec<NewChunk>,
    /// Chunks started per pipeline.
    new_chunks: BTreeMap<String, usize>,
}

/// What a commit decides under the store's lock (see [`Store::commit_unsynced`]).
struct Plan {
    /// Wholly expired ledger groups: pipeline, its number, the group, its key range.
    expire: Vec<(String, u32, u64, ledger::GroupRange)>,
    /// The dedup windows to record, if they changed.
    windows: Option<BTreeMap<String, u64>>,
    /// The outputs the outbox admits, by their place in the batch (cloned after the lock).
    outputs: Vec<usize>,
    /// Upserts a newer one of their key in the same batch superseded: never written.
    superseded: Vec<u64>,
    /// The dead-letter counts before this commit.
    dead: DeadLetterStats,
    /// The sinks' staged positions, encoded.
    sinks: Option<Vec<u8>>,
    /// Each ledger's entries before this commit.
    ledger_entries: BTreeMap<String, u64>,
    /// Per pipeline, the shared ledgers it is a member of.
    member_of: BTreeMap<String, Vec<String>>,
    /// The shared ledgers' record, when groups were named since it was written.
    groups: Option<Vec<u8>>,
}

/// The ledger's part of a commit.
struct LedgerWrites {
    /// The transaction's part: the expired chunks it deletes.
    batch: sled::Batch,
    added: Vec<NewChunk>,
    dropped: Vec<Dropped>,
    /// The dedup windows to record, if they changed (see `LEDGER_WINDOWS_KEY`).
    windows: Option<(BTreeMap<String, u64>, Vec<u8>)>,
}

/// Every tree's writes for one checkpoint, built before the transaction.
struct Writes {
    /// States that did not fit their row (see `rows.rs`).
    state: sled::Batch,
    rows: sled::Batch,
    sparkplug: sled::Batch,
    /// Expired ledger chunks deleted; the new ones are written before (`write_chunks`).
    dedup: sled::Batch,
    outbox: sled::Batch,
    dead: sled::Batch,
    checkpoints: sled::Batch,
    progress: Vec<u8>,
    /// The backfill cursors (see `BACKFILL_KEY`).
    backfill: Vec<u8>,
    /// `None` when the counts did not change.
    dead_stats: Option<Vec<u8>>,
    /// `None` when the dedup windows did not change.
    windows: Option<Vec<u8>>,
    /// The sinks' settled positions, when the agent staged them (`sinks.rs`).
    sinks: Option<Vec<u8>>,
    /// The send horizon the checkpoint records, if it records one (`SEND_HORIZON_KEY`).
    send_horizon: Option<[u8; 8]>,
    /// The shared ledgers, when groups were named since the record was written.
    groups: Option<Vec<u8>>,
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
        self.upgrade_layout()?;
        let (rows, state) = self.state_writes(&b.state)?;
        let sparkplug = sparkplug_batch(b)?;
        let Fresh {
            chunks,
            added,
            new_chunks,
        } = self.ledger_fresh(cp)?;
        let mut dedup = sled::Batch::default();
        // What depends on memory is decided under the lock, briefly: the loop's dedup
        // lookups and outbox reads take it too, and they go on while a checkpoint commits
        // beside the loop (`agent/keeper/commit.rs`). Only commits change the ledger's
        // groups, one at a time, so the groups chosen here stay as they are until the
        // update below.
        let (keep, superseded) = superseded_outputs(b);
        let plan = {
            let mut mem = self.lock();
            self.commit_plan(&mut mem, cp, &new_chunks, (keep, superseded))
        };
        let mut dropped = Vec::with_capacity(plan.expire.len());
        for (pipeline, pid, seq, range) in plan.expire {
            let (keys, hashes) = self.ledger_range_hashes(&pipeline, range)?;
            for k in keys {
                dedup.remove(k);
            }
            dropped.push(Dropped {
                pipeline,
                pid,
                seq,
                hashes,
            });
        }
        let windows = match plan.windows {
            Some(windows) => {
                let list: Vec<(&String, &u64)> = windows.iter().collect();
                let v = bounded("meta", LEDGER_WINDOWS_KEY, encode(&list))?;
                Some((windows, v))
            }
            None => None,
        };
        let mut lw = LedgerWrites {
            batch: dedup,
            added,
            dropped,
            windows,
        };
        // Borrowed from the batch, which the loop reads until the commit is durable: only
        // the chunks the outbox's cache keeps are copied, after the transaction. A copy of
        // every admitted output lived through the transaction beside the batch's own: ~2
        // MB at 16 pipelines and every key in one checkpoint (issue 33).
        let out_chunks = outbox::make_chunks(plan.outputs.iter().map(|&i| &b.outputs[i]));
        let (outbox, out_bytes) = outbox_batch(&out_chunks)?;
        let (dead, dead_stats) =
            self.dead_letter_batch(&b.dead_letters, &cp.progress, plan.dead)?;
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
        let progress =
            progress_with_ledger_sizes((&plan.ledger_entries, &plan.member_of), &cp.progress, &lw);
        let groups = (plan.groups)
            .map(|v| bounded("meta", LEDGER_GROUPS_KEY, v))
            .transpose()?;
        let writes = Writes {
            state,
            rows,
            sparkplug,
            dedup: std::mem::take(&mut lw.batch),
            outbox,
            dead,
            checkpoints,
            progress: bounded("meta", PROGRESS_KEY, encode(&progress))?,
            backfill: backfill_record(&progress)?,
            dead_stats: (dead_stats != plan.dead)
                .then(|| bounded("meta", DEAD_STATS_KEY, encode(&dead_stats)))
                .transpose()?,
            windows: lw.windows.as_ref().map(|(_, v)| v.clone()),
            sinks: plan.sinks,
            send_horizon: b.send_horizon.map(u64::to_be_bytes),
            groups,
        };
        // Every value is encoded and within its bound: nothing below refuses the checkpoint
        // but the disk.
        let fp = |name| crate::failpoint::hit(name).map_err(io_err(&self.dir));
        let committed = self
            .write_chunks(&chunks)
            .and_then(|()| fp("checkpoint.ledger_written"))
            .and_then(|()| self.transaction(&writes));
        drop(chunks);
        if let Err(e) = committed {
            self.unwrite_chunks(&lw.added);
            return Err(e);
        }
        self.committed_id.store(
            cp.progress.checkpoint_id,
            std::sync::atomic::Ordering::Release,
        );
        let freed = {
            let mut mem = self.lock();
            let mem = &mut *mem;
            mem.dead = dead_stats;
            // Only a start names groups, before its first commit: what was written is all.
            if writes.groups.is_some() {
                mem.groups_unrecorded = false;
            }
            if let Some((windows, _)) = lw.windows.take() {
                mem.windows = windows;
            }
            for seq in plan.superseded {
                mem.outbox.note_superseded(seq);
            }
            self.update_outbox(mem, out_chunks, out_bytes)?;
            Self::drop_expired(mem, lw.dropped)
        };
        let was_full = self.sweep_and_promote(freed)?;
        self.index_added(&lw.added, was_full);
        let mut mem = self.lock();
        mem.memo = None;
        mem.applied_id = Some(cp.progress.checkpoint_id);
        drop(mem);
        Ok(info)
    }

    /// The ledger's new chunks from this checkpoint's entries (no memory read): their
    /// writes, what the index will add, and how many each pipeline starts.
    pub(super) fn ledger_fresh(&self, cp: &Checkpoint) -> Result<Fresh, StoreError> {
        // By owner: an ID every member of a shared ledger accepted at one time is one
        // entry of the group's (see `LEDGER_GROUPS_KEY`).
        let mut by_pipeline: BTreeMap<&str, Vec<(String, u64)>> = BTreeMap::new();
        (cp.batch.dedup).grouped(&cp.batch.ledger_groups, |owner, id, seen| {
            (by_pipeline.entry(owner).or_default()).push((id.to_string(), seen));
        });
        let mut chunks = Vec::new();
        let mut added = Vec::new();
        let mut new_chunks: BTreeMap<String, usize> = BTreeMap::new();
        for (p, entries) in by_pipeline {
            for (suffix, chunk) in ledger::make_chunks(entries, cp.progress.checkpoint_id) {
                let key = pkey(p, &suffix);
                let value = bounded("dedup", &key, encode(&chunk))?;
                let bytes = (key.len() + value.len()) as u64;
                chunks.push((key, value));
                *new_chunks.entry(p.to_string()).or_default() += 1;
                added.push(NewChunk {
                    pipeline: p.to_string(),
                    suffix,
                    max_seen: chunk.max_seen_ms,
                    bytes,
                    hashes: chunk
                        .entries
                        .iter()
                        .map(|(id, _)| ledger::id_hash(&self.hasher, p, id.as_bytes()))
                        .collect(),
                });
            }
        }
        Ok(Fresh {
            chunks,
            added,
            new_chunks,
        })
    }

    /// What a commit takes from memory, under the lock: the wholly expired ledger groups to
    /// drop (for every pipeline with a ledger: a configured one by the cutoff the engine
    /// gives, a dormant one by its recorded window on its own clock) and their key ranges,
    /// the windows to record, the outputs the outbox admits, the dead-letter counts, the
    /// sinks' staged positions and each ledger's size.
    fn commit_plan(
        &self,
        mem: &mut Mem,
        cp: &Checkpoint,
        new_chunks: &BTreeMap<String, usize>,
        (keep, superseded): (Vec<bool>, Vec<u64>),
    ) -> Plan {
        let b = &cp.batch;
        let configured: BTreeSet<&str> = (b.dedup_windows.iter())
            .chain(&b.dedup_expired_at_or_before)
            .map(|(p, _)| p.as_str())
            .collect();
        let mut cutoffs = b.dedup_expired_at_or_before.clone();
        cutoffs.extend(self.dormant_cutoffs(mem, &cp.progress, &configured));
        let mut expire = Vec::new();
        for (p, cutoff) in &cutoffs {
            let Some(pid) = mem.ledgers.pid(p) else {
                continue;
            };
            // At least as many groups as this checkpoint may start, so that the ledger keeps
            // up with any rate; bounded by the checkpoint's size.
            let limit =
                ledger::EXPIRE_GROUPS_MAX + new_chunks.get(p.as_str()).copied().unwrap_or(0);
            for seq in mem.ledgers.expired(pid, *cutoff, limit) {
                if let Some(range) = mem.ledgers.group_range(pid, seq) {
                    expire.push((p.clone(), pid, seq, range));
                }
            }
        }
        let mut windows = mem.windows.clone();
        windows.extend(b.dedup_windows.iter().cloned());
        windows.retain(|p, _| {
            configured.contains(p.as_str()) || mem.ledgers.get(p).is_some_and(|l| l.entries() > 0)
        });
        let windows = (windows != mem.windows).then_some(windows);
        let outputs = admitted_outputs(mem, b, &keep);
        Plan {
            expire,
            windows,
            outputs,
            superseded,
            dead: mem.dead,
            sinks: self.take_sink_positions(mem),
            ledger_entries: mem
                .ledgers
                .named()
                .map(|(name, l)| (name.to_string(), l.entries()))
                .collect(),
            member_of: (mem.member_of.iter())
                .map(|(p, g)| (p.clone(), g.clone()))
                .collect(),
            groups: mem.groups_unrecorded.then(|| {
                let list: Vec<(&String, &Vec<String>)> = mem.ledger_groups.iter().collect();
                encode(&list)
            }),
        }
    }

    /// Cutoffs for the ledgers of pipelines the engine did not name (dormant: stored, no
    /// longer configured): their recorded window, measured on their own clock (the log
    /// clock, or their backfill's, which a configured pipeline would use). A pipeline whose
    /// window was never recorded (a store from a build before the record) keeps its ledger,
    /// and the journal says so once.
    fn dormant_cutoffs(
        &self,
        mem: &mut Mem,
        progress: &Progress,
        configured: &BTreeSet<&str>,
    ) -> Vec<(String, u64)> {
        let mut cutoffs = Vec::new();
        let mut unknown = Vec::new();
        for (name, _) in mem.ledgers.named() {
            if configured.contains(name) {
                continue;
            }
            let Some(&window) = mem.windows.get(name) else {
                unknown.push(name.to_string());
                continue;
            };
            let clock = progress
                .pipelines
                .iter()
                .find(|pp| pp.name == name)
                .and_then(|pp| pp.backfill)
                .map_or(progress.log_clock_ms, |b| b.clock_ms);
            if let Some(cutoff) = clock.checked_sub(window) {
                cutoffs.push((name.to_string(), cutoff));
            }
        }
        for name in unknown {
            if mem.warned_windows.insert(name.clone()) {
                crate::event!(warn, "ledger_window_unknown", pipeline = name;
                    "store: pipeline {} is not configured and its dedup window was never \
                     recorded (a store from an older cairn): its dedup ledger is kept until it \
                     is configured again or dropped with `cairn run --reset-pipeline {}`",
                    crate::text::Shown(&name),
                    crate::text::Shown(&name)
                );
            }
        }
        cutoffs
    }

    /// Write a checkpoint's new ledger chunks, before its transaction and outside it.
    ///
    /// They are new keys named by the checkpoint's ID, which no committed checkpoint has
    /// used, so until the transaction commits they are *uncommitted*: lookups and expiry
    /// skip them ([`Store::ledger_range`]), and the next open deletes any a crash left
    /// ([`Store::load_ledger`]). After the transaction they are part of it, and sled's log
    /// (a prefix survives a crash, the transaction after them) makes them durable with it.
    ///
    /// One write each, not one batch: a sled batch or transaction holds every page version
    /// it makes until it ends, and at 16 pipelines over one stream the chunks were most of
    /// a checkpoint's writes (issue 33: a 20,000-record checkpoint's transaction peaked near
    /// 70 MB, and writing the chunks so took the agent's peak RSS from 133 to 98 MiB).
    pub(super) fn write_chunks(&self, chunks: &[(Vec<u8>, Vec<u8>)]) -> Result<(), StoreError> {
        for (k, v) in chunks {
            self.dedup.insert(k.as_slice(), v.as_slice())?;
        }
        // What sled's flusher (every 500 ms) or a full buffer does at its own moment: the
        // crash tests make it certain, so that a crash finds the chunks in the file.
        if crate::failpoint::enabled("store.flush_chunks") {
            self.db.flush()?;
        }
        Ok(())
    }

    /// Delete the chunks [`Store::write_chunks`] wrote for a checkpoint whose transaction
    /// failed. Best effort: any left are uncommitted, skipped, and deleted at the next open.
    fn unwrite_chunks(&self, added: &[NewChunk]) {
        for c in added {
            if let Err(e) = self.dedup.remove(pkey(&c.pipeline, &c.suffix)) {
                crate::event!(warn, "ledger_chunk_unwritten";
                    "store: a ledger chunk of a failed checkpoint stays until the next start \
                     ({e}); it is skipped meanwhile"
                );
                return;
            }
        }
    }

    /// All trees in one sled transaction: a checkpoint is wholly visible or not at all.
    fn transaction(&self, w: &Writes) -> Result<(), StoreError> {
        // Every checkpoint tree, in the order of `trees()` (what a savepoint copies):
        // meta, state, dedup, outbox, dead, checkpoints, sparkplug, rows.
        self.trees()[..]
            .transaction(|tx| {
                tx[1].apply_batch(&w.state)?;
                tx[7].apply_batch(&w.rows)?;
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
                if let Some(v) = &w.windows {
                    tx[0].insert(LEDGER_WINDOWS_KEY, v.as_slice())?;
                }
                if let Some(v) = &w.sinks {
                    tx[0].insert(super::sinks::SINKS_KEY, v.as_slice())?;
                }
                if let Some(v) = &w.send_horizon {
                    tx[0].insert(SEND_HORIZON_KEY, v.as_slice())?;
                }
                if let Some(v) = &w.groups {
                    tx[0].insert(LEDGER_GROUPS_KEY, v.as_slice())?;
                }
                Ok::<(), sled::transaction::ConflictableTransactionError<()>>(())
            })
            .map_err(|e| match e {
                sled::transaction::TransactionError::Storage(e) => StoreError::Sled(e),
                sled::transaction::TransactionError::Abort(()) => unreachable!("never aborts"),
            })
    }

    /// After the transaction: the ledger's groups and index let go of the expired groups
    /// (durable after the fsync that follows; if that fails the process stops, and this
    /// memory with it). Returns the pipelines whose ledgers they were.
    fn drop_expired(mem: &mut Mem, dropped: Vec<Dropped>) -> BTreeSet<String> {
        let mut freed = BTreeSet::new();
        let mut removals = Vec::new();
        for d in dropped {
            mem.ledgers
                .drop_oldest(d.pid, d.seq, &d.hashes, &mut removals);
            freed.insert(d.pipeline);
        }
        mem.ledgers.remove_entries(&removals);
        freed
    }

    /// Then the index's sweep takes out the dropped groups' entries ([`SWEEP_SLICE`] walked
    /// per hold of the lock, as [`Store::index_added`] does and for the same reason: ~16
    /// entries walked per ID expired, 2-3 ms for a checkpoint's 20,000), and room freed by
    /// expiry goes first to groups the bound left out of the index (`freed`: whose ledgers
    /// lost groups). Returns whether chunks are still left out of the index.
    fn sweep_and_promote(&self, freed: BTreeSet<String>) -> Result<bool, StoreError> {
        loop {
            let mut mem = self.lock();
            let more = mem.ledgers.sweep_owed(SWEEP_SLICE);
            parking_lot::MutexGuard::unlock_fair(mem);
            if !more {
                break;
            }
        }
        let bound = self.bounds.ledger_index_bytes();
        let mut mem = self.lock();
        for p in freed {
            self.promote(&mut mem, &p, bound)?;
        }
        Ok(mem.ledgers.unindexed_chunks() > 0)
    }

    /// After the transaction: the checkpoint's new ledger chunks go into the groups, and
    /// their entries into the index, about [`INDEX_WALK`] entries of pages per hold of the
    /// lock, each hold handed straight to a lookup waiting. Merging a checkpoint's 20,000
    /// IDs takes 6-12 ms (every page of a 1M-entry index touched once), and the loop's
    /// dedup lookups, which take the lock too, waited for all of it while the commit ran
    /// beside the loop (issue 33; `cargo bench --bench ledger` with `CAIRN_LEDGER_BESIDE=1`
    /// shows the waits).
    /// Until its entry is in, a lookup of one of this checkpoint's IDs may miss in the
    /// index: the loop reads the checkpoint in flight first (`processor/inflight.rs`) until
    /// the commit is done, so such a lookup never gets this far. `was_full`: chunks were
    /// left out of the index already (the journal said so then).
    fn index_added(&self, added: &[NewChunk], was_full: bool) {
        let bound = self.bounds.ledger_index_bytes();
        let (placed, inserts, dir_bits) = {
            let mut mem = self.lock();
            let (placed, inserts) = mem.ledgers.place_chunks(added, bound);
            (placed, inserts, mem.ledgers.dir_bits())
        };
        let mut sorted = super::index::Sorted::new(dir_bits, &inserts);
        loop {
            let mut mem = self.lock();
            let more = mem.ledgers.merge_some(&mut sorted, INDEX_WALK);
            // Straight to a lookup waiting, if any: else this thread would take the lock
            // back for the next pages before the waiter woke, and it would wait them all.
            parking_lot::MutexGuard::unlock_fair(mem);
            if !more {
                break;
            }
        }
        if placed == Added::Unindexed && !was_full {
            crate::event!(warn, "ledger_index_full";
                "store: the dedup ledger index reached storage.ledger_index_max ({bound} \
                 bytes): new ledger chunks are not indexed, and every lookup reads them \
                 (exact, but slower); raise the bound or shorten dedup_window"
            );
        }
    }

    /// After the transaction: the outbox in memory follows the tree.
    fn update_outbox(
        &self,
        mem: &mut Mem,
        out_chunks: Vec<(u64, Vec<&(u64, Output)>)>,
        out_bytes: Vec<u64>,
    ) -> Result<(), StoreError> {
        let mut emptied = Vec::new();
        let seqs = out_chunks
            .iter()
            .flat_map(|(_, entries)| entries.iter().map(|e| e.0));
        mem.outbox.note_added(seqs);
        // The cache keeps the newest chunks: those that would have pushed the others out.
        let cached_from = out_chunks.len().saturating_sub(outbox::CACHE_CHUNKS);
        for (i, ((first, entries), bytes)) in out_chunks.into_iter().zip(out_bytes).enumerate() {
            emptied.extend(if i >= cached_from {
                let owned = entries.into_iter().cloned().collect();
                mem.outbox
                    .add_chunk(first, std::sync::Arc::new(owned), bytes)
            } else {
                mem.outbox.add_uncached(first, &entries, bytes)
            });
        }
        // Chunks whose every entry a newer upsert superseded. Not fsynced, like deletions on
        // PUBACK: after a crash loading marks the same entries superseded again.
        for first in emptied {
            self.delete_outbox_chunk(first)?;
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

    /// Index again, oldest first, the groups of `pipeline` that the memory bound left out,
    /// as far as the room expiry freed allows.
    fn promote(&self, mem: &mut Mem, pipeline: &str, bound: usize) -> Result<(), StoreError> {
        let Some(pid) = mem.ledgers.pid(pipeline) else {
            return Ok(());
        };
        for seq in mem.ledgers.unindexed(pid, PROMOTE_MAX) {
            let (_, hashes) = self.ledger_group_hashes(&mem.ledgers, pipeline, pid, seq)?;
            if !mem.ledgers.promote(pid, seq, &hashes, bound) {
                break;
            }
            if mem.ledgers.unindexed_chunks() == 0 {
                crate::event!(info, "ledger_index_ok";
                    "store: the dedup ledger index is within storage.ledger_index_max again"
                );
            }
        }
        Ok(())
    }
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

/// The upserts that a newer upsert of their key in the same batch supersedes: they are not
/// written at all (the outbox would mark them done as the newer one went in: with many
/// pipelines' upserts flushed at every log commit, most of a checkpoint's outputs were
/// written only to be dropped in the same commit; issue 33). Returns, per output, whether
/// it is kept, and the superseded ones' sequence numbers. Needs nothing the store's lock
/// guards, so it runs before it.
fn superseded_outputs(b: &Batch) -> (Vec<bool>, Vec<u64>) {
    // Per key, the highest version of the upserts after the one looked at.
    let mut newer_upsert: HashMap<&str, u64> = HashMap::new();
    let mut superseded = Vec::new();
    let mut keep = vec![true; b.outputs.len()];
    for (i, (seq, out)) in b.outputs.iter().enumerate().rev() {
        let (key, version) = outbox::split_id(&out.id);
        if newer_upsert.get(key).is_some_and(|&v| v > version) {
            keep[i] = false;
            superseded.push(*seq);
        }
        if out.latest_only {
            let v = newer_upsert.entry(key).or_insert(version);
            *v = (*v).max(version);
        }
    }
    superseded.reverse();
    (keep, superseded)
}

/// The outputs the outbox takes, by their place in the batch: those `keep` keeps, less the
/// IDs already waiting (invariant 6) and the second of two equal IDs. Under the store's
/// lock: only the outbox's IDs are looked at, and nothing is cloned here.
fn admitted_outputs(mem: &Mem, b: &Batch, keep: &[bool]) -> Vec<usize> {
    let mut fresh = Vec::with_capacity(keep.iter().filter(|&&k| k).count());
    let mut seen_ids = HashSet::new();
    for (i, ((_, out), &keep)) in b.outputs.iter().zip(keep).enumerate() {
        if keep && mem.outbox.admits(&out.id) && seen_ids.insert(out.id.as_str()) {
            fresh.push(i);
        }
    }
    fresh
}

/// The outbox writes, and the bytes (key and value) of each chunk for `outbox.max_size`.
fn outbox_batch(
    out_chunks: &[(u64, Vec<&(u64, Output)>)],
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

/// The progress record with each pipeline's ledger entries after this commit: its own
/// ledger's and those of the shared ledgers it is a member of (`before`: each ledger's
/// entries before it).
fn progress_with_ledger_sizes(
    (before, member_of): (&BTreeMap<String, u64>, &BTreeMap<String, Vec<String>>),
    progress: &Progress,
    lw: &LedgerWrites,
) -> Progress {
    let entries = |owner: &str| {
        let mut n = before.get(owner).copied().unwrap_or(0);
        for c in lw.added.iter().filter(|c| c.pipeline == owner) {
            n += c.hashes.len() as u64;
        }
        for d in lw.dropped.iter().filter(|d| d.pipeline == owner) {
            n = n.saturating_sub(d.hashes.len() as u64);
        }
        n
    };
    let mut progress = progress.clone();
    for pp in &mut progress.pipelines {
        let groups = member_of.get(&pp.name).into_iter().flatten();
        pp.dedup_entries = entries(&pp.name) + groups.map(|g| entries(g)).sum::<u64>();
    }
    progress
}
