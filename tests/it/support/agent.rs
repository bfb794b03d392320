//! The real `cairn` binary as a child process, the one wrapper every test and bench uses: a
//! config written into a temp dir, start (with arguments, environment, failpoints, a log
//! filter), signals, SIGKILL, SIGTERM, and its stderr kept in a file (every run appended,
//! each headed by a `=== run N ===` line) so that a failing assertion can show what the
//! agent said. [`AgentConfig`] is the one builder of `cairn.toml` text for a running agent.
//!
//! Dropping a [`CairnProcess`] SIGKILLs the agent if it still runs.

use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use super::{signal, wait_until};

/// The `cairn` binary cargo built for this test (or bench) target.
pub fn cairn_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_cairn"))
}

/// How long SIGTERM may take before the test calls it a hang (the longest drain_timeout a
/// test configures, 10 s in the crash harness, plus margin for a loaded box).
const TERM_TIMEOUT: Duration = Duration::from_secs(30);

/// The parts of `cairn.toml` a test varies. Each `*_extra` string holds raw TOML lines
/// added to that table; a key given there must not also be one of the defaults below. A
/// table whose body is empty is left out (its defaults apply), so `extra` may define it.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    pub port: u16,
    pub client_id: String,
    /// `[mqtt]` lines after host, port and client_id (keep-alive, reconnect backoff).
    pub mqtt: String,
    /// `[storage]` lines after data_dir.
    pub storage: String,
    /// Where the store and log live; `None`: `<the agent's temp dir>/data`.
    pub data_dir: Option<PathBuf>,
    /// `[log]` table body; defaults are small and fast (see [`AgentConfig::new`]).
    pub log: String,
    /// `[checkpoint]` table body.
    pub checkpoint: String,
    /// `[outbox]` table body.
    pub outbox: String,
    /// Extra lines for `[mqtt]`.
    pub mqtt_extra: String,
    /// Raw TOML tables placed before the pipelines (`[logging]`, `[savepoint]`, ...).
    pub extra: String,
    /// One or more complete `[[pipeline]]` tables.
    pub pipelines: String,
    /// `[uplink]` table body; empty: no uplink (results go to `[mqtt]`'s broker).
    pub uplink: String,
}

impl AgentConfig {
    pub fn new(port: u16, pipelines: &str) -> AgentConfig {
        AgentConfig {
            port,
            client_id: super::unique_id("cairn").replace('-', "_"),
            mqtt: "keep_alive = \"5s\"\nreconnect_min = \"50ms\"\nreconnect_max = \"500ms\"\n"
                .into(),
            storage: "cache_size = \"8MiB\"\n".into(),
            data_dir: None,
            log: "segment_size = \"4MiB\"\nmax_size = \"256MiB\"\nretention = \"1h\"\n\
                  commit_interval = \"2ms\"\nmax_payload = \"64KiB\"\n"
                .into(),
            checkpoint: "interval = \"50ms\"\nmax_records = 2000\n".into(),
            outbox: "max_entries = 100000\ninflight = 100\ndrain_timeout = \"5s\"\n".into(),
            mqtt_extra: String::new(),
            extra: String::new(),
            pipelines: pipelines.into(),
            uplink: String::new(),
        }
    }

    /// Results to a second broker on `port` under their own session `client_id`, with
    /// `prefix` before each topic, reconnecting fast (tests cut that link).
    pub fn with_uplink(mut self, port: u16, client_id: &str, prefix: &str) -> AgentConfig {
        self.uplink = format!(
            "host = \"127.0.0.1\"\nport = {port}\nclient_id = \"{client_id}\"\n\
             topic_prefix = \"{prefix}\"\nkeep_alive = \"5s\"\n\
             reconnect_min = \"50ms\"\nreconnect_max = \"500ms\"\n"
        );
        self
    }

    /// The `cairn.toml` text; `dir` is the agent's directory (data under `dir/data` unless
    /// [`AgentConfig::data_dir`] says otherwise).
    pub fn render(&self, dir: &Path) -> String {
        let data_dir = self.data_dir.clone().unwrap_or_else(|| dir.join("data"));
        let mut text = format!(
            "[mqtt]\nhost = \"127.0.0.1\"\nport = {}\nclient_id = \"{}\"\n{}{}\n\
             [storage]\ndata_dir = \"{}\"\n{}\n",
            self.port,
            self.client_id,
            self.mqtt,
            self.mqtt_extra,
            data_dir.display(),
            self.storage,
        );
        for (table, body) in [
            ("log", &self.log),
            ("checkpoint", &self.checkpoint),
            ("outbox", &self.outbox),
            ("uplink", &self.uplink),
        ] {
            if !body.is_empty() {
                text.push_str(&format!("[{table}]\n{body}\n"));
            }
        }
        text.push_str(&format!("{}\n{}\n", self.extra, self.pipelines));
        text
    }

    /// Write `dir/cairn.toml` (data under `dir/data` unless [`AgentConfig::data_dir`] says
    /// otherwise) for tests that run commands or open the store without a running agent.
    pub fn write(&self, dir: &Path) -> PathBuf {
        let file = dir.join("cairn.toml");
        std::fs::write(&file, self.render(dir)).expect("write cairn.toml");
        file
    }
}

/// One agent: its temp dir (config, data, stderr file) and, while running, its process.
pub struct CairnProcess {
    dir: tempfile::TempDir,
    child: Option<Child>,
    runs: usize,
    /// Byte length of the stderr file when the current run started.
    run_start: usize,
    /// Extra environment for every run (failpoints, the test clock).
    env: Vec<(String, String)>,
    /// Variables removed from the inherited environment for every run.
    env_removed: Vec<String>,
    /// `RUST_LOG` for runs; `None` removes it so that the config's `[logging]` decides.
    log_filter: Option<String>,
    /// Where the data lives (the config's `data_dir`).
    data_dir: PathBuf,
    /// The binary every run and command starts: [`cairn_bin`] unless a bench compares another
    /// build ([`CairnProcess::set_bin`]).
    bin: PathBuf,
}

impl CairnProcess {
    /// Writes `<tempdir>/cairn.toml` (data under `<tempdir>/data`); does not start it.
    pub fn new(cfg: &AgentConfig) -> CairnProcess {
        let dir = tempfile::tempdir().expect("agent temp dir");
        let text = cfg.render(dir.path());
        std::fs::write(dir.path().join("cairn.toml"), text).expect("write cairn.toml");
        let data_dir = cfg
            .data_dir
            .clone()
            .unwrap_or_else(|| dir.path().join("data"));
        CairnProcess {
            dir,
            child: None,
            runs: 0,
            run_start: 0,
            env: Vec::new(),
            env_removed: vec!["CAIRN_CONFIG".into()],
            // The checkpoint lines are debug; CAIRN_TEST_LOG asks for more when debugging.
            log_filter: Some(
                std::env::var("CAIRN_TEST_LOG").unwrap_or("info,cairn::agent=debug".into()),
            ),
            data_dir,
            bin: cairn_bin(),
        }
    }

    /// Runs another build of `cairn` from the next start on (the compare bench's
    /// `CAIRN_COMPARE_BIN`: an older commit's binary under the same load).
    pub fn set_bin(&mut self, bin: &Path) {
        self.bin = bin.to_path_buf();
    }

    /// The agent's own directory (config, stderr file, default data dir): tests put sockets
    /// and other per-agent files here.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// `RUST_LOG` for later runs; `None` removes it, so the config's `[logging]` level
    /// decides (what an operator gets).
    pub fn set_log_filter(&mut self, filter: Option<&str>) {
        self.log_filter = filter.map(str::to_string);
    }

    /// Removes a variable from the environment later runs inherit (e.g. `NOTIFY_SOCKET`).
    pub fn remove_env(&mut self, key: &str) {
        self.env.retain(|(k, _)| k != key);
        self.env_removed.push(key.to_string());
    }

    /// Sets an environment variable for every later run.
    pub fn set_env(&mut self, key: &str, value: &str) {
        self.env.retain(|(k, _)| k != key);
        self.env.push((key.to_string(), value.to_string()));
    }

    pub fn config_path(&self) -> PathBuf {
        self.dir.path().join("cairn.toml")
    }

    pub fn data_dir(&self) -> PathBuf {
        self.data_dir.clone()
    }

    /// The file every run's stderr is appended to.
    pub fn stderr_path(&self) -> PathBuf {
        self.dir.path().join("cairn.stderr")
    }

    /// Everything the agent wrote to stderr, all runs.
    pub fn stderr(&self) -> String {
        std::fs::read_to_string(self.stderr_path()).unwrap_or_default()
    }

    /// What the current (or last) run wrote to stderr.
    pub fn run_stderr(&self) -> String {
        let all = self.stderr();
        all.get(self.run_start..).unwrap_or("").to_string()
    }

    /// The last `lines` lines of stderr, for assertion messages.
    pub fn stderr_tail(&self, lines: usize) -> String {
        let all = self.stderr();
        let v: Vec<&str> = all.lines().collect();
        v[v.len().saturating_sub(lines)..].join("\n")
    }

    pub fn runs(&self) -> usize {
        self.runs
    }

    /// Adds a `=== line` to the stderr file: what the test did between runs, for the reader
    /// of a failure.
    pub fn note(&self, line: &str) {
        let mut file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.stderr_path())
            .expect("open the agent's stderr file");
        use std::io::Write;
        let _ = writeln!(file, "=== {line}");
    }

    /// Replaces `cairn.toml` with `cfg`, for the next start or a SIGHUP. `cfg.data_dir`
    /// should stay as it was.
    pub fn rewrite_config(&self, cfg: &AgentConfig) {
        let text = cfg.render(self.dir.path());
        std::fs::write(self.config_path(), text).expect("rewrite cairn.toml");
    }

    /// Replaces `cairn.toml` with raw text (e.g. a broken file).
    pub fn write_config_text(&self, text: &str) {
        std::fs::write(self.config_path(), text).expect("rewrite cairn.toml");
    }

    /// Starts `cairn run` (debug logs for the agent module: checkpoints are visible).
    pub fn start(&mut self) {
        self.start_with(&[], &[]);
    }

    /// Starts `cairn run ARGS...`, e.g. `--reset-pipeline NAME`.
    pub fn start_with_args(&mut self, args: &[&str]) {
        self.start_with(args, &[]);
    }

    /// As [`CairnProcess::start`], with extra environment (e.g. `CAIRN_FAILPOINTS`).
    pub fn start_with_env(&mut self, env: &[(&str, &str)]) {
        self.start_with(&[], env);
    }

    /// Starts `cairn run ARGS...` with the environment set by `set_env` plus `env`.
    pub fn start_with(&mut self, args: &[&str], env: &[(&str, &str)]) {
        assert!(self.child.is_none(), "the agent is already running");
        let arms = env.iter().any(|(k, _)| *k == "CAIRN_FAILPOINTS")
            || self.env.iter().any(|(k, _)| k == "CAIRN_FAILPOINTS");
        assert!(
            !arms || cfg!(feature = "failpoints"),
            "this test arms failpoints, which `cairn` has only when built with the \
             `failpoints` feature: run the tests as `.ci/test` does, `cargo test --all-features`"
        );
        self.runs += 1;
        let header = format!("=== run {} ===\n", self.runs);
        let mut file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.stderr_path())
            .expect("open the agent's stderr file");
        use std::io::Write;
        file.write_all(header.as_bytes())
            .expect("write stderr header");
        self.run_start = std::fs::metadata(self.stderr_path())
            .map(|m| m.len() as usize)
            .unwrap_or(0);
        let mut cmd = Command::new(&self.bin);
        cmd.arg("run")
            .arg("--config")
            .arg(self.config_path())
            .args(args);
        for key in &self.env_removed {
            cmd.env_remove(key);
        }
        match &self.log_filter {
            Some(filter) => cmd.env("RUST_LOG", filter),
            None => cmd.env_remove("RUST_LOG"),
        };
        let child = cmd
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(file))
            .spawn()
            .expect("spawn cairn");
        self.child = Some(child);
    }

    /// The running agent's process id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("the agent is not running").id()
    }

    /// Sends a signal (`HUP`, `TERM`, ...) to the running agent; panics if `kill` fails.
    pub fn signal(&self, sig: &str) {
        assert!(signal(self.pid(), sig), "kill -{sig} failed");
    }

    /// Waits until the current run's stderr contains `needle`; panics with the stderr if it
    /// does not within `timeout`.
    pub fn wait_for_stderr(&self, needle: &str, timeout: Duration) {
        let ok = wait_until(timeout, || self.run_stderr().contains(needle));
        assert!(
            ok,
            "no `{needle}` in the agent's stderr within {timeout:?}:\n{}",
            self.stderr()
        );
    }

    /// Waits for the agent to exit by itself; panics (after a SIGKILL) if it has not within
    /// `timeout`.
    pub fn expect_exit(&mut self, timeout: Duration) -> ExitStatus {
        match self.wait_exit(timeout) {
            Some(status) => status,
            None => {
                self.kill();
                panic!(
                    "cairn did not exit within {timeout:?}; stderr:\n{}",
                    self.stderr_tail(60)
                );
            }
        }
    }

    /// Waits until the current run logged its first MQTT connection.
    pub fn wait_connected(&mut self, timeout: Duration) {
        let ok = wait_until(timeout, || {
            if let Some(Ok(Some(status))) = self.child.as_mut().map(|c| c.try_wait()) {
                panic!(
                    "cairn exited at start ({status}); stderr:\n{}",
                    self.stderr_tail(40)
                );
            }
            self.run_stderr().contains("mqtt: connected")
        });
        assert!(
            ok,
            "cairn did not connect within {timeout:?}; stderr:\n{}",
            self.stderr_tail(40)
        );
        // "connected" is logged at CONNACK, before the SUBSCRIBE is answered: on a new
        // session, input published in between goes to no one (tests that published at once
        // lost their first events on a loaded box). Wait for the SUBACK's line, briefly: an
        // agent with no input subscription, or one that logs less, goes on after 3 s.
        wait_until(Duration::from_secs(3), || {
            self.run_stderr().contains("mqtt: subscribed to")
        });
    }

    /// Starts and waits for the connection.
    pub fn start_connected(&mut self) {
        self.start();
        self.wait_connected(Duration::from_secs(20));
    }

    /// One clean run (start, connect, SIGTERM, exit 0): the broker keeps the persistent
    /// session it subscribed, so it queues what is published while the agent is down.
    pub fn set_up_session(&mut self) {
        self.start_connected();
        let code = self.terminate().code();
        assert_eq!(code, Some(0), "first clean stop:\n{}", self.stderr_tail(30));
    }

    pub fn is_running(&mut self) -> bool {
        matches!(self.child.as_mut().map(|c| c.try_wait()), Some(Ok(None)))
    }

    /// Waits up to `timeout` for the agent to exit by itself (a refused start, a fatal
    /// error) and returns its status; `None` if it still runs (it is left running).
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let child = self.child.as_mut().expect("the agent is not running");
        let mut status = None;
        wait_until(timeout, || {
            status = child.try_wait().ok().flatten();
            status.is_some()
        });
        if status.is_some() {
            self.child = None;
        }
        status
    }

    /// SIGKILL and reap: no drain, no final checkpoint, like a crash.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERM and wait for the drained exit. Panics (after a SIGKILL) if it hangs.
    pub fn terminate(&mut self) -> ExitStatus {
        let mut child = self.child.take().expect("the agent is not running");
        signal(child.id(), "TERM");
        let deadline = Instant::now() + TERM_TIMEOUT;
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                return status;
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "cairn did not exit within {TERM_TIMEOUT:?} of SIGTERM; stderr:\n{}",
                    self.stderr_tail(40)
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Runs another `cairn` subcommand against the same config; returns (status, stdout, stderr).
    pub fn command(&self, args: &[&str]) -> (ExitStatus, String, String) {
        let out = Command::new(&self.bin)
            .arg("--config")
            .arg(self.config_path())
            .args(args)
            .env_remove("CAIRN_CONFIG")
            .env("RUST_LOG", "warn")
            .output()
            .expect("run cairn");
        (
            out.status,
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// `cairn inspect <what> --json`, one object per line. The agent must be stopped.
    pub fn inspect(&self, what: &str) -> Vec<serde_json::Value> {
        let (status, stdout, stderr) = self.command(&["inspect", what, "--json"]);
        assert!(
            status.success(),
            "cairn inspect {what} failed ({status}): {stderr}"
        );
        stdout
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| serde_json::from_str(l).expect("inspect --json prints JSON lines"))
            .collect()
    }

    /// Recovery times the agent reported, all runs ("recovery: done in N ms").
    pub fn recovery_ms(&self) -> Vec<u64> {
        self.stderr()
            .lines()
            .filter_map(|l| l.split("recovery: done in ").nth(1))
            .filter_map(|r| r.split(' ').next()?.parse().ok())
            .collect()
    }

    /// The highest `next_offset` among the current run's `checkpoint N at offset X` lines.
    pub fn checkpointed_offset(&self) -> Option<u64> {
        self.run_stderr()
            .lines()
            .filter_map(|l| l.split(" at offset ").nth(1))
            .filter_map(|rest| rest.trim().parse::<u64>().ok())
            .max()
    }
}

impl Drop for CairnProcess {
    fn drop(&mut self) {
        self.kill();
    }
}
