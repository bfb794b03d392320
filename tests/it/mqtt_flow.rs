//! Flow control of the mqtt module (issue 16): our PUBACKs for received messages must go out
//! while our own publish window is full and the broker has not acknowledged any of it.
//!
//! mosquitto acknowledges every publish at once, so it cannot hold our window full on demand.
//! The broker here is a scripted one on loopback that speaks just enough MQTT 3.1.1: it
//! accepts the connection and the subscription, never acknowledges our publishes, sends QoS 1
//! messages, and records the PUBACKs it gets. rumqttc 0.25.1 stops reading its request channel
//! (acks included) while its own outgoing window is full; with a window no larger than ours,
//! the PUBACKs below would never arrive.

use std::io::Write;
use std::net::TcpListener;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::time::{Duration, Instant};

use crate::support;
use cairn::config::MqttConfig;
use cairn::mqtt::{Event, Mqtt};

const STEP: Duration = Duration::from_secs(10);
const WINDOW: u16 = 4;
const MESSAGES: u16 = 50;

/// What the scripted broker saw, in order.
#[derive(Debug, PartialEq)]
enum Seen {
    Publish,
    PubAck(u16),
}

fn publish_packet(pkid: u16) -> Vec<u8> {
    let topic = b"in/x";
    let payload = format!("m{pkid}");
    let len = 2 + topic.len() + 2 + payload.len();
    let mut p = vec![0x32, len as u8, 0, topic.len() as u8];
    p.extend_from_slice(topic);
    p.extend_from_slice(&pkid.to_be_bytes());
    p.extend_from_slice(payload.as_bytes());
    p
}

/// Serves one connection: CONNACK, SUBACK, then `MESSAGES` QoS 1 publishes once `WINDOW` of
/// the client's publishes arrived (none acknowledged); reports what the client sends.
fn scripted_broker(listener: TcpListener, seen: Sender<Seen>) {
    let Ok((mut s, _)) = listener.accept() else {
        return;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(30)));
    let mut publishes = 0;
    while let Some((head, body)) = support::read_mqtt_packet(&mut s) {
        let reply: Vec<u8> = match head >> 4 {
            1 => vec![0x20, 2, 0, 0],                // CONNECT → CONNACK, no session
            8 => vec![0x90, 3, body[0], body[1], 1], // SUBSCRIBE → SUBACK QoS 1
            12 => vec![0xd0, 0],                     // PINGREQ → PINGRESP
            3 => {
                // Our PUBLISH: never acknowledged. Once the window is full, send messages.
                let _ = seen.send(Seen::Publish);
                publishes += 1;
                if publishes == WINDOW {
                    (1..=MESSAGES).flat_map(publish_packet).collect()
                } else {
                    Vec::new()
                }
            }
            4 => {
                let _ = seen.send(Seen::PubAck(u16::from_be_bytes([body[0], body[1]])));
                Vec::new()
            }
            14 => return, // DISCONNECT
            _ => Vec::new(),
        };
        if s.write_all(&reply).is_err() {
            return;
        }
    }
}

fn config(port: u16) -> MqttConfig {
    support::mqtt_config(port, "cairn-flow")
}

fn next(seen: &Receiver<Seen>, deadline: Instant) -> Option<Seen> {
    seen.recv_timeout(deadline.saturating_duration_since(Instant::now()))
        .ok()
}

#[test]
fn pubacks_go_out_while_our_publish_window_is_full_and_unacknowledged() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let (seen_tx, seen) = channel();
    let broker = std::thread::spawn(move || scripted_broker(listener, seen_tx));

    let (mqtt, rx) = Mqtt::start(&config(port), vec!["in/#".into()], WINDOW).unwrap();
    let deadline = Instant::now() + STEP;
    loop {
        match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(Event::Connected { .. }) => break,
            Ok(_) => {}
            Err(e) => panic!("no CONNACK: {e}"),
        }
    }
    for i in 0..WINDOW {
        mqtt.publish(format!("out-{i}"), "out/x", vec![1], false)
            .unwrap();
    }
    assert!(
        matches!(
            mqtt.publish("one-too-many".into(), "out/x", vec![1], false),
            Err(cairn::mqtt::MqttError::InflightFull { .. })
        ),
        "the window is ours to bound"
    );

    // Ack every message as it arrives, in receipt order.
    let mut received = 0;
    while received < MESSAGES {
        match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(Event::Message(m)) => {
                received += 1;
                mqtt.ack(m.token).unwrap();
            }
            Ok(Event::PubAcked { output_id }) => panic!("nothing was acked, yet {output_id}"),
            Ok(_) => {}
            Err(e) => panic!("{received} of {MESSAGES} messages arrived: {e}"),
        }
    }

    let mut acks = Vec::new();
    let mut publishes = 0;
    while acks.len() < usize::from(MESSAGES) {
        match next(&seen, deadline) {
            Some(Seen::Publish) => publishes += 1,
            Some(Seen::PubAck(pkid)) => acks.push(pkid),
            None => panic!(
                "the broker got {} of {MESSAGES} PUBACKs while {publishes} publishes waited \
                 for theirs",
                acks.len()
            ),
        }
    }
    assert_eq!(acks, (1..=MESSAGES).collect::<Vec<_>>(), "acks in order");
    assert_eq!(mqtt.inflight(), usize::from(WINDOW));
    mqtt.shutdown();
    broker.join().expect("scripted broker");
}
