//! A long run through a small log (issue 11): feed many times `log.max_size` through the
//! agent at full rate and print, per interval, how many inputs it acknowledged and
//! processed and what the log and the store hold on disk. It must stay flat: no cliff when
//! the log first fills (retention then evicts processed segments instead of stalling), and
//! disk use bounded by `max_size` plus the store.
//!
//! `cargo bench --bench longrun`. It starts a private mosquitto on a free loopback port and
//! the `cairn` binary cargo built for this bench, and reads the agent's own `/metrics`.
//! `CAIRN_LONGRUN_EVENTS` (default 300,000 events of ~1 KiB, ~18× a 16 MiB log) sizes it.

#[path = "../tests/it/support/mod.rs"]
mod support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use rumqttc::{Client, Event, MqttOptions, Packet, QoS};
use support::Broker;
use support::agent::{AgentConfig, CairnProcess};

const INTERVAL: Duration = Duration::from_secs(1);
const RUN_TIMEOUT: Duration = Duration::from_secs(600);

/// `log.max_size` in MiB: `CAIRN_LONGRUN_MAX_MIB` (default 16). A size larger than the
/// stream (e.g. 2048) is the control run: the same load with a log that never fills.
fn max_size() -> u64 {
    std::env::var("CAIRN_LONGRUN_MAX_MIB")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(16)
        << 20
}

fn events() -> usize {
    std::env::var("CAIRN_LONGRUN_EVENTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300_000)
}

/// Flat out, QoS 1, ~1 KiB each over 64 keys; the broker queues what the agent has not
/// taken yet, so the agent's own rate is what the figures show.
fn publish(port: u16, n: usize) {
    let mut o = MqttOptions::new(support::unique_id("longrun-pub"), "127.0.0.1", port);
    o.set_keep_alive(Duration::from_secs(10)).set_inflight(100);
    let (client, mut conn) = Client::new(o, 1000);
    let acker = std::thread::spawn(move || {
        let mut acked = 0;
        let deadline = Instant::now() + RUN_TIMEOUT;
        while acked < n && Instant::now() < deadline {
            if let Ok(Ok(Event::Incoming(Packet::PubAck(_)))) =
                conn.recv_timeout(Duration::from_millis(100))
            {
                acked += 1;
            }
        }
    });
    let pad = "x".repeat(960);
    for i in 0..n {
        let body = format!(
            "{{\"id\":\"e{i}\",\"k\":\"k{}\",\"v\":1,\"pad\":\"{pad}\"}}",
            i % 64
        );
        client
            .publish("long/in", QoS::AtLeastOnce, false, body)
            .expect("publish");
    }
    acker.join().expect("acker");
    let _ = client.disconnect();
}

/// One scrape of the agent's `/metrics`, as name → value (unlabelled samples only).
fn scrape(port: u16) -> std::collections::HashMap<String, f64> {
    let mut text = String::new();
    if let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) {
        let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
        let _ =
            s.write_all(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
        let _ = s.read_to_string(&mut text);
    }
    let body = text.split("\r\n\r\n").nth(1).unwrap_or("");
    cairn::metrics::parse(body)
        .into_iter()
        .filter(|s| s.labels.is_empty())
        .map(|s| (s.name, s.value))
        .collect()
}

fn mib(bytes: f64) -> f64 {
    bytes / (1024.0 * 1024.0)
}

fn main() {
    let n = events();
    let max_size = max_size();
    let broker = Broker::start();
    let metrics_port = support::free_port();
    let pipeline = format!(
        "[[pipeline]]\nname = \"long\"\ntopics = [\"long/in\"]\nformat = \"json\"\n\
         event_id = \"/id\"\nkey = \"/k\"\nvalue = \"/v\"\naggregate = \"sum\"\n\
         output_topic = \"long/out/{{key}}\"\nretain = false\n\n\
         [metrics]\nlisten = \"127.0.0.1:{metrics_port}\"\n"
    );
    let mut cfg = AgentConfig::new(broker.port(), &pipeline);
    cfg.log = format!(
        "segment_size = \"1MiB\"\nmax_size = \"{}MiB\"\nretention = \"24h\"\n\
         commit_interval = \"5ms\"\nmax_payload = \"64KiB\"\n",
        max_size >> 20
    );
    cfg.checkpoint = "interval = \"50ms\"\nmax_records = 5000\n".into();
    let mut agent = CairnProcess::new(&cfg);
    agent.start_connected();
    println!(
        "cairn {}: {n} events of ~1 KiB (~{:.0}× log.max_size {} MiB, segments 1 MiB, retention 24h)",
        support::agent::cairn_bin().display(),
        (n as f64 * 1024.0) / max_size as f64,
        max_size >> 20
    );
    let port = broker.port();
    let publisher = std::thread::spawn(move || publish(port, n));

    println!(
        "{:>5} {:>10} {:>14} {:>9} {:>9} {:>9} {:>8} {:>3}",
        "t s", "acked/s", "checkpointed/s", "log MiB", "store MiB", "data MiB", "evicted", "bp"
    );
    let t0 = Instant::now();
    let (mut last_acked, mut last_done) = (0.0, 0.0);
    let mut rows: Vec<(f64, f64)> = Vec::new();
    let mut first_eviction = None;
    let mut max_data = 0.0f64;
    let mut max_log = 0.0f64;
    while t0.elapsed() < RUN_TIMEOUT {
        std::thread::sleep(INTERVAL);
        let m = scrape(metrics_port);
        let get = |k: &str| m.get(k).copied().unwrap_or(0.0);
        let (acked, done) = (
            get("cairn_acked_total"),
            get("cairn_checkpoint_next_offset"),
        );
        let data = ["log", "store", "savepoints"]
            .iter()
            .map(|d| cairn::metrics::dir_size_bytes(&agent.data_dir().join(d)))
            .sum::<u64>() as f64;
        let evicted = get("cairn_log_segments_evicted_total");
        if evicted > 0.0 && first_eviction.is_none() {
            first_eviction = Some(rows.len());
        }
        max_data = max_data.max(data);
        max_log = max_log.max(get("cairn_log_size_bytes"));
        println!(
            "{:>5.0} {:>10.0} {:>14.0} {:>9.2} {:>9.2} {:>9.2} {:>8.0} {:>3.0}",
            t0.elapsed().as_secs_f64(),
            acked - last_acked,
            done - last_done,
            mib(get("cairn_log_size_bytes")),
            mib(get("cairn_store_size_bytes")),
            mib(data),
            evicted,
            get("cairn_backpressure")
        );
        rows.push((acked - last_acked, done - last_done));
        (last_acked, last_done) = (acked, done);
        if done as usize >= n {
            break;
        }
    }
    publisher.join().expect("publisher");
    let m = scrape(metrics_port);
    let get = |k: &str| m.get(k).copied().unwrap_or(0.0);
    let (reconnects, evicted) = (
        get("cairn_mqtt_reconnects_total"),
        get("cairn_log_segments_evicted_total"),
    );
    let status = agent.terminate();
    let said = agent.stderr();
    let count = |needle: &str| said.matches(needle).count();

    // The last interval is partial (the stream ended inside it).
    let full = &rows[..rows.len().saturating_sub(1)];
    let rates: Vec<f64> = full.iter().map(|r| r.1).collect();
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let (min, max) = rates
        .iter()
        .fold((f64::MAX, 0.0f64), |(lo, hi), &r| (lo.min(r), hi.max(r)));
    println!();
    println!(
        "processed {last_done:.0} of {n} in {:.1} s: {:.0} events/s mean over full intervals, min {:.0}, max {:.0}",
        t0.elapsed().as_secs_f64(),
        mean(&rates),
        if rates.is_empty() { 0.0 } else { min },
        max
    );
    if let Some(i) = first_eviction {
        let (before, after) = rates.split_at(i.min(rates.len()));
        println!(
            "log first full in interval {}: mean {:.0} events/s before, {:.0} after",
            i + 1,
            mean(before),
            mean(after)
        );
    } else {
        println!("the log never filled: raise CAIRN_LONGRUN_EVENTS");
    }
    println!(
        "disk: log at most {:.2} MiB (max_size {} MiB); data dir at most {:.2} MiB; cairn exit {status}",
        mib(max_log),
        max_size >> 20,
        mib(max_data)
    );
    println!(
        "segments evicted {evicted:.0}; reconnects {reconnects:.0}; journal: {} backpressure on, \
         {} mqtt disconnected, {} eviction warnings",
        count("backpressure on"),
        count("mqtt: disconnected"),
        count("retention: the log is short of room")
    );
}
