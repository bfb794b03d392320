//! The drain rate of a result connection, MQTT 5 against MQTT 3.1.1 (issue 29): N results
//! published through the `mqtt` layer alone as fast as a private mosquitto acknowledges
//! them, with a subscriber taking every one (as a central broker has), on loopback.
//!
//! Per run it prints results acknowledged per second and this process's CPU time per
//! result (the connection's thread, and the subscriber's, which runs in this process too).
//! Three kinds of run, same window of 100 unacknowledged results (the agent's
//! `outbox.inflight` in `benches/uplink.rs`):
//! - `3.1.1`: [`Mqtt`], which writes its publishes to the socket itself, many per flush;
//! - `5`: [`Mqtt5`], rumqttc's v5 client, one publish per request and flush (its socket is
//!   private), the broker's Receive Maximum raised to the window (`max_inflight_messages
//!   100`, as `benches/uplink.rs` sets for 3.1.1);
//! - `5, stock window`: the same against mosquitto's default Receive Maximum of 20, which
//!   MQTT 5 makes the client honour (3.1.1 has no such limit on what a client sends).
//!
//! `cargo bench --bench sink`; `CAIRN_SINK_RESULTS` sets N (default 200,000), `CAIRN_SINK_RUNS`
//! the runs of each kind (default 3, taking turns; the medians are printed last).
//!
//! Then the agent itself (`cairn run`, two private brokers, issue 29), with
//! `CAIRN_SINK_EVENTS` events (default 50,000, `changelog`: one result per event per sink):
//! - **one sink against two**: events per second until every sink holds every result, and
//!   the agent's CPU time per event (from `/proc`), with `sinks = ["local"]` and with
//!   `sinks = ["local", "central"]` (a `[[sink]]`, MQTT 5);
//! - **the central drain**: the `central` sink cut off while the events are processed (its
//!   results wait in the outbox, `local` keeps delivering), then let through: its results
//!   per second until the outbox is empty, over MQTT 5 and over 3.1.1.
//!
//! `CAIRN_SINK_PART=layer` or `agent` runs one half alone.

#[path = "../tests/it/support/mod.rs"]
mod support;

use std::time::{Duration, Instant};

use cairn::config::MqttConfig;
use cairn::mqtt::{Event, Events, Link, Mqtt, Mqtt5, MqttError};
use serde_json::Value;
use support::agent::{AgentConfig, CairnProcess};
use support::central::DurableCollector;
use support::{Broker, BrokerConfig, Proxy, publish_all, wait_until};

const WINDOW: u16 = 100;
const KEYS: usize = 1_000;

fn config(port: u16, client_id: &str) -> MqttConfig {
    MqttConfig {
        host: "127.0.0.1".into(),
        port,
        client_id: client_id.into(),
        keep_alive: Duration::from_secs(30),
        username: None,
        password_file: None,
        tls: None,
        ingest_batch: 20,
        reconnect_min: Duration::from_millis(50),
        reconnect_max: Duration::from_millis(500),
        channel_capacity: 1024,
        will: None,
    }
}

/// User plus system CPU time of this process.
fn cpu_time() -> Duration {
    // SAFETY: getrusage writes the struct it is given and nothing else.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(usage.ru_utime) + tv(usage.ru_stime)
}

/// A result as the agent publishes one: a per-key topic and a JSON payload of ~150 bytes.
fn result(i: usize) -> (String, String, Vec<u8>) {
    let key = format!("meter-{:04}", i % KEYS);
    let version = i / KEYS + 1;
    let id = format!("p/{key}/{version}");
    let value = i % 100;
    let payload = format!(
        r#"{{"id":"{id}","pipeline":"p","key":"{key}","version":{version},"value":{value},"#
    ) + &format!(r#""count":{version},"generation":1}}"#);
    (id, format!("site/box-17/out/{key}"), payload.into_bytes())
}

fn is_outcome(event: &Event) -> bool {
    match event {
        Event::PubAcked { .. } => true,
        Event::PubRefused {
            output_id, code, ..
        } => panic!("{output_id} refused: 0x{code:02X}"),
        Event::TooLarge { output_id, .. } => panic!("{output_id} too large"),
        Event::Disconnected { reason, .. } => panic!("disconnected: {reason}"),
        _ => false,
    }
}

/// Publishes `n` results keeping the window full; returns (wall time, CPU time).
fn drain(link: &Link, rx: &Events, n: usize) -> (Duration, Duration) {
    let (t0, cpu0) = (Instant::now(), cpu_time());
    let (mut next, mut done) = (0, 0);
    while done < n {
        while next < n {
            let (id, topic, payload) = result(next);
            match link.publish(id, &topic, payload, true) {
                Ok(()) => next += 1,
                Err(MqttError::InflightFull { .. }) => break,
                Err(e) => panic!("publish: {e}"),
            }
        }
        let event = rx.recv_timeout(Duration::from_secs(30)).expect("outcomes");
        done += usize::from(is_outcome(&event));
        while let Ok(event) = rx.try_recv() {
            done += usize::from(is_outcome(&event));
        }
    }
    (t0.elapsed(), cpu_time() - cpu0)
}

fn run(kind: &str, n: usize) -> f64 {
    let broker = Broker::start_with(BrokerConfig {
        log_types: vec!["error"],
        max_inflight: if kind == "5, stock window" { 20 } else { 100 },
        ..BrokerConfig::default()
    });
    let subscriber = DurableCollector::start(broker.port(), "site/#");
    let cfg = config(broker.port(), "cairn-sink-bench");
    let (link, rx) = if kind == "3.1.1" {
        let (m, rx) = Mqtt::start(&cfg, Vec::new(), WINDOW).expect("start 3.1.1");
        (Link::V311(m), rx)
    } else {
        let (m, rx) = Mqtt5::start(&cfg, WINDOW).expect("start MQTT 5");
        (Link::V5(m), rx)
    };
    match rx.recv_timeout(Duration::from_secs(10)) {
        Ok(Event::Connected { .. }) => {}
        other => panic!("not connected: {other:?}"),
    }
    let (wall, cpu) = drain(&link, &rx, n);
    link.shutdown();
    let rate = n as f64 / wall.as_secs_f64();
    println!(
        "  MQTT {kind:<16} {n} results in {:>6.2} s: {rate:>8.0} results/s, {:>5.1} µs CPU per \
         result (subscriber has {} so far)",
        wall.as_secs_f64(),
        cpu.as_secs_f64() * 1e6 / n as f64,
        subscriber.count()
    );
    rate
}

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// CPU time (user + system) of process `pid` so far, from `/proc/pid/stat`.
fn process_cpu(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // After the command name in parentheses: fields 3.. ; utime and stime are 14 and 15.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<u64> = rest
        .split_whitespace()
        .map(|x| x.parse().unwrap_or(0))
        .collect();
    // SAFETY: sysconf reads a constant.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    let ticks = f.get(11).copied().unwrap_or(0) + f.get(12).copied().unwrap_or(0);
    Duration::from_millis(ticks * 1000 / hz)
}

fn agent_pipeline(sinks: &str) -> String {
    format!(
        "[[pipeline]]\nname = \"p\"\ntopics = [\"in/#\"]\nformat = \"json\"\nevent_id = \"/id\"\n\
         key = \"/k\"\nvalue = \"/v\"\naggregate = \"sum\"\ndedup_window = \"1h\"\n\
         output_topic = \"out/{{key}}\"\nemit = \"changelog\"\nsinks = {sinks}\n"
    )
}

fn agent_events(from: usize, to: usize) -> Vec<(String, Vec<u8>, bool)> {
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

fn agent_status(agent: &CairnProcess) -> Option<Value> {
    let (st, out, _) = agent.command(&["status", "--json"]);
    st.success()
        .then(|| serde_json::from_str(&out).ok())
        .flatten()
}

/// One agent run: `sinks` for the pipeline, a central `[[sink]]` speaking `protocol`
/// behind a proxy (cut while the events go in when `cut`). Returns (events/s until every
/// sink holds every result, agent CPU µs per event, central drain results/s if cut).
fn agent_run(sinks: &str, protocol: &str, cut: bool, n: usize) -> (f64, f64, f64) {
    let quiet = BrokerConfig {
        log_types: vec!["error"],
        max_inflight: 100,
        ..BrokerConfig::default()
    };
    let local = Broker::start_with(quiet.clone());
    let central = Broker::start_with(quiet);
    let link = Proxy::start(central.port());
    let on_local = DurableCollector::start(local.port(), "out/#");
    let on_central = DurableCollector::start(central.port(), "site/#");
    let mut cfg = AgentConfig::new(local.port(), &agent_pipeline(sinks));
    cfg.checkpoint = "interval = \"200ms\"\nmax_records = 5000\n".into();
    cfg.outbox = "max_entries = 10000000\nmax_size = \"1GiB\"\ninflight = 100\n".into();
    cfg.mqtt_extra = "ingest_batch = 100\n".into();
    cfg.extra = format!(
        "[[sink]]\nname = \"central\"\nkind = \"mqtt\"\nprotocol = \"{protocol}\"\n\
         port = {}\nclient_id = \"bench_central\"\ntopic_prefix = \"site/\"\n\
         reconnect_min = \"50ms\"\nreconnect_max = \"500ms\"\n",
        link.port()
    );
    let mut agent = CairnProcess::new(&cfg);
    agent.set_log_filter(Some("warn"));
    agent.start();
    assert!(wait_until(Duration::from_secs(20), || agent_status(&agent)
        .is_some_and(|s| s["connected"] == 1)));
    let two = sinks.contains("central");
    if cut {
        link.pause(true);
        link.cut();
    }
    let cpu0 = process_cpu(agent.pid());
    let t = Instant::now();
    let port = local.port();
    let feeder = std::thread::spawn(move || {
        for from in (0..n).step_by(10_000) {
            publish_all(port, &agent_events(from, (from + 10_000).min(n)));
        }
    });
    let all = |c: &DurableCollector| c.count() >= n;
    let done = wait_until(Duration::from_secs(600), || {
        all(&on_local) && (!two || cut || all(&on_central))
    });
    feeder.join().expect("feeder");
    assert!(done, "results missing:\n{}", agent.stderr_tail(20));
    let took = t.elapsed();
    let cpu = process_cpu(agent.pid()) - cpu0;
    let mut drain = 0.0;
    if cut {
        // Every input applied, the central sink's results waiting: let them through.
        assert!(wait_until(Duration::from_secs(600), || agent_status(
            &agent
        )
        .is_some_and(
            |s| s["pipelines"][0]["applied"].as_u64() == Some(n as u64)
        )));
        let before = on_central.count();
        let t0 = Instant::now();
        link.pause(false);
        assert!(
            wait_until(Duration::from_secs(600), || on_central.count() >= n),
            "central never got its backlog:\n{}",
            agent.stderr_tail(20)
        );
        drain = (on_central.count() - before) as f64 / t0.elapsed().as_secs_f64();
    }
    let _ = agent.terminate();
    (
        n as f64 / took.as_secs_f64(),
        cpu.as_secs_f64() * 1e6 / n as f64,
        drain,
    )
}

fn agent_part(n: usize) {
    println!("the agent, {n} events (changelog: a result per event per sink):");
    for (what, sinks) in [
        ("one sink  (local)         ", "[\"local\"]"),
        ("two sinks (local, central)", "[\"local\", \"central\"]"),
    ] {
        let (rate, cpu, _) = agent_run(sinks, "5", false, n);
        println!(
            "  {what}: {rate:>7.0} events/s until every sink has every result, {cpu:>5.1} µs agent CPU per event"
        );
    }
    for protocol in ["5", "3.1.1"] {
        let (_, _, drain) = agent_run("[\"local\", \"central\"]", protocol, true, n);
        println!(
            "  central drain after an outage of {n} results, MQTT {protocol:<5}: {drain:>7.0} results/s"
        );
    }
}

fn main() {
    let part = std::env::var("CAIRN_SINK_PART").unwrap_or_default();
    if part != "layer" {
        agent_part(env("CAIRN_SINK_EVENTS", 50_000));
        if part == "agent" {
            return;
        }
    }
    let n = env("CAIRN_SINK_RESULTS", 200_000);
    let runs = env("CAIRN_SINK_RUNS", 3).max(1);
    println!("result connection drain, {n} results, window {WINDOW}, loopback mosquitto:");
    // Kinds take turns, so that a load that comes and goes on a shared box weighs on each.
    let kinds = ["3.1.1", "5", "5, stock window"];
    let mut rates = vec![Vec::new(); kinds.len()];
    for _ in 0..runs {
        for (kind, rates) in kinds.iter().zip(&mut rates) {
            rates.push(run(kind, n));
        }
    }
    for (kind, mut rates) in kinds.iter().zip(rates) {
        rates.sort_by(f64::total_cmp);
        println!(
            "MQTT {kind}: median {:.0} results/s",
            rates[rates.len() / 2]
        );
    }
}
