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
//!
//! CPU per event is also taken in pairs of flat-out runs, relay and Cairn in turn with both
//! up ([`measure::cpu_pairs`]); the target uses the median of the pairs' ratios, since the
//! box's speed drifts between the relay's runs and Cairn's a minute later.
//!
//! Then the checkpoint interval's curve (issue 14, [`intervals`]): Cairn's throughput,
//! latency at 50% load, bytes written per event and recovery after a SIGKILL for intervals
//! of 50 ms, 200 ms, 1 s and 5 s, beside the relay of the same run.
//!
//! Then, Cairn only: recovery from a SIGKILL with 100,000 logged but unprocessed records
//! ([`recovery`]); footprint (issue 16, [`footprint`]): a backlog of 1M inputs over 100k
//! keys (2% duplicates) waiting in a broker, drained by a freshly started agent (peak RSS,
//! RSS after 10 s idle, disk bytes and CPU per input, drain rate; then again with
//! `outbox.max_entries` at 20,000, a user's memory bound), RSS after 10 s idle with the live
//! runs' 1,000 keys, stripped binary. The targets are printed with pass/FAIL. And both
//! Cairn and Node-RED get the same SIGKILL at the same input of the same paced stream
//! ([`kill`]); their final per-key sums are compared with the oracle.
//!
//! The broker and the agent run under the tests' wrappers (`tests/it/support`: `Broker`,
//! `agent::CairnProcess`); the agent's config starts from the tests' builder and the bench
//! sets its own keys on it as a `toml_edit` document ([`config`]).
//!
//! Figures are printed, never asserted. Every child process is killed on drop.
//!
//! Issue 33's targets at the shipped settings, each with pass/FAIL, come from [`targets`]
//! (`CAIRN_COMPARE_ONLY=relay,targets`; its own knobs are in its module's text).
//!
//! For profiling one part: `CAIRN_COMPARE_ONLY=relay,cairn,pairs,intervals,node-red,kill,
//! recovery,footprint,targets` (any subset); skipped parts print n/a. For the backlog:
//! `CAIRN_COMPARE_ONCE` skips its bounded second run, `CAIRN_COMPARE_SMAPS=FILE` copies the
//! agent's /proc smaps at rest, `CAIRN_COMPARE_FOOT_RECORDS`, `_INTERVAL` and `_KEYS` its
//! `checkpoint.max_records` (5000), `interval` (50ms) and `max_keys` (the default).

#[path = "../../tests/it/support/mod.rs"]
mod support;

mod agent;
mod config;
mod footprint;
/// The checkpoint-interval curve (issue 14): `CAIRN_COMPARE_ONLY=relay,intervals`.
mod intervals;
mod kill;
mod measure;
mod mqtt;
mod node_red;
mod procs;
mod recovery;
mod relay;
mod report;
mod stream;
/// Issue 33's targets at the shipped settings: `CAIRN_COMPARE_ONLY=relay,targets`.
mod targets;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use agent::Cairn;
use footprint::{Foot, footprint};
use measure::{Latency, Live, System, measure_live};
use mqtt::{Publisher, Sink, start_broker};
use node_red::NodeRed;
use relay::Relay;
use report::{Figures, fmt};

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

/// Which parts run (`CAIRN_COMPARE_ONLY`, a comma-separated subset; all when unset).
struct Parts(Option<String>);

impl Parts {
    fn from_env() -> Parts {
        Parts(std::env::var("CAIRN_COMPARE_ONLY").ok())
    }

    fn want(&self, part: &str) -> bool {
        self.0
            .as_deref()
            .is_none_or(|o| o.split(',').any(|x| x.trim() == part))
    }
}

/// A live run that did not run: n/a in the table.
fn skipped() -> Live {
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
}

fn main() {
    if let Some(port) = std::env::var(relay::RELAY_ENV)
        .ok()
        .and_then(|p| p.parse().ok())
    {
        relay::relay_main(port);
        return;
    }
    let bench_t0 = Instant::now();
    let target = Path::new(env!("CARGO_MANIFEST_DIR")).join("target");
    let root = target.join("bench-compare");
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).expect("bench dir under target/");
    let bin = agent::cairn_bin();
    println!("cairn binary: {} (bench profile)", bin.display());
    let broker = start_broker(5);
    let port = broker.port();
    let t0 = Instant::now();
    let publisher = Publisher::start(port);
    let parts = Parts::from_env();

    let relay = if parts.want("relay") {
        println!("relay: {RUNS} x {RUN_EVENTS} events flat out, then paced at 50% / 90%");
        let relay = Relay::start(port);
        let sink = Sink::start(port, "relay", KEYS, t0);
        measure_live(&relay, &publisher, &sink, t0)
    } else {
        skipped()
    };

    let targets = parts.want("targets").then(|| {
        println!("issue 33 targets (benches/compare/targets.rs), shipped settings");
        targets::run(port, &publisher, t0)
    });

    let (cairn, cairn_idle_rss) = if parts.want("cairn") {
        println!("cairn: the same");
        cairn_live(port, &publisher, t0)
    } else {
        (skipped(), None)
    };

    let pairs = if parts.want("pairs") {
        println!(
            "cpu pairs: {} x 2 runs of {RUN_EVENTS} events flat out, relay and cairn in turn",
            measure::PAIRS
        );
        measure::cpu_pairs(port, &publisher, t0)
    } else {
        Vec::new()
    };

    let curve = if parts.want("intervals") {
        println!(
            "checkpoint intervals: {:?}",
            intervals::INTERVALS.map(|i| i.0)
        );
        intervals::sweep(port, &publisher, t0)
    } else {
        Vec::new()
    };

    let red = if parts.want("node-red") || parts.want("kill") {
        node_red::node_red(&target)
    } else {
        Err("skipped (CAIRN_COMPARE_ONLY)".into())
    };
    let (node_red, node_red_idle_cpu) = match &red {
        Ok(red_js) if parts.want("node-red") => {
            println!("node-red: the same ({})", red_js.display());
            node_red_live(&root, red_js, &broker, &publisher, t0)
        }
        Ok(_) => (None, None),
        Err(why) => {
            println!("node-red: NOT AVAILABLE: {why}");
            (None, None)
        }
    };

    println!(
        "kill test: {KILL_EVENTS} events at {KILL_RATE}/s over {KEYS} keys, SIGKILL after input {KILL_AT}, restart at once"
    );
    let cairn_kill = if parts.want("kill") {
        kill::cairn(port, t0)
    } else {
        kill::KillResult::default()
    };
    let node_red_kill = match &red {
        Ok(red_js) if parts.want("kill") => kill::node_red(&root, red_js, &broker, t0),
        _ => None,
    };

    println!("recovery: {RECOVERY_RECORDS} logged, unprocessed records after a SIGKILL");
    let recovery = if parts.want("recovery") {
        recovery::run(port, t0)
    } else {
        recovery::Recovery::default()
    };
    println!(
        "  READY after {} ms (recovery itself {} ms), caught up after {} ms",
        fmt(recovery.ready_ms, 0),
        fmt(recovery.replay_ms, 0),
        fmt(recovery.caught_up_ms, 0)
    );

    println!(
        "footprint: a backlog of {FOOT_EVENTS} inputs over {FOOT_KEYS} keys (every 50th a duplicate) \
         waiting in the broker, drained by a freshly started agent, upsert"
    );
    let foot = if parts.want("footprint") {
        footprint(None)
    } else {
        Foot::default()
    };
    // The bound a user sets for a smaller box (issue 16): at the outbox's bound processing
    // waits and input is still logged and acknowledged.
    println!("footprint again, with outbox.max_entries = {FOOT_BOUND}");
    let bounded = if parts.want("footprint") && std::env::var_os("CAIRN_COMPARE_ONCE").is_none() {
        footprint(Some(FOOT_BOUND))
    } else {
        Foot::default()
    };

    let figures = Figures {
        stripped: stripped_mib(&bin, &root),
        relay,
        cairn,
        node_red_missing: red.err(),
        node_red,
        node_red_idle_cpu,
        pairs,
        curve,
        cairn_idle_rss,
        cairn_kill,
        node_red_kill,
        recovery,
        foot,
        bounded,
    };
    report::print(&figures);
    if let Some(t) = &targets {
        targets::print(t);
    }
    if figures.relay.incomplete
        || figures.cairn.incomplete
        || figures.node_red.as_ref().is_some_and(|l| l.incomplete)
    {
        println!("warning: some runs did not deliver every result in time (marked above)");
    }
    println!("total bench time {:.0} s", bench_t0.elapsed().as_secs_f64());
    drop(publisher);
}

/// Cairn's live runs, then its RSS after [`IDLE`] without input (the live runs' 1,000 keys).
fn cairn_live(port: u16, publisher: &Publisher, t0: Instant) -> (Live, Option<f64>) {
    let mut cairn = Cairn::new(port, "changelog", 5_000);
    cairn.start_connected();
    let sink = Sink::start(port, "cairn", KEYS, t0);
    let live = measure_live(&cairn, publisher, &sink, t0);
    drop(sink);
    std::thread::sleep(IDLE);
    let idle_rss = cairn.stats().map(|p| p.rss_mib());
    cairn.terminate();
    (live, idle_rss)
}

/// Node-RED's live runs and its CPU over [`IDLE`] without input; `None` if its flow did not
/// connect.
fn node_red_live(
    root: &Path,
    red_js: &Path,
    broker: &support::Broker,
    publisher: &Publisher,
    t0: Instant,
) -> (Option<Live>, Option<f64>) {
    let mut nr = NodeRed::new(root, red_js.to_path_buf(), broker.port(), "node-red-live");
    nr.start();
    let out = if nr.wait_connected(broker, 1, Duration::from_secs(60)) {
        let sink = Sink::start(broker.port(), "nr", KEYS, t0);
        let live = measure_live(&nr, publisher, &sink, t0);
        drop(sink);
        (Some(live), nr.stats().map(|p| p.idle_cpu_percent(IDLE)))
    } else {
        println!("  node-red did not connect within 60 s; see its log");
        (None, None)
    };
    if let Some(p) = nr.proc.as_mut() {
        p.terminate(Duration::from_secs(5));
    }
    out
}

/// The stripped size of the agent's binary, MiB; `None` without `strip`.
fn stripped_mib(bin: &PathBuf, root: &Path) -> Option<f64> {
    let copy = root.join("cairn.stripped");
    std::fs::copy(bin, &copy).expect("copy the binary");
    let ok = Command::new("strip")
        .arg(&copy)
        .status()
        .is_ok_and(|s| s.success());
    ok.then(|| std::fs::metadata(&copy).map(|m| m.len()).unwrap_or(0) as f64 / (1 << 20) as f64)
}
