//! The agent under test, run by the tests' wrapper (`support::agent::CairnProcess`) with the
//! bench's config ([`Config`]): the binary cargo built for this bench, or `CAIRN_COMPARE_BIN`
//! (another build, e.g. an older commit's, for a before/after under the same load).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::config::Config;
use crate::measure::System;
use crate::procs::Stats;
use crate::stream::{SEED, event, payload};
use crate::support::agent::{AgentConfig, CairnProcess};
use crate::support::{free_port, wait_until};

/// The binary the bench runs (printed at its start).
pub(crate) fn cairn_bin() -> PathBuf {
    std::env::var_os("CAIRN_COMPARE_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(crate::support::agent::cairn_bin)
}

/// One agent: its process wrapper, the config written before each start, and its
/// `/metrics` port.
pub(crate) struct Cairn {
    agent: CairnProcess,
    config: Config,
    metrics_port: u16,
    /// The running process's id, for [`Stats`]; `None` once killed or stopped.
    pid: Option<u32>,
    /// Its MQTT session, ended when this is dropped (see [`forget_session`]).
    client_id: String,
    broker_port: u16,
}

impl Cairn {
    /// A stopped agent on the broker at `broker_port` with the bench's config
    /// ([`Config::new`]): a `sum` pipeline emitting `emit`, checkpoints every 50 ms or
    /// `max_records`.
    pub(crate) fn new(broker_port: u16, emit: &str, max_records: u64) -> Cairn {
        Cairn::with(broker_port, |base, dir, metrics_port| {
            Config::new(base, dir, emit, max_records, metrics_port)
        })
    }

    /// A stopped agent at the shipped settings ([`Config::shipped`]): the bench sets only
    /// `client_id`, `data_dir`, the broker's port, the metrics listener and the pipeline.
    pub(crate) fn shipped(broker_port: u16, emit: &str) -> Cairn {
        Cairn::with(broker_port, |base, dir, metrics_port| {
            Config::shipped(base, dir, emit, metrics_port)
        })
    }

    fn with(broker_port: u16, config: impl FnOnce(&AgentConfig, &Path, u16) -> Config) -> Cairn {
        let base = AgentConfig::new(broker_port, "");
        let mut agent = CairnProcess::new(&base);
        agent.set_bin(&cairn_bin());
        // Info only (the shipped level): the tests' checkpoint lines at debug would cost
        // throughput.
        agent.set_log_filter(Some("info"));
        agent.remove_env("NOTIFY_SOCKET");
        let metrics_port = free_port();
        let config = config(&base, agent.dir(), metrics_port);
        Cairn {
            agent,
            config,
            metrics_port,
            pid: None,
            client_id: base.client_id.clone(),
            broker_port,
        }
    }

    /// The config; what is set here applies from the next start.
    pub(crate) fn config(&mut self) -> &mut Config {
        &mut self.config
    }

    pub(crate) fn stderr(&self) -> String {
        self.agent.stderr()
    }

    /// Start `cairn run` and wait until it is connected; panics with its stderr if it is not
    /// within 20 s.
    pub(crate) fn start_connected(&mut self) {
        self.start(None);
        assert!(
            self.wait_connected(Duration::from_secs(20)),
            "cairn did not connect: {}",
            self.agent.stderr_tail(40)
        );
    }

    /// Start `cairn run`; with `notify`, as systemd would (`NOTIFY_SOCKET`).
    pub(crate) fn start(&mut self, notify: Option<&Path>) {
        self.agent.write_config_text(&self.config.text());
        match notify {
            Some(sock) => {
                let sock = sock.to_str().expect("a UTF-8 socket path");
                self.agent.start_with_env(&[("NOTIFY_SOCKET", sock)]);
            }
            None => self.agent.start(),
        }
        self.pid = Some(self.agent.pid());
    }

    /// Wait until the current run logged its MQTT connection, then a moment for SUBSCRIBE.
    pub(crate) fn wait_connected(&mut self, timeout: Duration) -> bool {
        let agent = &self.agent;
        let ok = wait_until(timeout, || agent.run_stderr().contains("mqtt: connected"));
        std::thread::sleep(Duration::from_millis(300));
        ok
    }

    /// SIGKILL: no drain, no final checkpoint.
    pub(crate) fn kill(&mut self) {
        self.agent.kill();
        self.pid = None;
    }

    /// SIGTERM and the drained exit.
    pub(crate) fn terminate(&mut self) {
        if self.agent.is_running() {
            self.agent.terminate();
        }
        self.pid = None;
    }

    /// One gauge from `/metrics` (summed over its labels).
    pub(crate) fn metric(&self, name: &str) -> Option<f64> {
        let mut s = TcpStream::connect(("127.0.0.1", self.metrics_port)).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
        s.write_all(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
            .ok()?;
        let mut body = String::new();
        s.read_to_string(&mut body).ok()?;
        body.lines()
            .filter(|l| l.starts_with(name))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .reduce(|a, b| a + b)
    }

    pub(crate) fn data_dir(&self) -> PathBuf {
        self.agent.data_dir()
    }

    /// Append `n` records of the stream to the stopped agent's log, as ingest would have.
    pub(crate) fn prefill_log(&self, tag: &str, n: u64, keys: u64) {
        use cairn::log::{Log, LogOptions};
        let opts = LogOptions {
            dir: self.data_dir().join("log"),
            segment_size: 64 << 20,
            max_size: 4 << 30,
            max_payload: 64 << 10,
        };
        let (mut log, _) = Log::open(opts, cairn::fsio::real()).expect("open the agent's log");
        let now = cairn::agent::wall_ms();
        for i in 0..n {
            let (key, value) = event(SEED, i, keys);
            log.append(
                now,
                &format!("cairn/in/k{key:06}"),
                payload(tag, i, key, value).as_bytes(),
                1,
                false,
            )
            .expect("append");
            if i % 10_000 == 9_999 {
                log.commit().expect("commit");
            }
        }
        log.commit().expect("commit");
    }

    /// `recovery: done in N ms` of the last run that logged it.
    pub(crate) fn recovery_ms(&self) -> Option<u64> {
        self.agent.recovery_ms().last().copied()
    }
}

impl System for Cairn {
    fn name(&self) -> &'static str {
        "cairn"
    }
    fn prefix(&self) -> &'static str {
        "cairn"
    }
    fn stats(&self) -> Option<Stats> {
        self.pid.map(|pid| Stats { pid })
    }
}

impl Drop for Cairn {
    fn drop(&mut self) {
        self.kill();
        forget_session(&self.client_id, self.broker_port);
    }
}

/// End `client_id`'s session at the broker on `port`: connect with a clean session and
/// leave. Each agent the bench starts has a client ID of its own and a persistent session
/// (the shipped `clean_session = false`); left behind, that session stays subscribed and
/// the broker queues every later input for it. Before this, by the steady part of the
/// targets the compare's broker held the queues of three departed agents (524 MB resident
/// after 1M of the 10M inputs) and the steady run's p99 grew from 73 ms to over a second
/// while the agent kept up.
fn forget_session(client_id: &str, port: u16) {
    use rumqttc::{Client, Event, MqttOptions, Outgoing, Packet};
    let mut o = MqttOptions::new(client_id, "127.0.0.1", port);
    o.set_clean_session(true)
        .set_keep_alive(Duration::from_secs(5));
    let (client, mut conn) = Client::new(o, 10);
    let until = std::time::Instant::now() + Duration::from_secs(5);
    while std::time::Instant::now() < until {
        match conn.recv_timeout(Duration::from_millis(200)) {
            Ok(Ok(Event::Incoming(Packet::ConnAck(_)))) => {
                let _ = client.disconnect();
            }
            Ok(Ok(Event::Outgoing(Outgoing::Disconnect))) | Ok(Err(_)) => return,
            _ => {}
        }
    }
    println!(
        "  (could not end the session of {client_id} within 5 s: the broker may keep queuing for it)"
    );
}
