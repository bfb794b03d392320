//! Sparkplug B throughput (issue 31): metric values per second through the engine and the
//! sled store (checkpoint every 1000 records, with the real fsync), against JSON events per
//! second through the same pipeline shape. Run: `cargo bench --bench sparkplug`.
//!
//! Both pipelines aggregate `[twa, min, max, count]` over 1-minute windows of 1,000 keys.
//! The Sparkplug records are DDATA messages of `METRICS_PER_MESSAGE` values by alias (one
//! NBIRTH and 10 DBIRTHs of 100 metrics first); the JSON records are one event each. Figures
//! are printed, never asserted. Each case runs in a fresh directory under `target/`.

use std::time::Instant;

use cairn::fsio;
use cairn::model::Record;
use cairn::pipeline::Engine;
use cairn::pipeline::sparkplug::proto::{Metric, Payload, Value, datatype};
use cairn::store::Store;
use prost::Message;

const DEVICES: u64 = 10;
const METRICS: u64 = 100;
const METRICS_PER_MESSAGE: u64 = 10;
const CHECKPOINT_RECORDS: u64 = 1000;
const T0: u64 = 1_700_000_000_000;

fn spec(first: &str, body: &str) -> cairn::pipeline::spec::PipelineSpec {
    cairn::config::pipeline_from_toml(&format!(
        "name = \"bench\"\naggregate = [\"{first}\", \"min\", \"max\", \"count\"]\n\
         window = {{ size = \"1m\" }}\ndedup_window = \"1h\"\nmax_keys = 1000000\n{body}"
    ))
    .unwrap()
}

fn sparkplug_records(values: u64) -> Vec<Record> {
    let payload = |seq: u64, metrics: Vec<Metric>| {
        Payload {
            timestamp: Some(T0),
            metrics,
            seq: Some(seq % 256),
            uuid: None,
        }
        .encode_to_vec()
    };
    let rec = |offset: usize, topic: String, payload: Vec<u8>| Record {
        offset: offset as u64,
        received_at_ms: T0 + 10_000_000,
        topic,
        payload,
        qos: 1,
        retain: false,
    };
    let mut out = Vec::new();
    let birth = vec![Metric {
        name: Some("bdSeq".into()),
        value: Some(Value::Long(0)),
        ..Default::default()
    }];
    out.push(rec(0, "spBv1.0/g/NBIRTH/n".into(), payload(0, birth)));
    for d in 0..DEVICES {
        let ms = (0..METRICS)
            .map(|m| Metric {
                name: Some(format!("m{m}")),
                alias: Some(d * METRICS + m),
                timestamp: Some(T0),
                datatype: Some(datatype::DOUBLE),
                value: Some(Value::Double(0.0)),
                ..Default::default()
            })
            .collect();
        out.push(rec(
            out.len(),
            format!("spBv1.0/g/DBIRTH/n/d{d}"),
            payload(d + 1, ms),
        ));
    }
    for i in 0..values / METRICS_PER_MESSAGE {
        let seq = DEVICES + 1 + i;
        let d = i % DEVICES;
        let ms = (0..METRICS_PER_MESSAGE)
            .map(|k| {
                let m = (i * 7 + k * 13) % METRICS;
                Metric {
                    alias: Some(d * METRICS + m),
                    timestamp: Some(T0 + i * 10 + k),
                    value: Some(Value::Double((i % 97) as f64 / 2.0)),
                    ..Default::default()
                }
            })
            .collect();
        out.push(rec(
            out.len(),
            format!("spBv1.0/g/DDATA/n/d{d}"),
            payload(seq, ms),
        ));
    }
    out
}

fn json_records(events: u64) -> Vec<Record> {
    (0..events)
        .map(|i| {
            let key = format!("n/d{}/m{}", i % DEVICES, (i * 7) % METRICS);
            let body = serde_json::json!({"id": i, "k": key, "v": (i % 97) as f64 / 2.0,
                "ts": T0 + i * 10});
            Record {
                offset: i,
                received_at_ms: T0 + 10_000_000,
                topic: "in/x".into(),
                payload: body.to_string().into_bytes(),
                qos: 1,
                retain: false,
            }
        })
        .collect()
}

/// Records through the engine into a fresh store, checkpointing every 1000; returns the
/// seconds taken.
fn run(name: &str, spec: cairn::pipeline::spec::PipelineSpec, records: &[Record]) -> f64 {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let store = Store::open(&dir.path().join(name), 16 << 20, fsio::real()).unwrap();
    let mut engine = Engine::new(vec![spec], store.progress().unwrap());
    let began = Instant::now();
    for rec in records {
        engine.apply(&store, rec).unwrap();
        if engine.pending_records() >= CHECKPOINT_RECORDS {
            store.commit(&engine.take_checkpoint(), 0).unwrap();
        }
    }
    store.commit(&engine.take_checkpoint(), 0).unwrap();
    let secs = began.elapsed().as_secs_f64();
    let c = &engine.progress().pipelines[0].counters;
    assert_eq!(c.dead_letters, 0, "{name}: {c:?}");
    secs
}

fn main() {
    let values: u64 = std::env::var("CAIRN_BENCH_VALUES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200_000);
    let sp = sparkplug_records(values);
    let sp_secs = run(
        "sparkplug",
        spec(
            "twa",
            "topics = [\"spBv1.0/#\"]\nformat = \"sparkplug_b\"\n\
             key = \"{edge_node}/{device}/{metric}\"\noutput_topic = \"o/{key}/{window_start}\"",
        ),
        &sp,
    );
    let js = json_records(values);
    let js_secs = run(
        "json",
        spec(
            "avg",
            "topics = [\"in/#\"]\nevent_id = \"/id\"\nkey = \"/k\"\nvalue = \"/v\"\n\
             event_time = \"/ts\"\noutput_topic = \"o/{key}/{window_start}\"",
        ),
        &js,
    );
    println!(
        "sparkplug: {values} metric values in {} messages: {:.0} values/s ({:.0} messages/s)",
        sp.len(),
        values as f64 / sp_secs,
        sp.len() as f64 / sp_secs
    );
    println!(
        "json:      {values} events: {:.0} events/s (twa replaced by avg, which JSON pipelines take)",
        values as f64 / js_secs
    );
}
