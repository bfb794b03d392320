//! SIGHUP: re-read the config file and apply what is safe to change while running (log
//! level, limits, intervals). Anything else (broker connection, storage, pipelines, log
//! framing) is reported and left for a restart. A config with problems changes nothing.
//!
//! Pipelines never change here: results leave before their checkpoint, so a pipeline change
//! must take effect at a checkpoint boundary, which the restart gives (a clean stop
//! checkpoints everything; after a crash, the start plan (`processor::plan`) settles the
//! tail under the old pipelines first, or starts a new generation).
//!
//! [`diff`] decides from the two configs alone; the loop (`Agent::reload` in
//! `agent/mod.rs`) reads the file and carries the plan out.

use crate::config::Config;

/// What a reload does with a new config.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct ReloadPlan {
    /// Sections changed that only a restart applies, for the journal.
    pub(crate) restart: Vec<&'static str>,
    /// `[savepoint] interval` changed: the next savepoint is scheduled again.
    pub(crate) savepoints_changed: bool,
}

/// Compare the running config with a new one.
pub(crate) fn diff(old: &Config, new: &Config) -> ReloadPlan {
    let mut restart = Vec::new();
    if new.mqtt != old.mqtt {
        restart.push("[mqtt]");
    }
    if new.uplink != old.uplink {
        restart.push("[uplink]");
    }
    if new.storage != old.storage {
        restart.push("[storage]");
    }
    if new.metrics != old.metrics {
        restart.push("[metrics]");
    }
    if new.pipelines != old.pipelines {
        restart.push("[[pipeline]]");
    }
    if new.log.segment_size != old.log.segment_size || new.log.max_payload != old.log.max_payload {
        restart.push("log.segment_size/log.max_payload");
    }
    if new.outbox.inflight != old.outbox.inflight {
        restart.push("outbox.inflight");
    }
    ReloadPlan {
        restart,
        savepoints_changed: new.savepoint.interval != old.savepoint.interval,
    }
}

/// Copy the settings that are safe to change while running from `new` into `cfg`.
pub(crate) fn apply_safe(cfg: &mut Config, new: &Config) {
    cfg.logging = new.logging.clone();
    cfg.log.max_size = new.log.max_size;
    cfg.log.retention = new.log.retention;
    cfg.log.commit_interval = new.log.commit_interval;
    cfg.checkpoint = new.checkpoint.clone();
    cfg.outbox.max_entries = new.outbox.max_entries;
    cfg.outbox.max_size = new.outbox.max_size;
    cfg.outbox.drain_timeout = new.outbox.drain_timeout;
    cfg.savepoint = new.savepoint.clone();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(extra: &str) -> Config {
        let text = format!(
            "[mqtt]\nclient_id = \"reload\"\n[storage]\ndata_dir = \"/data\"\n{extra}\n\
             [[pipeline]]\nname = \"p\"\ntopics = [\"t/#\"]\n\
             output_topic = \"o/{{key}}\"\nevent_id = \"/id\"\nkey = \"/k\"\nvalue = \"/v\"\n\
             aggregate = \"sum\"\n"
        );
        crate::config::parse_str(&text, std::path::Path::new("<reload>")).unwrap()
    }

    #[test]
    fn the_same_config_changes_nothing() {
        let plan = diff(&config(""), &config(""));
        assert_eq!(
            plan,
            ReloadPlan {
                restart: vec![],
                savepoints_changed: false
            }
        );
    }

    #[test]
    fn limits_and_intervals_apply_without_a_restart() {
        let old = config("");
        let new = config(
            "[log]\nmax_size = \"320MiB\"\nretention = \"1h\"\ncommit_interval = \"20ms\"\n\
             [checkpoint]\nmax_records = 77\n[outbox]\nmax_entries = 123\nmax_size = \"2MiB\"\n",
        );
        assert_ne!(old.log, new.log);
        assert_ne!(old.checkpoint, new.checkpoint);
        assert!(diff(&old, &new).restart.is_empty());
        let mut cfg = old.clone();
        apply_safe(&mut cfg, &new);
        assert_eq!(cfg, new);
    }

    #[test]
    fn connection_storage_and_framing_changes_are_named_for_a_restart_and_not_applied() {
        let old = config("");
        let new = config(
            "[log]\nsegment_size = \"8MiB\"\n[outbox]\ninflight = 3\n\
             [metrics]\nlisten = \"127.0.0.1:9999\"\n[uplink]\nclient_id = \"up\"\n",
        );
        let new = Config {
            mqtt: crate::config::MqttConfig {
                port: old.mqtt.port + 1,
                ..new.mqtt.clone()
            },
            ..new
        };
        assert_eq!(
            diff(&old, &new).restart,
            [
                "[mqtt]",
                "[uplink]",
                "[metrics]",
                "log.segment_size/log.max_payload",
                "outbox.inflight"
            ]
        );
        let mut cfg = old.clone();
        apply_safe(&mut cfg, &new);
        assert_eq!(cfg, old, "none of it applied");
    }

    #[test]
    fn a_new_savepoint_interval_reschedules() {
        let plan = diff(&config(""), &config("[savepoint]\ninterval = \"1h\"\n"));
        assert!(plan.savepoints_changed);
        assert!(plan.restart.is_empty());
    }
}
