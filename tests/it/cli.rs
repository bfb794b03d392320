//! The `cairn` command line: exit codes (0 ok, 1 runtime, 2 usage or config), `validate`,
//! and every `inspect` view with its filters, over a data directory filled through the
//! library (no broker needed).

use std::path::Path;
use std::process::Command;

use crate::support::agent::AgentConfig;
use cairn::fsio;
use cairn::log::{Log, LogOptions};
use cairn::processor::Processor;
use cairn::store::Store;

fn cairn(cfg: &Path, args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_cairn"))
        .arg("--config")
        .arg(cfg)
        .args(args)
        .env_remove("RUST_LOG")
        .output()
        .expect("run cairn");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

const PIPELINES: &str = r#"
[[pipeline]]
name = "balances"
topics = ["pay/#"]
format = "delimited"
separator = "/"
event_id = "0"
key = "1"
value = "2"
aggregate = "sum"
output_topic = "balances/{key}"

[[pipeline]]
name = "per_minute"
topics = ["pay/#"]
format = "delimited"
event_id = "0"
key = "1"
event_time = "3"
aggregate = "count"
window = { size = "1m" }
output_topic = "per_minute/{key}/{window_start}"
"#;

/// The commands tested here never connect: the port is one nothing listens on.
fn write_config(dir: &Path) -> std::path::PathBuf {
    AgentConfig::new(crate::support::free_port(), PIPELINES).write(dir)
}

/// Fill the log and the store as the agent would (log, fsync, process, checkpoint).
fn fill(dir: &Path) {
    let cfg = cairn::config::load(&dir.join("cairn.toml")).unwrap();
    let opts = LogOptions {
        dir: cfg.log_dir(),
        segment_size: cfg.log.segment_size,
        max_size: cfg.log.max_size,
        max_payload: cfg.log.max_payload,
    };
    let (mut log, _) = Log::open(opts, fsio::real()).unwrap();
    for (i, p) in [
        "E1/A/5/60000",
        "E2/B/7/60500",
        "E1/A/5/60000",
        "broken",
        "E3/A/1/130000",
    ]
    .iter()
    .enumerate()
    {
        log.append(1_000 + i as u64, "pay/x", p.as_bytes(), 1, false)
            .unwrap();
    }
    log.commit().unwrap();
    let store = Store::open(&cfg.store_dir(), cfg.storage.cache_size, fsio::real()).unwrap();
    let mut proc = Processor::open(store, cfg.pipelines.clone()).unwrap();
    proc.replay(&log, 1000, &|| 42, &mut |_| {}).unwrap();
}

fn json_lines(out: &str) -> Vec<serde_json::Value> {
    out.lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

#[test]
fn validate_prints_a_summary_and_exits_0_or_every_problem_and_exits_2() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(dir.path());
    let (code, out, _) = cairn(&cfg, &["validate"]);
    assert_eq!(code, 0);
    assert!(
        out.contains("balances") && out.contains("per_minute"),
        "{out}"
    );

    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "[mqtt]\nclient_id = \"x\"\nkeepalive = \"5s\"\n\n[storage]\ndata_dir = \"d\"\ncache_size = 5\n").unwrap();
    let (code, out, err) = cairn(&bad, &["validate"]);
    assert_eq!(code, 2, "{out}{err}");
    let file = bad.display().to_string();
    assert!(
        out.contains(&format!("{file}:3: mqtt.keepalive: unknown key")),
        "{out}"
    );
    assert!(
        out.contains(&format!("{file}:7: storage.cache_size:")),
        "{out}"
    );
    assert!(
        out.contains("pipeline"),
        "the missing pipeline is reported too: {out}"
    );

    // A config problem stops every other command with exit 2 as well.
    let (code, _, err) = cairn(&bad, &["inspect", "state"]);
    assert_eq!(code, 2, "{err}");
}

#[test]
fn usage_errors_exit_2_and_runtime_failures_exit_1() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(dir.path());
    assert_eq!(cairn(&cfg, &["no-such-command"]).0, 2);
    assert_eq!(cairn(&cfg, &["inspect", "state", "--limit", "many"]).0, 2);
    let (code, _, err) = cairn(&cfg, &["inspect", "state"]);
    assert_eq!(code, 1, "no store yet is a runtime failure");
    assert!(err.contains("no store"), "{err}");
    assert_eq!(cairn(&dir.path().join("missing.toml"), &["validate"]).0, 2);
}

/// Every allocator option the binary sets (`src/main.rs`) is one jemalloc takes: one it
/// cannot parse is named on stderr at start-up and left out, so a memory setting would go
/// silently unapplied.
#[test]
fn the_allocator_takes_every_option_the_binary_sets() {
    let stderr_of = |conf: Option<&str>| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_cairn"));
        cmd.arg("--version").env_remove("_RJEM_MALLOC_CONF");
        if let Some(conf) = conf {
            cmd.env("_RJEM_MALLOC_CONF", conf);
        }
        let out = cmd.output().unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let err = stderr_of(None);
    assert!(!err.contains("<jemalloc>"), "{err}");
    // What a bad option looks like, so the check above can fail.
    let err = stderr_of(Some("slab_sizes:1-1280:x"));
    assert!(
        err.contains("<jemalloc>: Invalid settings for slab_sizes"),
        "{err}"
    );
}

#[test]
fn inspect_shows_every_view_as_json_lines_with_filters() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(dir.path());
    fill(dir.path());

    let (code, out, err) = cairn(&cfg, &["inspect", "state", "--json"]);
    assert_eq!(code, 0, "{err}");
    let st = json_lines(&out);
    let bal: Vec<_> = st.iter().filter(|v| v["pipeline"] == "balances").collect();
    assert_eq!(bal.len(), 2);
    let a = bal.iter().find(|v| v["key"] == "A").unwrap();
    assert_eq!(
        (
            a["value"].as_i64(),
            a["count"].as_u64(),
            a["version"].as_u64()
        ),
        (Some(6), Some(2), Some(2))
    );
    let win: Vec<_> = st
        .iter()
        .filter(|v| v["pipeline"] == "per_minute")
        .collect();
    assert!(
        win.iter()
            .all(|v| v["window_end"].as_u64() == v["window_start"].as_u64().map(|s| s + 60_000)),
        "{win:?}"
    );

    let (_, out, _) = cairn(
        &cfg,
        &[
            "inspect",
            "state",
            "--json",
            "--pipeline",
            "balances",
            "--key",
            "B",
        ],
    );
    let only = json_lines(&out);
    assert_eq!(only.len(), 1);
    assert_eq!(only[0]["value"], 7);

    let (_, out, _) = cairn(
        &cfg,
        &["inspect", "dedup", "--json", "--pipeline", "balances"],
    );
    let ids: Vec<String> = json_lines(&out)
        .iter()
        .filter_map(|v| v["event_id"].as_str().map(String::from))
        .collect();
    assert!(
        ["E1", "E2", "E3"]
            .iter()
            .all(|id| ids.contains(&id.to_string())),
        "{ids:?}"
    );

    let (_, out, _) = cairn(&cfg, &["inspect", "outbox", "--json"]);
    let outbox = json_lines(&out);
    assert!(
        outbox
            .iter()
            .any(|v| v["id"] == "balances/A/2" && v["topic"] == "balances/A"),
        "{outbox:?}"
    );

    let (_, out, _) = cairn(&cfg, &["inspect", "dead-letters", "--json"]);
    let dead = json_lines(&out);
    assert_eq!(dead.len(), 2, "one per pipeline: {dead:?}");
    assert!(
        dead.iter().all(|v| v["offset"] == 3
            && v["reason"] == "missing_field"
            && v["payload"] == "broken")
    );

    let (_, out, _) = cairn(&cfg, &["inspect", "checkpoints", "--json"]);
    let cps = json_lines(&out);
    assert_eq!(cps.len(), 1);
    assert_eq!(
        (
            cps[0]["prev_offset"].as_u64(),
            cps[0]["next_offset"].as_u64()
        ),
        (Some(0), Some(5))
    );

    let (_, out, _) = cairn(
        &cfg,
        &["inspect", "log", "--json", "--from", "2", "--limit", "2"],
    );
    let recs = json_lines(&out);
    assert_eq!(
        recs.iter()
            .map(|v| v["offset"].as_u64().unwrap())
            .collect::<Vec<_>>(),
        [2, 3]
    );
    assert_eq!(recs[1]["payload"], "broken");

    let (code, out, _) = cairn(&cfg, &["inspect", "state"]);
    assert_eq!(code, 0);
    assert!(
        out.lines().any(|l| l.starts_with("balances\tA\tvalue=6")),
        "{out}"
    );

    let (code, out, _) = cairn(&cfg, &["verify", "--json"]);
    assert_eq!(code, 0, "{out}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["ok"], true);
    assert_eq!(v["store"]["next_offset"], 5);
}

/// Every file below `dir`: relative path → (length, modification time, contents).
fn tree_snapshot(dir: &Path) -> std::collections::BTreeMap<String, (u64, i64, i64, Vec<u8>)> {
    use std::os::unix::fs::MetadataExt;
    let mut out = std::collections::BTreeMap::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            let m = std::fs::symlink_metadata(&p).unwrap();
            let rel = p.strip_prefix(dir).unwrap().display().to_string();
            if m.is_dir() {
                out.insert(rel + "/", (0, m.mtime(), m.mtime_nsec(), Vec::new()));
                todo.push(p);
            } else {
                let bytes = std::fs::read(&p).unwrap();
                out.insert(rel, (m.len(), m.mtime(), m.mtime_nsec(), bytes));
            }
        }
    }
    out
}

#[test]
fn inspect_leaves_the_store_byte_for_byte_and_mtime_for_mtime_as_it_was() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(dir.path());
    fill(dir.path());
    // Let sled's background flusher settle, and make any later write visible in the mtimes.
    std::thread::sleep(std::time::Duration::from_millis(1100));
    let data = dir.path().join("data");
    let before = tree_snapshot(&data);
    for what in ["state", "dedup", "outbox", "checkpoints", "dead-letters"] {
        for json in [false, true] {
            let mut args = vec!["inspect", what];
            if json {
                args.push("--json");
            }
            let (code, out, err) = cairn(&cfg, &args);
            assert_eq!(code, 0, "{args:?}: {out}{err}");
        }
    }
    let (code, _, err) = cairn(&cfg, &["inspect", "log"]);
    assert_eq!(code, 0, "{err}");
    let after = tree_snapshot(&data);
    let names = |s: &std::collections::BTreeMap<String, _>| s.keys().cloned().collect::<Vec<_>>();
    assert_eq!(names(&after), names(&before), "files appeared or vanished");
    for (path, b) in &before {
        let a = &after[path];
        assert_eq!(
            (a.0, a.1, a.2),
            (b.0, b.1, b.2),
            "{path}: size or mtime changed"
        );
        assert!(a.3 == b.3, "{path}: contents changed");
    }
}

#[test]
fn inspect_refuses_a_store_another_process_holds_and_leaves_no_copy_behind() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(dir.path());
    fill(dir.path());
    let tmp = dir.path().join("tmp");
    std::fs::create_dir(&tmp).unwrap();
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_cairn"))
            .arg("--config")
            .arg(&cfg)
            .args(args)
            .env("TMPDIR", &tmp)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    {
        // As the agent would: sled's lock on the store.
        let c = cairn::config::load(&cfg).unwrap();
        let _held = Store::open(&c.store_dir(), c.storage.cache_size, fsio::real()).unwrap();
        let (code, err) = run(&["inspect", "state"]);
        assert_eq!(code, Some(1), "{err}");
        assert!(err.contains("in use by another process"), "{err}");
    }
    std::thread::sleep(std::time::Duration::from_millis(300));
    let (code, err) = run(&["inspect", "state"]);
    assert_eq!(code, Some(0), "{err}");
    let left: Vec<_> = std::fs::read_dir(&tmp).unwrap().collect();
    assert!(left.is_empty(), "the copy was left behind: {left:?}");
}

#[test]
fn text_output_escapes_control_characters_from_topics_and_payloads() {
    let dir = tempfile::tempdir().unwrap();
    let cfg_path = write_config(dir.path());
    let cfg = cairn::config::load(&cfg_path).unwrap();
    let opts = LogOptions {
        dir: cfg.log_dir(),
        segment_size: cfg.log.segment_size,
        max_size: cfg.log.max_size,
        max_payload: cfg.log.max_payload,
    };
    let (mut log, _) = Log::open(opts, fsio::real()).unwrap();
    // A payload that clears the screen and fakes a second line, on a topic with a bell.
    let hostile = "\u{1b}[2J\u{1b}[31mbroken\nFAKE\tline\u{7}";
    log.append(1_000, "pay/\u{7}x", hostile.as_bytes(), 1, false)
        .unwrap();
    log.commit().unwrap();
    let store = Store::open(&cfg.store_dir(), cfg.storage.cache_size, fsio::real()).unwrap();
    let mut proc = Processor::open(store, cfg.pipelines.clone()).unwrap();
    proc.replay(&log, 1000, &|| 42, &mut |_| {}).unwrap();
    drop(proc);
    std::thread::sleep(std::time::Duration::from_millis(300));

    for what in ["log", "dead-letters"] {
        let (code, out, err) = cairn(&cfg_path, &["inspect", what]);
        assert_eq!(code, 0, "{err}");
        assert!(
            !out.chars()
                .any(|c| c.is_control() && c != '\n' && c != '\t'),
            "{what}: control characters reach the terminal: {out:?}"
        );
        let records = if what == "log" { 1 } else { 2 }; // one dead letter per pipeline
        assert_eq!(out.lines().count(), records, "{what}: {out:?}");
        assert!(out.contains("\\u{1b}[2J"), "{what}: {out:?}");
        assert!(out.contains("\\nFAKE\\tline"), "{what}: {out:?}");
        assert!(out.contains("pay/\\u{7}x"), "{what}: {out:?}");
    }
    // --json keeps the exact bytes (JSON escapes them itself).
    let (_, out, _) = cairn(&cfg_path, &["inspect", "log", "--json"]);
    assert_eq!(json_lines(&out)[0]["payload"], hostile);
}

fn mode_of(p: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).unwrap().permissions().mode() & 0o777
}

/// A config with a username and a password file, on a loopback port nothing listens on.
fn config_with_password(dir: &Path, pw_mode: u32) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let pw = dir.join("mqtt.password");
    std::fs::write(&pw, "secret\n").unwrap();
    std::fs::set_permissions(&pw, std::fs::Permissions::from_mode(pw_mode)).unwrap();
    let mut cfg = AgentConfig::new(crate::support::free_port(), PIPELINES);
    cfg.mqtt_extra = format!(
        "username = \"cairn\"\npassword_file = \"{}\"\n",
        pw.display()
    );
    cfg.data_dir = Some(dir.join("new/data"));
    cfg.write(dir)
}

#[test]
fn validate_warns_about_a_password_file_its_group_or_everyone_can_read() {
    let dir = tempfile::tempdir().unwrap();
    for (mode, says) in [
        (0o644, Some("readable by everyone (mode 0644)")),
        (0o640, Some("readable by its group (mode 0640)")),
        (0o600, None),
        (0o400, None),
    ] {
        let cfg = config_with_password(dir.path(), mode);
        let (code, out, err) = cairn(&cfg, &["validate"]);
        assert_eq!(code, 0, "{out}{err}");
        match says {
            Some(says) => {
                assert!(
                    out.contains("warning: mqtt.password_file:"),
                    "{mode:o}: {out}"
                );
                assert!(out.contains(says), "{mode:o}: {out}");
                assert!(out.contains("chmod 600"), "{out}");
            }
            None => assert!(!out.contains("warning"), "{mode:o}: {out}"),
        }
    }
}

#[test]
fn run_warns_about_a_readable_password_file_and_creates_the_data_dir_0700() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config_with_password(dir.path(), 0o644);
    let stderr = dir.path().join("stderr");
    let mut child = Command::new(env!("CARGO_BIN_EXE_cairn"))
        .arg("--config")
        .arg(&cfg)
        .arg("run")
        .env_remove("RUST_LOG")
        .env_remove("NOTIFY_SOCKET")
        .env_remove("STATE_DIRECTORY")
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&stderr).unwrap())
        .spawn()
        .unwrap();
    let data = dir.path().join("new/data");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let mut log = String::new();
    while std::time::Instant::now() < deadline {
        log = std::fs::read_to_string(&stderr).unwrap_or_default();
        if log.contains("recovery: done") {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    crate::support::signal(child.id(), "TERM");
    let exited = child.wait().unwrap();
    assert!(log.contains("recovery: done"), "{log}");
    assert!(
        log.contains("password_file") && log.contains("readable by everyone"),
        "{log}"
    );
    assert_eq!(mode_of(&data), 0o700, "data dir mode");
    assert!(exited.success(), "{exited:?}\n{log}");
}

fn is_root() -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

/// Every file and directory below `dir` (itself included) with its owner.
fn owners(dir: &Path) -> Vec<(std::path::PathBuf, u32)> {
    use std::os::unix::fs::MetadataExt;
    let mut out = vec![(
        dir.to_path_buf(),
        std::fs::symlink_metadata(dir).unwrap().uid(),
    )];
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if std::fs::symlink_metadata(&path).unwrap().is_dir() {
            out.extend(owners(&path));
        } else {
            out.push((
                path.clone(),
                std::fs::symlink_metadata(&path).unwrap().uid(),
            ));
        }
    }
    out
}

/// Issue 27: a command run as root left root-owned files in the data directory (sled writes
/// on every open; a savepoint is a new file), after which the service, running as `cairn`,
/// could not start. Now root runs as the directory's owner: everything it leaves is theirs,
/// and a root-owned file an older command left is named, with the `chown` that repairs it.
/// Not as root, the other side of the rule: a data directory of another user is refused.
#[test]
fn a_command_run_as_root_on_another_users_data_dir_runs_as_its_owner() {
    let tmp = tempfile::tempdir().unwrap();
    if !is_root() {
        let mut cfg = AgentConfig::new(crate::support::free_port(), PIPELINES);
        cfg.data_dir = Some("/".into());
        let config = cfg.write(tmp.path());
        let (code, _, err) = cairn(&config, &["inspect", "log"]);
        assert_eq!(code, 1, "{err}");
        assert!(
            err.contains("data_dir / belongs to user root (uid 0), not to"),
            "{err}"
        );
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    // `nobody` must be able to reach the data directory.
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let config = write_config(tmp.path());
    fill(tmp.path());
    let data = tmp.path().join("data");
    for (path, _) in owners(&data) {
        std::os::unix::fs::lchown(&path, Some(65534), Some(65534)).unwrap();
    }
    let (code, out, err) = cairn(&config, &["savepoint", "create"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(err.contains("running as user nobody (uid 65534)"), "{err}");
    let (code, out, err) = cairn(&config, &["inspect", "state", "--json"]);
    assert_eq!((code, json_lines(&out).len()), (0, 3), "{out}{err}");
    let (code, out, err) = cairn(&config, &["validate"]);
    assert_eq!(code, 0, "{out}{err}");
    let not_theirs: Vec<_> = owners(&data)
        .into_iter()
        .filter(|(_, uid)| *uid != 65534)
        .collect();
    assert!(not_theirs.is_empty(), "left by root: {not_theirs:?}");
    assert!(data.join("savepoints").is_dir());

    // A file an older command left as root: named, with the repair.
    std::fs::write(data.join("stray"), "").unwrap();
    let (code, _, err) = cairn(&config, &["verify"]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("stray belongs to user root (uid 0), not to user nobody")
            && err.contains("chown -R nobody:"),
        "{err}"
    );
}

/// Issue 27: an existing data directory was used without a look at its mode: one its group
/// or everyone can write lets another user replace the log or the store under the agent.
#[test]
fn a_data_dir_others_can_write_is_refused_and_validate_says_so() {
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().unwrap();
    let config = write_config(tmp.path());
    fill(tmp.path());
    let data = tmp.path().join("data");
    std::fs::set_permissions(&data, std::fs::Permissions::from_mode(0o777)).unwrap();
    for args in [&["inspect", "log"][..], &["savepoint", "create"], &["run"]] {
        let (code, out, err) = cairn(&config, args);
        assert_eq!(code, 1, "{args:?}: {out}{err}");
        assert!(
            err.contains("is writable by everyone (mode 0777)") && err.contains("chmod 700"),
            "{args:?}: {err}"
        );
    }
    let (code, out, _) = cairn(&config, &["validate"]);
    assert_eq!(code, 0);
    assert!(
        out.contains("data_dir: `cairn run` will refuse: data_dir ")
            && out.contains("writable by everyone"),
        "{out}"
    );
    std::fs::set_permissions(&data, std::fs::Permissions::from_mode(0o700)).unwrap();
    let (code, out, err) = cairn(&config, &["inspect", "log"]);
    assert_eq!(code, 0, "{out}{err}");
}

/// Issue 27: `validate` warns when the agent connects anonymously (with the shipped broker
/// snippet it could not connect at all; with an anonymous broker anyone local can take its
/// queued inputs), when its password would cross the network in clear, when its TLS key is
/// readable by others, and when a file the connection needs cannot be read.
#[test]
fn validate_warns_about_an_anonymous_or_clear_text_login_an_open_key_and_an_unreadable_secret() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let validate_at = |host: &str, mqtt_extra: &str| {
        let mut cfg = AgentConfig::new(crate::support::free_port(), PIPELINES);
        cfg.mqtt_extra = mqtt_extra.to_string();
        cfg.data_dir = Some(dir.path().join("data"));
        let text = cfg
            .render(dir.path())
            .replace("host = \"127.0.0.1\"", &format!("host = \"{host}\""));
        let path = dir.path().join("cairn.toml");
        std::fs::write(&path, text).unwrap();
        let (code, out, err) = cairn(&path, &["validate"]);
        assert_eq!(code, 0, "{out}{err}");
        out.lines()
            .filter(|l| l.contains(": warning: "))
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    let validate = |mqtt_extra: &str| validate_at("127.0.0.1", mqtt_extra);
    let w = validate("");
    assert_eq!(w.len(), 1, "{w:?}");
    assert!(
        w[0].contains("warning: mqtt: connects anonymously"),
        "{w:?}"
    );

    let pw = dir.path().join("pw");
    std::fs::write(&pw, "secret\n").unwrap();
    std::fs::set_permissions(&pw, std::fs::Permissions::from_mode(0o600)).unwrap();
    let login = format!(
        "username = \"cairn\"\npassword_file = \"{}\"\n",
        pw.display()
    );
    assert_eq!(validate(&login), Vec::<String>::new());

    let w = validate_at("192.0.2.7", &login);
    assert!(
        w.len() == 1 && w[0].contains("the password goes to 192.0.2.7 in clear"),
        "{w:?}"
    );

    let key = dir.path().join("client.key");
    std::fs::write(&key, "key").unwrap();
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
    let tls = format!(
        "{login}tls = {{ ca_file = \"{}\", cert_file = \"{}\", key_file = \"{}\" }}\n",
        pw.display(),
        pw.display(),
        key.display()
    );
    let w = validate(&tls);
    assert!(
        w.len() == 1
            && w[0].contains("mqtt.tls.key_file:")
            && w[0].contains("readable by everyone"),
        "{w:?}"
    );

    let missing = format!(
        "username = \"cairn\"\npassword_file = \"{}\"\n",
        dir.path().join("nope").display()
    );
    let w = validate(&missing);
    assert!(
        w.len() == 1 && w[0].contains("mqtt.password_file:") && w[0].contains("cannot be read by"),
        "{w:?}"
    );
}
