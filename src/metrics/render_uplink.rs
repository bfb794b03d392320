//! The uplink and the outbox as its queue (issue 13), for the table in `render.rs`.

use super::{COUNTER, Figures, GAUGE, Out, age_seconds, b};

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
}
