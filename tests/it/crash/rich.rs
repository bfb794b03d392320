//! The crash suite's pipeline of the richer kind (issue 15): a key from a topic level and a
//! field, a `where` filter, a list of aggregates with a percentile, hopping windows and
//! final results. It reads the harness's own stream (so every kill, failpoint and power cut
//! runs it), and its oracle is a plain fold over the acknowledged inputs: every closed
//! window published once with the fold of its events, every open one in the state, and the
//! counters exact.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use super::{CairnProcess, Collector, Input, cli, wait_until};

/// Appended to the harness's pipelines. Not retained, so the harness's retained-topic
/// check sees only its own pipelines.
pub(super) const PIPELINE: &str = r#"
[[pipeline]]
name = "machines"
topics = ["in/#"]
format = "json"
event_id = "/id"
key = "{topic[1]}-{/k}"
value = "/v"
event_time = "/ts"
where = '/v > -150 and topic[0] == "in"'
aggregate = ["min", "max", "avg", "count", "stddev", "p90"]
window = { size = "2s", slide = "1s", allowed_lateness = "1s" }
dedup_window = "7d"
output_topic = "mach/{key}/{window_start}"
retain = false
emit = "final"
"#;

const SIZE: u64 = 2_000;
const SLIDE: u64 = 1_000;
const LATENESS: u64 = 1_000;

#[derive(Debug, Default)]
struct Oracle {
    /// Per (key, window start): the values applied, in log order.
    windows: BTreeMap<(String, u64), Vec<i64>>,
    max_ts: u64,
    applied: u64,
    filtered: u64,
    dead: u64,
    business_duplicates: u64,
}

/// The first window start still open at greatest applied event time `max` (the engine's
/// rule spelled out: a window closes when `max - lateness` reaches its end).
fn open_from(max: u64) -> u64 {
    let wm = max.saturating_sub(LATENESS);
    if wm < SIZE {
        0
    } else {
        ((wm - SIZE) / SLIDE + 1) * SLIDE
    }
}

/// Filter, then dedup by event ID, then the windows still open; an event none is open for
/// is a dead letter `late`, and the same bytes again are its duplicate.
fn oracle(inputs: &[Input]) -> Oracle {
    let mut o = Oracle::default();
    let mut seen = HashSet::new();
    let mut late = HashSet::new();
    for inp in inputs {
        let e = match inp {
            Input::Bad(_) => {
                o.dead += 1;
                continue;
            }
            Input::Event(e) => e,
        };
        if e.value <= -150 {
            o.filtered += 1;
            continue;
        }
        if seen.contains(&e.id) {
            o.business_duplicates += 1;
            continue;
        }
        let open = open_from(o.max_ts);
        let newest = e.ts - e.ts % SLIDE;
        let starts: Vec<u64> = [newest.checked_sub(SLIDE), Some(newest)]
            .into_iter()
            .flatten()
            .filter(|s| s + SIZE > e.ts && *s >= open)
            .collect();
        if starts.is_empty() {
            if late.insert(e.id.clone()) {
                o.dead += 1;
            } else {
                o.business_duplicates += 1;
            }
            continue;
        }
        seen.insert(e.id.clone());
        o.applied += 1;
        o.max_ts = o.max_ts.max(e.ts);
        for s in starts {
            let key = format!("dev-{}", e.key);
            o.windows.entry((key, s)).or_default().push(e.value);
        }
    }
    o
}

/// One result (its `values`, `count` and `version`) against the fold of its window:
/// integers exactly, floats to rounding, the percentile to the sketch's documented bound.
fn check_values(v: &serde_json::Value, count: u64, version: u64, vals: &[i64]) -> Option<String> {
    let n = vals.len() as u64;
    let mean = vals.iter().sum::<i64>() as f64 / n as f64;
    let var = vals.iter().map(|x| (*x as f64 - mean).powi(2)).sum::<f64>() / n as f64;
    let mut sorted = vals.to_vec();
    sorted.sort();
    let exact = sorted[((900 * n).div_ceil(1000).max(1) - 1) as usize] as f64;
    let close = |a: Option<f64>, b: f64| a.is_some_and(|a| (a - b).abs() <= 1e-9 * (1.0 + b.abs()));
    let p90 = v["p90"].as_f64().unwrap_or(f64::NAN);
    let ok = count == n
        && version == n
        && v["count"].as_u64() == Some(n)
        && v["min"].as_i64() == sorted.first().copied()
        && v["max"].as_i64() == sorted.last().copied()
        && close(v["avg"].as_f64(), mean)
        && close(v["stddev"].as_f64(), var.sqrt())
        && p90.abs() <= exact.abs()
        && (exact - p90).abs() <= exact.abs() / 128.0;
    (!ok).then(|| format!("{v} (count {count}, version {version}) is not the fold of {vals:?}"))
}

/// The richer pipeline against its oracle; the agent is stopped. `Err` lists deviations.
pub(super) fn compare(
    agent: &CairnProcess,
    outputs: &Collector,
    inputs: &[Input],
) -> Result<(), String> {
    let o = oracle(inputs);
    let open = open_from(o.max_ts);
    let closed = o.windows.keys().filter(|(_, s)| *s < open).count();
    let mut problems = Vec::new();
    if closed == 0 || o.filtered == 0 {
        problems
            .push("the stream closed no window or filtered nothing: nothing was checked".into());
    }

    // Final results: one ID per closed window, whatever was re-sent after a crash.
    let mut finals: HashMap<(String, u64), HashMap<String, serde_json::Value>> = HashMap::new();
    let collect = |finals: &mut HashMap<_, HashMap<_, _>>| {
        finals.clear();
        for m in outputs
            .messages()
            .iter()
            .filter(|m| m.topic.starts_with("mach/"))
        {
            let Ok(v) = serde_json::from_slice::<serde_json::Value>(&m.payload) else {
                continue;
            };
            let at = (
                v["key"].as_str().unwrap_or_default().to_string(),
                v["window_start"].as_u64().unwrap_or(0),
            );
            let id = v["id"].as_str().unwrap_or_default().to_string();
            finals.entry(at).or_default().insert(id, v);
        }
    };
    wait_until(Duration::from_secs(10), || {
        collect(&mut finals);
        finals.len() >= closed
    });
    collect(&mut finals);

    // Open windows: in the state.
    let (code, out, err) = cli(
        agent,
        &["inspect", "state", "--json", "--pipeline", "machines"],
    );
    if code != 0 {
        return Err(format!("inspect state machines failed ({code}): {err}"));
    }
    let mut state = BTreeMap::new();
    for line in out.lines() {
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| format!("{e}: {line}"))?;
        let at = (
            v["key"].as_str().unwrap_or_default().to_string(),
            v["window_start"].as_u64().unwrap_or(0),
        );
        state.insert(at, v);
    }

    for (at, vals) in &o.windows {
        if at.1 < open {
            match finals.get(at).map(|ids| ids.values().collect::<Vec<_>>()) {
                None => problems.push(format!("closed window {at:?} was never published")),
                Some(results) if results.len() > 1 => problems.push(format!(
                    "closed window {at:?} was published under {} IDs",
                    results.len()
                )),
                Some(results) => {
                    let r = results[0];
                    let (count, version) = (r["count"].as_u64(), r["version"].as_u64());
                    problems.extend(check_values(
                        &r["values"],
                        count.unwrap_or(0),
                        version.unwrap_or(0),
                        vals,
                    ));
                }
            }
        } else {
            match state.get(at) {
                None => problems.push(format!("open window {at:?} is not in the state")),
                Some(s) => problems.extend(check_values(
                    &s["value"],
                    s["count"].as_u64().unwrap_or(0),
                    s["version"].as_u64().unwrap_or(0),
                    vals,
                )),
            }
            if finals.contains_key(at) {
                problems.push(format!("open window {at:?} was published as final"));
            }
        }
    }
    let unknown = finals
        .keys()
        .filter(|at| !o.windows.contains_key(*at))
        .count()
        + state
            .keys()
            .filter(|at| !o.windows.contains_key(*at))
            .count();
    if unknown > 0 {
        problems.push(format!("{unknown} windows no input of the oracle falls in"));
    }

    // Counters, replayed exactly from the checkpoint.
    let (code, out, err) = cli(agent, &["status", "--offline", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap_or_default();
    let p = v["pipelines"]
        .as_array()
        .and_then(|a| a.iter().find(|p| p["name"] == "machines").cloned())
        .unwrap_or_default();
    let got = (p["applied"].as_u64(), p["dead_letters"].as_u64());
    if code != 0 || got != (Some(o.applied), Some(o.dead)) {
        problems.push(format!(
            "machines counters (applied, dead letters) {got:?}, oracle {:?} ({err})",
            (o.applied, o.dead)
        ));
    }
    // A filtered input leaves no dedup entry, so a broker redelivery after a crash is
    // filtered (and counted) again, as a duplicate is: at least what the stream holds.
    let (dups, filtered) = (
        p["duplicates"].as_u64().unwrap_or(0),
        p["filtered"].as_u64().unwrap_or(0),
    );
    if dups < o.business_duplicates || filtered < o.filtered {
        problems.push(format!(
            "machines duplicates {dups} and filtered {filtered}, the stream alone has {} and {}",
            o.business_duplicates, o.filtered
        ));
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems.join("\n"))
    }
}
