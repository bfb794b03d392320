//! `/metrics` and `cairn status` (issue 6) against the real binary and a private broker:
//! after a known stream (with a duplicate and a bad payload) the figures are exact, online
//! through the agent's endpoint and offline from the data directory after SIGTERM.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use crate::support::agent::{AgentConfig, CairnProcess};
use crate::support::{Broker, Collector, free_port, publish_all, unique_id, wait_until};

fn get_metrics(port: u16) -> Option<String> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    s.write_all(format!("GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n").as_bytes())
        .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    Some(out)
}

/// The value of one sample line, e.g. `cairn_applied_total{pipeline="balances"}`.
fn value(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

fn cairn(config: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cairn"))
        .arg("--config")
        .arg(config)
        .args(args)
        .output()
        .unwrap()
}

fn status_json(config: &Path, args: &[&str]) -> serde_json::Value {
    let out = cairn(config, &[&["status", "--json"], args].concat());
    assert_eq!(
        out.status.code(),
        Some(0),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The agent with the `balances` pipeline, checkpoints every 20 ms, and `extra` tables
/// (`[metrics]`, `[dead_letters]`); the config's `[logging]` decides the log level.
fn status_agent(port: u16, id: &str, extra: &str) -> CairnProcess {
    let pipeline = "[[pipeline]]\nname = \"balances\"\ntopics = [\"payments/#\"]\nformat = \"delimited\"\n\
                    separator = \"/\"\nevent_id = \"0\"\nkey = \"1\"\nvalue = \"2\"\naggregate = \"sum\"\n\
                    output_topic = \"balances/{key}\"\n";
    let mut cfg = AgentConfig::new(port, pipeline);
    cfg.client_id = unique_id(id);
    cfg.mqtt = String::new();
    cfg.storage = "cache_size = \"1MiB\"\n".into();
    cfg.log = String::new();
    cfg.checkpoint = "interval = \"20ms\"\n".into();
    cfg.outbox = String::new();
    cfg.extra = extra.to_string();
    let mut agent = CairnProcess::new(&cfg);
    agent.set_log_filter(None);
    agent
}

#[test]
fn metrics_and_status_report_a_known_stream_online_and_offline() {
    let broker = Broker::start();
    let mport = free_port();
    let mut agent = status_agent(
        broker.port(),
        "status",
        &format!("[metrics]\nlisten = \"127.0.0.1:{mport}\"\n"),
    );
    agent.start();
    let config = agent.config_path();
    let log = || agent.stderr();
    assert!(
        wait_until(Duration::from_secs(20), || get_metrics(mport)
            .is_some_and(|m| m.contains("\ncairn_mqtt_connected 1\n"))),
        "no metrics from the agent; log:\n{}",
        log()
    );
    std::thread::sleep(Duration::from_millis(300)); // the SUBACK follows the CONNACK
    let stream = ["E1/A/100", "E2/B/50", "E1/A/100", "garbage", "E3/A/5"];
    let msgs: Vec<_> = stream
        .iter()
        .map(|p| ("payments/in".to_string(), p.as_bytes().to_vec(), false))
        .collect();
    publish_all(broker.port(), &msgs);

    let p = "{pipeline=\"balances\"}";
    let mut text = String::new();
    let settled = wait_until(Duration::from_secs(15), || {
        text = get_metrics(mport).unwrap_or_default();
        value(&text, "cairn_checkpoint_next_offset") == Some(5.0)
            && value(&text, "cairn_received_total") == Some(5.0)
            && value(&text, &format!("cairn_applied_total{p}")) == Some(3.0)
            && value(&text, "cairn_outbox_entries") == Some(0.0)
            && value(&text, &format!("cairn_outputs_total{p}"))
                == value(&text, "cairn_pubacked_total")
    });
    assert!(settled, "metrics did not settle:\n{text}\nlog:\n{}", log());
    assert!(text.starts_with("HTTP/1.1 200 OK"), "{text}");
    assert!(text.contains("Content-Type: text/plain; version=0.0.4"));
    for (series, want) in [
        (format!("cairn_applied_total{p}"), 3.0),
        (format!("cairn_duplicates_total{p}"), 1.0),
        (format!("cairn_dead_letters_total{p}"), 1.0),
        (format!("cairn_state_keys{p}"), 2.0),
        // E1, E2, E3 and the bad input's ID: a redelivered bad input is not refused twice.
        (format!("cairn_dedup_entries{p}"), 4.0),
        ("cairn_received_total".into(), 5.0),
        ("cairn_acked_total".into(), 5.0),
        ("cairn_log_next_offset".into(), 5.0),
        ("cairn_log_first_offset".into(), 0.0),
        ("cairn_records_unchecked".into(), 0.0),
        ("cairn_source_replayable".into(), 1.0),
        ("cairn_backpressure".into(), 0.0),
        ("cairn_checkpoint_failures_total".into(), 0.0),
    ] {
        assert_eq!(value(&text, &series), Some(want), "{series} in\n{text}");
    }
    assert!(value(&text, "cairn_checkpoints_total").unwrap() >= 1.0);
    assert!(value(&text, "cairn_checkpoint_duration_seconds_count").unwrap() >= 1.0);
    assert!(value(&text, "cairn_log_commit_duration_seconds_count").unwrap() >= 1.0);
    // The loop's turns are timed: it turned at least once for each of the inputs above.
    assert!(value(&text, "cairn_loop_turn_duration_seconds_count").unwrap() >= 5.0);
    assert!(value(&text, "cairn_loop_turn_duration_seconds_sum").unwrap() > 0.0);
    assert!(value(&text, "cairn_store_size_bytes").unwrap() > 0.0);
    assert!(value(&text, "cairn_pubacked_total").unwrap() >= 2.0);
    assert!(text.contains("# TYPE cairn_applied_total counter"));
    assert!(text.contains("# TYPE cairn_outbox_entries gauge"));
    let mut s = TcpStream::connect(("127.0.0.1", mport)).unwrap();
    s.write_all(b"GET /nope HTTP/1.1\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    assert!(out.starts_with("HTTP/1.1 404"), "{out}");

    let online = status_json(&config, &[]);
    assert_eq!(online["source"], "agent");
    assert_eq!(online["checkpoint"]["next_offset"], 5);
    assert_eq!(online["pipelines"][0]["name"], "balances");
    assert_eq!(online["pipelines"][0]["applied"], 3);
    assert_eq!(online["pipelines"][0]["duplicates"], 1);
    assert_eq!(online["dead_letters"], 1);
    assert_eq!(online["outbox_entries"], 0);
    let locked = status_json(&config, &["--offline"]);
    assert_eq!(locked["source"], "data_dir");
    assert_eq!(locked["agent_running"], true);
    assert_eq!(locked["log"]["next_offset"], 5);

    agent.signal("TERM");
    let code = agent.expect_exit(Duration::from_secs(20));
    assert_eq!(code.code(), Some(0), "log:\n{}", agent.stderr());

    let offline = status_json(&config, &[]);
    assert_eq!(offline["source"], "data_dir", "{offline}");
    assert_eq!(offline["agent_running"], false);
    assert_eq!(offline["checkpoint"]["next_offset"], 5);
    assert_eq!(offline["checkpoint"]["keys"], 2);
    assert_eq!(offline["log"]["first_offset"], 0);
    assert_eq!(offline["log"]["next_offset"], 5);
    assert_eq!(offline["pipelines"][0]["applied"], 3);
    assert_eq!(offline["pipelines"][0]["duplicates"], 1);
    assert_eq!(offline["pipelines"][0]["dead_letters"], 1);
    assert_eq!(offline["dead_letters"], 1);
    assert_eq!(offline["outbox_entries"], 0);
    assert!(offline["savepoint"].is_null());
    let human = cairn(&config, &["status"]);
    assert_eq!(human.status.code(), Some(0));
    let human = String::from_utf8_lossy(&human.stdout);
    assert!(human.contains("agent       not running"), "{human}");
    assert!(
        human.contains("applied 3, duplicates 1, dead letters 1"),
        "{human}"
    );
}

/// Issue 10: the dead-letter tree is bounded, and what the bound dropped is counted in
/// `/metrics` and in `cairn status`, online and offline.
#[test]
fn dead_letters_over_max_entries_are_dropped_and_counted_online_and_offline() {
    let broker = Broker::start();
    let mport = free_port();
    let mut agent = status_agent(
        broker.port(),
        "status-dead",
        &format!("[metrics]\nlisten = \"127.0.0.1:{mport}\"\n[dead_letters]\nmax_entries = 2\n"),
    );
    agent.start();
    let config = agent.config_path();
    let log = || agent.stderr();
    assert!(
        wait_until(Duration::from_secs(20), || get_metrics(mport)
            .is_some_and(|m| m.contains("\ncairn_mqtt_connected 1\n"))),
        "no metrics from the agent; log:\n{}",
        log()
    );
    std::thread::sleep(Duration::from_millis(300));
    let msgs: Vec<_> = (0..5)
        .map(|i| {
            (
                "payments/in".to_string(),
                format!("bad{i}").into_bytes(),
                false,
            )
        })
        .collect();
    publish_all(broker.port(), &msgs);
    let mut text = String::new();
    let settled = wait_until(Duration::from_secs(15), || {
        text = get_metrics(mport).unwrap_or_default();
        value(&text, "cairn_checkpoint_next_offset") == Some(5.0)
            && value(&text, "cairn_dead_letters_pruned_total{cause=\"count\"}") == Some(3.0)
    });
    assert!(settled, "metrics did not settle:\n{text}\nlog:\n{}", log());
    assert_eq!(value(&text, "cairn_dead_letters_stored"), Some(2.0));
    assert_eq!(
        value(&text, "cairn_dead_letters_pruned_total{cause=\"age\"}"),
        Some(0.0)
    );
    assert_eq!(
        value(&text, "cairn_dead_letters_total{pipeline=\"balances\"}"),
        Some(5.0),
        "every refusal is still counted"
    );
    let online = status_json(&config, &[]);
    assert_eq!(online["dead_letters_stored"], 2, "{online}");
    assert_eq!(online["dead_letters_pruned"]["count"], 3, "{online}");
    assert_eq!(online["dead_letters_pruned"]["age"], 0, "{online}");

    agent.signal("TERM");
    let code = agent.expect_exit(Duration::from_secs(20));
    assert_eq!(code.code(), Some(0), "log:\n{}", agent.stderr());
    let offline = status_json(&config, &[]);
    assert_eq!(offline["source"], "data_dir", "{offline}");
    assert_eq!(offline["dead_letters"], 2, "{offline}");
    assert_eq!(offline["dead_letters_stored"], 2, "{offline}");
    assert_eq!(offline["dead_letters_pruned"]["count"], 3, "{offline}");
    let human = cairn(&config, &["status"]);
    let human = String::from_utf8_lossy(&human.stdout);
    assert!(
        human.contains("dead store  2 kept; pruned 0 by age, 3 by count"),
        "{human}"
    );
    let listed = cairn(&config, &["inspect", "dead-letters", "--json"]);
    let offsets: Vec<u64> = String::from_utf8_lossy(&listed.stdout)
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["offset"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert_eq!(offsets, vec![3, 4], "the newest are kept");
}

/// Issue 27: any local user could stop the agent from starting by holding the metrics port
/// first (the bind error was fatal). Now the agent starts and processes, says so in the
/// journal, and serves `/metrics` once the port is free.
#[test]
fn an_agent_whose_metrics_port_is_held_starts_processes_and_serves_once_the_port_is_free() {
    let broker = Broker::start();
    let holder = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mport = holder.local_addr().unwrap().port();
    let mut agent = status_agent(
        broker.port(),
        "status-held",
        &format!("[metrics]\nlisten = \"127.0.0.1:{mport}\"\n"),
    );
    let results = Collector::start(broker.port(), "balances/#");
    agent.start();
    agent.wait_connected(Duration::from_secs(20));
    agent.wait_for_stderr(
        &format!("metrics: cannot listen on 127.0.0.1:{mport}"),
        Duration::from_secs(5),
    );
    std::thread::sleep(Duration::from_millis(300)); // the SUBACK follows the CONNACK
    let msgs: Vec<_> = ["E1/A/100", "E2/B/50"]
        .iter()
        .map(|p| ("payments/in".to_string(), p.as_bytes().to_vec(), false))
        .collect();
    publish_all(broker.port(), &msgs);
    assert!(
        results.wait_for_count(2, Duration::from_secs(15)),
        "no results while the port was held: {:?}\n{}",
        results.messages(),
        agent.stderr()
    );

    drop(holder);
    let mut text = String::new();
    let served = wait_until(Duration::from_secs(20), || {
        text = get_metrics(mport).unwrap_or_default();
        value(&text, "cairn_metrics_listener_up") == Some(1.0)
    });
    assert!(
        served,
        "not served once the port was free:\n{text}\n{}",
        agent.stderr()
    );
    assert!(
        value(&text, "cairn_metrics_bind_failures_total").unwrap() >= 1.0,
        "{text}"
    );
    assert_eq!(
        value(&text, "cairn_applied_total{pipeline=\"balances\"}"),
        Some(2.0),
        "{text}"
    );
    let online = status_json(&agent.config_path(), &[]);
    assert_eq!(online["source"], "agent", "{online}");
    assert_eq!(online["metrics_listener"]["up"], 1, "{online}");
    agent.wait_for_stderr("metrics: serving http://", Duration::from_secs(5));
    assert!(agent.terminate().success(), "{}", agent.stderr());
}

/// Issue 27: 8 idle local connections got most scrapes refused, and the listener answered
/// any `Host` (a web page could read the figures by DNS rebinding). Now scrapes are answered
/// beside three dozen idle connections, and a request naming another host is refused.
#[test]
fn scrapes_are_answered_beside_idle_connections_and_other_hosts_are_refused() {
    let broker = Broker::start();
    let mport = free_port();
    let mut agent = status_agent(
        broker.port(),
        "status-idle",
        &format!("[metrics]\nlisten = \"127.0.0.1:{mport}\"\n"),
    );
    agent.start();
    assert!(
        wait_until(Duration::from_secs(20), || get_metrics(mport)
            .is_some_and(|m| m.starts_with("HTTP/1.1 200"))),
        "no metrics from the agent; log:\n{}",
        agent.stderr()
    );
    let mut s = TcpStream::connect(("127.0.0.1", mport)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(
        format!("GET /status.json HTTP/1.1\r\nHost: rebound.example:{mport}\r\n\r\n").as_bytes(),
    )
    .unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    assert!(
        !out.starts_with("HTTP/1.1 200"),
        "answered another host: {out}"
    );
    assert!(!out.contains("cairn_"), "{out}");
    let idle: Vec<TcpStream> = (0..36)
        .map(|_| TcpStream::connect(("127.0.0.1", mport)).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    for i in 0..10 {
        let text = get_metrics(mport).unwrap_or_default();
        assert!(
            text.starts_with("HTTP/1.1 200 OK"),
            "scrape {i} beside idle connections: {text:?}"
        );
    }
    let online = status_json(&agent.config_path(), &[]);
    assert_eq!(online["source"], "agent", "{online}");
    drop(idle);

    assert!(agent.terminate().success(), "{}", agent.stderr());
}

/// Issue 27: `cairn status` printed what the metrics endpoint returned as it was, so whatever
/// answers there (the agent's pipeline names, or another process on the port) could send a
/// terminal escape sequence. Text and JSON output now carry them escaped.
#[test]
fn status_escapes_terminal_control_codes_from_the_metrics_endpoint() {
    let fake = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = fake.local_addr().unwrap().port();
    let hostile = "evil\u{1b}]0;owned\u{7}\u{1b}[2J\u{9b}31m\u{202e}";
    let body = serde_json::json!({
        "source": "agent", "agent_running": true, "connected": 1,
        "pipelines": [{"name": hostile, "keys": 1}],
        "note": hostile,
        "savepoint": null,
    })
    .to_string();
    let server = std::thread::spawn(move || {
        for _ in 0..2 {
            let (mut s, _) = fake.accept().unwrap();
            let mut head = [0u8; 1024];
            let _ = s.read(&mut head);
            let answer = format!(
                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            );
            let _ = s.write_all(answer.as_bytes());
        }
    });
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = AgentConfig::new(
        free_port(),
        "[[pipeline]]\nname = \"balances\"\ntopics = [\"p/#\"]\nevent_id = \"/id\"\nkey = \"/k\"\naggregate = \"count\"\noutput_topic = \"o/{key}\"\n",
    );
    cfg.extra = format!("[metrics]\nlisten = \"127.0.0.1:{port}\"\n");
    let config = cfg.write(dir.path());
    let text = cairn(&config, &["status"]);
    let json = cairn(&config, &["status", "--json"]);
    server.join().unwrap();
    for (what, out) in [("text", &text), ("json", &json)] {
        assert_eq!(out.status.code(), Some(0), "{what}: {out:?}");
        let stdout = String::from_utf8(out.stdout.clone()).unwrap();
        let bad: Vec<char> = stdout
            .chars()
            .filter(|&c| (c.is_control() && c != '\n') || c == '\u{202e}')
            .collect();
        assert!(bad.is_empty(), "{what} output carries {bad:?}: {stdout:?}");
        assert!(stdout.contains("evil"), "{what}: {stdout}");
    }
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains("evil\\u{1b}]0;owned\\u{7}\\u{1b}[2J\\u{9b}31m\\u{202e}"),
        "{text}"
    );
    let v: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(v["note"], hostile, "JSON keeps the exact text");
}

/// Issue 32: with the shipped example config (no `[metrics]`), `cairn status` shows the
/// running agent's figures, read from the data directory's socket, with sizes as people
/// read them; once the agent stops, the socket is gone and the data directory speaks.
#[test]
fn status_shows_a_running_agents_figures_with_the_shipped_config_and_sizes_people_read() {
    let broker = Broker::start();
    let dir = tempfile::tempdir().unwrap();
    let shipped =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("config/cairn.toml"))
            .unwrap();
    assert!(
        !shipped.contains("\n[metrics]"),
        "the example enables no listener"
    );
    let data = dir.path().join("data");
    let text = shipped
        .replace("port = 1883", &format!("port = {}", broker.port()))
        .replace(
            "data_dir = \"./data\"",
            &format!("data_dir = \"{}\"", data.display()),
        )
        .replace("cairn-edge-1", &unique_id("status-shipped"));
    let config = dir.path().join("cairn.toml");
    std::fs::write(&config, text).unwrap();
    let mut agent = std::process::Command::new(env!("CARGO_BIN_EXE_cairn"))
        .args(["run", "--config"])
        .arg(&config)
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let socket = data.join("cairn.sock");
    let mut online = serde_json::Value::Null;
    let up = wait_until(Duration::from_secs(20), || {
        socket.exists() && {
            online = status_json(&config, &[]);
            online["source"] == "agent" && online["connected"] == 1
        }
    });
    let human = cairn(&config, &["status"]);
    let human = String::from_utf8_lossy(&human.stdout).to_string();
    crate::support::signal(agent.id(), "TERM");
    let code = agent.wait().unwrap();
    assert!(up, "no figures from the running agent: {online}");
    assert_eq!(online["metrics_address"], socket.display().to_string());
    assert_eq!(online["pipelines"][0]["name"], "balances", "{online}");
    assert!(
        human.contains(&format!(
            "agent       running (status from {})",
            socket.display()
        )),
        "{human}"
    );
    assert!(
        human.contains("queue       0 results, 0 B of 1 GiB"),
        "{human}"
    );
    assert!(
        !human.contains("bytes"),
        "sizes in units, not bytes: {human}"
    );
    assert_eq!(code.code(), Some(0));
    assert!(!socket.exists(), "a clean stop removes the socket");
    let offline = status_json(&config, &[]);
    assert_eq!(offline["source"], "data_dir", "{offline}");
    assert_eq!(offline["agent_running"], false);
}
