//! Engine throughput of issue 15's machine-telemetry job against a single-sum pipeline
//! over the same inputs: the pure engine over the in-memory store, checkpointing every
//! 1000 events, so the figure is the pipeline's own cost (parse, filter, windows,
//! aggregates, outputs) without sled or fsync. Run: `cargo bench --bench pipelines`.
//! Figures are printed, never asserted.

use std::time::Instant;

use cairn::model::Record;
use cairn::pipeline::engine::Engine;
use cairn::pipeline::memory::MemState;

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

fn main() {
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
