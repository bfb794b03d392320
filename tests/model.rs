//! Model test (issue 3): random streams with business duplicates, late events and bad
//! payloads, processed by the real engine and sled store with crashes at random points (the
//! uncommitted write set is dropped and the store reopened). The recovered result must
//! equal a plain fold over the unique valid events, every dead letter must be recorded
//! exactly once, and versions must rise by exactly one per change per key.

use std::collections::{BTreeMap, HashSet};

use cairn::fsio;
use cairn::model::Record;
use cairn::pipeline::engine::{Engine, Output};
use cairn::pipeline::spec::*;
use cairn::store::Store;
use proptest::prelude::*;

const WINDOW: u64 = 100;
const LATENESS: u64 = 50;

fn sums() -> PipelineSpec {
    cairn::config::pipeline_from_toml(
        r#"name = "sums"
topics = ["t/#"]
format = "delimited"
event_id = "0"
key = "1"
value = "2"
aggregate = "sum"
dedup_window = "366d"  # forever, in this test's record time
output_topic = "sums/{key}"
max_key_len = 16
max_keys = 1000"#,
    )
    .unwrap()
}

fn windows() -> PipelineSpec {
    cairn::config::pipeline_from_toml(&format!(
        r#"name = "windows"
topics = ["t/#"]
format = "delimited"
event_id = "0"
key = "1"
event_time = "3"
aggregate = "count"
window = {{ size = "{WINDOW}ms", allowed_lateness = "{LATENESS}ms" }}
dedup_window = "366d"
output_topic = "windows/{{key}}/{{window_start}}"
emit = "changelog"
max_key_len = 16
max_keys = 1000"#
    ))
    .unwrap()
}

/// What the generator makes, so the oracle knows validity without parsing.
#[derive(Debug, Clone)]
enum Input {
    Good {
        id: u32,
        key: u8,
        value: i64,
        time: u64,
    },
    /// Value is not a number: a dead letter for `sums`, fine for `windows` (count).
    BadValue { id: u32, key: u8, time: u64 },
    /// Not UTF-8: a dead letter for both.
    Binary,
    /// Missing fields: a dead letter for both.
    Short { id: u32 },
    /// Key longer than `max_key_len`: a dead letter for both.
    LongKey { id: u32 },
}

impl Input {
    fn payload(&self) -> Vec<u8> {
        match self {
            Input::Good {
                id,
                key,
                value,
                time,
            } => format!("E{id}/K{key}/{value}/{time}").into_bytes(),
            Input::BadValue { id, key, time } => format!("E{id}/K{key}/x1/{time}").into_bytes(),
            Input::Binary => vec![0xff, 0xfe, b'/', 0x80],
            Input::Short { id } => format!("E{id}").into_bytes(),
            Input::LongKey { id } => format!("E{id}/{}/1/1", "k".repeat(17)).into_bytes(),
        }
    }
}

fn input() -> impl Strategy<Value = Input> {
    prop_oneof![
        8 => (0u32..60, 0u8..5, -1000i64..1000, 0u64..600)
            .prop_map(|(id, key, value, time)| Input::Good { id, key, value, time }),
        1 => (0u32..60, 0u8..5, 0u64..600).prop_map(|(id, key, time)| Input::BadValue { id, key, time }),
        1 => Just(Input::Binary),
        1 => (0u32..60).prop_map(|id| Input::Short { id }),
        1 => (0u32..60).prop_map(|id| Input::LongKey { id }),
    ]
}

#[derive(Debug, Clone)]
enum Step {
    Apply(usize),
    Checkpoint,
    Crash,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => (1usize..15).prop_map(Step::Apply),
        2 => Just(Step::Checkpoint),
        1 => Just(Step::Crash),
    ]
}

/// The oracle: a plain fold over the inputs in log order.
#[derive(Default, Debug)]
struct Oracle {
    sums: BTreeMap<String, (i64, u64)>,
    windows: BTreeMap<(String, u64), u64>,
    dead: BTreeMap<(u64, &'static str), ()>,
    duplicates: [u64; 2],
}

fn oracle(inputs: &[Input]) -> Oracle {
    let mut o = Oracle::default();
    let mut seen = [HashSet::new(), HashSet::new()];
    // Refused inputs are identified by their bytes: the same bad payload twice is one dead
    // letter and one duplicate.
    let mut refused: [HashSet<Vec<u8>>; 2] = [HashSet::new(), HashSet::new()];
    let mut max_time = 0u64;
    let names = ["sums", "windows"];
    for (off, inp) in inputs.iter().enumerate() {
        let off = off as u64;
        let mut dead = |o: &mut Oracle, p: usize| {
            if refused[p].insert(inp.payload()) {
                o.dead.insert((off, names[p]), ());
            } else {
                o.duplicates[p] += 1;
            }
        };
        match inp {
            Input::Binary | Input::Short { .. } | Input::LongKey { .. } => {
                dead(&mut o, 0);
                dead(&mut o, 1);
            }
            Input::Good { id, key, time, .. } | Input::BadValue { id, key, time } => {
                // A payload that does not parse is a dead letter whatever its ID.
                if !matches!(inp, Input::Good { .. }) {
                    dead(&mut o, 0);
                } else if seen[0].contains(id) {
                    o.duplicates[0] += 1;
                } else {
                    seen[0].insert(*id);
                    let e = o.sums.entry(format!("K{key}")).or_default();
                    if let Input::Good { value, .. } = inp {
                        e.0 += value;
                    }
                    e.1 += 1;
                }
                if seen[1].contains(id) {
                    o.duplicates[1] += 1;
                } else {
                    let wm = max_time.saturating_sub(LATENESS);
                    let start = time - time % WINDOW;
                    if start < wm - wm % WINDOW {
                        dead(&mut o, 1);
                    } else {
                        seen[1].insert(*id);
                        max_time = max_time.max(*time);
                        *o.windows.entry((format!("K{key}"), start)).or_default() += 1;
                    }
                }
            }
        }
    }
    o
}

fn record(offset: u64, inp: &Input) -> Record {
    Record {
        offset,
        received_at_ms: 1_000 + offset,
        topic: "t/in".into(),
        payload: inp.payload(),
        qos: 1,
        retain: false,
    }
}

fn run(inputs: &[Input], steps: &[Step]) -> (Store, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store");
    let specs = vec![sums(), windows()];
    let open = || Store::open(&path, 1 << 20, fsio::real()).unwrap();
    let mut store = open();
    let mut engine = Engine::new(specs.clone(), store.progress().unwrap());
    let mut next = 0usize;
    let commit = |engine: &mut Engine, store: &Store| {
        if engine.pending_records() > 0 {
            let cp = engine.take_checkpoint();
            store.commit(&cp, 0).unwrap();
        }
    };
    for s in steps
        .iter()
        .chain(std::iter::once(&Step::Apply(usize::MAX)))
    {
        match s {
            Step::Apply(n) => {
                let end = next.saturating_add(*n).min(inputs.len());
                for (i, inp) in inputs.iter().enumerate().take(end).skip(next) {
                    engine.apply(&store, &record(i as u64, inp)).unwrap();
                }
                next = end;
            }
            Step::Checkpoint => commit(&mut engine, &store),
            Step::Crash => {
                // Power cut: the uncommitted write set is gone; replay from the checkpoint.
                drop(engine);
                drop(store);
                store = open();
                engine = Engine::new(specs.clone(), store.progress().unwrap());
                next = engine.progress().next_offset as usize;
            }
        }
    }
    commit(&mut engine, &store);
    drop(engine);
    (store, dir)
}

fn check(inputs: &[Input], steps: &[Step]) -> Result<(), TestCaseError> {
    let o = oracle(inputs);
    let (store, _dir) = run(inputs, steps);

    // Per-key sums and versions (one change per applied event).
    let mut got = BTreeMap::new();
    for r in store.states(Some("sums")) {
        let (_, k, st) = r.unwrap();
        got.insert(
            String::from_utf8(k).unwrap(),
            (st.value_json().as_i64().unwrap(), st.version),
        );
        prop_assert_eq!(st.version, st.count);
    }
    let want: BTreeMap<_, _> = o
        .sums
        .iter()
        .map(|(k, (s, n))| (k.clone(), (*s, *n)))
        .collect();
    prop_assert_eq!(&got, &want);

    // Outputs: upsert ids unique and the highest version per key equals the final state;
    // changelog versions per window are exactly 1..=n.
    let outputs: Vec<Output> = store.outbox_from(0).map(|r| r.unwrap().1).collect();
    let ids: HashSet<_> = outputs.iter().map(|o| o.id.clone()).collect();
    prop_assert_eq!(ids.len(), outputs.len(), "an output ID was emitted twice");
    let mut latest: BTreeMap<String, u64> = BTreeMap::new();
    let mut changelog: BTreeMap<(String, u64), Vec<u64>> = BTreeMap::new();
    for out in &outputs {
        let v: serde_json::Value = serde_json::from_slice(&out.payload).unwrap();
        let key = v["key"].as_str().unwrap().to_string();
        let version = v["version"].as_u64().unwrap();
        if v["pipeline"] == "sums" {
            let e = latest.entry(key).or_default();
            prop_assert!(version > *e, "upsert versions must rise");
            *e = version;
        } else {
            prop_assert_eq!(v["count"].as_u64().unwrap(), version);
            changelog
                .entry((key, v["window_start"].as_u64().unwrap()))
                .or_default()
                .push(version);
        }
    }
    let want_latest: BTreeMap<_, _> = o.sums.iter().map(|(k, (_, n))| (k.clone(), *n)).collect();
    prop_assert_eq!(latest, want_latest);
    for (w, versions) in &changelog {
        let n = o.windows.get(w).copied().unwrap_or(0);
        prop_assert_eq!(versions, &(1..=n).collect::<Vec<_>>(), "window {:?}", w);
    }
    prop_assert_eq!(changelog.len(), o.windows.len());

    // Dead letters: each recorded once, with the pipeline that refused it.
    let dead: BTreeMap<(u64, String), ()> = store
        .dead_letters()
        .map(|d| d.unwrap())
        .map(|d| ((d.offset, d.pipeline), ()))
        .collect();
    let want_dead: BTreeMap<(u64, String), ()> = o
        .dead
        .keys()
        .map(|(off, p)| ((*off, p.to_string()), ()))
        .collect();
    prop_assert_eq!(dead, want_dead);

    // Counters live in the checkpoint and are replayed exactly too.
    let progress = store.progress().unwrap();
    prop_assert_eq!(progress.next_offset, inputs.len() as u64);
    let c0 = &progress.pipelines[0].counters;
    let c1 = &progress.pipelines[1].counters;
    prop_assert_eq!(c0.duplicates, o.duplicates[0]);
    prop_assert_eq!(c1.duplicates, o.duplicates[1]);
    prop_assert_eq!(c0.applied, o.sums.values().map(|v| v.1).sum::<u64>());
    prop_assert_eq!(c1.applied, o.windows.values().sum::<u64>());
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn recovered_state_equals_a_fold_over_unique_valid_events(
        inputs in proptest::collection::vec(input(), 1..120),
        steps in proptest::collection::vec(step(), 0..40),
    ) {
        check(&inputs, &steps)?;
    }
}
