//! An in-memory fingerprint index kept in front of the sled dedup ledger.
//!
//! # What it is for
//!
//! Deciding whether an event ID was already recorded should not cost a sled read per event.
//! The index holds one small entry per ledger entry: a fingerprint of the caller's 64-bit hash
//! of the ID, and a 16-bit tag the caller chooses. It is a filter:
//!
//! - a **miss** (no entry) proves that the ID was never recorded: no ledger read at all;
//! - a **hit** only says *where* to look: the ledger tags each entry with the tag of the
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
//! An open-addressing table of 6-byte slots (all zeros = empty), linear probing, deletion by
//! backward shift (no tombstones), growing when the load would exceed 7/8: doubling while the
//! table is small, by a quarter from [`GROW_BY_QUARTER_FROM`] slots on (see *Memory*). Each
//! used slot holds three `u16`:
//!
//! ```text
//! ┌─────────────────┬─────────────────┬─────────────────────────────┐
//! │ fp, high half   │ fp, low half    │ tag (the ledger: its chunk) │
//! └─────────────────┴─────────────────┴─────────────────────────────┘
//!   fp: top 32 bits of the hash, lowest bit forced to 1
//! ```
//!
//! Forcing the lowest bit of `fp` to 1 makes a used slot never all zeros, so zeros can mean
//! "empty".
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
//! 6 bytes per slot; removals never shrink the table. Slots were 8 bytes with a 32-bit tag
//! until the index was the largest single item of the agent's RSS at rest (issue 16): 16
//! bits of tag name one chunk among 65,536, more than a million-entry window needs, and the
//! ledger shares tags past that (slower hits, never a wrong answer). Doubling kept the load
//! between 7/16 and 7/8 and held the old and the new table together while it grew: a
//! million entries took 16 MiB of 8-byte slots, and 24 MiB while it doubled. From
//! [`GROW_BY_QUARTER_FROM`] slots on a table grows by a quarter instead, so the load stays
//! between 7/10 and 7/8 (8.6 down to 6.9 bytes per entry). Past [`SPLIT_AT_SLOTS`] slots
//! the ledger splits its index into [`SHARDS`] tables ([`ShardedIndex`]), so only a
//! sixteenth is held twice while it grows: 980k entries take 6.8 MiB (9.1 with 8-byte
//! slots). The cost is more re-placing (each entry moves about five times over a table's
//! life instead of twice) and a higher average load for lookups (unrecorded IDs probe a few
//! more slots, within one or two cache lines).

use std::fmt;

/// The time-shaped wrappers the tests use keep record times in units of `1 << COARSE_SHIFT`
/// ms: `coarse = seen_ms >> 10`.
#[cfg(test)]
pub(crate) const COARSE_SHIFT: u32 = 10;

/// One slot: `fp` in two halves, then the tag; six bytes, no padding (see *Memory*).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct Slot([u16; 3]);

/// The value of an empty slot. A used slot is never all zeros: its `fp` has its lowest bit
/// set.
const EMPTY: Slot = Slot([0; 3]);

/// The smallest table, in slots (a power of two).
const MIN_SLOTS: usize = 16;

/// The largest table, in slots.
const MAX_SLOTS: usize = 1 << 31;

/// From this many slots on, the table grows by a quarter instead of doubling (see *Memory*).
const GROW_BY_QUARTER_FROM: usize = 1 << 12;

/// A compact multi-map from hash fingerprints to coarse record times (see the module docs).
pub(crate) struct FingerprintIndex {
    /// A multiple of 8, at least [`MIN_SLOTS`], at most [`MAX_SLOTS`]; [`EMPTY`] or a packed
    /// `(fp, tag)`.
    slots: Vec<Slot>,
    /// Used slots.
    len: usize,
}

/// The fingerprint of a caller's hash: its top 32 bits, lowest bit forced to 1.
fn fingerprint(hash: u64) -> u32 {
    ((hash >> 32) as u32) | 1
}

/// `seen_ms` in coarse units, saturated to `u16::MAX`.
#[cfg(test)]
fn coarse(seen_ms: u64) -> u16 {
    u16::try_from(seen_ms >> COARSE_SHIFT).unwrap_or(u16::MAX)
}

/// A used slot.
fn pack(fp: u32, tag: u16) -> Slot {
    Slot([(fp >> 16) as u16, fp as u16, tag])
}

/// The `fp` half of a slot.
fn slot_fp(slot: Slot) -> u32 {
    (u32::from(slot.0[0]) << 16) | u32::from(slot.0[1])
}

/// The tag of a slot (the tests' coarse time).
fn slot_coarse(slot: Slot) -> u16 {
    slot.0[2]
}

/// The record times `[lo_ms, hi_ms]` that map to `coarse`.
#[cfg(test)]
fn time_range(coarse: u16) -> (u64, u64) {
    let lo = u64::from(coarse) << COARSE_SHIFT;
    if coarse == u16::MAX {
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
fn place(slots: &mut [Slot], slot: Slot) {
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

/// The first size of the growth sequence from [`MIN_SLOTS`] that holds `entries`, or `None`
/// past [`MAX_SLOTS`].
fn slots_for(entries: usize) -> Option<usize> {
    let mut slots = MIN_SLOTS;
    while max_len(slots) < entries {
        slots = grown(slots)?;
    }
    Some(slots)
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
        let slots = slots_for(entries).unwrap_or_else(|| must_grow(MAX_SLOTS));
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
    pub(crate) fn insert_tag(&mut self, hash: u64, tag: u16) {
        if self.len + 1 > max_len(self.slots.len()) {
            self.grow();
        }
        place(&mut self.slots, pack(fingerprint(hash), tag));
        self.len += 1;
    }

    /// The tags of every entry whose fingerprint equals `hash`'s, pushed into `out` (cleared
    /// first). The order is unspecified.
    pub(crate) fn tags(&self, hash: u64, out: &mut Vec<u16>) {
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
    pub(crate) fn remove_tag(&mut self, hash: u64, tag: u16) -> bool {
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

    /// Bytes held by the table (slots * 6), for the footprint figures.
    pub(crate) fn memory_bytes(&self) -> usize {
        self.slots.len() * size_of::<Slot>()
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
        slots.checked_mul(size_of::<Slot>())
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

/// The ledger's index: one [`FingerprintIndex`] while it is small, [`SHARDS`] of them once
/// it would grow past [`SPLIT_AT_SLOTS`]. An entry's shard is named by bits 1 to 4 of its
/// fingerprint (bit 0 is always 1; a home bucket comes from the top bits), so the split
/// re-places slots without their hashes.
///
/// Why shards: a table grows by re-placing every entry into a larger one, and for that
/// moment both are held. One table of a million entries held 7.3 + 9.1 MiB while it grew,
/// at the agent's peak RSS (issue 16); a shard holds a sixteenth of that. The load and the
/// bytes per entry are those of a single table.
pub(crate) struct ShardedIndex {
    /// One table, or [`SHARDS`].
    shards: Vec<FingerprintIndex>,
}

/// Tables of a split [`ShardedIndex`] (a power of two).
pub(crate) const SHARDS: usize = 16;

/// A [`ShardedIndex`] splits when its one table would grow beyond this many slots (384 KiB).
const SPLIT_AT_SLOTS: usize = 1 << 16;

/// The shard of `fp` among `shards` (1 or [`SHARDS`]).
fn shard_of(fp: u32, shards: usize) -> usize {
    ((fp >> 1) as usize) & (shards - 1)
}

impl ShardedIndex {
    fn shard(&self, hash: u64) -> usize {
        shard_of(fingerprint(hash), self.shards.len())
    }

    /// The entries of all shards.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.shards.iter().map(|t| t.len).sum()
    }

    /// Whether it is split into [`SHARDS`] tables.
    #[cfg(test)]
    pub(crate) fn is_split(&self) -> bool {
        self.shards.len() == SHARDS
    }

    /// See [`FingerprintIndex::insert_tag`].
    pub(crate) fn insert_tag(&mut self, hash: u64, tag: u16) {
        if self.shards.len() == 1
            && self.shards[0]
                .bytes_to_hold(1)
                .is_none_or(|b| b > SPLIT_AT_SLOTS * size_of::<Slot>())
        {
            self.split();
        }
        let i = self.shard(hash);
        self.shards[i].insert_tag(hash, tag);
    }

    /// Entries per shard of a split index, for the slots of one table.
    fn counts(one: &FingerprintIndex) -> [usize; SHARDS] {
        let mut counts = [0; SHARDS];
        for &s in one.slots.iter().filter(|&&s| s != EMPTY) {
            counts[shard_of(slot_fp(s), SHARDS)] += 1;
        }
        counts
    }

    /// One table becomes [`SHARDS`], each sized for its entries.
    fn split(&mut self) {
        let one = self.shards.pop().expect("one table");
        let counts = Self::counts(&one);
        self.shards = counts
            .iter()
            .map(|&c| FingerprintIndex {
                slots: vec![EMPTY; slots_for(c).expect("a shard holds less than the table")],
                len: 0,
            })
            .collect();
        for s in one.slots.into_iter().filter(|&s| s != EMPTY) {
            let t = &mut self.shards[shard_of(slot_fp(s), SHARDS)];
            place(&mut t.slots, s);
            t.len += 1;
        }
    }

    /// See [`FingerprintIndex::tags`].
    pub(crate) fn tags(&self, hash: u64, out: &mut Vec<u16>) {
        self.shards[self.shard(hash)].tags(hash, out);
    }

    /// See [`FingerprintIndex::remove_tag`].
    pub(crate) fn remove_tag(&mut self, hash: u64, tag: u16) -> bool {
        let i = self.shard(hash);
        self.shards[i].remove_tag(hash, tag)
    }

    /// Bytes held by all shards.
    pub(crate) fn memory_bytes(&self) -> usize {
        self.shards.iter().map(FingerprintIndex::memory_bytes).sum()
    }

    /// Bytes the index would hold after inserting entries with these hashes, or `None` if a
    /// table could not hold its share (see [`FingerprintIndex::bytes_to_hold`]).
    pub(crate) fn bytes_to_hold(&self, hashes: &[u64]) -> Option<usize> {
        let mut counts = if let [one] = self.shards.as_slice() {
            // Inserts split the table exactly when it would grow past the split size.
            let unsplit = one.bytes_to_hold(hashes.len())?;
            if unsplit <= SPLIT_AT_SLOTS * size_of::<Slot>() {
                return Some(unsplit);
            }
            Self::counts(one)
        } else {
            self.shards
                .iter()
                .map(|t| t.len)
                .collect::<Vec<_>>()
                .try_into()
                .ok()?
        };
        for &h in hashes {
            counts[shard_of(fingerprint(h), SHARDS)] += 1;
        }
        counts.iter().try_fold(0usize, |sum, &c| {
            sum.checked_add(slots_for(c)?.checked_mul(size_of::<Slot>())?)
        })
    }
}

impl Default for ShardedIndex {
    fn default() -> Self {
        ShardedIndex {
            shards: vec![FingerprintIndex::new()],
        }
    }
}

impl fmt::Debug for ShardedIndex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(&self.shards).finish()
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
