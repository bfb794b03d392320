//! The in-memory index in front of the sled dedup ledger: 4 bytes per event ID.
//!
//! # What it is for
//!
//! Deciding whether an event ID was already recorded must not cost a sled read per event.
//! The index holds one 32-bit entry per ledger entry: 16 bits of the caller's 64-bit hash
//! of the ID (after the `d` that pick its bucket, 16 at the default bound) and a 16-bit
//! tag the caller chooses (the ledger: the group of chunks the ID is in). It is a filter:
//!
//! - a **miss** (no entry with the ID's `d + 16` bits) proves the ID was never recorded:
//!   no ledger read at all, the common case;
//! - a **hit** only says *where* to look: the ledger confirms in the chunks the tag names.
//!
//! Two IDs can share those bits, so a hit may be false: one read, never a wrong decision.
//! With `n` entries a lookup of an unrecorded ID meets a spurious entry with probability
//! `n / 2^(d+16)`: at the default bound 0.023% at one million entries, 0.23% at ten million.
//!
//! It is a multiset: every insert adds an entry (two IDs may share their 32 bits, and one ID
//! may be in the ledger twice); a remove takes out one equal entry.
//!
//! # Removal: retired tags and the sweep
//!
//! A group's entries can also go all at once, by its tag ([`PagedIndex::retire`]): from then
//! on lookups leave them out (a bit per tag), and a *sweep* takes them out of the pages,
//! walking the pages in bucket order, [`SWEEP_PER_DEAD`] entries for each one retired, a
//! little at each checkpoint. A retired tag is given out again only once a whole pass has
//! gone by since it was retired. Removing entries one at a time, as before (issue 33), cost
//! a cache miss and a shift of the rest of a page per entry: at ten million entries, where
//! every page is cold, 1.2 µs per expired ID, a fifth of the whole time per event; the
//! sweep reads the pages in order, 64 bytes per expired ID. What it costs in memory: a pass
//! over `n` entries comes with `n / 16` retired ones, so about `n / 8` at most wait (half a
//! byte per live ID; at the bound they are swept out at once before a chunk is refused).
//!
//! # Layout: a radix directory over sorted pages
//!
//! ```text
//!  hash:  │ bucket: d bits │ rest: 16 bits │ (unused) │
//!  entry: │ rest: 16 bits  │ tag: 16 bits  │            sorted within its bucket
//!
//!  buckets 0 .. 2^d - 1  ──▶  pages: Vec<u32>, each holding the entries of a run of
//!                             consecutive buckets, bucket after bucket
//! ```
//!
//! The bucket is implicit (the page and the offset it sits at say it), so an entry stores
//! only the 16 bits after it: `d + 16` bits of the hash for 16 stored. The directory has a
//! bucket per KiB of the memory bound ([`dir_bits_for`]: `d` = 16 at the default 64 MiB),
//! so it is 1/128 of the bound, and at the bound a bucket holds ~250 entries whatever the
//! bound is. Within a bucket entries are
//! sorted, so a lookup finds its place by interpolation (the bits are uniform) and a step or
//! two; at ten million entries a bucket holds ~150 of them, two or three cache lines.
//!
//! Why not an open-addressing table of (fingerprint, tag) as before (issue 33): a table that
//! grows must be able to re-place its entries without their keys, so each slot kept 32 bits
//! of fingerprint from which its position could be computed again, and with the load kept
//! between 7/10 and 7/8 that was 6.9 to 8.6 bytes per entry; 64 MiB held ~7 million IDs. A
//! page here never moves an entry to another bucket: a full page splits at a bucket
//! boundary (copying half a page), and the directory never changes size. So nothing needs
//! more bits than a lookup does, there is no load factor, and no growth step copies more
//! than one page.
//!
//! # Memory
//!
//! The directory (a page number and a start offset per bucket: 512 KiB at the default
//! bound) is allocated at the first insert. Pages start as empty runs of [`PAGE_BUCKETS`]
//! buckets and split past [`PAGE_MAX`] entries (64 KiB). A small page's capacity grows and
//! shrinks in steps of [`STEP`] entries; past [`SMALL_MAX`] (8 KiB) a page is *large*: at
//! least [`BIG_MIN`] entries (16 KiB) and a whole number of 4 KiB memory pages.
//!
//! Why large pages: the allocator serves objects under 16 KiB from slabs of its size
//! classes, and a slab goes back to the system only when every object in it is freed.
//! Pages of up to 2 KiB, as before, grew through the 1,280-, 1,536-, 1,792- and 2,048-byte
//! classes together (an index that only grows fills its pages evenly), and each class they
//! left stayed in slabs that a few pages still held: in the steady run 1.4 bytes of holes
//! per ID beside the 4.4 of the index, ~13 MiB at ten million. 16 KiB and up is served
//! whole memory pages at a time; a page that grows or shrinks gives its old ones back. Most
//! of a page moves when a checkpoint's entries merge into it either way, so a large page
//! costs a merge no more than many small ones, as long as a checkpoint touches most pages
//! (at 20,000 IDs a checkpoint and ~1,000 pages at ten million entries, it does).
//!
//! At ten million entries: 40 MB of entries, ~2 MB of slack (half a memory page a page),
//! 0.5 MB of directory, some tens of KiB of page headers, and ~0.1 bytes per entry for the
//! retired entries waiting for the sweep, plus two 8 KiB bitmaps.
//! [`PagedIndex::bytes_to_hold`] says, before any insert, what inserting some hashes would
//! take at most, so that the ledger keeps the index within `ledger_index_max`.

use std::fmt;

/// Fewest and most bits of the hash that pick a bucket (see [`dir_bits_for`]).
const DIR_BITS_MIN: u32 = 10;
const DIR_BITS_MAX: u32 = 24;
/// Bits of the hash an entry keeps after its bucket's (fewer in unit tests, so that false
/// hits are common there and every test exercises the confirming read).
pub(crate) const REST_BITS: u32 = if cfg!(test) { 5 } else { 16 };
/// Buckets of each page at the first insert: an insert moves the start of every later
/// bucket in its page, so a page never spans more.
const PAGE_BUCKETS: usize = if cfg!(test) { 4 } else { 256 };
/// A page of more entries than this splits (if it spans more than one bucket): 64 KiB.
const PAGE_MAX: usize = if cfg!(test) { 12 } else { 16_384 };
/// A small page's capacity grows and shrinks in steps of this many entries.
const STEP: usize = if cfg!(test) { 2 } else { 16 };
/// A page of more entries than this is large: its capacity is at least [`BIG_MIN`] entries
/// and a whole number of [`BIG_STEP`]s. 8 KiB of entries.
const SMALL_MAX: usize = if cfg!(test) { 6 } else { 2_048 };
/// A large page's least capacity: 16 KiB, jemalloc's smallest size served by whole memory
/// pages of their own (an extent) instead of a slot in a slab shared with other objects.
const BIG_MIN: usize = if cfg!(test) { 8 } else { 4_096 };
/// A large page's capacity grows and shrinks in steps of this many entries: a 4 KiB
/// memory page.
const BIG_STEP: usize = if cfg!(test) { 4 } else { 1_024 };
/// Most slack [`stepped`] leaves above a length: what each half of a split may add.
const MAX_SLACK: usize = max3(STEP, BIG_STEP, BIG_MIN - SMALL_MAX);
/// Page headers added at a time when a split needs one more.
const PAGES_STEP: usize = 64;
/// Most entries the index holds (a bucket's start offset is a `u32`).
const MAX_ENTRIES: usize = 1 << 31;
/// Entries the sweep walks for each entry of a retired tag: a full pass over `n` entries
/// comes with `n / SWEEP_PER_DEAD` retired ones, so at most about two passes' worth, `n / 8`,
/// are dead at once (half a byte per live entry), and each costs 16 entries (64 bytes) of a
/// sequential walk.
pub(crate) const SWEEP_PER_DEAD: usize = 16;

/// One page: the entries of buckets `first..end`, bucket by bucket, sorted within each.
struct Page {
    first: u32,
    end: u32,
    slots: Vec<u32>,
}

/// Bits of the hash that pick a bucket for an index bounded to `bound` bytes: a bucket per
/// KiB of the bound (a 1/128 of it in directory), 2^16 at the default 64 MiB, from 2^10 to
/// 2^24. At the bound, ~250 entries share a bucket whatever the bound, and a lookup of an
/// unrecorded ID meets a spurious entry with probability ~250 / 2^16 = 0.4%; below it, less.
/// Four in unit tests with a bound under 1 MiB, so that buckets fill and pages split on a
/// few hundred entries (larger ones keep this rule: their tests hold many entries).
pub(crate) fn dir_bits_for(bound: usize) -> u32 {
    if cfg!(test) && bound < 1 << 20 {
        return 4;
    }
    (bound / 1024)
        .max(1)
        .ilog2()
        .clamp(DIR_BITS_MIN, DIR_BITS_MAX)
}

/// A multiset of (32 bits of a hash, 16-bit tag) pairs (see the module docs).
pub(crate) struct PagedIndex {
    /// Bits of the hash that pick the bucket.
    dir_bits: u32,
    /// Bucket → (its page, where its entries start in the page): one cache line says both
    /// where a bucket starts and where it ends. Empty until the first insert.
    dir: Vec<(u32, u32)>,
    pages: Vec<Page>,
    len: usize,
    /// Slots of capacity of all pages together (kept, not summed: the bound is checked for
    /// every chunk).
    capacity: usize,
    /// Tags the sweep can give out (a bitmap's size; tags are below it).
    tag_space: usize,
    /// Retired tags (a bit each): those retired before the sweep's current pass swept its
    /// first page, and those retired since. The entries of the first are all gone when the
    /// pass ends; the others wait for the next pass.
    retired_old: Vec<u64>,
    retired_new: Vec<u64>,
    /// Bits set in both.
    retired_tags: usize,
    /// Entries of retired tags still in the pages (counted in `len`).
    dead: usize,
    /// The first bucket of the page the sweep takes next.
    sweep_at: usize,
}

/// The bucket of `hash` (its top `dir_bits`) and the entry it makes with `tag`. The rest
/// sits in the entry's high half, so entries sort by rest first and one rest's entries lie
/// together.
fn entry(dir_bits: u32, hash: u64, tag: u16) -> (usize, u32) {
    let bucket = (hash >> (64 - dir_bits)) as usize;
    let rest = ((hash >> (64 - dir_bits - REST_BITS)) as u32) & ((1 << REST_BITS) - 1);
    (bucket, (rest << 16) | u32::from(tag))
}

/// Entries to add, as the index files them (bucket, then rest and tag), sorted: built
/// without the index at hand (only its directory size), then merged a few pages at a time
/// ([`PagedIndex::merge_some`]).
pub(crate) struct Sorted {
    dir_bits: u32,
    entries: Vec<(usize, u32)>,
    /// How many [`PagedIndex::merge_some`] merged so far.
    at: usize,
}

impl Sorted {
    pub(crate) fn new(dir_bits: u32, items: &[(u64, u16)]) -> Sorted {
        let mut entries: Vec<(usize, u32)> =
            items.iter().map(|&(h, t)| entry(dir_bits, h, t)).collect();
        entries.sort_unstable();
        Sorted {
            dir_bits,
            entries,
            at: 0,
        }
    }
}

const fn max3(a: usize, b: usize, c: usize) -> usize {
    let ab = if a > b { a } else { b };
    if ab > c { ab } else { c }
}

/// The step a page of `len` entries grows and shrinks by.
fn step(len: usize) -> usize {
    if len <= SMALL_MAX { STEP } else { BIG_STEP }
}

/// Capacity for `len` entries: `len` rounded up to a whole step, and a large page at least
/// [`BIG_MIN`] (see the module docs, "Memory").
fn stepped(len: usize) -> usize {
    if len <= SMALL_MAX {
        len.div_ceil(STEP) * STEP
    } else {
        (len.div_ceil(BIG_STEP) * BIG_STEP).max(BIG_MIN)
    }
}

/// The first position in `s` (sorted) whose entry is at least `key`. The entries' rests are
/// uniform, so the position `key` would have in an even spread is a step or two from it;
/// a long walk (never, for random hashes) gives way to a binary search.
fn lower_bound(s: &[u32], key: u32) -> usize {
    let n = s.len();
    let rest = (key >> 16) as usize;
    let mut i = ((rest * n) >> REST_BITS).min(n);
    for _ in 0..16 {
        if i > 0 && s[i - 1] >= key {
            i -= 1;
        } else if i < n && s[i] < key {
            i += 1;
        } else {
            return i;
        }
    }
    s.partition_point(|&e| e < key)
}

impl PagedIndex {
    /// An empty index whose buckets are picked by `dir_bits` bits of the hash (see
    /// [`dir_bits_for`]). It allocates nothing until the first insert.
    /// Tags are below `tag_space` (at most 2^16).
    pub fn new(dir_bits: u32, tag_space: usize) -> Self {
        PagedIndex {
            dir_bits,
            dir: Vec::new(),
            pages: Vec::new(),
            len: 0,
            capacity: 0,
            tag_space: tag_space.min(1 << 16),
            retired_old: Vec::new(),
            retired_new: Vec::new(),
            retired_tags: 0,
            dead: 0,
            sweep_at: 0,
        }
    }

    /// Words of each retired-tag bitmap.
    fn tag_words(&self) -> usize {
        self.tag_space.div_ceil(64)
    }

    fn buckets(&self) -> usize {
        1 << self.dir_bits
    }

    fn initial_pages(&self) -> usize {
        self.buckets().div_ceil(PAGE_BUCKETS)
    }

    fn entry(&self, hash: u64, tag: u16) -> (usize, u32) {
        entry(self.dir_bits, hash, tag)
    }

    /// The number of entries, retired ones included.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Entries with `tag`, retired or not (tests: O(n)).
    #[cfg(test)]
    pub fn count_tag(&self, tag: u16) -> usize {
        (self.pages.iter().flat_map(|p| &p.slots))
            .filter(|&&e| e as u16 == tag)
            .count()
    }

    /// The number of entries whose tags are not retired.
    #[cfg(test)]
    pub fn live_len(&self) -> usize {
        self.len - self.dead
    }

    /// Allocate the directory and the initial pages.
    fn allocate(&mut self) {
        let buckets = self.buckets();
        self.dir = (0..buckets)
            .map(|b| ((b / PAGE_BUCKETS) as u32, 0))
            .collect();
        self.pages = (0..self.initial_pages())
            .map(|p| Page {
                first: (p * PAGE_BUCKETS) as u32,
                end: ((p + 1) * PAGE_BUCKETS).min(buckets) as u32,
                slots: Vec::new(),
            })
            .collect();
        self.retired_old = vec![0; self.tag_words()];
        self.retired_new = vec![0; self.tag_words()];
    }

    /// Bytes of the directory, the initial page headers and the retired-tag bitmaps: what
    /// the first insert allocates.
    fn base_bytes(&self) -> usize {
        self.buckets() * size_of::<(u32, u32)>()
            + self.initial_pages() * size_of::<Page>()
            + 2 * self.tag_words() * size_of::<u64>()
    }

    /// Page, start and end of `bucket`'s entries.
    fn range(&self, bucket: usize) -> (usize, usize, usize) {
        let (p, lo) = self.dir[bucket];
        let hi = match self.dir.get(bucket + 1) {
            Some(&(q, next)) if q == p => next as usize,
            _ => self.pages[p as usize].slots.len(),
        };
        (p as usize, lo as usize, hi)
    }

    /// Set page `p`'s capacity to `cap` slots (at least its length), keeping the count.
    fn set_capacity(&mut self, p: usize, cap: usize) {
        let slots = &mut self.pages[p].slots;
        let before = slots.capacity();
        if cap > before {
            slots.reserve_exact(cap - slots.len());
        } else if cap < before {
            slots.shrink_to(cap);
        }
        self.capacity = self.capacity + slots.capacity() - before;
    }

    /// The tags of every entry whose 32 bits equal `hash`'s, pushed into `out` (cleared
    /// first), in ascending order (repeats kept).
    pub(crate) fn tags(&self, hash: u64, out: &mut Vec<u16>) {
        out.clear();
        if self.len == 0 {
            return;
        }
        let (bucket, key) = self.entry(hash, 0);
        let (p, lo, hi) = self.range(bucket);
        let s = &self.pages[p].slots[lo..hi];
        let rest = key >> 16;
        out.extend(
            s[lower_bound(s, key)..]
                .iter()
                .take_while(|&&e| e >> 16 == rest)
                .map(|&e| e as u16)
                .filter(|&t| !self.is_retired(t)),
        );
    }

    /// Whether `tag` is retired: its entries count as gone, and it must not be inserted
    /// again until the sweep has taken them out.
    pub(crate) fn is_retired(&self, tag: u16) -> bool {
        let (w, b) = (usize::from(tag) / 64, tag % 64);
        let bit = |m: &[u64]| m.get(w).is_some_and(|x| x >> b & 1 == 1);
        bit(&self.retired_old) || bit(&self.retired_new)
    }

    /// Tags retired and not yet swept out.
    pub(crate) fn retired_tags(&self) -> usize {
        self.retired_tags
    }

    /// Entries of retired tags still held.
    pub(crate) fn dead(&self) -> usize {
        self.dead
    }

    /// Take every entry with `tag` out, lazily: from now on a lookup does not see them, and
    /// [`PagedIndex::sweep`] removes them as it passes. The caller says how many there are
    /// (`entries`, exactly), and gives `tag` to no insert until [`PagedIndex::is_retired`]
    /// says it is free again. Removing a group's entries one by one cost a cache miss and
    /// half a page moved per entry (issue 33: a third of the time per event at ten million
    /// entries); the sweep walks the pages in order instead, a few entries per one retired.
    pub(crate) fn retire(&mut self, tag: u16, entries: usize) {
        if entries == 0 || self.pages.is_empty() {
            return;
        }
        debug_assert!(!self.is_retired(tag), "tag {tag} retired twice");
        debug_assert!(usize::from(tag) < self.tag_space);
        // At the first bucket the pass to come has swept nothing yet: its end frees the tag.
        let bits = if self.sweep_at == 0 {
            &mut self.retired_old
        } else {
            &mut self.retired_new
        };
        bits[usize::from(tag) / 64] |= 1 << (tag % 64);
        self.retired_tags += 1;
        self.dead += entries;
        debug_assert!(self.dead <= self.len, "retired more entries than held");
    }

    /// Walk pages in bucket order from where the last sweep stopped, taking out the entries
    /// of retired tags, until about `budget` entries were walked or none is left. A pass
    /// that comes back to the first bucket frees the tags retired before it began.
    pub(crate) fn sweep(&mut self, budget: usize) {
        let mut walked = 0;
        while self.dead > 0 && walked < budget {
            let p = self.dir[self.sweep_at].0 as usize;
            walked += self.pages[p].slots.len().max(1);
            self.sweep_page(p);
            self.sweep_at = self.pages[p].end as usize;
            if self.sweep_at == self.buckets() {
                self.sweep_at = 0;
                self.retired_tags -= count_ones(&self.retired_old);
                std::mem::swap(&mut self.retired_old, &mut self.retired_new);
                self.retired_new.fill(0);
            }
        }
        if self.dead == 0 && self.retired_tags > 0 {
            // No entry of a retired tag is left anywhere: every one is free.
            self.retired_old.fill(0);
            self.retired_new.fill(0);
            self.retired_tags = 0;
        }
    }

    /// Sweep until no entry of a retired tag is left (each tag then free again): two passes
    /// at most, after which none can be left whatever the counts say.
    pub(crate) fn sweep_all(&mut self) {
        if self.pages.is_empty() {
            return;
        }
        // Each page walked counts at least one: two passes, wherever they start.
        self.sweep(2 * (self.len + self.pages.len()));
        debug_assert_eq!(self.dead, 0, "the retired entries' count is exact");
        if self.dead > 0 {
            self.dead = 0;
            self.sweep(0);
        }
    }

    /// Take the entries of retired tags out of page `p`.
    fn sweep_page(&mut self, p: usize) {
        let (first, end) = (self.pages[p].first as usize, self.pages[p].end as usize);
        let (old, new) = (&self.retired_old, &self.retired_new);
        let dir = &mut self.dir;
        let slots = &mut self.pages[p].slots;
        let old_len = slots.len();
        let mut w = 0;
        for b in first..end {
            let lo = dir[b].1 as usize;
            let hi = if b + 1 < end {
                dir[b + 1].1 as usize
            } else {
                old_len
            };
            dir[b].1 = w as u32;
            for r in lo..hi {
                let e = slots[r];
                let t = e as u16 as usize;
                let bit = 1u64 << (t % 64);
                if (old[t / 64] | new[t / 64]) & bit == 0 {
                    slots[w] = e;
                    w += 1;
                }
            }
        }
        slots.truncate(w);
        let gone = old_len - w;
        self.len -= gone;
        debug_assert!(gone <= self.dead, "the retired entries' count is exact");
        self.dead = self.dead.saturating_sub(gone);
        self.give_back(p);
    }

    /// Add one entry. Adds it even if an equal one is there already.
    ///
    /// # Panics
    ///
    /// Past 2^31 entries ([`PagedIndex::bytes_to_hold`] says `None` before that).
    #[cfg(test)]
    pub(crate) fn insert(&mut self, hash: u64, tag: u16) {
        assert!(self.len < MAX_ENTRIES, "PagedIndex: more than 2^31 entries");
        if self.pages.is_empty() {
            self.allocate();
        }
        let (bucket, e) = self.entry(hash, tag);
        let (p, lo, hi) = self.range(bucket);
        let at = lo + lower_bound(&self.pages[p].slots[lo..hi], e);
        if self.pages[p].slots.len() == self.pages[p].slots.capacity() {
            self.set_capacity(p, stepped(self.pages[p].slots.len() + 1));
        }
        let page = &mut self.pages[p];
        page.slots.insert(at, e);
        for d in &mut self.dir[bucket + 1..page.end as usize] {
            d.1 += 1;
        }
        self.len += 1;
        self.split_while_full(p);
    }

    /// Add many entries at once: sorted first, then merged page by page, each page touched
    /// once. A checkpoint's thousands of inserts then walk the directory and the pages in
    /// order instead of jumping to a cold cache line for each (issue 33: at ten million
    /// entries, one at a time cost ~1 µs per event more than at a hundred thousand).
    pub(crate) fn insert_many(&mut self, items: &[(u64, u16)]) {
        debug_assert!(!self.any_retired(items), "a retired tag is inserted again");
        let mut sorted = Sorted::new(self.dir_bits, items);
        while self.merge_some(&mut sorted, usize::MAX) {}
    }

    /// The directory's size in bits: what [`Sorted::new`] needs to know.
    pub(crate) fn dir_bits(&self) -> u32 {
        self.dir_bits
    }

    /// Whether an entry of these would carry a retired tag (never, when the caller is right).
    pub(crate) fn any_retired(&self, items: &[(u64, u16)]) -> bool {
        items.iter().any(|&(_, t)| self.is_retired(t))
    }

    /// Merge the entries of `s` into the next pages they fall in (each page once), going on
    /// from where the last call stopped, until pages of `walk` entries or more were merged
    /// (at least one page): a merge moves most of its page. Returns whether any are left.
    /// Between two calls the index is whole: each page holds all of its entries from `s` or
    /// none.
    pub(crate) fn merge_some(&mut self, s: &mut Sorted, walk: usize) -> bool {
        debug_assert_eq!(s.dir_bits, self.dir_bits, "sorted for another directory");
        let es = &s.entries;
        if s.at == es.len() {
            return false;
        }
        assert!(
            self.len + (es.len() - s.at) <= MAX_ENTRIES,
            "PagedIndex: more than 2^31 entries"
        );
        if self.pages.is_empty() {
            self.allocate();
        }
        let mut i = s.at;
        let mut walked = 0;
        while walked < walk.max(1) {
            if i == es.len() {
                break;
            }
            let p = self.dir[es[i].0].0 as usize;
            let end = self.pages[p].end as usize;
            let j = i + es[i..].partition_point(|e| e.0 < end);
            self.merge_into(p, &es[i..j]);
            walked += self.pages[p].slots.len();
            self.len += j - i;
            // Splitting moves only this page's buckets: the entries left lie beyond them.
            self.split_while_full(p);
            i = j;
        }
        s.at = i;
        i < es.len()
    }

    /// Merge `new` (sorted by bucket and entry, all in page `p`'s buckets) into page `p`,
    /// from the back, bucket by bucket, so that every entry moves at most once.
    fn merge_into(&mut self, p: usize, new: &[(usize, u32)]) {
        let (first, end) = (self.pages[p].first as usize, self.pages[p].end as usize);
        let old_len = self.pages[p].slots.len();
        let new_len = old_len + new.len();
        if new_len > self.pages[p].slots.capacity() {
            self.set_capacity(p, stepped(new_len));
        }
        let slots = &mut self.pages[p].slots;
        slots.resize(new_len, 0);
        let (mut w, mut k, mut r_end) = (new_len, new.len(), old_len);
        for b in (first..end).rev() {
            if k == 0 {
                break; // the buckets below keep their places
            }
            let lo = self.dir[b].1 as usize;
            let kb = new[..k].partition_point(|e| e.0 < b);
            let (mut r, mut n) = (r_end, k);
            while n > kb {
                if r > lo && slots[r - 1] > new[n - 1].1 {
                    r -= 1;
                    w -= 1;
                    slots[w] = slots[r];
                } else {
                    n -= 1;
                    w -= 1;
                    slots[w] = new[n].1;
                }
            }
            // The rest of this bucket's old entries move by what lies below them.
            let shift = w - r;
            if shift > 0 {
                slots.copy_within(lo..r, lo + shift);
            }
            w = lo + shift;
            self.dir[b].1 = w as u32;
            r_end = lo;
            k = kb;
        }
    }

    /// Remove ONE entry equal to (hash's 32 bits, tag). Returns whether one was found.
    #[cfg(test)]
    pub(crate) fn remove(&mut self, hash: u64, tag: u16) -> bool {
        if self.len == 0 {
            return false;
        }
        let (bucket, e) = self.entry(hash, tag);
        let (p, lo, hi) = self.range(bucket);
        let page = &mut self.pages[p];
        let at = lo + lower_bound(&page.slots[lo..hi], e);
        if at == hi || page.slots[at] != e {
            return false;
        }
        page.slots.remove(at);
        for d in &mut self.dir[bucket + 1..page.end as usize] {
            d.1 -= 1;
        }
        self.len -= 1;
        self.give_back(p);
        true
    }

    /// Remove one equal entry for each item (sorted first, then page by page, as
    /// [`PagedIndex::insert_many`]). Returns how many were found.
    pub(crate) fn remove_many(&mut self, items: &[(u64, u16)]) -> usize {
        if self.len == 0 || items.is_empty() {
            return 0;
        }
        let mut es: Vec<(usize, u32)> = items.iter().map(|&(h, t)| self.entry(h, t)).collect();
        es.sort_unstable();
        let mut removed = 0;
        let mut i = 0;
        while i < es.len() {
            let p = self.dir[es[i].0].0 as usize;
            let end = self.pages[p].end as usize;
            let j = i + es[i..].partition_point(|e| e.0 < end);
            removed += self.compact(p, &es[i..j]);
            self.give_back(p);
            i = j;
        }
        self.len -= removed;
        removed
    }

    /// Take one equal entry of page `p` out for each of `gone` (sorted, in its buckets),
    /// closing the gaps from the first bucket concerned on. Returns how many it found.
    fn compact(&mut self, p: usize, gone: &[(usize, u32)]) -> usize {
        let end = self.pages[p].end as usize;
        let first = gone[0].0;
        let old_len = self.pages[p].slots.len();
        let mut w = self.dir[first].1 as usize;
        let mut q = 0;
        let mut found = 0;
        for b in first..end {
            let lo = self.dir[b].1 as usize;
            let hi = match self.dir.get(b + 1) {
                Some(&(pp, next)) if pp as usize == p => next as usize,
                _ => old_len,
            };
            self.dir[b].1 = w as u32;
            let slots = &mut self.pages[p].slots;
            for r in lo..hi {
                let e = slots[r];
                while q < gone.len() && (gone[q].0, gone[q].1) < (b, e) {
                    q += 1; // not there
                }
                if q < gone.len() && gone[q] == (b, e) {
                    q += 1;
                    found += 1;
                } else {
                    slots[w] = e;
                    w += 1;
                }
            }
        }
        self.pages[p].slots.truncate(w);
        found
    }

    /// Give memory back as a window shrinks, with a step of room left so that an insert
    /// after a remove does not reallocate at once.
    fn give_back(&mut self, p: usize) {
        let (len, cap) = (self.pages[p].slots.len(), self.pages[p].slots.capacity());
        if cap >= len + 3 * step(len) {
            self.set_capacity(p, stepped(len + step(len)));
        }
    }

    /// Split page `p`, and the pages split off it, until each holds at most [`PAGE_MAX`]
    /// entries or a single bucket.
    fn split_while_full(&mut self, p: usize) {
        let mut todo = vec![p];
        while let Some(p) = todo.pop() {
            let page = &self.pages[p];
            if page.slots.len() > PAGE_MAX && page.end - page.first > 1 {
                let q = self.split(p);
                todo.extend([p, q]);
            }
        }
    }

    /// Split page `p` at the bucket boundary nearest its middle: the buckets from there on
    /// move to a new page, whose number it returns. Both keep capacity for their entries
    /// only (rounded to a step).
    fn split(&mut self, p: usize) -> usize {
        let (first, end) = (self.pages[p].first as usize, self.pages[p].end as usize);
        let half = self.pages[p].slots.len() / 2;
        let mid = (first + 1..end)
            .min_by_key(|&b| (self.dir[b].1 as usize).abs_diff(half))
            .expect("a page of two buckets or more");
        let cut = self.dir[mid].1 as usize;
        let len = self.pages[p].slots.len();
        let mut tail = Vec::with_capacity(stepped(len - cut));
        tail.extend_from_slice(&self.pages[p].slots[cut..]);
        self.capacity += tail.capacity();
        self.pages[p].slots.truncate(cut);
        self.set_capacity(p, stepped(cut));
        self.pages[p].end = mid as u32;
        let q = self.pages.len();
        for d in &mut self.dir[mid..end] {
            *d = (q as u32, d.1 - cut as u32);
        }
        if self.pages.len() == self.pages.capacity() {
            self.pages.reserve_exact(PAGES_STEP);
        }
        self.pages.push(Page {
            first: mid as u32,
            end: end as u32,
            slots: tail,
        });
        q
    }

    /// Bytes held: the directory, the page headers, every page's capacity and the
    /// retired-tag bitmaps.
    pub(crate) fn memory_bytes(&self) -> usize {
        self.dir.capacity() * size_of::<(u32, u32)>()
            + self.pages.capacity() * size_of::<Page>()
            + self.capacity * size_of::<u32>()
            + (self.retired_old.capacity() + self.retired_new.capacity()) * size_of::<u64>()
    }

    /// At most the bytes the index would hold after inserting entries with these hashes, or
    /// `None` past 2^31 entries. The ledger asks before it indexes chunks, so that the
    /// index stays within its memory bound. Exact for each page's capacity; a page that may
    /// split adds a header and two steps, and the header array its growth.
    pub(crate) fn bytes_to_hold(&self, hashes: &[u64]) -> Option<usize> {
        if self.len.checked_add(hashes.len())? > MAX_ENTRIES {
            return None;
        }
        if hashes.is_empty() {
            return Some(self.memory_bytes());
        }
        let mut bytes = self.memory_bytes();
        if self.pages.is_empty() {
            // A new directory: its pages are all empty.
            bytes += self.base_bytes();
            let mut per_page = vec![0usize; self.initial_pages()];
            for &h in hashes {
                per_page[self.entry(h, 0).0 / PAGE_BUCKETS] += 1;
            }
            let mut splits = 0;
            for n in per_page {
                bytes += stepped(n) * size_of::<u32>();
                if n > PAGE_MAX {
                    splits += n / (PAGE_MAX / 2);
                }
            }
            return Some(bytes + self.split_bytes(splits));
        }
        let mut pages: Vec<u32> = hashes
            .iter()
            .map(|&h| self.dir[self.entry(h, 0).0].0)
            .collect();
        pages.sort_unstable();
        let mut splits = 0;
        for run in pages.chunk_by(|a, b| a == b) {
            let slots = &self.pages[run[0] as usize].slots;
            let len = slots.len() + run.len();
            if len > slots.capacity() {
                bytes += (stepped(len) - slots.capacity()) * size_of::<u32>();
            }
            if len > PAGE_MAX {
                splits += len / (PAGE_MAX / 2);
            }
        }
        Some(bytes + self.split_bytes(splits))
    }

    /// What `splits` page splits may add: a header and twice [`MAX_SLACK`] each (each half
    /// rounds its length up by that at most), and the growth of the header array.
    fn split_bytes(&self, splits: usize) -> usize {
        if splits == 0 {
            return 0;
        }
        splits * (size_of::<Page>() + 2 * MAX_SLACK * size_of::<u32>())
            + (splits + PAGES_STEP) * size_of::<Page>()
    }
}

/// Bits set in a bitmap.
fn count_ones(m: &[u64]) -> usize {
    m.iter().map(|w| w.count_ones() as usize).sum()
}

impl fmt::Debug for PagedIndex {
    /// The counts only, not the entries.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PagedIndex")
            .field("len", &self.len)
            .field("dead", &self.dead)
            .field("pages", &self.pages.len())
            .field("bytes", &self.memory_bytes())
            .finish()
    }
}

#[cfg(test)]
#[path = "index_tests.rs"]
mod tests;
