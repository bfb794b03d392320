//! Backfill (issue 15, item 6): a pipeline added with `start = "earliest"` processes the
//! retained log first, exactly once and with its own dedup, then joins live processing;
//! `start = "latest"` (the default) begins at the live position.
//!
//! The library test drives `Processor` over the real log and store: a pipeline added later
//! and backfilled, with crashes anywhere, must give byte for byte the outputs and state the
//! same pipeline gives when it ran from the start. The process tests drive the binary: the
//! results against a plain fold, kills in the middle of a backfill (failpoints), retention
//! that must keep what the backfill still needs, and `cairn status` while it is unfinished.

use std::collections::{BTreeMap, HashSet};
use std::path::Path;
use std::time::Duration;

use cairn::fsio;
use cairn::log::{Log, LogOptions};
use cairn::pipeline::spec::PipelineSpec;
use cairn::processor::Processor;
use cairn::store::Store;
use proptest::prelude::*;

use crate::support::agent::{AgentConfig, CairnProcess};
use crate::support::{Broker, Collector, publish_all, wait_until};

// ---------------------------------------------------------------------------------------
// Library: a backfilled pipeline equals the same pipeline run from the start.

fn spec(name: &str, start: &str, body: &str) -> PipelineSpec {
    cairn::config::pipeline_from_toml(&format!(
        "name = \"{name}\"\ntopics = [\"m/#\"]\nformat = \"delimited\"\nevent_id = \"0\"\n\
         key = \"{{topic[1]}}\"\nvalue = \"1\"\nmax_key_len = 16\nmax_keys = 1000\n\
         start = \"{start}\"\n{body}"
    ))
    .unwrap()
}

fn base() -> PipelineSpec {
    spec(
        "base",
        "latest",
        "aggregate = \"sum\"\noutput_topic = \"base/{key}\"",
    )
}

/// The richer kind: a filter, a list of aggregates, hopping windows, final results.
fn finals(start: &str) -> PipelineSpec {
    spec(
        "finals",
        start,
        "event_time = \"2\"\nwhere = '{1} > -50'\n\
         aggregate = [\"count\", \"sum\", \"min\", \"max\", \"avg\", \"stddev\", \"p90\"]\n\
         window = { size = \"100ms\", slide = \"50ms\", allowed_lateness = \"20ms\" }\n\
         emit = \"final\"\ndedup_window = \"366d\"\n\
         output_topic = \"finals/{key}/{window_start}\"",
    )
}

/// A short dedup window (6 records apart, in record time): the backfill must judge
/// duplicates by the time they were received, not by the live clock.
fn sums(start: &str) -> PipelineSpec {
    spec(
        "sums",
        start,
        "aggregate = [\"sum\", \"count\", \"last\"]\nemit = \"changelog\"\n\
         dedup_window = \"1m\"\noutput_topic = \"sums/{key}\"",
    )
}

const ADDED: [&str; 2] = ["finals", "sums"];

#[derive(Debug, Clone)]
struct Input {
    id: u8,
    machine: u8,
    value: i16,
    time: u16,
    bad: bool,
}

fn input() -> impl Strategy<Value = Input> {
    (0u8..30, 0u8..4, -60i16..100, 0u16..600, 0u8..12).prop_map(
        |(id, machine, value, time, bad)| Input {
            id,
            machine,
            value,
            time,
            bad: bad == 0,
        },
    )
}

#[derive(Debug, Clone)]
enum Step {
    Live(usize),
    Backfill(u64),
    Checkpoint,
    Crash,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        3 => (1usize..12).prop_map(Step::Live),
        3 => (1u64..20).prop_map(Step::Backfill),
        2 => Just(Step::Checkpoint),
        1 => Just(Step::Crash),
    ]
}

/// Small segments, so a backfill reads across several.
fn write_log(dir: &Path, inputs: &[Input]) -> Log {
    let opts = LogOptions {
        dir: dir.join("log"),
        segment_size: 4096,
        max_size: 1 << 30,
        max_payload: 1 << 10,
    };
    let mut log = Log::open(opts, fsio::real()).unwrap().0;
    for (i, inp) in inputs.iter().enumerate() {
        let value = if inp.bad {
            "x".to_string()
        } else {
            inp.value.to_string()
        };
        let payload = format!("E{}/{value}/{}", inp.id, inp.time);
        let topic = format!("m/M{}", inp.machine);
        log.append(
            1_000 + 10_000 * i as u64,
            &topic,
            payload.as_bytes(),
            1,
            false,
        )
        .unwrap();
    }
    log.commit().unwrap();
    log
}

fn open(dir: &Path, specs: Vec<PipelineSpec>) -> Processor {
    let store = Store::open(&dir.join("store"), 1 << 20, fsio::real()).unwrap();
    Processor::open_with(store, specs, &[], None).unwrap()
}

/// Apply up to `n` live records from the log.
fn live(proc: &mut Processor, log: &Log, n: usize) {
    let from = proc.next_offset();
    for rec in log.read_from(from).unwrap().take(n) {
        proc.apply(&rec.unwrap()).unwrap();
    }
}

type Results = (
    BTreeMap<String, String>,
    BTreeMap<(String, Vec<u8>), String>,
    Vec<(u64, u64, u64, u64, u64)>,
);

/// The added pipelines' outputs (ID → payload), state and counters.
fn results(proc: &Processor) -> Results {
    let store = proc.store();
    let mut outputs = BTreeMap::new();
    for r in store.outbox_from(0) {
        let o = r.unwrap().1;
        if ADDED.iter().any(|p| o.id.starts_with(&format!("{p}/"))) {
            let payload = String::from_utf8(o.payload).unwrap();
            assert!(outputs.insert(o.id, payload).is_none(), "an ID twice");
        }
    }
    let mut state = BTreeMap::new();
    for p in ADDED {
        for r in store.states(Some(p)) {
            let (_, k, st) = r.unwrap();
            let v = serde_json::json!({"v": st.value_json(), "n": st.count, "ver": st.version});
            state.insert((p.to_string(), k), v.to_string());
        }
    }
    let progress = store.progress().unwrap();
    let counters = ADDED
        .iter()
        .map(|p| {
            let pp = progress.pipelines.iter().find(|pp| pp.name == *p).unwrap();
            assert_eq!(pp.backfill, None, "{p} still backfilling");
            let c = &pp.counters;
            (
                c.applied,
                c.duplicates,
                c.dead_letters,
                c.filtered,
                c.outputs,
            )
        })
        .collect();
    (outputs, state, counters)
}

/// Checkpoint, then the outputs, state and counters must be `want`'s.
fn same_results(proc: &mut Processor, want: &Results) -> Result<(), TestCaseError> {
    proc.checkpoint(0).unwrap();
    let got = results(proc);
    prop_assert_eq!(&got.0, &want.0, "outputs differ");
    prop_assert_eq!(&got.1, &want.1, "state differs");
    prop_assert_eq!(&got.2, &want.2, "counters differ");
    Ok(())
}

fn check(inputs: &[Input], before: usize, steps: &[Step]) -> Result<(), TestCaseError> {
    let dir = tempfile::tempdir().unwrap();
    let log = write_log(dir.path(), inputs);

    // The reference: the pipelines ran from the start.
    let a = dir.path().join("a");
    let mut proc = open(&a, vec![base(), finals("latest"), sums("latest")]);
    proc.replay(&log, 7, &|| 0, &mut |_| {}).unwrap();
    let want = results(&proc);
    drop(proc);

    // Added after `before` records, backfilled in slices between live records, with
    // checkpoints and crashes anywhere.
    let b = dir.path().join("b");
    let mut proc = open(&b, vec![base()]);
    live(&mut proc, &log, before);
    proc.checkpoint(0).unwrap();
    drop(proc);
    let specs = vec![base(), finals("earliest"), sums("earliest")];
    let mut proc = open(&b, specs.clone());
    for s in steps {
        match s {
            Step::Live(n) => live(&mut proc, &log, *n),
            Step::Backfill(n) => {
                proc.backfill_slice(&log, *n).unwrap();
            }
            Step::Checkpoint => {
                proc.checkpoint(0).unwrap();
            }
            Step::Crash => {
                drop(proc);
                proc = open(&b, specs.clone());
            }
        }
    }
    while proc.backfill_slice(&log, 13).unwrap().is_some() {}
    live(&mut proc, &log, usize::MAX);
    same_results(&mut proc, &want)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn a_backfilled_pipeline_gives_the_outputs_and_ids_of_one_that_ran_from_the_start(
        inputs in proptest::collection::vec(input(), 1..140),
        before in 0usize..140,
        steps in proptest::collection::vec(step(), 0..40),
    ) {
        check(&inputs, before, &steps)?;
    }

    /// Issue 16: while the outbox is full the agent leaves live records in the log and takes
    /// them back in slices (`Processor::catch_up`); with live records, checkpoints and
    /// crashes anywhere in between, the results are those of a plain replay.
    #[test]
    fn processing_behind_the_log_in_slices_gives_what_processing_on_arrival_gives(
        inputs in proptest::collection::vec(input(), 1..140),
        steps in proptest::collection::vec(step(), 0..40),
    ) {
        check_behind(&inputs, &steps)?;
    }
}

fn check_behind(inputs: &[Input], steps: &[Step]) -> Result<(), TestCaseError> {
    let dir = tempfile::tempdir().unwrap();
    let log = write_log(dir.path(), inputs);
    let specs = || vec![base(), finals("latest"), sums("latest")];
    let a = dir.path().join("a");
    let mut proc = open(&a, specs());
    proc.replay(&log, 7, &|| 0, &mut |_| {}).unwrap();
    let want = results(&proc);
    drop(proc);

    let b = dir.path().join("b");
    let mut proc = open(&b, specs());
    for s in steps {
        match s {
            Step::Live(n) => live(&mut proc, &log, *n),
            // A slice is as long as the backfill's step: the same strategy drives both.
            Step::Backfill(n) => {
                let before = proc.next_offset();
                let c = proc.catch_up(&log, *n, &mut |_, _| {}).unwrap();
                prop_assert_eq!(proc.next_offset() - before, c.taken);
                prop_assert!(c.taken <= *n);
                prop_assert_eq!(c.caught_up, proc.next_offset() == log.durable_next());
            }
            Step::Checkpoint => {
                proc.checkpoint(0).unwrap();
            }
            Step::Crash => {
                drop(proc);
                proc = open(&b, specs());
            }
        }
    }
    loop {
        let c = proc.catch_up(&log, 13, &mut |_, _| {}).unwrap();
        if c.caught_up {
            break;
        }
        prop_assert!(
            c.taken == 13,
            "a slice ended short of the log's end: {:?}",
            c
        );
    }
    prop_assert_eq!(proc.next_offset(), log.durable_next());
    same_results(&mut proc, &want)
}

// ---------------------------------------------------------------------------------------
// The binary: a plain fold as the oracle.

fn pipeline(name: &str, start: Option<&str>) -> String {
    format!(
        "[[pipeline]]\nname = \"{name}\"\ntopics = [\"m/#\"]\nformat = \"delimited\"\n\
         event_id = \"0\"\nkey = \"{{topic[1]}}\"\nvalue = \"1\"\naggregate = \"sum\"\n\
         output_topic = \"{name}/{{key}}\"\n{}\n",
        start
            .map(|s| format!("start = \"{s}\""))
            .unwrap_or_default()
    )
}

/// Event `id` of machine `id % 5`, value `id`, with `pad` bytes of padding.
fn event(id: u64, pad: usize) -> (String, Vec<u8>, bool) {
    let body = format!("E{id}/{id}/{}", "p".repeat(pad));
    (format!("m/M{}", id % 5), body.into_bytes(), false)
}

/// Per key: (sum, count) over the unique IDs.
pub(crate) fn fold(ids: impl IntoIterator<Item = u64>) -> BTreeMap<String, (i64, u64)> {
    let mut seen = HashSet::new();
    let mut out: BTreeMap<String, (i64, u64)> = BTreeMap::new();
    for id in ids {
        if seen.insert(id) {
            let e = out.entry(format!("M{}", id % 5)).or_default();
            e.0 += id as i64;
            e.1 += 1;
        }
    }
    out
}

/// A stopped agent's state of `pipeline`: per key (sum, count).
pub(crate) fn state(agent: &CairnProcess, pipeline: &str) -> BTreeMap<String, (i64, u64)> {
    let (st, out, err) = agent.command(&["inspect", "state", "--pipeline", pipeline, "--json"]);
    assert!(st.success(), "{err}");
    out.lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            let key = v["key"].as_str().unwrap().to_string();
            (
                key,
                (v["value"].as_i64().unwrap(), v["count"].as_u64().unwrap()),
            )
        })
        .collect()
}

fn status(agent: &CairnProcess) -> serde_json::Value {
    let (st, out, err) = agent.command(&["status", "--offline", "--json"]);
    assert!(st.success(), "{err}");
    serde_json::from_str(&out).unwrap()
}

fn pipeline_status(v: &serde_json::Value, name: &str) -> serde_json::Value {
    v["pipelines"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == name)
        .cloned()
        .unwrap_or_else(|| panic!("no pipeline {name} in {v}"))
}

/// Until the backfill is done (in this run, or in an earlier one a kill ended later).
fn wait_done(agent: &CairnProcess) {
    assert!(
        wait_until(Duration::from_secs(60), || agent
            .stderr()
            .contains("pipeline `back`: backfill done")),
        "the backfill did not finish:\n{}",
        agent.stderr_tail(20)
    );
}

#[test]
fn start_earliest_backfills_the_retained_log_with_its_own_dedup_and_latest_sees_only_new_events() {
    let broker = Broker::start();
    let mut cfg = AgentConfig::new(broker.port(), &pipeline("base", None));
    let mut agent = CairnProcess::new(&cfg);
    agent.start_connected();
    // 200 events, then 20 of them again: duplicates inside the range `back` backfills.
    let first: Vec<u64> = (0..200).chain(0..20).collect();
    let msgs: Vec<_> = first.iter().map(|i| event(*i, 0)).collect();
    publish_all(broker.port(), &msgs);
    assert!(wait_until(Duration::from_secs(30), || agent
        .checkpointed_offset()
        == Some(220)));
    assert!(agent.terminate().success());

    cfg.pipelines = format!(
        "{}{}{}",
        pipeline("base", None),
        pipeline("back", Some("earliest")),
        pipeline("new", Some("latest"))
    );
    agent.rewrite_config(&cfg);
    agent.start_connected();
    wait_done(&agent);
    // Live: 50 new events, 10 IDs the log already had (duplicates for `back`, first seen
    // by `new`), 5 new ones again.
    let second: Vec<u64> = (200..250).chain(0..10).chain(200..205).collect();
    let msgs: Vec<_> = second.iter().map(|i| event(*i, 0)).collect();
    publish_all(broker.port(), &msgs);
    assert!(wait_until(Duration::from_secs(30), || agent
        .checkpointed_offset()
        == Some(285)));
    assert!(agent.terminate().success());

    let all = fold(first.iter().chain(&second).copied());
    assert_eq!(state(&agent, "back"), all, "back: the whole log, once");
    assert_eq!(state(&agent, "base"), all);
    assert_eq!(
        state(&agent, "new"),
        fold(second.iter().copied()),
        "new: live only"
    );
    let v = status(&agent);
    let back = pipeline_status(&v, "back");
    assert_eq!(back["duplicates"], 35, "{v}");
    assert_eq!(back["applied"], 250, "{v}");
    assert_eq!(back["backfill_left"], 0, "{v}");
    assert_eq!(pipeline_status(&v, "new")["duplicates"], 5, "{v}");

    // `start` on a pipeline with state is ignored, and says so.
    agent.start_connected();
    assert!(
        agent
            .run_stderr()
            .contains("pipeline `back`: start = \"earliest\" ignored"),
        "{}",
        agent.run_stderr()
    );
    assert!(agent.terminate().success());
    assert_eq!(state(&agent, "back"), all);
}

/// Phase 1: `n` events (ids 0..n) and `dups` duplicates, logged under `base` only, padded
/// to `pad` bytes, with `retention`. Returns the agent (stopped) and its config.
fn logged(
    broker: &Broker,
    (n, dups, pad): (u64, u64, usize),
    retention: &str,
) -> (CairnProcess, AgentConfig) {
    let mut cfg = AgentConfig::new(broker.port(), &pipeline("base", None));
    cfg.log = format!(
        "segment_size = \"1MiB\"\nmax_size = \"256MiB\"\nretention = \"{retention}\"\n\
         commit_interval = \"2ms\"\nmax_payload = \"64KiB\"\n"
    );
    let mut agent = CairnProcess::new(&cfg);
    agent.start_connected();
    let msgs: Vec<_> = (0..n).chain(0..dups).map(|i| event(i, pad)).collect();
    publish_all(broker.port(), &msgs);
    assert!(
        wait_until(Duration::from_secs(60), || agent.checkpointed_offset()
            == Some(n + dups)),
        "{}",
        agent.stderr_tail(20)
    );
    assert!(agent.terminate().success());
    cfg.pipelines = format!(
        "{}{}",
        pipeline("base", None),
        pipeline("back", Some("earliest"))
    );
    // One checkpoint per backfill slice of 100 records.
    cfg.checkpoint = "interval = \"50ms\"\nmax_records = 100\n".into();
    agent.rewrite_config(&cfg);
    (agent, cfg)
}

fn crash_with(agent: &mut CairnProcess, failpoints: &str) {
    agent.note(&format!("failpoints=[{failpoints}]"));
    agent.start_with_env(&[("CAIRN_FAILPOINTS", failpoints)]);
    let exit = agent.wait_exit(Duration::from_secs(60));
    assert!(
        exit.is_some_and(|s| !s.success()),
        "the failpoint {failpoints} did not stop the agent:\n{}",
        agent.stderr_tail(20)
    );
}

#[test]
fn a_kill_in_the_middle_of_a_backfill_resumes_it_without_loss_or_double_counting() {
    let broker = Broker::start();
    let (mut agent, _cfg) = logged(&broker, (1500, 100, 0), "1h");

    // Killed after the 4th slice was applied, before its checkpoint: 3 committed, and the
    // 2nd or the 3rd durable (the checkpoint's fsync runs beside the loop, issue 14).
    crash_with(&mut agent, "backfill.after_slice=abort@4");
    let v = status(&agent);
    let left = pipeline_status(&v, "back")["backfill_left"]
        .as_u64()
        .unwrap();
    assert!([1600 - 200, 1600 - 300].contains(&left), "{v}");
    let (_, text, _) = agent.command(&["status", "--offline"]);
    assert!(
        text.contains(&format!("backfilling: {left} records left")),
        "{text}"
    );
    // Killed right after a backfill checkpoint committed; it resumes where the last run's
    // durable checkpoint left it.
    crash_with(&mut agent, "checkpoint.after_commit=abort@3");
    let resumed = format!("resuming its backfill at log offset {}", 1600 - left);
    assert!(
        agent.run_stderr().contains(&resumed),
        "{resumed}:\n{}",
        agent.stderr_tail(20)
    );
    // And a SIGKILL wherever it lands.
    agent.start();
    agent.wait_for_stderr("resuming its backfill", Duration::from_secs(30));
    std::thread::sleep(Duration::from_millis(20));
    agent.kill();

    agent.start_connected();
    wait_done(&agent);
    assert!(agent.terminate().success());
    let want = fold((0..1500).chain(0..100));
    assert_eq!(state(&agent, "back"), want);
    let back = pipeline_status(&status(&agent), "back");
    assert_eq!(
        (&back["applied"], &back["duplicates"]),
        (&1500.into(), &100.into())
    );
}

/// `back`'s results as `results` saw them: per key, the versions in the order their IDs
/// first arrived, and the newest value.
pub(crate) fn back_results(results: &Collector) -> BTreeMap<String, (Vec<u64>, i64)> {
    let mut ids = HashSet::new();
    let mut out: BTreeMap<String, (Vec<u64>, i64)> = BTreeMap::new();
    for m in results.messages() {
        let v: serde_json::Value = serde_json::from_slice(&m.payload).unwrap();
        if ids.insert(v["id"].as_str().unwrap().to_string()) {
            let e = out
                .entry(v["key"].as_str().unwrap().to_string())
                .or_default();
            e.0.push(v["version"].as_u64().unwrap());
            e.1 = v["value"].as_i64().unwrap();
        }
    }
    out
}

/// Per key of `results`: the versions of first-seen IDs rise, and the newest carries the
/// sum `want` has for it.
pub(crate) fn assert_versions_rise_to(results: &Collector, want: &BTreeMap<String, (i64, u64)>) {
    for (key, (versions, value)) in back_results(results) {
        assert!(
            versions.windows(2).all(|w| w[0] < w[1]),
            "key {key}: versions in the order they first arrived: {versions:?}"
        );
        assert_eq!(value, want[&key].0, "key {key}: the newest result's value");
    }
}

/// The soak of 2026-12-07 saw `win@29/k26/…/119` arrive after `…/121`: a backfill of
/// upserts resumed after a crash flushes at other points than the run before it, so it
/// emits versions that run never did, below ones it had sent. Here the first run takes
/// slices of 512 records and pauses after each (its results would leave meanwhile), and is
/// killed with no checkpoint since the backfill began; the second takes slices of 100. Its
/// first flush is then at version 20 of a key whose version 103 the first run had sent. So
/// while a backfill of upserts runs, results leave only once their checkpoint is durable.
#[test]
fn a_backfill_of_upserts_resumed_after_a_crash_never_sends_a_version_below_one_sent() {
    let broker = Broker::start();
    let (mut agent, mut cfg) = logged(&broker, (3000, 0, 0), "1h");
    let results = Collector::start(broker.port(), "back/#");
    cfg.checkpoint = "interval = \"1h\"\nmax_records = 100000\n".into();
    agent.rewrite_config(&cfg);
    agent.note("failpoints=[backfill.after_slice=pause:200@1+]");
    agent.start_with_env(&[("CAIRN_FAILPOINTS", "backfill.after_slice=pause:200@1+")]);
    agent.wait_connected(Duration::from_secs(20));
    // Six slices, 1.2 s: the backfill is done, and no checkpoint has been durable since it
    // began (the one at start records it at offset 0). So the hold also covers the time
    // after its end, while the durable checkpoint still says it backfills.
    std::thread::sleep(Duration::from_millis(2500));
    agent.kill();
    let early = results.messages().len();
    assert_eq!(
        early,
        0,
        "results of a backfill of upserts left before their checkpoint:\n{}",
        agent.stderr_tail(20)
    );

    cfg.checkpoint = "interval = \"50ms\"\nmax_records = 100\n".into();
    agent.rewrite_config(&cfg);
    agent.start_connected();
    wait_done(&agent);
    // Each key's last version (600 events each) has arrived.
    assert!(
        wait_until(Duration::from_secs(30), || {
            let seen = back_results(&results);
            seen.len() == 5 && seen.values().all(|(v, _)| v.contains(&600))
        }),
        "{:?}:\n{}",
        back_results(&results),
        agent.stderr_tail(20)
    );
    assert!(agent.terminate().success());
    let want = fold(0..3000);
    assert_versions_rise_to(&results, &want);
    assert_eq!(state(&agent, "back"), want);
    let journal = agent.run_stderr();
    assert!(
        journal.contains("results leave before their checkpoint again"),
        "{journal}"
    );
}

#[test]
fn retention_keeps_every_segment_an_unfinished_backfill_needs() {
    let broker = Broker::start();
    // ~3 MiB: three 1 MiB segments and more.
    let (mut agent, mut cfg) = logged(&broker, (1500, 0, 2000), "1h");
    assert!(
        std::fs::read_dir(agent.data_dir().join("log"))
            .unwrap()
            .count()
            >= 3
    );
    // Everything is processed and (after a second) outside retention: without the backfill,
    // the first checkpoint would delete every sealed segment.
    std::thread::sleep(Duration::from_millis(1100));
    cfg.log = cfg.log.replace("retention = \"1h\"", "retention = \"1s\"");
    agent.rewrite_config(&cfg);
    crash_with(&mut agent, "backfill.after_slice=abort@6");
    let v = status(&agent);
    assert!(
        v["log"]["first_offset"].as_u64().unwrap() <= 500,
        "retention deleted records the backfill (committed up to 500) still needs: {v}"
    );

    agent.start_connected();
    wait_done(&agent);
    // A checkpoint after the backfill: retention may delete the segments now.
    publish_all(broker.port(), &[event(1500, 2000)]);
    assert!(wait_until(Duration::from_secs(30), || agent
        .checkpointed_offset()
        == Some(1501)));
    assert!(agent.terminate().success());
    assert_eq!(state(&agent, "back"), fold(0..1501));
    let v = status(&agent);
    assert!(
        v["log"]["first_offset"].as_u64().unwrap() > 0,
        "retention deleted nothing once the backfill was done: {v}"
    );
}

/// The first log offset still on disk (the agent stopped).
fn first_offset(agent: &CairnProcess) -> u64 {
    status(agent)["log"]["first_offset"].as_u64().unwrap()
}

#[test]
fn a_backfill_covers_exactly_what_retention_left_in_the_log() {
    let broker = Broker::start();
    // Retention 0s: every sealed, checkpointed segment went while `base` ran.
    let (mut agent, _cfg) = logged(&broker, (1500, 0, 2000), "0s");
    let first = first_offset(&agent);
    assert!(first > 0 && first < 1500, "retention left [{first}, 1500)");
    agent.start_connected();
    wait_done(&agent);
    assert!(agent.terminate().success());
    // Published in order, once each: offset i holds event i.
    assert_eq!(state(&agent, "back"), fold(first..1500));
    assert_eq!(state(&agent, "base"), fold(0..1500));
}
