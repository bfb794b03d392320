//! Sparkplug B in (issue 31): `format = "sparkplug_b"` pipelines read Eclipse Sparkplug 3.0
//! messages, keep each edge node's session (its BIRTH tables, `bdSeq`, `seq`) as checkpointed
//! state, and aggregate every metric value as an event. Pure, like the rest of
//! [`crate::pipeline`]: the engine hands it a record and its view of the stored state.
//!
//! - [`proto`]: the payload schema, written here for prost, and [`decode`], the one entry
//!   point from bytes (bounded before anything is allocated; never panics).
//! - [`session`]: edge node sessions: how BIRTH, DATA and DEATH messages change them, what
//!   is stored, and the cuts a death makes in time-weighted averages.
//! - `records.rs` (a room of the engine, `engine::sparkplug_records`): one record → many events, through the
//!   engine's dedup, windows and aggregates one by one.
//!
//! # Topics
//!
//! `spBv1.0/<group>/<NBIRTH|NDATA|NDEATH>/<edge_node>` and
//! `spBv1.0/<group>/<DBIRTH|DDATA|DDEATH>/<edge_node>/<device>`. Any other shape under
//! `spBv1.0/` is a dead letter (`bad_topic`), except a host's `STATE` and the commands
//! `NCMD`/`DCMD` (a host's own rebirth requests among them), which are skipped as filtered.
//!
//! # One message, many events
//!
//! Each metric value of a BIRTH or DATA message is an event: its key is the pipeline's
//! template over `{group}`, `{edge_node}`, `{device}` ("" for the node's own metrics) and
//! `{metric}` (the name, resolved through the BIRTH when the message carries an alias), its
//! value the number (integers, floats, doubles; booleans as 0 and 1), its time the metric's
//! timestamp (else the message's, else the time of receipt). `bdSeq` and the `Node Control/`
//! and `Device Control/` metrics are the session's, not values, and are not aggregated. A
//! value of another type, or of a metric the BIRTH does not name, is refused; all the
//! refusals of one record make one dead letter, and the record's other values still count.
//!
//! # Event IDs: what makes one value the same value
//!
//! - A live value: `group/edge_node/device/seq/message/metric/timestamp`, where `message`
//!   is a 64-bit FNV-1a hash of the record's topic and payload in 16 hex digits, and the
//!   timestamp is the one the message states (`-` if it states none). Each part comes from
//!   the message alone, never from what the host has seen before it, so a broker
//!   redelivery (the same bytes) gives the same IDs wherever it lands in the log. It can
//!   land late: killed after logging a stretch of messages and before their PUBACKs left,
//!   the agent gets the whole stretch again, after it has already taken the node's next
//!   session's BIRTH from it. (The session's `bdSeq` was once part of the ID: the
//!   redelivered DATA of the old session took the new one's and counted twice.) Two
//!   different messages differ in their bytes (`seq` and the timestamps move), so they
//!   never share an ID, whatever `bdSeq` a node with no persistent counter restarts
//!   from. Only byte-identical messages of one node count once: same `seq`, same
//!   timestamps, same values.
//! - A historical value (`is_historical`): `group/edge_node/device/h/metric/timestamp`. A
//!   store-and-forward buffer may be flushed twice (the node crashed mid-flush, the host
//!   went offline again), each time in new messages with a new `seq`, maybe in a new
//!   session: the message is no identity for it, the metric and its time are (a metric has
//!   one value at one instant).
//!
//! - A whole message (all but NDEATH): `group/edge_node/device/message`. The broker may
//!   deliver a stretch again from any point, BIRTHs and deaths included, when the session
//!   has moved on: taken again, an old BIRTH would revive its session, its NDEATH would
//!   then cut every metric a second time at the second receipt's time, and DATA arriving
//!   while the session is dead would be refused. So a message whose bytes were taken
//!   before is skipped whole, before its session sees it (it counts as one duplicate).
//!   Not an NDEATH: a will has no `seq` and often no time, so two deaths may well be
//!   byte-identical; one delivered again finds its session over, or a newer one whose
//!   `bdSeq` it does not carry, and changes nothing.
//!
//! Within the pipeline's dedup window an ID seen before counts once (invariant 5).

pub mod proto;
pub mod session;

pub use proto::{Metric, Payload, Value, decode};
pub use session::{Notice, NoticeKind};

use super::refusal::Refusal;
use super::topic::escape_key;
use session::MAX_ID_BYTES;

/// The topic namespace of Sparkplug B.
pub const NAMESPACE: &str = "spBv1.0";

/// What a message is, by its topic's message type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    NBirth,
    NData,
    NDeath,
    DBirth,
    DData,
    DDeath,
}

/// A Sparkplug topic, split.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Topic<'a> {
    pub group: &'a str,
    pub kind: Kind,
    pub edge_node: &'a str,
    /// The device of D* messages.
    pub device: Option<&'a str>,
}

impl<'a> Topic<'a> {
    /// The Sparkplug topic `topic` is; `Ok(None)` for one a host skips (`STATE`, `NCMD`,
    /// `DCMD`), or why it is no Sparkplug B topic.
    pub fn parse(topic: &'a str) -> Result<Option<Topic<'a>>, Refusal> {
        let bad = |why: String| Refusal {
            reason: "bad_topic",
            detail: why,
        };
        let levels: Vec<&str> = topic.splitn(6, '/').collect();
        if levels.first() != Some(&NAMESPACE) {
            return Err(bad(format!(
                "a sparkplug_b pipeline reads topics under `{NAMESPACE}/`"
            )));
        }
        if levels.get(1) == Some(&"STATE") {
            return Ok(None);
        }
        let kind = match levels.get(2).copied() {
            Some("NBIRTH") => Kind::NBirth,
            Some("NDATA") => Kind::NData,
            Some("NDEATH") => Kind::NDeath,
            Some("DBIRTH") => Kind::DBirth,
            Some("DDATA") => Kind::DData,
            Some("DDEATH") => Kind::DDeath,
            Some("NCMD" | "DCMD") => return Ok(None),
            other => {
                return Err(bad(format!(
                    "`{}` is not a Sparkplug message type (NBIRTH, NDATA, NDEATH, DBIRTH, \
                     DDATA, DDEATH)",
                    other.unwrap_or("")
                )));
            }
        };
        let device_kind = matches!(kind, Kind::DBirth | Kind::DData | Kind::DDeath);
        let want = if device_kind { 5 } else { 4 };
        if levels.len() != want {
            return Err(bad(format!(
                "a {} topic has {want} levels: {NAMESPACE}/group/{}/edge_node{}",
                levels[2],
                levels[2],
                if device_kind { "/device" } else { "" }
            )));
        }
        for (what, id) in [("group", levels[1]), ("edge node", levels[3])]
            .into_iter()
            .chain(device_kind.then(|| ("device", levels[4])))
        {
            if id.is_empty() || id.len() > MAX_ID_BYTES {
                return Err(bad(format!(
                    "the {what} ID is {} bytes: 1 to {MAX_ID_BYTES} are accepted",
                    id.len()
                )));
            }
        }
        Ok(Some(Topic {
            group: levels[1],
            kind,
            edge_node: levels[3],
            device: device_kind.then(|| levels[4]),
        }))
    }
}

/// The event ID of one metric value (see the module docs). `message` is
/// [`message_hash`] and `seq` the message's; `time_ms` is the value's time, `stamped`
/// whether the message states it.
pub(crate) fn event_id(
    topic: &Topic<'_>,
    device: &str,
    metric: &str,
    (time_ms, stamped): (u64, bool),
    historical: bool,
    (message, seq): (u64, Option<u8>),
) -> String {
    let (g, n, d, m) = (
        escape_key(topic.group),
        escape_key(topic.edge_node),
        escape_key(device),
        escape_key(metric),
    );
    if historical {
        format!("{g}/{n}/{d}/h/{m}/{time_ms}")
    } else {
        let seq = seq.map_or_else(|| "-".to_string(), |s| s.to_string());
        let time = if stamped {
            time_ms.to_string()
        } else {
            "-".to_string()
        };
        format!("{g}/{n}/{d}/{seq}/{message:016x}/{m}/{time}")
    }
}

/// The ledger's ID of a whole message (the module docs say which are deduplicated whole):
/// four parts, where every value's ID has six or seven, so none can be another's.
pub(crate) fn message_id(topic: &Topic<'_>, message: u64) -> String {
    let device = topic.device.unwrap_or("");
    format!(
        "{}/{}/{}/{message:016x}",
        escape_key(topic.group),
        escape_key(topic.edge_node),
        escape_key(device)
    )
}

/// What identifies one message whatever the host's state: a stable hash (the same in
/// every build and on every machine, as the ledger keeps IDs across upgrades) of its topic
/// and payload.
pub(crate) fn message_hash(topic: &str, payload: &[u8]) -> u64 {
    crate::model::fnv1a(topic.as_bytes().iter().chain(&[0u8]).chain(payload))
}

#[cfg(test)]
mod tests;

/// The topic of a host's STATE (Sparkplug 3.0: `spBv1.0/STATE/<host_id>`).
pub fn state_topic(host_id: &str) -> String {
    format!("{NAMESPACE}/STATE/{host_id}")
}

/// A host's STATE payload: JSON `{"online":..,"timestamp":..}`, where the timestamp of the
/// online STATE is the one in the will registered at connect (spec 3.0).
pub fn state_payload(online: bool, timestamp_ms: u64) -> Vec<u8> {
    serde_json::json!({"online": online, "timestamp": timestamp_ms})
        .to_string()
        .into_bytes()
}

/// Whether `payload` says `online: false` (a STATE message, maybe a host's will).
pub fn state_says_offline(payload: &[u8]) -> bool {
    serde_json::from_slice::<serde_json::Value>(payload)
        .is_ok_and(|v| v.get("online") == Some(&serde_json::Value::Bool(false)))
}

/// The NCMD that asks an edge node to publish its BIRTHs again: topic and payload (a
/// `Node Control/Rebirth` metric, Boolean true, stamped `now_ms`).
pub fn rebirth_request(group: &str, edge_node: &str, now_ms: u64) -> (String, Vec<u8>) {
    use prost::Message;
    let payload = Payload {
        timestamp: Some(now_ms),
        metrics: vec![Metric {
            name: Some("Node Control/Rebirth".into()),
            timestamp: Some(now_ms),
            datatype: Some(proto::datatype::BOOLEAN),
            value: Some(Value::Boolean(true)),
            ..Default::default()
        }],
        seq: None,
        uuid: None,
    };
    (
        format!("{NAMESPACE}/{group}/NCMD/{edge_node}"),
        payload.encode_to_vec(),
    )
}
