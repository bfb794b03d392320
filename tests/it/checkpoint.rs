//! The exactly-once core over the real replay log and sled store (issue 3), including the
//! worked example of the design brief.

use std::path::Path;

use cairn::fsio;
use cairn::log::{Log, LogOptions};
use cairn::pipeline::spec::*;
use cairn::processor::Processor;
use cairn::store::Store;

fn spec() -> PipelineSpec {
    sum_pipeline("balances", 1000)
}

/// A pipeline `name` on `payments/#` summing field 2 by field 1, results on `name/{key}`.
fn sum_pipeline(name: &str, max_keys: u64) -> PipelineSpec {
    cairn::config::pipeline_from_toml(&format!(
        r#"name = "{name}"
topics = ["payments/#"]
format = "delimited"
event_id = "0"
key = "1"
value = "2"
aggregate = "sum"
output_topic = "{name}/{{key}}"
max_key_len = 64
max_keys = {max_keys}"#
    ))
    .unwrap()
}

fn open_log(dir: &Path) -> Log {
    let opts = LogOptions {
        dir: dir.join("log"),
        segment_size: 1 << 20,
        max_size: 1 << 30,
        max_payload: 1 << 16,
    };
    Log::open(opts, fsio::real()).unwrap().0
}

fn open_proc(dir: &Path) -> Processor {
    Processor::open(
        Store::open(&dir.join("store"), 1 << 20, fsio::real()).unwrap(),
        vec![spec()],
    )
    .unwrap()
}

/// Append and fsync, as ingest does before it acks.
fn log_events(log: &mut Log, events: &[&str]) {
    for e in events {
        log.append(
            1_000 + log.next_offset(),
            "payments/in",
            e.as_bytes(),
            1,
            false,
        )
        .unwrap();
    }
    log.commit().unwrap();
}

/// Recovery exactly as the agent does it: open the log, load the checkpoint, replay.
fn recover(dir: &Path) -> (Log, Processor) {
    let log = open_log(dir);
    let mut proc = open_proc(dir);
    proc.replay(&log, 1000, &|| 0, &mut |_| {}).unwrap();
    (log, proc)
}

fn balance(proc: &Processor, key: &str) -> (i64, u64) {
    for r in proc.store().states(Some("balances")) {
        let (_, k, st) = r.unwrap();
        if k == key.as_bytes() {
            return (st.value_json().as_i64().unwrap(), st.version);
        }
    }
    panic!("no state for {key}");
}

fn process_all(log: &Log, proc: &mut Processor) {
    for r in log.read_from(proc.next_offset()).unwrap() {
        proc.apply(&r.unwrap()).unwrap();
    }
}

#[test]
fn worked_example_power_cut_after_processing_e3_gives_85000() {
    let dir = tempfile::tempdir().unwrap();
    {
        let mut log = open_log(dir.path());
        let mut proc = open_proc(dir.path());
        log_events(&mut log, &["E1/A/50000", "E2/A/25000"]);
        process_all(&log, &mut proc);
        proc.checkpoint(0).unwrap().expect("a checkpoint");
        assert_eq!(balance(&proc, "A"), (75_000, 2));
        assert_eq!(proc.next_offset(), 2, "the checkpoint's next input is E3");

        log_events(&mut log, &["E3/A/10000"]);
        process_all(&log, &mut proc);
        // Power fails here: E3 was applied in memory but no checkpoint holds it.
    }
    let (_log, proc) = recover(dir.path());
    assert_eq!(
        balance(&proc, "A"),
        (85_000, 3),
        "not 95000 (counted twice), not 10000 (state lost)"
    );
    assert_eq!(proc.engine().progress().pipelines[0].counters.applied, 3);
    assert_eq!(proc.engine().progress().pipelines[0].counters.duplicates, 0);
}

#[test]
fn a_crash_before_commit_leaves_the_previous_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    {
        let mut log = open_log(dir.path());
        let mut proc = open_proc(dir.path());
        log_events(&mut log, &["E1/A/50000", "E2/A/25000"]);
        process_all(&log, &mut proc);
        proc.checkpoint(0).unwrap();
        log_events(&mut log, &["E3/A/10000"]);
        process_all(&log, &mut proc);
        proc.checkpoint(0).unwrap();
        // Power fails right after the checkpoint commit: nothing to replay, nothing twice.
    }
    let (_log, proc) = recover(dir.path());
    assert_eq!(balance(&proc, "A"), (85_000, 3));
    let cps: Vec<_> = proc.store().checkpoints().map(|c| c.unwrap()).collect();
    assert_eq!(
        cps.iter()
            .map(|c| (c.prev_offset, c.next_offset))
            .collect::<Vec<_>>(),
        [(0, 2), (2, 3)]
    );
}

#[test]
fn business_duplicate_at_two_log_positions_counts_once() {
    let dir = tempfile::tempdir().unwrap();
    {
        let mut log = open_log(dir.path());
        let mut proc = open_proc(dir.path());
        log_events(&mut log, &["E1/A/50000", "E2/A/25000", "E2/A/25000"]);
        process_all(&log, &mut proc);
        proc.checkpoint(0).unwrap();
        log_events(&mut log, &["E2/A/25000"]);
        process_all(&log, &mut proc);
        // Crash: the third copy is replayed and dropped again, not counted.
    }
    let (_log, proc) = recover(dir.path());
    assert_eq!(balance(&proc, "A"), (75_000, 2));
    let c = &proc.engine().progress().pipelines[0].counters;
    assert_eq!((c.applied, c.duplicates), (2, 2));
    let outbox: Vec<_> = proc
        .store()
        .outbox_from(0)
        .map(|r| r.unwrap().1.id)
        .collect();
    assert_eq!(
        outbox,
        ["balances/A/2"],
        "one upsert for the batch, carrying the latest version"
    );
}

#[test]
fn replayed_outputs_keep_their_ids_and_content() {
    let dir = tempfile::tempdir().unwrap();
    let before;
    {
        let mut log = open_log(dir.path());
        let mut proc = open_proc(dir.path());
        log_events(&mut log, &["E1/A/1", "E2/B/2"]);
        process_all(&log, &mut proc);
        proc.checkpoint(0).unwrap();
        before = proc
            .store()
            .outbox_from(0)
            .map(|r| r.unwrap().1)
            .collect::<Vec<_>>();
        log_events(&mut log, &["E3/A/3"]);
        process_all(&log, &mut proc);
    }
    let (_log, proc) = recover(dir.path());
    let after: Vec<_> = proc.store().outbox_from(0).map(|r| r.unwrap().1).collect();
    // The replayed upsert A/2 supersedes A/1, which was never sent; B/1 is untouched.
    assert_eq!(before.len(), 2);
    assert_eq!(
        after.iter().map(|o| o.id.as_str()).collect::<Vec<_>>(),
        ["balances/B/1", "balances/A/2"]
    );
    assert_eq!(
        after[0], before[1],
        "an entry of the durable checkpoint is untouched"
    );
    let v: serde_json::Value = serde_json::from_slice(&after[1].payload).unwrap();
    assert_eq!(
        (v["value"].as_i64(), v["version"].as_u64()),
        (Some(4), Some(2))
    );
}

#[test]
fn a_changed_pipeline_definition_is_refused_at_open() {
    let dir = tempfile::tempdir().unwrap();
    {
        let mut log = open_log(dir.path());
        let mut proc = open_proc(dir.path());
        log_events(&mut log, &["E1/A/1"]);
        process_all(&log, &mut proc);
        proc.checkpoint(0).unwrap();
    }
    let mut changed = spec();
    changed.aggregate = AggregateSpec::One(Aggregate::Max);
    let store = Store::open(&dir.path().join("store"), 1 << 20, fsio::real()).unwrap();
    let err = Processor::open(store, vec![changed])
        .err()
        .expect("refused")
        .to_string();
    assert!(err.contains("pipeline `balances` changed"), "{err}");
    // The definition as the user wrote it, only what changed, not Rust's or JSON's syntax.
    assert!(
        err.contains("stored:     aggregate = \"sum\"")
            && err.contains("configured: aggregate = \"max\""),
        "{err}"
    );
    for noise in ["Sum", "Max", "{\"", "Index", "key ="] {
        assert!(!err.contains(noise), "`{noise}` in {err}");
    }
}

#[test]
fn a_named_reset_drops_the_pipelines_state_and_continues_its_versions() {
    let dir = tempfile::tempdir().unwrap();
    {
        let mut log = open_log(dir.path());
        let mut proc = open_proc(dir.path());
        log_events(&mut log, &["E1/A/1", "E2/A/2", "E3/B/5"]);
        process_all(&log, &mut proc);
        proc.checkpoint(0).unwrap();
    }
    let mut changed = spec();
    changed.aggregate = AggregateSpec::One(Aggregate::Max);
    let store = Store::open(&dir.path().join("store"), 1 << 20, fsio::real()).unwrap();
    let err = Processor::open_with_reset(store, vec![changed.clone()], &["nope".into()])
        .err()
        .unwrap();
    assert!(
        err.to_string().contains("no pipeline of that name"),
        "{err}"
    );
    let store = Store::open(&dir.path().join("store"), 1 << 20, fsio::real()).unwrap();
    let mut proc =
        Processor::open_with_reset(store, vec![changed.clone()], &["balances".into()]).unwrap();
    assert_eq!(proc.store().states(None).count(), 0, "state dropped");
    assert_eq!(
        proc.store().dedup_entries(None).count(),
        0,
        "ledger dropped"
    );
    let mut log = open_log(dir.path());
    log_events(&mut log, &["E1/A/7"]); // E1 again: the old ledger is gone, so it counts
    process_all(&log, &mut proc);
    proc.checkpoint(0).unwrap();
    assert_eq!(
        balance(&proc, "A"),
        (7, 3),
        "versions continue above the old highest (2)"
    );
    let ids: Vec<_> = proc
        .store()
        .outbox_from(0)
        .map(|r| r.unwrap().1.id)
        .collect();
    assert!(
        ids.contains(&"balances@2/A/3".to_string()),
        "a reset starts generation 2: {ids:?}"
    );
    drop(proc);
    // The reset is durable and the new definition is now the stored one.
    let store = Store::open(&dir.path().join("store"), 1 << 20, fsio::real()).unwrap();
    Processor::open(store, vec![changed]).expect("the new definition is accepted");
}

/// Four pipelines over one stream, `payments/#`, each summing by the same key.
fn four_pipelines() -> Vec<PipelineSpec> {
    (0..4)
        .map(|i| sum_pipeline(&format!("p{i}"), 100_000))
        .collect()
}

/// Every pipeline's sum per key, and each pipeline's applied count.
fn sums(proc: &Processor) -> (Vec<(String, String, i64)>, Vec<u64>) {
    let mut sums = Vec::new();
    for r in proc.store().states(None) {
        let (p, k, st) = r.unwrap();
        let k = String::from_utf8(k).unwrap();
        sums.push((p, k, st.value_json().as_i64().unwrap()));
    }
    sums.sort();
    let applied = (proc.engine().progress().pipelines.iter())
        .map(|p| p.counters.applied)
        .collect();
    (sums, applied)
}

/// 300 records over distinct keys replayed by 4 pipelines under `bound` (keys, results: see
/// `Processor::set_batch_bound`), then 60 more taken by catch-up slices of up to 512: the
/// bound ends a replay's checkpoint and a catch-up's slice every 10 records. `held` reads
/// what the bound counts, at most `limit` after each slice. Returns the processor with the
/// last slice not yet checkpointed, and the directory it lives in.
fn replay_and_catch_up_in_tens(
    bound: (u64, u64),
    held: fn(&Processor) -> u64,
    limit: u64,
) -> (tempfile::TempDir, Processor) {
    let events: Vec<String> = (0..360).map(|i| format!("E{i}/k{i}/{}", i + 1)).collect();
    let dir = tempfile::tempdir().unwrap();
    let mut log = open_log(dir.path());
    let refs: Vec<&str> = events[..300].iter().map(String::as_str).collect();
    log_events(&mut log, &refs);
    let store = Store::open(&dir.path().join("store"), 1 << 20, fsio::real()).unwrap();
    let mut proc = Processor::open(store, four_pipelines()).unwrap();
    proc.set_batch_bound(bound.0, bound.1);
    let mut at = Vec::new();
    let stats = proc
        .replay(&log, 1000, &|| 0, &mut |s| at.push(s.to))
        .unwrap();
    assert_eq!(stats.records, 300);
    assert_eq!(
        stats.checkpoints, 30,
        "a checkpoint every 10 records, not one at max_records"
    );
    let every_ten: Vec<u64> = (1..=30).map(|i| i * 10).collect();
    assert_eq!(at, every_ten, "each at the bound exactly");
    assert_eq!(held(&proc), 0);

    // Catch-up: slices of up to 512 records stop at the bound too, and go on after the
    // checkpoint from where they stopped.
    let refs: Vec<&str> = events[300..].iter().map(String::as_str).collect();
    log_events(&mut log, &refs);
    let mut taken = Vec::new();
    loop {
        let slice = proc.catch_up(&log, 512, &mut |_, _| {}).unwrap();
        taken.push(slice.taken);
        assert!(held(&proc) <= limit, "{} held", held(&proc));
        if slice.caught_up {
            break;
        }
        proc.checkpoint(0).unwrap().expect("a checkpoint");
        assert!(taken.len() < 20, "catch-up makes progress: {taken:?}");
    }
    assert_eq!(taken, vec![10; 6]);
    (dir, proc)
}

/// `checkpoint.max_keys` bounds what records read back from the log may write before their
/// checkpoint, as it bounds live ones (issue 33): the replay at start checkpointed only at
/// `max_records`, and a catch-up slice took up to 512 records before anyone looked, so 16
/// pipelines over 100,000 keys held ~7,000 keys a checkpoint where the bound said 1,536.
/// Here 4 pipelines over distinct keys write one row a record (a key's states of every
/// pipeline); at a bound of 10 rows every 10 records end a replay's checkpoint and a
/// catch-up's slice, and the sums are those of a run without the bound.
#[test]
fn replay_and_catch_up_stop_at_the_key_bound_with_many_pipelines() {
    let expect = {
        let events: Vec<String> = (0..360).map(|i| format!("E{i}/k{i}/{}", i + 1)).collect();
        let dir = tempfile::tempdir().unwrap();
        let mut log = open_log(dir.path());
        let refs: Vec<&str> = events.iter().map(String::as_str).collect();
        log_events(&mut log, &refs);
        let store = Store::open(&dir.path().join("store"), 1 << 20, fsio::real()).unwrap();
        let mut proc = Processor::open(store, four_pipelines()).unwrap();
        let stats = proc.replay(&log, 1000, &|| 0, &mut |_| {}).unwrap();
        assert_eq!(
            stats.checkpoints, 1,
            "no key bound: one checkpoint at the end"
        );
        sums(&proc)
    };
    assert_eq!(expect.0.len(), 4 * 360);
    assert_eq!(expect.1, vec![360; 4]);

    let (_dir, mut proc) = replay_and_catch_up_in_tens((10, u64::MAX), Processor::pending_keys, 10);
    proc.checkpoint(0).unwrap().expect("the last checkpoint");
    assert_eq!(
        sums(&proc),
        expect,
        "the same sums and counts as without the bound"
    );
}

/// `checkpoint.max_records` bounds the results a batch read back from the log makes, as the
/// live loop's schedule counts them (issue 33): the replay at start checkpointed at
/// `max_records` records or `max_keys` keys, so 16 pipelines could hold 16 × `max_records`
/// results until their checkpoint. Here 4 pipelines make 4 results a record (one upsert
/// each per new key); at a bound of 40 results the replay checkpoints every 10 records, and
/// catch-up slices stop there; over 5 keys the upserts collapse and the records bound is
/// what ends the batch.
#[test]
fn replay_and_catch_up_stop_at_the_results_bound_with_many_pipelines() {
    let (_dir, mut proc) =
        replay_and_catch_up_in_tens((u64::MAX, 40), Processor::results_since_checkpoint, 40);
    assert_eq!(proc.results_since_checkpoint(), 40, "the last slice's");
    proc.checkpoint(0).unwrap().expect("the last checkpoint");
    let (sums_now, applied) = sums(&proc);
    assert_eq!(sums_now.len(), 4 * 360);
    assert_eq!(applied, vec![360; 4]);

    // Repeated keys: 300 records over 5 keys make at most 20 results, so only the records
    // bound ends the replay's batches.
    let dir = tempfile::tempdir().unwrap();
    let mut log = open_log(dir.path());
    let events: Vec<String> = (0..300).map(|i| format!("E{i}/k{}/1", i % 5)).collect();
    let refs: Vec<&str> = events.iter().map(String::as_str).collect();
    log_events(&mut log, &refs);
    let store = Store::open(&dir.path().join("store"), 1 << 20, fsio::real()).unwrap();
    let mut proc = Processor::open(store, four_pipelines()).unwrap();
    proc.set_batch_bound(u64::MAX, 40);
    let mut at = Vec::new();
    let stats = proc
        .replay(&log, 100, &|| 0, &mut |s| at.push(s.to))
        .unwrap();
    assert_eq!(at, vec![100, 200, 300], "{stats:?}");
    let (sums_now, _) = sums(&proc);
    assert!(sums_now.iter().all(|(_, _, v)| *v == 60), "{sums_now:?}");
}
