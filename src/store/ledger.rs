//! The dedup ledger on disk and in memory.
//!
//! On disk (tree `dedup`), each checkpoint writes the IDs it accepted as a few *chunks*, one
//! sled value each, instead of one key per ID: that was two sled writes per event (the entry
//! and its expiry index) and, with the reads, the largest cost of a checkpoint.
//!
//! - Key: `pipeline 0x00 | min_seen_ms u64 BE | checkpoint_id u64 BE | part u32 BE`.
//! - Value: [`Chunk`]: its greatest record time and its entries, sorted by ID.
//! - A checkpoint's entries are sorted by (record time, ID) and cut into parts of at most
//!   [`CHUNK_ENTRIES`] entries and about [`CHUNK_BYTES`] encoded bytes. Small on purpose: sled
//!   writes a whole leaf node (up to ~17 values) as one log item, and an item over 128 KiB
//!   goes to a blob file that sled never fsyncs; 32 KiB chunks did that, and the power-cut
//!   test found the torn blobs (`tests/it/crash.rs`). The log clock never goes back, so along the key order
//!   the chunks' record-time ranges follow one another: a chunk's `max_seen_ms` is at most
//!   the next chunk's minimum. Expiry relies on it.
//!
//! In memory, per pipeline: a fingerprint index ([`ShardedIndex`]) over every entry, tagged
//! with a 16-bit tag of its chunk (a miss proves an ID was never recorded, which is the
//! common case and costs no read; a hit names the chunk to confirm in, which gives the exact
//! answer), and a directory of the chunks: key, greatest record time, tag, bytes. Both are
//! rebuilt from the tree at open; tags live only in memory. A tag names one chunk while
//! fewer than 2^16 are indexed, else a few (see [`Ledger::index_entries`]).
//!
//! # The memory bound (`[storage] ledger_index_max`)
//!
//! The index costs 7 to 14 bytes per entry, so a long window of many events could take all
//! the box's memory. Its bytes (all pipelines together) are bounded: a chunk whose entries
//! would make a table grow beyond the bound is not indexed. It is still in the tree and in
//! the directory, marked *unindexed*, and every lookup reads it (through the chunk cache)
//! besides the chunks the index names. So a full index never costs a decision, only speed:
//! exactly-once holds, processing slows while unindexed chunks exist, and the journal says
//! so. Backpressure was the other choice, and it is not safe: the ledger expires by record
//! time, which moves only when new records are logged, so refusing input would wait forever.
//! When expiry frees room, unindexed chunks are indexed again, oldest first
//! ([`Ledger::unindexed`]).
//!
//! Expiry drops whole chunks whose greatest record time has expired; entries in a chunk
//! that is not yet wholly expired stay a little longer. Decisions never depend on it: the
//! engine compares each entry's own record time with the window.

use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::hash::BuildHasher;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::index::ShardedIndex;

/// Most entries in one chunk (a handful in unit tests, so that their small batches span
/// several chunks, as large ones do in production).
pub(crate) const CHUNK_ENTRIES: usize = if cfg!(test) { 8 } else { 512 };
/// Most encoded bytes (estimated: the ID and 12 bytes per entry) in one chunk.
pub(crate) const CHUNK_BYTES: usize = 4 * 1024;
/// Most wholly expired chunks dropped per pipeline in one checkpoint (bounds the
/// transaction; the rest go at the next ones).
pub(crate) const EXPIRE_CHUNKS_MAX: usize = 64;
/// Tags the index can give chunks (16 bits: see [`Ledger::index_entries`]). A handful in
/// unit tests, so that the store's model tests share tags as a window of more than 2^16
/// chunks does in production.
pub(crate) const TAG_SPACE: usize = if cfg!(test) { 4 } else { 1 << 16 };
/// Decoded chunks kept for lookups (redelivered duplicates hit recent chunks again and again).
pub(crate) const CACHE_CHUNKS: usize = 8;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Chunk {
    pub max_seen_ms: u64,
    /// (event ID, record time accepted), sorted by ID, IDs unique within the chunk.
    pub entries: Vec<(String, u64)>,
}

impl Chunk {
    pub fn get(&self, id: &str) -> Option<u64> {
        self.entries
            .binary_search_by(|(e, _)| e.as_str().cmp(id))
            .ok()
            .map(|i| self.entries[i].1)
    }
}

/// The key suffix after `pipeline 0x00`.
pub(crate) fn chunk_suffix(min_seen_ms: u64, checkpoint_id: u64, part: u32) -> Vec<u8> {
    let mut k = Vec::with_capacity(20);
    k.extend_from_slice(&min_seen_ms.to_be_bytes());
    k.extend_from_slice(&checkpoint_id.to_be_bytes());
    k.extend_from_slice(&part.to_be_bytes());
    k
}

/// Cut one checkpoint's entries of one pipeline into chunks: (key suffix, chunk).
pub(crate) fn make_chunks(
    mut entries: Vec<(String, u64)>,
    checkpoint_id: u64,
) -> Vec<(Vec<u8>, Chunk)> {
    entries.sort_by(|a, b| (a.1, &a.0).cmp(&(b.1, &b.0)));
    let mut out = Vec::new();
    let mut part: Vec<(String, u64)> = Vec::new();
    let mut bytes = 0;
    let flush = |part: &mut Vec<(String, u64)>, out: &mut Vec<(Vec<u8>, Chunk)>| {
        if part.is_empty() {
            return;
        }
        let min = part[0].1;
        let max = part[part.len() - 1].1;
        let mut entries = std::mem::take(part);
        entries.sort_by(|a, b| a.0.cmp(&b.0));
        let n = u32::try_from(out.len()).expect("parts fit in u32");
        out.push((
            chunk_suffix(min, checkpoint_id, n),
            Chunk {
                max_seen_ms: max,
                entries,
            },
        ));
    };
    for e in entries {
        let size = e.0.len() + 12;
        if part.len() >= CHUNK_ENTRIES || (bytes + size > CHUNK_BYTES && !part.is_empty()) {
            flush(&mut part, &mut out);
            bytes = 0;
        }
        bytes += size;
        part.push(e);
    }
    flush(&mut part, &mut out);
    out
}

/// The index hashes of a chunk's IDs, in entry order.
fn hashes(hasher: &impl BuildHasher, chunk: &Chunk) -> Vec<u64> {
    chunk
        .entries
        .iter()
        .map(|(id, _)| hasher.hash_one(id.as_bytes()))
        .collect()
}

/// One pipeline's in-memory view of its ledger.
#[derive(Default)]
pub(crate) struct Ledger {
    pub index: ShardedIndex,
    /// Key suffix → (greatest record time in that chunk, its tag (`None`: not indexed), its
    /// key and value's bytes in the tree).
    chunks: BTreeMap<Vec<u8>, (u64, Option<u16>, u64)>,
    /// Tag → the key suffix of the one indexed chunk that has it.
    by_tag: HashMap<u16, Vec<u8>>,
    /// Tags that more than one indexed chunk has: only when more than [`TAG_SPACE`] chunks
    /// are indexed at once (see [`Ledger::index_entries`]); the extra chunks' suffixes.
    shared: HashMap<u16, Vec<Vec<u8>>>,
    /// Chunks left out of the index by the memory bound: every lookup reads them.
    unindexed: BTreeSet<Vec<u8>>,
    /// Entries in all chunks, indexed or not.
    entries: u64,
    /// Bytes of the chunks' keys and values in the tree: what the agent's estimate of the
    /// store's live data counts for this ledger without walking it (issue 16).
    bytes: u64,
    next_tag: u16,
}

impl Ledger {
    /// Add a chunk whose key and value take `bytes` in the tree, in the index if that keeps
    /// the index within `max_index_bytes`, else as unindexed (see the module docs). Returns
    /// whether it was indexed.
    pub(crate) fn add_chunk(
        &mut self,
        hasher: &impl BuildHasher,
        suffix: Vec<u8>,
        chunk: &Chunk,
        bytes: u64,
        max_index_bytes: usize,
    ) -> bool {
        self.entries += chunk.entries.len() as u64;
        self.bytes = self.bytes.saturating_add(bytes);
        let hashes = hashes(hasher, chunk);
        let fits = self
            .index
            .bytes_to_hold(&hashes)
            .is_some_and(|b| b <= max_index_bytes);
        if !fits {
            self.chunks
                .insert(suffix.clone(), (chunk.max_seen_ms, None, bytes));
            self.unindexed.insert(suffix);
            return false;
        }
        self.index_entries(&hashes, suffix, chunk, bytes);
        true
    }

    /// Tag the chunk's entries in the index with a 16-bit tag no other indexed chunk has,
    /// while there is one. Tags are 16 bits to keep an index slot at 6 bytes (issue 16);
    /// past 2^16 indexed chunks at once (small checkpoints over a long window) a tag is
    /// shared, and a hit on it reads every chunk that has it: slower, never wrong.
    fn index_entries(&mut self, hashes: &[u64], suffix: Vec<u8>, chunk: &Chunk, bytes: u64) {
        let all_taken = self.by_tag.len() >= TAG_SPACE;
        let tag = loop {
            let t = self.next_tag;
            self.next_tag = if usize::from(t) + 1 >= TAG_SPACE {
                0
            } else {
                t + 1
            };
            if all_taken || !self.by_tag.contains_key(&t) {
                break t;
            }
        };
        for &h in hashes {
            self.index.insert_tag(h, tag);
        }
        self.chunks
            .insert(suffix.clone(), (chunk.max_seen_ms, Some(tag), bytes));
        match self.by_tag.entry(tag) {
            Entry::Occupied(_) => self.shared.entry(tag).or_default().push(suffix),
            Entry::Vacant(v) => {
                v.insert(suffix);
            }
        }
    }

    /// Index an unindexed chunk if it now fits within `max_index_bytes`. Returns whether
    /// it did.
    pub(crate) fn promote(
        &mut self,
        hasher: &impl BuildHasher,
        suffix: &[u8],
        chunk: &Chunk,
        max_index_bytes: usize,
    ) -> bool {
        let hashes = hashes(hasher, chunk);
        let fits = self
            .index
            .bytes_to_hold(&hashes)
            .is_some_and(|b| b <= max_index_bytes);
        if !fits || !self.unindexed.remove(suffix) {
            return false;
        }
        let bytes = self.chunks.get(suffix).map_or(0, |c| c.2);
        self.index_entries(&hashes, suffix.to_vec(), chunk, bytes);
        true
    }

    pub(crate) fn remove_chunk(&mut self, hasher: &impl BuildHasher, suffix: &[u8], chunk: &Chunk) {
        let Some((_, tag, bytes)) = self.chunks.remove(suffix) else {
            return;
        };
        self.entries = self.entries.saturating_sub(chunk.entries.len() as u64);
        self.bytes = self.bytes.saturating_sub(bytes);
        let Some(tag) = tag else {
            self.unindexed.remove(suffix);
            return;
        };
        // An entry of another chunk with the same fingerprint and tag is the same slot, so
        // which one goes does not matter.
        for (id, _) in &chunk.entries {
            let found = self.index.remove_tag(hasher.hash_one(id.as_bytes()), tag);
            debug_assert!(found, "every ledger entry is indexed");
        }
        if let Some(others) = self.shared.get_mut(&tag) {
            if let Some(i) = others.iter().position(|s| s == suffix) {
                others.swap_remove(i);
            } else if self.by_tag.get(&tag).is_some_and(|s| s == suffix) {
                let next = others.pop().expect("a shared tag has another chunk");
                self.by_tag.insert(tag, next);
            }
            if others.is_empty() {
                self.shared.remove(&tag);
            }
        } else {
            self.by_tag.remove(&tag);
        }
    }

    /// Key suffixes of the chunks that may hold the ID with this hash: the indexed ones
    /// whose entries share its fingerprint (usually none; one when it was recorded), and
    /// every unindexed one.
    pub(crate) fn chunks_for(&self, hash: u64, tags: &mut Vec<u16>) -> Vec<Vec<u8>> {
        self.index.tags(hash, tags);
        tags.sort_unstable();
        tags.dedup();
        tags.iter()
            .flat_map(|t| {
                let shared = self.shared.get(t).into_iter().flatten();
                self.by_tag.get(t).into_iter().chain(shared).cloned()
            })
            .chain(self.unindexed.iter().cloned())
            .collect()
    }

    /// Entries in all chunks (what `dedup_entries` reports).
    pub fn entries(&self) -> u64 {
        self.entries
    }

    /// Bytes of all chunks' keys and values in the tree.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Key suffixes of up to `limit` unindexed chunks, oldest first.
    pub(crate) fn unindexed(&self, limit: usize) -> Vec<Vec<u8>> {
        self.unindexed.iter().take(limit).cloned().collect()
    }

    /// Chunks left out of the index.
    pub(crate) fn unindexed_len(&self) -> usize {
        self.unindexed.len()
    }

    /// Key suffixes of the oldest chunks that have wholly expired, oldest first.
    pub fn expired(&self, cutoff: u64, limit: usize) -> Vec<Vec<u8>> {
        self.chunks
            .iter()
            .take_while(|(_, (max, _, _))| *max <= cutoff)
            .take(limit)
            .map(|(k, _)| k.clone())
            .collect()
    }
}

/// Decoded ledger chunks by key.
pub(crate) type ChunkCache = super::lru::Lru<Vec<u8>, Arc<Chunk>>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_are_cut_in_record_time_order_and_sorted_by_id_inside() {
        let entries: Vec<(String, u64)> = (0..1200u64)
            .map(|i| (format!("E{:04}", 1199 - i), 1000 + i / 10))
            .collect();
        let chunks = make_chunks(entries, 7);
        assert_eq!(chunks.len(), 1200_usize.div_ceil(CHUNK_ENTRIES));
        let mut prev_max = 0;
        for (suffix, c) in &chunks {
            assert!(
                c.entries.windows(2).all(|w| w[0].0 < w[1].0),
                "sorted by id"
            );
            let min = c.entries.iter().map(|e| e.1).min().unwrap();
            assert_eq!(&suffix[..8], &min.to_be_bytes());
            assert!(min >= prev_max, "ranges follow one another");
            prev_max = c.max_seen_ms;
            for (id, seen) in &c.entries {
                assert_eq!(c.get(id), Some(*seen));
            }
        }
        assert_eq!(
            chunks.iter().map(|c| c.1.entries.len()).sum::<usize>(),
            1200
        );
    }

    #[test]
    fn long_ids_cut_chunks_by_bytes() {
        let id = "x".repeat(1_000);
        let entries: Vec<(String, u64)> = (0..100u64).map(|i| (format!("{id}{i}"), i)).collect();
        let chunks = make_chunks(entries, 1);
        assert_eq!(chunks.len(), 25, "four IDs of 1 kB fill a chunk");
        for (_, c) in &chunks {
            assert!(postcard::to_stdvec(c).unwrap().len() <= CHUNK_BYTES);
        }
    }

    #[test]
    fn past_the_tag_space_tags_are_shared_and_every_id_is_still_found() {
        // Tags are 16 bits (issue 16; TAG_SPACE is 4 in tests): the chunk indexed after
        // every tag is taken shares one, and a hit on it names each chunk that has it;
        // removing any of them, owner or sharer, leaves the others found.
        let h = std::hash::RandomState::new();
        let mut l = Ledger::default();
        let space = TAG_SPACE as u64;
        let n = 2 * space + 5;
        let chunk = |i: u64| Chunk {
            max_seen_ms: i,
            entries: vec![(format!("E{i}"), i)],
        };
        let suffix = |i: u64| chunk_suffix(i, i, 0);
        for i in 0..n {
            assert!(l.add_chunk(&h, suffix(i), &chunk(i), 10, usize::MAX));
        }
        assert_eq!(l.by_tag.len(), TAG_SPACE, "every tag taken");
        assert_eq!(
            l.shared.values().map(Vec::len).sum::<usize>() as u64,
            n - space
        );
        let mut tags = Vec::new();
        let found = |l: &Ledger, i: u64, tags: &mut Vec<u16>| {
            l.chunks_for(h.hash_one(format!("E{i}").as_bytes()), tags)
        };
        for i in 0..n {
            let chunks = found(&l, i, &mut tags);
            assert!(chunks.contains(&suffix(i)), "E{i}");
            let per_tag = n.div_ceil(space) as usize;
            assert!(chunks.len() <= per_tag, "E{i}: {} chunks", chunks.len());
        }
        // Chunk 0 owns the tag chunks `space` and `2 * space` share; remove the owner, then
        // a sharer of tag 1.
        l.remove_chunk(&h, &suffix(0), &chunk(0));
        l.remove_chunk(&h, &suffix(space + 1), &chunk(space + 1));
        assert!(!found(&l, 0, &mut tags).contains(&suffix(0)));
        for i in [space, 2 * space, 1, 2 * space + 1] {
            assert!(found(&l, i, &mut tags).contains(&suffix(i)), "E{i}");
        }
        assert!(!found(&l, space + 1, &mut tags).contains(&suffix(space + 1)));
        for i in 0..n {
            l.remove_chunk(&h, &suffix(i), &chunk(i));
        }
        assert!(l.by_tag.is_empty() && l.shared.is_empty());
        assert_eq!((l.index.len(), l.bytes(), l.entries()), (0, 0, 0));
    }

    #[test]
    fn a_hit_names_the_one_chunk_that_holds_the_id_and_expiry_goes_oldest_first() {
        let h = std::hash::RandomState::new();
        let mut l = Ledger::default();
        let mut chunks = Vec::new();
        for cp in 0..4u64 {
            let entries = (0..CHUNK_ENTRIES as u64)
                .map(|i| (format!("E{cp}-{i}"), 1000 * cp + i))
                .collect();
            for (suffix, c) in make_chunks(entries, cp) {
                l.add_chunk(&h, suffix.clone(), &c, 100, usize::MAX);
                chunks.push((suffix, c));
            }
        }
        let mut tags = Vec::new();
        for (suffix, c) in &chunks {
            for (id, _) in &c.entries {
                assert_eq!(
                    l.chunks_for(h.hash_one(id.as_bytes()), &mut tags),
                    std::slice::from_ref(suffix)
                );
            }
        }
        assert!(l.chunks_for(h.hash_one(b"never"), &mut tags).is_empty());
        let starts = |v: Vec<Vec<u8>>| -> Vec<u64> {
            v.iter()
                .map(|k| u64::from_be_bytes(k[..8].try_into().unwrap()))
                .collect()
        };
        assert_eq!(
            starts(l.expired(1000 + CHUNK_ENTRIES as u64, 10)),
            [0, 1000]
        );
        assert_eq!(starts(l.expired(1000 + CHUNK_ENTRIES as u64, 1)), [0]);
        let (suffix, c) = &chunks[0];
        assert_eq!(l.bytes(), 100 * chunks.len() as u64);
        l.remove_chunk(&h, suffix, c);
        assert_eq!(l.bytes(), 100 * (chunks.len() as u64 - 1));
        assert_eq!(l.index.len(), 3 * CHUNK_ENTRIES);
        assert!(l.chunks_for(h.hash_one(b"E0-1"), &mut tags).is_empty());
        assert_eq!(starts(l.expired(u64::MAX, 10)), [1000, 2000, 3000]);
    }
}
