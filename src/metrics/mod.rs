//! Figures for operators: what the agent is doing, in Prometheus text format 0.0.4
//! (`/metrics`) and as the JSON `cairn status` reads (`/status.json`), served on a loopback
//! address by a tiny HTTP/1.1 server.
//!
//! Files: `render.rs` (the table of families from one copy, and its text), `status.rs`
//! (the JSON from the same table), `server.rs` (the bounded server), `parse.rs` (text read
//! back, for benchmarks).
//!
//! The agent owns an `Arc<Metrics>` and updates it from its loop (at each log commit, each
//! checkpoint, and every [`REFRESH_INTERVAL`] for the gauges); the server thread only reads
//! a copy. Nothing here feeds back into processing: the figures may use the wall clock.
//!
//! The server is bounded like everything else (invariant 7): one accepting thread that hands
//! each connection to a handler thread of its own, requests of at most
//! [`MAX_REQUEST_BYTES`], and one deadline of [`REQUEST_DEADLINE`] per connection for reading
//! the request head *and* writing the response. A per-read timeout alone is not enough: a
//! client that sends one byte every 1.5 s never trips a 2 s read timeout, and it held the
//! single-threaded listener for as long as it liked (issue 10). At most [`MAX_HANDLERS`]
//! connections are served at once; when they are all taken, a new connection takes the place
//! of the oldest one that has not sent its request yet, so idle connections cannot keep
//! scrapes out (8 idle local connections got most scrapes refused, issue 27); only when every
//! one is busy answering is the newcomer answered `503`. Handler threads are bounded by
//! [`MAX_HANDLER_THREADS`] (a cut connection's thread ends at once).
//!
//! It binds loopback addresses only, and answers only requests whose `Host` is a loopback
//! address or `localhost` (the figures carry no authentication; without the check a web page
//! could read them through DNS rebinding: its own name, resolved to 127.0.0.1). A port that
//! another process holds never stops the agent: the server retries the bind with a backoff
//! on its own thread, warns (at most once a minute), and says so in
//! `cairn_metrics_listener_up` and `cairn_metrics_bind_failures_total` once it is bound
//! (issue 27: any local user could stop the agent from starting by holding the port).

use std::collections::BTreeMap;
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

mod parse;
mod render;
mod server;
mod status;

pub use parse::{Sample, parse};
pub use render::{Family, families, render, render_figures, text};
pub use server::{serve, serve_local};

/// The running agent's status socket in `data_dir`: `/metrics` and `/status.json` as on the
/// `[metrics] listen` address, always on, for `cairn status` (issue 32). A unix socket rather
/// than a loopback port on by default: it belongs to one data directory, so `status` reaches
/// the agent of its own config even when two agents run on one box; it needs no port, which
/// another local user could hold (issue 27); and who may read it is who may read the data
/// directory, where a loopback port answers every local user.
pub fn local_socket(data_dir: &std::path::Path) -> std::path::PathBuf {
    data_dir.join("cairn.sock")
}
pub use status::{status, status_json};

/// How often the agent recomputes gauges that cost a tree walk (outbox depth, store size).
pub(crate) const REFRESH_INTERVAL: Duration = Duration::from_millis(250);
/// Longest request head the server reads before answering 431.
pub(crate) const MAX_REQUEST_BYTES: usize = 8 * 1024;
/// Time a connection gets from accept to the last byte of the response: a slow client is
/// cut when it runs out, however it trickles its bytes.
pub(crate) const REQUEST_DEADLINE: Duration = Duration::from_secs(2);
/// Connections served at once (a thread each). Scrapers are few; the cap bounds the threads
/// that slow or idle clients can pin, each for at most [`REQUEST_DEADLINE`], and an idle one
/// gives its place up to a newcomer (see the module docs).
pub(crate) const MAX_HANDLERS: usize = 16;
/// Handler threads alive at once: the served connections plus cut ones whose thread has not
/// ended yet (it ends as soon as it sees its socket shut).
pub(crate) const MAX_HANDLER_THREADS: usize = 2 * MAX_HANDLERS;
/// First wait before the bind is tried again, doubled up to [`BIND_RETRY_MAX`].
pub(crate) const BIND_RETRY_MIN: Duration = Duration::from_millis(250);
pub(crate) const BIND_RETRY_MAX: Duration = Duration::from_secs(5);
/// While the bind keeps failing, one warning per this interval.
pub(crate) const BIND_WARN_EVERY: Duration = Duration::from_secs(60);
/// Outbox age marks kept (one per checkpoint that added outputs); beyond it the newest mark
/// absorbs new entries, which only overstates their age.
const MAX_OUTBOX_MARKS: usize = 4096;

/// Upper bounds (seconds) of the duration histograms' buckets.
pub(crate) const DURATION_BUCKETS: [f64; 14] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// A duration histogram with the last observation.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Histogram {
    /// Non-cumulative counts per bucket of [`DURATION_BUCKETS`]; `+Inf` is `count`.
    pub buckets: [u64; DURATION_BUCKETS.len()],
    pub sum_seconds: f64,
    pub count: u64,
    pub last_seconds: f64,
}

impl Histogram {
    pub(crate) fn observe(&mut self, d: Duration) {
        let s = d.as_secs_f64();
        if let Some(i) = DURATION_BUCKETS.iter().position(|&b| s <= b) {
            self.buckets[i] += 1;
        }
        self.sum_seconds += s;
        self.count += 1;
        self.last_seconds = s;
    }
}

/// Per-pipeline figures (from the engine's progress: the checkpoint plus what was applied
/// since).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PipelineFigures {
    pub keys: u64,
    pub dedup_entries: u64,
    pub applied: u64,
    pub duplicates: u64,
    pub dead_letters: u64,
    pub outputs: u64,
    /// Inputs skipped by the pipeline's `where` filter.
    pub filtered: u64,
    /// Records a backfilling pipeline has still to take before it joins live processing
    /// (`start = "earliest"`); 0 when it is live.
    pub backfill_left: u64,
}

/// The uplink connection (issue 13).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UplinkFigures {
    pub connected: bool,
    /// Wall clock of the last change (connected or lost); 0 before the first.
    pub since_ms: u64,
    /// Connections lost.
    pub reconnects: u64,
}

/// One result sink as operators see it (issue 29).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SinkFigures {
    pub name: String,
    /// `connected`, `down` or `refusing`.
    pub state: &'static str,
    /// Wall clock of the last change of state; 0 before the first.
    pub since_ms: u64,
    /// Outbox entries routed to this sink that it has not settled yet, exactly, and their
    /// payload bytes.
    pub waiting: u64,
    pub waiting_bytes: u64,
    /// Wall-clock age of the oldest of them, since its checkpoint (0 when none waits).
    pub oldest_age_ms: u64,
    /// Configured pipelines whose results go to this sink (0: it gets none).
    pub pipelines: u64,
    /// Results sent and settled.
    pub sent: u64,
    pub acked: u64,
    /// Acknowledged per second, recent.
    pub drain_rate: f64,
    /// Refusals by reason name (MQTT 5 reason codes).
    pub refused: BTreeMap<&'static str, u64>,
    /// The last refusal: reason code and name.
    pub refusing: Option<(u8, &'static str)>,
    /// A JetStream sink's stream: its duplicate window (issue 30), once connected.
    pub duplicate_window: Option<std::time::Duration>,
}

/// Everything exported. The agent writes it; [`render`] reads a copy.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Figures {
    // Ingest and publish (counters since start).
    pub received: u64,
    pub acked: u64,
    pub oversize_refused: u64,
    /// Inputs let go (not appended, not acknowledged) while held ones filled their bound;
    /// the broker re-sends them on the next connection.
    pub held_let_go: u64,
    pub published: u64,
    pub pubacked: u64,
    /// Results published before the checkpoint that commits them (issue 14).
    pub published_early: u64,
    pub reconnects: u64,
    pub connected: bool,
    /// The input broker's own count of messages it dropped since it started (mosquitto's
    /// `$SYS/broker/publish/messages/dropped`, issue 26), as last reported; `None` until a
    /// value came.
    pub broker_dropped: Option<u64>,
    /// Whether the broker lets us watch that count (`$SYS` on and readable).
    pub broker_dropped_available: bool,
    pub backpressure: bool,
    /// Records logged and not processed yet: processing waits while the outbox is full.
    pub records_behind: u64,
    // Log.
    pub log_commits: u64,
    pub log_commit: Histogram,
    /// Turns of the event loop, from a wake-up to the next wait.
    pub loop_turn: Histogram,
    pub log_size_bytes: u64,
    /// `log.max_size`: at it, retention deletes processed segments, then input waits.
    pub log_max_bytes: u64,
    pub log_segments: u64,
    pub log_first_offset: u64,
    pub log_next_offset: u64,
    /// Processed segments deleted inside `retention` because the log was short of room.
    pub log_segments_evicted: u64,
    // Checkpoints.
    pub checkpoints: u64,
    pub checkpoint_failures: u64,
    pub checkpoint: Histogram,
    pub checkpoint_id: u64,
    pub checkpoint_next_offset: u64,
    /// Wall clock of the last completed checkpoint (0: none yet).
    pub checkpoint_at_ms: u64,
    pub records_unmatched: u64,
    // Store.
    pub store_bytes: u64,
    /// Bytes of keys and values in the checkpoint trees at the last estimate (0: none yet).
    pub store_live_bytes: u64,
    pub outbox_entries: u64,
    /// Wall-clock age of the oldest outbox entry (0 when empty).
    pub outbox_oldest_age_ms: u64,
    /// The outbox as the uplink's queue (issue 13): its chunks' bytes on disk, its bound
    /// (`outbox.max_size`), results acknowledged per second lately, and the estimated time
    /// to empty it at the current net drain (`None` while it is not shrinking).
    pub outbox_bytes: u64,
    pub outbox_max_bytes: u64,
    /// `outbox.max_entries`: at it, processing waits.
    pub outbox_max_entries: u64,
    pub outbox_drain_rate: f64,
    pub outbox_drain_eta_seconds: Option<f64>,
    /// `None` without `[uplink]`.
    pub uplink: Option<UplinkFigures>,
    /// Every sink, `local` first.
    pub sinks: Vec<SinkFigures>,
    pub pipelines: BTreeMap<String, PipelineFigures>,
    // The store's own bounds (as of the last checkpoint).
    pub dead_letters_stored: u64,
    pub dead_letters_pruned_age: u64,
    pub dead_letters_pruned_count: u64,
    pub ledger_index_bytes: u64,
    pub ledger_unindexed_chunks: u64,
    // Savepoints and replayability.
    pub savepoints: u64,
    pub savepoint_failures: u64,
    /// Savepoints taken because the newest one held a log short of room.
    pub savepoints_for_room: u64,
    /// Times the savepoint floor was let go (a savepoint for room failed).
    pub savepoint_floor_released: u64,
    /// Savepoint files kept (at most `[savepoint] keep`) and their bytes.
    pub savepoint_files: u64,
    pub savepoint_bytes: u64,
    /// The newest savepoint, if any: (checkpoint id, next_offset, created_at_ms).
    pub savepoint: Option<(u64, u64, u64)>,
    pub source_replayable: bool,
    // Recovery at start.
    pub replay_records: u64,
    pub replay_seconds: f64,
    // The metrics listener itself (issue 27).
    /// Whether the listener is bound (it retries while another process holds the port).
    pub metrics_listener_up: bool,
    /// Binds that failed since start.
    pub metrics_bind_failures: u64,
    /// The process's resident memory (`/proc/self/statm`), at the last refresh.
    pub resident_memory_bytes: u64,
    /// Sparkplug B sessions and the host (issue 31).
    pub sparkplug: SparkplugFigures,
}

/// What Sparkplug sessions reported to the live loop, and what the host did (counters since
/// start).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SparkplugFigures {
    /// `seq` jumps: messages of an edge node lost (QoS 0).
    pub seq_gaps: u64,
    /// Metrics (by alias or name) no BIRTH of the session named.
    pub unknown_metrics: u64,
    /// DATA or DBIRTH of a node or device with no live session.
    pub no_session: u64,
    /// NCMD `Node Control/Rebirth` requests sent (`[sparkplug] rebirth`).
    pub rebirths_sent: u64,
    /// With `[sparkplug] host_id`: 1 while the broker holds our STATE as online.
    pub host_online: bool,
}

/// The shared figures, plus the server's address, stop flag and connections.
#[derive(Debug, Default)]
pub struct Metrics {
    figures: Mutex<Figures>,
    /// (end outbox sequence, wall ms): entries below `end` were committed by `ms`.
    outbox_marks: Mutex<std::collections::VecDeque<(u64, u64)>>,
    server: Mutex<Option<SocketAddr>>,
    /// The unix socket [`serve_local`] listens on.
    local: Mutex<Option<std::path::PathBuf>>,
    stop: AtomicBool,
    /// The connections being served (at most [`MAX_HANDLERS`]).
    conns: Mutex<server::Conns>,
    /// Handler threads running now (at most [`MAX_HANDLER_THREADS`]).
    threads: AtomicUsize,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding the lock leaves plain numbers behind; keep serving them.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Metrics {
    pub fn new() -> Arc<Metrics> {
        Arc::new(Metrics::default())
    }

    pub fn update(&self, f: impl FnOnce(&mut Figures)) {
        f(&mut lock(&self.figures))
    }

    pub fn snapshot(&self) -> Figures {
        lock(&self.figures).clone()
    }

    /// Outbox entries with sequence below `end_seq` exist since `at_ms` (wall clock).
    pub(crate) fn note_outbox_committed(&self, end_seq: u64, at_ms: u64) {
        let mut marks = lock(&self.outbox_marks);
        let full = marks.len() >= MAX_OUTBOX_MARKS;
        match marks.back_mut() {
            Some(last) if last.0 >= end_seq => {}
            Some(last) if full => last.0 = end_seq,
            _ => marks.push_back((end_seq, at_ms)),
        }
    }

    /// Set the outbox gauges from its depth and its first sequence number.
    pub(crate) fn set_outbox(&self, entries: u64, first_seq: Option<u64>, now_ms: u64) {
        let age = {
            let mut marks = lock(&self.outbox_marks);
            match first_seq {
                None => {
                    marks.clear();
                    0
                }
                Some(first) => {
                    while marks.front().is_some_and(|m| m.0 <= first) {
                        marks.pop_front();
                    }
                    marks
                        .front()
                        .map_or(0, |&(_, at)| now_ms.saturating_sub(at))
                }
            }
        };
        self.update(|f| {
            f.outbox_entries = entries;
            f.outbox_oldest_age_ms = age;
        });
    }

    /// Wall-clock age at `now_ms` of outbox entry `seq`: since the checkpoint that committed
    /// it, by the marks the outbox's own oldest age uses ([`Metrics::set_outbox`]); 0 if no
    /// mark covers it. O(log marks).
    pub(crate) fn outbox_entry_age_ms(&self, seq: u64, now_ms: u64) -> u64 {
        let marks = lock(&self.outbox_marks);
        let i = marks.partition_point(|m| m.0 <= seq);
        marks.get(i).map_or(0, |&(_, at)| now_ms.saturating_sub(at))
    }

    /// Where [`serve`] listens (after it bound).
    pub(crate) fn server_addr(&self) -> Option<SocketAddr> {
        *lock(&self.server)
    }

    /// Stop the server threads (each exits after its current connection); the status socket
    /// is removed, so `cairn status` does not try a socket nobody serves.
    pub(crate) fn stop_server(&self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(addr) = self.server_addr() {
            // Wake the blocking accept; it sees the flag and returns.
            let _ = TcpStream::connect_timeout(&addr, Duration::from_millis(200));
        }
        if let Some(path) = lock(&self.local).take() {
            let _ = std::os::unix::net::UnixStream::connect(&path);
            let _ = std::fs::remove_file(&path);
        }
    }
}

/// The process's resident set in bytes, from `/proc/self/statm` (0 where there is none).
pub fn resident_memory_bytes() -> u64 {
    let Ok(statm) = std::fs::read_to_string("/proc/self/statm") else {
        return 0;
    };
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    // SAFETY: sysconf only reads a constant of the system.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    pages.saturating_mul(u64::try_from(page).unwrap_or(4096))
}

/// Bytes of the files in `dir` and its subdirectories (two levels: sled's `blobs/`).
/// Unreadable entries count as 0: this is a gauge, not an audit.
pub fn dir_size_bytes(dir: &std::path::Path) -> u64 {
    fn walk(dir: &std::path::Path, depth: u32) -> u64 {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return 0;
        };
        entries
            .flatten()
            .map(|e| match e.metadata() {
                Ok(m) if m.is_dir() && depth > 0 => walk(&e.path(), depth - 1),
                Ok(m) if m.is_file() => m.len(),
                _ => 0,
            })
            .sum()
    }
    walk(dir, 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn render_then_parse_gives_back_the_figures_with_help_and_type_for_each() {
        let mut f = Figures {
            received: 7,
            checkpoint_id: 3,
            ..Default::default()
        };
        f.checkpoint.observe(Duration::from_millis(3));
        f.pipelines.insert(
            "a\"b".into(),
            PipelineFigures {
                applied: 5,
                ..Default::default()
            },
        );
        let text = render_figures(&f, 1000);
        let samples = parse(&text);
        let get = |n: &str| samples.iter().find(|s| s.name == n).map(|s| s.value);
        assert_eq!(get("cairn_received_total"), Some(7.0));
        assert_eq!(get("cairn_checkpoint_id"), Some(3.0));
        assert_eq!(get("cairn_checkpoint_duration_seconds_count"), Some(1.0));
        let applied = samples
            .iter()
            .find(|s| s.name == "cairn_applied_total")
            .unwrap();
        assert_eq!(applied.labels["pipeline"], "a\"b");
        assert_eq!(applied.value, 5.0);
        for line in text.lines().filter(|l| l.starts_with("# TYPE")) {
            let name = line.split_whitespace().nth(2).unwrap();
            assert!(text.contains(&format!("# HELP {name} ")), "{name}");
            assert!(name.starts_with("cairn_"), "{name}");
        }
    }

    #[test]
    fn the_brokers_dropped_count_is_a_sample_only_once_known() {
        let mut f = Figures::default();
        let samples = parse(&render_figures(&f, 1000));
        let get = |s: &[Sample], n: &str| s.iter().find(|s| s.name == n).map(|s| s.value);
        assert_eq!(get(&samples, "cairn_broker_dropped_messages"), None);
        assert_eq!(get(&samples, "cairn_broker_dropped_available"), Some(0.0));
        f.broker_dropped = Some(2000);
        f.broker_dropped_available = true;
        let samples = parse(&render_figures(&f, 1000));
        assert_eq!(get(&samples, "cairn_broker_dropped_messages"), Some(2000.0));
        assert_eq!(get(&samples, "cairn_broker_dropped_available"), Some(1.0));
        let status = status_json(&families(&f, 1000));
        assert_eq!(
            status["broker_dropped"],
            serde_json::json!({"available": true, "total": 2000})
        );
    }

    #[test]
    fn outbox_age_follows_the_oldest_remaining_entry() {
        let m = Metrics::new();
        m.note_outbox_committed(10, 1_000);
        m.note_outbox_committed(20, 5_000);
        m.set_outbox(15, Some(3), 9_000);
        assert_eq!(m.snapshot().outbox_oldest_age_ms, 8_000);
        m.set_outbox(5, Some(12), 9_000);
        assert_eq!(m.snapshot().outbox_oldest_age_ms, 4_000);
        m.set_outbox(0, None, 9_000);
        assert_eq!(m.snapshot().outbox_oldest_age_ms, 0);
    }

    #[test]
    fn an_entrys_age_is_since_the_checkpoint_that_committed_it() {
        let m = Metrics::new();
        m.note_outbox_committed(10, 1_000);
        m.note_outbox_committed(20, 5_000);
        assert_eq!(m.outbox_entry_age_ms(0, 9_000), 8_000);
        assert_eq!(m.outbox_entry_age_ms(9, 9_000), 8_000);
        assert_eq!(m.outbox_entry_age_ms(10, 9_000), 4_000);
        assert_eq!(m.outbox_entry_age_ms(19, 9_000), 4_000);
        assert_eq!(m.outbox_entry_age_ms(20, 9_000), 0, "not committed yet");
        assert_eq!(
            m.outbox_entry_age_ms(5, 500),
            0,
            "a clock stepped back: 0, not negative"
        );
        // The outbox's first entry moved past the first mark: later entries keep theirs.
        m.set_outbox(3, Some(12), 9_000);
        assert_eq!(m.outbox_entry_age_ms(15, 10_000), 5_000);
    }
}
