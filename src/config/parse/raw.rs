//! Stage 1: raw shape. Integers are i64 so that range errors get our messages, not serde's.

use super::*;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawConfig {
    pub(super) mqtt: Option<RawMqtt>,
    pub(super) storage: Option<RawStorage>,
    pub(super) log: Option<RawLog>,
    pub(super) checkpoint: Option<RawCheckpoint>,
    pub(super) outbox: Option<RawOutbox>,
    pub(super) metrics: Option<RawMetrics>,
    pub(super) savepoint: Option<RawSavepoint>,
    pub(super) logging: Option<RawLogging>,
    pub(super) dead_letters: Option<RawDeadLetters>,
    pub(super) uplink: Option<RawUplink>,
    pub(super) sparkplug: Option<RawSparkplug>,
    pub(super) sink: Option<Vec<RawSink>>,
    pub(super) pipeline: Option<Vec<RawPipeline>>,
}

/// `[[sink]]` (issue 29): a named destination for results. Every kind's keys are here;
/// each kind refuses the keys of the others (`sinks.rs`).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawSink {
    pub(super) name: Option<String>,
    pub(super) kind: Option<String>,
    // kind = "mqtt"
    pub(super) protocol: Option<String>,
    pub(super) host: Option<String>,
    pub(super) port: Option<i64>,
    pub(super) client_id: Option<String>,
    pub(super) keep_alive: Option<DurationText>,
    pub(super) username: Option<String>,
    pub(super) password_file: Option<String>,
    pub(super) tls: Option<RawTls>,
    pub(super) topic_prefix: Option<String>,
    pub(super) reconnect_min: Option<DurationText>,
    pub(super) reconnect_max: Option<DurationText>,
    // kind = "postgres" (also username, password_file, tls above)
    pub(super) url: Option<String>,
    pub(super) source: Option<String>,
    pub(super) table_prefix: Option<String>,
    // kind = "jetstream"
    pub(super) servers: Option<Vec<String>>,
    pub(super) credentials_file: Option<String>,
    pub(super) token_file: Option<String>,
    pub(super) stream: Option<String>,
    pub(super) subject_prefix: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawSparkplug {
    pub(super) host_id: Option<String>,
    pub(super) rebirth: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawDeadLetters {
    pub(super) max_entries: Option<i64>,
    pub(super) max_age: Option<DurationText>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawLogging {
    pub(super) level: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawMqtt {
    pub(super) host: Option<String>,
    pub(super) port: Option<i64>,
    pub(super) client_id: Option<String>,
    pub(super) keep_alive: Option<DurationText>,
    pub(super) username: Option<String>,
    pub(super) password_file: Option<String>,
    pub(super) tls: Option<RawTls>,
    pub(super) ingest_batch: Option<i64>,
    pub(super) reconnect_min: Option<DurationText>,
    pub(super) reconnect_max: Option<DurationText>,
    pub(super) channel_capacity: Option<i64>,
}

/// `[uplink]`: the connection keys of `[mqtt]` (less the ingest ones), and the prefix.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawUplink {
    pub(super) host: Option<String>,
    pub(super) port: Option<i64>,
    pub(super) client_id: Option<String>,
    pub(super) keep_alive: Option<DurationText>,
    pub(super) username: Option<String>,
    pub(super) password_file: Option<String>,
    pub(super) tls: Option<RawTls>,
    pub(super) topic_prefix: Option<String>,
    pub(super) reconnect_min: Option<DurationText>,
    pub(super) reconnect_max: Option<DurationText>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTls {
    pub(super) ca_file: Option<String>,
    pub(super) cert_file: Option<String>,
    pub(super) key_file: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawStorage {
    pub(super) data_dir: Option<String>,
    pub(super) cache_size: Option<SizeText>,
    pub(super) ledger_index_max: Option<SizeText>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawLog {
    pub(super) segment_size: Option<SizeText>,
    pub(super) max_size: Option<SizeText>,
    pub(super) retention: Option<DurationText>,
    pub(super) commit_interval: Option<DurationText>,
    pub(super) max_payload: Option<SizeText>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawCheckpoint {
    pub(super) interval: Option<DurationText>,
    pub(super) max_records: Option<i64>,
    pub(super) max_keys: Option<i64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawOutbox {
    pub(super) max_entries: Option<i64>,
    pub(super) max_size: Option<SizeText>,
    pub(super) inflight: Option<i64>,
    pub(super) drain_timeout: Option<DurationText>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawMetrics {
    pub(super) listen: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawSavepoint {
    pub(super) interval: Option<DurationText>,
    pub(super) keep: Option<i64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawPipeline {
    pub(super) name: Option<String>,
    pub(super) topics: Option<Vec<String>>,
    pub(super) format: Option<String>,
    pub(super) separator: Option<String>,
    pub(super) event_id: Option<String>,
    pub(super) key: Option<String>,
    pub(super) value: Option<String>,
    pub(super) event_time: Option<String>,
    pub(super) aggregate: Option<RawAggregate>,
    #[serde(rename = "where")]
    pub(super) filter: Option<String>,
    pub(super) window: Option<RawWindow>,
    pub(super) dedup_window: Option<DurationText>,
    pub(super) output_topic: Option<String>,
    pub(super) retain: Option<bool>,
    pub(super) emit: Option<String>,
    pub(super) start: Option<String>,
    pub(super) max_key_len: Option<i64>,
    pub(super) max_keys: Option<i64>,
    pub(super) max_id_len: Option<i64>,
    pub(super) max_future: Option<DurationText>,
    pub(super) metrics: Option<Vec<String>>,
    /// Where its results go (issue 29): sink names.
    pub(super) sinks: Option<Vec<String>>,
}

/// `aggregate = "sum"` or `aggregate = ["min", "max"]`.
#[derive(Debug, Deserialize)]
#[serde(
    untagged,
    expecting = "a string such as \"sum\", or a list such as [\"min\", \"max\"]"
)]
pub(super) enum RawAggregate {
    One(String),
    List(Vec<String>),
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawWindow {
    pub(super) size: Option<DurationText>,
    pub(super) slide: Option<DurationText>,
    pub(super) allowed_lateness: Option<DurationText>,
}

/// A string that must carry a unit; a bare number is refused while deserializing, with a
/// message that names the accepted units.
#[derive(Debug)]
pub(super) struct UnitText<K>(pub(super) String, PhantomData<K>);

pub(super) type DurationText = UnitText<DurationUnits>;
pub(super) type SizeText = UnitText<SizeUnits>;

pub(super) trait Units {
    const WHAT: &'static str;
    const EXAMPLE_UNIT: &'static str;
    const UNITS: &'static str;
}

#[derive(Debug)]
pub(super) struct DurationUnits;
impl Units for DurationUnits {
    const WHAT: &'static str = "duration";
    const EXAMPLE_UNIT: &'static str = "s";
    const UNITS: &'static str = units::DURATION_UNITS;
}

#[derive(Debug)]
pub(super) struct SizeUnits;
impl Units for SizeUnits {
    const WHAT: &'static str = "size";
    // A bare number reads as bytes: `cache_size = 1000000` is hinted "1000000B", not
    // "1000000MiB" (about a terabyte, issue 32).
    const EXAMPLE_UNIT: &'static str = "B";
    const UNITS: &'static str = units::SIZE_UNITS;
}

impl<'de, K: Units> Deserialize<'de> for UnitText<K> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<K>(PhantomData<K>);
        impl<K: Units> Visitor<'_> for V<K> {
            type Value = UnitText<K>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(
                    f,
                    "a {} string such as \"30{}\" (units: {})",
                    K::WHAT,
                    K::EXAMPLE_UNIT,
                    K::UNITS
                )
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(UnitText(v.to_string(), PhantomData))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
                Err(E::custom(format!(
                    "`{v}` has no unit: a {} is a string such as \"{v}{}\"; accepted units: {}",
                    K::WHAT,
                    K::EXAMPLE_UNIT,
                    K::UNITS
                )))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
                self.visit_i64(i64::try_from(v).unwrap_or(i64::MAX))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
                Err(E::custom(format!(
                    "`{v}` has no unit: a {} is a string of an integer and a unit such as \"30{}\"; accepted units: {}",
                    K::WHAT,
                    K::EXAMPLE_UNIT,
                    K::UNITS
                )))
            }
        }
        d.deserialize_any(V(PhantomData))
    }
}

/// Serde's wording → the config's wording (keys and tables, not fields and maps).
pub(super) fn friendly(message: &str, key: &str) -> String {
    let mut m = one_line(message)
        .replace("unknown field", "unknown key")
        .replace("invalid type: ", "wrong type: found ")
        .replace("expected i64", "expected an integer")
        .replace("expected a sequence", "expected an array")
        .replace("found map", "found a table")
        .replace("found sequence", "found an array");
    // `expected struct RawMqtt` → `expected a table`.
    while let Some(i) = m.find("struct Raw") {
        let end = m[i..]
            .find(|c: char| !c.is_ascii_alphanumeric() && c != ' ')
            .map_or(m.len(), |j| i + j);
        let end = m[i + "struct ".len()..end]
            .find(' ')
            .map_or(end, |j| i + "struct ".len() + j);
        m.replace_range(i..end, "a table");
    }
    if key == "pipeline" && m.contains("found a table") {
        m.push_str("; write each pipeline as `[[pipeline]]`, with double brackets");
    }
    m
}
