//! The mqtt module against a private mosquitto: manual acks and redelivery, exact packet-id
//! binding (through retransmits and a lost session), reconnect backoff, credentials, TLS,
//! and the order in which results reach a subscriber across cuts and broker restarts.

use crate::support;

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::support::{Broker, BrokerConfig, Certs, Proxy, publish_all, wait_until};
use cairn::config::{MqttConfig, TlsConfig};
use cairn::mqtt::{Event, Events, Incoming, Mqtt, MqttError};

const STEP: Duration = Duration::from_secs(10);

fn config(port: u16, client_id: &str) -> MqttConfig {
    support::mqtt_config(port, client_id)
}

/// The next event that `want` accepts; other events are skipped. Panics after `timeout`.
fn expect<T>(rx: &Events, timeout: Duration, mut want: impl FnMut(Event) -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(event) => {
                if let Some(t) = want(event) {
                    return t;
                }
            }
            Err(e) => panic!("no expected event within {timeout:?}: {e}"),
        }
    }
}

fn connected(rx: &Events) -> bool {
    expect(rx, STEP, |e| match e {
        Event::Connected { session_present } => Some(session_present),
        _ => None,
    })
}

fn message(rx: &Events) -> Incoming {
    expect(rx, STEP, |e| match e {
        Event::Message(m) => Some(m),
        _ => None,
    })
}

/// Messages arriving within `quiet`.
fn drain_messages(rx: &Events, quiet: Duration) -> Vec<Incoming> {
    let mut out = Vec::new();
    while let Ok(event) = rx.recv_timeout(quiet) {
        if let Event::Message(m) = event {
            out.push(m);
        }
    }
    out
}

fn inputs(n: usize) -> Vec<(String, Vec<u8>, bool)> {
    (0..n)
        .map(|i| (format!("in/{i}"), format!("m{i}").into_bytes(), false))
        .collect()
}

#[test]
fn unacked_messages_are_redelivered_with_dup_after_a_restart_and_acked_ones_are_not() {
    let broker = Broker::start();
    let cfg = config(broker.port(), "cairn-acks");

    let (mqtt, rx) = Mqtt::start(&cfg, vec!["in/#".into()], 10).unwrap();
    assert!(!connected(&rx), "a new client id has no session");
    std::thread::sleep(Duration::from_millis(100)); // let SUBACK arrive
    publish_all(broker.port(), &inputs(10));
    let got: Vec<Incoming> = (0..10).map(|_| message(&rx)).collect();
    let payloads: Vec<_> = got.iter().map(|m| m.payload.clone()).collect();
    assert_eq!(
        payloads,
        inputs(10).into_iter().map(|m| m.1).collect::<Vec<_>>()
    );
    assert!(got.iter().all(|m| m.qos == 1 && !m.dup));
    // Ack the first five, in receipt order; the rest stay unacknowledged.
    for m in got.into_iter().take(5) {
        mqtt.ack(m.token).unwrap();
    }
    mqtt.shutdown(); // queued acks go out before DISCONNECT

    let (mqtt, rx) = Mqtt::start(&cfg, vec!["in/#".into()], 10).unwrap();
    assert!(
        connected(&rx),
        "the persistent session survives a client restart"
    );
    let again = drain_messages(&rx, Duration::from_millis(500));
    let topics: Vec<_> = again.iter().map(|m| m.topic.clone()).collect();
    assert_eq!(topics, ["in/5", "in/6", "in/7", "in/8", "in/9"]);
    assert!(again.iter().all(|m| m.dup), "redeliveries carry DUP=1");
    for m in again {
        mqtt.ack(m.token).unwrap();
    }
    mqtt.shutdown();

    let (mqtt, rx) = Mqtt::start(&cfg, vec!["in/#".into()], 10).unwrap();
    assert!(connected(&rx));
    assert!(drain_messages(&rx, Duration::from_millis(300)).is_empty());
    mqtt.shutdown();
}

/// Publishes `n` messages (payload = output id), keeping `inflight` unacknowledged, and
/// returns the PubAcked ids in arrival order. `during` runs once, after `n / 2` PubAcks.
fn publish_and_collect(
    mqtt: &Mqtt,
    rx: &Events,
    n: usize,
    mut during: impl FnMut(),
) -> (Vec<String>, Vec<Event>) {
    let mut acked = Vec::with_capacity(n);
    let mut other = Vec::new();
    let mut next = 0;
    let mut fired = false;
    let deadline = Instant::now() + Duration::from_secs(30);
    while acked.len() < n {
        assert!(
            Instant::now() < deadline,
            "only {} of {n} PubAcked",
            acked.len()
        );
        while next < n {
            let id = format!("out-{next}");
            match mqtt.publish(id.clone(), "out/x", id.into_bytes(), false) {
                Ok(()) => next += 1,
                Err(MqttError::InflightFull { .. }) => break,
                Err(e) => panic!("publish failed: {e}"),
            }
        }
        if !fired && acked.len() >= n / 2 {
            fired = true;
            during();
        }
        match rx.recv_timeout(Duration::from_secs(5)) {
            Ok(Event::PubAcked { output_id }) => acked.push(output_id),
            Ok(event) => other.push(event),
            Err(_) => {}
        }
    }
    (acked, other)
}

fn assert_each_once_in_order(acked: &[String], n: usize) {
    let mut count: HashMap<&str, usize> = HashMap::new();
    for id in acked {
        *count.entry(id).or_default() += 1;
    }
    let twice: Vec<_> = count.iter().filter(|(_, c)| **c > 1).collect();
    assert!(twice.is_empty(), "PubAcked more than once: {twice:?}");
    assert_eq!(count.len(), n, "every output id is PubAcked");
    // mosquitto acks in order and rumqttc retransmits in order, so a binding that shifted
    // even once would show up here.
    let expected: Vec<String> = (0..n).map(|i| format!("out-{i}")).collect();
    assert_eq!(acked, expected.as_slice());
}

#[test]
fn every_output_id_is_pubacked_exactly_once_over_5000_publishes() {
    let broker = Broker::start();
    let (mqtt, rx) = Mqtt::start(&config(broker.port(), "cairn-binding"), vec![], 100).unwrap();
    connected(&rx);
    let (acked, _) = publish_and_collect(&mqtt, &rx, 5000, || {});
    assert_each_once_in_order(&acked, 5000);
    assert_eq!(mqtt.inflight(), 0);
    mqtt.shutdown();
}

/// Input acks and result publishes share one connection, and rumqttc takes no request from
/// its channel (where an ack may wait) while its window of publishes is full: acks must still
/// leave while a steady stream of results keeps that window full, or the broker's in-flight
/// window for us fills with unacknowledged messages and input stops without a sign.
#[test]
fn acks_leave_while_a_steady_stream_of_publishes_keeps_the_window_full() {
    let broker = Broker::start();
    let (mqtt, rx) = Mqtt::start(
        &config(broker.port(), "cairn-acks-window"),
        vec!["in/#".into()],
        10,
    )
    .unwrap();
    connected(&rx);
    std::thread::sleep(Duration::from_millis(100)); // let SUBACK arrive
    let n = 2000;
    let port = broker.port();
    let sender = std::thread::spawn(move || publish_all(port, &inputs(n)));
    let (mut received, mut published, mut next) = (0usize, 0usize, 0usize);
    let mut unacked = std::collections::VecDeque::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while received < n && Instant::now() < deadline {
        // Results without end: the window stays full for as long as the inputs take.
        loop {
            let id = format!("out-{next}");
            match mqtt.publish(id.clone(), "out/x", id.into_bytes(), false) {
                Ok(()) => next += 1,
                Err(MqttError::InflightFull { .. }) => break,
                Err(e) => panic!("publish failed: {e}"),
            }
        }
        // As the agent does (`ingest`: `ack_room`), a full ack queue is backpressure, not an
        // error: the acks wait here, in order, until it has room. Acks that never leave
        // still fail the test below: the broker then stops sending input.
        let room = mqtt.ack_room().min(unacked.len());
        for token in unacked.drain(..room) {
            mqtt.ack(token).unwrap();
        }
        match rx.recv_timeout(Duration::from_millis(100)) {
            Ok(Event::Message(m)) => {
                unacked.push_back(m.token);
                received += 1;
            }
            Ok(Event::PubAcked { .. }) => published += 1,
            _ => {}
        }
    }
    assert_eq!(
        received, n,
        "input stopped at {received} of {n} while {published} results were PubAcked"
    );
    assert!(published > 0);
    sender.join().unwrap();
    mqtt.shutdown();
}

#[test]
fn packet_id_binding_stays_exact_through_a_connection_cut_with_retransmits() {
    let broker = Broker::start();
    let collector = support::Collector::start(broker.port(), "out/#");
    let proxy = Proxy::start(broker.port());
    let (mqtt, rx) = Mqtt::start(&config(proxy.port(), "cairn-cut"), vec![], 100).unwrap();
    connected(&rx);
    let (acked, other) = publish_and_collect(&mqtt, &rx, 5000, || proxy.cut());
    assert_each_once_in_order(&acked, 5000);
    assert!(
        matches!(
            other.as_slice(),
            [
                Event::Disconnected { .. },
                Event::Connected {
                    session_present: true
                }
            ]
        ),
        "one Disconnected, then Connected with the session: {other:?}"
    );
    assert_eq!(mqtt.inflight(), 0);
    // The broker really got every output (some twice: retransmits are at-least-once).
    assert!(wait_until(STEP, || {
        let seen = collector.messages();
        (0..5000).all(|i| {
            seen.iter()
                .any(|m| m.payload == format!("out-{i}").as_bytes())
        })
    }));
    mqtt.shutdown();
}

#[test]
fn a_lost_broker_session_resends_unacked_publishes_in_order() {
    let mut broker = Broker::start();
    let (mqtt, rx) = Mqtt::start(&config(broker.port(), "cairn-lost"), vec![], 50).unwrap();
    connected(&rx);
    let data = broker.dir().join("data");
    let (acked, other) = publish_and_collect(&mqtt, &rx, 2000, || {
        // A broker that comes back without its database has no session for us.
        broker.kill();
        std::fs::remove_dir_all(&data).unwrap();
        std::fs::create_dir(&data).unwrap();
        broker.restart();
    });
    assert_each_once_in_order(&acked, 2000);
    assert!(
        other.iter().any(|e| matches!(
            e,
            Event::Connected {
                session_present: false
            }
        )),
        "reconnected to a broker without our session: {other:?}"
    );
    assert_eq!(mqtt.inflight(), 0);
    mqtt.shutdown();
}

#[test]
fn reconnects_with_backoff_after_a_broker_kill_and_the_subscription_survives() {
    let mut broker = Broker::start();
    let (mqtt, rx) = Mqtt::start(
        &config(broker.port(), "cairn-reconnect"),
        vec!["in/#".into()],
        10,
    )
    .unwrap();
    assert!(!connected(&rx));
    // autosave_interval is 1 s (checked with whole-second granularity): give the broker time
    // to write the session and its subscription before the SIGKILL.
    std::thread::sleep(Duration::from_millis(2200));
    broker.kill();
    let reason = expect(&rx, STEP, |e| match e {
        Event::Disconnected { reason, .. } => Some(reason),
        _ => None,
    });
    assert!(!reason.is_empty());
    std::thread::sleep(Duration::from_millis(700)); // several failed attempts
    broker.restart();
    let mut between = Vec::new();
    let session_present = expect(&rx, STEP, |e| match e {
        Event::Connected { session_present } => Some(session_present),
        other => {
            between.push(format!("{other:?}"));
            None
        }
    });
    assert!(
        between.is_empty(),
        "one Disconnected per outage, not per retry: {between:?}"
    );
    // Either the broker restored the session with its subscription, or it lost it and the
    // module subscribed again: both must deliver.
    if !session_present {
        eprintln!("broker lost the session despite autosave; checking the re-subscribe");
        std::thread::sleep(Duration::from_millis(100)); // let SUBACK arrive
    }
    publish_all(broker.port(), &inputs(1));
    let m = message(&rx);
    assert_eq!(m.topic, "in/0");
    mqtt.ack(m.token).unwrap();
    mqtt.shutdown();
}

#[test]
fn a_refusing_endpoint_is_retried_with_bounded_backoff_not_in_a_tight_loop() {
    let broker = Broker::start();
    let proxy = Proxy::start(broker.port());
    proxy.pause(true);
    let (mqtt, rx) = Mqtt::start(&config(proxy.port(), "cairn-backoff"), vec![], 10).unwrap();
    expect(&rx, STEP, |e| {
        matches!(e, Event::Disconnected { .. }).then_some(())
    });
    std::thread::sleep(Duration::from_millis(1500));
    let attempts = proxy.accepted();
    // 50 ms doubling to 400 ms, with jitter down to half: at most ~12 attempts in 1.5 s.
    assert!((3..=14).contains(&attempts), "{attempts} attempts in 1.5 s");
    proxy.pause(false);
    assert!(!connected(&rx));
    mqtt.shutdown();
}

fn auth_broker(dir: &std::path::Path) -> Broker {
    Broker::start_with(BrokerConfig {
        allow_anonymous: false,
        password_file: Some(support::password_file(dir, "cairn", "s3cret")),
        ..BrokerConfig::default()
    })
}

#[test]
fn username_and_password_file_authenticate() {
    let dir = tempfile::tempdir().unwrap();
    let broker = auth_broker(dir.path());
    let file = dir.path().join("client.password");
    std::fs::write(&file, "s3cret\n").unwrap(); // as `echo` writes it
    let mut cfg = config(broker.port(), "cairn-auth");
    cfg.username = Some("cairn".into());
    cfg.password_file = Some(file);
    let (mqtt, rx) = Mqtt::start(&cfg, vec!["in/#".into()], 10).unwrap();
    assert!(!connected(&rx));
    mqtt.shutdown();
}

#[test]
fn a_bad_password_is_a_clear_error_and_not_a_tight_loop() {
    let dir = tempfile::tempdir().unwrap();
    let broker = auth_broker(dir.path());
    let proxy = Proxy::start(broker.port());
    let file = dir.path().join("client.password");
    std::fs::write(&file, "wrong\n").unwrap();
    let mut cfg = config(proxy.port(), "cairn-badauth");
    cfg.username = Some("cairn".into());
    cfg.password_file = Some(file);
    let (mqtt, rx) = Mqtt::start(&cfg, vec![], 10).unwrap();
    let reason = expect(&rx, STEP, |e| match e {
        Event::Disconnected { reason, .. } => Some(reason),
        Event::Connected { .. } => panic!("connected with a wrong password"),
        _ => None,
    });
    assert!(
        reason.contains("refused")
            && (reason.contains("password") || reason.contains("authorized")),
        "reason names the refusal: {reason}"
    );
    std::thread::sleep(Duration::from_millis(1000));
    let attempts = proxy.accepted();
    assert!(attempts <= 12, "{attempts} attempts in 1 s");
    assert!(rx.try_recv().is_err(), "no event per retry");
    mqtt.shutdown();
}

#[test]
fn a_missing_password_file_is_an_error_naming_the_file() {
    let mut cfg = config(1, "cairn-nofile");
    cfg.username = Some("cairn".into());
    cfg.password_file = Some(PathBuf::from("/nonexistent/cairn.password"));
    let err = Mqtt::start(&cfg, vec![], 10)
        .err()
        .expect("start must fail");
    assert!(
        err.to_string().contains("/nonexistent/cairn.password"),
        "{err}"
    );
}

#[test]
fn tls_with_a_private_ca_connects_and_carries_messages() {
    let dir = tempfile::tempdir().unwrap();
    let certs = Certs::generate(dir.path());
    let broker = Broker::start_with(BrokerConfig {
        tls: Some(certs.clone()),
        ..BrokerConfig::default()
    });
    let mut cfg = config(broker.port(), "cairn-tls");
    cfg.tls = Some(TlsConfig {
        ca_file: certs.ca.clone(),
        cert_file: None,
        key_file: None,
    });
    let (mqtt, rx) = Mqtt::start(&cfg, vec!["out/#".into()], 10).unwrap();
    assert!(!connected(&rx));
    std::thread::sleep(Duration::from_millis(100)); // let SUBACK arrive
    // Our own publish comes back through our own subscription, over TLS both ways.
    mqtt.publish("o1".into(), "out/tls", b"hello".to_vec(), false)
        .unwrap();
    let mut acked = false;
    let mut got = None;
    while !(acked && got.is_some()) {
        match rx.recv_timeout(STEP).expect("events over TLS") {
            Event::PubAcked { output_id } => {
                assert_eq!(output_id, "o1");
                acked = true;
            }
            Event::Message(m) => got = Some(m),
            // The input connection's watch of the broker's drops (tests/it/mqtt_sys.rs).
            Event::BrokerDrops(_) => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    let m = got.unwrap();
    assert_eq!(
        (m.topic.as_str(), m.payload.as_slice()),
        ("out/tls", &b"hello"[..])
    );
    mqtt.ack(m.token).unwrap();
    mqtt.shutdown();
}

// ---------------------------------------------------------------------------------------
// Results reach a subscriber in publish order, across cuts, restarts and reconnects
// (guarantee 6; the soak of 2026-12-06 saw a result first arrive after a later version of
// its key, right after a reconnect).

/// What a subscriber received, in arrival order, and the switch that stops it.
type Received = (Arc<Mutex<Vec<support::Seen>>>, Arc<AtomicBool>);

/// Offers `out-{next}` .. `out-{end - 1}` until the window is full (or the link refuses
/// while it is down); returns the next one to offer.
fn offer(mqtt: &Mqtt, mut next: usize, end: usize) -> usize {
    while next < end {
        let id = format!("out-{next}");
        if mqtt
            .publish(id.clone(), "out/x", id.into_bytes(), false)
            .is_err()
        {
            break;
        }
        next += 1;
    }
    next
}

/// One more PubAcked within `wait`?
fn one_acked(rx: &Events, wait: Duration) -> bool {
    matches!(rx.recv_timeout(wait), Ok(Event::PubAcked { .. }))
}

/// Where each of `out-0` .. `out-{n-1}` was first seen by a subscriber, in order of first
/// arrival: the outputs whose first arrival came after a later output's.
fn first_seen_out_of_order(seen: &[support::Seen], n: usize) -> Vec<usize> {
    let mut first = std::collections::HashSet::new();
    let mut highest: Option<usize> = None;
    let mut late = Vec::new();
    for m in seen {
        let Some(i) = std::str::from_utf8(&m.payload)
            .ok()
            .and_then(|p| p.strip_prefix("out-"))
            .and_then(|i| i.parse::<usize>().ok())
        else {
            continue;
        };
        if i >= n || !first.insert(i) {
            continue;
        }
        if highest.is_some_and(|h| i < h) {
            late.push(i);
        }
        highest = highest.max(Some(i));
    }
    late
}

/// Waits until the subscriber has all of `out-0` .. `out-{n-1}`, stops it, and asserts it
/// saw each for the first time in publish order (`what`: the run, for the message).
fn assert_first_seen_in_order((seen, stop): &Received, n: usize, what: &str) {
    assert!(
        wait_until(Duration::from_secs(20), || {
            let s = seen.lock().unwrap();
            let ids: HashSet<&[u8]> = s.iter().map(|m| &m.payload[..]).collect();
            ids.len() >= n
        }),
        "the subscriber never got all {n} results"
    );
    stop.store(true, Ordering::SeqCst);
    let late = first_seen_out_of_order(&seen.lock().unwrap(), n);
    assert!(
        late.is_empty(),
        "{} of {n} results first reached the subscriber after a later one, {what}: {:?}",
        late.len(),
        &late[..late.len().min(20)]
    );
}

/// A subscriber with a session the broker keeps (as the soak's watcher): every payload it
/// receives, in arrival order, across broker restarts.
fn persistent_subscriber(port: u16, filter: &str) -> Received {
    use rumqttc::{Client, Event as RE, MqttOptions, Packet, QoS};
    let mut opts = MqttOptions::new(support::unique_id("order-sub"), "127.0.0.1", port);
    opts.set_keep_alive(Duration::from_secs(5))
        .set_clean_session(false);
    let (client, mut conn) = Client::new(opts, 64);
    client.subscribe(filter, QoS::AtLeastOnce).unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let subscribed = Arc::new(AtomicBool::new(false));
    let (s2, st2, sub2) = (seen.clone(), stop.clone(), subscribed.clone());
    std::thread::spawn(move || {
        let _client = client;
        while !st2.load(Ordering::SeqCst) {
            match conn.recv_timeout(Duration::from_millis(50)) {
                Ok(Ok(RE::Incoming(Packet::SubAck(_)))) => sub2.store(true, Ordering::SeqCst),
                Ok(Ok(RE::Incoming(Packet::Publish(p)))) => {
                    s2.lock().unwrap().push(support::Seen {
                        topic: p.topic.clone(),
                        payload: p.payload.to_vec(),
                        retain: p.retain,
                    })
                }
                Ok(Err(_)) => std::thread::sleep(Duration::from_millis(50)),
                _ => {}
            }
        }
    });
    assert!(wait_until(Duration::from_secs(10), || subscribed
        .load(Ordering::SeqCst)));
    (seen, stop)
}

/// With an input filter, as the agent runs: the worker then also subscribes to `$SYS` on
/// every connection, and a SUBSCRIBE takes a packet id from the publishes' sequence.
fn start_publisher(port: u16, client_id: &str) -> (Mqtt, Events) {
    let (mqtt, rx) = Mqtt::start(&config(port, client_id), vec!["in/#".into()], 100).unwrap();
    connected(&rx);
    (mqtt, rx)
}

#[test]
fn results_reach_a_subscriber_in_order_through_connection_cuts() {
    let broker = Broker::start();
    let sub = persistent_subscriber(broker.port(), "out/#");
    let proxy = Proxy::start(broker.port());
    let (mqtt, rx) = start_publisher(proxy.port(), "cairn-order");
    let n = 20_000;
    let (mut acked, mut next, mut cuts) = (0usize, 0usize, 0usize);
    let deadline = Instant::now() + Duration::from_secs(60);
    while acked < n {
        assert!(Instant::now() < deadline, "only {acked} of {n} PubAcked");
        next = offer(&mqtt, next, n);
        // A cut every 1,000 acks, with the window full of unacknowledged results.
        if acked / 1000 > cuts {
            cuts += 1;
            proxy.cut();
        }
        acked += usize::from(one_acked(&rx, Duration::from_secs(5)));
    }
    assert_first_seen_in_order(&sub, n, &format!("over {cuts} cuts"));
    mqtt.shutdown();
}

/// The broker stopped (SIGTERM: mosquitto keeps both sessions) for 700 ms and started
/// again, results offered all the while: the soak's "broker outage".
fn outage(broker: &mut Broker, mqtt: &Mqtt, rx: &Events, next: &mut usize, end: usize) -> usize {
    broker.stop();
    let mut acked = 0;
    let back = Instant::now() + Duration::from_millis(700);
    while Instant::now() < back {
        *next = offer(mqtt, *next, end);
        acked += usize::from(one_acked(rx, Duration::from_millis(20)));
    }
    broker.restart();
    acked
}

#[test]
fn results_reach_a_subscriber_in_order_through_broker_restarts() {
    let mut broker = Broker::start();
    let sub = persistent_subscriber(broker.port(), "out/#");
    let (mqtt, rx) = start_publisher(broker.port(), "cairn-order-restart");
    let n = 12_000;
    let (mut acked, mut next, mut outages) = (0usize, 0usize, 0usize);
    let deadline = Instant::now() + Duration::from_secs(120);
    while acked < n {
        assert!(Instant::now() < deadline, "only {acked} of {n} PubAcked");
        next = offer(&mqtt, next, n);
        if acked / 3000 > outages {
            outages += 1;
            acked += outage(&mut broker, &mqtt, &rx, &mut next, n);
        }
        acked += usize::from(one_acked(&rx, Duration::from_secs(5)));
    }
    assert_first_seen_in_order(&sub, n, &format!("over {outages} broker restarts"));
    mqtt.shutdown();
}

/// As above with a new connection each round, the broker stopped soon after it connects,
/// as the soak's agents met it: started, a window of results out, the broker gone.
#[test]
fn results_reach_a_subscriber_in_order_when_the_broker_stops_soon_after_connecting() {
    let mut broker = Broker::start();
    let sub = persistent_subscriber(broker.port(), "out/#");
    let (per_round, rounds) = (400, 8);
    let mut next = 0usize;
    for round in 0..rounds {
        let (mqtt, rx) = start_publisher(broker.port(), "cairn-order-rounds");
        let end = next + per_round;
        let (mut acked, mut stopped) = (0usize, false);
        let deadline = Instant::now() + Duration::from_secs(60);
        while acked < per_round {
            assert!(
                Instant::now() < deadline,
                "round {round}: only {acked} PubAcked"
            );
            next = offer(&mqtt, next, end);
            if !stopped && acked >= 10 * (round + 1) {
                stopped = true;
                acked += outage(&mut broker, &mqtt, &rx, &mut next, end);
            }
            acked += usize::from(one_acked(&rx, Duration::from_secs(5)));
        }
        mqtt.shutdown();
    }
    assert_first_seen_in_order(&sub, per_round * rounds, "over fresh connections");
}

/// rumqttc re-sends what was unacknowledged when a connection ended in packet-id order,
/// starting after the last id the broker acknowledged. That is publish order only if ids
/// were handed out in it since that ack. A connection's SUBSCRIBEs take ids from the same
/// sequence (the inputs' filters, then `$SYS`), so on a new connection a full window of
/// results wraps around to id 1. With nothing acknowledged yet, the re-send then began
/// with the newest (99 of 300 late before `on_connack` took the publishes back). Here every
/// result of that window is held from the broker, the connection is cut, and the
/// subscriber must still see them in order.
#[test]
fn results_held_at_a_cut_before_any_ack_are_resent_in_order() {
    let broker = Broker::start();
    let sub = persistent_subscriber(broker.port(), "out/#");
    let proxy = Proxy::start(broker.port());
    let (mqtt, rx) = start_publisher(proxy.port(), "cairn-order-held");
    std::thread::sleep(Duration::from_millis(300)); // the SUBSCRIBEs are answered
    proxy.hold_upstream(true);
    let n = 300;
    let (mut acked, mut next, mut cut) = (0usize, 0usize, false);
    let deadline = Instant::now() + Duration::from_secs(60);
    while acked < n {
        assert!(Instant::now() < deadline, "only {acked} of {n} PubAcked");
        next = offer(&mqtt, next, n);
        if !cut && next >= 100 {
            cut = true;
            std::thread::sleep(Duration::from_millis(200)); // all of them written
            proxy.cut();
            proxy.hold_upstream(false);
        }
        acked += usize::from(one_acked(&rx, Duration::from_millis(200)));
    }
    assert_first_seen_in_order(&sub, n, "after a cut before any ack");
    mqtt.shutdown();
}
