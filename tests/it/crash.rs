//! The crash harness (issue 5): the real `cairn` binary is killed at random moments, at each
//! failpoint, and under a power-cut filesystem that forgets everything not fsynced, again
//! and again, while a seeded stream with business duplicates, late events and bad payloads
//! is published with QoS 1. At the end an oracle computed from the inputs the broker
//! acknowledged is compared with the per-key values and versions (`cairn inspect state`),
//! the retained outputs, the distinct output IDs, and the agent's counters.
//!
//! A restart that "worked" proves nothing: every scenario ends in that comparison, and
//! `the_harness_detects_loss_in_an_unsafe_build_that_acks_before_fsync` shows the
//! comparison fails when the product is broken on purpose.
//!
//! Bounded by default (CI): `CAIRN_CRASH_KILLS` (20) kills and `CAIRN_CRASH_CUTS` (20) power
//! cuts. `CAIRN_SOAK=1` runs the long soak (1,000 cuts) and prints its figures.
//!
//! Needs the `failpoints` feature (`cargo test --workspace --all-features`), `mosquitto`,
//! and `/dev/fuse` for the power-cut runs (as root).
//!
//! Why ~940 lines: the harness (stream, oracle, checks, kill and power-cut cycles) and its
//! scenarios together; the richer pipeline's stream and oracle are in `crash/rich.rs`.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::Path;
use std::time::Duration;

use crate::support::agent::{AgentConfig, CairnProcess};
use crate::support::powercut::PowerCut;
use crate::support::{Broker, Collector, publish_all, unique_id, wait_until};

/// The pipeline of the richer kind (issue 15) that every scenario also runs.
mod rich;

const WINDOW_MS: u64 = 1_000;
const LATENESS_MS: u64 = 1_000;
const KEYS: u64 = 8;
const BASE_TS: u64 = 1_700_000_000_000;

// ---------------------------------------------------------------------------------------
// The seeded stream and its oracle.

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[derive(Debug, Clone)]
struct Event {
    id: String,
    key: String,
    value: i64,
    ts: u64,
}

/// Padding that makes the log roll over to a new 1 MiB segment every few hundred events,
/// so segment roll-over and (with retention 0s) deletion happen under every kind of crash.
const PAD: usize = 2_000;

impl Event {
    fn payload(&self) -> Vec<u8> {
        let pad = "p".repeat(PAD);
        format!(
            r#"{{"id":"{}","k":"{}","v":{},"ts":{},"pad":"{pad}"}}"#,
            self.id, self.key, self.value, self.ts
        )
        .into_bytes()
    }
}

#[derive(Debug, Clone)]
enum Input {
    Event(Event),
    Bad(String),
}

impl Input {
    fn payload(&self) -> Vec<u8> {
        match self {
            Input::Event(e) => e.payload(),
            Input::Bad(s) => s.clone().into_bytes(),
        }
    }
}

/// A stream: mostly good events over a few keys with rising, jittered event times; business
/// duplicates (an earlier event published again); events too late for their window; and
/// distinct bad payloads.
struct Stream {
    rng: Rng,
    seq: u64,
    ts: u64,
    published: Vec<Event>,
}

impl Stream {
    fn new(seed: u64) -> Stream {
        Stream {
            rng: Rng(seed | 1),
            seq: 0,
            ts: BASE_TS,
            published: Vec::new(),
        }
    }

    fn next(&mut self) -> Input {
        self.seq += 1;
        self.ts += 7 + self.rng.below(20);
        let r = self.rng.below(100);
        if r < 8 && !self.published.is_empty() {
            let i = self.rng.below(self.published.len() as u64) as usize;
            return Input::Event(self.published[i].clone());
        }
        if r < 13 {
            return Input::Bad(format!("bad payload #{}", self.seq));
        }
        let late = r < 18;
        let e = Event {
            id: format!("E{}", self.seq),
            key: format!("K{}", self.rng.below(KEYS)),
            value: self.rng.below(1_000) as i64 - 200,
            ts: if late {
                self.ts.saturating_sub(3 * (WINDOW_MS + LATENESS_MS))
            } else {
                self.ts
            },
        };
        self.published.push(e.clone());
        Input::Event(e)
    }

    fn take(&mut self, n: usize) -> Vec<Input> {
        (0..n).map(|_| self.next()).collect()
    }
}

/// The fold over everything the broker acknowledged, in order.
#[derive(Debug, Default)]
struct Oracle {
    sums: BTreeMap<String, (i64, u64)>,
    windows: BTreeMap<(String, u64), u64>,
    applied: [u64; 2],
    dead: [u64; 2],
    /// Duplicates caused by the stream itself; redeliveries after crashes add to the
    /// agent's count, never to this.
    business_duplicates: [u64; 2],
}

fn oracle(inputs: &[Input]) -> Oracle {
    let mut o = Oracle::default();
    let mut seen: [HashSet<String>; 2] = Default::default();
    let mut max_ts = 0u64;
    for inp in inputs {
        match inp {
            Input::Bad(_) => o.dead = [o.dead[0] + 1, o.dead[1] + 1],
            Input::Event(e) => {
                if !seen[0].insert(e.id.clone()) {
                    o.business_duplicates[0] += 1;
                } else {
                    let s = o.sums.entry(e.key.clone()).or_default();
                    s.0 += e.value;
                    s.1 += 1;
                    o.applied[0] += 1;
                }
                if seen[1].contains(&e.id) {
                    o.business_duplicates[1] += 1;
                    continue;
                }
                let wm = max_ts.saturating_sub(LATENESS_MS);
                let start = e.ts - e.ts % WINDOW_MS;
                if start < wm - wm % WINDOW_MS {
                    // Late beyond the allowed lateness: a dead letter, and its ID is not
                    // remembered, so its business duplicate is one more dead letter... unless
                    // the bytes are the same, which they are: then it is a duplicate.
                    if seen[1].insert(format!("dead:{}", e.id)) {
                        o.dead[1] += 1;
                    } else {
                        o.business_duplicates[1] += 1;
                    }
                    continue;
                }
                seen[1].insert(e.id.clone());
                max_ts = max_ts.max(e.ts);
                *o.windows.entry((e.key.clone(), start)).or_default() += 1;
                o.applied[1] += 1;
            }
        }
    }
    o
}

// ---------------------------------------------------------------------------------------
// The agent under test.

const PIPELINES: &str = r#"
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
retain = true
emit = "changelog"

[[pipeline]]
name = "windows"
topics = ["in/#"]
format = "json"
event_id = "/id"
key = "/k"
event_time = "/ts"
aggregate = "count"
window = { size = "1s", allowed_lateness = "1s" }
dedup_window = "7d"
output_topic = "win/{key}/{window_start}"
retain = true
emit = "upsert"
"#;

/// The agent under test: the shared wrapper with the crash harness's config (fast
/// reconnects, 1 MiB segments, checkpoints every 30 ms or 300 records), its data in
/// `data_dir` (under the power-cut mount when there is one).
fn crash_agent(data_dir: &Path, port: u16, storage: &str) -> CairnProcess {
    let mut cfg = AgentConfig::new(port, &format!("{PIPELINES}{}", rich::PIPELINE));
    cfg.client_id = unique_id("crash").replace('-', "_");
    cfg.mqtt = "keep_alive = \"5s\"\nreconnect_min = \"20ms\"\nreconnect_max = \"200ms\"\n".into();
    cfg.storage = format!("cache_size = \"4MiB\"\n{storage}");
    cfg.data_dir = Some(data_dir.to_path_buf());
    cfg.log = "segment_size = \"1MiB\"\nmax_size = \"256MiB\"\nretention = \"0s\"\n\
               commit_interval = \"2ms\"\nmax_payload = \"16KiB\"\n"
        .into();
    cfg.checkpoint = "interval = \"30ms\"\nmax_records = 300\n".into();
    cfg.outbox = "max_entries = 100000\ninflight = 50\ndrain_timeout = \"10s\"\n".into();
    let mut agent = CairnProcess::new(&cfg);
    // Info only: hundreds of restarts per run, and the harness reads info lines.
    agent.set_log_filter(Some("info"));
    agent
}

/// Starts the agent with `failpoints` armed, noting them in its stderr file.
fn start_with_failpoints(agent: &mut CairnProcess, failpoints: &str) {
    agent.note(&format!("failpoints=[{failpoints}]"));
    agent.start_with_env(&[("CAIRN_FAILPOINTS", failpoints)]);
}

/// `cairn ARGS` against the agent's config: (exit code, stdout, stderr).
fn cli(agent: &CairnProcess, args: &[&str]) -> (i32, String, String) {
    let (status, out, err) = agent.command(args);
    (status.code().unwrap_or(-1), out, err)
}

// ---------------------------------------------------------------------------------------
// Scenarios.

/// Where the agent runs and how it is stopped in one cycle.
#[derive(Debug, Clone)]
enum Stop {
    /// SIGKILL after this many ms of streaming.
    KillAfter(u64),
    /// SIGKILL this many ms after the run connected to the broker. Recovery on a loaded
    /// machine can take longer than a whole `KillAfter`: a cut that lands during it tests
    /// recovery, but acknowledges nothing, so the negative control waits for ingest.
    KillAfterConnected(u64),
    /// Abort at the n-th hit of a failpoint (or SIGKILL if it never fires).
    Failpoint(&'static str, u64),
}

#[derive(Debug, Default)]
struct Figures {
    cycles: u64,
    events: u64,
    failpoints_fired: u64,
    recovery_ms: Vec<u64>,
    /// Runs that published results before their checkpoint.
    published_early: u64,
    /// Results the verifying run published before their checkpoint.
    published_early_last: u64,
}

const FAILPOINTS: &[&str] = &[
    "log.before_fsync",
    "log.after_fsync",
    "log.segment_roll",
    "log.segment_delete",
    "ingest.before_puback",
    "ingest.after_puback",
    "checkpoint.before_commit",
    "checkpoint.ledger_written",
    "checkpoint.before_fsync",
    "checkpoint.after_fsync",
    "checkpoint.after_commit",
    "outbox.before_publish",
    "outbox.after_publish",
    "outbox.before_delete",
    "outbox.after_delete",
    "publish.acked_before_checkpoint",
];

struct Harness {
    broker: Broker,
    agent: CairnProcess,
    stream: Stream,
    acked: Vec<Input>,
    outputs: Collector,
    cut: Option<PowerCut>,
    extra_failpoints: String,
    figures: Figures,
    _dir: tempfile::TempDir,
}

impl Harness {
    fn new(seed: u64, powercut: bool, extra_failpoints: &str) -> Harness {
        Harness::with_storage(seed, powercut, extra_failpoints, "")
    }

    /// [`Harness::new`] with more `[storage]` keys.
    fn with_storage(seed: u64, powercut: bool, extra_failpoints: &str, storage: &str) -> Harness {
        let broker = Broker::start();
        let dir = tempfile::tempdir().unwrap();
        let cut = powercut.then(PowerCut::mount);
        let data = match &cut {
            Some(c) => c.mount.join("data"),
            None => dir.path().join("data"),
        };
        let agent = crash_agent(&data, broker.port(), storage);
        let outputs = Collector::start(broker.port(), "#");
        // The broker queues for the agent only once its persistent session has subscribed:
        // start it once and wait for that before anything is published.
        let mut agent = agent;
        start_with_failpoints(&mut agent, "");
        let stderr = agent.stderr_path();
        assert!(
            wait_until(Duration::from_secs(20), || std::fs::read_to_string(&stderr)
                .is_ok_and(|s| s.contains("mqtt: connected"))),
            "the agent never connected:\n{}",
            agent.stderr_tail(40)
        );
        assert_eq!(
            agent.terminate().code().unwrap_or(-1),
            0,
            "first clean stop:\n{}",
            agent.stderr_tail(40)
        );
        Harness {
            broker,
            agent,
            stream: Stream::new(seed),
            acked: Vec::new(),
            outputs,
            cut,
            extra_failpoints: extra_failpoints.to_string(),
            figures: Figures::default(),
            _dir: dir,
        }
    }

    fn failpoints(&self, extra: &str) -> String {
        [self.extra_failpoints.as_str(), extra]
            .iter()
            .filter(|s| !s.is_empty())
            .cloned()
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Publish `n` inputs (the broker acknowledges them all) while the agent runs, then stop
    /// it as `stop` says; under the power-cut filesystem, cut the power at that moment.
    fn cycle(&mut self, n: usize, stop: Stop, cut_mode: &str) {
        let fp = match &stop {
            Stop::KillAfter(_) | Stop::KillAfterConnected(_) => self.failpoints(""),
            Stop::Failpoint(name, k) => self.failpoints(&format!("{name}=abort@{k}")),
        };
        start_with_failpoints(&mut self.agent, &fp);
        let batch = self.stream.take(n);
        let msgs: Vec<(String, Vec<u8>, bool)> = batch
            .iter()
            .map(|i| ("in/dev".to_string(), i.payload(), false))
            .collect();
        let port = self.broker.port();
        let publisher = std::thread::spawn(move || publish_all(port, &msgs));
        match stop {
            Stop::KillAfter(ms) => std::thread::sleep(Duration::from_millis(ms)),
            Stop::KillAfterConnected(ms) => {
                let agent = &self.agent;
                assert!(
                    wait_until(Duration::from_secs(20), || agent
                        .run_stderr()
                        .contains("mqtt: connected")),
                    "the agent never connected:\n{}",
                    agent.stderr_tail(40)
                );
                std::thread::sleep(Duration::from_millis(ms));
            }
            Stop::Failpoint(..) => {
                if self.agent.wait_exit(Duration::from_secs(3)).is_some() {
                    self.figures.failpoints_fired += 1;
                }
            }
        }
        // The power fails: the filesystem forgets what was not synced, the process dies.
        if let Some(c) = &self.cut {
            let reply = c.command(cut_mode);
            self.agent
                .note(&format!("power cut: `{cut_mode}`: {reply}"));
        }
        self.agent.kill();
        publisher.join().expect("publisher");
        if let Some(c) = &self.cut {
            c.command("thaw");
        }
        self.acked.extend(batch);
        self.figures.cycles += 1;
        self.figures.events += n as u64;
    }

    /// Run the agent without faults until it has processed and published everything, stop it
    /// cleanly, and compare everything with the oracle. `Err` describes each deviation.
    fn verify(&mut self) -> Result<(), String> {
        let end = Event {
            id: format!("END-{}", self.acked.len()),
            key: "END".into(),
            value: 1,
            ts: self.stream.ts,
        };
        let end_id = format!(
            "sums/END/{}",
            self.acked
                .iter()
                .filter(|i| matches!(i, Input::Event(e) if e.key == "END"))
                .count()
                + 1
        );
        self.acked.push(Input::Event(end.clone()));
        start_with_failpoints(&mut self.agent, &self.extra_failpoints.clone());
        publish_all(
            self.broker.port(),
            &[("in/dev".to_string(), end.payload(), false)],
        );
        let outputs = &self.outputs;
        let caught_up = wait_until(Duration::from_secs(60), || {
            outputs.messages().iter().any(|m| {
                serde_json::from_slice::<serde_json::Value>(&m.payload)
                    .is_ok_and(|v| v["id"] == end_id.as_str())
            })
        });
        if !caught_up {
            return Err(format!(
                "the agent never published {end_id}:\n{}",
                self.agent.stderr_tail(40)
            ));
        }
        let code = self.agent.terminate().code().unwrap_or(-1);
        if code != 0 {
            return Err(format!(
                "cairn exited {code} on SIGTERM:\n{}",
                self.agent.stderr_tail(40)
            ));
        }
        self.figures.recovery_ms = self.agent.recovery_ms();
        // Results leave before their checkpoint (issue 14): some run must have done so, or
        // the checks below would only cover the checkpoint-first publisher. (The last run
        // may send everything from the outbox: a backlog can outlast a checkpoint interval.)
        let journal = self.agent.stderr();
        let early_runs = journal
            .matches("publish: results now leave before their checkpoint")
            .count() as u64;
        if early_runs == 0 {
            return Err(format!(
                "no run published a result before its checkpoint:\n{}",
                self.agent.stderr_tail(20)
            ));
        }
        self.figures.published_early = early_runs;
        self.figures.published_early_last = published_early(&self.agent.run_stderr()).unwrap_or(0);
        // sled puts log items over 128 KiB in blob files it never fsyncs; the store keeps its
        // values small so that it never does (src/store/ledger.rs). A blob seen here is a
        // torn write waiting to happen.
        let journal = std::fs::read_to_string(self.agent.stderr_path()).unwrap_or_default();
        if let Some(line) = journal.lines().find(|l| l.contains("blob_io")) {
            return Err(format!("sled used blob files: {line}"));
        }
        let plain = compare(
            &self.agent,
            &self.outputs,
            &oracle(&self.acked),
            self.broker.port(),
        );
        let rich = rich::compare(&self.agent, &self.outputs, &self.acked);
        match (plain, rich) {
            (Ok(()), Ok(())) => Ok(()),
            (a, b) => Err([a.err(), b.err()]
                .into_iter()
                .flatten()
                .collect::<Vec<_>>()
                .join("\n")),
        }
    }
}

fn compare(agent: &CairnProcess, outputs: &Collector, o: &Oracle, port: u16) -> Result<(), String> {
    let mut problems = Vec::new();

    // 1. Per-key state, values and versions, from the store.
    let (code, out, err) = cli(agent, &["inspect", "state", "--json", "--pipeline", "sums"]);
    if code != 0 {
        return Err(format!("inspect state failed ({code}): {err}"));
    }
    let mut got = BTreeMap::new();
    for line in out.lines() {
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| format!("{e}: {line}"))?;
        let key = v["key"].as_str().unwrap_or_default().to_string();
        let version = v["version"].as_u64().unwrap_or(0);
        got.insert(
            key,
            (
                v["value"].as_i64().unwrap_or(i64::MIN),
                v["count"].as_u64().unwrap_or(0),
                version,
            ),
        );
    }
    let want: BTreeMap<String, (i64, u64, u64)> = o
        .sums
        .iter()
        .map(|(k, (s, n))| (k.clone(), (*s, *n, *n)))
        .collect();
    if got != want {
        problems.push(format!(
            "state differs from the oracle:\n  got  {got:?}\n  want {want:?}"
        ));
    }

    // 2. Distinct output IDs: changelog emits one per applied event; an ID never carries two
    //    different payloads.
    let mut by_id: HashMap<String, Vec<u8>> = HashMap::new();
    let mut conflicting = 0;
    for m in outputs.messages() {
        let Ok(v) = serde_json::from_slice::<serde_json::Value>(&m.payload) else {
            continue;
        };
        let Some(id) = v["id"].as_str() else { continue };
        if let Some(prev) = by_id.insert(id.to_string(), m.payload.clone()) {
            if prev != m.payload {
                conflicting += 1;
            }
        }
    }
    let sums_ids = by_id.keys().filter(|id| id.starts_with("sums/")).count() as u64;
    if sums_ids != o.applied[0] {
        problems.push(format!(
            "{sums_ids} distinct `sums` output IDs, the oracle applied {}",
            o.applied[0]
        ));
    }
    if conflicting > 0 {
        problems.push(format!(
            "{conflicting} output IDs arrived with two different payloads"
        ));
    }
    problems.extend(version_regressions(&outputs.messages()));

    // 3. Retained outputs: the latest value of every key and window.
    let retained = Collector::start(port, "#");
    let expect = o.sums.len() + o.windows.len();
    retained.wait_for_count(expect, Duration::from_secs(10));
    std::thread::sleep(Duration::from_millis(200));
    let mut sums_ret = BTreeMap::new();
    let mut win_ret = BTreeMap::new();
    for (topic, payload) in retained.latest() {
        let Ok(v) = serde_json::from_slice::<serde_json::Value>(&payload) else {
            continue;
        };
        if let Some(key) = topic.strip_prefix("sums/") {
            sums_ret.insert(
                key.to_string(),
                (
                    v["value"].as_i64().unwrap_or(i64::MIN),
                    v["version"].as_u64().unwrap_or(0),
                ),
            );
        } else if topic.starts_with("win/") {
            let key = v["key"].as_str().unwrap_or_default().to_string();
            win_ret.insert(
                (key, v["window_start"].as_u64().unwrap_or(0)),
                v["count"].as_u64().unwrap_or(0),
            );
        }
    }
    let want_ret: BTreeMap<String, (i64, u64)> = o
        .sums
        .iter()
        .map(|(k, (s, n))| (k.clone(), (*s, *n)))
        .collect();
    if sums_ret != want_ret {
        problems.push(format!(
            "retained sums differ:\n  got  {sums_ret:?}\n  want {want_ret:?}"
        ));
    }
    if win_ret != o.windows {
        let missing: BTreeSet<_> = o
            .windows
            .iter()
            .filter(|(k, v)| win_ret.get(*k) != Some(v))
            .collect();
        problems.push(format!(
            "retained windows differ from the oracle in {} windows: {missing:?}",
            missing.len()
        ));
    }

    // 4. Counters, replayed exactly from the checkpoint.
    let (code, out, err) = cli(agent, &["verify", "--json"]);
    if code != 0 {
        problems.push(format!("verify failed ({code}): {out}{err}"));
    } else {
        let v: serde_json::Value =
            serde_json::from_str(out.trim()).map_err(|e| format!("{e}: {out}"))?;
        for (i, name) in ["sums", "windows"].iter().enumerate() {
            let p = v["store"]["pipelines"]
                .as_array()
                .and_then(|a| a.iter().find(|p| p["name"] == *name).cloned())
                .unwrap_or_default();
            let (applied, dead, dups) = (
                p["applied"].as_u64().unwrap_or(0),
                p["dead_letters"].as_u64().unwrap_or(0),
                p["duplicates"].as_u64().unwrap_or(0),
            );
            if applied != o.applied[i] || dead != o.dead[i] || dups < o.business_duplicates[i] {
                problems.push(format!(
                    "{name} counters: applied {applied} dead {dead} duplicates {dups}; oracle applied {} dead {} duplicates >= {}",
                    o.applied[i], o.dead[i], o.business_duplicates[i]
                ));
            }
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems.join("\n"))
    }
}

/// No version regression per key (issue 14): taking, in arrival order, only the IDs seen for
/// the first time (a re-send after a crash repeats an ID, and the consumer drops it), the
/// versions of each result topic (a key, or a key's window) strictly ascend. Together with
/// the retained values equal to the oracle (section 3 of [`compare`]), this says a consumer
/// never sees a key go back to an older value, across any crash.
fn version_regressions(messages: &[crate::support::Seen]) -> Vec<String> {
    let mut seen_ids = HashSet::new();
    let mut newest: HashMap<&str, u64> = HashMap::new();
    let mut problems = Vec::new();
    for m in messages {
        if !(m.topic.starts_with("sums/") || m.topic.starts_with("win/")) {
            continue;
        }
        let Ok(v) = serde_json::from_slice::<serde_json::Value>(&m.payload) else {
            problems.push(format!("a result on {} is not JSON", m.topic));
            continue;
        };
        let (Some(id), Some(version)) = (v["id"].as_str(), v["version"].as_u64()) else {
            problems.push(format!("a result on {} has no id or version", m.topic));
            continue;
        };
        if !seen_ids.insert(id.to_string()) {
            continue;
        }
        if let Some(&before) = newest.get(m.topic.as_str()) {
            if version <= before && problems.len() < 10 {
                problems.push(format!(
                    "version regression on {}: first-seen {id} (version {version}) after version {before}",
                    m.topic
                ));
            }
        }
        let e = newest.entry(m.topic.as_str()).or_insert(version);
        *e = (*e).max(version);
    }
    problems
}

/// How many results the last run published before their checkpoint, from its shutdown line.
fn published_early(journal: &str) -> Option<u64> {
    let line = journal
        .lines()
        .rev()
        .find(|l| l.contains("results published before their checkpoint"))?;
    let before = line
        .split(" results published before their checkpoint")
        .next()?;
    before.rsplit(' ').next()?.parse().ok()
}

fn env_count(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn seed() -> u64 {
    env_count("CAIRN_CRASH_SEED", 0x5eed_cafe)
}

fn report(what: &str, h: &Harness) {
    let r = &h.figures.recovery_ms;
    let mean = if r.is_empty() {
        0.0
    } else {
        r.iter().sum::<u64>() as f64 / r.len() as f64
    };
    println!(
        "{what}: cycles {}, events {}, failpoints fired {}, starts {}, mean recovery {mean:.1} ms, max {} ms, lost 0, double-counted 0, runs that published before their checkpoint {} (results in the last run {})",
        h.figures.cycles,
        h.figures.events,
        h.figures.failpoints_fired,
        r.len(),
        r.iter().max().copied().unwrap_or(0),
        h.figures.published_early,
        h.figures.published_early_last
    );
}

#[test]
fn kills_at_random_moments_and_at_every_failpoint_lose_and_double_count_nothing() {
    // Every other cycle stops at a failpoint, the next in the list: twice the list's length
    // reaches them all (20 stopped short of the last five).
    let kills = env_count("CAIRN_CRASH_KILLS", 2 * FAILPOINTS.len() as u64);
    let mut h = Harness::new(seed(), false, "");
    let mut rng = Rng(seed() ^ 0x1234);
    for i in 0..kills {
        let stop = if i % 2 == 0 {
            Stop::KillAfter(20 + rng.below(200))
        } else {
            let fp = FAILPOINTS[(i as usize / 2) % FAILPOINTS.len()];
            Stop::Failpoint(fp, 1 + rng.below(4))
        };
        h.cycle(150 + rng.below(150) as usize, stop, "");
    }
    if let Err(e) = h.verify() {
        panic!("after {kills} kills the agent deviates from the oracle:\n{e}");
    }
    assert!(
        h.figures.failpoints_fired > 0,
        "no failpoint fired: is the test built with --all-features?"
    );
    report("kills", &h);
}

fn power_cuts(cuts: u64, extra_failpoints: &str, seed: u64) -> (Harness, Result<(), String>) {
    let mut h = Harness::new(seed, true, extra_failpoints);
    let mut rng = Rng(seed ^ 0xc0ffee);
    for i in 0..cuts {
        let mode = match rng.below(3) {
            0 => "cut all".to_string(),
            1 => format!("cut prefix {}", rng.next()),
            _ => format!("cut prefix {} tear", rng.next()),
        };
        let stop = if !extra_failpoints.is_empty() {
            Stop::KillAfterConnected(20 + rng.below(250))
        } else if i % 2 == 0 {
            Stop::KillAfter(20 + rng.below(250))
        } else {
            let fp = FAILPOINTS[(i as usize / 2) % FAILPOINTS.len()];
            Stop::Failpoint(fp, 1 + rng.below(4))
        };
        h.cycle(150 + rng.below(150) as usize, stop, &mode);
    }
    let r = h.verify();
    (h, r)
}

#[test]
fn power_cuts_at_random_moments_and_at_failpoints_lose_nothing_acknowledged() {
    let soak = std::env::var("CAIRN_SOAK").is_ok_and(|v| v == "1");
    let cuts = if soak {
        1_000
    } else {
        // As for the kills: every failpoint once.
        env_count("CAIRN_CRASH_CUTS", 2 * FAILPOINTS.len() as u64)
    };
    let (h, r) = power_cuts(cuts, "", seed());
    if let Err(e) = r {
        panic!("after {cuts} power cuts the agent deviates from the oracle:\n{e}");
    }
    report(if soak { "soak" } else { "power cuts" }, &h);
}

/// Issue 33: a checkpoint's ledger chunks are written before its transaction, outside it. A
/// crash between the two leaves chunks no checkpoint recorded; replay accepts their IDs
/// again, and would drop them as duplicates if the chunks still answered. The open deletes
/// them, and says so.
#[test]
fn crashes_between_the_ledger_chunks_and_the_transaction_lose_and_double_count_nothing() {
    // The chunks reach the file before the crash, as sled's flusher may have made them.
    let mut h = Harness::new(seed() ^ 0x1ed9, false, "store.flush_chunks=on");
    let mut rng = Rng(seed() ^ 0x1ed9e);
    for _ in 0..6 {
        let stop = Stop::Failpoint("checkpoint.ledger_written", 1 + rng.below(2));
        h.cycle(150 + rng.below(150) as usize, stop, "");
    }
    assert!(
        h.figures.failpoints_fired >= 3,
        "checkpoint.ledger_written fired in {} of 6 runs",
        h.figures.failpoints_fired
    );
    if let Err(e) = h.verify() {
        panic!("after crashes between the ledger chunks and the transaction:\n{e}");
    }
    let journal = h.agent.stderr();
    assert!(
        journal.contains("ledger chunks of a checkpoint that never committed"),
        "no open deleted uncommitted chunks:\n{}",
        h.agent.stderr_tail(30)
    );
    report("crashes between ledger chunks and transaction", &h);
}

/// Issue 33: kills while the dedup ledger holds more IDs than the index of old could hold at
/// the bound. At `ledger_index_max = "1MiB"` the old fingerprint table (6 bytes a slot at a
/// load of 7/10 to 7/8) held ~150,000 IDs and left the rest to be read by every lookup; the
/// ledger here starts with 200,000 (written into the store before the first run, IDs the
/// stream never sends, received now), all indexed, and the stream's own duplicates and
/// redeliveries are judged against it across kills and failpoints.
#[test]
fn kills_with_the_ledger_past_what_the_old_index_held_lose_and_double_count_nothing() {
    let mut h = Harness::with_storage(seed() ^ 0x33, false, "", "ledger_index_max = \"1MiB\"\n");
    preload_ledger(&h.agent.data_dir().join("store"), "sums", 200_000);
    let mut rng = Rng(seed() ^ 0x3333);
    for i in 0..8u64 {
        let stop = if i % 2 == 0 {
            Stop::KillAfter(50 + rng.below(300))
        } else {
            let fp = [
                "checkpoint.before_commit",
                "checkpoint.before_fsync",
                "ingest.after_puback",
                "publish.acked_before_checkpoint",
            ][(i as usize / 2) % 4];
            Stop::Failpoint(fp, 1 + rng.below(3))
        };
        h.cycle(150 + rng.below(150) as usize, stop, "");
    }
    if let Err(e) = h.verify() {
        panic!("with the ledger past the old index the agent deviates from the oracle:\n{e}");
    }
    let journal = h.agent.stderr();
    assert!(
        !journal.contains("are not indexed"),
        "the 1 MiB bound left ledger chunks out of the index:\n{}",
        h.agent.stderr_tail(20)
    );
    let store = cairn::store::Store::open(
        &h.agent.data_dir().join("store"),
        4 << 20,
        cairn::fsio::real(),
    )
    .expect("open the store");
    let held = store.dedup_entries(Some("sums")).count();
    assert!(held > 200_000, "the ledger holds {held} entries of sums");
    report("kills past the old ledger index", &h);
}

/// Write `n` ledger entries of `pipeline` into the store at `path` as one checkpoint that
/// changes nothing else: IDs `pre-N`, accepted now.
fn preload_ledger(path: &Path, pipeline: &str, n: u64) {
    use cairn::pipeline::engine::{Batch, Checkpoint};
    let store = cairn::store::Store::open(path, 4 << 20, cairn::fsio::real()).expect("open");
    let mut progress = store.progress().expect("progress");
    assert!(
        progress.pipelines.iter().any(|p| p.name == pipeline),
        "the first run records {pipeline}"
    );
    progress.checkpoint_id += 1;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let mut batch = Batch::default();
    for i in 0..n {
        batch
            .dedup
            .insert(0, pipeline, &format!("pre-{i}"), now - n + i);
    }
    store
        .commit(&Checkpoint { progress, batch }, now)
        .expect("commit the preloaded ledger");
}

#[test]
fn the_harness_detects_loss_in_an_unsafe_build_that_acks_before_fsync() {
    // Same harness, same checks; the only change is that the agent PUBACKs each batch
    // before its log fsync. Some acknowledged inputs must then be lost in a cut.
    let mut detected = None;
    for attempt in 0..4 {
        let (_h, r) = power_cuts(12, "unsafe.ack_before_fsync=on", seed() + attempt);
        if let Err(e) = r {
            detected = Some(e);
            break;
        }
    }
    let e = detected.expect(
        "an agent that acks before fsync lost nothing in 48 power cuts: the harness has no teeth",
    );
    println!("detected, as it must be:\n{e}");
}

/// Issue 14, focused: the agent is killed after the broker acknowledged a result and before
/// the checkpoint that commits it (the checkpoint interval is an hour, so none runs). The
/// consumer already has the result while the store holds nothing; after a restart replay
/// computes it again, it goes out again with the same ID and the same payload, and the
/// final state and retained values are the oracle's.
#[test]
fn a_kill_after_publish_and_before_the_checkpoint_resends_the_same_id_with_the_same_payload() {
    let broker = Broker::start();
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = AgentConfig::new(broker.port(), PIPELINES);
    cfg.client_id = unique_id("early").replace('-', "_");
    cfg.data_dir = Some(dir.path().join("data"));
    cfg.checkpoint = "interval = \"1h\"\nmax_records = 100000\n".into();
    let mut agent = CairnProcess::new(&cfg);
    agent.set_log_filter(Some("info"));
    let outputs = Collector::start(broker.port(), "#");
    agent.set_up_session();
    start_with_failpoints(&mut agent, "publish.acked_before_checkpoint=abort");
    agent.wait_connected(Duration::from_secs(20));
    let inputs: Vec<Input> = (0..6u64)
        .map(|i| {
            Input::Event(Event {
                id: format!("X{i}"),
                key: format!("K{}", i % 2),
                value: 10 + i as i64,
                ts: BASE_TS + 100 * i,
            })
        })
        .collect();
    let msgs: Vec<(String, Vec<u8>, bool)> = inputs
        .iter()
        .map(|i| ("in/dev".to_string(), i.payload(), false))
        .collect();
    publish_all(broker.port(), &msgs);
    assert!(
        agent.wait_exit(Duration::from_secs(20)).is_some(),
        "the failpoint never fired: no result was acknowledged before its checkpoint:\n{}",
        agent.stderr_tail(30)
    );
    let results = |c: &Collector| -> Vec<(String, Vec<u8>)> {
        c.messages()
            .into_iter()
            .filter(|m| m.topic.starts_with("sums/"))
            .filter_map(|m| {
                let v: serde_json::Value = serde_json::from_slice(&m.payload).ok()?;
                Some((v["id"].as_str()?.to_string(), m.payload))
            })
            .collect()
    };
    // The broker delivers what it acknowledged; give the collector a moment.
    assert!(
        wait_until(Duration::from_secs(5), || !results(&outputs).is_empty()),
        "the consumer has no result although the broker acknowledged one"
    );
    let before = results(&outputs);
    let (code, out, err) = cli(&agent, &["inspect", "checkpoints", "--json"]);
    assert_eq!(code, 0, "inspect checkpoints: {err}");
    assert!(
        out.trim().is_empty(),
        "a checkpoint was committed before the kill, so the result was not early:\n{out}"
    );
    // Restart without the failpoint: replay computes the results again and sends them.
    start_with_failpoints(&mut agent, "");
    let o = oracle(&inputs);
    assert!(
        wait_until(Duration::from_secs(30), || {
            let ids: HashSet<String> = results(&outputs).into_iter().map(|r| r.0).collect();
            ids.len() as u64 >= o.applied[0]
                && before
                    .iter()
                    .all(|(id, _)| results(&outputs).iter().filter(|(i, _)| i == id).count() >= 2)
        }),
        "after the restart the results did not all arrive, each early one again:\n{}",
        agent.stderr_tail(30)
    );
    assert_eq!(
        agent.terminate().code(),
        Some(0),
        "{}",
        agent.stderr_tail(30)
    );
    let all = results(&outputs);
    for (id, payload) in &before {
        let again: Vec<&Vec<u8>> = all
            .iter()
            .filter(|(i, _)| i == id)
            .map(|(_, p)| p)
            .collect();
        assert!(
            again.len() >= 2,
            "{id} was not sent again after the restart"
        );
        assert!(
            again.iter().all(|p| *p == payload),
            "{id} carried two payloads across the crash"
        );
    }
    if let Err(e) = compare(&agent, &outputs, &o, broker.port()) {
        panic!("after a kill between publish and checkpoint the agent deviates:\n{e}");
    }
}

/// The checker itself: an older version first seen after a newer one is a regression; a
/// re-sent ID (any version) is not, and neither are other keys' versions.
#[test]
fn the_version_check_flags_an_older_first_seen_version_after_a_newer_one() {
    let seen = |topic: &str, id: &str, version: u64| crate::support::Seen {
        topic: topic.into(),
        payload: format!(r#"{{"id":"{id}","version":{version}}}"#).into_bytes(),
        retain: false,
    };
    let fine = [
        seen("sums/A", "sums/A/1", 1),
        seen("sums/B", "sums/B/1", 1),
        seen("sums/A", "sums/A/2", 2),
        seen("sums/A", "sums/A/1", 1), // a re-send after a restart
        seen("sums/A", "sums/A/3", 3),
    ];
    assert!(version_regressions(&fine).is_empty());
    let regressed = [
        seen("win/A/0", "windows/A/0/1", 1),
        seen("win/A/0", "windows/A/0/3", 3),
        seen("win/A/0", "windows/A/0/2", 2),
    ];
    let problems = version_regressions(&regressed);
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(problems[0].contains("windows/A/0/2"), "{problems:?}");
}
