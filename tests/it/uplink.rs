//! The uplink (issue 13): results go to a second, central broker over their own connection,
//! and the outbox holds them through outages, kills, power cuts and central restarts.
//!
//! Every scenario has two private brokers: `local` (inputs, `[mqtt]`) and `central`
//! (results, `[uplink]`), and the link between the agent and `central` goes through a
//! [`Proxy`] that the test cuts. A persistent-session subscriber on `central` records
//! everything; at the end it must hold exactly the oracle: per pipeline and key, every
//! changelog version 1..=n and, for both modes, the final version carrying the oracle's sum.
//! Every ID seen more than once carried the same payload, and per key the versions first
//! seen ascend.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use serde_json::Value;

use crate::support::agent::{AgentConfig, CairnProcess};
use crate::support::central::DurableCollector;
use crate::support::powercut::{PowerCut, kill_rounds};
use crate::support::{
    Broker, Collector, Proxy, Seen, free_port, publish_all, unique_id, wait_until,
};

const PREFIX: &str = "site/box-1/";
const KEYS: u64 = 6;

const PIPELINES: &str = r#"
[[pipeline]]
name = "sums"
topics = ["in/#"]
format = "json"
event_id = "/id"
key = "/k"
value = "/v"
aggregate = "sum"
dedup_window = "7d"
output_topic = "sums/{key}"
emit = "changelog"

[[pipeline]]
name = "last"
topics = ["in/#"]
format = "json"
event_id = "/id"
key = "/k"
value = "/v"
aggregate = "sum"
dedup_window = "7d"
output_topic = "last/{key}"
emit = "upsert"
"#;

/// Events `from..to`: unique IDs over `KEYS` keys (named with `pad` to make results
/// bigger), small signed values.
fn events(from: u64, to: u64, pad: &str) -> Vec<(String, Vec<u8>, bool)> {
    (from..to)
        .map(|i| {
            let payload = format!(
                r#"{{"id":"E{i}","k":"K{}{pad}","v":{}}}"#,
                (i * 7) % KEYS,
                (i % 13) as i64 - 3
            );
            ("in/dev".to_string(), payload.into_bytes(), false)
        })
        .collect()
}

/// Per key: (number of events, sum), folded over events `0..n`.
fn oracle(n: u64, pad: &str) -> BTreeMap<String, (u64, i64)> {
    let mut o: BTreeMap<String, (u64, i64)> = BTreeMap::new();
    for i in 0..n {
        let e = o.entry(format!("K{}{pad}", (i * 7) % KEYS)).or_default();
        e.0 += 1;
        e.1 += (i % 13) as i64 - 3;
    }
    o
}

/// One result as the central side saw it.
struct Result1 {
    pipeline: String,
    key: String,
    id: String,
    version: u64,
    value: i64,
}

fn decode(m: &Seen) -> Result1 {
    let v: Value = serde_json::from_slice(&m.payload).expect("a result is JSON");
    Result1 {
        pipeline: v["pipeline"].as_str().unwrap().into(),
        key: v["key"].as_str().unwrap().into(),
        id: v["id"].as_str().unwrap().into(),
        version: v["version"].as_u64().unwrap(),
        value: v["value"].as_i64().unwrap(),
    }
}

/// Per (pipeline, key): the highest version seen and its value.
fn finals(seen: &[Seen]) -> BTreeMap<(String, String), (u64, i64)> {
    let mut f: BTreeMap<(String, String), (u64, i64)> = BTreeMap::new();
    for r in seen.iter().map(decode) {
        let e = f.entry((r.pipeline, r.key)).or_default();
        if r.version > e.0 {
            *e = (r.version, r.value);
        }
    }
    f
}

/// The central side holds exactly the oracle (`Err` lists every deviation).
fn check(
    seen: &[Seen],
    oracle: &BTreeMap<String, (u64, i64)>,
    changelog: &[&str],
) -> Result<(), String> {
    let mut errs = Vec::new();
    let mut payloads: HashMap<String, &[u8]> = HashMap::new();
    let mut versions: BTreeMap<(String, String), Vec<u64>> = BTreeMap::new();
    for m in seen {
        let r = decode(m);
        let topic_key = m.topic.strip_prefix(PREFIX);
        if topic_key != Some(&format!("{}/{}", r.pipeline, r.key)) {
            errs.push(format!(
                "topic {} is not {PREFIX}{}/{}",
                m.topic, r.pipeline, r.key
            ));
        }
        if let Some(p) = payloads.insert(r.id.clone(), &m.payload)
            && p != m.payload.as_slice()
        {
            errs.push(format!("{} seen with two payloads", r.id));
        }
        let v = versions.entry((r.pipeline, r.key)).or_default();
        if !v.contains(&r.version) {
            v.push(r.version);
        }
    }
    for ((p, k), first_seen) in &versions {
        if first_seen.windows(2).any(|w| w[0] > w[1]) {
            errs.push(format!(
                "{p}/{k}: versions first seen out of order: {first_seen:?}"
            ));
        }
    }
    let f = finals(seen);
    for pipeline in ["sums", "last"] {
        for (k, &(n, sum)) in oracle {
            let key = (pipeline.to_string(), k.clone());
            match f.get(&key) {
                Some(&(v, value)) if (v, value) == (n, sum) => {}
                got => errs.push(format!(
                    "{pipeline}/{k}: final {got:?}, oracle ({n}, {sum})"
                )),
            }
            if changelog.contains(&pipeline) {
                let all: BTreeSet<u64> =
                    versions.get(&key).into_iter().flatten().copied().collect();
                if all != (1..=n).collect() {
                    errs.push(format!(
                        "{pipeline}/{k}: {} distinct versions, oracle 1..={n}",
                        all.len()
                    ));
                }
            }
        }
    }
    if f.keys().any(|(_, k)| !oracle.contains_key(k)) {
        errs.push(format!(
            "keys beyond the oracle: {:?}",
            f.keys().collect::<Vec<_>>()
        ));
    }
    if errs.is_empty() {
        Ok(())
    } else {
        Err(errs.join("\n"))
    }
}

/// Wait until every key's final version reached the oracle's, then compare exactly.
fn expect_oracle(
    central: &DurableCollector,
    oracle: &BTreeMap<String, (u64, i64)>,
    changelog: &[&str],
    agent: &CairnProcess,
) {
    let done = wait_until(Duration::from_secs(120), || {
        let f = finals(&central.messages());
        ["sums", "last"].iter().all(|p| {
            oracle.iter().all(|(k, (n, _))| {
                f.get(&(p.to_string(), k.clone()))
                    .is_some_and(|(v, _)| v >= n)
            })
        })
    });
    // Whatever was still on its way arrives too: it must not change the verdict.
    std::thread::sleep(Duration::from_millis(500));
    let seen = central.messages();
    if let Err(e) = check(&seen, oracle, changelog) {
        panic!(
            "central side after {} messages (all final versions reached: {done}):\n{e}\nagent:\n{}",
            seen.len(),
            agent.stderr_tail(40)
        );
    }
    assert!(
        done,
        "the final versions never all arrived:\n{}",
        agent.stderr_tail(40)
    );
    let distinct: BTreeSet<String> = seen.iter().map(|m| decode(m).id).collect();
    eprintln!(
        "central side: {} messages, {} distinct IDs ({} re-sent)",
        seen.len(),
        distinct.len(),
        seen.len() - distinct.len()
    );
}

/// Local and central brokers, the cuttable link, the central subscriber, and the agent's
/// config (its data under `data_dir` when given).
struct Fleet {
    local: Broker,
    central: Broker,
    link: Proxy,
    subscriber: DurableCollector,
    /// Everything on the local broker: inputs only, no result may go there.
    local_seen: Collector,
    cfg: AgentConfig,
}

impl Fleet {
    fn new(pipelines: &str) -> Fleet {
        let local = Broker::start();
        let central = Broker::start();
        let link = Proxy::start(central.port());
        let subscriber = DurableCollector::start(central.port(), &format!("{PREFIX}#"));
        let local_seen = Collector::start(local.port(), "#");
        let up_id = unique_id("uplink").replace('-', "_");
        let mut cfg =
            AgentConfig::new(local.port(), pipelines).with_uplink(link.port(), &up_id, PREFIX);
        cfg.extra = format!("[metrics]\nlisten = \"127.0.0.1:{}\"\n", free_port());
        Fleet {
            local,
            central,
            link,
            subscriber,
            local_seen,
            cfg,
        }
    }

    /// Start the agent and wait until both connections are up.
    fn start(&self, agent: &mut CairnProcess) {
        agent.start();
        let up = wait_until(Duration::from_secs(20), || {
            let s = agent.run_stderr();
            s.contains("mqtt: connected") && s.contains("uplink: connected")
        });
        assert!(
            up,
            "the agent did not connect both ways:\n{}",
            agent.stderr_tail(40)
        );
    }

    /// Cut the uplink and keep it down.
    fn cut(&self) {
        self.link.pause(true);
        self.link.cut();
    }

    fn restore(&self) {
        self.link.pause(false);
    }

    /// No result went to the local broker: with an uplink, inputs only come from there.
    fn expect_nothing_published_locally(&self) {
        let stray: Vec<String> = self
            .local_seen
            .messages()
            .into_iter()
            .map(|m| m.topic)
            .filter(|t| !t.starts_with("in/"))
            .collect();
        assert!(stray.is_empty(), "results on the local broker: {stray:?}");
        assert!(
            !self.local_seen.messages().is_empty(),
            "the local collector saw no inputs"
        );
    }
}

/// `cairn status --json` of the running agent.
fn status(agent: &CairnProcess) -> Value {
    let (st, out, err) = agent.command(&["status", "--json"]);
    assert!(st.success(), "status failed: {err}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("status JSON: {e}: {out}"))
}

/// A long outage: streams while the uplink is down, the agent killed several times (and
/// its disk power-cut once when `powercut`), then the link returns.
fn outage(powercut: bool) {
    let fleet = Fleet::new(PIPELINES);
    let cut = powercut.then(PowerCut::mount);
    let mut cfg = fleet.cfg.clone();
    if let Some(c) = &cut {
        cfg.data_dir = Some(c.mount.join("data"));
    }
    let mut agent = CairnProcess::new(&cfg);
    agent.set_log_filter(Some("info"));
    fleet.start(&mut agent);
    // Some results go through while the link is up.
    publish_all(fleet.local.port(), &events(0, 100, ""));
    assert!(
        wait_until(Duration::from_secs(20), || fleet.subscriber.count() > 0),
        "nothing reached the central broker while the link was up:\n{}",
        agent.stderr_tail(40)
    );
    fleet.cut();
    agent.wait_for_stderr("uplink: lost", Duration::from_secs(20));
    let port = fleet.local.port();
    let mut next = kill_rounds(&mut agent, cut.as_ref(), port, 100, 600, |from, to| {
        events(from, to, "")
    });
    // The last stretch runs to the end with the link still down: everything waits.
    agent.start();
    agent.wait_for_stderr("mqtt: connected", Duration::from_secs(20));
    publish_all(fleet.local.port(), &events(next, next + 200, ""));
    next += 200;
    let waiting = wait_until(Duration::from_secs(30), || {
        agent.command(&["status", "--json"]).0.success()
            && status(&agent)["pipelines"]
                .as_array()
                .is_some_and(|p| p.iter().all(|p| p["applied"].as_u64() == Some(next)))
    });
    assert!(
        waiting,
        "the agent did not catch up with its inputs:\n{}",
        agent.stderr_tail(40)
    );
    let s = status(&agent);
    assert_eq!(s["uplink"]["connected"], Value::Bool(false), "{s}");
    assert!(s["outbox"]["entries"].as_u64().unwrap() > 0, "{s}");
    assert!(s["outbox"]["bytes"].as_u64().unwrap() > 0, "{s}");
    // Its oldest result waits since before the kills, not since this start.
    let oldest = s["outbox"]["oldest_age_seconds"].as_f64().unwrap();
    assert!(oldest > 1.0, "oldest {oldest}s: {s}");
    let (_, human, _) = agent.command(&["status"]);
    assert!(human.contains("uplink      DOWN for "), "{human}");
    assert!(human.contains("queue       "), "{human}");
    let before = fleet.subscriber.count();
    fleet.restore();
    agent.wait_for_stderr("uplink: backlog draining", Duration::from_secs(20));
    // New results keep flowing while the backlog drains, and the agent is killed once
    // mid-drain: what it sent but had not seen acknowledged goes again, with the same IDs.
    let live = events(next, next + 300, "");
    next += 300;
    let publisher = std::thread::spawn(move || publish_all(port, &live));
    let some = wait_until(Duration::from_secs(30), || {
        fleet.subscriber.count() >= before + 100
    });
    assert!(some, "the drain did not start:\n{}", agent.stderr_tail(40));
    agent.kill();
    publisher.join().expect("publisher");
    fleet.start(&mut agent);
    expect_oracle(&fleet.subscriber, &oracle(next, ""), &["sums"], &agent);
    agent.wait_for_stderr("uplink: backlog drained", Duration::from_secs(20));
    assert!(fleet.subscriber.count() > before);
    fleet.expect_nothing_published_locally();
    assert_eq!(
        agent.terminate().code(),
        Some(0),
        "{}",
        agent.stderr_tail(20)
    );
    drop(cut);
}

#[test]
fn a_long_outage_with_kills_ends_with_the_central_side_holding_exactly_the_oracle() {
    outage(false);
}

#[test]
fn a_power_cut_during_the_outage_loses_nothing_for_the_central_side() {
    outage(true);
}

#[test]
fn the_central_broker_restarted_mid_drain_loses_nothing() {
    let mut fleet = Fleet::new(PIPELINES);
    let mut agent = CairnProcess::new(&fleet.cfg);
    agent.set_log_filter(Some("info"));
    fleet.start(&mut agent);
    fleet.cut();
    agent.wait_for_stderr("uplink: lost", Duration::from_secs(20));
    let n = 3_000;
    publish_all(fleet.local.port(), &events(0, n, ""));
    let all_in = wait_until(Duration::from_secs(30), || {
        status(&agent)["pipelines"]
            .as_array()
            .is_some_and(|p| p.iter().all(|p| p["applied"].as_u64() == Some(n)))
    });
    assert!(all_in, "{}", agent.stderr_tail(40));
    fleet.restore();
    let some = wait_until(Duration::from_secs(30), || fleet.subscriber.count() >= 200);
    assert!(some, "nothing drained:\n{}", agent.stderr_tail(40));
    let at_restart = fleet.subscriber.count();
    fleet.central.restart_clean();
    // Mid-drain: the changelog alone has `n` results, most of them not yet delivered.
    assert!(
        at_restart < n as usize / 2,
        "the drain was over before the restart ({at_restart})"
    );
    eprintln!("central restarted after {at_restart} of {n}+ results");
    expect_oracle(&fleet.subscriber, &oracle(n, ""), &["sums"], &agent);
    assert_eq!(
        agent.terminate().code(),
        Some(0),
        "{}",
        agent.stderr_tail(20)
    );
}

/// Issue 16: at the outbox's bound processing waits, not input: every input is still
/// logged and acknowledged (the broker queues nothing and sends nothing twice), the records
/// wait in the log, and once the link returns they are processed from there, exactly once.
#[test]
fn a_full_outbox_pauses_processing_not_input_then_catches_up_when_the_link_returns_losing_nothing()
{
    // Long keys: each changelog result is a few hundred bytes, so 1 MiB fills fast (the
    // upsert pipeline beside it holds one result per key).
    let mut fleet = Fleet::new(PIPELINES);
    fleet.cfg.outbox = "max_entries = 1000000\nmax_size = \"1MiB\"\ninflight = 100\n\
                        drain_timeout = \"5s\"\n"
        .into();
    let mut agent = CairnProcess::new(&fleet.cfg);
    agent.set_log_filter(Some("info"));
    fleet.start(&mut agent);
    fleet.cut();
    agent.wait_for_stderr("uplink: lost", Duration::from_secs(20));
    let pad = "p".repeat(100);
    let n = 6_000;
    publish_all(fleet.local.port(), &events(0, n, &pad));
    agent.wait_for_stderr(
        "processing waits (outbox.max_size): input is still logged and acknowledged",
        Duration::from_secs(60),
    );
    // Every input logged and acknowledged, although processing waits.
    let all_in = wait_until(Duration::from_secs(30), || {
        status(&agent)["log"]["next_offset"].as_u64() == Some(n)
    });
    assert!(all_in, "inputs not all logged: {}", status(&agent));
    let s = status(&agent);
    assert_eq!(s["backpressure"], 0, "{s}");
    assert_eq!(s["metrics"]["cairn_acked_total"], n, "{s}");
    assert_eq!(s["metrics"]["cairn_held_let_go_total"], 0, "{s}");
    let behind = s["processing_behind"].as_u64().unwrap();
    assert!(behind > 0, "{s}");
    assert!(s["outbox"]["bytes"].as_u64().unwrap() >= 1 << 20, "{s}");
    assert_eq!(s["outbox"]["max_bytes"], 1 << 20, "{s}");
    assert_eq!(s["uplink"]["connected"], false, "{s}");
    assert_eq!(s["outbox"]["drain_rate"], 0, "nothing acknowledged: {s}");
    assert_eq!(
        s["outbox"]["drain_eta_seconds"],
        Value::Null,
        "not draining: {s}"
    );
    let applied = |s: &Value| s["pipelines"][0]["applied"].as_u64().unwrap();
    let stuck = applied(&s);
    assert_eq!(stuck + behind, n, "applied + behind = logged: {s}");
    std::thread::sleep(Duration::from_millis(1_000));
    let later = status(&agent);
    assert_eq!(
        applied(&later),
        stuck,
        "still processing at the bound: {stuck} then {}",
        applied(&later)
    );
    fleet.restore();
    expect_oracle(&fleet.subscriber, &oracle(n, &pad), &["sums"], &agent);
    agent.wait_for_stderr("processing caught up with the log", Duration::from_secs(20));
    assert!(
        !agent.stderr().contains("backpressure on"),
        "{}",
        agent.stderr_tail(20)
    );
    assert_eq!(status(&agent)["processing_behind"], 0);
    // Drained: the rate of the last seconds shows, and nothing is left to wait for.
    let drained = wait_until(Duration::from_secs(20), || {
        status(&agent)["outbox"]["entries"] == 0
    });
    assert!(drained, "{}", agent.stderr_tail(20));
    let s = status(&agent);
    assert_eq!(s["uplink"]["connected"], true, "{s}");
    assert!(s["outbox"]["drain_rate"].as_f64().unwrap() > 0.0, "{s}");
    assert_eq!(s["outbox"]["drain_eta_seconds"], 0, "{s}");
    assert_eq!(s["outbox"]["bytes"], 0, "{s}");
    assert_eq!(
        agent.terminate().code(),
        Some(0),
        "{}",
        agent.stderr_tail(20)
    );
}
