//! MQTT 5 for result connections (sinks): a PUBACK that can say no (issue 29).
//!
//! Under MQTT 3.1.1 a broker has no way to refuse a publish: mosquitto acknowledges one its
//! ACL denies and drops it (mosquitto issue 547), so a wrong ACL line at a central broker
//! silently lost every result of a fleet while the outbox deleted each on its PUBACK. Under
//! MQTT 5 the same broker answers 0x87 (not authorized). This connection is publish-only,
//! over rumqttc's v5 client (`rumqttc::v5`, the same pinned crate), with the API of the
//! 3.1.1 uplink: [`Mqtt5::publish`], [`Mqtt5::inflight`], its events on the caller's one
//! channel.
//!
//! # Guarantees
//!
//! - **Every [`Mqtt5::publish`] ends in exactly one outcome event** while the process lives,
//!   naming its output ID: [`Event::PubAcked`] for a PUBACK with reason 0x00 (success) or
//!   0x10 (no matching subscribers: delivered to the broker, nobody listens yet, which a
//!   retained result or a later subscriber makes good); [`Event::PubRefused`] for a reason
//!   code of 0x80 or more, with the code and its name: *not* delivered, and not settled here
//!   (rumqttc frees the packet id and only logs a warning, DESIGN §4; re-sending is the
//!   caller's, with backoff); [`Event::TooLarge`] for a result whose PUBLISH would exceed the
//!   broker's Maximum Packet Size, decided before sending. Packet ids are bound as on the
//!   3.1.1 path (`binding.rs`: a FIFO of output IDs bound by `Outgoing::Publish(pkid)`,
//!   resolved by the PUBACK's pkid); v5 offers nothing better to a client (no property of a
//!   PUBACK echoes anything of ours but the pkid).
//! - **What the broker says it cannot take is never sent.** Its CONNACK states a Maximum
//!   Packet Size, whether it takes retained messages, and the highest QoS it takes: a
//!   publish breaking one of them would make it close the connection, and re-sending it on
//!   the next would loop. Such a publish is answered at once instead (`TooLarge`, or
//!   `PubRefused` with 0x9A retain not supported / 0x9B QoS not supported) and taken out.
//! - **The broker's Receive Maximum is the window.** At most `min(publish_inflight, Receive
//!   Maximum)` publishes are unacknowledged on the wire; [`Mqtt5::publish`] refuses
//!   ([`MqttError::InflightFull`]) at that many accepted, and [`Mqtt5::window`] says it.
//! - **Reconnects** use the same backoff as every connection (`backoff.rs`: it starts again
//!   from its minimum only after a connection stayed up), and `Disconnected` names the
//!   publishes left unacknowledged, oldest first, as on the 3.1.1 path.
//!
//! # Mechanism
//!
//! One std thread runs a current-thread tokio runtime with two tasks: the rumqttc event
//! loop, polled only there (DESIGN §4), and a pump that hands the caller's queued publishes
//! to rumqttc's request channel while the window has room, checking each against the
//! broker's limits first. No session is kept (clean start): a publish-only connection has
//! nothing worth keeping in one, and on every new connection rumqttc forgets what it held
//! and every unacknowledged publish is queued again, in order, ahead of the rest
//! (`Publishes::requeue_all`), to be checked against the new connection's limits. As on
//! the 3.1.1 path, both tasks share one thread, so nothing reaches rumqttc between a
//! connection error (when it drains its request channel) and the moment the connection is
//! marked down. rumqttc's v5 event loop keeps its socket private, so publishes go through
//! its request channel one per turn (the 3.1.1 path writes them itself): what that costs
//! is measured by `benches/sink.rs`.

mod worker;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

use rumqttc::v5::AsyncClient;
use rumqttc::v5::mqttbytes::v5::PubAckReason;

use super::binding::{OutPublish, Publishes};
use super::{Event, Events, MqttError, Sink, admit_publish, events, give_up, options};
use crate::config::MqttConfig;

/// Room in rumqttc's request channel beyond one full window (DISCONNECT, a retry or two).
const REQUEST_CHANNEL_MARGIN: usize = 16;

/// A publish-only MQTT 5 connection for results. Dropping it disconnects.
pub struct Mqtt5 {
    inner: Arc<Inner>,
    thread: Option<JoinHandle<()>>,
}

/// State shared between the caller and the connection's thread.
pub(crate) struct Inner {
    queues: Mutex<Queues>,
    /// Wakes the pump: a new publish, room in the window, a new connection.
    wake: tokio::sync::Notify,
    /// Wakes the event-loop task to look at `stop`.
    stop_wake: tokio::sync::Notify,
    stop: AtomicBool,
    /// Give back the thread's allocation cache ([`Mqtt5::rest`]).
    rest: AtomicBool,
}

pub(crate) struct Queues {
    pubs: Publishes,
    /// Output IDs given up by the caller ([`Mqtt5::abandon`]) while handed to rumqttc:
    /// dropped when the next connection queues everything again.
    abandoned: Vec<String>,
    /// A connection is up (its CONNACK accepted) and `limits` are its.
    live: bool,
    limits: Limits,
    /// The thread has ended.
    stopped: bool,
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, Queues> {
        // As on the 3.1.1 path: the queues stay sound after a panic elsewhere.
        self.queues.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// What the broker's CONNACK allows: the window and what a publish must not break.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Limits {
    /// `min(publish_inflight, Receive Maximum)`.
    pub window: usize,
    /// Maximum Packet Size, if the broker set one.
    pub max_packet: Option<u32>,
    /// Retain Available (absent means yes).
    pub retain: bool,
    /// Maximum QoS of at least 1 (absent means 2).
    pub qos1: bool,
}

impl Limits {
    /// Before the first CONNACK: our own window, nothing else known.
    fn ours(publish_inflight: u16) -> Limits {
        Limits {
            window: usize::from(publish_inflight),
            max_packet: None,
            retain: true,
            qos1: true,
        }
    }

    /// The outcome for a publish these limits rule out, without sending it; `None` to send.
    pub(crate) fn rule_out(&self, p: &OutPublish) -> Option<Event> {
        let output_id = p.output_id.clone();
        let size = publish_packet_size(&p.topic, p.payload.len());
        if let Some(max) = self.max_packet
            && size > max as usize
        {
            return Some(Event::TooLarge {
                output_id,
                size,
                max,
            });
        }
        if !self.qos1 {
            return Some(Event::PubRefused {
                output_id,
                code: 0x9B,
                reason: "QoS not supported (the broker's CONNACK allows QoS 0 only)",
            });
        }
        if p.retain && !self.retain {
            return Some(Event::PubRefused {
                output_id,
                code: 0x9A,
                reason: "retain not supported (the broker's CONNACK says so)",
            });
        }
        None
    }
}

/// The size in bytes of the MQTT 5 PUBLISH we send for a result: QoS 1 (a packet id), no
/// properties. What rumqttc's codec compares with the broker's Maximum Packet Size.
pub(crate) fn publish_packet_size(topic: &str, payload_len: usize) -> usize {
    // Topic (length-prefixed), packet id, an empty property block, the payload.
    let remaining = 2 + topic.len() + 2 + 1 + payload_len;
    let length_bytes = match remaining {
        0..=127 => 1,
        128..=16_383 => 2,
        16_384..=2_097_151 => 3,
        _ => 4,
    };
    1 + length_bytes + remaining
}

/// A PUBACK's reason: its code, its name, and whether it means delivered (0x00, 0x10).
pub(crate) fn puback_reason(reason: PubAckReason) -> (u8, &'static str, bool) {
    match reason {
        PubAckReason::Success => (0x00, "success", true),
        PubAckReason::NoMatchingSubscribers => (0x10, "no matching subscribers", true),
        PubAckReason::UnspecifiedError => (0x80, "unspecified error", false),
        PubAckReason::ImplementationSpecificError => (0x83, "implementation specific error", false),
        PubAckReason::NotAuthorized => (0x87, "not authorized", false),
        PubAckReason::TopicNameInvalid => (0x90, "topic name invalid", false),
        PubAckReason::PacketIdentifierInUse => (0x91, "packet identifier in use", false),
        PubAckReason::QuotaExceeded => (0x97, "quota exceeded", false),
        PubAckReason::PayloadFormatInvalid => (0x99, "payload format invalid", false),
    }
}

impl Mqtt5 {
    /// A connection of its own with its own event channel (`cfg`'s capacity): for tests and
    /// benchmarks. The agent uses [`super::Mqtt::start_with_link`].
    pub fn start(cfg: &MqttConfig, publish_inflight: u16) -> Result<(Mqtt5, Events), MqttError> {
        let (tx, rx) = events::queue(cfg.channel_capacity);
        let sink = Sink {
            tx,
            uplink: false,
            tag: None,
        };
        Ok((Mqtt5::start_on(cfg, publish_inflight, sink)?, rx))
    }

    /// Validates the configuration, reads the password and TLS files, and starts the thread,
    /// which connects (and reconnects) in the background; events go to `events`.
    pub(crate) fn start_on(
        cfg: &MqttConfig,
        publish_inflight: u16,
        events: Sink,
    ) -> Result<Mqtt5, MqttError> {
        let opts = options::build_v5(cfg, publish_inflight)?;
        let (client, eventloop) =
            AsyncClient::new(opts, usize::from(publish_inflight) + REQUEST_CHANNEL_MARGIN);
        let inner = Arc::new(Inner {
            queues: Mutex::new(Queues {
                pubs: Publishes::default(),
                abandoned: Vec::new(),
                live: false,
                limits: Limits::ours(publish_inflight),
                stopped: false,
            }),
            wake: tokio::sync::Notify::new(),
            stop_wake: tokio::sync::Notify::new(),
            stop: AtomicBool::new(false),
            rest: AtomicBool::new(false),
        });
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .build()
            .map_err(MqttError::Start)?;
        let worker = worker::Worker::new(cfg, eventloop, client, inner.clone(), events);
        let thread = std::thread::Builder::new()
            .name("sink5".into())
            .spawn(move || {
                // Every result's packets pass through this thread, as on the 3.1.1 path.
                crate::alloc::cache_this_thread(true);
                runtime.block_on(worker.run())
            })
            .map_err(MqttError::Start)?;
        Ok(Mqtt5 {
            inner,
            thread: Some(thread),
        })
    }

    /// Queues a QoS 1 publish; it ends in one [`Event::PubAcked`], [`Event::PubRefused`] or
    /// [`Event::TooLarge`] carrying `output_id`. Returns at once: [`MqttError::InflightFull`]
    /// when [`Self::window`] publishes await their outcome. Publishes go out in call order.
    pub fn publish(
        &self,
        output_id: String,
        topic: &str,
        payload: Vec<u8>,
        retain: bool,
    ) -> Result<(), MqttError> {
        let mut q = self.inner.lock();
        admit_publish(topic, q.stopped, q.pubs.len(), q.limits.window)?;
        q.pubs.accept(output_id, topic.to_owned(), payload, retain);
        drop(q);
        self.inner.wake.notify_one();
        Ok(())
    }

    /// Gives up a publish for good (the caller set it aside as a dead letter for this
    /// destination). Queued, it goes at once; handed to rumqttc, it goes when the next
    /// connection queues every unacknowledged publish again, so it is never re-sent. No
    /// outcome event follows for it, except one already on its way.
    pub fn abandon(&self, output_id: &str) {
        let q = &mut *self.inner.lock();
        give_up(&mut q.pubs, &mut q.abandoned, output_id);
    }

    /// Publishes accepted and without an outcome yet (queued, on the wire, or queued again
    /// after a lost connection).
    pub fn inflight(&self) -> usize {
        self.inner.lock().pubs.len()
    }

    /// How many publishes may await their outcome at once: `min(publish_inflight, the
    /// broker's Receive Maximum)` once a CONNACK said it, `publish_inflight` before.
    pub fn window(&self) -> usize {
        self.inner.lock().limits.window
    }

    /// The caller is idle: the thread gives back its allocation cache (`crate::alloc`).
    pub fn rest(&self) {
        self.inner.rest.store(true, Ordering::SeqCst);
        self.inner.wake.notify_one();
    }

    /// Sends DISCONNECT if connected, waits up to a second for it to go out, and joins the
    /// thread. Publishes without an outcome are abandoned: the outbox still has them.
    pub fn shutdown(self) {
        drop(self);
    }
}

impl Drop for Mqtt5 {
    fn drop(&mut self) {
        self.inner.stop.store(true, Ordering::SeqCst);
        self.inner.stop_wake.notify_one();
        self.inner.wake.notify_one();
        if let Some(thread) = self.thread.take()
            && thread.join().is_err()
        {
            crate::event!(error, "mqtt_thread_panicked"; "the MQTT 5 thread panicked");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rumqttc::v5::mqttbytes::QoS;
    use rumqttc::v5::mqttbytes::v5::Publish;

    fn out(topic: &str, payload_len: usize, retain: bool) -> OutPublish {
        OutPublish {
            seq: 0,
            output_id: "o".into(),
            topic: topic.into(),
            payload: vec![b'x'; payload_len],
            retain,
        }
    }

    #[test]
    fn the_packet_size_is_what_rumqttc_writes_at_every_length_boundary() {
        for topic in ["t", "site/box-17/balances/acct-1", &"t".repeat(300)] {
            for payload in [
                0usize, 1, 100, 120, 127, 128, 16_000, 16_383, 16_384, 2_097_000,
            ] {
                for n in [payload, payload + 1, payload.saturating_sub(7)] {
                    let mut p = Publish::new(topic, QoS::AtLeastOnce, vec![0; n], None);
                    p.pkid = 1;
                    assert_eq!(
                        publish_packet_size(topic, n),
                        p.size(),
                        "topic of {} bytes, payload of {n}",
                        topic.len()
                    );
                }
            }
        }
    }

    #[test]
    fn a_publish_the_connack_rules_out_is_answered_without_sending() {
        let mut limits = Limits::ours(10);
        assert!(
            limits.rule_out(&out("t", 1 << 20, true)).is_none(),
            "nothing known yet"
        );
        limits.max_packet = Some(1000);
        let fits = (0..1000)
            .rev()
            .find(|&n| publish_packet_size("t", n) <= 1000)
            .unwrap();
        assert!(
            limits.rule_out(&out("t", fits, false)).is_none(),
            "exactly at the max"
        );
        assert!(matches!(
            limits.rule_out(&out("t", fits + 1, false)),
            Some(Event::TooLarge {
                size: 1001,
                max: 1000,
                ..
            })
        ));
        limits.retain = false;
        assert!(limits.rule_out(&out("t", 1, false)).is_none());
        assert!(matches!(
            limits.rule_out(&out("t", 1, true)),
            Some(Event::PubRefused { code: 0x9A, .. })
        ));
        limits.qos1 = false;
        assert!(matches!(
            limits.rule_out(&out("t", 1, false)),
            Some(Event::PubRefused { code: 0x9B, .. })
        ));
    }

    #[test]
    fn puback_reasons_below_0x80_are_delivered_and_the_others_are_refusals_with_their_code() {
        use PubAckReason::*;
        for (reason, code) in [
            (Success, 0x00),
            (NoMatchingSubscribers, 0x10),
            (UnspecifiedError, 0x80),
            (ImplementationSpecificError, 0x83),
            (NotAuthorized, 0x87),
            (TopicNameInvalid, 0x90),
            (PacketIdentifierInUse, 0x91),
            (QuotaExceeded, 0x97),
            (PayloadFormatInvalid, 0x99),
        ] {
            let (c, name, delivered) = puback_reason(reason);
            assert_eq!(c, code, "{reason:?}");
            assert_eq!(delivered, code < 0x80, "{reason:?}");
            assert!(!name.is_empty());
        }
        assert_eq!(puback_reason(NotAuthorized).1, "not authorized");
    }
}
