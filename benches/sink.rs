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

#[path = "../tests/it/support/mod.rs"]
mod support;

use std::time::{Duration, Instant};

use cairn::config::MqttConfig;
use cairn::mqtt::{Event, Events, Link, Mqtt, Mqtt5, MqttError};
use support::central::DurableCollector;
use support::{Broker, BrokerConfig};

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

fn main() {
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
