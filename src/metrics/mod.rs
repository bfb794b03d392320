//! Figures for operators: what the agent is doing, in Prometheus text format 0.0.4, served
//! on a loopback address by a tiny single-threaded HTTP/1.1 server.
//!
//! The agent owns an `Arc<Metrics>` and updates it from its loop (at each log commit, each
//! checkpoint, and every [`REFRESH_INTERVAL`] for the gauges); the server thread only reads
//! a copy. Nothing here feeds back into processing: the figures may use the wall clock.
//!
//! The server is bounded like everything else (invariant 7): one accepting thread that hands
//! each connection to a handler thread of its own, at most [`MAX_HANDLERS`] at once (one more
//! is answered `503` at once and closed), requests of at most [`MAX_REQUEST_BYTES`], and one
//! deadline of [`REQUEST_DEADLINE`] per connection for reading the request head *and*
//! writing the response. A per-read timeout alone is not enough: a client that sends one
//! byte every 1.5 s never trips a 2 s read timeout, and it held the single-threaded listener
//! for as long as it liked (issue 10). It binds loopback addresses only (the figures carry no
//! authentication).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How often the agent recomputes gauges that cost a tree walk (outbox depth, store size).
pub const REFRESH_INTERVAL: Duration = Duration::from_millis(250);
/// Longest request head the server reads before answering 431.
pub const MAX_REQUEST_BYTES: usize = 8 * 1024;
/// Time a connection gets from accept to the last byte of the response: a slow client is
/// cut when it runs out, however it trickles its bytes.
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(2);
/// Connections served at once (a thread each). Scrapers are few; the cap bounds the threads
/// that slow or idle clients can pin, each for at most [`REQUEST_DEADLINE`].
pub const MAX_HANDLERS: usize = 8;
/// Outbox age marks kept (one per checkpoint that added outputs); beyond it the newest mark
/// absorbs new entries, which only overstates their age.
const MAX_OUTBOX_MARKS: usize = 4096;

/// Upper bounds (seconds) of the duration histograms' buckets.
pub const DURATION_BUCKETS: [f64; 14] = [
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
    pub fn observe(&mut self, d: Duration) {
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
}

/// Everything exported. The agent writes it; [`render`] reads a copy.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Figures {
    // Ingest and publish (counters since start).
    pub received: u64,
    pub acked: u64,
    pub oversize_refused: u64,
    pub published: u64,
    pub pubacked: u64,
    pub reconnects: u64,
    pub connected: bool,
    pub backpressure: bool,
    // Log.
    pub log_commits: u64,
    pub log_commit: Histogram,
    pub log_size_bytes: u64,
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
}

/// The shared figures, plus the server's address and stop flag.
#[derive(Debug, Default)]
pub struct Metrics {
    figures: Mutex<Figures>,
    /// (end outbox sequence, wall ms): entries below `end` were committed by `ms`.
    outbox_marks: Mutex<std::collections::VecDeque<(u64, u64)>>,
    server: Mutex<Option<SocketAddr>>,
    stop: AtomicBool,
    /// Handler threads running now (at most [`MAX_HANDLERS`]).
    handlers: AtomicUsize,
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
    pub fn note_outbox_committed(&self, end_seq: u64, at_ms: u64) {
        let mut marks = lock(&self.outbox_marks);
        let full = marks.len() >= MAX_OUTBOX_MARKS;
        match marks.back_mut() {
            Some(last) if last.0 >= end_seq => {}
            Some(last) if full => last.0 = end_seq,
            _ => marks.push_back((end_seq, at_ms)),
        }
    }

    /// Set the outbox gauges from its depth and its first sequence number.
    pub fn set_outbox(&self, entries: u64, first_seq: Option<u64>, now_ms: u64) {
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

    /// Where [`serve`] listens (after it bound).
    pub fn server_addr(&self) -> Option<SocketAddr> {
        *lock(&self.server)
    }

    /// Stop the server thread (it exits after its current connection).
    pub fn stop_server(&self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(addr) = self.server_addr() {
            // Wake the blocking accept; it sees the flag and returns.
            let _ = TcpStream::connect_timeout(&addr, Duration::from_millis(200));
        }
    }
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

/// Serve `GET /metrics` on `addr` (loopback only) from one thread.
pub fn serve(addr: SocketAddr, metrics: Arc<Metrics>) -> io::Result<JoinHandle<()>> {
    if !addr.ip().is_loopback() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("metrics listen address {addr} is not loopback"),
        ));
    }
    let listener = TcpListener::bind(addr)?;
    *lock(&metrics.server) = Some(listener.local_addr()?);
    std::thread::Builder::new()
        .name("cairn-metrics".into())
        .spawn(move || {
            for conn in listener.incoming() {
                if metrics.stop.load(Ordering::SeqCst) {
                    break;
                }
                match conn {
                    Ok(stream) => dispatch(stream, &metrics),
                    Err(e) => {
                        // e.g. EMFILE: back off instead of spinning.
                        log::warn!("metrics: accept: {e}");
                        std::thread::sleep(Duration::from_millis(100));
                    }
                }
            }
        })
}

/// Give the connection a handler thread of its own, or answer 503 when [`MAX_HANDLERS`] are
/// busy, so the accepting thread never waits on a client.
fn dispatch(stream: TcpStream, metrics: &Arc<Metrics>) {
    let deadline = Instant::now() + REQUEST_DEADLINE;
    let busy = metrics
        .handlers
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
            (n < MAX_HANDLERS).then_some(n + 1)
        })
        .is_err();
    if busy {
        // The answer fits in the socket's send buffer: the write does not wait on the client,
        // and the short timeout bounds it if it ever did.
        let mut stream = stream;
        let _ = stream.set_write_timeout(Some(Duration::from_millis(100)));
        let _ = respond(
            &mut stream,
            "503 Service Unavailable",
            "text/plain",
            "busy\n",
            Instant::now() + Duration::from_millis(100),
        );
        return;
    }
    let m = metrics.clone();
    let spawned = std::thread::Builder::new()
        .name("cairn-metrics-conn".into())
        .spawn(move || {
            if let Err(e) = handle(stream, &m, deadline) {
                log::debug!("metrics: connection: {e}");
            }
            m.handlers.fetch_sub(1, Ordering::SeqCst);
        });
    if let Err(e) = spawned {
        metrics.handlers.fetch_sub(1, Ordering::SeqCst);
        log::warn!("metrics: cannot start a handler thread: {e}");
    }
}

/// Time left before `deadline`, or a `TimedOut` error once it has passed. Never zero: a zero
/// socket timeout means "wait forever".
fn remaining(deadline: Instant) -> io::Result<Duration> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(io::Error::new(
            io::ErrorKind::TimedOut,
            "request deadline passed",
        ));
    }
    Ok(left)
}

fn handle(mut stream: TcpStream, metrics: &Metrics, deadline: Instant) -> io::Result<()> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break Some(i);
        }
        if buf.len() >= MAX_REQUEST_BYTES {
            break None;
        }
        // Each read may wait only for what is left of the whole request's time.
        stream.set_read_timeout(Some(remaining(deadline)?))?;
        let n = stream.read(&mut chunk)?;
        if n == 0 {
            return Ok(());
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let Some(head_end) = head_end else {
        return respond(
            &mut stream,
            "431 Request Header Fields Too Large",
            "text/plain",
            "",
            deadline,
        );
    };
    let head = String::from_utf8_lossy(&buf[..head_end]);
    let mut parts = head.lines().next().unwrap_or("").split_whitespace();
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let path = target.split('?').next().unwrap_or("");
    match (method, path) {
        ("GET", "/metrics") => respond(
            &mut stream,
            "200 OK",
            "text/plain; version=0.0.4; charset=utf-8",
            &render(metrics),
            deadline,
        ),
        ("GET", _) => respond(
            &mut stream,
            "404 Not Found",
            "text/plain",
            "not found\n",
            deadline,
        ),
        _ => respond(
            &mut stream,
            "405 Method Not Allowed",
            "text/plain",
            "only GET\n",
            deadline,
        ),
    }
}

/// Write the response by `deadline`: a client that reads slowly is cut like one that writes
/// slowly.
fn respond(
    stream: &mut TcpStream,
    status: &str,
    ctype: &str,
    body: &str,
    deadline: Instant,
) -> io::Result<()> {
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let mut out = head.into_bytes();
    out.extend_from_slice(body.as_bytes());
    let mut rest = &out[..];
    while !rest.is_empty() {
        stream.set_write_timeout(Some(remaining(deadline)?))?;
        match stream.write(rest) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => rest = &rest[n..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    stream.flush()
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

struct Out(String);

impl Out {
    fn head(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.0, "# HELP {name} {help}");
        let _ = writeln!(self.0, "# TYPE {name} {kind}");
    }
    fn one(&mut self, name: &str, kind: &str, help: &str, v: f64) {
        self.head(name, kind, help);
        let _ = writeln!(self.0, "{name} {}", num(v));
    }
    fn per_pipeline(
        &mut self,
        name: &str,
        kind: &str,
        help: &str,
        f: &Figures,
        get: impl Fn(&PipelineFigures) -> u64,
    ) {
        self.head(name, kind, help);
        for (p, pf) in &f.pipelines {
            let _ = writeln!(self.0, "{name}{{pipeline=\"{}\"}} {}", label(p), get(pf));
        }
    }
    fn histogram(&mut self, name: &str, help: &str, h: &Histogram) {
        self.head(name, "histogram", help);
        let mut cumulative = 0;
        for (b, n) in DURATION_BUCKETS.iter().zip(h.buckets) {
            cumulative += n;
            let _ = writeln!(self.0, "{name}_bucket{{le=\"{b}\"}} {cumulative}");
        }
        let _ = writeln!(self.0, "{name}_bucket{{le=\"+Inf\"}} {}", h.count);
        let _ = writeln!(self.0, "{name}_sum {}", num(h.sum_seconds));
        let _ = writeln!(self.0, "{name}_count {}", h.count);
    }
}

fn num(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{}", v as i64)
    } else {
        format!("{v}")
    }
}

/// Escape a label value (backslash, quote, newline).
fn label(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn b(v: bool) -> f64 {
    if v { 1.0 } else { 0.0 }
}

/// The figures in Prometheus text format 0.0.4.
pub fn render(metrics: &Metrics) -> String {
    render_figures(&metrics.snapshot(), now_ms())
}

/// [`render`] for a given copy and wall clock (ages are computed against `now_ms`).
pub fn render_figures(f: &Figures, now_ms: u64) -> String {
    let mut o = Out(String::with_capacity(8 * 1024));
    let c = "counter";
    let g = "gauge";
    let age = |at_ms: u64| {
        if at_ms == 0 {
            0.0
        } else {
            now_ms.saturating_sub(at_ms) as f64 / 1000.0
        }
    };
    o.one(
        "cairn_received_total",
        c,
        "MQTT messages received.",
        f.received as f64,
    );
    o.one(
        "cairn_acked_total",
        c,
        "Inputs acknowledged to the broker (after their log record was fsynced).",
        f.acked as f64,
    );
    o.one(
        "cairn_oversize_refused_total",
        c,
        "Inputs over log.max_payload, each logged as a too_large dead letter.",
        f.oversize_refused as f64,
    );
    o.one(
        "cairn_published_total",
        c,
        "Results published.",
        f.published as f64,
    );
    o.one(
        "cairn_pubacked_total",
        c,
        "Results acknowledged by the broker and deleted from the outbox.",
        f.pubacked as f64,
    );
    o.one(
        "cairn_mqtt_reconnects_total",
        c,
        "Connections to the broker lost.",
        f.reconnects as f64,
    );
    o.one(
        "cairn_mqtt_connected",
        g,
        "1 while connected to the broker.",
        b(f.connected),
    );
    o.one(
        "cairn_backpressure",
        g,
        "1 while inputs are not acknowledged because the log or the outbox is full.",
        b(f.backpressure),
    );
    o.one(
        "cairn_log_commits_total",
        c,
        "Group commits (fsyncs) of the replay log.",
        f.log_commits as f64,
    );
    o.histogram(
        "cairn_log_commit_duration_seconds",
        "Duration of a replay log group commit (write and fsync).",
        &f.log_commit,
    );
    o.one(
        "cairn_log_commit_last_duration_seconds",
        g,
        "Duration of the last replay log group commit.",
        f.log_commit.last_seconds,
    );
    o.one(
        "cairn_log_size_bytes",
        g,
        "Replay log size on disk plus buffered.",
        f.log_size_bytes as f64,
    );
    o.one(
        "cairn_log_segments",
        g,
        "Replay log segment files.",
        f.log_segments as f64,
    );
    o.one(
        "cairn_log_segments_evicted_total",
        c,
        "Processed log segments deleted inside retention because the log was short of room.",
        f.log_segments_evicted as f64,
    );
    o.one(
        "cairn_log_first_offset",
        g,
        "Oldest offset the replay log still holds.",
        f.log_first_offset as f64,
    );
    o.one(
        "cairn_log_next_offset",
        g,
        "Offset the next input gets.",
        f.log_next_offset as f64,
    );
    o.one(
        "cairn_checkpoints_total",
        c,
        "Checkpoints committed since start.",
        f.checkpoints as f64,
    );
    o.one(
        "cairn_checkpoint_failures_total",
        c,
        "Checkpoints that failed (the agent stops and recovers by replay).",
        f.checkpoint_failures as f64,
    );
    o.histogram(
        "cairn_checkpoint_duration_seconds",
        "Duration of a checkpoint (one sled transaction and fsync).",
        &f.checkpoint,
    );
    o.one(
        "cairn_checkpoint_last_duration_seconds",
        g,
        "Duration of the last checkpoint.",
        f.checkpoint.last_seconds,
    );
    o.one(
        "cairn_checkpoint_id",
        g,
        "Id of the last durable checkpoint.",
        f.checkpoint_id as f64,
    );
    o.one(
        "cairn_checkpoint_next_offset",
        g,
        "First log offset the last durable checkpoint does not reflect.",
        f.checkpoint_next_offset as f64,
    );
    o.one(
        "cairn_checkpoint_age_seconds",
        g,
        "Seconds since the last completed checkpoint (0 if none).",
        age(f.checkpoint_at_ms),
    );
    o.one(
        "cairn_records_unchecked",
        g,
        "Records in the log that no durable checkpoint reflects yet.",
        f.log_next_offset.saturating_sub(f.checkpoint_next_offset) as f64,
    );
    o.one(
        "cairn_records_unmatched_total",
        c,
        "Records that matched no pipeline.",
        f.records_unmatched as f64,
    );
    o.one(
        "cairn_store_size_bytes",
        g,
        "Checkpoint store size on disk.",
        f.store_bytes as f64,
    );
    o.one(
        "cairn_store_live_bytes_estimate",
        g,
        "Keys and values in the checkpoint trees at the last estimate (0 if none yet).",
        f.store_live_bytes as f64,
    );
    o.one(
        "cairn_outbox_entries",
        g,
        "Results waiting for the broker's PUBACK.",
        f.outbox_entries as f64,
    );
    o.one(
        "cairn_outbox_oldest_age_seconds",
        g,
        "Age of the oldest result waiting in the outbox (0 if empty).",
        f.outbox_oldest_age_ms as f64 / 1000.0,
    );
    o.per_pipeline(
        "cairn_state_keys",
        g,
        "Live state entries (keys, or key-windows).",
        f,
        |p| p.keys,
    );
    o.per_pipeline(
        "cairn_dedup_entries",
        g,
        "Event IDs in the dedup ledger.",
        f,
        |p| p.dedup_entries,
    );
    o.per_pipeline(
        "cairn_applied_total",
        c,
        "Events applied to the state.",
        f,
        |p| p.applied,
    );
    o.per_pipeline(
        "cairn_duplicates_total",
        c,
        "Events dropped as duplicates by event ID.",
        f,
        |p| p.duplicates,
    );
    o.per_pipeline(
        "cairn_dead_letters_total",
        c,
        "Inputs refused into the dead-letter tree.",
        f,
        |p| p.dead_letters,
    );
    o.per_pipeline(
        "cairn_filtered_total",
        c,
        "Inputs skipped because they do not match the pipeline's `where` filter.",
        f,
        |p| p.filtered,
    );
    o.per_pipeline(
        "cairn_outputs_total",
        c,
        "Results produced into the outbox.",
        f,
        |p| p.outputs,
    );
    o.one(
        "cairn_dead_letters_stored",
        g,
        "Dead letters in the store (bounded by dead_letters.max_entries and max_age).",
        f.dead_letters_stored as f64,
    );
    o.head(
        "cairn_dead_letters_pruned_total",
        c,
        "Dead letters dropped from the store, oldest first, by the bound that dropped them.",
    );
    let _ = writeln!(
        o.0,
        "cairn_dead_letters_pruned_total{{cause=\"age\"}} {}",
        f.dead_letters_pruned_age
    );
    let _ = writeln!(
        o.0,
        "cairn_dead_letters_pruned_total{{cause=\"count\"}} {}",
        f.dead_letters_pruned_count
    );
    o.one(
        "cairn_ledger_index_bytes",
        g,
        "Bytes of the dedup ledger's in-memory index (bounded by storage.ledger_index_max).",
        f.ledger_index_bytes as f64,
    );
    o.one(
        "cairn_ledger_unindexed_chunks",
        g,
        "Ledger chunks left out of the full index; every lookup reads them (slower, exact).",
        f.ledger_unindexed_chunks as f64,
    );
    o.one(
        "cairn_savepoints_total",
        c,
        "Savepoints written since start.",
        f.savepoints as f64,
    );
    o.one(
        "cairn_savepoint_failures_total",
        c,
        "Savepoints that failed to be written.",
        f.savepoint_failures as f64,
    );
    o.one(
        "cairn_savepoints_for_room_total",
        c,
        "Savepoints taken because the newest one held a replay log short of room.",
        f.savepoints_for_room as f64,
    );
    o.one(
        "cairn_savepoint_floor_released_total",
        c,
        "Times the log was freed past the newest savepoint (a savepoint for room failed).",
        f.savepoint_floor_released as f64,
    );
    o.one(
        "cairn_savepoint_files",
        g,
        "Savepoint files kept (at most [savepoint] keep).",
        f.savepoint_files as f64,
    );
    o.one(
        "cairn_savepoint_bytes",
        g,
        "Bytes of the savepoint files kept.",
        f.savepoint_bytes as f64,
    );
    let (sp_id, sp_offset, sp_at) = f.savepoint.unwrap_or((0, 0, 0));
    o.one(
        "cairn_savepoint_checkpoint_id",
        g,
        "Checkpoint id of the newest savepoint (0 if none).",
        sp_id as f64,
    );
    o.one(
        "cairn_savepoint_next_offset",
        g,
        "Log offset the newest savepoint replays from.",
        sp_offset as f64,
    );
    o.one(
        "cairn_savepoint_age_seconds",
        g,
        "Seconds since the newest savepoint was written (0 if none).",
        age(sp_at),
    );
    o.one(
        "cairn_source_replayable",
        g,
        "1 if the log still holds every record from the newest savepoint's (or else the checkpoint's) offset.",
        b(f.source_replayable),
    );
    o.one(
        "cairn_replay_records",
        g,
        "Records replayed during recovery at start.",
        f.replay_records as f64,
    );
    o.one(
        "cairn_replay_duration_seconds",
        g,
        "Duration of recovery at start.",
        f.replay_seconds,
    );
    o.0
}

/// One sample of a parsed exposition: name, labels, value.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

/// Parse Prometheus text (the subset [`render`] writes: no timestamps, no escapes in label
/// values other than `\\`, `\"`, `\n`). Unparseable lines are skipped.
pub fn parse(text: &str) -> Vec<Sample> {
    let mut out = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (series, value) = match line.rsplit_once(' ') {
            Some(x) => x,
            None => continue,
        };
        let value = match value {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            v => match v.parse::<f64>() {
                Ok(v) => v,
                Err(_) => continue,
            },
        };
        let (name, labels) = match series.split_once('{') {
            None => (series.to_string(), BTreeMap::new()),
            Some((name, rest)) => match parse_labels(rest.strip_suffix('}').unwrap_or(rest)) {
                Some(l) => (name.to_string(), l),
                None => continue,
            },
        };
        out.push(Sample {
            name,
            labels,
            value,
        });
    }
    out
}

fn parse_labels(s: &str) -> Option<BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    let mut chars = s.chars().peekable();
    loop {
        while chars.peek().is_some_and(|c| *c == ',' || c.is_whitespace()) {
            chars.next();
        }
        if chars.peek().is_none() {
            return Some(out);
        }
        let mut key = String::new();
        for c in chars.by_ref() {
            if c == '=' {
                break;
            }
            key.push(c);
        }
        if chars.next() != Some('"') {
            return None;
        }
        let mut val = String::new();
        loop {
            match chars.next()? {
                '"' => break,
                '\\' => match chars.next()? {
                    'n' => val.push('\n'),
                    c => val.push(c),
                },
                c => val.push(c),
            }
        }
        out.insert(key.trim().to_string(), val);
    }
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

    /// A client trickling one byte every 1.5 s (under any per-read timeout) holds its
    /// connection while a second scrape is answered promptly, and is cut at the deadline.
    #[test]
    fn a_slow_loris_client_is_cut_at_the_deadline_and_does_not_block_other_scrapes() {
        let m = Metrics::new();
        m.update(|f| f.received = 7);
        let t = serve("127.0.0.1:0".parse().unwrap(), m.clone()).unwrap();
        let addr = m.server_addr().unwrap();

        let started = Instant::now();
        let slow = std::thread::spawn(move || {
            let mut s = TcpStream::connect(addr).unwrap();
            s.set_read_timeout(Some(Duration::from_millis(100)))
                .unwrap();
            let request = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n";
            let mut last = Instant::now() - Duration::from_secs(2);
            let mut sent = 0;
            let mut probe = [0u8; 64];
            // Until the server closes on us (or a generous 10 s pass: a failure).
            while started.elapsed() < Duration::from_secs(10) {
                if sent < request.len() && last.elapsed() >= Duration::from_millis(1500) {
                    if s.write_all(&request[sent..sent + 1]).is_err() {
                        return (started.elapsed(), sent, String::new());
                    }
                    sent += 1;
                    last = Instant::now();
                }
                match s.read(&mut probe) {
                    Ok(0) => return (started.elapsed(), sent, String::new()),
                    Ok(n) => {
                        return (
                            started.elapsed(),
                            sent,
                            String::from_utf8_lossy(&probe[..n]).into_owned(),
                        );
                    }
                    Err(e)
                        if matches!(
                            e.kind(),
                            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                        ) => {}
                    Err(_) => return (started.elapsed(), sent, String::new()),
                }
            }
            (started.elapsed(), sent, String::new())
        });

        // The slow client has its connection; a scrape now must not wait for it.
        std::thread::sleep(Duration::from_millis(300));
        let asked = Instant::now();
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        let took = asked.elapsed();
        assert!(out.starts_with("HTTP/1.1 200 OK"), "{out}");
        assert!(out.contains("\ncairn_received_total 7\n"), "{out}");
        assert!(took < Duration::from_millis(500), "scrape took {took:?}");

        let (cut_after, sent, answer) = slow.join().unwrap();
        assert!(answer.is_empty(), "the slow client got an answer: {answer}");
        assert!(
            sent < 5,
            "the slow client could send {sent} bytes before being cut"
        );
        assert!(
            cut_after >= REQUEST_DEADLINE && cut_after < REQUEST_DEADLINE + Duration::from_secs(2),
            "cut after {cut_after:?}"
        );
        m.stop_server();
        t.join().unwrap();
    }

    #[test]
    fn more_connections_than_handlers_get_503_while_a_slot_frees_within_the_deadline() {
        let m = Metrics::new();
        let t = serve("127.0.0.1:0".parse().unwrap(), m.clone()).unwrap();
        let addr = m.server_addr().unwrap();
        // Idle clients fill every handler.
        let idle: Vec<TcpStream> = (0..MAX_HANDLERS)
            .map(|_| TcpStream::connect(addr).unwrap())
            .collect();
        std::thread::sleep(Duration::from_millis(200));
        let get = || {
            let mut s = TcpStream::connect(addr).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            s.write_all(b"GET /metrics HTTP/1.1\r\n\r\n").unwrap();
            let mut out = String::new();
            let _ = s.read_to_string(&mut out);
            out
        };
        let busy = get();
        assert!(busy.starts_with("HTTP/1.1 503"), "{busy}");
        // The idle ones are cut at the deadline, and scrapes are served again.
        std::thread::sleep(REQUEST_DEADLINE + Duration::from_millis(300));
        let ok = get();
        assert!(ok.starts_with("HTTP/1.1 200 OK"), "{ok}");
        drop(idle);
        m.stop_server();
        t.join().unwrap();
    }

    #[test]
    fn the_server_answers_metrics_404_and_refuses_oversized_requests() {
        let m = Metrics::new();
        m.update(|f| f.received = 42);
        let t = serve("127.0.0.1:0".parse().unwrap(), m.clone()).unwrap();
        let addr = m.server_addr().unwrap();
        let get = |req: &[u8]| {
            let mut s = TcpStream::connect(addr).unwrap();
            let _ = s.write_all(req);
            let mut out = String::new();
            let _ = s.read_to_string(&mut out);
            out
        };
        let ok = get(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
        assert!(ok.starts_with("HTTP/1.1 200 OK"), "{ok}");
        assert!(ok.contains("text/plain; version=0.0.4"), "{ok}");
        assert!(ok.contains("\ncairn_received_total 42\n"), "{ok}");
        assert!(get(b"GET / HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 404"));
        let big = vec![b'a'; MAX_REQUEST_BYTES + 10];
        assert!(get(&big).starts_with("HTTP/1.1 431"));
        assert!(serve("0.0.0.0:0".parse().unwrap(), m.clone()).is_err());
        m.stop_server();
        t.join().unwrap();
    }
}
