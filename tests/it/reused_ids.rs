//! A broker that reuses a packet id while an earlier message under it is unacknowledged.
//!
//! Mosquitto 2.0.11 gives each message queued for a session the next value of a 16-bit
//! counter and never checks that the id is free, so past 65,535 unacknowledged messages two
//! are in flight under one id; a PUBACK removes the first in flight with that id. An agent
//! far behind lets inputs go under backpressure (unacknowledged, for the broker to send
//! again after a reconnect) and acknowledges later ones: the ack of a later input under a
//! let-go one's id removes the let-go one from the broker, and it is lost
//! (`src/agent/held_ids.rs`).
//!
//! Queuing 65,536 messages in a real mosquitto to reach that takes minutes, and where the
//! reuse falls depends on timing; the scripted broker here does the same with ids reused
//! within a few hundred, on purpose, and keeps its session as mosquitto does: every
//! message stays in flight until a PUBACK removes the first in flight under its id, and a
//! new connection is sent everything still in flight, in order.

use std::collections::HashSet;
use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::json;

use crate::support::agent::{AgentConfig, CairnProcess};
use crate::support::{self, wait_until};

/// Inputs of the first burst: past what a 2 MiB log and the 4 MiB bound of held input take,
/// so that the last ones are let go.
const FIRST: usize = 150;
/// Inputs sent once the agent acknowledged `ACKS_BEFORE_SECOND`, under the ids of the first
/// burst's last ones (let go by then).
const SECOND: usize = 20;
const ACKS_BEFORE_SECOND: usize = 60;
const PAD: usize = 48 * 1024;

fn remaining_length(mut n: usize) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let mut b = (n % 128) as u8;
        n /= 128;
        if n > 0 {
            b |= 0x80;
        }
        out.push(b);
        if n == 0 {
            return out;
        }
    }
}

/// One input of the stream: its event ID and the packet id the broker gives it.
#[derive(Clone)]
struct Message {
    id: String,
    pkid: u16,
}

fn publish_packet(m: &Message, dup: bool) -> Vec<u8> {
    let topic = b"in/a";
    let payload = json!({"id": m.id, "k": "a", "pad": "p".repeat(PAD)}).to_string();
    let len = 2 + topic.len() + 2 + payload.len();
    let mut p = vec![if dup { 0x3a } else { 0x32 }];
    p.extend(remaining_length(len));
    p.extend_from_slice(&(topic.len() as u16).to_be_bytes());
    p.extend_from_slice(topic);
    p.extend_from_slice(&m.pkid.to_be_bytes());
    p.extend_from_slice(payload.as_bytes());
    p
}

/// The session the scripted broker keeps for the agent.
#[derive(Default)]
struct Session {
    /// Sent and not removed by a PUBACK, in the order sent.
    in_flight: Vec<Message>,
    /// Not sent yet.
    second: Vec<Message>,
    connections: usize,
    /// PUBACKs for our inputs, over all connections.
    acks: usize,
}

/// Serves connections one after another until `stop`.
fn scripted_broker(listener: TcpListener, session: Arc<Mutex<Session>>, stop: Arc<AtomicBool>) {
    listener
        .set_nonblocking(true)
        .expect("nonblocking listener");
    while !stop.load(Ordering::SeqCst) {
        let Ok((s, _)) = listener.accept() else {
            std::thread::sleep(Duration::from_millis(10));
            continue;
        };
        s.set_nonblocking(false).expect("blocking stream");
        serve(s, &session);
    }
}

fn serve(mut s: TcpStream, session: &Mutex<Session>) {
    let _ = s.set_read_timeout(Some(Duration::from_secs(30)));
    let mut subscribed_inputs = false;
    while let Some((head, body)) = support::read_mqtt_packet(&mut s) {
        let reply: Vec<u8> = match head >> 4 {
            1 => {
                // CONNECT → CONNACK, with the session from the second connection on.
                let mut ss = session.lock().unwrap();
                ss.connections += 1;
                vec![0x20, 2, u8::from(ss.connections > 1), 0]
            }
            8 => {
                // SUBSCRIBE → SUBACK, QoS 1 for every filter; then the inputs, once the input
                // filter is subscribed (the first connection) or at once (the others).
                let mut filters = 0;
                let mut at = 2;
                let mut inputs = false;
                while at + 2 <= body.len() {
                    let n = usize::from(u16::from_be_bytes([body[at], body[at + 1]]));
                    inputs |= body.get(at + 2..at + 2 + n) == Some(b"in/#".as_slice());
                    at += 2 + n + 1;
                    filters += 1;
                }
                let mut r = vec![0x90];
                r.extend(remaining_length(2 + filters));
                r.extend_from_slice(&body[..2]);
                r.extend(std::iter::repeat_n(1u8, filters));
                let first_time = inputs && !subscribed_inputs;
                subscribed_inputs |= inputs;
                let ss = session.lock().unwrap();
                if first_time || (ss.connections > 1 && !inputs) {
                    // The $SYS watch subscribes on every connection: on a later one, that
                    // SUBACK is where the session's messages follow.
                    let dup = ss.connections > 1;
                    for m in &ss.in_flight {
                        r.extend(publish_packet(m, dup));
                    }
                }
                r
            }
            12 => vec![0xd0, 0], // PINGREQ → PINGRESP
            3 => {
                // A result from the agent: PUBACK it (QoS 1; QoS 0 has no id).
                let tlen = usize::from(u16::from_be_bytes([body[0], body[1]]));
                if (head >> 1) & 3 > 0 {
                    vec![0x40, 2, body[2 + tlen], body[3 + tlen]]
                } else {
                    Vec::new()
                }
            }
            4 => {
                // PUBACK for one of our inputs: it removes the first in flight under its id.
                let pkid = u16::from_be_bytes([body[0], body[1]]);
                let mut ss = session.lock().unwrap();
                if let Some(i) = ss.in_flight.iter().position(|m| m.pkid == pkid) {
                    ss.in_flight.remove(i);
                }
                ss.acks += 1;
                if ss.acks == ACKS_BEFORE_SECOND {
                    let second = std::mem::take(&mut ss.second);
                    let mut r = Vec::new();
                    for m in &second {
                        r.extend(publish_packet(m, false));
                    }
                    ss.in_flight.extend(second);
                    r
                } else {
                    Vec::new()
                }
            }
            14 => return, // DISCONNECT
            _ => Vec::new(),
        };
        if s.write_all(&reply).is_err() {
            return;
        }
    }
}

/// The broker reuses the ids of inputs the agent let go, for inputs it sends while the agent
/// acknowledges again. Every input is counted once: none was removed from the broker by
/// the ack of another under its id.
#[test]
fn inputs_under_an_id_the_broker_reused_are_not_acknowledged_and_none_is_lost() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let first: Vec<Message> = (0..FIRST)
        .map(|i| Message {
            id: format!("e{i:04}"),
            pkid: (i + 1) as u16,
        })
        .collect();
    let second: Vec<Message> = (0..SECOND)
        .map(|i| Message {
            id: format!("e{:04}", FIRST + i),
            pkid: (FIRST - SECOND + i + 1) as u16,
        })
        .collect();
    let session = Arc::new(Mutex::new(Session {
        in_flight: first,
        second,
        ..Session::default()
    }));
    let stop = Arc::new(AtomicBool::new(false));
    let broker = {
        let (session, stop) = (session.clone(), stop.clone());
        std::thread::spawn(move || scripted_broker(listener, session, stop))
    };

    let pipelines = "[[pipeline]]\nname = \"n\"\ntopics = [\"in/#\"]\nevent_id = \"/id\"\n\
                     key = \"/k\"\naggregate = \"count\"\noutput_topic = \"out/n/{key}\"\n";
    let mut cfg = AgentConfig::new(port, pipelines);
    cfg.log = "segment_size = \"1MiB\"\nmax_size = \"2MiB\"\nretention = \"0s\"\n\
               commit_interval = \"2ms\"\nmax_payload = \"64KiB\"\n"
        .into();
    let mut agent = CairnProcess::new(&cfg);
    agent.start_connected();
    let total = FIRST + SECOND;
    let drained = wait_until(Duration::from_secs(120), || {
        let ss = session.lock().unwrap();
        ss.in_flight.is_empty() && ss.second.is_empty()
    });
    let status = agent.terminate();
    stop.store(true, Ordering::SeqCst);
    broker.join().expect("scripted broker");
    let err = agent.stderr();
    let (connections, acks) = {
        let ss = session.lock().unwrap();
        (ss.connections, ss.acks)
    };
    assert!(
        drained,
        "the broker still holds inputs after 120 s ({connections} connections, {acks} acks); \
         stderr:\n{}",
        agent.stderr_tail(40)
    );
    assert_eq!(status.code(), Some(0), "{}", agent.stderr_tail(40));
    assert!(
        err.contains("let go past the"),
        "nothing was let go under backpressure, so no id was reused while held; stderr:\n{}",
        agent.stderr_tail(40)
    );
    let state = agent.inspect("state");
    let count = state
        .iter()
        .find(|r| r["pipeline"] == "n" && r["key"] == "a")
        .and_then(|r| r["count"].as_u64());
    let logged: HashSet<String> = agent
        .inspect("dedup")
        .iter()
        .filter_map(|r| r["event_id"].as_str().map(str::to_string))
        .collect();
    let missing: Vec<String> = (0..total)
        .map(|i| format!("e{i:04}"))
        .filter(|id| !logged.contains(id))
        .collect();
    assert!(
        missing.is_empty(),
        "inputs the broker no longer holds and the agent never logged: {missing:?}"
    );
    assert_eq!(count, Some(total as u64), "{state:?}");
    assert!(
        err.contains("while an earlier one it holds"),
        "the reused id was not noticed; stderr:\n{}",
        agent.stderr_tail(40)
    );
}
