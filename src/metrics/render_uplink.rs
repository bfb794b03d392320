//! The uplink and the outbox as its queue (issue 13), for the table in `render.rs`.

use super::{COUNTER, Figures, GAUGE, Out, age_seconds, b, sample};

pub(super) fn families(o: &mut Out, f: &Figures, now_ms: u64) {
    let up = f.uplink.clone().unwrap_or_default();
    o.one(
        "cairn_uplink_configured",
        GAUGE,
        "1 when results go to an [uplink] broker rather than to the [mqtt] one.",
        b(f.uplink.is_some()),
    );
    o.one(
        "cairn_uplink_connected",
        GAUGE,
        "1 while connected to the uplink broker.",
        b(up.connected),
    );
    o.one(
        "cairn_uplink_state_seconds",
        GAUGE,
        "Seconds since the uplink last connected or was lost (0 before the first change).",
        age_seconds(up.since_ms, now_ms),
    );
    o.one(
        "cairn_uplink_reconnects_total",
        COUNTER,
        "Connections to the uplink broker lost.",
        up.reconnects as f64,
    );
    o.one(
        "cairn_outbox_bytes",
        GAUGE,
        "Bytes of the outbox chunks on disk (what outbox.max_size bounds).",
        f.outbox_bytes as f64,
    );
    o.one(
        "cairn_outbox_max_bytes",
        GAUGE,
        "outbox.max_size: at it, inputs are not acknowledged until the outbox drains.",
        f.outbox_max_bytes as f64,
    );
    o.one(
        "cairn_outbox_max_entries",
        GAUGE,
        "outbox.max_entries: at it, processing waits (input is still logged and acknowledged).",
        f.outbox_max_entries as f64,
    );
    o.one(
        "cairn_outbox_drain_rate",
        GAUGE,
        "Results acknowledged by the broker per second, over the last 10 seconds.",
        f.outbox_drain_rate,
    );
    o.one(
        "cairn_outbox_drain_eta_seconds",
        GAUGE,
        "Estimated seconds until the outbox is empty at the current net drain; -1 while it is not shrinking.",
        f.outbox_drain_eta_seconds.unwrap_or(-1.0),
    );
    sinks(o, f, now_ms);
}

/// Each result sink (issue 29), labelled `sink`.
fn sinks(o: &mut Out, f: &Figures, now_ms: u64) {
    let per = |o: &mut Out,
               name: &'static str,
               kind: &'static str,
               help: &'static str,
               get: &dyn Fn(&crate::metrics::SinkFigures) -> f64| {
        let samples = o.family(name, kind, help);
        for s in &f.sinks {
            samples.push(sample(name, &[("sink", s.name.clone())], get(s)));
        }
    };
    per(
        o,
        "cairn_sink_connected",
        GAUGE,
        "1 while the sink's destination is connected.",
        &|s| b(s.state != "down"),
    );
    per(
        o,
        "cairn_sink_refusing",
        GAUGE,
        "1 while the sink's broker refuses results (MQTT 5 PUBACK reason >= 0x80): they stay in the outbox and are retried with backoff.",
        &|s| b(s.state == "refusing"),
    );
    per(
        o,
        "cairn_sink_state_seconds",
        GAUGE,
        "Seconds since the sink's state (connected, down, refusing) last changed (0 before the first change).",
        &|s| age_seconds(s.since_ms, now_ms),
    );
    per(
        o,
        "cairn_sink_waiting",
        GAUGE,
        "Outbox entries routed to the sink that it has not settled yet (counted from their checkpoint).",
        &|s| s.waiting as f64,
    );
    per(
        o,
        "cairn_sink_waiting_bytes",
        GAUGE,
        "Payload bytes of the results waiting for the sink.",
        &|s| s.waiting_bytes as f64,
    );
    per(
        o,
        "cairn_sink_oldest_age_seconds",
        GAUGE,
        "Age of the oldest result waiting for the sink, since its checkpoint (0 if none waits).",
        &|s| s.oldest_age_ms as f64 / 1000.0,
    );
    per(
        o,
        "cairn_sink_pipelines",
        GAUGE,
        "Configured pipelines whose results go to the sink (0: it gets none, whatever its state).",
        &|s| s.pipelines as f64,
    );
    per(
        o,
        "cairn_sink_sent_total",
        COUNTER,
        "Results the sink sent (re-sends included).",
        &|s| s.sent as f64,
    );
    per(
        o,
        "cairn_sink_settled_total",
        COUNTER,
        "Results the sink's destination settled.",
        &|s| s.acked as f64,
    );
    per(
        o,
        "cairn_sink_drain_rate",
        GAUGE,
        "Results the sink's destination settled per second, over the last 10 seconds.",
        &|s| s.drain_rate,
    );
    let name = "cairn_sink_duplicate_window_seconds";
    let samples = o.family(
        name,
        GAUGE,
        "A JetStream sink's stream duplicate window: a result re-sent after an outage longer than this is stored again.",
    );
    for s in &f.sinks {
        if let Some(w) = s.duplicate_window {
            samples.push(sample(name, &[("sink", s.name.clone())], w.as_secs_f64()));
        }
    }
    let name = "cairn_sink_refused_total";
    let samples = o.family(
        name,
        COUNTER,
        "Results the sink's broker refused, by MQTT 5 reason (not settled: retried).",
    );
    for s in &f.sinks {
        for (reason, n) in &s.refused {
            samples.push(sample(
                name,
                &[("sink", s.name.clone()), ("reason", reason.to_string())],
                *n as f64,
            ));
        }
    }
}
