//! The store's unit tests. Long (one test per guarantee in the module docs, sharing the
//! fixtures at the top); splitting them by file would scatter those fixtures.

use super::*;
use crate::fsio::{self, TestSync};
use crate::model::Record;
use crate::pipeline::engine::Engine;
use crate::pipeline::spec::*;

fn spec() -> PipelineSpec {
    crate::config::pipeline_from_toml(
        r#"name = "balances"
topics = ["payments/#"]
format = "delimited"
event_id = "0"
key = "1"
value = "2"
aggregate = "sum"
output_topic = "balances/{key}"
max_key_len = 64
max_keys = 1000"#,
    )
    .unwrap()
}

fn rec(offset: u64, payload: &str) -> Record {
    Record {
        offset,
        received_at_ms: 1000 + offset,
        topic: "payments/x".into(),
        payload: payload.as_bytes().to_vec(),
        qos: 1,
        retain: false,
    }
}

#[test]
fn commit_advances_progress() {
    let dir = tempfile::tempdir().unwrap();
    let sync = TestSync::new();
    let store = Store::open(&dir.path().join("store"), 1 << 20, sync.clone()).unwrap();
    let mut engine = Engine::new(vec![spec()], store.progress().unwrap());
    engine.apply(&store, &rec(0, "E1/A/5")).unwrap();
    let before = sync.file_syncs();
    let cp = engine.take_checkpoint();
    let info = store.commit(&cp, 0).unwrap();
    assert!(sync.file_syncs() > before, "commit must fsync the db file");
    assert_eq!((info.id, info.prev_offset, info.next_offset), (1, 0, 1));
    let p = store.progress().unwrap();
    assert_eq!(p.next_offset, 1);
    assert_eq!(p.checkpoint_id, 1);
    engine.apply(&store, &rec(1, "E2/A/7")).unwrap();
    let info = store.commit(&engine.take_checkpoint(), 0).unwrap();
    assert_eq!((info.id, info.prev_offset, info.next_offset), (2, 1, 2));
    assert_eq!(store.checkpoints().count(), 2);
    drop(store);
    let store = Store::open(&dir.path().join("store"), 1 << 20, fsio::real()).unwrap();
    assert_eq!(store.progress().unwrap().next_offset, 2);
    let st: Vec<_> = store.states(None).map(|r| r.unwrap()).collect();
    assert_eq!(st.len(), 1);
    assert_eq!(st[0].2.value_json(), serde_json::json!(12));
    assert_eq!(st[0].2.version, 2);
}

#[test]
fn outbox_insert_is_idempotent_by_id() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), 1 << 20, fsio::real()).unwrap();
    let mut engine = Engine::new(vec![spec()], store.progress().unwrap());
    engine.apply(&store, &rec(0, "E1/A/5")).unwrap();
    let mut cp = engine.take_checkpoint();
    assert_eq!(cp.batch.outputs.len(), 1);
    let dup = cp.batch.outputs[0].clone();
    cp.batch.outputs.push((dup.0 + 1, dup.1.clone()));
    store.commit(&cp, 0).unwrap();
    assert_eq!(store.outbox_len(), 1);
    // The same ID again in a later checkpoint: still waiting, so not inserted again.
    engine.apply(&store, &rec(1, "E2/B/1")).unwrap();
    let mut cp = engine.take_checkpoint();
    let again = (cp.batch.outputs[0].0 + 1, dup.1.clone());
    cp.batch.outputs.push(again);
    store.commit(&cp, 0).unwrap();
    assert_eq!(
        store.outbox_len(),
        2,
        "B/1 went in, A/1 did not go in twice"
    );
    let ids: Vec<String> = store.outbox_from(0).map(|r| r.unwrap().1.id).collect();
    assert_eq!(ids, ["balances/A/1", "balances/B/1"]);
    let (seq, out) = store.outbox_from(0).next().unwrap().unwrap();
    assert_eq!(out.id, "balances/A/1");
    store.outbox_delete(seq, &out.id).unwrap();
    assert_eq!(store.outbox_len(), 1);
}

#[test]
fn incomplete_sled_snapshots_are_removed_before_open() {
    let dir = tempfile::tempdir().unwrap();
    drop(Store::open(dir.path(), 1 << 20, fsio::real()).unwrap());
    let junk = dir.path().join("snap.00000000000000AB.generating");
    std::fs::write(&junk, b"half a snapshot").unwrap();
    Store::open(dir.path(), 1 << 20, fsio::real()).unwrap();
    assert!(!junk.exists());
}

#[test]
fn a_failed_fsync_fails_the_commit() {
    let dir = tempfile::tempdir().unwrap();
    let sync = TestSync::new();
    let store = Store::open(dir.path(), 1 << 20, sync.clone()).unwrap();
    let mut engine = Engine::new(vec![spec()], store.progress().unwrap());
    engine.apply(&store, &rec(0, "E1/A/5")).unwrap();
    let cp = engine.take_checkpoint();
    sync.fail.store(true, std::sync::atomic::Ordering::SeqCst);
    assert!(store.commit(&cp, 0).is_err());
}

mod ledger_model {
    use super::*;
    use crate::pipeline::memory::MemState;
    use proptest::prelude::*;

    fn spec_with_window(window_ms: u64) -> PipelineSpec {
        let mut s = spec();
        s.dedup_window_ms = window_ms;
        s.max_keys = 1_000_000;
        s
    }

    #[derive(Debug, Clone)]
    enum Op {
        /// Event with ID `E{n}` after the log clock moves on by `dt` ms.
        Event(u8, u64),
        Checkpoint,
        Reopen,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            8 => (0u8..40, prop_oneof![Just(0u64), 0u64..30, 500u64..3000]).prop_map(|(n, dt)| Op::Event(n, dt)),
            2 => Just(Op::Checkpoint),
            1 => Just(Op::Reopen),
        ]
    }

    /// The same records through an engine over the sled store (chunked ledger, fingerprint
    /// index, chunk expiry, reopened now and then) and an engine over a plain map: every
    /// decision must be the same, and the ledger must hold every unexpired entry.
    fn check(ops: &[Op], window_ms: u64, bounds: StoreBounds) -> Result<(), TestCaseError> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("store");
        let mut store = Store::open_with(&path, 1 << 20, fsio::real(), bounds).unwrap();
        let specs = vec![spec_with_window(window_ms)];
        let mut e_store = Engine::new(specs.clone(), store.progress().unwrap());
        let mut mem = MemState::default();
        let mut e_mem = Engine::new(specs, mem.progress.clone());
        let (mut offset, mut clock) = (0u64, 1_000_000u64);
        for op in ops {
            match op {
                Op::Event(n, dt) => {
                    clock += dt;
                    let r = Record {
                        offset,
                        received_at_ms: clock,
                        topic: "payments/x".into(),
                        payload: format!("E{n}/K{}/1", n % 3).into_bytes(),
                        qos: 1,
                        retain: false,
                    };
                    offset += 1;
                    let a = e_store.apply(&store, &r).unwrap();
                    let b = e_mem.apply(&mem, &r).unwrap();
                    prop_assert_eq!(a, b, "record {} (E{}, t={})", r.offset, n, clock);
                }
                Op::Checkpoint => {
                    if e_store.pending_records() > 0 {
                        store.commit(&e_store.take_checkpoint(), 0).unwrap();
                        mem.commit(&e_mem.take_checkpoint());
                        let cutoff = clock.saturating_sub(window_ms);
                        let live: std::collections::BTreeSet<_> = mem
                            .dedup
                            .iter()
                            .map(|((_, id), t)| (id.clone(), *t))
                            .collect();
                        let held: std::collections::BTreeSet<_> = store
                            .dedup_entries(None)
                            .map(|r| r.unwrap())
                            .map(|(_, id, t)| (id, t))
                            .collect();
                        prop_assert!(held.is_superset(&live), "an unexpired entry is missing");
                        prop_assert!(
                            held.difference(&live).all(|(_, t)| *t <= cutoff),
                            "only expired entries may linger"
                        );
                        prop_assert_eq!(store.dedup_len("balances"), held.len() as u64);
                        prop_assert!(
                            store.bound_figures().ledger_index_bytes
                                <= bounds.ledger_index_max_bytes,
                            "the index outgrew its bound"
                        );
                    }
                }
                Op::Reopen => {
                    // Uncommitted work is lost, as in a crash: both engines start again
                    // from the last checkpoint, and the log offset with them.
                    drop(store);
                    store = Store::open_with(&path, 1 << 20, fsio::real(), bounds).unwrap();
                    let specs = vec![spec_with_window(window_ms)];
                    e_store = Engine::new(specs.clone(), store.progress().unwrap());
                    e_mem = Engine::new(specs, mem.progress.clone());
                    offset = store.progress().unwrap().next_offset;
                }
            }
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

        #[test]
        fn the_chunked_ledger_answers_like_a_map(
            ops in proptest::collection::vec(op(), 1..300),
            window_ms in prop_oneof![Just(1u64), 10u64..100, 1000u64..5000],
        ) {
            check(&ops, window_ms, StoreBounds::default())?;
        }

        /// The same with an index bound so small that most chunks stay unindexed: lookups
        /// read them, and every decision is still the map's (issue 10: exactly-once holds
        /// when the bound is hit).
        #[test]
        fn a_ledger_over_its_index_bound_still_answers_like_a_map(
            ops in proptest::collection::vec(op(), 1..300),
            window_ms in prop_oneof![Just(1u64), 10u64..100, 1000u64..5000],
            index_max in prop_oneof![Just(0u64), Just(300u64), Just(400u64), Just(1024u64)],
        ) {
            let bounds = StoreBounds { ledger_index_max_bytes: index_max, ..StoreBounds::default() };
            check(&ops, window_ms, bounds)?;
        }
    }

    #[test]
    fn a_large_ledger_spans_many_chunks_and_survives_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("store");
        let store = Store::open(&path, 1 << 20, fsio::real()).unwrap();
        let mut s = spec_with_window(u64::MAX / 2);
        s.max_keys = 10;
        let mut engine = Engine::new(vec![s.clone()], store.progress().unwrap());
        for i in 0..5_000u64 {
            let payload = format!("event-{i:06}-{}/A/1", "x".repeat((i % 97) as usize));
            engine.apply(&store, &rec(i, &payload)).unwrap();
        }
        store.commit(&engine.take_checkpoint(), 0).unwrap();
        assert_eq!(store.dedup_len("balances"), 5_000);
        drop(store);
        let store = Store::open(&path, 1 << 20, fsio::real()).unwrap();
        assert_eq!(store.dedup_len("balances"), 5_000);
        let chunks = store.dedup.len();
        assert!(chunks >= 10, "{chunks} chunks");
        // sled writes a leaf node as one item and puts items over 128 KiB in blob files it
        // never fsyncs: the chunks must be small enough that no node gets there.
        store.sync().unwrap();
        let blobs = std::fs::read_dir(path.join("blobs")).map_or(0, |d| d.count());
        assert_eq!(blobs, 0, "sled wrote blob files");
        let mut engine = Engine::new(vec![s], store.progress().unwrap());
        for i in (0..5_000u64).step_by(7) {
            let payload = format!("event-{i:06}-{}/A/1", "x".repeat((i % 97) as usize));
            let o = engine.apply(&store, &rec(5_000 + i, &payload)).unwrap();
            assert_eq!(
                o,
                vec![crate::pipeline::engine::Outcome::Duplicate],
                "event {i}"
            );
        }
    }
}

#[test]
fn a_store_of_another_layout_is_refused_not_misread() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), 1 << 20, fsio::real()).unwrap();
    let mut engine = Engine::new(vec![spec()], store.progress().unwrap());
    engine.apply(&store, &rec(0, "E1/A/5")).unwrap();
    store.commit(&engine.take_checkpoint(), 0).unwrap();
    // A format-1 store has a progress record and no format record.
    store.meta.remove(FORMAT_KEY).unwrap();
    store.sync().unwrap();
    drop(store);
    let err = Store::open(dir.path(), 1 << 20, fsio::real())
        .err()
        .unwrap();
    assert!(matches!(err, StoreError::Format { found: 1, .. }), "{err}");
    assert!(err.to_string().contains("rebuilt from the log"), "{err}");
}

#[test]
fn expired_ledger_chunks_are_dropped_so_the_ledger_stays_bounded() {
    // Invariant 7 for the dedup ledger: it holds about one window of entries, not history.
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), 1 << 20, fsio::real()).unwrap();
    let mut s = spec();
    s.dedup_window_ms = 100;
    let mut engine = Engine::new(vec![s], store.progress().unwrap());
    let mut offset = 0;
    for cp in 0..20u64 {
        for i in 0..50u64 {
            let r = Record {
                offset,
                received_at_ms: 1_000_000 + cp * 1_000 + i,
                topic: "payments/x".into(),
                payload: format!("E{cp}-{i}/A/1").into_bytes(),
                qos: 1,
                retain: false,
            };
            engine.apply(&store, &r).unwrap();
            offset += 1;
        }
        store.commit(&engine.take_checkpoint(), 0).unwrap();
    }
    // Every earlier checkpoint's entries are at least 900 ms older than the window allows.
    assert_eq!(store.dedup_len("balances"), 50);
    let ids: std::collections::BTreeSet<String> =
        store.dedup_entries(None).map(|r| r.unwrap().1).collect();
    assert_eq!(ids.len(), 50);
    assert!(ids.iter().all(|id| id.starts_with("E19-")), "{ids:?}");
    assert_eq!(
        store.progress().unwrap().pipelines[0].dedup_entries,
        50,
        "the checkpoint records the ledger size it leaves"
    );
}

/// Keys and values of one tree, walked.
pub(super) fn tree_bytes(tree: &sled::Tree) -> u64 {
    tree.iter()
        .map(|kv| kv.map(|(k, v)| (k.len() + v.len()) as u64).unwrap())
        .sum()
}

/// Keys and values of every checkpoint tree, walked.
fn walked_bytes(store: &Store) -> u64 {
    store.trees().into_iter().map(tree_bytes).sum()
}

#[test]
fn the_live_data_estimate_counts_ledger_and_outbox_as_they_change_and_matches_a_walk() {
    // The agent's estimate no longer walks the ledger and the outbox (issue 16): their byte
    // counts must follow chunks added, expired, acknowledged and superseded, and a reopen.
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), 1 << 20, fsio::real()).unwrap();
    let mut s = spec();
    s.dedup_window_ms = 2_500;
    let mut engine = Engine::new(vec![s], store.progress().unwrap());
    let mut offset = 0;
    for cp in 0..12u64 {
        for i in 0..40u64 {
            let payload = format!("E{cp}-{i}/K{}/1", (cp * 7 + i) % 30);
            let r = rec(offset, &payload);
            let r = Record {
                received_at_ms: 1_000_000 + cp * 1_000 + i,
                ..r
            };
            engine.apply(&store, &r).unwrap();
            offset += 1;
        }
        store.commit(&engine.take_checkpoint(), 0).unwrap();
        // Acknowledge a few results now and then, as the publisher does.
        let waiting: Vec<_> = store.outbox_from(0).take(7).map(Result::unwrap).collect();
        for (seq, out) in waiting.iter().filter(|_| cp % 3 == 1) {
            store.outbox_delete(*seq, &out.id).unwrap();
        }
        assert_eq!(
            store.live_bytes().unwrap(),
            walked_bytes(&store),
            "after checkpoint {cp}"
        );
    }
    assert!(
        store.dedup_len("balances") < 12 * 40,
        "chunks expired on the way"
    );
    let before = store.live_bytes().unwrap();
    drop(store);
    let store = Store::open(dir.path(), 1 << 20, fsio::real()).unwrap();
    assert_eq!(store.live_bytes().unwrap(), before, "rebuilt at open");
    assert_eq!(walked_bytes(&store), before);
}

/// Format 2's progress record, written here as a cairn of that layout wrote it.
#[derive(serde::Serialize)]
struct ProgressV2 {
    next_offset: u64,
    checkpoint_id: u64,
    log_clock_ms: u64,
    records: u64,
    unmatched: u64,
    outbox_seq: u64,
    pipelines: Vec<PipelineV2>,
}

#[derive(serde::Serialize)]
struct PipelineV2 {
    name: String,
    max_event_time_ms: u64,
    evicted_below: u64,
    keys: u64,
    dedup_entries: u64,
    counters: CountersV2,
    definition: String,
    version_base: u64,
    max_version: u64,
}

#[derive(serde::Serialize)]
struct CountersV2 {
    applied: u64,
    duplicates: u64,
    dead_letters: u64,
    outputs: u64,
}

#[test]
fn a_format_2_store_loads_as_generation_1() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), 1 << 20, fsio::real()).unwrap();
    let mut engine = Engine::new(vec![spec()], store.progress().unwrap());
    engine.apply(&store, &rec(0, "E1/A/5")).unwrap();
    store.commit(&engine.take_checkpoint(), 0).unwrap();
    let now = store.progress().unwrap();
    let pp = &now.pipelines[0];
    let old = ProgressV2 {
        next_offset: now.next_offset,
        checkpoint_id: now.checkpoint_id,
        log_clock_ms: now.log_clock_ms,
        records: now.records,
        unmatched: now.unmatched,
        outbox_seq: now.outbox_seq,
        pipelines: vec![PipelineV2 {
            name: pp.name.clone(),
            max_event_time_ms: pp.max_event_time_ms,
            evicted_below: pp.evicted_below,
            keys: pp.keys,
            dedup_entries: pp.dedup_entries,
            counters: CountersV2 {
                applied: pp.counters.applied,
                duplicates: pp.counters.duplicates,
                dead_letters: pp.counters.dead_letters,
                outputs: pp.counters.outputs,
            },
            definition: pp.definition.clone(),
            version_base: pp.version_base,
            max_version: 9,
        }],
    };
    store.meta.insert(PROGRESS_KEY, encode(&old)).unwrap();
    store.meta.insert(FORMAT_KEY, &2u32.to_be_bytes()).unwrap();
    store.sync().unwrap();
    drop(store);

    let store = Store::open(dir.path(), 1 << 20, fsio::real()).unwrap();
    let p = store.progress().unwrap();
    assert_eq!(
        (
            p.next_offset,
            p.pipelines[0].max_version,
            p.pipelines[0].generation
        ),
        (1, 9, 1),
        "read as it was written, in generation 1"
    );
    assert_eq!(
        store.meta.get(FORMAT_KEY).unwrap().unwrap().as_ref(),
        2u32.to_be_bytes(),
        "opening alone does not rewrite it"
    );
    // The first commit writes this build's layout and says so, in the same transaction.
    let mut engine = Engine::new(vec![spec()], p);
    engine.apply(&store, &rec(1, "E2/A/7")).unwrap();
    store.commit(&engine.take_checkpoint(), 0).unwrap();
    drop(store);
    let store = Store::open(dir.path(), 1 << 20, fsio::real()).unwrap();
    assert_eq!(
        store.meta.get(FORMAT_KEY).unwrap().unwrap().as_ref(),
        STORE_FORMAT.to_be_bytes()
    );
    let p = store.progress().unwrap();
    assert_eq!((p.next_offset, p.pipelines[0].generation), (2, 1));
}

fn bad(offset: u64, received_at_ms: u64) -> Record {
    Record {
        offset,
        received_at_ms,
        topic: "payments/x".into(),
        // Distinct bytes: the same bad bytes again would be a duplicate, not a dead letter.
        payload: format!("bad{offset}").into_bytes(),
        qos: 1,
        retain: false,
    }
}

fn dead_offsets(store: &Store) -> Vec<u64> {
    store.dead_letters().map(|d| d.unwrap().offset).collect()
}

#[test]
fn dead_letters_beyond_max_entries_are_pruned_oldest_first_and_counted() {
    let dir = tempfile::tempdir().unwrap();
    let bounds = StoreBounds {
        dead_letters_max_entries: 5,
        ..StoreBounds::default()
    };
    let store = Store::open_with(dir.path(), 1 << 20, fsio::real(), bounds).unwrap();
    let mut engine = Engine::new(vec![spec()], store.progress().unwrap());
    let mut offset = 0;
    for cp in 1..=3u64 {
        for _ in 0..4 {
            engine.apply(&store, &bad(offset, 1_000 + offset)).unwrap();
            offset += 1;
        }
        store.commit(&engine.take_checkpoint(), 0).unwrap();
        let kept = (4 * cp).min(5);
        assert_eq!(store.dead_letter_len() as u64, kept);
        assert_eq!(
            dead_offsets(&store),
            (offset - kept..offset).collect::<Vec<_>>(),
            "the newest are kept"
        );
        let st = store.bound_figures().dead_letters;
        assert_eq!(
            (st.stored, st.pruned_count, st.pruned_age),
            (kept, 4 * cp - kept, 0)
        );
    }
    // One batch larger than the bound: only its newest letters are written at all.
    for _ in 0..8 {
        engine.apply(&store, &bad(offset, 1_000 + offset)).unwrap();
        offset += 1;
    }
    store.commit(&engine.take_checkpoint(), 0).unwrap();
    assert_eq!(
        dead_offsets(&store),
        (offset - 5..offset).collect::<Vec<_>>()
    );
    assert_eq!(store.bound_figures().dead_letters.pruned_count, 15);
    // The counts are durable, with the checkpoint that changed them.
    drop(store);
    let store = Store::open_with(dir.path(), 1 << 20, fsio::real(), bounds).unwrap();
    assert_eq!(
        store.bound_figures().dead_letters,
        DeadLetterStats {
            stored: 5,
            pruned_age: 0,
            pruned_count: 15
        }
    );
    assert_eq!(store.dead_letter_len(), 5);
}

#[test]
fn dead_letters_older_than_max_age_in_record_time_are_pruned_at_a_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let bounds = StoreBounds {
        dead_letters_max_age_ms: 10_000,
        ..StoreBounds::default()
    };
    let store = Store::open_with(dir.path(), 1 << 20, fsio::real(), bounds).unwrap();
    let mut engine = Engine::new(vec![spec()], store.progress().unwrap());
    // Letters received at 0 s, 5 s, 10 s, 15 s (record time).
    for i in 0..4u64 {
        engine
            .apply(&store, &bad(i, 1_000_000 + i * 5_000))
            .unwrap();
    }
    store.commit(&engine.take_checkpoint(), 0).unwrap();
    // A commit prunes what the tree held before it; its own letters wait for the next.
    assert_eq!(dead_offsets(&store), vec![0, 1, 2, 3]);
    // The clock at 25 s: the letters of 0, 5 and 10 s are older than 10 s; 15 s stays.
    engine.apply(&store, &rec(4, "E1/A/5")).unwrap();
    let mut cp = engine.take_checkpoint();
    cp.progress.log_clock_ms = 1_025_000;
    store.commit(&cp, 0).unwrap();
    assert_eq!(dead_offsets(&store), vec![3]);
    let st = store.bound_figures().dead_letters;
    assert_eq!((st.stored, st.pruned_age, st.pruned_count), (1, 3, 0));
}

#[test]
fn dead_letter_pruning_is_the_same_on_replay() {
    // Two stores fed the same records at the same checkpoint boundaries (as replay does)
    // hold the same dead letters and counts: pruning uses record time, not the wall clock.
    let bounds = StoreBounds {
        dead_letters_max_entries: 7,
        dead_letters_max_age_ms: 60_000,
        ..StoreBounds::default()
    };
    let run = || {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open_with(dir.path(), 1 << 20, fsio::real(), bounds).unwrap();
        let mut engine = Engine::new(vec![spec()], store.progress().unwrap());
        for i in 0..60u64 {
            engine
                .apply(&store, &bad(i, 1_000_000 + i * 3_000))
                .unwrap();
            if i % 9 == 8 {
                store.commit(&engine.take_checkpoint(), i).unwrap();
            }
        }
        let letters: Vec<DeadLetter> = store.dead_letters().map(|d| d.unwrap()).collect();
        (letters, store.bound_figures().dead_letters)
    };
    let (a, b) = (run(), run());
    assert_eq!(a, b);
    assert!(a.1.pruned_age + a.1.pruned_count > 0, "{:?}", a.1);
}

#[test]
fn a_dead_letter_with_a_64_kib_topic_is_stored_cut_not_refused() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), 1 << 20, fsio::real()).unwrap();
    let mut engine = Engine::new(vec![spec()], store.progress().unwrap());
    let mut r = bad(0, 1_000);
    r.topic = format!("payments/{}", "t".repeat(65_000));
    engine.apply(&store, &r).unwrap();
    store.commit(&engine.take_checkpoint(), 0).unwrap();
    let d = store.dead_letters().next().unwrap().unwrap();
    assert!(d.topic.len() < 1_000, "{}", d.topic.len());
    assert!(d.topic.starts_with("payments/ttt"), "{}", d.topic);
    assert!(d.topic.ends_with("(65009 bytes)"), "{}", d.topic);
}

#[test]
fn a_value_over_the_entry_bound_is_refused_before_anything_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store");
    let store = Store::open(&path, 1 << 20, fsio::real()).unwrap();
    let mut engine = Engine::new(vec![spec()], store.progress().unwrap());
    engine.apply(&store, &rec(0, "E1/A/5")).unwrap();
    let mut cp = engine.take_checkpoint();
    // A 200 KB event ID (issue 10 found one in a ledger chunk, which sled put in a blob).
    cp.batch
        .dedup
        .insert(0, "balances", &"x".repeat(200_000), 1_000);
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| store.commit(&cp, 0)));
    match result {
        // Debug builds: the assertion names the bug.
        Err(panic) => {
            let debug = cfg!(debug_assertions);
            assert!(debug, "release builds return the error, never panic");
            let msg = panic.downcast_ref::<String>().cloned().unwrap_or_default();
            assert!(msg.contains("dedup entry of"), "{msg}");
        }
        // Release builds: a typed error.
        Ok(r) => {
            let err = r.expect_err("the commit must be refused");
            assert!(
                matches!(err, StoreError::TooLarge { tree: "dedup", .. }),
                "{err}"
            );
        }
    }
    assert_eq!(
        store.progress().unwrap().checkpoint_id,
        0,
        "nothing committed"
    );
    assert_eq!(
        store.state.len() + store.dedup.len() + store.outbox.len(),
        0
    );
    drop(store);
    let blobs = std::fs::read_dir(path.join("blobs")).map_or(0, |d| d.count());
    assert_eq!(blobs, 0, "sled wrote a blob file");
}

#[test]
fn bounded_helper_passes_values_at_the_bound_and_refuses_one_byte_more() {
    let key = [0u8; 24];
    let at = vec![1u8; MAX_ENTRY_BYTES - key.len()];
    assert_eq!(bounded("state", &key, at.clone()).unwrap(), at);
    let meta = vec![1u8; MAX_META_BYTES - PROGRESS_KEY.len()];
    assert!(bounded("meta", PROGRESS_KEY, meta).is_ok());
    if !cfg!(debug_assertions) {
        let over = vec![1u8; MAX_ENTRY_BYTES - key.len() + 1];
        assert!(matches!(
            bounded("state", &key, over),
            Err(StoreError::TooLarge { .. })
        ));
    }
}

/// 512 bytes of ledger index: the unit tests' directory (256 bytes) and about fifty
/// entries; their chunks hold 8. Most chunks go unindexed, and lookups read them.
fn tiny_ledger_index() -> StoreBounds {
    StoreBounds {
        ledger_index_max_bytes: 512,
        ..StoreBounds::default()
    }
}

/// Event `E<id>` of one unit to key `A`, at log offset `offset` (record time 1,000,000 ms on).
fn id_event(offset: u64, id: u64) -> Record {
    Record {
        offset,
        received_at_ms: 1_000_000 + offset,
        topic: "payments/x".into(),
        payload: format!("E{id}/A/1").into_bytes(),
        qos: 1,
        retain: false,
    }
}

/// A store at `path` with [`tiny_ledger_index`] that has committed events `E0`..`E<n-1>`
/// ([`id_event`]), 50 a checkpoint; with the spec and the engine that applied them.
fn ids_past_a_tiny_index(path: &std::path::Path, n: u64) -> (Store, PipelineSpec, Engine) {
    let store = Store::open_with(path, 1 << 20, fsio::real(), tiny_ledger_index()).unwrap();
    let mut s = spec();
    s.dedup_window_ms = 1_000_000;
    let mut engine = Engine::new(vec![s.clone()], store.progress().unwrap());
    for i in 0..n {
        engine.apply(&store, &id_event(i, i)).unwrap();
        if i % 50 == 49 {
            store.commit(&engine.take_checkpoint(), 0).unwrap();
        }
    }
    (store, s, engine)
}

#[test]
fn a_full_ledger_index_leaves_chunks_unindexed_and_still_finds_every_duplicate() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store");
    let bounds = tiny_ledger_index();
    let (store, s, _) = ids_past_a_tiny_index(&path, 400);
    let f = store.bound_figures();
    assert!(
        f.ledger_index_bytes <= 512 && f.ledger_index_bytes > 256,
        "{f:?}"
    );
    assert!(f.ledger_unindexed_chunks >= 40, "{f:?}");
    assert_eq!(store.dedup_len("balances"), 400);
    drop(store);
    // After a reopen too: every ID is a duplicate, a new one is not.
    let store = Store::open_with(&path, 1 << 20, fsio::real(), bounds).unwrap();
    assert!(store.bound_figures().ledger_index_bytes <= 512);
    let mut engine = Engine::new(vec![s], store.progress().unwrap());
    let dup = vec![crate::pipeline::engine::Outcome::Duplicate];
    for i in 0..400u64 {
        assert_eq!(
            engine.apply(&store, &id_event(400 + i, i)).unwrap(),
            dup,
            "E{i}"
        );
    }
    let fresh = engine.apply(&store, &id_event(800, 10_000)).unwrap();
    assert_ne!(fresh, dup);
}

/// A checkpoint's ledger chunks are written before its transaction (`commit.rs`). If the
/// transaction never runs (a crash between the two), the chunks answer for no lookup, and
/// the next open deletes them: kept, they would make the same IDs duplicates when replay
/// (of other records, after a config edit) accepts them again. Lookups here read the
/// chunks' groups from the tree, as a full index makes them: the newest group's open key
/// range holds the uncommitted chunks.
#[test]
fn ledger_chunks_of_a_checkpoint_that_never_committed_answer_nothing_and_go_at_open() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store");
    let bounds = tiny_ledger_index();
    let (store, s, mut engine) = ids_past_a_tiny_index(&path, 100);
    assert!(store.bound_figures().ledger_unindexed_chunks > 0);
    for i in 100..150u64 {
        engine.apply(&store, &id_event(i, i)).unwrap();
    }
    let cp = engine.take_checkpoint();
    assert_eq!(cp.progress.checkpoint_id, 3);
    let fresh = store.ledger_fresh(&cp).unwrap();
    store.write_chunks(&fresh.chunks).unwrap();
    // The crash: no transaction.
    let seen = |store: &Store, id: &str| ReadState::dedup(store, "balances", id).unwrap();
    assert_eq!(seen(&store, "E120"), None, "an uncommitted chunk answered");
    assert_eq!(seen(&store, "E10"), Some(1_000_010));
    drop(store);
    let store = Store::open_with(&path, 1 << 20, fsio::real(), bounds).unwrap();
    let ids: Vec<u64> = store
        .dedup
        .iter()
        .keys()
        .map(|k| {
            let k = k.unwrap();
            ledger::chunk_checkpoint(&k[b"balances".len() + 1..]).unwrap()
        })
        .collect();
    assert!(ids.iter().all(|&id| id <= 2), "left at open: {ids:?}");
    assert_eq!(store.dedup_len("balances"), 100);
    assert_eq!(seen(&store, "E120"), None);
    // Replay after a config edit that takes fewer of the records: it accepts E100..E119
    // again, and its checkpoint, with the same ID, records only them. Chunks left from
    // before would now count as committed, E120..E149 with them.
    let mut engine = Engine::new(vec![s], store.progress().unwrap());
    for i in 100..120u64 {
        let out = engine.apply(&store, &id_event(i, i)).unwrap();
        assert_ne!(
            out,
            vec![crate::pipeline::engine::Outcome::Duplicate],
            "E{i}"
        );
    }
    let cp = engine.take_checkpoint();
    assert_eq!(cp.progress.checkpoint_id, 3);
    store.commit(&cp, 0).unwrap();
    assert_eq!(seen(&store, "E110"), Some(1_000_110));
    assert_eq!(
        seen(&store, "E140"),
        None,
        "a chunk of the crashed checkpoint answered"
    );
    assert_eq!(store.dedup_len("balances"), 120);
}

#[test]
fn room_freed_by_expiry_indexes_the_unindexed_chunks_again() {
    let dir = tempfile::tempdir().unwrap();
    // The unit tests' directory (256 bytes) and a few dozen entries.
    let bounds = StoreBounds {
        ledger_index_max_bytes: 400,
        ..StoreBounds::default()
    };
    let store = Store::open_with(dir.path(), 1 << 20, fsio::real(), bounds).unwrap();
    let mut s = spec();
    s.dedup_window_ms = 100;
    s.max_keys = 100_000;
    let mut engine = Engine::new(vec![s], store.progress().unwrap());
    let mut offset = 0;
    let mut commit_at = |engine: &mut Engine, at: u64, n: u64| {
        for i in 0..n {
            let r = Record {
                offset,
                received_at_ms: at + i,
                topic: "payments/x".into(),
                payload: format!("E{offset}/A/1").into_bytes(),
                qos: 1,
                retain: false,
            };
            engine.apply(&store, &r).unwrap();
            offset += 1;
        }
        store.commit(&engine.take_checkpoint(), 0).unwrap();
        store.bound_figures()
    };
    let full = commit_at(&mut engine, 1_000_000, 60);
    assert!(full.ledger_unindexed_chunks > 0, "{full:?}");
    // Much later: the 60 expire chunk by chunk, and a few new entries fit in the index.
    let mut f = full;
    for k in 1..=10u64 {
        f = commit_at(&mut engine, 2_000_000 + k * 1_000, 2);
    }
    assert_eq!(f.ledger_unindexed_chunks, 0, "{f:?}");
    assert!(f.ledger_index_bytes <= 400);
}

/// The ledger through the store's own API (no engine), against a plain map: random inserts,
/// lookups, checkpoints with expiry, reopens, pipelines going dormant and coming back, in
/// a store whose index bound ranges from nothing to plenty (issue 33).
pub(super) mod ledger_oracle {
    use super::*;
    use crate::model::PipelineProgress;
    use crate::pipeline::engine::{Batch, Checkpoint};
    use proptest::prelude::*;
    use std::collections::{BTreeMap, HashMap};

    const PIPELINES: [&str; 3] = ["a", "b", "c"];
    /// Each pipeline's window (ms).
    const WINDOWS: [u64; 3] = [40, 400, 4_000];

    /// A lookup's answer `got` is the map's `want`, or an entry the map forgot: only an
    /// expired one (at `clock`, by `window`), which decides nothing, may outlive it.
    pub(in crate::store) fn same_answer(
        got: Option<u64>,
        want: Option<u64>,
        (clock, window): (u64, u64),
        what: impl Fn() -> String,
    ) -> Result<(), TestCaseError> {
        match (got, want) {
            (g, w) if g == w => {}
            (Some(g), None) => prop_assert!(
                clock.saturating_sub(g) >= window,
                "{}: the store found {g}, which is not expired at {clock}",
                what()
            ),
            (g, w) => prop_assert!(false, "{}: store {g:?}, map {w:?}", what()),
        }
        Ok(())
    }

    #[derive(Debug, Clone)]
    enum Op {
        /// Pipeline, event ID, milliseconds the clock moves on first.
        Event(usize, u16, u64),
        Checkpoint,
        Reopen,
        /// The pipeline goes dormant (not configured), or comes back.
        Toggle(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            20 => (0usize..3, 0u16..120, prop_oneof![Just(0u64), 0u64..20, 100u64..1_000])
                .prop_map(|(p, n, dt)| Op::Event(p, n, dt)),
            4 => Just(Op::Checkpoint),
            1 => Just(Op::Reopen),
            1 => (0usize..3).prop_map(Op::Toggle),
        ]
    }

    struct World {
        path: std::path::PathBuf,
        bounds: StoreBounds,
        store: Store,
        clock: u64,
        checkpoint_id: u64,
        configured: [bool; 3],
        /// Committed: (pipeline, ID) → newest record time.
        oracle: HashMap<(usize, String), u64>,
        /// This checkpoint's entries, not yet committed.
        batch: BTreeMap<(usize, String), u64>,
        /// Pipelines the store has seen configured at a commit (it knows their windows).
        recorded: [bool; 3],
    }

    impl World {
        fn open(path: &std::path::Path, bounds: StoreBounds) -> Store {
            Store::open_with(path, 1 << 20, fsio::real(), bounds).unwrap()
        }

        /// The cutoff the store applies to pipeline `p` at this clock, if any.
        fn cutoff(&self, p: usize) -> Option<u64> {
            if !self.configured[p] && !self.recorded[p] {
                return None;
            }
            self.clock.checked_sub(WINDOWS[p])
        }

        fn event(&mut self, p: usize, n: u16) -> Result<(), TestCaseError> {
            let id = format!("E{n}");
            let key = (p, id.clone());
            let want = self
                .batch
                .get(&key)
                .or_else(|| self.oracle.get(&key))
                .copied();
            let got = match self.batch.get(&key) {
                Some(&t) => Some(t),
                None => self.store.dedup(PIPELINES[p], &id).unwrap(),
            };
            same_answer(got, want, (self.clock, WINDOWS[p]), || {
                format!("{}/{id}", PIPELINES[p])
            })?;
            if want.is_none_or(|t| self.clock - t >= WINDOWS[p]) {
                self.batch.insert(key, self.clock);
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
                if self.configured[p] {
                    batch.dedup_windows.push((PIPELINES[p].into(), WINDOWS[p]));
                    if let Some(c) = self.clock.checked_sub(WINDOWS[p]) {
                        batch
                            .dedup_expired_at_or_before
                            .push((PIPELINES[p].into(), c));
                    }
                    self.recorded[p] = true;
                }
            }
            let progress = Progress {
                checkpoint_id: self.checkpoint_id,
                log_clock_ms: self.clock,
                pipelines: PIPELINES
                    .iter()
                    .map(|n| PipelineProgress {
                        name: n.to_string(),
                        ..Default::default()
                    })
                    .collect(),
                ..Progress::default()
            };
            self.store
                .commit(&Checkpoint { progress, batch }, 0)
                .unwrap();
            let cutoffs: Vec<Option<u64>> = (0..3).map(|p| self.cutoff(p)).collect();
            self.oracle
                .retain(|(p, _), t| cutoffs[*p].is_none_or(|c| *t > c));
            // Every live entry is held; what else is held has expired.
            let held: HashMap<(usize, String), u64> = self
                .store
                .dedup_entries(None)
                .map(Result::unwrap)
                .map(|(p, id, t)| ((PIPELINES.iter().position(|n| *n == p).unwrap(), id), t))
                .fold(HashMap::new(), |mut m, (k, t)| {
                    let e = m.entry(k).or_insert(t);
                    *e = (*e).max(t);
                    m
                });
            for (k, t) in &self.oracle {
                prop_assert_eq!(held.get(k), Some(t), "{:?} missing", k);
            }
            for ((p, id), t) in &held {
                if self.oracle.get(&(*p, id.clone())) != Some(t) {
                    prop_assert!(
                        cutoffs[*p].is_some_and(|c| *t <= c),
                        "{}/{id} at {t} kept",
                        PIPELINES[*p]
                    );
                }
            }
            let f = self.store.bound_figures();
            prop_assert!(f.ledger_index_bytes <= self.bounds.ledger_index_max_bytes);
            Ok(())
        }

        /// Checkpoints with nothing new until every expired entry is gone: expiry, a
        /// dormant pipeline's too, gets there in bounded steps.
        fn drain_expired(&mut self) -> Result<(), TestCaseError> {
            for _ in 0..500 {
                self.checkpoint()?;
                let held = self.store.dedup_entries(None).count();
                if held == self.oracle.len() {
                    return Ok(());
                }
            }
            prop_assert!(false, "expired entries never went");
            Ok(())
        }
    }

    fn run(ops: &[Op], bound: u64) -> Result<(), TestCaseError> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("store");
        let bounds = StoreBounds {
            ledger_index_max_bytes: bound,
            ..StoreBounds::default()
        };
        let mut w = World {
            store: World::open(&path, bounds),
            path,
            bounds,
            clock: 1_000_000,
            checkpoint_id: 0,
            configured: [true; 3],
            oracle: HashMap::new(),
            batch: BTreeMap::new(),
            recorded: [false; 3],
        };
        for op in ops {
            match *op {
                Op::Event(p, n, dt) => {
                    w.clock += dt;
                    if w.configured[p] {
                        w.event(p, n)?;
                    }
                }
                Op::Checkpoint => w.checkpoint()?,
                Op::Reopen => {
                    // Uncommitted entries are lost, as in a crash.
                    w.batch.clear();
                    drop(std::mem::replace(&mut w.store, tempfile_store()));
                    w.store = World::open(&w.path, w.bounds);
                    w.checkpoint_id = w.store.progress().unwrap().checkpoint_id;
                }
                Op::Toggle(p) => {
                    // A pipeline's batch entries go with the checkpoint before it changes.
                    w.checkpoint()?;
                    w.configured[p] = !w.configured[p];
                }
            }
        }
        // Long after: every pipeline's window has passed, dormant ones' too.
        w.clock += 10 * WINDOWS[2];
        w.drain_expired()
    }

    /// A throwaway store to hold while the real one is reopened.
    fn tempfile_store() -> Store {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("s"), 1 << 20, fsio::real()).unwrap();
        std::mem::forget(dir);
        store
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

        #[test]
        fn the_ledger_answers_like_a_map_with_dormant_pipelines_and_any_bound(
            ops in proptest::collection::vec(op(), 1..400),
            bound in prop_oneof![Just(0u64), 300u64..600, Just(64u64 << 20)],
        ) {
            run(&ops, bound)?;
        }
    }
}

#[test]
fn expiry_keeps_up_with_full_checkpoints() {
    // Checkpoints of 2,000 entries are 250 of the unit tests' chunks (8 entries each), far
    // more than a fixed number expired per checkpoint (64 before issue 33, which at 20,000
    // records of 24-byte IDs, 177 chunks, let the ledger grow by 113 chunks a checkpoint).
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), 1 << 20, fsio::real()).unwrap();
    let mut s = spec();
    s.dedup_window_ms = 2_000;
    s.max_keys = 100_000;
    let mut engine = Engine::new(vec![s], store.progress().unwrap());
    let mut offset = 0;
    for cp in 0..12u64 {
        for i in 0..2_000u64 {
            let r = Record {
                offset,
                received_at_ms: 1_000_000 + offset,
                topic: "payments/x".into(),
                payload: format!("E{offset}/K{}/1", i % 50).into_bytes(),
                qos: 1,
                retain: false,
            };
            engine.apply(&store, &r).unwrap();
            offset += 1;
        }
        store.commit(&engine.take_checkpoint(), 0).unwrap();
        // One window of entries, and at most the group straddling the cutoff more.
        let held = store.dedup_len("balances");
        assert!(held <= 2_000 + 64, "checkpoint {cp}: {held} entries held");
    }
}

#[test]
fn a_dormant_pipelines_ledger_expires_by_its_own_window() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store");
    let store = Store::open(&path, 1 << 20, fsio::real()).unwrap();
    let mut a = spec();
    a.dedup_window_ms = 1_000;
    let mut b = spec();
    b.name = "audit".into();
    b.dedup_window_ms = 50_000;
    let mut offset = 0;
    let mut apply = |engine: &mut Engine, store: &Store, at: u64| {
        let r = Record {
            offset,
            received_at_ms: at,
            topic: "payments/x".into(),
            payload: format!("E{offset}/A/1").into_bytes(),
            qos: 1,
            retain: false,
        };
        offset += 1;
        engine.apply(store, &r).unwrap();
    };
    let mut engine = Engine::new(vec![a.clone(), b.clone()], store.progress().unwrap());
    for i in 0..100 {
        apply(&mut engine, &store, 1_000_000 + i);
    }
    store.commit(&engine.take_checkpoint(), 0).unwrap();
    assert_eq!(store.dedup_len("audit"), 100);
    drop((engine, store));

    // `audit` is no longer configured: the store keeps expiring it by its 50 s window on the
    // log clock, across a reopen, a bounded number of groups per checkpoint.
    let store = Store::open(&path, 1 << 20, fsio::real()).unwrap();
    let mut engine = Engine::new(vec![a], store.progress().unwrap());
    let commit_at = |engine: &mut Engine,
                     store: &Store,
                     at: u64,
                     apply: &mut dyn FnMut(&mut Engine, &Store, u64)| {
        apply(engine, store, at);
        store.commit(&engine.take_checkpoint(), 0).unwrap();
    };
    commit_at(&mut engine, &store, 1_040_000, &mut apply);
    assert_eq!(store.dedup_len("audit"), 100, "within its window: kept");
    assert!(
        store.dedup_len("balances") < 100,
        "the configured one expires by its own 1 s window"
    );
    let mut checkpoints = 0;
    while store.dedup_len("audit") > 0 {
        commit_at(&mut engine, &store, 1_060_000 + checkpoints, &mut apply);
        checkpoints += 1;
        assert!(checkpoints < 100, "the dormant ledger never expired");
    }
    assert!(checkpoints > 1, "bounded work: a few groups per checkpoint");
    let progress = store.progress().unwrap();
    let audit = progress
        .pipelines
        .iter()
        .find(|p| p.name == "audit")
        .unwrap();
    assert_eq!(audit.dedup_entries, 0, "the progress record says so too");

    // Back again with its definition: its window starts over, nothing old is a duplicate.
    let mut engine = Engine::new(vec![spec(), b], store.progress().unwrap());
    let dups = (0..3)
        .map(|i| {
            let r = Record {
                offset: 100_000 + i,
                received_at_ms: 1_070_000,
                topic: "payments/x".into(),
                payload: b"E5/A/1".to_vec(),
                qos: 1,
                retain: false,
            };
            engine.apply(&store, &r).unwrap()
        })
        .collect::<Vec<_>>();
    assert_ne!(dups[0][1], crate::pipeline::engine::Outcome::Duplicate);
    assert_eq!(dups[1][1], crate::pipeline::engine::Outcome::Duplicate);
}

#[test]
fn a_savepoint_write_reports_its_progress_so_the_watchdog_can_be_fed() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("store"), 1 << 20, fsio::real()).unwrap();
    let mut engine = Engine::new(vec![spec()], store.progress().unwrap());
    // Enough keys (state entries, dedup entries, outputs) for a few reports.
    let n = 3 * SAVEPOINT_PROGRESS_EVERY;
    for i in 0..n {
        engine
            .apply(&store, &rec(i, &format!("E{i}/K{i}/1")))
            .unwrap();
    }
    store.commit(&engine.take_checkpoint(), 0).unwrap();
    let mut reports = Vec::new();
    let info = store
        .write_savepoint_with(&dir.path().join("sp"), &fsio::real(), &mut |n| {
            reports.push(n)
        })
        .unwrap();
    assert!(info.entries >= n, "{}", info.entries);
    assert_eq!(
        reports.len() as u64,
        info.entries / SAVEPOINT_PROGRESS_EVERY,
        "one report every {SAVEPOINT_PROGRESS_EVERY} entries: {reports:?}"
    );
    assert!(reports.windows(2).all(|w| w[0] < w[1]), "{reports:?}");
}

/// Issue 31: Sparkplug sessions are committed with the checkpoint, read back after a
/// reopen (a DATA resolves with no BIRTH seen in this run), go into a savepoint and come
/// back from it, and go with a pipeline reset.
#[test]
fn sparkplug_sessions_are_checkpointed_savepointed_and_reset_with_their_pipeline() {
    use crate::pipeline::engine::Outcome;
    use crate::pipeline::sparkplug::proto::{Metric, Payload, Value, datatype};
    use prost::Message;
    let spec = crate::config::pipeline_from_toml(
        "name = \"line1\"\ntopics = [\"spBv1.0/#\"]\nformat = \"sparkplug_b\"\n\
         key = \"{edge_node}/{metric}\"\naggregate = \"sum\"\noutput_topic = \"o/{key}\"",
    )
    .unwrap();
    let msg = |offset: u64, topic: &str, seq: u64, metric: Metric| Record {
        offset,
        received_at_ms: 1000 + offset,
        topic: topic.into(),
        payload: Payload {
            timestamp: Some(1000),
            metrics: vec![metric],
            seq: Some(seq),
            uuid: None,
        }
        .encode_to_vec(),
        qos: 1,
        retain: false,
    };
    let metric = |name: Option<&str>, v: u64, ts: u64| Metric {
        name: name.map(String::from),
        alias: Some(5),
        timestamp: Some(ts),
        datatype: Some(datatype::INT64),
        value: Some(Value::Long(v)),
        ..Default::default()
    };
    let mut birth = msg(0, "spBv1.0/g/NBIRTH/n1", 0, metric(Some("Level"), 3, 1000));
    let mut p = Payload::decode(birth.payload.as_slice()).unwrap();
    p.metrics.push(Metric {
        name: Some("bdSeq".into()),
        value: Some(Value::Long(0)),
        ..Default::default()
    });
    birth.payload = p.encode_to_vec();

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store");
    let store = Store::open(&path, 1 << 20, fsio::real()).unwrap();
    let mut engine = Engine::new(vec![spec.clone()], store.progress().unwrap());
    engine.apply(&store, &birth).unwrap();
    store.commit(&engine.take_checkpoint(), 0).unwrap();
    drop(store);

    let store = Store::open(&path, 1 << 20, fsio::real()).unwrap();
    let mut engine = Engine::new(vec![spec.clone()], store.progress().unwrap());
    let data = msg(1, "spBv1.0/g/NDATA/n1", 1, metric(None, 4, 2000));
    let out = engine.apply(&store, &data).unwrap();
    assert!(
        matches!(&out[..], [Outcome::Applied { key, .. }] if key == "n1/Level"),
        "{out:?}"
    );
    store.commit(&engine.take_checkpoint(), 0).unwrap();
    let sessions = store.sparkplug.len();
    assert_eq!(sessions, 4, "node, alias, metric, bdSeq's metric");

    let info = store
        .write_savepoint(&dir.path().join("sp"), &fsio::real())
        .unwrap();
    assert!(info.entries > sessions as u64);
    drop(store);
    let restored = dir.path().join("restored");
    restore_savepoint(&info.path, &restored, 1 << 20, fsio::real()).unwrap();
    let store = Store::open(&restored, 1 << 20, fsio::real()).unwrap();
    assert_eq!(store.sparkplug.len(), sessions);
    let mut engine = Engine::new(vec![spec], store.progress().unwrap());
    let data = msg(2, "spBv1.0/g/NDATA/n1", 2, metric(None, 5, 3000));
    assert!(matches!(
        engine.apply(&store, &data).unwrap()[..],
        [Outcome::Applied { .. }]
    ));
    assert_eq!(store.pipelines_with_data().unwrap(), ["line1"]);

    store
        .reset_pipelines(&["line1"], &store.progress().unwrap())
        .unwrap();
    assert_eq!(store.sparkplug.len(), 0);
}

#[test]
fn lookups_beside_a_commit_find_every_recorded_id_and_no_other() {
    // The index takes a commit's entries a few pages at a time (`commit.rs`,
    // `index_added`), releasing the lock between them so that the loop's lookups go on.
    // Beside such a commit, a lookup through the checkpoint in flight (as the loop makes
    // it) must find every ID recorded before and by that checkpoint, and none never
    // recorded.
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), 1 << 20, fsio::real()).unwrap();
    let mut s = spec();
    s.dedup_window_ms = 1 << 40;
    s.max_keys = 100_000;
    let mut engine = Engine::new(vec![s], store.progress().unwrap());
    let ev = |offset: u64| Record {
        offset,
        received_at_ms: 1_000_000 + offset,
        topic: "payments/x".into(),
        payload: format!("E{offset}/K{}/1", offset % 50).into_bytes(),
        qos: 1,
        retain: false,
    };
    // 2,000 IDs per checkpoint: 250 of the unit tests' chunks, spread over every page of
    // the unit tests' index (4 buckets a page), merged a few pages at a time.
    const N: u64 = 2_000;
    for o in 0..N {
        engine.apply(&store, &ev(o)).unwrap();
    }
    store.commit(&engine.take_checkpoint(), 0).unwrap();
    for o in N..2 * N {
        engine.apply(&store, &ev(o)).unwrap();
    }
    let cp = engine.take_checkpoint();
    let layered = crate::processor::inflight::Layered::new(Some(&cp.batch), &store);
    let seen = |o: u64| {
        use crate::pipeline::engine::ReadState;
        layered.dedup("balances", &format!("E{o}")).unwrap()
    };
    let mut rounds = 0u64;
    std::thread::scope(|t| {
        // A commit that panics ends the loop below too (it is finished), and the join
        // fails the test rather than leave it spinning.
        let commit = t.spawn(|| store.commit(&cp, 0).unwrap());
        let mut o = 0;
        while !commit.is_finished() || rounds < 2 * N {
            for recorded in [o % N, N + o % N] {
                assert_eq!(seen(recorded), Some(1_000_000 + recorded), "E{recorded}");
            }
            assert_eq!(
                seen(2 * N + o % 97),
                None,
                "E{} was never recorded",
                2 * N + o % 97
            );
            o += 7;
            rounds += 1;
        }
        commit.join().expect("the commit beside the lookups");
    });
    // And the store alone, once the commit is done.
    use crate::pipeline::engine::ReadState;
    for o in 0..2 * N {
        assert_eq!(
            store.dedup("balances", &format!("E{o}")).unwrap(),
            Some(1_000_000 + o)
        );
    }
    assert_eq!(
        store.dedup("balances", &format!("E{}", 2 * N)).unwrap(),
        None
    );
}

/// A savepoint restore's start (`processor::plan`): the waiting results of one pipeline
/// move into its new generation under the same sequence numbers, those of a pipeline reset
/// at that start go, in one transaction that a reopened store reads back.
#[test]
fn a_start_moves_one_pipelines_waiting_results_into_a_generation_and_drops_anothers() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store");
    let store = Store::open(&path, 1 << 20, fsio::real()).unwrap();
    let mut changelog = spec();
    changelog.emit = Emit::Changelog;
    let mut other = changelog.clone();
    other.name = "other".into();
    other.output_topic = "other/{key}".into();
    let specs = vec![changelog, other];
    let mut engine = Engine::new(specs.clone(), store.progress().unwrap());
    for round in 0..3u64 {
        for i in 0..40 {
            let offset = round * 40 + i;
            engine
                .apply(&store, &rec(offset, &format!("E{offset}/K{}/{i}", i % 7)))
                .unwrap();
        }
        store.commit(&engine.take_checkpoint(), 0).unwrap();
    }
    let before: Vec<(u64, Output)> = store.outbox_from(0).map(|r| r.unwrap()).collect();
    assert_eq!(
        before.len(),
        240,
        "changelog: every result of both pipelines waits"
    );
    let progress = store.progress().unwrap();
    let moves = [
        ("balances".to_string(), Some(3)),
        ("other".to_string(), None),
    ];
    // One result whose body this build does not read stays as it is, and the start goes on.
    let odd = Output {
        id: "balances/Z/1".into(),
        topic: "balances/Z".into(),
        payload: b"not a body".to_vec(),
        retain: false,
        latest_only: false,
    };
    store
        .outbox
        .insert(1000u64.to_be_bytes(), encode(&vec![(1000u64, odd.clone())]))
        .unwrap();
    let done = store.commit_start(&[], &progress, &moves).unwrap();
    assert_eq!((done.moved, done.dropped), (120, 120));
    assert!(done.unmoved.is_some_and(|why| why.contains("balances/Z/1")));
    drop(store);
    let store = Store::open(&path, 1 << 20, fsio::real()).unwrap();
    let mut after: Vec<(u64, Output)> = store.outbox_from(0).map(|r| r.unwrap()).collect();
    assert_eq!(after.pop(), Some((1000, odd)));
    let expected: Vec<(u64, Output)> = before
        .iter()
        .filter(|(_, o)| o.id.starts_with("balances/"))
        .map(|(s, o)| (*s, in_generation(o, "balances", 3).unwrap()))
        .collect();
    assert_eq!(after, expected);
    assert_eq!(store.outbox_len(), 121);
    store.outbox.remove(1000u64.to_be_bytes()).unwrap();
    drop(store);
    let store = Store::open(&path, 1 << 20, fsio::real()).unwrap();
    for (_, o) in &after {
        let body: serde_json::Value = serde_json::from_slice(&o.payload).unwrap();
        assert!(o.id.starts_with("balances@3/"), "{}", o.id);
        assert_eq!(
            (body["id"].as_str(), body["generation"].as_u64()),
            (Some(o.id.as_str()), Some(3))
        );
    }
    // A crash before the restore marker was removed: the next start moves them again, into
    // the generation after, and nothing went out in between (the sinks start after).
    let again = [("balances".to_string(), Some(4))];
    let progress = store.progress().unwrap();
    let done = store.commit_start(&[], &progress, &again).unwrap();
    assert_eq!((done.moved, done.dropped, done.unmoved), (120, 0, None));
    let fourth: Vec<(u64, Output)> = store.outbox_from(0).map(|r| r.unwrap()).collect();
    let expected4: Vec<(u64, Output)> = expected
        .iter()
        .map(|(s, o)| (*s, in_generation(o, "balances", 4).unwrap()))
        .collect();
    assert_eq!(fourth, expected4);
    // The pipeline's next result in its generation goes in after them, a version higher.
    let mut progress = store.progress().unwrap();
    progress.pipelines[0].generation = 4;
    let mut engine = Engine::new(specs, progress);
    engine.apply(&store, &rec(120, "E120/K0/1")).unwrap();
    let cp = engine.take_checkpoint();
    let (_, next) = &cp.batch.outputs[0];
    assert!(next.id.starts_with("balances@4/K0/"), "{}", next.id);
    store.commit(&cp, 0).unwrap();
    assert_eq!(store.outbox_len(), 122, "and one of `other`, new");
}
