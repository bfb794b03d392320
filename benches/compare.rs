//! Cairn against the alternatives, in one run (issue 7): `cargo bench --bench compare`.
//!
//! One private mosquitto (loopback, free port, the settings of `config/mosquitto.conf` but
//! logging only notices, so the broker is not busy writing a line per message) carries the
//! same seeded stream to three systems:
//!
//! - a plain relay (rumqttc: subscribe, auto-ack, republish; no storage): the ceiling. It
//!   runs as a process of its own (this binary, re-executed), so that its CPU time per event
//!   is measured as Cairn's is: utime + stime over the flat-out runs / events;
//! - Cairn, the binary cargo built for this bench (`target/release/cairn` under the bench
//!   profile), with a changelog `sum` pipeline: one result per input, like the others;
//! - Node-RED 4 (from npm, under `target/node-red`; `benches/install-node-red.sh` installs it
//!   when missing): mqtt in → keyed sum in a `localfilesystem` context store → mqtt out.
//!
//! Every system publishes one result per input on `<prefix>/out/<key>`; results of one key
//! arrive in input order, so the sink pairs each result with its input's send time by a
//! per-key FIFO. Latency = result arrival − input send time. Throughput = inputs / (last
//! result − first send), median of [`RUNS`] runs after a warm-up. Latency is then taken at
//! 50% and 90% of each system's own median peak.
//!
//! CPU per event is also taken in pairs of flat-out runs, relay and Cairn in turn with both
//! up ([`cpu_pairs`]); the target uses the median of the pairs' ratios, since the box's
//! speed drifts between the relay's runs and Cairn's a minute later.
//!
//! Then the checkpoint interval's curve (issue 14, `compare/intervals.rs`): Cairn's
//! throughput, latency at 50% load, bytes written per event and recovery after a SIGKILL for
//! intervals of 50 ms, 200 ms, 1 s and 5 s, beside the relay of the same run.
//!
//! Then, Cairn only: recovery from a SIGKILL with 100,000 logged but unprocessed records
//! (pre-filled with `cairn::log::Log` while the agent is stopped), READY timed on a fake
//! `NOTIFY_SOCKET`; footprint (issue 16): a backlog of 1M inputs over 100k keys (2%
//! duplicates) waiting in a broker, drained by a freshly started agent (peak RSS, RSS after
//! 10 s idle, disk bytes and CPU per input, drain rate; then again with `outbox.max_entries`
//! at 20,000, a user's memory bound), RSS after 10 s idle with the live
//! runs' 1,000 keys, stripped binary. The targets are printed with pass/FAIL. And both Cairn and Node-RED get the same SIGKILL at the same
//! input of the same paced stream; their final per-key sums are compared with the oracle.
//!
//! Figures are printed, never asserted. Every child process is killed on drop.
//!
//! Why ~1,800 lines: every system and every figure of the comparison in one run, sharing
//! one broker and one seeded stream; the interval curve is in `compare/intervals.rs`.

#[path = "../tests/it/support/mod.rs"]
mod support;

/// The checkpoint-interval curve (issue 14): `CAIRN_COMPARE_ONLY=relay,intervals`.
#[path = "compare/intervals.rs"]
mod intervals;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rumqttc::{Client, Event, MqttOptions, Packet, QoS};
use support::{Broker, BrokerConfig, free_port, unique_id, wait_until};

/// Distinct keys of the live streams.
const KEYS: u64 = 1_000;
const WARMUP: u64 = 2_000;
const RUN_EVENTS: u64 = 20_000;
const RUNS: usize = 3;
/// Inputs per paced (latency) run.
const PACED_EVENTS: u64 = 10_000;
/// The low-rate paced run: inputs/s and inputs (printed only, for its CPU per event).
const LOW_RATE: u64 = 1_000;
const LOW_EVENTS: u64 = 3_000;
/// Kill test: a paced stream, every system killed when this input has been published.
const KILL_EVENTS: u64 = 10_000;
const KILL_RATE: u64 = 2_000;
const KILL_AT: u64 = 5_000;
/// Recovery: logged but unprocessed records at restart.
const RECOVERY_RECORDS: u64 = 100_000;
/// Footprint: keys and dedup ledger entries.
const FOOT_KEYS: u64 = 100_000;
/// The outbox bound of the second backlog run: a user's memory bound (issue 16).
const FOOT_BOUND: u64 = 20_000;
const FOOT_EVENTS: u64 = 1_000_000;
const IDLE: Duration = Duration::from_secs(10);
/// Any single wait in this bench; a system that cannot keep up is reported, not waited for.
const STEP_TIMEOUT: Duration = Duration::from_secs(60);
/// Node-RED's `localfilesystem` context flush interval, seconds (its default).
const NODE_RED_FLUSH_S: u64 = 30;
const SEED: u64 = 0x9E37_79B9_7F4A_7C15;

// ---------------------------------------------------------------- the seeded stream ----

/// Event `i` of the stream with `seed`: (key number, value). xorshift, so every system, run
/// and oracle sees the same stream.
fn event(seed: u64, i: u64, keys: u64) -> (u64, u64) {
    let mut s = seed ^ i.wrapping_mul(0x2545_F491_4F6C_DD1D);
    let mut step = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    step();
    (step() % keys, step() % 1_000)
}

fn payload(tag: &str, i: u64, key: u64, value: u64) -> String {
    format!(r#"{{"id":"{tag}-{i}","k":"k{key:06}","v":{value}}}"#)
}

fn key_of_topic(topic: &str) -> Option<usize> {
    topic.rsplit('/').next()?.strip_prefix('k')?.parse().ok()
}

// ----------------------------------------------------------------- processes ----------

/// A child process, SIGKILLed on drop.
struct Proc {
    child: Option<Child>,
    pid: u32,
}

impl Proc {
    fn spawn(cmd: &mut Command) -> Proc {
        let child = cmd.spawn().expect("spawn a bench child process");
        let pid = child.id();
        Proc {
            child: Some(child),
            pid,
        }
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM, then SIGKILL after `grace`.
    fn terminate(&mut self, grace: Duration) {
        if let Some(mut c) = self.child.take() {
            support::signal(c.id(), "TERM");
            let exited = wait_until(grace, || matches!(c.try_wait(), Ok(Some(_))));
            if !exited {
                let _ = c.kill();
            }
            let _ = c.wait();
        }
    }

    fn status_kib(&self, field: &str) -> u64 {
        let s = std::fs::read_to_string(format!("/proc/{}/status", self.pid)).unwrap_or_default();
        s.lines()
            .find(|l| l.starts_with(field))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    }

    fn rss_mib(&self) -> f64 {
        self.status_kib("VmRSS:") as f64 / 1024.0
    }

    fn hwm_mib(&self) -> f64 {
        self.status_kib("VmHWM:") as f64 / 1024.0
    }

    /// Bytes this process caused to be written to the block layer.
    fn write_bytes(&self) -> u64 {
        let s = std::fs::read_to_string(format!("/proc/{}/io", self.pid)).unwrap_or_default();
        s.lines()
            .find(|l| l.starts_with("write_bytes:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    }

    /// utime + stime, in clock ticks.
    fn cpu_ticks(&self) -> u64 {
        let s = std::fs::read_to_string(format!("/proc/{}/stat", self.pid)).unwrap_or_default();
        // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
        let rest = s.rsplit(')').next().unwrap_or("");
        let f: Vec<&str> = rest.split_whitespace().collect();
        let at = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
        at(11) + at(12)
    }

    /// Per thread (by name): CPU ticks (utime + stime), voluntary and involuntary context
    /// switches, for where a process's time goes.
    fn threads(&self) -> BTreeMap<String, (u64, u64, u64)> {
        let mut out = BTreeMap::new();
        let Ok(dir) = std::fs::read_dir(format!("/proc/{}/task", self.pid)) else {
            return out;
        };
        for t in dir.flatten() {
            let p = t.path();
            let stat = std::fs::read_to_string(p.join("stat")).unwrap_or_default();
            let name = stat
                .split_once('(')
                .and_then(|(_, r)| r.rsplit_once(')'))
                .map(|(n, _)| n.to_string())
                .unwrap_or_default();
            let rest = stat.rsplit(')').next().unwrap_or("");
            let f: Vec<&str> = rest.split_whitespace().collect();
            let at = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
            let status = std::fs::read_to_string(p.join("status")).unwrap_or_default();
            let switches = |field: &str| {
                status
                    .lines()
                    .find(|l| l.starts_with(field))
                    .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
                    .unwrap_or(0)
            };
            let e = out.entry(name).or_insert((0, 0, 0));
            e.0 += at(11) + at(12);
            e.1 += switches("voluntary_ctxt_switches:");
            e.2 += switches("nonvoluntary_ctxt_switches:");
        }
        out
    }

    /// CPU used over `span` of idleness, as % of one core.
    fn idle_cpu_percent(&self, span: Duration) -> f64 {
        let hz = ticks_per_second();
        let a = self.cpu_ticks();
        std::thread::sleep(span);
        let b = self.cpu_ticks();
        (b - a) as f64 / hz / span.as_secs_f64() * 100.0
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

fn ticks_per_second() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 { t as f64 } else { 100.0 }
}

// ------------------------------------------------------------------- broker ----------

/// The shared test broker (tests/it/support) with `config/mosquitto.conf`'s settings that
/// matter here: the inflight window, deep queues, Nagle off, rare autosaves, and only
/// notice-level logging (every publish logged would cost throughput; notices still show
/// connections for `Broker::connections`).
fn start_broker(autosave_interval_s: u32) -> Broker {
    Broker::start_with(BrokerConfig {
        max_inflight: broker_inflight() as u32,
        autosave_interval_s,
        log_types: vec!["error", "warning", "notice"],
        extra: [
            "max_queued_bytes 0",
            "queue_qos0_messages false",
            "set_tcp_nodelay true",
            "autosave_on_changes false",
        ]
        .map(String::from)
        .to_vec(),
        ..BrokerConfig::default()
    })
}

/// mosquitto's `max_inflight_messages` for the run: how many inputs a subscriber may hold
/// unacknowledged. Cairn acknowledges after the fsync, so this is its fsync batch; the
/// shipped `config/mosquitto.conf` value unless CAIRN_COMPARE_INFLIGHT says otherwise.
fn broker_inflight() -> u64 {
    std::env::var("CAIRN_COMPARE_INFLIGHT")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            let conf = include_str!("../config/mosquitto.conf");
            conf.lines()
                .find_map(|l| l.strip_prefix("max_inflight_messages "))
                .and_then(|v| v.trim().parse().ok())
                .expect("config/mosquitto.conf sets max_inflight_messages")
        })
}

// --------------------------------------------------------- sink and publisher ----------

/// Subscribes to `<prefix>/out/#`; pairs each result with its input's send time (per-key
/// FIFO, filled by the publisher), and keeps each key's latest (version, value, count).
struct Sink {
    shared: Arc<SinkShared>,
    client: Client,
}

#[derive(Default)]
struct SinkShared {
    stop: AtomicBool,
    subscribed: AtomicBool,
    results: AtomicUsize,
    last_us: AtomicU64,
    /// Per key: send times (µs since `t0`) of inputs whose result has not arrived.
    pending: Mutex<Vec<VecDeque<u64>>>,
    latencies_us: Mutex<Vec<u64>>,
    /// Per key: (version or arrival number, value, count) of the newest result.
    latest: Mutex<Latest>,
}

/// Per key number: (version or arrival number, value, count) of its newest result.
type Latest = HashMap<usize, (u64, f64, u64)>;

impl Sink {
    fn start(port: u16, prefix: &str, keys: u64, t0: Instant) -> Sink {
        let mut o = MqttOptions::new(unique_id("cmp-sink"), "127.0.0.1", port);
        o.set_keep_alive(Duration::from_secs(10))
            .set_max_packet_size(1 << 20, 1 << 20);
        let (client, mut conn) = Client::new(o, 10_000);
        client
            .subscribe(format!("{prefix}/out/#"), QoS::AtLeastOnce)
            .expect("subscribe");
        let shared = Arc::new(SinkShared {
            pending: Mutex::new(vec![VecDeque::new(); keys as usize]),
            ..Default::default()
        });
        let sh = shared.clone();
        std::thread::spawn(move || {
            let mut arrivals = 0u64;
            while !sh.stop.load(Ordering::SeqCst) {
                match conn.recv_timeout(Duration::from_millis(50)) {
                    Ok(Ok(Event::Incoming(Packet::SubAck(_)))) => {
                        sh.subscribed.store(true, Ordering::SeqCst)
                    }
                    Ok(Ok(Event::Incoming(Packet::Publish(p)))) => {
                        let at = t0.elapsed().as_micros() as u64;
                        arrivals += 1;
                        sh.on_result(&p.topic, &p.payload, at, arrivals);
                    }
                    Ok(Err(_)) => std::thread::sleep(Duration::from_millis(20)),
                    _ => {}
                }
            }
        });
        assert!(
            wait_until(Duration::from_secs(10), || shared
                .subscribed
                .load(Ordering::SeqCst)),
            "sink got no SUBACK"
        );
        Sink { shared, client }
    }

    fn results(&self) -> usize {
        self.shared.results.load(Ordering::SeqCst)
    }

    /// Forget latencies and counts; keeps the per-key FIFOs and latest values.
    fn reset(&self) -> usize {
        self.shared.latencies_us.lock().unwrap().clear();
        self.shared.results.swap(0, Ordering::SeqCst)
    }

    fn latest(&self) -> Latest {
        self.shared.latest.lock().unwrap().clone()
    }
}

impl SinkShared {
    fn on_result(&self, topic: &str, payload: &[u8], at: u64, arrival: u64) {
        let Some(k) = key_of_topic(topic) else { return };
        if let Some(sent) = self
            .pending
            .lock()
            .unwrap()
            .get_mut(k)
            .and_then(|q| q.pop_front())
        {
            self.latencies_us
                .lock()
                .unwrap()
                .push(at.saturating_sub(sent));
        }
        if let Ok(v) = serde_json::from_slice::<serde_json::Value>(payload) {
            // Cairn's results carry a per-key version (a re-send repeats an old one); the
            // others' results are ranked by arrival.
            let rank = v["version"].as_u64().unwrap_or(arrival);
            let value = v["value"].as_f64().unwrap_or(f64::NAN);
            let count = v["count"].as_u64().unwrap_or(0);
            let mut latest = self.latest.lock().unwrap();
            let e = latest.entry(k).or_insert((0, 0.0, 0));
            if rank >= e.0 {
                *e = (rank, value, count);
            }
        }
        self.last_us.store(at, Ordering::SeqCst);
        self.results.fetch_add(1, Ordering::SeqCst);
    }
}

impl Drop for Sink {
    fn drop(&mut self) {
        let _ = self.client.try_disconnect();
        self.shared.stop.store(true, Ordering::SeqCst);
    }
}

/// One QoS 1 publisher (inflight 100) for the whole bench.
struct Publisher {
    client: Client,
    acked: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
}

impl Publisher {
    fn start(port: u16) -> Publisher {
        let mut o = MqttOptions::new(unique_id("cmp-pub"), "127.0.0.1", port);
        o.set_keep_alive(Duration::from_secs(10)).set_inflight(100);
        let (client, mut conn) = Client::new(o, 1_000);
        let acked = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (a, s) = (acked.clone(), stop.clone());
        std::thread::spawn(move || {
            while !s.load(Ordering::SeqCst) {
                match conn.recv_timeout(Duration::from_millis(50)) {
                    Ok(Ok(Event::Incoming(Packet::PubAck(_)))) => {
                        a.fetch_add(1, Ordering::SeqCst);
                    }
                    Ok(Err(_)) => std::thread::sleep(Duration::from_millis(20)),
                    _ => {}
                }
            }
        });
        Publisher {
            client,
            acked,
            stop,
        }
    }

    /// Publish events `[from, to)` of the stream under `<prefix>/in/<key>` at `rate`/s (0:
    /// flat out); send times go into `sink`'s FIFOs. `progress` counts published inputs.
    #[allow(clippy::too_many_arguments)]
    fn send(
        &self,
        prefix: &str,
        tag: &str,
        range: std::ops::Range<u64>,
        keys: u64,
        rate: u64,
        sink: Option<&Sink>,
        t0: Instant,
        progress: Option<&AtomicU64>,
    ) {
        let acked0 = self.acked.load(Ordering::SeqCst);
        let n = range.end - range.start;
        let start = Instant::now();
        for i in range.clone() {
            if let Some(step) = ((i - range.start) * 1_000_000).checked_div(rate) {
                let due = start + Duration::from_micros(step);
                if let Some(wait) = due.checked_duration_since(Instant::now()) {
                    std::thread::sleep(wait);
                }
            }
            let (key, value) = event(SEED, i, keys);
            if let Some(s) = sink {
                let at = t0.elapsed().as_micros() as u64;
                s.shared.pending.lock().unwrap()[key as usize].push_back(at);
            }
            self.client
                .publish(
                    format!("{prefix}/in/k{key:06}"),
                    QoS::AtLeastOnce,
                    false,
                    payload(tag, i, key, value),
                )
                .expect("queue a publish");
            if let Some(p) = progress {
                p.store(i - range.start + 1, Ordering::SeqCst);
            }
        }
        let all = wait_until(STEP_TIMEOUT, || {
            self.acked.load(Ordering::SeqCst) - acked0 >= n
        });
        if !all {
            println!("  (publisher: not every PUBACK arrived within {STEP_TIMEOUT:?})");
        }
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        let _ = self.client.try_disconnect();
        self.stop.store(true, Ordering::SeqCst);
    }
}

// ---------------------------------------------------------------- systems ----------

/// What the throughput and latency runs need from a system under test.
trait System {
    fn name(&self) -> &'static str;
    fn prefix(&self) -> &'static str;
    fn proc(&self) -> Option<&Proc>;
}

/// The ceiling: auto-ack, republish the payload to `relay/out/<key>`, no storage. It runs in
/// a process of its own (this bench binary again, with [`RELAY_ENV`] set), so that its CPU
/// time and RSS are measured like Cairn's, without the bench's publisher and sink.
struct Relay {
    proc: Proc,
}

/// Set to a broker port, this binary runs [`relay_main`] instead of the bench.
const RELAY_ENV: &str = "CAIRN_COMPARE_RELAY_PORT";

impl Relay {
    fn start(port: u16) -> Relay {
        let exe = std::env::current_exe().expect("the bench binary");
        let mut cmd = Command::new(exe);
        cmd.env(RELAY_ENV, port.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut proc = Proc::spawn(&mut cmd);
        let out = proc
            .child
            .as_mut()
            .and_then(|c| c.stdout.take())
            .expect("relay stdout");
        let mut line = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(out), &mut line)
            .expect("relay says it subscribed");
        assert_eq!(line.trim(), "subscribed", "relay did not subscribe");
        Relay { proc }
    }
}

/// The relay process: subscribe, republish each input, until killed. Polling and publishing
/// run on different threads (one thread doing both can deadlock rumqttc).
fn relay_main(port: u16) {
    let mut o = MqttOptions::new(unique_id("cmp-relay"), "127.0.0.1", port);
    o.set_keep_alive(Duration::from_secs(10)).set_inflight(100);
    let (client, mut conn) = Client::new(o, 1_000);
    client
        .subscribe("relay/in/#", QoS::AtLeastOnce)
        .expect("relay subscribe");
    // Unbounded: the polling thread must never wait on the publishing one (which may be
    // waiting for the polling thread to drain rumqttc's request channel).
    let (tx, rx) = std::sync::mpsc::channel::<(String, Vec<u8>)>();
    let out = client.clone();
    std::thread::spawn(move || {
        while let Ok((topic, body)) = rx.recv() {
            if out.publish(topic, QoS::AtLeastOnce, false, body).is_err() {
                break;
            }
        }
    });
    loop {
        match conn.recv_timeout(Duration::from_millis(50)) {
            Ok(Ok(Event::Incoming(Packet::SubAck(_)))) => {
                println!("subscribed");
                let _ = std::io::stdout().flush();
            }
            Ok(Ok(Event::Incoming(Packet::Publish(p)))) => {
                let topic = p.topic.replacen("relay/in", "relay/out", 1);
                if tx.send((topic, p.payload.to_vec())).is_err() {
                    break;
                }
            }
            Ok(Err(_)) => std::thread::sleep(Duration::from_millis(20)),
            _ => {}
        }
    }
}

impl System for Relay {
    fn name(&self) -> &'static str {
        "relay"
    }
    fn prefix(&self) -> &'static str {
        "relay"
    }
    fn proc(&self) -> Option<&Proc> {
        Some(&self.proc)
    }
}

/// The agent under test: the one cargo built for this bench, or `CAIRN_COMPARE_BIN` (another
/// build, e.g. an older commit's, for a before/after under the same load).
fn cairn_bin() -> PathBuf {
    std::env::var_os("CAIRN_COMPARE_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(support::agent::cairn_bin)
}

/// The `cairn` binary with its own data directory and config.
struct Cairn {
    dir: PathBuf,
    metrics_port: u16,
    proc: Option<Proc>,
    runs: usize,
}

impl Cairn {
    fn new(root: &Path, name: &str, broker_port: u16, emit: &str, max_records: u64) -> Cairn {
        let dir = root.join(name);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("cairn dir");
        let client_id = format!("cmp_{name}_{}", std::process::id());
        let metrics_port = free_port();
        // The shipped config's cache; CAIRN_COMPARE_CACHE to try another.
        let cache = std::env::var("CAIRN_COMPARE_CACHE").unwrap_or_else(|_| "16MiB".into());
        // Results allowed to wait before ingest holds back; CAIRN_COMPARE_OUTBOX_MAX to bound
        // the memory they take (issue 16).
        let outbox_max =
            std::env::var("CAIRN_COMPARE_OUTBOX_MAX").unwrap_or_else(|_| "2000000".into());
        let inflight = broker_inflight();
        let conf = format!(
            "[mqtt]\nhost = \"127.0.0.1\"\nport = {broker_port}\nclient_id = \"{client_id}\"\n\
             keep_alive = \"10s\"\ningest_batch = {inflight}\n\n\
             [storage]\ndata_dir = \"{}\"\ncache_size = \"{cache}\"\n\n\
             [log]\nsegment_size = \"64MiB\"\nmax_size = \"4GiB\"\nretention = \"1h\"\n\
             commit_interval = \"5ms\"\nmax_payload = \"64KiB\"\n\n\
             [checkpoint]\ninterval = \"50ms\"\nmax_records = {max_records}\n\n\
             [outbox]\nmax_entries = {outbox_max}\ninflight = 100\ndrain_timeout = \"2s\"\n\n\
             [metrics]\nlisten = \"127.0.0.1:{metrics_port}\"\n\n\
             [[pipeline]]\nname = \"sums\"\ntopics = [\"cairn/in/#\"]\nformat = \"json\"\n\
             event_id = \"/id\"\nkey = \"/k\"\nvalue = \"/v\"\naggregate = \"sum\"\n\
             dedup_window = \"7d\"\noutput_topic = \"cairn/out/{{key}}\"\nretain = false\n\
             emit = \"{emit}\"\nmax_keys = 1000000\n",
            dir.join("data").display()
        );
        std::fs::write(dir.join("cairn.toml"), conf).expect("write cairn.toml");
        Cairn {
            dir,
            metrics_port,
            proc: None,
            runs: 0,
        }
    }

    fn stderr_path(&self) -> PathBuf {
        self.dir.join("cairn.stderr")
    }

    /// Set `outbox.max_entries` (before the agent starts).
    fn set_outbox_max(&self, max: u64) {
        let path = self.dir.join("cairn.toml");
        let conf = std::fs::read_to_string(&path).expect("read cairn.toml");
        let at = conf
            .find("[outbox]\nmax_entries = ")
            .expect("an [outbox] table");
        let end = at
            + conf[at..]
                .find("\ninflight")
                .expect("inflight after max_entries");
        let conf = format!(
            "{}[outbox]\nmax_entries = {max}{}",
            &conf[..at],
            &conf[end..]
        );
        std::fs::write(&path, conf).expect("write cairn.toml");
    }

    /// Set `[checkpoint]` (before the agent starts).
    fn set_checkpoint(&self, interval: &str, max_records: u64) {
        let path = self.dir.join("cairn.toml");
        let conf = std::fs::read_to_string(&path).expect("read cairn.toml");
        let at = conf.find("[checkpoint]").expect("a [checkpoint] table");
        let end = at + conf[at..].find("\n\n").expect("the table ends");
        let conf = format!(
            "{}[checkpoint]\ninterval = \"{interval}\"\nmax_records = {max_records}{}",
            &conf[..at],
            &conf[end..]
        );
        std::fs::write(&path, conf).expect("write cairn.toml");
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(self.stderr_path()).unwrap_or_default()
    }

    /// Start `cairn run` and wait until it is connected; panics with its stderr if it is not
    /// within 20 s.
    fn start_connected(&mut self) {
        self.start(None);
        assert!(
            self.wait_connected(Duration::from_secs(20)),
            "cairn did not connect: {}",
            self.stderr()
        );
    }

    /// Start `cairn run`; with `notify`, as systemd would (`NOTIFY_SOCKET`).
    fn start(&mut self, notify: Option<&Path>) {
        self.runs += 1;
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.stderr_path())
            .expect("stderr file");
        writeln!(f, "=== run {} ===", self.runs).expect("stderr header");
        let mut cmd = Command::new(cairn_bin());
        cmd.arg("run")
            .arg("--config")
            .arg(self.dir.join("cairn.toml"))
            .env("RUST_LOG", "info")
            .env_remove("NOTIFY_SOCKET")
            .env_remove("CAIRN_CONFIG")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(f));
        if let Some(sock) = notify {
            cmd.env("NOTIFY_SOCKET", sock);
        }
        self.proc = Some(Proc::spawn(&mut cmd));
    }

    /// Wait until run `self.runs` logged its MQTT connection, then a moment for SUBSCRIBE.
    fn wait_connected(&mut self, timeout: Duration) -> bool {
        let header = format!("=== run {} ===", self.runs);
        let ok = wait_until(timeout, || {
            let all = self.stderr();
            let run = all.rsplit(&header).next().unwrap_or("");
            run.contains("mqtt: connected")
        });
        std::thread::sleep(Duration::from_millis(300));
        ok
    }

    fn kill(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.kill();
        }
    }

    /// One gauge from `/metrics`.
    fn metric(&self, name: &str) -> Option<f64> {
        let mut s = TcpStream::connect(("127.0.0.1", self.metrics_port)).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
        s.write_all(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
            .ok()?;
        let mut body = String::new();
        s.read_to_string(&mut body).ok()?;
        body.lines()
            .filter(|l| l.starts_with(name))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .reduce(|a, b| a + b)
    }

    /// Append `n` records of the stream to the stopped agent's log, as ingest would have.
    fn prefill_log(&self, tag: &str, n: u64, keys: u64) {
        use cairn::log::{Log, LogOptions};
        let opts = LogOptions {
            dir: self.dir.join("data/log"),
            segment_size: 64 << 20,
            max_size: 4 << 30,
            max_payload: 64 << 10,
        };
        let (mut log, _) = Log::open(opts, cairn::fsio::real()).expect("open the agent's log");
        let now = cairn::agent::wall_ms();
        for i in 0..n {
            let (key, value) = event(SEED, i, keys);
            log.append(
                now,
                &format!("cairn/in/k{key:06}"),
                payload(tag, i, key, value).as_bytes(),
                1,
                false,
            )
            .expect("append");
            if i % 10_000 == 9_999 {
                log.commit().expect("commit");
            }
        }
        log.commit().expect("commit");
    }

    /// `recovery: done in N ms` of the last run.
    fn recovery_ms(&self) -> Option<u64> {
        let all = self.stderr();
        let line = all
            .lines()
            .rev()
            .find(|l| l.contains("recovery: done in "))?;
        line.split("recovery: done in ")
            .nth(1)?
            .split(' ')
            .next()?
            .parse()
            .ok()
    }
}

impl System for Cairn {
    fn name(&self) -> &'static str {
        "cairn"
    }
    fn prefix(&self) -> &'static str {
        "cairn"
    }
    fn proc(&self) -> Option<&Proc> {
        self.proc.as_ref()
    }
}

/// Node-RED 4 with a flow written here: mqtt in (QoS 1, persistent session) → function
/// (keyed sum and count in the `file` context store) → mqtt out (QoS 1).
struct NodeRed {
    red_js: PathBuf,
    user_dir: PathBuf,
    client_id: String,
    proc: Option<Proc>,
}

impl NodeRed {
    fn new(root: &Path, red_js: PathBuf, broker_port: u16, name: &str) -> NodeRed {
        let user_dir = root.join(name);
        let _ = std::fs::remove_dir_all(&user_dir);
        std::fs::create_dir_all(&user_dir).expect("node-red user dir");
        let client_id = format!("cmp_{name}_{}", std::process::id());
        let settings = format!(
            "module.exports = {{\n  uiHost: \"127.0.0.1\",\n  uiPort: {},\n  \
             flowFile: \"flows.json\",\n  credentialSecret: false,\n  \
             httpAdminRoot: false,\n  httpNodeRoot: false,\n  \
             logging: {{ console: {{ level: \"warn\", metrics: false, audit: false }} }},\n  \
             contextStorage: {{\n    default: {{ module: \"memory\" }},\n    \
             file: {{ module: \"localfilesystem\", config: {{ flushInterval: {NODE_RED_FLUSH_S} }} }}\n  }},\n  \
             editorTheme: {{ tours: false }},\n}};\n",
            free_port()
        );
        std::fs::write(user_dir.join("settings.js"), settings).expect("settings.js");
        let func = "const p = msg.payload;\n\
                    const s = context.get(p.k, \"file\") || { sum: 0, count: 0 };\n\
                    s.sum += p.v; s.count += 1;\n\
                    context.set(p.k, s, \"file\");\n\
                    return { topic: \"nr/out/\" + p.k, payload: { key: p.k, value: s.sum, count: s.count, id: p.id } };";
        let flows = serde_json::json!([
            {"id": "cmp_tab", "type": "tab", "label": "cairn-compare"},
            {"id": "cmp_broker", "type": "mqtt-broker", "name": "bench",
             "broker": "127.0.0.1", "port": broker_port.to_string(), "clientid": client_id,
             "autoConnect": true, "usetls": false, "protocolVersion": "4", "keepalive": "10",
             "cleansession": false, "autoUnsubscribe": false,
             "birthTopic": "", "closeTopic": "", "willTopic": ""},
            {"id": "cmp_in", "type": "mqtt in", "z": "cmp_tab", "name": "", "topic": "nr/in/#",
             "qos": "1", "datatype": "json", "broker": "cmp_broker", "nl": false, "rap": true,
             "rh": 0, "inputs": 0, "x": 100, "y": 100, "wires": [["cmp_sum"]]},
            {"id": "cmp_sum", "type": "function", "z": "cmp_tab", "name": "keyed sum",
             "func": func, "outputs": 1, "timeout": 0, "noerr": 0, "initialize": "",
             "finalize": "", "libs": [], "x": 300, "y": 100, "wires": [["cmp_out"]]},
            {"id": "cmp_out", "type": "mqtt out", "z": "cmp_tab", "name": "", "topic": "",
             "qos": "1", "retain": "false", "broker": "cmp_broker", "x": 500, "y": 100,
             "wires": []}
        ]);
        std::fs::write(user_dir.join("flows.json"), flows.to_string()).expect("flows.json");
        NodeRed {
            red_js,
            user_dir,
            client_id,
            proc: None,
        }
    }

    fn start(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.user_dir.join("node-red.log"))
            .expect("node-red log");
        self.proc = Some(Proc::spawn(
            Command::new("node")
                .arg(&self.red_js)
                .arg("--userDir")
                .arg(&self.user_dir)
                .arg("--settings")
                .arg(self.user_dir.join("settings.js"))
                .stdin(Stdio::null())
                .stdout(Stdio::from(log.try_clone().expect("log")))
                .stderr(Stdio::from(log)),
        ));
    }

    /// Wait for the broker to see connection number `n` of this flow, then a moment for
    /// its SUBSCRIBE.
    fn wait_connected(&mut self, broker: &Broker, n: usize, timeout: Duration) -> bool {
        let ok = wait_until(timeout, || broker.connections(&self.client_id) >= n);
        std::thread::sleep(Duration::from_millis(500));
        ok
    }

    fn kill(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.kill();
        }
    }
}

impl System for NodeRed {
    fn name(&self) -> &'static str {
        "node-red"
    }
    fn prefix(&self) -> &'static str {
        "nr"
    }
    fn proc(&self) -> Option<&Proc> {
        self.proc.as_ref()
    }
}

// ------------------------------------------------------------------ measuring ----------

#[derive(Clone, Copy, Default)]
struct Latency {
    rate: u64,
    p50: f64,
    p99: f64,
    p999: f64,
    complete: bool,
}

#[derive(Default)]
struct Live {
    /// Median events/s of the flat-out runs, and each run's.
    rate: f64,
    rates: Vec<f64>,
    lat50: Latency,
    lat90: Latency,
    bytes_per_event: Option<f64>,
    peak_rss: Option<f64>,
    rss: Option<f64>,
    /// CPU time (user + system) of the system's process over the flat-out runs / events.
    cpu_us_per_event: Option<f64>,
    incomplete: bool,
}

fn percentile_ms(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i] as f64 / 1000.0
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        f64::NAN
    } else {
        v[v.len() / 2]
    }
}

/// Publish `[from, from+n)` at `rate` and wait for `n` results. Returns (events/s,
/// latencies sorted, all arrived).
#[allow(clippy::too_many_arguments)]
fn one_run(
    publisher: &Publisher,
    sink: &Sink,
    prefix: &str,
    tag: &str,
    from: u64,
    n: u64,
    rate: u64,
    t0: Instant,
) -> (f64, Vec<u64>, bool) {
    sink.reset();
    let start = t0.elapsed().as_micros() as u64;
    publisher.send(
        prefix,
        tag,
        from..from + n,
        KEYS,
        rate,
        Some(sink),
        t0,
        None,
    );
    let all = wait_until(STEP_TIMEOUT, || sink.results() >= n as usize);
    if !all {
        // Whatever stays unpaired must not be matched with the next run's results.
        for q in sink.shared.pending.lock().unwrap().iter_mut() {
            q.clear();
        }
    }
    let last = sink.shared.last_us.load(Ordering::SeqCst);
    let mut lat = std::mem::take(&mut *sink.shared.latencies_us.lock().unwrap());
    lat.sort_unstable();
    let got = sink.reset();
    let secs = (last.saturating_sub(start)).max(1) as f64 / 1e6;
    (got as f64 / secs, lat, all)
}

/// Warm-up, [`RUNS`] flat-out runs, then paced runs at 50% and 90% of the median peak.
fn measure_live(sys: &dyn System, publisher: &Publisher, sink: &Sink, t0: Instant) -> Live {
    let (prefix, name) = (sys.prefix(), sys.name());
    let mut live = Live::default();
    let w0 = sys.proc().map(|p| p.write_bytes());
    let mut next = 0u64;
    one_run(publisher, sink, prefix, "w", next, WARMUP, 0, t0);
    next += WARMUP;
    let mut events = 0;
    let w1 = sys.proc().map(|p| p.write_bytes());
    let cpu1 = sys.proc().map(|p| p.cpu_ticks());
    let threads1 = sys.proc().map(|p| p.threads());
    for r in 0..RUNS {
        let (rate, _, all) = one_run(publisher, sink, prefix, "f", next, RUN_EVENTS, 0, t0);
        next += RUN_EVENTS;
        events += RUN_EVENTS;
        live.incomplete |= !all;
        println!(
            "  {name:<8} flat out run {}: {rate:>8.0} events/s{}",
            r + 1,
            if all { "" } else { "  (INCOMPLETE)" }
        );
        live.rates.push(rate);
    }
    if let (Some(a), Some(p)) = (w1, sys.proc()) {
        live.bytes_per_event = Some((p.write_bytes() - a) as f64 / events as f64);
    }
    if let (Some(a), Some(p)) = (cpu1, sys.proc()) {
        let us = (p.cpu_ticks() - a) as f64 / ticks_per_second() * 1e6;
        live.cpu_us_per_event = Some(us / events as f64);
    }
    // Where the time went, per thread (threads that live through the runs).
    if let (Some(a), Some(p)) = (threads1, sys.proc()) {
        let per = |v: u64| v as f64 / events as f64;
        let line: Vec<String> = p
            .threads()
            .into_iter()
            .filter_map(|(name, (cpu, vol, inv))| {
                let (cpu0, vol0, inv0) = a.get(&name)?;
                let us = per(cpu.saturating_sub(*cpu0)) / ticks_per_second() * 1e6;
                // Threads idle through the runs say nothing.
                (us >= 0.05).then(|| {
                    format!(
                        "{name} {us:.1} µs, {:.2}+{:.2} switches",
                        per(vol.saturating_sub(*vol0)),
                        per(inv.saturating_sub(*inv0))
                    )
                })
            })
            .collect();
        println!("  {name:<8} per event by thread: {}", line.join(", "));
    }
    let _ = w0;
    live.rate = median(&live.rates);
    // The two paced runs of the table, then one at a rate an edge box more often sees, for
    // its CPU per event (a wake-up per message costs more there than flat out).
    let of_peak = |frac: f64| ((live.rate * frac) as u64).max(1);
    let runs = [
        (of_peak(0.5), Some(0), PACED_EVENTS),
        (of_peak(0.9), Some(1), PACED_EVENTS),
        (LOW_RATE, None, LOW_EVENTS),
    ];
    for (rate, slot, n) in runs {
        let cpu0 = sys.proc().map(|p| p.cpu_ticks());
        let (_, lat, all) = one_run(publisher, sink, prefix, "p", next, n, rate, t0);
        next += n;
        let cpu = match (cpu0, sys.proc()) {
            (Some(a), Some(p)) => {
                let us = (p.cpu_ticks() - a) as f64 / ticks_per_second() * 1e6 / n as f64;
                format!("  CPU {us:.1} µs/event")
            }
            _ => String::new(),
        };
        let l = Latency {
            rate,
            p50: percentile_ms(&lat, 0.50),
            p99: percentile_ms(&lat, 0.99),
            p999: percentile_ms(&lat, 0.999),
            complete: all,
        };
        println!(
            "  {name:<8} paced {rate:>6}/s: p50 {:.2} ms  p99 {:.2} ms  p999 {:.2} ms{cpu}{}",
            l.p50,
            l.p99,
            l.p999,
            if all { "" } else { "  (INCOMPLETE)" }
        );
        live.incomplete |= !l.complete;
        match slot {
            Some(0) => live.lat50 = l,
            Some(_) => live.lat90 = l,
            None => {}
        }
    }
    if let Some(p) = sys.proc() {
        live.peak_rss = Some(p.hwm_mib());
        live.rss = Some(p.rss_mib());
    }
    live
}

/// Flat-out runs for the CPU pairs ([`cpu_pairs`]).
const PAIRS: usize = 6;

/// CPU per event of the relay and the agent, in [`PAIRS`] pairs of flat-out runs back to
/// back (relay then agent, then agent then relay, and so on), both processes up throughout.
/// The box's speed drifts over minutes: in one session the relay's figure from the
/// sequential runs of [`measure_live`] ranged 21.8-37 µs while the agent's moved less,
/// so a ratio of two runs a minute apart passed or failed with the drift. Returns each
/// pair's (relay, agent) µs per event.
fn cpu_pairs(root: &Path, port: u16, publisher: &Publisher, t0: Instant) -> Vec<(f64, f64)> {
    let relay = Relay::start(port);
    let relay_sink = Sink::start(port, "relay", KEYS, t0);
    let mut cairn = Cairn::new(root, "cairn-pairs", port, "changelog", 5_000);
    cairn.start_connected();
    let cairn_sink = Sink::start(port, "cairn", KEYS, t0);
    let mut next = 0u64;
    // One flat-out run of one system: its CPU µs per event.
    let mut run = |sys: &dyn System, sink: &Sink, warm: bool| {
        let n = if warm { WARMUP } else { RUN_EVENTS };
        let before = sys.proc().map(|p| p.cpu_ticks());
        let (_, _, all) = one_run(publisher, sink, sys.prefix(), "c", next, n, 0, t0);
        next += n;
        let after = sys.proc().map(|p| p.cpu_ticks());
        let us = match (before, after) {
            (Some(b), Some(a)) if all => (a - b) as f64 / ticks_per_second() * 1e6 / n as f64,
            _ => f64::NAN,
        };
        if !all {
            println!("  {} pair run INCOMPLETE", sys.name());
        }
        us
    };
    run(&relay, &relay_sink, true);
    run(&cairn, &cairn_sink, true);
    let mut pairs = Vec::with_capacity(PAIRS);
    for i in 0..PAIRS {
        let (r, c) = if i % 2 == 0 {
            let r = run(&relay, &relay_sink, false);
            (r, run(&cairn, &cairn_sink, false))
        } else {
            let c = run(&cairn, &cairn_sink, false);
            (run(&relay, &relay_sink, false), c)
        };
        println!(
            "  pair {}: relay {r:.1} µs, cairn {c:.1} µs per event: {:.2}x",
            i + 1,
            c / r
        );
        pairs.push((r, c));
    }
    drop((relay_sink, cairn_sink));
    if let Some(p) = cairn.proc.as_mut() {
        p.terminate(Duration::from_secs(10));
    }
    pairs
}

/// Final per-key sums against the oracle after a SIGKILL at input [`KILL_AT`].
#[derive(Default, Clone, Copy)]
struct KillResult {
    lost: u64,
    doubled: u64,
    wrong_keys: u64,
    keys: u64,
}

fn kill_oracle() -> HashMap<usize, (u64, u64)> {
    let mut m: HashMap<usize, (u64, u64)> = HashMap::new();
    for i in 0..KILL_EVENTS {
        let (k, v) = event(SEED, i, KEYS);
        let e = m.entry(k as usize).or_default();
        e.0 += v;
        e.1 += 1;
    }
    m
}

/// Publish the paced kill stream in a thread; SIGKILL via `kill` when input [`KILL_AT`] has
/// been published; `restart` at once; then wait until the results settle.
fn kill_test(
    port: u16,
    prefix: &'static str,
    sink: &Sink,
    kill: &mut dyn FnMut(),
    restart: &mut dyn FnMut(),
    settled: &dyn Fn(&Latest) -> bool,
) -> KillResult {
    let progress = Arc::new(AtomicU64::new(0));
    let p2 = progress.clone();
    let publishing = std::thread::spawn(move || {
        let publisher = Publisher::start(port);
        let t0 = Instant::now();
        publisher.send(
            prefix,
            "kill",
            0..KILL_EVENTS,
            KEYS,
            KILL_RATE,
            None,
            t0,
            Some(&p2),
        );
    });
    wait_until(STEP_TIMEOUT, || progress.load(Ordering::SeqCst) >= KILL_AT);
    kill();
    restart();
    publishing.join().expect("kill-test publisher");
    let oracle = kill_oracle();
    // Settled: the system says so, or nothing new for 5 s (bounded by STEP_TIMEOUT).
    let deadline = Instant::now() + STEP_TIMEOUT;
    let mut last_change = (Instant::now(), sink.results());
    while Instant::now() < deadline {
        if settled(&sink.latest()) {
            break;
        }
        let n = sink.results();
        if n != last_change.1 {
            last_change = (Instant::now(), n);
        } else if last_change.0.elapsed() > Duration::from_secs(5) {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let latest = sink.latest();
    let mut r = KillResult {
        keys: oracle.len() as u64,
        ..Default::default()
    };
    for (k, (sum, count)) in &oracle {
        let (_, value, got) = latest.get(k).copied().unwrap_or((0, 0.0, 0));
        r.lost += count.saturating_sub(got);
        r.doubled += got.saturating_sub(*count);
        if value != *sum as f64 {
            r.wrong_keys += 1;
        }
    }
    r
}

// ------------------------------------------------------------------- Node-RED ----------

/// `target/node-red/node_modules/node-red/red.js`, installing it with
/// `benches/install-node-red.sh` when missing. `Err` says why it is not available.
fn node_red(target: &Path) -> Result<PathBuf, String> {
    let prefix = target.join("node-red");
    let red = prefix.join("node_modules/node-red/red.js");
    if red.is_file() {
        return Ok(red);
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/install-node-red.sh");
    println!("Node-RED not found under {}: installing", prefix.display());
    let out = Command::new("sh")
        .arg(&script)
        .arg(&prefix)
        .output()
        .map_err(|e| format!("cannot run {}: {e}", script.display()))?;
    if red.is_file() {
        Ok(red)
    } else {
        Err(format!(
            "`{}` failed ({}): {}",
            script.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .rev()
                .take(5)
                .collect::<Vec<_>>()
                .join(" | ")
        ))
    }
}

// -------------------------------------------------------------------- table ----------

fn fmt(v: Option<f64>, prec: usize) -> String {
    match v {
        Some(v) if v.is_finite() => format!("{v:.prec$}"),
        _ => "n/a".into(),
    }
}

fn ratio(a: Option<f64>, b: Option<f64>) -> String {
    match (a, b) {
        (Some(a), Some(b)) if a.is_finite() && b.is_finite() && b != 0.0 => {
            format!("{:.2}x", a / b)
        }
        _ => "".into(),
    }
}

fn row(metric: &str, relay: Option<f64>, cairn: Option<f64>, nr: Option<f64>, prec: usize) {
    println!(
        "{metric:<44} {:>11} {:>11} {:>11} {:>10} {:>10}",
        fmt(relay, prec),
        fmt(cairn, prec),
        fmt(nr, prec),
        ratio(cairn, relay),
        ratio(cairn, nr)
    );
}

/// One target line: the figure, the bound, and pass, FAIL or n/a (the part did not run).
fn target_line(what: &str, got: Option<f64>, op: &str, bound: f64) {
    let verdict = match got.filter(|v| v.is_finite()) {
        None => "n/a",
        Some(v) if (op == "<=" && v <= bound) || (op == ">=" && v >= bound) => "pass",
        Some(_) => "FAIL",
    };
    println!("  {what:<40} {:>8} {op} {bound:<6} {verdict}", fmt(got, 2));
}

fn dir_size(p: &Path) -> u64 {
    let Ok(rd) = std::fs::read_dir(p) else {
        return 0;
    };
    rd.flatten()
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => dir_size(&e.path()),
            Ok(m) => m.len(),
            Err(_) => 0,
        })
        .sum()
}

// ---------------------------------------------------------------- footprint ----------

/// What the backlog run measured; NaN where it did not run.
struct Foot {
    peak_rss: f64,
    idle_rss: f64,
    bytes_per_event: f64,
    cpu_us_per_event: f64,
    events_per_s: f64,
    idle_cpu: f64,
}

impl Default for Foot {
    fn default() -> Self {
        Foot {
            peak_rss: f64::NAN,
            idle_rss: f64::NAN,
            bytes_per_event: f64::NAN,
            cpu_us_per_event: f64::NAN,
            events_per_s: f64::NAN,
            idle_cpu: f64::NAN,
        }
    }
}

/// Input `j` of the backlog: the stream's event `j`, except that every 50th repeats the
/// event 17 inputs before it (same ID, same payload): 2% duplicates.
fn backlog_event(j: u64) -> u64 {
    if j % 50 == 49 { j - 17 } else { j }
}

/// Publish the backlog into the broker while the agent (persistent session) is away.
fn publish_backlog(port: u16) {
    let publisher = Publisher::start(port);
    let acked0 = publisher.acked.load(Ordering::SeqCst);
    for j in 0..FOOT_EVENTS {
        let i = backlog_event(j);
        let (key, value) = event(SEED, i, FOOT_KEYS);
        publisher
            .client
            .publish(
                format!("cairn/in/k{key:06}"),
                QoS::AtLeastOnce,
                false,
                payload("foot", i, key, value),
            )
            .expect("queue a publish");
    }
    let all = wait_until(STEP_TIMEOUT * 5, || {
        publisher.acked.load(Ordering::SeqCst) - acked0 >= FOOT_EVENTS
    });
    assert!(all, "the broker did not take the whole backlog");
}

/// A broker of its own (rare autosaves: a million queued messages would be written every few
/// seconds otherwise), the agent subscribed once and stopped, the backlog published, then a
/// fresh agent drains it: peak RSS, CPU and bytes written per input, then RSS at rest.
fn footprint(root: &Path, t0: Instant, outbox_max: Option<u64>) -> Foot {
    let _ = t0;
    let broker = start_broker(3600);
    let port = broker.port();
    // `checkpoint.max_records` (CAIRN_COMPARE_FOOT_RECORDS to try another): each state key a
    // checkpoint writes costs a copy of its sled leaf until the checkpoint's transaction
    // ends, so this bounds the drain's peak (issue 16).
    let records = std::env::var("CAIRN_COMPARE_FOOT_RECORDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5_000);
    let mut c = Cairn::new(root, "cairn-footprint", port, "upsert", records);
    if let Ok(interval) = std::env::var("CAIRN_COMPARE_FOOT_INTERVAL") {
        c.set_checkpoint(&interval, records);
    }
    if let Some(max) = outbox_max {
        c.set_outbox_max(max);
    }
    // `checkpoint.max_keys` (CAIRN_COMPARE_FOOT_KEYS; else the default, 1536).
    let conf = c.dir.join("cairn.toml");
    if let Ok(keys) = std::env::var("CAIRN_COMPARE_FOOT_KEYS") {
        let text = std::fs::read_to_string(&conf).expect("read cairn.toml");
        let table = "[checkpoint]\n";
        let at = text.find(table).expect("a [checkpoint] table") + table.len();
        let text = format!("{}max_keys = {keys}\n{}", &text[..at], &text[at..]);
        std::fs::write(&conf, text).expect("write cairn.toml");
    }
    // A broker busy with a million queued messages can leave a ping unanswered for 10 s;
    // a reconnect then made mosquitto 2.0.11 send much of the backlog again (1.2M
    // duplicates seen), which measures the broker, not the agent's footprint.
    let text = std::fs::read_to_string(&conf).expect("read cairn.toml");
    std::fs::write(
        &conf,
        text.replace("keep_alive = \"10s\"", "keep_alive = \"60s\""),
    )
    .expect("write cairn.toml");
    c.start_connected();
    if let Some(p) = c.proc.as_mut() {
        p.terminate(Duration::from_secs(10));
    }
    let published = Instant::now();
    publish_backlog(port);
    println!(
        "  backlog published in {:.1} s",
        published.elapsed().as_secs_f64()
    );
    let started = Instant::now();
    c.start(None);
    let done = wait_until(STEP_TIMEOUT * 10, || {
        std::thread::sleep(Duration::from_millis(250));
        c.metric("cairn_checkpoint_next_offset")
            .is_some_and(|n| n >= FOOT_EVENTS as f64)
            && c.metric("cairn_outbox_entries") == Some(0.0)
    });
    let secs = started.elapsed().as_secs_f64();
    let records = c.metric("cairn_checkpoint_next_offset").unwrap_or(f64::NAN);
    let p = c.proc().expect("running");
    let cpu_s = p.cpu_ticks() as f64 / ticks_per_second();
    let written = p.write_bytes();
    let peak = p.hwm_mib();
    let idle_cpu = p.idle_cpu_percent(IDLE);
    let idle = p.rss_mib();
    let (anon, file) = (
        p.status_kib("RssAnon:") as f64 / 1024.0,
        p.status_kib("RssFile:") as f64 / 1024.0,
    );
    if let Some(out) = std::env::var_os("CAIRN_COMPARE_SMAPS") {
        let _ = std::fs::copy(format!("/proc/{}/smaps", p.pid), out);
    }
    let keys = c.metric("cairn_state_keys");
    let dedup = c.metric("cairn_dedup_entries");
    let dups = c.metric("cairn_duplicates_total");
    let index = c
        .metric("cairn_ledger_index_bytes")
        .map(|b| b / (1 << 20) as f64);
    let store = dir_size(&c.dir.join("data/store")) as f64 / (1 << 20) as f64;
    c.kill();
    if !done {
        println!("  (footprint: the backlog was NOT drained within the wait; figures are partial)");
    }
    println!(
        "  drained in {secs:.1} s ({records} records logged); keys {} dedup entries {} \
         duplicates {}; ledger index {} MiB; \
         store {store:.0} MiB on disk; RSS after {} s idle {idle:.1} MiB = {anon:.1} anonymous \
         + {file:.1} file-backed",
        fmt(keys, 0),
        fmt(dedup, 0),
        fmt(dups, 0),
        fmt(index, 1),
        IDLE.as_secs(),
    );
    Foot {
        peak_rss: peak,
        idle_rss: idle,
        bytes_per_event: written as f64 / FOOT_EVENTS as f64,
        // Per record processed: a redelivery is work too.
        cpu_us_per_event: cpu_s * 1e6 / records,
        events_per_s: FOOT_EVENTS as f64 / secs,
        idle_cpu,
    }
}

// --------------------------------------------------------------------- main ----------

fn main() {
    if let Some(port) = std::env::var(RELAY_ENV).ok().and_then(|p| p.parse().ok()) {
        relay_main(port);
        return;
    }
    let bench_t0 = Instant::now();
    let target = Path::new(env!("CARGO_MANIFEST_DIR")).join("target");
    let root = target.join("bench-compare");
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).expect("bench dir under target/");
    let bin = cairn_bin();
    println!("cairn binary: {} (bench profile)", bin.display());
    let broker = start_broker(5);
    let port = broker.port();
    let t0 = Instant::now();
    let publisher = Publisher::start(port);
    // For profiling one part: CAIRN_COMPARE_ONLY=relay,cairn,pairs,intervals,node-red,kill,recovery,footprint
    // (any subset). Skipped parts print n/a. For the backlog: CAIRN_COMPARE_ONCE skips its
    // bounded second run, CAIRN_COMPARE_SMAPS=FILE copies the agent's /proc smaps at rest,
    // CAIRN_COMPARE_FOOT_RECORDS, _INTERVAL and _KEYS its `checkpoint.max_records` (5000),
    // `interval` (50ms) and `max_keys` (the default).
    let only = std::env::var("CAIRN_COMPARE_ONLY").ok();
    let want = |part: &str| {
        only.as_deref()
            .is_none_or(|o| o.split(',').any(|x| x.trim() == part))
    };
    let skipped = || {
        let none = Latency {
            p50: f64::NAN,
            p99: f64::NAN,
            p999: f64::NAN,
            ..Default::default()
        };
        Live {
            rate: f64::NAN,
            lat50: none,
            lat90: none,
            ..Default::default()
        }
    };

    // ---- relay ----
    let relay_live = if want("relay") {
        println!("relay: {RUNS} x {RUN_EVENTS} events flat out, then paced at 50% / 90%");
        let relay = Relay::start(port);
        let sink = Sink::start(port, "relay", KEYS, t0);
        measure_live(&relay, &publisher, &sink, t0)
    } else {
        skipped()
    };

    // ---- cairn live ----
    let mut small_idle_rss = None;
    let cairn_live = if want("cairn") {
        println!("cairn: the same");
        let mut cairn = Cairn::new(&root, "cairn-live", port, "changelog", 5_000);
        cairn.start_connected();
        let sink = Sink::start(port, "cairn", KEYS, t0);
        let live = measure_live(&cairn, &publisher, &sink, t0);
        drop(sink);
        // At rest with the live runs' 1,000 keys: RSS after IDLE without input.
        std::thread::sleep(IDLE);
        small_idle_rss = cairn.proc().map(|p| p.rss_mib());
        if let Some(p) = cairn.proc.as_mut() {
            p.terminate(Duration::from_secs(10));
        }
        live
    } else {
        skipped()
    };

    // ---- CPU per event in alternating pairs (issue 16) ----
    let pairs = if want("pairs") {
        println!(
            "cpu pairs: {PAIRS} x 2 runs of {RUN_EVENTS} events flat out, relay and cairn in turn"
        );
        cpu_pairs(&root, port, &publisher, t0)
    } else {
        Vec::new()
    };
    let pair_median = |pick: fn(&(f64, f64)) -> f64| {
        (!pairs.is_empty()).then(|| median(&pairs.iter().map(pick).collect::<Vec<_>>()))
    };
    let pair_relay = pair_median(|p| p.0);
    let pair_cairn = pair_median(|p| p.1);
    let pair_ratio = pair_median(|p| p.1 / p.0);

    // ---- the checkpoint interval's curve (issue 14) ----
    let curve = if want("intervals") {
        println!(
            "checkpoint intervals: {:?}",
            intervals::INTERVALS.map(|i| i.0)
        );
        intervals::sweep(&root, port, &publisher, t0)
    } else {
        Vec::new()
    };

    // ---- node-red live ----
    let red = if want("node-red") || want("kill") {
        node_red(&target)
    } else {
        Err("skipped (CAIRN_COMPARE_ONLY)".into())
    };
    let mut nr_live = None;
    let mut nr_idle_cpu = None;
    match &red {
        Ok(red_js) if want("node-red") => {
            println!("node-red: the same ({})", red_js.display());
            let mut nr = NodeRed::new(&root, red_js.clone(), port, "node-red-live");
            nr.start();
            if nr.wait_connected(&broker, 1, Duration::from_secs(60)) {
                let sink = Sink::start(port, "nr", KEYS, t0);
                nr_live = Some(measure_live(&nr, &publisher, &sink, t0));
                drop(sink);
                nr_idle_cpu = nr.proc.as_ref().map(|p| p.idle_cpu_percent(IDLE));
            } else {
                println!("  node-red did not connect within 60 s; see its log");
            }
            if let Some(p) = nr.proc.as_mut() {
                p.terminate(Duration::from_secs(5));
            }
        }
        Ok(_) => {}
        Err(why) => println!("node-red: NOT AVAILABLE: {why}"),
    }

    // ---- kill test: cairn ----
    println!(
        "kill test: {KILL_EVENTS} events at {KILL_RATE}/s over {KEYS} keys, SIGKILL after input {KILL_AT}, restart at once"
    );
    let cairn_kill = if !want("kill") {
        KillResult::default()
    } else {
        let mut c = Cairn::new(&root, "cairn-kill", port, "changelog", 5_000);
        c.start_connected();
        let sink = Sink::start(port, "cairn", KEYS, t0);
        let c = std::cell::RefCell::new(c);
        let oracle = kill_oracle();
        let r = kill_test(
            port,
            "cairn",
            &sink,
            &mut || c.borrow_mut().kill(),
            &mut || {
                let mut c = c.borrow_mut();
                c.start(None);
                c.wait_connected(Duration::from_secs(20));
            },
            &|latest| {
                oracle
                    .iter()
                    .all(|(k, (_, n))| latest.get(k).is_some_and(|l| l.2 >= *n))
            },
        );
        println!(
            "  cairn    lost {} doubled {} wrong keys {}/{}",
            r.lost, r.doubled, r.wrong_keys, r.keys
        );
        r
    };
    // ---- kill test: node-red ----
    let nr_kill = match &red {
        Ok(red_js) if want("kill") => {
            let nr =
                std::cell::RefCell::new(NodeRed::new(&root, red_js.clone(), port, "node-red-kill"));
            nr.borrow_mut().start();
            if nr
                .borrow_mut()
                .wait_connected(&broker, 1, Duration::from_secs(60))
            {
                let sink = Sink::start(port, "nr", KEYS, t0);
                let r = kill_test(
                    port,
                    "nr",
                    &sink,
                    &mut || nr.borrow_mut().kill(),
                    &mut || {
                        let mut n = nr.borrow_mut();
                        n.start();
                        n.wait_connected(&broker, 2, Duration::from_secs(60));
                    },
                    &|_| false,
                );
                println!(
                    "  node-red lost {} doubled {} wrong keys {}/{} (context flushInterval {NODE_RED_FLUSH_S} s)",
                    r.lost, r.doubled, r.wrong_keys, r.keys
                );
                nr.borrow_mut().kill();
                Some(r)
            } else {
                None
            }
        }
        _ => None,
    };

    // ---- recovery ----
    println!("recovery: {RECOVERY_RECORDS} logged, unprocessed records after a SIGKILL");
    let (ready_ms, replay_ms, caught_up_ms) = if !want("recovery") {
        (None, None, None)
    } else {
        let mut c = Cairn::new(&root, "cairn-recovery", port, "changelog", 5_000);
        c.start_connected();
        c.kill();
        c.prefill_log("rec", RECOVERY_RECORDS, KEYS);
        let sink = Sink::start(port, "cairn", KEYS, t0);
        let sock_path = root.join("notify.sock");
        let _ = std::fs::remove_file(&sock_path);
        let sock = UnixDatagram::bind(&sock_path).expect("bind the fake NOTIFY_SOCKET");
        sock.set_read_timeout(Some(Duration::from_millis(200)))
            .expect("timeout");
        let started = Instant::now();
        c.start(Some(&sock_path));
        let mut ready = None;
        let mut buf = [0u8; 4096];
        while started.elapsed() < STEP_TIMEOUT * 2 {
            if let Ok(n) = sock.recv(&mut buf)
                && String::from_utf8_lossy(&buf[..n])
                    .lines()
                    .any(|l| l == "READY=1")
            {
                ready = Some(started.elapsed());
                break;
            }
        }
        let caught = wait_until(STEP_TIMEOUT * 2, || {
            sink.results() >= RECOVERY_RECORDS as usize
        })
        .then(|| started.elapsed());
        c.kill();
        (
            ready.map(|d| d.as_secs_f64() * 1e3),
            c.recovery_ms().map(|v| v as f64),
            caught.map(|d| d.as_secs_f64() * 1e3),
        )
    };
    let replay_rate = ready_ms.map(|ms| RECOVERY_RECORDS as f64 / (ms / 1e3));
    println!(
        "  READY after {} ms (recovery itself {} ms), caught up after {} ms",
        fmt(ready_ms, 0),
        fmt(replay_ms, 0),
        fmt(caught_up_ms, 0)
    );

    // ---- footprint ----
    println!(
        "footprint: a backlog of {FOOT_EVENTS} inputs over {FOOT_KEYS} keys (every 50th a duplicate) \
         waiting in the broker, drained by a freshly started agent, upsert"
    );
    let foot = if want("footprint") {
        footprint(&root, t0, None)
    } else {
        Foot::default()
    };
    // The bound a user sets for a smaller box (issue 16): at the outbox's bound processing
    // waits and input is still logged and acknowledged.
    println!("footprint again, with outbox.max_entries = {FOOT_BOUND}");
    let bounded = if want("footprint") && std::env::var_os("CAIRN_COMPARE_ONCE").is_none() {
        footprint(&root, t0, Some(FOOT_BOUND))
    } else {
        Foot::default()
    };
    let stripped = {
        let copy = root.join("cairn.stripped");
        std::fs::copy(&bin, &copy).expect("copy the binary");
        let ok = Command::new("strip")
            .arg(&copy)
            .status()
            .is_ok_and(|s| s.success());
        ok.then(|| std::fs::metadata(&copy).map(|m| m.len()).unwrap_or(0) as f64 / (1 << 20) as f64)
    };

    // ---- the table ----
    let nr = nr_live.as_ref();
    println!();
    println!(
        "{:<44} {:>11} {:>11} {:>11} {:>10} {:>10}",
        "metric", "relay", "cairn", "node-red", "cairn/rel", "cairn/nr"
    );
    println!("{}", "-".repeat(102));
    row(
        "throughput, events/s (median of 3)",
        Some(relay_live.rate),
        Some(cairn_live.rate),
        nr.map(|l| l.rate),
        0,
    );
    for (label, pick) in [
        ("50%", (|l: &Live| l.lat50) as fn(&Live) -> Latency),
        ("90%", |l: &Live| l.lat90),
    ] {
        let (r, c) = (pick(&relay_live), pick(&cairn_live));
        let n = nr.map(pick);
        row(
            &format!("  paced at {label} of own peak, events/s"),
            Some(r.rate as f64),
            Some(c.rate as f64),
            n.map(|l| l.rate as f64),
            0,
        );
        row(
            &format!("  latency p50 at {label}, ms"),
            Some(r.p50),
            Some(c.p50),
            n.map(|l| l.p50),
            2,
        );
        row(
            &format!("  latency p99 at {label}, ms"),
            Some(r.p99),
            Some(c.p99),
            n.map(|l| l.p99),
            2,
        );
        row(
            &format!("  latency p999 at {label}, ms"),
            Some(r.p999),
            Some(c.p999),
            n.map(|l| l.p999),
            2,
        );
    }
    row(
        "disk bytes written per event (live)",
        None,
        cairn_live.bytes_per_event,
        nr.and_then(|l| l.bytes_per_event),
        0,
    );
    row(
        "CPU (user+system) per event, flat out, µs",
        relay_live.cpu_us_per_event,
        cairn_live.cpu_us_per_event,
        nr.and_then(|l| l.cpu_us_per_event),
        1,
    );
    row(
        "  in alternating pairs, medians, µs",
        pair_relay,
        pair_cairn,
        None,
        1,
    );
    println!(
        "{:<44} {:>11} {:>11} {:>11} {:>10}",
        "  median of the pairs' ratios",
        "",
        "",
        "",
        pair_ratio.map_or("n/a".into(), |r| format!("{r:.2}x"))
    );
    row(
        "peak RSS during live runs, MiB",
        relay_live.peak_rss,
        cairn_live.peak_rss,
        nr.and_then(|l| l.peak_rss),
        1,
    );
    row(
        &format!("RSS after the live runs + {} s idle, MiB", IDLE.as_secs()),
        None,
        small_idle_rss,
        None,
        1,
    );
    row(
        &format!("SIGKILL at input {KILL_AT}: events lost"),
        None,
        Some(cairn_kill.lost as f64),
        nr_kill.map(|r| r.lost as f64),
        0,
    );
    row(
        "SIGKILL: events double-counted",
        None,
        Some(cairn_kill.doubled as f64),
        nr_kill.map(|r| r.doubled as f64),
        0,
    );
    row(
        &format!("SIGKILL: keys with a wrong final sum (/{KEYS})"),
        None,
        Some(cairn_kill.wrong_keys as f64),
        nr_kill.map(|r| r.wrong_keys as f64),
        0,
    );
    row(
        "idle CPU over 10 s, % of a core",
        None,
        Some(foot.idle_cpu),
        nr_idle_cpu,
        2,
    );
    println!("{}", "-".repeat(102));
    println!("cairn only:");
    row(
        "recovery (100k records): READY, ms",
        None,
        ready_ms,
        None,
        0,
    );
    row(
        "  recovery as logged by the agent, ms",
        None,
        replay_ms,
        None,
        0,
    );
    row(
        "  caught up (every result out), ms",
        None,
        caught_up_ms,
        None,
        0,
    );
    row("  replay events/s (to READY)", None, replay_rate, None, 0);
    row(
        "  replay / live throughput",
        None,
        replay_rate.map(|r| r / cairn_live.rate),
        None,
        2,
    );
    row(
        "backlog of 1M over 100k keys: peak RSS, MiB",
        None,
        Some(foot.peak_rss),
        None,
        1,
    );
    row(
        &format!("  RSS after {} s idle, MiB", IDLE.as_secs()),
        None,
        Some(foot.idle_rss),
        None,
        1,
    );
    row(
        "  disk bytes written per event",
        None,
        Some(foot.bytes_per_event),
        None,
        0,
    );
    row(
        "  CPU (user+system) per event, µs",
        None,
        Some(foot.cpu_us_per_event),
        None,
        1,
    );
    row(
        "  drain events/s (start to all out)",
        None,
        Some(foot.events_per_s),
        None,
        0,
    );
    let bounded_rows: [(String, f64, usize); 5] = [
        (
            format!("  outbox.max_entries {FOOT_BOUND}: peak RSS, MiB"),
            bounded.peak_rss,
            1,
        ),
        ("    RSS after idle, MiB".into(), bounded.idle_rss, 1),
        (
            "    disk bytes written per event".into(),
            bounded.bytes_per_event,
            0,
        ),
        (
            "    CPU (user+system) per event, µs".into(),
            bounded.cpu_us_per_event,
            1,
        ),
        (
            "    drain events/s (start to all out)".into(),
            bounded.events_per_s,
            0,
        ),
    ];
    for (label, v, digits) in bounded_rows {
        row(&label, None, Some(v), None, digits);
    }
    row("stripped binary, MiB", None, stripped, None, 2);
    println!("{}", "-".repeat(102));
    let thr = cairn_live.rate / relay_live.rate;
    // The pairs' median ratio where they ran: the sequential runs' ratio moves with the box.
    let cpu = pair_ratio.or_else(|| {
        cairn_live
            .cpu_us_per_event
            .zip(relay_live.cpu_us_per_event)
            .map(|(c, r)| c / r)
    });
    let replay = replay_rate.map(|r| r / cairn_live.rate);
    println!("targets:");
    target_line("throughput, x relay", Some(thr), ">=", 0.8);
    target_line("replay / live throughput", replay, ">=", 3.0);
    target_line("CPU per event, x relay (changelog)", cpu, "<=", 1.2);
    target_line("backlog: peak RSS, MiB", Some(foot.peak_rss), "<=", 64.0);
    target_line(
        "backlog: RSS after idle, MiB",
        Some(foot.idle_rss),
        "<=",
        32.0,
    );
    target_line(
        "1,000 keys: RSS after idle, MiB",
        small_idle_rss,
        "<=",
        16.0,
    );
    target_line("stripped binary, MiB", stripped, "<=", 10.0);
    if !curve.is_empty() {
        intervals::print(&curve, &relay_live);
    }
    if let Err(why) = &red {
        println!("node-red: NOT AVAILABLE, its columns are n/a: {why}");
    }
    if relay_live.incomplete || cairn_live.incomplete || nr.is_some_and(|l| l.incomplete) {
        println!("warning: some runs did not deliver every result in time (marked above)");
    }
    println!("total bench time {:.0} s", bench_t0.elapsed().as_secs_f64());
    drop(publisher);
}
