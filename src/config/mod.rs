//! Configuration: TOML text → raw serde form → validated, typed [`Config`] in which every
//! limit is explicit (DESIGN §3, invariant 7).
//!
//! Durations and sizes are strings (`"250ms"`, `"7d"`, `"512MiB"`). An unknown key, a wrong
//! type or an impossible value is a [`ConfigError`] naming the file, the key and its line.
//!
//! Every key's default, range, unit, reload behaviour and reason live once, in the table of
//! [`keys`]: validation, `cairn validate`'s [`summary`], the SIGHUP [`reload::plan`] and
//! `docs/configuration.md` all read it.

use std::path::PathBuf;
use std::time::Duration;

use crate::pipeline::spec::PipelineSpec;

pub mod keys;
mod parse;
pub mod reload;
pub(crate) mod units;
pub use parse::{ConfigError, Problem, load, parse_str, summary};

/// The whole, validated configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// The file it was read from (for messages).
    pub source: PathBuf,
    pub mqtt: MqttConfig,
    pub storage: StorageConfig,
    pub log: LogConfig,
    pub checkpoint: CheckpointConfig,
    pub outbox: OutboxConfig,
    pub metrics: MetricsConfig,
    pub savepoint: SavepointConfig,
    pub logging: LoggingConfig,
    pub dead_letters: DeadLettersConfig,
    /// `[uplink]`: where results go when they do not go to `[mqtt]`'s broker.
    pub uplink: Option<UplinkConfig>,
    /// `[[sink]]` tables (issue 29): named destinations pipelines send results to, beside
    /// `local` (`[mqtt]`'s broker) and `uplink` (`[uplink]`).
    pub sinks: Vec<SinkConfig>,
    /// `[sparkplug]`: Cairn as a Sparkplug host (issue 31).
    pub sparkplug: SparkplugConfig,
    pub pipelines: Vec<PipelineSpec>,
}

/// `[sparkplug]`: how Cairn acts as a Sparkplug B host application towards edge nodes.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SparkplugConfig {
    /// Act as the Primary Host Application of this ID: publish `spBv1.0/STATE/<host_id>`
    /// (online once the log is ready, offline by will and before a clean stop), so edge
    /// nodes configured with it buffer while Cairn is down.
    pub host_id: Option<String>,
    /// Answer a seq gap, an unknown metric or DATA without a session with an NCMD
    /// `Node Control/Rebirth` (rate limited).
    pub rebirth: bool,
}

/// `[dead_letters]`: how many and how old the stored dead letters may be; the oldest beyond
/// either bound are dropped at a checkpoint, and counted.
#[derive(Debug, Clone, PartialEq)]
pub struct DeadLettersConfig {
    pub max_entries: u64,
    /// Measured on record time (the log clock), like the dedup window.
    pub max_age: Duration,
}

#[derive(Debug, Clone, PartialEq)]
pub struct LoggingConfig {
    /// Applied at start and on SIGHUP; `RUST_LOG`, when set, overrides it.
    pub level: log::LevelFilter,
}

#[derive(Debug, Clone, PartialEq)]
pub struct TlsConfig {
    pub ca_file: PathBuf,
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct MqttConfig {
    pub host: String,
    pub port: u16,
    /// Stable: the broker keeps the persistent session under it.
    pub client_id: String,
    pub keep_alive: Duration,
    pub username: Option<String>,
    pub password_file: Option<PathBuf>,
    pub tls: Option<TlsConfig>,
    /// Group commit size for ingest: at most this many received messages wait for one
    /// fsync. Must not exceed the broker's inflight window (mosquitto default 20).
    pub ingest_batch: usize,
    /// Bounded exponential reconnect backoff.
    pub reconnect_min: Duration,
    pub reconnect_max: Duration,
    /// Capacity of rumqttc's request channel and of our event channel.
    pub channel_capacity: usize,
    /// The will registered at connect: not a config key; the agent sets it on the input
    /// connection when it is a Sparkplug Primary Host (`[sparkplug] host_id`).
    pub will: Option<Will>,
}

/// An MQTT will: published by the broker, QoS 1 and retained, when the connection ends
/// without a DISCONNECT.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Will {
    pub topic: String,
    pub payload: Vec<u8>,
}

/// `[uplink]`: a second, publish-only connection to a central broker; results go there
/// (with `topic_prefix` before their topic) and the outbox holds them through outages.
#[derive(Debug, Clone, PartialEq)]
pub struct UplinkConfig {
    /// The connection, checked as `[mqtt]`'s is. `ingest_batch` and `channel_capacity`
    /// are `[mqtt]`'s: both connections feed one event channel.
    pub mqtt: MqttConfig,
    /// Prepended to every result topic ("" by default).
    pub topic_prefix: String,
}

/// The sink name of `[mqtt]`'s broker.
pub const LOCAL_SINK: &str = "local";
/// The sink name of `[uplink]`.
pub const UPLINK_SINK: &str = "uplink";

/// One `[[sink]]`: its name (what pipelines' `sinks` list) and its kind with its keys.
#[derive(Debug, Clone, PartialEq)]
pub struct SinkConfig {
    pub name: String,
    pub kind: SinkKind,
}

/// What a sink is, with the keys of that kind.
#[derive(Debug, Clone, PartialEq)]
pub enum SinkKind {
    /// `kind = "mqtt"`: a publish-only connection to a broker.
    Mqtt(MqttSinkConfig),
    /// `kind = "postgres"` (issue 30): a table per pipeline (`src/sink/postgres.rs`).
    Postgres(crate::sink::postgres::PostgresConfig),
    /// `kind = "jetstream"` (issue 30): a NATS JetStream stream (`src/sink/jetstream.rs`).
    JetStream(crate::sink::jetstream::JetStreamConfig),
}

impl SinkKind {
    /// The `kind` as the config writes it.
    pub fn name(&self) -> &'static str {
        match self {
            SinkKind::Mqtt(_) => "mqtt",
            SinkKind::Postgres(_) => "postgres",
            SinkKind::JetStream(_) => "jetstream",
        }
    }
}

/// Which MQTT a sink speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SinkProtocol {
    /// MQTT 5 (`"5"`, the default): a PUBACK can refuse.
    V5,
    /// MQTT 3.1.1 (`"3.1.1"`): a broker that refuses acknowledges and drops.
    V311,
}

/// `kind = "mqtt"`: the connection (checked as `[uplink]`'s), its protocol and prefix.
#[derive(Debug, Clone, PartialEq)]
pub struct MqttSinkConfig {
    /// `ingest_batch` and `channel_capacity` are `[mqtt]`'s: every connection feeds one
    /// event channel.
    pub mqtt: MqttConfig,
    pub protocol: SinkProtocol,
    /// Prepended to every result topic ("" by default).
    pub topic_prefix: String,
}

#[derive(Debug, Clone, PartialEq)]
pub struct StorageConfig {
    /// `log/` and `store/` live below it.
    pub data_dir: PathBuf,
    /// sled `cache_capacity` in bytes.
    pub cache_size: u64,
    /// Most bytes of the dedup ledger's in-memory index (all pipelines); beyond it lookups
    /// read the ledger (exact, slower).
    pub ledger_index_max: u64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct LogConfig {
    pub segment_size: u64,
    /// Full ⇒ stop acking (backpressure), never drop.
    pub max_size: u64,
    /// Keep processed segments this long.
    pub retention: Duration,
    /// Group commit interval.
    pub commit_interval: Duration,
    pub max_payload: u64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct CheckpointConfig {
    pub interval: Duration,
    pub max_records: u64,
    /// Distinct state keys written, summed over pipelines: a checkpoint is taken at this
    /// many, to bound the memory its transaction takes.
    pub max_keys: u64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct OutboxConfig {
    /// At this many entries processing waits (input is still logged and acknowledged) until
    /// results leave: see `agent/behind.rs`.
    pub max_entries: u64,
    /// At this many bytes of outbox chunks on disk, processing waits likewise.
    pub max_size: u64,
    /// Unacknowledged outgoing publishes at once.
    pub inflight: u16,
    /// On shutdown, how long the publisher may keep draining.
    pub drain_timeout: Duration,
}

#[derive(Debug, Clone, PartialEq)]
pub struct MetricsConfig {
    /// Loopback address for Prometheus text, e.g. `127.0.0.1:9108`; `None` disables it.
    pub listen: Option<String>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct SavepointConfig {
    /// Take a savepoint this often; `None` disables periodic savepoints.
    pub interval: Option<Duration>,
    /// Keep this many newest savepoints.
    pub keep: usize,
}

/// Parse one `[[pipeline]]` table body (TOML, without the header) with every default and
/// check a config file would apply. For tests, benchmarks and tools that need a pipeline
/// without a whole config: a hand-built `PipelineSpec` would drift from the real defaults.
pub fn pipeline_from_toml(body: &str) -> Result<PipelineSpec, ConfigError> {
    let text = format!(
        "[mqtt]\nclient_id = \"pipeline\"\n[storage]\ndata_dir = \".\"\n[[pipeline]]\n{body}"
    );
    let cfg = parse_str(&text, std::path::Path::new("<pipeline>"))?;
    Ok(cfg
        .pipelines
        .into_iter()
        .next()
        .expect("exactly one [[pipeline]]"))
}

impl Config {
    /// The bounds the store applies by itself.
    pub(crate) fn store_bounds(&self) -> crate::store::StoreBounds {
        crate::store::StoreBounds {
            dead_letters_max_entries: self.dead_letters.max_entries,
            dead_letters_max_age_ms: u64::try_from(self.dead_letters.max_age.as_millis())
                .unwrap_or(u64::MAX),
            ledger_index_max_bytes: self.storage.ledger_index_max,
        }
    }

    /// What is allowed but unsafe, one line each: `validate` prints them, `run` logs them.
    /// Today: a `password_file` that its group or everyone can read (the MQTT password is
    /// in it; `chmod 600`, or `640` with the group the service runs as if root owns it).
    pub fn warnings(&self) -> Vec<String> {
        use std::os::unix::fs::PermissionsExt;
        let mut out = Vec::new();
        let sinks: Vec<(String, &MqttConfig)> = self
            .sinks
            .iter()
            .enumerate()
            .filter_map(|(i, s)| match &s.kind {
                SinkKind::Mqtt(m) => Some((format!("sink[{i}]"), &m.mqtt)),
                SinkKind::Postgres(_) | SinkKind::JetStream(_) => None,
            })
            .collect();
        for (i, s) in self.sinks.iter().enumerate() {
            if let SinkKind::Mqtt(m) = &s.kind
                && m.protocol == SinkProtocol::V311
            {
                out.push(format!(
                    "sink[{i}].protocol: sink `{}` speaks MQTT 3.1.1: a broker that refuses a \
                     result (an ACL, a quota) acknowledges it and drops it silently, and Cairn \
                     deletes it as delivered; use protocol = \"5\" unless the broker cannot",
                    s.name
                ));
            }
        }
        let files = [("mqtt".to_string(), &self.mqtt)]
            .into_iter()
            .chain(
                self.uplink
                    .as_ref()
                    .map(|u| ("uplink".to_string(), &u.mqtt)),
            )
            .chain(sinks);
        for (section, path) in files.filter_map(|(s, m)| Some((s, m.password_file.as_ref()?))) {
            let Ok(meta) = std::fs::metadata(path) else {
                continue;
            };
            let mode = meta.permissions().mode() & 0o7777;
            let who = match (mode & 0o040 != 0, mode & 0o004 != 0) {
                (_, true) => Some("everyone"),
                (true, false) => Some("its group"),
                (false, false) => None,
            };
            if let Some(who) = who {
                out.push(format!(
                    "{section}.password_file: {} is readable by {who} (mode {mode:04o}): it holds the \
                     broker password; `chmod 600 {}` (or 640 with only the service's group)",
                    path.display(),
                    path.display()
                ));
            }
        }
        out
    }

    /// The tables a `postgres` sink named `sink` writes: one per pipeline routed to it.
    pub fn sink_tables(&self, sink: &str) -> Vec<crate::sink::postgres::PipelineTable> {
        parse::dbsinks::pipeline_tables(&self.pipelines, sink)
    }

    /// Every sink results can go to, by name: `local`, `uplink` when `[uplink]` is
    /// configured, then the `[[sink]]` tables in order.
    pub fn sink_names(&self) -> Vec<&str> {
        std::iter::once(LOCAL_SINK)
            .chain(self.uplink.as_ref().map(|_| UPLINK_SINK))
            .chain(self.sinks.iter().map(|s| s.name.as_str()))
            .collect()
    }

    /// The sinks pipeline `name` sends its results to (none for a pipeline not configured).
    pub fn routes(&self, pipeline: &str) -> &[String] {
        self.pipelines
            .iter()
            .find(|p| p.name == pipeline)
            .map_or(&[], |p| p.sinks.as_slice())
    }

    pub fn log_dir(&self) -> PathBuf {
        self.storage.data_dir.join("log")
    }
    pub fn store_dir(&self) -> PathBuf {
        self.storage.data_dir.join("store")
    }
    pub fn savepoint_dir(&self) -> PathBuf {
        self.storage.data_dir.join("savepoints")
    }
}
