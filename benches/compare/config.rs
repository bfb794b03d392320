//! The agent's `cairn.toml` for the comparison, as a `toml_edit` document: the tests' builder
//! (`support::agent::AgentConfig`) gives the broker, the session and the data directory, and
//! the bench sets each of its own settings by table and key, so a change is one typed
//! assignment, never an edit of TOML text.

use std::path::Path;

use toml_edit::{Array, ArrayOfTables, DocumentMut, Item, Table, Value, value};

use crate::support::agent::AgentConfig;

pub(crate) struct Config {
    doc: DocumentMut,
}

/// A setting's value: text (durations, sizes, names) or a number.
pub(crate) enum Setting<'a> {
    Text(&'a str),
    Int(u64),
}

impl From<Setting<'_>> for Value {
    fn from(s: Setting<'_>) -> Value {
        match s {
            Setting::Text(t) => t.into(),
            Setting::Int(n) => i64::try_from(n)
                .expect("a bench setting fits TOML's integers")
                .into(),
        }
    }
}

impl<'a> From<&'a str> for Setting<'a> {
    fn from(t: &'a str) -> Self {
        Setting::Text(t)
    }
}

impl From<u64> for Setting<'_> {
    fn from(n: u64) -> Self {
        Setting::Int(n)
    }
}

impl Config {
    /// The bench's agent: `base` rendered for `dir` (the agent's directory), then the
    /// settings every run of the comparison shares, and one changelog or upsert `sum`
    /// pipeline over `cairn/in/#` (one result per input in changelog mode).
    pub(crate) fn new(
        base: &AgentConfig,
        dir: &Path,
        emit: &str,
        max_records: u64,
        metrics_port: u16,
    ) -> Config {
        let mut doc: DocumentMut = base
            .render(dir)
            .parse()
            .expect("the tests' config builder writes valid TOML");
        // The tests reconnect fast; the bench keeps the agent's own backoff.
        for key in ["reconnect_min", "reconnect_max"] {
            doc["mqtt"]
                .as_table_mut()
                .expect("an [mqtt] table")
                .remove(key);
        }
        let mut c = Config { doc };
        c.set("mqtt", "keep_alive", Setting::Text("10s"));
        // Cairn acknowledges after the fsync, so the broker's inflight window is its batch.
        c.set(
            "mqtt",
            "ingest_batch",
            Setting::Int(crate::mqtt::broker_inflight()),
        );
        // The shipped config's cache (its default in the key table); CAIRN_COMPARE_CACHE to
        // try another.
        let cache = std::env::var("CAIRN_COMPARE_CACHE")
            .unwrap_or_else(|_| format!("{}KiB", shipped_cache_size() / 1024));
        c.set("storage", "cache_size", Setting::Text(&cache));
        for (key, v) in [
            ("segment_size", "64MiB"),
            ("max_size", "4GiB"),
            ("retention", "1h"),
            ("commit_interval", "5ms"),
            ("max_payload", "64KiB"),
        ] {
            c.set("log", key, Setting::Text(v));
        }
        c.set("checkpoint", "interval", Setting::Text("50ms"));
        c.set("checkpoint", "max_records", Setting::Int(max_records));
        // Results allowed to wait before ingest holds back; CAIRN_COMPARE_OUTBOX_MAX to bound
        // the memory they take (issue 16).
        let outbox_max = std::env::var("CAIRN_COMPARE_OUTBOX_MAX")
            .ok()
            .map(|v| v.parse().expect("CAIRN_COMPARE_OUTBOX_MAX is a number"))
            .unwrap_or(2_000_000);
        c.set("outbox", "max_entries", Setting::Int(outbox_max));
        c.set("outbox", "inflight", Setting::Int(100));
        c.set("outbox", "drain_timeout", Setting::Text("2s"));
        let listen = format!("127.0.0.1:{metrics_port}");
        c.set("metrics", "listen", Setting::Text(&listen));

        c.pipeline(emit);
        c
    }

    /// The agent at the shipped settings (issue 33): `base` rendered with every table the
    /// tests' builder fills emptied, so that only `client_id`, `data_dir`, the broker's port,
    /// the metrics listener and the pipeline are set; every other key keeps the default that
    /// `config/cairn.toml` documents.
    pub(crate) fn shipped(base: &AgentConfig, dir: &Path, emit: &str, metrics_port: u16) -> Config {
        let mut base = base.clone();
        for table in [
            &mut base.mqtt,
            &mut base.storage,
            &mut base.log,
            &mut base.checkpoint,
            &mut base.outbox,
        ] {
            table.clear();
        }
        let doc: DocumentMut = base
            .render(dir)
            .parse()
            .expect("the tests' config builder writes valid TOML");
        let mut c = Config { doc };
        let listen = format!("127.0.0.1:{metrics_port}");
        c.set("metrics", "listen", Setting::Text(&listen));
        // To try another `storage.cache_size` than the shipped one (CAIRN_COMPARE_CACHE, as
        // for the comparison's agents above).
        if let Ok(cache) = std::env::var("CAIRN_COMPARE_CACHE") {
            c.set("storage", "cache_size", Setting::Text(&cache));
        }
        // To try another `outbox.inflight` than the shipped 100 (CAIRN_TARGETS_INFLIGHT),
        // with the channel the config check asks for it (2 × (ingest_batch 20 + inflight)).
        if let Ok(v) = std::env::var("CAIRN_TARGETS_INFLIGHT") {
            let inflight: u64 = v.parse().expect("CAIRN_TARGETS_INFLIGHT is a number");
            c.set("outbox", "inflight", Setting::Int(inflight));
            let channel = (2 * (20 + inflight)).max(1024);
            c.set("mqtt", "channel_capacity", Setting::Int(channel));
        }
        // Any other setting, to see what it does to the targets: CAIRN_TARGETS_SET holds
        // `table.key = value` lines (TOML values; `\n` between lines), e.g.
        // `checkpoint.interval = "1h"\ncheckpoint.max_records = 1000000\n
        // outbox.max_entries = 1000000`: checkpoints out of the latency runs' way.
        if let Ok(lines) = std::env::var("CAIRN_TARGETS_SET") {
            for line in lines
                .replace("\\n", "\n")
                .lines()
                .filter(|l| !l.trim().is_empty())
            {
                let (path, v) = line
                    .split_once('=')
                    .expect("CAIRN_TARGETS_SET: `table.key = value` lines");
                let (table, key) = path
                    .trim()
                    .split_once('.')
                    .expect("CAIRN_TARGETS_SET: a key is `table.key`");
                let v: Value = v.trim().parse().expect("CAIRN_TARGETS_SET: a TOML value");
                c.set_value(table, key, v);
            }
        }
        c.pipeline(emit);
        c
    }

    /// The bench's one pipeline: a `sum` over `cairn/in/#` keyed by `/k`, results on
    /// `cairn/out/<key>` (one per input in changelog mode), not retained.
    fn pipeline(&mut self, emit: &str) {
        let mut p = Table::new();
        let topics: Array = ["cairn/in/#"].into_iter().collect();
        p["name"] = value("sums");
        p["topics"] = value(topics);
        for (key, v) in [
            ("format", "json"),
            ("event_id", "/id"),
            ("key", "/k"),
            ("value", "/v"),
            ("aggregate", "sum"),
            ("dedup_window", "7d"),
            ("output_topic", "cairn/out/{key}"),
        ] {
            p[key] = value(v);
        }
        p["retain"] = value(false);
        p["emit"] = value(emit);
        p["max_keys"] = value(1_000_000i64);
        let mut pipelines = ArrayOfTables::new();
        pipelines.push(p);
        self.doc["pipeline"] = Item::ArrayOfTables(pipelines);
    }

    /// Sets `[table] key = v`, making the table if it is not there.
    pub(crate) fn set<'a>(&mut self, table: &str, key: &str, v: impl Into<Setting<'a>>) {
        self.set_value(table, key, v.into().into());
    }

    /// [`Config::set`] for a TOML value of any type.
    fn set_value(&mut self, table: &str, key: &str, v: Value) {
        let t = self
            .doc
            .entry(table)
            .or_insert_with(toml_edit::table)
            .as_table_mut()
            .unwrap_or_else(|| panic!("`{table}` is a table"));
        t[key] = Item::Value(v);
    }

    pub(crate) fn text(&self) -> String {
        self.doc.to_string()
    }
}

/// `storage.cache_size` as shipped: the default in the config's key table, so that the
/// comparison's agents follow it when it changes.
pub(crate) fn shipped_cache_size() -> u64 {
    match cairn::config::keys::row("storage.cache_size").default {
        cairn::config::keys::Def::Bytes(b) => b,
        _ => panic!("storage.cache_size has a size for its default"),
    }
}
