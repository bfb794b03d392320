//! Replay-log throughput with the real fsync seam: `cargo bench --bench log`.
//!
//! Appends 100-byte payloads, committing every 1, 10, 100 and 1000 records (each commit is
//! one `fdatasync`), then reads the largest log back sequentially. Each phase stops after a
//! time budget, so the whole run stays near 25 s. The data lives under `target/` (a real
//! disk; /tmp may be tmpfs, where fsync costs nothing) and is removed at the end.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use cairn::fsio;
use cairn::log::{Log, LogOptions};

const PAYLOAD_BYTES: usize = 100;
const PHASE_BUDGET: Duration = Duration::from_secs(5);
const MAX_RECORDS_PER_PHASE: u64 = 3_000_000;

fn options(dir: &Path) -> LogOptions {
    LogOptions {
        dir: dir.to_path_buf(),
        segment_size: 64 << 20,
        max_size: 4 << 30,
        max_payload: 256 << 10,
    }
}

fn append_phase(dir: &Path, batch: u64) -> (u64, u64) {
    let (mut log, _) = Log::open(options(dir), fsio::real()).expect("open log");
    let payload = [0x5Au8; PAYLOAD_BYTES];
    let start = Instant::now();
    let mut records = 0;
    let mut commits = 0;
    while start.elapsed() < PHASE_BUDGET && records < MAX_RECORDS_PER_PHASE {
        for i in 0..batch {
            log.append(1_700_000_000_000 + i, "bench/dev/1", &payload, 1, false)
                .expect("append");
        }
        log.commit().expect("commit");
        records += batch;
        commits += 1;
    }
    let secs = start.elapsed().as_secs_f64();
    let bytes = log.size_bytes();
    println!(
        "append  commit every {batch:>4}: {:>10.0} records/s {:>8.2} MB/s {:>8.0} commits/s  ({records} records, {:.1} MB, {} segments)",
        records as f64 / secs,
        bytes as f64 / secs / 1e6,
        commits as f64 / secs,
        bytes as f64 / 1e6,
        log.segments().len(),
    );
    (records, bytes)
}

fn read_phase(dir: &Path, expected: u64, bytes: u64) {
    let (log, _) = Log::open(options(dir), fsio::real()).expect("open log");
    let start = Instant::now();
    let mut records = 0u64;
    for r in log.read_from(0).expect("reader") {
        let r = r.expect("record");
        assert_eq!(r.offset, records);
        records += 1;
    }
    let secs = start.elapsed().as_secs_f64();
    assert_eq!(records, expected);
    println!(
        "read    sequential          : {:>10.0} records/s {:>8.2} MB/s  ({records} records, page cache warm)",
        records as f64 / secs,
        bytes as f64 / secs / 1e6,
    );
}

fn main() {
    let root: PathBuf = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("target")
        .join(format!("bench-log-{}", std::process::id()));
    std::fs::create_dir_all(&root).expect("create bench dir under target/");
    println!(
        "cairn log bench: {PAYLOAD_BYTES}-byte payloads, real fdatasync, dir {}",
        root.display()
    );
    let mut largest = (PathBuf::new(), 0, 0);
    for batch in [1u64, 10, 100, 1000] {
        let dir = root.join(format!("commit-every-{batch}"));
        let (records, bytes) = append_phase(&dir, batch);
        if records > largest.1 {
            largest = (dir, records, bytes);
        }
    }
    read_phase(&largest.0, largest.1, largest.2);
    std::fs::remove_dir_all(&root).expect("remove bench dir");
}
