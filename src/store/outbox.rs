//! The outbox on disk and in memory.
//!
//! On disk (tree `outbox`), each checkpoint writes its outputs as a few *chunks*: key
//! `first_seq u64 BE`, value a postcard `Vec<(seq, Output)>` in sequence order, at most
//! [`CHUNK_ENTRIES`] entries and about [`CHUNK_BYTES`] bytes (small, to keep sled's leaf
//! nodes out of its never-fsynced blob files: see [`super::ledger`]). A chunk is deleted (not
//! fsynced) when every entry in it has been acknowledged by the broker: one sled write per
//! chunk instead of two per output. After a crash a chunk that was partly acknowledged is
//! sent again whole, with the same IDs, which is what invariant 6 allows.
//!
//! In memory, per chunk: its sequence range and a bit per entry that is done (acknowledged,
//! or superseded); per output key (the ID without its version) the newest waiting entry; and
//! up to [`CACHE_CHUNKS`] decoded chunks: what was just committed, and what the sinks send
//! next, read ahead before a commit keeps the store from the loop (`Store::outbox_prefetch`).
//!
//! - **No going back.** An output whose version is at or below that of a waiting output of
//!   the same key is not inserted: this is how inserting an ID already waiting is a no-op
//!   (invariant 6), without keeping every waiting ID.
//! - **Upserts supersede.** An upsert output (`latest_only`) marks the older waiting upsert
//!   of its key done: it carries the key's whole state, so a consumer that keeps the highest
//!   version per key loses nothing, and after an outage the broker gets one result per key
//!   instead of every intermediate version (a replay of 1M events over 100k keys left about
//!   980k waiting before, 100k now). An upsert superseded within its own checkpoint is not
//!   written at all (`commit.rs`), and reported as superseded all the same. Changelog
//!   outputs are never superseded. After a restart
//!   the same rule, applied while loading the chunks in order, marks the same entries done.
//!
//! Keys are told apart by a 128-bit hash of their text (two keyed SipHash halves); a
//! collision would need about 2^64 keys.

use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasher, RandomState};
use std::sync::Arc;

use super::lru::Lru;
use crate::model::Output;

pub(crate) const CHUNK_ENTRIES: usize = 256;
pub(crate) const CHUNK_BYTES: usize = 4 * 1024;
/// Decoded chunks kept: the newest a commit wrote, and those read ahead for the sinks while
/// a commit runs ([`PREFETCH_CHUNKS`]). At most ~4 KiB each on disk.
pub(super) const CACHE_CHUNKS: usize = 128;
/// Most chunks read ahead of the sinks' cursors before a commit starts, over all sinks:
/// what a sink sends while the commit's transaction keeps the store from the loop. Under a
/// backlog a commit of 20,000 outputs (~750 outbox chunks) took 23-92 ms, while the sink
/// sent ~20,000 results/s (~27 a chunk): up to ~70 chunks.
pub(crate) const PREFETCH_CHUNKS: usize = 96;
/// Outputs a commit writes for each chunk read ahead ([`prefetch_chunks`]): the figures
/// above, ~20,000 outputs for ~70 chunks, rounded to be generous.
const PREFETCH_OUTPUTS_PER_CHUNK: usize = 256;
/// Fewest chunks read ahead for each sink, however small the commit.
pub(crate) const PREFETCH_MIN: usize = 4;
/// Superseded sequences kept for [`OutboxMem::take_superseded`] between two takes; past it
/// the taker is told to count again from the outbox instead (replay at start commits many
/// checkpoints before anyone takes them).
const SUPERSEDED_MAX: usize = 1 << 16;

pub(crate) type ChunkEntries = Arc<Vec<(u64, Output)>>;

/// Chunks to read ahead for each of `sinks` before a commit of `outputs` outputs: as many
/// as a sink sends while it runs, which grows with its size. With [`PREFETCH_CHUNKS`] read
/// ahead always, a commit at 16 pipelines (one every ~100 records, adding up to ~57 chunks:
/// 1,536 upserts at ~27 a chunk) and the read-ahead did not fit the 128 cached chunks
/// together, and each read-ahead decoded again chunks the sink then never reached before
/// newer upserts superseded them: a tenth of the loop's samples (issue 33).
pub(crate) fn prefetch_chunks(outputs: usize, sinks: usize) -> usize {
    let all = (outputs / PREFETCH_OUTPUTS_PER_CHUNK).min(PREFETCH_CHUNKS);
    (all / sinks.max(1)).max(PREFETCH_MIN)
}

/// Cut outputs (in sequence order) into chunks of consecutive sequence numbers:
/// (first seq, entries). Borrowed or owned alike (`&(u64, Output)` encodes as the entry).
pub(crate) fn make_chunks<E: std::borrow::Borrow<(u64, Output)>>(
    outputs: impl IntoIterator<Item = E>,
) -> Vec<(u64, Vec<E>)> {
    let mut out: Vec<(u64, Vec<E>)> = Vec::new();
    let mut bytes = 0;
    for e in outputs {
        let (seq, o) = e.borrow();
        let (seq, size) = (*seq, o.id.len() + o.topic.len() + o.payload.len() + 16);
        let full = out.last().is_none_or(|(first, c)| {
            c.len() >= CHUNK_ENTRIES || bytes + size > CHUNK_BYTES || *first + c.len() as u64 != seq
        });
        if full {
            out.push((seq, Vec::new()));
            bytes = 0;
        }
        bytes += size;
        out.last_mut().expect("pushed").1.push(e);
    }
    out
}

/// An output ID's key and version: `pipeline/key[/window]` and the number after the last
/// `/` (keys are escaped, so they hold no `/`). An ID of another shape is a key of its own
/// with version 0.
pub(crate) fn split_id(id: &str) -> (&str, u64) {
    match id.rsplit_once('/') {
        Some((key, v)) => match v.parse() {
            Ok(v) => (key, v),
            Err(_) => (id, 0),
        },
        None => (id, 0),
    }
}

struct ChunkMeta {
    n: u64,
    waiting: u64,
    /// Its key and value on disk.
    bytes: u64,
    /// Bit `i`: entry `first + i` is done (acknowledged or superseded).
    done: Vec<u64>,
}

impl ChunkMeta {
    fn is_done(&self, i: u64) -> bool {
        self.done[(i / 64) as usize] & (1 << (i % 64)) != 0
    }
}

/// The newest waiting entry of one output key.
#[derive(Clone, Copy)]
struct Newest {
    seq: u64,
    version: u64,
}

pub(crate) struct OutboxMem {
    chunks: BTreeMap<u64, ChunkMeta>,
    newest: HashMap<u128, Newest>,
    hashers: (RandomState, RandomState),
    len: usize,
    /// Bytes of the chunks on disk (see [`ChunkMeta::bytes`]).
    bytes: u64,
    /// Decoded chunks.
    cache: Lru<u64, ChunkEntries>,
    /// Entries commits superseded since the last [`OutboxMem::take_superseded`] (`None`:
    /// more than [`SUPERSEDED_MAX`]): the results room's per-sink figures follow them.
    superseded: Option<Vec<u64>>,
    /// The entries the newest commit added (see [`OutboxMem::take_added`]).
    added: Vec<u64>,
}

impl Default for OutboxMem {
    fn default() -> Self {
        OutboxMem {
            chunks: BTreeMap::new(),
            newest: HashMap::new(),
            hashers: Default::default(),
            len: 0,
            bytes: 0,
            cache: Lru::new(CACHE_CHUNKS),
            superseded: Some(Vec::new()),
            added: Vec::new(),
        }
    }
}

impl OutboxMem {
    /// Entries waiting to be sent or acknowledged.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Bytes of the chunks still on disk: what `outbox.max_size` bounds.
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }

    fn key_hash(&self, key: &str) -> u128 {
        let a = self.hashers.0.hash_one(key.as_bytes());
        let b = self.hashers.1.hash_one(key.as_bytes());
        (u128::from(a) << 64) | u128::from(b)
    }

    /// Whether an output with this ID may go in: not when one of its key with this or a
    /// higher version is waiting.
    pub(crate) fn admits(&self, id: &str) -> bool {
        let (key, version) = split_id(id);
        self.newest
            .get(&self.key_hash(key))
            .is_none_or(|n| version > n.version)
    }

    /// Register a chunk that is (or is about to be) in the tree. Its entries must have
    /// consecutive sequence numbers starting at `first`. Returns the chunks (this one
    /// included) that its upserts left with nothing waiting, to delete from the tree.
    /// `bytes`: its key and value as written.
    pub(crate) fn add_chunk(&mut self, first: u64, entries: ChunkEntries, bytes: u64) -> Vec<u64> {
        let emptied = self.add_uncached(first, &entries[..], bytes);
        self.cache_put(first, entries);
        emptied
    }

    /// [`OutboxMem::add_chunk`], leaving the entries out of the cache of decoded chunks
    /// (read from the store if a sink needs them).
    pub(crate) fn add_uncached<E: std::borrow::Borrow<(u64, Output)>>(
        &mut self,
        first: u64,
        entries: &[E],
        bytes: u64,
    ) -> Vec<u64> {
        self.insert_waiting(first, entries.len(), bytes);
        let mut emptied = Vec::new();
        for (i, e) in entries.iter().enumerate() {
            let (seq, o) = e.borrow();
            assert_eq!(
                *seq,
                first + i as u64,
                "an outbox chunk holds consecutive seqs"
            );
            let (key, version) = split_id(&o.id);
            let h = self.key_hash(key);
            let old = self.newest.insert(h, Newest { seq: *seq, version });
            if let Some(old) = old.filter(|_| o.latest_only) {
                let done = self.mark_done(old.seq);
                if done.is_some() {
                    self.note_superseded(old.seq);
                }
                if let Some(Some(c)) = done {
                    emptied.push(c);
                }
            }
        }
        emptied
    }

    /// Mark one entry done. `None` if it was not waiting; else the chunk it emptied, if it did.
    fn mark_done(&mut self, seq: u64) -> Option<Option<u64>> {
        let (&first, meta) = self.chunks.range_mut(..=seq).next_back()?;
        let i = seq - first;
        if i >= meta.n || meta.is_done(i) {
            return None;
        }
        meta.done[(i / 64) as usize] |= 1 << (i % 64);
        meta.waiting -= 1;
        self.len -= 1;
        if meta.waiting > 0 {
            return Some(None);
        }
        if let Some(gone) = self.chunks.remove(&first) {
            self.bytes = self.bytes.saturating_sub(gone.bytes);
        }
        self.cache.forget(&first);
        Some(Some(first))
    }

    /// Report `seq` as superseded (see [`OutboxMem::take_superseded`]).
    pub(crate) fn note_superseded(&mut self, seq: u64) {
        if let Some(v) = &mut self.superseded {
            if v.len() < SUPERSEDED_MAX {
                v.push(seq);
            } else {
                self.superseded = None;
            }
        }
    }

    /// The entries a newer upsert of their key superseded (they left the outbox) since the
    /// last call; `None` if there were too many to keep: count again from the outbox.
    pub(crate) fn take_superseded(&mut self) -> Option<Vec<u64>> {
        self.superseded.replace(Vec::new())
    }

    /// A commit is adding entries: these (in order) replace what the previous one added.
    /// Only the newest commit's are kept, so a replay's many commits keep one list.
    pub(crate) fn note_added(&mut self, seqs: impl Iterator<Item = u64>) {
        self.added.clear();
        self.added.extend(seqs);
    }

    /// The entries the newest commit added that still wait (in order), once: what the
    /// results room's per-sink figures count from that commit, without reading back the
    /// entries it already holds in memory (see `Results::checkpointed`).
    pub(crate) fn take_added(&mut self) -> Vec<u64> {
        let mut added = std::mem::take(&mut self.added);
        let mut chunk: Option<(u64, &ChunkMeta)> = None;
        added.retain(|&seq| {
            let within = |(first, m): (u64, &ChunkMeta)| seq >= first && seq - first < m.n;
            if !chunk.is_some_and(within) {
                chunk = (self.chunks.range(..=seq).next_back()).map(|(&f, m)| (f, m));
            }
            chunk.is_some_and(|(first, m)| within((first, m)) && !m.is_done(seq - first))
        });
        added
    }

    /// An entry was acknowledged. Returns the chunk to delete from the tree when it was the
    /// last one waiting in it.
    pub fn ack(&mut self, seq: u64, id: &str) -> Option<u64> {
        let emptied = self.mark_done(seq)?;
        let h = self.key_hash(split_id(id).0);
        if self.newest.get(&h).is_some_and(|n| n.seq == seq) {
            self.newest.remove(&h);
            if self.newest.capacity() > 4 * self.newest.len().max(1024) {
                self.newest.shrink_to_fit();
            }
        }
        emptied
    }

    /// The chunk holding `seq` and the runs of consecutive entries still waiting in it, as
    /// (first seq, count): what to write back when one entry is set aside for good while
    /// others in its chunk still wait (see `Store::outbox_set_aside`).
    pub(crate) fn waiting_runs(&self, seq: u64) -> Option<(u64, Vec<(u64, u64)>)> {
        let (&first, meta) = self.chunks.range(..=seq).next_back()?;
        if seq - first >= meta.n {
            return None;
        }
        let mut runs: Vec<(u64, u64)> = Vec::new();
        for i in (0..meta.n).filter(|&i| !meta.is_done(i)) {
            match runs.last_mut() {
                Some((s, n)) if *s + *n == first + i => *n += 1,
                _ => runs.push((first + i, 1)),
            }
        }
        Some((first, runs))
    }

    /// Chunk `old` was rewritten as `runs` (each: first seq, its waiting entries, bytes on
    /// disk): every entry in them waits, and nothing else of `old` does.
    pub(crate) fn replace_chunk(&mut self, old: u64, runs: Vec<(u64, ChunkEntries, u64)>) {
        if let Some(gone) = self.chunks.remove(&old) {
            self.bytes = self.bytes.saturating_sub(gone.bytes);
            self.len = self.len.saturating_sub(gone.waiting as usize);
        }
        self.cache.forget(&old);
        for (first, entries, bytes) in runs {
            self.insert_waiting(first, entries.len(), bytes);
            self.cache_put(first, entries);
        }
    }

    /// Counts a chunk of `n` entries from `first`, all of them waiting, `bytes` on disk.
    fn insert_waiting(&mut self, first: u64, n: usize, bytes: u64) {
        let meta = ChunkMeta {
            n: n as u64,
            waiting: n as u64,
            bytes,
            done: vec![0; n.div_ceil(64)],
        };
        self.chunks.insert(first, meta);
        self.len += n;
        self.bytes += bytes;
    }

    /// The first waiting entry at or after `from`: (seq, first seq of its chunk).
    pub(crate) fn next_from(&self, from: u64) -> Option<(u64, u64)> {
        let start = self
            .chunks
            .range(..=from)
            .next_back()
            .map_or(from, |(&first, _)| first);
        for (&first, meta) in self.chunks.range(start..) {
            let lo = from.saturating_sub(first);
            if let Some(i) = (lo..meta.n).find(|&i| !meta.is_done(i)) {
                return Some((first + i, first));
            }
        }
        None
    }

    /// The first sequences of the (at most `n`) chunks holding waiting entries at or after
    /// `from`, in order.
    pub(crate) fn chunks_from(&self, from: u64, n: usize) -> Vec<u64> {
        let mut out = Vec::new();
        let mut at = from;
        while out.len() < n {
            let Some((_, first)) = self.next_from(at) else {
                break;
            };
            out.push(first);
            at = first.saturating_add(self.chunks.get(&first).map_or(1, |m| m.n.max(1)));
        }
        out
    }

    pub(crate) fn cached(&mut self, first: u64) -> Option<ChunkEntries> {
        self.cache.get(&first)
    }

    pub(crate) fn cache_put(&mut self, first: u64, entries: ChunkEntries) {
        self.cache.put(first, entries);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn out(i: u64, payload: usize) -> (u64, Output) {
        entry(i, &format!("p/k{i}/1"), payload, false)
    }

    fn entry(seq: u64, id: &str, payload: usize, latest_only: bool) -> (u64, Output) {
        (
            seq,
            Output {
                id: id.into(),
                topic: "t".into(),
                payload: vec![b'x'; payload],
                retain: false,
                latest_only,
            },
        )
    }

    #[test]
    fn the_read_ahead_grows_with_the_commit_up_to_its_bound_and_is_shared_by_the_sinks() {
        let cases = [
            // (outputs, sinks, chunks for each sink, why)
            (0, 1, PREFETCH_MIN, "never fewer than the least"),
            (1_536, 1, 6, "a small commit: a few chunks"),
            (20_000, 1, 78, "the measured ~70 at 20,000 outputs"),
            (usize::MAX, 1, PREFETCH_CHUNKS, "the bound holds"),
            (usize::MAX, 3, PREFETCH_CHUNKS / 3, "shared by the sinks"),
            (usize::MAX, 0, PREFETCH_CHUNKS, "no sink: as one"),
            (usize::MAX, 64, PREFETCH_MIN, "each sink the least at most"),
        ];
        for (outputs, sinks, want, why) in cases {
            assert_eq!(prefetch_chunks(outputs, sinks), want, "{why}");
        }
    }

    #[test]
    fn chunks_are_cut_by_count_and_bytes() {
        let chunks = make_chunks((0..600).map(|i| out(i, 1)));
        assert_eq!(chunks.len(), 4);
        assert_eq!(chunks.iter().map(|c| c.1.len()).sum::<usize>(), 600);
        for (first, entries) in &chunks {
            assert_eq!(*first, entries[0].0, "a chunk is keyed by its first seq");
            assert!(postcard::to_stdvec(entries).unwrap().len() <= CHUNK_BYTES);
        }
        let chunks = make_chunks((0..10).map(|i| out(i, 1_000)));
        assert!(chunks.iter().all(|c| c.1.len() == 4 || c.1.len() == 2));
        assert_eq!(chunks.iter().map(|c| c.1.len()).sum::<usize>(), 10);
        let big = make_chunks(vec![out(0, 10_000)]);
        assert_eq!(
            big.len(),
            1,
            "an entry larger than a chunk still goes, alone"
        );
    }

    #[test]
    fn a_chunk_is_deleted_when_its_last_entry_is_acked() {
        let mut m = OutboxMem::default();
        let chunks = make_chunks((0..300).map(|i| out(i, 10)));
        let n = chunks[0].1.len() as u64;
        let second = chunks[1].0;
        for (first, entries) in chunks {
            assert!(m.add_chunk(first, Arc::new(entries), 100).is_empty());
        }
        assert_eq!(m.len(), 300);
        assert!(
            !m.admits("p/k5/1"),
            "an ID already waiting does not go in again"
        );
        assert!(m.admits("p/k5/2"));
        for i in (0..n).rev().filter(|i| *i != 7) {
            assert_eq!(m.ack(i, &format!("p/k{i}/1")), None);
        }
        assert_eq!(m.ack(7, "p/k7/1"), Some(0));
        assert_eq!(
            m.ack(7, "p/k7/1"),
            None,
            "a second ack of one entry is nothing"
        );
        assert!(m.admits("p/k5/1"), "nothing of k5 waits any more");
        assert_eq!(m.next_from(0), Some((second, second)));
        assert_eq!(m.len() as u64, 300 - n);
        m.ack(second + 1, &format!("p/k{}/1", second + 1));
        assert_eq!(m.next_from(second + 1), Some((second + 2, second)));
    }

    #[test]
    fn an_upsert_supersedes_the_older_waiting_upsert_of_its_key_and_a_changelog_does_not() {
        let mut m = OutboxMem::default();
        let a = vec![
            entry(0, "up/A/1", 1, true),
            entry(1, "up/B/1", 1, true),
            entry(2, "ch/A/1", 1, false),
        ];
        assert!(m.add_chunk(0, Arc::new(a), 10).is_empty());
        let b = vec![
            entry(3, "up/A/2", 1, true),
            entry(4, "ch/A/2", 1, false),
            entry(5, "up/B/2", 1, true),
        ];
        assert_eq!(m.add_chunk(3, Arc::new(b), 20), Vec::<u64>::new());
        // up/A/1 and up/B/1 are superseded; ch/A/1 still waits.
        assert_eq!(m.len(), 4);
        assert_eq!(m.take_superseded(), Some(vec![0, 1]), "reported once");
        assert_eq!(m.take_superseded(), Some(vec![]));
        assert_eq!(m.bytes(), 30, "both chunks are still on disk");
        assert_eq!(m.next_from(0), Some((2, 0)));
        assert!(!m.admits("up/A/2") && !m.admits("up/A/1") && m.admits("up/A/3"));
        // The ack of a superseded entry, still in flight, changes nothing.
        assert_eq!(m.ack(0, "up/A/1"), None);
        assert_eq!(m.len(), 4);
        assert_eq!(
            m.ack(2, "ch/A/1"),
            Some(0),
            "chunk 0 has nothing waiting now"
        );
        let c = vec![entry(6, "up/A/3", 1, true)];
        assert_eq!(m.add_chunk(6, Arc::new(c), 40), Vec::<u64>::new());
        assert_eq!(m.next_from(0), Some((4, 3)));
        assert_eq!(m.ack(4, "ch/A/2"), None);
        assert_eq!(
            m.ack(5, "up/B/2"),
            Some(3),
            "up/A/2 was superseded by up/A/3"
        );
        assert_eq!(m.len(), 1);
        assert_eq!(m.bytes(), 40, "only the last chunk is left on disk");
        assert_eq!(m.take_superseded(), Some(vec![3]), "acks are not reported");
    }

    #[test]
    fn too_many_superseded_entries_to_keep_say_so_instead() {
        let mut m = OutboxMem::default();
        let n = SUPERSEDED_MAX as u64 + 2;
        for v in 1..=n {
            let c = vec![entry(v, &format!("up/A/{v}"), 1, true)];
            m.add_chunk(v, Arc::new(c), 10);
        }
        assert_eq!(m.len(), 1);
        assert_eq!(m.take_superseded(), None, "count again from the outbox");
        let c = vec![entry(n + 1, &format!("up/A/{}", n + 1), 1, true)];
        m.add_chunk(n + 1, Arc::new(c), 10);
        assert_eq!(m.take_superseded(), Some(vec![n]), "and kept again after");
    }
}
