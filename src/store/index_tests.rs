//! The paged index's tests, beside it rather than inside it. The unit-test constants are
//! small (16 buckets, 5 bits of rest, pages of 12), so a few hundred entries split pages,
//! share buckets and collide, as tens of millions do in production.

use std::collections::BTreeMap;

use super::*;
use proptest::prelude::*;

const DIR_BITS: u32 = 4;
const BUCKETS: usize = 1 << DIR_BITS;

fn index() -> PagedIndex {
    PagedIndex::new(DIR_BITS, 64)
}

/// A hash with this bucket and rest; `low` fills the bits the index ignores.
fn h(bucket: u64, rest: u64, low: u64) -> u64 {
    (bucket << (64 - DIR_BITS))
        | (rest << (64 - DIR_BITS - REST_BITS))
        | (low & ((1 << (64 - DIR_BITS - REST_BITS)) - 1))
}

fn tags(ix: &PagedIndex, hash: u64) -> Vec<u16> {
    let mut out = vec![99]; // cleared first
    ix.tags(hash, &mut out);
    out
}

/// The layout's invariants: the pages cover the buckets in runs, each bucket's start lies
/// within its page and after the one before, every bucket's entries are sorted, a page
/// over the split size holds a single bucket, capacities are whole steps (a large page's
/// whole memory pages), and `len` counts every entry.
fn check(ix: &PagedIndex) {
    if ix.pages.is_empty() {
        assert_eq!(ix.len, 0);
        return;
    }
    let mut total = 0;
    for (p, page) in ix.pages.iter().enumerate() {
        assert!(page.first < page.end);
        for b in page.first as usize..page.end as usize {
            assert_eq!(ix.dir[b].0 as usize, p, "bucket {b}");
            let (_, lo, hi) = ix.range(b);
            assert!(lo <= hi && hi <= page.slots.len());
            assert!(
                page.slots[lo..hi].windows(2).all(|w| w[0] <= w[1]),
                "bucket {b} sorted"
            );
        }
        assert_eq!(ix.dir[page.first as usize].1, 0);
        assert!(page.slots.len() <= PAGE_MAX || page.end - page.first == 1);
        let cap = page.slots.capacity();
        assert_eq!(cap % STEP, 0, "capacity in whole steps");
        assert!(
            cap <= SMALL_MAX || (cap >= BIG_MIN && cap % BIG_STEP == 0),
            "a large page's capacity is whole memory pages, {BIG_MIN} at least: {cap}"
        );
        total += page.slots.len();
    }
    let mut covered: Vec<(u32, u32)> = ix.pages.iter().map(|p| (p.first, p.end)).collect();
    covered.sort_unstable();
    assert_eq!(covered[0].0, 0);
    assert!(covered.windows(2).all(|w| w[0].1 == w[1].0), "runs meet");
    assert_eq!(covered.last().unwrap().1 as usize, BUCKETS);
    assert_eq!(total, ix.len);
    let dead = (ix.pages.iter().flat_map(|p| &p.slots))
        .filter(|&&e| ix.is_retired(e as u16))
        .count();
    assert_eq!(dead, ix.dead, "the retired entries' count is exact");
    let both = (ix.retired_old.iter().zip(&ix.retired_new))
        .map(|(a, b)| {
            assert_eq!(a & b, 0, "a tag is retired once");
            (a | b).count_ones() as usize
        })
        .sum::<usize>();
    assert_eq!(both, ix.retired_tags);
    let capacity: usize = ix.pages.iter().map(|p| p.slots.capacity()).sum();
    assert_eq!(
        capacity, ix.capacity,
        "the capacity count follows the pages"
    );
}

#[test]
fn an_empty_index_holds_nothing_and_allocates_nothing() {
    let mut ix = index();
    assert_eq!((ix.len(), ix.memory_bytes()), (0, 0));
    assert!(tags(&ix, 0).is_empty() && tags(&ix, u64::MAX).is_empty());
    assert!(!ix.remove(0, 0));
    assert_eq!(ix.bytes_to_hold(&[]), Some(0));
    check(&ix);
}

#[test]
fn a_hit_gives_the_tags_of_equal_bits_only_and_a_remove_takes_one() {
    let mut ix = index();
    ix.insert(h(3, 7, 1), 10);
    ix.insert(h(3, 7, 2), 11); // the same 32 bits (the low ones are ignored)
    ix.insert(h(3, 7, 3), 10); // an equal entry: a second one
    ix.insert(h(3, 8, 0), 12); // same bucket, another rest
    ix.insert(h(4, 7, 0), 13); // same rest, another bucket
    check(&ix);
    assert_eq!(tags(&ix, h(3, 7, 99)), [10, 10, 11]);
    assert_eq!(tags(&ix, h(3, 8, 0)), [12]);
    assert_eq!(tags(&ix, h(4, 7, 0)), [13]);
    assert!(tags(&ix, h(3, 6, 0)).is_empty() && tags(&ix, h(5, 7, 0)).is_empty());
    assert!(ix.remove(h(3, 7, 5), 10));
    assert_eq!(tags(&ix, h(3, 7, 0)), [10, 11]);
    assert!(!ix.remove(h(3, 7, 0), 12), "tag 12 is under another rest");
    assert!(ix.remove(h(3, 7, 0), 10) && ix.remove(h(3, 7, 0), 11));
    assert!(!ix.remove(h(3, 7, 0), 10));
    assert_eq!(ix.len(), 2);
    check(&ix);
}

#[test]
fn the_highest_and_lowest_bits_land_in_the_first_and_last_buckets() {
    let mut ix = index();
    let max_rest = (1 << REST_BITS) - 1;
    for (b, r) in [
        (0, 0),
        (0, max_rest),
        (BUCKETS as u64 - 1, 0),
        (BUCKETS as u64 - 1, max_rest),
    ] {
        ix.insert(h(b, r, 0), 1);
    }
    ix.insert(u64::MAX, 2);
    ix.insert(0, 3);
    check(&ix);
    assert_eq!(tags(&ix, 0), [1, 3]);
    assert_eq!(tags(&ix, u64::MAX), [1, 2]);
}

#[test]
fn full_pages_split_at_bucket_boundaries_and_keep_every_entry() {
    let mut ix = index();
    let hashes: Vec<u64> = (0..600u64).map(mix).collect();
    for (i, &x) in hashes.iter().enumerate() {
        ix.insert(x, (i % 7) as u16);
        if i % 50 == 0 {
            check(&ix);
        }
    }
    check(&ix);
    assert!(
        ix.pages.len() > BUCKETS / PAGE_BUCKETS,
        "pages split: {}",
        ix.pages.len()
    );
    for (i, &x) in hashes.iter().enumerate() {
        assert!(tags(&ix, x).contains(&((i % 7) as u16)), "entry {i}");
    }
    // One bucket alone may outgrow a page: it cannot split.
    for i in 0..3 * PAGE_MAX as u64 {
        ix.insert(h(5, i % 32, i), 1);
    }
    check(&ix);
    for (i, &x) in hashes.iter().enumerate() {
        assert!(ix.remove(x, (i % 7) as u16), "entry {i}");
    }
    check(&ix);
    assert_eq!(ix.len(), 3 * PAGE_MAX);
}

#[test]
fn removing_entries_gives_their_memory_back() {
    let mut ix = index();
    let hashes: Vec<u64> = (0..2_000u64).map(mix).collect();
    for &x in &hashes {
        ix.insert(x, 1);
    }
    let full = ix.memory_bytes();
    for &x in &hashes[..1_900] {
        assert!(ix.remove(x, 1));
    }
    check(&ix);
    let slots: usize = ix.pages.iter().map(|p| p.slots.capacity()).sum();
    assert!(
        slots <= ix.len() + 3 * BIG_STEP * ix.pages.len(),
        "{slots} slots of capacity for {} entries in {} pages",
        ix.len(),
        ix.pages.len()
    );
    assert!(ix.memory_bytes() < full);
}

#[test]
fn a_retired_tag_is_gone_at_once_and_swept_out_in_passes() {
    let mut ix = index();
    let hashes: Vec<u64> = (0..1_200u64).map(mix).collect();
    let items: Vec<(u64, u16)> = (hashes.iter().enumerate())
        .map(|(i, &x)| (x, (i % 3) as u16))
        .collect();
    ix.insert_many(&items);
    let full = ix.memory_bytes();
    ix.retire(1, 400);
    check(&ix);
    assert!(ix.is_retired(1) && !ix.is_retired(0));
    assert_eq!((ix.dead(), ix.retired_tags(), ix.live_len()), (400, 1, 800));
    for (i, &x) in hashes.iter().enumerate() {
        let t = tags(&ix, x);
        assert!(!t.contains(&1), "entry {i}: {t:?}");
        if i % 3 != 1 {
            assert!(t.contains(&((i % 3) as u16)), "entry {i}");
        }
    }
    // A little at a time: a page per call at least, the tag held until nothing is left.
    let mut calls = 0;
    while ix.dead() > 0 {
        ix.sweep(1);
        calls += 1;
        check(&ix);
        assert!(ix.dead() == 0 || ix.is_retired(1));
    }
    assert!(calls > 1, "{calls} calls");
    assert!(!ix.is_retired(1) && ix.retired_tags() == 0);
    assert_eq!(ix.len(), 800);
    assert!(ix.memory_bytes() < full, "memory given back");
    // Freed, the tag goes in again.
    ix.insert_many(&[(hashes[1], 1)]);
    assert!(tags(&ix, hashes[1]).contains(&1));
}

#[test]
fn a_tag_retired_during_a_pass_waits_for_the_next_one() {
    let mut ix = index();
    let items: Vec<(u64, u16)> = (0..600u64).map(|i| (mix(i), (i % 4) as u16)).collect();
    ix.insert_many(&items);
    ix.retire(0, 150);
    ix.sweep(1); // the pass begins: tag 0 is in it from its first page
    ix.retire(1, 150);
    check(&ix);
    // Sweep to the end of the first pass: tag 0 is gone, tag 1 is not yet free.
    while ix.sweep_at != 0 {
        ix.sweep(1);
        check(&ix);
    }
    assert!(!ix.is_retired(0) && ix.is_retired(1));
    assert_eq!(ix.retired_tags(), 1);
    assert!(
        ix.dead() > 0,
        "tag 1's entries in the pages passed before it was retired"
    );
    ix.sweep_all();
    check(&ix);
    assert_eq!((ix.dead(), ix.retired_tags(), ix.len()), (0, 0, 300));
}

/// A well-mixed hash of `i` (splitmix64's finaliser).
fn mix(i: u64) -> u64 {
    let mut z = i.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[derive(Debug, Clone)]
enum Op {
    Insert(u64, u16),
    Remove(u64, u16),
    Query(u64),
    /// Insert a batch, after asking `bytes_to_hold` what it would take.
    Many(Vec<u64>, u16),
    /// Remove a batch.
    RemoveMany(Vec<(u64, u16)>),
    /// Retire a tag (the model drops its entries at once).
    Retire(u16),
    /// Sweep about this many entries.
    Sweep(usize),
}

/// Hashes from a small set of buckets and rests (so that equal ones are common), with
/// noise in the ignored bits.
fn hash() -> impl Strategy<Value = u64> {
    (0..BUCKETS as u64, 0u64..6, any::<u64>()).prop_map(|(b, r, low)| h(b, r, low))
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (hash(), 0u16..4).prop_map(|(x, t)| Op::Insert(x, t)),
        3 => (hash(), 0u16..4).prop_map(|(x, t)| Op::Remove(x, t)),
        3 => hash().prop_map(Op::Query),
        1 => (proptest::collection::vec(hash(), 0..40), 0u16..4).prop_map(|(v, t)| Op::Many(v, t)),
        1 => proptest::collection::vec((hash(), 0u16..4), 0..40).prop_map(Op::RemoveMany),
        1 => (0u16..4).prop_map(Op::Retire),
        1 => (0usize..60).prop_map(Op::Sweep),
    ]
}

/// The model's key: the 32 bits the index keeps, and the tag.
fn model_key(x: u64, tag: u16) -> (u64, u16) {
    (x >> (64 - DIR_BITS - REST_BITS), tag)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Any sequence of inserts and removes leaves the index answering as a multiset of
    /// (32 bits, tag) would, with its layout intact; and `bytes_to_hold` is never less than
    /// what the inserts then take.
    #[test]
    fn behaves_like_a_multiset(ops in proptest::collection::vec(op(), 1..400)) {
        let mut ix = index();
        let mut model: BTreeMap<(u64, u16), usize> = BTreeMap::new();
        for op in ops {
            // A retired tag is inserted and removed again only once the sweep freed it.
            let retired = |ix: &PagedIndex, t: u16| ix.is_retired(t);
            match op {
                Op::Insert(_, t) | Op::Remove(_, t) | Op::Many(_, t) if retired(&ix, t) => {}
                Op::Insert(x, t) => {
                    ix.insert(x, t);
                    *model.entry(model_key(x, t)).or_default() += 1;
                }
                Op::Remove(x, t) => {
                    let k = model_key(x, t);
                    let there = model.get(&k).copied().unwrap_or(0) > 0;
                    prop_assert_eq!(ix.remove(x, t), there);
                    if there {
                        *model.get_mut(&k).unwrap() -= 1;
                    }
                }
                Op::Query(x) => {
                    let bits = model_key(x, 0).0;
                    let want: Vec<u16> = model
                        .range((bits, 0)..=(bits, u16::MAX))
                        .flat_map(|(&(_, t), &n)| std::iter::repeat_n(t, n))
                        .collect();
                    prop_assert_eq!(tags(&ix, x), want);
                }
                Op::Many(xs, t) => {
                    let bound = ix.bytes_to_hold(&xs).unwrap();
                    // One at a time or all at once: the same multiset.
                    if t % 2 == 0 {
                        for &x in &xs {
                            ix.insert(x, t);
                        }
                    } else {
                        let items: Vec<(u64, u16)> = xs.iter().map(|&x| (x, t)).collect();
                        ix.insert_many(&items);
                    }
                    for &x in &xs {
                        *model.entry(model_key(x, t)).or_default() += 1;
                    }
                    prop_assert!(ix.memory_bytes() <= bound, "{} > {bound}", ix.memory_bytes());
                }
                Op::RemoveMany(mut items) => {
                    items.retain(|&(_, t)| !retired(&ix, t));
                    let mut want = 0;
                    for &(x, t) in &items {
                        if let Some(n) = model.get_mut(&model_key(x, t)).filter(|n| **n > 0) {
                            *n -= 1;
                            want += 1;
                        }
                    }
                    prop_assert_eq!(ix.remove_many(&items), want);
                }
                Op::Retire(t) => {
                    if !retired(&ix, t) {
                        let n: usize = model.iter().filter(|(k, _)| k.1 == t).map(|(_, n)| n).sum();
                        model.retain(|k, _| k.1 != t);
                        ix.retire(t, n);
                    }
                }
                Op::Sweep(budget) => ix.sweep(budget),
            }
            check(&ix);
        }
        prop_assert_eq!(ix.live_len(), model.values().sum::<usize>());
        ix.sweep_all();
        check(&ix);
        prop_assert_eq!((ix.len(), ix.retired_tags()), (model.values().sum::<usize>(), 0));
    }

    /// The interpolating search finds what a binary search finds, in any sorted bucket.
    #[test]
    fn lower_bound_is_a_binary_search(
        mut s in proptest::collection::vec(any::<u32>(), 0..300),
        key in any::<u32>(),
        skew in 0u32..3,
    ) {
        // Skewed buckets (all rests small) make the guess far off: the walk gives way.
        for e in &mut s {
            *e >>= skew * 8;
        }
        s.sort_unstable();
        let key = key >> (skew * 8);
        prop_assert_eq!(lower_bound(&s, key), s.partition_point(|&e| e < key));
        for &e in &s {
            prop_assert_eq!(lower_bound(&s, e), s.partition_point(|&x| x < e));
        }
    }
}

#[test]
fn entries_merged_a_page_at_a_time_are_each_found_once_their_page_is_merged() {
    let mut ix = index();
    let old: Vec<(u64, u16)> = (0..400u64).map(|i| (mix(i), 1)).collect();
    ix.insert_many(&old);
    let new: Vec<(u64, u16)> = (400..1_000u64).map(|i| (mix(i), 2)).collect();
    let mut whole = index();
    whole.insert_many(&old);
    whole.insert_many(&new);
    let mut s = Sorted::new(ix.dir_bits(), &new);
    let mut calls = 0;
    loop {
        let more = ix.merge_some(&mut s, 1);
        calls += 1;
        check(&ix);
        // The old entries throughout; a new one exactly when its bucket's page is done,
        // i.e. when it lies among the sorted entries merged so far.
        for &(x, _) in &old {
            assert!(tags(&ix, x).contains(&1));
        }
        let merged: std::collections::BTreeSet<(usize, u32)> =
            s.entries[..s.at].iter().copied().collect();
        for &(x, t) in &new {
            let e = entry(DIR_BITS, x, t);
            assert_eq!(tags(&ix, x).contains(&2), merged.contains(&e), "{x:#x}");
        }
        if !more {
            break;
        }
    }
    assert!(calls > 2, "{calls} calls");
    assert_eq!(ix.len(), whole.len());
    assert_eq!(
        ix.pages.iter().map(|p| &p.slots).collect::<Vec<_>>(),
        whole.pages.iter().map(|p| &p.slots).collect::<Vec<_>>(),
        "the same index as one batched insert"
    );
}
