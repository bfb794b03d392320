//! `[[sink]]` and each pipeline's `sinks` (issue 29). A sink is a name and a kind with that
//! kind's keys; `local` (`[mqtt]`'s broker) and `uplink` (`[uplink]`) are sinks too, with
//! names no `[[sink]]` may take. A pipeline without `sinks` goes to `uplink` when
//! `[uplink]` is configured, else to `local`: every config valid before keeps its meaning.

use super::link::raw_link;
use super::names::valid_name;
use super::*;
use crate::config::{
    LOCAL_SINK, MqttSinkConfig, SinkConfig, SinkKind, SinkProtocol, UPLINK_SINK, UplinkConfig,
};

/// Most `[[sink]]` tables: each is a connection with a thread and a cursor.
pub(super) const MAX_SINKS: usize = 16;

/// The kinds this build knows.
const KINDS: &str = "`mqtt`, `postgres`, `jetstream`";

impl Validator {
    /// Every `[[sink]]`, checked; `None` after a problem.
    pub(super) fn sinks(
        &mut self,
        raw: Option<Vec<RawSink>>,
        mqtt: Option<&MqttConfig>,
        uplink: Option<&UplinkConfig>,
    ) -> Option<Vec<SinkConfig>> {
        let raw = raw.unwrap_or_default();
        if raw.len() > MAX_SINKS {
            self.problem(
                "sink",
                format!("{} sinks: at most {MAX_SINKS} are allowed", raw.len()),
            );
            return None;
        }
        let mut out = Vec::with_capacity(raw.len());
        let mut ok = true;
        // (host, port, client_id) of every connection so far: no two may share a session.
        let mut sessions: Vec<(String, String, u16, String)> = mqtt
            .map(|m| {
                (
                    "mqtt".to_string(),
                    m.host.clone(),
                    m.port,
                    m.client_id.clone(),
                )
            })
            .into_iter()
            .chain(uplink.map(|u| {
                let m = &u.mqtt;
                (
                    "uplink".to_string(),
                    m.host.clone(),
                    m.port,
                    m.client_id.clone(),
                )
            }))
            .collect();
        for (i, r) in raw.into_iter().enumerate() {
            match self.sink(i, r, mqtt, &out, &mut sessions) {
                Some(s) => out.push(s),
                None => ok = false,
            }
        }
        ok.then_some(out)
    }

    fn sink(
        &mut self,
        i: usize,
        mut r: RawSink,
        mqtt: Option<&MqttConfig>,
        before: &[SinkConfig],
        sessions: &mut Vec<(String, String, u16, String)>,
    ) -> Option<SinkConfig> {
        let at = format!("sink[{i}]");
        let name = match r.name.take() {
            None => {
                self.problem(&format!("{at}.name"), "missing required key");
                None
            }
            Some(n) if n == LOCAL_SINK || n == UPLINK_SINK => {
                self.problem(
                    &format!("{at}.name"),
                    format!(
                        "`{n}` is taken: `local` is [mqtt]'s broker and `uplink` is [uplink]; \
                         name this sink another way"
                    ),
                );
                None
            }
            Some(n) if !valid_name(&n, 64) => {
                self.problem(
                    &format!("{at}.name"),
                    format!("`{}` is not 1 to 64 of A-Z a-z 0-9 _ -", n.escape_debug()),
                );
                None
            }
            Some(n) if before.iter().any(|s| s.name == n) => {
                self.problem(
                    &format!("{at}.name"),
                    format!("`{n}` names two sinks: each needs its own name"),
                );
                None
            }
            Some(n) => Some(n),
        };
        let kind = match r.kind.as_deref() {
            None => {
                self.problem(
                    &format!("{at}.kind"),
                    format!("missing required key: one of {KINDS}"),
                );
                return None;
            }
            Some("mqtt") => {
                self.not_of_kind(&at, "mqtt", &r);
                let m = self.mqtt_sink(&at, r, mqtt, sessions)?;
                SinkKind::Mqtt(m)
            }
            Some("postgres") => {
                self.not_of_kind(&at, "postgres", &r);
                SinkKind::Postgres(self.postgres_sink(&at, name.as_deref(), r)?)
            }
            Some("jetstream") => {
                self.not_of_kind(&at, "jetstream", &r);
                SinkKind::JetStream(self.jetstream_sink(&at, name.as_deref(), r)?)
            }
            Some(k) => {
                self.problem(
                    &format!("{at}.kind"),
                    format!(
                        "`{}` is not a sink kind: expected {KINDS}",
                        k.escape_debug()
                    ),
                );
                return None;
            }
        };
        Some(SinkConfig { name: name?, kind })
    }

    /// `kind = "mqtt"`: the connection keys as `[uplink]`'s, the protocol and the prefix.
    fn mqtt_sink(
        &mut self,
        at: &str,
        r: RawSink,
        mqtt: Option<&MqttConfig>,
        sessions: &mut Vec<(String, String, u16, String)>,
    ) -> Option<MqttSinkConfig> {
        let protocol = match r.protocol.as_deref() {
            None | Some("5") => Some(SinkProtocol::V5),
            Some("3.1.1") => Some(SinkProtocol::V311),
            Some(p) => {
                self.problem(
                    &format!("{at}.protocol"),
                    format!("`{}` is not `\"5\"` or `\"3.1.1\"`", p.escape_debug()),
                );
                None
            }
        };
        let link = self.link(at, raw_link!(r));
        let prefix = self.topic_prefix(&format!("{at}.topic_prefix"), r.topic_prefix);
        let mut link = link?;
        let clash = sessions
            .iter()
            .find(|(_, h, p, c)| *h == link.host && *p == link.port && *c == link.client_id)
            .map(|(who, ..)| who.clone());
        if let Some(who) = clash {
            self.problem(
                &format!("{at}.client_id"),
                format!(
                    "is {who}'s client_id (`{}`) on the same broker {}:{}: the two connections \
                     would take each other's session and disconnect each other; give each its \
                     own ID",
                    link.client_id, link.host, link.port
                ),
            );
            return None;
        }
        sessions.push((
            at.to_string(),
            link.host.clone(),
            link.port,
            link.client_id.clone(),
        ));
        if let Some(m) = mqtt {
            // One event channel takes every connection's events.
            link.ingest_batch = m.ingest_batch;
            link.channel_capacity = m.channel_capacity;
        }
        Some(MqttSinkConfig {
            mqtt: link,
            protocol: protocol?,
            topic_prefix: prefix?,
        })
    }

    /// Each pipeline's `sinks`: known names, none twice, at least one; the default filled
    /// in. `false` after a problem.
    pub(super) fn routes(
        &mut self,
        pipelines: &mut [PipelineSpec],
        sinks: &[SinkConfig],
        has_uplink: bool,
    ) -> bool {
        let known: Vec<&str> = std::iter::once(LOCAL_SINK)
            .chain(has_uplink.then_some(UPLINK_SINK))
            .chain(sinks.iter().map(|s| s.name.as_str()))
            .collect();
        let mut ok = true;
        for (i, p) in pipelines.iter_mut().enumerate() {
            let key = format!("pipeline[{i}].sinks");
            if p.sinks.is_empty() {
                p.sinks.0 = vec![if has_uplink { UPLINK_SINK } else { LOCAL_SINK }.to_string()];
                continue;
            }
            for (j, s) in p.sinks.iter().enumerate() {
                if !known.contains(&s.as_str()) {
                    let hint = if s == UPLINK_SINK {
                        " (`uplink` needs an [uplink] table)".to_string()
                    } else {
                        String::new()
                    };
                    self.problem(
                        &format!("{key}[{j}]"),
                        format!(
                            "`{}` is not a sink{hint}: expected one of {}",
                            s.escape_debug(),
                            known
                                .iter()
                                .map(|k| format!("`{k}`"))
                                .collect::<Vec<_>>()
                                .join(", ")
                        ),
                    );
                    ok = false;
                } else if p.sinks[..j].contains(s) {
                    self.problem(&format!("{key}[{j}]"), format!("`{s}` is listed twice"));
                    ok = false;
                }
            }
        }
        ok
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = "[mqtt]\nclient_id = \"box-1\"\n[storage]\ndata_dir = \"/d\"\n";

    fn pipeline(sinks: &str) -> String {
        format!(
            "[[pipeline]]\nname = \"p\"\ntopics = [\"t/#\"]\nevent_id = \"/id\"\nkey = \"/k\"\n\
             aggregate = \"count\"\noutput_topic = \"o/{{key}}\"\n{sinks}\n"
        )
    }

    fn parse(extra: &str, sinks: &str) -> Result<Config, ConfigError> {
        parse_str(
            &format!("{BASE}{extra}{}", pipeline(sinks)),
            Path::new("t.toml"),
        )
    }

    fn problems(extra: &str, sinks: &str) -> Vec<(String, Option<usize>, String)> {
        match parse(extra, sinks) {
            Err(ConfigError::Invalid { problems, .. }) => problems
                .into_iter()
                .map(|p| (p.key, p.line, p.message))
                .collect(),
            other => panic!("expected problems, got {other:#?}"),
        }
    }

    const CENTRAL: &str = "[[sink]]\nname = \"central\"\nkind = \"mqtt\"\nhost = \"central.example\"\n\
                           port = 8883\nclient_id = \"box-17-results\"\n\
                           topic_prefix = \"site/box-17/\"\n";

    #[test]
    fn every_key_of_the_issue_is_read_and_mqtt_5_is_the_default() {
        let cfg = parse(
            &format!(
                "{CENTRAL}keep_alive = \"20s\"\nusername = \"u\"\n\
                      password_file = \"/p\"\nreconnect_min = \"1s\"\nreconnect_max = \"9s\"\n"
            ),
            "sinks = [\"local\", \"central\"]",
        )
        .unwrap();
        assert_eq!(*cfg.pipelines[0].sinks, ["local", "central"]);
        let s = &cfg.sinks[0];
        assert_eq!(s.name, "central");
        let SinkKind::Mqtt(m) = &s.kind else {
            panic!("an mqtt sink")
        };
        assert_eq!(m.protocol, SinkProtocol::V5);
        assert_eq!(
            (m.mqtt.host.as_str(), m.mqtt.port),
            ("central.example", 8883)
        );
        assert_eq!(m.mqtt.client_id, "box-17-results");
        assert_eq!(m.topic_prefix, "site/box-17/");
        assert_eq!(m.mqtt.keep_alive, Duration::from_secs(20));
        assert_eq!(m.mqtt.reconnect_max, Duration::from_secs(9));
        assert_eq!(m.mqtt.channel_capacity, cfg.mqtt.channel_capacity);
        assert_eq!(cfg.sink_names(), ["local", "central"]);
        let v311 = parse(&format!("{CENTRAL}protocol = \"3.1.1\"\n"), "").unwrap();
        let SinkKind::Mqtt(m) = &v311.sinks[0].kind else {
            panic!("an mqtt sink")
        };
        assert_eq!(m.protocol, SinkProtocol::V311);
        assert!(
            v311.warnings()
                .iter()
                .any(|w| w.starts_with("sink[0].protocol") && w.contains("drops it silently")),
            "{:?}",
            v311.warnings()
        );
        assert!(parse(CENTRAL, "").unwrap().warnings().is_empty());
    }

    #[test]
    fn without_sinks_a_pipeline_goes_where_it_went_before() {
        assert_eq!(*parse("", "").unwrap().pipelines[0].sinks, ["local"]);
        let up = "[uplink]\nclient_id = \"up\"\n";
        let cfg = parse(up, "").unwrap();
        assert_eq!(*cfg.pipelines[0].sinks, ["uplink"]);
        assert_eq!(cfg.sink_names(), ["local", "uplink"]);
        let both = parse(up, "sinks = [\"local\", \"uplink\"]").unwrap();
        assert_eq!(*both.pipelines[0].sinks, ["local", "uplink"]);
        assert_eq!(*parse(CENTRAL, "").unwrap().pipelines[0].sinks, ["local"]);
    }

    #[test]
    fn the_pipelines_the_last_run_recorded_equal_the_same_ones_with_sinks() {
        // `pipelines.json` (the start plan's record of the last run) holds no sinks: an
        // upgrade, or a change of sinks alone, must not look like a pipeline change.
        let cfg = parse(CENTRAL, "sinks = [\"local\", \"central\"]").unwrap();
        let spec = &cfg.pipelines[0];
        let json = serde_json::to_string(spec).unwrap();
        assert!(!json.contains("central"), "{json}");
        let back: PipelineSpec = serde_json::from_str(&json).unwrap();
        assert!(back.sinks.is_empty());
        assert_eq!(&back, spec);
    }

    #[test]
    fn names_duplicates_unknown_sinks_and_bad_kinds_are_problems_on_their_lines() {
        let p = problems("", "sinks = [\"central\"]");
        assert_eq!(p[0].0, "pipeline[0].sinks[0]");
        assert!(p[0].2.contains("not a sink"), "{p:?}");
        assert!(p[0].1.is_some(), "{p:?}");
        let p = problems("", "sinks = [\"uplink\"]");
        assert!(p[0].2.contains("needs an [uplink]"), "{p:?}");
        let p = problems(CENTRAL, "sinks = [\"central\", \"central\"]");
        assert_eq!(p[0].0, "pipeline[0].sinks[1]");
        assert!(p[0].2.contains("twice"), "{p:?}");
        let p = problems("", "sinks = []");
        assert_eq!(p[0].0, "pipeline[0].sinks");
        let p = problems(
            &format!("{CENTRAL}{}", CENTRAL.replace("box-17-results", "b2")),
            "",
        );
        assert_eq!(p[0].0, "sink[1].name");
        assert!(p[0].2.contains("names two sinks"), "{p:?}");
        for taken in ["local", "uplink"] {
            let p = problems(&CENTRAL.replace("\"central\"", &format!("\"{taken}\"")), "");
            assert_eq!(p[0].0, "sink[0].name", "{taken}");
            assert!(p[0].2.contains("is taken"), "{p:?}");
        }
        let p = problems(&CENTRAL.replace("\"mqtt\"", "\"kafka\""), "");
        assert_eq!(p[0].0, "sink[0].kind");
        assert!(p[0].2.contains("not a sink kind"), "{p:?}");
        let p = problems(&format!("{CENTRAL}protocol = \"4\"\n"), "");
        assert_eq!((p[0].0.as_str(), p[0].1), ("sink[0].protocol", Some(12)));
        let p = problems(&format!("{CENTRAL}protocl = \"5\"\n"), "");
        assert!(p[0].2.contains("unknown key"), "{p:?}");
        let p = problems(&CENTRAL.replace("site/box-17/", "a/#"), "");
        assert!(p.iter().any(|p| p.0 == "sink[0].topic_prefix"), "{p:?}");
        // A session shared with [mqtt] on the same broker.
        let p = problems(
            "[[sink]]\nname = \"s\"\nkind = \"mqtt\"\nclient_id = \"box-1\"\n",
            "",
        );
        assert_eq!(p[0].0, "sink[0].client_id");
        assert!(p[0].2.contains("same broker"), "{p:?}");
    }
}
