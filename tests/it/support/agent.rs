//! The real `cairn` binary as a child process: a config written into a temp dir, start,
//! SIGKILL, SIGTERM, and its stderr kept in a file (every run appended, each headed by a
//! `=== run N ===` line) so that a failing assertion can show what the agent said.
//!
//! Dropping a [`CairnProcess`] SIGKILLs the agent if it still runs.

use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use super::wait_until;

/// The `cairn` binary cargo built for this test (or bench) target.
pub fn cairn_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_cairn"))
}

/// How long SIGTERM may take before the test calls it a hang (drain_timeout plus margin).
const TERM_TIMEOUT: Duration = Duration::from_secs(20);

/// The parts of `cairn.toml` a test varies. Each `*_extra` string holds raw TOML lines
/// added to that table; a key given there must not also be one of the defaults below.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    pub port: u16,
    pub client_id: String,
    /// `[log]` table body; defaults are small and fast (see [`AgentConfig::new`]).
    pub log: String,
    /// `[checkpoint]` table body.
    pub checkpoint: String,
    /// `[outbox]` table body.
    pub outbox: String,
    /// Extra lines for `[mqtt]`.
    pub mqtt_extra: String,
    /// One or more complete `[[pipeline]]` tables.
    pub pipelines: String,
}

impl AgentConfig {
    pub fn new(port: u16, pipelines: &str) -> AgentConfig {
        AgentConfig {
            port,
            client_id: super::unique_id("cairn").replace('-', "_"),
            log: "segment_size = \"4MiB\"\nmax_size = \"256MiB\"\nretention = \"1h\"\n\
                  commit_interval = \"2ms\"\nmax_payload = \"64KiB\"\n"
                .into(),
            checkpoint: "interval = \"50ms\"\nmax_records = 2000\n".into(),
            outbox: "max_entries = 100000\ninflight = 100\ndrain_timeout = \"5s\"\n".into(),
            mqtt_extra: String::new(),
            pipelines: pipelines.into(),
        }
    }

    fn render(&self, data_dir: &Path) -> String {
        format!(
            "[mqtt]\nhost = \"127.0.0.1\"\nport = {}\nclient_id = \"{}\"\nkeep_alive = \"5s\"\n\
             reconnect_min = \"50ms\"\nreconnect_max = \"500ms\"\n{}\n\
             [storage]\ndata_dir = \"{}\"\ncache_size = \"8MiB\"\n\n\
             [log]\n{}\n[checkpoint]\n{}\n[outbox]\n{}\n{}\n",
            self.port,
            self.client_id,
            self.mqtt_extra,
            data_dir.display(),
            self.log,
            self.checkpoint,
            self.outbox,
            self.pipelines
        )
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
}

impl CairnProcess {
    /// Writes `<tempdir>/cairn.toml` (data under `<tempdir>/data`); does not start it.
    pub fn new(cfg: &AgentConfig) -> CairnProcess {
        let dir = tempfile::tempdir().expect("agent temp dir");
        let text = cfg.render(&dir.path().join("data"));
        std::fs::write(dir.path().join("cairn.toml"), text).expect("write cairn.toml");
        CairnProcess {
            dir,
            child: None,
            runs: 0,
            run_start: 0,
            env: Vec::new(),
        }
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
        self.dir.path().join("data")
    }

    fn stderr_path(&self) -> PathBuf {
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

    /// Replaces `cairn.toml` with `cfg` (same data directory), for the next start.
    pub fn rewrite_config(&self, cfg: &AgentConfig) {
        let text = cfg.render(&self.data_dir());
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
        let child = Command::new(cairn_bin())
            .arg("run")
            .arg("--config")
            .arg(self.config_path())
            .args(args)
            .env(
                "RUST_LOG",
                // The checkpoint lines are debug; CAIRN_TEST_LOG asks for more when debugging.
                std::env::var("CAIRN_TEST_LOG").unwrap_or("info,cairn::agent=debug".into()),
            )
            .env_remove("CAIRN_CONFIG")
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(file))
            .spawn()
            .expect("spawn cairn");
        self.child = Some(child);
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
    }

    /// Starts and waits for the connection.
    pub fn start_connected(&mut self) {
        self.start();
        self.wait_connected(Duration::from_secs(20));
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
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(child.id().to_string())
            .status();
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
        let out = Command::new(cairn_bin())
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
