//! Results before their checkpoint (issue 14), beyond the crash harness: a pipeline change
//! takes effect only at a checkpoint boundary, so results that went out before a crash are
//! computed again, after it, with the same payloads.

use std::collections::HashMap;
use std::time::Duration;

use crate::support::agent::{AgentConfig, CairnProcess};
use crate::support::{Broker, Collector, publish_all, wait_until};

fn pipeline(filter: &str) -> String {
    format!(
        r#"
[[pipeline]]
name = "sums"
topics = ["in/#"]
format = "json"
event_id = "/id"
key = "/k"
value = "/v"
aggregate = "sum"
{filter}
output_topic = "sums/{{key}}"
retain = true
emit = "changelog"
"#
    )
}

fn event(i: u64) -> (String, Vec<u8>, bool) {
    (
        "in/dev".into(),
        format!(r#"{{"id":"E{i}","k":"A","v":{i}}}"#).into_bytes(),
        false,
    )
}

/// Output ID → every payload it arrived with.
fn by_id(c: &Collector) -> HashMap<String, Vec<Vec<u8>>> {
    let mut m: HashMap<String, Vec<Vec<u8>>> = HashMap::new();
    for s in c.messages() {
        if let Ok(v) = serde_json::from_slice::<serde_json::Value>(&s.payload) {
            if let Some(id) = v["id"].as_str().filter(|_| s.topic.starts_with("sums/")) {
                m.entry(id.to_string()).or_default().push(s.payload.clone());
            }
        }
    }
    m
}

#[test]
fn a_pipeline_change_after_a_crash_applies_only_after_the_old_tail_is_checkpointed() {
    let broker = Broker::start();
    let mut cfg = AgentConfig::new(broker.port(), &pipeline(""));
    // No checkpoint runs on its own: everything processed is in the log tail at the kill.
    cfg.checkpoint = "interval = \"1h\"\nmax_records = 100000\n".into();
    let mut agent = CairnProcess::new(&cfg);
    agent.set_log_filter(Some("info"));
    let outputs = Collector::start(broker.port(), "#");
    agent.set_up_session();

    agent.start_connected();
    publish_all(broker.port(), &(1..=4).map(event).collect::<Vec<_>>());
    assert!(
        wait_until(Duration::from_secs(20), || by_id(&outputs)
            .contains_key("sums/A/4")),
        "sums/A/4 never arrived before its checkpoint:\n{}",
        agent.stderr_tail(20)
    );
    agent.kill();
    assert!(
        agent.inspect("checkpoints").is_empty(),
        "a checkpoint ran: the results were not out before it"
    );

    // The operator edits the pipeline: a `where` that, applied to the tail, would give
    // sums/A/1 the value 3 instead of 1.
    let mut changed = cfg.clone();
    changed.pipelines = pipeline("where = '/v > 2'");
    agent.rewrite_config(&changed);
    agent.start_connected();
    publish_all(broker.port(), &[event(5)]);
    // Event 5's result: the sum with it is 15 (or 12, had the tail been counted under the
    // new `where`, which the checks below then catch).
    let with_5 = |c: &Collector| {
        c.messages().iter().any(|m| {
            serde_json::from_slice::<serde_json::Value>(&m.payload)
                .is_ok_and(|v| v["value"].as_i64().is_some_and(|x| x >= 12))
        })
    };
    assert!(
        wait_until(Duration::from_secs(20), || with_5(&outputs)),
        "event 5's result never arrived:\n{}",
        agent.stderr_tail(20)
    );
    assert_eq!(
        agent.terminate().code(),
        Some(0),
        "{}",
        agent.stderr_tail(20)
    );
    let ids = by_id(&outputs);
    for (id, payloads) in &ids {
        assert!(
            payloads.iter().all(|p| p == &payloads[0]),
            "{id} arrived with two payloads: {:?}",
            payloads
                .iter()
                .map(|p| String::from_utf8_lossy(p))
                .collect::<Vec<_>>()
        );
    }
    assert!(
        ids["sums/A/1"].len() >= 2,
        "sums/A/1 was not re-sent by the replay"
    );
    assert!(
        agent
            .stderr()
            .contains("pipelines changed since the last run (sums)"),
        "the start did not settle the tail under the old pipeline:\n{}",
        agent.stderr_tail(20)
    );
    // The tail (1..4) counted under the old pipeline, event 5 under the new one.
    let state = agent.inspect("state");
    assert_eq!(state.len(), 1, "{state:?}");
    assert_eq!(state[0]["value"], 15, "{state:?}");
    assert_eq!(state[0]["version"], 5, "{state:?}");
}
