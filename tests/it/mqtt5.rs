//! MQTT 5 result connections (issue 29, item 3) against a private mosquitto 2.0: a PUBACK
//! that refuses (an ACL: 0x87) comes back as a refusal naming the output ID and does not
//! settle; after the ACL is fixed and reloaded a re-send succeeds; a result over the broker's
//! Maximum Packet Size is answered at once, never sent, the connection untouched; the
//! broker's Receive Maximum is the window; credentials and TLS as on the 3.1.1 path.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::support::{self, Broker, BrokerConfig, Certs, Proxy, publish_all, wait_until};
use cairn::config::{MqttConfig, TlsConfig};
use cairn::mqtt::{Event, Events, Mqtt, Mqtt5, MqttError, Protocol};

const STEP: Duration = Duration::from_secs(10);

/// How one publish ended.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Outcome {
    Acked,
    Refused(u8, &'static str),
    TooLarge(usize, u32),
}

/// The outcome of an event, by output ID, unwrapping the uplink's wrapper.
fn outcome(event: Event) -> Result<(String, Outcome), Event> {
    match event {
        Event::PubAcked { output_id } => Ok((output_id, Outcome::Acked)),
        Event::PubRefused {
            output_id,
            code,
            reason,
        } => Ok((output_id, Outcome::Refused(code, reason))),
        Event::TooLarge {
            output_id,
            size,
            max,
        } => Ok((output_id, Outcome::TooLarge(size, max))),
        Event::Uplink(inner) => outcome(*inner),
        other => Err(other),
    }
}

/// The next `n` outcomes; any connection event on the way fails the test (none is due).
fn outcomes(rx: &Events, n: usize) -> BTreeMap<String, Outcome> {
    let mut got = BTreeMap::new();
    while got.len() < n {
        let event = rx.recv_timeout(STEP).expect("an outcome within 10 s");
        match outcome(event) {
            Ok((id, o)) => assert!(got.insert(id.clone(), o).is_none(), "{id} twice"),
            Err(other) => panic!("not an outcome: {other:?} (have {got:?})"),
        }
    }
    got
}

fn connected(rx: &Events) {
    match rx.recv_timeout(STEP) {
        Ok(Event::Connected { .. }) => {}
        other => panic!("expected Connected: {other:?}"),
    }
}

/// A broker that knows user `cairn`, whose ACL lets it write the prefixes in `writable`.
fn acl_broker(dir: &Path, writable: &[&str]) -> (Broker, MqttConfig) {
    let acl = dir.join("acl");
    write_acl(&acl, writable);
    let broker = Broker::start_with(BrokerConfig {
        allow_anonymous: false,
        password_file: Some(support::password_file(dir, "cairn", "s3cret")),
        extra: vec![format!("acl_file {}", acl.display())],
        ..BrokerConfig::default()
    });
    let file = dir.join("client.password");
    std::fs::write(&file, "s3cret\n").unwrap();
    let mut cfg = support::mqtt_config(broker.port(), "cairn-central");
    cfg.username = Some("cairn".into());
    cfg.password_file = Some(file);
    (broker, cfg)
}

/// Payloads that user `cairn` receives on `filter` from now on (QoS 1), in order.
fn subscribe(port: u16, filter: &str) -> Arc<Mutex<Vec<Vec<u8>>>> {
    use rumqttc::{Client, Event, MqttOptions, Packet, QoS};
    let mut opts = MqttOptions::new(support::unique_id("central-sub"), "127.0.0.1", port);
    opts.set_keep_alive(Duration::from_secs(5))
        .set_credentials("cairn", "s3cret");
    let (client, mut conn) = Client::new(opts, 16);
    client.subscribe(filter, QoS::AtLeastOnce).unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let (tx, subscribed) = std::sync::mpsc::channel();
    let seen2 = seen.clone();
    std::thread::spawn(move || {
        let _client = client; // the connection lives as long as this thread
        for event in conn.iter() {
            match event {
                Ok(Event::Incoming(Packet::SubAck(_))) => {
                    let _ = tx.send(());
                }
                Ok(Event::Incoming(Packet::Publish(p))) => {
                    seen2.lock().unwrap().push(p.payload.to_vec())
                }
                Ok(_) => {}
                Err(_) => return, // the broker stopped at the end of the test
            }
        }
    });
    subscribed.recv_timeout(STEP).expect("SUBACK");
    seen
}

fn write_acl(path: &Path, writable: &[&str]) {
    let mut text = String::from("user cairn\ntopic read #\n");
    for prefix in writable {
        text.push_str(&format!("topic write {prefix}#\n"));
    }
    std::fs::write(path, text).unwrap();
}

#[test]
fn an_acl_refusal_comes_back_as_0x87_naming_the_output_and_a_resend_succeeds_once_fixed() {
    let dir = tempfile::tempdir().unwrap();
    let (mut broker, cfg) = acl_broker(dir.path(), &["site/ok/"]);
    let (sink, rx) = Mqtt5::start(&cfg, 10).unwrap();
    connected(&rx);
    for (id, topic) in [
        ("r1", "site/ok/a"),
        ("r2", "site/denied/a"),
        ("r3", "site/ok/b"),
        ("r4", "site/denied/b"),
    ] {
        sink.publish(id.into(), topic, id.as_bytes().to_vec(), true)
            .unwrap();
    }
    // No subscriber yet: mosquitto answers the allowed ones with 0x10 (no matching
    // subscribers), a success.
    let got = outcomes(&rx, 4);
    let refused = Outcome::Refused(0x87, "not authorized");
    assert_eq!(got["r1"], Outcome::Acked);
    assert_eq!(got["r2"], refused);
    assert_eq!(got["r3"], Outcome::Acked);
    assert_eq!(got["r4"], refused);
    assert_eq!(sink.inflight(), 0, "a refusal ends the publish here");

    // The operator fixes the ACL; mosquitto reloads it on SIGHUP, then the same results are
    // sent again, under the same IDs.
    write_acl(&dir.path().join("acl"), &["site/ok/", "site/denied/"]);
    let seen = subscribe(broker.port(), "site/#");
    assert!(support::signal(broker.pid().unwrap(), "HUP"));
    assert!(
        wait_until(STEP, || broker.log().contains("Reloading config")),
        "mosquitto did not reload"
    );
    sink.publish("r2".into(), "site/denied/a", b"r2".to_vec(), true)
        .unwrap();
    sink.publish("r4".into(), "site/denied/b", b"r4".to_vec(), true)
        .unwrap();
    let got = outcomes(&rx, 2);
    assert_eq!(got["r2"], Outcome::Acked, "{got:?}");
    assert_eq!(got["r4"], Outcome::Acked, "{got:?}");
    assert!(
        wait_until(STEP, || seen.lock().unwrap().len() >= 4),
        "the subscriber got {:?}",
        seen.lock().unwrap()
    );
    // First the retained values the subscription found (the two accepted before the fix,
    // not the refused ones: they never reached the broker), then the two re-sent.
    let seen = seen.lock().unwrap().clone();
    let mut retained = seen[..2].to_vec();
    retained.sort();
    assert_eq!(retained, [b"r1".to_vec(), b"r3".to_vec()], "{seen:?}");
    assert_eq!(seen[2..], [b"r2".to_vec(), b"r4".to_vec()], "{seen:?}");
    assert!(
        rx.try_recv().is_err(),
        "no connection event: nothing dropped us"
    );
    sink.shutdown();
    broker.stop();
}

#[test]
fn a_result_over_the_brokers_maximum_packet_size_is_answered_at_once_and_never_sent() {
    let broker = Broker::start_with(BrokerConfig {
        extra: vec!["max_packet_size 1000".into()],
        ..BrokerConfig::default()
    });
    let id = "cairn-maxpacket";
    let (sink, rx) = Mqtt5::start(&support::mqtt_config(broker.port(), id), 10).unwrap();
    connected(&rx);
    sink.publish("small-1".into(), "out/a", vec![b'x'; 100], false)
        .unwrap();
    sink.publish("big".into(), "out/b", vec![b'x'; 2000], false)
        .unwrap();
    sink.publish("small-2".into(), "out/c", vec![b'x'; 100], false)
        .unwrap();
    let got = outcomes(&rx, 3);
    assert_eq!(got["small-1"], Outcome::Acked);
    assert_eq!(got["small-2"], Outcome::Acked);
    let Outcome::TooLarge(size, max) = got["big"] else {
        panic!("{got:?}");
    };
    assert_eq!(max, 1000);
    assert!(size > 2000, "{size}");
    assert_eq!(sink.inflight(), 0);
    // No reconnect loop: one connection, never dropped.
    std::thread::sleep(Duration::from_millis(300));
    assert!(rx.try_recv().is_err(), "no connection event");
    assert_eq!(broker.connections(id), 1, "{}", broker.log());
    sink.shutdown();
}

#[test]
fn the_window_is_the_brokers_receive_maximum_when_that_is_smaller_than_ours() {
    let broker = Broker::start_with(BrokerConfig {
        max_inflight: 5, // mosquitto's Receive Maximum for MQTT 5 clients
        ..BrokerConfig::default()
    });
    let (sink, rx) =
        Mqtt5::start(&support::mqtt_config(broker.port(), "cairn-window"), 100).unwrap();
    assert_eq!(sink.window(), 100, "ours, before the broker said anything");
    connected(&rx);
    assert_eq!(sink.window(), 5);
    let n = 500;
    let mut next = 0;
    let mut acked = Vec::new();
    let mut most = 0;
    let deadline = Instant::now() + Duration::from_secs(30);
    while acked.len() < n {
        assert!(Instant::now() < deadline, "{} of {n} acked", acked.len());
        while next < n {
            match sink.publish(format!("o{next:03}"), "out/w", vec![1], false) {
                Ok(()) => next += 1,
                Err(MqttError::InflightFull { limit }) => {
                    assert_eq!(limit, 5);
                    break;
                }
                Err(e) => panic!("{e}"),
            }
        }
        most = most.max(sink.inflight());
        let event = rx.recv_timeout(STEP).expect("an outcome");
        match outcome(event) {
            Ok((id, Outcome::Acked)) => acked.push(id),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(most, 5, "never more than the broker's window");
    let expected: Vec<String> = (0..n).map(|i| format!("o{i:03}")).collect();
    assert_eq!(acked, expected, "each once, in order");
    // A broker that got more than its Receive Maximum would have dropped us (0x93).
    assert!(rx.try_recv().is_err(), "no connection event");
    sink.shutdown();
}

#[test]
fn mqtt5_connects_over_tls_with_a_private_ca_and_a_bad_password_is_retried_with_backoff() {
    let dir = tempfile::tempdir().unwrap();
    let certs = Certs::generate(dir.path());
    let broker = Broker::start_with(BrokerConfig {
        tls: Some(certs.clone()),
        ..BrokerConfig::default()
    });
    let mut cfg = support::mqtt_config(broker.port(), "cairn-tls5");
    cfg.tls = Some(TlsConfig {
        ca_file: certs.ca.clone(),
        cert_file: None,
        key_file: None,
    });
    let (sink, rx) = Mqtt5::start(&cfg, 10).unwrap();
    connected(&rx);
    sink.publish("t1".into(), "out/tls", b"hello".to_vec(), false)
        .unwrap();
    assert_eq!(outcomes(&rx, 1)["t1"], Outcome::Acked);
    sink.shutdown();

    let (broker, mut cfg) = acl_broker(dir.path(), &["out/"]);
    let proxy = Proxy::start(broker.port());
    cfg.port = proxy.port();
    std::fs::write(cfg.password_file.as_ref().unwrap(), "wrong\n").unwrap();
    let (sink, rx) = Mqtt5::start(&cfg, 10).unwrap();
    let Ok(Event::Disconnected { reason, .. }) = rx.recv_timeout(STEP) else {
        panic!("a refused connection is reported");
    };
    // mosquitto 2.0 answers a wrong password with 0x87 (not authorized) under MQTT 5.
    assert!(
        reason.contains("refused")
            && (reason.contains("password") || reason.contains("not authorized")),
        "{reason}"
    );
    std::thread::sleep(Duration::from_secs(1));
    let attempts = proxy.accepted();
    assert!((2..=12).contains(&attempts), "{attempts} attempts in 1 s");
    assert!(rx.try_recv().is_err(), "no event per retry");
    sink.shutdown();
}

#[test]
fn an_input_connection_and_an_mqtt5_link_share_one_channel() {
    let local = Broker::start();
    let central = Broker::start();
    let (input, link, rx) = Mqtt::start_with_link(
        &support::mqtt_config(local.port(), "cairn-in"),
        vec!["in/#".into()],
        &support::mqtt_config(central.port(), "cairn-link"),
        Protocol::V5,
        10,
    )
    .unwrap();
    assert_eq!(link.protocol(), Protocol::V5);
    let mut connected = 0;
    while connected < 2 {
        match rx.recv_timeout(STEP).expect("both connect") {
            Event::Connected { .. } => connected += 1,
            Event::Uplink(e) if matches!(*e, Event::Connected { .. }) => connected += 1,
            _ => {}
        }
    }
    publish_all(local.port(), &[("in/1".into(), b"x".to_vec(), false)]);
    link.publish("r1".into(), "out/1", b"y".to_vec(), false)
        .unwrap();
    let (mut message, mut acked) = (false, false);
    while !(message && acked) {
        match rx.recv_timeout(STEP).expect("events of both") {
            Event::Message(m) => {
                assert_eq!(m.topic, "in/1");
                input.ack(m.token).unwrap();
                message = true;
            }
            Event::Uplink(e) => match *e {
                Event::PubAcked { output_id } => {
                    assert_eq!(output_id, "r1");
                    acked = true;
                }
                other => panic!("from the link: {other:?}"),
            },
            _ => {}
        }
    }
    link.shutdown();
    input.shutdown();
}
