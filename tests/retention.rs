//! Invariant 7, log retention: a segment is deleted only when it lies wholly before the
//! durable checkpoint *and* outside the configured retention.

mod support;

use std::time::Duration;

use support::agent::{AgentConfig, CairnProcess};
use support::{Broker, publish_all, wait_until};

const PIPELINE: &str = r#"
[[pipeline]]
name = "sums"
topics = ["in/#"]
format = "json"
event_id = "/id"
key = "/k"
value = "/v"
aggregate = "sum"
output_topic = "sums/{key}"
"#;

/// ~16 KiB events, so a 1 MiB segment rolls every ~60 of them.
fn batch(first: usize, n: usize) -> Vec<(String, Vec<u8>, bool)> {
    let pad = "p".repeat(16 * 1024);
    (first..first + n)
        .map(|i| {
            let body = format!(r#"{{"id":"E{i}","k":"K{}","v":1,"pad":"{pad}"}}"#, i % 4);
            ("in/x".to_string(), body.into_bytes(), false)
        })
        .collect()
}

fn first_log_offset(agent: &CairnProcess) -> u64 {
    let (st, out, err) = agent.command(&["inspect", "log", "--json", "--limit", "1"]);
    assert!(st.success(), "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).expect("one log record");
    v["offset"].as_u64().unwrap()
}

fn checkpoint_offset(agent: &CairnProcess) -> u64 {
    let (st, out, err) = agent.command(&["verify", "--json"]);
    assert!(st.success(), "{out}{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    v["store"]["next_offset"].as_u64().unwrap()
}

#[test]
fn segments_are_deleted_only_behind_the_checkpoint_and_outside_retention() {
    let broker = Broker::start();
    let mut cfg = AgentConfig::new(broker.port(), PIPELINE);
    cfg.log = "segment_size = \"1MiB\"\nmax_size = \"256MiB\"\nretention = \"1h\"\n\
               commit_interval = \"2ms\"\nmax_payload = \"64KiB\"\n"
        .into();
    let mut agent = CairnProcess::new(&cfg);
    agent.start_connected();

    // Inside retention: everything checkpointed, nothing deleted.
    publish_all(broker.port(), &batch(0, 300));
    assert!(
        wait_until(Duration::from_secs(30), || agent.checkpointed_offset()
            == Some(300)),
        "not all 300 checkpointed:\n{}",
        agent.stderr_tail(20)
    );
    assert!(agent.terminate().success());
    let segments = std::fs::read_dir(agent.data_dir().join("log"))
        .unwrap()
        .count();
    assert!(
        segments >= 4,
        "the log should have rolled: {segments} entries"
    );
    assert_eq!(
        first_log_offset(&agent),
        0,
        "a 1h retention keeps every segment"
    );

    // Retention 0s: whole segments behind the checkpoint go, never one it still needs.
    let text = std::fs::read_to_string(agent.config_path()).unwrap();
    std::fs::write(
        agent.config_path(),
        text.replace("retention = \"1h\"", "retention = \"0s\""),
    )
    .unwrap();
    agent.start_connected();
    publish_all(broker.port(), &batch(300, 100));
    assert!(
        wait_until(Duration::from_secs(30), || agent.checkpointed_offset()
            == Some(400)),
        "not all 400 checkpointed:\n{}",
        agent.stderr_tail(20)
    );
    assert!(agent.terminate().success());
    let first = first_log_offset(&agent);
    let checkpoint = checkpoint_offset(&agent);
    assert!(first > 0, "retention 0s deleted nothing");
    assert!(
        first <= checkpoint,
        "the log starts at {first}, after the checkpoint's next offset {checkpoint}"
    );
    // And the state is whole: 400 events of value 1 over 4 keys.
    let (_, out, _) = agent.command(&["inspect", "state", "--json"]);
    let total: i64 = out
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["value"]
                .as_i64()
                .unwrap()
        })
        .sum();
    assert_eq!(total, 400);
}
