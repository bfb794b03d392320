//! The central side of an uplink test: a subscriber with a persistent session that records
//! every message it gets, across its broker's restarts (QoS 1, `clean_session = false`, so
//! what the broker queued while it was away arrives when it is back).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use super::{Seen, unique_id, wait_until};

pub struct DurableCollector {
    seen: Arc<Mutex<Vec<Seen>>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl DurableCollector {
    /// Returns once the broker confirmed the subscription.
    pub fn start(port: u16, filter: &str) -> DurableCollector {
        use rumqttc::{Client, Event, MqttOptions, Packet, QoS};
        let mut opts = MqttOptions::new(unique_id("central-sub"), "127.0.0.1", port);
        opts.set_keep_alive(Duration::from_secs(5))
            .set_clean_session(false)
            .set_max_packet_size(1 << 20, 1 << 20);
        let (client, mut conn) = Client::new(opts, 64);
        client
            .subscribe(filter, QoS::AtLeastOnce)
            .expect("queue central subscribe");
        let seen = Arc::new(Mutex::new(Vec::new()));
        let subscribed = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let (seen2, subscribed2, stop2) = (seen.clone(), subscribed.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            while !stop2.load(Ordering::SeqCst) {
                let Ok(event) = conn.recv_timeout(Duration::from_millis(50)) else {
                    continue;
                };
                match event {
                    Ok(Event::Incoming(Packet::SubAck(_))) => {
                        subscribed2.store(true, Ordering::SeqCst)
                    }
                    Ok(Event::Incoming(Packet::Publish(p))) => seen2.lock().unwrap().push(Seen {
                        topic: p.topic,
                        payload: p.payload.to_vec(),
                        retain: p.retain,
                    }),
                    Ok(_) => {}
                    // The broker is restarting: rumqttc reconnects on the next poll.
                    Err(_) => std::thread::sleep(Duration::from_millis(50)),
                }
            }
            let _ = client.try_disconnect();
        });
        assert!(
            wait_until(Duration::from_secs(10), || subscribed
                .load(Ordering::SeqCst)),
            "central collector did not get its SUBACK"
        );
        DurableCollector {
            seen,
            stop,
            thread: Some(thread),
        }
    }

    /// Every message so far, in arrival order.
    pub fn messages(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    pub fn count(&self) -> usize {
        self.seen.lock().unwrap().len()
    }
}

impl Drop for DurableCollector {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
