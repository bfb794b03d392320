//! The dedup ledger (issue 33): lookups and inserts per second through the store's own
//! ledger API (no broker, no log, no engine), and memory, at 100k, 1M and 10M event IDs in
//! the dedup window. Run: `cargo bench --bench ledger`.
//!
//! Each level runs in a child process of its own (so that RSS is that level's alone) on a
//! fresh store under `target/` (a real disk) with the real fsync seam, the agent's allocator
//! and the shipped bounds (`ledger_index_max` 64MiB, `cache_size` as shipped, checkpoints of
//! 20,000 records):
//!
//! 1. **Fill**: N events with fresh IDs, one per millisecond of record time, so that a
//!    window of N ms holds N IDs. The rate of each tenth is printed: a cliff shows there.
//! 2. **Steady**: 400,000 more events (`CAIRN_LEDGER_STEADY`) at that window, so each
//!    checkpoint expires about as many IDs as it adds. Every event is a lookup
//!    (`ReadState::dedup`, after the checkpoint's own batch, as the engine does) and, unless
//!    it is a duplicate, an insert (the checkpoint's commit and fsync). One event in 100
//!    re-sends an ID seen a few thousand events before (a broker redelivery): a lookup that
//!    must find it.
//!
//! Printed per level: the steady rate (events/s), CPU per event (all threads; on a shared
//! box the wall-clock rate moves with everyone else's load, CPU much less), the time in
//! lookups and in commits per event, the index's own bytes and bytes per ID, RSS (from
//! `/proc/self/statm`) and what the level added to it, the store on disk, and the fill's
//! rate per tenth. The reference level (the first) runs again after the others; the ratio
//! of the last level to it (mean of its runs), by events/s and by events per CPU-second, is
//! checked against issue 33's 0.8. Figures are printed, never asserted.
//!
//! `CAIRN_LEDGER_BESIDE=1` commits as the agent does (issue 33, item 2): each checkpoint's
//! commit and fsync on a thread of its own while the events go on, their lookups reading the
//! checkpoint in flight first, then the store; a checkpoint waits for the one before. Each
//! level then also prints how long the steady events' store lookups took: p99, p99.9, the
//! longest, and how many took over a millisecond (a lookup waits while a commit holds the
//! store's lock).
//!
//! `CAIRN_LEDGER_IDS` (comma-separated) replaces the levels, e.g. `100000,1000000` for a
//! quick run. `CAIRN_LEDGER_CACHE` (bytes) replaces the shipped `storage.cache_size`.
//! `CAIRN_LEDGER_FILL_BUDGET` (seconds, default 900) stops a fill that takes
//! longer, and reports how far it got (a ledger with a cliff would otherwise never finish).

use std::process::Command;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

/// The agent's allocator and options (`src/main.rs`): what the ledger costs in `cairn run`.
/// glibc's malloc, the default here, spent a third of the 10M run in its free lists.
#[global_allocator]
static ALLOC: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[unsafe(export_name = "_rjem_malloc_conf")]
static MALLOC_CONF: Conf = Conf(
    c"narenas:1,tcache:false,tcache_max:4096,tcache_nslots_small_max:32,tcache_nslots_large:4,background_thread:true,dirty_decay_ms:200,muzzy_decay_ms:0,slab_sizes:1-1280:1".as_ptr(),
);

/// jemalloc reads its options through a pointer to a C string.
#[repr(transparent)]
struct Conf(*const std::ffi::c_char);

// SAFETY: the pointer is to a static C string that is never written.
unsafe impl Sync for Conf {}

use cairn::fsio;
use cairn::model::{PipelineProgress, Progress};
use cairn::pipeline::engine::{Batch, Checkpoint, ReadState};
use cairn::store::{Store, StoreBounds};

/// Events measured at each level once its window is full (`CAIRN_LEDGER_STEADY` changes it).
const STEADY: u64 = 400_000;

fn steady_events() -> u64 {
    std::env::var("CAIRN_LEDGER_STEADY")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(STEADY)
}
/// Records per checkpoint (the shipped `checkpoint.max_records`).
const PER_CHECKPOINT: u64 = 20_000;
/// One event in this many re-sends a recent ID.
const DUP_EVERY: u64 = 100;
/// The first record time (ms), a date in 2023 like the ones a box stamps.
const T0: u64 = 1_700_000_000_000;
const PIPELINE: &str = "bench";

/// CPU seconds this process has used, all threads (`/proc/self/stat`: utime + stime, in
/// clock ticks of 10 ms). On a shared box the wall-clock rate moves with everyone else's
/// load; the CPU per event does much less.
fn cpu_s() -> f64 {
    let s = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // The fields after the command name, which is in parentheses and may hold spaces.
    let rest = s.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<u64> = rest
        .split_whitespace()
        .map(|v| v.parse().unwrap_or(0))
        .collect();
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the name.
    (f.get(11).copied().unwrap_or(0) + f.get(12).copied().unwrap_or(0)) as f64 / 100.0
}

fn rss_bytes() -> u64 {
    let s = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = s
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

/// The event ID of event `i`: a device and a sequence number, 24 bytes, as sensors send.
fn id_of(i: u64) -> String {
    format!("dev-{:05}-seq-{:010}", i % 50_000, i)
}

struct Level {
    store: Arc<Store>,
    /// `CAIRN_LEDGER_BESIDE`: the checkpoint committing beside the events, and its commit
    /// (returning its seconds).
    beside: bool,
    inflight: Option<(Arc<Checkpoint>, JoinHandle<f64>)>,
    /// Each store lookup's time in µs, once `timing` is on (the steady events).
    timing: bool,
    waits: Vec<f32>,
    progress: Progress,
    batch: Batch,
    window_ms: u64,
    /// Next event number (also its offset and its record time above `T0`).
    next: u64,
    lookups: u64,
    found: u64,
    /// Time spent in store lookups and in commits (with their fsync).
    lookup_s: f64,
    commit_s: f64,
}

impl Level {
    fn open(dir: &std::path::Path, window_ms: u64) -> Level {
        let cache = std::env::var("CAIRN_LEDGER_CACHE")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(
                || match cairn::config::keys::row("storage.cache_size").default {
                    cairn::config::keys::Def::Bytes(b) => b,
                    _ => panic!("storage.cache_size has a size for its default"),
                },
            );
        let store =
            Store::open_with(dir, cache, fsio::real(), StoreBounds::default()).expect("store");
        let mut progress = store.progress().expect("progress");
        progress.pipelines = vec![PipelineProgress {
            name: PIPELINE.into(),
            ..Default::default()
        }];
        Level {
            store: Arc::new(store),
            beside: std::env::var_os("CAIRN_LEDGER_BESIDE").is_some(),
            inflight: None,
            timing: false,
            waits: Vec::new(),
            progress,
            batch: Batch::default(),
            window_ms,
            next: 0,
            lookups: 0,
            found: 0,
            lookup_s: 0.0,
            commit_s: 0.0,
        }
    }

    /// One event: look its ID up, as the engine does (this checkpoint's batch first, then
    /// the store), and record it unless it is a duplicate within the window.
    fn event(&mut self) {
        let i = self.next;
        self.next += 1;
        let now = T0 + i;
        let id = if i % DUP_EVERY == DUP_EVERY - 1 && i > 10_000 {
            id_of(i - 1_000 - (i * 7_919) % 5_000)
        } else {
            id_of(i)
        };
        self.lookups += 1;
        let in_flight = || {
            let (cp, _) = self.inflight.as_ref()?;
            cp.batch.dedup.get(0, PIPELINE, &id)
        };
        let seen = match self.batch.dedup.get(0, PIPELINE, &id).or_else(in_flight) {
            Some(t) => Some(t),
            None => {
                let t = Instant::now();
                let seen = self.store.dedup(PIPELINE, &id).expect("lookup");

                let took = t.elapsed().as_secs_f64();
                self.lookup_s += took;
                if self.timing {
                    self.waits.push((took * 1e6) as f32);
                }
                seen
            }
        };
        if seen.is_some_and(|t| now - t < self.window_ms) {
            self.found += 1;
        } else {
            self.batch.dedup.insert(0, PIPELINE, &id, now);
        }
        self.batch.records += 1;
        if self.batch.records == PER_CHECKPOINT {
            self.checkpoint();
        }
    }

    fn checkpoint(&mut self) {
        let now = T0 + self.next - 1;
        let mut batch = std::mem::take(&mut self.batch);
        if let Some(cutoff) = now.checked_sub(self.window_ms) {
            batch
                .dedup_expired_at_or_before
                .push((PIPELINE.into(), cutoff));
        }
        self.progress.checkpoint_id += 1;
        self.progress.next_offset = self.next;
        self.progress.log_clock_ms = now;
        self.progress.records += batch.records;
        let cp = Checkpoint {
            progress: self.progress.clone(),
            batch,
        };
        if !self.beside {
            let t = Instant::now();
            self.store.commit(&cp, 0).expect("commit");
            self.commit_s += t.elapsed().as_secs_f64();
            return;
        }
        self.settle();
        let cp = Arc::new(cp);
        let (store, mine) = (self.store.clone(), cp.clone());
        let commit = std::thread::spawn(move || {
            let t = Instant::now();
            store.commit(&mine, 0).expect("commit");
            t.elapsed().as_secs_f64()
        });
        self.inflight = Some((cp, commit));
    }

    /// Wait for the checkpoint committing beside, if any.
    fn settle(&mut self) {
        if let Some((_, commit)) = self.inflight.take() {
            self.commit_s += commit.join().expect("the commit thread");
        }
    }
}

/// The `q` quantile of `v` (sorted here), 0 if empty.
fn quantile(v: &mut [f32], q: f64) -> f32 {
    v.sort_unstable_by(f32::total_cmp);
    let i = ((v.len() as f64 * q) as usize).min(v.len().saturating_sub(1));
    v.get(i).copied().unwrap_or(0.0)
}

/// Run one level in this process and print its figures as one `level ...` line.
fn run_level(n: u64, budget_s: f64) {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("target/bench-ledger")
        .join(n.to_string());
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).unwrap();
    let rss0 = rss_bytes();
    let mut l = Level::open(&root.join("store"), n);
    let t0 = Instant::now();
    let tenth = (n / 10).max(PER_CHECKPOINT);
    let mut t_mark = Instant::now();
    let mut mark = 0;
    let mut tenths = Vec::new();
    let mut complete = true;
    while l.next < n {
        l.event();
        let at_checkpoint = l.next % PER_CHECKPOINT == 0;
        if l.next % tenth == 0 || (at_checkpoint && t0.elapsed().as_secs_f64() > budget_s) {
            tenths.push((l.next - mark) as f64 / t_mark.elapsed().as_secs_f64());
            (t_mark, mark) = (Instant::now(), l.next);
            if t0.elapsed().as_secs_f64() > budget_s && l.next < n {
                complete = false;
                break;
            }
        }
    }
    let fill_s = t0.elapsed().as_secs_f64();
    let filled = l.next;
    let (lookups0, found0) = (l.lookups, l.found);
    let (lookup_s0, commit_s0) = (l.lookup_s, l.commit_s);
    // A fill the budget stopped measures what it can in a tenth of the budget more.
    let t1 = Instant::now();
    let cpu1 = cpu_s();
    let mut steady = 0;
    let steady_max = steady_events();
    l.timing = true;
    while steady < steady_max {
        l.event();
        steady += 1;
        if !complete && steady % 1000 == 0 && t1.elapsed().as_secs_f64() > budget_s / 10.0 {
            break;
        }
    }
    l.settle();
    let steady_s = t1.elapsed().as_secs_f64();
    let waits_1ms = l.waits.iter().filter(|&&w| w > 1_000.0).count();
    let wait_p99 = quantile(&mut l.waits, 0.99);
    let wait_p999 = quantile(&mut l.waits, 0.999);
    let wait_max = l.waits.last().copied().unwrap_or(0.0);
    let cpu_us = (cpu_s() - cpu1) * 1e6 / steady as f64;
    let rate = steady as f64 / steady_s;
    let lookup_us = (l.lookup_s - lookup_s0) * 1e6 / steady as f64;
    let commit_us = (l.commit_s - commit_s0) * 1e6 / steady as f64;
    let index = l.store.ledger_index_bytes() as u64;
    let entries = l
        .store
        .progress()
        .unwrap()
        .pipelines
        .first()
        .map_or(0, |p| p.dedup_entries);
    let rss = rss_bytes();
    let disk = l.store.size_on_disk();
    let tenths: Vec<String> = tenths.iter().map(|r| format!("{r:.0}")).collect();
    println!(
        "level {n} filled {filled} complete {complete} fill_s {fill_s:.1} steady_rate {rate:.0} \
         index {index} entries {entries} rss {rss} rss0 {rss0} disk {disk} dups {} of {} \
         lookup_us {lookup_us:.2} commit_us {commit_us:.2} cpu_us {cpu_us:.2} \
         wait_p99 {wait_p99:.0} wait_p999 {wait_p999:.0} wait_max {wait_max:.0} \
         waits_1ms {waits_1ms} timed {} tenths {}",
        l.found - found0,
        l.lookups - lookups0,
        l.waits.len(),
        tenths.join(",")
    );
    drop(l);
    let _ = std::fs::remove_dir_all(&root);
}

fn field<'a>(line: &'a str, name: &str) -> &'a str {
    let mut it = line.split_whitespace();
    while let Some(w) = it.next() {
        if w == name {
            return it.next().unwrap_or("");
        }
    }
    ""
}

fn main() {
    let budget_s: f64 = std::env::var("CAIRN_LEDGER_FILL_BUDGET")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(900.0);
    if let Ok(n) = std::env::var("CAIRN_LEDGER_LEVEL") {
        run_level(n.parse().expect("CAIRN_LEDGER_LEVEL"), budget_s);
        return;
    }
    let levels: Vec<u64> = std::env::var("CAIRN_LEDGER_IDS")
        .unwrap_or_else(|_| "100000,1000000,10000000".into())
        .split(',')
        .map(|s| s.trim().parse().expect("CAIRN_LEDGER_IDS: numbers"))
        .collect();
    println!(
        "ledger: {} steady events per level, checkpoints of {PER_CHECKPOINT}, 1 in \
         {DUP_EVERY} a redelivered ID; shipped bounds (ledger_index_max 64MiB)",
        steady_events()
    );
    println!(
        "{:>10} {:>9} {:>13} {:>10} {:>9} {:>9} {:>10} {:>8} {:>9} {:>9} {:>9}  fill rate per tenth (events/s)",
        "IDs",
        "fill s",
        "steady ev/s",
        "CPU µs/ev",
        "lookup µs",
        "commit µs",
        "index MiB",
        "B/ID",
        "RSS MiB",
        "+RSS MiB",
        "disk MiB"
    );
    // The reference level runs again after the others, and its two runs are averaged: on a
    // shared box the load drifts over the minutes the larger levels take.
    let mut order: Vec<u64> = levels.clone();
    if levels.len() > 1 {
        order.push(levels[0]);
    }
    let mut results: Vec<(u64, f64, f64)> = Vec::new();
    for &n in &order {
        let out = Command::new(std::env::current_exe().unwrap())
            .env("CAIRN_LEDGER_LEVEL", n.to_string())
            .output()
            .expect("run a level");
        let text = String::from_utf8_lossy(&out.stdout);
        let Some(line) = text.lines().find(|l| l.starts_with("level ")) else {
            println!(
                "{n:>10} failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
            continue;
        };
        let num = |k: &str| field(line, k).parse::<f64>().unwrap_or(0.0);
        let mib = |b: f64| b / (1u64 << 20) as f64;
        let entries = num("entries").max(1.0);
        let note = if field(line, "complete") == "true" {
            String::new()
        } else {
            format!(
                " (fill stopped at {} IDs by the budget)",
                field(line, "filled")
            )
        };
        println!(
            "{n:>10} {:>9.1} {:>13.0} {:>10.2} {:>9.2} {:>9.2} {:>10.1} {:>8.2} {:>9.1} {:>9.1} {:>9.0}  {}{note}",
            num("fill_s"),
            num("steady_rate"),
            num("cpu_us"),
            num("lookup_us"),
            num("commit_us"),
            mib(num("index")),
            num("index") / entries,
            mib(num("rss")),
            mib(num("rss") - num("rss0")),
            mib(num("disk")),
            field(line, "tenths"),
        );
        if std::env::var_os("CAIRN_LEDGER_BESIDE").is_some() {
            println!(
                "{:>10} beside: store lookups p99 {:.0} µs, p99.9 {:.0} µs, longest {:.0} µs; \
                 {} of {} over 1 ms",
                "",
                num("wait_p99"),
                num("wait_p999"),
                num("wait_max"),
                field(line, "waits_1ms"),
                field(line, "timed"),
            );
        }
        results.push((n, num("steady_rate"), num("cpu_us")));
    }
    let (first, last) = (levels[0], levels[levels.len() - 1]);
    let of = |n: u64| -> Option<(f64, f64)> {
        let runs: Vec<&(u64, f64, f64)> = results.iter().filter(|r| r.0 == n).collect();
        (!runs.is_empty()).then(|| {
            let k = runs.len() as f64;
            (
                runs.iter().map(|r| r.1).sum::<f64>() / k,
                runs.iter().map(|r| r.2).sum::<f64>() / k,
            )
        })
    };
    if let (true, Some((rate0, cpu0)), Some((rate1, cpu1))) =
        (levels.len() > 1, of(first), of(last))
    {
        let verdict = |r: f64| if r >= 0.8 { "PASS" } else { "FAIL" };
        let wall = rate1 / rate0;
        let cpu = cpu0 / cpu1;
        println!(
            "ratio {last} IDs / {first} IDs (reference: mean of its runs): events/s {wall:.2} \
             {}, events per CPU-second {cpu:.2} {} (target >= 0.80)",
            verdict(wall),
            verdict(cpu)
        );
    }
}
