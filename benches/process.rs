//! Processor throughput (issue 3): events/s from a pre-filled replay log into the sled
//! store, checkpointing every 1000 events, for 1k and 100k distinct keys; peak RSS; and
//! bytes written to disk per event. Run: `cargo bench --bench process`.
//!
//! Figures are printed, never asserted. Each case runs in a fresh directory under
//! `target/` (a real disk, not tmpfs) with the real fsync seam.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

/// Counts live heap bytes, to tell what the process holds from what the allocator keeps.
struct Counting;
static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards every call to the system allocator unchanged; only counts sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(l) };
        if !p.is_null() {
            let now = LIVE.fetch_add(l.size(), Ordering::Relaxed) + l.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { System.dealloc(p, l) };
        LIVE.fetch_sub(l.size(), Ordering::Relaxed);
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        let q = unsafe { System.realloc(p, l, new) };
        if !q.is_null() {
            LIVE.fetch_sub(l.size(), Ordering::Relaxed);
            let now = LIVE.fetch_add(new, Ordering::Relaxed) + new;
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        q
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

use cairn::fsio;
use cairn::log::{Log, LogOptions};
use cairn::pipeline::spec::*;
use cairn::processor::Processor;
use cairn::store::Store;

fn spec() -> PipelineSpec {
    cairn::config::pipeline_from_toml(
        r#"name = "balances"
topics = ["payments/#"]
event_id = "/id"
key = "/account"
value = "/amount"
aggregate = "sum"
output_topic = "balances/{key}"
max_key_len = 64
max_keys = 10000000"#,
    )
    .unwrap()
}

fn proc_status(field: &str) -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn write_bytes() -> u64 {
    let s = std::fs::read_to_string("/proc/self/io").unwrap_or_default();
    s.lines()
        .find(|l| l.starts_with("write_bytes:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// xorshift: a fixed, seeded stream; no randomness in what is measured.
fn next(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

fn run(events: u64, keys: u64, cache: u64, every: u64) {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/bench-process");
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).unwrap();
    let opts = LogOptions {
        dir: root.join("log"),
        segment_size: 64 << 20,
        max_size: 8 << 30,
        max_payload: 1 << 16,
    };
    let (mut log, _) = Log::open(opts, fsio::real()).unwrap();
    let mut rng = 0x9E37_79B9_7F4A_7C15u64;
    for i in 0..events {
        let key = next(&mut rng) % keys;
        let payload = format!(
            r#"{{"id":"E{i}","account":"acct-{key:06}","amount":{}}}"#,
            next(&mut rng) % 10_000
        );
        log.append(
            1_700_000_000_000 + i,
            "payments/in",
            payload.as_bytes(),
            1,
            false,
        )
        .unwrap();
        if i % 10_000 == 9_999 {
            log.commit().unwrap();
        }
    }
    log.commit().unwrap();

    let store = Store::open(&root.join("store"), cache, fsio::real()).unwrap();
    let mut proc = Processor::open(store, vec![spec()]).unwrap();
    let w0 = write_bytes();
    let t0 = Instant::now();
    let stats = proc.replay(&log, every, &|| 0, &mut |_| {}).unwrap();
    let secs = t0.elapsed().as_secs_f64();
    let written = write_bytes() - w0;
    println!(
        "process: {events:>7} events, {keys:>6} keys: {:>8.0} events/s, {:>4} checkpoints, {:>6.0} disk bytes written/event, peak RSS {} MiB, RSS {} MiB (heap {} MiB live, {} MiB at peak, ledger index {} MiB), store {} MiB on disk",
        stats.records as f64 / secs,
        stats.checkpoints,
        written as f64 / events as f64,
        proc_status("VmHWM:") / 1024,
        proc_status("VmRSS:") / 1024,
        LIVE.load(Ordering::Relaxed) >> 20,
        PEAK.load(Ordering::Relaxed) >> 20,
        proc.store().ledger_index_bytes() >> 20,
        proc.store().size_on_disk() >> 20,
    );
    // As if the broker took every output: the outbox drains, as it does in the agent.
    let waiting: Vec<(u64, String)> = proc
        .store()
        .outbox_from(0)
        .map(|r| r.map(|(seq, o)| (seq, o.id)).unwrap())
        .collect();
    for (seq, id) in &waiting {
        proc.store().outbox_delete(*seq, id).unwrap();
    }
    println!(
        "         after the outbox drained ({} outputs): RSS {} MiB (heap {} MiB live)",
        waiting.len(),
        proc_status("VmRSS:") / 1024,
        LIVE.load(Ordering::Relaxed) >> 20,
    );
    if std::env::var("CAIRN_BENCH_EXIT").is_ok() {
        std::process::exit(0); // for heap profilers: what is live now shows as "leaked"
    }
    drop(proc);
    let _ = std::fs::remove_dir_all(&root);
}

fn main() {
    // `cargo bench` passes `--bench`; ignore arguments. One case of your own:
    // CAIRN_BENCH_CASE=events,keys,cache_bytes,checkpoint_records.
    if let Ok(case) = std::env::var("CAIRN_BENCH_CASE") {
        let v: Vec<u64> = case.split(',').map(|x| x.trim().parse().unwrap()).collect();
        run(v[0], v[1], v[2], v[3]);
        return;
    }
    run(100_000, 1_000, 16 << 20, 1000);
    run(100_000, 100_000, 16 << 20, 1000);
}
