//! Footprint (issue 16): a backlog of 1M inputs over 100k keys (2% duplicates) waiting in a
//! broker, drained by a freshly started agent: peak RSS, RSS after idle, disk bytes and CPU
//! per input, drain rate.

use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use rumqttc::QoS;

use crate::agent::Cairn;
use crate::measure::System;
use crate::mqtt::{Publisher, Sink, start_broker};
use crate::procs::ticks_per_second;
use crate::report::fmt;
use crate::stream::{SEED, backlog_event, event, payload};
use crate::support::wait_until;
use crate::{FOOT_EVENTS, FOOT_KEYS, IDLE, STEP_TIMEOUT};

/// What the backlog run measured; NaN where it did not run.
pub(crate) struct Foot {
    pub(crate) peak_rss: f64,
    pub(crate) idle_rss: f64,
    pub(crate) bytes_per_event: f64,
    pub(crate) cpu_us_per_event: f64,
    pub(crate) events_per_s: f64,
    pub(crate) idle_cpu: f64,
    /// Results the subscriber read during the drain (NaN without one).
    pub(crate) results: f64,
}

impl Default for Foot {
    fn default() -> Self {
        Foot {
            peak_rss: f64::NAN,
            idle_rss: f64::NAN,
            bytes_per_event: f64::NAN,
            cpu_us_per_event: f64::NAN,
            events_per_s: f64::NAN,
            idle_cpu: f64::NAN,
            results: f64::NAN,
        }
    }
}

/// Publish the backlog into the broker while the agent (persistent session) is away.
fn publish_backlog(port: u16) {
    let publisher = Publisher::start(port);
    let acked0 = publisher.acked.load(Ordering::SeqCst);
    for j in 0..FOOT_EVENTS {
        let i = backlog_event(j);
        let (key, value) = event(SEED, i, FOOT_KEYS);
        publisher
            .client
            .publish(
                format!("cairn/in/k{key:06}"),
                QoS::AtLeastOnce,
                false,
                payload("foot", i, key, value),
            )
            .expect("queue a publish");
    }
    let all = wait_until(STEP_TIMEOUT * 5, || {
        publisher.acked.load(Ordering::SeqCst) - acked0 >= FOOT_EVENTS
    });
    assert!(all, "the broker did not take the whole backlog");
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

/// A broker of its own (rare autosaves: a million queued messages would be written every few
/// seconds otherwise), the agent subscribed once and stopped, the backlog published, then a
/// fresh agent drains it: peak RSS, CPU and bytes written per input, then RSS at rest.
/// `outbox_max`: the agent's `outbox.max_entries` (a user's memory bound).
pub(crate) fn footprint(outbox_max: Option<u64>) -> Foot {
    let broker = start_broker(3600);
    let port = broker.port();
    // `checkpoint.max_records` (CAIRN_COMPARE_FOOT_RECORDS to try another): each state key a
    // checkpoint writes costs a copy of its sled leaf until the checkpoint's transaction
    // ends, so this bounds the drain's peak (issue 16).
    let records = env_u64("CAIRN_COMPARE_FOOT_RECORDS").unwrap_or(5_000);
    let mut c = Cairn::new(port, "upsert", records);
    let config = c.config();
    if let Ok(interval) = std::env::var("CAIRN_COMPARE_FOOT_INTERVAL") {
        config.set("checkpoint", "interval", interval.as_str());
    }
    if let Some(max) = outbox_max {
        config.set("outbox", "max_entries", max);
    }
    // `checkpoint.max_keys` (CAIRN_COMPARE_FOOT_KEYS; else the default, 3072).
    if let Some(keys) = env_u64("CAIRN_COMPARE_FOOT_KEYS") {
        config.set("checkpoint", "max_keys", keys);
    }
    // A broker busy with a million queued messages can leave a ping unanswered for 10 s;
    // a reconnect then made mosquitto 2.0.11 send much of the backlog again (1.2M
    // duplicates seen), which measures the broker, not the agent's footprint.
    config.set("mqtt", "keep_alive", "60s");
    drain(port, &mut c, false)
}

/// Inputs of the backlog with an ID not seen before: one changelog result each.
pub(crate) const FOOT_UNIQUE: u64 = FOOT_EVENTS - FOOT_EVENTS / 50;

/// The agent `c` (on the broker at `port`) subscribes once and stops, the backlog is
/// published, then it is started afresh and drains it. With `subscriber`, a reader on the
/// results topic connects before the restart and reads every result throughout; the drain
/// then also waits for [`FOOT_UNIQUE`] results (changelog: one per input not a duplicate).
pub(crate) fn drain(port: u16, c: &mut Cairn, subscriber: bool) -> Foot {
    c.start_connected();
    c.terminate();
    let published = Instant::now();
    publish_backlog(port);
    println!(
        "  backlog published in {:.1} s",
        published.elapsed().as_secs_f64()
    );
    let sink = subscriber.then(|| Sink::start(port, "cairn", FOOT_KEYS, Instant::now()));
    let started = Instant::now();
    c.start(None);
    let done = wait_until(STEP_TIMEOUT * 10, || {
        std::thread::sleep(Duration::from_millis(250));
        c.metric("cairn_checkpoint_next_offset")
            .is_some_and(|n| n >= FOOT_EVENTS as f64)
            && c.metric("cairn_outbox_entries") == Some(0.0)
            && sink
                .as_ref()
                .is_none_or(|s| s.results() >= FOOT_UNIQUE as usize)
    });
    let results = sink.as_ref().map_or(f64::NAN, |s| s.results() as f64);
    drop(sink);
    let secs = started.elapsed().as_secs_f64();
    let records = c.metric("cairn_checkpoint_next_offset").unwrap_or(f64::NAN);
    let p = c.stats().expect("running");
    let cpu_s = p.cpu_ticks() as f64 / ticks_per_second();
    let written = p.write_bytes();
    let peak = p.hwm_mib();
    let idle_cpu = p.idle_cpu_percent(IDLE);
    let idle = p.rss_mib();
    let (anon, file) = (
        p.status_kib("RssAnon:") as f64 / 1024.0,
        p.status_kib("RssFile:") as f64 / 1024.0,
    );
    if let Some(out) = std::env::var_os("CAIRN_COMPARE_SMAPS") {
        let _ = std::fs::copy(format!("/proc/{}/smaps", p.pid), out);
    }
    let keys = c.metric("cairn_state_keys");
    let dedup = c.metric("cairn_dedup_entries");
    let dups = c.metric("cairn_duplicates_total");
    let index = c
        .metric("cairn_ledger_index_bytes")
        .map(|b| b / (1 << 20) as f64);
    let store = dir_size(&c.data_dir().join("store")) as f64 / (1 << 20) as f64;
    c.kill();
    if !done {
        println!("  (footprint: the backlog was NOT drained within the wait; figures are partial)");
    }
    println!(
        "  drained in {secs:.1} s ({records} records logged{}); keys {} dedup entries {} \
         duplicates {}; ledger index {} MiB; \
         store {store:.0} MiB on disk; RSS after {} s idle {idle:.1} MiB = {anon:.1} anonymous \
         + {file:.1} file-backed",
        if subscriber {
            format!(", {results} results read by the subscriber")
        } else {
            String::new()
        },
        fmt(keys, 0),
        fmt(dedup, 0),
        fmt(dups, 0),
        fmt(index, 1),
        IDLE.as_secs(),
    );
    Foot {
        peak_rss: peak,
        idle_rss: idle,
        bytes_per_event: written as f64 / FOOT_EVENTS as f64,
        // Per record processed: a redelivery is work too.
        cpu_us_per_event: cpu_s * 1e6 / records,
        events_per_s: FOOT_EVENTS as f64 / secs,
        idle_cpu,
        results,
    }
}

pub(crate) fn dir_size(p: &Path) -> u64 {
    let Ok(rd) = std::fs::read_dir(p) else {
        return 0;
    };
    rd.flatten()
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => dir_size(&e.path()),
            Ok(m) => m.len(),
            Err(_) => 0,
        })
        .sum()
}
