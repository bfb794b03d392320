//! Stage 2 for every table but `[[pipeline]]`: each section's keys checked and defaulted
//! into its typed config, and the limits between keys of one section.

use super::*;

impl Validator {
    pub(super) fn dead_letters(&mut self, r: RawDeadLetters) -> Option<DeadLettersConfig> {
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
        let link = self.link(
            "mqtt",
            RawLink {
                host: r.host,
                port: r.port,
                client_id: r.client_id,
                keep_alive: r.keep_alive,
                username: r.username,
                password_file: r.password_file,
                tls: r.tls,
                reconnect_min: r.reconnect_min,
                reconnect_max: r.reconnect_max,
            },
        );
        let ingest_batch = self.int(
            "mqtt.ingest_batch",
            r.ingest_batch,
            DEFAULT_INGEST_BATCH,
            1..=65_535,
            "; keep it at or below the broker's max_inflight_messages (mosquitto: 20)",
        );
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
        self.duration(&key, raw, DEFAULT_KEEP_ALIVE_MS)
            .filter(|&ms| {
                self.require(
                    &key,
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
        let reconnect_min = self
            .duration(&min_key, min, DEFAULT_RECONNECT_MIN_MS)
            .filter(|&ms| {
                self.require(&min_key, ms >= MIN_RECONNECT_MIN_MS, || {
                    format!(
                        "must be at least {}, found {}: a shorter backoff hammers a broker that is down",
                        format_duration_ms(MIN_RECONNECT_MIN_MS),
                        format_duration_ms(ms)
                    )
                })
            });
        let reconnect_max = self
            .duration(&max_key, max, DEFAULT_RECONNECT_MAX_MS)
            .filter(|&ms| {
                self.require(&max_key, ms <= MAX_RECONNECT_MAX_MS, || {
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
                             takes about 4.5 bytes per event ID in the window",
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

    pub(super) fn log(
        &mut self,
        r: RawLog,
        savepoint_interval: Option<Duration>,
    ) -> Option<LogConfig> {
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

    pub(super) fn checkpoint(&mut self, r: RawCheckpoint) -> Option<CheckpointConfig> {
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
                            "must be between 1ms and 1h, found {}: replay after a crash \
                             starts at the last checkpoint",
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
        let max_keys = self.int(
            "checkpoint.max_keys",
            r.max_keys,
            DEFAULT_CHECKPOINT_MAX_KEYS,
            1..=MAX_CHECKPOINT_MAX_RECORDS,
            ": each key a checkpoint writes holds a copy of a sled leaf until it commits",
        );
        Some(CheckpointConfig {
            interval: Duration::from_millis(interval?),
            max_records: u64::try_from(max_records?).ok()?,
            max_keys: u64::try_from(max_keys?).ok()?,
        })
    }

    pub(super) fn outbox(&mut self, r: RawOutbox) -> Option<OutboxConfig> {
        let max_entries = self.int(
            "outbox.max_entries",
            r.max_entries,
            DEFAULT_OUTBOX_MAX_ENTRIES,
            1..=i64::MAX,
            "",
        );
        let max_size = self
            .size("outbox.max_size", r.max_size, DEFAULT_OUTBOX_MAX_SIZE)
            .filter(|&n| {
                self.require("outbox.max_size", n >= MIN_OUTBOX_MAX_SIZE, || {
                    format!(
                        "must be at least 1MiB, found {}: one checkpoint's results must fit",
                        format_size(n)
                    )
                })
            });
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
}
