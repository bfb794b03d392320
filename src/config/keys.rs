//! Every config key, once: its name, default, range or choices, unit, what a SIGHUP does
//! with a change, and why the default is what it is (issue 28).
//!
//! Validation takes each key's default and range from here (`parse.rs`: `int`, `duration`,
//! `size`), the `validate` summary lists every key's value from here
//! ([`super::summary`]), the SIGHUP plan decides from here what applies and what needs a
//! restart ([`super::reload`]), and `docs/configuration.md` is generated from here
//! ([`reference`]; `config::keys::tests::the_reference_doc_is_what_the_table_generates`
//! fails when the committed file differs). Checks between keys (a channel big enough for
//! the batch and the inflight window, retention covering the savepoint interval, a result
//! that fits the store) stay in the validation code, next to their messages.

use std::time::Duration;

use super::units::{format_duration_ms, format_size};
use super::{Config, MqttConfig, MqttSinkConfig, SinkConfig, SinkKind, SinkProtocol, TlsConfig};
use crate::pipeline::field::{Field, Format, TemplatePart};
use crate::pipeline::spec::{AggregateSpec, Emit, PipelineSpec, Start};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const DAY_MS: u64 = 86_400_000;

/// What a SIGHUP does when a key's value changed.
#[derive(Clone, Copy)]
pub enum Reload {
    /// Applied while running: the plan copies the new value into the running config
    /// (with this function), and the agent reads it from there.
    Sighup(fn(&mut Config, &Config)),
    /// Reported; takes effect at the next start.
    Restart,
    /// Part of a pipeline's stored definition: the next start refuses the change unless the
    /// pipeline is reset (`cairn run --reset-pipeline NAME`), since stored state would be
    /// read under another meaning.
    Definition,
}

impl Reload {
    fn text(self) -> &'static str {
        match self {
            Reload::Sighup(_) => "SIGHUP",
            Reload::Restart => "restart",
            Reload::Definition => "restart + reset",
        }
    }
}

/// The default: a value, or what its absence means.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Def {
    Required,
    /// Optional; absent turns the feature off.
    Unset,
    Int(i64),
    /// Milliseconds.
    Ms(u64),
    /// Bytes.
    Bytes(u64),
    Text(&'static str),
    Bool(bool),
    /// Follows from other keys, as described.
    Derived(&'static str),
}

/// What values validation accepts, before checks between keys.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Range {
    Int(i64, i64),
    Ms(u64, u64),
    Bytes(u64, u64),
    Choices(&'static [&'static str]),
    /// Described in words (names, paths, templates).
    Text(&'static str),
}

/// How to read a key's value from a validated config, as TOML text (`None`: not set).
#[derive(Clone, Copy)]
pub enum Get {
    Config(fn(&Config) -> Option<String>),
    Pipeline(fn(&PipelineSpec) -> Option<String>),
    /// A key of every `[[sink]]` table (`None` where that sink's kind has no such key).
    Sink(fn(&SinkConfig) -> Option<String>),
}

/// One config key.
#[derive(Clone, Copy)]
pub struct Key {
    /// Dotted path; `pipeline.*` stands for the key in every `[[pipeline]]` table.
    pub name: &'static str,
    pub default: Def,
    pub range: Range,
    /// What a number counts, or the kind of text.
    pub unit: &'static str,
    pub reload: Reload,
    /// What it bounds and why the default is what it is.
    pub why: &'static str,
    pub get: Get,
}

impl Key {
    /// The default as the config would write it.
    pub fn default_text(&self) -> String {
        match self.default {
            Def::Required => "required".into(),
            Def::Unset => "not set".into(),
            Def::Int(n) => n.to_string(),
            Def::Ms(ms) => q(&format_duration_ms(ms)),
            Def::Bytes(b) => q(&format_size(b)),
            Def::Text(s) => q(s),
            Def::Bool(b) => b.to_string(),
            Def::Derived(how) => how.into(),
        }
    }

    /// The range or choices in words.
    pub fn range_text(&self) -> String {
        match self.range {
            Range::Int(lo, hi) => bounds(&lo.to_string(), &hi.to_string(), false, hi == i64::MAX),
            Range::Ms(lo, hi) => bounds(
                &format_duration_ms(lo),
                &format_duration_ms(hi),
                lo == 0,
                hi == u64::MAX,
            ),
            Range::Bytes(lo, hi) => {
                bounds(&format_size(lo), &format_size(hi), lo == 0, hi == u64::MAX)
            }
            Range::Choices(c) => c.iter().map(|s| q(s)).collect::<Vec<_>>().join(", "),
            Range::Text(t) => t.into(),
        }
    }

    /// The value in `cfg` (the first pipeline's for a pipeline key).
    pub fn value(&self, cfg: &Config) -> Option<String> {
        match self.get {
            Get::Config(f) => f(cfg),
            Get::Pipeline(f) => cfg.pipelines.first().and_then(f),
            Get::Sink(f) => cfg.sinks.first().and_then(f),
        }
    }
}

/// "between LO and HI", or one side alone when the other is open, or "any": for the
/// reference and for validation's problems alike.
pub(crate) fn bounds(lo: &str, hi: &str, open_lo: bool, open_hi: bool) -> String {
    match (open_lo, open_hi) {
        (true, true) => "any".to_string(),
        (false, true) => format!("at least {lo}"),
        (true, false) => format!("at most {hi}"),
        (false, false) => format!("between {lo} and {hi}"),
    }
}

/// The key `path` names: `pipeline[2].window.size` is the row `pipeline.window.size`.
/// Every path validation uses has a row (`every_key_the_parser_accepts_is_in_the_table`).
pub fn row(path: &str) -> &'static Key {
    let mut name = String::with_capacity(path.len());
    let mut skipping = false;
    for c in path.chars() {
        match c {
            '[' => skipping = true,
            ']' => skipping = false,
            c if !skipping => name.push(c),
            _ => {}
        }
    }
    KEYS.iter()
        .find(|k| k.name == name)
        .unwrap_or_else(|| panic!("the config key table has no row `{name}`"))
}

// ---------------------------------------------------------------------------------------
// Values as TOML text.

/// A TOML string.
fn q(s: &str) -> String {
    toml_edit::Value::from(s).to_string()
}

fn dur(d: Duration) -> String {
    q(&format_duration_ms(
        u64::try_from(d.as_millis()).unwrap_or(u64::MAX),
    ))
}

fn ms(ms: u64) -> String {
    q(&format_duration_ms(ms))
}

fn bytes(b: u64) -> String {
    q(&format_size(b))
}

fn path(p: &std::path::Path) -> String {
    q(&p.display().to_string())
}

fn list(items: &[String]) -> String {
    let quoted: Vec<String> = items.iter().map(|s| q(s)).collect();
    format!("[{}]", quoted.join(", "))
}

/// A field as the config writes it (`/a`, `2`, `topic[1]`, `{/a}-{/b}`).
pub(crate) fn field_text(f: &Field) -> String {
    match f {
        Field::Pointer(p) => p.clone(),
        Field::Index(i) => i.to_string(),
        Field::Topic(i) => format!("topic[{i}]"),
        Field::Sparkplug(part) => part.name().to_string(),
        Field::Template(parts) => parts
            .iter()
            .map(|part| match part {
                TemplatePart::Literal(l) => l.clone(),
                TemplatePart::Field(f) => format!("{{{}}}", field_text(f)),
            })
            .collect(),
    }
}

/// `sum` or `["min", "max"]`, as TOML.
fn aggregate(a: &AggregateSpec) -> String {
    match a {
        AggregateSpec::One(a) => q(&a.name()),
        AggregateSpec::List(l) => list(&l.iter().map(|a| a.name()).collect::<Vec<_>>()),
    }
}

/// A sink's MQTT keys, if it is an MQTT sink.
fn mqtt_sink<T>(s: &SinkConfig, f: impl Fn(&MqttSinkConfig) -> T) -> Option<T> {
    match &s.kind {
        SinkKind::Mqtt(m) => Some(f(m)),
        SinkKind::Postgres(_) | SinkKind::JetStream(_) => None,
    }
}

/// A `postgres` sink's keys.
fn pg_sink<T>(
    s: &SinkConfig,
    f: impl Fn(&crate::sink::postgres::PostgresConfig) -> T,
) -> Option<T> {
    match &s.kind {
        SinkKind::Postgres(p) => Some(f(p)),
        _ => None,
    }
}

/// A `jetstream` sink's keys.
fn js_sink<T>(
    s: &SinkConfig,
    f: impl Fn(&crate::sink::jetstream::JetStreamConfig) -> T,
) -> Option<T> {
    match &s.kind {
        SinkKind::JetStream(j) => Some(f(j)),
        _ => None,
    }
}

/// The `tls` of a sink of any kind.
fn sink_tls(s: &SinkConfig) -> Option<&TlsConfig> {
    match &s.kind {
        SinkKind::Mqtt(m) => m.mqtt.tls.as_ref(),
        SinkKind::Postgres(p) => p.tls.as_ref(),
        SinkKind::JetStream(j) => j.tls.as_ref(),
    }
}

fn uplink<T>(c: &Config, f: impl Fn(&MqttConfig) -> T) -> Option<T> {
    c.uplink.as_ref().map(|u| f(&u.mqtt))
}

fn tls_file(
    t: &Option<TlsConfig>,
    f: fn(&TlsConfig) -> Option<&std::path::PathBuf>,
) -> Option<String> {
    t.as_ref().and_then(|t| f(t).map(|p| path(p)))
}

// ---------------------------------------------------------------------------------------
// The table.

/// `[mqtt]` and `[uplink]` share these reasons.
const WHY_KEEP_ALIVE: &str = "MQTT sends it as a 16-bit count of seconds; under 5s a busy fsync can look like a dead connection";
const WHY_RECONNECT_MIN: &str = "backoff against a dead broker (rumqttc has none: without it, a tight loop); shorter hammers a broker that is down";
const WHY_RECONNECT_MAX: &str = "while we are away the broker queues for us, and mosquitto drops silently past max_queued_messages (default 1000): never back off longer";
const WHY_CLIENT_ID: &str = "the broker keeps the persistent session under it: stable and unique per box; 23 characters or fewer work with every MQTT 3.1.1 broker";
const NAME_CHARS: &str = "1 to 64 of A-Z a-z 0-9 _ -";

macro_rules! key {
    ($name:expr, $default:expr, $range:expr, $unit:expr, $reload:expr, $why:expr, $get:expr $(,)?) => {
        Key {
            name: $name,
            default: $default,
            range: $range,
            unit: $unit,
            reload: $reload,
            why: $why,
            get: $get,
        }
    };
}

/// Every key the parser accepts, in the order of DESIGN §3's schema.
pub static KEYS: &[Key] = &[
    // [mqtt]
    key!(
        "mqtt.host",
        Def::Text("127.0.0.1"),
        Range::Text("a host name or IP address"),
        "host",
        Reload::Restart,
        "the local broker the inputs come from",
        Get::Config(|c| Some(q(&c.mqtt.host)))
    ),
    key!(
        "mqtt.port",
        Def::Int(1883),
        Range::Int(1, 65_535),
        "TCP port",
        Reload::Restart,
        "MQTT's port",
        Get::Config(|c| Some(c.mqtt.port.to_string()))
    ),
    key!(
        "mqtt.client_id",
        Def::Required,
        Range::Text(NAME_CHARS),
        "name",
        Reload::Restart,
        WHY_CLIENT_ID,
        Get::Config(|c| Some(q(&c.mqtt.client_id)))
    ),
    key!(
        "mqtt.keep_alive",
        Def::Ms(30_000),
        Range::Ms(5_000, 65_535_000),
        "duration, whole seconds",
        Reload::Restart,
        WHY_KEEP_ALIVE,
        Get::Config(|c| Some(dur(c.mqtt.keep_alive)))
    ),
    key!(
        "mqtt.username",
        Def::Unset,
        Range::Text("a user name"),
        "name",
        Reload::Restart,
        "anonymous when not set",
        Get::Config(|c| c.mqtt.username.as_deref().map(q))
    ),
    key!(
        "mqtt.password_file",
        Def::Unset,
        Range::Text("a file path; needs username"),
        "path",
        Reload::Restart,
        "a file holding the password, so the password is in no config or output",
        Get::Config(|c| c.mqtt.password_file.as_deref().map(path))
    ),
    key!(
        "mqtt.tls.ca_file",
        Def::Unset,
        Range::Text("a file path; required in tls"),
        "path",
        Reload::Restart,
        "TLS needs the CA that signed the broker's certificate; plain TCP when `tls` is not set",
        Get::Config(|c| c.mqtt.tls.as_ref().map(|t| path(&t.ca_file)))
    ),
    key!(
        "mqtt.tls.cert_file",
        Def::Unset,
        Range::Text("a file path; with key_file"),
        "path",
        Reload::Restart,
        "a client certificate, for brokers that authenticate by certificate",
        Get::Config(|c| tls_file(&c.mqtt.tls, |t| t.cert_file.as_ref()))
    ),
    key!(
        "mqtt.tls.key_file",
        Def::Unset,
        Range::Text("a file path; with cert_file"),
        "path",
        Reload::Restart,
        "the client certificate's key",
        Get::Config(|c| tls_file(&c.mqtt.tls, |t| t.key_file.as_ref()))
    ),
    key!(
        "mqtt.ingest_batch",
        Def::Int(20),
        Range::Int(1, 65_535),
        "messages",
        Reload::Restart,
        "mosquitto's default max_inflight_messages: the broker never has more unacknowledged inputs out at once, so a larger batch would only wait for the timer; keep it at or below the broker's",
        Get::Config(|c| Some(c.mqtt.ingest_batch.to_string()))
    ),
    key!(
        "mqtt.reconnect_min",
        Def::Ms(100),
        Range::Ms(10, u64::MAX),
        "duration",
        Reload::Restart,
        WHY_RECONNECT_MIN,
        Get::Config(|c| Some(dur(c.mqtt.reconnect_min)))
    ),
    key!(
        "mqtt.reconnect_max",
        Def::Ms(30_000),
        Range::Ms(0, 600_000),
        "duration",
        Reload::Restart,
        WHY_RECONNECT_MAX,
        Get::Config(|c| Some(dur(c.mqtt.reconnect_max)))
    ),
    key!(
        "mqtt.channel_capacity",
        Def::Int(1024),
        Range::Int(1, 1 << 20),
        "events",
        Reload::Restart,
        "memory we promise to hold; at least 2 × (ingest_batch + outbox.inflight), or the event loop can deadlock (rumqttc #1025)",
        Get::Config(|c| Some(c.mqtt.channel_capacity.to_string()))
    ),
    // [storage]
    key!(
        "storage.data_dir",
        Def::Required,
        Range::Text("a directory"),
        "path",
        Reload::Restart,
        "the replay log and the store live below it; a default could put them on a volatile or shared disk",
        Get::Config(|c| Some(path(&c.storage.data_dir)))
    ),
    key!(
        "storage.cache_size",
        Def::Bytes(4 * MIB),
        Range::Bytes(MIB, GIB),
        "size",
        Reload::Restart,
        "sled's cache_capacity, counted in on-disk bytes; its memory use can be several times this (DESIGN §4); 4 MiB (the default) to 32 MiB suits an edge box, sled's own 1 GiB lets RSS grow to several GiB; what it misses, sled reads through the kernel's page cache, which the kernel gives back under pressure",
        Get::Config(|c| Some(bytes(c.storage.cache_size)))
    ),
    key!(
        "storage.ledger_index_max",
        Def::Bytes(64 * MIB),
        Range::Bytes(MIB, 16 * GIB),
        "size",
        Reload::Restart,
        "the dedup ledger's in-memory index takes about 4.5 bytes per event ID in the window (the default holds ~15 million); beyond it lookups read the ledger, exact but slower; it also sizes the index's directory (one bucket per KiB)",
        Get::Config(|c| Some(bytes(c.storage.ledger_index_max)))
    ),
    // [log]
    key!(
        "log.segment_size",
        Def::Bytes(64 * MIB),
        Range::Bytes(MIB, GIB),
        "size",
        Reload::Restart,
        "offsets inside a segment stay far from the framing's u32 length field",
        Get::Config(|c| Some(bytes(c.log.segment_size)))
    ),
    key!(
        "log.max_size",
        Def::Bytes(2 * GIB),
        Range::Text("at least 2 × segment_size"),
        "size",
        Reload::Sighup(|c, n| c.log.max_size = n.log.max_size),
        "32 segments, a few hours of a busy box; full stops acknowledging (backpressure), never drops",
        Get::Config(|c| Some(bytes(c.log.max_size)))
    ),
    key!(
        "log.retention",
        Def::Ms(DAY_MS),
        Range::Text("at least savepoint.interval"),
        "duration",
        Reload::Sighup(|c, n| c.log.retention = n.log.retention),
        "processed segments are kept this long; the log must reach back to the newest savepoint so state can always be rebuilt",
        Get::Config(|c| Some(dur(c.log.retention)))
    ),
    key!(
        "log.commit_interval",
        Def::Ms(5),
        Range::Ms(0, 1_000),
        "duration",
        Reload::Sighup(|c, n| c.log.commit_interval = n.log.commit_interval),
        "group commit: a few ms of latency buy one fsync for a whole batch; inputs wait unacknowledged this long, and the broker stops sending when its inflight window is full",
        Get::Config(|c| Some(dur(c.log.commit_interval)))
    ),
    key!(
        "log.max_payload",
        Def::Bytes(256 * KIB),
        Range::Bytes(1, u64::MAX),
        "size",
        Reload::Restart,
        "a larger input is kept as a `too_large` stand-in and becomes a dead letter; at most log.segment_size less 64KiB, left for framing",
        Get::Config(|c| Some(bytes(c.log.max_payload)))
    ),
    // [checkpoint]
    key!(
        "checkpoint.interval",
        Def::Ms(5_000),
        Range::Ms(1, 3_600_000),
        "duration",
        Reload::Sighup(|c, n| c.checkpoint.interval = n.checkpoint.interval),
        "bounds replay after a crash; bytes written per event fall from ~2,500 at 50ms to ~340 at 5s, while recovery after a kill stays under half a second (benches/compare/, issue 14)",
        Get::Config(|c| Some(dur(c.checkpoint.interval)))
    ),
    key!(
        "checkpoint.max_records",
        Def::Int(20_000),
        Range::Int(1, 1_000_000),
        "records",
        Reload::Sighup(|c, n| c.checkpoint.max_records = n.checkpoint.max_records),
        "one checkpoint is one sled transaction held in memory (~13k 4-tree transactions/s, DESIGN §4); high enough that the interval decides below ~4,000 events/s; when not set, a smaller outbox.max_entries lowers it; as many results made since the last checkpoint (one per pipeline and record, or per key touched) make one due too: they are held until it, and count against outbox.max_entries; records read back from the log (the replay at start, catch-up, backfill) are bound by it as live ones (issue 33)",
        Get::Config(|c| Some(c.checkpoint.max_records.to_string()))
    ),
    key!(
        "checkpoint.max_keys",
        Def::Int(3_072),
        Range::Int(1, 1_000_000),
        "keys",
        Reload::Sighup(|c, n| c.checkpoint.max_keys = n.checkpoint.max_keys),
        "each key a checkpoint writes holds a copy of a sled leaf until it commits: peak RSS 122 MiB at 20,000 records per checkpoint, 55.7-57.5 MiB bounded at 1,536 keys (issue 16); 3,072 since sketches are stored packed: 16 pipelines over 1,000 keys, six of them percentiles, then span their keys in one checkpoint (12-13x one pipeline's CPU, peak 62.8-63.8 MiB; at 1,536, 31x) while a backlog of 1M inputs over 100k keys peaks at 56.1-56.5 MiB (51.8-60.7 at 1,536) and rests lower (issue 33); counted per stored row (a key's states of every pipeline; one per KiB of its states, at most one per state: 16 light pipelines over a key count once, as one does, issue 33), and held by records read back from the log (the replay at start, catch-up, backfill) as by live ones",
        Get::Config(|c| Some(c.checkpoint.max_keys.to_string()))
    ),
    // [outbox]
    key!(
        "outbox.max_entries",
        Def::Int(100_000),
        Range::Int(1, i64::MAX),
        "results",
        Reload::Sighup(|c, n| c.outbox.max_entries = n.outbox.max_entries),
        "hours of output while the broker is away; at the bound processing waits (input is still logged and acknowledged); at least checkpoint.max_records, since one checkpoint can add a result per record; with upsert pipelines the replay at start may pass it by up to 2 × checkpoint.max_records + 4096 records' results (the send horizon, docs/guarantees.md)",
        Get::Config(|c| Some(c.outbox.max_entries.to_string()))
    ),
    key!(
        "outbox.max_size",
        Def::Bytes(GIB),
        Range::Bytes(MIB, u64::MAX),
        "size",
        Reload::Sighup(|c, n| c.outbox.max_size = n.outbox.max_size),
        "the uplink's store-and-forward queue: 1 GiB holds about 5 million results of ~200 bytes, half the log's default; one checkpoint's results must fit",
        Get::Config(|c| Some(bytes(c.outbox.max_size)))
    ),
    key!(
        "outbox.inflight",
        Def::Int(100),
        Range::Int(1, 65_535),
        "publishes",
        Reload::Restart,
        "unacknowledged outgoing publishes at once; MQTT packet IDs are 16-bit",
        Get::Config(|c| Some(c.outbox.inflight.to_string()))
    ),
    key!(
        "outbox.drain_timeout",
        Def::Ms(5_000),
        Range::Ms(0, 60_000),
        "duration",
        Reload::Sighup(|c, n| c.outbox.drain_timeout = n.outbox.drain_timeout),
        "how long a stop may keep publishing; systemd kills after TimeoutStopSec (90s by default)",
        Get::Config(|c| Some(dur(c.outbox.drain_timeout)))
    ),
    // [metrics]
    key!(
        "metrics.listen",
        Def::Unset,
        Range::Text("a loopback IP:port, e.g. \"127.0.0.1:9108\""),
        "address",
        Reload::Restart,
        "Prometheus text and status JSON, served without authentication, so loopback only; off when not set",
        Get::Config(|c| c.metrics.listen.as_deref().map(q))
    ),
    // [savepoint]
    key!(
        "savepoint.interval",
        Def::Unset,
        Range::Ms(1_000, u64::MAX),
        "duration",
        Reload::Sighup(|c, n| c.savepoint.interval = n.savepoint.interval),
        "each savepoint copies the whole state; off when not set",
        Get::Config(|c| c.savepoint.interval.map(dur))
    ),
    key!(
        "savepoint.keep",
        Def::Int(3),
        Range::Int(1, 1_000),
        "savepoints",
        Reload::Sighup(|c, n| c.savepoint.keep = n.savepoint.keep),
        "the newest savepoints kept",
        Get::Config(|c| Some(c.savepoint.keep.to_string()))
    ),
    // [logging]
    key!(
        "logging.level",
        Def::Text("info"),
        Range::Choices(&["off", "error", "warn", "info", "debug", "trace"]),
        "level",
        Reload::Sighup(|c, n| c.logging.level = n.logging.level),
        "RUST_LOG, when set, overrides it",
        Get::Config(|c| Some(q(&c.logging.level.to_string().to_lowercase())))
    ),
    // [dead_letters]
    key!(
        "dead_letters.max_entries",
        Def::Int(100_000),
        Range::Int(1, 100_000_000),
        "letters",
        Reload::Restart,
        "the oldest dead letters are dropped (and counted) beyond it; the store takes the bound when it opens",
        Get::Config(|c| Some(c.dead_letters.max_entries.to_string()))
    ),
    key!(
        "dead_letters.max_age",
        Def::Ms(30 * DAY_MS),
        Range::Ms(60_000, u64::MAX),
        "duration",
        Reload::Restart,
        "dead letters are kept for a person to read, measured on record time like the dedup window; the store takes the bound when it opens",
        Get::Config(|c| Some(dur(c.dead_letters.max_age)))
    ),
    // [uplink]
    key!(
        "uplink.host",
        Def::Text("127.0.0.1"),
        Range::Text("a host name or IP address"),
        "host",
        Reload::Restart,
        "the central broker results go to instead of [mqtt]'s; no uplink when the table is absent",
        Get::Config(|c| uplink(c, |m| q(&m.host)))
    ),
    key!(
        "uplink.port",
        Def::Int(1883),
        Range::Int(1, 65_535),
        "TCP port",
        Reload::Restart,
        "MQTT's port",
        Get::Config(|c| uplink(c, |m| m.port.to_string()))
    ),
    key!(
        "uplink.client_id",
        Def::Required,
        Range::Text(NAME_CHARS),
        "name",
        Reload::Restart,
        "its own session, not mqtt.client_id on the same broker (the two connections would disconnect each other)",
        Get::Config(|c| uplink(c, |m| q(&m.client_id)))
    ),
    key!(
        "uplink.keep_alive",
        Def::Ms(30_000),
        Range::Ms(5_000, 65_535_000),
        "duration, whole seconds",
        Reload::Restart,
        WHY_KEEP_ALIVE,
        Get::Config(|c| uplink(c, |m| dur(m.keep_alive)))
    ),
    key!(
        "uplink.username",
        Def::Unset,
        Range::Text("a user name"),
        "name",
        Reload::Restart,
        "anonymous when not set",
        Get::Config(|c| uplink(c, |m| m.username.as_deref().map(q)).flatten())
    ),
    key!(
        "uplink.password_file",
        Def::Unset,
        Range::Text("a file path; needs username"),
        "path",
        Reload::Restart,
        "a file holding the password",
        Get::Config(|c| uplink(c, |m| m.password_file.as_deref().map(path)).flatten())
    ),
    key!(
        "uplink.tls.ca_file",
        Def::Unset,
        Range::Text("a file path; required in tls"),
        "path",
        Reload::Restart,
        "TLS needs the CA that signed the broker's certificate; plain TCP when `tls` is not set",
        Get::Config(|c| uplink(c, |m| m.tls.as_ref().map(|t| path(&t.ca_file))).flatten())
    ),
    key!(
        "uplink.tls.cert_file",
        Def::Unset,
        Range::Text("a file path; with key_file"),
        "path",
        Reload::Restart,
        "a client certificate",
        Get::Config(|c| uplink(c, |m| tls_file(&m.tls, |t| t.cert_file.as_ref())).flatten())
    ),
    key!(
        "uplink.tls.key_file",
        Def::Unset,
        Range::Text("a file path; with cert_file"),
        "path",
        Reload::Restart,
        "the client certificate's key",
        Get::Config(|c| uplink(c, |m| tls_file(&m.tls, |t| t.key_file.as_ref())).flatten())
    ),
    key!(
        "uplink.topic_prefix",
        Def::Text(""),
        Range::Text(
            "at most 1024 bytes; no + # or code point a receiver may refuse; not starting with $"
        ),
        "topic text",
        Reload::Restart,
        "prepended to every result topic; result topics leave room for it under MQTT's 65,535",
        Get::Config(|c| c.uplink.as_ref().map(|u| q(&u.topic_prefix)))
    ),
    key!(
        "uplink.reconnect_min",
        Def::Ms(100),
        Range::Ms(10, u64::MAX),
        "duration",
        Reload::Restart,
        WHY_RECONNECT_MIN,
        Get::Config(|c| uplink(c, |m| dur(m.reconnect_min)))
    ),
    key!(
        "uplink.reconnect_max",
        Def::Ms(30_000),
        Range::Ms(0, 600_000),
        "duration",
        Reload::Restart,
        WHY_RECONNECT_MAX,
        Get::Config(|c| uplink(c, |m| dur(m.reconnect_max)))
    ),
    // [[sink]]: `sink.*` stands for the key in every `[[sink]]` table.
    key!(
        "sink.name",
        Def::Required,
        Range::Text("1 to 64 of A-Z a-z 0-9 _ -; not `local` or `uplink`"),
        "name",
        Reload::Restart,
        "what a pipeline's `sinks` names; `local` is [mqtt]'s broker and `uplink` is [uplink]",
        Get::Sink(|s| Some(q(&s.name)))
    ),
    key!(
        "sink.kind",
        Def::Required,
        Range::Choices(&["mqtt", "postgres", "jetstream"]),
        "kind",
        Reload::Restart,
        "what the destination is; each kind has its own keys below",
        Get::Sink(|s| Some(q(s.kind.name())))
    ),
    key!(
        "sink.protocol",
        Def::Text("5"),
        Range::Choices(&["5", "3.1.1"]),
        "MQTT version",
        Reload::Restart,
        "MQTT 5's PUBACK can refuse (an ACL says 0x87 not authorized) and Cairn keeps the result; under 3.1.1 a broker that refuses acknowledges and drops it, and Cairn cannot tell",
        Get::Sink(|c| mqtt_sink(c, |m| q(match m.protocol {
            SinkProtocol::V5 => "5",
            SinkProtocol::V311 => "3.1.1",
        })))
    ),
    key!(
        "sink.host",
        Def::Text("127.0.0.1"),
        Range::Text("a host name or IP address"),
        "host",
        Reload::Restart,
        "the broker this sink publishes results to (kind mqtt)",
        Get::Sink(|c| mqtt_sink(c, |m| q(&m.mqtt.host)))
    ),
    key!(
        "sink.port",
        Def::Int(1883),
        Range::Int(1, 65_535),
        "TCP port",
        Reload::Restart,
        "MQTT's port",
        Get::Sink(|c| mqtt_sink(c, |m| m.mqtt.port.to_string()))
    ),
    key!(
        "sink.client_id",
        Def::Required,
        Range::Text(NAME_CHARS),
        "name",
        Reload::Restart,
        "its own session: not the client_id of another connection to the same broker (they would disconnect each other)",
        Get::Sink(|c| mqtt_sink(c, |m| q(&m.mqtt.client_id)))
    ),
    key!(
        "sink.keep_alive",
        Def::Ms(30_000),
        Range::Ms(5_000, 65_535_000),
        "duration, whole seconds",
        Reload::Restart,
        WHY_KEEP_ALIVE,
        Get::Sink(|c| mqtt_sink(c, |m| dur(m.mqtt.keep_alive)))
    ),
    key!(
        "sink.username",
        Def::Unset,
        Range::Text("a user name"),
        "name",
        Reload::Restart,
        "anonymous when not set (kinds mqtt and jetstream)",
        Get::Sink(|c| {
            mqtt_sink(c, |m| m.mqtt.username.as_deref().map(q))
                .or_else(|| js_sink(c, |j| j.username.as_deref().map(q)))
                .flatten()
        })
    ),
    key!(
        "sink.password_file",
        Def::Unset,
        Range::Text("a file path; needs username"),
        "path",
        Reload::Restart,
        "a file holding the password (kinds mqtt, jetstream and postgres)",
        Get::Sink(|c| {
            mqtt_sink(c, |m| m.mqtt.password_file.as_deref().map(path))
                .or_else(|| js_sink(c, |j| j.password_file.as_deref().map(path)))
                .or_else(|| pg_sink(c, |p| p.password_file.as_deref().map(path)))
                .flatten()
        })
    ),
    key!(
        "sink.tls.ca_file",
        Def::Unset,
        Range::Text("a file path; required in tls"),
        "path",
        Reload::Restart,
        "TLS needs the CA that signed the broker's certificate; plain TCP when `tls` is not set",
        Get::Sink(|c| sink_tls(c).map(|t| path(&t.ca_file)))
    ),
    key!(
        "sink.tls.cert_file",
        Def::Unset,
        Range::Text("a file path; with key_file"),
        "path",
        Reload::Restart,
        "a client certificate",
        Get::Sink(|c| tls_file(&sink_tls(c).cloned(), |t| t.cert_file.as_ref()))
    ),
    key!(
        "sink.tls.key_file",
        Def::Unset,
        Range::Text("a file path; with cert_file"),
        "path",
        Reload::Restart,
        "the client certificate's key",
        Get::Sink(|c| tls_file(&sink_tls(c).cloned(), |t| t.key_file.as_ref()))
    ),
    key!(
        "sink.topic_prefix",
        Def::Text(""),
        Range::Text(
            "at most 1024 bytes; no + # or code point a receiver may refuse; not starting with $"
        ),
        "topic text",
        Reload::Restart,
        "prepended to every result topic this sink publishes",
        Get::Sink(|c| mqtt_sink(c, |m| q(&m.topic_prefix)))
    ),
    key!(
        "sink.reconnect_min",
        Def::Ms(100),
        Range::Ms(10, u64::MAX),
        "duration",
        Reload::Restart,
        WHY_RECONNECT_MIN,
        Get::Sink(|c| mqtt_sink(c, |m| dur(m.mqtt.reconnect_min)))
    ),
    key!(
        "sink.reconnect_max",
        Def::Ms(30_000),
        Range::Ms(0, 600_000),
        "duration",
        Reload::Restart,
        WHY_RECONNECT_MAX,
        Get::Sink(|c| mqtt_sink(c, |m| dur(m.mqtt.reconnect_max)))
    ),
    key!(
        "sink.url",
        Def::Derived("required (kind postgres)"),
        Range::Text("a PostgreSQL URL, postgresql://user@host:port/database"),
        "URL",
        Reload::Restart,
        "the database results go to (kind postgres); its password in password_file, not here",
        Get::Sink(|c| pg_sink(c, |p| q(&p.url)))
    ),
    key!(
        "sink.source",
        Def::Derived("required (kinds postgres, jetstream)"),
        Range::Text("1 to 64 of A-Z a-z 0-9 _ - ."),
        "name",
        Reload::Restart,
        "this box's identity (kinds postgres and jetstream): a column of every row, the start of every Nats-Msg-Id; unique per box, or two boxes' results meet",
        Get::Sink(|c| pg_sink(c, |p| q(&p.source)).or_else(|| js_sink(c, |j| q(&j.source))))
    ),
    key!(
        "sink.table_prefix",
        Def::Text("cairn_"),
        Range::Text("A-Z a-z 0-9 _; with each pipeline name at most 63 bytes"),
        "table name text",
        Reload::Restart,
        "one table per pipeline, <table_prefix><pipeline>, and <table_prefix>progress (kind postgres); PostgreSQL cuts names at 63 bytes",
        Get::Sink(|c| pg_sink(c, |p| q(&p.table_prefix)))
    ),
    key!(
        "sink.servers",
        Def::Derived("required (kind jetstream)"),
        Range::Text("NATS URLs, nats://host:port"),
        "list",
        Reload::Restart,
        "the NATS servers to try (kind jetstream); the client also learns the cluster's others",
        Get::Sink(|c| js_sink(c, |j| list(&j.servers)))
    ),
    key!(
        "sink.credentials_file",
        Def::Unset,
        Range::Text("a file path; not with username or token_file"),
        "path",
        Reload::Restart,
        "a NATS .creds file (JWT and NKey seed), kind jetstream",
        Get::Sink(|c| js_sink(c, |j| j.credentials_file.as_deref().map(path)).flatten())
    ),
    key!(
        "sink.token_file",
        Def::Unset,
        Range::Text("a file path; not with username or credentials_file"),
        "path",
        Reload::Restart,
        "a file holding the NATS token, kind jetstream",
        Get::Sink(|c| js_sink(c, |j| j.token_file.as_deref().map(path)).flatten())
    ),
    key!(
        "sink.stream",
        Def::Derived("required (kind jetstream)"),
        Range::Text("a stream name: no . * > / \\ or white space"),
        "name",
        Reload::Restart,
        "the JetStream stream results go to (kind jetstream); it must exist, with a subject covering <subject_prefix>.>; its duplicate window bounds the outage a re-send is dropped after",
        Get::Sink(|c| js_sink(c, |j| q(&j.stream)))
    ),
    key!(
        "sink.subject_prefix",
        Def::Text(""),
        Range::Text("subject tokens separated by `.`: none empty, no * > or white space"),
        "subject text",
        Reload::Restart,
        "before every result's subject (kind jetstream): the topic's levels follow as tokens, escaped one to one",
        Get::Sink(|c| js_sink(c, |j| q(&j.subject_prefix)))
    ),
    // [sparkplug]
    key!(
        "sparkplug.host_id",
        Def::Unset,
        Range::Text(
            "1 to 256 bytes, one topic level: no + / # or code point a receiver may refuse"
        ),
        "name",
        Reload::Restart,
        "act as the Sparkplug Primary Host of this ID: publish spBv1.0/STATE/<host_id> (online once the log is ready; offline as the will and before a clean stop), so edge nodes that name it buffer while Cairn is down",
        Get::Config(|c| c.sparkplug.host_id.as_ref().map(|h| q(h)))
    ),
    key!(
        "sparkplug.rebirth",
        Def::Bool(false),
        Range::Choices(&["true", "false"]),
        "flag",
        Reload::Restart,
        "answer a seq gap, an unknown metric or DATA without a session with an NCMD Node Control/Rebirth (at most one per node every 10s); off by default, since it writes to the plant",
        Get::Config(|c| Some(c.sparkplug.rebirth.to_string()))
    ),
    // [[pipeline]]
    key!(
        "pipeline.name",
        Def::Required,
        Range::Text(NAME_CHARS),
        "name",
        Reload::Restart,
        "output IDs and state are keyed by it",
        Get::Pipeline(|p| Some(q(&p.name)))
    ),
    key!(
        "pipeline.topics",
        Def::Required,
        Range::Text("MQTT topic filters, at least one"),
        "filters",
        Reload::Restart,
        "the inputs this pipeline consumes",
        Get::Pipeline(|p| Some(list(&p.topics)))
    ),
    key!(
        "pipeline.sinks",
        Def::Derived("[\"uplink\"] with [uplink], else [\"local\"]"),
        Range::Text("sink names, at least one, none twice: `local`, `uplink`, or a [[sink]] name"),
        "names",
        Reload::Restart,
        "where its results go; each sink gets every result from its place in the outbox on (a sink added later: the results from then on), in order, and settles it on its own",
        Get::Pipeline(|p| Some(list(&p.sinks)))
    ),
    key!(
        "pipeline.format",
        Def::Text("json"),
        Range::Choices(&["json", "delimited", "sparkplug_b"]),
        "format",
        Reload::Definition,
        "JSON payloads read by JSON pointer; delimited text by position; Sparkplug B protobuf, each metric value an event",
        Get::Pipeline(|p| Some(q(match p.format {
            Format::Json => "json",
            Format::Delimited { .. } => "delimited",
            Format::SparkplugB => "sparkplug_b",
        })))
    ),
    key!(
        "pipeline.separator",
        Def::Derived("\"/\" with format = \"delimited\""),
        Range::Text("non-empty text; delimited only"),
        "text",
        Reload::Definition,
        "the text between fields, as in E2/A/35000",
        Get::Pipeline(|p| match &p.format {
            Format::Delimited { separator } => Some(q(separator)),
            Format::Json | Format::SparkplugB => None,
        })
    ),
    key!(
        "pipeline.event_id",
        Def::Required,
        Range::Text("a field or a template such as \"{/device}-{/seq}\""),
        "field",
        Reload::Definition,
        "events are deduplicated by it (broker redeliveries and repeated publishes)",
        // Sparkplug B builds it from each metric's identity (`pipeline::sparkplug`).
        Get::Pipeline(|p| (p.format != Format::SparkplugB).then(|| q(&field_text(&p.event_id))))
    ),
    key!(
        "pipeline.key",
        Def::Required,
        Range::Text("a field or a template"),
        "field",
        Reload::Definition,
        "names the aggregate; it becomes a topic level and part of each output ID",
        Get::Pipeline(|p| Some(q(&field_text(&p.key))))
    ),
    key!(
        "pipeline.value",
        Def::Derived("required unless aggregate = \"count\""),
        Range::Text("a field"),
        "field",
        Reload::Definition,
        "the number aggregated; count reads none",
        Get::Pipeline(|p| p.value.as_ref().map(|f| q(&field_text(f))))
    ),
    key!(
        "pipeline.event_time",
        Def::Unset,
        Range::Text("a field: ms since the epoch or RFC 3339"),
        "field",
        Reload::Definition,
        "the time of receipt is the event time when not set",
        Get::Pipeline(|p| p.event_time.as_ref().map(|f| q(&field_text(f))))
    ),
    key!(
        "pipeline.aggregate",
        Def::Required,
        Range::Text(
            "sum, count, min, max, avg, last, stddev, variance, twa (sparkplug_b), pNN; or a list of 1 to 32"
        ),
        "aggregate",
        Reload::Definition,
        "a list gives one result with `values`, one per name",
        Get::Pipeline(|p| Some(aggregate(&p.aggregate)))
    ),
    key!(
        "pipeline.where",
        Def::Unset,
        Range::Text("a filter of at most 4096 bytes and 64 levels of not and parentheses"),
        "filter",
        Reload::Restart,
        "only matching inputs are aggregated; all inputs when not set",
        Get::Pipeline(|p| p.filter.as_ref().map(|e| q(&e.to_string())))
    ),
    key!(
        "pipeline.window.size",
        Def::Unset,
        Range::Ms(1, u64::MAX),
        "duration",
        Reload::Definition,
        "an event-time window; unwindowed when `window` is not set",
        Get::Pipeline(|p| p.window.map(|w| ms(w.size_ms)))
    ),
    key!(
        "pipeline.window.slide",
        Def::Derived("the window size (tumbling)"),
        Range::Text("more than 0s, at most size, at most 100 windows per event"),
        "duration",
        Reload::Definition,
        "hopping windows when shorter than size; each window an event lands in is a state write",
        Get::Pipeline(|p| p.window.map(|w| ms(w.slide())))
    ),
    key!(
        "pipeline.window.allowed_lateness",
        Def::Ms(0),
        Range::Ms(0, u64::MAX),
        "duration",
        Reload::Definition,
        "a window closes once the watermark passes its end by this much",
        Get::Pipeline(|p| p.window.map(|w| ms(w.allowed_lateness_ms)))
    ),
    key!(
        "pipeline.dedup_window",
        Def::Ms(7 * DAY_MS),
        Range::Ms(60_000, 366 * DAY_MS),
        "duration",
        Reload::Restart,
        "business duplicates can come days later (a device that re-sends its backlog after a week offline), broker redeliveries minutes later; the window is held in the store",
        Get::Pipeline(|p| Some(ms(p.dedup_window_ms)))
    ),
    key!(
        "pipeline.output_topic",
        Def::Required,
        Range::Text("a topic with {key} (and {window_start} when windowed)"),
        "template",
        Reload::Restart,
        "each key needs its own topic, or retained results overwrite each other",
        Get::Pipeline(|p| Some(q(&p.output_topic)))
    ),
    key!(
        "pipeline.retain",
        Def::Bool(true),
        Range::Choices(&["true", "false"]),
        "flag",
        Reload::Restart,
        "retained results give the latest value to any late subscriber",
        Get::Pipeline(|p| Some(p.retain.to_string()))
    ),
    key!(
        "pipeline.emit",
        Def::Text("upsert"),
        Range::Choices(&["upsert", "changelog", "final"]),
        "mode",
        Reload::Restart,
        "upsert: the latest version per key at each flush; changelog: one per event; final: one per window when it closes",
        Get::Pipeline(|p| Some(q(match p.emit {
            Emit::Upsert => "upsert",
            Emit::Changelog => "changelog",
            Emit::Final => "final",
        })))
    ),
    key!(
        "pipeline.start",
        Def::Text("latest"),
        Range::Choices(&["latest", "earliest"]),
        "position",
        Reload::Restart,
        "where a pipeline new to the store starts: live records only, or a backfill of the retained log",
        Get::Pipeline(|p| Some(q(match p.start {
            Start::Latest => "latest",
            Start::Earliest => "earliest",
        })))
    ),
    key!(
        "pipeline.max_key_len",
        Def::Int(128),
        Range::Int(1, 1_024),
        "bytes",
        Reload::Restart,
        "keys are part of topics, output IDs and store keys; every result must fit one stored entry (7 KiB) for the worst key, which validation checks with output_topic",
        Get::Pipeline(|p| Some(p.max_key_len.to_string()))
    ),
    key!(
        "pipeline.max_keys",
        Def::Int(1_000_000),
        Range::Int(1, i64::MAX),
        "keys",
        Reload::Restart,
        "state per key is small; a million keys is tens of MB in sled",
        Get::Pipeline(|p| Some(p.max_keys.to_string()))
    ),
    key!(
        "pipeline.max_id_len",
        Def::Int(256),
        Range::Int(1, 1_024),
        "bytes",
        Reload::Restart,
        "event IDs live in the dedup ledger; the bound keeps its values far below sled's blob threshold (a 200 KB ID once made an unfsynced blob file)",
        Get::Pipeline(|p| Some(p.max_id_len.to_string()))
    ),
    key!(
        "pipeline.metrics",
        Def::Unset,
        Range::Text("1 to 1000 metric names; sparkplug_b only"),
        "names",
        Reload::Restart,
        "only these metrics are aggregated; every metric when not set (then a value that is not a number is a dead letter)",
        Get::Pipeline(|p| p.metrics.as_ref().map(|m| list(m)))
    ),
    key!(
        "pipeline.max_future",
        Def::Ms(600_000),
        Range::Ms(0, 366 * DAY_MS),
        "duration",
        Reload::Restart,
        "device clocks drift by seconds to minutes; an event further ahead is a broken clock, and accepting it would close every window up to it",
        Get::Pipeline(|p| Some(ms(p.max_future_ms)))
    ),
];

// ---------------------------------------------------------------------------------------
// The reference.

/// `docs/configuration.md`: every key of the table, section by section.
pub fn reference() -> String {
    let mut out = String::from(
        "# Configuration reference\n\n\
         Generated from the table of config keys in `src/config/keys.rs` (the test \
         `config::keys::tests::the_reference_doc_is_what_the_table_generates` fails when this \
         file differs; `CAIRN_WRITE_DOCS=1` on that test writes it). Durations and sizes are \
         strings with a unit (`\"250ms\"`, `\"7d\"`, `\"512MiB\"`); an unknown key is an \
         error naming the key and its line.\n\n\
         Reload: **SIGHUP** means `systemctl reload cairn` applies a change while running; \
         **restart** means it takes effect at the next start (a SIGHUP names it); **restart + \
         reset** means the key is part of a pipeline's stored definition: a start refuses the \
         change until the pipeline is reset (`cairn run --reset-pipeline NAME`).\n",
    );
    let mut section = "";
    for k in KEYS {
        let s = section_of(k.name);
        if s != section {
            section = s;
            let header = if s == "pipeline" {
                "[[pipeline]]".to_string()
            } else {
                format!("[{s}]")
            };
            out.push_str(&format!(
                "\n## `{header}`\n\n| key | default | range or choices | unit | reload | why |\n\
                 |---|---|---|---|---|---|\n"
            ));
        }
        let cell = |s: &str| s.replace('|', "\\|");
        out.push_str(&format!(
            "| `{}` | {} | {} | {} | {} | {} |\n",
            &k.name[section.len() + 1..],
            cell(&code(&k.default_text(), k.default)),
            cell(&k.range_text()),
            k.unit,
            k.reload.text(),
            cell(k.why)
        ));
    }
    out
}

/// A default in code style when it is a value.
fn code(text: &str, def: Def) -> String {
    match def {
        Def::Required | Def::Unset | Def::Derived(_) => text.to_string(),
        _ => format!("`{text}`"),
    }
}

/// `mqtt` of `mqtt.tls.ca_file`.
pub(crate) fn section_of(name: &str) -> &str {
    name.split('.').next().unwrap_or(name)
}

#[cfg(test)]
#[path = "keys_tests.rs"]
mod tests;
