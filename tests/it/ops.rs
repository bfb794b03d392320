//! Operations: the systemd unit, the notify protocol, journal-friendly logging, the mosquitto
//! snippet and the Debian package, checked with the tools an operator would use.
//!
//! Tools: `systemd-analyze` (package `systemd`), `mosquitto`, `dpkg-deb` (package `dpkg`) and
//! `cargo deb` (`cargo install cargo-deb --locked`). A missing tool fails the test with the
//! install command; `.ci/test` (the README's test command) installs them.
//!
//! The .deb test builds a release binary (about a minute with warm dependencies, a few on a
//! cold cache).
//!
//! Why ~700 lines: every operator-facing artefact (unit, package, journal, signals) with
//! the fixtures it needs; split by artefact, the fixtures would repeat.

use std::fs::File;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::support;
use crate::support::Broker;
use crate::support::agent::{AgentConfig, CairnProcess};
use cairn::notify::{Heartbeat, Notifier};

const MAX_EXPOSURE: f64 = 2.0;

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn cairn_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_cairn"))
}

/// Runs `cmd`, or panics with how to install `tool` if it cannot be started.
fn run_tool(cmd: &mut Command, tool: &str, install: &str) -> Output {
    cmd.output().unwrap_or_else(|e| {
        panic!("cannot run `{tool}` ({e}); install it with `{install}` (`.ci/test` does)")
    })
}

fn systemd_analyze() -> Command {
    Command::new("systemd-analyze")
}

const INSTALL_SYSTEMD: &str = "apt-get install systemd";

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

// ---------------------------------------------------------------------------------------------
// The unit

/// The shipped unit with ExecStart pointing at the binary cargo built, since `verify` checks
/// that the program exists; the file keeps its name, which `verify` derives the unit from.
fn unit_for_this_box(dir: &Path) -> PathBuf {
    let unit = std::fs::read_to_string(repo().join("systemd/cairn.service")).unwrap();
    assert!(
        unit.contains("ExecStart=/usr/bin/cairn run --config /etc/cairn/cairn.toml\n"),
        "the unit's ExecStart changed; update this test with it"
    );
    let path = dir.join("cairn.service");
    let bin = cairn_bin().display().to_string();
    std::fs::write(
        &path,
        unit.replace("ExecStart=/usr/bin/cairn", &format!("ExecStart={bin}")),
    )
    .unwrap();
    path
}

#[test]
fn the_unit_passes_systemd_analyze_verify_without_a_warning() {
    let dir = tempfile::tempdir().unwrap();
    let unit = unit_for_this_box(dir.path());
    let out = run_tool(
        systemd_analyze().arg("verify").arg(&unit),
        "systemd-analyze",
        INSTALL_SYSTEMD,
    );
    let stderr = text(&out.stderr);
    println!("systemd-analyze verify: {}, stderr: {stderr:?}", out.status);
    assert!(
        out.status.success(),
        "systemd-analyze verify failed:\n{stderr}"
    );
    assert!(
        stderr.trim().is_empty(),
        "systemd-analyze verify warned:\n{stderr}"
    );
}

/// `systemd-analyze security` needs no running systemd with `--offline=yes` (systemd 250+):
/// it rates the unit file itself.
#[test]
fn the_unit_is_hardened_to_an_exposure_of_2_or_lower() {
    let unit = repo().join("systemd/cairn.service");
    let out = run_tool(
        systemd_analyze()
            .args(["security", "--offline=yes", "--no-pager"])
            .arg(&unit),
        "systemd-analyze",
        INSTALL_SYSTEMD,
    );
    let stdout = text(&out.stdout);
    let stderr = text(&out.stderr);
    assert!(
        out.status.success(),
        "systemd-analyze security --offline=yes failed ({}); it needs systemd 250 or later:\n\
         {stderr}{stdout}",
        out.status
    );
    let line = stdout
        .lines()
        .find(|l| l.contains("Overall exposure level for cairn.service:"))
        .unwrap_or_else(|| panic!("no overall exposure line in:\n{stdout}"));
    let score: f64 = line
        .split(':')
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("cannot read the score in {line:?}"));
    println!("{}", line.trim_start_matches('→').trim());
    let open: Vec<&str> = stdout.lines().filter(|l| l.starts_with('✗')).collect();
    println!("still open:\n{}", open.join("\n"));
    assert!(
        score <= MAX_EXPOSURE,
        "exposure {score} > {MAX_EXPOSURE}:\n{stdout}"
    );
}

#[test]
fn the_packaged_config_differs_from_the_example_only_in_data_dir_and_the_broker_login() {
    let example = cairn::config::load(&repo().join("config/cairn.toml")).unwrap();
    let packaged = cairn::config::load(&repo().join("systemd/cairn.toml")).unwrap();
    assert_eq!(packaged.storage.data_dir, Path::new("/var/lib/cairn"));
    // The example runs against a broker as Debian installs it (anonymous); the packaged
    // config logs in as the snippet's `cairn` user (README, "Before the box goes into
    // service").
    assert_eq!(example.mqtt.username, None);
    assert_eq!(packaged.mqtt.username.as_deref(), Some("cairn"));
    let rest = |c: &cairn::config::Config| {
        cairn::config::summary(c)
            .lines()
            .filter(|l| {
                let l = l.trim_start_matches("# ");
                !["data_dir", "username", "password_file"]
                    .iter()
                    .any(|k| l.starts_with(k))
            })
            .collect::<Vec<_>>()
            .join("\n")
    };
    assert_eq!(rest(&packaged), rest(&example));
}

#[test]
fn the_mosquitto_snippet_is_accepted_by_mosquitto() {
    let dir = tempfile::tempdir().unwrap();
    let port = support::free_port();
    // Only the port and the paths of the password and ACL files differ from the shipped
    // snippet (tests/it/snippet.rs checks what it promises).
    support::password_file(dir.path(), "cairn", "secret");
    std::fs::rename(
        dir.path().join("mosquitto.passwd"),
        dir.path().join("passwd"),
    )
    .unwrap();
    std::fs::copy(
        repo().join("config/mosquitto.acl"),
        dir.path().join("cairn.acl"),
    )
    .unwrap();
    let conf = crate::snippet::SnippetBroker::config_text(dir.path(), port);
    let path = dir.path().join("mosquitto.conf");
    std::fs::write(&path, conf).unwrap();
    let mut child = Command::new(support::mosquitto_bin())
        .arg("-c")
        .arg(&path)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let up = support::wait_until(Duration::from_secs(10), || {
        std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
            || matches!(child.try_wait(), Ok(Some(_)))
    });
    let exited = child.try_wait().unwrap();
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    assert!(
        up && exited.is_none(),
        "mosquitto refused config/mosquitto.conf ({exited:?}):\n{}{}",
        text(&out.stderr),
        std::fs::read_to_string(dir.path().join("mosquitto.log")).unwrap_or_default()
    );
}

// ---------------------------------------------------------------------------------------------
// The notify protocol

/// A fake `$NOTIFY_SOCKET`: a datagram socket we read what the agent says from.
struct FakeSystemd {
    socket: UnixDatagram,
    seen: Vec<String>,
}

impl FakeSystemd {
    fn bind(path: &Path) -> FakeSystemd {
        FakeSystemd::from(UnixDatagram::bind(path).unwrap())
    }

    fn from(socket: UnixDatagram) -> FakeSystemd {
        socket
            .set_read_timeout(Some(Duration::from_millis(50)))
            .unwrap();
        FakeSystemd {
            socket,
            seen: Vec::new(),
        }
    }

    /// Reads messages until one has a line equal to `line`, or `timeout` passes.
    fn wait_for(&mut self, line: &str, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut buf = vec![0u8; 4096];
        loop {
            if self.seen.iter().any(|m| m.lines().any(|l| l == line)) {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            if let Ok(n) = self.socket.recv(&mut buf) {
                self.seen.push(text(&buf[..n]));
            }
        }
    }

    /// Index of the first message with a line equal to `line`.
    fn position(&self, line: &str) -> Option<usize> {
        self.seen.iter().position(|m| m.lines().any(|l| l == line))
    }

    fn count(&self, line: &str) -> usize {
        self.seen
            .iter()
            .filter(|m| m.lines().any(|l| l == line))
            .count()
    }
}

#[test]
fn notify_messages_reach_a_socket_bound_in_a_directory() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("notify");
    let mut systemd = FakeSystemd::bind(&path);
    let n = Notifier::to(path.to_str().unwrap()).unwrap();
    n.send("READY=1\nSTATUS=up").unwrap();
    assert!(systemd.wait_for("READY=1", Duration::from_secs(2)));
    assert_eq!(systemd.seen, ["READY=1\nSTATUS=up"]);
}

#[test]
fn notify_messages_reach_an_abstract_socket_named_with_an_at_sign() {
    let name = format!("cairn-notify-test-{}", std::process::id());
    let addr = SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
    let mut systemd = FakeSystemd::from(UnixDatagram::bind_addr(&addr).unwrap());
    Notifier::to(&format!("@{name}"))
        .unwrap()
        .send("WATCHDOG=1")
        .unwrap();
    assert!(systemd.wait_for("WATCHDOG=1", Duration::from_secs(2)));
}

#[test]
fn a_notify_socket_nobody_reads_never_blocks_the_sender() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("notify");
    let _unread = UnixDatagram::bind(&path).unwrap();
    let n = Notifier::to(path.to_str().unwrap()).unwrap();
    let started = Instant::now();
    let mut refused = 0;
    for _ in 0..5_000 {
        if n.send("WATCHDOG=1").is_err() {
            refused += 1;
        }
    }
    let took = started.elapsed();
    assert!(refused > 0, "the receive queue never filled up");
    assert!(took < Duration::from_secs(2), "5000 sends took {took:?}");
}

#[test]
fn a_heartbeat_pings_the_watchdog_and_refreshes_the_status_when_due() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("notify");
    let mut systemd = FakeSystemd::bind(&path);
    let n = Notifier::to(path.to_str().unwrap()).unwrap();
    let mut beat = Heartbeat::new(
        Some(n),
        Some(Duration::from_secs(15)),
        Duration::from_secs(10),
    );
    let t0 = Instant::now(); // not before the heartbeat's own clocks start
    let mut described = 0;
    beat.beat(t0 + Duration::from_secs(1), || {
        described += 1;
        "x".into()
    });
    beat.beat(t0 + Duration::from_secs(10), || {
        described += 1;
        "processed 5\ncheckpoint 2".into()
    });
    beat.beat(t0 + Duration::from_secs(15), || unreachable!());
    assert_eq!(described, 1, "the status is described only when due");
    assert!(systemd.wait_for("WATCHDOG=1", Duration::from_secs(2)));
    assert_eq!(
        systemd.seen,
        ["STATUS=processed 5 checkpoint 2\n", "WATCHDOG=1\n"]
    );
}

#[test]
fn without_a_notify_socket_a_heartbeat_does_nothing() {
    let mut beat = Heartbeat::new(None, Some(Duration::ZERO), Duration::ZERO);
    beat.beat(Instant::now() + Duration::from_secs(1), || {
        panic!("nothing to describe without systemd")
    });
}

// ---------------------------------------------------------------------------------------------
// The real binary

/// The ops tests' agent config; `checkpoint` is the body of the `[checkpoint]` table.
fn ops_config(port: u16, checkpoint: &str) -> AgentConfig {
    let pipeline = "[[pipeline]]\nname = \"balances\"\ntopics = [\"payments/#\"]\nformat = \"json\"\n\
                    event_id = \"/id\"\nkey = \"/account\"\nvalue = \"/amount\"\naggregate = \"sum\"\n\
                    output_topic = \"balances/{key}\"\n";
    let mut cfg = AgentConfig::new(port, pipeline);
    cfg.client_id = support::unique_id("ops").replace('-', "_");
    cfg.mqtt = "reconnect_min = \"50ms\"\nreconnect_max = \"200ms\"\n".into();
    cfg.log = "segment_size = \"4MiB\"\nmax_size = \"64MiB\"\n".into();
    cfg.checkpoint = checkpoint.into();
    cfg.outbox = "drain_timeout = \"2s\"\n".into();
    cfg
}

/// `cairn run` without the systemd variables this test process may have inherited (each
/// test sets the ones it checks), logging at info.
fn ops_agent(cfg: &AgentConfig) -> CairnProcess {
    let mut agent = CairnProcess::new(cfg);
    for key in [
        "NOTIFY_SOCKET",
        "WATCHDOG_USEC",
        "WATCHDOG_PID",
        "JOURNAL_STREAM",
    ] {
        agent.remove_env(key);
    }
    // No native journal: these tests read what a journal stream gets (on a box where
    // journald runs, a JOURNAL_STREAM test would otherwise log natively; tests/it/journal.rs
    // covers that way).
    let no_journal = agent.dir().join("no-journal-socket");
    agent.set_env("CAIRN_JOURNAL_SOCKET", &no_journal.to_string_lossy());
    agent.set_log_filter(Some("info"));
    agent
}

#[test]
fn cairn_run_notifies_ready_after_recovery_pings_the_watchdog_and_notifies_stopping() {
    let broker = Broker::start();
    let mut agent = ops_agent(&ops_config(broker.port(), ""));
    let socket = agent.dir().join("notify");
    let mut systemd = FakeSystemd::bind(&socket);
    let socket_var = socket.display().to_string();
    agent.start_with_env(&[
        ("NOTIFY_SOCKET", socket_var.as_str()),
        ("WATCHDOG_USEC", "400000"), // a ping every 200 ms
    ]);

    assert!(
        systemd.wait_for("READY=1", Duration::from_secs(20)),
        "no READY=1; got {:?}; stderr:\n{}",
        systemd.seen,
        agent.stderr()
    );
    assert!(
        agent.stderr().contains("recovery: done"),
        "READY=1 before recovery finished; stderr:\n{}",
        agent.stderr()
    );
    assert!(systemd.wait_for("STATUS=running: recovery done", Duration::from_secs(2)));

    // Input flows while systemd watches; the watchdog keeps being fed.
    support::publish_all(
        broker.port(),
        &[(
            "payments/eu".into(),
            br#"{"id":"E1","account":"A","amount":5}"#.to_vec(),
            false,
        )],
    );
    let ready_at = systemd.position("READY=1").unwrap();
    let fed = support::wait_until(Duration::from_secs(5), || {
        systemd.wait_for("never", Duration::from_millis(50));
        systemd.count("WATCHDOG=1") >= 3
    });
    assert!(fed, "fewer than 3 WATCHDOG=1 in 5 s: {:?}", systemd.seen);
    assert!(systemd.position("WATCHDOG=1").unwrap() > ready_at);

    agent.signal("TERM");
    assert!(
        systemd.wait_for("STOPPING=1", Duration::from_secs(10)),
        "no STOPPING=1 after SIGTERM; got {:?}; stderr:\n{}",
        systemd.seen,
        agent.stderr()
    );
    let status = agent.expect_exit(Duration::from_secs(20));
    assert!(
        status.success(),
        "exit {status}; stderr:\n{}",
        agent.stderr()
    );
    assert!(systemd.position("STOPPING=1").unwrap() > ready_at);
    println!("notifications: {:?}", systemd.seen);
}

#[test]
fn a_long_replay_reports_progress_and_extends_the_start_timeout_before_ready() {
    // Run 1 logs 300 inputs but never checkpoints (1h, 1M records) and is SIGKILLed; run 2
    // checkpoints every 100 records, so its replay reports progress at least three times.
    let broker = Broker::start();
    let lazy = "interval = \"1h\"\nmax_records = 100000\n";
    let mut cfg = ops_config(broker.port(), lazy);
    let mut agent = ops_agent(&cfg);
    agent.start();
    let config = agent.config_path();
    let logged_records = || {
        let out = Command::new(cairn_bin())
            .args(["inspect", "log", "--limit", "1000", "--config"])
            .arg(&config)
            .output()
            .unwrap();
        text(&out.stdout).lines().count()
    };
    // The agent subscribes after it connects; probe until an input reaches its log.
    let mut probe = 0;
    let subscribed = support::wait_until(Duration::from_secs(20), || {
        probe += 1;
        let p = format!(r#"{{"id":"P{probe}","account":"P","amount":1}}"#);
        support::publish_all(broker.port(), &[("payments/probe".into(), p.into(), false)]);
        std::thread::sleep(Duration::from_millis(100));
        logged_records() > 0
    });
    let inputs: Vec<(String, Vec<u8>, bool)> = (0..300)
        .map(|i| {
            let p = format!(r#"{{"id":"E{i}","account":"A{}","amount":1}}"#, i % 7);
            ("payments/eu".to_string(), p.into_bytes(), false)
        })
        .collect();
    support::publish_all(broker.port(), &inputs);
    let logged = support::wait_until(Duration::from_secs(20), || logged_records() >= 301);
    agent.kill();
    assert!(
        subscribed && logged,
        "the agent did not log 300 inputs; stderr:\n{}",
        agent.stderr()
    );

    cfg.checkpoint = "max_records = 100\n".into();
    agent.rewrite_config(&cfg);
    let socket = agent.dir().join("notify");
    let mut systemd = FakeSystemd::bind(&socket);
    agent.start_with_env(&[("NOTIFY_SOCKET", socket.display().to_string().as_str())]);
    let ready = systemd.wait_for("READY=1", Duration::from_secs(20));
    agent.signal("TERM");
    agent.expect_exit(Duration::from_secs(20));
    assert!(
        ready,
        "no READY=1: {:?}; stderr:\n{}",
        systemd.seen,
        agent.stderr()
    );
    let ready_at = systemd.position("READY=1").unwrap();
    let progress: Vec<&String> = systemd.seen[..ready_at]
        .iter()
        .filter(|m| m.starts_with("STATUS=recovery: replayed "))
        .collect();
    assert!(progress.len() >= 3, "{:?}", systemd.seen);
    assert_eq!(
        progress[0].as_str(),
        "STATUS=recovery: replayed 100 records up to offset 100\n\
         EXTEND_TIMEOUT_USEC=30000000\nWATCHDOG=1"
    );
}

/// `2024-05-01T12:34:56`: the start of an RFC 3339 timestamp anywhere in `line`.
fn has_timestamp(line: &str) -> bool {
    const SHAPE: &[u8] = b"dddd-dd-ddTdd:";
    line.as_bytes().windows(SHAPE.len()).any(|w| {
        w.iter().zip(SHAPE).all(|(&c, &s)| match s {
            b'd' => c.is_ascii_digit(),
            _ => c == s,
        })
    })
}

/// A stderr file and the `JOURNAL_STREAM` value systemd would set for it.
fn journal_stream(path: &Path) -> String {
    File::create(path).unwrap();
    let m = std::fs::metadata(path).unwrap();
    format!("{}:{}", m.dev(), m.ino())
}

fn priority_of(line: &str) -> Option<u8> {
    let rest = line.strip_prefix('<')?;
    let (p, _) = rest.split_once('>')?;
    p.parse().ok().filter(|p| *p <= 7)
}

#[test]
fn under_the_journal_every_stderr_line_has_a_priority_prefix_and_no_timestamp() {
    // A broker port nobody listens on: the agent logs at info, warns about the broker, and
    // at debug (RUST_LOG=debug) says more; then SIGTERM makes it drain and exit.
    let mut agent = ops_agent(&ops_config(support::free_port(), ""));
    agent.set_log_filter(Some("debug"));
    // The stderr file the agent appends to: its identity is what systemd would announce.
    let stream = journal_stream(&agent.stderr_path());
    agent.start_with_env(&[("JOURNAL_STREAM", stream.as_str())]);
    // This run's lines only: the wrapper's `=== run` header is not the agent's.
    let warned = support::wait_until(Duration::from_secs(15), || {
        agent.run_stderr().contains("mqtt: disconnected")
    });
    agent.signal("TERM");
    let status = agent.expect_exit(Duration::from_secs(20));
    let out = agent.run_stderr();
    assert!(warned, "no broker warning in:\n{out}");
    assert!(status.success(), "exit {status}:\n{out}");
    let mut seen = std::collections::BTreeSet::new();
    for line in out.lines() {
        let p = priority_of(line).unwrap_or_else(|| panic!("no priority prefix: {line:?}"));
        assert!(
            !has_timestamp(line),
            "a timestamp under the journal: {line:?}"
        );
        seen.insert(p);
    }
    for (p, what) in [(4, "warn"), (6, "info"), (7, "debug")] {
        assert!(seen.contains(&p), "no <{p}> ({what}) line in:\n{out}");
    }
    assert!(
        out.contains("<4>[WARN  cairn::agent] mqtt: disconnected"),
        "{out}"
    );
}

#[test]
fn under_the_journal_a_fatal_config_error_is_logged_at_error_priority() {
    let mut agent = ops_agent(&ops_config(support::free_port(), ""));
    agent.write_config_text("[mqtt]\nclient_id = \"x\"\nport = \"many\"\n");
    let stream = journal_stream(&agent.stderr_path());
    agent.start_with_env(&[("JOURNAL_STREAM", stream.as_str())]);
    let status = agent.expect_exit(Duration::from_secs(20));
    let out = agent.run_stderr();
    assert_eq!(status.code(), Some(2), "{out}");
    assert!(!out.is_empty());
    for line in out.lines() {
        assert!(line.starts_with("<3>"), "not at error priority: {line:?}");
        assert!(!has_timestamp(line), "{line:?}");
    }
    assert!(out.starts_with("<3>cairn: "), "{out}");
}

#[test]
fn outside_the_journal_lines_are_human_with_a_timestamp() {
    // Also when JOURNAL_STREAM is inherited but stderr went elsewhere (`2>file` in a shell
    // started by a unit): it names another file, so it is not believed.
    let mut agent = ops_agent(&ops_config(support::free_port(), ""));
    let elsewhere = journal_stream(&agent.dir().join("the-real-journal"));
    for journal in [None, Some(elsewhere)] {
        let env: Vec<(&str, &str)> = journal
            .iter()
            .map(|j| ("JOURNAL_STREAM", j.as_str()))
            .collect();
        agent.start_with_env(&env);
        let started = support::wait_until(Duration::from_secs(15), || {
            agent.run_stderr().contains("recovery: done")
        });
        agent.signal("TERM");
        agent.expect_exit(Duration::from_secs(20));
        let out = agent.run_stderr();
        assert!(started, "{out}");
        let line = out.lines().find(|l| l.contains("recovery: done")).unwrap();
        assert!(line.starts_with('['), "{line:?}");
        assert!(has_timestamp(line), "no timestamp: {line:?}");
        assert!(priority_of(line).is_none(), "{line:?}");
    }
}

// ---------------------------------------------------------------------------------------------
// The Debian package

/// Runs `systemd/debian/postinst configure` (as shipped, before cargo-deb adds its systemd
/// fragments) with fake `getent`, `adduser`, `addgroup`, `useradd` and `groupadd` first on
/// PATH: `getent passwd cairn` answers `passwd` (nothing: no such account). Returns the exit
/// code, stderr, and the account commands it ran.
fn run_postinst(passwd: Option<&str>) -> (Option<i32>, String, String) {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let bin = dir.path().join("bin");
    std::fs::create_dir(&bin).unwrap();
    let calls = dir.path().join("calls");
    let stub = |name: &str, body: &str| {
        let path = bin.join(name);
        std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    };
    stub(
        "getent",
        "case \"$1\" in passwd) [ -n \"$FAKE_PASSWD\" ] && echo \"$FAKE_PASSWD\" && exit 0; exit 2;; \
         group) echo 'cairn:x:999:'; exit 0;; esac; exit 2",
    );
    for tool in ["adduser", "addgroup", "useradd", "groupadd"] {
        stub(tool, &format!("echo \"{tool} $*\" >> {}", calls.display()));
    }
    let path = format!("{}:/usr/bin:/bin", bin.display());
    let out = Command::new("sh")
        .arg(repo().join("systemd/debian/postinst"))
        .args(["configure", ""])
        .env("PATH", path)
        .env("FAKE_PASSWD", passwd.unwrap_or(""))
        .output()
        .unwrap();
    (
        out.status.code(),
        text(&out.stderr),
        std::fs::read_to_string(&calls).unwrap_or_default(),
    )
}

/// Issue 27: the package silently reused an existing `cairn` login account. The postinst now
/// makes the account when there is none, reuses one that looks like its own (a system
/// account without a login shell), and refuses anything else, saying what is wrong and how
/// to go on.
#[test]
fn the_postinst_makes_the_account_reuses_a_system_one_and_refuses_a_login_account() {
    let (code, err, calls) = run_postinst(None);
    assert_eq!(code, Some(0), "{err}");
    assert!(
        calls.contains("adduser --system") && calls.contains("--shell /usr/sbin/nologin"),
        "{calls}"
    );
    let (code, err, calls) = run_postinst(Some(
        "cairn:x:998:998:Cairn:/var/lib/cairn:/usr/sbin/nologin",
    ));
    assert_eq!((code, calls.as_str()), (Some(0), ""), "{err}");
    for (entry, says) in [
        (
            "cairn:x:1001:1001:Someone:/home/cairn:/bin/bash",
            "uid 1001 is not a system account's (1-999); its shell '/bin/bash' lets someone log in",
        ),
        (
            "cairn:x:997:997::/var/lib/cairn:/bin/sh",
            "its shell '/bin/sh' lets someone log in",
        ),
        (
            "cairn:x:0:0:root:/root:/usr/sbin/nologin",
            "uid 0 is not a system account's",
        ),
        ("cairn:x:1500:1500::/home/c:/bin/false", "uid 1500 is not"),
    ] {
        let (code, err, calls) = run_postinst(Some(entry));
        assert_eq!(code, Some(1), "{entry}: {err}");
        assert!(err.contains(says), "{entry}: {err}");
        assert!(err.contains("dpkg --configure cairn"), "{err}");
        assert_eq!(calls, "", "{entry}: nothing is created");
    }
}

fn dpkg_deb(args: &[&str], deb: &Path) -> String {
    let out = run_tool(
        Command::new("dpkg-deb").args(args).arg(deb),
        "dpkg-deb",
        "apt-get install dpkg",
    );
    assert!(
        out.status.success(),
        "dpkg-deb {args:?}: {}",
        text(&out.stderr)
    );
    text(&out.stdout)
}

#[test]
fn cargo_deb_packages_the_binary_unit_conffile_snippet_man_pages_completions_docs_and_monitoring() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    // Checked here, first, so that a box without it gets the fix in the failure message
    // instead of an error from deep inside the packaging.
    let probe = Command::new(&cargo).args(["deb", "--version"]).output();
    assert!(
        probe.as_ref().is_ok_and(|o| o.status.success()),
        "`cargo deb` is not installed ({}): install it with `cargo install cargo-deb --locked`, \
         or run the suite with `.ci/test`, which installs it",
        probe
            .as_ref()
            .map_or_else(|e| e.to_string(), |o| text(&o.stderr))
    );
    let dir = tempfile::tempdir().unwrap();
    let started = Instant::now();
    let out = Command::new(&cargo)
        .args(["deb", "--output"])
        .arg(dir.path())
        .current_dir(repo())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "cargo deb failed:\n{}",
        text(&out.stderr)
    );
    let deb = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "deb"))
        .expect("cargo deb wrote no .deb");
    println!(
        "{}: {} bytes, built in {:?}",
        deb.file_name().unwrap().to_string_lossy(),
        std::fs::metadata(&deb).unwrap().len(),
        started.elapsed()
    );

    let listing = dpkg_deb(&["-c"], &deb);
    println!("{listing}");
    let has = |path: &str| listing.lines().any(|l| l.ends_with(path));
    assert!(has(" ./usr/bin/cairn"), "no binary:\n{listing}");
    assert!(
        has(" ./lib/systemd/system/cairn.service")
            || has(" ./usr/lib/systemd/system/cairn.service"),
        "no unit:\n{listing}"
    );
    assert!(has(" ./etc/cairn/cairn.toml"), "no config:\n{listing}");
    assert!(
        has(" ./usr/share/doc/cairn/mosquitto.conf"),
        "no mosquitto snippet:\n{listing}"
    );
    assert!(
        has(" ./usr/share/doc/cairn/mosquitto.acl"),
        "no mosquitto ACL:\n{listing}"
    );

    let info = dpkg_deb(&["-I"], &deb);
    println!("{info}");
    for part in ["postinst", "postrm", "prerm", "conffiles"] {
        assert!(info.contains(part), "no {part}:\n{info}");
    }

    // What the box gets is exactly what this repository holds.
    let control = dir.path().join("control");
    let out = Command::new("dpkg-deb")
        .arg("-e")
        .arg(&deb)
        .arg(&control)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let conffiles = std::fs::read_to_string(control.join("conffiles")).unwrap();
    assert_eq!(conffiles.trim(), "/etc/cairn/cairn.toml");
    let postinst = std::fs::read_to_string(control.join("postinst")).unwrap();
    assert!(postinst.contains("getent passwd cairn"), "{postinst}");
    assert!(postinst.contains("deb-systemd-helper"), "{postinst}");
    let root = dir.path().join("root");
    let out = Command::new("dpkg-deb")
        .arg("-x")
        .arg(&deb)
        .arg(&root)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let same = |installed: &str, source: &str| {
        assert_eq!(
            std::fs::read(root.join(installed)).unwrap(),
            std::fs::read(repo().join(source)).unwrap(),
            "{installed} differs from {source}"
        );
    };
    same("etc/cairn/cairn.toml", "systemd/cairn.toml");
    same(
        "usr/share/doc/cairn/mosquitto.conf",
        "config/mosquitto.conf",
    );
    same("usr/share/doc/cairn/mosquitto.acl", "config/mosquitto.acl");
    let unit = [
        "lib/systemd/system/cairn.service",
        "usr/lib/systemd/system/cairn.service",
    ]
    .into_iter()
    .find(|u| root.join(u).exists())
    .unwrap();
    same(unit, "systemd/cairn.service");
    // Man pages (gzipped by cargo-deb), completions and docs, as generated and committed.
    for page in std::fs::read_dir(repo().join("dist/man")).unwrap() {
        let page = page.unwrap().file_name().to_string_lossy().to_string();
        let gz = root.join(format!("usr/share/man/man1/{page}.gz"));
        let out = Command::new("gzip").arg("-dc").arg(&gz).output().unwrap();
        assert!(out.status.success(), "no man page {page}.gz:\n{listing}");
        assert_eq!(
            out.stdout,
            std::fs::read(repo().join("dist/man").join(&page)).unwrap(),
            "{page}"
        );
    }
    assert!(
        has(" ./usr/share/man/man1/cairn-inspect-log.1.gz"),
        "{listing}"
    );
    same(
        "usr/share/bash-completion/completions/cairn",
        "dist/completions/cairn.bash",
    );
    same(
        "usr/share/zsh/vendor-completions/_cairn",
        "dist/completions/_cairn",
    );
    same(
        "usr/share/fish/vendor_completions.d/cairn.fish",
        "dist/completions/cairn.fish",
    );
    same(
        "usr/share/cairn/prometheus/cairn.rules.yml",
        "monitoring/cairn.rules.yml",
    );
    same(
        "usr/share/cairn/prometheus/cairn.rules.test.yml",
        "monitoring/cairn.rules.test.yml",
    );
    same(
        "usr/share/cairn/grafana/cairn.dashboard.json",
        "monitoring/cairn.dashboard.json",
    );
    for doc in std::fs::read_dir(repo().join("docs")).unwrap() {
        let doc = doc.unwrap().file_name().to_string_lossy().to_string();
        same(
            &format!("usr/share/doc/cairn/docs/{doc}"),
            &format!("docs/{doc}"),
        );
    }
    let version = Command::new(root.join("usr/bin/cairn"))
        .arg("--version")
        .output()
        .unwrap();
    assert!(
        text(&version.stdout).starts_with("cairn "),
        "{}",
        text(&version.stdout)
    );
}
