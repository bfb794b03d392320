//! The ledger entries one checkpoint's batch records: which pipeline accepted which event
//! ID, at what record time.
//!
//! Pipelines that read one stream see the same event IDs, so each ID is held once, with the
//! pipelines that accepted it. Held as `(pipeline, ID)` pairs in a sorted map, 16 pipelines
//! over one stream kept 16 copies of every ID and of the pipeline's name (about 110 bytes an
//! entry: 35 MB for a checkpoint of 20,000 records), and a lookup compared the pipeline's
//! name before the ID at every level of the map (with the batch's state map, keyed the same
//! way, `memcmp` took a third of the processor's time at 16 pipelines; issue 33). Here an
//! entry is an ID and the pipelines that accepted it: a bit set with one time when they
//! accepted it together (the usual case), a short list otherwise.
//!
//! Lookups hash the ID with std's randomly keyed hasher, so that IDs a sender picks cannot
//! be made to collide. What the batch holds is deterministic; only the order the map keeps
//! it in is not, and nothing reads that order: [`BatchLedger::iter`]'s users sort or key by
//! what they read (the store's chunks sort their entries).

use std::collections::HashMap;

/// One ID's acceptances: by pipeline (an index into [`BatchLedger`]'s names), the record
/// time. Nearly always one pipeline, or all of one stream's, at one time: `Set` holds the
/// latter without a list. As a list, 16 pipelines took 256 bytes an ID and four
/// reallocations to build it: 5.3 MB of a drain's peak heap (16 pipelines, ~7,000 records
/// a checkpoint, heaptrack; issue 33).
#[derive(Debug, Clone)]
enum Seen {
    One(u32, u64),
    /// The pipelines whose index is a set bit (all below [`SET_BITS`]), at one time.
    Set(u128, u64),
    Many(Vec<(u32, u64)>),
}

/// Pipelines below this index can share a [`Seen::Set`].
const SET_BITS: u32 = u128::BITS;

/// A batch's ledger entries: (pipeline, event ID) → the record time (ms) it was accepted at.
#[derive(Clone, Default)]
pub struct BatchLedger {
    /// Pipeline names, in the order first recorded.
    names: Vec<String>,
    ids: HashMap<Box<str>, Seen>,
    len: usize,
}

impl BatchLedger {
    /// An empty ledger that knows `names` already, so that pipeline `names[i]` can be named
    /// by its index `i` (see [`BatchLedger::insert`]).
    pub fn with_names<'a>(names: impl IntoIterator<Item = &'a str>) -> BatchLedger {
        BatchLedger {
            names: names.into_iter().map(str::to_string).collect(),
            ..BatchLedger::default()
        }
    }

    /// The index of `pipeline` among the names: `hint` if that is it (the engine's own index
    /// of the pipeline, which [`BatchLedger::with_names`] made the same), else a search.
    fn index(&self, hint: usize, pipeline: &str) -> Option<usize> {
        match self.names.get(hint) {
            Some(n) if n == pipeline => Some(hint),
            _ => self.names.iter().position(|n| n == pipeline),
        }
    }

    /// Record that `pipeline` accepted `id` at `seen` (a later record of the same pair in one
    /// batch replaces the time, as an ID accepted again after its entry expired does).
    /// `hint`: where `pipeline` likely is among the names (any value is correct).
    pub fn insert(&mut self, hint: usize, pipeline: &str, id: &str, seen: u64) {
        let p = match self.index(hint, pipeline) {
            Some(p) => p,
            None => {
                self.names.push(pipeline.to_string());
                self.names.len() - 1
            }
        };
        let p = u32::try_from(p).expect("fewer than 2^32 pipelines");
        let added = match self.ids.get_mut(id) {
            None => {
                self.ids.insert(id.into(), Seen::One(p, seen));
                true
            }
            Some(s) => s.set(p, seen),
        };
        self.len += usize::from(added);
    }

    /// When `pipeline` accepted `id` in this batch, if it did (`hint` as for
    /// [`BatchLedger::insert`]).
    pub fn get(&self, hint: usize, pipeline: &str, id: &str) -> Option<u64> {
        let p = self.index(hint, pipeline)?;
        self.ids.get(id)?.get(p as u32)
    }

    /// Every entry as (pipeline, ID, record time), in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str, u64)> + '_ {
        self.ids.iter().flat_map(move |(id, s)| {
            let (one, set, many) = match s {
                Seen::One(p, t) => (Some((*p, *t)), (0, 0), &[][..]),
                Seen::Set(mask, t) => (None, (*mask, *t), &[][..]),
                Seen::Many(v) => (None, (0, 0), v.as_slice()),
            };
            one.into_iter()
                .chain(bits(set.0).map(move |p| (p, set.1)))
                .chain(many.iter().copied())
                .map(move |(p, t)| (self.names[p as usize].as_str(), &**id, t))
        })
    }

    /// Entries: one per pipeline and ID.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Every entry as (owner, ID, record time), for the store's ledger chunks: an ID that
    /// every member of a group accepted, all at one record time, is one entry owned by the
    /// group (`groups`: its name and its members' pipeline names, at least two); every other
    /// acceptance is an entry owned by its pipeline. What a pipeline accepted is the same
    /// either way: its own entries and those of the groups it is a member of.
    pub fn grouped<'a>(
        &'a self,
        groups: &'a [(String, Vec<String>)],
        mut each: impl FnMut(&'a str, &'a str, u64),
    ) {
        // Members by their index among the names; a group with a member this batch never
        // named takes nothing.
        let groups: Vec<(&str, Vec<u32>)> = groups
            .iter()
            .filter(|(_, m)| m.len() >= 2)
            .filter_map(|(g, m)| {
                let idx = m.iter().map(|n| {
                    let i = self.names.iter().position(|x| x == n)?;
                    u32::try_from(i).ok()
                });
                Some((g.as_str(), idx.collect::<Option<Vec<u32>>>()?))
            })
            .collect();
        for (id, s) in &self.ids {
            let v = match s {
                Seen::One(p, t) => {
                    each(&self.names[*p as usize], id, *t);
                    continue;
                }
                Seen::Set(mask, t) => {
                    // One time for all: a group takes its members if each is in the set and
                    // not taken by a group before it.
                    let mut left = *mask;
                    for (g, members) in &groups {
                        let m = members
                            .iter()
                            .try_fold(0u128, |m, &p| (p < SET_BITS).then(|| m | 1 << p));
                        if let Some(m) = m.filter(|&m| m & left == m) {
                            left &= !m;
                            each(g, id, *t);
                        }
                    }
                    for p in bits(left) {
                        each(&self.names[p as usize], id, *t);
                    }
                    continue;
                }
                Seen::Many(v) => v,
            };
            // Entries taken by a group; only the first 128 can be (more pipelines than that
            // accepting one ID are written one by one, as without groups).
            let mut taken = 0u128;
            for (g, members) in &groups {
                let mut at = None;
                let mut mask = 0u128;
                let all = members.iter().all(|m| {
                    let Some(i) = v.iter().position(|(q, _)| q == m).filter(|&i| i < 128) else {
                        return false;
                    };
                    let t = v[i].1;
                    let fits = taken & (1 << i) == 0 && *at.get_or_insert(t) == t;
                    mask |= 1 << i;
                    fits
                });
                if let (true, Some(t)) = (all, at) {
                    taken |= mask;
                    each(g, id, t);
                }
            }
            for (i, &(p, t)) in v.iter().enumerate() {
                if i >= 128 || taken & (1 << i) == 0 {
                    each(&self.names[p as usize], id, t);
                }
            }
        }
    }
}

/// The indexes of `mask`'s set bits, lowest first.
fn bits(mut mask: u128) -> impl Iterator<Item = u32> {
    std::iter::from_fn(move || {
        let p = mask.trailing_zeros();
        (p < SET_BITS).then(|| {
            mask &= mask - 1;
            p
        })
    })
}

impl Seen {
    /// Set pipeline `p`'s time; `true` if `p` had none.
    fn set(&mut self, p: u32, t: u64) -> bool {
        match self {
            Seen::One(q, old) if *q == p => {
                *old = t;
                false
            }
            Seen::One(q, old) if *old == t && *q < SET_BITS && p < SET_BITS => {
                *self = Seen::Set(1 << *q | 1 << p, t);
                true
            }
            Seen::One(q, old) => {
                *self = Seen::Many(vec![(*q, *old), (p, t)]);
                true
            }
            Seen::Set(mask, old) if *old == t && p < SET_BITS => {
                let had = *mask & 1 << p != 0;
                *mask |= 1 << p;
                !had
            }
            Seen::Set(mask, old) => {
                let mut v: Vec<(u32, u64)> = bits(*mask).map(|q| (q, *old)).collect();
                let added = match v.iter_mut().find(|(q, _)| *q == p) {
                    Some((_, old)) => {
                        *old = t;
                        false
                    }
                    None => {
                        v.push((p, t));
                        true
                    }
                };
                *self = Seen::Many(v);
                added
            }
            Seen::Many(v) => match v.iter_mut().find(|(q, _)| *q == p) {
                Some((_, old)) => {
                    *old = t;
                    false
                }
                None => {
                    v.push((p, t));
                    true
                }
            },
        }
    }

    fn get(&self, p: u32) -> Option<u64> {
        match self {
            Seen::One(q, t) => (*q == p).then_some(*t),
            Seen::Set(mask, t) => (p < SET_BITS && mask & 1 << p != 0).then_some(*t),
            Seen::Many(v) => v.iter().find(|(q, _)| *q == p).map(|&(_, t)| t),
        }
    }
}

impl BatchLedger {
    /// Every entry, sorted: what equality and `Debug` compare and show.
    fn sorted(&self) -> Vec<(&str, &str, u64)> {
        let mut v: Vec<_> = self.iter().collect();
        v.sort_unstable();
        v
    }
}

/// Equal when they hold the same entries, whatever order they were recorded in.
impl PartialEq for BatchLedger {
    fn eq(&self, other: &Self) -> bool {
        self.len == other.len && self.sorted() == other.sorted()
    }
}

/// The entries as a map from (pipeline, ID) to record time, in that order: the same for
/// the same entries, as replay's checks compare (the hash map's own order differs between
/// two maps).
impl std::fmt::Debug for BatchLedger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map()
            .entries(self.sorted().into_iter().map(|(p, id, t)| ((p, id), t)))
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sorted(l: &BatchLedger) -> Vec<(String, String, u64)> {
        let mut v: Vec<_> = l
            .iter()
            .map(|(p, id, t)| (p.to_string(), id.to_string(), t))
            .collect();
        v.sort();
        v
    }

    #[test]
    fn each_pipeline_sees_only_its_own_entries() {
        let mut l = BatchLedger::with_names(["a", "b", "c"]);
        l.insert(0, "a", "E1", 10);
        l.insert(2, "c", "E1", 11);
        l.insert(1, "b", "E2", 12);
        assert_eq!(l.get(0, "a", "E1"), Some(10));
        assert_eq!(l.get(1, "b", "E1"), None);
        assert_eq!(l.get(2, "c", "E1"), Some(11));
        assert_eq!(l.get(1, "b", "E2"), Some(12));
        assert_eq!(l.get(0, "a", "E2"), None);
        assert_eq!(l.get(0, "z", "E1"), None, "a pipeline it never saw");
        assert_eq!(l.len(), 3);
        assert_eq!(
            sorted(&l),
            [
                ("a".into(), "E1".into(), 10),
                ("b".into(), "E2".into(), 12),
                ("c".into(), "E1".into(), 11),
            ]
        );
    }

    #[test]
    fn a_second_acceptance_replaces_the_time_and_counts_once() {
        let mut l = BatchLedger::default();
        for (p, t) in [("a", 1), ("b", 2), ("a", 3), ("c", 4), ("b", 5), ("b", 6)] {
            l.insert(0, p, "E", t);
        }
        assert_eq!(l.len(), 3);
        assert_eq!(
            (l.get(0, "a", "E"), l.get(0, "b", "E"), l.get(0, "c", "E")),
            (Some(3), Some(6), Some(4))
        );
        assert_eq!(l.iter().count(), 3);
    }

    fn grouped(l: &BatchLedger, groups: &[(String, Vec<String>)]) -> Vec<(String, String, u64)> {
        let mut v = Vec::new();
        l.grouped(groups, |o, id, t| {
            v.push((o.to_string(), id.to_string(), t))
        });
        v.sort();
        v
    }

    #[test]
    fn an_id_every_member_accepted_at_one_time_is_the_groups_and_the_rest_stay_their_own() {
        let names = ["a", "b", "c", "d"];
        let mut l = BatchLedger::with_names(names);
        let group =
            |g: &str, m: &[&str]| (g.to_string(), m.iter().map(|s| s.to_string()).collect());
        for (i, p) in names.iter().enumerate() {
            l.insert(i, p, "all", 5);
        }
        l.insert(0, "a", "some", 6);
        l.insert(1, "b", "some", 6);
        l.insert(0, "a", "times", 7);
        l.insert(1, "b", "times", 8);
        l.insert(2, "c", "times", 8);
        l.insert(3, "d", "one", 9);
        let e = |o: &str, id: &str, t| (o.to_string(), id.to_string(), t);
        assert_eq!(
            grouped(&l, &[group("+1", &["a", "b", "c"])]),
            [
                e("+1", "all", 5),
                e("a", "some", 6),
                e("a", "times", 7),
                e("b", "some", 6),
                e("b", "times", 8),
                e("c", "times", 8),
                e("d", "all", 5),
                e("d", "one", 9),
            ]
        );
        // Two groups take what they can, each acceptance once; a group of one, or with a
        // member the batch never named, takes nothing.
        assert_eq!(
            grouped(
                &l,
                &[
                    group("+1", &["a", "b"]),
                    group("+2", &["b", "c"]),
                    group("+3", &["c", "d"]),
                    group("+4", &["d"]),
                    group("+5", &["a", "zz"]),
                ]
            ),
            [
                e("+1", "all", 5),
                e("+1", "some", 6),
                e("+2", "times", 8),
                e("+3", "all", 5),
                e("a", "times", 7),
                e("d", "one", 9),
            ]
        );
        assert_eq!(grouped(&l, &[]), sorted(&l));
    }

    #[test]
    fn a_wrong_hint_finds_the_pipeline_all_the_same() {
        let mut l = BatchLedger::with_names(["a", "b"]);
        l.insert(1, "a", "E1", 7);
        l.insert(9, "new", "E1", 8);
        assert_eq!(l.get(0, "a", "E1"), Some(7));
        assert_eq!(l.get(0, "new", "E1"), Some(8));
        assert_eq!(l.get(5, "b", "E1"), None);
    }

    #[test]
    fn debug_shows_the_entries_sorted_whatever_the_order_recorded() {
        let mut x = BatchLedger::default();
        let mut y = BatchLedger::default();
        for i in 0..50 {
            x.insert(0, "a", &format!("E{i}"), i);
            y.insert(0, "a", &format!("E{}", 49 - i), 49 - i);
        }
        assert_eq!(format!("{x:?}"), format!("{y:?}"));
        assert!(format!("{x:?}").starts_with(r#"{("a", "E0"): 0, ("a", "E1"): 1, ("a", "E10")"#));
    }

    #[test]
    fn equal_means_the_same_entries_in_any_order() {
        let mut x = BatchLedger::with_names(["a", "b"]);
        let mut y = BatchLedger::default();
        x.insert(0, "a", "E1", 1);
        x.insert(1, "b", "E2", 2);
        y.insert(0, "b", "E2", 2);
        y.insert(0, "a", "E1", 1);
        assert_eq!(x, y);
        y.insert(0, "a", "E1", 3);
        assert_ne!(x, y);
        y.insert(0, "a", "E1", 1);
        y.insert(0, "c", "E1", 1);
        assert_ne!(x, y);
    }

    #[test]
    fn many_pipelines_and_ids_round_trip() {
        let mut l = BatchLedger::default();
        let mut want = Vec::new();
        for i in 0..2_000u64 {
            for p in 0..(i % 7) {
                let (name, id) = (format!("p{p}"), format!("E{}", i / 3));
                l.insert(p as usize, &name, &id, i);
                want.retain(|(n, d, _): &(String, String, u64)| (n, d) != (&name, &id));
                want.push((name, id, i));
            }
        }
        want.sort();
        assert_eq!(sorted(&l), want);
        assert_eq!(l.len(), want.len());
        for (p, id, t) in &want {
            assert_eq!(l.get(0, p, id), Some(*t));
        }
    }

    /// The ledger against a map of (pipeline, ID) → time, through any inserts: entries,
    /// lookups, count and grouping agree, whether an ID's acceptances are one, a set at
    /// one time or a list (times that differ, a pipeline past the set's 128 bits).
    mod model {
        use super::*;
        use proptest::prelude::*;
        use std::collections::BTreeMap;

        /// Pipelines the cases pick from: a few low indexes and some at the set's edge.
        const PICK: [usize; 7] = [0, 1, 2, 3, 127, 128, 139];

        fn name(i: usize) -> String {
            format!("p{i}")
        }

        /// The rule `grouped` keeps, on the model: per ID, each group in turn takes its
        /// members if every one accepted the ID, all at one time, and none is taken yet.
        fn model_grouped(
            m: &BTreeMap<(String, String), u64>,
            groups: &[(String, Vec<String>)],
        ) -> Vec<(String, String, u64)> {
            let mut out = Vec::new();
            let ids: std::collections::BTreeSet<&String> = m.keys().map(|(_, id)| id).collect();
            for id in ids {
                let mut left: BTreeMap<&String, u64> = m
                    .iter()
                    .filter(|((_, i), _)| i == id)
                    .map(|((p, _), t)| (p, *t))
                    .collect();
                for (g, members) in groups.iter().filter(|(_, ms)| ms.len() >= 2) {
                    let times: Option<Vec<u64>> =
                        members.iter().map(|p| left.get(p).copied()).collect();
                    if let Some(t) = times.filter(|ts| ts.iter().all(|t| *t == ts[0])) {
                        members.iter().for_each(|p| {
                            left.remove(p);
                        });
                        out.push((g.clone(), id.clone(), t[0]));
                    }
                }
                out.extend(left.into_iter().map(|(p, t)| (p.clone(), id.clone(), t)));
            }
            out.sort();
            out
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(300))]
            #[test]
            fn the_ledger_holds_what_a_map_would(
                ops in proptest::collection::vec((0..PICK.len(), 0..4u8, 1..4u64), 0..60),
                groups in proptest::collection::vec(
                    proptest::collection::btree_set(0..PICK.len(), 1..4), 0..3),
            ) {
                let names: Vec<String> = (0..140).map(name).collect();
                let mut l = BatchLedger::with_names(names.iter().map(String::as_str));
                let mut m = BTreeMap::new();
                for &(p, id, t) in &ops {
                    let (p, id) = (PICK[p], format!("E{id}"));
                    l.insert(p, &name(p), &id, t);
                    m.insert((name(p), id), t);
                }
                prop_assert_eq!(l.len(), m.len());
                let want: Vec<_> = m.iter().map(|((p, id), t)| (p.clone(), id.clone(), *t)).collect();
                prop_assert_eq!(sorted(&l), want.clone());
                for p in PICK {
                    for id in 0..4 {
                        let id = format!("E{id}");
                        prop_assert_eq!(l.get(p, &name(p), &id), m.get(&(name(p), id.clone())).copied());
                    }
                }
                let groups: Vec<(String, Vec<String>)> = groups
                    .iter()
                    .enumerate()
                    .map(|(i, ms)| (format!("+{i}"), ms.iter().map(|&p| name(PICK[p])).collect()))
                    .collect();
                prop_assert_eq!(grouped(&l, &groups), model_grouped(&m, &groups));
                prop_assert_eq!(grouped(&l, &[]), want);
            }
        }
    }
}
