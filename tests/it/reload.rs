//! SIGHUP reloads the safe parts of the config; a changed pipeline definition is refused at
//! start unless the operator names it to be reset (issue 6, item 5). Real binary, private
//! broker.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::support::{Broker, publish_all, unique_id, wait_until};

fn config(dir: &Path, port: u16, client_id: &str, extra: &str, aggregate: &str) -> String {
    format!(
        "[mqtt]\nhost = \"127.0.0.1\"\nport = {port}\nclient_id = \"{client_id}\"\n\
         reconnect_min = \"20ms\"\nreconnect_max = \"200ms\"\n\n\
         [storage]\ndata_dir = \"{}\"\n\n\
         [log]\nsegment_size = \"1MiB\"\nmax_size = \"64MiB\"\ncommit_interval = \"2ms\"\nmax_payload = \"16KiB\"\n\n\
         [checkpoint]\ninterval = \"20ms\"\n\n{extra}\n\
         [[pipeline]]\nname = \"balances\"\ntopics = [\"pay/#\"]\nformat = \"delimited\"\nseparator = \"/\"\n\
         event_id = \"0\"\nkey = \"1\"\nvalue = \"2\"\naggregate = \"{aggregate}\"\noutput_topic = \"balances/{{key}}\"\n",
        dir.join("data").display()
    )
}

struct Run {
    child: Child,
    stderr: PathBuf,
}

impl Run {
    fn start(cfg: &Path, stderr: &Path, args: &[&str]) -> Run {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(stderr)
            .unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_cairn"))
            .arg("--config")
            .arg(cfg)
            .arg("run")
            .args(args)
            .env_remove("RUST_LOG") // the config's [logging] level decides
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .unwrap();
        Run {
            child,
            stderr: stderr.to_path_buf(),
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    fn wait_log(&mut self, needle: &str) {
        let ok = wait_until(Duration::from_secs(15), || self.log().contains(needle));
        assert!(ok, "no `{needle}` in the agent's stderr:\n{}", self.log());
    }

    fn signal(&self, sig: &str) {
        Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(self.child.id().to_string())
            .status()
            .unwrap();
    }

    fn wait(mut self) -> i32 {
        let mut code = None;
        wait_until(Duration::from_secs(20), || {
            code = self
                .child
                .try_wait()
                .ok()
                .flatten()
                .map(|s| s.code().unwrap_or(-1));
            code.is_some()
        });
        code.unwrap_or_else(|| {
            let _ = self.child.kill();
            panic!("cairn did not exit:\n{}", self.log())
        })
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn state(cfg: &Path) -> Vec<serde_json::Value> {
    let out = Command::new(env!("CARGO_BIN_EXE_cairn"))
        .arg("--config")
        .arg(cfg)
        .args(["inspect", "state", "--json"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn sighup_applies_safe_changes_reports_the_rest_and_keeps_running() {
    let broker = Broker::start();
    let dir = tempfile::tempdir().unwrap();
    let (cfg, err) = (dir.path().join("cairn.toml"), dir.path().join("stderr"));
    let id = unique_id("reload").replace('-', "_");
    std::fs::write(&cfg, config(dir.path(), broker.port(), &id, "", "sum")).unwrap();
    let mut run = Run::start(&cfg, &err, &[]);
    run.wait_log("mqtt: connected");
    assert!(!run.log().contains("DEBUG"), "info is the default level");

    // Safe: the log level and a limit.
    let text = config(
        dir.path(),
        broker.port(),
        &id,
        "[logging]\nlevel = \"debug\"\n\n[outbox]\nmax_entries = 9000\n",
        "sum",
    );
    std::fs::write(&cfg, text).unwrap();
    run.signal("HUP");
    run.wait_log("log level is now DEBUG");
    run.wait_log("reload: applied");

    // Not safe while running: the broker port. Reported, not applied; the agent stays up.
    std::fs::write(&cfg, config(dir.path(), broker.port() + 1, &id, "", "sum")).unwrap();
    run.signal("HUP");
    run.wait_log("[mqtt] changed too and need a restart");

    // A broken file changes nothing.
    std::fs::write(&cfg, "[mqtt\n").unwrap();
    run.signal("HUP");
    run.wait_log("keeping the running configuration");

    // Still processing on the original connection; a dead letter shows in the journal.
    publish_all(
        broker.port(),
        &[
            ("pay/x".into(), b"E1/A/5".to_vec(), false),
            ("pay/x".into(), b"E2".to_vec(), false),
        ],
    );
    run.wait_log("dead letter: offset 1 topic `pay/x` reason missing_field");
    std::fs::write(&cfg, config(dir.path(), broker.port(), &id, "", "sum")).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    run.signal("TERM");
    assert_eq!(run.wait(), 0);
    let st = state(&cfg);
    assert_eq!(st.len(), 1, "{st:?}");
    assert_eq!(st[0]["value"], 5);
}

#[test]
fn a_changed_pipeline_is_refused_until_it_is_named_for_reset() {
    let broker = Broker::start();
    let dir = tempfile::tempdir().unwrap();
    let (cfg, err) = (dir.path().join("cairn.toml"), dir.path().join("stderr"));
    let id = unique_id("reset").replace('-', "_");
    std::fs::write(&cfg, config(dir.path(), broker.port(), &id, "", "sum")).unwrap();
    let mut run = Run::start(&cfg, &err, &[]);
    run.wait_log("mqtt: connected");
    publish_all(
        broker.port(),
        &[
            ("pay/x".into(), b"E1/A/5".to_vec(), false),
            ("pay/x".into(), b"E2/A/7".to_vec(), false),
        ],
    );
    std::thread::sleep(Duration::from_millis(500));
    run.signal("TERM");
    assert_eq!(run.wait(), 0);
    assert_eq!(state(&cfg)[0]["value"], 12);

    // sum -> max would misread the stored sum: refused, saying what to do.
    std::fs::write(&cfg, config(dir.path(), broker.port(), &id, "", "max")).unwrap();
    let run = Run::start(&cfg, &err, &[]);
    assert_eq!(run.wait(), 1, "a changed pipeline must be refused");
    let log = std::fs::read_to_string(&err).unwrap();
    assert!(
        log.contains("pipeline `balances` changed") && log.contains("--reset-pipeline balances"),
        "{log}"
    );

    // Named for reset: state starts empty and versions continue above the old ones.
    let mut run = Run::start(&cfg, &err, &["--reset-pipeline", "balances"]);
    run.wait_log("pipeline `balances` reset");
    run.wait_log("mqtt: connected");
    publish_all(
        broker.port(),
        &[("pay/x".into(), b"E3/A/4".to_vec(), false)],
    );
    std::thread::sleep(Duration::from_millis(500));
    run.signal("TERM");
    assert_eq!(run.wait(), 0);
    let st = state(&cfg);
    assert_eq!(
        (st[0]["value"].as_i64(), st[0]["version"].as_u64()),
        (Some(4), Some(3)),
        "{st:?}"
    );
}

#[test]
fn a_failed_checkpoint_is_logged_and_the_restart_replays_it() {
    let broker = Broker::start();
    let dir = tempfile::tempdir().unwrap();
    let (cfg, err) = (dir.path().join("cairn.toml"), dir.path().join("stderr"));
    let id = unique_id("cpfail").replace('-', "_");
    std::fs::write(&cfg, config(dir.path(), broker.port(), &id, "", "sum")).unwrap();
    // Subscribe once, so the broker queues for us.
    let mut run = Run::start(&cfg, &err, &[]);
    run.wait_log("mqtt: connected");
    run.signal("TERM");
    assert_eq!(run.wait(), 0);

    let file = std::fs::OpenOptions::new().append(true).open(&err).unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_cairn"))
        .arg("--config")
        .arg(&cfg)
        .arg("run")
        .env("CAIRN_FAILPOINTS", "checkpoint.before_commit=error")
        .stderr(file)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let run = Run {
        child,
        stderr: err.clone(),
    };
    publish_all(
        broker.port(),
        &[("pay/x".into(), b"E1/A/5".to_vec(), false)],
    );
    assert_eq!(
        run.wait(),
        1,
        "a failed checkpoint stops the agent (built with --all-features?)"
    );
    let log = std::fs::read_to_string(&err).unwrap();
    assert!(
        log.contains("checkpoint failed: ") && log.contains("failpoint checkpoint.before_commit"),
        "{log}"
    );

    let mut run = Run::start(&cfg, &err, &[]);
    run.wait_log("replayed 1 records");
    run.signal("TERM");
    assert_eq!(run.wait(), 0);
    assert_eq!(state(&cfg)[0]["value"], 5);
}

#[test]
fn a_pipeline_added_to_the_config_receives_its_topic_although_the_broker_kept_the_session() {
    let broker = Broker::start();
    let dir = tempfile::tempdir().unwrap();
    let (cfg, err) = (dir.path().join("cairn.toml"), dir.path().join("stderr"));
    let id = unique_id("newtopic").replace('-', "_");
    std::fs::write(&cfg, config(dir.path(), broker.port(), &id, "", "sum")).unwrap();
    let mut run = Run::start(&cfg, &err, &[]);
    run.wait_log("mqtt: connected");
    run.signal("TERM");
    assert_eq!(run.wait(), 0);

    let extra = "[[pipeline]]\nname = \"counts\"\ntopics = [\"other/#\"]\nformat = \"delimited\"\nevent_id = \"0\"\n\
                 key = \"1\"\naggregate = \"count\"\noutput_topic = \"counts/{key}\"\n";
    let text = format!(
        "{}\n{extra}",
        config(dir.path(), broker.port(), &id, "", "sum")
    );
    std::fs::write(&cfg, text).unwrap();
    let mut run = Run::start(&cfg, &err, &[]);
    run.wait_log("session present: true");
    std::thread::sleep(Duration::from_millis(200));
    publish_all(
        broker.port(),
        &[("other/x".into(), b"C1/K".to_vec(), false)],
    );
    std::thread::sleep(Duration::from_millis(500));
    run.signal("TERM");
    assert_eq!(run.wait(), 0);
    let st = state(&cfg);
    assert!(
        st.iter()
            .any(|v| v["pipeline"] == "counts" && v["value"] == 1),
        "{st:?}"
    );
}

#[test]
fn a_sighup_that_turns_on_savepoints_takes_one() {
    let broker = Broker::start();
    let dir = tempfile::tempdir().unwrap();
    let (cfg, err) = (dir.path().join("cairn.toml"), dir.path().join("stderr"));
    let id = unique_id("spon").replace('-', "_");
    std::fs::write(&cfg, config(dir.path(), broker.port(), &id, "", "sum")).unwrap();
    let mut run = Run::start(&cfg, &err, &[]);
    run.wait_log("mqtt: connected");
    publish_all(
        broker.port(),
        &[("pay/x".into(), b"E1/A/5".to_vec(), false)],
    );
    let spdir = dir.path().join("data/savepoints");
    let savepoints = || {
        std::fs::read_dir(&spdir)
            .map(|d| d.filter_map(Result::ok).count())
            .unwrap_or(0)
    };
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(savepoints(), 0, "savepoints are off");

    let on = "[savepoint]\ninterval = \"1s\"\nkeep = 2\n";
    std::fs::write(&cfg, config(dir.path(), broker.port(), &id, on, "sum")).unwrap();
    run.signal("HUP");
    run.wait_log("reload: applied");
    // A savepoint is taken right after a checkpoint: the next input brings one.
    publish_all(
        broker.port(),
        &[("pay/x".into(), b"E2/A/7".to_vec(), false)],
    );
    run.wait_log("savepoint: checkpoint");
    assert!(
        wait_until(Duration::from_secs(5), || savepoints() == 1),
        "{}",
        run.log()
    );
    run.signal("TERM");
    assert_eq!(run.wait(), 0);
}
