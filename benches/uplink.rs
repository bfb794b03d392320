//! The uplink's backlog (issue 13): results held by the outbox during an outage of N events,
//! then drained to the central broker when the link returns, while new results keep
//! flowing. Two private brokers (local inputs, central results) and a proxy on the link.
//!
//! Per mode (`changelog`: every result waits; `upsert`: one per key) it prints: the results
//! waiting after the outage, the outbox's bytes per waiting result (its chunks) and the
//! store's growth per waiting result (sled's files), then the drain: results delivered per
//! second and the time until the agent has caught up (outbox empty, every input applied)
//! with new inputs arriving at a steady rate meanwhile.
//!
//! `cargo bench --bench uplink`; `CAIRN_UPLINK_EVENTS` sets N (default 50,000).

#[path = "../tests/it/support/mod.rs"]
mod support;

use std::time::{Duration, Instant};

use serde_json::Value;
use support::agent::{AgentConfig, CairnProcess};
use support::central::DurableCollector;
use support::{Broker, BrokerConfig, Proxy, publish_all, unique_id, wait_until};

const KEYS: u64 = 1_000;
/// New inputs per second while the backlog drains, and for how long.
const LIVE_RATE: u64 = 1_000;
const LIVE_SECONDS: u64 = 5;

fn pipeline(emit: &str) -> String {
    format!(
        r#"[[pipeline]]
name = "p"
topics = ["in/#"]
format = "json"
event_id = "/id"
key = "/k"
value = "/v"
aggregate = "sum"
dedup_window = "1h"
output_topic = "out/{{key}}"
emit = "{emit}"
"#
    )
}

fn events(from: u64, to: u64) -> Vec<(String, Vec<u8>, bool)> {
    (from..to)
        .map(|i| {
            let p = format!(
                r#"{{"id":"E{i}","k":"meter-{:04}","v":{}}}"#,
                i % KEYS,
                i % 100
            );
            ("in/m".to_string(), p.into_bytes(), false)
        })
        .collect()
}

fn status(agent: &CairnProcess) -> Option<Value> {
    let (st, out, _) = agent.command(&["status", "--json"]);
    st.success()
        .then(|| serde_json::from_str(&out).ok())
        .flatten()
}

fn applied(s: &Value) -> u64 {
    s["pipelines"][0]["applied"].as_u64().unwrap_or(0)
}

fn run(emit: &str, n: u64) {
    let quiet = BrokerConfig {
        log_types: vec!["error"],
        max_inflight: 100,
        ..BrokerConfig::default()
    };
    let local = Broker::start_with(quiet.clone());
    let central = Broker::start_with(quiet);
    let link = Proxy::start(central.port());
    let central_sub = DurableCollector::start(central.port(), "box/#");
    let mut cfg = AgentConfig::new(local.port(), &pipeline(emit)).with_uplink(
        link.port(),
        &unique_id("up").replace('-', "_"),
        "box/",
    );
    cfg.checkpoint = "interval = \"200ms\"\nmax_records = 5000\n".into();
    cfg.outbox = "max_entries = 10000000\nmax_size = \"1GiB\"\ninflight = 100\n".into();
    cfg.mqtt_extra = "ingest_batch = 100\n".into();
    cfg.extra = format!(
        "[metrics]\nlisten = \"127.0.0.1:{}\"\n",
        support::free_port()
    );
    let mut agent = CairnProcess::new(&cfg);
    agent.set_log_filter(Some("info"));
    agent.start();
    assert!(wait_until(Duration::from_secs(20), || {
        let s = agent.run_stderr();
        s.contains("mqtt: connected") && s.contains("uplink: connected")
    }));
    let store_before = status(&agent).map_or(0, |s| s["store"]["size_bytes"].as_u64().unwrap_or(0));

    // The outage: N events, every result waits.
    link.pause(true);
    link.cut();
    let t = Instant::now();
    for from in (0..n).step_by(10_000) {
        publish_all(local.port(), &events(from, (from + 10_000).min(n)));
    }
    assert!(
        wait_until(Duration::from_secs(600), || status(&agent)
            .is_some_and(|s| applied(&s) >= n)),
        "the agent did not apply the outage's inputs:\n{}",
        agent.stderr_tail(20)
    );
    let ingest = t.elapsed();
    // Let a refresh of the slow gauges (store size) pass.
    std::thread::sleep(Duration::from_millis(600));
    let s = status(&agent).expect("status");
    let waiting = s["outbox"]["entries"].as_u64().unwrap_or(0);
    let bytes = s["outbox"]["bytes"].as_u64().unwrap_or(0);
    let store = s["store"]["size_bytes"].as_u64().unwrap_or(0);
    println!(
        "{emit:>9}: outage of {n} events over {KEYS} keys (ingested in {:.1}s): {waiting} results \
         waiting, outbox {bytes} bytes = {:.0} B/result; store grew {} bytes = {:.0} B/result",
        ingest.as_secs_f64(),
        bytes as f64 / waiting.max(1) as f64,
        store.saturating_sub(store_before),
        store.saturating_sub(store_before) as f64 / waiting.max(1) as f64
    );

    // The link returns; new inputs keep coming at LIVE_RATE meanwhile.
    let before = central_sub.count();
    let t0 = Instant::now();
    link.pause(false);
    let live = n + LIVE_RATE * LIVE_SECONDS;
    let port = local.port();
    let feeder = std::thread::spawn(move || {
        let start = Instant::now();
        for s in 0..LIVE_SECONDS * 10 {
            let from = n + s * LIVE_RATE / 10;
            publish_all(port, &events(from, from + LIVE_RATE / 10));
            let due = Duration::from_millis((s + 1) * 100);
            if let Some(wait) = due.checked_sub(start.elapsed()) {
                std::thread::sleep(wait);
            }
        }
    });
    let mut backlog_gone = None;
    let caught_up = wait_until(Duration::from_secs(600), || {
        let Some(s) = status(&agent) else {
            return false;
        };
        let entries = s["outbox"]["entries"].as_u64().unwrap_or(u64::MAX);
        if backlog_gone.is_none() && entries <= 100 {
            backlog_gone = Some(t0.elapsed());
        }
        applied(&s) >= live && entries == 0
    });
    let took = t0.elapsed();
    feeder.join().expect("feeder");
    assert!(caught_up, "never caught up:\n{}", agent.stderr_tail(20));
    let delivered = central_sub.count() - before;
    let gone = backlog_gone.unwrap_or(took);
    println!(
        "{emit:>9}: link back: backlog of {waiting} down to one window in {:.2}s ({:.0} results/s), \
         caught up with {} live inputs at {LIVE_RATE}/s in {:.2}s; {delivered} results delivered \
         ({:.0}/s)",
        gone.as_secs_f64(),
        waiting as f64 / gone.as_secs_f64().max(1e-3),
        LIVE_RATE * LIVE_SECONDS,
        took.as_secs_f64(),
        delivered as f64 / took.as_secs_f64().max(1e-3)
    );
    let _ = agent.terminate();
}

fn main() {
    let n = std::env::var("CAIRN_UPLINK_EVENTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50_000);
    for emit in ["changelog", "upsert"] {
        run(emit, n);
    }
}
