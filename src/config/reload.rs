//! SIGHUP as a decision from two configs: which changed keys apply while running, and which
//! need a restart. Pure: the agent reads the file, asks [`plan`], carries the plan out
//! ([`Plan::apply`] copies exactly the applied values) and logs [`Plan::describe`].
//!
//! What a key does on a SIGHUP is its row's [`Reload`] in the table of keys
//! ([`super::keys`]): a key is reported as applied only if its row says SIGHUP applies it,
//! and then its value is copied; every other change is reported as needing a restart (a
//! key of a pipeline's stored definition also needs `--reset-pipeline`). Pipelines never
//! change on a SIGHUP: results leave before their checkpoint, so a pipeline change must
//! take effect at a checkpoint boundary, which the restart gives.

use super::Config;
use super::keys::{Get, KEYS, Reload};

/// What a SIGHUP does with a new config.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    /// Keys whose new value applies now (`log.retention`, ...), in table order.
    pub applied: Vec<String>,
    /// Changes that take effect at the next start (`mqtt.port`, `pipeline[p].where`, a
    /// pipeline added or removed), in table order.
    pub restart: Vec<String>,
}

/// Compare the running config with a new one.
pub fn plan(old: &Config, new: &Config) -> Plan {
    let mut plan = Plan::default();
    for k in KEYS {
        let Get::Config(get) = k.get else { continue };
        if get(old) == get(new) {
            continue;
        }
        match k.reload {
            Reload::Sighup(_) => plan.applied.push(k.name.to_string()),
            Reload::Restart | Reload::Definition => plan.restart.push(k.name.to_string()),
        }
    }
    pipelines(old, new, &mut plan.restart);
    sinks(old, new, &mut plan.restart);
    plan
}

/// The `[[sink]]` changes, by name: added, removed, or a key changed (all at a restart:
/// each sink is a connection and a cursor).
fn sinks(old: &Config, new: &Config, restart: &mut Vec<String>) {
    for s in &old.sinks {
        let Some(t) = new.sinks.iter().find(|t| t.name == s.name) else {
            restart.push(format!("sink[{}] (removed)", s.name));
            continue;
        };
        for k in KEYS {
            let Get::Sink(get) = k.get else { continue };
            if get(s) != get(t) {
                restart.push(format!("sink[{}].{}", s.name, &k.name["sink.".len()..]));
            }
        }
    }
    for t in &new.sinks {
        if !old.sinks.iter().any(|s| s.name == t.name) {
            restart.push(format!("sink[{}] (added)", t.name));
        }
    }
}

/// The pipeline changes, by name: added, removed, reordered, or a key changed.
fn pipelines(old: &Config, new: &Config, restart: &mut Vec<String>) {
    let names = |c: &Config| {
        c.pipelines
            .iter()
            .map(|p| p.name.clone())
            .collect::<Vec<_>>()
    };
    let (was, is) = (names(old), names(new));
    for p in &old.pipelines {
        let Some(q) = new.pipelines.iter().find(|q| q.name == p.name) else {
            restart.push(format!("pipeline[{}] (removed)", p.name));
            continue;
        };
        for k in KEYS {
            let Get::Pipeline(get) = k.get else { continue };
            if get(p) != get(q) {
                let key = &k.name["pipeline.".len()..];
                restart.push(match k.reload {
                    Reload::Definition => format!(
                        "pipeline[{}].{key} (its stored definition: also --reset-pipeline {})",
                        p.name, p.name
                    ),
                    _ => format!("pipeline[{}].{key}", p.name),
                });
            }
        }
    }
    for q in &new.pipelines {
        if !was.contains(&q.name) {
            restart.push(format!("pipeline[{}] (added)", q.name));
        }
    }
    let common = |a: &[String], b: &[String]| -> Vec<String> {
        a.iter().filter(|n| b.contains(n)).cloned().collect()
    };
    if common(&was, &is) != common(&is, &was) {
        restart.push("[[pipeline]] order".to_string());
    }
}

impl Plan {
    /// Copy the applied keys' values from `new` into the running `cfg`, and nothing else.
    pub fn apply(&self, cfg: &mut Config, new: &Config) {
        for k in KEYS {
            if let Reload::Sighup(copy) = k.reload {
                if self.applied.iter().any(|a| a == k.name) {
                    copy(cfg, new);
                }
            }
        }
    }

    /// Whether `key` changed and applies now.
    pub fn applies(&self, key: &str) -> bool {
        self.applied.iter().any(|a| a == key)
    }

    /// The journal's line about it.
    pub fn describe(&self) -> String {
        let applied = if self.applied.is_empty() {
            "no change applies while running".to_string()
        } else {
            format!("applied {}", self.applied.join(", "))
        };
        if self.restart.is_empty() {
            applied
        } else {
            format!(
                "{applied}; {} changed too and need a restart (systemctl restart cairn)",
                self.restart.join(", ")
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::keys::KEYS;

    /// A config: `[mqtt]` and `[storage]` with their required keys unless `mqtt` or
    /// `storage` give them, `extra` tables, one pipeline `p` with `pipeline` lines added.
    fn build(mqtt: &str, storage: &str, extra: &str, pipeline: &str) -> Config {
        let mqtt = if mqtt.contains("client_id") {
            mqtt.to_string()
        } else {
            format!("client_id = \"reload\"\n{mqtt}")
        };
        let storage = if storage.contains("data_dir") {
            storage.to_string()
        } else {
            format!("data_dir = \"/data\"\n{storage}")
        };
        let text = format!(
            "[mqtt]\n{mqtt}\n[storage]\n{storage}\n{extra}\n\
             [[pipeline]]\nname = \"p\"\ntopics = [\"t/#\"]\n\
             output_topic = \"o/{{key}}\"\nevent_id = \"/id\"\nkey = \"/k\"\nvalue = \"/v\"\n\
             aggregate = \"sum\"\n{pipeline}\n"
        );
        crate::config::parse_str(&text, std::path::Path::new("<reload>"))
            .unwrap_or_else(|e| panic!("{e}"))
    }

    fn config(extra: &str) -> Config {
        build("", "", extra, "")
    }

    fn config_with(extra: &str, pipeline: &str) -> Config {
        build("", "", extra, pipeline)
    }

    #[test]
    fn the_same_config_changes_nothing() {
        let plan = plan(&config(""), &config(""));
        assert_eq!(plan, Plan::default());
        assert_eq!(plan.describe(), "no change applies while running");
    }

    /// Issue 28: a SIGHUP that changed `[dead_letters]` said "applied" and changed nothing
    /// (the store takes the bounds when it opens). A key a SIGHUP cannot apply is reported
    /// as needing a restart.
    #[test]
    fn a_dead_letters_change_needs_a_restart_and_is_not_reported_applied() {
        let old = config("");
        let new = config("[dead_letters]\nmax_entries = 5\nmax_age = \"1h\"\n");
        let plan = plan(&old, &new);
        assert_eq!(
            plan.restart,
            ["dead_letters.max_entries", "dead_letters.max_age"]
        );
        assert!(plan.applied.is_empty(), "{plan:?}");
        assert!(
            plan.describe().contains("need a restart"),
            "{}",
            plan.describe()
        );
        assert!(
            !plan.describe().starts_with("applied"),
            "{}",
            plan.describe()
        );
    }

    /// One changed value per key of the sections (pipelines apart), and what a SIGHUP does
    /// with it: a key its row applies is reported applied and copied, and the copy makes
    /// the running config equal the new one; any other is reported for a restart and left.
    #[test]
    fn every_key_is_applied_and_copied_or_reported_for_a_restart_as_its_row_says() {
        let cases: &[(&str, &str)] = &[
            ("mqtt.host", "[mqtt]\nhost = \"broker\""),
            ("mqtt.port", "[mqtt]\nport = 1884"),
            ("mqtt.client_id", "[mqtt]\nclient_id = \"other\""),
            ("mqtt.keep_alive", "[mqtt]\nkeep_alive = \"10s\""),
            ("mqtt.username", "[mqtt]\nusername = \"u\""),
            (
                "mqtt.password_file",
                "[mqtt]\nusername = \"u\"\npassword_file = \"/p\"",
            ),
            ("mqtt.tls.ca_file", "[mqtt]\ntls = { ca_file = \"/ca\" }"),
            (
                "mqtt.tls.cert_file",
                "[mqtt]\ntls = { ca_file = \"/ca\", cert_file = \"/c\", key_file = \"/k\" }",
            ),
            (
                "mqtt.tls.key_file",
                "[mqtt]\ntls = { ca_file = \"/ca\", cert_file = \"/c\", key_file = \"/k\" }",
            ),
            ("mqtt.ingest_batch", "[mqtt]\ningest_batch = 10"),
            ("mqtt.reconnect_min", "[mqtt]\nreconnect_min = \"1s\""),
            ("mqtt.reconnect_max", "[mqtt]\nreconnect_max = \"1m\""),
            ("mqtt.channel_capacity", "[mqtt]\nchannel_capacity = 4096"),
            ("storage.data_dir", "[storage]\ndata_dir = \"/other\""),
            ("storage.cache_size", "[storage]\ncache_size = \"32MiB\""),
            (
                "storage.ledger_index_max",
                "[storage]\nledger_index_max = \"8MiB\"",
            ),
            ("log.segment_size", "[log]\nsegment_size = \"8MiB\""),
            ("log.max_size", "[log]\nmax_size = \"320MiB\""),
            ("log.retention", "[log]\nretention = \"1h\""),
            ("log.commit_interval", "[log]\ncommit_interval = \"20ms\""),
            ("log.max_payload", "[log]\nmax_payload = \"1MiB\""),
            ("checkpoint.interval", "[checkpoint]\ninterval = \"1s\""),
            ("checkpoint.max_records", "[checkpoint]\nmax_records = 77"),
            ("checkpoint.max_keys", "[checkpoint]\nmax_keys = 99"),
            ("outbox.max_entries", "[outbox]\nmax_entries = 123456"),
            ("outbox.max_size", "[outbox]\nmax_size = \"2MiB\""),
            ("outbox.inflight", "[outbox]\ninflight = 3"),
            ("outbox.drain_timeout", "[outbox]\ndrain_timeout = \"1s\""),
            ("metrics.listen", "[metrics]\nlisten = \"127.0.0.1:9999\""),
            ("savepoint.interval", "[savepoint]\ninterval = \"1h\""),
            ("savepoint.keep", "[savepoint]\nkeep = 9"),
            ("logging.level", "[logging]\nlevel = \"debug\""),
            (
                "dead_letters.max_entries",
                "[dead_letters]\nmax_entries = 5",
            ),
            ("dead_letters.max_age", "[dead_letters]\nmax_age = \"1h\""),
            ("sparkplug.host_id", "[sparkplug]\nhost_id = \"cairn-1\""),
            ("sparkplug.rebirth", "[sparkplug]\nrebirth = true"),
        ];
        // The uplink: from none to one changes every key it has a value for.
        let uplink = "[uplink]\nclient_id = \"up\"";
        let base = config("");
        let with_uplink = config(uplink);
        let up = plan(&base, &with_uplink);
        assert!(up.applied.is_empty());
        // (The pipeline's default sink moves to the uplink with it.)
        assert!(
            up.restart
                .iter()
                .all(|k| k.starts_with("uplink.") || k == "pipeline[p].sinks"),
            "{up:?}"
        );
        // And each uplink key alone, against a config that has one.
        let uplink_cases: &[(&str, &str)] = &[
            ("uplink.host", "host = \"central\""),
            ("uplink.port", "port = 8883"),
            ("uplink.client_id", "client_id = \"up2\""),
            ("uplink.keep_alive", "keep_alive = \"10s\""),
            ("uplink.username", "username = \"u\""),
            (
                "uplink.password_file",
                "username = \"u\"\npassword_file = \"/p\"",
            ),
            ("uplink.tls.ca_file", "tls = { ca_file = \"/ca\" }"),
            (
                "uplink.tls.cert_file",
                "tls = { ca_file = \"/ca\", cert_file = \"/c\", key_file = \"/k\" }",
            ),
            (
                "uplink.tls.key_file",
                "tls = { ca_file = \"/ca\", cert_file = \"/c\", key_file = \"/k\" }",
            ),
            ("uplink.topic_prefix", "topic_prefix = \"site/\""),
            ("uplink.reconnect_min", "reconnect_min = \"1s\""),
            ("uplink.reconnect_max", "reconnect_max = \"1m\""),
        ];
        let mut seen = Vec::new();
        let mut check = |key: &str, old: &Config, new: &Config| {
            let row = KEYS.iter().find(|k| k.name == key).expect(key);
            let p = plan(old, new);
            let mut cfg = old.clone();
            p.apply(&mut cfg, new);
            match row.reload {
                Reload::Sighup(_) => {
                    assert!(p.applies(key), "{key}: {p:?}");
                    assert!(p.restart.is_empty(), "{key}: {p:?}");
                    assert_eq!(&cfg, new, "{key}: the copy left something behind");
                }
                _ => {
                    assert!(p.restart.iter().any(|r| r == key), "{key}: {p:?}");
                    assert!(p.applied.is_empty(), "{key}: {p:?}");
                    assert_eq!(&cfg, old, "{key}: a restart key was copied");
                }
            }
            seen.push(key.to_string());
        };
        for (key, text) in cases {
            let (section, lines) = text.split_once('\n').unwrap();
            let new = match section {
                "[mqtt]" => build(lines, "", "", ""),
                "[storage]" => build("", lines, "", ""),
                _ => config(text),
            };
            check(key, &base, &new);
        }
        for (key, line) in uplink_cases {
            let new = config(&format!("{uplink}\n{line}").replace(
                "client_id = \"up\"\nclient_id = \"up2\"",
                "client_id = \"up2\"",
            ));
            check(key, &with_uplink, &new);
        }
        // Every section key has its case.
        for k in KEYS {
            if matches!(k.get, Get::Config(_)) {
                assert!(
                    seen.iter().any(|s| s == k.name),
                    "no reload case for {}",
                    k.name
                );
            }
        }
    }

    #[test]
    fn pipeline_changes_are_named_for_a_restart_by_pipeline_and_key() {
        let old = config("");
        let new = config_with("", "where = '/v > 2'\ndedup_window = \"1d\"");
        assert_eq!(
            plan(&old, &new).restart,
            ["pipeline[p].where", "pipeline[p].dedup_window"]
        );
        // A window is part of the stored definition: a restart, and a reset with it.
        let p = plan(&old, &config_with("", "window = { size = \"1m\" }"));
        assert_eq!(p.restart.len(), 3, "size, slide and lateness: {p:?}");
        assert!(
            p.restart
                .iter()
                .all(|r| r.starts_with("pipeline[p].window.") && r.contains("--reset-pipeline p")),
            "{p:?}"
        );
        let mut added = config("");
        let mut second = added.pipelines[0].clone();
        second.name = "q".into();
        added.pipelines.push(second);
        assert_eq!(plan(&old, &added).restart, ["pipeline[q] (added)"]);
        assert_eq!(plan(&added, &old).restart, ["pipeline[q] (removed)"]);
        let mut swapped = added.clone();
        swapped.pipelines.reverse();
        assert_eq!(plan(&added, &swapped).restart, ["[[pipeline]] order"]);
        assert!(plan(&old, &swapped).applied.is_empty());
    }
}
