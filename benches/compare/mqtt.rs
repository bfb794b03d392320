//! The broker every system shares, and the bench's own MQTT clients: one QoS 1 publisher
//! that notes each input's send time, and a sink per system that pairs each result with it.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rumqttc::{Client, Event, MqttOptions, Packet, QoS};

use crate::STEP_TIMEOUT;
use crate::stream::{SEED, event, key_of_topic, payload};
use crate::support::{Broker, BrokerConfig, unique_id, wait_until};

/// The shared test broker (tests/it/support) with `config/mosquitto.conf`'s settings that
/// matter here: the inflight window, deep queues, Nagle off, rare autosaves, and only
/// notice-level logging (every publish logged would cost throughput; notices still show
/// connections for `Broker::connections`).
pub(crate) fn start_broker(autosave_interval_s: u32) -> Broker {
    Broker::start_with(BrokerConfig {
        max_inflight: broker_inflight() as u32,
        autosave_interval_s,
        log_types: vec!["error", "warning", "notice"],
        extra: [
            "max_queued_bytes 0",
            "queue_qos0_messages false",
            "set_tcp_nodelay true",
            "autosave_on_changes false",
        ]
        .map(String::from)
        .to_vec(),
        ..BrokerConfig::default()
    })
}

/// mosquitto's `max_inflight_messages` for the run: how many inputs a subscriber may hold
/// unacknowledged. Cairn acknowledges after the fsync, so this is its fsync batch; the
/// shipped `config/mosquitto.conf` value unless CAIRN_COMPARE_INFLIGHT says otherwise.
pub(crate) fn broker_inflight() -> u64 {
    std::env::var("CAIRN_COMPARE_INFLIGHT")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            let conf = include_str!("../../config/mosquitto.conf");
            conf.lines()
                .find_map(|l| l.strip_prefix("max_inflight_messages "))
                .and_then(|v| v.trim().parse().ok())
                .expect("config/mosquitto.conf sets max_inflight_messages")
        })
}

/// Subscribes to `<prefix>/out/#`; pairs each result with its input's send time (per-key
/// FIFO, filled by the publisher), and keeps each key's latest (version, value, count).
pub(crate) struct Sink {
    pub(crate) shared: Arc<SinkShared>,
    pub(crate) client: Client,
}

#[derive(Default)]
pub(crate) struct SinkShared {
    pub(crate) stop: AtomicBool,
    pub(crate) subscribed: AtomicBool,
    pub(crate) results: AtomicUsize,
    pub(crate) last_us: AtomicU64,
    /// Per key: send times (µs since `t0`) of inputs whose result has not arrived.
    pub(crate) pending: Mutex<Vec<VecDeque<u64>>>,
    pub(crate) latencies_us: Mutex<Vec<u64>>,
    /// Per key: (version or arrival number, value, count) of the newest result.
    pub(crate) latest: Mutex<Latest>,
}

/// Per key number: (version or arrival number, value, count) of its newest result.
pub(crate) type Latest = HashMap<usize, (u64, f64, u64)>;

impl Sink {
    pub(crate) fn start(port: u16, prefix: &str, keys: u64, t0: Instant) -> Sink {
        let mut o = MqttOptions::new(unique_id("cmp-sink"), "127.0.0.1", port);
        o.set_keep_alive(Duration::from_secs(10))
            .set_max_packet_size(1 << 20, 1 << 20);
        let (client, mut conn) = Client::new(o, 10_000);
        client
            .subscribe(format!("{prefix}/out/#"), QoS::AtLeastOnce)
            .expect("subscribe");
        let shared = Arc::new(SinkShared {
            pending: Mutex::new(vec![VecDeque::new(); keys as usize]),
            ..Default::default()
        });
        let sh = shared.clone();
        std::thread::spawn(move || {
            let mut arrivals = 0u64;
            while !sh.stop.load(Ordering::SeqCst) {
                match conn.recv_timeout(Duration::from_millis(50)) {
                    Ok(Ok(Event::Incoming(Packet::SubAck(_)))) => {
                        sh.subscribed.store(true, Ordering::SeqCst)
                    }
                    Ok(Ok(Event::Incoming(Packet::Publish(p)))) => {
                        let at = t0.elapsed().as_micros() as u64;
                        arrivals += 1;
                        sh.on_result(&p.topic, &p.payload, at, arrivals);
                    }
                    Ok(Err(_)) => std::thread::sleep(Duration::from_millis(20)),
                    _ => {}
                }
            }
        });
        assert!(
            wait_until(Duration::from_secs(10), || shared
                .subscribed
                .load(Ordering::SeqCst)),
            "sink got no SUBACK"
        );
        Sink { shared, client }
    }

    pub(crate) fn results(&self) -> usize {
        self.shared.results.load(Ordering::SeqCst)
    }

    /// Forget latencies and counts; keeps the per-key FIFOs and latest values.
    pub(crate) fn reset(&self) -> usize {
        self.shared.latencies_us.lock().unwrap().clear();
        self.shared.results.swap(0, Ordering::SeqCst)
    }

    pub(crate) fn latest(&self) -> Latest {
        self.shared.latest.lock().unwrap().clone()
    }
}

impl SinkShared {
    pub(crate) fn on_result(&self, topic: &str, payload: &[u8], at: u64, arrival: u64) {
        let Some(k) = key_of_topic(topic) else { return };
        if let Some(sent) = self
            .pending
            .lock()
            .unwrap()
            .get_mut(k)
            .and_then(|q| q.pop_front())
        {
            self.latencies_us
                .lock()
                .unwrap()
                .push(at.saturating_sub(sent));
        }
        if let Ok(v) = serde_json::from_slice::<serde_json::Value>(payload) {
            // Cairn's results carry a per-key version (a re-send repeats an old one); the
            // others' results are ranked by arrival.
            let rank = v["version"].as_u64().unwrap_or(arrival);
            let value = v["value"].as_f64().unwrap_or(f64::NAN);
            let count = v["count"].as_u64().unwrap_or(0);
            let mut latest = self.latest.lock().unwrap();
            let e = latest.entry(k).or_insert((0, 0.0, 0));
            if rank >= e.0 {
                *e = (rank, value, count);
            }
        }
        self.last_us.store(at, Ordering::SeqCst);
        self.results.fetch_add(1, Ordering::SeqCst);
    }
}

impl Drop for Sink {
    fn drop(&mut self) {
        let _ = self.client.try_disconnect();
        self.shared.stop.store(true, Ordering::SeqCst);
    }
}

/// One QoS 1 publisher (inflight 100) for the whole bench.
pub(crate) struct Publisher {
    pub(crate) client: Client,
    pub(crate) acked: Arc<AtomicU64>,
    pub(crate) stop: Arc<AtomicBool>,
}

impl Publisher {
    pub(crate) fn start(port: u16) -> Publisher {
        let mut o = MqttOptions::new(unique_id("cmp-pub"), "127.0.0.1", port);
        o.set_keep_alive(Duration::from_secs(10)).set_inflight(100);
        let (client, mut conn) = Client::new(o, 1_000);
        let acked = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (a, s) = (acked.clone(), stop.clone());
        std::thread::spawn(move || {
            while !s.load(Ordering::SeqCst) {
                match conn.recv_timeout(Duration::from_millis(50)) {
                    Ok(Ok(Event::Incoming(Packet::PubAck(_)))) => {
                        a.fetch_add(1, Ordering::SeqCst);
                    }
                    Ok(Err(_)) => std::thread::sleep(Duration::from_millis(20)),
                    _ => {}
                }
            }
        });
        Publisher {
            client,
            acked,
            stop,
        }
    }

    /// Publish events `[from, to)` of the stream under `<prefix>/in/<key>` at `rate`/s (0:
    /// flat out); send times go into `sink`'s FIFOs. `progress` counts published inputs.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn send(
        &self,
        prefix: &str,
        tag: &str,
        range: std::ops::Range<u64>,
        keys: u64,
        rate: u64,
        sink: Option<&Sink>,
        t0: Instant,
        progress: Option<&AtomicU64>,
    ) {
        let acked0 = self.acked.load(Ordering::SeqCst);
        let n = range.end - range.start;
        let start = Instant::now();
        for i in range.clone() {
            if let Some(step) = ((i - range.start) * 1_000_000).checked_div(rate) {
                let due = start + Duration::from_micros(step);
                if let Some(wait) = due.checked_duration_since(Instant::now()) {
                    std::thread::sleep(wait);
                }
            }
            let (key, value) = event(SEED, i, keys);
            if let Some(s) = sink {
                let at = t0.elapsed().as_micros() as u64;
                s.shared.pending.lock().unwrap()[key as usize].push_back(at);
            }
            self.client
                .publish(
                    format!("{prefix}/in/k{key:06}"),
                    QoS::AtLeastOnce,
                    false,
                    payload(tag, i, key, value),
                )
                .expect("queue a publish");
            if let Some(p) = progress {
                p.store(i - range.start + 1, Ordering::SeqCst);
            }
        }
        let all = wait_until(STEP_TIMEOUT, || {
            self.acked.load(Ordering::SeqCst) - acked0 >= n
        });
        if !all {
            println!("  (publisher: not every PUBACK arrived within {STEP_TIMEOUT:?})");
        }
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        let _ = self.client.try_disconnect();
        self.stop.store(true, Ordering::SeqCst);
    }
}
