//! The ledger entries one checkpoint's batch records: which pipeline accepted which event
//! ID, at what record time.
//!
//! Pipelines that read one stream see the same event IDs, so each ID is held once, with the
//! pipelines that accepted it. Held as `(pipeline, ID)` pairs in a sorted map, 16 pipelines
//! over one stream kept 16 copies of every ID and of the pipeline's name (about 110 bytes an
//! entry: 35 MB for a checkpoint of 20,000 records), and a lookup compared the pipeline's
//! name before the ID at every level of the map (with the batch's state map, keyed the same
//! way, `memcmp` took a third of the processor's time at 16 pipelines; issue 33). Here an
//! entry is an ID and a short list.
//!
//! Lookups hash the ID with std's randomly keyed hasher, so that IDs a sender picks cannot
//! be made to collide. What the batch holds is deterministic; only the order the map keeps
//! it in is not, and nothing reads that order: [`BatchLedger::iter`]'s users sort or key by
//! what they read (the store's chunks sort their entries).

use std::collections::HashMap;

/// One ID's acceptances: by pipeline (an index into [`BatchLedger`]'s names), the record
/// time. Nearly always one pipeline, or all of one stream's, at one time.
#[derive(Debug, Clone)]
enum Seen {
    One(u32, u64),
    Many(Vec<(u32, u64)>),
}

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
            let (one, many) = match s {
                Seen::One(p, t) => (Some((*p, *t)), &[][..]),
                Seen::Many(v) => (None, v.as_slice()),
            };
            one.into_iter()
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

impl Seen {
    /// Set pipeline `p`'s time; `true` if `p` had none.
    fn set(&mut self, p: u32, t: u64) -> bool {
        match self {
            Seen::One(q, old) if *q == p => {
                *old = t;
                false
            }
            Seen::One(q, old) => {
                *self = Seen::Many(vec![(*q, *old), (p, t)]);
                true
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
}
