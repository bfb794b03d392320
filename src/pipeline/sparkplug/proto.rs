//! The Sparkplug B payload schema (Eclipse Sparkplug 3.0, `sparkplug_b.proto`, proto2), as
//! message structs written here for `prost`: no `protoc`, no build script.
//!
//! What Cairn aggregates is a metric's number, so the structs keep the fields that say which
//! metric, when and what number, and declare the rest so that a sender cannot make decoding
//! costly:
//!
//! - `Payload`: `timestamp` (1), `metrics` (2), `seq` (3), `uuid` (4). `body` (5) and
//!   extensions are not declared: prost skips an undeclared field by its length, allocating
//!   nothing.
//! - `Metric`: `name` (1) .. `is_null` (7) and the `value` oneof (10 .. 19). `metadata` (8)
//!   and `properties` (9) are not declared (skipped likewise). The nested values a metric
//!   may carry (`DataSet` 17, `Template` 18, an extension 19) are declared as opaque bytes:
//!   they are length-delimited on the wire like any message, so they decode without being
//!   parsed, and a `Template` nested thousands deep is one byte string, not a recursion.
//!   Cairn refuses their values anyway (only numbers aggregate).
//!
//! So the only nesting is `Payload` → `Metric`, and the only repeated field is `metrics`,
//! whose entries [`decode`] counts on the wire before prost allocates any of them
//! ([`MAX_METRICS_PER_MESSAGE`]). The payload itself is bounded before it gets here: the log
//! never holds a payload over `log.max_payload` (a bigger one is a `too_large` stand-in).

use super::super::refusal::Refusal;

/// Most metrics one message may carry. A metric can be two bytes on the wire and ~150 in
/// memory, so a 256 KiB payload of empty metrics would decode to ~20 MiB: the count is
/// checked on the wire first. An NBIRTH names every metric of its node, so the bound is
/// generous (a large gateway publishes a few thousand); a bigger message is a dead letter
/// that says so.
pub const MAX_METRICS_PER_MESSAGE: usize = 10_000;

/// The Sparkplug data types (`DataType` in the spec), by their numbers.
pub mod datatype {
    pub const INT8: u32 = 1;
    pub const INT16: u32 = 2;
    pub const INT32: u32 = 3;
    pub const INT64: u32 = 4;
    pub const UINT8: u32 = 5;
    pub const UINT16: u32 = 6;
    pub const UINT32: u32 = 7;
    pub const UINT64: u32 = 8;
    pub const FLOAT: u32 = 9;
    pub const DOUBLE: u32 = 10;
    pub const BOOLEAN: u32 = 11;
    pub const STRING: u32 = 12;
    pub const DATETIME: u32 = 13;
    pub const TEXT: u32 = 14;
    pub const UUID: u32 = 15;
    pub const DATASET: u32 = 16;
    pub const BYTES: u32 = 17;
    pub const FILE: u32 = 18;
    pub const TEMPLATE: u32 = 19;

    /// The spec's name of a data type number, for a dead letter.
    pub fn name(t: u32) -> &'static str {
        const NAMES: [&str; 20] = [
            "Unknown", "Int8", "Int16", "Int32", "Int64", "UInt8", "UInt16", "UInt32", "UInt64",
            "Float", "Double", "Boolean", "String", "DateTime", "Text", "UUID", "DataSet", "Bytes",
            "File", "Template",
        ];
        NAMES.get(t as usize).copied().unwrap_or("unknown")
    }
}

/// A Sparkplug B payload (`Payload` in the spec).
#[derive(Clone, PartialEq, prost::Message)]
pub struct Payload {
    /// When the message was sent, ms since the epoch.
    #[prost(uint64, optional, tag = "1")]
    pub timestamp: Option<u64>,
    #[prost(message, repeated, tag = "2")]
    pub metrics: Vec<Metric>,
    /// 0..=255 per edge node session, one more per message; absent in NDEATH.
    #[prost(uint64, optional, tag = "3")]
    pub seq: Option<u64>,
    #[prost(string, optional, tag = "4")]
    pub uuid: Option<String>,
}

/// One metric of a payload (`Payload.Metric` in the spec).
#[derive(Clone, PartialEq, prost::Message)]
pub struct Metric {
    /// In BIRTH messages; DATA messages usually carry the alias alone.
    #[prost(string, optional, tag = "1")]
    pub name: Option<String>,
    #[prost(uint64, optional, tag = "2")]
    pub alias: Option<u64>,
    /// When the value was taken, ms since the epoch.
    #[prost(uint64, optional, tag = "3")]
    pub timestamp: Option<u64>,
    #[prost(uint32, optional, tag = "4")]
    pub datatype: Option<u32>,
    /// A value from the edge node's store-and-forward buffer, not a live one.
    #[prost(bool, optional, tag = "5")]
    pub is_historical: Option<bool>,
    #[prost(bool, optional, tag = "6")]
    pub is_transient: Option<bool>,
    #[prost(bool, optional, tag = "7")]
    pub is_null: Option<bool>,
    #[prost(oneof = "Value", tags = "10, 11, 12, 13, 14, 15, 16, 17, 18, 19")]
    pub value: Option<Value>,
}

/// A metric's value (the `value` oneof of `Payload.Metric`).
#[derive(Clone, PartialEq, prost::Oneof)]
pub enum Value {
    /// Int8, Int16, Int32, UInt8, UInt16 (and UInt32 by older encoders).
    #[prost(uint32, tag = "10")]
    Int(u32),
    /// Int64, UInt32, UInt64, DateTime.
    #[prost(uint64, tag = "11")]
    Long(u64),
    #[prost(float, tag = "12")]
    Float(f32),
    #[prost(double, tag = "13")]
    Double(f64),
    #[prost(bool, tag = "14")]
    Boolean(bool),
    #[prost(string, tag = "15")]
    String(String),
    #[prost(bytes = "vec", tag = "16")]
    Bytes(Vec<u8>),
    /// A `DataSet` message, kept opaque (see the module docs).
    #[prost(bytes = "vec", tag = "17")]
    DataSet(Vec<u8>),
    /// A `Template` message, kept opaque.
    #[prost(bytes = "vec", tag = "18")]
    Template(Vec<u8>),
    /// A `MetricValueExtension` message, kept opaque.
    #[prost(bytes = "vec", tag = "19")]
    Extension(Vec<u8>),
}

fn refuse(detail: String) -> Refusal {
    Refusal {
        reason: "not_sparkplug",
        detail,
    }
}

/// Decode a Sparkplug B payload, or say why it is not one. Pure; never panics, whatever the
/// bytes (`sparkplug::tests` and the property tests of `tests/it/sparkplug.rs`): the number
/// of metrics is counted on the wire first, so no input makes it allocate more than a few
/// times its own size.
pub fn decode(bytes: &[u8]) -> Result<Payload, Refusal> {
    let metrics = count_metrics(bytes)?;
    if metrics > MAX_METRICS_PER_MESSAGE {
        return Err(Refusal {
            reason: "too_many_metrics",
            detail: format!(
                "the message carries {metrics} metrics, at most {MAX_METRICS_PER_MESSAGE} are \
                 taken from one message"
            ),
        });
    }
    <Payload as prost::Message>::decode(bytes)
        .map_err(|e| refuse(format!("payload is not a Sparkplug B protobuf: {e}")))
}

/// Top-level fields numbered 2 (`metrics`), counted by walking the wire format without
/// decoding anything. Stops at the first field that does not parse (prost then says why).
fn count_metrics(mut b: &[u8]) -> Result<usize, Refusal> {
    let mut metrics = 0usize;
    while !b.is_empty() {
        let Some((key, rest)) = varint(b) else {
            return Ok(metrics);
        };
        b = rest;
        let (field, wire) = (key >> 3, key & 7);
        let skip = match wire {
            0 => match varint(b) {
                Some((_, rest)) => b.len() - rest.len(),
                None => return Ok(metrics),
            },
            1 => 8,
            5 => 4,
            2 => match varint(b) {
                Some((len, rest)) => {
                    let head = b.len() - rest.len();
                    match usize::try_from(len).ok().and_then(|l| l.checked_add(head)) {
                        Some(n) => n,
                        None => return Ok(metrics),
                    }
                }
                None => return Ok(metrics),
            },
            _ => return Ok(metrics),
        };
        if skip > b.len() {
            return Ok(metrics);
        }
        if field == 2 && wire == 2 {
            metrics += 1;
        }
        b = &b[skip..];
    }
    Ok(metrics)
}

/// One base-128 varint: its value and the bytes after it; `None` when truncated or longer
/// than ten bytes.
fn varint(b: &[u8]) -> Option<(u64, &[u8])> {
    let mut v: u64 = 0;
    for (i, &byte) in b.iter().enumerate().take(10) {
        v |= u64::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            return Some((v, &b[i + 1..]));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    fn metric(name: &str, alias: u64, v: Value) -> Metric {
        Metric {
            name: Some(name.into()),
            alias: Some(alias),
            timestamp: Some(1000),
            datatype: Some(datatype::DOUBLE),
            value: Some(v),
            ..Default::default()
        }
    }

    #[test]
    fn a_payload_round_trips_and_unknown_fields_are_skipped() {
        let p = Payload {
            timestamp: Some(5),
            metrics: vec![metric("Temperature", 7, Value::Double(21.5))],
            seq: Some(3),
            uuid: None,
        };
        let mut bytes = p.encode_to_vec();
        // A `body` (field 5) and an extension field (20) as a sender may add them.
        bytes.extend_from_slice(&[0x2a, 0x03, b'a', b'b', b'c', 0xa0, 0x01, 0x05]);
        assert_eq!(decode(&bytes).unwrap(), p);
    }

    #[test]
    fn the_metric_count_is_checked_on_the_wire_before_decoding() {
        // Empty metrics: two bytes each.
        let many: Vec<u8> = [0x12, 0x00].repeat(MAX_METRICS_PER_MESSAGE + 1);
        assert_eq!(decode(&many).unwrap_err().reason, "too_many_metrics");
        let fine: Vec<u8> = [0x12, 0x00].repeat(MAX_METRICS_PER_MESSAGE);
        assert_eq!(
            decode(&fine).unwrap().metrics.len(),
            MAX_METRICS_PER_MESSAGE
        );
    }

    #[test]
    fn truncated_and_mistyped_payloads_are_refused_not_panicking() {
        let p = Payload {
            timestamp: Some(5),
            metrics: vec![metric("a", 1, Value::Long(9))],
            seq: Some(0),
            uuid: Some("u".into()),
        };
        let bytes = p.encode_to_vec();
        for cut in 0..bytes.len() {
            let _ = decode(&bytes[..cut]);
        }
        // Field 1 (timestamp, a varint) sent as a length-delimited field.
        assert_eq!(
            decode(&[0x0a, 0x01, 0x00]).unwrap_err().reason,
            "not_sparkplug"
        );
        // A length far beyond the payload.
        assert_eq!(
            decode(&[0x12, 0xff, 0xff, 0xff, 0xff, 0x0f])
                .unwrap_err()
                .reason,
            "not_sparkplug"
        );
        // Wire types 3, 4 (groups), 6, 7.
        for key in [0x0b, 0x0c, 0x0e, 0x0f] {
            assert!(decode(&[key, 0]).is_err());
        }
    }

    #[test]
    fn a_deeply_nested_template_is_one_opaque_value() {
        // Template { metrics: [Metric { template_value: Template { ... } }] }, 5000 deep.
        let mut inner: Vec<u8> = Vec::new();
        for _ in 0..5000 {
            let m = Metric {
                value: Some(Value::Template(inner)),
                ..Default::default()
            };
            let m = m.encode_to_vec();
            let mut t = vec![0x12];
            prost::encoding::encode_varint(m.len() as u64, &mut t);
            t.extend_from_slice(&m);
            inner = t;
        }
        let p = Payload {
            metrics: vec![Metric {
                name: Some("deep".into()),
                value: Some(Value::Template(inner)),
                ..Default::default()
            }],
            ..Default::default()
        };
        let got = decode(&p.encode_to_vec()).unwrap();
        assert!(matches!(got.metrics[0].value, Some(Value::Template(_))));
    }
}
