//! The read side: what the engine reads during a checkpoint ([`ReadState`]), and the
//! listings and figures `cairn inspect`, `status` and `/metrics` show.

use super::*;

impl Store {
    /// Ledger entries per pipeline after the last commit (what `dedup_entries` reports).
    pub(crate) fn dedup_len(&self, pipeline: &str) -> u64 {
        let mem = self.lock();
        let entries = |name: &str| mem.ledgers.get(name).map_or(0, |l| l.entries());
        let groups = mem.member_of.get(pipeline).into_iter().flatten();
        entries(pipeline) + groups.map(|g| entries(g)).sum::<u64>()
    }

    /// The store's own bounds at the last commit (for `/metrics` and `cairn status`).
    pub(crate) fn bound_figures(&self) -> BoundFigures {
        let mem = self.lock();
        BoundFigures {
            dead_letters: mem.dead,
            ledger_index_bytes: mem.ledgers.index_bytes() as u64,
            ledger_unindexed_chunks: mem.ledgers.unindexed_chunks(),
        }
    }

    /// Bytes the in-memory ledger index holds (for the footprint figures).
    pub fn ledger_index_bytes(&self) -> usize {
        self.lock().ledgers.index_bytes()
    }

    /// Names of the pipelines that have state or ledger entries in the store, whether or not
    /// the progress record knows them (a store written before dormant pipelines were kept
    /// can hold state whose pipeline it forgot). One seek per pipeline in the trees keyed by
    /// pipeline; the rows, keyed by state key, are walked (their names are read in place).
    pub fn pipelines_with_data(&self) -> Result<Vec<String>, StoreError> {
        let mut names = self.row_pipelines()?;
        for tree in [&self.state, &self.dedup, &self.sparkplug] {
            let mut from = Vec::new();
            while let Some(kv) = tree.range(from.as_slice()..).next() {
                let (k, _) = kv?;
                let (p, _) = split_pkey(&k)?;
                // Every key of `p` starts `p 0x00`: the first key after them all is `p 0x01`.
                from = pkey(&p, &[]);
                *from.last_mut().expect("pkey ends in 0") = 1;
                names.insert(p);
            }
        }
        // A shared ledger's entries are its members' data.
        let mem = self.lock();
        for (g, members) in &mem.ledger_groups {
            if names.remove(g) {
                names.extend(members.iter().cloned());
            }
        }
        Ok(names.into_iter().collect())
    }

    // ---- outbox (publisher side) ----

    /// Waiting outbox entries with sequence number ≥ `from`, in order. Entries of the last
    /// checkpoints come from memory; older ones are read from the tree a chunk at a time.
    pub fn outbox_from(
        &self,
        from: u64,
    ) -> impl Iterator<Item = Result<(u64, Output), StoreError>> + '_ {
        let mut next = from;
        std::iter::from_fn(move || {
            let mut mem = self.lock();
            let (seq, first) = mem.outbox.next_from(next)?;
            next = seq + 1;
            let entry = self.outbox_chunk(&mut mem, first).and_then(|chunk| {
                chunk
                    .get((seq - first) as usize)
                    .filter(|(s, _)| *s == seq)
                    .cloned()
                    .ok_or_else(|| StoreError::Corrupt(format!("outbox entry {seq} is missing")))
            });
            Some(entry)
        })
    }

    /// Read the outbox chunks from `from` on into memory (at most `chunks`), so that the
    /// results room sends them without the store: called just before a checkpoint's commit
    /// starts, whose transaction would make every read wait for it (see
    /// [`Store::hold_outbox_deletes`]). Under a backlog the room read them one by one as it
    /// went, each read stopping the loop until the commit was done (27 stops of up to
    /// 128 ms in one run of the latency bench, 1 with the read-ahead; issue 33).
    pub(crate) fn outbox_prefetch(&self, from: u64, chunks: usize) -> Result<(), StoreError> {
        let mut mem = self.lock();
        for first in mem.outbox.chunks_from(from, chunks) {
            self.outbox_chunk(&mut mem, first)?;
        }
        Ok(())
    }

    /// An entry was published and acknowledged (on PUBACK). The chunk it is in is deleted
    /// when nothing in it waits any more; not fsynced: see the module docs.
    pub fn outbox_delete(&self, seq: u64, id: &str) -> Result<(), StoreError> {
        let mut mem = self.lock();
        match mem.outbox.ack(seq, id) {
            Some(first) => self.remove_outbox_chunk(&mut mem, first),
            None => Ok(()),
        }
    }

    /// `true` while a checkpoint commits beside the caller: outbox chunks emptied meanwhile
    /// are deleted only when it is `false` again (then, before this returns). sled's
    /// transaction excludes every other write and read of the store while it runs (its
    /// global lock), so a delete on a PUBACK stopped the loop for the whole commit: 111 ms
    /// at a time under a flat-out run (issue 33). Entries still count as gone at once; the
    /// chunk stays on disk a little longer, which a crash may bring back to be sent again
    /// with the same IDs, as for any delete not yet fsynced (see the `outbox` module).
    pub(crate) fn hold_outbox_deletes(&self, hold: bool) -> Result<(), StoreError> {
        let held = {
            let mut mem = self.lock();
            match hold {
                true => {
                    // Every commit's hold is released when it settles, before the next.
                    debug_assert!(mem.held_deletes.is_none(), "a hold never released");
                    mem.held_deletes = Some(Vec::new());
                    return Ok(());
                }
                false => mem.held_deletes.take().unwrap_or_default(),
            }
        };
        held.into_iter()
            .try_for_each(|first| self.delete_outbox_chunk(first))
    }

    /// The outbox entries commits superseded (a newer upsert of their key) since the last
    /// call, or `None` if there were too many to keep: for figures that follow what waits
    /// (the results room's per-sink counts), which then count again from the outbox.
    pub(crate) fn outbox_take_superseded(&self) -> Option<Vec<u64>> {
        self.lock().outbox.take_superseded()
    }

    /// The outbox entries the newest commit added that still wait, in order, once (see
    /// `OutboxMem::take_added`).
    pub(crate) fn outbox_take_added(&self) -> Vec<u64> {
        self.lock().outbox.take_added()
    }

    /// Entries waiting in the outbox (O(1)).
    pub(crate) fn outbox_len(&self) -> usize {
        self.lock().outbox.len()
    }

    /// Bytes (keys and values) of the outbox chunks on disk, for `outbox.max_size` (O(1)):
    /// counted as chunks are written and deleted, rebuilt at open. sled's own overhead and
    /// the space it has not reclaimed yet are not in it.
    pub(crate) fn outbox_bytes(&self) -> u64 {
        self.lock().outbox.bytes()
    }

    // ---- inspection ----

    /// Every state entry, optionally of one pipeline: (pipeline, stored key, state).
    pub fn states(
        &self,
        pipeline: Option<&str>,
    ) -> impl Iterator<Item = Result<(String, Vec<u8>, KeyState), StoreError>> + '_ {
        self.all_states(pipeline)
    }

    /// States stored over all pipelines (walks every row).
    pub(crate) fn state_len(&self) -> Result<usize, StoreError> {
        self.count_states()
    }

    /// Every ledger entry: (pipeline, event ID, seen_ms), chunk by chunk. An entry of a
    /// shared ledger is every member's (see `LEDGER_GROUPS_KEY`).
    pub fn dedup_entries(
        &self,
        pipeline: Option<&str>,
    ) -> impl Iterator<Item = Result<(String, String, u64), StoreError>> + '_ {
        let groups = self.lock().ledger_groups.clone();
        let owners: Vec<Option<String>> = match pipeline {
            Some(p) => std::iter::once(p.to_string())
                .chain(
                    (groups.iter())
                        .filter(|(_, m)| m.iter().any(|m| m == p))
                        .map(|(g, _)| g.clone()),
                )
                .map(Some)
                .collect(),
            None => vec![None],
        };
        let only = pipeline.map(str::to_string);
        owners.into_iter().flat_map(move |owner| {
            let it = match &owner {
                Some(o) => self.dedup.scan_prefix(pkey(o, &[])),
                None => self.dedup.iter(),
            };
            let (groups, only) = (groups.clone(), only.clone());
            it.flat_map(move |r| {
                let chunk = r.map_err(StoreError::from).and_then(|(k, v)| {
                    let (p, _) = split_pkey(&k)?;
                    Ok((p, decode::<ledger::Chunk>("ledger chunk", &v)?))
                });
                let (p, c) = match chunk {
                    Ok(pc) => pc,
                    Err(e) => return vec![Err(e)],
                };
                let names: Vec<String> = match groups.get(&p) {
                    Some(members) => (members.iter())
                        .filter(|m| only.as_ref().is_none_or(|o| o == *m))
                        .cloned()
                        .collect(),
                    None => vec![p],
                };
                let mut items = Vec::with_capacity(c.entries.len() * names.len());
                for (id, seen) in c.entries {
                    for n in &names {
                        items.push(Ok((n.clone(), id.clone(), seen)));
                    }
                }
                items
            })
        })
    }

    pub fn dead_letters(&self) -> impl Iterator<Item = Result<DeadLetter, StoreError>> + '_ {
        self.dead.iter().map(|r| decode("dead letter", &r?.1))
    }

    /// Dead letters stored (O(1): counted at each commit).
    pub(crate) fn dead_letter_len(&self) -> usize {
        usize::try_from(self.lock().dead.stored).unwrap_or(usize::MAX)
    }

    pub fn checkpoints(
        &self,
    ) -> impl DoubleEndedIterator<Item = Result<CheckpointInfo, StoreError>> + '_ {
        self.checkpoints
            .iter()
            .map(|r| decode("checkpoint record", &r?.1))
    }

    /// Bytes sled reports on disk.
    pub fn size_on_disk(&self) -> u64 {
        self.db.size_on_disk().unwrap_or(0)
    }
}

impl Store {
    /// When ledger `name` (a pipeline's, or a group's) recorded the ID hashed `hash`, if it
    /// did: the newest of its groups' entries for it. `mem`: the ledgers, and the lookups'
    /// reused vectors.
    fn ledger_get(
        &self,
        (ledgers, tags, groups): (&Ledgers, &mut Vec<u16>, &mut Vec<u64>),
        name: &str,
        hash: u64,
        id: &[u8],
    ) -> Result<Option<u64>, ReadError> {
        let Some(pid) = ledgers.pid(name) else {
            return Ok(None);
        };
        ledgers.candidates(pid, hash, tags, groups);
        // An ID accepted again after its entry expired is in two groups: the newest counts.
        let mut best = None;
        let mut read = Vec::new();
        for &seq in groups.iter() {
            let chunks = self
                .ledger_group(ledgers, name, pid, seq)
                .map_err(read_err)?;
            read.clear();
            for kv in chunks {
                let (k, v) = kv.map_err(|e| read_err(e.into()))?;
                let seen = ledger::chunk_get(&v, id).map_err(|_| read_err(bad_chunk()))?;
                best = best.max(seen);
                read.push(k);
            }
            // A false hit, or a duplicate of an old ID, reads a group that is usually cold.
            if ledgers.reads_cold(pid, seq) {
                self.count_group_in_cache(&read);
            }
        }
        Ok(best)
    }
}

fn read_err(e: StoreError) -> ReadError {
    ReadError(e.to_string())
}

impl crate::processor::inflight::Below for Store {
    fn state_after(
        &self,
        pipeline: &str,
        skey: &[u8],
        last: &mut super::LastRow,
    ) -> Result<Option<KeyState>, ReadError> {
        self.stored_state_after(pipeline, skey, last)
            .map_err(read_err)
    }
}

impl ReadState for Store {
    fn sparkplug(
        &self,
        pipeline: &str,
        key: &[u8],
    ) -> Result<Option<crate::pipeline::sparkplug::session::Entry>, ReadError> {
        match self
            .sparkplug
            .get(pkey(pipeline, key))
            .map_err(|e| read_err(e.into()))?
        {
            None => Ok(None),
            Some(v) => decode("Sparkplug session entry", &v)
                .map(Some)
                .map_err(read_err),
        }
    }

    fn sparkplug_keys(&self, pipeline: &str, prefix: &[u8]) -> Result<Vec<Vec<u8>>, ReadError> {
        let at = pkey(pipeline, &[]).len();
        self.sparkplug
            .scan_prefix(pkey(pipeline, prefix))
            .keys()
            .map(|k| k.map(|k| k[at..].to_vec()).map_err(|e| read_err(e.into())))
            .collect()
    }

    fn state(&self, pipeline: &str, skey: &[u8]) -> Result<Option<KeyState>, ReadError> {
        self.stored_state(pipeline, skey).map_err(read_err)
    }

    fn dedup(&self, pipeline: &str, event_id: &str) -> Result<Option<u64>, ReadError> {
        // Hashed before the lock, which the commit beside the loop waits for (16 pipelines
        // take it 16 times a record).
        let hash = ledger::id_hash(&self.hasher, pipeline, event_id.as_bytes());
        let mut mem = self.lock();
        let Mem {
            ledgers,
            tags,
            groups,
            member_of,
            applied_id,
            memo,
            ..
        } = &mut *mem;
        let id = event_id.as_bytes();
        let mut best = self.ledger_get((ledgers, tags, groups), pipeline, hash, id)?;
        // And the shared ledgers it is a member of (see `LEDGER_GROUPS_KEY`): an ID accepted
        // again after its entry expired may be in both, and the newest counts. The last
        // answer is reused while no commit has changed the ledger since (the committed
        // checkpoint is the one memory holds in full).
        let committed = self.committed_id.load(Ordering::Acquire);
        let reuse = *applied_id == Some(committed);
        for g in member_of.get(pipeline).into_iter().flatten() {
            let known = memo
                .as_ref()
                .filter(|m| reuse && m.at == committed && m.group == *g && m.id == id);
            let seen = match known {
                Some(m) => m.seen,
                None => {
                    let hash = ledger::id_hash(&self.hasher, g, id);
                    let seen = self.ledger_get((ledgers, tags, groups), g, hash, id)?;
                    if reuse {
                        let m = memo.get_or_insert_with(|| GroupMemo {
                            at: committed,
                            group: String::new(),
                            id: Vec::new(),
                            seen,
                        });
                        m.at = committed;
                        m.group.clear();
                        m.group.push_str(g);
                        m.id.clear();
                        m.id.extend_from_slice(id);
                        m.seen = seen;
                    }
                    seen
                }
            };
            best = best.max(seen);
        }
        Ok(best)
    }

    fn window_keys(&self, pipeline: &str, from: u64, to: u64) -> Result<Vec<Vec<u8>>, ReadError> {
        self.state_keys_in(pipeline, &from.to_be_bytes(), &to.to_be_bytes())
            .map_err(read_err)
    }
}
