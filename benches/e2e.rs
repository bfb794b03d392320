//! End to end over MQTT, on one private mosquitto: Cairn (the `cairn` binary cargo built for
//! this bench, i.e. `target/release/cairn` under the bench profile) against a plain relay (a
//! rumqttc client that consumes and republishes, no storage) as the ceiling.
//!
//! Each input carries its send time (µs since the bench started) as its value. Cairn runs a
//! changelog `last` pipeline, so every input yields exactly one result whose value is that
//! send time; the relay copies it. Latency = arrival of the result − send time.
//!
//! Two runs per system: flat out (throughput; latency then includes queueing), and paced
//! (latency at a moderate rate). `cargo bench --bench e2e`; bounded to about a minute.

#[path = "../tests/it/support/mod.rs"]
mod support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rumqttc::{Client, Event, MqttOptions, Packet, QoS};
use support::Broker;
use support::agent::{AgentConfig, CairnProcess};

const FLAT_OUT: usize = 20_000;
const PACED: usize = 4_000;
const PACED_RATE: u64 = 2_000; // msg/s
const RUN_TIMEOUT: Duration = Duration::from_secs(40);

fn now_us(t0: Instant) -> u64 {
    t0.elapsed().as_micros() as u64
}

/// Subscribes to `filter` and records (arrival µs, value) for every result.
struct Sink {
    got: Arc<Mutex<Vec<(u64, u64)>>>,
    stop: Arc<AtomicBool>,
    client: Client,
}

impl Sink {
    fn start(port: u16, filter: &str, t0: Instant) -> Sink {
        let mut o = MqttOptions::new(support::unique_id("bench-sink"), "127.0.0.1", port);
        o.set_keep_alive(Duration::from_secs(10))
            .set_max_packet_size(1 << 20, 1 << 20);
        let (client, mut conn) = Client::new(o, 1000);
        client
            .subscribe(filter, QoS::AtLeastOnce)
            .expect("subscribe");
        let got = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let ready = Arc::new(AtomicBool::new(false));
        let (g, s, r) = (got.clone(), stop.clone(), ready.clone());
        std::thread::spawn(move || {
            while !s.load(Ordering::SeqCst) {
                match conn.recv_timeout(Duration::from_millis(50)) {
                    Ok(Ok(Event::Incoming(Packet::SubAck(_)))) => r.store(true, Ordering::SeqCst),
                    Ok(Ok(Event::Incoming(Packet::Publish(p)))) => {
                        let at = now_us(t0);
                        if let Ok(v) = serde_json::from_slice::<serde_json::Value>(&p.payload)
                            && let Some(sent) = v["value"].as_u64()
                        {
                            g.lock().unwrap().push((at, sent));
                        }
                    }
                    Ok(Err(_)) => std::thread::sleep(Duration::from_millis(20)),
                    _ => {}
                }
            }
        });
        assert!(support::wait_until(Duration::from_secs(10), || ready.load(Ordering::SeqCst)));
        Sink { got, stop, client }
    }

    fn count(&self) -> usize {
        self.got.lock().unwrap().len()
    }

    fn take(&self) -> Vec<(u64, u64)> {
        std::mem::take(&mut *self.got.lock().unwrap())
    }
}

impl Drop for Sink {
    fn drop(&mut self) {
        let _ = self.client.try_disconnect();
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// A QoS 1 publisher whose send times are embedded in the payloads; `rate` 0 = flat out.
fn publish(port: u16, prefix: &str, first: usize, n: usize, rate: u64, t0: Instant) {
    let mut o = MqttOptions::new(support::unique_id("bench-pub"), "127.0.0.1", port);
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
    let start = Instant::now();
    for i in first..first + n {
        if let Some(step) = ((i - first) as u64 * 1_000_000).checked_div(rate) {
            let due = start + Duration::from_micros(step);
            if let Some(wait) = due.checked_duration_since(Instant::now()) {
                std::thread::sleep(wait);
            }
        }
        let body = format!(
            "{{\"id\":\"e{i}\",\"k\":\"k{}\",\"ts\":{i},\"v\":{}}}",
            i % 16,
            now_us(t0)
        );
        client
            .publish(
                format!("{prefix}/k{}", i % 16),
                QoS::AtLeastOnce,
                false,
                body,
            )
            .expect("publish");
    }
    acker.join().expect("acker");
    let _ = client.disconnect();
}

/// The ceiling: consume (auto-ack) and republish each value, no storage.
struct Relay {
    stop: Arc<AtomicBool>,
}

impl Relay {
    fn start(port: u16) -> Relay {
        let mut o = MqttOptions::new(support::unique_id("bench-relay"), "127.0.0.1", port);
        o.set_keep_alive(Duration::from_secs(10)).set_inflight(100);
        let (client, mut conn) = Client::new(o, 1000);
        client
            .subscribe("relay/in/#", QoS::AtLeastOnce)
            .expect("subscribe");
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = channel::<(String, Vec<u8>)>();
        // Never publish from the polling thread: a full request channel would deadlock it.
        let s = stop.clone();
        std::thread::spawn(move || {
            while !s.load(Ordering::SeqCst) {
                if let Ok(Ok(Event::Incoming(Packet::Publish(p)))) =
                    conn.recv_timeout(Duration::from_millis(50))
                {
                    let v: serde_json::Value = serde_json::from_slice(&p.payload).unwrap();
                    let out = serde_json::json!({"value": v["v"]})
                        .to_string()
                        .into_bytes();
                    let _ = tx.send((p.topic.replacen("relay/in", "relay/out", 1), out));
                }
            }
        });
        std::thread::spawn(move || republish(client, rx));
        std::thread::sleep(Duration::from_millis(300)); // SUBACK
        Relay { stop }
    }
}

fn republish(client: Client, rx: Receiver<(String, Vec<u8>)>) {
    while let Ok((topic, body)) = rx.recv() {
        if client
            .publish(topic, QoS::AtLeastOnce, false, body)
            .is_err()
        {
            break;
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

struct Figures {
    rate: f64,
    p50_ms: f64,
    p99_ms: f64,
    got: usize,
    want: usize,
}

fn percentile(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i] as f64 / 1000.0
}

/// Publishes `n` inputs, waits for `n` results, returns the figures.
fn run(
    port: u16,
    prefix: &str,
    sink: &Sink,
    first: usize,
    n: usize,
    rate: u64,
    t0: Instant,
) -> Figures {
    sink.take();
    let start = now_us(t0);
    publish(port, prefix, first, n, rate, t0);
    support::wait_until(RUN_TIMEOUT, || sink.count() >= n);
    let got = sink.take();
    let last = got.iter().map(|(at, _)| *at).max().unwrap_or(start);
    let mut lat: Vec<u64> = got
        .iter()
        .map(|(at, sent)| at.saturating_sub(*sent))
        .collect();
    lat.sort_unstable();
    Figures {
        rate: got.len() as f64 / ((last - start).max(1) as f64 / 1e6),
        p50_ms: percentile(&lat, 0.50),
        p99_ms: percentile(&lat, 0.99),
        got: got.len(),
        want: n,
    }
}

fn print(name: &str, what: &str, f: &Figures) {
    println!(
        "{name:<6} {what:<22} {:>9.0} events/s   p50 {:>8.2} ms   p99 {:>8.2} ms   ({}/{} results)",
        f.rate, f.p50_ms, f.p99_ms, f.got, f.want
    );
}

fn main() {
    let t0 = Instant::now();
    let broker = Broker::start();
    let port = broker.port();
    println!("cairn binary: {}", support::agent::cairn_bin().display());

    let pipeline = "[[pipeline]]\nname = \"lat\"\ntopics = [\"bench/in/#\"]\nformat = \"json\"\n\
        event_id = \"/id\"\nkey = \"/k\"\nvalue = \"/v\"\nevent_time = \"/ts\"\naggregate = \"last\"\n\
        output_topic = \"bench/out/{key}\"\nretain = false\nemit = \"changelog\"\n";
    let mut cfg = AgentConfig::new(port, pipeline);
    cfg.log = "segment_size = \"64MiB\"\nmax_size = \"1GiB\"\nretention = \"1h\"\n\
               commit_interval = \"5ms\"\nmax_payload = \"64KiB\"\n"
        .into();
    cfg.checkpoint = "interval = \"20ms\"\nmax_records = 5000\n".into();
    let mut agent = CairnProcess::new(&cfg);
    agent.start_connected();
    let sink = Sink::start(port, "bench/out/#", t0);
    run(port, "bench/in", &sink, 0, 500, 0, t0); // warm-up
    let c_flat = run(port, "bench/in", &sink, 1_000, FLAT_OUT, 0, t0);
    let c_paced = run(port, "bench/in", &sink, 100_000, PACED, PACED_RATE, t0);
    let status = agent.terminate();
    drop(sink);

    let relay = Relay::start(port);
    let sink = Sink::start(port, "relay/out/#", t0);
    run(port, "relay/in", &sink, 0, 500, 0, t0);
    let r_flat = run(port, "relay/in", &sink, 1_000, FLAT_OUT, 0, t0);
    let r_paced = run(port, "relay/in", &sink, 100_000, PACED, PACED_RATE, t0);
    drop(sink);
    drop(relay);

    println!();
    print("cairn", "flat out", &c_flat);
    print("relay", "flat out", &r_flat);
    print("cairn", &format!("paced {PACED_RATE}/s"), &c_paced);
    print("relay", &format!("paced {PACED_RATE}/s"), &r_paced);
    println!(
        "\ncairn / relay throughput: {:.2}   p50 latency ratio (paced): {:.1}x   (cairn exit {status})",
        c_flat.rate / r_flat.rate,
        c_paced.p50_ms / r_paced.p50_ms
    );
    println!("total bench time {:.1} s", t0.elapsed().as_secs_f64());
}
