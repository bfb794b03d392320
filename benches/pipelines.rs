//! How the cost of processing grows with the number of pipelines (issue 33, item 4), and
//! what issue 15's machine-telemetry job costs against a single sum. Run:
//! `cargo bench --bench pipelines`. Figures are printed, never asserted.
//!
//! **Scale** (`CAIRN_PIPELINES_ONLY=scale`): for 1, 4, 16 and 64 pipelines
//! (`CAIRN_PIPELINES_COUNTS=1,4,16` to choose), a private mosquitto (the shipped
//! `config/mosquitto.conf` settings that matter: inflight 20, deep queues, Nagle off, rare
//! autosaves) and the real `cairn` binary this bench was built with, at the shipped settings
//! (every key the example config leaves at its default is left out here too): one stream
//! on `in/<key>`, every pipeline on it, each with its own aggregate (upsert, retained
//! results on `out/<pipeline>/<key>`). The agent subscribes once and stops; a backlog of
//! [`INPUTS`] inputs over [`KEYS`] keys is published into the broker; a fresh agent drains
//! it. Drained: every pipeline applied every input, nothing is behind and the outbox is
//! empty. Printed per count: CPU (utime + stime) per input, peak RSS (VmHWM), drain time,
//! results published per input, checkpoints, and the load average before and after (the
//! box is shared). A drain still running after `CAIRN_PIPELINES_TIMEOUT` seconds (default
//! 300) is reported with what it applied by then, marked `partial`.
//! `CAIRN_PIPELINES_AGGREGATES=light` gives every pipeline a state of a few numbers (sum,
//! min, max, avg, last, stddev in turn) instead of the default mix, in which 6 of 16 keep a
//! percentile sketch of up to 512 buckets: a key's stored row, one value for all its
//! pipelines, is then far smaller (this mode and `processor` both take it).
//!
//! **Engine** (`CAIRN_PIPELINES_ONLY=engine`): the pure engine over the in-memory store,
//! checkpointing every 1000 events, so the figure is the pipeline's own cost (parse,
//! filter, windows, aggregates, outputs) without sled or fsync.

#[path = "../tests/it/support/mod.rs"]
mod support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use cairn::model::Record;
use cairn::pipeline::engine::Engine;
use cairn::pipeline::memory::MemState;
use rumqttc::{Client, Event, MqttOptions, Packet, QoS};
use support::agent::{AgentConfig, CairnProcess};
use support::{Broker, BrokerConfig, free_port, unique_id, wait_until};

/// Inputs in the backlog, and the keys they spread over.
const INPUTS: u64 = 200_000;
const KEYS: u64 = 1_000;

/// The keys the inputs spread over: [`KEYS`], or `CAIRN_PIPELINES_KEYS` (to see how the
/// cost per pipeline depends on how often a checkpoint meets a key again).
fn keys() -> u64 {
    static KEYS_SET: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *KEYS_SET.get_or_init(|| {
        std::env::var("CAIRN_PIPELINES_KEYS")
            .ok()
            .map(|v| v.parse().expect("CAIRN_PIPELINES_KEYS: a number of keys"))
            .filter(|&k| k > 0)
            .unwrap_or(KEYS)
    })
}

/// One aggregate per pipeline, in order; more pipelines than rows take them again.
const AGGREGATES: [&str; 16] = [
    r#""sum""#,
    r#""p75""#,
    r#""min""#,
    r#""max""#,
    r#""avg""#,
    r#""last""#,
    r#""stddev""#,
    r#""variance""#,
    r#""p50""#,
    r#""p90""#,
    r#""p95""#,
    r#""p99""#,
    r#"["min", "max"]"#,
    r#"["avg", "count"]"#,
    r#"["sum", "last"]"#,
    r#"["p50", "p99"]"#,
];

/// Cheap aggregates (a few numbers of state each), for `CAIRN_PIPELINES_AGGREGATES=light`.
const LIGHT: [&str; 6] = [
    r#""sum""#,
    r#""min""#,
    r#""max""#,
    r#""avg""#,
    r#""last""#,
    r#""stddev""#,
];

/// Pipeline `i`'s aggregate: from [`AGGREGATES`], or [`LIGHT`] if
/// `CAIRN_PIPELINES_AGGREGATES=light`.
fn aggregate(i: usize) -> &'static str {
    match std::env::var("CAIRN_PIPELINES_AGGREGATES").as_deref() {
        Ok("light") => LIGHT[i % LIGHT.len()],
        Ok("mixed") | Err(_) => AGGREGATES[i % AGGREGATES.len()],
        Ok(other) => panic!("CAIRN_PIPELINES_AGGREGATES={other}: expected light or mixed"),
    }
}

// ------------------------------------------------------------------ scale ----------

fn pipelines(n: usize) -> String {
    (0..n)
        .map(|i| {
            format!(
                "[[pipeline]]\nname = \"p{i:02}\"\ntopics = [\"in/#\"]\nformat = \"json\"\n\
                 event_id = \"/id\"\nkey = \"/k\"\nvalue = \"/v\"\naggregate = {}\n\
                 output_topic = \"out/p{i:02}/{{key}}\"\nretain = true\nemit = \"upsert\"\n\n",
                aggregate(i)
            )
        })
        .collect()
}

/// Input `i`: its key and value, spread by xorshift so keys interleave as live traffic does.
fn input(i: u64) -> (u64, u64) {
    let mut s = 0x9E37_79B9_7F4A_7C15 ^ i.wrapping_mul(0x2545_F491_4F6C_DD1D);
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    (s % keys(), (s >> 20) % 1_000)
}

fn start_broker() -> Broker {
    Broker::start_with(BrokerConfig {
        max_inflight: 20,
        autosave_interval_s: 3600,
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

/// Publish the backlog (QoS 1, 100 in flight) and wait for every PUBACK.
fn publish_backlog(port: u16) {
    let mut o = MqttOptions::new(unique_id("bench-pub"), "127.0.0.1", port);
    o.set_keep_alive(Duration::from_secs(30)).set_inflight(100);
    let (client, mut conn) = Client::new(o, 1_000);
    let acked = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let (a, s) = (acked.clone(), stop.clone());
    let reader = std::thread::spawn(move || {
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
    for i in 0..INPUTS {
        let (key, value) = input(i);
        client
            .publish(
                format!("in/k{key:04}"),
                QoS::AtLeastOnce,
                false,
                format!(r#"{{"id":"e{i}","k":"k{key:04}","v":{value}}}"#),
            )
            .expect("queue a publish");
    }
    let all = wait_until(Duration::from_secs(300), || {
        acked.load(Ordering::SeqCst) >= INPUTS
    });
    assert!(all, "the broker did not take the whole backlog");
    let _ = client.disconnect();
    stop.store(true, Ordering::SeqCst);
    let _ = reader.join();
}

/// The sum of every sample of `name` in `/metrics` (all pipelines' together).
fn metric(port: u16, name: &str) -> Option<f64> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .ok()?;
    let mut body = String::new();
    s.read_to_string(&mut body).ok()?;
    body.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|r| r.starts_with(' ') || r.starts_with('{'))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .reduce(|a, b| a + b)
}

fn status_kib(pid: u32, field: &str) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    s.lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// utime + stime of `pid`, seconds.
fn cpu_s(pid: u32) -> f64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let rest = s.rsplit(')').next().unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let at = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    (at(11) + at(12)) as f64 / if hz > 0 { hz as f64 } else { 100.0 }
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .next()
        .unwrap_or("?")
        .to_string()
}

struct Scale {
    pipelines: usize,
    cpu_us_per_input: f64,
    peak_mib: f64,
    drain_s: f64,
    results_per_input: f64,
    checkpoints: f64,
    store_mib: f64,
    partial: bool,
    load: (String, String),
}

fn dir_bytes(dir: &std::path::Path) -> u64 {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return 0;
    };
    rd.flatten()
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => dir_bytes(&e.path()),
            Ok(m) => m.len(),
            Err(_) => 0,
        })
        .sum()
}

fn scale(n: usize, timeout: Duration) -> Scale {
    let broker = start_broker();
    let mut cfg = AgentConfig::new(broker.port(), &pipelines(n));
    let metrics_port = free_port();
    // The shipped settings: only what has no default, plus a metrics listener and a
    // keep-alive long enough that a broker busy with the backlog is not taken for dead.
    cfg.mqtt = "keep_alive = \"60s\"\n".into();
    cfg.storage = String::new();
    cfg.log = String::new();
    // `CAIRN_PIPELINES_CHECKPOINT="max_keys = 4096"`: other checkpoint settings, to compare.
    cfg.checkpoint = std::env::var("CAIRN_PIPELINES_CHECKPOINT")
        .unwrap_or_default()
        .replace("\\n", "\n");
    cfg.outbox = String::new();
    cfg.extra = format!("[metrics]\nlisten = \"127.0.0.1:{metrics_port}\"\n");
    let mut agent = CairnProcess::new(&cfg);
    agent.set_log_filter(Some("info"));
    agent.set_up_session();
    publish_backlog(broker.port());
    let load0 = loadavg();
    let started = Instant::now();
    agent.start();
    let want = INPUTS as f64 * n as f64;
    // `CAIRN_PIPELINES_KILL_AT=0.25`: kill the agent (SIGKILL) once that share is applied
    // and start it again: the log then holds the rest, which the replay at start takes.
    if let Ok(at) = std::env::var("CAIRN_PIPELINES_KILL_AT") {
        let at: f64 = at.parse().expect("CAIRN_PIPELINES_KILL_AT: a fraction");
        wait_until(timeout, || {
            std::thread::sleep(Duration::from_millis(20));
            metric(metrics_port, "cairn_applied_total").is_some_and(|a| a >= at * want)
        });
        agent.kill();
        agent.start();
        wait_until(timeout, || {
            std::thread::sleep(Duration::from_millis(20));
            agent.run_stderr().contains("recovery: done in")
        });
        let err = agent.run_stderr();
        let line = err.lines().rev().find(|l| l.contains("recovery: done in"));
        eprintln!(
            "  {n} pipelines, killed at {:.0}% applied; start: {}; peak RSS of the start {:.1} MiB",
            at * 100.0,
            line.map_or("no recovery line", |l| l.split("] ").nth(1).unwrap_or(l)),
            status_kib(agent.pid(), "VmHWM:") as f64 / 1024.0
        );
    }
    let pid = agent.pid();
    // For a profiler to attach to (`perf record -p`).
    eprintln!("  draining: agent pid {pid}");
    let drained = wait_until(timeout, || {
        std::thread::sleep(Duration::from_millis(100));
        metric(metrics_port, "cairn_applied_total").is_some_and(|a| a >= want)
            && metric(metrics_port, "cairn_processing_behind_records") == Some(0.0)
            && metric(metrics_port, "cairn_outbox_entries") == Some(0.0)
    });
    let drain_s = started.elapsed().as_secs_f64();
    let cpu = cpu_s(pid);
    let peak_mib = status_kib(pid, "VmHWM:") as f64 / 1024.0;
    let applied = metric(metrics_port, "cairn_applied_total").unwrap_or(f64::NAN);
    let published = metric(metrics_port, "cairn_published_total").unwrap_or(f64::NAN);
    let checkpoints = metric(metrics_port, "cairn_checkpoints_total").unwrap_or(f64::NAN);
    let store_mib = dir_bytes(&agent.data_dir().join("store")) as f64 / (1 << 20) as f64;
    let load1 = loadavg();
    agent.kill();
    if std::env::var_os("CAIRN_PIPELINES_STDERR").is_some() {
        println!("{}", agent.stderr());
    }
    // Inputs taken: every pipeline applies each one (no duplicates in the backlog).
    let inputs = applied / n as f64;
    Scale {
        pipelines: n,
        cpu_us_per_input: cpu * 1e6 / inputs,
        peak_mib,
        drain_s,
        results_per_input: published / inputs,
        checkpoints,
        store_mib,
        partial: !drained,
        load: (load0, load1),
    }
}

fn scale_main() {
    let counts: Vec<usize> = std::env::var("CAIRN_PIPELINES_COUNTS")
        .unwrap_or_else(|_| "1,4,16,64".into())
        .split(',')
        .filter_map(|c| c.trim().parse().ok())
        .collect();
    let timeout = Duration::from_secs(
        std::env::var("CAIRN_PIPELINES_TIMEOUT")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(300),
    );
    println!(
        "scale: a backlog of {INPUTS} inputs over {} keys drained at the shipped settings \
         (upsert, one stream, each pipeline its own aggregate); cairn: {}",
        keys(),
        support::agent::cairn_bin().display()
    );
    let mut rows = Vec::new();
    for n in counts {
        let s = scale(n, timeout);
        println!(
            "  {n:>2} pipelines: {:.1} µs CPU/input, peak {:.1} MiB, drained in {:.1} s{}",
            s.cpu_us_per_input,
            s.peak_mib,
            s.drain_s,
            if s.partial { " (partial)" } else { "" }
        );
        rows.push(s);
    }
    let one = rows
        .iter()
        .find(|r| r.pipelines == 1)
        .map(|r| r.cpu_us_per_input);
    println!();
    println!(
        "| pipelines | CPU/input, µs | × one pipeline | ÷ pipelines | peak RSS, MiB | drain, s | \
         results/input | checkpoints | store, MiB | load before / after |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|");
    for r in &rows {
        let ratio = one.map(|o| r.cpu_us_per_input / o);
        println!(
            "| {} | {:.1} | {} | {} | {:.1} | {:.1}{} | {:.2} | {:.0} | {:.1} | {} / {} |",
            r.pipelines,
            r.cpu_us_per_input,
            ratio.map_or("n/a".into(), |x| format!("{x:.1}×")),
            ratio.map_or("n/a".into(), |x| format!("{:.2}", x / r.pipelines as f64)),
            r.peak_mib,
            r.drain_s,
            if r.partial { " (partial)" } else { "" },
            r.results_per_input,
            r.checkpoints,
            r.store_mib,
            r.load.0,
            r.load.1,
        );
    }
}

// ----------------------------------------------------------------- engine ----------

const EVENTS: u64 = 200_000;
const MACHINES: u64 = 100;

fn job(body: &str) -> cairn::pipeline::spec::PipelineSpec {
    cairn::config::pipeline_from_toml(&format!(
        r#"name = "machines"
topics = ["plant/+/telemetry"]
event_id = "{{topic[1]}}-{{/seq}}"
key = "{{topic[1]}}"
value = "/temp"
event_time = "/ts"
dedup_window = "1h"
max_future = "366d"
{body}"#
    ))
    .unwrap()
}

fn run(name: &str, spec: cairn::pipeline::spec::PipelineSpec) {
    let records: Vec<Record> = (0..EVENTS)
        .map(|i| {
            let m = i % MACHINES;
            let status = if i % 10 == 0 { "idle" } else { "running" };
            // One event per machine every 100 ms of event time; temperatures wander.
            let ts = 1_796_040_000_000 + i;
            let temp = 40.0 + ((i * 7919) % 400) as f64 / 10.0;
            let payload = format!(r#"{{"seq":{i},"ts":{ts},"status":"{status}","temp":{temp}}}"#);
            Record {
                offset: i,
                received_at_ms: ts,
                topic: format!("plant/m{m}/telemetry"),
                payload: payload.into_bytes(),
                qos: 1,
                retain: false,
            }
        })
        .collect();
    let mut engine = Engine::new(vec![spec], Default::default());
    let mut mem = MemState::default();
    let start = Instant::now();
    for r in &records {
        engine.apply(&mem, r).unwrap();
        if engine.pending_records() >= 1000 {
            let cp = engine.take_checkpoint();
            mem.commit(&cp);
            mem.outbox.clear();
        }
    }
    let cp = engine.take_checkpoint();
    mem.commit(&cp);
    let secs = start.elapsed().as_secs_f64();
    let c = &mem.progress.pipelines[0].counters;
    println!(
        "{name:<10} {:>9.0} events/s  (applied {}, filtered {}, outputs {})",
        EVENTS as f64 / secs,
        c.applied,
        c.filtered,
        c.outputs
    );
}

fn engine_main() {
    println!("engine: issue 15's job against a single sum, pure engine, in-memory store");
    run(
        "sum",
        job(r#"aggregate = "sum"
output_topic = "m/{key}""#),
    );
    run(
        "telemetry",
        job(r#"where = '/status == "running" and /temp > -40'
aggregate = ["min", "max", "avg", "count", "stddev", "p95"]
window = { size = "1m", slide = "10s", allowed_lateness = "30s" }
output_topic = "machines/{key}/{window_start}"
emit = "final""#),
    );
}

fn main() {
    let only = std::env::var("CAIRN_PIPELINES_ONLY").unwrap_or_default();
    if only.is_empty() || only == "scale" {
        scale_main();
    }
    if only == "processor" {
        processor_main();
    }
    if only.is_empty() || only == "engine" {
        println!();
        engine_main();
    }
}

// -------------------------------------------------------------- processor ----------

/// The processor over a real store, no broker: `CAIRN_PIPELINES_ONLY=processor`. Records
/// are applied as the live loop applies them (upserts flushed every 20, the ingest batch;
/// `CAIRN_PIPELINES_FLUSH=N` flushes every N instead, as an agent whose results wait for a
/// busy sink does), with a checkpoint whenever the shipped `max_records`/`max_keys` say one
/// is due. Prints time in apply and in checkpoints separately, per input.
fn processor_main() {
    use cairn::fsio;
    use cairn::processor::Processor;
    use cairn::store::Store;
    let counts: Vec<usize> = std::env::var("CAIRN_PIPELINES_COUNTS")
        .unwrap_or_else(|_| "1,4,16".into())
        .split(',')
        .filter_map(|c| c.trim().parse().ok())
        .collect();
    // The same `CAIRN_PIPELINES_CHECKPOINT` as the scale run reads: `max_keys` and
    // `max_records`, the shipped 3,072 and 20,000 otherwise.
    let checkpoint: toml_edit::DocumentMut = std::env::var("CAIRN_PIPELINES_CHECKPOINT")
        .unwrap_or_default()
        .replace("\\n", "\n")
        .parse()
        .expect("CAIRN_PIPELINES_CHECKPOINT: TOML");
    let bound = |key: &str, shipped: u64| {
        checkpoint
            .get(key)
            .and_then(|v| v.as_integer())
            .map_or(shipped, |v| v as u64)
    };
    let (max_keys, max_records) = (bound("max_keys", 3_072), bound("max_records", 20_000));
    let flush_every: u64 = std::env::var("CAIRN_PIPELINES_FLUSH")
        .ok()
        .and_then(|f| f.parse().ok())
        .filter(|&f| f > 0)
        .unwrap_or(20);
    println!(
        "processor: {INPUTS} inputs over {} keys, real store, no broker, upserts flushed \
         every {flush_every} records",
        keys()
    );
    for n in counts {
        let dir = tempfile::tempdir().unwrap();
        let specs: Vec<_> = (0..n)
            .map(|i| {
                cairn::config::pipeline_from_toml(&format!(
                    "name = \"p{i:02}\"\ntopics = [\"in/#\"]\nformat = \"json\"\n\
                     event_id = \"/id\"\nkey = \"/k\"\nvalue = \"/v\"\naggregate = {}\n\
                     output_topic = \"out/p{i:02}/{{key}}\"\nretain = true\nemit = \"upsert\"\n",
                    aggregate(i)
                ))
                .unwrap()
            })
            .collect();
        let store = Store::open(&dir.path().join("store"), 16 << 20, fsio::real()).unwrap();
        let mut proc = Processor::open_with(store, specs, &[], None).unwrap();
        let (mut apply_s, mut cp_s, mut cps, mut keys_written) = (0.0, 0.0, 0u64, 0u64);
        let t0 = Instant::now();
        for i in 0..INPUTS {
            let (key, value) = input(i);
            let rec = Record {
                offset: i,
                received_at_ms: 1_796_040_000_000 + i,
                topic: format!("in/k{key:04}"),
                payload: format!(r#"{{"id":"e{i}","k":"k{key:04}","v":{value}}}"#).into_bytes(),
                qos: 1,
                retain: false,
            };
            let a = Instant::now();
            proc.apply(&rec).unwrap();
            if i % flush_every == flush_every - 1 {
                proc.flush_upserts();
            }
            apply_s += a.elapsed().as_secs_f64();
            if proc.pending_records() >= max_records || proc.pending_keys() >= max_keys {
                keys_written += proc.pending_keys();
                let c = Instant::now();
                proc.checkpoint(0).unwrap();
                cp_s += c.elapsed().as_secs_f64();
                cps += 1;
            }
        }
        let total = t0.elapsed().as_secs_f64();
        let per = |s: f64| s * 1e6 / INPUTS as f64;
        println!(
            "  {n:>2} pipelines: {:.1} µs/input ({:.1} apply, {:.1} checkpoint); {cps} checkpoints, \
             {:.2} state writes/input",
            per(total),
            per(apply_s),
            per(cp_s),
            keys_written as f64 / INPUTS as f64,
        );
    }
}
