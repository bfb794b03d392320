//! The checkpoint interval's trade-off (issue 14), in the same run as the plain relay:
//! for each interval, Cairn (changelog `sum`, results published once their log records are
//! durable) gets the live runs of [`measure_live`] (throughput: median of 3 flat-out
//! runs; latency at 50% and 90% of its own peak), then a paced run at 50% of that peak
//! during which the bytes its process wrote to the block layer are counted
//! (`/proc/<pid>/io` `write_bytes`, per event and against the input payload's size), then a
//! paced stream cut by a SIGKILL part-way, and the restart's recovery time as the agent logs
//! it (`recovery: done in N ms`) with the records it replayed.
//!
//! `max_records` is set far above what any interval collects at these rates, so that the
//! interval alone decides when checkpoints run.

use std::time::{Duration, Instant};

use crate::agent::Cairn;
use crate::measure::{Live, System, measure_live, one_run};
use crate::mqtt::{Publisher, Sink};
use crate::stream::{SEED, event, payload};
use crate::{KEYS, PACED_EVENTS, STEP_TIMEOUT};

/// The intervals of the curve.
pub(crate) const INTERVALS: [(&str, u64); 4] =
    [("50ms", 50), ("200ms", 200), ("1s", 1_000), ("5s", 5_000)];
const MAX_RECORDS: u64 = 1_000_000;

/// One point of the curve.
pub(crate) struct Point {
    pub(crate) interval: &'static str,
    pub(crate) live: Live,
    /// Bytes written per event at 50% of the peak, and the mean input payload size.
    pub(crate) bytes_per_event: Option<f64>,
    pub(crate) payload_bytes: f64,
    pub(crate) recovery_ms: Option<u64>,
    pub(crate) replayed: Option<u64>,
}

/// Mean payload size of the bench stream's inputs (what "bytes per event" is held against).
fn mean_payload(tag: &str, n: u64) -> f64 {
    let total: usize = (0..n)
        .map(|i| {
            let (k, v) = event(SEED, i, KEYS);
            payload(tag, i, k, v).len()
        })
        .sum();
    total as f64 / n as f64
}

/// `replayed N records` of the last run's `recovery: done` line.
fn replayed(stderr: &str) -> Option<u64> {
    let line = stderr
        .lines()
        .rev()
        .find(|l| l.contains("recovery: done in "))?;
    line.split("replayed ")
        .nth(1)?
        .split(' ')
        .next()?
        .parse()
        .ok()
}

/// Checkpoints and log commits so far: how many, their mean duration, and how many took
/// over 25 ms (from `/metrics`). Log commits hold the loop; checkpoints, since issue 33,
/// commit beside it (their duration is the commit and fsync on the keeper's thread).
fn stalls(c: &Cairn) -> String {
    let part = |name: &str| {
        let n = c.metric(&format!("{name}_count")).unwrap_or(0.0);
        let sum = c.metric(&format!("{name}_sum")).unwrap_or(0.0);
        let fast = c
            .metric(&format!("{name}_bucket{{le=\"0.025\"}}"))
            .unwrap_or(0.0);
        format!(
            "{n:.0}, mean {:.1} ms, {:.0} over 25 ms",
            if n > 0.0 { sum / n * 1e3 } else { 0.0 },
            n - fast
        )
    };
    format!(
        "checkpoints {}; log commits {}",
        part("cairn_checkpoint_duration_seconds"),
        part("cairn_log_commit_duration_seconds")
    )
}

/// Run the curve. `port`: the shared broker; results are printed as they come.
pub(crate) fn sweep(port: u16, publisher: &Publisher, t0: Instant) -> Vec<Point> {
    let mut points = Vec::new();
    for (label, ms) in INTERVALS {
        println!("cairn, checkpoint.interval = {label}:");
        let mut c = Cairn::new(port, "changelog", 5_000);
        c.config().set("checkpoint", "interval", label);
        c.config().set("checkpoint", "max_records", MAX_RECORDS);
        c.start_connected();
        let sink = Sink::start(port, "cairn", KEYS, t0);
        let live = measure_live(&c, publisher, &sink, t0);
        // Bytes written at 50% load, over a run long enough for several checkpoints of
        // the longest interval.
        let rate = ((live.rate * 0.5) as u64).max(1);
        let n = (rate * (3 * ms).max(3_000) / 1_000).max(PACED_EVENTS);
        let w0 = c.stats().map(|p| p.write_bytes());
        let (_, _, all) = one_run(publisher, &sink, "cairn", "b", 0, n, rate, t0);
        // What the last checkpoint commits belongs to these events too.
        std::thread::sleep(Duration::from_millis(ms + 200));
        let bytes = match (w0, c.stats()) {
            (Some(a), Some(p)) if all => Some(p.write_bytes().saturating_sub(a) as f64 / n as f64),
            _ => None,
        };
        let payload_bytes = mean_payload("b", n);
        let stalls = stalls(&c);
        println!("  {stalls}");
        println!(
            "  {n} events at {rate}/s: {} bytes written per event ({payload_bytes:.0}-byte payloads){}",
            bytes.map_or("n/a".into(), |b| format!("{b:.0}")),
            if all { "" } else { "  (INCOMPLETE)" }
        );
        // Recovery: a paced stream, SIGKILL when it ends (some part of an interval after
        // the last checkpoint), restart at once.
        let kill_n = (rate * (ms + ms / 2).max(1_000) / 1_000).max(1_000);
        publisher.send("cairn", "k", 0..kill_n, KEYS, rate, None, t0, None);
        c.kill();
        c.start(None);
        let up = c.wait_connected(STEP_TIMEOUT);
        let (recovery_ms, replayed) = if up {
            let all = c.stderr();
            (c.recovery_ms(), replayed(&all))
        } else {
            (None, None)
        };
        println!(
            "  SIGKILL after {kill_n} paced events: recovery {} ms, {} records replayed",
            recovery_ms.map_or("n/a".into(), |v| v.to_string()),
            replayed.map_or("n/a".into(), |v| v.to_string())
        );
        drop(sink);
        c.kill();
        points.push(Point {
            interval: label,
            live,
            bytes_per_event: bytes,
            payload_bytes,
            recovery_ms,
            replayed,
        });
    }
    points
}

/// The curve as a table, with the relay of the same run, and the targets.
pub(crate) fn print(points: &[Point], relay: &Live) {
    println!();
    println!(
        "checkpoint interval curve (changelog; relay in the same run: {:.0} events/s, p50 {:.2} ms, p99 {:.2} ms at 50%)",
        relay.rate, relay.lat50.p50, relay.lat50.p99
    );
    println!(
        "{:<10} {:>12} {:>10} {:>10} {:>10} {:>10} {:>12} {:>12} {:>10}",
        "interval",
        "events/s",
        "at 50%/s",
        "p50 ms",
        "p99 ms",
        "B/event",
        "x payload",
        "recovery ms",
        "replayed"
    );
    println!("{}", "-".repeat(104));
    for p in points {
        let ratio = p.bytes_per_event.map(|b| b / p.payload_bytes);
        println!(
            "{:<10} {:>12.0} {:>10} {:>10.2} {:>10.2} {:>10} {:>12} {:>12} {:>10}",
            p.interval,
            p.live.rate,
            p.live.lat50.rate,
            p.live.lat50.p50,
            p.live.lat50.p99,
            p.bytes_per_event
                .map_or("n/a".into(), |b| format!("{b:.0}")),
            ratio.map_or("n/a".into(), |r| format!("{r:.1}")),
            p.recovery_ms.map_or("n/a".into(), |v| v.to_string()),
            p.replayed.map_or("n/a".into(), |v| v.to_string()),
        );
    }
    println!("{}", "-".repeat(104));
    for p in points {
        let met = |ok: bool| if ok { "met" } else { "MISSED" };
        let ratio = p.bytes_per_event.map(|b| b / p.payload_bytes);
        println!(
            "targets at {}: p50 <= 5 ms {}; p99 <= 25 ms {}; bytes/event <= 10x payload {}",
            p.interval,
            met(p.live.lat50.p50 <= 5.0),
            met(p.live.lat50.p99 <= 25.0),
            met(ratio.is_some_and(|r| r <= 10.0)),
        );
    }
}
