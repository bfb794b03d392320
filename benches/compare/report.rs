//! The comparison's table: every figure in one place, the ratios, and the targets with
//! pass/FAIL.

use crate::footprint::Foot;
use crate::intervals::{self, Point};
use crate::kill::KillResult;
use crate::measure::{Latency, Live, median};
use crate::recovery::Recovery;
use crate::{FOOT_BOUND, IDLE, KEYS, KILL_AT};

/// Every figure of one run; `None` or NaN where a part did not run.
pub(crate) struct Figures {
    pub(crate) relay: Live,
    pub(crate) cairn: Live,
    pub(crate) node_red: Option<Live>,
    /// Why Node-RED did not run, if it did not.
    pub(crate) node_red_missing: Option<String>,
    pub(crate) node_red_idle_cpu: Option<f64>,
    /// CPU µs per event of each (relay, cairn) pair.
    pub(crate) pairs: Vec<(f64, f64)>,
    pub(crate) curve: Vec<Point>,
    /// RSS after the live runs and [`IDLE`] without input.
    pub(crate) cairn_idle_rss: Option<f64>,
    pub(crate) cairn_kill: KillResult,
    pub(crate) node_red_kill: Option<KillResult>,
    pub(crate) recovery: Recovery,
    pub(crate) foot: Foot,
    pub(crate) bounded: Foot,
    pub(crate) stripped: Option<f64>,
}

/// The table, the targets, the interval curve and the warnings.
pub(crate) fn print(f: &Figures) {
    let nr = f.node_red.as_ref();
    let pair_median = |pick: fn(&(f64, f64)) -> f64| {
        (!f.pairs.is_empty()).then(|| median(&f.pairs.iter().map(pick).collect::<Vec<_>>()))
    };
    let pair_relay = pair_median(|p| p.0);
    let pair_cairn = pair_median(|p| p.1);
    let pair_ratio = pair_median(|p| p.1 / p.0);
    println!();
    println!(
        "{:<44} {:>11} {:>11} {:>11} {:>10} {:>10}",
        "metric", "relay", "cairn", "node-red", "cairn/rel", "cairn/nr"
    );
    println!("{}", "-".repeat(102));
    row(
        "throughput, events/s (median of 3)",
        Some(f.relay.rate),
        Some(f.cairn.rate),
        nr.map(|l| l.rate),
        0,
    );
    for (label, pick) in [
        ("50%", (|l: &Live| l.lat50) as fn(&Live) -> Latency),
        ("90%", |l: &Live| l.lat90),
    ] {
        let (r, c) = (pick(&f.relay), pick(&f.cairn));
        let n = nr.map(pick);
        row(
            &format!("  paced at {label} of own peak, events/s"),
            Some(r.rate as f64),
            Some(c.rate as f64),
            n.map(|l| l.rate as f64),
            0,
        );
        row(
            &format!("  latency p50 at {label}, ms"),
            Some(r.p50),
            Some(c.p50),
            n.map(|l| l.p50),
            2,
        );
        row(
            &format!("  latency p99 at {label}, ms"),
            Some(r.p99),
            Some(c.p99),
            n.map(|l| l.p99),
            2,
        );
        row(
            &format!("  latency p999 at {label}, ms"),
            Some(r.p999),
            Some(c.p999),
            n.map(|l| l.p999),
            2,
        );
    }
    row(
        "disk bytes written per event (live)",
        None,
        f.cairn.bytes_per_event,
        nr.and_then(|l| l.bytes_per_event),
        0,
    );
    row(
        "CPU (user+system) per event, flat out, µs",
        f.relay.cpu_us_per_event,
        f.cairn.cpu_us_per_event,
        nr.and_then(|l| l.cpu_us_per_event),
        1,
    );
    row(
        "  in alternating pairs, medians, µs",
        pair_relay,
        pair_cairn,
        None,
        1,
    );
    println!(
        "{:<44} {:>11} {:>11} {:>11} {:>10}",
        "  median of the pairs' ratios",
        "",
        "",
        "",
        pair_ratio.map_or("n/a".into(), |r| format!("{r:.2}x"))
    );
    row(
        "peak RSS during live runs, MiB",
        f.relay.peak_rss,
        f.cairn.peak_rss,
        nr.and_then(|l| l.peak_rss),
        1,
    );
    row(
        &format!("RSS after the live runs + {} s idle, MiB", IDLE.as_secs()),
        None,
        f.cairn_idle_rss,
        None,
        1,
    );
    row(
        &format!("SIGKILL at input {KILL_AT}: events lost"),
        None,
        Some(f.cairn_kill.lost as f64),
        f.node_red_kill.map(|r| r.lost as f64),
        0,
    );
    row(
        "SIGKILL: events double-counted",
        None,
        Some(f.cairn_kill.doubled as f64),
        f.node_red_kill.map(|r| r.doubled as f64),
        0,
    );
    row(
        &format!("SIGKILL: keys with a wrong final sum (/{KEYS})"),
        None,
        Some(f.cairn_kill.wrong_keys as f64),
        f.node_red_kill.map(|r| r.wrong_keys as f64),
        0,
    );
    row(
        "idle CPU over 10 s, % of a core",
        None,
        Some(f.foot.idle_cpu),
        f.node_red_idle_cpu,
        2,
    );
    println!("{}", "-".repeat(102));
    println!("cairn only:");
    row(
        "recovery (100k records): READY, ms",
        None,
        f.recovery.ready_ms,
        None,
        0,
    );
    row(
        "  recovery as logged by the agent, ms",
        None,
        f.recovery.replay_ms,
        None,
        0,
    );
    row(
        "  caught up (every result out), ms",
        None,
        f.recovery.caught_up_ms,
        None,
        0,
    );
    row(
        "  replay events/s (to READY)",
        None,
        f.recovery.replay_rate(),
        None,
        0,
    );
    row(
        "  replay / live throughput",
        None,
        f.recovery.replay_rate().map(|r| r / f.cairn.rate),
        None,
        2,
    );
    row(
        "backlog of 1M over 100k keys: peak RSS, MiB",
        None,
        Some(f.foot.peak_rss),
        None,
        1,
    );
    row(
        &format!("  RSS after {} s idle, MiB", IDLE.as_secs()),
        None,
        Some(f.foot.idle_rss),
        None,
        1,
    );
    row(
        "  disk bytes written per event",
        None,
        Some(f.foot.bytes_per_event),
        None,
        0,
    );
    row(
        "  CPU (user+system) per event, µs",
        None,
        Some(f.foot.cpu_us_per_event),
        None,
        1,
    );
    row(
        "  drain events/s (start to all out)",
        None,
        Some(f.foot.events_per_s),
        None,
        0,
    );
    let bounded_rows: [(String, f64, usize); 5] = [
        (
            format!("  outbox.max_entries {FOOT_BOUND}: peak RSS, MiB"),
            f.bounded.peak_rss,
            1,
        ),
        ("    RSS after idle, MiB".into(), f.bounded.idle_rss, 1),
        (
            "    disk bytes written per event".into(),
            f.bounded.bytes_per_event,
            0,
        ),
        (
            "    CPU (user+system) per event, µs".into(),
            f.bounded.cpu_us_per_event,
            1,
        ),
        (
            "    drain events/s (start to all out)".into(),
            f.bounded.events_per_s,
            0,
        ),
    ];
    for (label, v, digits) in bounded_rows {
        row(&label, None, Some(v), None, digits);
    }
    row("stripped binary, MiB", None, f.stripped, None, 2);
    println!("{}", "-".repeat(102));
    let thr = f.cairn.rate / f.relay.rate;
    // The pairs' median ratio where they ran: the sequential runs' ratio moves with the box.
    let cpu = pair_ratio.or_else(|| {
        f.cairn
            .cpu_us_per_event
            .zip(f.relay.cpu_us_per_event)
            .map(|(c, r)| c / r)
    });
    let replay = f.recovery.replay_rate().map(|r| r / f.cairn.rate);
    println!("targets:");
    target_line("throughput, x relay", Some(thr), ">=", 0.8);
    target_line("replay / live throughput", replay, ">=", 3.0);
    target_line("CPU per event, x relay (changelog)", cpu, "<=", 1.2);
    target_line("backlog: peak RSS, MiB", Some(f.foot.peak_rss), "<=", 64.0);
    target_line(
        "backlog: RSS after idle, MiB",
        Some(f.foot.idle_rss),
        "<=",
        32.0,
    );
    target_line(
        "1,000 keys: RSS after idle, MiB",
        f.cairn_idle_rss,
        "<=",
        16.0,
    );
    target_line("stripped binary, MiB", f.stripped, "<=", 10.0);
    if !f.curve.is_empty() {
        intervals::print(&f.curve, &f.relay);
    }
    if let Some(why) = &f.node_red_missing {
        println!("node-red: NOT AVAILABLE, its columns are n/a: {why}");
    }
    if f.relay.incomplete || f.cairn.incomplete || nr.is_some_and(|l| l.incomplete) {
        println!("warning: some runs did not deliver every result in time (marked above)");
    }
}

pub(crate) fn fmt(v: Option<f64>, prec: usize) -> String {
    match v {
        Some(v) if v.is_finite() => format!("{v:.prec$}"),
        _ => "n/a".into(),
    }
}

pub(crate) fn ratio(a: Option<f64>, b: Option<f64>) -> String {
    match (a, b) {
        (Some(a), Some(b)) if a.is_finite() && b.is_finite() && b != 0.0 => {
            format!("{:.2}x", a / b)
        }
        _ => "".into(),
    }
}

pub(crate) fn row(
    metric: &str,
    relay: Option<f64>,
    cairn: Option<f64>,
    nr: Option<f64>,
    prec: usize,
) {
    println!(
        "{metric:<44} {:>11} {:>11} {:>11} {:>10} {:>10}",
        fmt(relay, prec),
        fmt(cairn, prec),
        fmt(nr, prec),
        ratio(cairn, relay),
        ratio(cairn, nr)
    );
}

/// One target line: the figure, the bound, and pass, FAIL or n/a (the part did not run).
pub(crate) fn target_line(what: &str, got: Option<f64>, op: &str, bound: f64) {
    let verdict = match got.filter(|v| v.is_finite()) {
        None => "n/a",
        Some(v) if (op == "<=" && v <= bound) || (op == ">=" && v >= bound) => "pass",
        Some(_) => "FAIL",
    };
    println!("  {what:<40} {:>8} {op} {bound:<6} {verdict}", fmt(got, 2));
}
