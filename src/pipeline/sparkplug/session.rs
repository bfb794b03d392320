//! Edge node sessions: what one pipeline remembers of each Sparkplug edge node, and how each
//! message changes it. Pure: entries are read and written through [`Entries`], which the
//! engine backs with its overlay over the last checkpoint (tree `sparkplug` of the store).
//!
//! # What is stored (one entry each, all bounded by `MAX_ENTRY_BYTES`)
//!
//! Keys start with the node: `len u16 | group | len u16 | edge_node`, then
//!
//! - `N` → [`NodeEntry`]: the session's `bdSeq`, the last `seq`, alive or dead, and how
//!   many metrics the node and its devices named in their BIRTHs (bounded by
//!   [`MAX_METRICS_PER_NODE`]).
//! - `D device` → [`DeviceEntry`]: alive or dead, its metric count.
//! - `A alias` (u64 big-endian) → [`AliasEntry`]: which device's which metric the alias
//!   names (aliases are unique across a node and its devices, spec 3.0).
//! - `M len u16 | device | name` → [`MetricEntry`]: its data type and its latest sample while
//!   its session lives (a twa window's carried-in value comes from here).
//!
//! An alias table is thus one small entry per metric, never one large value: a node of
//! 50,000 metrics is 100,000 entries of a few dozen bytes, each within the store's bound.
//!
//! # The rules (Sparkplug 3.0 §4 and §5, as a host applies them)
//!
//! - NBIRTH opens a node session: its `bdSeq` metric names it, its `seq` restarts the count,
//!   its metrics (name, alias, type, current value) replace every table of the node; device
//!   sessions end with it (their DATA is refused until their DBIRTH). A BIRTH restates
//!   current values and cuts nothing (a rebirth is no gap in the data); each metric keeps
//!   its last point across it, so a new session knows whether the value before it had died.
//! - DBIRTH opens a device session of a live node; NDATA and DDATA need a live session, and
//!   resolve each metric by alias (or name) through the BIRTH's tables.
//! - `seq` counts 0..=255 per node and wraps; a message more than one ahead is a gap (lost
//!   messages: QoS 0), reported ([`Notice`]). One at or behind the last (by less than half
//!   the circle) is a redelivery: no gap, and dedup drops its values.
//! - NDEATH ends the node session, and every device's, only if its `bdSeq` is the
//!   session's: a late will of an earlier connection is ignored. DDEATH ends one device's.
//!   A session that ends makes its metrics stale: each one's last value stops at the death
//!   time (a [`Cut`]), and DATA is refused until the next BIRTH.
//! - A metric whose `is_null` is set has no value from its timestamp on (a cut, too).

use serde::{Deserialize, Serialize};

use super::super::engine::ReadError;
use super::super::num::{MAX_EXACT_FLOAT, Num};
use super::super::refusal::Refusal;
use super::proto::{Metric, Payload, Value, datatype};
use super::{Kind, Topic};

/// Most metrics one node and its devices may name in their BIRTHs together: each is two
/// stored entries, and an NBIRTH or NDEATH touches all of them in one checkpoint. A BIRTH
/// that would pass it is a dead letter (`too_many_metrics`) and opens no session.
pub const MAX_METRICS_PER_NODE: u32 = 50_000;

/// Longest metric name kept (bytes): names are keys of stored entries and parts of state
/// keys and event IDs. A longer one is refused with its value.
pub const MAX_NAME_BYTES: usize = 1024;

/// Longest group, edge node or device ID (bytes): they prefix every stored entry of a node.
pub const MAX_ID_BYTES: usize = 256;

/// A stored entry of the Sparkplug state (see the module docs). Postcard names a variant by
/// its position: new variants go at the end.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Entry {
    Node(NodeEntry),
    Device(DeviceEntry),
    Alias(AliasEntry),
    Metric(MetricEntry),
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeEntry {
    /// The `bdSeq` of the NBIRTH that opened the session.
    pub bd_seq: u64,
    /// `seq` of the session's latest message (`None` before one carried it).
    pub seq: Option<u8>,
    pub alive: bool,
    /// Metrics named by the node's NBIRTH and its devices' DBIRTHs.
    pub metrics: u32,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceEntry {
    pub alive: bool,
    pub metrics: u32,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AliasEntry {
    /// "" for a metric of the node itself.
    pub device: String,
    pub name: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MetricEntry {
    pub datatype: u32,
    pub alias: Option<u64>,
    /// The point with the greatest time so far (kept across BIRTHs): `(time, Some(value))`, or
    /// `(time, None)` once a death or a null made it stale at `time`.
    pub last: Option<(u64, Option<f64>)>,
}

/// Reads and writes of one pipeline's Sparkplug entries (keys as in the module docs).
pub(crate) trait Entries {
    fn get(&mut self, key: &[u8]) -> Result<Option<Entry>, ReadError>;
    /// `None` deletes.
    fn put(&mut self, key: Vec<u8>, entry: Option<Entry>);
    /// Every key with this prefix, in order.
    fn keys(&mut self, prefix: &[u8]) -> Result<Vec<Vec<u8>>, ReadError>;
}

/// Something a host should know about a node's session, for the live loop to count, log
/// and (with `rebirth = true`) answer with a rebirth request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notice {
    pub group: String,
    pub edge_node: String,
    pub kind: NoticeKind,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NoticeKind {
    /// Messages were lost: `seq` jumped from `last` to `got`.
    SeqGap { last: u8, got: u8 },
    /// A metric the session's BIRTHs do not name (by alias or name).
    UnknownMetric { alias: Option<u64> },
    /// DATA or DBIRTH of a node (or device) with no live session.
    NoSession,
}

/// One value of a metric, to aggregate.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Sample {
    pub device: String,
    pub metric: String,
    pub time_ms: u64,
    /// The number, `None` for a null (no value from `time_ms` on), or why it is refused.
    pub value: Result<Option<Num>, Refusal>,
    pub historical: bool,
    /// The metric's latest point before this one: a value, or `None` when it was dead (or
    /// null) from that time on.
    pub prior: Option<(u64, Option<f64>)>,
    /// Whether the message states `time_ms` (the metric's timestamp or the payload's), rather
    /// than the time of receipt standing in; and the message's `seq`. Both for the event ID,
    /// which must not change when the broker delivers the same message again.
    pub stamped: bool,
    pub seq: Option<u8>,
}

/// A metric whose value stops at `time_ms` (its session ended).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Cut {
    pub device: String,
    pub metric: String,
    pub time_ms: u64,
}

/// What one message did: values to aggregate, metrics cut, a refusal for the rest, and a
/// notice for the host.
#[derive(Debug, Default)]
pub(crate) struct Step {
    pub samples: Vec<Sample>,
    pub cuts: Vec<Cut>,
    pub notices: Vec<NoticeKind>,
    /// The message was ignored on purpose (an NDEATH of an earlier session).
    pub ignored: bool,
}

fn refuse(reason: &'static str, detail: impl Into<String>) -> Refusal {
    Refusal {
        reason,
        detail: detail.into(),
    }
}

/// The key prefix of a node's entries.
pub(crate) fn node_prefix(group: &str, edge_node: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(4 + group.len() + edge_node.len());
    push_text(&mut k, group);
    push_text(&mut k, edge_node);
    k
}

fn push_text(k: &mut Vec<u8>, s: &str) {
    // Group, node and device IDs are bounded by MAX_ID_BYTES, names by MAX_NAME_BYTES.
    k.extend_from_slice(&(s.len() as u16).to_be_bytes());
    k.extend_from_slice(s.as_bytes());
}

fn with(prefix: &[u8], tag: u8, rest: &[u8]) -> Vec<u8> {
    let mut k = Vec::with_capacity(prefix.len() + 1 + rest.len());
    k.extend_from_slice(prefix);
    k.push(tag);
    k.extend_from_slice(rest);
    k
}

fn device_metrics_prefix(prefix: &[u8], device: &str) -> Vec<u8> {
    let mut k = with(prefix, b'M', &[]);
    push_text(&mut k, device);
    k
}

fn metric_key(prefix: &[u8], device: &str, name: &str) -> Vec<u8> {
    let mut k = device_metrics_prefix(prefix, device);
    k.extend_from_slice(name.as_bytes());
    k
}

/// The device and name a metric key holds.
fn split_metric_key(prefix: &[u8], key: &[u8]) -> Option<(String, String)> {
    let rest = key.get(prefix.len() + 1..)?;
    let len = u16::from_be_bytes([*rest.first()?, *rest.get(1)?]) as usize;
    let device = std::str::from_utf8(rest.get(2..2 + len)?).ok()?;
    let name = std::str::from_utf8(rest.get(2 + len..)?).ok()?;
    Some((device.to_string(), name.to_string()))
}

/// The state `step` works on: the entries, and the node's key prefix.
struct Node<'a, E: Entries> {
    e: &'a mut E,
    prefix: Vec<u8>,
}

impl<E: Entries> Node<'_, E> {
    fn node(&mut self) -> Result<Option<NodeEntry>, ReadError> {
        Ok(match self.e.get(&with(&self.prefix, b'N', &[]))? {
            Some(Entry::Node(n)) => Some(n),
            _ => None,
        })
    }
    fn set_node(&mut self, n: NodeEntry) {
        self.e
            .put(with(&self.prefix, b'N', &[]), Some(Entry::Node(n)));
    }
    fn device(&mut self, device: &str) -> Result<Option<DeviceEntry>, ReadError> {
        Ok(
            match self.e.get(&with(&self.prefix, b'D', device.as_bytes()))? {
                Some(Entry::Device(d)) => Some(d),
                _ => None,
            },
        )
    }
    fn set_device(&mut self, device: &str, d: Option<DeviceEntry>) {
        self.e.put(
            with(&self.prefix, b'D', device.as_bytes()),
            d.map(Entry::Device),
        );
    }
    fn metric(&mut self, device: &str, name: &str) -> Result<Option<MetricEntry>, ReadError> {
        Ok(match self.e.get(&metric_key(&self.prefix, device, name))? {
            Some(Entry::Metric(m)) => Some(m),
            _ => None,
        })
    }
    fn set_metric(&mut self, device: &str, name: &str, m: Option<MetricEntry>) {
        self.e
            .put(metric_key(&self.prefix, device, name), m.map(Entry::Metric));
    }
    fn alias(&mut self, alias: u64) -> Result<Option<AliasEntry>, ReadError> {
        Ok(
            match self
                .e
                .get(&with(&self.prefix, b'A', &alias.to_be_bytes()))?
            {
                Some(Entry::Alias(a)) => Some(a),
                _ => None,
            },
        )
    }
    fn set_alias(&mut self, alias: u64, a: Option<AliasEntry>) {
        self.e.put(
            with(&self.prefix, b'A', &alias.to_be_bytes()),
            a.map(Entry::Alias),
        );
    }

    /// End the sessions of `device` (or, with `None`, of the node's own metrics and every
    /// device's) at `time_ms`: each metric with a value is cut there (never before its last
    /// sample), and keeps no value until a BIRTH.
    fn end(
        &mut self,
        device: Option<&str>,
        time_ms: u64,
        cuts: &mut Vec<Cut>,
    ) -> Result<(), ReadError> {
        let prefix = match device {
            Some(d) => device_metrics_prefix(&self.prefix, d),
            None => with(&self.prefix, b'M', &[]),
        };
        for key in self.e.keys(&prefix)? {
            let Some(Entry::Metric(mut m)) = self.e.get(&key)? else {
                continue;
            };
            let Some((t, Some(_))) = m.last else {
                continue;
            };
            let Some((device, metric)) = split_metric_key(&self.prefix, &key) else {
                continue;
            };
            let at = time_ms.max(t);
            m.last = Some((at, None));
            self.e.put(key, Some(Entry::Metric(m)));
            cuts.push(Cut {
                device,
                metric,
                time_ms: at,
            });
        }
        Ok(())
    }

    /// Before a BIRTH of `device` (or, with `None`, of the node) replaces its tables:
    /// forget its aliases (an NBIRTH: every alias and device entry of the node), and the
    /// metric entries of the metrics the BIRTH does not name. Those it names keep their last
    /// point, so a new session knows whether the value before it was dead. Returns how many
    /// device metric entries an NBIRTH leaves stored (stale until their DBIRTH).
    fn forget(&mut self, device: Option<&str>, birth: &Payload) -> Result<u32, ReadError> {
        let named: std::collections::HashSet<&str> = birth
            .metrics
            .iter()
            .filter_map(|m| m.name.as_deref())
            .collect();
        let prefix = match device {
            Some(d) => device_metrics_prefix(&self.prefix, d),
            None => with(&self.prefix, b'M', &[]),
        };
        let mut kept = 0u32;
        for key in self.e.keys(&prefix)? {
            let Some((dev, name)) = split_metric_key(&self.prefix, &key) else {
                self.e.put(key, None);
                continue;
            };
            if let (Some(Entry::Metric(m)), Some(_)) = (self.e.get(&key)?, device) {
                if let Some(a) = m.alias {
                    self.set_alias(a, None);
                }
            }
            let ours = device.unwrap_or("") == dev;
            if ours && !named.contains(name.as_str()) {
                self.e.put(key, None);
            } else if !ours {
                kept += 1;
            }
        }
        if device.is_none() {
            for tag in [b'A', b'D'] {
                for key in self.e.keys(&with(&self.prefix, tag, &[]))? {
                    self.e.put(key, None);
                }
            }
        }
        Ok(kept)
    }
}

/// Apply one message of `topic` to the session state and say what it yields; a refusal
/// (`no_session`, `bad_birth`, ...) changes nothing.
/// `received_at_ms` stands in for a missing timestamp, and is the time of an NDEATH (the
/// broker publishes a will when it finds the connection dead: its payload was written at
/// connect). `wanted` says which metrics the pipeline aggregates: the others change only
/// the tables.
pub(crate) fn step<E: Entries>(
    entries: &mut E,
    topic: &Topic<'_>,
    payload: &Payload,
    received_at_ms: u64,
    wanted: &dyn Fn(&str) -> bool,
) -> Result<Step, Refusal> {
    let mut node = Node {
        e: entries,
        prefix: node_prefix(topic.group, topic.edge_node),
    };
    let read = |e: ReadError| refuse("internal", e.0);
    let sent_at = payload.timestamp.unwrap_or(received_at_ms);
    let stamped = payload.timestamp.is_some();
    let seq = match payload.seq {
        None => None,
        Some(s) if s <= 255 => Some(s as u8),
        Some(s) => return Err(refuse("bad_seq", format!("seq is {s}, beyond 255"))),
    };
    let mut out = Step::default();
    let device = topic.device.unwrap_or("");
    match topic.kind {
        Kind::NBirth => {
            let bd_seq = bd_seq_of(payload).ok_or_else(|| {
                refuse(
                    "bad_birth",
                    "the NBIRTH has no `bdSeq` metric with an integer value",
                )
            })?;
            let named = payload.metrics.len() as u32;
            // Device metrics stay stored (stale, with their last points) until their DBIRTH.
            let kept = node.forget(None, payload).map_err(read)?;
            let total = named.saturating_add(kept);
            if total > MAX_METRICS_PER_NODE {
                return Err(too_many(total));
            }
            node.set_node(NodeEntry {
                bd_seq,
                seq,
                alive: true,
                metrics: total,
            });
            birth(
                &mut node, "", payload, sent_at, stamped, seq, wanted, &mut out,
            )
            .map_err(read)?;
        }
        Kind::DBirth => {
            let Some(mut n) = node.node().map_err(read)?.filter(|n| n.alive) else {
                return Err(refuse(
                    "no_session",
                    format!(
                        "DBIRTH of device `{device}` while its edge node has no live session (no NBIRTH since it started or died)"
                    ),
                ));
            };
            check_seq(&mut n, seq, &mut out);
            let old = node.device(device).map_err(read)?;
            let before = old.as_ref().map_or(0, |d| d.metrics);
            let named = payload.metrics.len() as u32;
            let total = (n.metrics - before.min(n.metrics)).saturating_add(named);
            if total > MAX_METRICS_PER_NODE {
                return Err(too_many(total));
            }
            node.forget(Some(device), payload).map_err(read)?;
            n.metrics = total;
            node.set_node(n);
            node.set_device(
                device,
                Some(DeviceEntry {
                    alive: true,
                    metrics: named,
                }),
            );
            birth(
                &mut node, device, payload, sent_at, stamped, seq, wanted, &mut out,
            )
            .map_err(read)?;
        }
        Kind::NData | Kind::DData => {
            let Some(mut n) = node.node().map_err(read)?.filter(|n| n.alive) else {
                return Err(refuse(
                    "no_session",
                    "DATA from an edge node with no live session (no NBIRTH since it started \
                     or died): its aliases cannot be resolved",
                ));
            };
            check_seq(&mut n, seq, &mut out);
            node.set_node(n);
            if topic.kind == Kind::DData
                && !node.device(device).map_err(read)?.is_some_and(|d| d.alive)
            {
                return Err(refuse(
                    "no_session",
                    format!(
                        "DDATA of device `{device}` with no live device session (no DBIRTH since the node's NBIRTH or the device's DDEATH)"
                    ),
                ));
            }
            data(
                &mut node, device, payload, sent_at, stamped, seq, wanted, &mut out,
            )
            .map_err(read)?;
        }
        Kind::NDeath => {
            let bd_seq = bd_seq_of(payload);
            match node.node().map_err(read)? {
                Some(mut n) if n.alive && bd_seq == Some(n.bd_seq) => {
                    node.end(None, received_at_ms, &mut out.cuts)
                        .map_err(read)?;
                    for key in node.e.keys(&with(&node.prefix, b'D', &[])).map_err(read)? {
                        if let Some(Entry::Device(mut d)) = node.e.get(&key).map_err(read)? {
                            d.alive = false;
                            node.e.put(key, Some(Entry::Device(d)));
                        }
                    }
                    n.alive = false;
                    node.set_node(n);
                }
                // An NDEATH of an earlier connection (its will, published late), or of a
                // session already ended: the spec says to ignore it.
                _ => out.ignored = true,
            }
        }
        Kind::DDeath => match node.node().map_err(read)?.filter(|n| n.alive) {
            Some(mut n) => {
                check_seq(&mut n, seq, &mut out);
                node.set_node(n);
                match node.device(device).map_err(read)? {
                    Some(mut d) if d.alive => {
                        node.end(Some(device), sent_at, &mut out.cuts)
                            .map_err(read)?;
                        d.alive = false;
                        node.set_device(device, Some(d));
                    }
                    _ => out.ignored = true,
                }
            }
            None => out.ignored = true,
        },
    }
    Ok(out)
}

fn too_many(n: u32) -> Refusal {
    refuse(
        "too_many_metrics",
        format!(
            "the edge node and its devices would name {n} metrics, at most \
             {MAX_METRICS_PER_NODE} are kept per node"
        ),
    )
}

/// The session's `seq` after one more message: a jump is a gap.
fn check_seq(n: &mut NodeEntry, seq: Option<u8>, out: &mut Step) {
    let (Some(last), Some(got)) = (n.seq, seq) else {
        if seq.is_some() {
            n.seq = seq;
        }
        return;
    };
    let ahead = got.wrapping_sub(last);
    if ahead == 1 {
        n.seq = Some(got);
    } else if ahead == 0 || ahead >= 128 {
        // At or behind the last one: a redelivery, or a message overtaken by a later one.
    } else {
        out.notices.push(NoticeKind::SeqGap { last, got });
        n.seq = Some(got);
    }
}

/// The `bdSeq` metric's value.
fn bd_seq_of(p: &Payload) -> Option<u64> {
    p.metrics
        .iter()
        .find(|m| m.name.as_deref() == Some("bdSeq"))
        .and_then(|m| match m.value {
            Some(Value::Long(v)) => Some(v),
            Some(Value::Int(v)) => Some(u64::from(v)),
            _ => None,
        })
}

/// Metrics that are the session's own bookkeeping, not process values.
fn bookkeeping(name: &str) -> bool {
    name == "bdSeq" || name.starts_with("Node Control/") || name.starts_with("Device Control/")
}

/// A BIRTH's tables, and its current values as samples.
#[allow(clippy::too_many_arguments)]
fn birth<E: Entries>(
    node: &mut Node<'_, E>,
    device: &str,
    p: &Payload,
    sent_at: u64,
    stamped: bool,
    seq: Option<u8>,
    wanted: &dyn Fn(&str) -> bool,
    out: &mut Step,
) -> Result<(), ReadError> {
    for m in &p.metrics {
        let Some(name) = m.name.as_deref() else {
            continue; // a BIRTH names every metric; an unnamed one names nothing
        };
        if name.len() > MAX_NAME_BYTES {
            continue;
        }
        let datatype = m.datatype.unwrap_or(0);
        if let Some(alias) = m.alias {
            node.set_alias(
                alias,
                Some(AliasEntry {
                    device: device.to_string(),
                    name: name.to_string(),
                }),
            );
        }
        let last = node.metric(device, name)?.and_then(|e| e.last);
        let mut entry = MetricEntry {
            datatype,
            alias: m.alias,
            last,
        };
        if !bookkeeping(name) && wanted(name) {
            sample(device, name, &mut entry, m, sent_at, stamped, seq, out);
        }
        node.set_metric(device, name, Some(entry));
    }
    Ok(())
}

/// A DATA message's values, each resolved through the tables.
#[allow(clippy::too_many_arguments)]
fn data<E: Entries>(
    node: &mut Node<'_, E>,
    device: &str,
    p: &Payload,
    sent_at: u64,
    stamped: bool,
    seq: Option<u8>,
    wanted: &dyn Fn(&str) -> bool,
    out: &mut Step,
) -> Result<(), ReadError> {
    for m in &p.metrics {
        let name = match (&m.name, m.alias) {
            (Some(name), _) => Some(name.clone()),
            (None, Some(alias)) => node
                .alias(alias)?
                .filter(|a| a.device == device)
                .map(|a| a.name),
            (None, None) => None,
        };
        let entry = match &name {
            Some(name) if name.len() <= MAX_NAME_BYTES => node.metric(device, name)?,
            _ => None,
        };
        let (Some(name), Some(mut entry)) = (name, entry) else {
            out.notices
                .push(NoticeKind::UnknownMetric { alias: m.alias });
            out.samples.push(Sample {
                device: device.to_string(),
                metric: m
                    .alias
                    .map_or_else(|| "(no name)".into(), |a| format!("alias {a}")),
                time_ms: m.timestamp.unwrap_or(sent_at),
                value: Err(refuse(
                    "unknown_metric",
                    "a metric the session's BIRTH does not name (by alias or name)",
                )),
                historical: m.is_historical == Some(true),
                prior: None,
                stamped: stamped || m.timestamp.is_some(),
                seq,
            });
            continue;
        };
        if bookkeeping(&name) || !wanted(&name) {
            continue;
        }
        if let Some(t) = m.datatype {
            entry.datatype = t;
        }
        sample(device, &name, &mut entry, m, sent_at, stamped, seq, out);
        node.set_metric(device, &name, Some(entry));
    }
    Ok(())
}

/// One value of a metric as a sample; the metric's latest sample moves to it if it is not
/// older.
#[allow(clippy::too_many_arguments)]
fn sample(
    device: &str,
    name: &str,
    entry: &mut MetricEntry,
    m: &Metric,
    sent_at: u64,
    stamped: bool,
    seq: Option<u8>,
    out: &mut Step,
) {
    let time_ms = m.timestamp.unwrap_or(sent_at);
    let value = if m.is_null == Some(true) {
        Ok(None)
    } else {
        number(entry.datatype, m.value.as_ref()).map(Some)
    };
    let prior = entry.last;
    if let Ok(v) = &value {
        if entry.last.is_none_or(|(t, _)| time_ms >= t) {
            entry.last = Some((time_ms, v.map(Num::as_f64)));
        }
    }
    out.samples.push(Sample {
        device: device.to_string(),
        metric: name.to_string(),
        time_ms,
        value,
        historical: m.is_historical == Some(true),
        prior,
        stamped: stamped || m.timestamp.is_some(),
        seq,
    });
}

/// A metric's value as a number, read by its data type: integers (signed ones by their
/// width's two's complement), floats and doubles (finite, below 2^53), booleans as 0 and 1.
/// Anything else is refused with the type's name.
pub(crate) fn number(dtype: u32, value: Option<&Value>) -> Result<Num, Refusal> {
    use datatype as t;
    let Some(value) = value else {
        return Err(refuse("missing_value", "the metric carries no value"));
    };
    let int = match value {
        Value::Int(v) => Some(u64::from(*v)),
        Value::Long(v) => Some(*v),
        _ => None,
    };
    let wrong = || {
        refuse(
            "wrong_type",
            format!(
                "a {} metric carries a {} value",
                t::name(dtype),
                match value {
                    Value::Int(_) => "uint32",
                    Value::Long(_) => "uint64",
                    Value::Float(_) => "float",
                    Value::Double(_) => "double",
                    Value::Boolean(_) => "boolean",
                    Value::String(_) => "string",
                    Value::Bytes(_) => "bytes",
                    Value::DataSet(_) => "DataSet",
                    Value::Template(_) => "Template",
                    Value::Extension(_) => "extension",
                }
            ),
        )
    };
    let float = |f: f64| {
        if f.is_finite() && f.abs() < MAX_EXACT_FLOAT {
            Ok(Num::Float(f))
        } else {
            Err(refuse(
                "out_of_range",
                format!("{f} is not a finite number below 2^53"),
            ))
        }
    };
    match dtype {
        t::INT8 => int
            .map(|v| Num::Int(i64::from(v as u8 as i8)))
            .ok_or_else(wrong),
        t::INT16 => int
            .map(|v| Num::Int(i64::from(v as u16 as i16)))
            .ok_or_else(wrong),
        t::INT32 => int
            .map(|v| Num::Int(i64::from(v as u32 as i32)))
            .ok_or_else(wrong),
        t::INT64 => int.map(|v| Num::Int(v as i64)).ok_or_else(wrong),
        t::UINT8 => int.map(|v| Num::Int(i64::from(v as u8))).ok_or_else(wrong),
        t::UINT16 => int.map(|v| Num::Int(i64::from(v as u16))).ok_or_else(wrong),
        t::UINT32 => int.map(|v| Num::Int(i64::from(v as u32))).ok_or_else(wrong),
        t::UINT64 => match int {
            Some(v) => i64::try_from(v).map(Num::Int).map_err(|_| {
                refuse(
                    "out_of_range",
                    format!("{v} does not fit a signed 64-bit integer"),
                )
            }),
            None => Err(wrong()),
        },
        t::FLOAT => match value {
            Value::Float(f) => float(f64::from(*f)),
            _ => Err(wrong()),
        },
        t::DOUBLE => match value {
            Value::Double(f) => float(*f),
            Value::Float(f) => float(f64::from(*f)),
            _ => Err(wrong()),
        },
        t::BOOLEAN => match value {
            Value::Boolean(b) => Ok(Num::Int(i64::from(*b))),
            _ => Err(wrong()),
        },
        other => Err(refuse(
            "not_numeric",
            format!(
                "a {} metric: only integers, floats, doubles and booleans aggregate",
                t::name(other)
            ),
        )),
    }
}
