//! The live runs: warm-up, flat-out runs and paced runs of any [`System`], and the CPU per
//! event in alternating pairs of the relay and the agent.

use std::sync::atomic::Ordering;
use std::time::Instant;

use crate::agent::Cairn;
use crate::mqtt::{Publisher, Sink};
use crate::procs::{Stats, ticks_per_second};
use crate::relay::Relay;
use crate::support::wait_until;
use crate::{KEYS, LOW_EVENTS, LOW_RATE, PACED_EVENTS, RUN_EVENTS, RUNS, STEP_TIMEOUT, WARMUP};

/// What the throughput and latency runs need from a system under test.
pub(crate) trait System {
    fn name(&self) -> &'static str;
    /// Its topics: inputs on `<prefix>/in/<key>`, results on `<prefix>/out/<key>`.
    fn prefix(&self) -> &'static str;
    /// Its process while it runs.
    fn stats(&self) -> Option<Stats>;
}

#[derive(Clone, Copy, Default)]
pub(crate) struct Latency {
    pub(crate) rate: u64,
    pub(crate) p50: f64,
    pub(crate) p99: f64,
    pub(crate) p999: f64,
    pub(crate) complete: bool,
}

#[derive(Default)]
pub(crate) struct Live {
    /// Median events/s of the flat-out runs, and each run's.
    pub(crate) rate: f64,
    pub(crate) rates: Vec<f64>,
    pub(crate) lat50: Latency,
    pub(crate) lat90: Latency,
    pub(crate) bytes_per_event: Option<f64>,
    pub(crate) peak_rss: Option<f64>,
    pub(crate) rss: Option<f64>,
    /// CPU time (user + system) of the system's process over the flat-out runs / events.
    pub(crate) cpu_us_per_event: Option<f64>,
    pub(crate) incomplete: bool,
}

pub(crate) fn percentile_ms(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i] as f64 / 1000.0
}

pub(crate) fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        f64::NAN
    } else {
        v[v.len() / 2]
    }
}

/// Publish `[from, from+n)` at `rate` and wait for `n` results. Returns (events/s,
/// latencies sorted, all arrived).
#[allow(clippy::too_many_arguments)]
pub(crate) fn one_run(
    publisher: &Publisher,
    sink: &Sink,
    prefix: &str,
    tag: &str,
    from: u64,
    n: u64,
    rate: u64,
    t0: Instant,
) -> (f64, Vec<u64>, bool) {
    sink.reset();
    let start = t0.elapsed().as_micros() as u64;
    publisher.send(
        prefix,
        tag,
        from..from + n,
        KEYS,
        rate,
        Some(sink),
        t0,
        None,
    );
    let all = wait_until(STEP_TIMEOUT, || sink.results() >= n as usize);
    if !all {
        // Whatever stays unpaired must not be matched with the next run's results.
        for q in sink.shared.pending.lock().unwrap().iter_mut() {
            q.clear();
        }
    }
    let last = sink.shared.last_us.load(Ordering::SeqCst);
    let mut lat = std::mem::take(&mut *sink.shared.latencies_us.lock().unwrap());
    lat.sort_unstable();
    let got = sink.reset();
    let secs = (last.saturating_sub(start)).max(1) as f64 / 1e6;
    (got as f64 / secs, lat, all)
}

/// Warm-up, [`RUNS`] flat-out runs, then paced runs at 50% and 90% of the median peak.
pub(crate) fn measure_live(
    sys: &dyn System,
    publisher: &Publisher,
    sink: &Sink,
    t0: Instant,
) -> Live {
    let (prefix, name) = (sys.prefix(), sys.name());
    let mut live = Live::default();
    let w0 = sys.stats().map(|p| p.write_bytes());
    let mut next = 0u64;
    one_run(publisher, sink, prefix, "w", next, WARMUP, 0, t0);
    next += WARMUP;
    let mut events = 0;
    let w1 = sys.stats().map(|p| p.write_bytes());
    let cpu1 = sys.stats().map(|p| p.cpu_ticks());
    let threads1 = sys.stats().map(|p| p.threads());
    for r in 0..RUNS {
        let (rate, _, all) = one_run(publisher, sink, prefix, "f", next, RUN_EVENTS, 0, t0);
        next += RUN_EVENTS;
        events += RUN_EVENTS;
        live.incomplete |= !all;
        println!(
            "  {name:<8} flat out run {}: {rate:>8.0} events/s{}",
            r + 1,
            if all { "" } else { "  (INCOMPLETE)" }
        );
        live.rates.push(rate);
    }
    if let (Some(a), Some(p)) = (w1, sys.stats()) {
        live.bytes_per_event = Some(p.write_bytes().saturating_sub(a) as f64 / events as f64);
    }
    if let (Some(a), Some(p)) = (cpu1, sys.stats()) {
        let us = p.cpu_ticks().saturating_sub(a) as f64 / ticks_per_second() * 1e6;
        live.cpu_us_per_event = Some(us / events as f64);
    }
    // Where the time went, per thread (threads that live through the runs).
    if let (Some(a), Some(p)) = (threads1, sys.stats()) {
        let per = |v: u64| v as f64 / events as f64;
        let line: Vec<String> = p
            .threads()
            .into_iter()
            .filter_map(|(name, (cpu, vol, inv))| {
                let (cpu0, vol0, inv0) = a.get(&name)?;
                let us = per(cpu.saturating_sub(*cpu0)) / ticks_per_second() * 1e6;
                // Threads idle through the runs say nothing.
                (us >= 0.05).then(|| {
                    format!(
                        "{name} {us:.1} µs, {:.2}+{:.2} switches",
                        per(vol.saturating_sub(*vol0)),
                        per(inv.saturating_sub(*inv0))
                    )
                })
            })
            .collect();
        println!("  {name:<8} per event by thread: {}", line.join(", "));
    }
    let _ = w0;
    live.rate = median(&live.rates);
    // The two paced runs of the table, then one at a rate an edge box more often sees, for
    // its CPU per event (a wake-up per message costs more there than flat out).
    let of_peak = |frac: f64| ((live.rate * frac) as u64).max(1);
    let runs = [
        (of_peak(0.5), Some(0), PACED_EVENTS),
        (of_peak(0.9), Some(1), PACED_EVENTS),
        (LOW_RATE, None, LOW_EVENTS),
    ];
    for (rate, slot, n) in runs {
        let cpu0 = sys.stats().map(|p| p.cpu_ticks());
        let (_, lat, all) = one_run(publisher, sink, prefix, "p", next, n, rate, t0);
        next += n;
        let cpu = match (cpu0, sys.stats()) {
            (Some(a), Some(p)) => {
                let us =
                    p.cpu_ticks().saturating_sub(a) as f64 / ticks_per_second() * 1e6 / n as f64;
                format!("  CPU {us:.1} µs/event")
            }
            _ => String::new(),
        };
        let l = Latency {
            rate,
            p50: percentile_ms(&lat, 0.50),
            p99: percentile_ms(&lat, 0.99),
            p999: percentile_ms(&lat, 0.999),
            complete: all,
        };
        println!(
            "  {name:<8} paced {rate:>6}/s: p50 {:.2} ms  p99 {:.2} ms  p999 {:.2} ms{cpu}{}",
            l.p50,
            l.p99,
            l.p999,
            if all { "" } else { "  (INCOMPLETE)" }
        );
        live.incomplete |= !l.complete;
        match slot {
            Some(0) => live.lat50 = l,
            Some(_) => live.lat90 = l,
            None => {}
        }
    }
    if let Some(p) = sys.stats() {
        live.peak_rss = Some(p.hwm_mib());
        live.rss = Some(p.rss_mib());
    }
    live
}

/// Flat-out runs for the CPU pairs ([`cpu_pairs`]).
pub(crate) const PAIRS: usize = 6;

/// CPU per event of the relay and the agent, in [`PAIRS`] pairs of flat-out runs back to
/// back (relay then agent, then agent then relay, and so on), both processes up throughout.
/// The box's speed drifts over minutes: in one session the relay's figure from the
/// sequential runs of [`measure_live`] ranged 21.8-37 µs while the agent's moved less,
/// so a ratio of two runs a minute apart passed or failed with the drift. Returns each
/// pair's (relay, agent) µs per event.
pub(crate) fn cpu_pairs(port: u16, publisher: &Publisher, t0: Instant) -> Vec<(f64, f64)> {
    let relay = Relay::start(port);
    let relay_sink = Sink::start(port, "relay", KEYS, t0);
    let mut cairn = Cairn::new(port, "changelog", 5_000);
    cairn.start_connected();
    let cairn_sink = Sink::start(port, "cairn", KEYS, t0);
    let mut next = 0u64;
    // One flat-out run of one system: its CPU µs per event.
    let mut run = |sys: &dyn System, sink: &Sink, warm: bool| {
        let n = if warm { WARMUP } else { RUN_EVENTS };
        let before = sys.stats().map(|p| p.cpu_ticks());
        let (_, _, all) = one_run(publisher, sink, sys.prefix(), "c", next, n, 0, t0);
        next += n;
        let after = sys.stats().map(|p| p.cpu_ticks());
        let us = match (before, after) {
            (Some(b), Some(a)) if all => {
                a.saturating_sub(b) as f64 / ticks_per_second() * 1e6 / n as f64
            }
            _ => f64::NAN,
        };
        if !all {
            println!("  {} pair run INCOMPLETE", sys.name());
        }
        us
    };
    run(&relay, &relay_sink, true);
    run(&cairn, &cairn_sink, true);
    let mut pairs = Vec::with_capacity(PAIRS);
    for i in 0..PAIRS {
        let (r, c) = if i % 2 == 0 {
            let r = run(&relay, &relay_sink, false);
            (r, run(&cairn, &cairn_sink, false))
        } else {
            let c = run(&cairn, &cairn_sink, false);
            (run(&relay, &relay_sink, false), c)
        };
        println!(
            "  pair {}: relay {r:.1} µs, cairn {c:.1} µs per event: {:.2}x",
            i + 1,
            c / r
        );
        pairs.push((r, c));
    }
    drop((relay_sink, cairn_sink));
    cairn.terminate();
    pairs
}
