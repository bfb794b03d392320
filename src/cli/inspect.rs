//! `cairn inspect {log,state,dedup,outbox,checkpoints,dead-letters}`: look inside the log or
//! the store. The store is read from a private copy, so looking never writes to it.

use clap::{Args, Subcommand};
use serde_json::json;

use super::failure::Failure;
use super::output::{emit, payload_json, printable, printable_bytes};
use crate::config::Config;
use crate::pipeline::spec::PipelineSpec;
use crate::store::{Store, StoreCopy};

#[derive(Args, Debug, Clone)]
pub(crate) struct Filter {
    /// Only this pipeline.
    #[arg(long)]
    pub pipeline: Option<String>,
    /// Only this key.
    #[arg(long)]
    pub key: Option<String>,
    /// At most this many lines.
    #[arg(long)]
    pub limit: Option<usize>,
    /// One JSON object per line.
    #[arg(long)]
    pub json: bool,
}

#[derive(Subcommand, Debug)]
pub(crate) enum Inspect {
    /// Records in the replay log.
    Log {
        /// First offset to show.
        #[arg(long, default_value_t = 0)]
        from: u64,
        #[arg(long, default_value_t = 100)]
        limit: usize,
        #[arg(long)]
        json: bool,
    },
    /// Per-key aggregate state.
    State(Filter),
    /// The event-ID dedup ledger.
    Dedup(Filter),
    /// Results waiting for the broker's PUBACK.
    Outbox(Filter),
    /// Checkpoint history, newest last.
    Checkpoints(Filter),
    /// Refused inputs with offset, topic and reason.
    DeadLetters(Filter),
}

/// The store for `inspect`: a private copy, so that looking never writes to it (sled has no
/// read-only mode; see [`crate::store::StoreCopy`]).
fn open_store_readonly(cfg: &Config) -> Result<crate::store::StoreCopy, Failure> {
    let dir = cfg.store_dir();
    if !dir.join("db").exists() {
        return Err(Failure::runtime(format!(
            "no store at {} yet (the agent has not run with this data_dir)",
            dir.display()
        )));
    }
    Store::open_copy(&dir, cfg.storage.cache_size).map_err(|e| match e {
        crate::store::StoreError::Locked { .. } => {
            Failure::runtime(format!("{e}: stop it first, or use `cairn status`"))
        }
        e => Failure::runtime(e),
    })
}

fn spec_of<'a>(cfg: &'a Config, name: &str) -> Option<&'a PipelineSpec> {
    cfg.pipelines.iter().find(|p| p.name == name)
}

/// Split a stored key into (key, window bounds) using the window size of the definition
/// that wrote it (`None`: not windowed).
fn decode_skey(window_ms: Option<u64>, skey: &[u8]) -> (String, Option<(u64, u64)>) {
    match window_ms {
        Some(size) if skey.len() >= 8 => {
            let start = u64::from_be_bytes(skey[..8].try_into().expect("8 bytes"));
            (
                String::from_utf8_lossy(&skey[8..]).into_owned(),
                Some((start, start.saturating_add(size))),
            )
        }
        _ => (String::from_utf8_lossy(skey).into_owned(), None),
    }
}

/// The window size a pipeline's state was written with: from the config, or for a pipeline
/// no longer configured from the definition the store kept for it.
fn window_of(cfg: &Config, stored: &crate::model::Progress, name: &str) -> Option<u64> {
    if let Some(spec) = spec_of(cfg, name) {
        return spec.window.map(|w| w.size_ms);
    }
    let p = stored.pipelines.iter().find(|p| p.name == name)?;
    let def: serde_json::Value = serde_json::from_str(&p.definition).ok()?;
    def["window"]["size_ms"].as_u64()
}

pub(crate) fn run(cfg: &Config, what: Inspect) -> Result<(), Failure> {
    if let Inspect::Log { from, limit, json } = what {
        return inspect_log(cfg, from, limit, json);
    }
    let store = open_store_readonly(cfg)?;
    crate::logging::progress::done();
    match what {
        Inspect::Log { .. } => unreachable!(),
        Inspect::State(f) => state(cfg, &store, &f),
        Inspect::Dedup(f) => dedup(&store, &f),
        Inspect::Outbox(f) => outbox(&store, &f),
        Inspect::Checkpoints(f) => checkpoints(&store, &f),
        Inspect::DeadLetters(f) => dead_letters(&store, &f),
    }
}

fn rt(e: crate::store::StoreError) -> Failure {
    Failure::runtime(e)
}

/// Whether a filter lets an entry of pipeline `p` (and key `k`, where entries have one) through.
fn keep(f: &Filter, p: &str, k: Option<&str>) -> bool {
    f.pipeline.as_deref().is_none_or(|x| x == p) && (f.key.is_none() || f.key.as_deref() == k)
}

fn state(cfg: &Config, store: &StoreCopy, f: &Filter) -> Result<(), Failure> {
    let stored = store.progress().map_err(rt)?;
    let mut n = 0;
    for r in store.states(f.pipeline.as_deref()) {
        let (p, skey, st) = r.map_err(rt)?;
        let (key, window) = decode_skey(window_of(cfg, &stored, &p), &skey);
        if !keep(f, &p, Some(&key)) || f.limit.is_some_and(|l| n >= l) {
            continue;
        }
        n += 1;
        let mut v = json!({"pipeline": p, "key": key, "value": st.value_json(),
                           "count": st.count, "version": st.version});
        if let Some((s, e)) = window {
            v["window_start"] = s.into();
            v["window_end"] = e.into();
        }
        if f.json {
            emit(&v.to_string())?;
        } else {
            let w = window
                .map(|(s, e)| format!(" window=[{s},{e})"))
                .unwrap_or_default();
            emit(&format!(
                "{}\t{}{w}\tvalue={}\tcount={}\tversion={}",
                printable(&p),
                printable(&key),
                v["value"],
                st.count,
                st.version
            ))?;
        }
    }
    Ok(())
}

fn dedup(store: &StoreCopy, f: &Filter) -> Result<(), Failure> {
    let mut n = 0;
    for r in store.dedup_entries(f.pipeline.as_deref()) {
        let (p, id, seen) = r.map_err(rt)?;
        if !keep(f, &p, None) || f.limit.is_some_and(|l| n >= l) {
            continue;
        }
        n += 1;
        if f.json {
            emit(&json!({"pipeline": p, "event_id": id, "seen_ms": seen}).to_string())?;
        } else {
            emit(&format!(
                "{}\t{}\tseen_ms={seen}",
                printable(&p),
                printable(&id)
            ))?;
        }
    }
    Ok(())
}

fn outbox(store: &StoreCopy, f: &Filter) -> Result<(), Failure> {
    let mut n = 0;
    for r in store.outbox_from(0) {
        let (seq, o) = r.map_err(rt)?;
        // `name/...`, or `name@generation/...` from generation 2 on.
        let p = o.id.split(['/', '@']).next().unwrap_or("").to_string();
        if !keep(f, &p, None) || f.limit.is_some_and(|l| n >= l) {
            continue;
        }
        n += 1;
        if f.json {
            emit(
                &json!({"seq": seq, "id": o.id, "topic": o.topic, "retain": o.retain,
                         "payload": payload_json(&o.payload)})
                .to_string(),
            )?;
        } else {
            emit(&format!(
                "{seq}\t{}\t{}\t{}",
                printable(&o.id),
                printable(&o.topic),
                printable_bytes(&o.payload)
            ))?;
        }
    }
    Ok(())
}

fn checkpoints(store: &StoreCopy, f: &Filter) -> Result<(), Failure> {
    let all: Vec<_> = store.checkpoints().collect::<Result<_, _>>().map_err(rt)?;
    let skip = f.limit.map(|l| all.len().saturating_sub(l)).unwrap_or(0);
    for c in &all[skip..] {
        if f.json {
            emit(
                &json!({"id": c.id, "prev_offset": c.prev_offset, "next_offset": c.next_offset,
                         "records": c.records, "outputs": c.outputs, "dead_letters": c.dead_letters,
                         "committed_at_ms": c.committed_at_ms})
                .to_string(),
            )?;
        } else {
            emit(&format!(
                "#{}\toffsets [{}, {})\trecords={}\toutputs={}\tdead_letters={}\tat_ms={}",
                c.id,
                c.prev_offset,
                c.next_offset,
                c.records,
                c.outputs,
                c.dead_letters,
                c.committed_at_ms
            ))?;
        }
    }
    Ok(())
}

fn dead_letters(store: &StoreCopy, f: &Filter) -> Result<(), Failure> {
    let mut n = 0;
    for r in store.dead_letters() {
        let d = r.map_err(rt)?;
        if !keep(f, &d.pipeline, None) || f.limit.is_some_and(|l| n >= l) {
            continue;
        }
        n += 1;
        if f.json {
            emit(
                &json!({"offset": d.offset, "pipeline": d.pipeline, "topic": d.topic,
                         "reason": d.reason, "detail": d.detail, "received_at_ms": d.received_at_ms,
                         "payload": payload_json(&d.payload)})
                .to_string(),
            )?;
        } else {
            emit(&format!(
                "{}\t{}\t{}\t{}\t{}\t{}",
                d.offset,
                printable(&d.pipeline),
                printable(&d.topic),
                printable(&d.reason),
                printable(&d.detail),
                printable_bytes(&d.payload)
            ))?;
        }
    }
    Ok(())
}

fn inspect_log(cfg: &Config, from: u64, limit: usize, json: bool) -> Result<(), Failure> {
    let dir = cfg.log_dir();
    if !dir.exists() {
        return Err(Failure::runtime(format!("no log at {} yet", dir.display())));
    }
    let reader = crate::log::read_dir(&dir, from).map_err(Failure::runtime)?;
    for rec in reader.take(limit) {
        let r = rec.map_err(Failure::runtime)?;
        // A stand-in for an oversized input shows what it stands for, not its header bytes.
        let (payload, too_large) = match r.too_large() {
            Some(t) => (t.prefix, json!({"size": t.size, "limit": t.limit})),
            None => (&r.payload[..], serde_json::Value::Null),
        };
        if json {
            let mut line = json!({"offset": r.offset, "received_at_ms": r.received_at_ms,
                                  "topic": r.topic, "qos": r.qos & !crate::model::QOS_TOO_LARGE,
                                  "retain": r.retain, "payload": payload_json(payload)});
            if !too_large.is_null() {
                line["too_large"] = too_large;
            }
            emit(&line.to_string())?;
        } else {
            let note = match r.too_large() {
                Some(t) => format!(" too_large({} bytes)", t.size),
                None => String::new(),
            };
            emit(&format!(
                "{}\t{}\t{}\tq{}{}{note}\t{}",
                r.offset,
                r.received_at_ms,
                printable(&r.topic),
                r.qos & !crate::model::QOS_TOO_LARGE,
                if r.retain { " retain" } else { "" },
                printable_bytes(payload)
            ))?;
        }
    }
    Ok(())
}
