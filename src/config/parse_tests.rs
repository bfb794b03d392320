//! The config parser's tests: one per rule, reading as the list of rules. Long because
//! the rules are many; split by section they would each need the shared config texts.

use super::names::check_filter;
use super::*;

/// The smallest valid config: only the required keys.
const MINIMAL: &str = r#"[mqtt]
client_id = "box-1"

[storage]
data_dir = "/var/lib/cairn"

[[pipeline]]
name = "balances"
topics = ["payments/#"]
event_id = "/id"
key = "/account"
value = "/amount"
aggregate = "sum"
output_topic = "balances/{key}"
"#;

fn parse(text: &str) -> Result<Config, ConfigError> {
    parse_str(text, Path::new("t.toml"))
}

fn problems(text: &str) -> Vec<Problem> {
    match parse(text) {
        Err(ConfigError::Invalid { problems, .. }) => problems,
        other => panic!("expected problems, got {other:#?}"),
    }
}

/// The only problem in `text`.
fn only(text: &str) -> Problem {
    let p = problems(text);
    assert_eq!(p.len(), 1, "{p:#?}");
    p.into_iter().next().unwrap()
}

/// 1-based line of the first line of `text` containing `needle`.
fn line_of(text: &str, needle: &str) -> usize {
    text.lines()
        .position(|l| l.contains(needle))
        .unwrap_or_else(|| panic!("`{needle}` not in text"))
        + 1
}

/// MINIMAL with `line` inserted right below the header `[section]` (added if absent).
fn with(section: &str, line: &str) -> String {
    let header = format!("[{section}]\n");
    match MINIMAL.find(&header) {
        Some(i) => {
            let at = i + header.len();
            format!("{}{line}\n{}", &MINIMAL[..at], &MINIMAL[at..])
        }
        None => format!("{MINIMAL}\n{header}{line}\n"),
    }
}

/// MINIMAL with `line` added to its pipeline.
fn with_pipeline(line: &str) -> String {
    format!("{MINIMAL}{line}\n")
}

fn assert_problem(p: &Problem, key: &str, line: usize, message_has: &str) {
    assert_eq!(p.key, key, "{p:#?}");
    assert_eq!(p.line, Some(line), "{p:#?}");
    assert!(
        p.message.contains(message_has),
        "message `{}` lacks `{message_has}`",
        p.message
    );
}

#[test]
fn the_example_file_loads() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/cairn.toml");
    let cfg = load(&path).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(cfg.mqtt.host, "127.0.0.1");
    assert_eq!(cfg.mqtt.port, 1883);
    assert_eq!(cfg.storage.data_dir, PathBuf::from("./data"));
    assert_eq!(cfg.pipelines.len(), 1);
    assert_eq!(cfg.pipelines[0].name, "balances");
    assert_eq!(cfg.source, path);
    let s = summary(&cfg);
    assert!(s.contains("client_id = \"cairn-edge-1\"\n"), "{s}");
    assert!(
        s.contains("name = \"balances\"\ntopics = [\"payments/#\"]"),
        "{s}"
    );
}

#[test]
fn the_example_file_spells_out_the_defaults() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/cairn.toml");
    let example = load(&path).unwrap();
    let minimal = parse(MINIMAL).unwrap();
    assert_eq!(example.log, minimal.log);
    assert_eq!(example.checkpoint, minimal.checkpoint);
    assert_eq!(example.outbox, minimal.outbox);
    assert_eq!(
        example.pipelines[0].dedup_window_ms,
        minimal.pipelines[0].dedup_window_ms
    );
    assert_eq!(example.mqtt.channel_capacity, minimal.mqtt.channel_capacity);
}

#[test]
fn a_load_error_names_the_file() {
    let e = load(Path::new("/nonexistent/cairn.toml")).unwrap_err();
    assert!(matches!(e, ConfigError::Read { .. }));
    assert!(
        e.to_string()
            .starts_with("cannot read /nonexistent/cairn.toml: "),
        "{e}"
    );
}

#[test]
fn a_minimal_config_gets_safe_default_limits() {
    let cfg = parse(MINIMAL).unwrap();
    let m = &cfg.mqtt;
    assert_eq!(m.host, "127.0.0.1");
    assert_eq!(m.port, 1883);
    assert_eq!(m.client_id, "box-1");
    assert_eq!(m.keep_alive, Duration::from_secs(30));
    assert_eq!(
        (m.username.clone(), m.password_file.clone(), m.tls.clone()),
        (None, None, None)
    );
    assert_eq!(m.ingest_batch, 20);
    assert_eq!(m.reconnect_min, Duration::from_millis(100));
    assert_eq!(m.reconnect_max, Duration::from_secs(30));
    assert_eq!(m.channel_capacity, 1024);
    assert_eq!(cfg.storage.data_dir, PathBuf::from("/var/lib/cairn"));
    assert_eq!(cfg.storage.cache_size, 4 << 20);
    assert_eq!(
        cfg.log,
        LogConfig {
            segment_size: 64 << 20,
            max_size: 2 << 30,
            retention: Duration::from_secs(24 * 3600),
            commit_interval: Duration::from_millis(5),
            max_payload: 256 << 10,
        }
    );
    assert_eq!(
        cfg.checkpoint,
        CheckpointConfig {
            interval: Duration::from_secs(5),
            max_records: 20_000,
            max_keys: 3_072
        }
    );
    assert_eq!(
        cfg.outbox,
        OutboxConfig {
            max_entries: 100_000,
            max_size: 1 << 30,
            inflight: 100,
            drain_timeout: Duration::from_secs(5)
        }
    );
    assert_eq!(cfg.metrics, MetricsConfig { listen: None });
    assert_eq!(
        cfg.savepoint,
        SavepointConfig {
            interval: None,
            keep: 3
        }
    );
    assert_eq!(
        cfg.pipelines,
        vec![PipelineSpec {
            name: "balances".into(),
            topics: vec!["payments/#".into()],
            format: Format::Json,
            event_id: Field::Pointer("/id".into()),
            key: Field::Pointer("/account".into()),
            value: Some(Field::Pointer("/amount".into())),
            event_time: None,
            aggregate: AggregateSpec::One(Aggregate::Sum),
            window: None,
            dedup_window_ms: 7 * 86_400_000,
            output_topic: "balances/{key}".into(),
            retain: true,
            emit: Emit::Upsert,
            start: Start::Latest,
            max_key_len: 128,
            max_keys: 1_000_000,
            max_id_len: 256,
            max_future_ms: 600_000,
            metrics: None,
            filter: None,
            sinks: crate::pipeline::spec::Route(vec!["local".into()]),
        }]
    );
}

#[test]
fn a_problem_displays_as_file_line_key_message() {
    let p = Problem {
        file: "cairn.toml".into(),
        key: "log.max_size".into(),
        line: Some(12),
        message: "too small".into(),
    };
    assert_eq!(p.to_string(), "cairn.toml:12: log.max_size: too small");
    let no_line = Problem {
        line: None,
        ..p.clone()
    };
    assert_eq!(no_line.to_string(), "cairn.toml: log.max_size: too small");
    let no_key = Problem {
        key: String::new(),
        ..p
    };
    assert_eq!(no_key.to_string(), "cairn.toml:12: too small");
}

#[test]
fn an_invalid_config_error_lists_every_problem_on_its_own_line() {
    let text = with("mqtt", "colour = 1\nport = 0");
    let e = parse(&text).unwrap_err().to_string();
    let lines: Vec<&str> = e.lines().collect();
    assert_eq!(lines[0], "t.toml: 2 problems in the configuration", "{e}");
    assert!(
        lines[1].starts_with("  t.toml:2: mqtt.colour: unknown key `colour`"),
        "{e}"
    );
    assert!(
        lines[2].starts_with("  t.toml:3: mqtt.port: must be between 1 and 65535, found 0"),
        "{e}"
    );
}

#[test]
fn an_unknown_top_level_key_is_named_with_its_line() {
    // At the top: a bare key below `[[pipeline]]` would belong to the pipeline.
    let text = format!("verbose = true\n{MINIMAL}");
    let p = only(&text);
    assert_problem(&p, "verbose", 1, "unknown key `verbose`");
    assert!(
        p.message.contains("`mqtt`"),
        "lists the valid keys: {}",
        p.message
    );
}

#[test]
fn an_unknown_top_level_table_is_named_with_its_header_line() {
    let text = format!("{MINIMAL}\n[loging]\nlevel = \"debug\"\n");
    assert_problem(
        &only(&text),
        "loging",
        line_of(&text, "[loging]"),
        "unknown key `loging`",
    );
}

#[test]
fn an_unknown_key_inside_a_pipeline_names_its_index_and_line() {
    let text = format!(
        "{MINIMAL}\n[[pipeline]]\nname = \"b\"\ntopics = [\"x/+\"]\nevent_id = \"/id\"\nkey = \"/k\"\n\
         aggregate = \"count\"\noutput_topic = \"b/{{key}}\"\nretian = false\n"
    );
    assert_problem(
        &only(&text),
        "pipeline[1].retian",
        line_of(&text, "retian"),
        "unknown key `retian`",
    );
}

#[test]
fn an_unknown_key_inside_an_inline_window_is_named() {
    let text = with_pipeline("window = { size = \"1m\", lateness = \"5m\" }");
    assert_problem(
        &only(&text),
        "pipeline[0].window.lateness",
        line_of(&text, "window ="),
        "unknown key `lateness`, expected one of `size`, `slide`, `allowed_lateness`",
    );
}

#[test]
fn a_wrong_type_names_the_key_and_the_expected_type() {
    let text = with("mqtt", "port = \"1883\"");
    assert_problem(
        &only(&text),
        "mqtt.port",
        2,
        "wrong type: found string \"1883\", expected an integer",
    );
    let text = with_pipeline("retain = \"yes\"");
    assert_problem(
        &only(&text),
        "pipeline[0].retain",
        line_of(&text, "retain"),
        "expected a boolean",
    );
    let text = format!("metrics = 5\n{MINIMAL}");
    assert_problem(
        &only(&text),
        "metrics",
        1,
        "wrong type: found integer `5`, expected a table",
    );
}

#[test]
fn a_wrong_type_inside_an_array_names_the_element() {
    let text = MINIMAL.replace(
        "topics = [\"payments/#\"]",
        "topics = [\n  \"payments/#\",\n  7,\n]",
    );
    assert_problem(
        &only(&text),
        "pipeline[0].topics[1]",
        line_of(&text, "  7,"),
        "found integer `7`",
    );
}

#[test]
fn a_bare_number_for_a_duration_says_which_units_are_accepted() {
    let text = with("mqtt", "keep_alive = 30");
    assert_problem(
        &only(&text),
        "mqtt.keep_alive",
        2,
        "`30` has no unit: a duration is a string such as \"30s\"; accepted units: ms, s, m, h, d",
    );
    let text = with("log", "segment_size = 64");
    assert_problem(
        &only(&text),
        "log.segment_size",
        line_of(&text, "segment_size"),
        "accepted units: B, KiB, MiB",
    );
    let text = with("log", "retention = \"30\"");
    assert_problem(
        &only(&text),
        "log.retention",
        line_of(&text, "retention"),
        "`30` has no unit: write e.g. \"30s\"",
    );
}

#[test]
fn a_bad_duration_names_the_key_and_line() {
    let text = with_pipeline("window = { size = \"1 minute\" }");
    assert_problem(
        &only(&text),
        "pipeline[0].window.size",
        line_of(&text, "window"),
        "unknown unit `minute`",
    );
    let text = with("checkpoint", "interval = \"0.5s\"");
    assert_problem(
        &only(&text),
        "checkpoint.interval",
        line_of(&text, "interval"),
        "fractions are not accepted",
    );
}

#[test]
fn a_bad_size_names_the_key_and_line() {
    let text = with("storage", "cache_size = \"16M\"");
    assert_problem(
        &only(&text),
        "storage.cache_size",
        line_of(&text, "cache_size"),
        "unknown unit `M`",
    );
}

#[test]
fn a_missing_required_key_points_at_its_table_header() {
    let text = MINIMAL.replace("client_id = \"box-1\"\n", "host = \"broker\"\n");
    assert_problem(
        &only(&text),
        "mqtt.client_id",
        1,
        "missing required key: the broker keeps",
    );
    let text = MINIMAL.replace("aggregate = \"sum\"\n", "");
    assert_problem(
        &only(&text),
        "pipeline[0].aggregate",
        line_of(&text, "[[pipeline]]"),
        "missing required key",
    );
}

#[test]
fn a_missing_required_table_has_no_line() {
    let text = MINIMAL.replace("[storage]\ndata_dir = \"/var/lib/cairn\"\n", "");
    let p = only(&text);
    assert_eq!(
        (p.key.as_str(), p.line),
        ("storage.data_dir", None),
        "{p:#?}"
    );
    assert_eq!(
        p.to_string(),
        format!("t.toml: storage.data_dir: {}", p.message)
    );
}

#[test]
fn a_config_without_pipelines_is_refused() {
    let text = &MINIMAL[..MINIMAL.find("[[pipeline]]").unwrap()];
    let p = only(text);
    assert_eq!((p.key.as_str(), p.line), ("pipeline", None));
    assert!(p.message.contains("at least one `[[pipeline]]`"));
}

#[test]
fn a_single_bracket_pipeline_gets_a_hint() {
    let text = MINIMAL.replace("[[pipeline]]", "[pipeline]");
    let p = only(&text);
    assert_problem(
        &p,
        "pipeline",
        line_of(&text, "[pipeline]"),
        "found a table, expected an array",
    );
    assert!(p.message.contains("double brackets"), "{}", p.message);
}

#[test]
fn impossible_log_limits_are_refused() {
    let text = with("log", "segment_size = \"64MiB\"\nmax_size = \"100MiB\"");
    assert_problem(
        &only(&text),
        "log.max_size",
        line_of(&text, "max_size"),
        "must be at least 2 × log.segment_size = 128MiB, found 100MiB",
    );
    let text = with("log", "segment_size = \"1MiB\"\nmax_payload = \"1MiB\"");
    assert_problem(
        &only(&text),
        "log.max_payload",
        line_of(&text, "max_payload"),
        "so at most 960KiB, found 1MiB",
    );
    let text = with("log", "commit_interval = \"2s\"");
    assert_problem(
        &only(&text),
        "log.commit_interval",
        line_of(&text, "commit_interval"),
        "must be at most 1s",
    );
}

#[test]
fn a_dependent_check_is_skipped_when_its_input_is_already_wrong() {
    // segment_size is unreadable: max_size is not also blamed against a guessed default.
    let text = with("log", "segment_size = \"lots\"\nmax_size = \"1MiB\"");
    assert_problem(
        &only(&text),
        "log.segment_size",
        line_of(&text, "segment_size"),
        "not a size",
    );
}

#[test]
fn mqtt_limits_are_checked_against_each_other() {
    let text = with("mqtt", "ingest_batch = 500\nchannel_capacity = 1000");
    assert_problem(
        &only(&text),
        "mqtt.channel_capacity",
        3,
        "at least 2 × (mqtt.ingest_batch + outbox.inflight) = 1200, found 1000",
    );
    let text = with("mqtt", "reconnect_min = \"5s\"\nreconnect_max = \"1s\"");
    assert_problem(
        &only(&text),
        "mqtt.reconnect_max",
        3,
        "must be at least mqtt.reconnect_min (5s)",
    );
    let text = with("mqtt", "keep_alive = \"1500ms\"");
    assert_problem(
        &only(&text),
        "mqtt.keep_alive",
        2,
        "between 5s and 18h12m15s",
    );
    let text = with("mqtt", "keep_alive = \"5500ms\"");
    assert_problem(&only(&text), "mqtt.keep_alive", 2, "must be whole seconds");
    let text = MINIMAL.replace("box-1", "box 1");
    assert_problem(
        &only(&text),
        "mqtt.client_id",
        2,
        "`box 1` is not a valid client ID",
    );
    let text = with("mqtt", "password_file = \"/etc/cairn/pw\"");
    assert_problem(
        &only(&text),
        "mqtt.password_file",
        2,
        "needs `mqtt.username`",
    );
}

#[test]
fn tls_needs_cert_and_key_together() {
    let text = with(
        "mqtt",
        "tls = { ca_file = \"ca.pem\", cert_file = \"c.pem\" }",
    );
    assert_problem(
        &only(&text),
        "mqtt.tls.cert_file",
        2,
        "needs `key_file` too",
    );
    let text = with(
        "mqtt",
        "tls = { cert_file = \"c.pem\", key_file = \"k.pem\" }",
    );
    assert_problem(&only(&text), "mqtt.tls.ca_file", 2, "missing required key");
    let text = with(
        "mqtt",
        "tls = { ca_file = \"ca.pem\", cert_file = \"c.pem\", key_file = \"k.pem\" }",
    );
    let tls = parse(&text).unwrap().mqtt.tls.unwrap();
    assert_eq!(tls.key_file, Some(PathBuf::from("k.pem")));
}

#[test]
fn metrics_listen_must_be_a_loopback_socket_address() {
    let cfg = parse(&with("metrics", "listen = \"127.0.0.1:9108\"")).unwrap();
    assert_eq!(cfg.metrics.listen.as_deref(), Some("127.0.0.1:9108"));
    let text = with("metrics", "listen = \"0.0.0.0:9108\"");
    assert_problem(
        &only(&text),
        "metrics.listen",
        line_of(&text, "listen"),
        "not a loopback address",
    );
    let text = with("metrics", "listen = \"localhost\"");
    assert_problem(
        &only(&text),
        "metrics.listen",
        line_of(&text, "listen"),
        "not an IP:port address",
    );
}

#[test]
fn savepoints_are_off_by_default_and_bound_the_retention() {
    let cfg = parse(&with("savepoint", "interval = \"1h\"\nkeep = 5")).unwrap();
    assert_eq!(cfg.savepoint.interval, Some(Duration::from_secs(3600)));
    assert_eq!(cfg.savepoint.keep, 5);
    let text = with("savepoint", "interval = \"2d\"");
    let p = only(&text);
    assert_eq!(p.key, "log.retention");
    assert!(
        p.message.contains("at least savepoint.interval (2d)"),
        "{}",
        p.message
    );
}

#[test]
fn a_bad_json_pointer_is_reported_with_the_field_parser_message() {
    let text = MINIMAL.replace("key = \"/account\"", "key = \"account\"");
    assert_problem(
        &only(&text),
        "pipeline[0].key",
        line_of(&text, "key = \"account\""),
        "`account` is not a JSON pointer",
    );
}

#[test]
fn a_bad_topic_filter_names_the_element() {
    let text = MINIMAL.replace("[\"payments/#\"]", "[\"payments/#\", \"a/#/b\", \"x+/y\"]");
    let p = problems(&text);
    assert_eq!(p.len(), 2, "{p:#?}");
    assert_problem(
        &p[0],
        "pipeline[0].topics[1]",
        line_of(&text, "topics"),
        "`#` must be the last level",
    );
    assert_problem(
        &p[1],
        "pipeline[0].topics[2]",
        line_of(&text, "topics"),
        "`+` must be a whole level",
    );
    let text = MINIMAL.replace("[\"payments/#\"]", "[]");
    assert_problem(
        &only(&text),
        "pipeline[0].topics",
        line_of(&text, "topics"),
        "is empty",
    );
}

#[test]
fn topic_filters_follow_mqtt_rules() {
    for ok in ["#", "+", "a/+/c", "a/#", "/a", "a//b", "$SYS/#", "+/+/#"] {
        assert_eq!(check_filter(ok), Ok(()), "{ok}");
    }
    for bad in ["", "a#", "#/a", "a/b#", "a+", "a/+b/c", "a\0b"] {
        assert!(check_filter(bad).is_err(), "{bad:?}");
    }
}

/// Issue 27: config text that becomes a topic (filters, output templates, the uplink's
/// prefix, the literal parts of key and event-ID templates) holds no code point an MQTT
/// receiver may refuse; each is reported at its line, naming the code point.
#[test]
fn code_points_a_receiver_may_refuse_are_refused_in_config_text_at_their_line() {
    let cases = [
        (
            "topics = [\"payments/#\"]",
            "topics = [\"payments/\\uFFFF/#\"]",
            "pipeline[0].topics[0]",
            "U+FFFF",
        ),
        (
            "topics = [\"payments/#\"]",
            "topics = [\"in/\\u0085\"]",
            "pipeline[0].topics[0]",
            "U+0085",
        ),
        (
            "output_topic = \"balances/{key}\"",
            "output_topic = \"b/\\uFDD0/{key}\"",
            "pipeline[0].output_topic",
            "U+FDD0",
        ),
        (
            "output_topic = \"balances/{key}\"",
            "output_topic = \"b/{key}\\U0010FFFE\"",
            "pipeline[0].output_topic",
            "U+10FFFE",
        ),
        (
            "key = \"/account\"",
            "key = \"{/account}-\\uFFFE\"",
            "pipeline[0].key",
            "U+FFFE",
        ),
        (
            "event_id = \"/id\"",
            "event_id = \"\\u0001{/id}\"",
            "pipeline[0].event_id",
            "U+0001",
        ),
    ];
    for (from, to, key, code) in cases {
        let text = MINIMAL.replace(from, to);
        let line = line_of(&text, to.split(' ').next().unwrap());
        assert_problem(&only(&text), key, line, code);
    }
    let text = format!("{MINIMAL}[uplink]\nclient_id = \"up\"\ntopic_prefix = \"site/\\uFDEF/\"\n");
    assert_problem(
        &only(&text),
        "uplink.topic_prefix",
        line_of(&text, "topic_prefix"),
        "U+FDEF",
    );
    // A pointer may name such a member: it reads the payload, it is not a topic.
    assert!(parse(&MINIMAL.replace("\"/account\"", "\"/acc\\uFFFFount\"")).is_ok());
    // And their neighbours are text like any other.
    assert!(parse(&MINIMAL.replace("balances/{key}", "b/\\uFFFD\\uFDCF/{key}")).is_ok());
}

#[test]
fn a_duplicate_pipeline_name_is_refused() {
    let second = &MINIMAL[MINIMAL.find("[[pipeline]]").unwrap()..];
    let text = format!("{MINIMAL}\n{second}");
    let header2 = text.rfind("[[pipeline]]").unwrap();
    let line = text[..header2].lines().count() + 2;
    assert_problem(
        &only(&text),
        "pipeline[1].name",
        line,
        "duplicate pipeline name `balances`, also used by pipeline[0]",
    );
}

#[test]
fn output_topics_are_checked() {
    let cases = [
        ("balances/all", "must contain `{key}`"),
        ("balances/+/{key}", "wildcards"),
        ("$SYS/{key}", "reserved for the broker"),
        (
            "b/{key}/{window_start}",
            "`{window_start}` needs a `window`",
        ),
        ("b/{key}/{version}", "unknown placeholder `{version}`"),
        ("b/{key", "unclosed `{`"),
    ];
    for (topic, why) in cases {
        let text = MINIMAL.replace("balances/{key}", topic);
        assert_problem(
            &only(&text),
            "pipeline[0].output_topic",
            line_of(&text, "output_topic"),
            why,
        );
    }
    let text = with_pipeline("window = { size = \"1m\" }")
        .replace("balances/{key}", "b/{key}/{window_start}");
    let p = &parse(&text).unwrap().pipelines[0];
    assert_eq!(
        p.window,
        Some(WindowSpec {
            size_ms: 60_000,
            allowed_lateness_ms: 0,
            slide_ms: None
        })
    );
}

#[test]
fn count_needs_no_value_and_other_aggregates_do() {
    let text = MINIMAL
        .replace("value = \"/amount\"\n", "")
        .replace("\"sum\"", "\"count\"");
    let p = &parse(&text).unwrap().pipelines[0];
    assert_eq!(
        (p.aggregate.clone(), p.value.clone()),
        (AggregateSpec::One(Aggregate::Count), None)
    );
    let text = MINIMAL.replace("value = \"/amount\"\n", "");
    assert_problem(
        &only(&text),
        "pipeline[0].value",
        line_of(&text, "[[pipeline]]"),
        "`sum` needs the field",
    );
    let text = MINIMAL.replace("\"sum\"", "\"count\"");
    assert_problem(
        &only(&text),
        "pipeline[0].value",
        line_of(&text, "value"),
        "count counts events",
    );
    let text = MINIMAL.replace("\"sum\"", "\"median\"");
    assert_problem(
        &only(&text),
        "pipeline[0].aggregate",
        line_of(&text, "aggregate"),
        "expected one of sum, count",
    );
}

#[test]
fn delimited_pipelines_read_fields_by_position() {
    let text = MINIMAL
        .replace("\"/id\"", "\"0\"")
        .replace("\"/account\"", "\"1\"")
        .replace("\"/amount\"", "\"2\"")
        .replace("aggregate", "format = \"delimited\"\naggregate");
    let p = &parse(&text).unwrap().pipelines[0];
    assert_eq!(
        p.format,
        Format::Delimited {
            separator: "/".into()
        }
    );
    assert_eq!(
        (p.key.clone(), p.value.clone()),
        (Field::Index(1), Some(Field::Index(2)))
    );
    let text = with_pipeline("separator = \",\"");
    assert_problem(
        &only(&text),
        "pipeline[0].separator",
        line_of(&text, "separator"),
        "only applies to format = \"delimited\"",
    );
    let text = with_pipeline("format = \"delimited\"\nseparator = \"\"");
    // The JSON pointers are not positions, but an empty separator is reported first.
    let p = problems(&text);
    assert!(p.iter().any(|p| p.key == "pipeline[0].separator"), "{p:#?}");
    let text = with_pipeline("format = \"csv\"");
    assert_problem(
        &only(&text),
        "pipeline[0].format",
        line_of(&text, "format"),
        "expected \"json\", \"delimited\" or \"sparkplug_b\"",
    );
}

#[test]
fn many_problems_are_reported_at_once_in_file_order() {
    let text = r#"[mqtt]
client_id = "box-1"
colour = "blue"
port = "high"
flavour = 3

[storage]
data_dir = "/data"

[log]
retention = "forever"
max_size = "1MiB"

[[pipeline]]
name = "bad name"
topics = ["a/#/b"]
event_id = "id"
key = "/k"
aggregate = "sum"
output_topic = "x"
"#;
    let got: Vec<(String, Option<usize>)> = problems(text)
        .into_iter()
        .map(|p| (p.key, p.line))
        .collect();
    let want = [
        ("mqtt.colour", 3),
        ("mqtt.port", 4),
        ("mqtt.flavour", 5),
        ("log.retention", 11),
        ("log.max_size", 12),
        ("pipeline[0].name", 15),
        ("pipeline[0].topics[0]", 16),
        ("pipeline[0].event_id", 17),
        ("pipeline[0].output_topic", 20),
        ("pipeline[0].value", 14),
    ];
    let mut want: Vec<(String, Option<usize>)> = want
        .iter()
        .map(|(k, l)| (k.to_string(), Some(*l)))
        .collect();
    want.sort_by_key(|(_, l)| *l);
    assert_eq!(got, want);
}

#[test]
fn a_broken_window_does_not_hide_the_keys_after_it() {
    let text = with_pipeline("window = { size = \"0s\" }").replace("balances/{key}", "balances/+");
    let keys: Vec<String> = problems(&text).into_iter().map(|p| p.key).collect();
    assert_eq!(
        keys,
        ["pipeline[0].output_topic", "pipeline[0].window.size"]
    );
}

#[test]
fn a_key_that_failed_its_type_is_not_also_called_missing() {
    let text = MINIMAL.replace("client_id = \"box-1\"", "client_id = 1");
    assert_problem(&only(&text), "mqtt.client_id", 2, "wrong type");
}

#[test]
fn a_syntax_error_is_one_problem_with_its_line() {
    let text = MINIMAL
        .replace("port", "x")
        .replace("data_dir = ", "data_dir ");
    let p = only(&text);
    assert_eq!(p.key, "");
    assert_eq!(p.line, Some(line_of(&text, "data_dir ")));
    assert!(
        p.message.starts_with("TOML syntax error at column "),
        "{}",
        p.message
    );
    let text = with("mqtt", "port = 1\nport = 2");
    let p = only(&text);
    assert_eq!(p.line, Some(3), "{p:#?}");
    assert!(p.message.contains("duplicate key"), "{}", p.message);
}

#[test]
fn durations_parse_with_units() {
    use units::parse_duration_ms as d;
    assert_eq!(d("250ms"), Ok(250));
    assert_eq!(d("5s"), Ok(5_000));
    assert_eq!(d("30m"), Ok(1_800_000));
    assert_eq!(d("24h"), Ok(86_400_000));
    assert_eq!(d("7d"), Ok(604_800_000));
    assert_eq!(d("1h30m"), Ok(5_400_000));
    assert_eq!(d("1d2h3m4s5ms"), Ok(93_784_005));
    assert_eq!(d("0s"), Ok(0));
    assert_eq!(d(" 5s "), Ok(5_000));
    for bad in [
        "", "5", "s", "-5s", "5 s s", "1.5s", "5sec", "30m1h", "1h1h", "5S", "1h30",
    ] {
        assert!(d(bad).is_err(), "{bad:?} should not parse");
    }
}

#[test]
fn a_duration_too_large_is_an_error_not_a_wrap() {
    use units::parse_duration_ms as d;
    assert_eq!(d("18446744073709551615ms"), Ok(u64::MAX));
    assert!(
        d("18446744073709551616ms")
            .unwrap_err()
            .contains("too large")
    );
    assert!(d("213503982334602d").unwrap_err().contains("too large"));
    assert!(
        d("213503982334601d1000000000h")
            .unwrap_err()
            .contains("too large")
    );
}

#[test]
fn sizes_parse_with_binary_and_decimal_units() {
    use units::parse_size as s;
    assert_eq!(s("100B"), Ok(100));
    assert_eq!(s("64KiB"), Ok(65_536));
    assert_eq!(s("512MiB"), Ok(512 << 20));
    assert_eq!(s("2GiB"), Ok(2 << 30));
    assert_eq!(s("1TiB"), Ok(1 << 40));
    assert_eq!(s("5KB"), Ok(5_000));
    assert_eq!(s("5kB"), Ok(5_000));
    assert_eq!(s("3MB"), Ok(3_000_000));
    assert_eq!(s("2GB"), Ok(2_000_000_000));
    assert_eq!(s("64 MiB"), Ok(64 << 20));
    for bad in ["", "64", "MiB", "64M", "64mib", "1.5GiB", "-1B", "64MiB!"] {
        assert!(s(bad).is_err(), "{bad:?} should not parse");
    }
    assert!(s("64").unwrap_err().contains("accepted units: B, KiB"));
}

#[test]
fn a_size_too_large_is_an_error_not_a_wrap() {
    use units::parse_size as s;
    assert_eq!(s("16777215TiB"), Ok(16_777_215 << 40));
    assert!(s("16777216TiB").unwrap_err().contains("too large"));
    assert!(
        s("99999999999999999999B")
            .unwrap_err()
            .contains("too large")
    );
}

#[test]
fn durations_and_sizes_format_back_to_their_spelling() {
    for text in ["250ms", "5s", "30m", "7d", "1h30m", "0s", "1d2h3m4s5ms"] {
        assert_eq!(format_duration_ms(parse_duration_ms(text).unwrap()), text);
    }
    for text in ["100B", "64KiB", "512MiB", "2GiB", "5KB", "3MB", "1000001B"] {
        assert_eq!(format_size(parse_size(text).unwrap()), text);
    }
}

#[test]
fn every_pipeline_key_can_be_set() {
    let text = r#"[mqtt]
client_id = "box-1"
[storage]
data_dir = "d"
[[pipeline]]
name = "energy"
topics = ["meters/+/reading", "meters/+/backfill"]
format = "delimited"
separator = ";"
event_id = "{0}-{1}"
key = "1"
value = "2"
event_time = "3"
aggregate = "max"
dedup_window = "1d"
output_topic = "energy/{key}/{window_start}"
retain = false
emit = "changelog"
max_key_len = 64
max_keys = 10
[pipeline.window]
size = "15m"
allowed_lateness = "1m"
"#;
    let cfg = parse(text).unwrap();
    let p = &cfg.pipelines[0];
    assert_eq!(
        p.window,
        Some(WindowSpec {
            size_ms: 900_000,
            allowed_lateness_ms: 60_000,
            slide_ms: None
        })
    );
    assert_eq!(p.event_time, Some(Field::Index(3)));
    assert_eq!(
        (p.retain, p.emit, p.max_key_len, p.max_keys),
        (false, Emit::Changelog, 64, 10)
    );
    assert_eq!(p.dedup_window_ms, 86_400_000);
    let s = summary(&cfg);
    for line in [
        "aggregate = \"max\"",
        "value = \"2\"",
        "key = \"1\"",
        "window.size = \"15m\"",
        "window.allowed_lateness = \"1m\"",
    ] {
        assert!(s.contains(&format!("{line}\n")), "{line}: {s}");
    }
}

#[test]
fn aggregate_lists_are_checked_name_by_name() {
    let text = MINIMAL.replace(
        "aggregate = \"sum\"",
        "aggregate = [\"min\", \"p95\", \"median\", \"min\", \"p99.9\"]",
    );
    let p = problems(&text);
    assert_eq!(p.len(), 2, "{p:#?}");
    let line = line_of(&text, "median");
    assert_problem(
        &p[0],
        "pipeline[0].aggregate[2]",
        line,
        "`median` is not an aggregate",
    );
    assert_problem(
        &p[1],
        "pipeline[0].aggregate[3]",
        line,
        "`min` is listed twice",
    );
    let ok = MINIMAL.replace("aggregate = \"sum\"", "aggregate = [\"p99.9\", \"stddev\"]");
    let cfg = parse(&ok).unwrap();
    assert_eq!(
        cfg.pipelines[0].aggregate,
        AggregateSpec::List(vec![Aggregate::Percentile(999), Aggregate::Stddev])
    );
    let empty = MINIMAL.replace("aggregate = \"sum\"", "aggregate = []");
    assert_problem(
        &only(&empty),
        "pipeline[0].aggregate",
        line_of(&empty, "aggregate"),
        "1 to 32",
    );
    let count_only = MINIMAL
        .replace("aggregate = \"sum\"", "aggregate = [\"count\"]")
        .replace("value = \"/amount\"\n", "");
    assert!(parse(&count_only).is_ok());
}

#[test]
fn a_bad_filter_is_reported_with_its_line_and_column() {
    let text = with_pipeline("where = '/status == \"running\" and /temp >> -40'");
    assert_problem(
        &only(&text),
        "pipeline[0].where",
        line_of(&text, "where"),
        "column 33 of the filter: expected a field or a literal, found an operator",
    );
    let text = with_pipeline("where = '''\n/status == \"running\"\n  and (/temp > -40'''");
    assert_problem(
        &only(&text),
        "pipeline[0].where",
        line_of(&text, "where"),
        "line 2, column 19 of the filter: expected `)`",
    );
    let cfg = parse(&with_pipeline("where = 'not (/temp > 3)'")).unwrap();
    assert!(cfg.pipelines[0].filter.is_some());
    let text = with_pipeline("key2 = 1");
    assert!(!problems(&text).is_empty());
}

#[test]
fn dead_letter_bounds_and_the_ledger_index_bound_have_defaults_and_ranges() {
    let cfg = parse(MINIMAL).unwrap();
    assert_eq!(cfg.dead_letters.max_entries, 100_000);
    assert_eq!(cfg.dead_letters.max_age, Duration::from_secs(30 * 86_400));
    assert_eq!(cfg.storage.ledger_index_max, 64 << 20);
    let b = cfg.store_bounds();
    assert_eq!(b.dead_letters_max_age_ms, 30 * 86_400_000);
    assert_eq!(b, crate::store::StoreBounds::default());

    let text = with("dead_letters", "max_entries = 10\nmax_age = \"1h\"");
    let text = text.replace("[storage]\n", "[storage]\nledger_index_max = \"8MiB\"\n");
    let cfg = parse(&text).unwrap();
    assert_eq!(cfg.dead_letters.max_entries, 10);
    assert_eq!(cfg.dead_letters.max_age, Duration::from_secs(3600));
    assert_eq!(cfg.storage.ledger_index_max, 8 << 20);

    for (text, key, says) in [
        (
            with("dead_letters", "max_entries = 0"),
            "dead_letters.max_entries",
            "must be between 1 and",
        ),
        (
            with("dead_letters", "max_age = \"5s\""),
            "dead_letters.max_age",
            "at least 1m",
        ),
        (
            with("dead_letters", "max_size = 3"),
            "dead_letters.max_size",
            "",
        ),
        (
            MINIMAL.replace("[storage]\n", "[storage]\nledger_index_max = \"64KiB\"\n"),
            "storage.ledger_index_max",
            "between 1MiB and 16GiB",
        ),
    ] {
        let p = only(&text);
        assert_eq!(p.key, key, "{p:#?}");
        assert!(p.message.contains(says), "{p:#?}");
    }
}

#[test]
fn start_is_latest_by_default_or_earliest_and_nothing_else() {
    let start = |text: &str| parse(text).unwrap().pipelines[0].start;
    assert_eq!(start(MINIMAL), Start::Latest);
    assert_eq!(start(&with_pipeline("start = \"latest\"")), Start::Latest);
    assert_eq!(
        start(&with_pipeline("start = \"earliest\"")),
        Start::Earliest
    );
    let earliest = parse(&with_pipeline("start = \"earliest\"")).unwrap();
    assert!(summary(&earliest).contains("start = \"earliest\"\n"));
    assert!(summary(&parse(MINIMAL).unwrap()).contains("start = \"latest\"  # default\n"));
    let text = with_pipeline("start = \"beginning\"");
    assert_problem(
        &only(&text),
        "pipeline[0].start",
        line_of(&text, "start ="),
        "expected \"latest\" or \"earliest\"",
    );
}

#[test]
fn the_checkpoint_record_default_follows_a_smaller_outbox_bound_but_a_written_one_is_checked() {
    // A config written for the older 5,000-record default still loads.
    let cfg = parse(&with("outbox", "max_entries = 9000")).unwrap();
    assert_eq!(cfg.checkpoint.max_records, 9000);
    assert_eq!(
        parse(MINIMAL).unwrap().checkpoint.max_records,
        20_000,
        "the default otherwise"
    );
    let text = with("outbox", "max_entries = 9000");
    let text = format!("{text}\n[checkpoint]\nmax_records = 10000\n");
    let e = parse(&text).unwrap_err().to_string();
    assert!(
        e.contains("outbox.max_entries") && e.contains("at least checkpoint.max_records"),
        "{e}"
    );
}

#[test]
fn checkpoint_max_keys_defaults_to_3072_and_must_be_at_least_one() {
    assert_eq!(parse(MINIMAL).unwrap().checkpoint.max_keys, 3072);
    let ok = format!("{MINIMAL}\n[checkpoint]\nmax_keys = 500\n");
    assert_eq!(parse(&ok).unwrap().checkpoint.max_keys, 500);
    let text = format!("{MINIMAL}\n[checkpoint]\nmax_keys = 0\n");
    let e = parse(&text).unwrap_err().to_string();
    assert!(e.contains("checkpoint.max_keys"), "{e}");
}

/// Issue 26: a pipeline whose worst key makes a result too large for one stored entry is
/// refused at load, at the key to change, with the largest value that fits.
#[test]
fn a_pipeline_whose_worst_result_cannot_be_stored_is_refused_naming_the_keys() {
    let text = with_pipeline("max_key_len = 1024");
    let p = only(&text);
    assert_problem(
        &p,
        "pipeline[0].max_key_len",
        line_of(&text, "max_key_len"),
        "lower max_key_len to at most",
    );
    assert!(
        p.message.contains("output_topic") && p.message.contains("7168"),
        "{}",
        p.message
    );
    // The value it names is the largest that loads.
    let fits: usize = p
        .message
        .split("at most ")
        .nth(1)
        .unwrap()
        .split(|c: char| !c.is_ascii_digit())
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!((500..1024).contains(&fits), "{fits}");
    assert!(parse(&with_pipeline(&format!("max_key_len = {fits}"))).is_ok());
    assert!(parse(&with_pipeline(&format!("max_key_len = {}", fits + 1))).is_err());
    // Each `{key}` in the template counts: two of them halve what fits, about.
    let twice = MINIMAL.replace("balances/{key}", "balances/{key}/{key}");
    let text = format!("{twice}max_key_len = {fits}\n");
    assert_eq!(only(&text).key, "pipeline[0].max_key_len");
    // A template too long for any key is reported at the template.
    let long = MINIMAL.replace("balances/{key}", &format!("{}/{{key}}", "b".repeat(7100)));
    let p = only(&long);
    assert_problem(
        &p,
        "pipeline[0].output_topic",
        line_of(&long, "output_topic"),
        "shorten output_topic",
    );
    // Aggregates count too: a list of all of them leaves less room for the key.
    let list = MINIMAL.replace(
        "aggregate = \"sum\"",
        "aggregate = [\"count\", \"sum\", \"min\", \"max\", \"avg\", \"last\", \"stddev\", \"variance\", \"p1\", \"p95\", \"p99.9\"]",
    );
    assert!(parse(&format!("{list}max_key_len = {}\n", fits - 20)).is_err());
    assert!(
        parse(&list).is_ok(),
        "the defaults fit with every aggregate"
    );
}

/// Issue 26: the checkpoint's progress record holds every pipeline's definition; so many
/// pipelines that it cannot fit one stored record are refused at load.
#[test]
fn too_many_pipelines_for_the_progress_record_are_refused() {
    let head = &MINIMAL[..MINIMAL.find("[[pipeline]]").unwrap()];
    let pipelines = |n: usize| {
        let mut text = head.to_string();
        for i in 0..n {
            text.push_str(&format!(
                "[[pipeline]]\nname = \"p{i:03}{}\"\ntopics = [\"in/{i}\"]\nevent_id = \"{{/device}}-{{/seq}}-{}\"\nkey = \"/k\"\n\
                 value = \"/v\"\naggregate = \"sum\"\noutput_topic = \"o/{i}/{{key}}\"\n",
                "n".repeat(60),
                "x".repeat(100)
            ));
        }
        text
    };
    assert!(parse(&pipelines(100)).is_ok());
    let p = problems(&pipelines(300));
    assert_eq!(p.len(), 1, "{p:#?}");
    assert_eq!(p[0].key, "pipeline");
    assert!(
        p[0].message.contains("progress record") && p[0].message.contains("fewer pipelines"),
        "{}",
        p[0].message
    );
}

/// A Sparkplug B pipeline and `[sparkplug]`, as issue 31 writes them.
const SPARKPLUG: &str = r#"[mqtt]
client_id = "box-1"

[storage]
data_dir = "/var/lib/cairn"

[sparkplug]
host_id = "cairn-box17"
rebirth = true

[[pipeline]]
name = "line1"
topics = ["spBv1.0/plant1/#"]
format = "sparkplug_b"
metrics = ["Temperature", "Pressure"]
key = "{edge_node}/{device}/{metric}"
aggregate = ["twa", "min", "max", "count"]
window = { size = "1m" }
output_topic = "line1/{key}"
"#;

#[test]
fn a_sparkplug_pipeline_and_host_load_as_the_issue_writes_them() {
    let cfg = parse(SPARKPLUG).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(cfg.sparkplug.host_id.as_deref(), Some("cairn-box17"));
    assert!(cfg.sparkplug.rebirth);
    let p = &cfg.pipelines[0];
    assert_eq!(p.format, Format::SparkplugB);
    assert_eq!(
        p.metrics.as_deref(),
        Some(&["Temperature".to_string(), "Pressure".to_string()][..])
    );
    assert!(p.aggregate.all().contains(&Aggregate::Twa));
    assert_eq!(p.value, None);
    // Without the section: no host, no rebirth requests.
    let plain = SPARKPLUG.replace(
        "[sparkplug]\nhost_id = \"cairn-box17\"\nrebirth = true\n",
        "",
    );
    assert_eq!(parse(&plain).unwrap().sparkplug, SparkplugConfig::default());
}

#[test]
fn sparkplug_mistakes_are_problems_at_their_line() {
    let case = |from: &str, to: &str, key: &str, needle: &str, has: &str| {
        let text = SPARKPLUG.replace(from, to);
        assert_problem(&only(&text), key, line_of(&text, needle), has);
    };
    case(
        "host_id = \"cairn-box17\"",
        "host_id = \"cairn/box17\"",
        "sparkplug.host_id",
        "host_id",
        "one topic level",
    );
    case(
        "host_id = \"cairn-box17\"",
        "host_id = \"\"",
        "sparkplug.host_id",
        "host_id",
        "1 to 256 bytes",
    );
    case(
        "key = \"{edge_node}/{device}/{metric}\"",
        "key = \"{edge_node}/{sensor}\"",
        "pipeline[0].key",
        "key =",
        "not a Sparkplug part",
    );
    case(
        "key = \"{edge_node}/{device}/{metric}\"",
        "key = \"{edge_node}/{device}/{metric}\"\nvalue = \"/v\"",
        "pipeline[0].value",
        "value =",
        "not used with format = \"sparkplug_b\"",
    );
    case(
        "metrics = [\"Temperature\", \"Pressure\"]",
        "metrics = [\"Temperature\", \"Temperature\"]",
        "pipeline[0].metrics[1]",
        "metrics =",
        "listed twice",
    );
    case(
        "window = { size = \"1m\" }",
        "window = { size = \"1m\", slide = \"30s\" }",
        "pipeline[0].window.slide",
        "window =",
        "twa takes tumbling windows",
    );
    case(
        "rebirth = true",
        "rebirth = \"yes\"",
        "sparkplug.rebirth",
        "rebirth",
        "wrong type",
    );
    // twa and metrics are Sparkplug B's.
    let text = with_pipeline("metrics = [\"a\"]");
    assert_problem(
        &only(&text),
        "pipeline[0].metrics",
        line_of(&text, "metrics"),
        "only applies to format = \"sparkplug_b\"",
    );
    let text = MINIMAL.replace("aggregate = \"sum\"", "aggregate = \"twa\"");
    assert_problem(
        &only(&text),
        "pipeline[0].aggregate",
        line_of(&text, "aggregate"),
        "it needs format = \"sparkplug_b\"",
    );
}
