//! Result sinks (issues 27 and 29): a publish the broker keeps refusing by closing the
//! connection is set aside as a dead letter for that destination while the others flow,
//! and the operator can drop one stuck result with `cairn outbox drop`.

use std::time::Duration;

use serde_json::Value;

use crate::support::agent::{AgentConfig, CairnProcess};
use crate::support::{Broker, BrokerConfig, Collector, publish_all, wait_until};

/// Results per key on `out/{key}`, one per event (changelog), keys up to 600 bytes.
const PIPELINE: &str = r#"
[[pipeline]]
name = "p"
topics = ["in/#"]
format = "json"
event_id = "/id"
key = "/k"
value = "/v"
aggregate = "sum"
dedup_window = "7d"
output_topic = "out/{key}"
emit = "changelog"
max_key_len = 600
"#;

fn event(id: &str, key: &str) -> (String, Vec<u8>, bool) {
    (
        "in/dev".to_string(),
        format!(r#"{{"id":"{id}","k":"{key}","v":1}}"#).into_bytes(),
        false,
    )
}

/// Keys of the results a collector saw.
fn keys(c: &Collector) -> Vec<String> {
    c.messages()
        .iter()
        .map(|m| {
            let v: Value = serde_json::from_slice(&m.payload).expect("a result is JSON");
            v["key"].as_str().expect("key").to_string()
        })
        .collect()
}

#[test]
fn a_result_the_broker_refuses_by_disconnecting_becomes_a_dead_letter_and_the_others_flow() {
    // mosquitto closes the connection of a client whose packet is over `max_packet_size`
    // (a 3.1.1 client is never told the limit). The input of the big key fits; its result
    // (the key in the topic, the ID and the payload) does not.
    let broker = Broker::start_with(BrokerConfig {
        extra: vec!["max_packet_size 1500".into()],
        ..BrokerConfig::default()
    });
    let collector = Collector::start(broker.port(), "out/#");
    let cfg = AgentConfig::new(broker.port(), PIPELINE);
    let mut agent = CairnProcess::new(&cfg);
    agent.set_log_filter(Some("info"));
    agent.start_connected();
    let big = "B".repeat(600);
    publish_all(
        broker.port(),
        &[event("E1", "a"), event("E2", &big), event("E3", "b")],
    );
    agent.wait_for_stderr("results: set aside", Duration::from_secs(30));
    // The connection comes back and stays: later results flow.
    publish_all(broker.port(), &[event("E4", "c"), event("E5", "a")]);
    let flowed = wait_until(Duration::from_secs(20), || {
        let k = keys(&collector);
        ["a", "b", "c"].iter().all(|x| k.contains(&x.to_string())) && k.len() >= 4
    });
    assert!(
        flowed,
        "results after the refused one did not arrive: {:?}\n{}",
        keys(&collector),
        agent.stderr_tail(40)
    );
    assert!(!keys(&collector).contains(&big), "the big result arrived?");
    let drops = agent.run_stderr().matches("mqtt: disconnected").count();
    assert!(
        (3..=6).contains(&drops),
        "{drops} disconnects: the refused publish must be set aside after 3 quick drops\n{}",
        agent.stderr_tail(40)
    );
    // Then quiet: no more drops once it is set aside.
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(
        agent.run_stderr().matches("mqtt: disconnected").count(),
        drops,
        "the connection kept dropping:\n{}",
        agent.stderr_tail(40)
    );
    assert_eq!(agent.terminate().code(), Some(0));
    let letters = agent.inspect("dead-letters");
    let refused: Vec<&Value> = letters
        .iter()
        .filter(|d| d["reason"] == "refused_by_disconnect")
        .collect();
    assert_eq!(refused.len(), 1, "{letters:?}");
    assert_eq!(refused[0]["topic"], Value::String(format!("out/{big}")));
    assert_eq!(refused[0]["pipeline"], "p");
    let detail = refused[0]["detail"].as_str().unwrap();
    assert!(detail.contains("sink `local`"), "{detail}");
    assert!(
        agent.inspect("outbox").is_empty(),
        "the outbox still holds: {:?}",
        agent.inspect("outbox")
    );
    // A restart does not bring it back.
    agent.start_connected();
    std::thread::sleep(Duration::from_secs(1));
    assert!(!agent.run_stderr().contains("mqtt: disconnected"));
    assert_eq!(agent.terminate().code(), Some(0));
}

#[test]
fn cairn_outbox_drop_gives_up_one_waiting_result_for_good_and_records_it() {
    let local = Broker::start();
    let mut central = Broker::start();
    central.stop();
    let cfg = AgentConfig::new(local.port(), PIPELINE).with_uplink(
        central.port(),
        "sinks_drop_uplink",
        "site/",
    );
    let mut agent = CairnProcess::new(&cfg);
    // Subscribed before anything is published ("connected" comes before the SUBSCRIBE: on
    // a loaded box the events once went nowhere).
    agent.set_up_session();
    agent.start_connected();
    let events: Vec<_> = (0..5)
        .map(|i| event(&format!("E{i}"), &format!("k{i}")))
        .collect();
    publish_all(local.port(), &events);
    let waiting = wait_until(Duration::from_secs(20), || {
        let (ok, out, _) = agent.command(&["status", "--json"]);
        ok.success()
            && serde_json::from_str::<Value>(&out)
                .is_ok_and(|s| s["outbox"]["entries"].as_u64() == Some(5))
    });
    assert!(
        waiting,
        "5 results never waited:\n{}",
        agent.stderr_tail(30)
    );
    // They wait for the uplink, which every pipeline goes to; `local` gets none.
    let s = status(&agent);
    assert_eq!(sink(&s, "uplink")["waiting"], 5, "{s}");
    assert_eq!(sink(&s, "local")["pipelines"], 0, "{s}");
    assert_eq!(sink(&s, "local")["waiting"], 0, "{s}");
    let (st, _, err) = agent.command(&["outbox", "drop", "p/k2/1"]);
    assert_eq!(st.code(), Some(1), "refused while the agent runs: {err}");
    assert!(err.contains("stop the agent first"), "{err}");
    assert_eq!(agent.terminate().code(), Some(0));

    let (st, out, err) = agent.command(&["outbox", "list", "--json"]);
    assert!(st.success(), "{err}");
    assert_eq!(out.lines().count(), 5, "{out}");
    let (st, _, err) = agent.command(&["outbox", "drop", "p/nope/1"]);
    assert_eq!(st.code(), Some(1));
    assert!(err.contains("no result with ID"), "{err}");
    let (st, out, err) = agent.command(&["outbox", "drop", "p/k2/1"]);
    assert!(st.success(), "{err}");
    assert!(out.contains("dropped p/k2/1"), "{out}");
    let ids: Vec<String> = agent
        .inspect("outbox")
        .iter()
        .map(|e| e["id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(ids, ["p/k0/1", "p/k1/1", "p/k3/1", "p/k4/1"]);
    let letters = agent.inspect("dead-letters");
    assert!(
        letters
            .iter()
            .any(|d| d["reason"] == "dropped_by_operator" && d["topic"] == "out/k2"),
        "{letters:?}"
    );

    // Started again with the central broker still away: 4 wait for the uplink now.
    agent.start_connected();
    let four = wait_until(Duration::from_secs(10), || {
        let s = status(&agent);
        sink(&s, "uplink")["waiting"] == 4
            && sink(&s, "uplink")["waiting_bytes"]
                .as_u64()
                .is_some_and(|b| b > 0)
    });
    assert!(four, "{}", status(&agent));
    assert_eq!(agent.terminate().code(), Some(0));

    // The central broker returns: everything but the dropped result arrives.
    central.restart();
    let collector = Collector::start(central.port(), "site/#");
    agent.start_connected();
    let arrived = wait_until(Duration::from_secs(20), || collector.messages().len() >= 4);
    assert!(arrived, "{:?}\n{}", keys(&collector), agent.stderr_tail(30));
    std::thread::sleep(Duration::from_millis(500));
    let mut got = keys(&collector);
    got.sort();
    assert_eq!(got, ["k0", "k1", "k3", "k4"]);
    assert!(
        wait_until(Duration::from_secs(10), || sink(&status(&agent), "uplink")
            ["waiting"]
            == 0),
        "{}",
        status(&agent)
    );
    assert_eq!(agent.terminate().code(), Some(0));
}

/// Two `[[sink]]`s on one central broker, `a/` and `b/` prefixes, MQTT 5 by default.
fn two_sinks(central: u16) -> String {
    format!(
        "[[sink]]\nname = \"central_a\"\nkind = \"mqtt\"\nport = {central}\n\
         client_id = \"sinks_a\"\ntopic_prefix = \"a/\"\nreconnect_min = \"50ms\"\n\
         reconnect_max = \"500ms\"\n\n\
         [[sink]]\nname = \"central_b\"\nkind = \"mqtt\"\nport = {central}\n\
         client_id = \"sinks_b\"\ntopic_prefix = \"b/\"\nreconnect_min = \"50ms\"\n\
         reconnect_max = \"500ms\"\n"
    )
}

fn get_metrics(port: u16) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("metrics listener");
    s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    s.write_all(format!("GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n").as_bytes())
        .unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out
}

/// `cairn status --json` of the running agent.
fn status(agent: &CairnProcess) -> Value {
    let (st, out, err) = agent.command(&["status", "--json"]);
    assert!(st.success(), "status failed: {err}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("status JSON: {e}: {out}"))
}

fn sink<'a>(s: &'a Value, name: &str) -> &'a Value {
    s["sinks"]
        .as_array()
        .and_then(|a| a.iter().find(|x| x["name"] == name))
        .unwrap_or_else(|| panic!("no sink {name} in {s}"))
}

/// (topic without its prefix, payload) of what a collector saw under `prefix`.
fn under(c: &Collector, prefix: &str) -> Vec<(String, Vec<u8>)> {
    c.messages()
        .into_iter()
        .filter_map(|m| Some((m.topic.strip_prefix(prefix)?.to_string(), m.payload)))
        .collect()
}

#[test]
fn a_sink_the_acl_refuses_keeps_its_results_while_the_others_deliver_until_the_acl_is_fixed() {
    let local = Broker::start();
    let central_dir = tempfile::tempdir().unwrap();
    let acl = central_dir.path().join("acl");
    std::fs::write(&acl, "topic readwrite a/#\ntopic read b/#\n").unwrap();
    let central = Broker::start_with(BrokerConfig {
        extra: vec![format!("acl_file {}", acl.display())],
        ..BrokerConfig::default()
    });
    let on_central = Collector::start(central.port(), "#");
    let on_local = Collector::start(local.port(), "out/#");
    let mut cfg = AgentConfig::new(
        local.port(),
        &PIPELINE.replace(
            "max_key_len = 600",
            "sinks = [\"local\", \"central_a\", \"central_b\"]",
        ),
    );
    cfg.extra = format!(
        "[metrics]\nlisten = \"127.0.0.1:{}\"\n\n{}",
        crate::support::free_port(),
        two_sinks(central.port())
    );
    let mut agent = CairnProcess::new(&cfg);
    agent.set_log_filter(Some("info"));
    agent.start_connected();
    let n = 40;
    let events: Vec<_> = (0..n)
        .map(|i| event(&format!("E{i}"), &format!("k{}", i % 5)))
        .collect();
    publish_all(local.port(), &events);
    let delivered = wait_until(Duration::from_secs(20), || {
        under(&on_central, "a/").len() >= n && on_local.messages().len() >= n
    });
    assert!(
        delivered,
        "a/ and local did not get every result:\n{}",
        agent.stderr_tail(30)
    );
    agent.wait_for_stderr("sink `central_b`: the broker", Duration::from_secs(20));
    assert!(
        under(&on_central, "b/").is_empty(),
        "the ACL let b/ through?"
    );
    // Reported and counted, and the results wait in the outbox.
    let refusing = wait_until(Duration::from_secs(10), || {
        let s = status(&agent);
        sink(&s, "central_b")["state"] == "refusing"
            && sink(&s, "central_b")["refused"]["not authorized"]
                .as_u64()
                .is_some_and(|r| r >= 1)
            && s["outbox"]["entries"].as_u64().is_some_and(|e| e > 0)
    });
    let s = status(&agent);
    assert!(refusing, "{s}");
    assert_eq!(sink(&s, "central_a")["state"], "connected", "{s}");
    assert_eq!(sink(&s, "local")["state"], "connected", "{s}");
    let port: u16 = cfg
        .extra
        .split("127.0.0.1:")
        .nth(1)
        .unwrap()
        .split('"')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let metrics = get_metrics(port);
    assert!(
        metrics.contains("cairn_sink_refused_total{reason=\"not authorized\",sink=\"central_b\"}")
            || metrics
                .contains("cairn_sink_refused_total{sink=\"central_b\",reason=\"not authorized\"}"),
        "{}",
        metrics
            .lines()
            .filter(|l| l.contains("cairn_sink"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    // Later results still go to the others meanwhile.
    publish_all(local.port(), &[event("E100", "k0")]);
    assert!(
        wait_until(Duration::from_secs(10), || under(&on_central, "a/").len()
            > n),
        "central_a stopped while central_b was refused"
    );

    // The ACL is fixed and the broker reloads it: every result arrives, same IDs, same
    // payloads as the other sink got.
    std::fs::write(&acl, "topic readwrite a/#\ntopic readwrite b/#\n").unwrap();
    crate::support::signal(central.pid().unwrap(), "HUP");
    let arrived = wait_until(Duration::from_secs(60), || {
        under(&on_central, "b/").len() > n
    });
    assert!(
        arrived,
        "b/ got {} of {}:\n{}",
        under(&on_central, "b/").len(),
        n + 1,
        agent.stderr_tail(30)
    );
    std::thread::sleep(Duration::from_millis(500));
    let ids = |v: Vec<(String, Vec<u8>)>| {
        let mut m = std::collections::BTreeMap::new();
        for (_, p) in v {
            let j: Value = serde_json::from_slice(&p).unwrap();
            let id = j["id"].as_str().unwrap().to_string();
            if let Some(old) = m.insert(id.clone(), p.clone()) {
                assert_eq!(old, p, "{id} came with two payloads");
            }
        }
        m
    };
    let (a, b) = (ids(under(&on_central, "a/")), ids(under(&on_central, "b/")));
    assert_eq!(a.len(), n + 1);
    assert_eq!(a, b, "b/ holds exactly what a/ holds");
    let s = status(&agent);
    assert_eq!(sink(&s, "central_b")["state"], "connected", "{s}");
    assert!(
        wait_until(
            Duration::from_secs(10),
            || status(&agent)["outbox"]["entries"] == 0
        ),
        "{}",
        status(&agent)
    );
    assert_eq!(agent.terminate().code(), Some(0));
}

// ---------------------------------------------------------------------------------------
// Fan-out: local plus central through kills and power cuts during a long central outage.

const FANOUT: &str = r#"
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
sinks = ["local", "central"]

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
sinks = ["local", "central"]
"#;

const FAN_KEYS: u64 = 6;

fn fan_events(from: u64, to: u64) -> Vec<(String, Vec<u8>, bool)> {
    (from..to)
        .map(|i| {
            let payload = format!(
                r#"{{"id":"E{i}","k":"K{}","v":{}}}"#,
                (i * 7) % FAN_KEYS,
                (i % 13) as i64 - 3
            );
            ("in/dev".to_string(), payload.into_bytes(), false)
        })
        .collect()
}

/// Per key: (events, sum) over events `0..n`.
fn fan_oracle(n: u64) -> std::collections::BTreeMap<String, (u64, i64)> {
    let mut o = std::collections::BTreeMap::new();
    for i in 0..n {
        let e: &mut (u64, i64) = o.entry(format!("K{}", (i * 7) % FAN_KEYS)).or_default();
        e.0 += 1;
        e.1 += (i % 13) as i64 - 3;
    }
    o
}

/// What one sink holds against the oracle: every ID seen twice with one payload, per key the
/// versions first seen ascending, `sums` every version 1..=n, both pipelines' final value
/// the oracle's. `Err` lists every deviation.
fn holds_the_oracle(
    seen: &[crate::support::Seen],
    prefix: &str,
    oracle: &std::collections::BTreeMap<String, (u64, i64)>,
) -> Result<(), String> {
    use std::collections::{BTreeMap, BTreeSet, HashMap};
    let mut errs = Vec::new();
    let mut payloads: HashMap<String, Vec<u8>> = HashMap::new();
    let mut versions: BTreeMap<(String, String), Vec<u64>> = BTreeMap::new();
    let mut finals: BTreeMap<(String, String), (u64, i64)> = BTreeMap::new();
    for m in seen {
        let Some(topic) = m.topic.strip_prefix(prefix) else {
            continue;
        };
        let v: Value = serde_json::from_slice(&m.payload).expect("JSON result");
        let (p, k) = (v["pipeline"].as_str().unwrap(), v["key"].as_str().unwrap());
        if topic != format!("{p}/{k}") {
            errs.push(format!("topic {} for {p}/{k}", m.topic));
        }
        let id = v["id"].as_str().unwrap().to_string();
        if let Some(old) = payloads.insert(id.clone(), m.payload.clone())
            && old != m.payload
        {
            errs.push(format!("{id} seen with two payloads"));
        }
        let version = v["version"].as_u64().unwrap();
        let key = (p.to_string(), k.to_string());
        let vs = versions.entry(key.clone()).or_default();
        if !vs.contains(&version) {
            vs.push(version);
        }
        let f = finals.entry(key).or_default();
        if version > f.0 {
            *f = (version, v["value"].as_i64().unwrap());
        }
    }
    for ((p, k), vs) in &versions {
        if vs.windows(2).any(|w| w[0] > w[1]) {
            errs.push(format!("{p}/{k}: versions first seen out of order: {vs:?}"));
        }
    }
    for p in ["sums", "last"] {
        for (k, &(n, sum)) in oracle {
            let key = (p.to_string(), k.clone());
            if finals.get(&key) != Some(&(n, sum)) {
                errs.push(format!(
                    "{p}/{k}: final {:?}, oracle ({n}, {sum})",
                    finals.get(&key)
                ));
            }
            if p == "sums" {
                let all: BTreeSet<u64> =
                    versions.get(&key).into_iter().flatten().copied().collect();
                if all != (1..=n).collect() {
                    errs.push(format!(
                        "sums/{k}: {} distinct versions, oracle 1..={n}",
                        all.len()
                    ));
                }
            }
        }
    }
    if finals.keys().any(|(_, k)| !oracle.contains_key(k)) {
        errs.push("keys beyond the oracle".into());
    }
    if errs.is_empty() {
        Ok(())
    } else {
        Err(errs.join("\n"))
    }
}

fn fan_out(powercut: bool) {
    use crate::support::central::DurableCollector;
    use crate::support::powercut::{PowerCut, kill_rounds};
    use crate::support::{Proxy, free_port};
    let local = Broker::start();
    let central = Broker::start();
    let link = Proxy::start(central.port());
    let on_central = DurableCollector::start(central.port(), "site/#");
    let on_local_sums = DurableCollector::start(local.port(), "sums/#");
    let on_local_last = DurableCollector::start(local.port(), "last/#");
    let cut = powercut.then(PowerCut::mount);
    let mut cfg = AgentConfig::new(local.port(), FANOUT);
    cfg.extra = format!(
        "[metrics]\nlisten = \"127.0.0.1:{}\"\n\n[[sink]]\nname = \"central\"\nkind = \"mqtt\"\n\
         port = {}\nclient_id = \"fan_central\"\ntopic_prefix = \"site/\"\n\
         reconnect_min = \"50ms\"\nreconnect_max = \"500ms\"\n",
        free_port(),
        link.port()
    );
    if let Some(c) = &cut {
        cfg.data_dir = Some(c.mount.join("data"));
    }
    let mut agent = CairnProcess::new(&cfg);
    agent.set_log_filter(Some("info"));
    agent.start_connected();
    agent.wait_for_stderr("central: connected", Duration::from_secs(20));
    publish_all(local.port(), &fan_events(0, 100));
    assert!(
        wait_until(Duration::from_secs(20), || on_central.count() > 0),
        "nothing reached central:\n{}",
        agent.stderr_tail(30)
    );
    // The long central outage: kills (and power cuts) while inputs keep coming.
    link.pause(true);
    link.cut();
    agent.wait_for_stderr("central: lost", Duration::from_secs(20));
    let mut next = kill_rounds(&mut agent, cut.as_ref(), local.port(), 100, 500, fan_events);
    agent.start_connected();
    publish_all(local.port(), &fan_events(next, next + 200));
    next += 200;
    let oracle = fan_oracle(next);
    // Local keeps delivering while central is away.
    let local_done = wait_until(Duration::from_secs(120), || {
        let mut all = on_local_sums.messages();
        all.extend(on_local_last.messages());
        holds_the_oracle(&all, "", &oracle).is_ok()
    });
    let mut all = on_local_sums.messages();
    all.extend(on_local_last.messages());
    assert!(
        local_done,
        "local during the outage:\n{}\nagent:\n{}",
        holds_the_oracle(&all, "", &oracle).unwrap_err(),
        agent.stderr_tail(30)
    );
    link.pause(false);
    let central_done = wait_until(Duration::from_secs(120), || {
        holds_the_oracle(&on_central.messages(), "site/", &oracle).is_ok()
    });
    std::thread::sleep(Duration::from_millis(500));
    if let Err(e) = holds_the_oracle(&on_central.messages(), "site/", &oracle) {
        panic!(
            "central (done: {central_done}):\n{e}\nagent:\n{}",
            agent.stderr_tail(30)
        );
    }
    let mut all = on_local_sums.messages();
    all.extend(on_local_last.messages());
    if let Err(e) = holds_the_oracle(&all, "", &oracle) {
        panic!("local at the end:\n{e}");
    }
    assert!(
        wait_until(
            Duration::from_secs(20),
            || status(&agent)["outbox"]["entries"] == 0
        ),
        "{}",
        status(&agent)
    );
    assert_eq!(
        agent.terminate().code(),
        Some(0),
        "{}",
        agent.stderr_tail(20)
    );
    drop(cut);
}

#[test]
fn fan_out_to_local_and_central_through_kills_in_a_long_central_outage_ends_with_each_holding_the_oracle()
 {
    fan_out(false);
}

#[test]
fn fan_out_through_power_cuts_in_a_long_central_outage_loses_nothing_for_either_sink() {
    fan_out(true);
}

#[test]
fn a_result_over_an_mqtt_5_sinks_maximum_packet_size_is_its_dead_letter_and_the_other_sink_gets_it()
{
    let local = Broker::start();
    // MQTT 5 tells the client the limit in its CONNACK: the result is never sent there.
    let central = Broker::start_with(BrokerConfig {
        extra: vec!["max_packet_size 1500".into()],
        ..BrokerConfig::default()
    });
    let on_central = Collector::start(central.port(), "site/#");
    let on_local = Collector::start(local.port(), "out/#");
    let mut cfg = AgentConfig::new(
        local.port(),
        &PIPELINE.replace(
            "max_key_len = 600",
            "max_key_len = 600\nsinks = [\"local\", \"central\"]",
        ),
    );
    cfg.extra = format!(
        "[[sink]]\nname = \"central\"\nkind = \"mqtt\"\nport = {}\nclient_id = \"big_central\"\n\
         topic_prefix = \"site/\"\nreconnect_min = \"50ms\"\nreconnect_max = \"500ms\"\n",
        central.port()
    );
    let mut agent = CairnProcess::new(&cfg);
    agent.set_log_filter(Some("info"));
    agent.start_connected();
    agent.wait_for_stderr("central: connected", Duration::from_secs(20));
    let big = "B".repeat(600);
    publish_all(
        local.port(),
        &[event("E1", "a"), event("E2", &big), event("E3", "b")],
    );
    agent.wait_for_stderr("results: set aside", Duration::from_secs(20));
    let both = wait_until(Duration::from_secs(20), || {
        keys(&on_local).len() == 3 && keys(&on_central).len() == 2
    });
    assert!(
        both,
        "local {:?}, central {:?}\n{}",
        keys(&on_local).len(),
        keys(&on_central),
        agent.stderr_tail(20)
    );
    assert!(keys(&on_local).contains(&big), "local gets the big result");
    assert!(
        !agent.run_stderr().contains("central: lost"),
        "no reconnect loop:\n{}",
        agent.stderr_tail(20)
    );
    // Its dead letter settled it for `central`: nothing waits there, nor for `local`.
    assert!(
        wait_until(Duration::from_secs(10), || {
            let s = status(&agent);
            s["outbox"]["entries"] == 0
                && sink(&s, "central")["waiting"] == 0
                && sink(&s, "local")["waiting"] == 0
        }),
        "{}",
        status(&agent)
    );
    assert_eq!(agent.terminate().code(), Some(0));
    let letters = agent.inspect("dead-letters");
    let too_large: Vec<&Value> = letters
        .iter()
        .filter(|d| d["reason"] == "too_large_for_sink")
        .collect();
    assert_eq!(too_large.len(), 1, "{letters:?}");
    assert_eq!(
        too_large[0]["topic"],
        Value::String(format!("site/out/{big}"))
    );
    assert!(
        too_large[0]["detail"]
            .as_str()
            .unwrap()
            .contains("sink `central`")
    );
}

// ---------------------------------------------------------------------------------------
// What waits for each sink, exactly (issue 29, item 5).

/// Every event gives one `sums` result (changelog) for `local` and `central_a`, and an
/// upsert of its key for all three sinks: while `central_a` and `central_b` are down, the
/// newest upsert of each key waits for them (a newer one supersedes the older).
const WAITING: &str = r#"
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
sinks = ["local", "central_a"]

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
retain = false
sinks = ["local", "central_a", "central_b"]
"#;

/// GET `path` from the metrics listener: the body.
fn http_get(port: u16, path: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("metrics listener");
    s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n").as_bytes())
        .unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out.split_once("\r\n\r\n")
        .map_or(String::new(), |(_, body)| body.to_string())
}

/// The value of `name{sink="sink"}` in a `/metrics` text.
fn sink_sample(text: &str, name: &str, sink: &str) -> Option<f64> {
    let prefix = format!("{name}{{sink=\"{sink}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .and_then(|v| v.trim().parse().ok())
}

/// (waiting, waiting_bytes, oldest_age_seconds, pipelines) of one sink, as `/status.json`,
/// `cairn status --json` and `/metrics` each show it; the three must agree on the counts.
fn sink_view(agent: &CairnProcess, port: u16, name: &str) -> (u64, u64, f64, u64) {
    let from_json = |v: &Value| {
        let s = sink(v, name);
        (
            s["waiting"].as_u64().unwrap_or(u64::MAX),
            s["waiting_bytes"].as_u64().unwrap_or(u64::MAX),
            s["oldest_age_seconds"].as_f64().unwrap_or(-1.0),
            s["pipelines"].as_u64().unwrap_or(u64::MAX),
        )
    };
    let served: Value = serde_json::from_str(&http_get(port, "/status.json")).expect("JSON");
    let (w, b, age, p) = from_json(&served);
    let cli = from_json(&status(agent));
    let text = http_get(port, "/metrics");
    let m = |n: &str| sink_sample(&text, n, name).unwrap_or(-1.0);
    let metrics = (
        m("cairn_sink_waiting") as u64,
        m("cairn_sink_waiting_bytes") as u64,
        m("cairn_sink_pipelines") as u64,
    );
    // A figure can move between two reads only while results flow: compare the counts
    // when they are settled (the callers wait for that), never the ages.
    if (cli.0, cli.1) == (w, b) && (metrics.0, metrics.1) == (w, b) {
        assert_eq!((cli.3, metrics.2), (p, p), "pipelines of {name}");
        assert!(m("cairn_sink_oldest_age_seconds") >= 0.0, "{text}");
    }
    (w, b, age, p)
}

#[test]
fn each_sink_shows_exactly_what_waits_for_it_through_a_crash_until_it_drains() {
    use crate::support::{Proxy, free_port};
    let local = Broker::start();
    let central = Broker::start();
    // central_a and central_b reach the central broker through a link that is down from
    // the start; `spare` reaches it directly, and no pipeline sends it anything.
    let link = Proxy::start(central.port());
    link.pause(true);
    let on_central = Collector::start(central.port(), "#");
    let on_local = Collector::start(local.port(), "sums/#");
    let on_local_last = Collector::start(local.port(), "last/#");
    let port = free_port();
    let mut cfg = AgentConfig::new(local.port(), WAITING);
    let sink_table = |name: &str, port: u16, prefix: &str| {
        format!(
            "[[sink]]\nname = \"{name}\"\nkind = \"mqtt\"\nport = {port}\n\
             client_id = \"waiting_{name}\"\ntopic_prefix = \"{prefix}\"\n\
             reconnect_min = \"50ms\"\nreconnect_max = \"300ms\"\n\n"
        )
    };
    cfg.extra = format!(
        "[metrics]\nlisten = \"127.0.0.1:{port}\"\n\n{}{}{}",
        sink_table("central_a", link.port(), "a/"),
        sink_table("central_b", link.port(), "b/"),
        sink_table("spare", central.port(), "spare/"),
    );
    let mut agent = CairnProcess::new(&cfg);
    agent.set_log_filter(Some("info"));
    agent.start_connected();
    agent.wait_for_stderr(
        "sink `spare`: no pipeline names it",
        Duration::from_secs(10),
    );
    agent.wait_for_stderr("spare: connected", Duration::from_secs(20));

    let (n, keys) = (30u64, 5u64);
    let events: Vec<_> = (0..n)
        .map(|i| event(&format!("W{i}"), &format!("k{}", i % keys)))
        .collect();
    // In two rounds with a checkpoint between: the second round's upserts supersede
    // entries already in the outbox, not only older results of their own checkpoint.
    let half = (n / 2) as usize;
    publish_all(local.port(), &events[..half]);
    let first = wait_until(Duration::from_secs(20), || {
        sink_view(&agent, port, "central_a").0 == half as u64 + keys
            && sink_view(&agent, port, "central_b").0 == keys
    });
    assert!(
        first,
        "the first round: central_a {:?}, central_b {:?}",
        sink_view(&agent, port, "central_a"),
        sink_view(&agent, port, "central_b")
    );
    publish_all(local.port(), &events[half..]);
    assert!(
        on_local.wait_for_count(n as usize, Duration::from_secs(20)),
        "local did not get every result:\n{}",
        agent.stderr_tail(30)
    );
    // What waits for the down sinks, from what local got (the same IDs and payloads):
    // every `sums` result for central_a, and the newest `last` result of each key for both.
    let payloads = |c: &Collector| {
        let mut by_id = std::collections::BTreeMap::new();
        for m in c.messages() {
            let v: Value = serde_json::from_slice(&m.payload).unwrap();
            by_id.insert(v["id"].as_str().unwrap().to_string(), (v, m.payload.len()));
        }
        by_id
    };
    let sums_bytes: usize = payloads(&on_local).values().map(|(_, n)| n).sum();
    let newest_last = || {
        let mut newest: std::collections::BTreeMap<String, (u64, usize)> = Default::default();
        for (v, len) in payloads(&on_local_last).into_values() {
            let key = v["key"].as_str().unwrap().to_string();
            let version = v["version"].as_u64().unwrap();
            let e = newest.entry(key).or_insert((0, 0));
            if version > e.0 {
                *e = (version, len);
            }
        }
        newest
    };
    assert!(
        wait_until(Duration::from_secs(10), || newest_last()
            .values()
            .map(|(v, _)| v)
            .sum::<u64>()
            == n),
        "local's upserts did not reach the last versions: {:?}",
        newest_last()
    );
    let last_bytes: u64 = newest_last().values().map(|(_, n)| *n as u64).sum();
    let want_a = (n + keys, sums_bytes as u64 + last_bytes);
    let want_b = (keys, last_bytes);
    let exact = |agent: &CairnProcess| {
        let a = sink_view(agent, port, "central_a");
        let b = sink_view(agent, port, "central_b");
        let l = sink_view(agent, port, "local");
        (a.0, a.1) == want_a && (b.0, b.1) == want_b && l.0 == 0
    };
    let shown = |agent: &CairnProcess| {
        format!(
            "central_a {:?} (want {want_a:?}), central_b {:?} (want {want_b:?}), local {:?}\n{}",
            sink_view(agent, port, "central_a"),
            sink_view(agent, port, "central_b"),
            sink_view(agent, port, "local"),
            agent.stderr_tail(20)
        )
    };
    assert!(
        wait_until(Duration::from_secs(20), || exact(&agent)),
        "{}",
        shown(&agent)
    );
    // The outbox holds central_a's results, central_b's among them (its figure is
    // refreshed every 250 ms).
    assert!(
        wait_until(
            Duration::from_secs(5),
            || status(&agent)["outbox"]["entries"].as_u64() == Some(want_a.0)
        ),
        "{}",
        status(&agent)
    );
    let s = status(&agent);
    assert_eq!(sink(&s, "central_a")["state"], "down", "{s}");
    assert_eq!(sink(&s, "central_b")["state"], "down", "{s}");
    // The oldest waits longer and longer; the delivering sink has none.
    let age = |agent: &CairnProcess, name| sink_view(agent, port, name).2;
    let before = age(&agent, "central_b");
    std::thread::sleep(Duration::from_millis(1_500));
    let after = age(&agent, "central_b");
    assert!(
        before > 0.0 && after >= before + 1.0,
        "{before} then {after}"
    );
    assert!(
        age(&agent, "central_a") >= after,
        "central_a waits since the same start"
    );
    assert_eq!(age(&agent, "local"), 0.0);
    // `spare` gets nothing and says so, rather than looking stalled.
    assert_eq!(sink_view(&agent, port, "spare"), (0, 0, 0.0, 0));
    let (st, text, _) = agent.command(&["status"]);
    assert!(st.success());
    assert!(
        text.contains("sink spare      no pipelines: no results go to it (connected for"),
        "{text}"
    );
    assert!(
        text.contains("sink central_a  DOWN for ")
            && text.contains(&format!("s, {} waiting (", want_a.0)),
        "{text}"
    );

    // A crash: the same numbers after the restart, and the age goes on from before.
    agent.kill();
    agent.start_connected();
    assert!(
        wait_until(Duration::from_secs(20), || exact(&agent)),
        "after the restart: {}",
        shown(&agent)
    );
    assert!(
        age(&agent, "central_b") >= after,
        "the age counts from the results' checkpoint, not from the restart"
    );

    // The link comes back: each drains to 0, and gets exactly what waited for it.
    link.pause(false);
    agent.wait_for_stderr(
        &format!("{} results waiting for it in the outbox", want_a.0),
        Duration::from_secs(20),
    );
    let drained = wait_until(Duration::from_secs(30), || {
        ["central_a", "central_b", "local", "spare"]
            .iter()
            .all(|s| sink_view(&agent, port, s).0 == 0)
            && status(&agent)["outbox"]["entries"] == 0
    });
    assert!(drained, "{}", shown(&agent));
    for name in ["central_a", "central_b"] {
        let (w, b, age, p) = sink_view(&agent, port, name);
        assert_eq!((w, b, age), (0, 0, 0.0), "{name}");
        assert!(p >= 1, "{name}");
    }
    let ids = |prefix: &str| {
        under(&on_central, prefix)
            .into_iter()
            .map(|(_, p)| {
                let v: Value = serde_json::from_slice(&p).unwrap();
                v["id"].as_str().unwrap().to_string()
            })
            .collect::<std::collections::BTreeSet<_>>()
    };
    assert_eq!(ids("a/").len() as u64, want_a.0, "{:?}", ids("a/"));
    assert_eq!(ids("b/").len() as u64, want_b.0, "{:?}", ids("b/"));
    assert!(ids("spare/").is_empty());
    assert_eq!(agent.terminate().code(), Some(0));
}
