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
    MqttConfig, OutboxConfig, SavepointConfig, SparkplugConfig, StorageConfig, TlsConfig,
};
use crate::pipeline::expr::Expr;
use crate::pipeline::field::{Field, Format, TemplatePart};
use crate::pipeline::filter::parse_filter;
use crate::pipeline::spec::{
    Aggregate, AggregateSpec, Emit, MAX_WINDOWS_PER_EVENT, PipelineSpec, Start, WindowSpec,
};

pub(super) mod dbsinks;
mod link;
#[path = "locate.rs"]
mod locate;
mod names;
mod pipeline;
mod raw;
mod sections;
mod sinks;
mod summary;
#[cfg(test)]
#[path = "parse_tests.rs"]
mod tests;
mod uplink;

use super::keys::{self, Def, Range, bounds};
use super::units::{self, format_duration_ms, format_size, parse_duration_ms, parse_size};
use link::RawLink;
use locate::{Lines, Seg};
use names::valid_name;
use raw::*;
pub use summary::summary;

// ---------------------------------------------------------------------------------------
// Bounds that are not one key's: every key's default and range, with the reason for the
// default, are in the table of keys (`config/keys.rs`).

const KIB: u64 = 1 << 10;
/// MQTT 3.1.1 guarantees 23 characters; most brokers accept more.
const MAX_CLIENT_ID_LEN: usize = 64;
const PORTABLE_CLIENT_ID_LEN: usize = 23;
/// Room for a record's framing and metadata (topic, offsets, times) beside its payload.
const RECORD_OVERHEAD: u64 = 64 * KIB;
const MAX_PIPELINE_NAME_LEN: usize = 64;

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

const AGGREGATE_NAMES: &str = "one of sum, count, min, max, avg, last, stddev, variance, twa, or a percentile such as p50, p95, p99.9";

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

    /// A duration key: absent, its default from the table of keys; present, parsed and held
    /// to the table's range.
    fn duration(&mut self, key: &str, raw: Option<DurationText>) -> Option<u64> {
        let row = keys::row(key);
        let ms = match raw {
            None => match row.default {
                Def::Ms(ms) => return Some(ms),
                _ => return Some(0),
            },
            Some(text) => parse_duration_ms(&text.0)
                .map_err(|e| self.problem(key, e))
                .ok()?,
        };
        match row.range {
            Range::Ms(lo, hi) => self.within(key, row.why, ms, (lo, hi), format_duration_ms),
            _ => Some(ms),
        }
    }

    /// A size key, likewise.
    fn size(&mut self, key: &str, raw: Option<SizeText>) -> Option<u64> {
        let row = keys::row(key);
        let n = match raw {
            None => match row.default {
                Def::Bytes(n) => return Some(n),
                _ => return Some(0),
            },
            Some(text) => parse_size(&text.0).map_err(|e| self.problem(key, e)).ok()?,
        };
        match row.range {
            Range::Bytes(lo, hi) => self.within(key, row.why, n, (lo, hi), format_size),
            _ => Some(n),
        }
    }

    /// `n` when it lies in `lo..=hi`; else a problem naming the range as `show` writes it.
    fn within(
        &mut self,
        key: &str,
        why: &str,
        n: u64,
        (lo, hi): (u64, u64),
        show: fn(u64) -> String,
    ) -> Option<u64> {
        if (lo..=hi).contains(&n) {
            return Some(n);
        }
        let bounds = bounds(&show(lo), &show(hi), lo == 0, hi == u64::MAX);
        self.problem(key, format!("must be {bounds}, found {}: {why}", show(n)));
        None
    }

    /// An integer key, likewise.
    fn int(&mut self, key: &str, raw: Option<i64>) -> Option<i64> {
        let row = keys::row(key);
        let n = match (raw, row.default) {
            (Some(n), _) => n,
            (None, Def::Int(n)) => n,
            (None, _) => 0,
        };
        match row.range {
            Range::Int(lo, hi) if !(lo..=hi).contains(&n) => {
                let bounds = bounds(&lo.to_string(), &hi.to_string(), false, hi == i64::MAX);
                self.problem(key, format!("must be {bounds}, found {n}: {}", row.why));
                None
            }
            _ => Some(n),
        }
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
        let sparkplug = self.sparkplug(raw.sparkplug.unwrap_or_default());
        let sinks = self.sinks(
            raw.sink,
            mqtt.as_ref(),
            uplink.as_ref().and_then(|u| u.as_ref()),
        );
        let mut pipelines = self.pipelines(raw.pipeline);
        if let (Some(p), Some(s), Some(u)) = (&mut pipelines, &sinks, &uplink) {
            if !self.routes(p, s, u.is_some()) || !self.tables(p, s) {
                pipelines = None;
            }
        }
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
            sinks: sinks?,
            sparkplug: sparkplug?,
            pipelines: pipelines?,
        })
    }
}
