//! `cairn status`: how the agent is doing.
//!
//! With an agent running, it shows the agent's figures: one `GET /status.json` (the JSON
//! the agent builds from the same copy of its figures as `/metrics`, so nothing is parsed
//! back from Prometheus text) on the data directory's unix socket (`DATA_DIR/cairn.sock`,
//! always served: nothing to configure, see [`crate::metrics::local_socket`]), or else on
//! the `[metrics] listen` address. Otherwise, or with `--offline`, it reads the data
//! directory: the log (read-only scan), the store (only if no agent holds it) and the newest
//! savepoint. Both forms share the JSON fields `source`, `log`, `checkpoint`, `pipelines`,
//! `outbox_entries`, `dead_letters` and `savepoint`. Sizes read as people read them ("0 B of
//! 1 GiB") in the text; the JSON keeps bytes.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use serde_json::{Value, json};

use super::failure::Failure;
use super::output::{printable, terminal_safe_json};
use crate::config::Config;
use crate::store::{self, Store, StoreError};
use crate::text::Shown;

/// The agent answers from memory; anything slower than this is treated as not answering.
const METRICS_TIMEOUT: Duration = Duration::from_secs(2);
/// A status document is a few KiB; refuse to buffer more than this.
const MAX_RESPONSE_BYTES: u64 = 1 << 20;

pub(crate) fn run(cfg: &Config, as_json: bool, offline: bool) -> Result<(), Failure> {
    let mut unanswered = Vec::new();
    let online = if offline {
        None
    } else {
        find_agent(cfg, &mut unanswered)
    };
    let status = match online {
        Some((addr, mut v)) => {
            v["metrics_address"] = json!(addr);
            split_unconfigured(&mut v, cfg);
            v
        }
        None => from_data_dir(cfg, &unanswered)?,
    };
    let mut out = std::io::stdout().lock();
    // What the endpoint returns is read as data, not trusted as text: a name or a note with
    // an escape sequence must not reach the terminal as one (issue 27).
    let text = if as_json {
        terminal_safe_json(&status.to_string())
    } else {
        human(&status)
            .lines()
            .map(printable)
            .collect::<Vec<_>>()
            .join("\n")
    };
    let _ = writeln!(out, "{text}");
    Ok(())
}

/// The running agent's status: from its socket in the data directory, else from `[metrics]
/// listen`. What did not answer, and why, goes to `unanswered` (a socket that is not there
/// is no news: no agent runs).
fn find_agent(cfg: &Config, unanswered: &mut Vec<String>) -> Option<(String, Value)> {
    let socket = crate::metrics::local_socket(&cfg.storage.data_dir);
    let shown = socket.display().to_string();
    if socket.exists() {
        match UnixStream::connect(&socket)
            .map_err(|e| e.to_string())
            .and_then(|s| fetch(s, "localhost"))
        {
            Ok(v) => return Some((shown, v)),
            Err(e) => unanswered.push(format!("{} did not answer ({})", Shown(&shown), Shown(&e))),
        }
    }
    if let Some(addr) = &cfg.metrics.listen {
        match fetch_tcp(addr) {
            Ok(v) => return Some((addr.clone(), v)),
            Err(e) => unanswered.push(format!("{addr} did not answer ({})", Shown(&e))),
        }
    }
    for u in unanswered.iter() {
        crate::event!(info, "status_agent_unanswered";
            "status: the agent's status at {u}; reading the data directory");
    }
    None
}

/// `GET /status.json` on a loopback address, with bounded time and size.
fn fetch_tcp(addr: &str) -> Result<Value, String> {
    let addr: SocketAddr = addr.parse().map_err(|e| format!("bad address: {e}"))?;
    let s = TcpStream::connect_timeout(&addr, METRICS_TIMEOUT).map_err(|e| e.to_string())?;
    // The listener answers only a loopback `Host` (DNS rebinding, issue 27): name the address.
    fetch(s, &addr.to_string())
}

/// A stream the status request can go over.
trait Conn: Read + Write {
    fn timeouts(&self, d: Duration) -> std::io::Result<()>;
}

impl Conn for TcpStream {
    fn timeouts(&self, d: Duration) -> std::io::Result<()> {
        self.set_read_timeout(Some(d))?;
        self.set_write_timeout(Some(d))
    }
}

impl Conn for UnixStream {
    fn timeouts(&self, d: Duration) -> std::io::Result<()> {
        self.set_read_timeout(Some(d))?;
        self.set_write_timeout(Some(d))
    }
}

/// `GET /status.json` over `s`, with bounded time and size.
fn fetch(mut s: impl Conn, host: &str) -> Result<Value, String> {
    s.timeouts(METRICS_TIMEOUT).map_err(|e| e.to_string())?;
    let request = format!("GET /status.json HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
    s.write_all(request.as_bytes()).map_err(|e| e.to_string())?;
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
    match serde_json::from_str::<Value>(body) {
        Ok(v) if v.is_object() => Ok(v),
        Ok(_) => Err("the status is not a JSON object".to_string()),
        Err(e) => Err(format!("the status is not JSON: {e}")),
    }
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

fn from_data_dir(cfg: &Config, unanswered: &[String]) -> Result<Value, Failure> {
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
            // Its socket answers unless it cannot serve it (see the agent's journal), or this
            // user may not connect to it.
            let why = if unanswered.is_empty() {
                format!(
                    "its status socket {} is not there",
                    crate::metrics::local_socket(&cfg.storage.data_dir).display()
                )
            } else {
                unanswered.join("; ")
            };
            v["note"] = json!(format!(
                "the agent is running and holds the store, but {why}: run `cairn status` as \
                 the data directory's owner (or root), or set `[metrics] listen`"
            ));
            return Ok(v);
        }
        Err(e) => return Err(Failure::runtime(e)),
    };
    let p = store.progress().map_err(Failure::runtime)?;
    let first = v["log"]["first_offset"].as_u64().unwrap_or(0);
    let last = store
        .checkpoints()
        .next_back()
        .transpose()
        .map_err(Failure::runtime)?;
    v["checkpoint"] = json!({"id": p.checkpoint_id, "next_offset": p.next_offset,
                             "committed_at_ms": last.map(|c| c.committed_at_ms),
                             "keys": store.state_len().map_err(Failure::runtime)?, "store_bytes": store.size_on_disk()});
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
                   "backfill_left": pp.backfill.map_or(0, |b| p.next_offset.saturating_sub(b.next.max(first))),
                   "generation": pp.generation.max(1)})
        })
        .collect();
    let (unconfigured, refusals) =
        crate::processor::audit(&store, &cfg.pipelines).map_err(Failure::runtime)?;
    v["unconfigured_pipelines"] = unconfigured_json(&unconfigured);
    v["definition_problems"] = json!(refusals);
    v["outbox_entries"] = json!(store.outbox_len());
    v["outbox"] = json!({"entries": store.outbox_len(), "bytes": store.outbox_bytes(),
                         "max_bytes": cfg.outbox.max_size});
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

/// Bytes as people read them: `0 B`, `512 B`, `1 GiB`, `634.8 KiB` (binary units, as the
/// config's sizes; one decimal when not whole).
pub(crate) fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut unit = 0;
    let mut factor: u64 = 1024;
    while unit + 1 < UNITS.len() && n / factor >= 1024 {
        factor *= 1024;
        unit += 1;
    }
    if n % factor == 0 {
        return format!("{} {}", n / factor, UNITS[unit]);
    }
    let v = n as f64 / factor as f64;
    // 1023.96 KiB would print as "1024.0 KiB": say "1.0 MiB" instead.
    if format!("{v:.1}") == "1024.0" && unit + 1 < UNITS.len() {
        return format!("1.0 {}", UNITS[unit + 1]);
    }
    format!("{v:.1} {}", UNITS[unit])
}

/// A byte count from the status as [`human_bytes`] says it; `-` for none.
fn bytes(x: &Value) -> String {
    match x.as_f64() {
        Some(v) if v >= 0.0 => human_bytes(v as u64),
        _ => cell(x),
    }
}

/// A value as `status` prints it: `-` for none, strings without quotes.
fn cell(x: &Value) -> String {
    match x {
        Value::Null => "-".to_string(),
        Value::String(s) => s.clone(),
        x => x.to_string(),
    }
}

fn pipeline_line(p: &Value) -> String {
    let s = cell;
    format!(
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
        } + &match p["backfill_left"].as_u64() {
            Some(n) if n > 0 => format!(", backfilling: {n} records left"),
            _ => String::new(),
        }
    )
}

fn human(v: &Value) -> String {
    let mut lines = Vec::new();
    let s = cell;
    match v["source"].as_str() {
        Some("agent") => lines.push(format!(
            "agent       running (status from {}), connected {}, backpressure {}, records \
             behind {}",
            s(&v["metrics_address"]),
            s(&v["connected"]),
            s(&v["backpressure"]),
            s(&v["processing_behind"])
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
    if let Some(line) = broker_drops_line(&v["broker_dropped"]) {
        lines.push(line);
    }
    let l = &v["log"];
    if !l.is_null() {
        lines.push(format!(
            "log         offsets [{}, {}), {} in {} segments",
            s(&l["first_offset"]),
            s(&l["next_offset"]),
            bytes(&l["size_bytes"]),
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
        lines.push(pipeline_line(p));
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
        lines.extend(queue_lines(v));
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
            "store       {} on disk; live data about {}",
            bytes(&v["store"]["size_bytes"]),
            bytes(&v["store"]["live_bytes_estimate"])
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

/// The broker's own count of the messages it dropped instead of queueing or delivering them
/// (issue 26), from a running agent: senders were told they were delivered.
fn broker_drops_line(d: &Value) -> Option<String> {
    if !d.is_object() {
        return None; // no running agent, or one from before the count was watched
    }
    Some(match (d["available"].as_bool(), d["total"].as_u64()) {
        (Some(true), Some(0)) => "broker      dropped no messages since it started".into(),
        (Some(true), Some(n)) => format!(
            "broker      dropped {n} messages since it started (for all its clients; senders \
             were told they were delivered): apply the queue settings of config/mosquitto.conf"
        ),
        (Some(true), None) => "broker      its count of dropped messages: none yet".into(),
        _ => "broker      its count of dropped messages is not available (the agent cannot read \
              $SYS/broker/publish/messages/dropped: see the journal)"
            .into(),
    })
}

/// The uplink and the outbox as its queue (issue 13): connected or not and for how long,
/// bytes, oldest entry, drain rate and the time left to drain.
fn queue_lines(v: &Value) -> Vec<String> {
    let mut lines = Vec::new();
    let u = &v["uplink"];
    if u.is_object() {
        lines.push(format!(
            "uplink      {} for {}s, {} connections lost",
            if u["connected"] == json!(true) {
                "connected"
            } else {
                "DOWN"
            },
            u["state_seconds"],
            u["reconnects"]
        ));
    }
    let o = &v["outbox"];
    if o.is_object() {
        let mut line = format!(
            "queue       {} results, {} of {}",
            o["entries"],
            bytes(&o["bytes"]),
            bytes(&o["max_bytes"])
        );
        if let Some(age) = o["oldest_age_seconds"].as_f64() {
            line.push_str(&format!(", oldest {age}s"));
        }
        if let Some(rate) = o["drain_rate"].as_f64() {
            line.push_str(&format!(", draining {rate:.1}/s"));
        }
        match o["drain_eta_seconds"].as_f64() {
            Some(eta) => line.push_str(&format!(", about {eta:.0}s to drain")),
            // Results keep coming as fast as they go (or nothing goes: the link is down).
            None if v["source"] == json!("agent") && o["entries"] != json!(0) => {
                line.push_str(match o["drain_rate"].as_f64() {
                    Some(r) if r > 0.0 => ", not shrinking",
                    _ => ", not draining",
                })
            }
            None => {}
        }
        lines.push(line);
    }
    lines.extend(sink_lines(v));
    lines
}

/// One line per sink when results go to more than one (issue 29): its state and since
/// when, what waits for it and how old the oldest is, what it settled, its drain rate and
/// refusals; or that no pipeline sends it anything (so a sink that is down but gets nothing
/// does not look stalled).
fn sink_lines(v: &Value) -> Vec<String> {
    let Some(sinks) = v["sinks"].as_array().filter(|s| s.len() > 1) else {
        return Vec::new();
    };
    sinks
        .iter()
        .map(|s| {
            let state = s["state"].as_str().unwrap_or("?");
            let name = printable(s["name"].as_str().unwrap_or("?"));
            if s["pipelines"] == json!(0) && s["waiting"] == json!(0) {
                return format!(
                    "sink {name:<10} no pipelines: no results go to it ({state} for {}s)",
                    s["state_seconds"]
                );
            }
            let mut line = format!(
                "sink {name:<10} {} for {}s, {} waiting ({}",
                if state == "connected" {
                    state.to_string()
                } else {
                    state.to_uppercase()
                },
                s["state_seconds"],
                s["waiting"],
                bytes(&s["waiting_bytes"]),
            );
            if let Some(age) = s["oldest_age_seconds"].as_f64().filter(|a| *a > 0.0) {
                line.push_str(&format!(", oldest {age}s"));
            }
            line.push_str(&format!(
                "), {} settled, {:.1}/s",
                s["settled"],
                s["drain_rate"].as_f64().unwrap_or(0.0)
            ));
            if s["pipelines"] == json!(0) {
                // Results of pipelines no longer configured, which went here by default.
                line.push_str(", no configured pipelines");
            }
            if let Some(w) = s["duplicate_window_seconds"].as_f64() {
                line.push_str(&format!(", duplicate window {w}s"));
            }
            if let Some(r) = s["refused"].as_object().filter(|r| !r.is_empty()) {
                let all: Vec<String> = r
                    .iter()
                    .map(|(k, n)| format!("{} {n}", printable(k)))
                    .collect();
                line.push_str(&format!(", refused: {}", all.join(", ")));
            }
            line
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_read_as_people_read_them() {
        for (n, want) in [
            (0, "0 B"),
            (1023, "1023 B"),
            (1024, "1 KiB"),
            (1536, "1.5 KiB"),
            (650_000, "634.8 KiB"),
            (1 << 30, "1 GiB"),
            ((1 << 20) - 1, "1.0 MiB"),
            (16 << 20, "16 MiB"),
            (u64::MAX, "16.0 EiB"),
        ] {
            assert_eq!(human_bytes(n), want, "{n}");
        }
    }

    #[test]
    fn the_brokers_drops_are_shown_and_so_is_a_count_that_cannot_be_watched() {
        let line = |v: Value| broker_drops_line(&v);
        assert_eq!(line(Value::Null), None, "no running agent: no line");
        let seen = line(json!({"available": true, "total": 15028})).unwrap();
        assert!(seen.contains("dropped 15028 messages") && seen.contains("config/mosquitto.conf"));
        assert!(
            line(json!({"available": true, "total": 0}))
                .unwrap()
                .contains("no messages")
        );
        let hidden = line(json!({"available": false, "total": null})).unwrap();
        assert!(hidden.contains("not available"), "{hidden}");
    }

    #[test]
    fn the_running_agents_dormant_pipelines_are_listed_apart_from_the_configured_ones() {
        let cfg = crate::config::parse_str(
            "[mqtt]\nclient_id = \"t\"\n[storage]\ndata_dir = \".\"\n[[pipeline]]\n\
             name = \"kept\"\ntopics = [\"a/#\"]\nevent_id = \"/id\"\nkey = \"/k\"\n\
             aggregate = \"count\"\noutput_topic = \"o/{key}\"\n",
            std::path::Path::new("t.toml"),
        )
        .unwrap();
        let mut f = crate::metrics::Figures::default();
        for (name, keys) in [("kept", 1), ("gone", 4)] {
            let pf = crate::metrics::PipelineFigures {
                keys,
                ..Default::default()
            };
            f.pipelines.insert(name.into(), pf);
        }
        let mut v = crate::metrics::status_json(&crate::metrics::families(&f, 0));
        split_unconfigured(&mut v, &cfg);
        assert_eq!(v["pipelines"].as_array().unwrap().len(), 1, "{v}");
        assert_eq!(v["pipelines"][0]["name"], "kept");
        let u = &v["unconfigured_pipelines"][0];
        assert_eq!((&u["name"], &u["keys"]), (&json!("gone"), &json!(4)), "{v}");
        assert!(human(&v).contains("pipeline `gone` is not configured: 4 keys"));
    }

    #[test]
    fn each_sink_is_shown_with_its_state_backlog_and_refusals_in_json_and_text() {
        let sink =
            |name: &str, state, refused: &[(&'static str, u64)]| crate::metrics::SinkFigures {
                name: name.into(),
                state,
                since_ms: 40_000,
                waiting: 12,
                waiting_bytes: 2048,
                oldest_age_ms: 90_500,
                pipelines: 1,
                sent: 30,
                acked: 25,
                drain_rate: 4.0,
                refused: refused.iter().copied().collect(),
                refusing: None,
                duplicate_window: None,
            };
        let f = crate::metrics::Figures {
            sinks: vec![
                sink("local", "connected", &[]),
                sink("central", "refusing", &[("not authorized", 7)]),
            ],
            ..Default::default()
        };
        let v = crate::metrics::status_json(&crate::metrics::families(&f, 100_000));
        let c = &v["sinks"][1];
        assert_eq!(c["name"], "central", "{v}");
        assert_eq!(c["state"], "refusing", "{v}");
        assert_eq!(c["state_seconds"], json!(60), "{v}");
        assert_eq!(c["refused"]["not authorized"], json!(7), "{v}");
        assert_eq!(v["sinks"][0]["state"], "connected", "{v}");
        let text = human(&v);
        assert!(
            text.contains("sink central    REFUSING for 60s, 12 waiting (2 KiB, oldest 90.5s), 25 settled, 4.0/s, refused: not authorized 7"),
            "{text}"
        );
        assert_eq!(c["waiting"], json!(12), "{v}");
        assert_eq!(c["waiting_bytes"], json!(2048), "{v}");
        assert_eq!(c["oldest_age_seconds"], json!(90.5), "{v}");
        assert_eq!(c["pipelines"], json!(1), "{v}");
        // A sink no pipeline sends to says so, whatever its state: not a stalled backlog.
        let mut spare = sink("spare", "down", &[]);
        (spare.pipelines, spare.waiting, spare.waiting_bytes) = (0, 0, 0);
        spare.oldest_age_ms = 0;
        let f = crate::metrics::Figures {
            sinks: vec![sink("local", "connected", &[]), spare],
            ..Default::default()
        };
        let v = crate::metrics::status_json(&crate::metrics::families(&f, 100_000));
        assert_eq!(v["sinks"][1]["pipelines"], json!(0), "{v}");
        let text = human(&v);
        assert!(
            text.contains("sink spare      no pipelines: no results go to it (down for 60s)"),
            "{text}"
        );
        // A JetStream sink shows its stream's duplicate window.
        let mut stream = sink("stream", "connected", &[]);
        stream.duplicate_window = Some(std::time::Duration::from_secs(120));
        let f = crate::metrics::Figures {
            sinks: vec![sink("local", "connected", &[]), stream],
            ..Default::default()
        };
        let v = crate::metrics::status_json(&crate::metrics::families(&f, 100_000));
        assert_eq!(v["sinks"][1]["duplicate_window_seconds"], json!(120), "{v}");
        assert!(
            human(&v).contains(", duplicate window 120s"),
            "{}",
            human(&v)
        );
        // One sink alone: nothing more than before.
        let one = crate::metrics::Figures {
            sinks: vec![sink("local", "connected", &[])],
            ..Default::default()
        };
        let v = crate::metrics::status_json(&crate::metrics::families(&one, 100_000));
        assert!(!human(&v).contains("sink local"));
    }

    #[test]
    fn the_uplink_and_its_queue_are_shown_with_the_time_to_drain_or_null() {
        let f = crate::metrics::Figures {
            outbox_entries: 5_000,
            outbox_bytes: 650_000,
            outbox_max_bytes: 1 << 30,
            outbox_oldest_age_ms: 90_000,
            outbox_drain_rate: 2_000.0,
            outbox_drain_eta_seconds: Some(2.5),
            uplink: Some(crate::metrics::UplinkFigures {
                connected: true,
                since_ms: 40_000,
                reconnects: 3,
            }),
            ..Default::default()
        };
        let mut v = crate::metrics::status_json(&crate::metrics::families(&f, 100_000));
        v["source"] = json!("agent");
        assert_eq!(v["uplink"]["connected"], json!(true), "{v}");
        assert_eq!(v["uplink"]["state_seconds"], json!(60), "{v}");
        assert_eq!(v["outbox"]["bytes"], json!(650_000), "{v}");
        assert_eq!(v["outbox"]["drain_eta_seconds"], json!(2.5), "{v}");
        let text = human(&v);
        assert!(
            text.contains("uplink      connected for 60s, 3 connections lost"),
            "{text}"
        );
        assert!(
            text.contains("queue       5000 results, 634.8 KiB of 1 GiB, oldest 90s, draining 2000.0/s, about 2s to drain"),
            "{text}"
        );
        let f = crate::metrics::Figures {
            outbox_entries: 7,
            outbox_drain_eta_seconds: None,
            uplink: None,
            ..f
        };
        let mut v = crate::metrics::status_json(&crate::metrics::families(&f, 100_000));
        v["source"] = json!("agent");
        assert_eq!(v["uplink"], json!(null), "no [uplink]");
        assert_eq!(v["outbox"]["drain_eta_seconds"], json!(null), "no estimate");
        assert!(human(&v).contains(", not shrinking"), "{}", human(&v));
    }
}
