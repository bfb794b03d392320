//! Shared ledgers (see `LEDGER_GROUPS_KEY`): a pipeline's lookups answer what a map of its
//! own acceptances would, whichever ledger holds them, through regrouping at reopen,
//! resets, dormant groups and expiry by windows that differ between the members.

use super::tests::ledger_oracle::same_answer;
use super::*;
use crate::fsio;
use crate::model::PipelineProgress;
use crate::pipeline::engine::{Batch, Checkpoint};
use proptest::prelude::*;
use std::collections::{BTreeMap, HashMap};

const PIPELINES: [&str; 3] = ["a", "b", "c"];
/// Each pipeline's window (ms): a group keeps its entries for its members' longest.
const WINDOWS: [u64; 3] = [40, 400, 4_000];

#[derive(Debug, Clone)]
enum Op {
    /// The pipelines (a bit each) that accept one record's ID, milliseconds the clock moves
    /// on first.
    Event(u8, u16, u64),
    Checkpoint,
    /// Reopen, as a start does, and share a ledger among these pipelines (a bit each) from
    /// then on: another config, or a pipeline back from a backfill.
    Reopen(u8),
    /// An operator resets the pipeline at a start.
    Reset(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        20 => (prop_oneof![3 => Just(7u8), 1 => 1u8..8], 0u16..100,
               prop_oneof![Just(0u64), 0u64..20, 100u64..1_000])
            .prop_map(|(m, n, dt)| Op::Event(m, n, dt)),
        4 => Just(Op::Checkpoint),
        1 => (0u8..8).prop_map(Op::Reopen),
        1 => (0usize..3).prop_map(Op::Reset),
    ]
}

struct World {
    path: std::path::PathBuf,
    store: Store,
    clock: u64,
    checkpoint_id: u64,
    /// The shared ledger of this run, if any: its name and members.
    group: Option<(String, Vec<usize>)>,
    /// Committed: (pipeline, ID) → newest record time.
    oracle: HashMap<(usize, String), u64>,
    batch: BTreeMap<(usize, String), u64>,
}

impl World {
    /// A new store at `path`, its pipelines sharing no ledger yet.
    fn new(path: std::path::PathBuf) -> World {
        World {
            store: World::open(&path),
            path,
            clock: 1_000_000,
            checkpoint_id: 0,
            group: None,
            oracle: HashMap::new(),
            batch: BTreeMap::new(),
        }
    }

    fn open(path: &std::path::Path) -> Store {
        Store::open_with(path, 1 << 20, fsio::real(), StoreBounds::default()).unwrap()
    }

    fn progress(&self) -> Progress {
        Progress {
            checkpoint_id: self.checkpoint_id,
            log_clock_ms: self.clock,
            pipelines: (PIPELINES.iter())
                .map(|n| PipelineProgress {
                    name: n.to_string(),
                    ..Default::default()
                })
                .collect(),
            ..Progress::default()
        }
    }

    /// Name the group of `mask`, as a start does ([`Store::ledger_group_name`]).
    fn regroup(&mut self, mask: u8) {
        let members: Vec<usize> = (0..3).filter(|p| mask & (1 << p) != 0).collect();
        self.group = (members.len() >= 2).then(|| {
            let names: Vec<&str> = members.iter().map(|&p| PIPELINES[p]).collect();
            let name = self.store.ledger_group_name(&names).expect("room");
            assert!(name.starts_with('+'), "{name}");
            (name, members)
        });
    }

    fn event(&mut self, mask: u8, n: u16) -> Result<(), TestCaseError> {
        let id = format!("E{n}");
        for p in (0..3).filter(|p| mask & (1 << p) != 0) {
            let key = (p, id.clone());
            let batch = self.batch.get(&key).copied();
            let want = batch.or_else(|| self.oracle.get(&key).copied());
            let got = match batch {
                Some(t) => Some(t),
                None => self.store.dedup(PIPELINES[p], &id).unwrap(),
            };
            same_answer(got, want, (self.clock, WINDOWS[p]), || {
                format!("{}/{id}", PIPELINES[p])
            })?;
            if want.is_none_or(|t| self.clock - t >= WINDOWS[p]) {
                self.batch.insert(key, self.clock);
            }
        }
        Ok(())
    }

    fn checkpoint(&mut self) -> Result<(), TestCaseError> {
        self.checkpoint_id += 1;
        let mut batch = Batch::default();
        for ((p, id), t) in std::mem::take(&mut self.batch) {
            batch.dedup.insert(p, PIPELINES[p], &id, t);
            self.oracle.insert((p, id), t);
        }
        for p in 0..3 {
            batch.dedup_windows.push((PIPELINES[p].into(), WINDOWS[p]));
            if let Some(c) = self.clock.checked_sub(WINDOWS[p]) {
                batch
                    .dedup_expired_at_or_before
                    .push((PIPELINES[p].into(), c));
            }
        }
        // As the engine does (`Engine::take_checkpoint`).
        if let Some((g, members)) = &self.group {
            let window = members.iter().map(|&p| WINDOWS[p]).max().unwrap();
            batch.dedup_windows.push((g.clone(), window));
            if let Some(c) = self.clock.checked_sub(window) {
                batch.dedup_expired_at_or_before.push((g.clone(), c));
            }
            let names = members.iter().map(|&p| PIPELINES[p].to_string()).collect();
            batch.ledger_groups = vec![(g.clone(), names)];
        }
        let cp = Checkpoint {
            progress: self.progress(),
            batch,
        };
        self.store.commit(&cp, 0).unwrap();
        self.oracle
            .retain(|(p, _), t| self.clock.checked_sub(WINDOWS[*p]).is_none_or(|c| *t > c));
        // Every live entry is held, under the pipeline's name as `dedup_entries` gives it.
        let mut held: HashMap<(usize, String), u64> = HashMap::new();
        for e in self.store.dedup_entries(None) {
            let (p, id, t) = e.unwrap();
            let p = PIPELINES.iter().position(|n| *n == p);
            let p = p.unwrap_or_else(|| panic!("an entry of no pipeline: {id}"));
            let e = held.entry((p, id)).or_insert(t);
            *e = (*e).max(t);
        }
        for (k, t) in &self.oracle {
            prop_assert_eq!(held.get(k), Some(t), "{:?} missing", k);
        }
        for (p, name) in PIPELINES.iter().enumerate() {
            let n = self.oracle.keys().filter(|(q, _)| *q == p).count() as u64;
            prop_assert!(self.store.dedup_len(name) >= n);
        }
        Ok(())
    }

    fn reopen(&mut self) {
        self.batch.clear();
        // sled holds the directory's lock until the old store is dropped.
        let scratch = tempfile::tempdir().unwrap();
        drop(std::mem::replace(
            &mut self.store,
            World::open(&scratch.path().join("s")),
        ));
        self.store = World::open(&self.path);
        self.checkpoint_id = self.store.progress().unwrap().checkpoint_id;
        self.group = None;
    }
}

fn run(ops: &[Op]) -> Result<(), TestCaseError> {
    let dir = tempfile::tempdir().unwrap();
    let mut w = World::new(dir.path().join("store"));
    w.regroup(7);
    for op in ops {
        match *op {
            Op::Event(mask, n, dt) => {
                w.clock += dt;
                w.event(mask, n)?;
            }
            Op::Checkpoint => w.checkpoint()?,
            Op::Reopen(mask) => {
                w.reopen();
                w.regroup(mask);
            }
            Op::Reset(p) => {
                // At a start, before the groups are named.
                w.reopen();
                w.checkpoint_id += 1;
                w.store
                    .reset_pipelines(&[PIPELINES[p]], &w.progress())
                    .unwrap();
                w.oracle.retain(|(q, _), _| *q != p);
                w.regroup(7);
            }
        }
    }
    // Long after: every window has passed, the dormant groups' too.
    w.clock += 10 * WINDOWS[2];
    for _ in 0..500 {
        w.checkpoint()?;
        if w.store.dedup_entries(None).count() == 0 {
            return Ok(());
        }
    }
    prop_assert!(false, "expired entries never went");
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn shared_ledgers_answer_each_pipeline_like_a_map_of_its_own(
        ops in proptest::collection::vec(op(), 1..300),
    ) {
        run(&ops)?;
    }
}

/// An ID every member accepted at one time is one entry, the group's; the rest are their
/// pipelines' own. Checked on the tree: this is what makes 16 pipelines over one stream
/// write one entry per input.
#[test]
fn one_entry_per_id_that_every_member_accepted_and_own_entries_for_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let mut w = World::new(dir.path().join("store"));
    w.regroup(7);
    let g = w.group.clone().unwrap().0;
    w.event(7, 1).unwrap();
    w.event(3, 2).unwrap();
    w.event(1, 3).unwrap();
    w.clock += 1;
    w.event(6, 3).unwrap();
    w.checkpoint().unwrap();
    let mut owners: Vec<(String, String)> = Vec::new();
    for kv in w.store.dedup.iter() {
        let (k, v) = kv.unwrap();
        let (owner, _) = split_pkey(&k).unwrap();
        for (id, _) in decode::<ledger::Chunk>("chunk", &v).unwrap().entries {
            owners.push((owner.clone(), id));
        }
    }
    owners.sort();
    let want = |v: &[(&str, &str)]| -> Vec<(String, String)> {
        let mut v: Vec<_> = v
            .iter()
            .map(|(o, i)| (o.to_string(), i.to_string()))
            .collect();
        v.sort();
        v
    };
    assert_eq!(
        owners,
        want(&[
            (g.as_str(), "E1"),
            ("a", "E2"),
            ("b", "E2"),
            ("a", "E3"),
            ("b", "E3"),
            ("c", "E3"),
        ])
    );
    assert_eq!(w.store.dedup_len("a"), 3);
    assert_eq!(w.store.dedup_len("c"), 2);
    // The same members name the same group after a reopen; others a new one.
    w.reopen();
    assert_eq!(w.store.ledger_group_name(&["c", "a", "b"]), Some(g.clone()));
    let other = w.store.ledger_group_name(&["a", "b"]).unwrap();
    assert_ne!(other, g);
    let mut with_data = w.store.pipelines_with_data().unwrap();
    with_data.sort();
    assert_eq!(with_data, ["a", "b", "c"]);
}

/// As the agent's loop: each record applied through a read layer over the checkpoint in
/// flight, whose commit runs on another thread meanwhile, by an engine whose pipelines share
/// a ledger; one pipeline's `where` leaves out some inputs, so their IDs are the others'
/// own entries. IDs come again (duplicates) within a checkpoint, across checkpoints and
/// across a reopen. The oracle: the same records through an engine over the in-memory
/// store, which keeps every pipeline's ledger apart.
#[test]
fn decisions_beside_a_commit_with_a_shared_ledger_are_the_in_memory_engines() {
    use crate::model::Record;
    use crate::pipeline::engine::Engine;
    use crate::pipeline::memory::MemState;
    use crate::processor::inflight::Layered;
    use crate::store::rows::store_tests::spec;
    let specs = || {
        vec![
            spec("total", "sum", ""),
            spec("top", "max", ""),
            spec("big", "min", "where = \"{2} > 40\""),
        ]
    };
    let rec = |offset: u64| Record {
        offset,
        received_at_ms: 1_000_000 + offset,
        topic: "m/x".into(),
        // Every ID comes about three times, some within one checkpoint.
        payload: format!(
            "E{}/k{}/{}/1000",
            (offset * 7) % 400,
            offset % 13,
            offset % 97
        )
        .into_bytes(),
        qos: 1,
        retain: false,
    };
    let dir = tempfile::tempdir().unwrap();
    let mut oracle = MemState::default();
    let mut oracle_engine = Engine::new(specs(), Progress::default());
    let mut i = 0;
    for _run in 0..2 {
        let store = Store::open(dir.path(), 1 << 20, fsio::real()).unwrap();
        let mut engine = Engine::new(specs(), store.progress().unwrap());
        let group = store.ledger_group_name(&["total", "top", "big"]).unwrap();
        engine.set_ledger_groups(vec![(group.clone(), vec![0, 1, 2])]);
        for _ in 0..15 {
            let cp = engine.take_checkpoint();
            oracle.commit(&oracle_engine.take_checkpoint());
            std::thread::scope(|t| {
                let commit = t.spawn(|| store.commit(&cp, 0).unwrap());
                for _ in 0..41 {
                    let layer = Layered::new(Some(&cp.batch), &store);
                    let r = rec(i);
                    let got = engine.apply(&layer, &r).unwrap();
                    assert_eq!(got, oracle_engine.apply(&oracle, &r).unwrap(), "record {i}");
                    i += 1;
                }
                commit.join().expect("the commit beside the loop");
            });
        }
        let cp = engine.take_checkpoint();
        store.commit(&cp, 0).unwrap();
        oracle.commit(&oracle_engine.take_checkpoint());
        let shared =
            store.dedup_len("total") - store.lock().ledgers.get("total").map_or(0, |l| l.entries());
        assert!(shared > 0, "the group holds entries");
        // `big` left some out that the others took: those are their own entries.
        assert!(
            store
                .lock()
                .ledgers
                .get("total")
                .is_some_and(|l| l.entries() > 0)
        );
    }
    let (dups, applied) = (oracle_engine.progress().pipelines.iter())
        .map(|pp| (pp.counters.duplicates, pp.counters.applied))
        .fold((0, 0), |(d, a), (x, y)| (d + x, a + y));
    assert!(
        dups > 1_000 && applied > 1_000,
        "{dups} duplicates, {applied} applied"
    );
}
