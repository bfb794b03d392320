//! The checkpoint commits beside the loop (issue 33): while a checkpoint's transaction and
//! fsync run on the keeper's thread, the loop goes on taking input and sending results; a
//! crash between the commit and its fsync loses nothing and doubles nothing.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::support::agent::{AgentConfig, CairnProcess};
use crate::support::{Broker, Collector, publish_all, wait_until};

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
emit = "changelog"
"#;

/// Event `i`: key `K{i % 3}`, value `i`.
fn event(i: u64) -> (String, Vec<u8>, bool) {
    (
        "in/dev".into(),
        format!(r#"{{"id":"E{i}","k":"K{}","v":{i}}}"#, i % 3).into_bytes(),
        false,
    )
}

/// Output ID → every payload it arrived with, for the pipeline's results.
fn by_id(c: &Collector) -> HashMap<String, Vec<serde_json::Value>> {
    let mut m: HashMap<String, Vec<serde_json::Value>> = HashMap::new();
    for s in c.messages().iter().filter(|s| s.topic.starts_with("sums/")) {
        if let Ok(v) = serde_json::from_slice::<serde_json::Value>(&s.payload) {
            if let Some(id) = v["id"].as_str() {
                m.entry(id.to_string()).or_default().push(v.clone());
            }
        }
    }
    m
}

/// How many of `events` have their result here: event `i` is its key's
/// (events of that key up to `i`)-th, so its result's ID ends in that version.
fn results_of(c: &Collector, events: std::ops::RangeInclusive<u64>) -> usize {
    let ids = by_id(c);
    events
        .filter(|i| {
            let version = (1..=*i).filter(|j| j % 3 == i % 3).count();
            ids.contains_key(&format!("sums/K{}/{version}", i % 3))
        })
        .count()
}

#[test]
fn results_flow_while_a_checkpoint_commits_and_a_crash_between_its_commit_and_fsync_loses_nothing()
{
    let broker = Broker::start();
    let mut cfg = AgentConfig::new(broker.port(), PIPELINE);
    cfg.checkpoint = "interval = \"300ms\"\n".into();
    let mut agent = CairnProcess::new(&cfg);
    agent.set_log_filter(Some("info"));
    let outputs = Collector::start(broker.port(), "#");
    agent.set_up_session();

    // The second checkpoint commits, then its thread holds for 6 s before the fsync, and
    // the process dies there: committed, not durable.
    agent.start_with_env(&[(
        "CAIRN_FAILPOINTS",
        "checkpoint.after_commit=pause:6000@2,checkpoint.before_fsync=abort@2",
    )]);
    agent.wait_connected(Duration::from_secs(20));
    let mut next = 1u64;
    let paused = wait_until(Duration::from_secs(30), || {
        publish_all(broker.port(), &[event(next)]);
        next += 1;
        std::thread::sleep(Duration::from_millis(50));
        agent
            .stderr()
            .contains("failpoint checkpoint.after_commit: pause")
    });
    assert!(
        paused,
        "the second checkpoint never reached its pause:\n{}",
        agent.stderr_tail(30)
    );
    let held_since = Instant::now();
    // While the commit thread holds: 30 events in, their 30 results out.
    let during = next..=next + 29;
    publish_all(
        broker.port(),
        &during.clone().map(event).collect::<Vec<_>>(),
    );
    next += 30;
    let flowed = wait_until(Duration::from_secs(4), || {
        results_of(&outputs, during.clone()) == 30
    });
    let within = held_since.elapsed();
    assert!(
        flowed,
        "results stopped while a checkpoint committed beside the loop: {} of 30 arrived\n{}",
        results_of(&outputs, during.clone()),
        agent.stderr_tail(30)
    );
    assert!(
        !agent.stderr().contains("pause over") && agent.is_running(),
        "the results arrived only after the pause ({within:?}): not beside it"
    );

    // Then the crash between the commit and its fsync.
    let status = agent.expect_exit(Duration::from_secs(30));
    assert!(!status.success(), "the agent did not die at its failpoint");
    assert!(
        agent
            .stderr()
            .contains("failpoint checkpoint.before_fsync: abort"),
        "{}",
        agent.stderr_tail(30)
    );

    // Restart, a few more events, a clean stop.
    agent.start_connected();
    let last = next + 9;
    publish_all(broker.port(), &(next..=last).map(event).collect::<Vec<_>>());
    assert!(
        wait_until(Duration::from_secs(30), || results_of(&outputs, 1..=last)
            == last as usize),
        "not every event's result arrived after the restart: {} of {last}\n{}",
        results_of(&outputs, 1..=last),
        agent.stderr_tail(30)
    );
    assert_eq!(
        agent.terminate().code(),
        Some(0),
        "{}",
        agent.stderr_tail(20)
    );

    // Exactly once: one payload per ID, one ID per event of each key (versions 1..=n, no
    // more), and each key's last value is the sum of its events.
    let ids = by_id(&outputs);
    for (id, payloads) in &ids {
        assert!(
            payloads.iter().all(|p| p == &payloads[0]),
            "{id} arrived with two payloads: {payloads:?}"
        );
    }
    for k in 0..3u64 {
        let events: Vec<u64> = (1..=last).filter(|i| i % 3 == k).collect();
        let n = events.len() as u64;
        let newest = &ids[&format!("sums/K{k}/{n}")][0];
        assert_eq!(
            newest["value"].as_i64(),
            Some(events.iter().sum::<u64>() as i64),
            "K{k}'s sum: {newest}"
        );
        assert!(
            !ids.contains_key(&format!("sums/K{k}/{}", n + 1)),
            "K{k} counted an event twice"
        );
    }
    assert_eq!(ids.len() as u64, last, "one result ID per event, no more");
}
