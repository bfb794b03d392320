//! `[uplink]`: a second, publish-only MQTT connection for results (issue 13). Its
//! connection keys are checked by the same code as `[mqtt]`'s (`link.rs`); here
//! only what is its own: `topic_prefix`, and that it is not `[mqtt]`'s session.

use super::link::raw_link;
use super::names::refusable;
use super::*;
use crate::config::UplinkConfig;

/// Longest `topic_prefix`: the room every result topic leaves for it under MQTT's 65,535
/// (see `pipeline::topic::TOPIC_PREFIX_ROOM`).
const MAX_TOPIC_PREFIX_LEN: usize = TOPIC_PREFIX_ROOM;

impl Validator {
    /// `None` after a problem; `Some(None)` when there is no `[uplink]`.
    pub(super) fn uplink(
        &mut self,
        r: Option<RawUplink>,
        mqtt: Option<&MqttConfig>,
    ) -> Option<Option<UplinkConfig>> {
        let Some(r) = r else {
            return Some(None);
        };
        let link = self.link("uplink", raw_link!(r));
        let prefix = self.topic_prefix("uplink.topic_prefix", r.topic_prefix);
        let mut link = link?;
        if let Some(m) = mqtt {
            let same_broker = m.host == link.host && m.port == link.port;
            let ok = self.require(
                "uplink.client_id",
                !(same_broker && m.client_id == link.client_id),
                || {
                    format!(
                        "is mqtt.client_id (`{}`) on the same broker {}:{}: the two connections \
                         would take each other's session and disconnect each other; give the \
                         uplink its own ID",
                        m.client_id, m.host, m.port
                    )
                },
            );
            if !ok {
                return None;
            }
            // One event channel takes both connections' events.
            link.ingest_batch = m.ingest_batch;
            link.channel_capacity = m.channel_capacity;
        }
        Some(Some(UplinkConfig {
            mqtt: link,
            topic_prefix: prefix?,
        }))
    }

    /// `topic_prefix` of `[uplink]` or an mqtt `[[sink]]`, at `key`: empty by default; `None`
    /// after a problem.
    pub(super) fn topic_prefix(&mut self, key: &str, raw: Option<String>) -> Option<String> {
        let prefix = raw.unwrap_or_default();
        let ok = match refusable(&prefix) {
            Some(why) => {
                self.problem(key, format!("`{}`: {why}", prefix.escape_debug()));
                false
            }
            None => self.require(key, valid_prefix(&prefix), || {
                format!(
                    "`{}` cannot begin an MQTT topic: no `+` or `#`, not starting with `$`, \
                     at most {MAX_TOPIC_PREFIX_LEN} bytes",
                    prefix.escape_debug()
                )
            }),
        };
        ok.then_some(prefix)
    }
}

/// A prefix the publish topic checks will accept before any result topic (code points a
/// receiver may refuse are checked before, with their own message).
fn valid_prefix(p: &str) -> bool {
    p.len() <= MAX_TOPIC_PREFIX_LEN && !p.contains(['+', '#']) && !p.starts_with('$')
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = "[mqtt]\nclient_id = \"box-1\"\n[storage]\ndata_dir = \"/d\"\n";

    const PIPELINE: &str = "[[pipeline]]\nname = \"p\"\ntopics = [\"t/#\"]\nevent_id = \"/id\"\n\
                            key = \"/k\"\naggregate = \"count\"\noutput_topic = \"o/{key}\"\n";

    fn parse(extra: &str) -> Result<Config, ConfigError> {
        parse_str(&format!("{BASE}{extra}{PIPELINE}"), Path::new("t.toml"))
    }

    /// The problems of `BASE` + `extra`: (key, line, message).
    fn problems(extra: &str) -> Vec<(String, Option<usize>, String)> {
        match parse(extra) {
            Err(ConfigError::Invalid { problems, .. }) => problems
                .into_iter()
                .map(|p| (p.key, p.line, p.message))
                .collect(),
            other => panic!("expected problems, got {other:#?}"),
        }
    }

    #[test]
    fn every_key_of_the_issue_is_read_with_its_default() {
        let cfg = parse(
            "[uplink]\nhost = \"central.example\"\nport = 8883\nclient_id = \"box-17-results\"\n\
             keep_alive = \"30s\"\nusername = \"box17\"\npassword_file = \"/etc/cairn/up\"\n\
             tls = { ca_file = \"/ca.pem\", cert_file = \"/c.pem\", key_file = \"/k.pem\" }\n\
             topic_prefix = \"site/box-17/\"\nreconnect_min = \"100ms\"\nreconnect_max = \"30s\"\n",
        )
        .unwrap();
        let u = cfg.uplink.expect("an [uplink]");
        assert_eq!(
            (u.mqtt.host.as_str(), u.mqtt.port),
            ("central.example", 8883)
        );
        assert_eq!(u.mqtt.client_id, "box-17-results");
        assert_eq!(u.mqtt.keep_alive, Duration::from_secs(30));
        assert_eq!(u.mqtt.username.as_deref(), Some("box17"));
        assert_eq!(u.mqtt.password_file, Some(PathBuf::from("/etc/cairn/up")));
        let tls = u.mqtt.tls.expect("tls");
        assert_eq!(tls.cert_file, Some(PathBuf::from("/c.pem")));
        assert_eq!(u.topic_prefix, "site/box-17/");
        assert_eq!(u.mqtt.reconnect_min, Duration::from_millis(100));
        assert_eq!(
            (u.mqtt.ingest_batch, u.mqtt.channel_capacity),
            (cfg.mqtt.ingest_batch, cfg.mqtt.channel_capacity),
            "one event channel: [mqtt]'s sizes"
        );
        let d = parse("[uplink]\nclient_id = \"up\"\n")
            .unwrap()
            .uplink
            .unwrap();
        assert_eq!(d.topic_prefix, "", "no prefix by default");
        assert_eq!((d.mqtt.host.as_str(), d.mqtt.port), ("127.0.0.1", 1883));
        assert_eq!(d.mqtt.reconnect_max, Duration::from_secs(30));
        assert_eq!(parse("").unwrap().uplink, None, "optional");
        assert_eq!(
            parse("").unwrap().outbox.max_size,
            1 << 30,
            "1GiB by default"
        );
    }

    #[test]
    fn an_unknown_key_or_a_bad_value_is_a_problem_on_its_line() {
        let p = problems("[uplink]\nclient_id = \"up\"\ntopic_prefx = \"a/\"\n");
        assert_eq!(p.len(), 1, "{p:#?}");
        assert_eq!((p[0].0.as_str(), p[0].1), ("uplink.topic_prefx", Some(7)));
        assert!(p[0].2.contains("unknown key"), "{p:#?}");
        // [mqtt]'s checks, under uplink's names.
        let p = problems(
            "[uplink]\nclient_id = \"up\"\nkeep_alive = \"1s\"\nreconnect_min = \"1ms\"\n\
             password_file = \"/p\"\ntls = { cert_file = \"/c\" }\n",
        );
        let keys: Vec<&str> = p.iter().map(|p| p.0.as_str()).collect();
        for k in [
            "uplink.keep_alive",
            "uplink.reconnect_min",
            "uplink.password_file",
            "uplink.tls.ca_file",
            "uplink.tls.cert_file",
        ] {
            assert!(keys.contains(&k), "{k} not in {p:#?}");
        }
        assert!(
            p.iter().all(|p| p.1.is_some()),
            "every problem has a line: {p:#?}"
        );
        let p = problems("[uplink]\n");
        assert_eq!(p[0].0, "uplink.client_id");
        assert!(p[0].2.contains("missing required key"), "{p:#?}");
        for bad in ["a/+/", "#", "$SYS/", "a\\u0000"] {
            let p = problems(&format!(
                "[uplink]\nclient_id = \"up\"\ntopic_prefix = \"{bad}\"\n"
            ));
            assert_eq!(
                (p[0].0.as_str(), p[0].1),
                ("uplink.topic_prefix", Some(7)),
                "{bad}"
            );
        }
        let long = "a".repeat(MAX_TOPIC_PREFIX_LEN + 1);
        let p = problems(&format!(
            "[uplink]\nclient_id = \"up\"\ntopic_prefix = \"{long}\"\n"
        ));
        assert_eq!(p[0].0, "uplink.topic_prefix");
    }

    #[test]
    fn the_uplink_may_not_take_the_input_connections_session() {
        let p = problems("[uplink]\nclient_id = \"box-1\"\n");
        assert_eq!(p.len(), 1, "{p:#?}");
        assert_eq!((p[0].0.as_str(), p[0].1), ("uplink.client_id", Some(6)));
        assert!(p[0].2.contains("same broker"), "{p:#?}");
        // Another broker (port or host): the same ID is its own session there.
        assert!(parse("[uplink]\nclient_id = \"box-1\"\nport = 8883\n").is_ok());
        assert!(parse("[uplink]\nclient_id = \"box-1\"\nhost = \"central\"\n").is_ok());
    }

    #[test]
    fn outbox_max_size_is_a_size_of_at_least_one_mib() {
        let cfg = parse("[outbox]\nmax_size = \"64MiB\"\n").unwrap();
        assert_eq!(cfg.outbox.max_size, 64 << 20);
        let p = problems("[outbox]\nmax_size = \"100KiB\"\n");
        assert_eq!((p[0].0.as_str(), p[0].1), ("outbox.max_size", Some(6)));
        let p = problems("[outbox]\nmax_size = 5\n");
        assert_eq!(p[0].0, "outbox.max_size");
        assert!(p[0].2.contains("no unit"), "{p:#?}");
    }
}
