//! A simulated edge node through the engine, against an oracle that applies the spec's
//! rules by hand (`Oracle`): sessions, aliases, report by exception, a seq gap, deaths,
//! store-and-forward values, dedup and a restart with no BIRTH to be seen again.

use std::collections::BTreeMap;

use prost::Message;

use super::proto::datatype as t;
use super::*;
use crate::model::{Progress, Record};
use crate::pipeline::engine::{Engine, Outcome};
use crate::pipeline::memory::MemState;
use crate::pipeline::spec::PipelineSpec;

/// 20,000,000 minutes after the epoch: window starts are whole minutes from here.
const T0: u64 = 1_200_000_000_000;

fn spec(extra: &str) -> PipelineSpec {
    crate::config::pipeline_from_toml(&format!(
        "name = \"line1\"\ntopics = [\"spBv1.0/plant1/#\"]\nformat = \"sparkplug_b\"\n\
         key = \"{{edge_node}}/{{device}}/{{metric}}\"\n\
         aggregate = [\"twa\", \"min\", \"max\", \"count\"]\n\
         window = {{ size = \"1m\", allowed_lateness = \"5m\" }}\n\
         output_topic = \"out/{{key}}\"\ndedup_window = \"1d\"\nmax_future = \"1d\"\n{extra}"
    ))
    .unwrap()
}

/// One metric value as an edge node writes it.
fn m(name: Option<&str>, alias: u64, dtype: u32, value: Value, ts: u64) -> Metric {
    Metric {
        name: name.map(String::from),
        alias: Some(alias),
        timestamp: Some(T0 + ts),
        datatype: Some(dtype),
        value: Some(value),
        ..Default::default()
    }
}

fn historical(mut metric: Metric) -> Metric {
    metric.is_historical = Some(true);
    metric
}

fn payload(seq: Option<u64>, metrics: Vec<Metric>) -> Vec<u8> {
    Payload {
        timestamp: Some(T0),
        metrics,
        seq,
        uuid: None,
    }
    .encode_to_vec()
}

fn bd_seq(v: u64) -> Metric {
    Metric {
        name: Some("bdSeq".into()),
        datatype: Some(t::INT64),
        value: Some(Value::Long(v)),
        ..Default::default()
    }
}

/// The engine over an in-memory store, fed like the agent feeds it.
struct Host {
    specs: Vec<PipelineSpec>,
    engine: Engine,
    store: MemState,
    offset: u64,
}

impl Host {
    fn new(specs: Vec<PipelineSpec>) -> Host {
        Host {
            engine: Engine::new(specs.clone(), Progress::default()),
            specs,
            store: MemState::default(),
            offset: 0,
        }
    }

    fn send(&mut self, topic: &str, payload: Vec<u8>, received_ms: u64) -> Vec<Outcome> {
        let rec = Record {
            offset: self.offset,
            received_at_ms: T0 + received_ms,
            topic: topic.into(),
            payload,
            qos: 1,
            retain: false,
        };
        self.offset += 1;
        self.engine.apply(&self.store, &rec).unwrap()
    }

    fn checkpoint(&mut self) {
        let cp = self.engine.take_checkpoint();
        self.store.commit(&cp);
    }

    /// A restart: nothing but the store is left.
    fn restart(&mut self) {
        self.checkpoint();
        self.engine = Engine::new(self.specs.clone(), self.store.progress.clone());
    }

    /// Every window's `values` of `key`, by window start (relative to T0).
    fn windows(&mut self, key: &str) -> BTreeMap<u64, serde_json::Value> {
        self.checkpoint();
        self.store
            .state
            .iter()
            .filter(|((_, k), _)| &k[8..] == key.as_bytes())
            .map(|((_, k), st)| {
                let start = u64::from_be_bytes(k[..8].try_into().unwrap());
                (start - T0, st.value_json())
            })
            .collect()
    }
}

/// The spec's rules applied by hand: each metric's values on one time line, in time order
/// (whatever order they arrived in), a death as a point with no value; each window with a
/// value in it integrates the steps from its start (carrying in the value in effect there)
/// to its end.
#[derive(Default)]
struct Oracle {
    points: BTreeMap<String, Vec<(u64, Option<f64>)>>,
}

impl Oracle {
    fn value(&mut self, key: &str, at: u64, v: f64) {
        self.points
            .entry(key.into())
            .or_default()
            .push((at, Some(v)));
    }

    fn death(&mut self, key: &str, at: u64) {
        self.points.entry(key.into()).or_default().push((at, None));
    }

    fn windows(&self, key: &str, size: u64) -> BTreeMap<u64, serde_json::Value> {
        let mut pts = self.points[key].clone();
        pts.sort_by_key(|p| p.0); // stable: ties keep their order
        let mut out = BTreeMap::new();
        let starts: std::collections::BTreeSet<u64> = pts
            .iter()
            .filter(|p| p.1.is_some())
            .map(|p| p.0 - p.0 % size)
            .collect();
        for start in starts {
            let end = start + size;
            let mut value = pts.iter().rev().find(|p| p.0 < start).and_then(|p| p.1);
            let (mut at, mut area, mut covered) = (start, 0.0, 0u64);
            let inside: Vec<_> = pts.iter().filter(|p| p.0 >= start && p.0 < end).collect();
            for &&(t, v) in inside.iter().chain(std::iter::once(&&(end, None))) {
                if let Some(x) = value {
                    area += x * (t - at) as f64;
                    covered += t - at;
                }
                (at, value) = (t, v);
            }
            let vals: Vec<f64> = inside.iter().filter_map(|p| p.1).collect();
            let min = vals.iter().copied().fold(f64::INFINITY, f64::min);
            let max = vals.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            out.insert(
                start,
                serde_json::json!({
                    "twa": area / covered as f64, "min": min, "max": max, "count": vals.len()
                }),
            );
        }
        out
    }
}

/// Numbers as the engine writes them: integers stay integers.
fn same(engine: &serde_json::Value, oracle: &serde_json::Value) -> bool {
    let (e, o) = (engine.as_object().unwrap(), oracle.as_object().unwrap());
    e.len() == o.len()
        && e.iter()
            .all(|(k, v)| v.as_f64() == o.get(k).and_then(serde_json::Value::as_f64))
}

#[test]
fn topics_split_into_group_node_and_device_or_are_refused() {
    let ok = Topic::parse("spBv1.0/plant1/DDATA/n1/d1").unwrap().unwrap();
    assert_eq!(
        (ok.group, ok.kind, ok.edge_node, ok.device),
        ("plant1", Kind::DData, "n1", Some("d1"))
    );
    let node = Topic::parse("spBv1.0/g/NBIRTH/n").unwrap().unwrap();
    assert_eq!((node.kind, node.device), (Kind::NBirth, None));
    for skipped in [
        "spBv1.0/STATE/host",
        "spBv1.0/g/NCMD/n",
        "spBv1.0/g/DCMD/n/d",
    ] {
        assert_eq!(Topic::parse(skipped).unwrap(), None, "{skipped}");
    }
    let long = format!("spBv1.0/{}/NDATA/n", "g".repeat(MAX_ID_BYTES + 1));
    for bad in [
        "spBv1.0/g/NDATA",
        "spBv1.0/g/NDATA/n/d",
        "spBv1.0/g/DDATA/n",
        "spBv1.0/g/DDATA/n/d/x",
        "spBv1.0/g/XDATA/n",
        "spBv1.0//NDATA/n",
        "spAv1.0/g/NDATA/n",
        "spBv1.0",
        long.as_str(),
    ] {
        assert_eq!(Topic::parse(bad).unwrap_err().reason, "bad_topic", "{bad}");
    }
}

#[test]
fn metric_values_read_by_their_data_type() {
    use session::number;
    let n = |dt, v| number(dt, Some(&v)).map_err(|r| r.reason);
    assert_eq!(
        n(t::INT8, Value::Int(0xff)),
        Ok(crate::pipeline::Num::Int(-1))
    );
    assert_eq!(
        n(t::INT16, Value::Int(0xffff_fffe)),
        Ok(crate::pipeline::Num::Int(-2))
    );
    assert_eq!(
        n(t::INT32, Value::Int(u32::MAX)),
        Ok(crate::pipeline::Num::Int(-1))
    );
    assert_eq!(
        n(t::INT64, Value::Long(u64::MAX)),
        Ok(crate::pipeline::Num::Int(-1))
    );
    assert_eq!(
        n(t::UINT32, Value::Long(u64::from(u32::MAX))),
        Ok(crate::pipeline::Num::Int(4294967295))
    );
    assert_eq!(n(t::UINT64, Value::Long(u64::MAX)), Err("out_of_range"));
    assert_eq!(
        n(t::BOOLEAN, Value::Boolean(true)),
        Ok(crate::pipeline::Num::Int(1))
    );
    assert_eq!(n(t::FLOAT, Value::Float(f32::NAN)), Err("out_of_range"));
    assert_eq!(
        n(t::DOUBLE, Value::Double(2.5)),
        Ok(crate::pipeline::Num::Float(2.5))
    );
    assert_eq!(n(t::DOUBLE, Value::String("x".into())), Err("wrong_type"));
    assert_eq!(n(t::STRING, Value::String("x".into())), Err("not_numeric"));
    assert_eq!(n(t::DATASET, Value::DataSet(vec![])), Err("not_numeric"));
    assert_eq!(
        number(t::INT32, None).map_err(|r| r.reason),
        Err("missing_value")
    );
}

const BIRTH: &str = "spBv1.0/plant1/NBIRTH/n1";
const DBIRTH: &str = "spBv1.0/plant1/DBIRTH/n1/d1";
const NDATA: &str = "spBv1.0/plant1/NDATA/n1";
const DDATA: &str = "spBv1.0/plant1/DDATA/n1/d1";
const NDEATH: &str = "spBv1.0/plant1/NDEATH/n1";

fn node_birth(bd: u64, temperature: f64, ts: u64) -> Vec<u8> {
    payload(
        Some(0),
        vec![
            bd_seq(bd),
            m(
                Some("Node Control/Rebirth"),
                9,
                t::BOOLEAN,
                Value::Boolean(false),
                ts,
            ),
            m(
                Some("Temperature"),
                1,
                t::DOUBLE,
                Value::Double(temperature),
                ts,
            ),
        ],
    )
}

fn device_birth(seq: u64, speed: u32, running: bool, ts: u64) -> Vec<u8> {
    payload(
        Some(seq),
        vec![
            m(Some("Speed"), 2, t::INT32, Value::Int(speed), ts),
            m(Some("Running"), 3, t::BOOLEAN, Value::Boolean(running), ts),
            m(
                Some("Label"),
                4,
                t::STRING,
                Value::String("line one".into()),
                ts,
            ),
        ],
    )
}

fn speed(seq: u64, v: u32, ts: u64) -> Vec<u8> {
    payload(Some(seq), vec![m(None, 2, t::INT32, Value::Int(v), ts)])
}

#[test]
fn a_simulated_edge_node_gives_what_the_spec_rules_give_by_hand() {
    let mut host = Host::new(vec![spec("")]);
    let mut oracle = Oracle::default();
    let minute = 60_000;

    // Session 1 (bdSeq 0): births with current values, then report by exception.
    assert!(matches!(
        host.send(BIRTH, node_birth(0, 20.0, 1000), 1000)[..],
        [Outcome::Applied { .. }]
    ));
    oracle.value("n1//Temperature", 1000, 20.0);
    // The String metric is refused (one dead letter), the rest of the DBIRTH counts.
    assert_eq!(
        host.send(DBIRTH, device_birth(1, 100, true, 1000), 1000),
        vec![Outcome::DeadLetter {
            reason: "not_numeric"
        }]
    );
    oracle.value("n1/d1/Speed", 1000, 100.0);
    oracle.value("n1/d1/Running", 1000, 1.0);
    host.send(DDATA, speed(2, 120, 20_000), 20_000);
    oracle.value("n1/d1/Speed", 20_000, 120.0);
    let temp = payload(
        Some(3),
        vec![m(None, 1, t::DOUBLE, Value::Double(22.5), 30_000)],
    );
    host.send(NDATA, temp, 30_000);
    oracle.value("n1//Temperature", 30_000, 22.5);
    let two = payload(
        Some(4),
        vec![
            m(None, 2, t::INT32, Value::Int(80), 70_000),
            m(None, 3, t::BOOLEAN, Value::Boolean(false), 75_000),
        ],
    );
    host.send(DDATA, two, 75_000);
    oracle.value("n1/d1/Speed", 70_000, 80.0);
    oracle.value("n1/d1/Running", 75_000, 0.0);
    assert!(host.engine.take_notices().is_empty());
    // seq 5 is lost (QoS 0): the gap is noticed, the values of seq 6 still count.
    host.send(DDATA, speed(6, 90, 90_000), 90_000);
    oracle.value("n1/d1/Speed", 90_000, 90.0);
    let notices = host.engine.take_notices();
    assert_eq!(notices.len(), 1);
    assert_eq!(notices[0].kind, NoticeKind::SeqGap { last: 4, got: 6 });
    assert_eq!(
        (notices[0].group.as_str(), notices[0].edge_node.as_str()),
        ("plant1", "n1")
    );

    // A late will of an earlier connection (bdSeq 7) is ignored; the session's own ends it
    // at its time of receipt, and every metric with it.
    assert_eq!(
        host.send(NDEATH, payload(None, vec![bd_seq(7)]), 95_000),
        vec![Outcome::Filtered]
    );
    host.send(NDEATH, payload(None, vec![bd_seq(0)]), 100_000);
    for key in ["n1//Temperature", "n1/d1/Speed", "n1/d1/Running"] {
        oracle.death(key, 100_000);
    }
    // Stale until the next BIRTH: DATA is refused, and asks for a rebirth.
    assert_eq!(
        host.send(DDATA, speed(7, 1, 101_000), 101_000),
        vec![Outcome::DeadLetter {
            reason: "no_session"
        }]
    );
    assert_eq!(host.engine.take_notices()[0].kind, NoticeKind::NoSession);

    // Session 2 (bdSeq 1), after a restart of the host that saw no BIRTH being retained.
    host.restart();
    host.send(BIRTH, node_birth(1, 25.0, 130_000), 130_000);
    oracle.value("n1//Temperature", 130_000, 25.0);
    host.send(DBIRTH, device_birth(1, 50, true, 130_000), 130_000);
    oracle.value("n1/d1/Speed", 130_000, 50.0);
    oracle.value("n1/d1/Running", 130_000, 1.0);
    host.restart();
    // Store-and-forward: what the node measured while it was cut off, as historical values,
    // after the live ones; they land in the earlier window and are carried into the next.
    let stored = payload(
        Some(2),
        vec![
            historical(m(None, 2, t::INT32, Value::Int(60), 105_000)),
            historical(m(None, 2, t::INT32, Value::Int(70), 115_000)),
        ],
    );
    assert!(matches!(
        host.send(DDATA, stored.clone(), 131_000)[..],
        [Outcome::Applied { .. }]
    ));
    oracle.value("n1/d1/Speed", 105_000, 60.0);
    oracle.value("n1/d1/Speed", 115_000, 70.0);
    // The same message again (a broker redelivery), and the buffer flushed a second time in
    // a new message: each value counts once.
    assert_eq!(host.send(DDATA, stored, 131_500), vec![Outcome::Duplicate]);
    let again = payload(
        Some(3),
        vec![historical(m(None, 2, t::INT32, Value::Int(70), 115_000))],
    );
    assert_eq!(host.send(DDATA, again, 132_000), vec![Outcome::Duplicate]);
    assert!(
        host.engine.take_notices().is_empty(),
        "a redelivery is no gap"
    );
    // Report by exception after the restart: the alias still resolves.
    host.send(DDATA, speed(4, 55, 150_000), 150_000);
    oracle.value("n1/d1/Speed", 150_000, 55.0);

    for key in ["n1//Temperature", "n1/d1/Speed", "n1/d1/Running"] {
        let got = host.windows(key);
        let want = oracle.windows(key, minute);
        assert_eq!(
            got.keys().collect::<Vec<_>>(),
            want.keys().collect::<Vec<_>>(),
            "{key}"
        );
        for (start, w) in &want {
            assert!(
                same(&got[start], w),
                "{key} at {start}: {} != {w}",
                got[start]
            );
        }
    }
    // Spot-check one window by hand: Speed in [60s, 120s) carries 120 in until 70s, then 80,
    // 90, dead from 100s to 105s, then the stored 60 and 70:
    // (120*10 + 80*20 + 90*10 + 60*10 + 70*5) / 55 seconds.
    let want =
        (120.0 * 10_000.0 + 80.0 * 20_000.0 + 90.0 * 10_000.0 + 60.0 * 10_000.0 + 70.0 * 5000.0)
            / 55_000.0;
    assert_eq!(
        host.windows("n1/d1/Speed")[&minute]["twa"],
        serde_json::json!(want)
    );
    // Bookkeeping metrics are not values; the String one never was.
    assert!(host.store.state.keys().all(|(_, k)| !k.ends_with(b"bdSeq")));
    assert!(
        host.store
            .state
            .keys()
            .all(|(_, k)| !k.ends_with(b"Rebirth"))
    );
    assert!(host.store.state.keys().all(|(_, k)| !k.ends_with(b"Label")));
}

#[test]
fn data_before_any_birth_and_unknown_aliases_are_dead_letters_that_ask_for_a_rebirth() {
    let mut host = Host::new(vec![spec("")]);
    assert_eq!(
        host.send(DDATA, speed(1, 5, 1000), 1000),
        vec![Outcome::DeadLetter {
            reason: "no_session"
        }]
    );
    host.send(BIRTH, node_birth(0, 1.0, 1000), 1000);
    // A DDATA of a device with no DBIRTH.
    assert_eq!(
        host.send(DDATA, speed(1, 5, 2000), 2000),
        vec![Outcome::DeadLetter {
            reason: "no_session"
        }]
    );
    // An alias the NBIRTH did not name: refused, the known one beside it counts.
    let mixed = payload(
        Some(2),
        vec![
            m(None, 77, t::DOUBLE, Value::Double(1.0), 3000),
            m(None, 1, t::DOUBLE, Value::Double(2.0), 3000),
        ],
    );
    assert_eq!(
        host.send(NDATA, mixed, 3000),
        vec![Outcome::DeadLetter {
            reason: "unknown_metric"
        }]
    );
    let kinds: Vec<_> = host
        .engine
        .take_notices()
        .into_iter()
        .map(|n| n.kind)
        .collect();
    assert_eq!(
        kinds,
        [
            NoticeKind::NoSession,
            NoticeKind::NoSession,
            NoticeKind::UnknownMetric { alias: Some(77) }
        ]
    );
    let temp = host.windows("n1//Temperature");
    assert_eq!(temp.values().next().unwrap()["count"], serde_json::json!(2));
    // Malformed protobuf and a wrong topic shape: dead letters with their reasons.
    assert_eq!(
        host.send(NDATA, vec![0x0a, 0x05, 1], 4000),
        vec![Outcome::DeadLetter {
            reason: "not_sparkplug"
        }]
    );
    assert_eq!(
        host.send("spBv1.0/plant1/NDATA/n1/extra", speed(3, 1, 4000), 4000),
        vec![Outcome::DeadLetter {
            reason: "bad_topic"
        }]
    );
    let letters: Vec<_> = host.engine.take_checkpoint().batch.dead_letters;
    assert!(
        letters
            .iter()
            .all(|d| !d.reason.is_empty() && !d.detail.is_empty())
    );
}

#[test]
fn the_metrics_list_takes_only_the_metrics_it_names() {
    let mut host = Host::new(vec![spec("metrics = [\"Speed\"]")]);
    host.send(BIRTH, node_birth(0, 20.0, 1000), 1000);
    // The String metric is not listed: no dead letter for it.
    let out = host.send(DBIRTH, device_birth(1, 100, true, 1000), 1000);
    assert!(matches!(out[..], [Outcome::Applied { .. }]), "{out:?}");
    host.checkpoint();
    let keys: Vec<_> = host
        .store
        .state
        .keys()
        .map(|(_, k)| k[8..].to_vec())
        .collect();
    assert_eq!(keys, [b"n1/d1/Speed".to_vec()]);
}

#[test]
fn session_entries_stay_small_and_a_birth_replaces_the_tables() {
    let mut host = Host::new(vec![spec("")]);
    let many: Vec<Metric> = (0..500u64)
        .map(|i| {
            m(
                Some(&format!("m{i}")),
                100 + i,
                t::INT32,
                Value::Int(1),
                1000,
            )
        })
        .chain([bd_seq(0)])
        .collect();
    host.send(BIRTH, payload(Some(0), many), 1000);
    host.checkpoint();
    let entries = host.store.sparkplug.len();
    assert_eq!(
        entries,
        1 + 2 * 500 + 1,
        "a node entry, two per metric, bdSeq's"
    );
    for ((p, k), e) in &host.store.sparkplug {
        let bytes = p.len() + 1 + k.len() + postcard::to_stdvec(e).unwrap().len();
        assert!(bytes < 200, "{bytes}");
    }
    // A new NBIRTH with one metric: the old tables are gone.
    host.send(
        BIRTH,
        payload(
            Some(0),
            vec![bd_seq(1), m(Some("x"), 1, t::INT32, Value::Int(1), 2000)],
        ),
        2000,
    );
    host.checkpoint();
    assert_eq!(host.store.sparkplug.len(), 1 + 2 + 1);
}

/// The broker delivers a whole stretch again (the agent was killed after logging it and
/// before its PUBACKs left), and the stretch holds the node's death and next BIRTH: the old
/// session's DATA now arrives after the new session began, and must still count once. A
/// node that restarts its `bdSeq` (no persistent counter) and sends new values still
/// counts them; a message without any timestamp, delivered again later, counts once.
#[test]
fn a_stretch_delivered_again_past_the_next_birth_counts_once() {
    let mut host = Host::new(vec![spec("")]);
    let stretch = [
        (BIRTH, node_birth(0, 20.0, 1000), 1000),
        (DBIRTH, device_birth(1, 100, true, 1000), 1000),
        (DDATA, speed(2, 120, 20_000), 20_000),
        (DDATA, speed(3, 130, 25_000), 25_000),
        (NDEATH, payload(None, vec![bd_seq(0)]), 30_000),
        (BIRTH, node_birth(1, 21.0, 40_000), 40_000),
        (DBIRTH, device_birth(1, 140, true, 40_000), 40_000),
    ];
    for (topic, body, at) in &stretch {
        host.send(topic, body.clone(), *at);
    }
    host.checkpoint();
    let once = host.windows("n1/d1/Speed");
    assert_eq!(once[&0]["count"], 4, "100, 120, 130, 140: {once:?}");
    // Again from the first DATA on (the BIRTHs before it were acknowledged), in order,
    // after a restart and past the new session's BIRTH: nothing counts.
    host.restart();
    for (topic, body, at) in &stretch[2..] {
        let got = host.send(topic, body.clone(), at + 50_000);
        assert!(
            got.iter()
                .all(|o| matches!(o, Outcome::Duplicate | Outcome::Filtered)
                    || matches!(
                        o,
                        Outcome::DeadLetter {
                            reason: "not_numeric"
                        }
                    )),
            "{topic}: {got:?}"
        );
    }
    assert_eq!(host.windows("n1/d1/Speed"), once);

    // The node restarts from bdSeq 0 and seq 2 again: new timestamps, new values, new IDs.
    host.send(NDEATH, payload(None, vec![bd_seq(1)]), 100_000);
    host.send(BIRTH, node_birth(0, 22.0, 110_000), 110_000);
    host.send(DBIRTH, device_birth(1, 150, true, 110_000), 110_000);
    assert!(matches!(
        host.send(DDATA, speed(2, 160, 115_000), 115_000)[..],
        [Outcome::Applied { .. }]
    ));

    // No timestamp anywhere: the time of receipt stands in for the value's time, but not
    // for its ID, so a later delivery of the same bytes is the same event.
    let bare = Payload {
        timestamp: None,
        metrics: vec![Metric {
            alias: Some(2),
            value: Some(Value::Int(170)),
            ..Default::default()
        }],
        seq: Some(3),
        uuid: None,
    }
    .encode_to_vec();
    assert!(matches!(
        host.send(DDATA, bare.clone(), 116_000)[..],
        [Outcome::Applied { .. }]
    ));
    assert_eq!(host.send(DDATA, bare, 117_000), vec![Outcome::Duplicate]);
}

/// A stretch delivered again from its NBIRTH on, the node's death included, while the
/// host has moved on (the session dead, then a new one): each message is skipped whole, as
/// the same message. Taken again, the BIRTH would revive the old session, its DATA would
/// seem to jump in `seq`, and its NDEATH would cut every metric a second time, at the time
/// of the second receipt; and DATA arriving while the session is dead would be refused.
#[test]
fn a_message_delivered_again_changes_no_session() {
    let mut host = Host::new(vec![spec("")]);
    let stretch = [
        (BIRTH, node_birth(0, 20.0, 1000), 1000),
        (DBIRTH, device_birth(1, 100, true, 1000), 1000),
        (DDATA, speed(2, 120, 20_000), 20_000),
        (NDEATH, payload(None, vec![bd_seq(0)]), 30_000),
    ];
    for (topic, body, at) in &stretch {
        host.send(topic, body.clone(), *at);
    }
    host.engine.take_notices();
    let once = host.windows("n1/d1/Speed");
    // Dead now: the DATA and the death again, then the whole stretch again.
    host.restart();
    for (topic, body, at) in stretch[2..].iter().chain(&stretch) {
        let got = host.send(topic, body.clone(), at + 35_000);
        let want = if *topic == NDEATH {
            Outcome::Filtered // a death of no live session
        } else {
            Outcome::Duplicate
        };
        assert_eq!(got, vec![want], "{topic}");
    }
    assert_eq!(host.windows("n1/d1/Speed"), once);
    assert!(host.engine.take_notices().is_empty());
    // The next session goes on as if nothing came twice.
    host.send(BIRTH, node_birth(1, 21.0, 70_000), 70_000);
    host.send(DBIRTH, device_birth(1, 140, true, 70_000), 70_000);
    let mut oracle = Oracle::default();
    oracle.value("n1/d1/Speed", 1000, 100.0);
    oracle.value("n1/d1/Speed", 20_000, 120.0);
    oracle.death("n1/d1/Speed", 30_000);
    oracle.value("n1/d1/Speed", 70_000, 140.0);
    let got = host.windows("n1/d1/Speed");
    let want = oracle.windows("n1/d1/Speed", 60_000);
    assert_eq!(got.len(), want.len());
    for (start, w) in &want {
        assert!(same(&got[start], w), "{start}: {} != {w}", got[start]);
    }
}

/// A message ID is bounded as a value's is: on a topic whose IDs escape past `max_id_len`,
/// no ledger entry exceeds it and the values are refused; the same bytes again are the same
/// dead letter, not a second one (nothing counted, nothing panics).
#[test]
fn a_message_id_past_max_id_len_enters_no_ledger() {
    let mut host = Host::new(vec![spec("max_id_len = 64")]);
    let node = "n%".repeat(20); // 80 bytes escaped
    let birth = format!("spBv1.0/plant1/NBIRTH/{node}");
    let data = format!("spBv1.0/plant1/NDATA/{node}");
    for (round, want) in [
        Outcome::DeadLetter {
            reason: "id_too_long",
        },
        Outcome::Duplicate,
    ]
    .into_iter()
    .enumerate()
    {
        host.send(&birth, node_birth(0, 20.0, 1000), 1000);
        let temp = payload(
            Some(1),
            vec![m(None, 1, t::DOUBLE, Value::Double(21.0), 2000)],
        );
        assert_eq!(host.send(&data, temp, 2000), vec![want], "round {round}");
    }
    host.checkpoint();
    assert!(host.store.dedup.keys().all(|(_, id)| id.len() <= 64));
    assert!(host.store.state.is_empty());
}
