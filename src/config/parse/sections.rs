//! Stage 2 for every table but `[[pipeline]]`: each section's keys checked and defaulted
//! into its typed config, and the limits between keys of one section.

use super::link::raw_link;
use super::*;

impl Validator {
    pub(super) fn dead_letters(&mut self, r: RawDeadLetters) -> Option<DeadLettersConfig> {
        let max_entries = self.int("dead_letters.max_entries", r.max_entries);
        let max_age = self.duration("dead_letters.max_age", r.max_age);
        Some(DeadLettersConfig {
            max_entries: u64::try_from(max_entries?).ok()?,
            max_age: Duration::from_millis(max_age?),
        })
    }

    /// `[sparkplug]`: a host ID that can be a topic level of `spBv1.0/STATE/<host_id>`.
    pub(super) fn sparkplug(&mut self, r: RawSparkplug) -> Option<SparkplugConfig> {
        use crate::pipeline::sparkplug::session::MAX_ID_BYTES;
        let host_id = match r.host_id {
            None => Some(None),
            Some(id) if id.is_empty() || id.len() > MAX_ID_BYTES => {
                self.problem(
                    "sparkplug.host_id",
                    format!("must be 1 to {MAX_ID_BYTES} bytes, found {}", id.len()),
                );
                None
            }
            Some(id) if id.contains(['+', '/', '#']) => {
                self.problem(
                    "sparkplug.host_id",
                    format!(
                        "`{id}`: a Sparkplug host ID is one topic level (spBv1.0/STATE/<host_id>), \
                         without +, / or #"
                    ),
                );
                None
            }
            Some(id) => match super::names::refusable(&id) {
                Some(why) => {
                    self.problem(
                        "sparkplug.host_id",
                        format!("`{}`: {why}", id.escape_debug()),
                    );
                    None
                }
                None => Some(Some(id)),
            },
        };
        Some(SparkplugConfig {
            host_id: host_id?,
            rebirth: r.rebirth.unwrap_or(false),
        })
    }

    pub(super) fn logging(&mut self, r: RawLogging) -> Option<LoggingConfig> {
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

    pub(super) fn mqtt(&mut self, r: RawMqtt, outbox_inflight: Option<u16>) -> Option<MqttConfig> {
        let link = self.link("mqtt", raw_link!(r));
        let ingest_batch = self.int("mqtt.ingest_batch", r.ingest_batch);
        let channel_capacity =
            self.channel_capacity(r.channel_capacity, ingest_batch, outbox_inflight);
        Some(MqttConfig {
            ingest_batch: usize::try_from(ingest_batch?).ok()?,
            channel_capacity: usize::try_from(channel_capacity?).ok()?,
            ..link?
        })
    }

    /// The client ID: required, stable and short (the broker keeps the session under it).
    pub(super) fn client_id(&mut self, section: &str, raw: Option<String>) -> Option<String> {
        let key = format!("{section}.client_id");
        match raw {
            None => {
                self.missing(
                    &key,
                    "the broker keeps this agent's persistent session under it, so it must be \
                     stable and unique per box (two boxes with one ID keep disconnecting each other)",
                );
                None
            }
            Some(id) => {
                let ok = self.require(&key, valid_name(&id, MAX_CLIENT_ID_LEN), || {
                    format!(
                        "`{id}` is not a valid client ID: use 1 to {MAX_CLIENT_ID_LEN} of A-Z a-z 0-9 _ - \
                         ({PORTABLE_CLIENT_ID_LEN} or fewer work with every MQTT 3.1.1 broker)"
                    )
                });
                ok.then_some(id)
            }
        }
    }

    pub(super) fn keep_alive(&mut self, section: &str, raw: Option<DurationText>) -> Option<u64> {
        let key = format!("{section}.keep_alive");
        self.duration(&key, raw).filter(|&ms| {
            self.require(&key, ms % 1000 == 0, || {
                format!(
                    "must be whole seconds, found {}: MQTT sends it as a count of seconds",
                    format_duration_ms(ms)
                )
            })
        })
    }

    /// The reconnect backoff bounds, `min <= max`.
    pub(super) fn reconnect(
        &mut self,
        section: &str,
        min: Option<DurationText>,
        max: Option<DurationText>,
    ) -> (Option<u64>, Option<u64>) {
        let (min_key, max_key) = (
            format!("{section}.reconnect_min"),
            format!("{section}.reconnect_max"),
        );
        let reconnect_min = self.duration(&min_key, min);
        let reconnect_max = self.duration(&max_key, max);
        let reconnect_max = match (reconnect_min, reconnect_max) {
            (Some(lo), Some(hi)) if hi < lo => {
                self.problem(
                    &max_key,
                    format!(
                        "must be at least {min_key} ({}), found {}",
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
        let channel_capacity = self.int("mqtt.channel_capacity", raw);
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
    pub(super) fn path(&mut self, key: &str, raw: Option<String>) -> Option<Option<PathBuf>> {
        match raw {
            None => Some(None),
            Some(p) if p.is_empty() => {
                self.problem(key, "is empty: give a file path, or remove the key");
                None
            }
            Some(p) => Some(Some(PathBuf::from(p))),
        }
    }

    pub(super) fn tls(&mut self, section: &str, r: RawTls) -> Option<TlsConfig> {
        let key = |k: &str| format!("{section}.tls.{k}");
        let ca_file = match r.ca_file {
            None => {
                self.missing(
                    &key("ca_file"),
                    "TLS needs the CA certificate that signed the broker's certificate",
                );
                None
            }
            some => self.path(&key("ca_file"), some).flatten(),
        };
        let cert_file = self.path(&key("cert_file"), r.cert_file);
        let key_file = self.path(&key("key_file"), r.key_file);
        let (cert_file, key_file) = match (cert_file, key_file) {
            (Some(Some(_)), Some(None)) => {
                self.problem(
                    &key("cert_file"),
                    "needs `key_file` too: a client certificate is useless without its key",
                );
                (None, None)
            }
            (Some(None), Some(Some(_))) => {
                self.problem(
                    &key("key_file"),
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

    pub(super) fn storage(&mut self, r: RawStorage) -> Option<StorageConfig> {
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
        let cache_size = self.size("storage.cache_size", r.cache_size);
        let ledger_index_max = self.size("storage.ledger_index_max", r.ledger_index_max);
        Some(StorageConfig {
            data_dir: data_dir?,
            cache_size: cache_size?,
            ledger_index_max: ledger_index_max?,
        })
    }

    pub(super) fn log(
        &mut self,
        r: RawLog,
        savepoint_interval: Option<Duration>,
    ) -> Option<LogConfig> {
        let segment_size = self.size("log.segment_size", r.segment_size);
        let max_size = self.size("log.max_size", r.max_size);
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
        let retention = self.duration("log.retention", r.retention);
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
        let commit_interval = self.duration("log.commit_interval", r.commit_interval);
        let max_payload = self.size("log.max_payload", r.max_payload);
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

    pub(super) fn checkpoint(&mut self, r: RawCheckpoint) -> Option<CheckpointConfig> {
        let interval = self.duration("checkpoint.interval", r.interval);
        let max_records = self.int("checkpoint.max_records", r.max_records);
        let max_keys = self.int("checkpoint.max_keys", r.max_keys);
        Some(CheckpointConfig {
            interval: Duration::from_millis(interval?),
            max_records: u64::try_from(max_records?).ok()?,
            max_keys: u64::try_from(max_keys?).ok()?,
        })
    }

    pub(super) fn outbox(&mut self, r: RawOutbox) -> Option<OutboxConfig> {
        let max_entries = self.int("outbox.max_entries", r.max_entries);
        let max_size = self.size("outbox.max_size", r.max_size);
        let inflight = self.int("outbox.inflight", r.inflight);
        let drain_timeout = self.duration("outbox.drain_timeout", r.drain_timeout);
        Some(OutboxConfig {
            max_entries: u64::try_from(max_entries?).ok()?,
            max_size: max_size?,
            inflight: u16::try_from(inflight?).ok()?,
            drain_timeout: Duration::from_millis(drain_timeout?),
        })
    }

    pub(super) fn metrics(&mut self, r: RawMetrics) -> Option<MetricsConfig> {
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

    pub(super) fn savepoint(&mut self, r: RawSavepoint) -> Option<SavepointConfig> {
        // Absent: no savepoints.
        let interval = match r.interval {
            None => Some(None),
            some => self
                .duration("savepoint.interval", some)
                .map(|ms| Some(Duration::from_millis(ms))),
        };
        let keep = self.int("savepoint.keep", r.keep);
        Some(SavepointConfig {
            interval: interval?,
            keep: usize::try_from(keep?).ok()?,
        })
    }
}
