//! Field hardening (issue 10): what a box in the field meets and the lab did not. Each test
//! runs a private mosquitto and the real `cairn` binary and checks the outcome with
//! `cairn inspect ... --json` against an oracle.
//!
//! - A record whose processing panics (a bug, injected by the `engine.panic_at_offset`
//!   failpoint) stops the agent a bounded number of times, then becomes an `internal` dead
//!   letter: no crash loop, and every other record is applied exactly once.
//! - The wall clock stepped back (a box without a battery-backed clock) does not turn new
//!   events into `late` dead letters, and times of receipt stay monotonic across a restart;
//!   a clock stepped forwards is reported in the journal.
//! - An input over `log.max_payload` is a `too_large` dead letter with its size, topic and
//!   a prefix, durable before its PUBACK, and processing goes on.
//!
//! Needs the `failpoints` feature (`cargo test --all-features --test it field::`) and `mosquitto`.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use crate::support::agent::{AgentConfig, CairnProcess};
use crate::support::{Broker, publish_all, wait_until};

const PIPELINE: &str = "[[pipeline]]\nname = \"sums\"\ntopics = [\"in/#\"]\nformat = \"json\"\n\
     event_id = \"/id\"\nkey = \"/k\"\nvalue = \"/v\"\naggregate = \"sum\"\n\
     dedup_window = \"7d\"\noutput_topic = \"out/{key}\"\nretain = true\n";

/// Windows by time of receipt (no event time): one hour, closed two hours after the newest
/// receipt, so that every event of a test lands in an open window unless the time of
/// receipt jumps back.
const WINDOWED: &str = "[[pipeline]]\nname = \"hourly\"\ntopics = [\"in/#\"]\nformat = \"json\"\n\
     event_id = \"/id\"\nkey = \"/k\"\nvalue = \"/v\"\naggregate = \"sum\"\n\
     window = { size = \"1h\", allowed_lateness = \"2h\" }\n\
     dedup_window = \"7d\"\noutput_topic = \"out/{key}/{window_start}\"\nretain = false\n";

const DAY_MS: i64 = 86_400_000;

fn require_failpoints() {
    if !cfg!(feature = "failpoints") {
        panic!("these tests inject panics and clock steps: run them with `--features failpoints`");
    }
}

fn event(i: u64) -> (String, Vec<u8>, bool) {
    let body = format!(r#"{{"id":"E{i}","k":"k{}","v":{}}}"#, i % 5, i % 7 + 1);
    (format!("in/{}", i % 2), body.into_bytes(), false)
}

fn events(from: u64, to: u64) -> Vec<(String, Vec<u8>, bool)> {
    (from..to).map(event).collect()
}

/// One record of `cairn inspect log --json`.
#[derive(Debug, Clone)]
struct Logged {
    offset: u64,
    received_at_ms: u64,
    /// The event ID, when the payload is one of our JSON events.
    id: Option<String>,
}

fn logged(agent: &CairnProcess) -> Vec<Logged> {
    let (status, out, err) = agent.command(&["inspect", "log", "--limit", "10000000", "--json"]);
    assert!(
        status.success(),
        "cairn inspect log failed ({status}): {err}"
    );
    out.lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("JSON line");
            let id = v["payload"]
                .as_str()
                .and_then(|p| serde_json::from_str::<serde_json::Value>(p).ok())
                .and_then(|p| p["id"].as_str().map(str::to_string));
            Logged {
                offset: v["offset"].as_u64().expect("offset"),
                received_at_ms: v["received_at_ms"].as_u64().expect("received_at_ms"),
                id,
            }
        })
        .collect()
}

/// Waits until `n` distinct event IDs are in the log.
fn wait_logged(agent: &CairnProcess, n: usize) {
    let count = || {
        logged(agent)
            .into_iter()
            .filter_map(|r| r.id)
            .collect::<BTreeSet<_>>()
            .len()
    };
    assert!(
        wait_until(Duration::from_secs(30), || count() >= n),
        "only {} of {n} events reached the log; stderr:\n{}",
        count(),
        agent.stderr_tail(30)
    );
}

/// key → (sum, count) over the events with these IDs (`E{i}`).
fn oracle<'a>(ids: impl IntoIterator<Item = &'a String>) -> BTreeMap<String, (i64, u64)> {
    let mut m = BTreeMap::new();
    for id in ids {
        let i: u64 = id[1..].parse().expect("E<number>");
        let e = m.entry(format!("k{}", i % 5)).or_insert((0, 0));
        e.0 += (i % 7 + 1) as i64;
        e.1 += 1;
    }
    m
}

/// key → (sum, count) from `cairn inspect state --json`, windows added up.
fn state(agent: &CairnProcess) -> BTreeMap<String, (i64, u64)> {
    let mut m = BTreeMap::new();
    for row in agent.inspect("state") {
        let e = m
            .entry(row["key"].as_str().expect("key").to_string())
            .or_insert((0, 0));
        e.0 += row["value"].as_f64().expect("numeric value") as i64;
        e.1 += row["count"].as_u64().expect("count");
    }
    m
}

fn stop_cleanly(agent: &mut CairnProcess) {
    let status = agent.terminate();
    assert_eq!(
        status.code(),
        Some(0),
        "cairn did not exit 0 on SIGTERM ({status}); stderr:\n{}",
        agent.stderr_tail(30)
    );
}

/// Waits for the agent to stop by itself with exit code 1, as systemd would see it.
fn expect_failure_exit(agent: &mut CairnProcess) {
    let status = agent
        .wait_exit(Duration::from_secs(30))
        .unwrap_or_else(|| panic!("cairn kept running; stderr:\n{}", agent.stderr_tail(30)));
    assert_eq!(
        status.code(),
        Some(1),
        "cairn should exit 1 (a runtime failure systemd restarts); stderr:\n{}",
        agent.stderr_tail(30)
    );
}

#[test]
fn a_record_that_panics_is_retried_then_set_aside_as_an_internal_dead_letter() {
    require_failpoints();
    const N: u64 = 60;
    const POISON: u64 = 25;
    let broker = Broker::start();
    let mut agent = CairnProcess::new(&AgentConfig::new(broker.port(), PIPELINE));
    agent.set_env(
        "CAIRN_FAILPOINTS",
        &format!("engine.panic_at_offset=panic:{POISON}"),
    );
    agent.start_connected();
    publish_all(broker.port(), &events(0, N));

    // Like systemd's Restart=on-failure: each exit is a failure, each start replays the
    // record again, until its attempts are used up.
    for attempt in 1..=3 {
        expect_failure_exit(&mut agent);
        let said = agent.run_stderr();
        assert!(
            said.contains(&format!("processing log record {POISON} "))
                && said.contains(&format!("Attempt {attempt} of 3 is recorded in")),
            "run {attempt} should say which record panicked and which attempt it was:\n{said}"
        );
        if attempt == 3 {
            assert!(said.contains("that start sets the record aside"), "{said}");
        }
        assert!(agent.data_dir().join("quarantine").exists());
        agent.start();
    }
    agent.wait_connected(Duration::from_secs(20));
    assert!(
        agent
            .run_stderr()
            .contains(&format!("quarantine: log record {POISON} (topic")),
        "the set-aside is in the journal:\n{}",
        agent.stderr_tail(20)
    );
    // And it goes on with new input.
    publish_all(broker.port(), &events(N, N + 20));
    wait_logged(&agent, N as usize + 20);
    stop_cleanly(&mut agent);

    let log = logged(&agent);
    let poison = log
        .iter()
        .find(|r| r.offset == POISON)
        .expect("the poison record is still in the log");
    let all: BTreeSet<String> = log.iter().filter_map(|r| r.id.clone()).collect();
    assert_eq!(all.len() as u64, N + 20, "every event reached the log");
    // The poison record's event counts only if the broker redelivered it at another offset
    // (its PUBACK may not have left before the exit): then that copy is applied, once.
    let applied: BTreeSet<String> = log
        .iter()
        .filter(|r| r.offset != POISON)
        .filter_map(|r| r.id.clone())
        .collect();
    assert!(applied.len() as u64 >= N + 19);
    assert_eq!(
        state(&agent),
        oracle(&applied),
        "every record but the poison one applied exactly once; poison was {:?}; stderr:\n{}",
        poison.id,
        agent.stderr_tail(30)
    );
    let dead = agent.inspect("dead-letters");
    assert_eq!(dead.len(), 1, "one dead letter: {dead:?}");
    assert_eq!(dead[0]["offset"], POISON);
    assert_eq!(dead[0]["reason"], "internal");
    assert_eq!(dead[0]["pipeline"], "sums");
    let detail = dead[0]["detail"].as_str().unwrap();
    assert!(
        detail.contains("panicked on 3 attempts") && detail.contains("failpoint"),
        "{detail}"
    );
    assert!(
        !agent.data_dir().join("quarantine").exists(),
        "a checkpoint past the record settles it: the quarantine file is gone"
    );
    assert_eq!(agent.runs(), 4, "three failed starts, then on");
}

#[test]
fn an_oversized_input_is_a_too_large_dead_letter_and_the_next_messages_go_on() {
    const N: u64 = 20;
    let broker = Broker::start();
    let mut agent = CairnProcess::new(&AgentConfig::new(broker.port(), PIPELINE));
    agent.start_connected();
    let mut big = br#"{"id":"BIG","k":"k0","v":1,"pad":""#.to_vec();
    big.resize(100_000, b'x');
    let mut msgs = events(0, N / 2);
    msgs.push(("in/big".into(), big.clone(), false));
    msgs.extend(events(N / 2, N));
    publish_all(broker.port(), &msgs);
    wait_logged(&agent, N as usize);
    assert!(
        wait_until(Duration::from_secs(10), || logged(&agent).len()
            > N as usize),
        "the oversized input is logged too"
    );
    stop_cleanly(&mut agent);

    let ids: BTreeSet<String> = (0..N).map(|i| format!("E{i}")).collect();
    assert_eq!(
        state(&agent),
        oracle(&ids),
        "the other events are all applied"
    );
    let check = |agent: &CairnProcess| {
        let dead = agent.inspect("dead-letters");
        assert_eq!(dead.len(), 1, "one dead letter: {dead:?}");
        let d = &dead[0];
        assert_eq!(d["reason"], "too_large");
        assert_eq!(d["topic"], "in/big");
        assert_eq!(d["pipeline"], "sums");
        let detail = d["detail"].as_str().unwrap();
        assert!(
            detail.contains("payload of 100000 bytes") && detail.contains("65536"),
            "the detail carries the size and the limit: {detail}"
        );
        let prefix = d["payload"].as_str().expect("a text prefix");
        assert_eq!(prefix.as_bytes(), &big[..1024], "the first 1 KiB is kept");
    };
    check(&agent);
    assert!(
        !agent.stderr().contains("ingest: refused"),
        "not the old acknowledge-and-drop"
    );
    // The log holds a small stand-in, and `inspect log` says what it stands for.
    let (status, out, err) = agent.command(&["inspect", "log", "--json"]);
    assert!(status.success(), "{err}");
    let stand_in: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["topic"] == "in/big")
        .collect();
    assert_eq!(stand_in.len(), 1, "{out}");
    assert_eq!(stand_in[0]["too_large"]["size"], 100_000);
    assert_eq!(stand_in[0]["too_large"]["limit"], 65_536);
    assert_eq!(stand_in[0]["payload"].as_str().unwrap().len(), 1024);

    // Replay decides the same way: rebuild the store from the log alone.
    std::fs::remove_dir_all(agent.data_dir().join("store")).expect("move the store away");
    agent.start_connected();
    stop_cleanly(&mut agent);
    check(&agent);
    assert_eq!(state(&agent), oracle(&ids));
}

/// Steps the agent's wall clock (the `failpoints` build reads this file at every stamp).
struct TestClock(std::path::PathBuf);

impl TestClock {
    fn new(agent: &mut CairnProcess) -> TestClock {
        let path = agent.data_dir().with_file_name("clock-offset-ms");
        std::fs::write(&path, "0").unwrap();
        agent.set_env("CAIRN_TEST_CLOCK_OFFSET_FILE", path.to_str().unwrap());
        TestClock(path)
    }
    fn set(&self, offset_ms: i64) {
        std::fs::write(&self.0, offset_ms.to_string()).unwrap();
    }
}

fn assert_stamps_monotonic(log: &[Logged]) {
    for w in log.windows(2) {
        assert!(
            w[1].received_at_ms >= w[0].received_at_ms,
            "time of receipt went back from {} (offset {}) to {} (offset {})",
            w[0].received_at_ms,
            w[0].offset,
            w[1].received_at_ms,
            w[1].offset
        );
    }
}

#[test]
fn a_clock_stepped_back_a_day_does_not_make_new_events_late_and_stamps_stay_monotonic() {
    require_failpoints();
    let broker = Broker::start();
    let mut agent = CairnProcess::new(&AgentConfig::new(broker.port(), WINDOWED));
    let clock = TestClock::new(&mut agent);
    agent.start_connected();
    publish_all(broker.port(), &events(0, 10));
    wait_logged(&agent, 10);
    clock.set(-DAY_MS);
    publish_all(broker.port(), &events(10, 20));
    wait_logged(&agent, 20);
    // A day less the moments since the last stamp: `1d` or `23h59m..s`.
    let said = agent.run_stderr();
    assert!(
        said.contains("clock: the wall clock stepped back by 1d;")
            || said.contains("clock: the wall clock stepped back by 23h59m"),
        "the step is in the journal:\n{}",
        agent.stderr_tail(20)
    );
    stop_cleanly(&mut agent);

    // A restart with the clock still a day behind: stamps start at the recorded ones.
    agent.start_connected();
    assert!(
        agent
            .run_stderr()
            .contains("is behind the newest time of receipt"),
        "{}",
        agent.stderr_tail(20)
    );
    publish_all(broker.port(), &events(20, 30));
    wait_logged(&agent, 30);
    stop_cleanly(&mut agent);

    let dead = agent.inspect("dead-letters");
    assert!(dead.is_empty(), "no event became a dead letter: {dead:?}");
    let ids: BTreeSet<String> = (0..30).map(|i| format!("E{i}")).collect();
    assert_eq!(state(&agent), oracle(&ids));
    let log = logged(&agent);
    assert_stamps_monotonic(&log);
    let span = log.last().unwrap().received_at_ms - log[0].received_at_ms;
    assert!(
        span < 600_000,
        "stamps advanced at the real rate, not by a day: span {span} ms"
    );
}

#[test]
fn a_clock_stepped_forwards_is_followed_and_reported() {
    require_failpoints();
    let broker = Broker::start();
    let mut agent = CairnProcess::new(&AgentConfig::new(broker.port(), PIPELINE));
    let clock = TestClock::new(&mut agent);
    agent.start_connected();
    publish_all(broker.port(), &events(0, 5));
    wait_logged(&agent, 5);
    clock.set(365 * DAY_MS);
    publish_all(broker.port(), &events(5, 10));
    wait_logged(&agent, 10);
    stop_cleanly(&mut agent);
    let said = agent.stderr();
    let line = said
        .lines()
        .find(|l| l.contains("clock: the wall clock stepped forwards by 365d"))
        .unwrap_or_else(|| panic!("no forward-step warning:\n{}", agent.stderr_tail(20)));
    assert!(
        line.contains("dedup entries first seen before")
            && line.contains("pipeline `sums`, dedup_window 7d")
            && line.contains("log.retention 1h"),
        "the warning says what expires: {line}"
    );
    assert_eq!(
        said.matches("stepped forwards").count(),
        1,
        "one step, one line"
    );
    let log = logged(&agent);
    assert_stamps_monotonic(&log);
    let jump = log.last().unwrap().received_at_ms - log[0].received_at_ms;
    assert!(
        jump >= 365 * DAY_MS as u64,
        "stamps follow a forward step: {jump} ms"
    );
    let ids: BTreeSet<String> = (0..10).map(|i| format!("E{i}")).collect();
    assert_eq!(state(&agent), oracle(&ids));
}
