//! Model test (issue 3): random streams with business duplicates, late events and bad
//! payloads, processed by the real engine and sled store with crashes at random points (the
//! uncommitted write set is dropped and the store reopened). The recovered result must
//! equal a plain fold over the unique valid events, every dead letter must be recorded
//! exactly once, and versions must rise by exactly one per change per key.

use std::collections::{BTreeMap, HashSet};

use cairn::fsio;
use cairn::model::Output;
use cairn::model::Record;
use cairn::pipeline::engine::Engine;
use cairn::pipeline::spec::*;
use cairn::store::Store;
use proptest::prelude::*;

const WINDOW: u64 = 100;
const LATENESS: u64 = 50;
/// The rich pipeline's hopping windows: 100 ms every 50 ms.
const SLIDE: u64 = 50;
const RICH_AGGS: [&str; 10] = [
    "count", "sum", "min", "max", "avg", "stddev", "variance", "last", "p50", "p90",
];

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

/// Issue 15 in one pipeline: a filter on a topic level and a field (every operator kind:
/// `and`, `or`, `not`, parentheses; for integers it reads `{2} > -900`), a key from a template
/// mixing a field and a topic level, every aggregate in a list, hopping windows, final
/// results.
fn rich() -> PipelineSpec {
    let aggs: Vec<String> = RICH_AGGS.iter().map(|a| format!("\"{a}\"")).collect();
    cairn::config::pipeline_from_toml(&format!(
        r#"name = "rich"
topics = ["t/#"]
format = "delimited"
event_id = "0"
key = "{{1}}@{{topic[0]}}"
value = "2"
event_time = "3"
where = 'topic[1] == "run" and not ({{2}} <= -950 or ({{2}} < -899 and {{2}} >= -950))'
aggregate = [{}]
window = {{ size = "{WINDOW}ms", slide = "{SLIDE}ms", allowed_lateness = "{LATENESS}ms" }}
dedup_window = "366d"
output_topic = "rich/{{key}}/{{window_start}}"
emit = "final"
max_key_len = 16
max_keys = 1000"#,
        aggs.join(", ")
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
    /// Inputs with an ID ending in 3 (mod 4) come from an idle machine: `rich` skips them.
    /// A function of the payload, so a refused payload is still identified by its bytes.
    fn topic(&self) -> &'static str {
        match self {
            Input::Good { id, .. }
            | Input::BadValue { id, .. }
            | Input::Short { id }
            | Input::LongKey { id }
                if id % 4 == 3 =>
            {
                "t/idle"
            }
            _ => "t/run",
        }
    }

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
    duplicates: [u64; 3],
    /// `rich`: per (key, window start), the applied (value, event time) in log order.
    rich: BTreeMap<(String, u64), Vec<(i64, u64)>>,
    rich_filtered: u64,
    rich_applied: u64,
    rich_max_time: u64,
}

/// The first window start still open at greatest event time `max`, the engine's rule
/// spelled out: a window closes when `max - lateness` reaches its end.
fn open_from(max: u64) -> u64 {
    let wm = max.saturating_sub(LATENESS);
    if wm < WINDOW {
        0
    } else {
        ((wm - WINDOW) / SLIDE + 1) * SLIDE
    }
}

fn oracle(inputs: &[Input]) -> Oracle {
    let mut o = Oracle::default();
    let mut seen = [HashSet::new(), HashSet::new(), HashSet::new()];
    // Refused inputs are identified by their bytes: the same bad payload twice is one dead
    // letter and one duplicate.
    let mut refused: [HashSet<Vec<u8>>; 3] = [HashSet::new(), HashSet::new(), HashSet::new()];
    let mut max_time = 0u64;
    let names = ["sums", "windows", "rich"];
    for (off, inp) in inputs.iter().enumerate() {
        let off = off as u64;
        let mut dead = |o: &mut Oracle, p: usize| {
            if refused[p].insert(inp.payload()) {
                o.dead.insert((off, names[p]), ());
            } else {
                o.duplicates[p] += 1;
            }
        };
        // `rich`: not UTF-8 is refused before the filter; the filter reads the topic, then
        // the value (a non-number there is a dead letter); then the key, dedup, windows.
        let run = inp.topic() == "t/run";
        match inp {
            Input::Binary => dead(&mut o, 2),
            _ if !run => o.rich_filtered += 1,
            Input::Short { .. } | Input::BadValue { .. } => dead(&mut o, 2),
            Input::Good { value, .. } if *value <= -900 => o.rich_filtered += 1,
            Input::LongKey { .. } => dead(&mut o, 2),
            Input::Good {
                id,
                key,
                value,
                time,
            } => {
                if !seen[2].insert(*id) {
                    o.duplicates[2] += 1;
                } else {
                    let open = open_from(o.rich_max_time);
                    let newest = time - time % SLIDE;
                    let starts: Vec<u64> = [newest.checked_sub(SLIDE), Some(newest)]
                        .into_iter()
                        .flatten()
                        .filter(|s| s + WINDOW > *time && *s >= open)
                        .collect();
                    if starts.is_empty() {
                        seen[2].remove(id);
                        dead(&mut o, 2);
                    } else {
                        o.rich_applied += 1;
                        o.rich_max_time = o.rich_max_time.max(*time);
                        for s in starts {
                            o.rich
                                .entry((format!("K{key}@t"), s))
                                .or_default()
                                .push((*value, *time));
                        }
                    }
                }
            }
        }
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
        topic: inp.topic().into(),
        payload: inp.payload(),
        qos: 1,
        retain: false,
    }
}

fn run(inputs: &[Input], steps: &[Step]) -> (Store, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store");
    let specs = vec![sums(), windows(), rich()];
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
    let mut rich_out: BTreeMap<(String, u64), serde_json::Value> = BTreeMap::new();
    for out in &outputs {
        let v: serde_json::Value = serde_json::from_slice(&out.payload).unwrap();
        let key = v["key"].as_str().unwrap().to_string();
        let version = v["version"].as_u64().unwrap();
        if v["pipeline"] == "sums" {
            let e = latest.entry(key).or_default();
            prop_assert!(version > *e, "upsert versions must rise");
            *e = version;
        } else if v["pipeline"] == "rich" {
            let start = v["window_start"].as_u64().unwrap();
            prop_assert!(
                rich_out.insert((key, start), v.clone()).is_none(),
                "a final result was emitted twice: {}",
                v
            );
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

    // `rich`: every closed window has exactly one final result, every open one its state,
    // and each equals the fold of its events.
    let open = open_from(o.rich_max_time);
    let mut rich_state = BTreeMap::new();
    for r in store.states(Some("rich")) {
        let (_, k, st) = r.unwrap();
        let start = u64::from_be_bytes(k[..8].try_into().unwrap());
        let key = String::from_utf8(k[8..].to_vec()).unwrap();
        prop_assert!(start >= open, "a closed window was kept");
        let v = serde_json::json!({"values": st.value_json(), "count": st.count, "version": st.version});
        rich_state.insert((key, start), v);
    }
    for ((key, start), events) in &o.rich {
        let got = if *start < open {
            rich_out.get(&(key.clone(), *start))
        } else {
            prop_assert!(
                !rich_out.contains_key(&(key.clone(), *start)),
                "open window emitted"
            );
            rich_state.get(&(key.clone(), *start))
        };
        let Some(got) = got else {
            return Err(TestCaseError::fail(format!(
                "window {key} {start} is missing"
            )));
        };
        check_values(got, events)?;
    }
    prop_assert_eq!(rich_out.len() + rich_state.len(), o.rich.len());
    let c2 = &progress.pipelines[2].counters;
    prop_assert_eq!(c2.duplicates, o.duplicates[2]);
    prop_assert_eq!(c2.filtered, o.rich_filtered);
    prop_assert_eq!(c2.applied, o.rich_applied);
    Ok(())
}

/// One result of `rich` against a plain fold of its window's events (value, event time),
/// in log order: integers exactly, floats to rounding, percentiles to the sketch's bound.
fn check_values(got: &serde_json::Value, events: &[(i64, u64)]) -> Result<(), TestCaseError> {
    let n = events.len() as u64;
    let vals: Vec<i64> = events.iter().map(|e| e.0).collect();
    let v = &got["values"];
    prop_assert_eq!(got["count"].as_u64(), Some(n));
    prop_assert_eq!(got["version"].as_u64(), Some(n), "one version per event");
    prop_assert_eq!(v["count"].as_u64(), Some(n));
    let sum: i64 = vals.iter().sum();
    prop_assert_eq!(v["sum"].as_i64(), Some(sum));
    prop_assert_eq!(v["min"].as_i64(), vals.iter().min().copied());
    prop_assert_eq!(v["max"].as_i64(), vals.iter().max().copied());
    // Last: the greatest event time; on a tie, the later in the log.
    let last = events
        .iter()
        .fold(events[0], |a, e| if e.1 >= a.1 { *e } else { a });
    prop_assert_eq!(v["last"].as_i64(), Some(last.0));
    let mean = sum as f64 / n as f64;
    let close = |a: f64, b: f64, tol: f64| (a - b).abs() <= tol * (1.0 + b.abs());
    prop_assert!(close(v["avg"].as_f64().unwrap(), mean, 1e-12), "avg {}", v);
    let var = vals.iter().map(|x| (*x as f64 - mean).powi(2)).sum::<f64>() / n as f64;
    prop_assert!(
        close(v["variance"].as_f64().unwrap(), var, 1e-9),
        "variance {} vs {}",
        v,
        var
    );
    prop_assert!(
        close(v["stddev"].as_f64().unwrap(), var.sqrt(), 1e-9),
        "stddev {}",
        v
    );
    let mut sorted = vals.clone();
    sorted.sort();
    for (name, permille) in [("p50", 500u64), ("p90", 900)] {
        let rank = (permille * n).div_ceil(1000).max(1);
        let exact = sorted[rank as usize - 1] as f64;
        let p = v[name].as_f64().unwrap();
        prop_assert!(
            p.abs() <= exact.abs() && (exact - p).abs() <= exact.abs() / 128.0,
            "{} = {} but the value at rank {} is {}",
            name,
            p,
            rank,
            exact
        );
    }
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
