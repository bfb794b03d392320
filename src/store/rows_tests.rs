//! Rows against the in-memory model: shared rows, spilled states, windows that close, and
//! the upgrade of a format-3 store, whole and after a crash part way.

use std::collections::BTreeMap;

use super::super::*;
use crate::fsio;
use crate::model::Record;
use crate::pipeline::engine::{Engine, ReadState};
use crate::pipeline::memory::MemState;
use crate::pipeline::spec::PipelineSpec;

/// A pipeline over delimited `id/key/value/time` inputs on `m/#`; `extra`: more of its
/// TOML (a window, a `where`).
pub(in crate::store) fn spec(name: &str, aggregate: &str, extra: &str) -> PipelineSpec {
    crate::config::pipeline_from_toml(&format!(
        r#"name = "{name}"
topics = ["m/#"]
format = "delimited"
event_id = "0"
key = "1"
value = "2"
event_time = "3"
aggregate = "{aggregate}"
{extra}
output_topic = "out/{name}/{{key}}"
max_key_len = 64
max_keys = 100000"#
    ))
    .unwrap()
}

/// Six percentile pipelines (their sketches grow with spread values, past what one row
/// holds for all six), a sum, and a windowed count whose windows close.
fn specs() -> Vec<PipelineSpec> {
    let mut v: Vec<PipelineSpec> = ["p50", "p90", "p95", "p99", "p25", "p99.9"]
        .iter()
        .map(|a| spec(&format!("q_{}", a.replace('.', "_")), a, ""))
        .collect();
    v.push(spec("total", "sum", ""));
    v.push(spec(
        "per_second",
        "max",
        "window = { size = \"1s\", allowed_lateness = \"0s\" }",
    ));
    v
}

fn rec(offset: u64, key: &str, value: f64, time_ms: u64) -> Record {
    Record {
        offset,
        received_at_ms: 1_000_000 + offset,
        topic: "m/x".into(),
        payload: format!("E{offset}/{key}/{value}/{time_ms}").into_bytes(),
        qos: 1,
        retain: false,
    }
}

fn stored(store: &Store) -> BTreeMap<(String, Vec<u8>), KeyState> {
    store
        .states(None)
        .map(|r| {
            let (p, k, s) = r.unwrap();
            ((p, k), s)
        })
        .collect()
}

fn assert_as_model(store: &Store, model: &MemState, when: &str) {
    let got = stored(store);
    assert_eq!(got.len(), model.state.len(), "{when}: states stored");
    for ((p, k), s) in &model.state {
        assert_eq!(
            got.get(&(p.clone(), k.clone())),
            Some(s),
            "{when}: {p} {k:?}"
        );
        assert_eq!(
            store.state(p, k).unwrap().as_ref(),
            Some(s),
            "{when}: read {p}"
        );
    }
    assert_eq!(store.state_len().unwrap(), model.state.len(), "{when}");
}

/// Record `i` of a run over `keys` keys, `ms_apart` in event time. Spread values: every
/// percentile sketch gains buckets for a long while, over 128 buckets apart (1.3 powers of
/// two), so that a bucket takes three bytes in the store.
fn spread(i: u64, keys: u64, ms_apart: u64) -> Record {
    let value = 2f64.powf((i % 1500) as f64 * 1.3 - 975.0) * if i % 2 == 0 { 1.0 } else { -1.0 };
    rec(i, &format!("k{}", i % keys), value, i * ms_apart)
}

/// Run `n` records through an engine over `store`, committing every `every` records to
/// the store and the model alike.
fn run(store: &Store, model: &mut MemState, from: u64, n: u64, every: u64) {
    let mut engine = Engine::new(specs(), store.progress().unwrap());
    for i in from..from + n {
        engine.apply(store, &spread(i, 2, 97)).unwrap();
        if (i + 1) % every == 0 || i + 1 == from + n {
            let cp = engine.take_checkpoint();
            store.commit(&cp, 0).unwrap();
            model.commit(&cp);
            assert_as_model(store, model, &format!("after record {i}"));
        }
    }
}

#[test]
fn pipelines_sharing_keys_share_rows_spill_what_does_not_fit_and_read_as_the_model() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), 1 << 20, fsio::real()).unwrap();
    let mut model = MemState::default();
    run(&store, &mut model, 0, 1500, 37);
    let keys: std::collections::BTreeSet<&Vec<u8>> = model.state.keys().map(|(_, k)| k).collect();
    assert!(
        store.rows.len() <= keys.len(),
        "a row per stored key at most"
    );
    assert!(!store.state.is_empty(), "some states were spilled");
    assert!(
        model.state.len() > store.state.len() * 2,
        "most states are in rows"
    );
    let windows = model
        .state
        .keys()
        .filter(|(p, _)| p == "per_second")
        .count();
    assert!(windows < 1500 * 97 / 1000, "closed windows were deleted");
    drop(store);
    let store = Store::open(dir.path(), 1 << 20, fsio::real()).unwrap();
    assert_as_model(&store, &model, "reopened");
}

#[test]
fn states_read_as_the_loop_reads_them_beside_a_commit_are_the_in_memory_engines() {
    // As the agent's loop: each record applied through a read layer of its own over the
    // checkpoint in flight, whose commit runs on another thread meanwhile. The layer serves
    // the row it read for one pipeline to the next (`LastRow`), spilled states and a
    // windowed pipeline's keys (another row) included. 53 keys, so that most keys a record
    // reads are not in the checkpoint in flight but in the store; ~500 records in a window,
    // so that a key's window has state when the key comes again. The oracle: the same
    // records through an engine over the in-memory store, with the same checkpoints.
    use crate::processor::inflight::Layered;
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), 1 << 20, fsio::real()).unwrap();
    let mut engine = Engine::new(specs(), store.progress().unwrap());
    let mut oracle = MemState::default();
    let mut oracle_engine = Engine::new(specs(), store.progress().unwrap());
    let mut i = 0;
    while i < 1500 {
        let cp = engine.take_checkpoint();
        oracle.commit(&oracle_engine.take_checkpoint());
        std::thread::scope(|t| {
            let commit = t.spawn(|| store.commit(&cp, 0).unwrap());
            for _ in 0..37 {
                let layer = Layered::new(Some(&cp.batch), &store);
                let r = spread(i, 53, 2);
                let got = engine.apply(&layer, &r).unwrap();
                assert_eq!(got, oracle_engine.apply(&oracle, &r).unwrap(), "record {i}");
                i += 1;
            }
            commit.join().expect("the commit beside the loop");
        });
        assert_as_model(&store, &oracle, &format!("before record {i}"));
    }
}

#[test]
fn a_checkpoint_writes_one_row_per_key_however_many_pipelines_keep_state_for_it() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), 1 << 20, fsio::real()).unwrap();
    let mut engine = Engine::new(specs(), store.progress().unwrap());
    engine.apply(&store, &rec(0, "a", 1.0, 10)).unwrap();
    engine.apply(&store, &rec(1, "a", 2.0, 20)).unwrap();
    engine.apply(&store, &rec(2, "b", 2.0, 30)).unwrap();
    // `max_keys` counts rows: five pipelines share "a" and "b"; the windowed one keys by
    // window and key. Each row's states are a few hundred bytes, so each weighs one.
    assert_eq!(engine.pending_keys(), 4);
    store.commit(&engine.take_checkpoint(), 0).unwrap();
    assert_eq!(store.rows.len(), 4);
    assert!(store.state.is_empty());
}

/// A row weighs what its states are worth in KiB when they enter the batch, at least one
/// and at most one per state: 16 light pipelines over one key take one key of `max_keys`,
/// as one pipeline does, while four grown sketches count for their size.
#[test]
fn max_keys_weighs_a_row_by_its_bytes_at_least_one_and_at_most_one_per_state() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), 1 << 20, fsio::real()).unwrap();
    let light: Vec<PipelineSpec> = (0..16).map(|i| spec(&format!("s{i}"), "sum", "")).collect();
    let mut engine = Engine::new(light, store.progress().unwrap());
    engine.apply(&store, &rec(0, "a", 1.0, 10)).unwrap();
    engine.apply(&store, &rec(1, "a", 2.0, 20)).unwrap();
    assert_eq!(engine.pending_keys(), 1, "16 states of a few numbers");
    engine.apply(&store, &rec(2, "b", 2.0, 30)).unwrap();
    assert_eq!(engine.pending_keys(), 2);
    drop(engine);

    let mut engine = Engine::new(specs(), store.progress().unwrap());
    let mut offset = 0;
    // Spread values grow the sketches past a KiB each: 600 buckets, a power of two apart.
    for i in 0..600u32 {
        let v = 2f64.powi(i as i32 - 300);
        engine.apply(&store, &rec(offset, "a", v, 10)).unwrap();
        offset += 1;
    }
    // Entered small, counted small: one row, and the windowed pipeline's.
    assert_eq!(engine.pending_keys(), 2);
    store.commit(&engine.take_checkpoint(), 0).unwrap();
    engine.apply(&store, &rec(offset, "a", 1.0, 10)).unwrap();
    // The row of "a" now holds six grown sketches and a sum (those that fit it, the rest
    // spilled): more than a KiB each, so it weighs its seven states; the windowed
    // pipeline's window row, one.
    assert_eq!(engine.pending_keys(), 8);
}

/// Put every state of `store` back in format 3's layout (`pipeline 0x00 skey` in `state`),
/// except the rows of keys `keep` accepts: what a crash part way through an upgrade leaves.
fn as_format_3(store: &Store, keep: impl Fn(&[u8]) -> bool) {
    for r in store.rows.iter() {
        let (k, v) = r.unwrap();
        if keep(&k) {
            continue;
        }
        let row: super::Row = decode("row", &v).unwrap();
        for (p, s) in row.entries {
            store.state.insert(pkey(&p, &k), s).unwrap();
        }
        store.rows.remove(&k).unwrap();
    }
    store.meta.insert(FORMAT_KEY, &3u32.to_be_bytes()).unwrap();
    store.sync().unwrap();
}

#[test]
fn a_format_3_store_reads_as_it_is_and_the_upgrade_moves_every_state_whole_or_again() {
    for partial in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), 1 << 20, fsio::real()).unwrap();
        let mut model = MemState::default();
        run(&store, &mut model, 0, 800, 50);
        as_format_3(&store, |k| partial && k.ends_with(b"k1"));
        drop(store);

        let store = Store::open(dir.path(), 1 << 20, fsio::real()).unwrap();
        assert!(store.legacy_layout());
        assert_as_model(&store, &model, "format 3, read as it is");
        assert_eq!(
            store.meta.get(FORMAT_KEY).unwrap().unwrap().as_ref(),
            3u32.to_be_bytes(),
            "reading does not rewrite it"
        );
        store.upgrade_layout().unwrap();
        assert!(!store.legacy_layout());
        assert_as_model(&store, &model, "upgraded");
        assert_eq!(
            store.meta.get(FORMAT_KEY).unwrap().unwrap().as_ref(),
            STORE_FORMAT.to_be_bytes()
        );
        let spilled: usize = store.state.len();
        assert!(
            spilled * 2 < model.state.len(),
            "{partial}: moved into rows"
        );
        // And processing goes on from there as the model does.
        run(&store, &mut model, 800, 300, 41);
        drop(store);
        let store = Store::open(dir.path(), 1 << 20, fsio::real()).unwrap();
        assert!(!store.legacy_layout());
        assert_as_model(&store, &model, "reopened after the upgrade");
    }
}

/// A store whose progress record forgot a pipeline is refused by what
/// `pipelines_with_data` finds: every pipeline with a state, also when its states are in
/// rows only and its ledger is gone.
#[test]
fn every_pipeline_with_a_state_in_a_row_is_found() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), 1 << 20, fsio::real()).unwrap();
    let mut model = MemState::default();
    run(&store, &mut model, 0, 200, 50);
    let mut names: Vec<String> = specs().iter().map(|s| s.name.clone()).collect();
    names.sort();
    assert_eq!(store.pipelines_with_data().unwrap(), names);
    store.dedup.clear().unwrap();
    store.state.clear().unwrap();
    assert!(!store.rows.is_empty());
    assert_eq!(
        store.pipelines_with_data().unwrap(),
        names,
        "from the rows alone"
    );
}

/// A percentile state as formats up to 5 stored it: its sketch as a list of buckets and
/// counts (`Agg::Percentile` is the ninth variant). `None` for any other state.
fn listed(state: &KeyState) -> Option<Vec<u8>> {
    let crate::pipeline::value::Agg::Percentile { permille, sketch } = &state.agg else {
        return None;
    };
    let pairs: Vec<(i32, u64)> = sketch.pairs().collect();
    let bytes = encode(&(state.version, state.count, 8u32, *permille, pairs));
    assert_eq!(
        &decode::<KeyState>("listed", &bytes).unwrap(),
        state,
        "the old layout reads"
    );
    Some(bytes)
}

/// Rewrite every percentile state of `store` as format 5 stored it, in its row or the
/// `state` tree, and say format 5: the bytes those states take before and after.
fn as_format_5(store: &Store) -> (usize, usize) {
    let (mut before, mut after) = (0, 0);
    let mut list = |s: &[u8]| {
        let old = listed(&decode("state", s).unwrap())?;
        (before, after) = (before + s.len(), after + old.len());
        Some(old)
    };
    for r in store.rows.iter() {
        let (k, v) = r.unwrap();
        let mut row: super::Row = decode("row", &v).unwrap();
        for (_, s) in &mut row.entries {
            if let Some(old) = list(s) {
                *s = old;
            }
        }
        store.rows.insert(k, encode(&row)).unwrap();
    }
    for r in store.state.iter() {
        let (k, v) = r.unwrap();
        if let Some(old) = list(&v) {
            store.state.insert(k, old).unwrap();
        }
    }
    store.meta.insert(FORMAT_KEY, &5u32.to_be_bytes()).unwrap();
    store.sync().unwrap();
    (before, after)
}

/// Every stored state is in this build's bytes: what encoding it again gives.
fn all_packed(store: &Store) -> bool {
    let rows = store.rows.iter().all(|r| {
        let (_, v) = r.unwrap();
        let row: super::Row = decode("row", &v).unwrap();
        (row.entries.iter()).all(|(_, s)| *s == encode(&decode::<KeyState>("state", s).unwrap()))
    });
    rows && store.state.iter().all(|r| {
        let (_, v) = r.unwrap();
        v.as_ref() == encode(&decode::<KeyState>("state", &v).unwrap()).as_slice()
    })
}

#[test]
fn a_format_5_store_reads_its_sketch_lists_and_is_packed_by_its_next_commits() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), 1 << 20, fsio::real()).unwrap();
    let mut model = MemState::default();
    run(&store, &mut model, 0, 400, 50);
    assert!(all_packed(&store));
    let (packed, listed) = as_format_5(&store);
    assert!(!all_packed(&store));
    // Buckets 1.3 powers of two apart: three bytes each packed, four listed.
    assert!(
        packed * 10 < listed * 8,
        "sketches of {packed} bytes packed, {listed} listed"
    );
    drop(store);

    let store = Store::open(dir.path(), 1 << 20, fsio::real()).unwrap();
    assert_as_model(&store, &model, "format 5, read as it is");
    assert_eq!(
        store.meta.get(FORMAT_KEY).unwrap().unwrap().as_ref(),
        5u32.to_be_bytes(),
        "reading does not rewrite it"
    );
    // Both keys take records again: every state they hold is written again, packed, and
    // the first commit says format 6 in its transaction.
    run(&store, &mut model, 400, 300, 41);
    assert!(all_packed(&store));
    drop(store);
    let store = Store::open(dir.path(), 1 << 20, fsio::real()).unwrap();
    assert_eq!(
        store.meta.get(FORMAT_KEY).unwrap().unwrap().as_ref(),
        STORE_FORMAT.to_be_bytes()
    );
    assert_as_model(&store, &model, "packed, reopened");
}
