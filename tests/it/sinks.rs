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
    assert_eq!(agent.terminate().code(), Some(0));
}
