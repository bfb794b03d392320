//! Prometheus text format 0.0.4 from one [`Figures`] copy.
//!
//! The figures become a table of [`Family`]s first (name, type, help, samples); the text
//! exposition and `/status.json` are both written from that one table, so a scrape and a
//! `cairn status` each see one consistent moment, and the two can never disagree on a
//! value. The table is built per area (ingest, log, checkpoint, pipelines, bounds,
//! savepoints) so that each function stays short.
//!
//! Why not the `prometheus-client` crate (0.22-0.24, checked 2026-11-30, issue 12): its
//! ordinary metrics are separate atomics, and an encode reads each in turn, so one scrape
//! could see a checkpoint's `checkpoint_id` but not yet its `checkpoint_next_offset`. Its
//! `Collector` trait could encode from one copy of our figures per scrape and keep the one
//! moment, but then we would still write every family by hand (this table), and the crate
//! only encodes OpenMetrics text: a `# EOF` line, `_total` appended to counter names and
//! dropped from their `# TYPE` line, another content type. Scrapers and alerts written
//! against our 0.0.4 names would break, and `/status.json` would still need this table. What
//! it would save is `text` below, about twenty lines.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use super::{DURATION_BUCKETS, Figures, Histogram, Metrics, PipelineFigures, Sample};

#[path = "render_uplink.rs"]
mod uplink;

const COUNTER: &str = "counter";
const GAUGE: &str = "gauge";

/// One metric family: its `# HELP`, its `# TYPE`, and its samples (a histogram's buckets,
/// sum and count included).
#[derive(Debug, Clone, PartialEq)]
pub struct Family {
    pub name: &'static str,
    pub kind: &'static str,
    pub help: &'static str,
    pub samples: Vec<Sample>,
}

/// The table being built.
struct Out(Vec<Family>);

fn sample(name: &str, labels: &[(&str, String)], value: f64) -> Sample {
    Sample {
        name: name.to_string(),
        labels: labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect::<BTreeMap<_, _>>(),
        value,
    }
}

impl Out {
    fn family(
        &mut self,
        name: &'static str,
        kind: &'static str,
        help: &'static str,
    ) -> &mut Vec<Sample> {
        self.0.push(Family {
            name,
            kind,
            help,
            samples: Vec::new(),
        });
        &mut self.0.last_mut().expect("just pushed").samples
    }
    fn one(&mut self, name: &'static str, kind: &'static str, help: &'static str, v: f64) {
        self.family(name, kind, help).push(sample(name, &[], v));
    }
    fn labelled<const N: usize>(
        &mut self,
        name: &'static str,
        kind: &'static str,
        help: &'static str,
        label: &str,
        values: [(&str, u64); N],
    ) {
        let samples = self.family(name, kind, help);
        for (l, v) in values {
            samples.push(sample(name, &[(label, l.to_string())], v as f64));
        }
    }
    fn per_pipeline(
        &mut self,
        name: &'static str,
        kind: &'static str,
        help: &'static str,
        f: &Figures,
        get: impl Fn(&PipelineFigures) -> u64,
    ) {
        let samples = self.family(name, kind, help);
        for (p, pf) in &f.pipelines {
            samples.push(sample(name, &[("pipeline", p.clone())], get(pf) as f64));
        }
    }
    fn histogram(&mut self, name: &'static str, help: &'static str, h: &Histogram) {
        let samples = self.family(name, "histogram", help);
        let bucket = format!("{name}_bucket");
        let mut cumulative = 0;
        for (b, n) in DURATION_BUCKETS.iter().zip(h.buckets) {
            cumulative += n;
            samples.push(sample(
                &bucket,
                &[("le", format!("{b}"))],
                cumulative as f64,
            ));
        }
        samples.push(sample(&bucket, &[("le", "+Inf".into())], h.count as f64));
        samples.push(sample(&format!("{name}_sum"), &[], h.sum_seconds));
        samples.push(sample(&format!("{name}_count"), &[], h.count as f64));
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

/// Seconds since `at_ms` (0 when `at_ms` is 0: it has not happened yet).
fn age_seconds(at_ms: u64, now_ms: u64) -> f64 {
    if at_ms == 0 {
        0.0
    } else {
        now_ms.saturating_sub(at_ms) as f64 / 1000.0
    }
}

pub(crate) fn now_ms() -> u64 {
    crate::clock::system_wall_ms()
}

/// The figures in Prometheus text format 0.0.4.
pub fn render(metrics: &Metrics) -> String {
    render_figures(&metrics.snapshot(), now_ms())
}

/// [`render`] for a given copy and wall clock (ages are computed against `now_ms`).
pub fn render_figures(f: &Figures, now_ms: u64) -> String {
    text(&families(f, now_ms))
}

/// The table of every family, from one copy of the figures and one reading of the clock.
pub fn families(f: &Figures, now_ms: u64) -> Vec<Family> {
    let mut o = Out(Vec::with_capacity(64));
    ingest(&mut o, f);
    log(&mut o, f);
    checkpoint(&mut o, f, now_ms);
    pipelines(&mut o, f);
    bounds(&mut o, f);
    savepoints(&mut o, f, now_ms);
    uplink::families(&mut o, f, now_ms);
    listener(&mut o, f);
    sparkplug(&mut o, f);
    o.0
}

/// The exposition: per family its help and type, then one line per sample.
pub fn text(families: &[Family]) -> String {
    let mut out = String::with_capacity(8 * 1024);
    for fam in families {
        let _ = writeln!(out, "# HELP {} {}", fam.name, fam.help);
        let _ = writeln!(out, "# TYPE {} {}", fam.name, fam.kind);
        for s in &fam.samples {
            out.push_str(&s.name);
            if !s.labels.is_empty() {
                let labels: Vec<String> = s
                    .labels
                    .iter()
                    .map(|(k, v)| format!("{k}=\"{}\"", label(v)))
                    .collect();
                let _ = write!(out, "{{{}}}", labels.join(","));
            }
            let _ = writeln!(out, " {}", num(s.value));
        }
    }
    out
}

/// Ingest and publish: what came in, went out, and the connection.
fn ingest(o: &mut Out, f: &Figures) {
    o.one(
        "cairn_received_total",
        COUNTER,
        "MQTT messages received.",
        f.received as f64,
    );
    o.one(
        "cairn_acked_total",
        COUNTER,
        "Inputs acknowledged to the broker (after their log record was fsynced).",
        f.acked as f64,
    );
    o.one(
        "cairn_oversize_refused_total",
        COUNTER,
        "Inputs over log.max_payload, each logged as a too_large dead letter.",
        f.oversize_refused as f64,
    );
    o.one(
        "cairn_held_let_go_total",
        COUNTER,
        "Inputs received under backpressure past the bound of held ones, or under a packet id \
         an earlier unacknowledged input holds: not appended, not acknowledged; the agent \
         reconnects once backpressure ends and the broker re-sends them.",
        f.held_let_go as f64,
    );
    o.one(
        "cairn_published_total",
        COUNTER,
        "Results published.",
        f.published as f64,
    );
    o.one(
        "cairn_published_before_checkpoint_total",
        COUNTER,
        "Results published before the checkpoint that commits them (their inputs were durable in the log).",
        f.published_early as f64,
    );
    o.one(
        "cairn_pubacked_total",
        COUNTER,
        "Results acknowledged by the broker and deleted from the outbox.",
        f.pubacked as f64,
    );
    o.one(
        "cairn_mqtt_reconnects_total",
        COUNTER,
        "Connections to the broker lost.",
        f.reconnects as f64,
    );
    o.one(
        "cairn_mqtt_connected",
        GAUGE,
        "1 while connected to the broker.",
        b(f.connected),
    );
    // A gauge, not a counter: the broker's total starts again from 0 when it restarts.
    o.family(
        "cairn_broker_dropped_messages",
        GAUGE,
        "Messages the input broker dropped since it started instead of queueing or delivering \
         them (mosquitto's $SYS/broker/publish/messages/dropped, all clients), as it last \
         reported; no sample until it has.",
    )
    .extend(
        f.broker_dropped
            .map(|n| sample("cairn_broker_dropped_messages", &[], n as f64)),
    );
    o.one(
        "cairn_broker_dropped_available",
        GAUGE,
        "1 while the input broker publishes its dropped-message count and lets the agent read it.",
        b(f.broker_dropped_available),
    );
    o.one(
        "cairn_backpressure",
        GAUGE,
        "1 while inputs are not acknowledged because the log or the disk is full.",
        b(f.backpressure),
    );
    o.one(
        "cairn_processing_behind_records",
        GAUGE,
        "Records logged and acknowledged but not processed yet: while the outbox is full, \
         processing waits and takes them from the log once results leave.",
        f.records_behind as f64,
    );
}

/// The replay log.
fn log(o: &mut Out, f: &Figures) {
    o.one(
        "cairn_log_commits_total",
        COUNTER,
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
        GAUGE,
        "Duration of the last replay log group commit.",
        f.log_commit.last_seconds,
    );
    o.histogram(
        "cairn_loop_turn_duration_seconds",
        "Duration of one turn of the event loop, from a wake-up to its next wait (a group commit, processing, publishing, timers). What a turn makes leaves no earlier than its end: turns of tens of ms are the latency tail. A checkpoint's commit runs beside the loop, not in a turn.",
        &f.loop_turn,
    );
    o.one(
        "cairn_log_size_bytes",
        GAUGE,
        "Replay log size on disk plus buffered.",
        f.log_size_bytes as f64,
    );
    o.one(
        "cairn_log_max_bytes",
        GAUGE,
        "log.max_size: at it, processed segments go oldest first, and input waits (backpressure) if none can.",
        f.log_max_bytes as f64,
    );
    o.one(
        "cairn_log_segments",
        GAUGE,
        "Replay log segment files.",
        f.log_segments as f64,
    );
    o.one(
        "cairn_log_segments_evicted_total",
        COUNTER,
        "Processed log segments deleted inside retention because the log was short of room.",
        f.log_segments_evicted as f64,
    );
    o.one(
        "cairn_log_first_offset",
        GAUGE,
        "Oldest offset the replay log still holds.",
        f.log_first_offset as f64,
    );
    o.one(
        "cairn_log_next_offset",
        GAUGE,
        "Offset the next input gets.",
        f.log_next_offset as f64,
    );
}

/// Checkpoints and the store.
fn checkpoint(o: &mut Out, f: &Figures, now_ms: u64) {
    let age = |at_ms: u64| age_seconds(at_ms, now_ms);
    o.one(
        "cairn_checkpoints_total",
        COUNTER,
        "Checkpoints committed since start.",
        f.checkpoints as f64,
    );
    o.one(
        "cairn_checkpoint_failures_total",
        COUNTER,
        "Checkpoints that failed (the agent stops and recovers by replay).",
        f.checkpoint_failures as f64,
    );
    o.histogram(
        "cairn_checkpoint_duration_seconds",
        "Duration of a checkpoint's commit beside the loop (one sled transaction and its fsync; processing goes on meanwhile).",
        &f.checkpoint,
    );
    o.one(
        "cairn_checkpoint_last_duration_seconds",
        GAUGE,
        "Duration of the last checkpoint.",
        f.checkpoint.last_seconds,
    );
    o.one(
        "cairn_checkpoint_id",
        GAUGE,
        "Id of the last durable checkpoint.",
        f.checkpoint_id as f64,
    );
    o.one(
        "cairn_checkpoint_next_offset",
        GAUGE,
        "First log offset the last durable checkpoint does not reflect.",
        f.checkpoint_next_offset as f64,
    );
    o.one(
        "cairn_checkpoint_age_seconds",
        GAUGE,
        "Seconds since the last completed checkpoint (0 if none).",
        age(f.checkpoint_at_ms),
    );
    o.one(
        "cairn_records_unchecked",
        GAUGE,
        "Records in the log that no durable checkpoint reflects yet.",
        f.log_next_offset.saturating_sub(f.checkpoint_next_offset) as f64,
    );
    o.one(
        "cairn_records_unmatched_total",
        COUNTER,
        "Records that matched no pipeline.",
        f.records_unmatched as f64,
    );
    o.one(
        "cairn_store_size_bytes",
        GAUGE,
        "Checkpoint store size on disk.",
        f.store_bytes as f64,
    );
    o.one(
        "cairn_store_live_bytes_estimate",
        GAUGE,
        "Keys and values in the checkpoint trees at the last estimate (0 if none yet).",
        f.store_live_bytes as f64,
    );
    o.one(
        "cairn_outbox_entries",
        GAUGE,
        "Results waiting for the broker's PUBACK.",
        f.outbox_entries as f64,
    );
    o.one(
        "cairn_outbox_oldest_age_seconds",
        GAUGE,
        "Age of the oldest result waiting in the outbox (0 if empty).",
        f.outbox_oldest_age_ms as f64 / 1000.0,
    );
}

/// Per pipeline, from the engine's progress.
fn pipelines(o: &mut Out, f: &Figures) {
    o.per_pipeline(
        "cairn_state_keys",
        GAUGE,
        "Live state entries (keys, or key-windows).",
        f,
        |p| p.keys,
    );
    o.per_pipeline(
        "cairn_dedup_entries",
        GAUGE,
        "Event IDs in the dedup ledger.",
        f,
        |p| p.dedup_entries,
    );
    o.per_pipeline(
        "cairn_applied_total",
        COUNTER,
        "Events applied to the state.",
        f,
        |p| p.applied,
    );
    o.per_pipeline(
        "cairn_duplicates_total",
        COUNTER,
        "Events dropped as duplicates by event ID.",
        f,
        |p| p.duplicates,
    );
    o.per_pipeline(
        "cairn_dead_letters_total",
        COUNTER,
        "Inputs refused into the dead-letter tree.",
        f,
        |p| p.dead_letters,
    );
    o.per_pipeline(
        "cairn_backfill_records_left",
        GAUGE,
        "Log records a pipeline started with start = \"earliest\" has still to take before it joins live processing.",
        f,
        |p| p.backfill_left,
    );
    o.per_pipeline(
        "cairn_filtered_total",
        COUNTER,
        "Inputs skipped because they do not match the pipeline's `where` filter.",
        f,
        |p| p.filtered,
    );
    o.per_pipeline(
        "cairn_outputs_total",
        COUNTER,
        "Results produced into the outbox.",
        f,
        |p| p.outputs,
    );
}

/// The store's own bounds: dead letters and the ledger index.
fn bounds(o: &mut Out, f: &Figures) {
    o.one(
        "cairn_dead_letters_stored",
        GAUGE,
        "Dead letters in the store (bounded by dead_letters.max_entries and max_age).",
        f.dead_letters_stored as f64,
    );
    o.labelled(
        "cairn_dead_letters_pruned_total",
        COUNTER,
        "Dead letters dropped from the store, oldest first, by the bound that dropped them.",
        "cause",
        [
            ("age", f.dead_letters_pruned_age),
            ("count", f.dead_letters_pruned_count),
        ],
    );
    o.one(
        "cairn_ledger_index_bytes",
        GAUGE,
        "Bytes of the dedup ledger's in-memory index (bounded by storage.ledger_index_max).",
        f.ledger_index_bytes as f64,
    );
    o.one(
        "cairn_ledger_unindexed_chunks",
        GAUGE,
        "Ledger chunks left out of the full index; every lookup reads them (slower, exact).",
        f.ledger_unindexed_chunks as f64,
    );
}

/// Savepoints, replayability and recovery.
fn savepoints(o: &mut Out, f: &Figures, now_ms: u64) {
    let age = |at_ms: u64| age_seconds(at_ms, now_ms);
    o.one(
        "cairn_savepoints_total",
        COUNTER,
        "Savepoints written since start.",
        f.savepoints as f64,
    );
    o.one(
        "cairn_savepoint_failures_total",
        COUNTER,
        "Savepoints that failed to be written.",
        f.savepoint_failures as f64,
    );
    o.one(
        "cairn_savepoints_for_room_total",
        COUNTER,
        "Savepoints taken because the newest one held a replay log short of room.",
        f.savepoints_for_room as f64,
    );
    o.one(
        "cairn_savepoint_floor_released_total",
        COUNTER,
        "Times the log was freed past the newest savepoint (a savepoint for room failed).",
        f.savepoint_floor_released as f64,
    );
    o.one(
        "cairn_savepoint_files",
        GAUGE,
        "Savepoint files kept (at most [savepoint] keep).",
        f.savepoint_files as f64,
    );
    o.one(
        "cairn_savepoint_bytes",
        GAUGE,
        "Bytes of the savepoint files kept.",
        f.savepoint_bytes as f64,
    );
    let (sp_id, sp_offset, sp_at) = f.savepoint.unwrap_or((0, 0, 0));
    o.one(
        "cairn_savepoint_checkpoint_id",
        GAUGE,
        "Checkpoint id of the newest savepoint (0 if none).",
        sp_id as f64,
    );
    o.one(
        "cairn_savepoint_next_offset",
        GAUGE,
        "Log offset the newest savepoint replays from.",
        sp_offset as f64,
    );
    o.one(
        "cairn_savepoint_age_seconds",
        GAUGE,
        "Seconds since the newest savepoint was written (0 if none).",
        age(sp_at),
    );
    o.one(
        "cairn_source_replayable",
        GAUGE,
        "1 if the log still holds every record from the newest savepoint's (or else the checkpoint's) offset.",
        b(f.source_replayable),
    );
    o.one(
        "cairn_replay_records",
        GAUGE,
        "Records replayed during recovery at start.",
        f.replay_records as f64,
    );
    o.one(
        "cairn_replay_duration_seconds",
        GAUGE,
        "Duration of recovery at start.",
        f.replay_seconds,
    );
}

/// The metrics listener itself: a scrape that reads these found it bound, so `up` is 1 here;
/// the failures say how long another process held the port.
/// Sparkplug B sessions and the host (issue 31).
fn sparkplug(o: &mut Out, f: &Figures) {
    let s = &f.sparkplug;
    o.one(
        "cairn_sparkplug_seq_gaps_total",
        COUNTER,
        "Sparkplug seq jumps seen live: messages of an edge node were lost (QoS 0).",
        s.seq_gaps as f64,
    );
    o.one(
        "cairn_sparkplug_unknown_metrics_total",
        COUNTER,
        "Sparkplug metric values whose alias or name no BIRTH of the session named.",
        s.unknown_metrics as f64,
    );
    o.one(
        "cairn_sparkplug_no_session_total",
        COUNTER,
        "Sparkplug DATA or DBIRTH messages of a node or device with no live session.",
        s.no_session as f64,
    );
    o.one(
        "cairn_sparkplug_rebirths_sent_total",
        COUNTER,
        "NCMD Node Control/Rebirth requests sent to edge nodes ([sparkplug] rebirth).",
        s.rebirths_sent as f64,
    );
    o.one(
        "cairn_sparkplug_host_online",
        GAUGE,
        "1 while the broker holds this host's Sparkplug STATE as online ([sparkplug] host_id).",
        b(s.host_online),
    );
}

fn listener(o: &mut Out, f: &Figures) {
    o.one(
        "cairn_metrics_listener_up",
        GAUGE,
        "1 once the metrics listener is bound (it retries while another process holds the port).",
        b(f.metrics_listener_up),
    );
    o.one(
        "cairn_metrics_bind_failures_total",
        COUNTER,
        "Binds of the metrics listener that failed (another process held the port).",
        f.metrics_bind_failures as f64,
    );
    o.one(
        "cairn_resident_memory_bytes",
        GAUGE,
        "Resident memory of the agent process.",
        f.resident_memory_bytes as f64,
    );
}
