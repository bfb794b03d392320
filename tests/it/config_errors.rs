//! The config's public contract, as `cairn validate` sees it: a bad file yields every
//! problem as `FILE:LINE: KEY: MESSAGE`; a good one loads.

use std::path::Path;

use cairn::config::{ConfigError, load, parse_str};

#[test]
fn the_shipped_example_config_loads() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/cairn.toml");
    let cfg = load(&path).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(cfg.mqtt.client_id, "cairn-edge-1");
    assert_eq!(cfg.pipelines[0].output_topic, "balances/{key}");
}

#[test]
fn a_bad_config_reports_every_problem_with_file_line_and_key() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cairn.toml");
    std::fs::write(
        &path,
        "[mqtt]\nclient_id = \"box-1\"\nkeep_alive = 30\n\n[storage]\ndata_dir = \"d\"\n\n\
         [[pipeline]]\nname = \"p\"\ntopics = [\"a/#\"]\nevent_id = \"/id\"\nkey = \"/k\"\n\
         aggregate = \"count\"\noutput_topic = \"p/{key}\"\nwindw = { size = \"1m\" }\n",
    )
    .unwrap();
    let Err(ConfigError::Invalid { file, problems }) = load(&path) else {
        panic!("expected an invalid config");
    };
    assert_eq!(file, path.display().to_string());
    let lines: Vec<String> = problems.iter().map(ToString::to_string).collect();
    let f = path.display();
    assert_eq!(
        lines,
        [
            format!(
                "{f}:3: mqtt.keep_alive: `30` has no unit: a duration is a string such as \
                 \"30s\"; accepted units: ms, s, m, h, d"
            ),
            format!(
                "{f}:15: pipeline[0].windw: unknown key `windw`, expected one of `name`, \
                 `topics`, `format`, `separator`, `event_id`, `key`, `value`, `event_time`, \
                 `aggregate`, `where`, `window`, `dedup_window`, `output_topic`, `retain`, `emit`, \
                 `start`, `max_key_len`, `max_keys`, `max_id_len`, `max_future`, `metrics`, `sinks`"
            ),
        ]
    );
}

#[test]
fn a_toml_syntax_error_is_a_single_problem() {
    let err = parse_str("[mqtt\nclient_id = 1\n", Path::new("x.toml")).unwrap_err();
    let ConfigError::Invalid { problems, .. } = &err else {
        panic!("{err:?}");
    };
    assert_eq!(problems.len(), 1);
    assert!(
        problems[0]
            .to_string()
            .starts_with("x.toml:1: TOML syntax error at column "),
        "{err}"
    );
}
