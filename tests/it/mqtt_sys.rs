//! The input connection watches the broker's own count of the messages it dropped
//! (issue 26, item 5): a stock mosquitto keeps at most 1,000 messages for an offline client
//! and drops the rest while PUBACKing their senders. The count comes from mosquitto's
//! `$SYS/broker/publish/messages/dropped`, never as an input.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use crate::support::{self, Broker, BrokerConfig, publish_all, unique_id};
use cairn::config::MqttConfig;
use cairn::mqtt::{BrokerDrops, Event, Events, Mqtt};

const DROPPED: &str = "$SYS/broker/publish/messages/dropped";

fn config(port: u16, client_id: &str) -> MqttConfig {
    MqttConfig {
        // Room for an ack of every message of the burst: these tests ack as fast as they
        // read (the agent asks `ack_room` first).
        channel_capacity: 4096,
        ..support::mqtt_config(port, client_id)
    }
}

/// mosquitto as shipped: 1,000 queued messages per client; `$SYS` every second (default 10).
fn stock_broker(extra: &[&str]) -> Broker {
    let mut lines = vec![
        "max_queued_messages 1000".to_string(),
        "sys_interval 1".into(),
    ];
    lines.extend(extra.iter().map(|l| l.to_string()));
    Broker::start_with(BrokerConfig {
        extra: lines,
        ..BrokerConfig::default()
    })
}

/// The broker's dropped count as a separate test client reads it, once it is at least `min`.
fn dropped_read_directly(port: u16, min: u64) -> u64 {
    use rumqttc::{Client, Event, MqttOptions, Packet, QoS};
    let mut opts = MqttOptions::new(unique_id("sys-reader"), "127.0.0.1", port);
    opts.set_keep_alive(Duration::from_secs(5));
    let (client, mut conn) = Client::new(opts, 16);
    client.subscribe(DROPPED, QoS::AtMostOnce).unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut last = None;
    while Instant::now() < deadline && last.is_none_or(|v| v < min) {
        if let Ok(Ok(Event::Incoming(Packet::Publish(p)))) =
            conn.recv_timeout(Duration::from_millis(200))
        {
            last = std::str::from_utf8(&p.payload)
                .ok()
                .and_then(|s| s.parse().ok());
        }
    }
    let _ = client.disconnect();
    last.unwrap_or_else(|| panic!("no value of {DROPPED} within 15 s"))
}

/// Events for `for_`, acking every message; returns the messages' topics and the reports.
fn take_events(mqtt: &Mqtt, rx: &Events, for_: Duration) -> (Vec<String>, Vec<BrokerDrops>) {
    let mut topics = Vec::new();
    let mut reports = Vec::new();
    let t0 = Instant::now();
    while let Some(left) = for_.checked_sub(t0.elapsed()) {
        match rx.recv_timeout(left) {
            Ok(Event::Message(m)) => {
                topics.push(m.topic.clone());
                mqtt.ack(m.token).unwrap();
            }
            Ok(Event::BrokerDrops(d)) => reports.push(d),
            Ok(_) => {}
            Err(_) => break,
        }
    }
    (topics, reports)
}

#[test]
fn a_burst_while_the_session_is_offline_is_partly_dropped_by_a_stock_broker_and_reported() {
    let broker = stock_broker(&[]);
    let id = "cairn-sys";
    let filters = vec!["burst/#".to_string()];
    let (mqtt, rx) = Mqtt::start(&config(broker.port(), id), filters.clone(), 10).unwrap();
    // A fresh broker publishes "0" at start-up, retained for a minute, and its version.
    let (_, reports) = take_events(&mqtt, &rx, Duration::from_secs(2));
    assert!(
        reports.contains(&BrokerDrops::Total(0)),
        "the broker's count before the burst: {reports:?}"
    );
    mqtt.shutdown(); // the session stays with the broker, offline

    let burst: Vec<(String, Vec<u8>, bool)> = (0..3000)
        .map(|i| (format!("burst/{i}"), format!("{i}").into_bytes(), false))
        .collect();
    publish_all(broker.port(), &burst); // every one PUBACKed to the sender
    let direct = dropped_read_directly(broker.port(), 1);

    let (mqtt, rx) = Mqtt::start(&config(broker.port(), id), filters, 10).unwrap();
    let (topics, reports) = take_events(&mqtt, &rx, Duration::from_secs(4));
    mqtt.shutdown();
    let totals: Vec<u64> = reports
        .iter()
        .filter_map(|r| match r {
            BrokerDrops::Total(n) => Some(*n),
            _ => None,
        })
        .collect();
    assert_eq!(
        totals.last(),
        Some(&direct),
        "the agent's view of the broker's drops against a direct read: {reports:?}"
    );
    assert!(
        direct >= 1000,
        "a stock queue drops most of 3,000: {direct}"
    );
    // What was not dropped came through, and nothing else: no `$SYS` message as an input.
    let unique: HashSet<&String> = topics.iter().collect();
    assert!(topics.iter().all(|t| t.starts_with("burst/")), "{topics:?}");
    assert_eq!(
        unique.len() as u64 + direct,
        3000,
        "delivered plus dropped is the burst"
    );
}

#[test]
fn a_broker_without_sys_or_whose_acl_hides_it_is_reported_unavailable_after_the_wait() {
    // `$SYS` off: nothing comes.
    let quiet = Broker::start_with(BrokerConfig {
        extra: vec!["sys_interval 0".into()],
        ..BrokerConfig::default()
    });
    // An ACL that lets anonymous clients read only their inputs: mosquitto grants the
    // SUBSCRIBE and withholds the messages.
    let dir = tempfile::tempdir().unwrap();
    let acl = dir.path().join("acl");
    std::fs::write(&acl, "topic read in/#\n").unwrap();
    let guarded = Broker::start_with(BrokerConfig {
        extra: vec![format!("acl_file {}", acl.display())],
        ..BrokerConfig::default()
    });
    let t0 = Instant::now();
    let watched = [&quiet, &guarded]
        .map(|b| Mqtt::start(&config(b.port(), "cairn-nosys"), vec!["in/#".into()], 10).unwrap());
    for (mqtt, rx) in watched {
        let report = loop {
            let left = Duration::from_secs(15).saturating_sub(t0.elapsed());
            match rx.recv_timeout(left) {
                Ok(Event::BrokerDrops(d)) => break d,
                Ok(_) => {}
                Err(e) => panic!("no report within 15 s: {e}"),
            }
        };
        assert!(
            t0.elapsed() >= sys_wait(),
            "not before the wait: {report:?}"
        );
        // And nothing more: one report per connection.
        let (_, more) = take_events(&mqtt, &rx, Duration::from_millis(200));
        mqtt.shutdown();
        assert!(more.is_empty(), "{more:?}");
        let BrokerDrops::Unavailable { reason } = report else {
            panic!("unavailable: {report:?}");
        };
        assert!(
            reason.contains("sys_interval") && reason.contains("ACL"),
            "{reason}"
        );
    }
}

/// `cairn::mqtt`'s wait for a first `$SYS` message (10 s), less a little for clocks.
fn sys_wait() -> Duration {
    cairn::mqtt::SYS_WAIT - Duration::from_millis(50)
}

#[test]
fn a_pipeline_reading_sys_still_gets_its_own_copy_as_an_input() {
    let broker = Broker::start();
    let (mqtt, rx) = Mqtt::start(
        &config(broker.port(), "cairn-sys-input"),
        vec!["$SYS/broker/version".into()],
        10,
    )
    .unwrap();
    let (topics, reports) = take_events(&mqtt, &rx, Duration::from_secs(2));
    mqtt.shutdown();
    assert_eq!(topics, ["$SYS/broker/version"], "the pipeline's QoS 1 copy");
    assert!(
        !reports.is_empty()
            && !reports
                .iter()
                .any(|r| matches!(r, BrokerDrops::Unavailable { .. })),
        "the watch's QoS 0 copies: {reports:?}"
    );
}

/// The whole agent against a stock broker (issue 26, item 5, "must show"): its session is
/// offline while a burst arrives, the broker drops most of it while PUBACKing the sender,
/// and once the agent is back its journal, `/status.json` and `cairn status` report the
/// broker's count, equal to what the broker itself publishes.
#[test]
fn the_agent_reports_what_a_stock_broker_dropped_while_it_was_away() {
    use crate::support::agent::{AgentConfig, CairnProcess};
    let broker = stock_broker(&[]);
    let mport = support::free_port();
    let mut cfg = AgentConfig::new(
        broker.port(),
        "[[pipeline]]\nname = \"sums\"\ntopics = [\"burst/#\"]\nformat = \"delimited\"\n\
         separator = \"/\"\nevent_id = \"0\"\nkey = \"1\"\nvalue = \"2\"\naggregate = \"sum\"\n\
         output_topic = \"sums/{key}\"\n",
    );
    cfg.extra = format!("[metrics]\nlisten = \"127.0.0.1:{mport}\"\n");
    let mut agent = CairnProcess::new(&cfg);
    agent.set_up_session();

    let burst: Vec<(String, Vec<u8>, bool)> = (0..3000)
        .map(|i| {
            (
                "burst/in".to_string(),
                format!("E{i}/k/1").into_bytes(),
                false,
            )
        })
        .collect();
    publish_all(broker.port(), &burst); // every one PUBACKed to the sender
    let direct = dropped_read_directly(broker.port(), 1);
    assert!(
        direct >= 1000,
        "a stock queue drops most of 3,000: {direct}"
    );

    agent.start_connected();
    agent.wait_for_stderr("broker: it dropped", Duration::from_secs(20));
    let line = agent
        .run_stderr()
        .lines()
        .find(|l| l.contains("broker: it dropped"))
        .unwrap_or_default()
        .to_string();
    assert!(
        line.contains(&format!("({direct} since it started"))
            && line.contains("config/mosquitto.conf"),
        "the journal line names the count and the fix: {line}"
    );
    let status = || {
        let (code, out, err) = agent.command(&["status"]);
        assert!(code.success(), "status: {err}");
        out
    };
    let shown = support::wait_until(Duration::from_secs(10), || {
        status().contains(&format!("broker      dropped {direct} messages"))
    });
    assert!(
        shown,
        "`cairn status` shows the broker's drops:\n{}",
        status()
    );
    // What reached the log is what the broker did not drop: the agent counted all of it.
    let acked = || {
        let (_, out, _) = agent.command(&["status", "--json"]);
        serde_json::from_str::<serde_json::Value>(&out).ok()?["metrics"]["cairn_acked_total"]
            .as_f64()
    };
    let all_in = support::wait_until(Duration::from_secs(30), || {
        acked() == Some((3000 - direct) as f64)
    });
    assert!(
        all_in,
        "the agent acknowledged {:?} of {}",
        acked(),
        3000 - direct
    );
    let code = agent.terminate().code();
    assert_eq!(code, Some(0), "{}", agent.stderr_tail(20));
    let state = agent.inspect("state");
    assert_eq!(
        state.first().and_then(|s| s["value"].as_f64()),
        Some((3000 - direct) as f64),
        "the agent's sum is the burst less the broker's drops: {state:?}"
    );
}
