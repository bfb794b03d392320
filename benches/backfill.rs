//! Backfill throughput (issue 15, `start = "earliest"`): a pipeline added to a store whose
//! log holds `RECORDS` records, backfilled through the processor over the real log and sled
//! store with a checkpoint (one transaction and fsync) every `checkpoint.max_records`,
//! against a replay of the same log by the same pipeline from an empty store. Both read the
//! log from disk and commit the same way, so the difference is what a backfill adds (its
//! cursor, its own clock, slices). Run: `cargo bench --bench backfill`. Figures are
//! printed, never asserted.

use std::path::Path;
use std::time::Instant;

use cairn::fsio;
use cairn::log::{Log, LogOptions};
use cairn::pipeline::spec::PipelineSpec;
use cairn::processor::Processor;
use cairn::store::Store;

const RECORDS: u64 = 200_000;
const MAX_RECORDS: u64 = 5_000;
const SLICE: u64 = 512;

fn spec(name: &str, start: &str) -> PipelineSpec {
    cairn::config::pipeline_from_toml(&format!(
        r#"name = "{name}"
topics = ["pay/#"]
format = "delimited"
event_id = "0"
key = "1"
value = "2"
aggregate = "sum"
output_topic = "{name}/{{key}}"
start = "{start}""#
    ))
    .unwrap()
}

fn open(dir: &Path, specs: Vec<PipelineSpec>) -> Processor {
    let store = Store::open(&dir.join("store"), 16 << 20, fsio::real()).unwrap();
    Processor::open_with(store, specs, &[], None).unwrap()
}

fn main() {
    let dir = tempfile::tempdir().unwrap();
    let opts = LogOptions {
        dir: dir.path().join("log"),
        segment_size: 64 << 20,
        max_size: 1 << 32,
        max_payload: 1 << 16,
    };
    let mut log = Log::open(opts, fsio::real()).unwrap().0;
    for i in 0..RECORDS {
        // One business duplicate in twenty.
        let id = if i % 20 == 19 { i - 10 } else { i };
        let payload = format!("E{id}/K{}/{}", id % 1000, id % 97);
        log.append(1_000 + i, "pay/x", payload.as_bytes(), 1, false)
            .unwrap();
    }
    log.commit().unwrap();

    // Replay: the pipeline from an empty store, as recovery runs it.
    let replayed = dir.path().join("replayed");
    let mut proc = open(&replayed, vec![spec("sums", "latest")]);
    let start = Instant::now();
    proc.replay(&log, MAX_RECORDS, &|| 0, &mut |_| {}).unwrap();
    let replay_s = start.elapsed().as_secs_f64();
    drop(proc);

    // Backfill: the log processed live by another pipeline, then `sums` added.
    let live = dir.path().join("backfilled");
    let mut proc = open(&live, vec![spec("base", "latest")]);
    proc.replay(&log, MAX_RECORDS, &|| 0, &mut |_| {}).unwrap();
    drop(proc);
    let mut proc = open(
        &live,
        vec![spec("base", "latest"), spec("sums", "earliest")],
    );
    let start = Instant::now();
    while proc.backfill_slice(&log, SLICE).unwrap().is_some() {
        if proc.pending_records() >= MAX_RECORDS {
            proc.checkpoint(0).unwrap();
        }
    }
    proc.checkpoint(0).unwrap();
    let backfill_s = start.elapsed().as_secs_f64();
    let same = proc
        .store()
        .states(Some("sums"))
        .map(|r| r.unwrap())
        .map(|(_, k, st)| (k, st.value_json()))
        .eq(open(&replayed, vec![spec("sums", "latest")])
            .store()
            .states(Some("sums"))
            .map(|r| r.unwrap())
            .map(|(_, k, st)| (k, st.value_json())));

    let rate = |s: f64| RECORDS as f64 / s;
    println!(
        "backfill: {RECORDS} records (1,000 keys, 5 % duplicates), checkpoint every {MAX_RECORDS}"
    );
    println!(
        "  replay from an empty store: {:>9.0} records/s",
        rate(replay_s)
    );
    println!(
        "  backfill of a new pipeline: {:>9.0} records/s ({:.2}x replay); same state: {same}",
        rate(backfill_s),
        replay_s / backfill_s
    );
}
