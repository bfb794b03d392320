//! The outbox bound holds for every way processing makes results (issue 26, finding 2):
//! live input, a backfill (`start = "earliest"`) and the replay at start all wait at
//! `outbox.max_entries` while the results cannot leave, and take the rest from the log once
//! they do. Before, a backfill with the uplink down filled the outbox to 15 times its bound
//! while live processing waited, and a start replayed the whole log tail into it.
//!
//! The uplink is a second broker that is stopped while the bound must hold, and started
//! again (same port) to show that everything then goes out and nothing was lost.

use std::time::Duration;

use crate::backfill::{assert_versions_rise_to, back_results, fold, state};
use crate::support::agent::{AgentConfig, CairnProcess};
use crate::support::{Broker, Collector, publish_all, unique_id, wait_until};

/// The bound these tests set, and what a slice may add past it (one slice of
/// `checkpoint.max_records` records, one result each in changelog mode; the live pipeline's
/// upserts, one per key).
const BOUND: usize = 100;
const SLICE: usize = 50;
const SLACK: usize = SLICE + 5;

fn pipeline(name: &str, emit: &str, start: &str) -> String {
    format!(
        "[[pipeline]]\nname = \"{name}\"\ntopics = [\"m/#\"]\nformat = \"delimited\"\n\
         event_id = \"0\"\nkey = \"{{topic[1]}}\"\nvalue = \"1\"\naggregate = \"sum\"\n\
         emit = \"{emit}\"\nstart = \"{start}\"\noutput_topic = \"{name}/{{key}}\"\n"
    )
}

/// Event `id` of machine `id % 5`, value `id`.
fn event(id: u64) -> (String, Vec<u8>, bool) {
    (
        format!("m/M{}", id % 5),
        format!("E{id}/{id}").into_bytes(),
        false,
    )
}

fn offline_status(agent: &CairnProcess) -> serde_json::Value {
    let (st, out, err) = agent.command(&["status", "--offline", "--json"]);
    assert!(st.success(), "{err}");
    serde_json::from_str(&out).unwrap()
}

/// The uplink's broker and the agent's config with results going there, the outbox bound
/// at [`BOUND`] and slices of [`SLICE`] records.
fn setup(pipelines: &str) -> (Broker, Broker, AgentConfig) {
    let local = Broker::start();
    let central = Broker::start();
    let up_id = unique_id("uplink").replace('-', "_");
    let mut cfg =
        AgentConfig::new(local.port(), pipelines).with_uplink(central.port(), &up_id, "site/");
    cfg.outbox = format!("max_entries = {BOUND}\ninflight = 20\ndrain_timeout = \"1s\"\n");
    cfg.checkpoint = format!("interval = \"50ms\"\nmax_records = {SLICE}\n");
    (local, central, cfg)
}

/// With the uplink up: wait until everything up to `logged` is checkpointed, then stop
/// cleanly (the drain publishes what it can).
fn drain_and_stop(agent: &mut CairnProcess, logged: u64) {
    let up = wait_until(Duration::from_secs(30), || {
        agent.run_stderr().contains("uplink: connected")
    });
    assert!(up, "no uplink:\n{}", agent.stderr_tail(30));
    let done = wait_until(Duration::from_secs(60), || {
        agent.checkpointed_offset() == Some(logged)
    });
    assert!(
        done,
        "processing did not finish:\n{}",
        agent.stderr_tail(30)
    );
    assert!(agent.terminate().success(), "{}", agent.stderr_tail(30));
}

#[test]
fn a_backfill_waits_at_the_outbox_bound_while_the_uplink_is_down_and_finishes_once_it_returns() {
    let (local, mut central, mut cfg) = setup(&pipeline("base", "upsert", "latest"));
    let mut agent = CairnProcess::new(&cfg);
    agent.start_connected();
    publish_all(local.port(), &(0..1000).map(event).collect::<Vec<_>>());
    drain_and_stop(&mut agent, 1000);

    // The uplink goes down; a pipeline is added that backfills the 1000 logged records,
    // one result each.
    central.stop();
    cfg.pipelines = format!(
        "{}{}",
        pipeline("base", "upsert", "latest"),
        pipeline("back", "changelog", "earliest")
    );
    agent.rewrite_config(&cfg);
    agent.start_connected();
    let stopped = wait_until(Duration::from_secs(30), || {
        let s = agent.run_stderr();
        s.contains("pipeline `back`: backfill done") || s.contains("processing waits")
    });
    assert!(stopped, "{}", agent.stderr_tail(30));
    assert!(agent.terminate().success(), "{}", agent.stderr_tail(30));
    let entries = agent.inspect("outbox").len();
    assert!(
        entries <= BOUND + SLACK,
        "the backfill filled the outbox to {entries} entries, past its bound of {BOUND}:\n{}",
        agent.stderr_tail(20)
    );
    assert!(
        entries >= BOUND,
        "the backfill stopped before the bound: {entries}"
    );

    // The uplink returns: the backfill goes on as results leave, and nothing is lost.
    central.restart();
    agent.start_connected();
    let done = wait_until(Duration::from_secs(60), || {
        agent
            .run_stderr()
            .contains("pipeline `back`: backfill done")
    });
    assert!(done, "{}", agent.stderr_tail(30));
    drain_and_stop(&mut agent, 1000);
    assert_eq!(state(&agent, "back"), fold(0..1000));
    assert_eq!(state(&agent, "base"), fold(0..1000));
}

#[test]
fn the_replay_at_start_stops_at_the_outbox_bound_and_the_rest_follows_as_results_leave() {
    let (local, mut central, mut cfg) = setup(&pipeline("sums", "changelog", "latest"));
    cfg.extra = format!(
        "[metrics]\nlisten = \"127.0.0.1:{}\"\n",
        crate::support::free_port()
    );
    let mut agent = CairnProcess::new(&cfg);
    // The uplink is down from the start: processing waits at the bound and the log holds
    // the rest.
    central.stop();
    agent.start_connected();
    publish_all(local.port(), &(0..1000).map(event).collect::<Vec<_>>());
    let logged = wait_until(Duration::from_secs(30), || {
        let (st, out, _) = agent.command(&["status", "--json"]);
        st.success()
            && serde_json::from_str::<serde_json::Value>(&out)
                .is_ok_and(|v| v["log"]["next_offset"].as_u64() == Some(1000))
    });
    assert!(logged, "not all logged:\n{}", agent.stderr_tail(30));
    assert!(agent.terminate().success(), "{}", agent.stderr_tail(30));
    let v = offline_status(&agent);
    let checkpointed = v["checkpoint"]["next_offset"].as_u64().unwrap();
    assert!(
        checkpointed < 500,
        "processing did not wait at the bound: checkpoint at {checkpointed}: {v}"
    );

    // A start with the uplink still down: its replay must not run past the bound either.
    agent.start_connected();
    let recovered = wait_until(Duration::from_secs(30), || {
        agent.run_stderr().contains("recovery: done")
    });
    assert!(recovered, "{}", agent.stderr_tail(30));
    assert!(agent.terminate().success(), "{}", agent.stderr_tail(30));
    let entries = agent.inspect("outbox").len();
    assert!(
        entries <= BOUND + SLACK,
        "the replay filled the outbox to {entries} entries, past its bound of {BOUND}:\n{}",
        agent.stderr_tail(20)
    );

    central.restart();
    agent.start_connected();
    drain_and_stop(&mut agent, 1000);
    assert_eq!(state(&agent, "sums"), fold(0..1000));
}

/// With a pipeline that emits upserts the replay at start goes past the outbox bound, but
/// only up to the send horizon the last durable checkpoint recorded (`2 × max_records +
/// 4096` records past it): the bound still holds the rest of a long log tail back.
#[test]
fn with_upserts_the_replay_passes_the_outbox_bound_only_up_to_the_send_horizon() {
    const LOGGED: u64 = 10_000;
    const SLACK_RECORDS: u64 = 2 * SLICE as u64 + 4096;
    let both = format!(
        "{}{}",
        pipeline("sums", "changelog", "latest"),
        pipeline("ups", "upsert", "latest")
    );
    let (local, mut central, cfg) = setup(&both);
    let mut agent = CairnProcess::new(&cfg);
    central.stop();
    agent.start_connected();
    publish_all(local.port(), &(0..LOGGED).map(event).collect::<Vec<_>>());
    let logged = wait_until(Duration::from_secs(60), || {
        let (st, out, _) = agent.command(&["status", "--json"]);
        st.success()
            && serde_json::from_str::<serde_json::Value>(&out)
                .is_ok_and(|v| v["log"]["next_offset"].as_u64() == Some(LOGGED))
    });
    assert!(logged, "not all logged:\n{}", agent.stderr_tail(30));
    assert!(agent.terminate().success(), "{}", agent.stderr_tail(30));
    let first = offline_status(&agent)["checkpoint"]["next_offset"]
        .as_u64()
        .unwrap();
    assert!(first < 500, "processing did not wait at the bound: {first}");

    // The uplink still down: the replay goes past the bound to the horizon, and stops.
    agent.start_connected();
    let recovered = wait_until(Duration::from_secs(30), || {
        agent.run_stderr().contains("recovery: done")
    });
    assert!(recovered, "{}", agent.stderr_tail(30));
    assert!(agent.terminate().success(), "{}", agent.stderr_tail(30));
    assert!(
        agent.stderr().contains("replaying on to there first"),
        "{}",
        agent.stderr_tail(30)
    );
    let second = offline_status(&agent)["checkpoint"]["next_offset"]
        .as_u64()
        .unwrap();
    assert!(
        second > first + (BOUND + SLACK) as u64,
        "the replay stopped at the bound ({first} → {second})"
    );
    assert!(
        second <= first + SLACK_RECORDS + SLICE as u64,
        "the replay ran past the send horizon {} to {second}",
        first + SLACK_RECORDS
    );

    central.restart();
    agent.start_connected();
    drain_and_stop(&mut agent, LOGGED);
    assert_eq!(state(&agent, "sums"), fold(0..LOGGED));
    assert_eq!(state(&agent, "ups"), fold(0..LOGGED));
}

/// Store writes under the free-space guard (issue 26): a checkpoint on a disk with less than
/// the reserve free waits, and processing with it, instead of failing with `ENOSPC` and
/// crash-looping the agent; with room again it goes on, and nothing is lost. The data
/// directory is a 24 MiB tmpfs; a backfill's checkpoints are what would write into it.
#[test]
fn a_checkpoint_on_a_nearly_full_disk_waits_instead_of_crash_looping() {
    use crate::faults::{Mount, fill};
    const MIB: u64 = 1 << 20;
    let broker = Broker::start();
    let mut cfg = AgentConfig::new(broker.port(), &pipeline("base", "upsert", "latest"));
    cfg.log = "segment_size = \"1MiB\"\nmax_size = \"16MiB\"\nretention = \"1h\"\n\
               commit_interval = \"2ms\"\nmax_payload = \"64KiB\"\n"
        .into();
    cfg.checkpoint = format!("interval = \"50ms\"\nmax_records = {SLICE}\n");
    let mut agent = CairnProcess::new(&cfg);
    let data = agent.data_dir();
    let _mount = Mount::tmpfs(&data, "size=24m");
    agent.start_connected();
    publish_all(broker.port(), &(0..2000).map(event).collect::<Vec<_>>());
    assert!(
        wait_until(Duration::from_secs(30), || agent.checkpointed_offset()
            == Some(2000)),
        "checkpointed {:?} of 2000\n{}\nbroker:\n{}",
        agent.checkpointed_offset(),
        agent.stderr_tail(20),
        broker.log_tail_of(&cfg.client_id, 40)
    );
    assert!(agent.terminate().success());

    // A pipeline that backfills 2000 records, one result each, on a disk with 128 KiB free.
    cfg.pipelines = format!(
        "{}{}",
        pipeline("base", "upsert", "latest"),
        pipeline("back", "changelog", "earliest")
    );
    agent.rewrite_config(&cfg);
    let ballast = data.join("ballast");
    let free = cairn::disk::free_bytes(&data).unwrap();
    assert!(free > 4 * MIB, "the tmpfs is unexpectedly full: {free}");
    fill(&ballast, free - 128 * 1024);
    agent.start_connected();
    assert!(
        wait_until(Duration::from_secs(20), || agent
            .run_stderr()
            .contains("checkpoint waits: the disk is nearly full")),
        "no checkpoint waited for room:\n{}",
        agent.stderr_tail(30)
    );
    // It waits, alive, and stays so.
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        agent.is_running(),
        "the agent died:\n{}",
        agent.stderr_tail(30)
    );
    assert!(!agent.run_stderr().contains("checkpoint failed"));

    std::fs::remove_file(&ballast).unwrap();
    assert!(
        wait_until(Duration::from_secs(30), || agent
            .run_stderr()
            .contains("pipeline `back`: backfill done")),
        "the backfill did not go on once there was room:\n{}",
        agent.stderr_tail(30)
    );
    assert!(agent.run_stderr().contains("checkpoints resume"));
    assert!(agent.terminate().success(), "{}", agent.stderr_tail(20));
    assert_eq!(state(&agent, "back"), fold(0..2000));
}

/// The first run of the two tests below: `sums` (upsert) over 3,000 events, each key's
/// upserts sent before their checkpoint up to version 600 (`cfg` makes none durable), then
/// SIGKILL. `before_start` prepares the data directory (what it returns is kept).
fn sent_early_then_killed<T>(
    local: &Broker,
    cfg: &AgentConfig,
    before_start: impl FnOnce(&CairnProcess) -> T,
) -> (CairnProcess, Collector, T) {
    let mut agent = CairnProcess::new(cfg);
    let kept = before_start(&agent);
    let results = Collector::start(local.port(), "sums/#");
    agent.start_connected();
    publish_all(local.port(), &(0..3000).map(event).collect::<Vec<_>>());
    let all_sent = wait_until(Duration::from_secs(30), || {
        let seen = back_results(&results);
        seen.len() == 5 && seen.values().all(|(v, _)| v.contains(&600))
    });
    assert!(
        all_sent,
        "{:?}:\n{}",
        back_results(&results),
        agent.stderr_tail(20)
    );
    agent.kill();
    (agent, results, kept)
}

/// Everything up to `logged` processed (by the replay or by catch-up) and every result gone.
fn wait_processed_and_sent(agent: &CairnProcess, logged: u64) {
    let done = wait_until(Duration::from_secs(60), || {
        let (st, out, _) = agent.command(&["status", "--json"]);
        st.success()
            && serde_json::from_str::<serde_json::Value>(&out).is_ok_and(|v| {
                v["checkpoint"]["next_offset"] == logged && v["outbox"]["entries"] == 0
            })
    });
    assert!(done, "{}", agent.stderr_tail(30));
}

/// A start whose replay stops at the outbox bound (here lowered by a config edit made while
/// the agent was down; lost deletions of settled entries do the same) must not send a
/// key's result below a version the run before sent. That run sent each key's upserts
/// before their checkpoint, up to version 600, and was killed with none durable; a replay
/// cut short after five records, and a catch-up flushing every five, would emit versions it
/// never did (2, 3, ...) after 600. So a start replays past the bound up to the send horizon
/// the last durable checkpoint recorded: every record whose results may have left early.
#[test]
fn a_replay_cut_short_by_a_lowered_outbox_bound_never_sends_a_version_below_one_sent() {
    let local = Broker::start();
    let mut cfg = AgentConfig::new(local.port(), &pipeline("sums", "upsert", "latest"));
    cfg.checkpoint = "interval = \"1h\"\nmax_records = 100000\n".into();
    let (mut agent, results, ()) = sent_early_then_killed(&local, &cfg, |_| ());
    assert_eq!(
        offline_status(&agent)["checkpoint"]["next_offset"].as_u64(),
        Some(0),
        "a checkpoint became durable in the first run: the test needs none"
    );

    cfg.outbox = "max_entries = 5\ninflight = 20\ndrain_timeout = \"1s\"\n".into();
    cfg.checkpoint = "interval = \"50ms\"\nmax_records = 5\n".into();
    agent.rewrite_config(&cfg);
    agent.start_connected();
    wait_processed_and_sent(&agent, 3000);
    assert!(agent.terminate().success(), "{}", agent.stderr_tail(30));
    let want = fold(0..3000);
    assert_versions_rise_to(&results, &want);
    assert_eq!(state(&agent, "sums"), want);
}

/// The replay at start goes past the outbox bound up to the send horizon, but a nearly full
/// disk stops it short (nothing may be written past the reserve). Then nothing is sent, not
/// even what is durable, until processing has caught up with where results of the run
/// before may have left from, and the outbox bound does not hold processing meanwhile.
#[test]
fn a_replay_stopped_by_a_full_disk_sends_nothing_until_it_has_caught_up_with_what_went_out() {
    use crate::faults::{Mount, fill};
    let local = Broker::start();
    let mut cfg = AgentConfig::new(local.port(), &pipeline("sums", "upsert", "latest"));
    cfg.log = "segment_size = \"1MiB\"\nmax_size = \"16MiB\"\nretention = \"1h\"\n\
               commit_interval = \"2ms\"\nmax_payload = \"64KiB\"\n"
        .into();
    cfg.checkpoint = "interval = \"1h\"\nmax_records = 100000\n".into();
    let (mut agent, results, _mount) = sent_early_then_killed(&local, &cfg, |agent| {
        Mount::tmpfs(&agent.data_dir(), "size=24m")
    });
    let data = agent.data_dir();

    cfg.checkpoint = "interval = \"50ms\"\nmax_records = 5\n".into();
    agent.rewrite_config(&cfg);
    let ballast = data.join("ballast");
    let free = cairn::disk::free_bytes(&data).unwrap();
    fill(&ballast, free - 128 * 1024);
    let sent = results.messages().len();
    agent.start_connected();
    assert!(
        wait_until(Duration::from_secs(20), || agent.run_stderr().contains(
            "short of where results of the run before may have left from"
        )),
        "{}",
        agent.stderr_tail(30)
    );
    assert!(
        wait_until(Duration::from_secs(20), || agent
            .run_stderr()
            .contains("checkpoint waits: the disk is nearly full")),
        "{}",
        agent.stderr_tail(30)
    );
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        results.messages().len(),
        sent,
        "results left before the replay's debt was paid:\n{}",
        agent.stderr_tail(30)
    );

    std::fs::remove_file(&ballast).unwrap();
    wait_processed_and_sent(&agent, 3000);
    assert!(agent.terminate().success(), "{}", agent.stderr_tail(30));
    let want = fold(0..3000);
    assert_versions_rise_to(&results, &want);
    assert_eq!(state(&agent, "sums"), want);
}
