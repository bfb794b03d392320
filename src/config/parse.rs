//! Config text → [`Config`], in two stages, reporting every problem at once.
//!
//! 1. **Shape.** The TOML is parsed with spans kept ([`toml_edit::ImDocument`]) and
//!    deserialized into raw serde structs (`Raw*`, `deny_unknown_fields`, every field an
//!    `Option`). Serde stops at the first unknown key or wrong type, so on each error the
//!    offending key is recorded as a problem, removed from a copy of the document, and the
//!    copy deserialized again, until it deserializes cleanly.
//! 2. **Meaning.** The raw structs are validated field by field into the typed [`Config`]:
//!    defaults filled in, durations and sizes parsed, ranges and cross-field limits checked.
//!    A field that fails yields `None` and a problem; checks that depend on it are skipped,
//!    so one mistake is reported once.
//!
//! Every [`Problem`] names the key as a dotted path (`pipeline[1].window.size`) and the
//! 1-based line of that key; a missing key points at the header of its table.
//!
//! Every limit has a default chosen to be safe on a small edge box (DESIGN invariant 7);
//! the `DEFAULT_*` constants below say why each value was picked.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::marker::PhantomData;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use serde::de::{self, Deserializer, Visitor};
use toml_edit::{DocumentMut, ImDocument, Table};

use super::{
    CheckpointConfig, Config, DeadLettersConfig, LogConfig, LoggingConfig, MetricsConfig,
    MqttConfig, OutboxConfig, SavepointConfig, StorageConfig, TlsConfig,
};
use crate::pipeline::filter::{Expr, parse_filter};
use crate::pipeline::spec::{
    Aggregate, AggregateSpec, Emit, Field, Format, MAX_WINDOWS_PER_EVENT, PipelineSpec,
    TemplatePart, WindowSpec,
};

#[path = "locate.rs"]
mod locate;
#[cfg(test)]
#[path = "parse_tests.rs"]
mod tests;
#[path = "units.rs"]
mod units;

use locate::{Lines, Seg};
use units::{format_duration_ms, format_size, parse_duration_ms, parse_size};

// ---------------------------------------------------------------------------------------
// Defaults and bounds. Durations in ms, sizes in bytes.

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

const DEFAULT_HOST: &str = "127.0.0.1";
const DEFAULT_PORT: i64 = 1883;
/// MQTT keep-alive is a 16-bit count of seconds; under 5s a busy fsync can look like a
/// dead connection.
const DEFAULT_KEEP_ALIVE_MS: u64 = 30_000;
const MIN_KEEP_ALIVE_MS: u64 = 5_000;
const MAX_KEEP_ALIVE_MS: u64 = 65_535_000;
/// mosquitto's default `max_inflight_messages`: the broker never has more unacked inputs
/// out at once, so a larger batch would never fill and would only wait for the timer.
const DEFAULT_INGEST_BATCH: i64 = 20;
/// Backoff against a dead broker (rumqttc has none: without it, a tight loop).
const DEFAULT_RECONNECT_MIN_MS: u64 = 100;
const MIN_RECONNECT_MIN_MS: u64 = 10;
const DEFAULT_RECONNECT_MAX_MS: u64 = 30_000;
/// While we are disconnected the broker queues for us, but mosquitto drops silently past
/// `max_queued_messages` (default 1000): never back off for longer than this.
const MAX_RECONNECT_MAX_MS: u64 = 600_000;
const DEFAULT_CHANNEL_CAPACITY: i64 = 1024;
/// A channel is memory we promise to hold; a million messages is already far too many for
/// an edge box.
const MAX_CHANNEL_CAPACITY: i64 = 1 << 20;
/// MQTT 3.1.1 guarantees 23 characters; most brokers accept more.
const MAX_CLIENT_ID_LEN: usize = 64;
const PORTABLE_CLIENT_ID_LEN: usize = 23;

/// DESIGN §4: 8–32 MiB on an edge box; sled's own default (1 GiB, counted in on-disk bytes)
/// lets RSS grow to several GiB.
const DEFAULT_CACHE_SIZE: u64 = 16 * MIB;
const MIN_CACHE_SIZE: u64 = MIB;
const MAX_CACHE_SIZE: u64 = GIB;
// The dedup ledger's in-memory index (issue 10): below 1 MiB it would be full at ~60k events.
const DEFAULT_LEDGER_INDEX_MAX: u64 = 64 * MIB;
const MIN_LEDGER_INDEX_MAX: u64 = MIB;
const MAX_LEDGER_INDEX_MAX: u64 = 16 * GIB;
// Dead letters (issue 10): kept at most this many, this long.
const DEFAULT_DEAD_LETTERS_MAX_ENTRIES: i64 = 100_000;
const MAX_DEAD_LETTERS_MAX_ENTRIES: i64 = 100_000_000;
const DEFAULT_DEAD_LETTERS_MAX_AGE_MS: u64 = 30 * 86_400_000;
const MIN_DEAD_LETTERS_MAX_AGE_MS: u64 = 60_000;

const DEFAULT_SEGMENT_SIZE: u64 = 64 * MIB;
const MIN_SEGMENT_SIZE: u64 = MIB;
/// Offsets inside a segment stay far from the framing's u32 length field.
const MAX_SEGMENT_SIZE: u64 = GIB;
/// 32 segments: a few hours of a busy box, and full ⇒ backpressure, never loss.
const DEFAULT_LOG_MAX_SIZE: u64 = 2 * GIB;
const DEFAULT_RETENTION_MS: u64 = 24 * 3_600_000;
/// Group commit: a few ms of latency buys one fsync for a whole batch.
const DEFAULT_COMMIT_INTERVAL_MS: u64 = 5;
/// Held inputs are unacked inputs; beyond a second the broker's inflight window stalls.
const MAX_COMMIT_INTERVAL_MS: u64 = 1_000;
const DEFAULT_MAX_PAYLOAD: u64 = 256 * KIB;
/// Room for a record's framing and metadata (topic, offsets, times) beside its payload.
const RECORD_OVERHEAD: u64 = 64 * KIB;

/// Bounds replay after a crash and the latency until outputs are published.
const DEFAULT_CHECKPOINT_INTERVAL_MS: u64 = 200;
const MAX_CHECKPOINT_INTERVAL_MS: u64 = 3_600_000;
/// One sled transaction holds a whole checkpoint in memory (~13k 4-tree txn/s, DESIGN §4).
const DEFAULT_CHECKPOINT_MAX_RECORDS: i64 = 5_000;
const MAX_CHECKPOINT_MAX_RECORDS: i64 = 1_000_000;

/// Hours of output while the broker is away, at a few kB each: well under the disk.
const DEFAULT_OUTBOX_MAX_ENTRIES: i64 = 100_000;
const DEFAULT_OUTBOX_INFLIGHT: i64 = 100;
const DEFAULT_DRAIN_TIMEOUT_MS: u64 = 5_000;
/// systemd kills after TimeoutStopSec (90s by default); finish well before.
const MAX_DRAIN_TIMEOUT_MS: u64 = 60_000;

const DEFAULT_SAVEPOINT_KEEP: i64 = 3;
const MIN_SAVEPOINT_INTERVAL_MS: u64 = 1_000;
const MAX_SAVEPOINT_KEEP: i64 = 1_000;

const MAX_PIPELINE_NAME_LEN: usize = 64;
/// Business duplicates can come days later (a device that re-sends its backlog after a
/// week offline); broker redeliveries minutes later.
const DEFAULT_DEDUP_WINDOW_MS: u64 = 7 * 86_400_000;
const MIN_DEDUP_WINDOW_MS: u64 = 60_000;
const MAX_DEDUP_WINDOW_MS: u64 = 366 * 86_400_000;
const DEFAULT_MAX_KEY_LEN: i64 = 128;
const MAX_MAX_KEY_LEN: i64 = 1_024;
/// State per key is small; a million keys is tens of MB in sled.
const DEFAULT_MAX_KEYS: i64 = 1_000_000;
/// MQTT strings (topics, filters) are at most 65535 bytes.
const MAX_TOPIC_LEN: usize = 65_535;
/// Event IDs live in the dedup ledger; a bound keeps its values far below sled's blob
/// threshold (a 200 KB ID once produced an unfsynced blob file).
const DEFAULT_MAX_ID_LEN: i64 = 256;
const MAX_MAX_ID_LEN: i64 = 1_024;
/// Device clocks drift by seconds to minutes; an event further ahead is a broken clock, and
/// accepting it would close every window up to it.
const DEFAULT_MAX_FUTURE_MS: u64 = 600_000;
const MAX_MAX_FUTURE_MS: u64 = 366 * 86_400_000;

// ---------------------------------------------------------------------------------------
// Errors.

/// One thing wrong with the config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// The config file, as given.
    pub file: String,
    /// Dotted path of the key, e.g. `pipeline[0].window.size`; empty for a syntax error.
    pub key: String,
    /// 1-based line of the key (of its table header when the key is missing); `None` when
    /// the whole table is missing.
    pub line: Option<usize>,
    pub message: String,
}

/// `FILE:LINE: KEY: MESSAGE`; the line and key are left out when unknown.
impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.file)?;
        if let Some(line) = self.line {
            write!(f, ":{line}")?;
        }
        if !self.key.is_empty() {
            write!(f, ": {}", self.key)?;
        }
        write!(f, ": {}", self.message)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    /// The file was read but is not a valid config; `problems` lists every problem found,
    /// in file order where known. Displays as a header line and one line per problem.
    #[error("{}", render_invalid(.file, .problems))]
    Invalid {
        file: String,
        problems: Vec<Problem>,
    },
}

fn render_invalid(file: &str, problems: &[Problem]) -> String {
    let n = problems.len();
    let mut out = format!(
        "{file}: {n} problem{} in the configuration",
        if n == 1 { "" } else { "s" }
    );
    for p in problems {
        out.push_str(&format!("\n  {p}"));
    }
    out
}

// ---------------------------------------------------------------------------------------
// Entry points.

/// Read and validate the config file at `path`.
pub fn load(path: &Path) -> Result<Config, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.display().to_string(),
        source,
    })?;
    parse_str(&text, path)
}

/// Validate config `text`; `path` is used in messages and kept as [`Config::source`].
pub fn parse_str(text: &str, path: &Path) -> Result<Config, ConfigError> {
    let file = path.display().to_string();
    let lines = Lines::new(text);
    let invalid = |problems| ConfigError::Invalid {
        file: file.clone(),
        problems,
    };

    let doc = match ImDocument::parse(text) {
        Ok(doc) => doc,
        Err(e) => {
            let offset = e.span().map_or(0, |s| s.start);
            let message = format!(
                "TOML syntax error at column {}: {}",
                lines.column(offset),
                one_line(e.message())
            );
            return Err(invalid(vec![Problem {
                file: file.clone(),
                key: String::new(),
                line: Some(lines.line(offset)),
                message,
            }]));
        }
    };

    let mut v = Validator {
        file: file.clone(),
        index: locate::index(doc.as_table(), &lines),
        broken: HashSet::new(),
        problems: Vec::new(),
    };
    let Some(raw) = v.deserialize(doc.as_table(), &lines) else {
        return Err(invalid(v.problems));
    };
    let config = v.config(raw, path);
    match config {
        Some(config) if v.problems.is_empty() => Ok(config),
        _ => {
            if v.problems.is_empty() {
                // A field came out `None` without saying why: a bug here, not in the file.
                debug_assert!(false, "config validation lost a problem");
                v.problem("", "internal error: a value was rejected without a reason");
            }
            v.problems.sort_by_key(|p| p.line.unwrap_or(usize::MAX));
            Err(invalid(v.problems))
        }
    }
}

/// A short human summary of a validated config, printed by `cairn validate`.
pub fn summary(cfg: &Config) -> String {
    let mut lines = broker_summary(&cfg.mqtt);
    lines.extend(storage_summary(cfg));
    lines.extend(cfg.pipelines.iter().map(pipeline_summary));
    let mut out = String::new();
    for l in lines {
        out.push_str(&l);
        out.push('\n');
    }
    out
}

fn summary_duration(d: Duration) -> String {
    format_duration_ms(duration_ms(d))
}

/// The `broker` and `ingest` lines, with the client-ID portability note between them.
fn broker_summary(m: &MqttConfig) -> Vec<String> {
    let d = summary_duration;
    let cert = |t: &TlsConfig| {
        if t.cert_file.is_some() {
            " + client cert"
        } else {
            ""
        }
    };
    let auth = match (&m.username, &m.tls) {
        (None, None) => "no auth, plain TCP".to_string(),
        (Some(u), None) => format!("user {u}, plain TCP"),
        (None, Some(t)) => format!("TLS{}", cert(t)),
        (Some(u), Some(t)) => format!("user {u}, TLS{}", cert(t)),
    };
    let mut lines = vec![format!(
        "broker      {}:{} as {} ({auth}, keep-alive {})",
        m.host,
        m.port,
        m.client_id,
        d(m.keep_alive)
    )];
    if m.client_id.len() > PORTABLE_CLIENT_ID_LEN {
        lines.push(format!(
            "            note: client_id is {} chars; MQTT 3.1.1 only guarantees {PORTABLE_CLIENT_ID_LEN}",
            m.client_id.len()
        ));
    }
    lines.push(format!(
        "ingest      batch {}, channel {}, reconnect {}..{}",
        m.ingest_batch,
        m.channel_capacity,
        d(m.reconnect_min),
        d(m.reconnect_max)
    ));
    lines
}

/// The lines for storage, dead letters, the log, checkpoints, the outbox, metrics and
/// savepoints.
fn storage_summary(cfg: &Config) -> Vec<String> {
    let d = summary_duration;
    let l = &cfg.log;
    let o = &cfg.outbox;
    vec![
        format!(
            "data dir    {} (sled cache {}, ledger index <= {})",
            cfg.storage.data_dir.display(),
            format_size(cfg.storage.cache_size),
            format_size(cfg.storage.ledger_index_max)
        ),
        format!(
            "dead letters <= {}, <= {} old",
            cfg.dead_letters.max_entries,
            d(cfg.dead_letters.max_age)
        ),
        format!(
            "log         segments {}, max {}, retention {}, commit every {}, payload <= {}",
            format_size(l.segment_size),
            format_size(l.max_size),
            d(l.retention),
            d(l.commit_interval),
            format_size(l.max_payload)
        ),
        format!(
            "checkpoint  every {} or {} records",
            d(cfg.checkpoint.interval),
            cfg.checkpoint.max_records
        ),
        format!(
            "outbox      <= {} entries, {} inflight, drain {}",
            o.max_entries,
            o.inflight,
            d(o.drain_timeout)
        ),
        format!(
            "metrics     {}",
            cfg.metrics.listen.as_deref().unwrap_or("off")
        ),
        match cfg.savepoint.interval {
            Some(i) => format!("savepoints  every {}, keep {}", d(i), cfg.savepoint.keep),
            None => "savepoints  off".to_string(),
        },
    ]
}

/// One `pipeline` line: topics, format, aggregate, window, output and limits.
fn pipeline_summary(p: &PipelineSpec) -> String {
    let format = match &p.format {
        Format::Json => "json".to_string(),
        Format::Delimited { separator } => format!("delimited {separator:?}"),
    };
    let value = p
        .value
        .as_ref()
        .map(|v| format!("({})", field_text(v)))
        .unwrap_or_default();
    let window = p
        .window
        .map(|w| {
            let slide = w
                .slide_ms
                .map(|s| format!(" sliding {}", format_duration_ms(s)))
                .unwrap_or_default();
            format!(
                " per {} window{slide} (lateness {})",
                format_duration_ms(w.size_ms),
                format_duration_ms(w.allowed_lateness_ms)
            )
        })
        .unwrap_or_default();
    format!(
        "pipeline    {}: {} [{format}] -> {}{value} by {}{window} -> {} ({}, {}, dedup {}, <= {} keys)",
        p.name,
        p.topics.join(", "),
        aggregate_text(&p.aggregate),
        field_text(&p.key),
        p.output_topic,
        if p.retain { "retained" } else { "not retained" },
        match p.emit {
            Emit::Upsert => "upsert",
            Emit::Changelog => "changelog",
            Emit::Final => "final",
        },
        format_duration_ms(p.dedup_window_ms),
        p.max_keys
    )
}

fn duration_ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// A field as the config writes it.
fn field_text(f: &Field) -> String {
    match f {
        Field::Pointer(p) => p.clone(),
        Field::Index(i) => i.to_string(),
        Field::Topic(i) => format!("topic[{i}]"),
        Field::Template(parts) => parts
            .iter()
            .map(|part| match part {
                TemplatePart::Literal(l) => l.clone(),
                TemplatePart::Field(f) => format!("{{{}}}", field_text(f)),
            })
            .collect(),
    }
}

const AGGREGATE_NAMES: &str = "one of sum, count, min, max, avg, last, stddev, variance, or a percentile such as p50, p95, p99.9";

/// Most aggregates in one list: each is a field of every result.
const MAX_AGGREGATES: usize = 32;

fn aggregate_text(a: &AggregateSpec) -> String {
    match a {
        AggregateSpec::One(a) => a.name(),
        AggregateSpec::List(l) => {
            let names: Vec<String> = l.iter().map(|a| a.name()).collect();
            format!("[{}]", names.join(", "))
        }
    }
}

fn one_line(s: &str) -> String {
    s.trim()
        .lines()
        .map(str::trim)
        .collect::<Vec<_>>()
        .join("; ")
}

// ---------------------------------------------------------------------------------------
// Stage 1: raw shape. Integers are i64 so that range errors get our messages, not serde's.

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    mqtt: Option<RawMqtt>,
    storage: Option<RawStorage>,
    log: Option<RawLog>,
    checkpoint: Option<RawCheckpoint>,
    outbox: Option<RawOutbox>,
    metrics: Option<RawMetrics>,
    savepoint: Option<RawSavepoint>,
    logging: Option<RawLogging>,
    dead_letters: Option<RawDeadLetters>,
    pipeline: Option<Vec<RawPipeline>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDeadLetters {
    max_entries: Option<i64>,
    max_age: Option<DurationText>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLogging {
    level: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawMqtt {
    host: Option<String>,
    port: Option<i64>,
    client_id: Option<String>,
    keep_alive: Option<DurationText>,
    username: Option<String>,
    password_file: Option<String>,
    tls: Option<RawTls>,
    ingest_batch: Option<i64>,
    reconnect_min: Option<DurationText>,
    reconnect_max: Option<DurationText>,
    channel_capacity: Option<i64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTls {
    ca_file: Option<String>,
    cert_file: Option<String>,
    key_file: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawStorage {
    data_dir: Option<String>,
    cache_size: Option<SizeText>,
    ledger_index_max: Option<SizeText>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLog {
    segment_size: Option<SizeText>,
    max_size: Option<SizeText>,
    retention: Option<DurationText>,
    commit_interval: Option<DurationText>,
    max_payload: Option<SizeText>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCheckpoint {
    interval: Option<DurationText>,
    max_records: Option<i64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawOutbox {
    max_entries: Option<i64>,
    inflight: Option<i64>,
    drain_timeout: Option<DurationText>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawMetrics {
    listen: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSavepoint {
    interval: Option<DurationText>,
    keep: Option<i64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPipeline {
    name: Option<String>,
    topics: Option<Vec<String>>,
    format: Option<String>,
    separator: Option<String>,
    event_id: Option<String>,
    key: Option<String>,
    value: Option<String>,
    event_time: Option<String>,
    aggregate: Option<RawAggregate>,
    #[serde(rename = "where")]
    filter: Option<String>,
    window: Option<RawWindow>,
    dedup_window: Option<DurationText>,
    output_topic: Option<String>,
    retain: Option<bool>,
    emit: Option<String>,
    max_key_len: Option<i64>,
    max_keys: Option<i64>,
    max_id_len: Option<i64>,
    max_future: Option<DurationText>,
}

/// `aggregate = "sum"` or `aggregate = ["min", "max"]`.
#[derive(Debug, Deserialize)]
#[serde(
    untagged,
    expecting = "a string such as \"sum\", or a list such as [\"min\", \"max\"]"
)]
enum RawAggregate {
    One(String),
    List(Vec<String>),
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawWindow {
    size: Option<DurationText>,
    slide: Option<DurationText>,
    allowed_lateness: Option<DurationText>,
}

/// A string that must carry a unit; a bare number is refused while deserializing, with a
/// message that names the accepted units.
#[derive(Debug)]
struct UnitText<K>(String, PhantomData<K>);

type DurationText = UnitText<DurationUnits>;
type SizeText = UnitText<SizeUnits>;

trait Units {
    const WHAT: &'static str;
    const EXAMPLE_UNIT: &'static str;
    const UNITS: &'static str;
}

#[derive(Debug)]
struct DurationUnits;
impl Units for DurationUnits {
    const WHAT: &'static str = "duration";
    const EXAMPLE_UNIT: &'static str = "s";
    const UNITS: &'static str = units::DURATION_UNITS;
}

#[derive(Debug)]
struct SizeUnits;
impl Units for SizeUnits {
    const WHAT: &'static str = "size";
    const EXAMPLE_UNIT: &'static str = "MiB";
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
fn friendly(message: &str, key: &str) -> String {
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

// ---------------------------------------------------------------------------------------
// Stage 2: meaning.

struct Validator {
    file: String,
    /// Every key path present in the file → its line.
    index: HashMap<String, usize>,
    /// Keys already reported in stage 1; stage 2 must not also call them missing.
    broken: HashSet<String>,
    problems: Vec<Problem>,
}

impl Validator {
    /// Line of `key`, or of the nearest enclosing table present in the file.
    fn line(&self, key: &str) -> Option<usize> {
        let mut k = key;
        loop {
            if let Some(&line) = self.index.get(k) {
                return Some(line);
            }
            k = &k[..k.rfind(['.', '['])?];
        }
    }

    fn problem(&mut self, key: &str, message: impl Into<String>) {
        self.problems.push(Problem {
            file: self.file.clone(),
            key: key.to_string(),
            line: self.line(key),
            message: message.into(),
        });
    }

    fn missing(&mut self, key: &str, why: &str) {
        let reported = self
            .broken
            .iter()
            .any(|b| key == b || key.starts_with(&format!("{b}.")));
        if !reported {
            self.problem(key, format!("missing required key: {why}"));
        }
    }

    /// Stage 1: deserialize, dropping and reporting each key serde rejects, until clean.
    fn deserialize(&mut self, root: &Table, lines: &Lines) -> Option<RawConfig> {
        let mut table = root.clone();
        // Each round removes one key, so this many rounds always suffice.
        for _ in 0..=self.index.len() {
            let de = toml_edit::de::Deserializer::from(DocumentMut::from(table.clone()));
            let err = match RawConfig::deserialize(de) {
                Ok(raw) => return Some(raw),
                Err(err) => err,
            };
            let found = err
                .span()
                .and_then(|span| locate::innermost(&table, span.start));
            let Some((path, start)) = found else {
                self.problems.push(Problem {
                    file: self.file.clone(),
                    key: String::new(),
                    line: err.span().map(|s| lines.line(s.start)),
                    message: one_line(err.message()),
                });
                return None;
            };
            let key = locate::render(&path);
            self.problems.push(Problem {
                file: self.file.clone(),
                key: key.clone(),
                line: Some(lines.line(start)),
                message: friendly(err.message(), &key),
            });
            let removed_end = path
                .iter()
                .rposition(|s| matches!(s, Seg::Key(_)))
                .map_or(0, |i| i + 1);
            self.broken.insert(locate::render(&path[..removed_end]));
            if !locate::remove(&mut table, &path) {
                return None;
            }
        }
        None
    }

    fn duration(&mut self, key: &str, raw: Option<DurationText>, default_ms: u64) -> Option<u64> {
        match raw {
            None => Some(default_ms),
            Some(text) => parse_duration_ms(&text.0)
                .map_err(|e| self.problem(key, e))
                .ok(),
        }
    }

    fn size(&mut self, key: &str, raw: Option<SizeText>, default: u64) -> Option<u64> {
        match raw {
            None => Some(default),
            Some(text) => parse_size(&text.0).map_err(|e| self.problem(key, e)).ok(),
        }
    }

    /// An integer in `range`; `why` follows the range in the message.
    fn int(
        &mut self,
        key: &str,
        raw: Option<i64>,
        default: i64,
        range: std::ops::RangeInclusive<i64>,
        why: &str,
    ) -> Option<i64> {
        let n = raw.unwrap_or(default);
        if range.contains(&n) {
            return Some(n);
        }
        let bounds = if *range.end() == i64::MAX {
            format!("at least {}", range.start())
        } else {
            format!("between {} and {}", range.start(), range.end())
        };
        self.problem(key, format!("must be {bounds}, found {n}{why}"));
        None
    }

    /// `check` false ⇒ a problem at `key`.
    fn require(&mut self, key: &str, check: bool, message: impl FnOnce() -> String) -> bool {
        if !check {
            self.problem(key, message());
        }
        check
    }

    fn config(&mut self, raw: RawConfig, path: &Path) -> Option<Config> {
        let outbox_raw = raw.outbox.unwrap_or_default();
        let outbox = self.outbox(outbox_raw);
        let mqtt = self.mqtt(
            raw.mqtt.unwrap_or_default(),
            outbox.as_ref().map(|o| o.inflight),
        );
        let storage = self.storage(raw.storage.unwrap_or_default());
        let checkpoint = self.checkpoint(raw.checkpoint.unwrap_or_default());
        if let (Some(o), Some(c)) = (&outbox, &checkpoint) {
            self.require("outbox.max_entries", o.max_entries >= c.max_records, || {
                format!(
                    "must be at least checkpoint.max_records ({}), found {}: one checkpoint can \
                     add an output per record, and it must fit",
                    c.max_records, o.max_entries
                )
            });
        }
        let savepoint = self.savepoint(raw.savepoint.unwrap_or_default());
        let log = self.log(
            raw.log.unwrap_or_default(),
            savepoint.as_ref().and_then(|s| s.interval),
        );
        let metrics = self.metrics(raw.metrics.unwrap_or_default());
        let logging = self.logging(raw.logging.unwrap_or_default());
        let dead_letters = self.dead_letters(raw.dead_letters.unwrap_or_default());
        let pipelines = self.pipelines(raw.pipeline);
        Some(Config {
            source: path.to_path_buf(),
            mqtt: mqtt?,
            storage: storage?,
            log: log?,
            checkpoint: checkpoint?,
            outbox: outbox?,
            metrics: metrics?,
            savepoint: savepoint?,
            logging: logging?,
            dead_letters: dead_letters?,
            pipelines: pipelines?,
        })
    }

    fn dead_letters(&mut self, r: RawDeadLetters) -> Option<DeadLettersConfig> {
        let max_entries = self.int(
            "dead_letters.max_entries",
            r.max_entries,
            DEFAULT_DEAD_LETTERS_MAX_ENTRIES,
            1..=MAX_DEAD_LETTERS_MAX_ENTRIES,
            ": the oldest dead letters are dropped (and counted) beyond it",
        );
        let max_age = self
            .duration(
                "dead_letters.max_age",
                r.max_age,
                DEFAULT_DEAD_LETTERS_MAX_AGE_MS,
            )
            .filter(|&ms| {
                self.require("dead_letters.max_age", ms >= MIN_DEAD_LETTERS_MAX_AGE_MS, || {
                    format!(
                        "must be at least 1m, found {}: dead letters are kept for a person to read",
                        format_duration_ms(ms)
                    )
                })
            });
        Some(DeadLettersConfig {
            max_entries: u64::try_from(max_entries?).ok()?,
            max_age: Duration::from_millis(max_age?),
        })
    }

    fn logging(&mut self, r: RawLogging) -> Option<LoggingConfig> {
        let text = r.level.unwrap_or_else(|| "info".to_string());
        match text.parse::<log::LevelFilter>() {
            Ok(level) => Some(LoggingConfig { level }),
            Err(_) => {
                self.problem(
                    "logging.level",
                    format!("`{text}` is not a level: use off, error, warn, info, debug or trace"),
                );
                None
            }
        }
    }

    fn mqtt(&mut self, r: RawMqtt, outbox_inflight: Option<u16>) -> Option<MqttConfig> {
        let host = r.host.unwrap_or_else(|| DEFAULT_HOST.to_string());
        let host_ok = self.require(
            "mqtt.host",
            !host.is_empty() && !host.contains(char::is_whitespace),
            || format!("`{host}` is not a host name or IP address"),
        );
        let port = self
            .int("mqtt.port", r.port, DEFAULT_PORT, 1..=65_535, "")
            .map(|p| p as u16);

        let client_id = self.client_id(r.client_id);

        let keep_alive = self.keep_alive(r.keep_alive);

        let username = match r.username {
            Some(u) if u.is_empty() => {
                self.problem("mqtt.username", "is empty: remove it, or name the user");
                None
            }
            u => Some(u),
        };
        let password_file = self.path("mqtt.password_file", r.password_file);
        if let (Some(Some(_)), Some(None)) = (&password_file, &username) {
            self.problem(
                "mqtt.password_file",
                "needs `mqtt.username`: MQTT 3.1.1 does not allow a password without a user name",
            );
        }
        let tls = match r.tls {
            None => Some(None),
            Some(t) => self.tls(t).map(Some),
        };

        let ingest_batch = self.int(
            "mqtt.ingest_batch",
            r.ingest_batch,
            DEFAULT_INGEST_BATCH,
            1..=65_535,
            "; keep it at or below the broker's max_inflight_messages (mosquitto: 20)",
        );

        let (reconnect_min, reconnect_max) = self.reconnect(r.reconnect_min, r.reconnect_max);

        let channel_capacity =
            self.channel_capacity(r.channel_capacity, ingest_batch, outbox_inflight);

        Some(MqttConfig {
            host: host_ok.then_some(host)?,
            port: port?,
            client_id: client_id?,
            keep_alive: Duration::from_millis(keep_alive?),
            username: username?,
            password_file: password_file?,
            tls: tls?,
            ingest_batch: usize::try_from(ingest_batch?).ok()?,
            reconnect_min: Duration::from_millis(reconnect_min?),
            reconnect_max: Duration::from_millis(reconnect_max?),
            channel_capacity: usize::try_from(channel_capacity?).ok()?,
        })
    }

    /// The client ID: required, stable and short (the broker keeps the session under it).
    fn client_id(&mut self, raw: Option<String>) -> Option<String> {
        match raw {
            None => {
                self.missing(
                    "mqtt.client_id",
                    "the broker keeps this agent's persistent session under it, so it must be \
                     stable and unique per box (two boxes with one ID keep disconnecting each other)",
                );
                None
            }
            Some(id) => {
                let ok = self.require("mqtt.client_id", valid_name(&id, MAX_CLIENT_ID_LEN), || {
                    format!(
                        "`{id}` is not a valid client ID: use 1 to {MAX_CLIENT_ID_LEN} of A-Z a-z 0-9 _ - \
                         ({PORTABLE_CLIENT_ID_LEN} or fewer work with every MQTT 3.1.1 broker)"
                    )
                });
                ok.then_some(id)
            }
        }
    }

    fn keep_alive(&mut self, raw: Option<DurationText>) -> Option<u64> {
        self
            .duration("mqtt.keep_alive", raw, DEFAULT_KEEP_ALIVE_MS)
            .filter(|&ms| {
                self.require(
                    "mqtt.keep_alive",
                    (MIN_KEEP_ALIVE_MS..=MAX_KEEP_ALIVE_MS).contains(&ms) && ms % 1000 == 0,
                    || {
                        format!(
                            "must be whole seconds between 5s and 65535s (MQTT sends it as a 16-bit \
                             count of seconds; below 5s a slow fsync looks like a dead link), found {}",
                            format_duration_ms(ms)
                        )
                    },
                )
            })
    }

    /// The reconnect backoff bounds, `min <= max`.
    fn reconnect(
        &mut self,
        min: Option<DurationText>,
        max: Option<DurationText>,
    ) -> (Option<u64>, Option<u64>) {
        let reconnect_min = self
            .duration("mqtt.reconnect_min", min, DEFAULT_RECONNECT_MIN_MS)
            .filter(|&ms| {
                self.require("mqtt.reconnect_min", ms >= MIN_RECONNECT_MIN_MS, || {
                    format!(
                        "must be at least {}, found {}: a shorter backoff hammers a broker that is down",
                        format_duration_ms(MIN_RECONNECT_MIN_MS),
                        format_duration_ms(ms)
                    )
                })
            });
        let reconnect_max = self
            .duration("mqtt.reconnect_max", max, DEFAULT_RECONNECT_MAX_MS)
            .filter(|&ms| {
                self.require("mqtt.reconnect_max", ms <= MAX_RECONNECT_MAX_MS, || {
                    format!(
                        "must be at most {}, found {}: while we are away the broker queues our \
                         messages, and mosquitto drops them silently past max_queued_messages",
                        format_duration_ms(MAX_RECONNECT_MAX_MS),
                        format_duration_ms(ms)
                    )
                })
            });
        let reconnect_max = match (reconnect_min, reconnect_max) {
            (Some(lo), Some(hi)) if hi < lo => {
                self.problem(
                    "mqtt.reconnect_max",
                    format!(
                        "must be at least mqtt.reconnect_min ({}), found {}",
                        format_duration_ms(lo),
                        format_duration_ms(hi)
                    ),
                );
                None
            }
            (_, hi) => hi,
        };
        (reconnect_min, reconnect_max)
    }

    /// The event channel: big enough that the event loop cannot deadlock on it.
    fn channel_capacity(
        &mut self,
        raw: Option<i64>,
        ingest_batch: Option<i64>,
        outbox_inflight: Option<u16>,
    ) -> Option<i64> {
        let channel_capacity = self.int(
            "mqtt.channel_capacity",
            raw,
            DEFAULT_CHANNEL_CAPACITY,
            1..=MAX_CHANNEL_CAPACITY,
            "",
        );
        match (channel_capacity, ingest_batch, outbox_inflight) {
            (Some(cap), Some(batch), Some(inflight)) => {
                let need = 2 * (batch + i64::from(inflight));
                let ok = self.require("mqtt.channel_capacity", cap >= need, || {
                    format!(
                        "must be at least 2 × (mqtt.ingest_batch + outbox.inflight) = {need}, found {cap}: \
                         a smaller channel can deadlock the event loop (rumqttc #1025)"
                    )
                });
                ok.then_some(cap)
            }
            (cap, _, _) => cap,
        }
    }

    /// An optional path: `Some(None)` when absent, `None` after a problem.
    fn path(&mut self, key: &str, raw: Option<String>) -> Option<Option<PathBuf>> {
        match raw {
            None => Some(None),
            Some(p) if p.is_empty() => {
                self.problem(key, "is empty: give a file path, or remove the key");
                None
            }
            Some(p) => Some(Some(PathBuf::from(p))),
        }
    }

    fn tls(&mut self, r: RawTls) -> Option<TlsConfig> {
        let ca_file = match r.ca_file {
            None => {
                self.missing(
                    "mqtt.tls.ca_file",
                    "TLS needs the CA certificate that signed the broker's certificate",
                );
                None
            }
            some => self.path("mqtt.tls.ca_file", some).flatten(),
        };
        let cert_file = self.path("mqtt.tls.cert_file", r.cert_file);
        let key_file = self.path("mqtt.tls.key_file", r.key_file);
        let (cert_file, key_file) = match (cert_file, key_file) {
            (Some(Some(_)), Some(None)) => {
                self.problem(
                    "mqtt.tls.cert_file",
                    "needs `key_file` too: a client certificate is useless without its key",
                );
                (None, None)
            }
            (Some(None), Some(Some(_))) => {
                self.problem(
                    "mqtt.tls.key_file",
                    "needs `cert_file` too: a client key is useless without its certificate",
                );
                (None, None)
            }
            pair => pair,
        };
        Some(TlsConfig {
            ca_file: ca_file?,
            cert_file: cert_file?,
            key_file: key_file?,
        })
    }

    fn storage(&mut self, r: RawStorage) -> Option<StorageConfig> {
        let data_dir = match r.data_dir {
            None => {
                self.missing(
                    "storage.data_dir",
                    "the replay log and the state store live below it; a default could put \
                     them on a volatile or shared disk",
                );
                None
            }
            Some(d) if d.is_empty() => {
                self.problem(
                    "storage.data_dir",
                    "is empty: give a directory, e.g. \"/var/lib/cairn\"",
                );
                None
            }
            Some(d) => Some(PathBuf::from(d)),
        };
        let cache_size = self
            .size("storage.cache_size", r.cache_size, DEFAULT_CACHE_SIZE)
            .filter(|&n| {
                self.require("storage.cache_size", (MIN_CACHE_SIZE..=MAX_CACHE_SIZE).contains(&n), || {
                    format!(
                        "must be between 1MiB and 1GiB, found {}: sled counts on-disk bytes, and \
                         its memory use can be several times this (DESIGN §4)",
                        format_size(n)
                    )
                })
            });
        let ledger_index_max = self
            .size(
                "storage.ledger_index_max",
                r.ledger_index_max,
                DEFAULT_LEDGER_INDEX_MAX,
            )
            .filter(|&n| {
                self.require(
                    "storage.ledger_index_max",
                    (MIN_LEDGER_INDEX_MAX..=MAX_LEDGER_INDEX_MAX).contains(&n),
                    || {
                        format!(
                            "must be between 1MiB and 16GiB, found {}: the dedup ledger's index \
                             takes 9 to 18 bytes per event ID in the window",
                            format_size(n)
                        )
                    },
                )
            });
        Some(StorageConfig {
            data_dir: data_dir?,
            cache_size: cache_size?,
            ledger_index_max: ledger_index_max?,
        })
    }

    fn log(&mut self, r: RawLog, savepoint_interval: Option<Duration>) -> Option<LogConfig> {
        let segment_size = self
            .size("log.segment_size", r.segment_size, DEFAULT_SEGMENT_SIZE)
            .filter(|&n| {
                self.require(
                    "log.segment_size",
                    (MIN_SEGMENT_SIZE..=MAX_SEGMENT_SIZE).contains(&n),
                    || format!("must be between 1MiB and 1GiB, found {}", format_size(n)),
                )
            });
        let max_size = self.size("log.max_size", r.max_size, DEFAULT_LOG_MAX_SIZE);
        let max_size = match (segment_size, max_size) {
            (Some(seg), Some(max)) if max < seg.saturating_mul(2) => {
                self.problem(
                    "log.max_size",
                    format!(
                        "must be at least 2 × log.segment_size = {}, found {}: the log needs room \
                         for the segment being written and the one before it",
                        format_size(seg.saturating_mul(2)),
                        format_size(max)
                    ),
                );
                None
            }
            (_, max) => max,
        };
        let retention = self.duration("log.retention", r.retention, DEFAULT_RETENTION_MS);
        if let (Some(ret), Some(sp)) = (retention, savepoint_interval) {
            let sp = duration_ms(sp);
            self.require("log.retention", ret >= sp, || {
                format!(
                    "must be at least savepoint.interval ({}), found {}: the log must reach back \
                     to the newest savepoint so state can always be rebuilt (DESIGN §4)",
                    format_duration_ms(sp),
                    format_duration_ms(ret)
                )
            });
        }
        let commit_interval = self
            .duration(
                "log.commit_interval",
                r.commit_interval,
                DEFAULT_COMMIT_INTERVAL_MS,
            )
            .filter(|&ms| {
                self.require("log.commit_interval", ms <= MAX_COMMIT_INTERVAL_MS, || {
                    format!(
                        "must be at most 1s, found {}: inputs wait unacknowledged this long, and \
                         the broker stops sending when its inflight window is full",
                        format_duration_ms(ms)
                    )
                })
            });
        let max_payload = self
            .size("log.max_payload", r.max_payload, DEFAULT_MAX_PAYLOAD)
            .filter(|&n| {
                self.require("log.max_payload", n >= 1, || {
                    "must be at least 1B".to_string()
                })
            });
        let max_payload = match (segment_size, max_payload) {
            (Some(seg), Some(p)) if p.saturating_add(RECORD_OVERHEAD) > seg => {
                self.problem(
                    "log.max_payload",
                    format!(
                        "must leave {} of log.segment_size ({}) for record framing, so at most {}, found {}",
                        format_size(RECORD_OVERHEAD),
                        format_size(seg),
                        format_size(seg - RECORD_OVERHEAD.min(seg)),
                        format_size(p)
                    ),
                );
                None
            }
            (_, p) => p,
        };
        Some(LogConfig {
            segment_size: segment_size?,
            max_size: max_size?,
            retention: Duration::from_millis(retention?),
            commit_interval: Duration::from_millis(commit_interval?),
            max_payload: max_payload?,
        })
    }

    fn checkpoint(&mut self, r: RawCheckpoint) -> Option<CheckpointConfig> {
        let interval = self
            .duration(
                "checkpoint.interval",
                r.interval,
                DEFAULT_CHECKPOINT_INTERVAL_MS,
            )
            .filter(|&ms| {
                self.require(
                    "checkpoint.interval",
                    (1..=MAX_CHECKPOINT_INTERVAL_MS).contains(&ms),
                    || {
                        format!(
                            "must be between 1ms and 1h, found {}: outputs are published only \
                             after the checkpoint that made them",
                            format_duration_ms(ms)
                        )
                    },
                )
            });
        let max_records = self.int(
            "checkpoint.max_records",
            r.max_records,
            DEFAULT_CHECKPOINT_MAX_RECORDS,
            1..=MAX_CHECKPOINT_MAX_RECORDS,
            ": one checkpoint is one sled transaction, held in memory",
        );
        Some(CheckpointConfig {
            interval: Duration::from_millis(interval?),
            max_records: u64::try_from(max_records?).ok()?,
        })
    }

    fn outbox(&mut self, r: RawOutbox) -> Option<OutboxConfig> {
        let max_entries = self.int(
            "outbox.max_entries",
            r.max_entries,
            DEFAULT_OUTBOX_MAX_ENTRIES,
            1..=i64::MAX,
            "",
        );
        let inflight = self.int(
            "outbox.inflight",
            r.inflight,
            DEFAULT_OUTBOX_INFLIGHT,
            1..=65_535,
            ": MQTT packet IDs are 16-bit",
        );
        let drain_timeout = self
            .duration(
                "outbox.drain_timeout",
                r.drain_timeout,
                DEFAULT_DRAIN_TIMEOUT_MS,
            )
            .filter(|&ms| {
                self.require("outbox.drain_timeout", ms <= MAX_DRAIN_TIMEOUT_MS, || {
                    format!(
                        "must be at most 1m, found {}: systemd kills a service that takes longer \
                         than TimeoutStopSec (90s by default) to stop",
                        format_duration_ms(ms)
                    )
                })
            });
        Some(OutboxConfig {
            max_entries: u64::try_from(max_entries?).ok()?,
            inflight: u16::try_from(inflight?).ok()?,
            drain_timeout: Duration::from_millis(drain_timeout?),
        })
    }

    fn metrics(&mut self, r: RawMetrics) -> Option<MetricsConfig> {
        let Some(text) = r.listen else {
            return Some(MetricsConfig { listen: None });
        };
        match text.parse::<SocketAddr>() {
            Err(_) => {
                self.problem(
                    "metrics.listen",
                    format!("`{text}` is not an IP:port address such as \"127.0.0.1:9108\""),
                );
                None
            }
            Ok(addr) if !addr.ip().is_loopback() => {
                self.problem(
                    "metrics.listen",
                    format!(
                        "`{text}` is not a loopback address: metrics are served without \
                         authentication, so bind to 127.0.0.1 or [::1] and put a proxy in front \
                         if they must leave the box"
                    ),
                );
                None
            }
            Ok(addr) => Some(MetricsConfig {
                listen: Some(addr.to_string()),
            }),
        }
    }

    fn savepoint(&mut self, r: RawSavepoint) -> Option<SavepointConfig> {
        let interval = match r.interval {
            None => Some(None),
            Some(text) => match parse_duration_ms(&text.0) {
                Err(e) => {
                    self.problem("savepoint.interval", e);
                    None
                }
                Ok(ms) if ms < MIN_SAVEPOINT_INTERVAL_MS => {
                    self.problem(
                        "savepoint.interval",
                        format!(
                            "must be at least 1s, found {}: each savepoint copies the whole state; \
                             remove the key to disable savepoints",
                            format_duration_ms(ms)
                        ),
                    );
                    None
                }
                Ok(ms) => Some(Some(Duration::from_millis(ms))),
            },
        };
        let keep = self.int(
            "savepoint.keep",
            r.keep,
            DEFAULT_SAVEPOINT_KEEP,
            1..=MAX_SAVEPOINT_KEEP,
            "",
        );
        Some(SavepointConfig {
            interval: interval?,
            keep: usize::try_from(keep?).ok()?,
        })
    }

    fn pipelines(&mut self, raw: Option<Vec<RawPipeline>>) -> Option<Vec<PipelineSpec>> {
        let raw = raw.unwrap_or_default();
        if raw.is_empty() {
            if !self.broken.contains("pipeline") {
                self.problem(
                    "pipeline",
                    "no pipeline: add at least one `[[pipeline]]` table, or there is nothing to do",
                );
            }
            return None;
        }
        let mut names: HashMap<String, usize> = HashMap::new();
        let mut out = Vec::new();
        let mut ok = true;
        for (i, p) in raw.into_iter().enumerate() {
            match self.pipeline(i, p, &mut names) {
                Some(spec) => out.push(spec),
                None => ok = false,
            }
        }
        ok.then_some(out)
    }

    /// A window's slide: `None` when it equals the size (tumbling, stored as before).
    fn slide(&mut self, key: &str, slide: u64, size: Option<u64>) -> Option<Option<u64>> {
        let size = size?;
        if slide == 0 || slide > size {
            self.problem(
                key,
                format!(
                    "must be longer than 0s and at most the window size {}, found {}",
                    format_duration_ms(size),
                    format_duration_ms(slide)
                ),
            );
            return None;
        }
        if size.div_ceil(slide) > MAX_WINDOWS_PER_EVENT {
            self.problem(
                key,
                format!(
                    "a {} window sliding every {} puts each event in {} windows; at most \
                     {MAX_WINDOWS_PER_EVENT} are allowed (each is a state write per event)",
                    format_duration_ms(size),
                    format_duration_ms(slide),
                    size.div_ceil(slide)
                ),
            );
            return None;
        }
        Some((slide != size).then_some(slide))
    }

    /// A list of aggregates: not empty, each known, none twice.
    fn aggregate_list(&mut self, key: &str, list: Vec<String>) -> Option<AggregateSpec> {
        if list.is_empty() || list.len() > MAX_AGGREGATES {
            self.problem(
                key,
                format!(
                    "must list 1 to {MAX_AGGREGATES} aggregates, found {}",
                    list.len()
                ),
            );
            return None;
        }
        let mut out: Vec<Aggregate> = Vec::with_capacity(list.len());
        let mut ok = true;
        for (j, a) in list.iter().enumerate() {
            let at = format!("{key}[{j}]");
            match Aggregate::parse(a) {
                Some(agg) if out.contains(&agg) => {
                    self.problem(&at, format!("`{a}` is listed twice"));
                    ok = false;
                }
                Some(agg) => out.push(agg),
                None => {
                    self.problem(
                        &at,
                        format!("`{a}` is not an aggregate: expected {AGGREGATE_NAMES}"),
                    );
                    ok = false;
                }
            }
        }
        ok.then_some(AggregateSpec::List(out))
    }

    /// One `[[pipeline]]` table, checked key group by key group in the order the problems
    /// are reported; every group is checked even when an earlier one failed.
    fn pipeline(
        &mut self,
        i: usize,
        r: RawPipeline,
        names: &mut HashMap<String, usize>,
    ) -> Option<PipelineSpec> {
        let p = format!("pipeline[{i}]");
        let name = self.pipeline_name(&p, i, r.name, names);
        let topics = self.pipeline_topics(&p, r.topics);
        let format = self.pipeline_format(&p, r.format, r.separator);
        let aggregate = self.pipeline_aggregate(&p, r.aggregate);
        let filter = self.pipeline_filter(&p, r.filter, format.as_ref());
        let fields = self.pipeline_fields(
            &p,
            RawFields {
                event_id: r.event_id,
                key: r.key,
                value: r.value,
                event_time: r.event_time,
            },
            format.as_ref(),
            aggregate.as_ref(),
        );
        let window = self.pipeline_window(&p, r.window);
        let dedup_window_ms = self.dedup_window(&p, r.dedup_window);
        let output_topic = self.output_topic(&p, r.output_topic, &window);
        let emit = self.emit(&p, r.emit.as_deref(), &window);
        let limits =
            self.pipeline_limits(&p, r.max_key_len, r.max_keys, r.max_id_len, r.max_future);

        format.as_ref()?;
        Some(PipelineSpec {
            name: name?,
            topics: topics?,
            format: format?,
            event_id: fields.event_id??,
            key: fields.key??,
            value: fields.value?,
            event_time: fields.event_time?,
            aggregate: aggregate?,
            window: window?,
            filter: filter?,
            dedup_window_ms: dedup_window_ms?,
            output_topic: output_topic?,
            retain: r.retain.unwrap_or(true),
            emit: emit?,
            max_key_len: usize::try_from(limits.max_key_len?).ok()?,
            max_keys: u64::try_from(limits.max_keys?).ok()?,
            max_id_len: usize::try_from(limits.max_id_len?).ok()?,
            max_future_ms: limits.max_future_ms?,
        })
    }

    /// The name: valid, and not used by an earlier pipeline (`names` remembers them).
    fn pipeline_name(
        &mut self,
        p: &str,
        i: usize,
        raw: Option<String>,
        names: &mut HashMap<String, usize>,
    ) -> Option<String> {
        let key = format!("{p}.name");
        match raw {
            None => {
                self.missing(&key, "output IDs and state are keyed by the pipeline name");
                None
            }
            Some(name) if !valid_name(&name, MAX_PIPELINE_NAME_LEN) => {
                self.problem(
                    &key,
                    format!(
                        "`{name}` is not a valid pipeline name: use 1 to {MAX_PIPELINE_NAME_LEN} \
                         of A-Z a-z 0-9 _ - (it is part of every output ID)"
                    ),
                );
                None
            }
            Some(name) => match names.get(&name) {
                Some(&first) => {
                    self.problem(
                        &key,
                        format!(
                            "duplicate pipeline name `{name}`, also used by pipeline[{first}]: \
                             output IDs and state are keyed by it"
                        ),
                    );
                    None
                }
                None => {
                    names.insert(name.clone(), i);
                    Some(name)
                }
            },
        }
    }

    /// The topic filters: at least one, each valid, none twice.
    fn pipeline_topics(&mut self, p: &str, raw: Option<Vec<String>>) -> Option<Vec<String>> {
        match raw {
            None => {
                self.missing(
                    &format!("{p}.topics"),
                    "the MQTT topic filters this pipeline consumes",
                );
                None
            }
            Some(t) if t.is_empty() => {
                self.problem(
                    &format!("{p}.topics"),
                    "is empty: list at least one topic filter, e.g. [\"payments/#\"]",
                );
                None
            }
            Some(topics) => {
                let mut ok = true;
                for (j, t) in topics.iter().enumerate() {
                    let key = format!("{p}.topics[{j}]");
                    if let Err(e) = check_filter(t) {
                        self.problem(&key, format!("`{t}` is not a valid topic filter: {e}"));
                        ok = false;
                    } else if topics[..j].contains(t) {
                        self.problem(&key, format!("`{t}` is listed twice"));
                        ok = false;
                    }
                }
                ok.then_some(topics)
            }
        }
    }

    /// The payload format, and the separator that only `delimited` takes.
    fn pipeline_format(
        &mut self,
        p: &str,
        format: Option<String>,
        separator: Option<String>,
    ) -> Option<Format> {
        match (format.as_deref().unwrap_or("json"), separator) {
            ("json", None) => Some(Format::Json),
            ("json", Some(_)) => {
                self.problem(
                    &format!("{p}.separator"),
                    "only applies to format = \"delimited\"; remove it for JSON",
                );
                None
            }
            ("delimited", separator) => {
                let separator = separator.unwrap_or_else(|| "/".to_string());
                if separator.is_empty() {
                    self.problem(
                        &format!("{p}.separator"),
                        "is empty: give the text between fields, e.g. \"/\"",
                    );
                    None
                } else {
                    Some(Format::Delimited { separator })
                }
            }
            (other, _) => {
                self.problem(
                    &format!("{p}.format"),
                    format!("`{other}` is not a format: expected \"json\" or \"delimited\""),
                );
                None
            }
        }
    }

    /// One aggregate or a list of them.
    fn pipeline_aggregate(&mut self, p: &str, raw: Option<RawAggregate>) -> Option<AggregateSpec> {
        let key = format!("{p}.aggregate");
        match raw {
            None => {
                self.missing(&key, AGGREGATE_NAMES);
                None
            }
            Some(RawAggregate::One(a)) => match Aggregate::parse(&a) {
                Some(agg) => Some(AggregateSpec::One(agg)),
                None => {
                    self.problem(
                        &key,
                        format!("`{a}` is not an aggregate: expected {AGGREGATE_NAMES}"),
                    );
                    None
                }
            },
            Some(RawAggregate::List(list)) => self.aggregate_list(&key, list),
        }
    }

    /// The `where` filter, read with the pipeline's format (skipped without a valid one).
    /// `Some(None)`: absent; `None`: rejected.
    fn pipeline_filter(
        &mut self,
        p: &str,
        raw: Option<String>,
        format: Option<&Format>,
    ) -> Option<Option<Expr>> {
        match (raw, format) {
            (None, _) => Some(None),
            (Some(_), None) => None,
            (Some(text), Some(format)) => match parse_filter(&text, format) {
                Ok(e) => Some(Some(e)),
                Err(e) => {
                    // The position within the expression: TOML drops the newline after an
                    // opening `'''`, so a file line could be off by one.
                    let at = match e.position(&text) {
                        (0, col) => format!("column {col}"),
                        (line, col) => format!("line {}, column {col}", line + 1),
                    };
                    self.problem(
                        &format!("{p}.where"),
                        format!("{at} of the filter: {}", e.message),
                    );
                    None
                }
            },
        }
    }

    /// One field, read with the pipeline's format; without a valid format it is skipped.
    /// `Some(None)`: absent; `None`: rejected (or unreadable without a format).
    fn field(
        &mut self,
        p: &str,
        name: &str,
        text: Option<String>,
        format: Option<&Format>,
    ) -> Option<Option<Field>> {
        let Some(text) = text else {
            return Some(None);
        };
        let format = format?;
        match Field::parse(&text, format) {
            Ok(f) => Some(Some(f)),
            Err(e) => {
                self.problem(&format!("{p}.{name}"), e);
                None
            }
        }
    }

    /// The fields an event is read through: `event_id` and `key` required, `value` exactly
    /// when the aggregate reads one, `event_time` optional.
    fn pipeline_fields(
        &mut self,
        p: &str,
        raw: RawFields,
        format: Option<&Format>,
        aggregate: Option<&AggregateSpec>,
    ) -> Fields {
        let event_id_present = raw.event_id.is_some();
        let key_present = raw.key.is_some();
        let value_present = raw.value.is_some();
        let event_id = self.field(p, "event_id", raw.event_id, format);
        let key = self.field(p, "key", raw.key, format);
        let value = self.field(p, "value", raw.value, format);
        let event_time = self.field(p, "event_time", raw.event_time, format);
        if !event_id_present {
            self.missing(
                &format!("{p}.event_id"),
                "events are deduplicated by it (broker redeliveries and repeated publishes); \
                 a JSON pointer such as \"/id\", or a template such as \"{/device}-{/seq}\"",
            );
        }
        if !key_present {
            self.missing(
                &format!("{p}.key"),
                "the field whose value names the aggregate, e.g. \"/account\"",
            );
        }
        let needs_value = aggregate.map(AggregateSpec::needs_value);
        let value = match (needs_value, value_present) {
            (Some(false), true) => {
                self.problem(
                    &format!("{p}.value"),
                    "count counts events and reads no value: remove `value`, or use another aggregate",
                );
                None
            }
            (Some(true), false) => {
                let agg = aggregate.map(aggregate_text).unwrap_or_default();
                self.missing(
                    &format!("{p}.value"),
                    &format!("`{agg}` needs the field to aggregate, e.g. \"/amount\""),
                );
                None
            }
            (_, false) => Some(None),
            (_, true) => value,
        };
        Fields {
            event_id,
            key,
            value,
            event_time,
        }
    }

    /// The optional window: a size, a lateness and a slide. `Some(None)`: no window.
    fn pipeline_window(&mut self, p: &str, raw: Option<RawWindow>) -> Option<Option<WindowSpec>> {
        let Some(w) = raw else {
            return Some(None);
        };
        let k = |key: &str| format!("{p}.window.{key}");
        let size = match w.size {
            None => {
                self.missing(
                    &k("size"),
                    "the length of each tumbling window, e.g. \"1m\"",
                );
                None
            }
            some => self.duration(&k("size"), some, 0).filter(|&ms| {
                self.require(&k("size"), ms > 0, || {
                    "must be longer than 0s; remove `window` for an unwindowed aggregate"
                        .to_string()
                })
            }),
        };
        let lateness = self.duration(&k("allowed_lateness"), w.allowed_lateness, 0);
        let slide = match w.slide {
            None => Some(None),
            some => self
                .duration(&k("slide"), some, 0)
                .and_then(|slide| self.slide(&k("slide"), slide, size)),
        };
        // No `?` before here: it would skip the checks above, hiding their problems.
        Some(Some(WindowSpec {
            size_ms: size?,
            allowed_lateness_ms: lateness?,
            slide_ms: slide?,
        }))
    }

    fn dedup_window(&mut self, p: &str, raw: Option<DurationText>) -> Option<u64> {
        let key = format!("{p}.dedup_window");
        self.duration(&key, raw, DEFAULT_DEDUP_WINDOW_MS)
            .filter(|&ms| {
                self.require(
                    &key,
                    (MIN_DEDUP_WINDOW_MS..=MAX_DEDUP_WINDOW_MS).contains(&ms),
                    || {
                        format!(
                            "must be between 1m and 366d, found {}: broker redeliveries after a \
                             reconnect come minutes later, and the window is held in the store",
                            format_duration_ms(ms)
                        )
                    },
                )
            })
    }

    /// The output topic template; `{window_start}` only with a window.
    fn output_topic(
        &mut self,
        p: &str,
        raw: Option<String>,
        window: &Option<Option<WindowSpec>>,
    ) -> Option<String> {
        let key = format!("{p}.output_topic");
        let Some(t) = raw else {
            self.missing(
                &key,
                "the topic results are published to, with `{key}`, e.g. \"balances/{key}\"",
            );
            return None;
        };
        // Whether `{window_start}` is allowed depends on a valid window; if the window
        // itself is broken, it was reported already.
        let windowed = matches!(window, Some(Some(_)) | None);
        match check_output_topic(&t, windowed) {
            Ok(()) => Some(t),
            Err(e) => {
                self.problem(&key, format!("`{t}`: {e}"));
                None
            }
        }
    }

    /// The emit mode; `final` only with a window.
    fn emit(
        &mut self,
        p: &str,
        raw: Option<&str>,
        window: &Option<Option<WindowSpec>>,
    ) -> Option<Emit> {
        let key = format!("{p}.emit");
        match raw {
            None | Some("upsert") => Some(Emit::Upsert),
            Some("changelog") => Some(Emit::Changelog),
            // Whether there is a window is known only if `window` itself is valid.
            Some("final") if matches!(window, Some(None)) => {
                self.problem(
                    &key,
                    "\"final\" emits a result when its window closes: it needs a `window`",
                );
                None
            }
            Some("final") => Some(Emit::Final),
            Some(other) => {
                self.problem(
                    &key,
                    format!(
                        "`{other}` is not an emit mode: expected \"upsert\", \"changelog\" or \"final\""
                    ),
                );
                None
            }
        }
    }

    /// The per-pipeline bounds on keys, IDs and event times (invariant 7).
    fn pipeline_limits(
        &mut self,
        p: &str,
        max_key_len: Option<i64>,
        max_keys: Option<i64>,
        max_id_len: Option<i64>,
        max_future: Option<DurationText>,
    ) -> Limits {
        let max_key_len = self.int(
            &format!("{p}.max_key_len"),
            max_key_len,
            DEFAULT_MAX_KEY_LEN,
            1..=MAX_MAX_KEY_LEN,
            " bytes: keys are part of topics, output IDs and store keys",
        );
        let max_keys = self.int(
            &format!("{p}.max_keys"),
            max_keys,
            DEFAULT_MAX_KEYS,
            1..=i64::MAX,
            "",
        );
        let max_id_len = self.int(
            &format!("{p}.max_id_len"),
            max_id_len,
            DEFAULT_MAX_ID_LEN,
            1..=MAX_MAX_ID_LEN,
            " bytes: event IDs are held in the dedup ledger",
        );
        let key = format!("{p}.max_future");
        let max_future_ms = self
            .duration(&key, max_future, DEFAULT_MAX_FUTURE_MS)
            .filter(|&ms| {
                self.require(&key, ms <= MAX_MAX_FUTURE_MS, || {
                    format!(
                        "must be at most 366d, found {}: it is how far a device clock may run \
                         ahead, and events beyond it are dead letters",
                        format_duration_ms(ms)
                    )
                })
            });
        Limits {
            max_key_len,
            max_keys,
            max_id_len,
            max_future_ms,
        }
    }
}

/// A pipeline's field texts, before they are read with its format.
struct RawFields {
    event_id: Option<String>,
    key: Option<String>,
    value: Option<String>,
    event_time: Option<String>,
}

/// A pipeline's fields: `Some(None)` absent, `None` rejected (see [`Validator::field`]);
/// `value` is already checked against the aggregate.
struct Fields {
    event_id: Option<Option<Field>>,
    key: Option<Option<Field>>,
    value: Option<Option<Field>>,
    event_time: Option<Option<Field>>,
}

/// A pipeline's bounds, each `None` after a problem.
struct Limits {
    max_key_len: Option<i64>,
    max_keys: Option<i64>,
    max_id_len: Option<i64>,
    max_future_ms: Option<u64>,
}

/// `[A-Za-z0-9_-]{1,max}`.
fn valid_name(s: &str, max: usize) -> bool {
    (1..=max).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// An MQTT topic filter (MQTT 3.1.1 §4.7): `#` only as the whole last level, `+` only as a
/// whole level.
fn check_filter(f: &str) -> Result<(), String> {
    if f.is_empty() {
        return Err("it is empty and matches nothing".to_string());
    }
    if f.contains('\0') {
        return Err("it contains a NUL character".to_string());
    }
    if f.len() > MAX_TOPIC_LEN {
        return Err(format!("it is longer than {MAX_TOPIC_LEN} bytes"));
    }
    let levels: Vec<&str> = f.split('/').collect();
    for (i, level) in levels.iter().enumerate() {
        if level.contains('#') {
            if *level != "#" {
                return Err("`#` must be a whole level, e.g. \"a/#\"".to_string());
            }
            if i + 1 != levels.len() {
                return Err("`#` must be the last level".to_string());
            }
        }
        if level.contains('+') && *level != "+" {
            return Err("`+` must be a whole level, e.g. \"a/+/c\"".to_string());
        }
    }
    Ok(())
}

/// An output topic template: a publish topic (no wildcards) with `{key}` and, when
/// windowed, optionally `{window_start}`.
fn check_output_topic(t: &str, windowed: bool) -> Result<(), String> {
    if t.is_empty() {
        return Err("an output topic cannot be empty".to_string());
    }
    if t.contains('\0') {
        return Err("it contains a NUL character".to_string());
    }
    if t.len() > MAX_TOPIC_LEN {
        return Err(format!("it is longer than {MAX_TOPIC_LEN} bytes"));
    }
    if t.contains(['+', '#']) {
        return Err(
            "`+` and `#` are wildcards for subscribing; a published topic cannot contain them"
                .to_string(),
        );
    }
    if t.starts_with('$') {
        return Err("topics starting with `$` are reserved for the broker".to_string());
    }
    let mut has_key = false;
    let mut rest = t;
    while let Some(open) = rest.find(['{', '}']) {
        if rest.as_bytes()[open] == b'}' {
            return Err("unmatched `}`".to_string());
        }
        let after = &rest[open + 1..];
        let Some(close) = after.find('}') else {
            return Err("unclosed `{`".to_string());
        };
        match &after[..close] {
            "key" => has_key = true,
            "window_start" if windowed => {}
            "window_start" => {
                return Err("`{window_start}` needs a `window`".to_string());
            }
            other => {
                return Err(format!(
                    "unknown placeholder `{{{other}}}`: only {{key}} and {{window_start}} are replaced"
                ));
            }
        }
        rest = &after[close + 1..];
    }
    if !has_key {
        return Err(
            "must contain `{key}`: each key needs its own topic, or retained results overwrite each other"
                .to_string(),
        );
    }
    Ok(())
}
