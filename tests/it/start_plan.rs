//! Start-up as one plan (issue 28, item 6), and the holes the plan closes (issue 26): what
//! the last run left (the store, the generations, the last run's pipelines, a savepoint
//! restore) against the config decides which pipelines settle under the old definitions,
//! which start a new generation, and what is refused. The decision itself is tested as a
//! table in `src/agent/plan.rs`; these drive the binary through the cases that gave output
//! IDs a second payload or a start that skipped the settle.

use std::collections::HashMap;
use std::time::Duration;

use crate::support::agent::{AgentConfig, CairnProcess};
use crate::support::{Broker, Collector, publish_all, wait_until};

fn pipeline(name: &str, start: &str, extra: &str) -> String {
    format!(
        "[[pipeline]]\nname = \"{name}\"\ntopics = [\"m/#\"]\nformat = \"delimited\"\n\
         event_id = \"0\"\nkey = \"{{topic[1]}}\"\nvalue = \"1\"\naggregate = \"sum\"\n\
         emit = \"changelog\"\nstart = \"{start}\"\noutput_topic = \"{name}/{{key}}\"\n{extra}\n"
    )
}

/// Event `id` of machine `id % 5`, value `id`.
fn event(id: u64) -> (String, Vec<u8>, bool) {
    (
        format!("m/M{}", id % 5),
        format!("E{id}/{id}").into_bytes(),
        false,
    )
}

/// Output ID → every distinct payload it arrived with, for results on `prefix`.
fn payloads(c: &Collector, prefix: &str) -> HashMap<String, Vec<String>> {
    let mut m: HashMap<String, Vec<String>> = HashMap::new();
    for s in c.messages() {
        if !s.topic.starts_with(prefix) {
            continue;
        }
        let v: serde_json::Value = serde_json::from_slice(&s.payload).unwrap();
        let id = v["id"].as_str().unwrap().to_string();
        let text = String::from_utf8_lossy(&s.payload).into_owned();
        let e = m.entry(id).or_default();
        if !e.contains(&text) {
            e.push(text);
        }
    }
    m
}

fn assert_one_payload_per_id(c: &Collector, prefix: &str) {
    let twice: Vec<_> = payloads(c, prefix)
        .into_iter()
        .filter(|(_, p)| p.len() > 1)
        .collect();
    assert!(
        twice.is_empty(),
        "{} output IDs carry two payloads, e.g. {:?}",
        twice.len(),
        twice.first()
    );
}

fn status(agent: &CairnProcess) -> serde_json::Value {
    let (st, out, err) = agent.command(&["status", "--offline", "--json"]);
    assert!(st.success(), "{err}");
    serde_json::from_str(&out).unwrap()
}

fn generation(agent: &CairnProcess, name: &str) -> u64 {
    let v = status(agent);
    v["pipelines"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == name)
        .and_then(|p| p["generation"].as_u64())
        .unwrap_or_else(|| panic!("no generation for {name}: {v}"))
}

/// Issue 26, finding 3: killed while a backfill's results were going out (none of them
/// checkpointed), then the backfilling pipeline is edited. The start must not resume the
/// backfill under the new settings in the old generation: that recomputed IDs that had
/// gone out (reproduced: thousands of IDs with two payloads).
#[test]
fn a_crash_mid_backfill_then_an_edit_gives_no_published_id_a_second_payload() {
    let broker = Broker::start();
    let outputs = Collector::start(broker.port(), "back/#");
    let mut cfg = AgentConfig::new(broker.port(), &pipeline("base", "latest", ""));
    let mut agent = CairnProcess::new(&cfg);
    agent.start_connected();
    publish_all(broker.port(), &(0..3000).map(event).collect::<Vec<_>>());
    assert!(
        wait_until(Duration::from_secs(30), || agent.checkpointed_offset()
            == Some(3000)),
        "{}",
        agent.stderr_tail(20)
    );
    assert!(agent.terminate().success());

    // `back` backfills the 3000 records; no checkpoint runs while it does, and the agent
    // dies after its 400th publish.
    cfg.pipelines = format!(
        "{}{}",
        pipeline("base", "latest", ""),
        pipeline("back", "earliest", "")
    );
    cfg.checkpoint = "interval = \"1h\"\nmax_records = 100000\n".into();
    agent.rewrite_config(&cfg);
    agent.note("failpoints=[outbox.after_publish=abort@400]");
    agent.start_with_env(&[("CAIRN_FAILPOINTS", "outbox.after_publish=abort@400")]);
    let exit = agent.wait_exit(Duration::from_secs(60));
    assert!(
        exit.is_some_and(|s| !s.success()),
        "the failpoint did not stop the agent:\n{}",
        agent.stderr_tail(20)
    );
    assert!(
        wait_until(Duration::from_secs(10), || payloads(&outputs, "back/")
            .len()
            >= 100),
        "too few of back's results went out before the kill: {}\n{}",
        payloads(&outputs, "back/").len(),
        agent.stderr_tail(30)
    );

    // The operator edits `back`: a filter that changes every key's first versions.
    cfg.pipelines = format!(
        "{}{}",
        pipeline("base", "latest", ""),
        pipeline("back", "earliest", "where = '{1} > 2'")
    );
    cfg.checkpoint = "interval = \"50ms\"\nmax_records = 2000\n".into();
    agent.rewrite_config(&cfg);
    agent.start_connected();
    assert!(
        wait_until(Duration::from_secs(60), || agent
            .run_stderr()
            .contains("pipeline `back`: backfill done")),
        "{}",
        agent.stderr_tail(20)
    );
    // Its last result (the 2997 records that pass the filter, one version each).
    assert!(
        wait_until(Duration::from_secs(30), || payloads(&outputs, "back")
            .keys()
            .any(|id| id.ends_with("/M4/599"))),
        "back's last result never arrived:\n{}",
        agent.stderr_tail(20)
    );
    assert!(agent.terminate().success(), "{}", agent.stderr_tail(20));
    assert_one_payload_per_id(&outputs, "back");
    assert!(
        generation(&agent, "back") >= 2,
        "back went on in the generation whose results went out under the old settings"
    );
}

/// Issue 26, finding 4 (the start's side): a record of the last run's pipelines that exists
/// but does not read stops the start with an error that says what to do, instead of a
/// warning and a start that skips the settle.
#[test]
fn an_unreadable_record_of_the_last_runs_pipelines_stops_the_start_and_says_what_to_do() {
    let broker = Broker::start();
    let cfg = AgentConfig::new(broker.port(), &pipeline("sums", "latest", ""));
    let mut agent = CairnProcess::new(&cfg);
    agent.start_connected();
    assert!(agent.terminate().success());
    let file = agent.data_dir().join("pipelines.json");
    assert!(file.exists(), "the start records its pipelines");
    std::fs::write(&file, b"[{\"name\": \"sums\", \"topics\": [").unwrap();

    agent.start();
    let exit = agent.wait_exit(Duration::from_secs(20));
    let err = agent.run_stderr();
    assert_eq!(
        exit.and_then(|s| s.code()),
        Some(1),
        "the start went on over an unreadable pipelines.json:\n{err}"
    );
    assert!(
        err.contains("pipelines.json") && err.contains("settle"),
        "the error does not name the file or what it is for:\n{err}"
    );
    assert!(
        err.contains("remove"),
        "the error does not say what to do:\n{err}"
    );
}

/// Start the agent, publish events 0..50 on the broker at `port`, wait for their checkpoint,
/// stop, and take a savepoint.
fn run_then_savepoint(agent: &mut CairnProcess, port: u16) {
    agent.start_connected();
    publish_all(port, &(0..50).map(event).collect::<Vec<_>>());
    assert!(wait_until(Duration::from_secs(30), || agent
        .checkpointed_offset()
        == Some(50)));
    assert!(agent.terminate().success());
    let (st, _, err) = agent.command(&["savepoint", "create"]);
    assert!(st.success(), "{err}");
}

/// Issue 26: a savepoint restore starts a new generation for the pipelines it restores.
/// Replay from the savepoint under settings changed since then would otherwise compute IDs
/// that went out after the savepoint again, differently.
#[test]
fn a_restored_savepoint_continues_in_a_new_generation_so_no_id_gets_a_second_payload() {
    let broker = Broker::start();
    let outputs = Collector::start(broker.port(), "sums/#");
    let mut cfg = AgentConfig::new(broker.port(), &pipeline("sums", "latest", ""));
    let mut agent = CairnProcess::new(&cfg);
    run_then_savepoint(&mut agent, broker.port());

    agent.start_connected();
    publish_all(broker.port(), &(50..100).map(event).collect::<Vec<_>>());
    assert!(wait_until(Duration::from_secs(30), || agent
        .checkpointed_offset()
        == Some(100)));
    assert!(
        wait_until(Duration::from_secs(10), || payloads(&outputs, "sums/")
            .keys()
            .any(|id| id.ends_with("/M4/20"))),
        "the results after the savepoint did not go out"
    );
    assert!(agent.terminate().success());

    // An edit since the savepoint, and a run under it (which records it as the last run's
    // pipelines); then the restore: replay takes [50, 100) again under the edited pipeline.
    cfg.pipelines = pipeline("sums", "latest", "where = '{1} > 60'");
    agent.rewrite_config(&cfg);
    agent.start_connected();
    assert!(agent.terminate().success());
    let (st, _, err) = agent.command(&["savepoint", "restore", "--latest"]);
    assert!(st.success(), "{err}");
    let before = outputs.messages().len();
    agent.start_connected();
    // The replay's 39 results (records 61..99 pass the new filter) go out.
    assert!(
        wait_until(Duration::from_secs(30), || outputs.messages().len()
            >= before + 39),
        "the replay's results did not go out:\n{}",
        agent.stderr_tail(20)
    );
    assert!(agent.terminate().success());
    assert_one_payload_per_id(&outputs, "sums");
    assert_eq!(generation(&agent, "sums"), 2);
    // A later start is an ordinary one: no new generation again.
    agent.start_connected();
    assert!(agent.terminate().success());
    assert_eq!(generation(&agent, "sums"), 2);
}

/// A JSON pipeline whose definition takes about 3 KB in the progress record (its value
/// pointer is long).
fn wide(name: &str) -> String {
    format!(
        "[[pipeline]]\nname = \"{name}\"\ntopics = [\"w/{name}\"]\nformat = \"json\"\n\
         event_id = \"/id\"\nkey = \"/k\"\nvalue = \"/{}\"\naggregate = \"sum\"\n\
         output_topic = \"{name}/{{key}}\"\n",
        "v".repeat(3000)
    )
}

/// Issue 26: the progress record holds every pipeline the store keeps, dormant ones
/// included, within 96 KiB. A set that cannot fit is refused at start with what to do,
/// not left to fail every checkpoint after it.
#[test]
fn a_start_whose_pipelines_and_dormant_ones_cannot_fit_the_progress_record_is_refused() {
    let broker = Broker::start();
    let first: String = (0..20).map(|i| wide(&format!("a{i}"))).collect();
    let mut cfg = AgentConfig::new(broker.port(), &first);
    let mut agent = CairnProcess::new(&cfg);
    agent.start_connected();
    assert!(agent.terminate().success(), "{}", agent.stderr_tail(20));

    // Twenty others: each set fits alone; with the first twenty dormant, they do not.
    cfg.pipelines = (0..20).map(|i| wide(&format!("b{i}"))).collect();
    agent.rewrite_config(&cfg);
    agent.start();
    let exit = agent.wait_exit(Duration::from_secs(20));
    let err = agent.run_stderr();
    assert_eq!(
        exit.and_then(|s| s.code()),
        Some(1),
        "the start went on with a progress record that cannot be stored:\n{}",
        agent.stderr_tail(20)
    );
    assert!(
        err.contains("progress record") && err.contains("--reset-pipeline"),
        "the error does not say what does not fit or what to do:\n{}",
        agent.stderr_tail(20)
    );
}

/// Per key, the (generation, version) of each result on `prefix` in the order they arrived.
fn arrivals(c: &Collector, prefix: &str) -> HashMap<String, Vec<(u64, u64)>> {
    let mut m: HashMap<String, Vec<(u64, u64)>> = HashMap::new();
    for s in c.messages() {
        if !s.topic.starts_with(prefix) {
            continue;
        }
        let v: serde_json::Value = serde_json::from_slice(&s.payload).unwrap();
        let key = v["key"].as_str().unwrap().to_string();
        let at = (
            v["generation"].as_u64().unwrap_or(1),
            v["version"].as_u64().unwrap(),
        );
        m.entry(key).or_default().push(at);
    }
    m
}

/// The seventh session's soak: a savepoint restore sent the savepoint's outbox again under
/// the IDs of the generation the restore ended, after newer versions of those keys had gone
/// out. A consumer that applies every new ID set those keys back. The restored outbox now
/// goes on in the new generation: per key, what arrives never goes back.
#[test]
fn a_restored_outbox_goes_out_in_the_new_generation_never_behind_what_went_out() {
    restore_with_a_waiting_outbox(false);
}

/// The same, with a crash after the start committed the new generation and moved the outbox
/// into it, before it removed the restore marker: the next start takes one more generation
/// and moves the outbox again. Nothing went out in between, and nothing goes back.
#[test]
fn a_crash_after_the_restored_outbox_moved_takes_one_more_generation_and_nothing_goes_back() {
    restore_with_a_waiting_outbox(true);
}

/// A savepoint taken while the results of 0..50 wait for a central broker that is down;
/// 50..100 and those results go out; then the restore and a start (after a crash at
/// `start.plan_committed` if `crash`).
fn restore_with_a_waiting_outbox(crash: bool) {
    let local = Broker::start();
    let mut central = Broker::start();
    let ups = "[[pipeline]]\nname = \"ups\"\ntopics = [\"m/#\"]\nformat = \"delimited\"\n\
               event_id = \"0\"\nkey = \"{topic[1]}\"\nvalue = \"1\"\naggregate = \"sum\"\n\
               emit = \"upsert\"\noutput_topic = \"ups/{key}\"\n";
    let up_id = crate::support::unique_id("uplink").replace('-', "_");
    let cfg = AgentConfig::new(local.port(), ups).with_uplink(central.port(), &up_id, "c/");
    let mut agent = CairnProcess::new(&cfg);

    // The central broker is down: the results of 0..50 wait in the outbox, and the
    // savepoint holds them.
    central.stop();
    run_then_savepoint(&mut agent, local.port());

    // Back up: the waiting results and those of 50..100 go out, up to version 20 per key.
    central.restart();
    let seen = Collector::start(central.port(), "c/#");
    agent.start_connected();
    publish_all(local.port(), &(50..100).map(event).collect::<Vec<_>>());
    let reached = |generation: u64| {
        let a = arrivals(&seen, "c/ups/");
        a.len() == 5 && a.values().all(|v| v.last() == Some(&(generation, 20)))
    };
    assert!(
        wait_until(Duration::from_secs(30), || reached(1)),
        "the results after the savepoint did not go out: {:?}\n{}",
        arrivals(&seen, "c/ups/"),
        agent.stderr_tail(20)
    );
    assert!(agent.terminate().success());

    let (st, _, err) = agent.command(&["savepoint", "restore", "--latest"]);
    assert!(st.success(), "{err}");
    let mut last = 2;
    if crash {
        let before = seen.messages().len();
        agent.note("failpoints=[start.plan_committed=abort]");
        agent.start_with_env(&[("CAIRN_FAILPOINTS", "start.plan_committed=abort")]);
        let exit = agent.expect_exit(Duration::from_secs(30));
        assert!(
            !exit.success()
                && agent
                    .run_stderr()
                    .contains("waiting results of the restored outbox"),
            "the start did not stop at the failpoint after the move ({exit:?}):\n{}",
            agent.stderr_tail(30)
        );
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(
            seen.messages().len(),
            before,
            "a result went out before the crash"
        );
        last = 3;
    }
    agent.start_connected();
    assert!(
        wait_until(Duration::from_secs(30), || reached(last)),
        "the replay's results did not go out in generation {last}: {:?}\n{}",
        arrivals(&seen, "c/ups/"),
        agent.stderr_tail(20)
    );
    // Whatever the restored outbox still holds goes out before the replay's results.
    std::thread::sleep(Duration::from_millis(500));
    assert!(agent.terminate().success());
    for (key, got) in arrivals(&seen, "c/ups/") {
        assert!(
            got.windows(2).all(|w| w[0] <= w[1]),
            "key {key} went back: (generation, version) in arrival order {got:?}"
        );
        if crash {
            assert!(
                got.iter().all(|(g, _)| *g != 2),
                "key {key}: a result of the generation the crash ended went out: {got:?}"
            );
        }
    }
    assert_one_payload_per_id(&seen, "c/ups/");
    assert!(
        agent
            .stderr()
            .contains("waiting results of the restored outbox"),
        "the start did not say it moved the restored outbox:\n{}",
        agent.stderr_tail(30)
    );
}
