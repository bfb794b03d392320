//! Invariant 7, log retention (rule: `src/log/mod.rs`, "Retention"): a segment is deleted
//! only when it lies wholly before the durable checkpoint, and, while the log has room, only
//! outside the configured retention; a log short of room evicts processed segments instead
//! of stalling (issue 11).

use crate::support;

use std::time::Duration;

use crate::support::agent::{AgentConfig, CairnProcess};
use crate::support::{Broker, publish_all, wait_until};

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

// ---- issue 11: a log far smaller than the stream never stalls ----

/// Small segments and a log of two of them: the smallest valid log.
const TINY_LOG: &str = "segment_size = \"1MiB\"\nmax_size = \"2MiB\"\nretention = \"24h\"\n\
                        commit_interval = \"2ms\"\nmax_payload = \"64KiB\"\n";
const KEYS: usize = 5;

/// ~2 KiB events `first..first+n`: key `K{i % KEYS}`, value `i % 7 + 1`.
fn stream(first: usize, n: usize) -> Vec<(String, Vec<u8>, bool)> {
    let pad = "q".repeat(2000);
    (first..first + n)
        .map(|i| {
            let body = format!(
                r#"{{"id":"S{i}","k":"K{}","v":{},"pad":"{pad}"}}"#,
                i % KEYS,
                i % 7 + 1
            );
            ("in/s".to_string(), body.into_bytes(), false)
        })
        .collect()
}

/// The exact per-key sums of events `0..n`.
fn expected_sums(n: usize) -> std::collections::BTreeMap<String, i64> {
    let mut m = std::collections::BTreeMap::new();
    for i in 0..n {
        *m.entry(format!("K{}", i % KEYS)).or_insert(0) += (i % 7 + 1) as i64;
    }
    m
}

/// Per-key sums from the results on the broker (the latest version of each key).
fn sums_seen(c: &support::Collector) -> std::collections::BTreeMap<String, i64> {
    let mut best: std::collections::BTreeMap<String, (u64, i64)> = Default::default();
    for m in c.messages() {
        let v: serde_json::Value = serde_json::from_slice(&m.payload).unwrap();
        let key = v["key"].as_str().unwrap().to_string();
        let (version, value) = (v["version"].as_u64().unwrap(), v["value"].as_i64().unwrap());
        let e = best.entry(key).or_insert((0, 0));
        if version > e.0 {
            *e = (version, value);
        }
    }
    best.into_iter().map(|(k, (_, v))| (k, v)).collect()
}

fn state_sums(agent: &CairnProcess) -> std::collections::BTreeMap<String, i64> {
    agent
        .inspect("state")
        .iter()
        .map(|v| {
            (
                v["key"].as_str().unwrap().to_string(),
                v["value"].as_i64().unwrap(),
            )
        })
        .collect()
}

/// Publish in chunks with short pauses (see tests/e2e.rs `publish_paced`: a flood makes
/// mosquitto 2.0.11 starve the agent's acks), from a thread.
fn publish_stream(port: u16, msgs: Vec<(String, Vec<u8>, bool)>) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        for chunk in msgs.chunks(500) {
            publish_all(port, chunk);
            std::thread::sleep(Duration::from_millis(100));
        }
    })
}

fn log_bytes(agent: &CairnProcess) -> u64 {
    std::fs::read_dir(agent.data_dir().join("log"))
        .unwrap()
        .filter_map(|e| e.ok()?.metadata().ok())
        .filter(|m| m.is_file())
        .map(|m| m.len())
        .sum()
}

/// Publishes `n` events while the agent runs and waits for every key's exact result.
fn flow_through(broker: &Broker, agent: &mut CairnProcess, first: usize, n: usize) {
    let results = support::Collector::start(broker.port(), "sums/#");
    let publisher = publish_stream(broker.port(), stream(first, n));
    let want = expected_sums(first + n);
    let mut max_log = 0;
    let done = wait_until(Duration::from_secs(120), || {
        max_log = max_log.max(log_bytes(agent));
        sums_seen(&results) == want
    });
    publisher.join().unwrap();
    assert!(
        done,
        "the stream did not flow through: results {:?}, want {want:?}\n{}",
        sums_seen(&results),
        agent.stderr_tail(30)
    );
    assert!(
        max_log <= 2 << 20,
        "the log grew to {max_log} bytes, past max_size"
    );
}

#[test]
fn a_stream_many_times_larger_than_a_tiny_log_flows_through_with_exact_results() {
    let broker = Broker::start();
    let mut cfg = AgentConfig::new(broker.port(), PIPELINE);
    cfg.log = TINY_LOG.into();
    let mut agent = CairnProcess::new(&cfg);
    agent.start_connected();
    // ~10 MiB through a 2 MiB log whose retention (24h) would keep every record.
    flow_through(&broker, &mut agent, 0, 5000);
    assert!(agent.terminate().success());
    assert_eq!(state_sums(&agent), expected_sums(5000));
    let said = agent.stderr();
    assert!(
        said.contains("retention: the log is short of room"),
        "no eviction warning:\n{}",
        agent.stderr_tail(30)
    );
    assert!(first_log_offset(&agent) > 0);
    assert!(first_log_offset(&agent) <= checkpoint_offset(&agent));
}

#[test]
fn a_savepoint_taken_by_hand_does_not_stall_a_tiny_log_and_stays_restorable() {
    let broker = Broker::start();
    let mut cfg = AgentConfig::new(broker.port(), PIPELINE);
    cfg.log = TINY_LOG.into();
    let mut agent = CairnProcess::new(&cfg);
    agent.start_connected();
    flow_through(&broker, &mut agent, 0, 100);
    assert!(agent.terminate().success());
    let (st, out, err) = agent.command(&["savepoint", "create", "--json"]);
    assert!(st.success(), "{out}{err}");
    let by_hand: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(by_hand["next_offset"], 100);

    // Periodic savepoints are off; the one taken by hand must not pin the log.
    agent.start_connected();
    flow_through(&broker, &mut agent, 100, 4900);
    assert!(agent.terminate().success());
    assert_eq!(state_sums(&agent), expected_sums(5000));
    assert!(
        agent.stderr().contains("held a replay log short of room"),
        "{}",
        agent.stderr_tail(30)
    );

    // Bounded: every savepoint taken for room pruned the directory to `keep` (3).
    let files = std::fs::read_dir(agent.data_dir().join("savepoints"))
        .unwrap()
        .count();
    assert!((1..=3).contains(&files), "{files} savepoint files");

    // The rebuild path is whole: the newest savepoint restores and the log completes it.
    let (st, out, err) = agent.command(&["savepoint", "restore", "--latest", "--json"]);
    assert!(st.success(), "{out}{err}");
    let restored: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert!(
        restored["next_offset"].as_u64().unwrap() > 100,
        "{restored}"
    );
    assert!(restored["seq"].as_u64().unwrap() > by_hand["seq"].as_u64().unwrap());
    agent.start_connected();
    assert!(
        wait_until(Duration::from_secs(30), || agent
            .run_stderr()
            .contains("recovery: done")),
        "{}",
        agent.stderr_tail(30)
    );
    assert!(agent.terminate().success());
    assert_eq!(state_sums(&agent), expected_sums(5000));
}

/// Armed by this test: a crash right after retention deleted segments, before any later
/// checkpoint.
const RETENTION_CRASH: &str = "retention.after_delete=abort";

#[test]
fn a_crash_right_after_retention_loses_nothing_and_leaves_no_gap() {
    let broker = Broker::start();
    let mut cfg = AgentConfig::new(broker.port(), PIPELINE);
    // Expire at once; checkpoints only when something forces one, so the engine runs far
    // ahead of the durable checkpoint when the log fills.
    cfg.log = TINY_LOG.replace("24h", "0s");
    cfg.checkpoint = "interval = \"1h\"\nmax_records = 100000\n".into();
    let mut agent = CairnProcess::new(&cfg);
    agent.start_connected();
    assert!(agent.terminate().success()); // the broker now queues for the agent's session

    let results = support::Collector::start(broker.port(), "sums/#");
    let publisher = publish_stream(broker.port(), stream(0, 3000));
    agent.start_with_env(&[("CAIRN_FAILPOINTS", RETENTION_CRASH)]);
    let crashed = agent.wait_exit(Duration::from_secs(60));
    publisher.join().unwrap();
    assert!(
        crashed.is_some_and(|s| !s.success()),
        "the failpoint did not fire (built with --all-features?):\n{}",
        agent.stderr_tail(20)
    );
    assert!(
        agent
            .stderr()
            .contains("failpoint retention.after_delete: abort")
    );

    // The restart replays from the committed checkpoint: no gap, no loss, no double count.
    // (Checkpoints on a timer again, so every result shows without more input.)
    let text = std::fs::read_to_string(agent.config_path()).unwrap();
    std::fs::write(agent.config_path(), text.replace("\"1h\"", "\"50ms\"")).unwrap();
    agent.start_connected();
    let want = expected_sums(3000);
    let done = wait_until(Duration::from_secs(60), || sums_seen(&results) == want);
    assert!(
        done,
        "after the crash: results {:?}, want {want:?}\n{}",
        sums_seen(&results),
        agent.stderr_tail(30)
    );
    assert!(agent.terminate().success());
    assert_eq!(state_sums(&agent), want);
    assert!(!agent.stderr().contains("LogGap") && !agent.stderr().contains("no longer in the log"));
}
