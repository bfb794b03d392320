//! The shipped broker snippet, `config/mosquitto.conf` with `config/mosquitto.acl`, does what
//! it promises, on a private mosquitto that runs it with only its port and file paths
//! changed ([`SnippetBroker`]):
//!
//! - the agent, logged in as `cairn`, works; an anonymous client, and clients logged in as
//!   other users under the agent's client ID, get none of the inputs queued for it while it
//!   was stopped, and the agent gets every one of them afterwards (issue 27: anyone local
//!   could take them);
//! - a sender cannot publish a result, a reader cannot publish an input;
//! - `max_packet_size` stops an oversized input at the broker, so the agent's memory stays
//!   flat, while an input of exactly `log.max_payload` under a long topic still passes
//!   (issue 26: three 100 MB inputs took the agent's RSS from 19 to 214 MB).
//!
//! Tools: `mosquitto` and `mosquitto_passwd` (package `mosquitto`).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rumqttc::{Client, ConnectReturnCode, Connection, Event, MqttOptions, Packet, QoS};

use crate::support::agent::{AgentConfig, CairnProcess};
use crate::support::{free_port, mosquitto_bin, unique_id, wait_until};

/// Users of the password file the tests make: the agent, a sender, a reader, and a user
/// the ACL grants nothing.
pub const AGENT: (&str, &str) = ("cairn", "agent-secret");
pub const SENSOR: (&str, &str) = ("sensor", "sensor-secret");
pub const READER: (&str, &str) = ("reader", "reader-secret");
pub const MALLORY: (&str, &str) = ("mallory", "mallory-secret");

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// `text` with the line `from` replaced by `to`; panics if the snippet no longer has it, so
/// that a changed snippet fails here rather than run with settings nobody checked.
fn replace_line(text: &str, from: &str, to: &str) -> String {
    let from_line = format!("\n{from}\n");
    assert!(
        text.contains(&from_line),
        "config/mosquitto.conf has no line `{from}`; update tests/it/snippet.rs with it"
    );
    text.replace(&from_line, &format!("\n{to}\n"))
}

/// A private mosquitto running `config/mosquitto.conf` and `config/mosquitto.acl` as shipped,
/// but for its port, its password and ACL files' paths and where it keeps its own files.
/// Dropping it kills the broker.
pub struct SnippetBroker {
    dir: tempfile::TempDir,
    port: u16,
    child: Option<Child>,
}

impl SnippetBroker {
    /// The password file holds [`AGENT`], [`SENSOR`], [`READER`] and [`MALLORY`].
    pub fn start() -> SnippetBroker {
        let dir = tempfile::tempdir().expect("broker temp dir");
        let port = free_port();
        let passwd = dir.path().join("passwd");
        for (i, (user, password)) in [AGENT, SENSOR, READER, MALLORY].into_iter().enumerate() {
            let mut cmd = Command::new("mosquitto_passwd");
            cmd.arg("-b");
            if i == 0 {
                cmd.arg("-c");
            }
            let out = cmd
                .arg(&passwd)
                .arg(user)
                .arg(password)
                .output()
                .expect("run mosquitto_passwd (apt-get install mosquitto)");
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let acl = dir.path().join("cairn.acl");
        std::fs::copy(repo().join("config/mosquitto.acl"), &acl).expect("copy the ACL");
        let conf = SnippetBroker::config_text(dir.path(), port);
        std::fs::write(dir.path().join("mosquitto.conf"), conf).expect("write mosquitto.conf");
        let mut broker = SnippetBroker {
            dir,
            port,
            child: None,
        };
        broker.spawn();
        broker
    }

    /// The snippet with only the port and file paths changed, plus where this broker keeps
    /// its persistence and log (the snippet leaves those to the main file).
    pub fn config_text(dir: &Path, port: u16) -> String {
        let snippet = std::fs::read_to_string(repo().join("config/mosquitto.conf")).unwrap();
        let mut conf = replace_line(
            &snippet,
            "listener 1883 127.0.0.1",
            &format!("listener {port} 127.0.0.1"),
        );
        conf = replace_line(
            &conf,
            "password_file /etc/mosquitto/passwd",
            &format!("password_file {}", dir.join("passwd").display()),
        );
        conf = replace_line(
            &conf,
            "acl_file /etc/mosquitto/cairn.acl",
            &format!("acl_file {}", dir.join("cairn.acl").display()),
        );
        conf.push_str(&format!(
            "persistence_location {}/\nlog_dest file {}\nlog_type all\n",
            dir.display(),
            dir.join("mosquitto.log").display()
        ));
        if std::fs::metadata("/proc/self")
            .is_ok_and(|m| std::os::unix::fs::MetadataExt::uid(&m) == 0)
        {
            // Otherwise mosquitto drops to user `mosquitto`, which cannot read our temp dir.
            conf.push_str("user root\n");
        }
        conf
    }

    fn spawn(&mut self) {
        let child = Command::new(mosquitto_bin())
            .arg("-c")
            .arg(self.dir.path().join("mosquitto.conf"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn mosquitto");
        self.child = Some(child);
        let port = self.port;
        let up = wait_until(Duration::from_secs(10), || {
            if let Some(Ok(Some(status))) = self.child.as_mut().map(|c| c.try_wait()) {
                panic!(
                    "mosquitto refused the snippet ({status}); log:\n{}",
                    self.log()
                );
            }
            std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
        });
        assert!(
            up,
            "mosquitto did not listen on {port}; log:\n{}",
            self.log()
        );
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("mosquitto.log")).unwrap_or_default()
    }
}

impl Drop for SnippetBroker {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A test client: `user` logs in (`None`: anonymous), with a persistent session unless
/// `clean`.
fn client(
    port: u16,
    id: &str,
    user: Option<(&str, &str)>,
    clean: bool,
    max_packet: usize,
) -> (Client, Connection) {
    let mut opts = MqttOptions::new(id, "127.0.0.1", port);
    opts.set_keep_alive(Duration::from_secs(5))
        .set_clean_session(clean)
        .set_max_packet_size(max_packet, max_packet);
    if let Some((u, p)) = user {
        opts.set_credentials(u, p);
    }
    Client::new(opts, 16)
}

/// What a client saw while its connection was driven for a while.
#[derive(Debug, Default)]
struct Seen {
    connack: Option<ConnectReturnCode>,
    publishes: Vec<(String, Vec<u8>)>,
    pubacks: usize,
    /// The first connection error (the broker refused or closed the connection).
    error: Option<String>,
}

/// Drive `conn` for `how_long`, or until the connection fails.
fn drive(conn: &mut Connection, how_long: Duration) -> Seen {
    let mut seen = Seen::default();
    let until = Instant::now() + how_long;
    while Instant::now() < until {
        match conn.recv_timeout(Duration::from_millis(50)) {
            Ok(Ok(Event::Incoming(Packet::ConnAck(c)))) => seen.connack = Some(c.code),
            Ok(Ok(Event::Incoming(Packet::Publish(p)))) => {
                seen.publishes.push((p.topic.clone(), p.payload.to_vec()))
            }
            Ok(Ok(Event::Incoming(Packet::PubAck(_)))) => seen.pubacks += 1,
            Ok(Ok(_)) => {}
            Ok(Err(e)) => {
                seen.error = Some(e.to_string());
                break;
            }
            Err(_) => {}
        }
    }
    seen
}

/// Publish QoS 1 messages as `user` and wait for every PUBACK (the broker acknowledges a
/// publish the ACL denies as well: MQTT 3.1.1 has no way to refuse one).
fn publish_as(port: u16, user: (&str, &str), messages: &[(&str, &[u8])]) {
    let (c, mut conn) = client(port, &unique_id("snippet-pub"), Some(user), true, 1 << 20);
    for (topic, payload) in messages {
        c.publish(*topic, QoS::AtLeastOnce, false, payload.to_vec())
            .unwrap();
    }
    let mut acked = 0;
    let until = Instant::now() + Duration::from_secs(10);
    while acked < messages.len() && Instant::now() < until {
        let seen = drive(&mut conn, Duration::from_millis(200));
        assert!(
            seen.error.is_none(),
            "{} lost its connection: {seen:?}",
            user.0
        );
        acked += seen.pubacks;
    }
    assert_eq!(acked, messages.len(), "PUBACKs for {}", user.0);
    let _ = c.disconnect();
    let _ = drive(&mut conn, Duration::from_millis(100));
}

/// The agent on `port`, logged in as [`AGENT`] with its password in a 0600 file, one
/// pipeline reading `payments/#` and writing `balances/{key}`, `/metrics` on `mport`, and
/// `log.max_payload = max_payload`.
fn agent(port: u16, mport: u16, max_payload: &str) -> CairnProcess {
    let pipeline = "[[pipeline]]\nname = \"balances\"\ntopics = [\"payments/#\"]\nformat = \"delimited\"\n\
                    separator = \"/\"\nevent_id = \"0\"\nkey = \"1\"\nvalue = \"2\"\naggregate = \"sum\"\n\
                    output_topic = \"balances/{key}\"\n";
    let mut cfg = AgentConfig::new(port, pipeline);
    cfg.client_id = "cairn-edge-1".into();
    cfg.extra = format!("[metrics]\nlisten = \"127.0.0.1:{mport}\"\n");
    assert!(cfg.log.contains("max_payload = \"64KiB\""), "{}", cfg.log);
    cfg.log = cfg.log.replace(
        "max_payload = \"64KiB\"",
        &format!("max_payload = \"{max_payload}\""),
    );
    let agent = CairnProcess::new(&cfg);
    let pw: PathBuf = agent.dir().join("mqtt.password");
    std::fs::write(&pw, format!("{}\n", AGENT.1)).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&pw, std::fs::Permissions::from_mode(0o600)).unwrap();
    cfg.mqtt_extra = format!(
        "username = \"{}\"\npassword_file = \"{}\"\n",
        AGENT.0,
        pw.display()
    );
    agent.rewrite_config(&cfg);
    agent
}

/// One sample of the agent's `/metrics` (0 if absent or not answering).
fn metric(mport: u16, series: &str) -> f64 {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", mport)) else {
        return 0.0;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    let _ = s.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n");
    let mut text = String::new();
    let _ = s.read_to_string(&mut text);
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0.0)
}

const APPLIED: &str = "cairn_applied_total{pipeline=\"balances\"}";

/// Issue 27, "the anonymous session thief": with the agent stopped, clients connecting under
/// its client ID, anonymously or as other users, took the inputs queued for it. With the
/// shipped snippet they get none, the agent gets all of them, and nobody but the agent can
/// publish a result or read an input.
#[test]
fn with_the_shipped_snippet_only_the_agent_gets_its_queued_inputs_and_only_it_publishes_results() {
    let broker = SnippetBroker::start();
    let port = broker.port();
    let mport = free_port();
    let mut agent = agent(port, mport, "64KiB");
    // Its persistent session: subscribed, then stopped.
    agent.set_up_session();
    let inputs: Vec<String> = (1..=5).map(|i| format!("E{i}/A/10")).collect();
    let queued: Vec<(&str, &[u8])> = inputs
        .iter()
        .map(|p| ("payments/in", p.as_bytes()))
        .collect();
    publish_as(port, SENSOR, &queued);
    // A reader may not publish inputs. (Before the reader of results below connects: two
    // clients of one user are one client to the snippet's broker, and disconnect each other.)
    publish_as(port, READER, &[("payments/in", b"E9/Z/1000")]);

    // Anonymous: refused at the door.
    let (_c, mut conn) = client(port, "cairn-edge-1", None, false, 1 << 20);
    let anonymous = drive(&mut conn, Duration::from_secs(2));
    assert!(
        anonymous.publishes.is_empty() && anonymous.error.is_some(),
        "an anonymous client under the agent's ID: {anonymous:?}"
    );
    // Other users under the agent's configured ID and under its user name (the ID the broker
    // keeps its session under): subscribed to the inputs, they get nothing.
    for (user, id) in [
        (SENSOR, "cairn-edge-1"),
        (MALLORY, "cairn-edge-1"),
        (SENSOR, "cairn"),
        (READER, "cairn"),
    ] {
        let (c, mut conn) = client(port, id, Some(user), false, 1 << 20);
        c.subscribe("payments/#", QoS::AtLeastOnce).unwrap();
        let thief = drive(&mut conn, Duration::from_secs(2));
        assert_eq!(
            thief.connack,
            Some(ConnectReturnCode::Success),
            "{} as {id}: {thief:?}\n{}",
            user.0,
            broker.log()
        );
        assert!(
            thief.publishes.is_empty(),
            "{} under the client ID {id} got the agent's inputs: {:?}",
            user.0,
            thief.publishes
        );
        let _ = c.disconnect();
        let _ = drive(&mut conn, Duration::from_millis(100));
    }

    // A reader of results, then the agent again: every queued input arrives.
    let (reader, mut reader_conn) = client(port, "results-reader", Some(READER), true, 1 << 20);
    reader.subscribe("balances/#", QoS::AtLeastOnce).unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reading = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut all = Seen::default();
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let seen = drive(&mut reader_conn, Duration::from_millis(100));
                all.publishes.extend(seen.publishes);
                if seen.error.is_some() {
                    all.error = seen.error;
                    break;
                }
            }
            all
        })
    };
    agent.start_connected();
    assert!(
        wait_until(Duration::from_secs(20), || metric(mport, APPLIED) == 5.0),
        "the agent did not get its 5 queued inputs (applied {}):\n{}\n{}",
        metric(mport, APPLIED),
        agent.stderr_tail(30),
        broker.log()
    );

    // A sender publishes a fake result; a real input follows.
    publish_as(port, SENSOR, &[("balances/A", b"fake result")]);
    publish_as(port, SENSOR, &[("payments/in", b"E6/A/10")]);
    assert!(
        wait_until(Duration::from_secs(20), || metric(mport, APPLIED) == 6.0),
        "applied {}",
        metric(mport, APPLIED)
    );
    std::thread::sleep(Duration::from_millis(500)); // the last result reaches the reader
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let seen = reading.join().unwrap();
    assert!(
        seen.error.is_none(),
        "the reader lost its connection: {seen:?}"
    );
    assert!(agent.terminate().success(), "{}", agent.stderr_tail(30));
    let topics: Vec<&str> = seen.publishes.iter().map(|(t, _)| t.as_str()).collect();
    assert!(
        !seen.publishes.is_empty() && topics.iter().all(|t| *t == "balances/A"),
        "the reader saw {topics:?}"
    );
    assert!(
        seen.publishes.iter().all(|(_, p)| p != b"fake result"),
        "a sender's fake result reached the reader"
    );
    let last = String::from_utf8_lossy(&seen.publishes.last().unwrap().1).into_owned();
    assert!(last.contains("\"value\":60"), "{last}");
    let state = agent.inspect("state");
    assert!(
        state.iter().all(|s| s["key"] != "Z"),
        "a reader's fake input was processed: {state:?}"
    );
    let log = broker.log();
    assert!(log.contains("Denied PUBLISH"), "{log}");
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .expect("VmRSS in /proc/PID/status")
}

/// Issue 26: inputs up to 256 MiB were read whole before `log.max_payload` applied (three
/// 100 MB inputs took the agent's RSS from 19 to 214 MB). With the snippet's
/// `max_packet_size`, the broker refuses them (it drops the sender) and the agent never sees
/// them; an input of exactly `log.max_payload` under a long topic still passes.
#[test]
fn the_snippets_max_packet_size_stops_oversized_inputs_at_the_broker_and_lets_max_payload_pass() {
    let broker = SnippetBroker::start();
    let port = broker.port();
    let mport = free_port();
    // The snippet's figure is worked out for the default log.max_payload.
    let mut agent = agent(port, mport, "256KiB");
    agent.start_connected();
    std::thread::sleep(Duration::from_millis(300)); // the SUBACK follows the CONNACK
    publish_as(port, SENSOR, &[("payments/in", b"E1/A/1")]);
    assert!(
        wait_until(Duration::from_secs(20), || metric(mport, APPLIED) == 1.0),
        "{}",
        agent.stderr_tail(20)
    );
    let before = rss_kib(agent.pid());

    let big = vec![b'x'; 40 << 20];
    for i in 0..3 {
        let (c, mut conn) = client(port, &format!("big-{i}"), Some(SENSOR), true, 64 << 20);
        c.publish("payments/in", QoS::AtLeastOnce, false, big.clone())
            .unwrap();
        let seen = drive(&mut conn, Duration::from_secs(10));
        assert_eq!(seen.pubacks, 0, "the broker took a 40 MiB input: {seen:?}");
        assert!(
            seen.error.is_some(),
            "the broker kept the sender of 40 MiB: {seen:?}"
        );
    }
    // Exactly log.max_payload, under a 1,000-byte topic: it passes the broker.
    let topic = format!("payments/{}", "t".repeat(991));
    let mut at_bound = b"E2/B/5/".to_vec();
    at_bound.resize(256 * 1024, b'p');
    publish_as(port, SENSOR, &[(topic.as_str(), &at_bound)]);
    publish_as(port, SENSOR, &[("payments/in", b"E3/A/1")]);
    assert!(
        wait_until(Duration::from_secs(20), || metric(
            mport,
            "cairn_received_total"
        ) == 3.0
            && metric(mport, APPLIED) >= 2.0),
        "received {}, applied {}:\n{}",
        metric(mport, "cairn_received_total"),
        metric(mport, APPLIED),
        agent.stderr_tail(20)
    );
    assert_eq!(metric(mport, "cairn_oversize_refused_total"), 0.0);
    let after = rss_kib(agent.pid());
    println!("agent RSS {before} KiB before three 40 MiB inputs, {after} KiB after");
    assert!(
        after < before + 16 * 1024,
        "the agent's RSS grew from {before} to {after} KiB"
    );
    assert!(agent.terminate().success());
}
