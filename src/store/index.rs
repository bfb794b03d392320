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
//! shift (no tombstones), growing when the load would exceed 7/8: doubling while the table is
//! small, by a quarter from [`GROW_BY_QUARTER_FROM`] slots on (see *Memory*). Each used slot
//! packs:
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
//! # Why buckets come from `fp` alone
//!
//! The full hash is not kept, only `fp`. The home bucket of an entry in a table of `n` slots
//! is `fp * n / 2^32` (multiply and shift: for a power of two `n`, the top `log2(n)` bits of
//! `fp`), so when the table grows each slot can be re-placed from the slot alone, whatever
//! the new size. The caller's hash must therefore be well mixed in its top bits.
//!
//! # Memory
//!
//! 8 bytes per slot; removals never shrink the table. Doubling kept the load between 7/16
//! and 7/8 (18 down to 9 bytes per entry) and held the old and the new table together while
//! it grew: a million entries took 16 MiB, and 24 MiB while it doubled, the largest single
//! item of the agent's peak RSS (issue 16). From [`GROW_BY_QUARTER_FROM`] slots (512 KiB) on
//! the table grows by a quarter instead: the load stays between 7/10 and 7/8 (11.4 down to
//! 9.1 bytes per entry), a million entries take 9.1 MiB, 16.4 MiB for the moment it grows.
//! The cost is more re-placing (each entry moves about five times over the table's life
//! instead of twice: under 1% of the time a million inserts take) and a higher average load
//! for lookups (unrecorded IDs probe a few more slots, within one or two cache lines).

use std::fmt;

/// The time-shaped wrappers the tests use keep record times in units of `1 << COARSE_SHIFT`
/// ms: `coarse = seen_ms >> 10`.
#[cfg(test)]
pub const COARSE_SHIFT: u32 = 10;

/// The value of an empty slot. A used slot is never 0: its `fp` has its lowest bit set.
const EMPTY: u64 = 0;

/// The smallest table, in slots (a power of two).
const MIN_SLOTS: usize = 16;

/// The largest table, in slots.
const MAX_SLOTS: usize = 1 << 31;

/// From this many slots on, the table grows by a quarter instead of doubling (see *Memory*).
const GROW_BY_QUARTER_FROM: usize = 1 << 16;

/// A compact multi-map from hash fingerprints to coarse record times (see the module docs).
pub struct FingerprintIndex {
    /// A multiple of 8, at least [`MIN_SLOTS`], at most [`MAX_SLOTS`]; [`EMPTY`] or a packed
    /// `(fp, tag)`.
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

/// The home bucket of `fp` in a table of `slots` slots: `fp * slots / 2^32` (for a power of
/// two, the top `log2(slots)` bits of `fp`).
fn home(fp: u32, slots: usize) -> usize {
    ((u64::from(fp) * slots as u64) >> 32) as usize
}

/// The slot after `i` in a table of `n` slots, wrapping at the end.
fn next(i: usize, n: usize) -> usize {
    if i + 1 == n { 0 } else { i + 1 }
}

/// How many steps forward (cyclically) `to` lies from `from` in a table of `n` slots.
fn distance(from: usize, to: usize, n: usize) -> usize {
    if to >= from { to - from } else { n - from + to }
}

/// Puts `slot` in the first empty slot at or after its home bucket, wrapping at the end.
/// The table must have an empty slot.
fn place(slots: &mut [u64], slot: u64) {
    let n = slots.len();
    let mut i = home(slot_fp(slot), n);
    while slots[i] != EMPTY {
        i = next(i, n);
    }
    slots[i] = slot;
}

/// The size a table of `slots` slots grows to (a multiple of 8), or `None` at [`MAX_SLOTS`].
fn grown(slots: usize) -> Option<usize> {
    if slots >= MAX_SLOTS {
        return None;
    }
    let bigger = if slots < GROW_BY_QUARTER_FROM {
        slots * 2
    } else {
        slots + slots / 32 * 8
    };
    Some(bigger.min(MAX_SLOTS))
}

/// The size a table of `slots` slots grows to; panics at [`MAX_SLOTS`].
fn must_grow(slots: usize) -> usize {
    grown(slots).unwrap_or_else(|| panic!("FingerprintIndex: more than {} entries", max_len(slots)))
}

impl FingerprintIndex {
    /// An empty index of 16 slots.
    pub fn new() -> Self {
        Self {
            slots: vec![EMPTY; MIN_SLOTS],
            len: 0,
        }
    }

    /// An empty index that holds `entries` entries without growing: the first size of the
    /// growth sequence from 16 slots of which 7/8 is at least `entries`.
    ///
    /// # Panics
    ///
    /// If that would take more than 2^31 slots.
    #[cfg(test)]
    pub fn with_capacity(entries: usize) -> Self {
        let mut slots = MIN_SLOTS;
        while max_len(slots) < entries {
            slots = must_grow(slots);
        }
        Self {
            slots: vec![EMPTY; slots],
            len: 0,
        }
    }

    /// An empty index of `slots` slots (a multiple of 8, at least 16): the tests' way to a
    /// table whose size is no power of two while it is still small.
    #[cfg(test)]
    pub(crate) fn with_slots(slots: usize) -> Self {
        assert!(slots % 8 == 0 && (MIN_SLOTS..=MAX_SLOTS).contains(&slots));
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
    /// grows the table first if the load would exceed 7/8.
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
        let n = self.slots.len();
        let mut i = home(fp, n);
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
            i = next(i, n);
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
        let mut i = home(slot_fp(target), n);
        loop {
            match self.slots[i] {
                EMPTY => return false,
                slot if slot == target => break,
                _ => i = next(i, n),
            }
        }
        // Backward shift: walk the rest of the run after the hole. An entry moves into the hole
        // only if the hole lies on its probe path, cyclically in [home, j): its distance from
        // its home is at least the hole's distance behind it. Otherwise (its home is after the
        // hole, possibly across the end of the array) it stays, and the walk goes on.
        let mut hole = i;
        let mut j = next(i, n);
        loop {
            let slot = self.slots[j];
            if slot == EMPTY {
                break;
            }
            let from_home = distance(home(slot_fp(slot), n), j, n);
            let from_hole = distance(hole, j, n);
            if from_home >= from_hole {
                self.slots[hole] = slot;
                hole = j;
            }
            j = next(j, n);
        }
        self.slots[hole] = EMPTY;
        self.len -= 1;
        true
    }

    /// Bytes held by the table (slots * 8), for the footprint figures.
    pub(crate) fn memory_bytes(&self) -> usize {
        self.slots.len() * size_of::<u64>()
    }

    /// Bytes the table would hold after `extra` more inserts (it grows until 7/8 of it holds
    /// them), or `None` if no table of at most 2^31 slots can. The ledger asks before
    /// it indexes a chunk, so that the index stays within its memory bound and never reaches
    /// the panic in [`FingerprintIndex::insert_tag`].
    pub(crate) fn bytes_to_hold(&self, extra: usize) -> Option<usize> {
        let want = self.len.checked_add(extra)?;
        let mut slots = self.slots.len();
        while max_len(slots) < want {
            slots = grown(slots)?;
        }
        slots.checked_mul(size_of::<u64>())
    }

    /// Grows the table one step, re-placing every entry from its slot alone.
    fn grow(&mut self) {
        let bigger = must_grow(self.slots.len());
        let old = std::mem::replace(&mut self.slots, vec![EMPTY; bigger]);
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
