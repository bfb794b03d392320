//! Config edits are explicit (issue 10, item 3): a pipeline's stored definition is compared
//! with the configured one at every start, including one that comes back after it was
//! removed; state of pipelines no longer configured is reported and can be dropped; and a
//! reset or a store rebuilt from the log starts a new generation of output IDs, so no ID
//! ever goes out with two payloads. The library tests drive `Processor` over the real log
//! and store; the process tests drive the binary with a private broker.

use crate::support;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use cairn::fsio;
use cairn::log::{Log, LogOptions};
use cairn::model::{PipelineProgress, Progress};
use cairn::pipeline::Engine;
use cairn::pipeline::memory::MemState;
use cairn::pipeline::spec::PipelineSpec;
use cairn::processor::{ProcessError, Processor, audit};
use cairn::store::Store;

use crate::support::agent::{AgentConfig, CairnProcess};
use crate::support::{Broker, Collector, publish_all};

fn pipeline(name: &str, aggregate: &str) -> PipelineSpec {
    cairn::config::pipeline_from_toml(&format!(
        "name = \"{name}\"\ntopics = [\"pay/#\"]\nformat = \"delimited\"\nevent_id = \"0\"\n\
         key = \"1\"\n{}aggregate = \"{aggregate}\"\noutput_topic = \"{name}/{{key}}\"",
        if aggregate == "count" {
            ""
        } else {
            "value = \"2\"\n"
        }
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

fn store(dir: &Path) -> Store {
    Store::open(&dir.join("store"), 1 << 20, fsio::real()).unwrap()
}

/// Open as the agent does: with the generations file beside the store.
fn open(dir: &Path, specs: Vec<PipelineSpec>, reset: &[&str]) -> Result<Processor, ProcessError> {
    let reset: Vec<String> = reset.iter().map(|s| s.to_string()).collect();
    let gens = dir.join(cairn::processor::generations::FILE_NAME);
    Processor::open_with(store(dir), specs, &reset, Some(&gens))
}

/// Log the events (fsynced, as ingest does), apply everything new, and checkpoint.
fn run(dir: &Path, proc: &mut Processor, events: &[&str]) {
    let mut log = open_log(dir);
    for e in events {
        let at = 1_000 + log.next_offset();
        log.append(at, "pay/x", e.as_bytes(), 1, false).unwrap();
    }
    log.commit().unwrap();
    proc.replay(&log, 1000, &|| 0, &mut |_| {}).unwrap();
}

fn state(proc: &Processor, pipeline: &str) -> BTreeMap<String, (serde_json::Value, u64)> {
    proc.store()
        .states(Some(pipeline))
        .map(|r| {
            let (_, k, st) = r.unwrap();
            (String::from_utf8(k).unwrap(), (st.value_json(), st.version))
        })
        .collect()
}

/// Every output ID the outbox holds, with its payload.
fn outbox(proc: &Processor) -> BTreeMap<String, serde_json::Value> {
    proc.store()
        .outbox_from(0)
        .map(|r| {
            let o = r.unwrap().1;
            (o.id, serde_json::from_slice(&o.payload).unwrap())
        })
        .collect()
}

/// The property item 3 asks for: an ID seen in both runs carries one payload.
fn assert_no_id_has_two_payloads(
    before: &BTreeMap<String, serde_json::Value>,
    after: &BTreeMap<String, serde_json::Value>,
) {
    for (id, payload) in after {
        if let Some(old) = before.get(id) {
            assert_eq!(old, payload, "output ID {id} went out with two payloads");
        }
    }
}

#[test]
fn a_pipeline_removed_for_a_checkpoint_and_readded_changed_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut proc = open(dir.path(), vec![pipeline("balances", "sum")], &[]).unwrap();
    run(dir.path(), &mut proc, &["E1/A/5"]);
    drop(proc);
    // One checkpoint with `balances` removed from the config.
    let mut proc = open(dir.path(), vec![pipeline("other", "sum")], &[]).unwrap();
    run(dir.path(), &mut proc, &["E2/B/1"]);
    drop(proc);
    // Back under the same name with another aggregate: its stored sum must not be read as
    // a count. (Before the fix its progress was gone and the count read A=5 as its own.)
    let err = open(dir.path(), vec![pipeline("balances", "count")], &[])
        .err()
        .expect("a changed definition that comes back is refused");
    assert!(
        matches!(err, ProcessError::IncompatiblePipeline { .. }),
        "{err}"
    );
    // Back unchanged: it continues its state (records while it was away were not its).
    let mut proc = open(dir.path(), vec![pipeline("balances", "sum")], &[]).unwrap();
    assert_eq!(state(&proc, "balances")["A"], (serde_json::json!(5), 1));
    run(dir.path(), &mut proc, &["E3/A/7"]);
    assert_eq!(state(&proc, "balances")["A"], (serde_json::json!(12), 2));
}

#[test]
fn state_whose_definition_the_store_forgot_is_not_read_as_this_ones() {
    let dir = tempfile::tempdir().unwrap();
    let mut proc = open(dir.path(), vec![pipeline("balances", "sum")], &[]).unwrap();
    run(dir.path(), &mut proc, &["E1/A/5"]);
    // A store written by an earlier cairn: state of `balances`, no progress record for it.
    let mut p = proc.store().progress().unwrap();
    p.pipelines.clear();
    proc.store().reset_pipelines(&[], &p).unwrap();
    drop(proc);
    let err = open(dir.path(), vec![pipeline("balances", "count")], &[])
        .err()
        .expect("state of an unknown definition is refused");
    assert!(
        matches!(err, ProcessError::UnknownDefinition { .. })
            && err.to_string().contains("--reset-pipeline balances"),
        "{err}"
    );
    let (_, refusals) = audit(&store(dir.path()), &[pipeline("balances", "count")]).unwrap();
    assert_eq!(refusals.len(), 1, "{refusals:?}");
    let mut proc = open(
        dir.path(),
        vec![pipeline("balances", "count")],
        &["balances"],
    )
    .unwrap();
    assert!(
        state(&proc, "balances").is_empty(),
        "the unknown state is dropped"
    );
    run(dir.path(), &mut proc, &["E9/A/1"]);
    let ids: Vec<String> = outbox(&proc).into_keys().collect();
    assert_eq!(
        ids,
        ["balances/A/1", "balances@2/A/1"],
        "the old result still waits; the new one is generation 2, as the old went out in 1"
    );
}

#[test]
fn a_pipeline_no_longer_configured_is_reported_and_dropped_by_name_durably() {
    let dir = tempfile::tempdir().unwrap();
    let both = vec![pipeline("balances", "sum"), pipeline("counts", "count")];
    let mut proc = open(dir.path(), both, &[]).unwrap();
    run(dir.path(), &mut proc, &["E1/A/5", "E2/B/7"]);
    drop(proc);

    let only = vec![pipeline("balances", "sum")];
    let (unconfigured, refusals) = audit(&store(dir.path()), &only).unwrap();
    assert!(refusals.is_empty(), "{refusals:?}");
    let names: Vec<(String, u64, u64)> = unconfigured
        .iter()
        .map(|u| (u.name.clone(), u.keys, u.dedup_entries))
        .collect();
    assert_eq!(names, [("counts".to_string(), 2, 2)]);

    let err = open(dir.path(), only.clone(), &["nope"]).err().unwrap();
    assert!(matches!(err, ProcessError::UnknownReset { .. }), "{err}");

    // Named: dropped, state and ledger with it (before the fix: "no pipeline of that name").
    let proc = open(dir.path(), only.clone(), &["counts"]).unwrap();
    assert_eq!(proc.store().states(Some("counts")).count(), 0);
    assert_eq!(proc.store().dedup_entries(Some("counts")).count(), 0);
    assert_eq!(
        proc.store().states(Some("balances")).count(),
        2,
        "untouched"
    );
    drop(proc);
    // Durable, and nothing is reported any more.
    let s = store(dir.path());
    assert!(
        !s.progress()
            .unwrap()
            .pipelines
            .iter()
            .any(|p| p.name == "counts")
    );
    assert_eq!(s.pipelines_with_data().unwrap(), ["balances"]);
    assert!(audit(&s, &only).unwrap().0.is_empty());
    drop(s);

    // Added again: it starts empty, in a new generation (its old IDs went out).
    let both = vec![pipeline("balances", "sum"), pipeline("counts", "count")];
    let mut proc = open(dir.path(), both, &[]).unwrap();
    run(dir.path(), &mut proc, &["E3/A/1"]);
    let counts: Vec<String> = outbox(&proc)
        .into_keys()
        .filter(|id| id.starts_with("counts"))
        .collect();
    assert!(counts.contains(&"counts@2/A/1".to_string()), "{counts:?}");
}

#[test]
fn a_store_rebuilt_from_the_log_never_gives_an_output_id_a_second_payload() {
    let dir = tempfile::tempdir().unwrap();
    let mut proc = open(dir.path(), vec![pipeline("balances", "sum")], &[]).unwrap();
    run(dir.path(), &mut proc, &["E1/A/5", "E2/A/7"]);
    let first = outbox(&proc);
    assert_eq!(
        first.keys().collect::<Vec<_>>(),
        ["balances/A/2"],
        "generation 1 keeps the ID format of before"
    );
    assert!(first["balances/A/2"].get("generation").is_none());
    drop(proc);

    // Move the store aside and rebuild under another definition: replay gives A/2 again,
    // now a count of 2 instead of a sum of 12.
    std::fs::rename(dir.path().join("store"), dir.path().join("store.old")).unwrap();
    let mut proc = open(dir.path(), vec![pipeline("balances", "count")], &[]).unwrap();
    run(dir.path(), &mut proc, &[]);
    let second = outbox(&proc);
    assert_eq!(second.keys().collect::<Vec<_>>(), ["balances@2/A/2"]);
    assert_eq!(second["balances@2/A/2"]["generation"], 2);
    assert_eq!(second["balances@2/A/2"]["value"], 2);
    assert_no_id_has_two_payloads(&first, &second);
    drop(proc);

    // A plain restart keeps the generation: no new IDs for the same results.
    let mut proc = open(dir.path(), vec![pipeline("balances", "count")], &[]).unwrap();
    run(dir.path(), &mut proc, &["E3/A/1"]);
    assert!(outbox(&proc).contains_key("balances@2/A/3"));
    let text = std::fs::read_to_string(dir.path().join("generations")).unwrap();
    assert!(text.lines().any(|l| l == "balances 2"), "{text}");
}

#[test]
fn a_reset_and_then_a_rebuild_under_the_same_definition_stay_distinct() {
    let dir = tempfile::tempdir().unwrap();
    let sum = || vec![pipeline("balances", "sum")];
    let mut proc = open(dir.path(), sum(), &[]).unwrap();
    run(dir.path(), &mut proc, &["E1/A/5"]);
    let mut sent = outbox(&proc);
    drop(proc);
    // Reset (same definition): A starts again at 7, version 2 continues above 1.
    let mut proc = open(dir.path(), sum(), &["balances"]).unwrap();
    run(dir.path(), &mut proc, &["E2/A/7"]);
    let after_reset = outbox(&proc);
    assert_eq!(after_reset["balances@2/A/2"]["value"], 7);
    assert_no_id_has_two_payloads(&sent, &after_reset);
    sent.extend(after_reset);
    drop(proc);
    // Rebuild: the store no longer knows about the reset and folds E1 and E2 together.
    std::fs::rename(dir.path().join("store"), dir.path().join("store.old")).unwrap();
    let mut proc = open(dir.path(), sum(), &[]).unwrap();
    run(dir.path(), &mut proc, &[]);
    let rebuilt = outbox(&proc);
    assert_eq!(rebuilt["balances@3/A/2"]["value"], 12);
    assert_no_id_has_two_payloads(&sent, &rebuilt);
}

#[test]
fn the_engine_keeps_dormant_pipelines_after_the_configured_ones() {
    let dormant = PipelineProgress {
        keys: 3,
        generation: 4,
        ..PipelineProgress::new(&pipeline("gone", "sum"), 4)
    };
    let kept = PipelineProgress {
        keys: 1,
        generation: 2,
        ..PipelineProgress::new(&pipeline("balances", "sum"), 2)
    };
    let progress = Progress {
        pipelines: vec![dormant.clone(), kept.clone()],
        ..Default::default()
    };
    let mut engine = Engine::new(vec![pipeline("balances", "sum")], progress);
    assert_eq!(engine.progress().pipelines, [kept, dormant.clone()]);
    let mut mem = MemState::default();
    let rec = cairn::model::Record {
        offset: 0,
        received_at_ms: 1,
        topic: "pay/x".into(),
        payload: b"E1/A/5".to_vec(),
        qos: 1,
        retain: false,
    };
    engine.apply(&mem, &rec).unwrap();
    let cp = engine.take_checkpoint();
    mem.commit(&cp);
    assert_eq!(cp.progress.pipelines[1], dormant, "checkpointed untouched");
    let (_, out) = &cp.batch.outputs[0];
    assert_eq!(out.id, "balances@2/A/1");
    let body: serde_json::Value = serde_json::from_slice(&out.payload).unwrap();
    assert_eq!(body["generation"], 2);
}

// ---- through the binary ----

const BALANCES: &str = "[[pipeline]]\nname = \"balances\"\ntopics = [\"pay/#\"]\n\
    format = \"delimited\"\nevent_id = \"0\"\nkey = \"1\"\nvalue = \"2\"\naggregate = \"sum\"\n\
    output_topic = \"balances/{key}\"\n";
const COUNTS: &str = "[[pipeline]]\nname = \"counts\"\ntopics = [\"pay/#\"]\n\
    format = \"delimited\"\nevent_id = \"0\"\nkey = \"1\"\naggregate = \"count\"\n\
    output_topic = \"counts/{key}\"\n";

fn status_json(agent: &CairnProcess) -> serde_json::Value {
    let (st, out, err) = agent.command(&["status", "--offline", "--json"]);
    assert!(st.success(), "{err}");
    serde_json::from_str(&out).unwrap()
}

#[test]
fn a_removed_pipeline_is_reported_by_status_validate_and_the_journal_then_dropped() {
    let broker = Broker::start();
    let mut cfg = AgentConfig::new(broker.port(), &format!("{BALANCES}\n{COUNTS}"));
    let mut agent = CairnProcess::new(&cfg);
    agent.start_connected();
    publish_all(
        broker.port(),
        &[
            ("pay/x".into(), b"E1/A/5".to_vec(), false),
            ("pay/x".into(), b"E2/B/7".to_vec(), false),
        ],
    );
    assert!(support::wait_until(Duration::from_secs(10), || {
        agent.checkpointed_offset() == Some(2)
    }));
    assert!(agent.terminate().success());

    cfg.pipelines = BALANCES.into();
    agent.rewrite_config(&cfg);
    let v = status_json(&agent);
    let names: Vec<&str> = v["pipelines"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["balances"], "{v}");
    let u = &v["unconfigured_pipelines"][0];
    assert_eq!(
        (&u["name"], &u["keys"], &u["drop_with"]),
        (
            &serde_json::json!("counts"),
            &serde_json::json!(2),
            &serde_json::json!("cairn run --reset-pipeline counts")
        ),
        "{v}"
    );
    let (st, out, _) = agent.command(&["validate"]);
    assert!(st.success());
    assert!(
        out.contains("pipeline `counts` is not configured: 2 keys"),
        "{out}"
    );
    let (_, text, _) = agent.command(&["status", "--offline"]);
    assert!(text.contains("--reset-pipeline counts"), "{text}");

    // The journal says it at start; the state stays.
    agent.start_connected();
    assert!(
        agent
            .run_stderr()
            .contains("pipeline `counts` is not configured, and its stored state is kept"),
        "{}",
        agent.run_stderr()
    );
    assert!(agent.terminate().success());
    assert_eq!(
        status_json(&agent)["unconfigured_pipelines"][0]["name"],
        "counts"
    );

    // Dropped by name.
    agent.start_with_args(&["--reset-pipeline", "counts"]);
    agent.wait_connected(Duration::from_secs(20));
    assert!(agent.run_stderr().contains("pipeline `counts` dropped"));
    assert!(agent.terminate().success());
    let v = status_json(&agent);
    assert_eq!(v["unconfigured_pipelines"], serde_json::json!([]), "{v}");
    let (_, out, _) = agent.command(&["inspect", "state", "--pipeline", "counts", "--json"]);
    assert!(out.trim().is_empty(), "{out}");
    let (_, out, _) = agent.command(&["validate"]);
    assert!(!out.contains("counts"), "{out}");
}

#[test]
fn results_of_a_store_rebuilt_under_a_new_definition_go_out_as_a_new_generation() {
    let broker = Broker::start();
    let collector = Collector::start(broker.port(), "balances/#");
    let mut cfg = AgentConfig::new(broker.port(), BALANCES);
    let mut agent = CairnProcess::new(&cfg);
    agent.start_connected();
    publish_all(
        broker.port(),
        &[
            ("pay/x".into(), b"E1/A/5".to_vec(), false),
            ("pay/x".into(), b"E2/A/7".to_vec(), false),
        ],
    );
    let got = |n: &str| {
        collector
            .messages()
            .iter()
            .any(|m| String::from_utf8_lossy(&m.payload).contains(n))
    };
    assert!(support::wait_until(Duration::from_secs(10), || got(
        "\"value\":12"
    )));
    assert!(agent.terminate().success());

    // The operator moves the store aside and changes the aggregate; replay rebuilds.
    let data = agent.data_dir();
    std::fs::rename(data.join("store"), data.join("store.aside")).unwrap();
    cfg.pipelines = BALANCES.replace(
        "value = \"2\"\naggregate = \"sum\"",
        "aggregate = \"count\"",
    );
    agent.rewrite_config(&cfg);
    agent.start_connected();
    assert!(
        support::wait_until(Duration::from_secs(10), || got("\"generation\":2")),
        "{}",
        agent.stderr_tail(20)
    );
    assert!(agent.terminate().success());
    assert!(agent.stderr().contains("starts empty in generation 2"));

    let mut by_id: BTreeMap<String, Vec<serde_json::Value>> = BTreeMap::new();
    for m in collector.messages() {
        let v: serde_json::Value = serde_json::from_slice(&m.payload).unwrap();
        by_id
            .entry(v["id"].as_str().unwrap().into())
            .or_default()
            .push(v);
    }
    for (id, payloads) in &by_id {
        assert!(
            payloads.windows(2).all(|w| w[0] == w[1]),
            "output ID {id} went out with different payloads: {payloads:?}"
        );
    }
    assert!(by_id.contains_key("balances@2/A/2"), "{by_id:?}");
}

#[test]
fn inspect_shows_a_dormant_windowed_pipelines_state_with_its_stored_window() {
    let dir = tempfile::tempdir().unwrap();
    let windowed = "[[pipeline]]\nname = \"per_minute\"\ntopics = [\"pay/#\"]\n\
        format = \"delimited\"\nevent_id = \"0\"\nkey = \"1\"\nevent_time = \"2\"\n\
        aggregate = \"count\"\nwindow = { size = \"1m\" }\n\
        output_topic = \"per_minute/{key}/{window_start}\"\n";
    let write = |pipelines: &str| {
        let mut cfg = AgentConfig::new(crate::support::free_port(), pipelines);
        cfg.data_dir = Some(dir.path().to_path_buf());
        cfg.write(dir.path());
    };
    write(&format!("{BALANCES}\n{windowed}"));
    let cfg = cairn::config::load(&dir.path().join("cairn.toml")).unwrap();
    let mut proc = open(dir.path(), cfg.pipelines.clone(), &[]).unwrap();
    run(dir.path(), &mut proc, &["E1/A/60500"]);
    drop(proc);
    write(BALANCES);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_cairn"))
        .arg("--config")
        .arg(dir.path().join("cairn.toml"))
        .args(["inspect", "state", "--pipeline", "per_minute", "--json"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let v: serde_json::Value =
        serde_json::from_str(text.trim()).unwrap_or_else(|e| panic!("{e}: {text}"));
    assert_eq!(
        (&v["key"], &v["window_start"], &v["window_end"]),
        (
            &serde_json::json!("A"),
            &serde_json::json!(60000),
            &serde_json::json!(120000)
        ),
        "{v}"
    );
}
