//! `cairn status`: how the agent is doing.
//!
//! With `[metrics] listen` configured and answering, it shows the running agent's figures
//! (one `GET /metrics` over loopback). Otherwise, or with `--offline`, it reads the data
//! directory: the log (read-only scan), the store (only if no agent holds it) and the newest
//! savepoint. Both forms share the JSON fields `source`, `log`, `checkpoint`, `pipelines`,
//! `outbox_entries`, `dead_letters` and `savepoint`.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use serde_json::{Value, json};

use super::failure::Failure;
use crate::config::Config;
use crate::metrics::{Sample, parse};
use crate::store::{self, Store, StoreError};

/// The agent answers from memory; anything slower than this is treated as not answering.
const METRICS_TIMEOUT: Duration = Duration::from_secs(2);
/// A metrics page is a few KiB; refuse to buffer more than this.
const MAX_RESPONSE_BYTES: u64 = 1 << 20;

pub(crate) fn run(cfg: &Config, as_json: bool, offline: bool) -> Result<(), Failure> {
    let online = match (&cfg.metrics.listen, offline) {
        (Some(addr), false) => match fetch(addr) {
            Ok(text) => Some((addr.clone(), text)),
            Err(e) => {
                log::info!(
                    "status: the agent's metrics at {addr} do not answer ({e}); reading the data directory"
                );
                None
            }
        },
        _ => None,
    };
    let status = match online {
        Some((addr, text)) => {
            let mut v = from_metrics(&addr, &parse(&text));
            split_unconfigured(&mut v, cfg);
            v
        }
        None => from_data_dir(cfg)?,
    };
    let mut out = std::io::stdout().lock();
    let text = if as_json {
        status.to_string()
    } else {
        human(&status)
    };
    let _ = writeln!(out, "{text}");
    Ok(())
}

/// `GET /metrics` with bounded time and size.
fn fetch(addr: &str) -> Result<String, String> {
    let addr: SocketAddr = addr.parse().map_err(|e| format!("bad address: {e}"))?;
    let mut s = TcpStream::connect_timeout(&addr, METRICS_TIMEOUT).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(METRICS_TIMEOUT))
        .and_then(|()| s.set_write_timeout(Some(METRICS_TIMEOUT)))
        .map_err(|e| e.to_string())?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: cairn\r\nConnection: close\r\n\r\n")
        .map_err(|e| e.to_string())?;
    let mut buf = Vec::new();
    s.take(MAX_RESPONSE_BYTES)
        .read_to_end(&mut buf)
        .map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&buf);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| "not an HTTP response".to_string())?;
    if !head.starts_with("HTTP/1.1 200") {
        return Err(head.lines().next().unwrap_or("").to_string());
    }
    Ok(body.to_string())
}

fn from_metrics(addr: &str, samples: &[Sample]) -> Value {
    let one = |name: &str| {
        samples
            .iter()
            .find(|s| s.name == name && s.labels.is_empty())
            .map_or(json!(null), |s| num(s.value))
    };
    let mut pipelines: BTreeMap<String, serde_json::Map<String, Value>> = BTreeMap::new();
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
            _ => continue,
        };
        pipelines
            .entry(p.clone())
            .or_default()
            .insert(field.into(), num(s.value));
    }
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
    let flat: serde_json::Map<String, Value> = samples
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
        .collect();
    json!({
        "source": "agent",
        "metrics_address": addr,
        "agent_running": true,
        "log": {"size_bytes": one("cairn_log_size_bytes"), "segments": one("cairn_log_segments"),
                "first_offset": one("cairn_log_first_offset"), "next_offset": one("cairn_log_next_offset")},
        "checkpoint": {"id": one("cairn_checkpoint_id"), "next_offset": one("cairn_checkpoint_next_offset"),
                       "age_seconds": one("cairn_checkpoint_age_seconds"),
                       "records_unchecked": one("cairn_records_unchecked")},
        "pipelines": pipelines.into_iter().map(|(name, mut m)| {
            m.insert("name".into(), json!(name));
            Value::Object(m)
        }).collect::<Vec<_>>(),
        "store": {"size_bytes": one("cairn_store_size_bytes"),
                  "live_bytes_estimate": one("cairn_store_live_bytes_estimate")},
        "outbox_entries": one("cairn_outbox_entries"),
        "dead_letters": num(dead),
        "dead_letters_stored": one("cairn_dead_letters_stored"),
        "dead_letters_pruned": {"age": pruned("age"), "count": pruned("count")},
        "savepoint": savepoint,
        "source_replayable": one("cairn_source_replayable"),
        "backpressure": one("cairn_backpressure"),
        "connected": one("cairn_mqtt_connected"),
        "metrics": flat,
    })
}

/// The agent reports every pipeline its store keeps; those the config does not name are
/// dormant state, listed apart so they are not read as running pipelines.
fn split_unconfigured(v: &mut Value, cfg: &Config) {
    let all = v["pipelines"].as_array().cloned().unwrap_or_default();
    let (on, off): (Vec<Value>, Vec<Value>) = all.into_iter().partition(|p| {
        cfg.pipelines
            .iter()
            .any(|s| Some(s.name.as_str()) == p["name"].as_str())
    });
    v["pipelines"] = json!(on);
    v["unconfigured_pipelines"] = off
        .iter()
        .map(|p| {
            json!({"name": p["name"], "keys": p["keys"], "dedup_entries": p["dedup_entries"],
                   "generation": null,
                   "drop_with": format!("cairn run --reset-pipeline {}", p["name"].as_str().unwrap_or("?"))})
        })
        .collect();
}

fn num(v: f64) -> Value {
    if v.fract() == 0.0 && (0.0..9.0e15).contains(&v) {
        json!(v as u64)
    } else {
        json!(v)
    }
}

fn from_data_dir(cfg: &Config) -> Result<Value, Failure> {
    let log_dir = cfg.log_dir();
    let log = if log_dir.is_dir() {
        let r = crate::log::verify_dir(&log_dir).map_err(Failure::runtime)?;
        json!({"dir": log_dir.display().to_string(), "segments": r.segments.len(),
               "size_bytes": r.segments.iter().map(|s| s.bytes).sum::<u64>(),
               "records": r.records, "first_offset": r.first_offset, "next_offset": r.next_offset,
               "opens": r.opens()})
    } else {
        json!(null)
    };
    let savepoint = store::list_savepoints(&cfg.savepoint_dir())
        .map_err(Failure::runtime)?
        .pop()
        .map_or(json!(null), |i| {
            json!({"checkpoint_id": i.checkpoint_id, "next_offset": i.next_offset,
                   "bytes": i.bytes, "created_at_ms": i.created_at_ms,
                   "file": i.path.display().to_string()})
        });
    let mut v = json!({
        "source": "data_dir",
        "data_dir": cfg.storage.data_dir.display().to_string(),
        "agent_running": false,
        "log": log,
        "checkpoint": null,
        "pipelines": [],
        "outbox_entries": null,
        "dead_letters": null,
        "savepoint": savepoint,
    });
    let store_dir = cfg.store_dir();
    if !store_dir.join("db").exists() {
        v["note"] = json!("no store yet (the agent has not run with this data_dir)");
        return Ok(v);
    }
    let store = match Store::open(&store_dir, cfg.storage.cache_size, crate::fsio::real()) {
        Ok(s) => s,
        Err(StoreError::Locked { .. }) => {
            v["agent_running"] = json!(true);
            v["note"] = json!(
                "the agent is running and holds the store; enable `[metrics] listen` to see its figures"
            );
            return Ok(v);
        }
        Err(e) => return Err(Failure::runtime(e)),
    };
    let p = store.progress().map_err(Failure::runtime)?;
    let last = store
        .checkpoints()
        .next_back()
        .transpose()
        .map_err(Failure::runtime)?;
    v["checkpoint"] = json!({"id": p.checkpoint_id, "next_offset": p.next_offset,
                             "committed_at_ms": last.map(|c| c.committed_at_ms),
                             "keys": store.state_len(), "store_bytes": store.size_on_disk()});
    v["store"] = json!({"size_bytes": crate::metrics::dir_size_bytes(&store_dir),
                        "live_bytes_estimate": store.live_bytes().map_err(Failure::runtime)?});
    v["pipelines"] = p
        .pipelines
        .iter()
        .filter(|pp| cfg.pipelines.iter().any(|s| s.name == pp.name))
        .map(|pp| {
            json!({"name": pp.name, "keys": pp.keys, "dedup_entries": pp.dedup_entries,
                   "applied": pp.counters.applied, "duplicates": pp.counters.duplicates,
                   "dead_letters": pp.counters.dead_letters, "outputs": pp.counters.outputs,
                   "filtered": pp.counters.filtered,
                   "generation": pp.generation.max(1)})
        })
        .collect();
    let (unconfigured, refusals) =
        crate::processor::audit(&store, &cfg.pipelines).map_err(Failure::runtime)?;
    v["unconfigured_pipelines"] = unconfigured_json(&unconfigured);
    v["definition_problems"] = json!(refusals);
    v["outbox_entries"] = json!(store.outbox_len());
    v["dead_letters"] = json!(store.dead_letter_len());
    let b = store.bound_figures();
    v["dead_letters_stored"] = json!(b.dead_letters.stored);
    v["dead_letters_pruned"] =
        json!({"age": b.dead_letters.pruned_age, "count": b.dead_letters.pruned_count});
    Ok(v)
}

/// Stored pipelines the config does not name, for `status` and `validate`.
pub(crate) fn unconfigured_json(list: &[crate::processor::Unconfigured]) -> Value {
    list.iter()
        .map(|u| {
            json!({"name": u.name, "keys": u.keys, "dedup_entries": u.dedup_entries,
                   "generation": u.generation,
                   "drop_with": format!("cairn run --reset-pipeline {}", u.name)})
        })
        .collect()
}

/// One line per stored pipeline the config does not name.
pub(crate) fn unconfigured_line(u: &Value) -> String {
    format!(
        "stored      pipeline `{}` is not configured: {} keys and {} dedup entries kept; drop them with `{}`",
        u["name"].as_str().unwrap_or("?"),
        u["keys"],
        u["dedup_entries"],
        u["drop_with"].as_str().unwrap_or("")
    )
}

fn human(v: &Value) -> String {
    let mut lines = Vec::new();
    let s = |x: &Value| match x {
        Value::Null => "-".to_string(),
        Value::String(s) => s.clone(),
        x => x.to_string(),
    };
    match v["source"].as_str() {
        Some("agent") => lines.push(format!(
            "agent       running (metrics at {}), connected {}, backpressure {}",
            s(&v["metrics_address"]),
            s(&v["connected"]),
            s(&v["backpressure"])
        )),
        _ => lines.push(format!(
            "agent       {}",
            if v["agent_running"] == json!(true) {
                "running"
            } else {
                "not running"
            }
        )),
    }
    let l = &v["log"];
    if !l.is_null() {
        lines.push(format!(
            "log         offsets [{}, {}), {} bytes in {} segments",
            s(&l["first_offset"]),
            s(&l["next_offset"]),
            s(&l["size_bytes"]),
            s(&l["segments"])
        ));
    }
    let c = &v["checkpoint"];
    if !c.is_null() {
        lines.push(format!(
            "checkpoint  #{} at offset {}",
            s(&c["id"]),
            s(&c["next_offset"])
        ));
    }
    for p in v["pipelines"].as_array().into_iter().flatten() {
        lines.push(format!(
            "pipeline    {}: keys {}, applied {}, duplicates {}, dead letters {}, outputs {}{}",
            s(&p["name"]),
            s(&p["keys"]),
            s(&p["applied"]),
            s(&p["duplicates"]),
            s(&p["dead_letters"]),
            s(&p["outputs"]),
            // Only pipelines with a `where` skip anything; the others keep their line.
            match p["filtered"].as_u64() {
                Some(n) if n > 0 => format!(", filtered {n}"),
                _ => String::new(),
            }
        ));
    }
    for u in v["unconfigured_pipelines"].as_array().into_iter().flatten() {
        lines.push(unconfigured_line(u));
    }
    for r in v["definition_problems"].as_array().into_iter().flatten() {
        lines.push(format!("definition  {}", s(r)));
    }
    if !v["outbox_entries"].is_null() {
        lines.push(format!(
            "outbox      {} entries; dead letters {}",
            s(&v["outbox_entries"]),
            s(&v["dead_letters"])
        ));
        let p = &v["dead_letters_pruned"];
        lines.push(format!(
            "dead store  {} kept; pruned {} by age, {} by count",
            s(&v["dead_letters_stored"]),
            s(&p["age"]),
            s(&p["count"])
        ));
    }
    if v["store"].is_object() {
        lines.push(format!(
            "store       {} bytes on disk; live data about {} bytes",
            s(&v["store"]["size_bytes"]),
            s(&v["store"]["live_bytes_estimate"])
        ));
    }
    let sp = &v["savepoint"];
    lines.push(if sp.is_null() {
        "savepoint   none".to_string()
    } else {
        format!(
            "savepoint   checkpoint {} at offset {}",
            s(&sp["checkpoint_id"]),
            s(&sp["next_offset"])
        )
    });
    if let Some(n) = v["note"].as_str() {
        lines.push(format!("note        {n}"));
    }
    lines.join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_running_agents_dormant_pipelines_are_listed_apart_from_the_configured_ones() {
        let cfg = crate::config::parse_str(
            "[mqtt]\nclient_id = \"t\"\n[storage]\ndata_dir = \".\"\n[[pipeline]]\n\
             name = \"kept\"\ntopics = [\"a/#\"]\nevent_id = \"/id\"\nkey = \"/k\"\n\
             aggregate = \"count\"\noutput_topic = \"o/{key}\"\n",
            std::path::Path::new("t.toml"),
        )
        .unwrap();
        let text = "cairn_state_keys{pipeline=\"kept\"} 1\ncairn_state_keys{pipeline=\"gone\"} 4\n";
        let mut v = from_metrics("127.0.0.1:1", &parse(text));
        split_unconfigured(&mut v, &cfg);
        assert_eq!(v["pipelines"].as_array().unwrap().len(), 1, "{v}");
        assert_eq!(v["pipelines"][0]["name"], "kept");
        let u = &v["unconfigured_pipelines"][0];
        assert_eq!((&u["name"], &u["keys"]), (&json!("gone"), &json!(4)), "{v}");
        assert!(human(&v).contains("pipeline `gone` is not configured: 4 keys"));
    }
}
