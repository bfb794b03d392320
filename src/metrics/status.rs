//! `/status.json`: the running agent's figures in the shape `cairn status --json` prints.
//!
//! Built from the same [`Family`] table as `/metrics`, from one copy of the figures, so the
//! fields agree with each other and with a scrape of the same moment. `cairn status` adds
//! only what the agent cannot know: the address it asked, and which stored pipelines its
//! config still names.

use std::collections::BTreeMap;

use serde_json::{Map, Value, json};

use super::render::{Family, families, now_ms};
use super::{Metrics, Sample};

/// The status document of `metrics` now.
pub fn status(metrics: &Metrics) -> Value {
    status_json(&families(&metrics.snapshot(), now_ms()))
}

/// A JSON number the way the status has always shown one: whole values as integers.
fn num(v: f64) -> Value {
    if v.fract() == 0.0 && (0.0..9.0e15).contains(&v) {
        json!(v as u64)
    } else {
        json!(v)
    }
}

/// `null` for a negative figure (an estimate there is none of).
fn non_negative(v: Value) -> Value {
    match v.as_f64() {
        Some(x) if x >= 0.0 => v,
        _ => json!(null),
    }
}

/// The status document of one table of families.
pub fn status_json(families: &[Family]) -> Value {
    let samples: Vec<&Sample> = families.iter().flat_map(|f| &f.samples).collect();
    let one = |name: &str| {
        samples
            .iter()
            .find(|s| s.name == name && s.labels.is_empty())
            .map_or(json!(null), |s| num(s.value))
    };
    let dead: f64 = samples
        .iter()
        .filter(|s| s.name == "cairn_dead_letters_total")
        .map(|s| s.value)
        .sum();
    let pruned = |cause: &str| {
        samples
            .iter()
            .find(|s| {
                s.name == "cairn_dead_letters_pruned_total"
                    && s.labels.get("cause").map(String::as_str) == Some(cause)
            })
            .map_or(json!(null), |s| num(s.value))
    };
    let sp_id = samples
        .iter()
        .find(|s| s.name == "cairn_savepoint_checkpoint_id")
        .map_or(0.0, |s| s.value);
    let savepoint = if sp_id > 0.0 {
        json!({"checkpoint_id": one("cairn_savepoint_checkpoint_id"),
               "next_offset": one("cairn_savepoint_next_offset"),
               "age_seconds": one("cairn_savepoint_age_seconds")})
    } else {
        json!(null)
    };
    json!({
        "source": "agent",
        "agent_running": true,
        "log": {"size_bytes": one("cairn_log_size_bytes"), "segments": one("cairn_log_segments"),
                "first_offset": one("cairn_log_first_offset"), "next_offset": one("cairn_log_next_offset")},
        "checkpoint": {"id": one("cairn_checkpoint_id"), "next_offset": one("cairn_checkpoint_next_offset"),
                       "age_seconds": one("cairn_checkpoint_age_seconds"),
                       "records_unchecked": one("cairn_records_unchecked")},
        "pipelines": pipelines(&samples),
        "store": {"size_bytes": one("cairn_store_size_bytes"),
                  "live_bytes_estimate": one("cairn_store_live_bytes_estimate")},
        "outbox_entries": one("cairn_outbox_entries"),
        "outbox": {"entries": one("cairn_outbox_entries"), "bytes": one("cairn_outbox_bytes"),
                   "max_bytes": one("cairn_outbox_max_bytes"),
                   "oldest_age_seconds": one("cairn_outbox_oldest_age_seconds"),
                   "drain_rate": one("cairn_outbox_drain_rate"),
                   "drain_eta_seconds": non_negative(one("cairn_outbox_drain_eta_seconds"))},
        "uplink": if one("cairn_uplink_configured") == json!(1) {
            json!({"connected": one("cairn_uplink_connected") == json!(1),
                   "state_seconds": one("cairn_uplink_state_seconds"),
                   "reconnects": one("cairn_uplink_reconnects_total")})
        } else {
            json!(null)
        },
        "sinks": sinks(&samples),
        "dead_letters": num(dead),
        "dead_letters_stored": one("cairn_dead_letters_stored"),
        "dead_letters_pruned": {"age": pruned("age"), "count": pruned("count")},
        "savepoint": savepoint,
        "source_replayable": one("cairn_source_replayable"),
        "backpressure": one("cairn_backpressure"),
        "processing_behind": one("cairn_processing_behind_records"),
        "connected": one("cairn_mqtt_connected"),
        "metrics_listener": {"up": one("cairn_metrics_listener_up"),
                             "bind_failures": one("cairn_metrics_bind_failures_total")},
        "broker_dropped": {"available": one("cairn_broker_dropped_available") == json!(1),
                           "total": one("cairn_broker_dropped_messages")},
        "metrics": flat(&samples),
    })
}

/// One object per sink label: its state and figures under short names.
fn sinks(samples: &[&Sample]) -> Vec<Value> {
    let mut sinks: Vec<(String, Map<String, Value>)> = Vec::new();
    for s in samples {
        let Some(name) = s.labels.get("sink") else {
            continue;
        };
        let at = match sinks.iter().position(|(n, _)| n == name) {
            Some(i) => i,
            None => {
                let mut m = Map::new();
                m.insert("name".into(), json!(name));
                sinks.push((name.clone(), m));
                sinks.len() - 1
            }
        };
        let m = &mut sinks[at].1;
        match s.name.as_str() {
            "cairn_sink_connected" => {
                m.entry("state").or_insert(json!(if s.value == 1.0 {
                    "connected"
                } else {
                    "down"
                }));
            }
            "cairn_sink_refusing" if s.value == 1.0 => {
                m.insert("state".into(), json!("refusing"));
            }
            "cairn_sink_state_seconds" => {
                m.insert("state_seconds".into(), num(s.value));
            }
            "cairn_sink_waiting" => {
                m.insert("waiting".into(), num(s.value));
            }
            "cairn_sink_waiting_bytes" => {
                m.insert("waiting_bytes".into(), num(s.value));
            }
            "cairn_sink_oldest_age_seconds" => {
                m.insert("oldest_age_seconds".into(), num(s.value));
            }
            "cairn_sink_pipelines" => {
                m.insert("pipelines".into(), num(s.value));
            }
            "cairn_sink_sent_total" => {
                m.insert("sent".into(), num(s.value));
            }
            "cairn_sink_settled_total" => {
                m.insert("settled".into(), num(s.value));
            }
            "cairn_sink_drain_rate" => {
                m.insert("drain_rate".into(), num(s.value));
            }
            "cairn_sink_duplicate_window_seconds" => {
                m.insert("duplicate_window_seconds".into(), num(s.value));
            }
            "cairn_sink_refused_total" => {
                let r = m.entry("refused").or_insert(json!({}));
                if let (Some(obj), Some(reason)) = (r.as_object_mut(), s.labels.get("reason")) {
                    obj.insert(reason.clone(), num(s.value));
                }
            }
            _ => {}
        }
    }
    sinks.into_iter().map(|(_, m)| Value::Object(m)).collect()
}

/// One object per pipeline label, with the per-pipeline counters under short names.
fn pipelines(samples: &[&Sample]) -> Vec<Value> {
    let mut pipelines: BTreeMap<String, Map<String, Value>> = BTreeMap::new();
    for s in samples {
        let Some(p) = s.labels.get("pipeline") else {
            continue;
        };
        let field = match s.name.as_str() {
            "cairn_state_keys" => "keys",
            "cairn_dedup_entries" => "dedup_entries",
            "cairn_applied_total" => "applied",
            "cairn_duplicates_total" => "duplicates",
            "cairn_dead_letters_total" => "dead_letters",
            "cairn_outputs_total" => "outputs",
            "cairn_filtered_total" => "filtered",
            "cairn_backfill_records_left" => "backfill_left",
            _ => continue,
        };
        pipelines
            .entry(p.clone())
            .or_default()
            .insert(field.into(), num(s.value));
    }
    pipelines
        .into_iter()
        .map(|(name, mut m)| {
            m.insert("name".into(), json!(name));
            Value::Object(m)
        })
        .collect()
}

/// Every sample but histogram buckets, keyed `name{label="value",...}` (values unescaped).
fn flat(samples: &[&Sample]) -> Map<String, Value> {
    samples
        .iter()
        .filter(|s| !s.name.ends_with("_bucket"))
        .map(|s| {
            let labels: Vec<String> = s
                .labels
                .iter()
                .map(|(k, v)| format!("{k}=\"{v}\""))
                .collect();
            let key = if labels.is_empty() {
                s.name.clone()
            } else {
                format!("{}{{{}}}", s.name, labels.join(","))
            };
            (key, num(s.value))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::{Figures, PipelineFigures, parse, render_figures};
    use super::*;

    /// What `cairn status` showed when it parsed `/metrics` back is what `/status.json`
    /// gives now: the same fields, the same numbers.
    #[test]
    fn the_status_document_equals_the_one_read_back_from_the_text() {
        let mut f = Figures {
            received: 7,
            checkpoint_id: 3,
            checkpoint_at_ms: 400,
            outbox_oldest_age_ms: 1_234,
            savepoint: Some((2, 9, 100)),
            dead_letters_pruned_age: 5,
            ..Default::default()
        };
        f.checkpoint.observe(std::time::Duration::from_millis(3));
        for (name, dead) in [("a\"b", 2), ("c", 3)] {
            let pf = PipelineFigures {
                dead_letters: dead,
                applied: 5,
                backfill_left: dead * 100,
                ..Default::default()
            };
            f.pipelines.insert(name.into(), pf);
        }
        let fams = families(&f, 1_000);
        let parsed = parse(&render_figures(&f, 1_000));
        let read_back = status_json(&[Family {
            name: "all",
            kind: "untyped",
            help: "",
            samples: parsed,
        }]);
        let v = status_json(&fams);
        assert_eq!(v, read_back);
        assert_eq!(v["dead_letters"], json!(5));
        assert_eq!(v["checkpoint"]["age_seconds"], json!(0.6));
        assert_eq!(v["pipelines"][0]["name"], json!("a\"b"));
        assert_eq!(v["pipelines"][1]["backfill_left"], json!(300));
        assert_eq!(v["savepoint"]["checkpoint_id"], json!(2));
        assert_eq!(
            v["metrics"]["cairn_outbox_oldest_age_seconds"],
            json!(1.234)
        );
    }
}
