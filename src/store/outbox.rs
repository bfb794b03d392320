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
//! In memory, per chunk: its sequence range and a bit per entry for "acknowledged" (a
//! chunk holds consecutive sequence numbers); a set of the waiting IDs' 64-bit hashes, so
//! that inserting an ID already waiting is a no-op (a hit is confirmed against the chunks);
//! and a few decoded chunks, so that the publisher reads what was just committed without
//! decoding it again. A million waiting outputs (a long outage replayed) cost about 20 MiB,
//! most of it the hash set, which is shrunk again as the outbox drains.

use std::collections::{BTreeMap, HashSet};
use std::hash::{BuildHasher, RandomState};
use std::sync::Arc;

use crate::pipeline::engine::Output;

pub const CHUNK_ENTRIES: usize = 256;
pub const CHUNK_BYTES: usize = 4 * 1024;
const CACHE_CHUNKS: usize = 16;

pub type ChunkEntries = Arc<Vec<(u64, Output)>>;

/// Cut outputs (in sequence order) into chunks of consecutive sequence numbers:
/// (first seq, entries).
pub fn make_chunks(outputs: Vec<(u64, Output)>) -> Vec<(u64, Vec<(u64, Output)>)> {
    let mut out: Vec<(u64, Vec<(u64, Output)>)> = Vec::new();
    let mut bytes = 0;
    for (seq, o) in outputs {
        let size = o.id.len() + o.topic.len() + o.payload.len() + 16;
        let full = out.last().is_none_or(|(first, c)| {
            c.len() >= CHUNK_ENTRIES || bytes + size > CHUNK_BYTES || *first + c.len() as u64 != seq
        });
        if full {
            out.push((seq, Vec::new()));
            bytes = 0;
        }
        bytes += size;
        out.last_mut().expect("pushed").1.push((seq, o));
    }
    out
}

struct ChunkMeta {
    n: u64,
    waiting: u64,
    /// Bit `i`: entry `first + i` was acknowledged.
    acked: Vec<u64>,
}

impl ChunkMeta {
    fn is_acked(&self, i: u64) -> bool {
        self.acked[(i / 64) as usize] & (1 << (i % 64)) != 0
    }
}

#[derive(Default)]
pub struct OutboxMem {
    chunks: BTreeMap<u64, ChunkMeta>,
    /// Hashes of the waiting entries' IDs.
    ids: HashSet<u64>,
    hasher: RandomState,
    len: usize,
    /// Decoded chunks, most recently used first.
    cache: Vec<(u64, ChunkEntries)>,
}

impl OutboxMem {
    pub fn len(&self) -> usize {
        self.len
    }

    fn hash(&self, id: &str) -> u64 {
        self.hasher.hash_one(id.as_bytes())
    }

    /// False proves `id` is not waiting; true means it may be (the caller confirms).
    pub fn may_contain_id(&self, id: &str) -> bool {
        self.ids.contains(&self.hash(id))
    }

    /// Register a chunk that is (or is about to be) in the tree. Its entries must have
    /// consecutive sequence numbers starting at `first`.
    pub fn add_chunk(&mut self, first: u64, entries: ChunkEntries) {
        for (i, (seq, o)) in entries.iter().enumerate() {
            assert_eq!(
                *seq,
                first + i as u64,
                "an outbox chunk holds consecutive seqs"
            );
            self.ids.insert(self.hash(&o.id));
        }
        let n = entries.len() as u64;
        self.chunks.insert(
            first,
            ChunkMeta {
                n,
                waiting: n,
                acked: vec![0; n.div_ceil(64) as usize],
            },
        );
        self.len += entries.len();
        self.cache_put(first, entries);
    }

    /// An entry was acknowledged. Returns the chunk to delete from the tree when it was the
    /// last one waiting in it.
    pub fn ack(&mut self, seq: u64, id: &str) -> Option<u64> {
        let h = self.hasher.hash_one(id.as_bytes());
        let (&first, meta) = self.chunks.range_mut(..=seq).next_back()?;
        let i = seq - first;
        if i >= meta.n || meta.is_acked(i) {
            return None;
        }
        meta.acked[(i / 64) as usize] |= 1 << (i % 64);
        meta.waiting -= 1;
        self.len -= 1;
        self.ids.remove(&h);
        let done = meta.waiting == 0;
        if self.ids.capacity() > 4 * self.ids.len().max(1024) {
            self.ids.shrink_to_fit();
        }
        if !done {
            return None;
        }
        self.chunks.remove(&first);
        self.cache.retain(|(k, _)| *k != first);
        Some(first)
    }

    /// The first waiting entry at or after `from`: (seq, first seq of its chunk).
    pub fn next_from(&self, from: u64) -> Option<(u64, u64)> {
        let start = self
            .chunks
            .range(..=from)
            .next_back()
            .map_or(from, |(&first, _)| first);
        for (&first, meta) in self.chunks.range(start..) {
            let lo = from.saturating_sub(first);
            if let Some(i) = (lo..meta.n).find(|&i| !meta.is_acked(i)) {
                return Some((first + i, first));
            }
        }
        None
    }

    /// First seqs of the chunks that still have waiting entries.
    pub fn chunk_firsts(&self) -> Vec<u64> {
        self.chunks.keys().copied().collect()
    }

    /// Whether entry `seq` is still waiting.
    pub fn is_waiting(&self, seq: u64) -> bool {
        self.chunks
            .range(..=seq)
            .next_back()
            .is_some_and(|(&first, m)| seq - first < m.n && !m.is_acked(seq - first))
    }

    pub fn cached(&mut self, first: u64) -> Option<ChunkEntries> {
        let i = self.cache.iter().position(|(k, _)| *k == first)?;
        let e = self.cache.remove(i);
        let c = e.1.clone();
        self.cache.insert(0, e);
        Some(c)
    }

    pub fn cache_put(&mut self, first: u64, entries: ChunkEntries) {
        self.cache.retain(|(k, _)| *k != first);
        self.cache.insert(0, (first, entries));
        self.cache.truncate(CACHE_CHUNKS);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn out(i: u64, payload: usize) -> (u64, Output) {
        (
            i,
            Output {
                id: format!("p/k/{i}"),
                topic: "t".into(),
                payload: vec![b'x'; payload],
                retain: false,
            },
        )
    }

    #[test]
    fn chunks_are_cut_by_count_and_bytes() {
        let chunks = make_chunks((0..600).map(|i| out(i, 1)).collect());
        assert_eq!(chunks.len(), 4);
        assert_eq!(chunks.iter().map(|c| c.1.len()).sum::<usize>(), 600);
        for (first, entries) in &chunks {
            assert_eq!(*first, entries[0].0, "a chunk is keyed by its first seq");
            assert!(postcard::to_stdvec(entries).unwrap().len() <= CHUNK_BYTES);
        }
        let chunks = make_chunks((0..10).map(|i| out(i, 1_000)).collect());
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
        let chunks = make_chunks((0..300).map(|i| out(i, 10)).collect());
        let n = chunks[0].1.len() as u64;
        let second = chunks[1].0;
        for (first, entries) in chunks {
            m.add_chunk(first, Arc::new(entries));
        }
        assert_eq!(m.len(), 300);
        assert!(m.may_contain_id("p/k/5"));
        for i in (0..n).rev().filter(|i| *i != 7) {
            assert_eq!(m.ack(i, &format!("p/k/{i}")), None);
        }
        assert_eq!(m.ack(7, "p/k/7"), Some(0));
        assert_eq!(
            m.ack(7, "p/k/7"),
            None,
            "a second ack of one entry is nothing"
        );
        assert!(!m.may_contain_id("p/k/5"));
        assert!(m.may_contain_id(&format!("p/k/{n}")));
        assert!(!m.is_waiting(3) && m.is_waiting(n));
        assert_eq!(m.next_from(0), Some((second, second)));
        assert_eq!(m.len() as u64, 300 - n);
        m.ack(second + 1, &format!("p/k/{}", second + 1));
        assert_eq!(m.next_from(second + 1), Some((second + 2, second)));
    }
}
