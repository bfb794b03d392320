//! `[[sink]] kind = "postgres"` and `kind = "jetstream"` (issue 30): their keys read into
//! the sink module's configs, checked by the sink module's own rules
//! (`PostgresConfig::problems`, `JetStreamConfig::problems`), each problem under its key.
//! A kind refuses the keys of the others, naming the kinds that have them.

use super::*;
use crate::config::{SinkConfig, SinkKind};
use crate::pipeline::spec::Emit;
use crate::sink::jetstream::JetStreamConfig;
use crate::sink::postgres::{PipelineTable, PostgresConfig};

/// Which kinds have each key (the ones not every kind has).
const KEYS_OF_KINDS: &[(&str, &[&str])] = &[
    ("protocol", &["mqtt"]),
    ("host", &["mqtt"]),
    ("port", &["mqtt"]),
    ("client_id", &["mqtt"]),
    ("keep_alive", &["mqtt"]),
    ("topic_prefix", &["mqtt"]),
    ("reconnect_min", &["mqtt"]),
    ("reconnect_max", &["mqtt"]),
    ("username", &["mqtt", "jetstream"]),
    ("url", &["postgres"]),
    ("table_prefix", &["postgres"]),
    ("source", &["postgres", "jetstream"]),
    ("servers", &["jetstream"]),
    ("credentials_file", &["jetstream"]),
    ("token_file", &["jetstream"]),
    ("stream", &["jetstream"]),
    ("subject_prefix", &["jetstream"]),
];

fn set_keys(r: &RawSink) -> Vec<&'static str> {
    let set = [
        ("protocol", r.protocol.is_some()),
        ("host", r.host.is_some()),
        ("port", r.port.is_some()),
        ("client_id", r.client_id.is_some()),
        ("keep_alive", r.keep_alive.is_some()),
        ("topic_prefix", r.topic_prefix.is_some()),
        ("reconnect_min", r.reconnect_min.is_some()),
        ("reconnect_max", r.reconnect_max.is_some()),
        ("username", r.username.is_some()),
        ("url", r.url.is_some()),
        ("table_prefix", r.table_prefix.is_some()),
        ("source", r.source.is_some()),
        ("servers", r.servers.is_some()),
        ("credentials_file", r.credentials_file.is_some()),
        ("token_file", r.token_file.is_some()),
        ("stream", r.stream.is_some()),
        ("subject_prefix", r.subject_prefix.is_some()),
    ];
    set.iter().filter(|(_, s)| *s).map(|(k, _)| *k).collect()
}

impl Validator {
    /// A key set that `kind` does not have is a problem naming the kinds that do.
    pub(super) fn not_of_kind(&mut self, at: &str, kind: &str, r: &RawSink) {
        for key in set_keys(r) {
            let Some((_, kinds)) = KEYS_OF_KINDS.iter().find(|(k, _)| *k == key) else {
                continue;
            };
            if !kinds.contains(&kind) {
                self.problem(
                    &format!("{at}.{key}"),
                    format!(
                        "is not a key of a `{kind}` sink (only of {})",
                        kinds
                            .iter()
                            .map(|k| format!("`{k}`"))
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                );
            }
        }
    }

    fn required(
        &mut self,
        at: &str,
        key: &str,
        value: Option<String>,
        why: &str,
    ) -> Option<String> {
        if value.is_none() {
            self.missing(&format!("{at}.{key}"), why);
        }
        value
    }

    /// Report the sink module's problems with a config, each under its key.
    fn report(&mut self, at: &str, problems: Vec<(&'static str, String)>) -> bool {
        let ok = problems.is_empty();
        for (key, p) in problems {
            self.problem(&format!("{at}.{key}"), p);
        }
        ok
    }

    pub(super) fn postgres_sink(
        &mut self,
        at: &str,
        name: Option<&str>,
        r: RawSink,
    ) -> Option<PostgresConfig> {
        let url = self.required(at, "url", r.url, "where the database is");
        let source = self.required(
            at,
            "source",
            r.source,
            "this box's identity, written into every row",
        );
        let password_file = self.path(&format!("{at}.password_file"), r.password_file);
        let tls = r.tls.map(|t| self.tls(at, t));
        let cfg = PostgresConfig {
            name: name?.to_string(),
            url: url?,
            password_file: password_file?,
            tls: match tls {
                Some(Some(t)) => Some(t),
                Some(None) => return None,
                None => None,
            },
            source: source?,
            table_prefix: r.table_prefix.unwrap_or_else(|| "cairn_".to_string()),
        };
        // Table names are checked once the pipelines it takes are known (`tables`).
        self.report(at, cfg.problems(&[])).then_some(cfg)
    }

    pub(super) fn jetstream_sink(
        &mut self,
        at: &str,
        name: Option<&str>,
        r: RawSink,
    ) -> Option<JetStreamConfig> {
        let servers = r.servers.unwrap_or_default();
        if servers.is_empty() {
            self.missing(&format!("{at}.servers"), "the NATS servers to connect to");
        }
        let stream = self.required(at, "stream", r.stream, "the stream results go to");
        let source = self.required(
            at,
            "source",
            r.source,
            "this box's identity, the start of every message ID",
        );
        let credentials_file = self.path(&format!("{at}.credentials_file"), r.credentials_file);
        let password_file = self.path(&format!("{at}.password_file"), r.password_file);
        let token_file = self.path(&format!("{at}.token_file"), r.token_file);
        let tls = match r.tls {
            Some(t) => Some(self.tls(at, t)?),
            None => None,
        };
        if servers.is_empty() {
            return None;
        }
        let cfg = JetStreamConfig {
            name: name?.to_string(),
            servers,
            credentials_file: credentials_file?,
            username: r.username,
            password_file: password_file?,
            token_file: token_file?,
            tls,
            stream: stream?,
            subject_prefix: r.subject_prefix.unwrap_or_default(),
            source: source?,
        };
        self.report(at, cfg.problems()).then_some(cfg)
    }

    /// Each `postgres` sink's tables, named from the pipelines routed to it: within
    /// PostgreSQL's identifier limit, and none the progress table. `false` after a problem.
    pub(super) fn tables(&mut self, pipelines: &[PipelineSpec], sinks: &[SinkConfig]) -> bool {
        let mut ok = true;
        for (i, s) in sinks.iter().enumerate() {
            let SinkKind::Postgres(cfg) = &s.kind else {
                continue;
            };
            let tables = pipeline_tables(pipelines, &s.name);
            ok &= self.report(&format!("sink[{i}]"), cfg.problems(&tables));
        }
        ok
    }
}

/// The pipelines routed to sink `sink`, as its tables need them.
pub(crate) fn pipeline_tables(pipelines: &[PipelineSpec], sink: &str) -> Vec<PipelineTable> {
    pipelines
        .iter()
        .filter(|p| p.sinks.iter().any(|s| s == sink))
        .map(|p| PipelineTable {
            pipeline: p.name.clone(),
            windowed: p.window.is_some(),
            changelog: p.emit == Emit::Changelog,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = "[mqtt]\nclient_id = \"box-1\"\n[storage]\ndata_dir = \"/d\"\n";

    fn parse(sink: &str, pipeline_name: &str) -> Result<Config, ConfigError> {
        parse_str(
            &format!(
                "{BASE}{sink}\n[[pipeline]]\nname = \"{pipeline_name}\"\ntopics = [\"t/#\"]\n\
                 event_id = \"/id\"\nkey = \"/k\"\naggregate = \"count\"\n\
                 output_topic = \"o/{{key}}\"\nsinks = [\"local\", \"db\"]\n"
            ),
            Path::new("t.toml"),
        )
    }

    fn problems(sink: &str, pipeline_name: &str) -> Vec<(String, String)> {
        match parse(sink, pipeline_name) {
            Err(ConfigError::Invalid { problems, .. }) => {
                problems.into_iter().map(|p| (p.key, p.message)).collect()
            }
            other => panic!("expected problems, got {other:#?}"),
        }
    }

    const PG: &str = "[[sink]]\nname = \"db\"\nkind = \"postgres\"\n\
                      url = \"postgresql://cairn@db.example:5432/telemetry\"\n\
                      password_file = \"/etc/cairn/db-password\"\nsource = \"box-17\"\n\
                      table_prefix = \"cairn_\"\n";

    #[test]
    fn the_postgres_keys_of_the_issue_are_read() {
        let cfg = parse(PG, "balances").unwrap();
        let SinkKind::Postgres(p) = &cfg.sinks[0].kind else {
            panic!("a postgres sink");
        };
        assert_eq!(p.name, "db");
        assert_eq!(p.url, "postgresql://cairn@db.example:5432/telemetry");
        assert_eq!(p.source, "box-17");
        assert_eq!(p.table_prefix, "cairn_");
        assert_eq!(
            p.password_file.as_deref(),
            Some(Path::new("/etc/cairn/db-password"))
        );
        assert_eq!(
            pipeline_tables(&cfg.pipelines, "db"),
            [PipelineTable {
                pipeline: "balances".into(),
                windowed: false,
                changelog: false
            }]
        );
    }

    #[test]
    fn the_jetstream_keys_of_the_issue_are_read() {
        let cfg = parse(
            "[[sink]]\nname = \"db\"\nkind = \"jetstream\"\n\
             servers = [\"nats://n1.example:4222\", \"nats://n2.example:4222\"]\n\
             username = \"box17\"\npassword_file = \"/p\"\nstream = \"RESULTS\"\n\
             subject_prefix = \"site.box-17\"\nsource = \"box-17\"\n",
            "balances",
        )
        .unwrap();
        let SinkKind::JetStream(j) = &cfg.sinks[0].kind else {
            panic!("a jetstream sink");
        };
        assert_eq!(j.servers.len(), 2);
        assert_eq!(
            (
                j.stream.as_str(),
                j.subject_prefix.as_str(),
                j.source.as_str()
            ),
            ("RESULTS", "site.box-17", "box-17")
        );
        assert_eq!(j.username.as_deref(), Some("box17"));
    }

    #[test]
    fn missing_wrong_and_foreign_keys_are_problems_under_their_names() {
        let p = problems(
            "[[sink]]\nname = \"db\"\nkind = \"postgres\"\nhost = \"x\"\nstream = \"S\"\n",
            "balances",
        );
        let keys: Vec<&str> = p.iter().map(|(k, _)| k.as_str()).collect();
        for want in [
            "sink[0].host",
            "sink[0].stream",
            "sink[0].url",
            "sink[0].source",
        ] {
            assert!(keys.contains(&want), "{want}: {p:?}");
        }
        assert!(
            p.iter()
                .any(|(k, m)| k == "sink[0].stream" && m.contains("only of `jetstream`")),
            "{p:?}"
        );
        let p = problems(
            &PG.replace(
                "table_prefix = \"cairn_\"",
                "table_prefix = \"cairn_\"\nurl2 = 1",
            ),
            "x",
        );
        assert!(p[0].1.contains("unknown key `url2`"), "{p:?}");
        let p = problems(PG, "progress");
        assert!(
            p.iter()
                .any(|(k, m)| k == "sink[0].table_prefix" && m.contains("progress table")),
            "{p:?}"
        );
        let p = problems(
            "[[sink]]\nname = \"db\"\nkind = \"jetstream\"\nservers = []\nstream = \"A B\"\n\
             source = \"a/b\"\ntopic_prefix = \"x/\"\n",
            "balances",
        );
        let keys: Vec<&str> = p.iter().map(|(k, _)| k.as_str()).collect();
        for want in ["sink[0].servers", "sink[0].topic_prefix"] {
            assert!(keys.contains(&want), "{want}: {p:?}");
        }
    }
}
