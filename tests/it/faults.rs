//! Faults beyond a crash (issue 5, item 5): a full disk, a corrupt log segment, a missing,
//! corrupt or unreachable store. Each test runs a private mosquitto and the real `cairn`
//! binary, and compares `cairn inspect state --json` with an oracle (a fold over the events
//! published, each event ID once).
//!
//! The disk tests mount small tmpfs filesystems and so need root; without it they panic
//! saying so (a test that silently skips proves nothing). Every mount is undone by a
//! [`Mount`] guard, lazily if the agent still holds files in it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::support::agent::{AgentConfig, CairnProcess};
use crate::support::{Broker, publish_all, wait_until};

const MIB: u64 = 1 << 20;

const PIPELINE: &str = "[[pipeline]]\nname = \"sums\"\ntopics = [\"in/#\"]\nformat = \"json\"\n\
     event_id = \"/id\"\nkey = \"/k\"\nvalue = \"/v\"\naggregate = \"sum\"\n\
     dedup_window = \"7d\"\noutput_topic = \"out/{key}\"\nretain = true\n";

/// Events `from..to`, each with `pad` filler bytes so the log grows as fast as a test needs.
fn events(from: u64, to: u64, pad: usize) -> Vec<(String, Vec<u8>, bool)> {
    let filler = "x".repeat(pad);
    (from..to)
        .map(|i| {
            let body = format!(
                r#"{{"id":"E{i}","k":"k{}","v":{},"pad":"{filler}"}}"#,
                i % 7,
                i % 11 + 1
            );
            (format!("in/{}", i % 3), body.into_bytes(), false)
        })
        .collect()
}

/// key → (sum, count) over events `0..n`.
fn oracle(n: u64) -> BTreeMap<String, (i64, u64)> {
    let mut m = BTreeMap::new();
    for i in 0..n {
        let e = m.entry(format!("k{}", i % 7)).or_insert((0, 0));
        e.0 += (i % 11 + 1) as i64;
        e.1 += 1;
    }
    m
}

/// key → (sum, count) as `cairn inspect state --json` reports it (the agent stopped).
fn state(agent: &CairnProcess) -> BTreeMap<String, (i64, u64)> {
    agent
        .inspect("state")
        .iter()
        .map(|row| {
            let value = row["value"].as_f64().expect("numeric value");
            (
                row["key"].as_str().expect("key").to_string(),
                (value as i64, row["count"].as_u64().expect("count")),
            )
        })
        .collect()
}

fn assert_state_is_oracle(agent: &CairnProcess, n: u64) {
    assert_eq!(
        state(agent),
        oracle(n),
        "the state differs from the oracle over {n} events; stderr:\n{}",
        agent.stderr_tail(30)
    );
}

/// `cairn inspect log --json`: (offset, event id) of every readable record.
fn logged(agent: &CairnProcess) -> Vec<(u64, String)> {
    let (status, out, err) = agent.command(&["inspect", "log", "--limit", "10000000", "--json"]);
    assert!(
        status.success(),
        "cairn inspect log failed ({status}): {err}"
    );
    out.lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("JSON line");
            let payload: serde_json::Value =
                serde_json::from_str(v["payload"].as_str().expect("text payload"))
                    .expect("JSON payload");
            (
                v["offset"].as_u64().expect("offset"),
                payload["id"].as_str().expect("id").to_string(),
            )
        })
        .collect()
}

fn distinct_ids(agent: &CairnProcess) -> usize {
    logged(agent)
        .into_iter()
        .map(|(_, id)| id)
        .collect::<BTreeSet<_>>()
        .len()
}

/// Waits until every one of `n` events is in the log (each at least once).
fn wait_all_logged(agent: &CairnProcess, n: usize, timeout: Duration) {
    assert!(
        wait_until(timeout, || distinct_ids(agent) >= n),
        "only {} of {n} events reached the log; stderr:\n{}",
        distinct_ids(agent),
        agent.stderr_tail(30)
    );
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

/// Starts `cairn run` and expects it to refuse: exit 1 within 20 s. Returns its stderr.
fn run_refused(agent: &mut CairnProcess) -> String {
    agent.start();
    let status = agent.wait_exit(Duration::from_secs(20)).unwrap_or_else(|| {
        panic!(
            "cairn run did not refuse; stderr:\n{}",
            agent.stderr_tail(30)
        )
    });
    assert_eq!(
        status.code(),
        Some(1),
        "cairn run should exit 1; stderr:\n{}",
        agent.run_stderr()
    );
    agent.run_stderr()
}

/// Bytes of every segment file in the log directory.
fn log_bytes(data: &Path) -> u64 {
    std::fs::read_dir(data.join("log"))
        .expect("read the log dir")
        .filter_map(|e| e.ok())
        .filter(|e| e.path().extension().is_some_and(|x| x == "log"))
        .map(|e| e.metadata().map(|m| m.len()).unwrap_or(0))
        .sum()
}

fn segments(data: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(data.join("log"))
        .expect("read the log dir")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "log"))
        .collect();
    v.sort();
    v
}

/// A tmpfs mounted for the length of a test. Dropping it unmounts, lazily (`umount -l`) if
/// a process still holds files in it, so a failing test never leaves a mount behind.
pub(crate) struct Mount(PathBuf);

impl Mount {
    pub(crate) fn tmpfs(dir: &Path, options: &str) -> Mount {
        std::fs::create_dir_all(dir).expect("create the mount point");
        // A tmpfs root is 1777 by default, a data directory the agent refuses (others could
        // write it): 0700, as Cairn makes one.
        let options = format!("{options},mode=0700");
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &options, "tmpfs"])
            .arg(dir)
            .output()
            .expect("run mount");
        assert!(
            out.status.success(),
            "mounting a tmpfs needs root (these tests fill a small filesystem): {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Mount(dir.to_path_buf())
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let ok = Command::new("umount")
            .arg(&self.0)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            let _ = Command::new("umount").arg("-l").arg(&self.0).status();
        }
    }
}

fn small_log(cfg: &mut AgentConfig, retention: &str) {
    cfg.log = format!(
        "segment_size = \"1MiB\"\nmax_size = \"256MiB\"\nretention = \"{retention}\"\n\
         commit_interval = \"2ms\"\nmax_payload = \"64KiB\"\n"
    );
}

// ---------------------------------------------------------------------------------------
// 1. Disk full.

/// The data directory is a 24 MiB tmpfs. With a ballast leaving less than the reserve
/// (2 × segment_size = 2 MiB) free, the agent says "backpressure on", stops acking and its
/// log stops growing while the broker queues; with the ballast gone it resumes, and every
/// event counts exactly once.
#[test]
fn a_nearly_full_disk_is_backpressure_and_nothing_is_lost_when_space_returns() {
    let broker = Broker::start();
    let mut cfg = AgentConfig::new(broker.port(), PIPELINE);
    small_log(&mut cfg, "1h");
    let mut agent = CairnProcess::new(&cfg);
    let data = agent.data_dir();
    let _mount = Mount::tmpfs(&data, "size=24m");
    agent.start_connected();

    publish_all(broker.port(), &events(0, 300, 200));
    wait_all_logged(&agent, 300, Duration::from_secs(10));

    // Leave 1.7 MiB: below the 2 MiB reserve, but room for the store's checkpoints.
    let ballast = data.join("ballast");
    let free = cairn::disk::free_bytes(&data).unwrap();
    let leave = 2 * MIB - 300 * 1024;
    assert!(
        free > leave + 4 * MIB,
        "the tmpfs is unexpectedly full: {free}"
    );
    fill(&ballast, free - leave);
    assert!(cairn::disk::free_bytes(&data).unwrap() < 2 * MIB);
    // The guard trusts a measurement for 100 ms (`disk::REFRESH`), counting only its own
    // writes against it: another writer's bytes count from its next one. Wait that out, or a
    // burst arriving within it is logged whole on the figure taken before the ballast.
    std::thread::sleep(Duration::from_millis(300));

    // The broker acknowledges the publisher regardless; the agent must hold these.
    publish_all(broker.port(), &events(300, 1000, 200));
    assert!(
        wait_until(Duration::from_secs(5), || agent
            .run_stderr()
            .contains("backpressure on: the disk is nearly full")),
        "no disk-full backpressure; stderr:\n{}",
        agent.stderr_tail(30)
    );
    let held_at = log_bytes(&data);
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(
        log_bytes(&data),
        held_at,
        "the log grew under disk-full backpressure"
    );
    let logged_while_full = distinct_ids(&agent);
    assert!(
        logged_while_full < 1000,
        "every event was logged although the disk was full"
    );
    assert!(
        agent.is_running(),
        "the agent died: {}",
        agent.stderr_tail(30)
    );

    std::fs::remove_file(&ballast).unwrap();
    assert!(
        wait_until(Duration::from_secs(5), || agent
            .run_stderr()
            .contains("backpressure off")),
        "backpressure did not end when space returned; stderr:\n{}",
        agent.stderr_tail(30)
    );
    wait_all_logged(&agent, 1000, Duration::from_secs(15));
    eprintln!("{logged_while_full} of 1000 events were logged before the disk filled");
    stop_cleanly(&mut agent);
    assert_state_is_oracle(&agent, 1000);
}

/// Writes `bytes` real bytes (tmpfs does not allocate for a sparse file).
pub(crate) fn fill(path: &Path, bytes: u64) {
    use std::io::Write;
    let mut f = std::fs::File::create(path).expect("create the ballast");
    let chunk = vec![0xA5u8; MIB as usize];
    let mut left = bytes;
    while left > 0 {
        let n = left.min(MIB) as usize;
        f.write_all(&chunk[..n]).expect("write the ballast");
        left -= n as u64;
    }
}

/// The space guard counts bytes, not inodes: a tmpfs out of inodes makes the next segment
/// roll fail with ENOSPC. The agent exits 1 saying the disk is full and what to do; once
/// inodes are freed it restarts and loses nothing (the failed batch was never acked, so the
/// broker redelivers it).
#[test]
fn enospc_reaching_the_log_stops_the_agent_with_a_clear_message_and_a_restart_loses_nothing() {
    let broker = Broker::start();
    let mut cfg = AgentConfig::new(broker.port(), PIPELINE);
    small_log(&mut cfg, "1h");
    let mut agent = CairnProcess::new(&cfg);
    let data = agent.data_dir();
    let _mount = Mount::tmpfs(&data, "size=64m,nr_inodes=64");
    agent.start_connected();
    publish_all(broker.port(), &events(0, 100, 100));
    wait_all_logged(&agent, 100, Duration::from_secs(10));

    let ballast = data.join("inodes");
    std::fs::create_dir(&ballast).unwrap();
    let mut made = 0;
    loop {
        match std::fs::File::create(ballast.join(made.to_string())) {
            Ok(_) => made += 1,
            Err(e) if cairn::disk::is_disk_full(&e) => break,
            Err(e) => panic!("unexpected error filling inodes: {e}"),
        }
        assert!(made < 1000, "nr_inodes had no effect");
    }

    // 1000 × ~2 KiB: past the 1 MiB segment, so the log must create a new segment file.
    publish_all(broker.port(), &events(100, 1100, 2000));
    let status = agent
        .wait_exit(Duration::from_secs(20))
        .unwrap_or_else(|| panic!("the agent kept running; stderr:\n{}", agent.stderr_tail(30)));
    let said = agent.run_stderr();
    assert_eq!(status.code(), Some(1), "stderr:\n{said}");
    for part in [
        "No space left on device",
        "is out of space (bytes or inodes): free space there and start the agent again",
        "Nothing acknowledged is lost",
    ] {
        assert!(said.contains(part), "the message lacks `{part}`:\n{said}");
    }

    std::fs::remove_dir_all(&ballast).unwrap();
    agent.start_connected();
    wait_all_logged(&agent, 1100, Duration::from_secs(15));
    stop_cleanly(&mut agent);
    assert_state_is_oracle(&agent, 1100);
}

// ---------------------------------------------------------------------------------------
// 2. Mid-log corruption.

/// A flipped byte inside a frame in the middle of the only segment, good frames of later
/// commits after it.
/// `run` and `verify` refuse naming the segment and offset and point to `verify --repair`;
/// the repair moves the segment aside byte for byte and keeps its valid prefix. What is lost
/// is log history only: records [k, k + 1 + dropped) (the damaged one and the good ones after
/// it) are gone from the log, exactly as the repair reports, but the store had checkpointed
/// them all before the stop, so the state still counts every event, and new events go on.
#[test]
fn a_corrupt_frame_mid_log_is_refused_until_verify_repair_moves_the_segment_aside() {
    let broker = Broker::start();
    let mut cfg = AgentConfig::new(broker.port(), PIPELINE);
    small_log(&mut cfg, "1h");
    let mut agent = CairnProcess::new(&cfg);
    let data = agent.data_dir();
    agent.start_connected();
    // In two parts, the second only once the first is in the log: the damage below lies in
    // the first part, and the second part's commits, which began after it was synced, prove
    // it is not a torn commit (a commit's own pages may reach the disk in any order).
    publish_all(broker.port(), &events(0, 200, 100));
    wait_all_logged(&agent, 200, Duration::from_secs(10));
    let first_part = std::fs::metadata(&segments(&data)[0]).unwrap().len();
    publish_all(broker.port(), &events(200, 400, 100));
    wait_all_logged(&agent, 400, Duration::from_secs(10));
    stop_cleanly(&mut agent);

    let segs = segments(&data);
    assert_eq!(segs.len(), 1, "expected one segment: {segs:?}");
    let seg = &segs[0];
    let seg_name = seg.file_name().unwrap().to_string_lossy().into_owned();
    let mut bytes = std::fs::read(seg).unwrap();
    let pos = first_part as usize / 2;
    bytes[pos] ^= 0x40;
    std::fs::write(seg, &bytes).unwrap();

    let said = run_refused(&mut agent);
    for part in [
        seg_name.as_str(),
        "is corrupt at byte",
        "(offset ",
        "cairn verify --repair",
    ] {
        assert!(said.contains(part), "`cairn run` lacks `{part}`:\n{said}");
    }
    let (status, out, _) = agent.command(&["verify"]);
    assert_eq!(status.code(), Some(1), "verify should fail:\n{out}");
    for part in [
        seg_name.as_str(),
        "log corruption in",
        "(offset ",
        "cairn verify --repair",
    ] {
        assert!(out.contains(part), "`cairn verify` lacks `{part}`:\n{out}");
    }

    let (status, out, err) = agent.command(&["verify", "--repair"]);
    assert_eq!(status.code(), Some(0), "repair failed:\n{out}\n{err}");
    let line = out
        .lines()
        .find(|l| l.starts_with("repaired "))
        .unwrap_or_else(|| panic!("no repair line:\n{out}"));
    let num = |after: &str| -> u64 {
        let rest = &line[line.find(after).expect(after) + after.len()..];
        rest.split(|c: char| !c.is_ascii_digit())
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    let kept = num("kept ");
    let dropped = num("dropped ");
    let moved: PathBuf = line
        .split("moved the original to ")
        .nth(1)
        .and_then(|r| r.split(';').next())
        .expect("moved-to path")
        .into();
    assert_eq!(
        std::fs::read(&moved).unwrap(),
        bytes,
        "the moved segment is not byte-identical"
    );

    // The log now holds [0, kept) and nothing up to the 400 records' end.
    let offsets: Vec<u64> = logged(&agent).into_iter().map(|(o, _)| o).collect();
    assert_eq!(offsets, (0..kept).collect::<Vec<_>>());
    assert_eq!(
        kept + 1 + dropped,
        400,
        "the damaged record plus the dropped ones"
    );
    eprintln!("repair kept offsets [0, {kept}), lost [{kept}, 400) from the log: {line}");

    agent.start_connected();
    publish_all(broker.port(), &events(400, 500, 100));
    wait_all_logged(&agent, kept as usize + 100, Duration::from_secs(10));
    stop_cleanly(&mut agent);
    assert_state_is_oracle(&agent, 500);
    let offsets: Vec<u64> = logged(&agent).into_iter().map(|(o, _)| o).collect();
    assert!(
        offsets.iter().all(|&o| o < kept || o >= 400),
        "an offset of a dropped record was reused: {offsets:?}"
    );
}

// ---------------------------------------------------------------------------------------
// 3. A missing, corrupt or unreachable store.

fn run_once(broker: &Broker, cfg: &AgentConfig, n: u64) -> CairnProcess {
    let mut agent = CairnProcess::new(cfg);
    agent.start_connected();
    publish_all(broker.port(), &events(0, n, 50));
    wait_all_logged(&agent, n as usize, Duration::from_secs(10));
    stop_cleanly(&mut agent);
    assert_state_is_oracle(&agent, n);
    agent
}

/// Replay rebuilds a deleted store from the whole log.
#[test]
fn a_deleted_store_is_rebuilt_from_the_log_with_identical_state() {
    let broker = Broker::start();
    let cfg = AgentConfig::new(broker.port(), PIPELINE);
    let mut agent = run_once(&broker, &cfg, 500);
    let before = agent.inspect("state");
    std::fs::remove_dir_all(agent.data_dir().join("store")).unwrap();

    agent.start_connected();
    assert!(
        agent
            .run_stderr()
            .contains("replayed 500 records from offset 0"),
        "no full replay; stderr:\n{}",
        agent.run_stderr()
    );
    stop_cleanly(&mut agent);
    assert_eq!(agent.inspect("state"), before);
}

/// A store sled cannot open stops the agent with the text that says what to do; doing it
/// (moving the store aside) brings the same state back.
#[test]
fn a_corrupt_store_is_refused_with_instructions_that_work() {
    let broker = Broker::start();
    let cfg = AgentConfig::new(broker.port(), PIPELINE);
    let mut agent = run_once(&broker, &cfg, 500);
    let before = agent.inspect("state");
    let store = agent.data_dir().join("store");
    std::fs::write(store.join("conf"), b"\x00garbage\xff not a sled config").unwrap();
    let db = std::fs::OpenOptions::new()
        .write(true)
        .open(store.join("db"))
        .unwrap();
    db.set_len(100).unwrap();
    drop(db);

    let said = run_refused(&mut agent);
    let broken = format!("{}.broken", store.display());
    for part in [
        "cannot be opened",
        "The replay log is not affected",
        &format!("mv {} {broken}", store.display()),
        "the state is rebuilt from the log, if it still starts at offset 0",
        "cairn savepoint restore --latest",
    ] {
        assert!(said.contains(part), "the message lacks `{part}`:\n{said}");
    }
    std::fs::rename(&store, &broken).unwrap();
    agent.start_connected();
    stop_cleanly(&mut agent);
    assert_eq!(agent.inspect("state"), before);
}

/// With 1 MiB segments and retention "0s", checkpointed segments are deleted at once; a
/// store deleted afterwards cannot be rebuilt, and `run` refuses with the `LogGap` text.
#[test]
fn a_store_the_log_no_longer_reaches_is_refused_with_what_to_do() {
    let broker = Broker::start();
    let mut cfg = AgentConfig::new(broker.port(), PIPELINE);
    small_log(&mut cfg, "0s");
    let mut agent = CairnProcess::new(&cfg);
    let data = agent.data_dir();
    agent.start_connected();
    // ~3.5 MiB of records: three sealed segments, deleted once checkpointed.
    publish_all(broker.port(), &events(0, 1700, 2000));
    // Retention deletes what is logged, so wait for the checkpoint to cover every event.
    assert!(
        wait_until(Duration::from_secs(15), || agent
            .checkpointed_offset()
            .is_some_and(|o| o >= 1700)),
        "not every event was checkpointed; stderr:\n{}",
        agent.stderr_tail(20)
    );
    assert!(
        wait_until(Duration::from_secs(5), || segments(&data)
            .first()
            .is_some_and(|s| !s.ends_with("00000000000000000000.log"))),
        "retention deleted no segment: {:?}",
        segments(&data)
    );
    stop_cleanly(&mut agent);
    assert_state_is_oracle(&agent, 1700);
    let first: u64 = segments(&data)[0]
        .file_stem()
        .unwrap()
        .to_string_lossy()
        .parse()
        .unwrap();
    std::fs::remove_dir_all(data.join("store")).unwrap();

    let said = run_refused(&mut agent);
    for part in [
        "the store is empty (new, or moved aside)",
        &format!("replay must start at log offset 0, but the log starts at offset {first}"),
        "deleted by retention",
        &format!("restore a savepoint taken at or after offset {first}"),
        "cairn savepoint restore",
    ] {
        assert!(said.contains(part), "the message lacks `{part}`:\n{said}");
    }
}
