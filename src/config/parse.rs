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

// MQTT strings (topics, filters) are at most 65535 bytes; result topics leave room for an
// uplink's prefix.
use crate::pipeline::topic::{MAX_RESULT_TOPIC_LEN, MAX_TOPIC_LEN, TOPIC_PREFIX_ROOM};
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
use crate::pipeline::expr::Expr;
use crate::pipeline::field::{Field, Format, TemplatePart};
use crate::pipeline::filter::parse_filter;
use crate::pipeline::spec::{
    Aggregate, AggregateSpec, Emit, MAX_WINDOWS_PER_EVENT, PipelineSpec, Start, WindowSpec,
};

mod link;
#[path = "locate.rs"]
mod locate;
mod names;
mod pipeline;
mod raw;
mod sections;
mod summary;
#[cfg(test)]
#[path = "parse_tests.rs"]
mod tests;
#[path = "units.rs"]
mod units;
mod uplink;

use link::RawLink;
use locate::{Lines, Seg};
use names::valid_name;
use raw::*;
pub use summary::summary;
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

/// Bounds replay after a crash (results leave before their checkpoint, so it no longer sets
/// their latency). 5 s, from the interval curve of `benches/compare.rs` (issue 14, README
/// "Performance"): bytes written per event fall from ~2,500 at 50 ms to ~340 at 5 s, while
/// recovery after a kill stays under half a second at the rates this box sustains.
const DEFAULT_CHECKPOINT_INTERVAL_MS: u64 = 5_000;
const MAX_CHECKPOINT_INTERVAL_MS: u64 = 3_600_000;
/// One sled transaction holds a whole checkpoint in memory (~13k 4-tree txn/s, DESIGN §4),
/// and so does the engine's overlay until then (ledger entries, outputs: a few MiB at this
/// bound). High enough that the interval decides below ~4,000 events/s.
const DEFAULT_CHECKPOINT_MAX_RECORDS: i64 = 20_000;
const MAX_CHECKPOINT_MAX_RECORDS: i64 = 1_000_000;
/// Each key a checkpoint writes costs a copy of its sled leaf (~4 KiB with 100k keys) until
/// the checkpoint's transaction ends: sled copies a leaf on every write and frees the old
/// copy only once the transaction unpins. Measured on the 1M backlog over 100k keys
/// (`benches/compare.rs`): peak RSS 122 MiB at 20,000 records per checkpoint, 68-73 at 5,000,
/// 60 at 2,500 (issue 16); bounded by keys, 59.2-64.2 MiB at 2,048 and 55.7-57.5 at 1,536,
/// at rest the same. With few keys the record bound or the interval decides.
const DEFAULT_CHECKPOINT_MAX_KEYS: i64 = 1_536;

/// Hours of output while the broker is away, at a few kB each: well under the disk.
const DEFAULT_OUTBOX_MAX_ENTRIES: i64 = 100_000;
/// The outbox is the uplink's store-and-forward queue: 1 GiB holds about 5 million
/// results of ~200 bytes (a day and a half of changelog results at 40/s with the uplink
/// down), half the replay log's default 2 GiB, and still small beside an edge box's
/// flash. In `upsert` mode it holds one result per key whatever the outage.
const DEFAULT_OUTBOX_MAX_SIZE: u64 = GIB;
/// One checkpoint's outputs must fit under the bound with room to spare.
const MIN_OUTBOX_MAX_SIZE: u64 = MIB;
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

fn duration_ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
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
        let max_records_given = raw
            .checkpoint
            .as_ref()
            .is_some_and(|c| c.max_records.is_some());
        let mut checkpoint = self.checkpoint(raw.checkpoint.unwrap_or_default());
        if let (Some(o), Some(c), false) = (&outbox, &mut checkpoint, max_records_given) {
            // The default follows a smaller outbox bound written for an older default, so
            // such a config keeps loading (a box must not need a person after an upgrade).
            c.max_records = c.max_records.min(o.max_entries);
        }
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
        let uplink = self.uplink(raw.uplink, mqtt.as_ref());
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
            uplink: uplink?,
            pipelines: pipelines?,
        })
    }
}
