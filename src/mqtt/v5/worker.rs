//! The MQTT 5 connection's thread: polls rumqttc's v5 event loop, binds packet ids, reads
//! each PUBACK's reason, reconnects with backoff, and pumps the caller's publishes into
//! rumqttc while the broker's window has room.
//!
//! As on the 3.1.1 path (`../worker.rs`), everything runs on one current-thread runtime:
//! when a poll fails, rumqttc drains its request channel, and the handler below marks the
//! connection down before the pump can run again, so no publish handed to rumqttc can slip
//! into the next connection unaccounted for.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use log::debug;
use rumqttc::Outgoing;
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::mqttbytes::v5::{ConnAck, ConnectReturnCode, Packet};
use rumqttc::v5::{AsyncClient, ConnectionError, Event as V5Event, EventLoop, StateError};

use super::super::backoff::Reconnects;
use super::super::binding::Sent;
use super::super::{Event, Sink};
use super::{Inner, Limits, Queues, puback_reason};
use crate::config::MqttConfig;

/// How long shutdown waits for DISCONNECT to be written.
const DISCONNECT_GRACE: Duration = Duration::from_secs(1);
/// At most this many events are handed to the caller per wake-up.
const MAX_BATCH: usize = 64;

pub(super) struct Worker {
    eventloop: EventLoop,
    client: AsyncClient,
    inner: Arc<Inner>,
    events: Sink,
    /// Backoff, one `Disconnected` per down period, the journal lines of failures.
    reconnects: Reconnects,
    /// Our own window (`publish_inflight`); the broker's Receive Maximum may lower it.
    ours: usize,
    connected: bool,
    /// Events for the caller, handed over together by [`Self::flush`].
    batch: VecDeque<Event>,
}

impl Worker {
    pub(super) fn new(
        cfg: &MqttConfig,
        eventloop: EventLoop,
        client: AsyncClient,
        inner: Arc<Inner>,
        events: Sink,
    ) -> Worker {
        let ours = inner.lock().limits.window;
        Worker {
            eventloop,
            client,
            inner,
            events,
            reconnects: Reconnects::new(
                format!("{}:{} as {:?} (MQTT 5)", cfg.host, cfg.port, cfg.client_id),
                cfg.reconnect_min,
                cfg.reconnect_max,
            ),
            ours,
            connected: false,
            batch: VecDeque::with_capacity(MAX_BATCH),
        }
    }

    pub(super) async fn run(mut self) {
        let pump = tokio::spawn(pump_task(
            self.client.clone(),
            self.inner.clone(),
            self.events.clone(),
        ));
        while !self.stopping() {
            let polled = tokio::select! {
                // Only at shutdown is a poll abandoned half way (see the 3.1.1 worker).
                _ = self.inner.stop_wake.notified() => continue,
                polled = self.eventloop.poll() => polled,
            };
            match polled {
                Ok(event) => {
                    self.on_event(event);
                    // One read burst, one handoff (as on the 3.1.1 path).
                    while self.batch.len() < MAX_BATCH
                        && let Some(event) = self.eventloop.state.events.pop_front()
                    {
                        self.on_event(event);
                    }
                    self.flush().await;
                }
                Err(e) => self.on_error(e).await,
            }
        }
        self.disconnect().await;
        pump.abort();
        let mut q = self.inner.lock();
        q.stopped = true;
        q.live = false;
    }

    fn stopping(&self) -> bool {
        self.inner.stop.load(Ordering::SeqCst)
    }

    fn on_event(&mut self, event: V5Event) {
        match event {
            V5Event::Incoming(Packet::ConnAck(ack)) => self.on_connack(&ack),
            V5Event::Incoming(Packet::PubAck(ack)) => {
                let resolved = self.inner.lock().pubs.on_puback(ack.pkid);
                let Some(output_id) = resolved else {
                    crate::event!(error, "mqtt_unknown_puback"; "PUBACK for packet id {} that names no publish", ack.pkid);
                    return;
                };
                let (code, reason, delivered) = puback_reason(ack.reason);
                if delivered {
                    self.emit(Event::PubAcked { output_id });
                } else {
                    debug!(
                        "{} refused output {}: 0x{code:02X} {reason}",
                        self.reconnects.endpoint(),
                        crate::text::Shown(&output_id)
                    );
                    self.emit(Event::PubRefused {
                        output_id,
                        code,
                        reason,
                    });
                }
                // Room in the window.
                self.inner.wake.notify_one();
            }
            V5Event::Incoming(Packet::Publish(p)) => {
                // No subscriptions and no session: nothing should come. rumqttc acks it.
                crate::event!(warn, "mqtt_unexpected_message";
                    "{} sent a message on `{}` to a publish-only connection; dropped",
                    self.reconnects.endpoint(),
                    crate::text::Shown(&String::from_utf8_lossy(&p.topic))
                );
            }
            V5Event::Outgoing(Outgoing::Publish(pkid)) => {
                let sent = self.inner.lock().pubs.on_outgoing(pkid);
                match sent {
                    Sent::Bound(id) => debug!("packet id {pkid} is output {id}"),
                    Sent::Retransmit => debug!("packet id {pkid} retransmitted"),
                    Sent::Unexpected => {
                        crate::event!(error, "mqtt_unknown_publish_id"; "PUBLISH with packet id {pkid} that we did not queue")
                    }
                }
            }
            V5Event::Outgoing(Outgoing::AwaitAck(pkid)) => {
                crate::event!(warn, "mqtt_ack_out_of_order"; "packet id {pkid} is still in flight: the next publish waits for its PUBACK (the broker acked out of order, or a SUBSCRIBE's id made the window wrap)");
                self.inner.lock().pubs.on_await_ack(pkid);
            }
            _ => {}
        }
    }

    fn on_connack(&mut self, ack: &ConnAck) {
        let props = ack.properties.as_ref();
        // rumqttc sets the same window for itself (`max_outgoing_inflight`); a Receive
        // Maximum of 0 is a protocol error, taken as 1.
        let receive_max = props
            .and_then(|p| p.receive_max)
            .map_or(usize::MAX, |m| usize::from(m.max(1)));
        let limits = Limits {
            window: self.ours.min(receive_max),
            max_packet: props.and_then(|p| p.max_packet_size),
            retain: props.and_then(|p| p.retain_available) != Some(0),
            qos1: props.and_then(|p| p.max_qos) != Some(0),
        };
        let session_present = ack.session_present;
        let requeued = {
            let mut q = self.inner.lock();
            q.live = true;
            q.limits = limits;
            if session_present {
                0
            } else {
                // Clean start: rumqttc has just dropped everything it held for the last
                // connection, but not a parked collision.
                self.eventloop.state.collision = None;
                let requeued = q.pubs.requeue_all();
                // Everything is queued again: what the caller gave up goes now.
                for id in std::mem::take(&mut q.abandoned) {
                    if q.pubs.remove_queued(&id) {
                        crate::event!(info, "mqtt_publish_abandoned";
                            "gave up output {} for good, as asked",
                            crate::text::Shown(&id)
                        );
                    }
                }
                requeued
            }
        };
        self.connected = true;
        let again = self.reconnects.up(Instant::now());
        crate::event!(info, "mqtt_connected";
            "connected to {}{again}: window {} (Receive Maximum {}), maximum packet {}{}{}",
            self.reconnects.endpoint(),
            limits.window,
            props
                .and_then(|p| p.receive_max)
                .map_or("unset".into(), |m| m.to_string()),
            limits
                .max_packet
                .map_or("unset".into(), |m| format!("{m} bytes")),
            if limits.retain { "" } else { ", no retain" },
            if limits.qos1 { "" } else { ", QoS 0 only" },
        );
        if requeued > 0 {
            crate::event!(info, "mqtt_resending"; "re-sending {requeued} publishes without an outcome, in order");
        }
        self.emit(Event::Connected { session_present });
        self.inner.wake.notify_one();
    }

    /// A poll failed: what that means is [`Reconnects::poll_failed`]'s to decide, as for the
    /// 3.1.1 worker; this carries it out.
    async fn on_error(&mut self, e: ConnectionError) {
        let refused = matches!(e, ConnectionError::ConnectionRefused(_));
        let lost = self
            .connected
            .then(|| (self.connection_gone(), self.inner.lock().pubs.unacked()));
        let (disconnected, delay) = self.reconnects.poll_failed(describe(&e), refused, lost);
        self.batch.extend(disconnected);
        self.flush().await;
        super::super::wait_or_stop(delay, &self.inner.stop_wake).await;
    }

    /// The live connection is gone (rumqttc has cleaned up); what rumqttc buffered from it
    /// is taken now. Returns how long it was up.
    fn connection_gone(&mut self) -> Option<Duration> {
        self.connected = false;
        let up_for = self.reconnects.lost(Instant::now());
        // Synchronously after rumqttc's cleanup: the pump hands nothing more to it.
        self.inner.lock().live = false;
        // PUBACKs read before the failure still count; an `Outgoing::Publish` must bind
        // before the next CONNACK queues everything again.
        let buffered: Vec<_> = self.eventloop.state.events.drain(..).collect();
        for event in buffered {
            self.on_event(event);
        }
        up_for
    }

    /// Queues an event for the caller; [`Self::flush`] hands it over.
    fn emit(&mut self, event: Event) {
        self.batch.push_back(event);
    }

    /// Hands the queued events to the caller in order, waiting while its queue is full.
    async fn flush(&mut self) {
        self.events
            .hand_over(&mut self.batch, &self.inner.stop)
            .await;
    }

    /// Best effort: DISCONNECT, then poll until it is written.
    async fn disconnect(&mut self) {
        if !self.connected || self.client.try_disconnect().is_err() {
            return;
        }
        let deadline = tokio::time::sleep(DISCONNECT_GRACE);
        tokio::pin!(deadline);
        loop {
            tokio::select! {
                _ = &mut deadline => {
                    let endpoint = &self.reconnects.endpoint();
                    crate::event!(warn, "mqtt_disconnect_not_written"; "DISCONNECT to {endpoint} not written within {DISCONNECT_GRACE:?}");
                    return;
                }
                polled = self.eventloop.poll() => match polled {
                    Ok(V5Event::Outgoing(Outgoing::Disconnect)) => {
                        crate::event!(info, "mqtt_disconnected"; "disconnected from {}", self.reconnects.endpoint());
                        return;
                    }
                    Ok(_) => {}
                    Err(_) => return,
                },
            }
        }
    }
}

/// Wakes on every new publish, on room in the window and on a new connection; hands what
/// fits to rumqttc, and answers at once what the broker's limits rule out.
async fn pump_task(client: AsyncClient, inner: Arc<Inner>, events: Sink) {
    loop {
        inner.wake.notified().await;
        if inner.rest.swap(false, Ordering::SeqCst) {
            crate::alloc::flush_this_thread();
        }
        loop {
            let ruled_out = pump_once(&client, &mut inner.lock());
            let Some(event) = ruled_out else { break };
            // The outcome of a publish the caller waits for: it must arrive.
            if events.deliver(event).await.is_err() {
                return; // the caller is gone
            }
        }
    }
}

/// Hands queued publishes to rumqttc's request channel, in order, while a connection is up
/// and the window has room. Stops at the first one the connection's limits rule out: takes
/// it out and returns its outcome. Never awaits (so it cannot interleave with the event
/// loop's error handling); what does not fit waits for the next wake-up.
fn pump_once(client: &AsyncClient, q: &mut Queues) -> Option<Event> {
    if !q.live {
        return None;
    }
    while q.pubs.handed_len() < q.limits.window {
        let p = q.pubs.next_to_hand()?;
        if let Some(outcome) = q.limits.rule_out(p) {
            q.pubs.take_next();
            return Some(outcome);
        }
        let handed = client.try_publish(
            p.topic.clone(),
            QoS::AtLeastOnce,
            p.retain,
            p.payload.clone(),
        );
        if handed.is_err() {
            return None; // the channel is full: rumqttc takes one per turn
        }
        q.pubs.handed();
    }
    None
}

fn describe(e: &ConnectionError) -> String {
    match e {
        ConnectionError::ConnectionRefused(code) => {
            let why = match code {
                ConnectReturnCode::BadUserNamePassword => {
                    "bad user name or password (check username and password_file)"
                }
                ConnectReturnCode::NotAuthorized => {
                    "not authorized (check username, password_file and the broker's ACL)"
                }
                ConnectReturnCode::UnsupportedProtocolVersion
                | ConnectReturnCode::RefusedProtocolVersion => {
                    "MQTT 5 not supported (use protocol = \"3.1.1\" for this broker)"
                }
                ConnectReturnCode::ClientIdentifierNotValid | ConnectReturnCode::BadClientId => {
                    "client id rejected"
                }
                ConnectReturnCode::Banned => "banned",
                other => return format!("broker refused the connection: {other:?}"),
            };
            format!("broker refused the connection: {why}")
        }
        ConnectionError::MqttState(StateError::ServerDisconnect {
            reason_code,
            reason_string,
        }) => format!(
            "the broker disconnected us: {reason_code:?} (0x{:02X}){}",
            *reason_code as u8,
            reason_string
                .as_deref()
                .map(|s| format!(": {}", crate::text::Shown(s)))
                .unwrap_or_default()
        ),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mqtt::binding::Publishes;

    fn queues(window: usize, sizes: &[usize]) -> Queues {
        let mut pubs = Publishes::default();
        for (i, n) in sizes.iter().enumerate() {
            pubs.accept(format!("o{i}"), format!("t/{i}"), vec![0; *n], false);
        }
        Queues {
            pubs,
            abandoned: Vec::new(),
            live: true,
            limits: Limits {
                window,
                max_packet: Some(100),
                retain: true,
                qos1: true,
            },
            stopped: false,
        }
    }

    /// A client whose request channel stays open (its event loop is kept, never polled).
    fn client() -> (AsyncClient, EventLoop) {
        let opts = rumqttc::v5::MqttOptions::new("t", "127.0.0.1", 1);
        AsyncClient::new(opts, 64)
    }

    #[test]
    fn the_pump_fills_the_window_in_order() {
        let (client, _eventloop) = client();
        let mut q = queues(2, &[10, 10, 10]);
        assert!(pump_once(&client, &mut q).is_none());
        assert_eq!(q.pubs.handed_len(), 2, "the window");
        assert_eq!(
            q.pubs.next_to_hand().map(|p| p.output_id.as_str()),
            Some("o2")
        );
    }

    #[test]
    fn the_pump_takes_out_what_the_broker_cannot_take_and_goes_on() {
        let (client, _eventloop) = client();
        let mut q = queues(4, &[10, 500, 10]);
        let Some(Event::TooLarge {
            output_id,
            size,
            max,
        }) = pump_once(&client, &mut q)
        else {
            panic!("o1 is too large for a maximum packet of 100");
        };
        assert_eq!((output_id.as_str(), max), ("o1", 100));
        assert!(size > 500);
        assert_eq!(q.pubs.len(), 2, "taken out: it will never be sent");
        assert_eq!(q.pubs.handed_len(), 1, "o0, before it");
        assert!(pump_once(&client, &mut q).is_none());
        assert_eq!(q.pubs.handed_len(), 2, "o2, after it");
    }

    #[test]
    fn nothing_is_handed_while_the_connection_is_down() {
        let (client, _eventloop) = client();
        let mut q = queues(4, &[10, 10]);
        q.live = false;
        assert!(pump_once(&client, &mut q).is_none());
        assert_eq!(q.pubs.handed_len(), 0);
    }
}
