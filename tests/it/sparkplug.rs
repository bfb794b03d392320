//! Sparkplug B in (issue 31), end to end over a private mosquitto: a simulated edge node
//! (NBIRTH, DBIRTHs, DDATA and NDATA by alias, report by exception, several values of one
//! metric in one message, a lost message, an NDEATH and a new session, store-and-forward
//! values, a redelivered message and a second flush of the same stored values) against an
//! oracle that applies the spec's rules by hand, with kills and power cuts between the
//! runs; Cairn as Primary Host with the node buffering while it is down; rebirth requests;
//! hostile protobuf in property tests.
//!
//! The node's clock is its own (two days behind the box's, a second or so per message), as
//! an edge node's is: so a value's window is known to the oracle whatever moment the agent
//! takes it in. An NDEATH stops the node's metrics at its time of receipt, which lies after
//! every value here: what deaths do to the averages is checked exactly by the engine-level
//! test beside the decoder (`pipeline::sparkplug::tests`).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use cairn::model::{Progress, Record};
use cairn::pipeline::memory::MemState;
use cairn::pipeline::sparkplug::proto::{Metric, Payload, Value, datatype as dt};
use cairn::pipeline::{Engine, Outcome};
use proptest::prelude::*;
use prost::Message;

use crate::support::agent::{AgentConfig, CairnProcess};
use crate::support::powercut::PowerCut;
use crate::support::{Broker, Collector, publish_all, unique_id, wait_until};

/// Window size of the pipeline, ms.
const WINDOW: u64 = 10_000;

const PIPELINE: &str = r#"
[[pipeline]]
name = "line1"
topics = ["spBv1.0/plant1/#"]
format = "sparkplug_b"
metrics = ["Temperature", "Speed", "Running", "Level"]
key = "{edge_node}/{device}/{metric}"
aggregate = ["twa", "min", "max", "count"]
window = { size = "10s", allowed_lateness = "1d" }
dedup_window = "7d"
max_future = "1d"
output_topic = "line1/{key}/{window_start}"
"#;

/// (device, metric, alias, data type): the node's own metric and two devices'. `Label` is
/// a String the pipeline does not list.
const METRICS: [(&str, &str, u64, u32); 5] = [
    ("", "Temperature", 1, dt::INT32),
    ("d1", "Speed", 2, dt::INT32),
    ("d1", "Running", 3, dt::BOOLEAN),
    ("d2", "Level", 4, dt::DOUBLE),
    ("d2", "Label", 5, dt::STRING),
];

type Msg = (String, Vec<u8>, bool);

/// Every value the node sent that the pipeline takes, on each metric's time line.
#[derive(Default, Clone)]
struct Oracle {
    points: BTreeMap<String, Vec<(u64, f64)>>,
}

impl Oracle {
    /// Each window with a value of `key`: the stair-step integral from the window's start
    /// (the value in effect there carried in) to its end, over the time covered; and the
    /// min, max and count of its values.
    fn windows(&self) -> BTreeMap<(String, u64), serde_json::Value> {
        let mut out = BTreeMap::new();
        for (key, pts) in &self.points {
            let mut pts = pts.clone();
            pts.sort_by_key(|p| p.0);
            let starts: BTreeSet<u64> = pts.iter().map(|p| p.0 - p.0 % WINDOW).collect();
            for start in starts {
                let end = start + WINDOW;
                let mut value = pts.iter().rev().find(|p| p.0 < start).map(|p| p.1);
                let (mut at, mut area, mut covered) = (start, 0.0, 0u64);
                let inside: Vec<(u64, f64)> = pts
                    .iter()
                    .copied()
                    .filter(|p| p.0 >= start && p.0 < end)
                    .collect();
                for &(t, v) in &inside {
                    if let Some(x) = value {
                        area += x * (t - at) as f64;
                        covered += t - at;
                    }
                    (at, value) = (t, Some(v));
                }
                area += value.unwrap() * (end - at) as f64;
                covered += end - at;
                let vals = inside.iter().map(|p| p.1);
                out.insert(
                    (key.clone(), start),
                    serde_json::json!({
                        "twa": area / covered as f64,
                        "min": vals.clone().fold(f64::INFINITY, f64::min),
                        "max": vals.fold(f64::NEG_INFINITY, f64::max),
                        "count": inside.len(),
                    }),
                );
            }
        }
        out
    }
}

/// A simulated edge node (see the module docs).
struct EdgeNode {
    name: String,
    bd_seq: u64,
    seq: u64,
    clock: u64,
    rng: u64,
    values: BTreeMap<&'static str, f64>,
    /// Values measured while the node could not send: sent later as historical.
    buffered: Vec<(usize, u64, f64)>,
    oracle: Oracle,
}

impl EdgeNode {
    fn new(name: &str, seed: u64, clock: u64) -> EdgeNode {
        EdgeNode {
            name: name.into(),
            bd_seq: 0,
            seq: 0,
            clock: clock - clock % WINDOW,
            rng: seed | 1,
            values: METRICS
                .iter()
                .map(|m| (m.1, if m.3 == dt::BOOLEAN { 1.0 } else { 10.0 }))
                .collect(),
            buffered: Vec::new(),
            oracle: Oracle::default(),
        }
    }

    fn rand(&mut self, n: u64) -> u64 {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        self.rng % n
    }

    fn topic(&self, kind: &str, device: &str) -> String {
        if device.is_empty() {
            format!("spBv1.0/plant1/{kind}/{}", self.name)
        } else {
            format!("spBv1.0/plant1/{kind}/{}/{device}", self.name)
        }
    }

    /// Metric `i` with value `v` at `t`, as the wire carries it; noted in the oracle.
    fn metric(&mut self, i: usize, t: u64, v: f64, birth: bool, historical: bool) -> Metric {
        let (device, name, alias, ty) = METRICS[i];
        if ty != dt::STRING {
            let key = format!("{}/{device}/{name}", self.name);
            self.oracle.points.entry(key).or_default().push((t, v));
        }
        let value = match ty {
            dt::INT32 => Value::Int(v as i32 as u32),
            dt::BOOLEAN => Value::Boolean(v != 0.0),
            dt::DOUBLE => Value::Double(v),
            _ => Value::String(format!("batch {v}")),
        };
        Metric {
            name: birth.then(|| name.to_string()),
            alias: Some(alias),
            timestamp: Some(t),
            datatype: birth.then_some(ty),
            is_historical: historical.then_some(true),
            value: Some(value),
            ..Default::default()
        }
    }

    fn payload(&mut self, metrics: Vec<Metric>, seq: Option<u64>) -> Vec<u8> {
        Payload {
            timestamp: Some(self.clock),
            metrics,
            seq,
            uuid: None,
        }
        .encode_to_vec()
    }

    fn next_seq(&mut self) -> u64 {
        self.seq = (self.seq + 1) % 256;
        self.seq
    }

    /// NBIRTH and both DBIRTHs of a new session, with every current value.
    fn births(&mut self) -> Vec<Msg> {
        self.clock += 1000;
        let t = self.clock;
        self.seq = 0;
        let mut node = vec![
            Metric {
                name: Some("bdSeq".into()),
                datatype: Some(dt::INT64),
                value: Some(Value::Long(self.bd_seq)),
                ..Default::default()
            },
            Metric {
                name: Some("Node Control/Rebirth".into()),
                datatype: Some(dt::BOOLEAN),
                value: Some(Value::Boolean(false)),
                ..Default::default()
            },
        ];
        node.push(self.metric(0, t, self.values["Temperature"], true, false));
        let mut out = vec![(self.topic("NBIRTH", ""), self.payload(node, Some(0)), false)];
        for device in ["d1", "d2"] {
            let ms: Vec<Metric> = (0..METRICS.len())
                .filter(|&i| METRICS[i].0 == device)
                .map(|i| self.metric(i, t, self.values[METRICS[i].1], true, false))
                .collect();
            let seq = self.next_seq();
            out.push((
                self.topic("DBIRTH", device),
                self.payload(ms, Some(seq)),
                false,
            ));
        }
        out
    }

    /// A new value for metric `i` (numeric ones move by whole steps, Level by halves).
    fn change(&mut self, i: usize) -> f64 {
        let step = (self.rand(9) as f64) - 4.0;
        let v = match METRICS[i].3 {
            dt::BOOLEAN => (self.rand(2)) as f64,
            dt::DOUBLE => self.values[METRICS[i].1] + step / 2.0,
            _ => self.values[METRICS[i].1] + step,
        };
        self.values.insert(METRICS[i].1, v);
        v
    }

    /// One report by exception: one or two metrics of the node or one device changed; now
    /// and then one metric twice in the message.
    fn report(&mut self) -> Msg {
        self.clock += 500 + self.rand(1500);
        let device = ["", "d1", "d2"][self.rand(3) as usize];
        let of: Vec<usize> = (0..METRICS.len())
            .filter(|&i| METRICS[i].0 == device)
            .collect();
        let mut ms = Vec::new();
        let first = self.rand(of.len() as u64) as usize;
        // One or two metrics, each once (a node reports a metric once per instant).
        for k in 0..(1 + self.rand(2) as usize).min(of.len()) {
            let i = of[(first + k) % of.len()];
            let v = self.change(i);
            let t = self.clock;
            ms.push(self.metric(i, t, v, false, false));
            if self.rand(5) == 0 {
                let v = self.change(i);
                ms.push(self.metric(i, t + 300, v, false, false));
            }
        }
        let seq = self.next_seq();
        let kind = if device.is_empty() { "NDATA" } else { "DDATA" };
        (self.topic(kind, device), self.payload(ms, Some(seq)), false)
    }

    /// A message lost on the way (QoS 0 in the field): its seq is used, nothing arrives.
    fn lose_one(&mut self) {
        self.clock += 1000;
        self.next_seq();
    }

    /// The node's session ends (it publishes its NDEATH before it disconnects).
    fn death(&mut self) -> Msg {
        let m = Metric {
            name: Some("bdSeq".into()),
            datatype: Some(dt::INT64),
            value: Some(Value::Long(self.bd_seq)),
            ..Default::default()
        };
        self.bd_seq += 1;
        (self.topic("NDEATH", ""), self.payload(vec![m], None), false)
    }

    /// While it cannot send: every numeric metric measured about once a second, kept.
    fn measure_offline(&mut self, seconds: u64) {
        for _ in 0..seconds {
            self.clock += 1000;
            for (i, m) in METRICS.iter().enumerate() {
                if m.3 != dt::STRING && self.rand(2) == 0 {
                    let v = self.change(i);
                    self.buffered.push((i, self.clock + i as u64, v));
                }
            }
        }
    }

    /// What it kept, as historical values, one message per device, oldest first. The oracle
    /// notes each value once, however many times it is sent.
    fn flush(&mut self, note: bool) -> Vec<Msg> {
        let kept = std::mem::take(&mut self.buffered);
        let mut out = Vec::new();
        for device in ["", "d1", "d2"] {
            let mut ms = Vec::new();
            for &(i, t, v) in kept.iter().filter(|b| METRICS[b.0].0 == device) {
                let m = if note {
                    self.metric(i, t, v, false, true)
                } else {
                    let saved = self.oracle.clone();
                    let m = self.metric(i, t, v, false, true);
                    self.oracle = saved;
                    m
                };
                ms.push(m);
            }
            if !ms.is_empty() {
                let seq = self.next_seq();
                let kind = if device.is_empty() { "NDATA" } else { "DDATA" };
                out.push((self.topic(kind, device), self.payload(ms, Some(seq)), false));
            }
        }
        if !note {
            self.buffered = kept;
        }
        out
    }
}

/// The state the agent stored, per (key, window start): `inspect state` after a clean stop.
fn stored(agent: &CairnProcess) -> BTreeMap<(String, u64), serde_json::Value> {
    agent
        .inspect("state")
        .into_iter()
        .filter(|v| v["pipeline"] == "line1")
        .map(|v| {
            let key = v["key"].as_str().unwrap().to_string();
            (
                (key, v["window_start"].as_u64().unwrap()),
                v["value"].clone(),
            )
        })
        .collect()
}

/// Every window the oracle has, with its numbers: min, max and count exactly; the average
/// to within a few units in the last place. The engine's sums are exact (integers and halves
/// over whole milliseconds; the engine-level tests compare them with `==`), but the numbers
/// here come back through `cairn inspect`'s JSON text, and serde_json's default parsing of
/// a float is not always correctly rounded (its `float_roundtrip` feature, off here, is).
fn compare(
    got: &BTreeMap<(String, u64), serde_json::Value>,
    want: &BTreeMap<(String, u64), serde_json::Value>,
) -> Result<(), String> {
    let mut problems = Vec::new();
    for (k, w) in want {
        match got.get(k) {
            None => problems.push(format!("missing window {k:?}: want {w}")),
            Some(g) => {
                let exact = ["min", "max", "count"]
                    .iter()
                    .all(|f| g[f].as_f64() == w[f].as_f64());
                let (gt, wt) = (g["twa"].as_f64(), w["twa"].as_f64().unwrap());
                let same = exact && gt.is_some_and(|t| (t - wt).abs() <= 1e-12 * wt.abs());
                if !same {
                    problems.push(format!("{k:?}: got {g}, want {w}"));
                }
            }
        }
    }
    for k in got.keys().filter(|k| !want.contains_key(*k)) {
        problems.push(format!("window {k:?} the oracle does not have: {}", got[k]));
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems.join("\n"))
    }
}

fn wall_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

fn agent(port: u16, data: Option<std::path::PathBuf>, extra: &str) -> CairnProcess {
    let mut cfg = AgentConfig::new(port, PIPELINE);
    cfg.client_id = unique_id("spb").replace('-', "_");
    cfg.data_dir = data;
    cfg.extra = extra.into();
    let mut a = CairnProcess::new(&cfg);
    a.set_log_filter(Some("info"));
    a
}

/// Waits until the agent has published a result for `key`'s window at `start` with
/// `count` values (it has processed everything sent before that value).
fn wait_for(outputs: &Collector, key: &str, start: u64, count: u64) -> bool {
    wait_until(Duration::from_secs(60), || {
        outputs.messages().iter().any(|m| {
            serde_json::from_slice::<serde_json::Value>(&m.payload)
                .is_ok_and(|v| v["key"] == key && v["window_start"] == start && v["count"] == count)
        })
    })
}

/// A last value the agent must take before the state is compared: the Temperature of a
/// window no earlier value reached, waited for in the results.
fn finish(node: &mut EdgeNode, port: u16, outputs: &Collector) {
    node.clock += 2 * WINDOW;
    let t = node.clock;
    let m = node.metric(0, t, 1000.0, false, false);
    let seq = node.next_seq();
    let last = (
        node.topic("NDATA", ""),
        node.payload(vec![m], Some(seq)),
        false,
    );
    publish_all(port, &[last]);
    let key = format!("{}//Temperature", node.name);
    assert!(
        wait_for(outputs, &key, t - t % WINDOW, 1),
        "the agent never published the last value"
    );
}

#[test]
fn an_edge_node_through_kills_and_power_cuts_gives_what_the_spec_rules_give_by_hand() {
    let broker = Broker::start();
    let cut = PowerCut::mount();
    let mut agent = agent(broker.port(), Some(cut.mount.join("data")), "");
    let outputs = Collector::start(broker.port(), "line1/#");
    agent.set_up_session();
    let mut node = EdgeNode::new("n1", 0x005e_ed5b, wall_ms() - 2 * 86_400_000);

    // The node's whole script, then cut into phases: each is published while the agent
    // runs, and ends in a kill, a power cut (the file system forgets what was not fsynced,
    // torn or not) or a clean stop, some while the agent still catches up.
    let mut script = node.births();
    script.extend((0..400).map(|_| node.report()));
    node.lose_one();
    script.extend((0..300).map(|_| node.report()));
    // A message the broker delivers twice (its PUBACK was lost, say).
    script.push(script[50].clone());
    script.extend((0..12).map(|_| node.report()));
    script.push(node.death());
    // Disconnected a while: measured, kept, then sent after the new session's births.
    node.measure_offline(25);
    script.extend(node.births());
    let resent = node.flush(false);
    script.extend(node.flush(true));
    // The stored values flushed a second time (a crash mid-flush), in new messages.
    script.extend(resent);
    script.extend((0..400).map(|_| node.report()));
    let stops = [
        "kill",
        "cut all",
        "cut prefix 3 tear",
        "term",
        "cut prefix 7",
        "kill",
        "cut random 11 tear",
        "term",
    ];
    let chunk = script.len().div_ceil(stops.len());
    let phases: Vec<(Vec<Msg>, &str)> = script
        .chunks(chunk)
        .map(<[Msg]>::to_vec)
        .zip(stops)
        .collect();
    for (i, (msgs, stop)) in phases.into_iter().enumerate() {
        let port = broker.port();
        let publisher = if stop.starts_with("cut") {
            // The phase waits at the broker (the agent is down); the cut lands while the
            // agent takes that backlog in, its log and store writes under way.
            publish_all(port, &msgs);
            agent.start();
            let connected = wait_until(Duration::from_secs(20), || {
                agent.run_stderr().contains("mqtt: connected")
            });
            assert!(connected, "{}", agent.stderr_tail(20));
            std::thread::sleep(Duration::from_millis(i as u64 % 3));
            std::thread::spawn(|| ())
        } else {
            agent.start();
            let p = std::thread::spawn(move || publish_all(port, &msgs));
            std::thread::sleep(Duration::from_millis(60 + 70 * (i as u64 % 4)));
            p
        };
        match stop {
            "term" => {
                publisher.join().unwrap();
                assert_eq!(
                    agent.terminate().code(),
                    Some(0),
                    "{}",
                    agent.stderr_tail(30)
                );
            }
            "kill" => {
                agent.kill();
                publisher.join().unwrap();
            }
            cut_mode => {
                let reply = cut.command(cut_mode);
                agent.note(&format!("power cut: `{cut_mode}`: {reply}"));
                agent.kill();
                publisher.join().unwrap();
                cut.command("thaw");
            }
        }
    }
    // After a restart with no BIRTH retained anywhere, DATA by alias still resolves.
    agent.start();
    finish(&mut node, broker.port(), &outputs);
    assert_eq!(agent.terminate().code(), Some(0));

    let got = stored(&agent);
    let want = node.oracle.windows();
    if let Err(e) = compare(&got, &want) {
        panic!("{e}\n{}", agent.stderr_tail(40));
    }
    assert!(want.len() > 40, "{} windows", want.len());
    let dead = agent.inspect("dead-letters");
    assert!(dead.is_empty(), "no value is refused: {dead:?}");
}

/// Cairn as Primary Host: the node publishes only while `spBv1.0/STATE/<host_id>` says
/// online; while Cairn is down (killed: the will says offline; stopped: it says so itself)
/// the node keeps its values and sends them, as historical, once the host is back.
#[test]
fn with_host_id_the_node_buffers_while_cairn_is_down_and_no_value_is_missing() {
    let broker = Broker::start();
    let port = broker.port();
    let mut agent = agent(port, None, "[sparkplug]\nhost_id = \"cairn-it\"\n");
    let outputs = Collector::start(port, "line1/#");
    let state = Collector::start(port, "spBv1.0/STATE/#");
    let online = |c: &Collector| {
        c.latest()
            .get("spBv1.0/STATE/cairn-it")
            .and_then(|p| serde_json::from_slice::<serde_json::Value>(p).ok())
            .map(|v| (v["online"].as_bool(), v["timestamp"].as_u64()))
    };
    agent.set_up_session();
    let mut node = EdgeNode::new("n1", 0xb0ff, wall_ms() - 2 * 86_400_000);
    let mut stamps = Vec::new();
    for (run, stop) in ["kill", "term", "kill"].into_iter().enumerate() {
        agent.start();
        assert!(
            wait_until(Duration::from_secs(20), || online(&state)
                .is_some_and(|s| s.0 == Some(true))),
            "run {run}: STATE never said online: {:?}",
            online(&state)
        );
        stamps.push(online(&state).unwrap().1.unwrap());
        // Online: a new session, what was kept, then live values.
        let mut msgs = node.births();
        msgs.extend(node.flush(true));
        msgs.extend((0..30).map(|_| node.report()));
        publish_all(port, &msgs);
        match stop {
            "kill" => agent.kill(),
            _ => assert_eq!(
                agent.terminate().code(),
                Some(0),
                "{}",
                agent.stderr_tail(30)
            ),
        }
        assert!(
            wait_until(Duration::from_secs(20), || online(&state)
                .is_some_and(|s| s.0 == Some(false))),
            "run {run} ({stop}): STATE never said offline: {:?}",
            online(&state)
        );
        // The will and the clean offline carry the timestamp of the run's online STATE.
        assert_eq!(online(&state).unwrap().1, Some(stamps[run]));
        // Offline: the node ends its session and keeps what it measures.
        publish_all(port, &[node.death()]);
        node.measure_offline(20);
    }
    agent.start();
    assert!(wait_until(Duration::from_secs(20), || online(&state)
        .is_some_and(|s| s.0 == Some(true))));
    let mut msgs = node.births();
    msgs.extend(node.flush(true));
    publish_all(port, &msgs);
    finish(&mut node, port, &outputs);
    assert_eq!(agent.terminate().code(), Some(0));
    assert!(
        stamps.windows(2).all(|w| w[0] < w[1]),
        "a new stamp per run: {stamps:?}"
    );
    let got = stored(&agent);
    let want = node.oracle.windows();
    if let Err(e) = compare(&got, &want) {
        let dead = agent.inspect("dead-letters");
        panic!("{e}\ndead letters: {dead:?}\n{}", agent.stderr_tail(40));
    }
}

/// A seq gap seen live is counted and answered by one NCMD `Node Control/Rebirth`; a second
/// gap within the rate limit is counted, not answered again.
#[test]
fn a_seq_gap_seen_live_asks_the_node_to_rebirth_once_per_interval() {
    let broker = Broker::start();
    let port = broker.port();
    let mut agent = agent(port, None, "[sparkplug]\nrebirth = true\n");
    agent.start_connected();
    let commands = Collector::start(port, "spBv1.0/plant1/NCMD/#");
    let mut node = EdgeNode::new("n7", 7, wall_ms() - 86_400_000);
    let mut msgs = node.births();
    msgs.push(node.report());
    node.lose_one();
    msgs.push(node.report());
    node.lose_one();
    msgs.push(node.report());
    publish_all(port, &msgs);
    assert!(
        commands.wait_for_count(1, Duration::from_secs(20)),
        "no rebirth request:\n{}",
        agent.stderr_tail(20)
    );
    std::thread::sleep(Duration::from_millis(500));
    let got = commands.messages();
    assert_eq!(got.len(), 1, "rate limited to one per node");
    assert_eq!(got[0].topic, "spBv1.0/plant1/NCMD/n7");
    let p = Payload::decode(got[0].payload.as_slice()).unwrap();
    assert_eq!(p.metrics[0].name.as_deref(), Some("Node Control/Rebirth"));
    assert_eq!(p.metrics[0].value, Some(Value::Boolean(true)));
    agent.wait_for_stderr("asked it to rebirth", Duration::from_secs(5));
    assert_eq!(agent.terminate().code(), Some(0));
}

// ---------------------------------------------------------------------------------------
// Hostile protobuf: whatever arrives, the engine refuses it as a dead letter (or skips it),
// never panics.

fn hostile_spec() -> cairn::pipeline::spec::PipelineSpec {
    cairn::config::pipeline_from_toml(
        "name = \"h\"\ntopics = [\"spBv1.0/#\"]\nformat = \"sparkplug_b\"\n\
         key = \"{group}/{edge_node}/{device}/{metric}\"\n\
         aggregate = [\"twa\", \"count\", \"last\"]\nwindow = { size = \"1m\" }\n\
         output_topic = \"h/{key}\"",
    )
    .unwrap()
}

fn varint(mut v: u64, out: &mut Vec<u8>) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// A field of wire type 2 (`tag`, length, bytes).
fn delimited(tag: u64, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    varint(tag << 3 | 2, &mut out);
    varint(body.len() as u64, &mut out);
    out.extend_from_slice(body);
    out
}

fn hostile_payload() -> impl Strategy<Value = Vec<u8>> {
    let good = (any::<u64>(), any::<u32>(), any::<u8>(), any::<bool>()).prop_map(
        |(alias, v, seq, hist)| {
            Payload {
                timestamp: Some(1000),
                metrics: vec![
                    Metric {
                        name: Some("bdSeq".into()),
                        value: Some(Value::Long(0)),
                        ..Default::default()
                    },
                    Metric {
                        name: Some("m".into()),
                        alias: Some(alias),
                        timestamp: Some(u64::from(v)),
                        datatype: Some(v % 21),
                        is_historical: Some(hist),
                        value: Some(Value::Int(v)),
                        ..Default::default()
                    },
                ],
                seq: Some(u64::from(seq)),
                uuid: None,
            }
            .encode_to_vec()
        },
    );
    prop_oneof![
        // Anything at all.
        prop::collection::vec(any::<u8>(), 0..300),
        // A valid payload, truncated anywhere or with bytes flipped.
        (good.clone(), any::<usize>()).prop_map(|(p, cut)| p[..cut % (p.len() + 1)].to_vec()),
        (good.clone(), any::<usize>(), any::<u8>()).prop_map(|(mut p, at, x)| {
            let n = p.len();
            p[at % n] ^= x;
            p
        }),
        good,
        // Huge repeated fields: many empty metrics, and long varint runs.
        (1usize..40_000).prop_map(|n| [0x12u8, 0x00].repeat(n)),
        Just(
            [
                0x18u8, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01
            ]
            .repeat(3000)
        ),
        // Deep nesting: a metric whose Template value holds templates thousands deep.
        (1usize..3000).prop_map(|depth| {
            let mut inner = Vec::new();
            for _ in 0..depth {
                inner = delimited(2, &delimited(18, &inner));
            }
            delimited(2, &delimited(18, &inner))
        }),
        // Wrong wire types for known fields, and lengths past the end.
        (0u64..20, 0u64..6, any::<u32>()).prop_map(|(field, wire, n)| {
            let mut out = Vec::new();
            varint(field << 3 | wire, &mut out);
            varint(u64::from(n), &mut out);
            out
        }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// Every message type, every hostile payload: a dead letter, a skip or values, never a
    /// panic, and every checkpoint still fits the store's bounds.
    #[test]
    fn hostile_protobuf_never_panics_and_is_refused_as_dead_letters(
        payloads in prop::collection::vec(
            (hostile_payload(), 0usize..8),
            1..12,
        )
    ) {
        let topics = [
            "spBv1.0/g/NBIRTH/n", "spBv1.0/g/NDATA/n", "spBv1.0/g/NDEATH/n",
            "spBv1.0/g/DBIRTH/n/d", "spBv1.0/g/DDATA/n/d", "spBv1.0/g/DDEATH/n/d",
            "spBv1.0/g/NCMD/n", "spBv1.0/g/BAD",
        ];
        let mut engine = Engine::new(vec![hostile_spec()], Progress::default());
        let mut store = MemState::default();
        for (offset, (payload, t)) in payloads.into_iter().enumerate() {
            let rec = Record {
                offset: offset as u64,
                received_at_ms: 5_000_000,
                topic: topics[t].into(),
                payload,
                qos: 1,
                retain: false,
            };
            let outcomes = engine.apply(&store, &rec).unwrap();
            prop_assert_eq!(outcomes.len(), 1);
            if let Outcome::DeadLetter { reason } = outcomes[0] {
                prop_assert!(!reason.is_empty());
            }
            let cp = engine.take_checkpoint();
            for ((p, k), e) in &cp.batch.sparkplug {
                let bytes = p.len() + 1 + k.len()
                    + e.as_ref().map_or(0, |e| postcard::to_stdvec(e).unwrap().len());
                prop_assert!(bytes <= cairn::model::MAX_ENTRY_BYTES);
            }
            store.commit(&cp);
        }
    }
}

/// The scenarios' node through the engine alone (no broker, no crash): what the
/// end-to-end tests compare against holds before any fault is added.
#[test]
fn the_simulated_node_through_the_engine_alone_gives_the_oracle_s_windows() {
    let spec = cairn::config::pipeline_from_toml(
        PIPELINE.trim_start().trim_start_matches("[[pipeline]]\n"),
    )
    .unwrap();
    let mut node = EdgeNode::new("n1", 0xb0ff, wall_ms() - 2 * 86_400_000);
    let mut msgs = Vec::new();
    for _ in 0..3 {
        msgs.extend(node.births());
        msgs.extend(node.flush(true));
        msgs.extend((0..30).map(|_| node.report()));
        msgs.push(node.death());
        node.measure_offline(20);
    }
    msgs.extend(node.births());
    msgs.extend(node.flush(true));
    let mut engine = Engine::new(vec![spec], Progress::default());
    let mut store = MemState::default();
    for (offset, (topic, payload, _)) in msgs.into_iter().enumerate() {
        let rec = Record {
            offset: offset as u64,
            received_at_ms: wall_ms(),
            topic,
            payload,
            qos: 1,
            retain: false,
        };
        let out = engine.apply(&store, &rec).unwrap();
        assert!(
            !matches!(out[..], [Outcome::DeadLetter { .. }] | [Outcome::Duplicate]),
            "{offset}: {out:?}"
        );
    }
    store.commit(&engine.take_checkpoint());
    assert_eq!(store.progress.pipelines[0].counters.duplicates, 0);
    let got: BTreeMap<(String, u64), serde_json::Value> = store
        .state
        .iter()
        .map(|((_, k), st)| {
            let start = u64::from_be_bytes(k[..8].try_into().unwrap());
            (
                (String::from_utf8(k[8..].to_vec()).unwrap(), start),
                st.value_json(),
            )
        })
        .collect();
    compare(&got, &node.oracle.windows()).unwrap();
}
