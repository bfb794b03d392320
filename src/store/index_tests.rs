//! The fingerprint index's tests, beside it rather than inside it: the index reads on its
//! own in under 350 lines.

use super::*;
use proptest::prelude::*;

/// A hash whose fingerprint is `fp | 1`; the low 32 bits vary with `tag` (and are ignored).
fn h(fp: u32, tag: u32) -> u64 {
    (u64::from(fp) << 32) | u64::from(tag)
}

/// The sorted candidates of `hash`.
fn sorted(ix: &FingerprintIndex, hash: u64) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    ix.candidates(hash, &mut out);
    out.sort_unstable();
    out
}

/// Checks the table's invariants: `len` counts the used slots, there is an empty slot, and
/// every entry is reachable: all the slots from its home bucket to it (cyclically) are used.
fn check_invariants(ix: &FingerprintIndex) {
    let n = ix.slots.len();
    assert!(n % 8 == 0 && (MIN_SLOTS..=MAX_SLOTS).contains(&n));
    let used = ix.slots.iter().filter(|&&s| s != EMPTY).count();
    assert_eq!(used, ix.len, "len counts the used slots");
    assert!(used <= max_len(n), "load at most 7/8");
    for (p, &slot) in ix.slots.iter().enumerate() {
        if slot == EMPTY {
            continue;
        }
        assert_eq!(slot_fp(slot) & 1, 1, "fp has its lowest bit set");
        let mut i = home(slot_fp(slot), n);
        while i != p {
            assert_ne!(ix.slots[i], EMPTY, "slot {p} unreachable: {i} is empty");
            i = (i + 1) % n;
        }
    }
}

/// A well-mixed hash of `i` (splitmix64's finaliser).
fn mix(i: u64) -> u64 {
    let mut z = i.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[test]
fn new_index_is_empty_with_16_slots() {
    let ix = FingerprintIndex::new();
    assert_eq!(ix.len(), 0);
    assert!(ix.is_empty());
    assert_eq!(ix.memory_bytes(), 16 * 6);
    assert_eq!(sorted(&ix, 0), vec![]);
    assert_eq!(sorted(&ix, u64::MAX), vec![]);
    assert_eq!(FingerprintIndex::default().memory_bytes(), 16 * 6);
    check_invariants(&ix);
}

#[test]
fn insert_gives_the_coarse_time_range() {
    let mut ix = FingerprintIndex::new();
    let a = h(0x1234_5678, 7);
    ix.insert(a, 5000);
    assert_eq!(ix.len(), 1);
    assert!(!ix.is_empty());
    assert_eq!(sorted(&ix, a), vec![(4096, 5119)]);
    assert_eq!(
        sorted(&ix, h(0x1234_567A, 7)),
        vec![],
        "another fingerprint"
    );
    ix.insert(h(0x0000_0000, 0), 0);
    assert_eq!(sorted(&ix, 0), vec![(0, 1023)]);
    check_invariants(&ix);
}

#[test]
fn candidates_clears_the_output_first() {
    let mut ix = FingerprintIndex::new();
    ix.insert(h(0xABCD_0001, 0), 2048);
    let mut out = vec![(1, 2), (3, 4)];
    ix.candidates(h(0xABCD_0001, 0), &mut out);
    assert_eq!(out, vec![(2048, 3071)]);
    ix.candidates(h(0x5555_5555, 0), &mut out);
    assert_eq!(out, vec![]);
}

#[test]
fn fingerprint_ignores_the_low_half_and_the_lowest_fp_bit() {
    let mut ix = FingerprintIndex::new();
    ix.insert(h(0xDEAD_BEEE, 1), 1024);
    ix.insert(h(0xDEAD_BEEF, 2), 3000);
    let both = vec![(1024, 2047), (2048, 3071)];
    assert_eq!(sorted(&ix, h(0xDEAD_BEEE, 99)), both);
    assert_eq!(sorted(&ix, h(0xDEAD_BEEF, 0)), both);
    assert_eq!(sorted(&ix, h(0xDEAD_BEEC, 0)), vec![]);
    // Removal matches the same fingerprint too.
    assert!(ix.remove(h(0xDEAD_BEEF, 5), 1024));
    assert_eq!(sorted(&ix, h(0xDEAD_BEEE, 0)), vec![(2048, 3071)]);
}

#[test]
fn remove_takes_out_one_matching_entry() {
    let mut ix = FingerprintIndex::new();
    let a = h(0x4000_0000, 0);
    let b = h(0x4000_0002, 0);
    ix.insert(a, 10_000);
    ix.insert(b, 10_000);
    assert!(!ix.remove(a, 20_000), "other coarse time");
    assert!(!ix.remove(h(0x4000_0004, 0), 10_000), "other fingerprint");
    assert_eq!(ix.len(), 2);
    // Same coarse unit (9216..=10239), other millisecond: the same entry.
    assert!(ix.remove(a, 9216));
    assert_eq!(ix.len(), 1);
    assert_eq!(sorted(&ix, a), vec![]);
    assert_eq!(sorted(&ix, b), vec![(9216, 10239)]);
    assert!(!ix.remove(a, 10_000));
    assert!(ix.remove(b, 10_239));
    assert!(ix.is_empty());
    check_invariants(&ix);
}

#[test]
fn duplicates_are_separate_entries() {
    let mut ix = FingerprintIndex::new();
    let a = h(0x9999_9999, 0);
    ix.insert(a, 77_777);
    ix.insert(a, 77_777);
    ix.insert(a, 1);
    assert_eq!(ix.len(), 3);
    assert_eq!(
        sorted(&ix, a),
        vec![(0, 1023), (76_800, 77_823), (76_800, 77_823)]
    );
    assert!(ix.remove(a, 77_777));
    assert_eq!(sorted(&ix, a), vec![(0, 1023), (76_800, 77_823)]);
    assert!(ix.remove(a, 77_777));
    assert_eq!(sorted(&ix, a), vec![(0, 1023)]);
    assert!(!ix.remove(a, 77_777));
    assert_eq!(ix.len(), 1);
    check_invariants(&ix);
}

#[test]
fn saturated_coarse_reaches_u64_max() {
    let mut ix = FingerprintIndex::new();
    let a = h(0x7777_7777, 0);
    let top = u64::from(u16::MAX) << COARSE_SHIFT;
    ix.insert(a, u64::MAX);
    assert_eq!(sorted(&ix, a), vec![(top, u64::MAX)]);
    // Exactly the first saturated unit and anything later share the entry.
    assert!(ix.remove(a, top));
    ix.insert(a, top);
    ix.insert(a, top - 1);
    assert_eq!(sorted(&ix, a), vec![(top - 1024, top - 1), (top, u64::MAX)]);
    assert!(ix.remove(a, 1 << 60));
    assert!(!ix.remove(a, u64::MAX));
    assert!(ix.remove(a, top - 1024));
    assert!(ix.is_empty());
}

#[test]
fn grows_at_seven_eighths() {
    let mut ix = FingerprintIndex::new();
    for i in 0..14 {
        ix.insert(mix(i), i);
    }
    assert_eq!(ix.memory_bytes(), 16 * 6, "14 of 16 fit");
    ix.insert(mix(14), 14);
    assert_eq!(ix.memory_bytes(), 32 * 6, "the 15th doubles");
    check_invariants(&ix);
}

#[test]
fn with_capacity_is_the_smallest_table_that_fits() {
    for (entries, slots) in [
        (0, 16),
        (14, 16),
        (15, 32),
        (28, 32),
        (29, 64),
        (3_584, 4_096),
        (3_585, 5_120),
        (1_000_000, 1_354_016),
    ] {
        let mut ix = FingerprintIndex::with_capacity(entries);
        assert_eq!(ix.memory_bytes(), slots * 6, "{entries} entries");
        if entries <= 1000 {
            for i in 0..entries as u64 {
                ix.insert(mix(i), i);
            }
            assert_eq!(ix.memory_bytes(), slots * 6, "{entries} entries: no growth");
            check_invariants(&ix);
        }
    }
    assert_eq!(
        FingerprintIndex::with_capacity(1_000_000).memory_bytes(),
        1_354_016 * 6,
        "7.7 MiB for a million entries (16 MiB when every step doubled, with 8-byte slots)"
    );
}

#[test]
fn large_tables_grow_by_a_quarter_and_keep_every_entry_findable() {
    // 3,584 entries fill 4,096 slots to 7/8; the next ones grow it by quarters.
    let mut ix = FingerprintIndex::new();
    let n = 10_000u64;
    for i in 0..n {
        ix.insert_tag(mix(i), i as u16);
        if i == 3_583 {
            assert_eq!(ix.memory_bytes(), 4_096 * 6);
        }
        if i == 3_584 {
            assert_eq!(ix.memory_bytes(), 5_120 * 6, "a quarter more, not double");
        }
    }
    assert_eq!(ix.memory_bytes(), 12_496 * 6);
    assert_eq!(ix.bytes_to_hold(0), Some(12_496 * 6));
    assert_eq!(ix.bytes_to_hold(1_000), Some(15_616 * 6));
    check_invariants(&ix);
    let mut tags = Vec::new();
    for i in 0..n {
        ix.tags(mix(i), &mut tags);
        assert!(tags.contains(&(i as u16)), "entry {i} lost");
    }
    // Removal by backward shift on a table whose size is no power of two, wrapping included.
    for i in (0..n).filter(|i| i % 3 != 0) {
        assert!(ix.remove_tag(mix(i), i as u16), "entry {i}");
    }
    check_invariants(&ix);
    for i in 0..n {
        ix.tags(mix(i), &mut tags);
        assert_eq!(tags.contains(&(i as u16)), i % 3 == 0, "entry {i}");
    }
}

#[test]
fn growth_keeps_every_entry_findable() {
    let mut ix = FingerprintIndex::new();
    let n = 20_000u64;
    for i in 0..n {
        ix.insert(mix(i), i * 1000);
    }
    assert_eq!(ix.len(), n as usize);
    assert_eq!(ix.memory_bytes(), 24_400 * 6);
    check_invariants(&ix);
    let mut out = Vec::new();
    for i in 0..n {
        ix.candidates(mix(i), &mut out);
        let seen = i * 1000;
        assert!(
            out.iter().any(|&(lo, hi)| lo <= seen && seen <= hi),
            "entry {i} lost"
        );
    }
    for i in (0..n).rev() {
        assert!(ix.remove(mix(i), i * 1000), "entry {i}");
    }
    assert!(ix.is_empty());
    check_invariants(&ix);
    ix.insert(1, 1);
    ix.clear();
    assert!(ix.is_empty());
    assert_eq!(ix.memory_bytes(), 16 * 6, "clear shrinks");
    assert_eq!(sorted(&ix, 1), vec![]);
}

#[test]
fn probing_wraps_around_the_end_of_the_table() {
    // 16 slots: the home bucket is the top 4 bits of fp. Five entries with home 15 fill
    // slot 15 and wrap to 0..=3; one with home 0 then lands in 4.
    let mut ix = FingerprintIndex::new();
    let last: Vec<u64> = (0..5).map(|k| h(0xF000_0000 | (k << 8), 0)).collect();
    for (k, &a) in last.iter().enumerate() {
        ix.insert(a, k as u64 * 1024);
    }
    let first = h(0x0000_0000, 0);
    ix.insert(first, 0);
    assert_eq!(ix.slots[15], pack(fingerprint(last[0]), 0));
    assert_eq!(slot_fp(ix.slots[4]), fingerprint(first));
    check_invariants(&ix);
    for (k, &a) in last.iter().enumerate() {
        let lo = k as u64 * 1024;
        assert_eq!(sorted(&ix, a), vec![(lo, lo + 1023)]);
    }
    assert_eq!(sorted(&ix, first), vec![(0, 1023)]);

    // Removing the entry in slot 15 shifts the wrapped ones back across the end, and
    // the home-0 entry back to slot 3 (its home is still before it).
    assert!(ix.remove(last[0], 0));
    check_invariants(&ix);
    assert_eq!(slot_fp(ix.slots[15]), fingerprint(last[1]));
    assert_eq!(slot_fp(ix.slots[3]), fingerprint(first));
    assert_eq!(ix.slots[4], EMPTY);
    for (k, &a) in last.iter().enumerate().skip(1) {
        let lo = k as u64 * 1024;
        assert_eq!(sorted(&ix, a), vec![(lo, lo + 1023)]);
    }
    assert_eq!(sorted(&ix, first), vec![(0, 1023)]);

    for (k, &a) in last.iter().enumerate().skip(1).rev() {
        assert!(ix.remove(a, k as u64 * 1024));
        check_invariants(&ix);
    }
    assert_eq!(sorted(&ix, first), vec![(0, 1023)]);
    assert_eq!(ix.len(), 1);
}

#[test]
fn an_entry_never_shifts_back_before_its_home() {
    // Slot 15: home 15. Slots 0 and 1: home 0. Removing slot 15 must leave both home-0
    // entries where they are: slot 15 comes before their home in probe order.
    let mut ix = FingerprintIndex::new();
    let a = h(0xF000_0000, 0);
    let b = h(0x0000_0000, 0);
    let c = h(0x0000_0100, 0);
    ix.insert(a, 0);
    ix.insert(b, 0);
    ix.insert(c, 0);
    assert_eq!(slot_fp(ix.slots[15]), fingerprint(a));
    assert_eq!(slot_fp(ix.slots[0]), fingerprint(b));
    assert_eq!(slot_fp(ix.slots[1]), fingerprint(c));
    assert!(ix.remove(a, 0));
    assert_eq!(ix.slots[15], EMPTY);
    assert_eq!(slot_fp(ix.slots[0]), fingerprint(b));
    assert_eq!(slot_fp(ix.slots[1]), fingerprint(c));
    check_invariants(&ix);
    assert_eq!(sorted(&ix, b), vec![(0, 1023)]);
    assert_eq!(sorted(&ix, c), vec![(0, 1023)]);

    // A mixed run: 14 (home 14), 15 (home 15), 0 (home 14), 1 (home 0). Removing slot 14
    // leaves the home-15 entry at 15 (14 is before its home), moves the home-14 entry back
    // across the end from 0 to 14, then the home-0 entry from 1 to 0.
    let mut ix = FingerprintIndex::new();
    let d = h(0xE000_0000, 0);
    let e = h(0xF000_0000, 0);
    let f = h(0xE000_0100, 0);
    let g = h(0x0000_0000, 0);
    for x in [d, e, f, g] {
        ix.insert(x, 5000);
    }
    assert_eq!(slot_fp(ix.slots[0]), fingerprint(f));
    assert_eq!(slot_fp(ix.slots[1]), fingerprint(g));
    assert!(ix.remove(d, 5000));
    check_invariants(&ix);
    assert_eq!(slot_fp(ix.slots[14]), fingerprint(f));
    assert_eq!(slot_fp(ix.slots[15]), fingerprint(e));
    assert_eq!(slot_fp(ix.slots[0]), fingerprint(g));
    assert_eq!(ix.slots[1], EMPTY);
    for x in [e, f, g] {
        assert_eq!(sorted(&ix, x), vec![(4096, 5119)]);
    }
    assert_eq!(sorted(&ix, d), vec![]);
}

#[test]
fn bytes_to_hold_predicts_the_table_size_after_inserts() {
    let mut ix = FingerprintIndex::new();
    assert_eq!(ix.bytes_to_hold(0), Some(16 * 6));
    assert_eq!(ix.bytes_to_hold(14), Some(16 * 6), "7/8 of 16 slots");
    assert_eq!(ix.bytes_to_hold(15), Some(32 * 6));
    for i in 0..15 {
        ix.insert_tag(mix(i), 0);
    }
    assert_eq!(ix.memory_bytes(), 32 * 6);
    assert_eq!(ix.bytes_to_hold(97), Some(128 * 6), "112 of 128 slots");
    assert_eq!(ix.bytes_to_hold(98), Some(256 * 6));
    assert_eq!(ix.bytes_to_hold(usize::MAX), None);
    assert_eq!(ix.bytes_to_hold(1 << 31), None, "more than 2^31 slots");
}

/// One step of the property test; hashes and times are indices into small tables.
#[derive(Debug, Clone)]
enum Op {
    Insert(usize, u64),
    Remove(usize, u64),
    Lookup(usize),
    Clear,
}

/// Few hashes, so that shared fingerprints, shared buckets and wrap-around are common.
/// Pairs share a fingerprint: (0, 1), (2, 3), (4, 5).
const HASHES: [u64; 10] = [
    0x0000_0000_0000_0000,
    0x0000_0001_FFFF_FFFF,
    0xFFFF_FFFF_FFFF_FFFF,
    0xFFFF_FFFE_0000_0000,
    0x8000_0000_1234_5678,
    0x8000_0001_8765_4321,
    0xF000_0000_0000_0000,
    0x0FFF_FFFF_0000_0000,
    0xF800_0000_0000_0001,
    0x1234_5678_9ABC_DEF0,
];

fn seen_ms() -> impl Strategy<Value = u64> {
    let top = u64::from(u16::MAX) << COARSE_SHIFT;
    prop_oneof![
        prop::sample::select(vec![
            0,
            1,
            1023,
            1024,
            2047,
            2048,
            1_700_000_000_000,
            top - 1,
            top,
            u64::MAX,
        ]),
        0u64..8192,
    ]
}

fn op() -> impl Strategy<Value = Op> {
    let hash = 0..HASHES.len();
    prop_oneof![
        12 => (hash.clone(), seen_ms()).prop_map(|(h, s)| Op::Insert(h, s)),
        7 => (hash.clone(), seen_ms()).prop_map(|(h, s)| Op::Remove(h, s)),
        3 => hash.prop_map(Op::Lookup),
        1 => Just(Op::Clear),
    ]
}

/// The model's ranges for `hash`, sorted: computed from the spec, not from the index.
fn model_ranges(model: &[(u32, u16)], hash: u64) -> Vec<(u64, u64)> {
    let fp = ((hash >> 32) as u32) | 1;
    let mut v: Vec<(u64, u64)> = model
        .iter()
        .filter(|&&(f, _)| f == fp)
        .map(|&(_, c)| {
            let lo = u64::from(c) * 1024;
            (lo, if c == u16::MAX { u64::MAX } else { lo + 1023 })
        })
        .collect();
    v.sort_unstable();
    v
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]

    #[test]
    fn behaves_like_a_multiset(
        initial in prop_oneof![Just(None), (0usize..64).prop_map(Some)],
        ops in prop::collection::vec(op(), 0..400),
    ) {
        let mut ix = match initial {
            None => FingerprintIndex::new(),
            // Odd: a table whose size is no power of two (as large tables grow to).
            Some(n) if n % 2 == 1 => FingerprintIndex::with_slots(8 * (n / 2 + 2)),
            Some(n) => FingerprintIndex::with_capacity(n),
        };
        let mut model: Vec<(u32, u16)> = Vec::new();
        let mut out = Vec::new();
        for op in ops {
            match op {
                Op::Insert(i, seen) => {
                    ix.insert(HASHES[i], seen);
                    let c = u16::try_from(seen >> 10).unwrap_or(u16::MAX);
                    model.push((((HASHES[i] >> 32) as u32) | 1, c));
                    ix.candidates(HASHES[i], &mut out);
                    prop_assert!(out.iter().any(|&(lo, hi)| lo <= seen && seen <= hi));
                }
                Op::Remove(i, seen) => {
                    let c = u16::try_from(seen >> 10).unwrap_or(u16::MAX);
                    let key = (((HASHES[i] >> 32) as u32) | 1, c);
                    let expected = match model.iter().position(|&e| e == key) {
                        Some(p) => {
                            model.swap_remove(p);
                            true
                        }
                        None => false,
                    };
                    prop_assert_eq!(ix.remove(HASHES[i], seen), expected);
                }
                Op::Lookup(i) => {
                    prop_assert_eq!(sorted(&ix, HASHES[i]), model_ranges(&model, HASHES[i]));
                }
                Op::Clear => {
                    ix.clear();
                    model.clear();
                }
            }
            prop_assert_eq!(ix.len(), model.len());
            prop_assert_eq!(ix.is_empty(), model.is_empty());
            check_invariants(&ix);
            for &hash in &HASHES {
                prop_assert_eq!(sorted(&ix, hash), model_ranges(&model, hash));
            }
        }
    }
}

#[test]
fn the_sharded_index_splits_when_large_finds_every_entry_and_bounds_exactly() {
    let mut ix = ShardedIndex::default();
    assert_eq!(ix.memory_bytes(), 16 * 6, "small: one table");
    let hashes: Vec<u64> = (0..200_000u64).map(mix).collect();
    // In steps, so that the bound is checked before the split, across it and after.
    for (k, part) in hashes.chunks(7_000).enumerate() {
        let need = ix.bytes_to_hold(part).unwrap();
        for (i, &h) in part.iter().enumerate() {
            ix.insert_tag(h, (k * 7_000 + i) as u16);
        }
        assert_eq!(
            ix.memory_bytes(),
            need,
            "step {k}: the bound given is what it took"
        );
    }
    assert!(ix.is_split());
    assert_eq!(ix.len(), 200_000);
    assert!(
        ix.memory_bytes() < 200_000 * 9,
        "{} bytes",
        ix.memory_bytes()
    );
    let mut tags = Vec::new();
    for (i, &h) in hashes.iter().enumerate() {
        ix.tags(h, &mut tags);
        assert!(tags.contains(&(i as u16)), "entry {i}");
    }
    for (i, &h) in hashes.iter().enumerate().filter(|(i, _)| i % 2 == 0) {
        assert!(ix.remove_tag(h, i as u16));
    }
    assert_eq!(ix.len(), 100_000);
    for (i, &h) in hashes.iter().enumerate() {
        ix.tags(h, &mut tags);
        assert_eq!(tags.contains(&(i as u16)), i % 2 == 1, "entry {i}");
    }
    for t in &ix.shards {
        check_invariants(t);
    }
}
