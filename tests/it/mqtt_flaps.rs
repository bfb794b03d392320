//! A broker that accepts the connection and then drops it because of what we send on it
//! (issue 27): mosquitto 2.0 closes the socket of a client that publishes to a topic with a
//! Unicode non-character. The reconnects must follow the backoff, not restart it at every
//! CONNACK, and the `Disconnected` events must name the publish that keeps being refused.

use std::time::{Duration, Instant};

use crate::support::{self, Broker};
use cairn::mqtt::{Event, Mqtt};

#[test]
fn a_publish_the_broker_drops_us_for_is_named_and_retried_at_the_backoffs_pace() {
    let broker = Broker::start();
    let id = "cairn-flap";
    let (mqtt, rx) = Mqtt::start(&support::mqtt_config(broker.port(), id), vec![], 100).unwrap();
    let first = rx.recv_timeout(Duration::from_secs(10));
    assert!(matches!(first, Ok(Event::Connected { .. })), "{first:?}");
    let before = broker.connections(id);
    // U+FFFF is a non-character: MQTT lets a receiver treat the topic as malformed, and
    // mosquitto does, by closing the connection.
    mqtt.publish("o0".into(), "r/a", b"0".to_vec(), false)
        .unwrap();
    mqtt.publish("o1".into(), "r/\u{FFFF}", b"1".to_vec(), false)
        .unwrap();
    mqtt.publish("o2".into(), "r/b", b"2".to_vec(), false)
        .unwrap();

    let window = Duration::from_secs(3);
    let t0 = Instant::now();
    let mut acked = Vec::new();
    let mut drops = Vec::new();
    while t0.elapsed() < window {
        match rx.recv_timeout(window.saturating_sub(t0.elapsed())) {
            Ok(Event::PubAcked { output_id }) => acked.push(output_id),
            Ok(Event::Disconnected {
                unacked, up_for, ..
            }) => drops.push((acked.len(), unacked, up_for)),
            Ok(_) | Err(_) => {}
        }
    }
    let connects = broker.connections(id) - before;
    mqtt.shutdown();

    // 50 ms doubling to 400 ms, each delay at least half its bound: 25 + 50 + 100, then
    // 200 ms or more each: at most 17 connects in 3 s. Reset at every CONNACK (the bug),
    // every delay was 25-50 ms: 60-75 connects.
    assert!(
        (3..=18).contains(&connects),
        "{connects} connects in {window:?}; broker log:\n{}",
        broker.log()
    );
    // The first connection was up before the window, the last may still be up after it.
    assert!(
        drops.len().abs_diff(connects) <= 1,
        "one Disconnected per dropped connection: {} for {connects} connects",
        drops.len()
    );
    // The others get through (rumqttc re-sends them in a varying order), the refused one
    // never does.
    acked.sort();
    assert_eq!(acked, ["o0", "o2"]);
    for (n_acked, unacked, up_for) in &drops {
        assert_eq!(unacked.first().map(String::as_str), Some("o1"), "{drops:?}");
        if *n_acked == 2 {
            assert_eq!(unacked, &["o1"], "{drops:?}");
        }
        let up_for = up_for.expect("a connection was up");
        assert!(up_for < Duration::from_secs(1), "{drops:?}");
    }
}
