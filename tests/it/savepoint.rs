//! Savepoints (issue 6): a portable snapshot of one checkpoint that rebuilds the store, with
//! the log replaying the rest; damage and a log that no longer reaches back are refused; the
//! agent takes them periodically and its retention keeps the log back to the newest one.

use crate::support;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use crate::support::agent::AgentConfig;
use crate::support::{Broker, publish_all, wait_until};
use cairn::agent::{Agent, Shutdown};
use cairn::config::Config;
use cairn::fsio;
use cairn::log::{Log, LogOptions};
use cairn::processor::Processor;
use cairn::store::{self, Store};

/// The savepoint tests' config: small checkpoints, a 1 s retention (so old segments go),
/// `extra` tables before the pipeline.
fn config(port: u16, extra: &str) -> AgentConfig {
    let mut cfg = AgentConfig::new(port, PIPELINE);
    cfg.mqtt = "keep_alive = \"5s\"\n".into();
    cfg.storage = "cache_size = \"1MiB\"\n".into();
    cfg.log = "retention = \"1s\"\n".into();
    cfg.checkpoint = "interval = \"20ms\"\nmax_records = 100\n".into();
    cfg.outbox = String::new();
    cfg.extra = extra.into();
    cfg
}

const PIPELINE: &str = r#"[[pipeline]]
name = "balances"
topics = ["payments/#"]
format = "delimited"
separator = "/"
event_id = "0"
key = "1"
value = "2"
aggregate = "sum"
dedup_window = "7d"
output_topic = "balances/{key}"
retain = true
"#;

/// A config file in `dir` (data below `dir/data`) and the loaded config.
fn setup(dir: &Path, port: u16, extra: &str) -> (PathBuf, Config) {
    let file = config(port, extra).write(dir);
    let cfg = cairn::config::load(&file).unwrap();
    (file, cfg)
}

/// A log with tiny segments (a few records each), so retention has something to delete.
fn open_log(cfg: &Config, segment_size: u64) -> Log {
    let opts = LogOptions {
        dir: cfg.log_dir(),
        segment_size,
        max_size: 1 << 30,
        max_payload: 1 << 16,
    };
    Log::open(opts, fsio::real()).unwrap().0
}

fn open_proc(cfg: &Config) -> Processor {
    let store = Store::open(&cfg.store_dir(), 1 << 20, fsio::real()).unwrap();
    Processor::open(store, cfg.pipelines.clone()).unwrap()
}

/// Append and fsync (received long ago, so retention may take any processed segment).
fn log_events(log: &mut Log, events: &[&str]) {
    for e in events {
        let at = 1_000 + log.next_offset();
        log.append(at, "payments/in", e.as_bytes(), 1, false)
            .unwrap();
    }
    log.commit().unwrap();
}

fn process_and_checkpoint(log: &Log, proc: &mut Processor) {
    for r in log.read_from(proc.next_offset()).unwrap() {
        proc.apply(&r.unwrap()).unwrap();
    }
    proc.checkpoint(7).unwrap();
}

fn cairn(config: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cairn"))
        .arg("--config")
        .arg(config)
        .args(args)
        .output()
        .unwrap()
}

fn ok(out: &Output) -> String {
    assert!(
        out.status.success(),
        "exit {:?}\nstdout: {}\nstderr: {}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).unwrap()
}

/// Everything `inspect` shows of the store, for before/after comparisons.
fn inspect_all(config: &Path) -> Vec<String> {
    ["state", "dedup", "outbox", "dead-letters", "checkpoints"]
        .iter()
        .map(|what| ok(&cairn(config, &["inspect", what, "--json"])))
        .collect()
}

fn balance(proc: &Processor, key: &str) -> (i64, u64) {
    for r in proc.store().states(Some("balances")) {
        let (_, k, st) = r.unwrap();
        if k == key.as_bytes() {
            return (st.value_json().as_i64().unwrap(), st.version);
        }
    }
    panic!("no state for {key}");
}

fn siblings(store_dir: &Path) -> Vec<String> {
    let name = store_dir
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    let mut v: Vec<String> = std::fs::read_dir(store_dir.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&name))
        .collect();
    v.sort();
    v
}

#[test]
fn a_savepoint_restores_identical_state_after_the_store_is_deleted_and_processing_continues() {
    let dir = tempfile::tempdir().unwrap();
    let (config, cfg) = setup(dir.path(), 1, "");
    {
        let mut log = open_log(&cfg, 1 << 20);
        let mut proc = open_proc(&cfg);
        log_events(&mut log, &["E1/A/100", "E2/B/50", "E1/A/100", "garbage"]);
        process_and_checkpoint(&log, &mut proc);
        log_events(&mut log, &["E3/A/7"]);
        process_and_checkpoint(&log, &mut proc);
        // Logged but not checkpointed: the replay after the restore brings it in.
        log_events(&mut log, &["E4/B/1"]);
    }
    let created: serde_json::Value =
        serde_json::from_str(&ok(&cairn(&config, &["savepoint", "create", "--json"]))).unwrap();
    assert_eq!(created["checkpoint_id"], 2);
    assert_eq!(created["next_offset"], 5);
    let listed = ok(&cairn(&config, &["savepoint", "list", "--json"]));
    assert_eq!(listed.lines().count(), 1, "{listed}");
    let before = inspect_all(&config);
    assert!(before[0].contains("\"value\":107"), "{}", before[0]);

    std::fs::remove_dir_all(cfg.store_dir()).unwrap();
    let restored = ok(&cairn(&config, &["savepoint", "restore", "--latest"]));
    assert!(
        restored.contains("replays the log from offset 5"),
        "{restored}"
    );
    assert_eq!(inspect_all(&config), before, "restored store differs");

    // Continued processing: the log replays E4 and new records; E1 is still a duplicate
    // because the dedup ledger came back with the state.
    let mut log = open_log(&cfg, 1 << 20);
    log_events(&mut log, &["E5/A/3", "E1/A/100"]);
    let mut proc = open_proc(&cfg);
    proc.replay(&log, 1000, &|| 0, &mut |_| {}).unwrap();
    assert_eq!(balance(&proc, "A"), (110, 3));
    assert_eq!(balance(&proc, "B"), (51, 2));
    let p = &proc.engine().progress().pipelines[0];
    assert_eq!(
        (
            p.counters.applied,
            p.counters.duplicates,
            p.counters.dead_letters
        ),
        (5, 2, 1)
    );
}

#[test]
fn restore_moves_an_existing_store_aside_and_never_deletes_it() {
    let dir = tempfile::tempdir().unwrap();
    let (config, cfg) = setup(dir.path(), 1, "");
    let file = {
        let mut log = open_log(&cfg, 1 << 20);
        let mut proc = open_proc(&cfg);
        log_events(&mut log, &["E1/A/100"]);
        process_and_checkpoint(&log, &mut proc);
        let sp = proc
            .store()
            .write_savepoint(&cfg.savepoint_dir(), &fsio::real())
            .unwrap();
        log_events(&mut log, &["E2/A/1"]);
        process_and_checkpoint(&log, &mut proc);
        sp.path
    };
    ok(&cairn(
        &config,
        &["savepoint", "restore", file.to_str().unwrap()],
    ));
    ok(&cairn(
        &config,
        &["savepoint", "restore", file.to_str().unwrap()],
    ));
    assert_eq!(
        siblings(&cfg.store_dir()),
        ["store", "store.old-1", "store.old-2"]
    );
    let old = Store::open(&dir.path().join("data/store.old-1"), 1 << 20, fsio::real()).unwrap();
    assert_eq!(
        old.progress().unwrap().checkpoint_id,
        2,
        "the previous store is intact"
    );
}

#[test]
fn a_damaged_savepoint_is_refused_and_the_store_is_left_alone() {
    let dir = tempfile::tempdir().unwrap();
    let (config, cfg) = setup(dir.path(), 1, "");
    let sp = {
        let mut log = open_log(&cfg, 1 << 20);
        let mut proc = open_proc(&cfg);
        log_events(&mut log, &["E1/A/100", "E2/B/5"]);
        process_and_checkpoint(&log, &mut proc);
        proc.store()
            .write_savepoint(&cfg.savepoint_dir(), &fsio::real())
            .unwrap()
    };
    let before = inspect_all(&config);
    let mut bytes = std::fs::read(&sp.path).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    std::fs::write(&sp.path, &bytes).unwrap();

    assert!(
        store::read_savepoint_header(&sp.path).is_ok(),
        "the header is intact"
    );
    let err = store::verify_savepoint(&sp.path).unwrap_err().to_string();
    assert!(err.contains("CRC mismatch"), "{err}");
    let out = cairn(&config, &["savepoint", "restore", "--latest"]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("is damaged: CRC mismatch"), "{stderr}");
    assert_eq!(
        siblings(&cfg.store_dir()),
        ["store"],
        "nothing built, nothing moved"
    );
    assert_eq!(inspect_all(&config), before);

    // A damaged header is not listed (and so never chosen by --latest).
    bytes[20] ^= 1;
    std::fs::write(&sp.path, &bytes).unwrap();
    assert!(
        store::list_savepoints(&cfg.savepoint_dir())
            .unwrap()
            .is_empty()
    );
}

#[test]
fn restore_refuses_when_the_log_no_longer_reaches_back_to_the_savepoint() {
    let dir = tempfile::tempdir().unwrap();
    let (config, cfg) = setup(dir.path(), 1, "");
    {
        let mut log = open_log(&cfg, 200);
        let mut proc = open_proc(&cfg);
        log_events(&mut log, &["E1/A/1", "E2/A/2"]);
        process_and_checkpoint(&log, &mut proc);
        proc.store()
            .write_savepoint(&cfg.savepoint_dir(), &fsio::real())
            .unwrap();
        let more: Vec<String> = (3..40).map(|i| format!("E{i}/A/1")).collect();
        log_events(
            &mut log,
            &more.iter().map(String::as_str).collect::<Vec<_>>(),
        );
        process_and_checkpoint(&log, &mut proc);
        assert!(log.truncate_before(proc.next_offset()).unwrap() > 0);
        assert!(log.first_offset() > 2);
    }
    let before = inspect_all(&config);
    let out = cairn(&config, &["savepoint", "restore", "--latest"]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("needs the log from offset 2 on, but the log holds offsets"),
        "{stderr}"
    );
    assert_eq!(siblings(&cfg.store_dir()), ["store"]);
    assert_eq!(inspect_all(&config), before);
}

/// Runs the agent in this process until the returned closure is called.
fn run_agent(cfg: Config) -> (std::sync::Arc<cairn::metrics::Metrics>, impl FnOnce()) {
    let agent = Agent::start(cfg, fsio::real()).unwrap();
    let metrics = agent.metrics().clone();
    let shutdown = Shutdown::new();
    let stop = shutdown.clone();
    let thread = std::thread::spawn(move || agent.run(&shutdown).unwrap());
    assert!(
        wait_until(Duration::from_secs(10), || metrics.snapshot().connected),
        "the agent did not connect"
    );
    // Connected precedes the SUBACK by a round trip; messages before it would be missed.
    std::thread::sleep(Duration::from_millis(300));
    (metrics, move || {
        stop.request();
        thread.join().unwrap();
    })
}

/// The log's first offset, read while the agent runs: retention may delete a segment
/// between the listing and the read of it, so a failed scan is tried again.
fn first_offset(cfg: &Config) -> u64 {
    let mut last_err = None;
    for _ in 0..50 {
        match cairn::log::verify_dir(&cfg.log_dir()) {
            Ok(v) => return v.first_offset,
            Err(e) => last_err = Some(e),
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("the log could not be scanned: {last_err:?}")
}

#[test]
fn retention_keeps_the_log_back_to_the_newest_savepoint() {
    support::init_log();
    let broker = Broker::start();
    let dir = tempfile::tempdir().unwrap();
    let (_config, cfg) = setup(dir.path(), broker.port(), "");
    {
        // Tiny segments, all records received long ago: retention may delete any segment
        // the checkpoint covers, except for the savepoint at offset 10.
        let mut log = open_log(&cfg, 200);
        let mut proc = open_proc(&cfg);
        let events: Vec<String> = (0..30).map(|i| format!("event-{i:040}/A/1")).collect();
        let events: Vec<&str> = events.iter().map(String::as_str).collect();
        log_events(&mut log, &events[..10]);
        process_and_checkpoint(&log, &mut proc);
        let sp = proc
            .store()
            .write_savepoint(&cfg.savepoint_dir(), &fsio::real())
            .unwrap();
        assert_eq!(sp.next_offset, 10);
        log_events(&mut log, &events[10..]);
        process_and_checkpoint(&log, &mut proc);
        assert!(log.segments().len() > 5);
    }
    let (metrics, stop) = run_agent(cfg.clone());
    publish_all(
        broker.port(),
        &[("payments/x".into(), b"N1/A/1".to_vec(), false)],
    );
    assert!(
        wait_until(Duration::from_secs(10), || first_offset(&cfg) > 0),
        "retention never ran"
    );
    assert!(wait_until(Duration::from_secs(5), || metrics
        .snapshot()
        .checkpoint_next_offset
        == 31));
    let first = first_offset(&cfg);
    assert!(
        first <= 10,
        "the log must reach back to the savepoint at 10, starts at {first}"
    );
    let f = metrics.snapshot();
    assert!(f.source_replayable);
    assert_eq!(f.savepoint.map(|s| s.1), Some(10));
    stop();
}

#[test]
fn the_agent_takes_periodic_savepoints_and_keeps_the_newest() {
    support::init_log();
    let broker = Broker::start();
    let dir = tempfile::tempdir().unwrap();
    let (_config, cfg) = setup(
        dir.path(),
        broker.port(),
        "[savepoint]\ninterval = \"1s\"\nkeep = 2\n",
    );
    let (metrics, stop) = run_agent(cfg.clone());
    for i in 0..12 {
        publish_all(
            broker.port(),
            &[("payments/x".into(), format!("P{i}/A/1").into_bytes(), false)],
        );
        std::thread::sleep(Duration::from_millis(300));
    }
    assert!(wait_until(Duration::from_secs(5), || metrics
        .snapshot()
        .checkpoint_next_offset
        == 12));
    let f = metrics.snapshot();
    stop();
    assert!(f.savepoints >= 3, "{} savepoints in ~3.6 s", f.savepoints);
    assert_eq!(f.savepoint_failures, 0);
    let kept = store::list_savepoints(&cfg.savepoint_dir()).unwrap();
    assert_eq!(kept.len(), 2, "{kept:?}");
    for sp in &kept {
        assert!(store::verify_savepoint(&sp.path).is_ok());
    }
    assert_eq!(f.savepoint.map(|s| s.0), Some(kept[1].checkpoint_id));
    let names: Vec<String> = std::fs::read_dir(cfg.savepoint_dir())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        names
            .iter()
            .all(|n| n.starts_with("savepoint-") && n.ends_with(".cairn")),
        "{names:?}"
    );
}

#[test]
fn savepoints_keep_the_order_they_were_taken_in_across_a_store_rebuild() {
    let dir = tempfile::tempdir().unwrap();
    let (config, cfg) = setup(dir.path(), 1, "");
    let mut log = open_log(&cfg, 1 << 20);
    let old = {
        let mut proc = open_proc(&cfg);
        for i in 0..3 {
            log_events(&mut log, &[&format!("E{i}/A/1")]);
            process_and_checkpoint(&log, &mut proc);
        }
        proc.store()
            .write_savepoint(&cfg.savepoint_dir(), &fsio::real())
            .unwrap()
    };
    assert_eq!((old.checkpoint_id, old.next_offset), (3, 3));
    // The store is rebuilt (here: from scratch, replaying the whole log): its checkpoint
    // IDs start again, so the newer savepoint carries the lower ID.
    std::fs::remove_dir_all(cfg.store_dir()).unwrap();
    log_events(&mut log, &["E3/A/1"]);
    let new = {
        let mut proc = open_proc(&cfg);
        process_and_checkpoint(&log, &mut proc);
        proc.store()
            .write_savepoint(&cfg.savepoint_dir(), &fsio::real())
            .unwrap()
    };
    assert_eq!((new.checkpoint_id, new.next_offset), (1, 4));
    assert!(new.seq > old.seq, "{new:?} after {old:?}");

    let listed = store::list_savepoints(&cfg.savepoint_dir()).unwrap();
    assert_eq!(
        listed.iter().map(|s| &s.path).collect::<Vec<_>>(),
        [&old.path, &new.path],
        "oldest first, by when taken"
    );
    let restored = ok(&cairn(
        &config,
        &["savepoint", "restore", "--latest", "--json"],
    ));
    let restored: serde_json::Value = serde_json::from_str(restored.trim()).unwrap();
    assert_eq!(
        (&restored["checkpoint_id"], &restored["next_offset"]),
        (&1.into(), &4.into()),
        "--latest is the last taken"
    );
    // Pruning keeps the newest, not the highest ID.
    let removed = store::prune_savepoints(&cfg.savepoint_dir(), 1).unwrap();
    assert_eq!(removed, vec![old.path]);
    // And the next one still comes after it, whatever its checkpoint.
    let proc = open_proc(&cfg);
    let third = proc
        .store()
        .write_savepoint(&cfg.savepoint_dir(), &fsio::real())
        .unwrap();
    assert!(third.seq > new.seq);
}

#[test]
fn the_live_data_estimate_is_what_a_savepoint_holds() {
    let dir = tempfile::tempdir().unwrap();
    let (_config, cfg) = setup(dir.path(), 1, "");
    let mut log = open_log(&cfg, 1 << 20);
    let mut proc = open_proc(&cfg);
    let events: Vec<String> = (0..200).map(|i| format!("E{i}/K{}/1", i % 20)).collect();
    log_events(
        &mut log,
        &events.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    process_and_checkpoint(&log, &mut proc);
    let live = proc.store().live_bytes().unwrap();
    let sp = proc
        .store()
        .write_savepoint(&cfg.savepoint_dir(), &fsio::real())
        .unwrap();
    // The file is the entries plus 9 bytes of framing each, a header and a trailer.
    assert_eq!(live + 9 * sp.entries + 52 + 12, sp.bytes);
}

/// A savepoint file's parts, to craft one (format in `store/savepoint.rs`).
struct Parts {
    checkpoint_id: u64,
    next_offset: u64,
    created_at_ms: u64,
    entries: Vec<(u8, Vec<u8>, Vec<u8>)>,
}

fn u32_at(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes(b[i..i + 4].try_into().unwrap())
}

fn u64_at(b: &[u8], i: usize) -> u64 {
    u64::from_le_bytes(b[i..i + 8].try_into().unwrap())
}

impl Parts {
    fn read(path: &Path) -> Parts {
        let b = std::fs::read(path).unwrap();
        let mut entries = Vec::new();
        let mut pos = 52;
        while pos < b.len() - 12 {
            let (klen, vlen) = (u32_at(&b, pos + 1) as usize, u32_at(&b, pos + 5) as usize);
            let k = b[pos + 9..pos + 9 + klen].to_vec();
            let v = b[pos + 9 + klen..pos + 9 + klen + vlen].to_vec();
            entries.push((b[pos], k, v));
            pos += 9 + klen + vlen;
        }
        Parts {
            checkpoint_id: u64_at(&b, 16),
            next_offset: u64_at(&b, 24),
            created_at_ms: u64_at(&b, 40),
            entries,
        }
    }

    /// Written with every checksum right: only the contents are wrong.
    fn write(&self, path: &Path) {
        let mut b = Vec::new();
        b.extend_from_slice(b"CAIRNSP\0");
        b.extend_from_slice(&store::SAVEPOINT_FORMAT_VERSION.to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes());
        for n in [
            self.checkpoint_id,
            self.next_offset,
            self.entries.len() as u64,
            self.created_at_ms,
        ] {
            b.extend_from_slice(&n.to_le_bytes());
        }
        let crc = crc32fast::hash(&b);
        b.extend_from_slice(&crc.to_le_bytes());
        for (tree, k, v) in &self.entries {
            b.push(*tree);
            b.extend_from_slice(&(k.len() as u32).to_le_bytes());
            b.extend_from_slice(&(v.len() as u32).to_le_bytes());
            b.extend_from_slice(k);
            b.extend_from_slice(v);
        }
        b.extend_from_slice(b"CAIRNEND");
        let crc = crc32fast::hash(&b);
        b.extend_from_slice(&crc.to_le_bytes());
        std::fs::write(path, b).unwrap();
    }
}

/// Issue 27: a crafted savepoint with valid checksums was restored, the good store moved
/// aside, and the agent then refused to start; and restore held up to 10,000 entries of up to
/// 2 MiB each in memory at once. Now the whole file is checked first: each crafted file is
/// refused with what is wrong, nothing is built or moved, and the store is as it was.
#[test]
fn a_crafted_savepoint_with_valid_checksums_is_refused_before_anything_is_moved() {
    let dir = tempfile::tempdir().unwrap();
    let (config, cfg) = setup(dir.path(), 1, "");
    let sp = {
        let mut log = open_log(&cfg, 1 << 20);
        let mut proc = open_proc(&cfg);
        log_events(&mut log, &["E1/A/100", "E2/B/5"]);
        process_and_checkpoint(&log, &mut proc);
        proc.store()
            .write_savepoint(&cfg.savepoint_dir(), &fsio::real())
            .unwrap()
    };
    let before = inspect_all(&config);
    let good = Parts::read(&sp.path);
    let state = good
        .entries
        .iter()
        .position(|e| e.0 == 7)
        .expect("a row of states");
    let crafted = dir.path().join("crafted.cairn");
    type Craft = Box<dyn Fn(&mut Parts)>;
    let variants: Vec<(&str, Craft)> = vec![
        (
            "rows: undecodable state row",
            Box::new(move |p| p.entries[state].2 = vec![0xff; 16]),
        ),
        (
            "a rows entry of 1048600 bytes, over the 7168 bytes a store ever writes",
            Box::new(move |p| {
                p.entries[state].2 = vec![0; (1 << 20) + 24 - p.entries[state].1.len()]
            }),
        ),
        (
            "its progress record says checkpoint 1 at offset 2, the header checkpoint 1 at offset 1",
            Box::new(|p| p.next_offset = 1),
        ),
        (
            // A well-formed row (not spilled, one entry for pipeline "x") whose state is not one.
            "rows: undecodable state",
            Box::new(move |p| p.entries[state].2 = vec![0, 1, 1, b'x', 2, 0xff, 0xff]),
        ),
        (
            "out of order",
            Box::new(move |p| {
                let e = p.entries[state].clone();
                p.entries.insert(state, e);
            }),
        ),
        (
            "no tree number 9",
            Box::new(move |p| p.entries[state].0 = 9),
        ),
    ];
    for (says, craft) in &variants {
        let mut p = Parts::read(&sp.path);
        craft(&mut p);
        p.write(&crafted);
        store::verify_savepoint(&crafted).expect("the checksums are valid");
        let out = cairn(
            &config,
            &["savepoint", "restore", crafted.to_str().unwrap()],
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{says}: {stderr}");
        assert!(
            stderr.contains("is damaged") && stderr.contains(says),
            "{says}: {stderr}"
        );
        assert_eq!(
            siblings(&cfg.store_dir()),
            ["store"],
            "{says}: nothing built, nothing moved"
        );
    }
    assert_eq!(inspect_all(&config), before);
    // The untouched parts, written the same way, restore: the crafting is faithful.
    good.write(&crafted);
    ok(&cairn(
        &config,
        &["savepoint", "restore", crafted.to_str().unwrap()],
    ));
    assert_eq!(inspect_all(&config), before);
}
