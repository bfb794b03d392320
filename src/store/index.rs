//! An in-memory fingerprint index kept in front of the sled dedup ledger.
//!
//! # What it is for
//!
//! Deciding whether an event ID was already recorded should not cost a sled read per event.
//! The index holds one small entry per ledger entry: a fingerprint of the caller's 64-bit hash
//! of the ID, and a 32-bit tag the caller chooses. It is a filter:
//!
//! - a **miss** (no entry) proves that the ID was never recorded: no ledger read at all;
//! - a **hit** only says *where* to look: the ledger tags each entry with the number of the
//!   chunk it is in, and confirms against that chunk.
//!
//! A first version tagged entries with their coarse record time (1.024 s units), and a hit
//! had to read every chunk of that second: with small checkpoints that was dozens of chunks
//! per duplicate, and the 1,000-cut soak (debug build, checkpoints of 300 records) stalled
//! on redelivered backlogs. The tests still exercise the table through that time-shaped view.
//!
//! Two IDs can share a fingerprint, so a hit may be false. A false positive costs one ledger
//! read, never a wrong decision. With `n` entries, a lookup of an unrecorded ID finds a spurious
//! entry with probability about `n / 2^31` (about 0.05% at one million entries).
//!
//! It is a multi-map: every insert adds an entry, because two IDs may share a fingerprint and
//! one ID may be in the ledger twice (accepted again after its entry expired). A remove takes
//! out one entry.
//!
//! # Layout
//!
//! An open-addressing table of `u64` slots (0 = empty), linear probing, deletion by backward
//! shift (no tombstones), doubling when the load would exceed 7/8. Each used slot packs:
//!
//! ```text
//!  63                              32 31                               0
//! ┌──────────────────────────────────┬──────────────────────────────────┐
//! │ fp: top 32 bits of the hash,     │ tag (the ledger: chunk number)   │
//! │     lowest bit forced to 1       │                                  │
//! └──────────────────────────────────┴──────────────────────────────────┘
//! ```
//!
//! Forcing the lowest bit of `fp` to 1 makes a used slot never 0, so 0 can mean "empty".
//!
//! # Why buckets come from the top bits
//!
//! The full hash is not kept, only `fp`. The home bucket of an entry is the top `log2(capacity)`
//! bits of `fp`, so when the table doubles each slot can be re-placed from the slot alone: the
//! new home is the old top bits plus the next one. (Capacity stops at 2^31 slots so the home
//! never uses the forced bit.) The caller's hash must therefore be well mixed in its top bits.
//!
//! # Memory
//!
//! 8 bytes per slot. Between doublings the load runs from 7/16 to 7/8, about 18 down to 9 bytes
//! per entry (removals never shrink the table): one million entries fit in 2^21 slots, 16 MiB. While the table doubles, the old and the new
//! table are held together for a moment.

use std::fmt;

/// The time-shaped wrappers the tests use keep record times in units of `1 << COARSE_SHIFT`
/// ms: `coarse = seen_ms >> 10`.
#[cfg(test)]
pub(crate) const COARSE_SHIFT: u32 = 10;

/// The value of an empty slot. A used slot is never 0: its `fp` has its lowest bit set.
const EMPTY: u64 = 0;

/// The smallest table, in slots (a power of two).
const MIN_SLOTS: usize = 16;

/// The largest table is `2^MAX_SLOTS_LOG2` slots, so that the home bucket (the top bits of
/// `fp`) never includes the lowest bit of `fp`, which is always 1.
const MAX_SLOTS_LOG2: u32 = 31;

/// A compact multi-map from hash fingerprints to coarse record times (see the module docs).
pub(crate) struct FingerprintIndex {
    /// A power of two, at least [`MIN_SLOTS`], at most `2^MAX_SLOTS_LOG2`; [`EMPTY`] or a packed
    /// `(fp, coarse)`.
    slots: Vec<u64>,
    /// Used slots.
    len: usize,
}

/// The fingerprint of a caller's hash: its top 32 bits, lowest bit forced to 1.
fn fingerprint(hash: u64) -> u32 {
    ((hash >> 32) as u32) | 1
}

/// `seen_ms` in coarse units, saturated to `u32::MAX`.
#[cfg(test)]
fn coarse(seen_ms: u64) -> u32 {
    u32::try_from(seen_ms >> COARSE_SHIFT).unwrap_or(u32::MAX)
}

/// A used slot.
fn pack(fp: u32, coarse: u32) -> u64 {
    (u64::from(fp) << 32) | u64::from(coarse)
}

/// The `fp` half of a slot.
fn slot_fp(slot: u64) -> u32 {
    (slot >> 32) as u32
}

/// The `coarse` half of a slot.
fn slot_coarse(slot: u64) -> u32 {
    slot as u32
}

/// The record times `[lo_ms, hi_ms]` that map to `coarse`.
#[cfg(test)]
fn time_range(coarse: u32) -> (u64, u64) {
    let lo = u64::from(coarse) << COARSE_SHIFT;
    if coarse == u32::MAX {
        (lo, u64::MAX)
    } else {
        (lo, lo + ((1 << COARSE_SHIFT) - 1))
    }
}

/// The most entries a table of `slots` slots may hold (7/8 of it; `slots` is a multiple of 8,
/// and dividing first cannot overflow).
fn max_len(slots: usize) -> usize {
    slots / 8 * 7
}

/// The home bucket of `fp` in a table of `slots` slots: the top `log2(slots)` bits of `fp`.
fn home(fp: u32, slots: usize) -> usize {
    (fp >> (32 - slots.trailing_zeros())) as usize
}

/// Puts `slot` in the first empty slot at or after its home bucket, wrapping at the end.
/// The table must have an empty slot.
fn place(slots: &mut [u64], slot: u64) {
    let mask = slots.len() - 1;
    let mut i = home(slot_fp(slot), slots.len());
    while slots[i] != EMPTY {
        i = (i + 1) & mask;
    }
    slots[i] = slot;
}

/// Panics unless a table of `slots` slots may double.
fn assert_can_double(slots: usize) {
    assert!(
        slots.trailing_zeros() < MAX_SLOTS_LOG2,
        "FingerprintIndex: more than {} entries",
        max_len(slots)
    );
}

impl FingerprintIndex {
    /// An empty index of 16 slots.
    pub fn new() -> Self {
        Self {
            slots: vec![EMPTY; MIN_SLOTS],
            len: 0,
        }
    }

    /// An empty index that holds `entries` entries without growing: the smallest power of two
    /// of slots, at least 16, of which 7/8 is at least `entries`.
    ///
    /// # Panics
    ///
    /// If that would take more than 2^31 slots.
    #[cfg(test)]
    pub fn with_capacity(entries: usize) -> Self {
        let mut slots = MIN_SLOTS;
        while max_len(slots) < entries {
            assert_can_double(slots);
            slots *= 2;
        }
        Self {
            slots: vec![EMPTY; slots],
            len: 0,
        }
    }

    /// The number of entries.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are no entries.
    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Removes every entry and shrinks the table back to 16 slots, releasing its memory.
    #[cfg(test)]
    pub fn clear(&mut self) {
        self.slots = vec![EMPTY; MIN_SLOTS];
        self.len = 0;
    }

    /// Add one entry: the fingerprint of `hash` and a caller's `tag` (the ledger uses the
    /// number of the chunk the entry is in). Adds it even if an equal one is there already;
    /// doubles the table first if the load would exceed 7/8.
    ///
    /// # Panics
    ///
    /// If the table is at 2^31 slots and full.
    pub(crate) fn insert_tag(&mut self, hash: u64, tag: u32) {
        if self.len + 1 > max_len(self.slots.len()) {
            self.grow();
        }
        place(&mut self.slots, pack(fingerprint(hash), tag));
        self.len += 1;
    }

    /// The tags of every entry whose fingerprint equals `hash`'s, pushed into `out` (cleared
    /// first). The order is unspecified.
    pub(crate) fn tags(&self, hash: u64, out: &mut Vec<u32>) {
        out.clear();
        let fp = fingerprint(hash);
        let mask = self.slots.len() - 1;
        let mut i = home(fp, self.slots.len());
        // Every entry lies in the run of used slots that starts at its home bucket, so the
        // first empty slot ends the search. There is one: the load is at most 7/8.
        loop {
            let slot = self.slots[i];
            if slot == EMPTY {
                return;
            }
            if slot_fp(slot) == fp {
                out.push(slot_coarse(slot));
            }
            i = (i + 1) & mask;
        }
    }

    /// Add one entry with the coarse time of `seen_ms` as its tag (the tests' view).
    #[cfg(test)]
    pub fn insert(&mut self, hash: u64, seen_ms: u64) {
        self.insert_tag(hash, coarse(seen_ms));
    }

    /// The record-time ranges of the entries matching `hash` (the tests' view).
    #[cfg(test)]
    pub(crate) fn candidates(&self, hash: u64, out: &mut Vec<(u64, u64)>) {
        let mut tags = Vec::new();
        self.tags(hash, &mut tags);
        out.clear();
        out.extend(tags.into_iter().map(time_range));
    }

    /// Remove one entry equal to (hash's fp, seen_ms's coarse) (the tests' view).
    #[cfg(test)]
    pub fn remove(&mut self, hash: u64, seen_ms: u64) -> bool {
        self.remove_tag(hash, coarse(seen_ms))
    }

    /// Remove ONE entry equal to (hash's fp, tag). Returns whether one was found.
    pub(crate) fn remove_tag(&mut self, hash: u64, tag: u32) -> bool {
        let target = pack(fingerprint(hash), tag);
        let n = self.slots.len();
        let mask = n - 1;
        let mut i = home(slot_fp(target), n);
        loop {
            match self.slots[i] {
                EMPTY => return false,
                slot if slot == target => break,
                _ => i = (i + 1) & mask,
            }
        }
        // Backward shift: walk the rest of the run after the hole. An entry moves into the hole
        // only if the hole lies on its probe path, cyclically in [home, j): its distance from
        // its home is at least the hole's distance behind it. Otherwise (its home is after the
        // hole, possibly across the end of the array) it stays, and the walk goes on.
        let mut hole = i;
        let mut j = (i + 1) & mask;
        loop {
            let slot = self.slots[j];
            if slot == EMPTY {
                break;
            }
            let from_home = j.wrapping_sub(home(slot_fp(slot), n)) & mask;
            let from_hole = j.wrapping_sub(hole) & mask;
            if from_home >= from_hole {
                self.slots[hole] = slot;
                hole = j;
            }
            j = (j + 1) & mask;
        }
        self.slots[hole] = EMPTY;
        self.len -= 1;
        true
    }

    /// Bytes held by the table (slots * 8), for the footprint figures.
    pub(crate) fn memory_bytes(&self) -> usize {
        self.slots.len() * size_of::<u64>()
    }

    /// Bytes the table would hold after `extra` more inserts (it doubles until 7/8 of it
    /// holds them), or `None` if no table of at most 2^31 slots can. The ledger asks before
    /// it indexes a chunk, so that the index stays within its memory bound and never reaches
    /// the panic in [`FingerprintIndex::insert_tag`].
    pub(crate) fn bytes_to_hold(&self, extra: usize) -> Option<usize> {
        let want = self.len.checked_add(extra)?;
        let mut slots = self.slots.len();
        while max_len(slots) < want {
            if slots.trailing_zeros() >= MAX_SLOTS_LOG2 {
                return None;
            }
            slots *= 2;
        }
        slots.checked_mul(size_of::<u64>())
    }

    /// Doubles the table, re-placing every entry from its slot alone.
    fn grow(&mut self) {
        let n = self.slots.len();
        assert_can_double(n);
        let old = std::mem::replace(&mut self.slots, vec![EMPTY; n * 2]);
        for slot in old.into_iter().filter(|&s| s != EMPTY) {
            place(&mut self.slots, slot);
        }
    }
}

impl Default for FingerprintIndex {
    /// Same as [`FingerprintIndex::new`].
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for FingerprintIndex {
    /// The counts only, not the slots.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FingerprintIndex")
            .field("len", &self.len)
            .field("slots", &self.slots.len())
            .finish()
    }
}

#[cfg(test)]
#[path = "index_tests.rs"]
mod tests;
