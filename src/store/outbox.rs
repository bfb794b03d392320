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
//! In memory: which entries are still waiting (sequence → chunk), their IDs (so that
//! inserting an ID already waiting is a no-op), how many wait per chunk, and a few decoded
//! chunks, so that the publisher reads what was just committed without decoding it again.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use crate::pipeline::engine::Output;

pub const CHUNK_ENTRIES: usize = 256;
pub const CHUNK_BYTES: usize = 4 * 1024;
const CACHE_CHUNKS: usize = 16;

pub type ChunkEntries = Arc<Vec<(u64, Output)>>;

/// Cut outputs (in sequence order) into chunks: (first seq, entries).
pub fn make_chunks(outputs: Vec<(u64, Output)>) -> Vec<(u64, Vec<(u64, Output)>)> {
    let mut out: Vec<(u64, Vec<(u64, Output)>)> = Vec::new();
    let mut bytes = 0;
    for (seq, o) in outputs {
        let size = o.id.len() + o.topic.len() + o.payload.len() + 16;
        let full = out
            .last()
            .is_none_or(|(_, c)| c.len() >= CHUNK_ENTRIES || bytes + size > CHUNK_BYTES);
        if full {
            out.push((seq, Vec::new()));
            bytes = 0;
        }
        bytes += size;
        out.last_mut().expect("pushed").1.push((seq, o));
    }
    out
}

#[derive(Default)]
pub struct OutboxMem {
    /// Waiting entries: seq → first seq of its chunk.
    pending: BTreeMap<u64, u64>,
    /// Waiting IDs → seq.
    ids: HashMap<String, u64>,
    /// Chunk → entries in it still waiting.
    live: HashMap<u64, usize>,
    /// Decoded chunks, most recently used first.
    cache: Vec<(u64, ChunkEntries)>,
}

impl OutboxMem {
    pub fn len(&self) -> usize {
        self.pending.len()
    }

    pub fn contains_id(&self, id: &str) -> bool {
        self.ids.contains_key(id)
    }

    /// Register a chunk that is (or is about to be) in the tree.
    pub fn add_chunk(&mut self, first: u64, entries: ChunkEntries) {
        for (seq, o) in entries.iter() {
            self.pending.insert(*seq, first);
            self.ids.insert(o.id.clone(), *seq);
        }
        self.live.insert(first, entries.len());
        self.cache_put(first, entries);
    }

    /// An entry was acknowledged. Returns the chunk to delete from the tree when it was the
    /// last one waiting in it.
    pub fn ack(&mut self, seq: u64, id: &str) -> Option<u64> {
        let first = self.pending.remove(&seq)?;
        if self.ids.get(id) == Some(&seq) {
            self.ids.remove(id);
        }
        let left = self
            .live
            .get_mut(&first)
            .expect("a waiting entry's chunk is live");
        *left -= 1;
        if *left > 0 {
            return None;
        }
        self.live.remove(&first);
        self.cache.retain(|(k, _)| *k != first);
        Some(first)
    }

    /// The first waiting entry at or after `from`: (seq, its chunk).
    pub fn next_from(&self, from: u64) -> Option<(u64, u64)> {
        self.pending.range(from..).next().map(|(s, c)| (*s, *c))
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
        assert!(m.contains_id("p/k/5"));
        for i in (0..n).rev().filter(|i| *i != 7) {
            assert_eq!(m.ack(i, &format!("p/k/{i}")), None);
        }
        assert_eq!(m.ack(7, "p/k/7"), Some(0));
        assert_eq!(
            m.ack(7, "p/k/7"),
            None,
            "a second ack of one entry is nothing"
        );
        assert!(!m.contains_id("p/k/5"));
        assert_eq!(m.next_from(0), Some((second, second)));
        assert_eq!(m.len() as u64, 300 - n);
    }
}
