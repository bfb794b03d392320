//! The ceiling: a plain relay (rumqttc: subscribe, auto-ack, republish; no storage).

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Duration;

use rumqttc::{Client, Event, MqttOptions, Packet, QoS};

use crate::measure::System;
use crate::procs::{Proc, Stats};
use crate::support::unique_id;

/// The ceiling: auto-ack, republish the payload to `relay/out/<key>`, no storage. It runs in
/// a process of its own (this bench binary again, with [`RELAY_ENV`] set), so that its CPU
/// time and RSS are measured like Cairn's, without the bench's publisher and sink.
pub(crate) struct Relay {
    pub(crate) proc: Proc,
}

/// Set to a broker port, this binary runs [`relay_main`] instead of the bench.
pub(crate) const RELAY_ENV: &str = "CAIRN_COMPARE_RELAY_PORT";

impl Relay {
    pub(crate) fn start(port: u16) -> Relay {
        let exe = std::env::current_exe().expect("the bench binary");
        let mut cmd = Command::new(exe);
        cmd.env(RELAY_ENV, port.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut proc = Proc::spawn(&mut cmd);
        let out = proc
            .child
            .as_mut()
            .and_then(|c| c.stdout.take())
            .expect("relay stdout");
        let mut line = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(out), &mut line)
            .expect("relay says it subscribed");
        assert_eq!(line.trim(), "subscribed", "relay did not subscribe");
        Relay { proc }
    }
}

/// The relay process: subscribe, republish each input, until killed. Polling and publishing
/// run on different threads (one thread doing both can deadlock rumqttc).
pub(crate) fn relay_main(port: u16) {
    let mut o = MqttOptions::new(unique_id("cmp-relay"), "127.0.0.1", port);
    o.set_keep_alive(Duration::from_secs(10)).set_inflight(100);
    let (client, mut conn) = Client::new(o, 1_000);
    client
        .subscribe("relay/in/#", QoS::AtLeastOnce)
        .expect("relay subscribe");
    // Unbounded: the polling thread must never wait on the publishing one (which may be
    // waiting for the polling thread to drain rumqttc's request channel).
    let (tx, rx) = std::sync::mpsc::channel::<(String, Vec<u8>)>();
    let out = client.clone();
    std::thread::spawn(move || {
        while let Ok((topic, body)) = rx.recv() {
            if out.publish(topic, QoS::AtLeastOnce, false, body).is_err() {
                break;
            }
        }
    });
    loop {
        match conn.recv_timeout(Duration::from_millis(50)) {
            Ok(Ok(Event::Incoming(Packet::SubAck(_)))) => {
                println!("subscribed");
                let _ = std::io::stdout().flush();
            }
            Ok(Ok(Event::Incoming(Packet::Publish(p)))) => {
                let topic = p.topic.replacen("relay/in", "relay/out", 1);
                if tx.send((topic, p.payload.to_vec())).is_err() {
                    break;
                }
            }
            Ok(Err(_)) => std::thread::sleep(Duration::from_millis(20)),
            _ => {}
        }
    }
}

impl System for Relay {
    fn name(&self) -> &'static str {
        "relay"
    }
    fn prefix(&self) -> &'static str {
        "relay"
    }
    fn stats(&self) -> Option<Stats> {
        Some(self.proc.stats())
    }
}
