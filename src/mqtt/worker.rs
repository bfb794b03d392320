//! The MQTT thread: polls rumqttc's event loop, binds packet ids, reconnects with backoff,
//! and pumps the caller's queued publishes and acks into rumqttc.
//!
//! Everything here runs on one current-thread runtime. That matters: when a poll fails,
//! rumqttc drains its request channel into its retransmission queue, and the handler below
//! marks the connection down before any other task can run. So the pump never adds a request
//! that would survive into the next connection unaccounted for.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use log::debug;
use rumqttc::{
    AsyncClient, ConnectReturnCode, ConnectionError, EventLoop, Outgoing, Packet, PubAck, PubRec,
    QoS, Request, SubscribeFilter, SubscribeReasonCode,
};

use super::backoff::Reconnects;
use super::binding::{Handed, Sent};
use super::sys::SysWatch;
use super::{AckToken, Event, Incoming, Inner, Queues, Sink};
use crate::config::MqttConfig;

/// How long shutdown waits for DISCONNECT to be written.
const DISCONNECT_GRACE: Duration = Duration::from_secs(1);
/// How long a clean shutdown waits for the broker to close the connection after DISCONNECT.
const LINGER_GRACE: Duration = Duration::from_millis(500);
/// How long the thread rests after a turn that read from the broker, before it reads again:
/// what arrives meanwhile is then read in one burst, with one wake-up, not one each (see
/// [`pause_after`]).
const READ_PAUSE: Duration = Duration::from_micros(50);
/// A read that came this soon after the last turn ended is taken as load, worth a rest
/// ([`pause_after`]).
const BUSY_WAIT: Duration = Duration::from_micros(250);
/// rumqttc parses at most this many packets per read burst (its `readb` stops when a count
/// that starts at 1 reaches `max_readb_count`, 10, fixed in 0.25); a burst that long probably
/// left more in its buffer.
const FULL_BURST: usize = 9;
/// Acks waiting this long with none leaving are reported ([`watch_acks`]): the broker sends
/// nothing more while its in-flight window holds messages we have not acknowledged.
const ACK_STALL: Duration = Duration::from_secs(10);
/// How often the pump looks at the acks when nothing wakes it.
const ACK_WATCH_TICK: Duration = Duration::from_secs(1);
/// At most this many events are handed to the caller per wake-up (rumqttc reads at most 9
/// packets per burst, each of which can add an event or two).
const MAX_BATCH: usize = 64;

pub(crate) struct Worker {
    eventloop: EventLoop,
    client: AsyncClient,
    inner: Arc<Inner>,
    events: Sink,
    filters: Vec<String>,
    /// Backoff, one `Disconnected` per down period, the journal lines of failures.
    reconnects: Reconnects,
    /// Epoch of the current (or last) connection; 0 never names one.
    epoch: u64,
    connected: bool,
    /// Events for the caller, handed over together by [`Self::flush`].
    batch: VecDeque<Event>,
    /// Acks or publishes being written by [`Self::write_all`] (kept for its allocation).
    packets: Vec<Packet>,
    /// The broker's count of dropped messages, watched on the input connection (`sys.rs`);
    /// shared with the timer tasks of [`sys_timer`].
    sys: Option<Arc<Mutex<SysWatch>>>,
    subs: SubRequests,
}

impl Worker {
    pub(crate) fn new(
        cfg: &MqttConfig,
        eventloop: EventLoop,
        client: AsyncClient,
        inner: Arc<Inner>,
        events: Sink,
        filters: Vec<String>,
        watch_sys: bool,
    ) -> Worker {
        Worker {
            eventloop,
            client,
            inner,
            events,
            filters,
            reconnects: Reconnects::new(
                format!("{}:{} as {:?}", cfg.host, cfg.port, cfg.client_id),
                cfg.reconnect_min,
                cfg.reconnect_max,
            ),
            epoch: 0,
            connected: false,
            batch: VecDeque::with_capacity(MAX_BATCH),
            packets: Vec::new(),
            sys: watch_sys.then(Default::default),
            subs: SubRequests::default(),
        }
    }

    pub(crate) async fn run(mut self) {
        let pump = tokio::spawn(pump_task(self.client.clone(), self.inner.clone()));
        let mut turn_ended = Instant::now();
        while !self.stopping() {
            if !self.connected {
                // Before a connect attempt: what the caller gave up is not re-sent on it.
                self.apply_abandons();
            }
            let polled = tokio::select! {
                // Only at shutdown, and to drop the connection for a reconnect, do we abandon
                // a poll half way: the connection's state no longer matters, and rumqttc
                // changes its session state (what awaits a PUBACK) only between awaits.
                _ = self.inner.stop_wake.notified() => continue,
                _ = self.inner.reconnect_wake.notified() => None,
                polled = self.eventloop.poll() => Some(polled),
            };
            let waited = turn_ended.elapsed();
            let mut read = 0usize;
            match polled {
                None => {}
                Some(Ok(event)) => {
                    read += usize::from(matches!(event, rumqttc::Event::Incoming(_)));
                    self.on_event(event, false);
                    // One read burst, one handoff: rumqttc buffers every packet of the read
                    // that produced this event; take them all, then hand them over back to
                    // back, so the caller wakes once for the lot, not once per event.
                    while self.batch.len() < MAX_BATCH
                        && let Some(event) = self.eventloop.state.events.pop_front()
                    {
                        read += usize::from(matches!(event, rumqttc::Event::Incoming(_)));
                        self.on_event(event, false);
                    }
                    self.flush().await;
                }
                Some(Err(e)) => self.on_error(e).await,
            }
            self.write_acks().await;
            self.write_publishes().await;
            self.reconnect_if_asked().await;
            pump_once(&self.client, &self.inner, Some(1));
            if let Some(pause) = pause_after(read, waited)
                && !self.stopping()
            {
                // Blocking on purpose: nothing else runs on this thread but the pump, whose
                // work the next turn does anyway.
                std::thread::sleep(pause);
            }
            turn_ended = Instant::now();
        }
        self.disconnect().await;
        pump.abort();
        let mut q = self.inner.lock();
        q.stopped = true;
        q.live = None;
    }

    fn stopping(&self) -> bool {
        self.inner.stop.load(Ordering::SeqCst)
    }

    /// `stale`: the event was buffered by rumqttc on a connection that has since failed.
    /// Emitted events wait in `batch` for [`Self::flush`].
    fn on_event(&mut self, event: rumqttc::Event, stale: bool) {
        match event {
            rumqttc::Event::Incoming(Packet::ConnAck(ack)) => self.on_connack(ack.session_present),
            rumqttc::Event::Incoming(Packet::Publish(p))
                if self.sys.is_some() && SysWatch::takes(&p.topic, p.qos == QoS::AtMostOnce) =>
            {
                // The broker's `$SYS`, for the watch (`sys.rs`): never an input.
                let reports = match &self.sys {
                    Some(watch) => lock(watch).on_message(&p.topic, &p.payload),
                    None => Vec::new(),
                };
                for report in reports {
                    self.emit(Event::BrokerDrops(report));
                }
            }
            rumqttc::Event::Incoming(Packet::Publish(p)) => {
                let qos = match p.qos {
                    QoS::AtMostOnce => 0,
                    QoS::AtLeastOnce => 1,
                    QoS::ExactlyOnce => 2,
                };
                let token = AckToken {
                    // A message from the previous connection gets an epoch that is never
                    // live, so its ack is dropped and the broker redelivers it.
                    epoch: if stale { 0 } else { self.epoch },
                    pkid: p.pkid,
                    qos,
                };
                let msg = Incoming {
                    topic: p.topic,
                    payload: p.payload.to_vec(),
                    qos,
                    retain: p.retain,
                    dup: p.dup,
                    token,
                };
                self.emit(Event::Message(msg));
            }
            rumqttc::Event::Incoming(Packet::PubAck(ack)) => {
                let resolved = self.inner.lock().pubs.on_puback(ack.pkid);
                match resolved {
                    Some(output_id) => self.emit(Event::PubAcked { output_id }),
                    None => {
                        crate::event!(error, "mqtt_unknown_puback"; "PUBACK for packet id {} that names no publish", ack.pkid)
                    }
                }
            }
            rumqttc::Event::Incoming(Packet::SubAck(ack)) => match self.subs.acked(ack.pkid) {
                Some(SubKind::Inputs) | None => {
                    // From here on the broker queues input for this session: what was
                    // published before it, on a new session, went to no one.
                    crate::event!(info, "mqtt_subscribed";
                        "mqtt: subscribed to {} input filter(s) at {}",
                        ack.return_codes.len(),
                        self.reconnects.endpoint()
                    );
                    for (filter, code) in self.filters.iter().zip(&ack.return_codes) {
                        if *code == SubscribeReasonCode::Failure {
                            crate::event!(error, "mqtt_subscription_refused";
                                "broker {} refused the subscription {filter:?}",
                                self.reconnects.endpoint()
                            );
                        }
                    }
                }
                Some(SubKind::Sys) => {
                    let refused = SysWatch::filters()
                        .into_iter()
                        .zip(&ack.return_codes)
                        .find(|(_, code)| **code == SubscribeReasonCode::Failure)
                        .map(|(filter, _)| filter);
                    let report = self.sys.as_ref().and_then(|w| lock(w).suback(refused));
                    if let Some(report) = report {
                        self.emit(Event::BrokerDrops(report));
                    }
                }
            },
            rumqttc::Event::Outgoing(Outgoing::Subscribe(pkid)) => self.subs.sent(pkid),
            rumqttc::Event::Outgoing(Outgoing::Publish(pkid)) => {
                let sent = self.inner.lock().pubs.on_outgoing(pkid);
                match sent {
                    Sent::Bound(id) => debug!("packet id {pkid} is output {id}"),
                    Sent::Retransmit => debug!("packet id {pkid} retransmitted"),
                    Sent::Unexpected => {
                        crate::event!(error, "mqtt_unknown_publish_id"; "PUBLISH with packet id {pkid} that we did not queue")
                    }
                }
            }
            rumqttc::Event::Outgoing(Outgoing::PubAck(_) | Outgoing::PubRec(_)) => {
                let mut q = self.inner.lock();
                q.channel_acks = q.channel_acks.saturating_sub(1);
                q.ack_watch.left += 1;
            }
            rumqttc::Event::Outgoing(Outgoing::AwaitAck(pkid)) => {
                crate::event!(warn, "mqtt_ack_out_of_order"; "packet id {pkid} is still in flight: the next publish waits for its PUBACK (the broker acked out of order, or a SUBSCRIBE's id made the window wrap)");
                self.inner.lock().pubs.on_await_ack(pkid);
            }
            _ => {}
        }
    }

    fn on_connack(&mut self, session_present: bool) {
        self.epoch += 1;
        // A new connection re-sends what a reconnect was asked for.
        self.inner.reconnect.store(false, Ordering::SeqCst);
        self.connected = true;
        let requeued = {
            let mut q = self.inner.lock();
            q.live = Some(self.epoch);
            // rumqttc dropped the acks in its channel when the last connection failed.
            q.channel_acks = 0;
            if session_present {
                // rumqttc would re-send the unacknowledged publishes itself, in packet-id
                // order from the id after the last PUBACK. That is not publish order:
                // SUBSCRIBEs take ids from the same sequence, so a window of publishes wraps
                // to id 1 early, and before any PUBACK the re-send began with the newest
                // (`tests/it/mqtt_client.rs`,
                // `results_held_at_a_cut_before_any_ack_are_resent_in_order`; the soak saw
                // results of a key arrive out of order). A collision then parked one while
                // the rest of its queue went out. So we take them all back and send them
                // again in our order, under new ids: for QoS 1 the broker keeps nothing by
                // our packet id, and a re-send under another id is the same duplicate that
                // a retransmission is, dropped by ID downstream.
                self.eventloop
                    .pending
                    .retain(|r| !matches!(r, Request::Publish(_)));
            } else {
                // rumqttc dropped the requests it kept for the old session, SUBSCRIBEs too.
                self.subs.session_lost();
            }
            // rumqttc has cleared its retransmission queue (or we just did), but not a parked
            // collision, which would then wait for an ack that never comes.
            self.eventloop.state.collision = None;
            let n = q.pubs.requeue_all();
            if session_present { 0 } else { n }
        };
        if requeued > 0 {
            crate::event!(warn, "mqtt_session_lost";
                "broker {} had no session for us: re-sending {requeued} unacknowledged publishes",
                self.reconnects.endpoint()
            );
        }
        // Also on this process's first connection even if the broker kept our session: the
        // config may name filters that session never subscribed to (a new pipeline, a changed
        // topic), and re-subscribing an existing filter changes nothing for the broker. (It
        // does re-send retained messages on those topics; dedup by event ID drops them.)
        if (!session_present || !self.reconnects.ever_connected()) && !self.filters.is_empty() {
            let filters = self
                .filters
                .iter()
                .map(|f| SubscribeFilter::new(f.clone(), QoS::AtLeastOnce));
            // The request channel is empty here: the pump adds nothing while disconnected and
            // rumqttc drained it when the previous connection failed.
            match self.client.try_subscribe_many(filters) {
                Ok(()) => self.subs.asked(SubKind::Inputs),
                Err(e) => crate::event!(error, "mqtt_subscribe_failed";
                    "cannot queue SUBSCRIBE to {}: {e}",
                    self.reconnects.endpoint()
                ),
            }
        }
        self.watch_sys();
        let again = self.reconnects.up(Instant::now());
        crate::event!(info, "mqtt_connected";
            "connected to {}{again} (session present: {session_present})",
            self.reconnects.endpoint()
        );
        self.emit(Event::Connected { session_present });
    }

    /// A poll (or our own write) failed: what that means is [`Reconnects::poll_failed`]'s to
    /// decide, as for the MQTT 5 worker; this carries it out.
    async fn on_error(&mut self, e: ConnectionError) {
        let refused = matches!(e, ConnectionError::ConnectionRefused(_));
        let lost = self
            .connected
            .then(|| (self.connection_gone(), self.inner.lock().pubs.unacked()));
        let (disconnected, delay) = self.reconnects.poll_failed(describe(&e), refused, lost);
        self.batch.extend(disconnected);
        self.flush().await;
        super::wait_or_stop(delay, &self.inner.stop_wake).await;
    }

    /// On every connection: subscribe (again) to the broker's `$SYS` count of dropped
    /// messages, and call it unavailable if nothing comes ([`super::sys::WAIT`]). Again on every
    /// connection, not only when the session was lost: `$SYS` values are QoS 0, not queued
    /// for us while we were away, and a new subscription brings the retained ones.
    fn watch_sys(&mut self) {
        let Some(watch) = &self.sys else { return };
        let filters =
            SysWatch::filters().map(|f| SubscribeFilter::new(f.to_owned(), QoS::AtMostOnce));
        if let Err(e) = self.client.try_subscribe_many(filters) {
            crate::event!(error, "mqtt_subscribe_failed";
                "cannot queue SUBSCRIBE to $SYS on {}: {e}",
                self.reconnects.endpoint()
            );
            return;
        }
        self.subs.asked(SubKind::Sys);
        lock(watch).subscribed(self.epoch, Instant::now());
        tokio::spawn(sys_timer(watch.clone(), self.events.clone(), self.epoch));
    }

    /// The live connection is gone (rumqttc has cleaned up): no ack goes out on it any more,
    /// and what rumqttc buffered from it is taken now. Returns how long it was up.
    fn connection_gone(&mut self) -> Option<Duration> {
        self.connected = false;
        if let Some(watch) = &self.sys {
            lock(watch).down();
        }
        // SUBSCRIBEs written on it are never answered; those not written are in rumqttc's
        // queue for the next connection, first.
        self.subs.connection_gone();
        let up_for = self.reconnects.lost(Instant::now());
        // Synchronously after rumqttc's cleanup: see the module comment.
        self.inner.lock().live = None;
        // rumqttc would hand us these after the next CONNACK, mixed up with the new
        // connection (a PUBLISH whose ack must not go out on it, an `Outgoing::Publish` that
        // must bind before a lost session re-queues everything). Take them now.
        let buffered: Vec<_> = self.eventloop.state.events.drain(..).collect();
        for event in buffered {
            self.on_event(event, true);
        }
        self.check_unbound();
        up_for
    }

    /// [`super::Mqtt::reconnect`] was asked for: once the queued acks are written, drop the
    /// connection (the session stays with the broker) and let the next poll connect again,
    /// with no backoff.
    async fn reconnect_if_asked(&mut self) {
        if !self.connected || !self.inner.reconnect.load(Ordering::SeqCst) {
            return;
        }
        {
            let q = self.inner.lock();
            if !q.acks.is_empty() || q.channel_acks > 0 {
                return; // after the acks: they belong to this connection
            }
        }
        self.inner.reconnect.store(false, Ordering::SeqCst);
        self.eventloop.clean();
        let up_for = self.connection_gone();
        crate::event!(info, "mqtt_reconnect_for_redelivery";
            "dropped the connection to {} so that the broker re-sends what we have not \
             acknowledged; connecting again",
            self.reconnects.endpoint()
        );
        self.reconnects.announced();
        self.emit(Event::Disconnected {
            reason: "reconnecting for redelivery".into(),
            // Our doing, not the broker's: nothing here was refused.
            unacked: Vec::new(),
            up_for,
        });
        self.flush().await;
    }

    /// Takes the publishes the caller gave up ([`super::Mqtt::abandon`]) out of our binding
    /// and out of rumqttc's queue for the next connection. Only while the connection is
    /// down: rumqttc's cleanup has then moved everything unacknowledged into that queue
    /// (`EventLoop::pending`), the written ones under their packet ids, the others with 0 in
    /// the order of our unbound FIFO.
    fn apply_abandons(&mut self) {
        let mut q = self.inner.lock();
        for id in std::mem::take(&mut q.abandoned) {
            if q.pubs.remove_queued(&id) {
                continue;
            }
            let Some(handed) = q.pubs.remove_handed(&id) else {
                continue; // acknowledged meanwhile
            };
            let pending = &mut self.eventloop.pending;
            let at = match handed {
                Handed::Bound(pkid) => pending
                    .iter()
                    .position(|r| matches!(r, Request::Publish(p) if p.pkid == pkid)),
                Handed::Unbound(n) => pending
                    .iter()
                    .enumerate()
                    .filter(|(_, r)| matches!(r, Request::Publish(p) if p.pkid == 0))
                    .nth(n)
                    .map(|(at, _)| at),
                Handed::Collided => {
                    self.eventloop.state.collision = None;
                    None
                }
            };
            if let Some(at) = at {
                pending.remove(at);
            }
            crate::event!(info, "mqtt_publish_abandoned";
                "{}: gave up output {} for good, as asked: it is not sent again",
                self.reconnects.endpoint(),
                crate::text::Shown(&id)
            );
        }
    }

    /// After rumqttc's cleanup, every publish it took without a packet id sits in its
    /// retransmission queue with pkid 0 (or is the parked collision), and our unbound FIFO
    /// must hold exactly those. A mismatch is a bug that would shift the binding.
    fn check_unbound(&self) {
        let in_rumqttc = self
            .eventloop
            .pending
            .iter()
            .filter(|r| matches!(r, Request::Publish(p) if p.pkid == 0))
            .count()
            + usize::from(self.eventloop.state.collision.is_some());
        let ours = self.inner.lock().pubs.unbound_len();
        if in_rumqttc != ours {
            crate::event!(error, "mqtt_packet_id_mismatch"; "bug: {ours} publishes await a packet id, rumqttc holds {in_rumqttc}");
        }
    }

    /// Writes every queued ack of the live connection straight to the socket, one flush for
    /// all ([`Self::write_all`]). Not while an ack is in rumqttc's channel: these would
    /// overtake it.
    async fn write_acks(&mut self) {
        let mut packets = std::mem::take(&mut self.packets);
        {
            let mut q = self.inner.lock();
            if let Some(live) = q.live
                && q.channel_acks == 0
            {
                let before = packets.len();
                for t in q.acks.drain(..) {
                    if t.epoch != live {
                        debug!(
                            "dropped an ack for packet id {} from an earlier connection",
                            t.pkid
                        );
                    } else if t.qos >= 2 {
                        packets.push(Packet::PubRec(PubRec::new(t.pkid)));
                    } else {
                        packets.push(Packet::PubAck(PubAck::new(t.pkid)));
                    }
                }
                q.ack_watch.left += (packets.len() - before) as u64;
            }
            let state = &self.eventloop.state;
            let w = &mut q.ack_watch;
            w.turns += 1;
            w.inflight = state.inflight();
            w.window = self.eventloop.mqtt_options.inflight();
            w.collision = state.collision.is_some();
            w.pending = self.eventloop.pending.len();
        }
        self.write_all(packets).await;
    }

    /// Writes queued publishes straight to the socket, as many as rumqttc's window has room
    /// for, one flush for all, between two turns of the event loop. rumqttc takes one request
    /// per turn and flushes each on its own: a write (and, on loopback, the broker's receive
    /// path run in this thread) per result, the largest single cost per event (issue 16).
    ///
    /// Each publish goes through rumqttc's own state (`handle_outgoing_packet`: packet id,
    /// retransmission queue, the `Outgoing::Publish` event that binds it), all of them before
    /// the first await, exactly as rumqttc does for a request it takes; only the writing is
    /// ours. So a failed write leaves them where a failed turn would: in rumqttc's
    /// retransmission queue, bound in order. Not while anything of ours waits for a packet id
    /// inside rumqttc (the pump's doorbell publish in the request channel, publishes re-queued
    /// from the last connection, or these ones' events not yet read) nor during a collision:
    /// these would be overtaken.
    async fn write_publishes(&mut self) {
        if !self.connected
            || self.eventloop.network.is_none()
            || !self.eventloop.pending.is_empty()
            || self.eventloop.state.collision.is_some()
        {
            return;
        }
        let window = self.eventloop.mqtt_options.inflight();
        let mut packets = std::mem::take(&mut self.packets);
        let taken = {
            let mut q = self.inner.lock();
            if q.live.is_some() && q.pubs.unbound_len() == 0 {
                // rumqttc takes no request while its window is full, and an ack in its
                // channel holds back every ack after it: leave it a slot, or a steady
                // stream of results keeps the window full and input acks never leave.
                let window = window.saturating_sub(u16::from(q.channel_acks > 0));
                take_publishes(&mut q, &mut self.eventloop.state, window, &mut packets)
            } else {
                Ok(())
            }
        };
        if let Err(e) = taken {
            // As rumqttc's own turn ends on a state error: the connection goes. What was
            // taken before the error is in rumqttc's state, so `clean` queues it for
            // retransmission; its packets here must not be written on the next connection.
            packets.clear();
            self.packets = packets;
            self.eventloop.clean();
            self.on_error(ConnectionError::MqttState(e)).await;
            return;
        }
        self.write_all(packets).await;
    }

    /// Writes `packets` with one flush, between two turns of the event loop (nothing else
    /// uses the socket then; rumqttc does the same for a request it takes). A failed write is
    /// a connection error, handled as `poll` does. With no socket, nothing is written: the
    /// broker redelivers what these acks were for (publishes are not taken then).
    async fn write_all(&mut self, mut packets: Vec<Packet>) {
        let timeout = Duration::from_secs(self.eventloop.network_options.connection_timeout());
        let written = match self.eventloop.network.as_mut() {
            Some(network) if !packets.is_empty() => {
                async {
                    for packet in packets.drain(..) {
                        network.write(packet).await?;
                    }
                    match tokio::time::timeout(timeout, network.flush()).await {
                        Ok(flushed) => Ok(flushed?),
                        Err(_) => Err(ConnectionError::FlushTimeout),
                    }
                }
                .await
            }
            _ => Ok(()),
        };
        packets.clear();
        self.packets = packets;
        if let Err(e) = written {
            self.eventloop.clean();
            self.on_error(e).await;
        }
    }

    /// Queues an event for the caller; [`Self::flush`] hands it over.
    fn emit(&mut self, event: Event) {
        self.batch.push_back(event);
    }

    /// Hands the queued events to the caller in order, under one lock as far as there is
    /// room, waiting while its queue is full (that is the backpressure: we stop reading from
    /// the broker). Gives up at shutdown.
    async fn flush(&mut self) {
        self.events
            .hand_over(&mut self.batch, &self.inner.stop)
            .await;
    }

    /// After DISCONNECT is written, wait (briefly) for the broker to close the connection.
    /// Dropping the socket at once can lose what was written just before: PUBACKs that
    /// mosquitto had not read yet were seen redelivered after a clean client restart
    /// (tests/it/mqtt_client.rs, under load), so a closed socket is the proof they arrived.
    async fn linger(&mut self) {
        let grace = tokio::time::sleep(LINGER_GRACE);
        tokio::pin!(grace);
        loop {
            tokio::select! {
                _ = &mut grace => return,
                polled = self.eventloop.poll() => if polled.is_err() { return },
            }
        }
    }

    /// Best effort: queued acks first, then DISCONNECT, then poll until it is written.
    async fn disconnect(&mut self) {
        if !self.connected {
            return;
        }
        pump_once(&self.client, &self.inner, None);
        if self.client.try_disconnect().is_err() {
            return;
        }
        let deadline = tokio::time::sleep(DISCONNECT_GRACE);
        tokio::pin!(deadline);
        loop {
            tokio::select! {
                _ = &mut deadline => {
                    let endpoint = self.reconnects.endpoint();
                    crate::event!(warn, "mqtt_disconnect_not_written"; "DISCONNECT to {endpoint} not written within {DISCONNECT_GRACE:?}");
                    return;
                }
                polled = self.eventloop.poll() => match polled {
                    Ok(rumqttc::Event::Outgoing(Outgoing::Disconnect)) => {
                        self.linger().await;
                        crate::event!(info, "mqtt_disconnected"; "disconnected from {}", self.reconnects.endpoint());
                        return;
                    }
                    Ok(rumqttc::Event::Incoming(Packet::PubAck(ack))) => {
                        let resolved = self.inner.lock().pubs.on_puback(ack.pkid);
                        if let Some(output_id) = resolved {
                            let _ = self.events.try_send(Event::PubAcked { output_id });
                        }
                    }
                    Ok(rumqttc::Event::Outgoing(Outgoing::Publish(pkid))) => {
                        self.inner.lock().pubs.on_outgoing(pkid);
                    }
                    Ok(_) => {}
                    Err(_) => return,
                },
            }
        }
    }
}

/// [`super::sys::WAIT`] after subscribing on connection `epoch`: reports the count unavailable if
/// no `$SYS` message came meanwhile. A task of its own, because the worker only wakes for
/// rumqttc (a poll is never abandoned half way, see [`Worker::run`]); it sends straight to
/// the caller, after the watch has decided under its lock, so its report is never out of
/// order with the worker's.
async fn sys_timer(watch: Arc<Mutex<SysWatch>>, events: Sink, epoch: u64) {
    let Some(deadline) = lock(&watch).deadline() else {
        return;
    };
    tokio::time::sleep_until(deadline.into()).await;
    // Tokio's timer rounds to its own millisecond ticks and was seen to wake a fraction of
    // a millisecond before `Instant::now()` reached the deadline: it is the deadline here.
    let now = Instant::now().max(deadline);
    let Some(report) = lock(&watch).tick(epoch, now) else {
        return;
    };
    // A receiver that is gone needs no report.
    let _ = events.deliver(Event::BrokerDrops(report)).await;
}

fn lock(watch: &Mutex<SysWatch>) -> MutexGuard<'_, SysWatch> {
    // The watch is a few plain fields, whole after any panic.
    watch.lock().unwrap_or_else(|e| e.into_inner())
}

/// What each SUBSCRIBE we asked for was for, to read its SUBACK: asked in order, given a
/// packet id in that order (`Outgoing::Subscribe`), answered by packet id.
#[derive(Debug, Default)]
struct SubRequests {
    /// Asked (in rumqttc's request channel or its queue for the next connection), no packet
    /// id yet; front = oldest.
    asked: VecDeque<SubKind>,
    /// Written, awaiting their SUBACK.
    sent: Vec<(u16, SubKind)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SubKind {
    /// The pipelines' filters.
    Inputs,
    /// The broker's `$SYS` count of dropped messages.
    Sys,
}

impl SubRequests {
    fn asked(&mut self, kind: SubKind) {
        self.asked.push_back(kind);
    }

    fn sent(&mut self, pkid: u16) {
        if let Some(kind) = self.asked.pop_front() {
            self.sent.retain(|(p, _)| *p != pkid);
            self.sent.push((pkid, kind));
        }
    }

    fn acked(&mut self, pkid: u16) -> Option<SubKind> {
        let at = self.sent.iter().position(|(p, _)| *p == pkid)?;
        Some(self.sent.swap_remove(at).1)
    }

    /// The connection is gone: written SUBSCRIBEs get no answer.
    fn connection_gone(&mut self) {
        self.sent.clear();
    }

    /// The broker kept no session: rumqttc dropped the requests it held for it.
    fn session_lost(&mut self) {
        self.asked.clear();
    }
}

/// The rest after a turn that read `read` packets from the broker, `waited` after the last
/// turn ended: [`READ_PAUSE`] after a short burst that came soon ([`BUSY_WAIT`]), none after
/// a full burst (more is waiting), a turn that read nothing (the caller's acks and publishes,
/// a timer), or one that came after a longer quiet spell.
///
/// The broker sends each message as its publisher's arrives, so under load this thread woke,
/// read one packet and slept again for every message: 0.99 wake-ups and 12.2 µs of CPU per
/// event, more than the relay spends in all (issue 16). With the rest, 0.24 wake-ups and
/// 4.8 µs, and 20% more throughput. A message that arrives alone is read at once; one that
/// arrives in the rest waits at most that long (plus the kernel's timer slack, 50 µs), a
/// small part of the group commit it waits for anyway (`log.commit_interval`, 5 ms). When
/// messages come further apart than a rest catches, it would only add a wake-up of its own
/// per message (at 1,000 inputs/s: 60 → 73 µs of CPU per input), hence `BUSY_WAIT`.
fn pause_after(read: usize, waited: Duration) -> Option<Duration> {
    (read > 0 && read < FULL_BURST && waited < BUSY_WAIT).then_some(READ_PAUSE)
}

/// Wakes on every new publish or ack from the caller, and when it rests
/// ([`super::Mqtt::rest`]).
async fn pump_task(client: AsyncClient, inner: Arc<Inner>) {
    loop {
        tokio::select! {
            _ = inner.wake.notified() => {}
            _ = tokio::time::sleep(ACK_WATCH_TICK) => {
                watch_acks(&inner, Instant::now());
                continue;
            }
        }
        if inner.rest.swap(false, Ordering::SeqCst) {
            crate::alloc::flush_this_thread();
        }
        pump_once(&client, &inner, Some(1));
    }
}

/// How acks have been leaving, and what the event loop looked like at its last turn: the
/// facts a report of stalled acks needs ([`watch_acks`]).
#[derive(Debug, Default)]
pub(crate) struct AckWatch {
    /// Acks that left: written by the worker, or taken by rumqttc from its channel.
    left: u64,
    /// Turns of the event loop so far.
    turns: u64,
    /// At the last turn: rumqttc's publishes in flight, its window, a parked collision, its
    /// re-queued requests.
    inflight: u16,
    window: u16,
    collision: bool,
    pending: usize,
    /// Acks wait and none has left since: `left` and `turns` then, and when.
    stalled: Option<(u64, u64, Instant)>,
    reported: bool,
}

/// Reports acks that wait on a live connection with none leaving for [`ACK_STALL`]: the
/// broker then holds its in-flight window of messages for us and sends nothing more, so input
/// stops with no other sign. Once per stall, with what keeps them.
fn watch_acks(inner: &Inner, now: Instant) {
    let mut q = inner.lock();
    let waiting = q.live.is_some() && (!q.acks.is_empty() || q.channel_acks > 0);
    let (queued, in_channel, unbound) = (q.acks.len(), q.channel_acks, q.pubs.unbound_len());
    let w = &mut q.ack_watch;
    if let Some((waited, turns)) = w.stalled(waiting, now) {
        crate::event!(warn, "mqtt_acks_stalled";
            "{queued} acks queued and {in_channel} in rumqttc's request channel have waited {} s \
             with none leaving; {turns} event-loop turns since; at the last turn {}/{} \
             publishes in flight, collision {}, {} requests re-queued, {unbound} publishes \
             awaiting a packet id",
            waited.as_secs(),
            w.inflight,
            w.window,
            w.collision,
            w.pending
        );
    }
}

impl AckWatch {
    /// Whether acks that are `waiting` now have waited [`ACK_STALL`] with none leaving: how
    /// long, and how many event-loop turns passed meanwhile. Once per stall.
    fn stalled(&mut self, waiting: bool, now: Instant) -> Option<(Duration, u64)> {
        if !waiting {
            self.stalled = None;
            return None;
        }
        match self.stalled {
            Some((left, turns, since)) if left == self.left => {
                let waited = now.saturating_duration_since(since);
                if self.reported || waited < ACK_STALL {
                    return None;
                }
                self.reported = true;
                Some((waited, self.turns - turns))
            }
            _ => {
                self.stalled = Some((self.left, self.turns, now));
                self.reported = false;
                None
            }
        }
    }
}

/// Moves queued acks and publishes into rumqttc's request channel, as far as it has room.
/// Never awaits (so it cannot interleave with the event loop's error handling) and never
/// blocks; what does not fit waits for the next event-loop event, which every request rumqttc
/// takes produces.
///
/// Acks: rumqttc takes one request per turn of its event loop and flushes each on its own,
/// while a turn may read ten packets, so acks sent this way fell ever further behind a broker
/// sending a backlog (940k of 1M were once waiting). The worker writes them itself after each
/// turn ([`Worker::write_acks`]), all at once. Here at most `ack_limit` acks (the worker's
/// loop passes 1) go through the channel: one is the doorbell that ends an idle event-loop
/// turn so the worker writes the rest, and while it is in the channel no ack is written past
/// it. `None` (at shutdown) sends them all this way.
fn pump_once(client: &AsyncClient, inner: &Inner, ack_limit: Option<usize>) {
    let mut q = inner.lock();
    let Some(live) = q.live else {
        let dropped = q.acks.len();
        if dropped > 0 {
            q.acks.clear();
            debug!("dropped {dropped} acks queued while disconnected; the broker redelivers");
        }
        return;
    };
    while let Some(token) = q.acks.front() {
        if ack_limit.is_some_and(|limit| q.channel_acks >= limit) {
            break;
        }
        if token.epoch == live {
            let qos = if token.qos >= 2 {
                QoS::ExactlyOnce
            } else {
                QoS::AtLeastOnce
            };
            let mut publish = rumqttc::Publish::new("", qos, Vec::new());
            publish.pkid = token.pkid;
            if client.try_ack(&publish).is_err() {
                break;
            }
            q.channel_acks += 1;
        } else {
            debug!(
                "dropped an ack for packet id {} from an earlier connection",
                token.pkid
            );
        }
        q.acks.pop_front();
    }
    // Publishes: one, as the doorbell that ends an idle turn so that the worker writes the
    // rest itself ([`Worker::write_publishes`]); none while one of ours waits inside rumqttc
    // for a packet id, since a publish in the channel stops the worker's writes until rumqttc
    // has taken it.
    if q.pubs.unbound_len() == 0
        && let Some(p) = q.pubs.next_to_hand()
    {
        let handed = client.try_publish(
            p.topic.clone(),
            QoS::AtLeastOnce,
            p.retain,
            p.payload.clone(),
        );
        if handed.is_ok() {
            q.pubs.handed();
        }
    }
}

/// Takes queued publishes into rumqttc's state while its window has room (see
/// [`Worker::write_publishes`]); their packets, to be written, go to `packets`. Stops at a
/// collision (rumqttc parks that publish and reports `AwaitAck`, as for one it takes itself).
fn take_publishes(
    q: &mut Queues,
    state: &mut rumqttc::MqttState,
    window: u16,
    packets: &mut Vec<Packet>,
) -> Result<(), rumqttc::StateError> {
    while state.inflight() < window
        && state.collision.is_none()
        && let Some(p) = q.pubs.next_to_hand()
    {
        let mut publish =
            rumqttc::Publish::new(p.topic.clone(), QoS::AtLeastOnce, p.payload.clone());
        publish.retain = p.retain;
        let packet = state.handle_outgoing_packet(Request::Publish(publish))?;
        q.pubs.handed();
        packets.extend(packet);
    }
    Ok(())
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
                ConnectReturnCode::BadClientId => "client id rejected",
                ConnectReturnCode::ServiceUnavailable => "service unavailable",
                ConnectReturnCode::RefusedProtocolVersion => "MQTT 3.1.1 not supported",
                ConnectReturnCode::Success => "success code in a refusal",
            };
            format!("broker refused the connection: {why}")
        }
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mqtt::binding::Publishes;

    fn queues(n: usize) -> Queues {
        let mut pubs = Publishes::default();
        for i in 0..n {
            pubs.accept(format!("o{i}"), format!("t/{i}"), vec![i as u8], false);
        }
        Queues {
            pubs,
            abandoned: Vec::new(),
            acks: VecDeque::new(),
            live: Some(1),
            channel_acks: 0,
            ack_watch: AckWatch::default(),
            stopped: false,
        }
    }

    fn outgoing(state: &mut rumqttc::MqttState) -> Vec<rumqttc::Event> {
        state.events.drain(..).collect()
    }

    #[test]
    fn publishes_are_taken_in_order_as_far_as_the_window_has_room_and_bind_in_that_order() {
        let mut q = queues(5);
        let mut state = rumqttc::MqttState::new(4, true);
        let mut packets = Vec::new();
        take_publishes(&mut q, &mut state, 3, &mut packets).unwrap();
        let topics: Vec<_> = packets
            .iter()
            .map(|p| match p {
                Packet::Publish(p) => (p.topic.clone(), p.pkid),
                other => panic!("not a publish: {other:?}"),
            })
            .collect();
        assert_eq!(
            topics,
            [("t/0".into(), 1), ("t/1".into(), 2), ("t/2".into(), 3)]
        );
        assert_eq!(state.inflight(), 3);
        // Bound exactly as rumqttc's events say, as if it had taken them itself.
        for event in outgoing(&mut state) {
            let rumqttc::Event::Outgoing(Outgoing::Publish(pkid)) = event else {
                panic!("unexpected event {event:?}");
            };
            assert_eq!(
                q.pubs.on_outgoing(pkid),
                Sent::Bound(format!("o{}", pkid - 1))
            );
        }
        // The other two wait for room.
        assert_eq!(q.pubs.len(), 5);
        assert_eq!(q.pubs.next_to_hand().map(|p| p.topic.as_str()), Some("t/3"));
        packets.clear();
        take_publishes(&mut q, &mut state, 3, &mut packets).unwrap();
        assert!(packets.is_empty(), "took a publish with the window full");
    }

    #[test]
    fn a_collision_stops_taking_and_parks_that_publish_as_rumqttc_would() {
        let mut q = queues(4);
        let mut state = rumqttc::MqttState::new(2, true);
        let mut packets = Vec::new();
        // A window of 2: packet ids 1 and 2, then the next wraps round to 1.
        take_publishes(&mut q, &mut state, 2, &mut packets).unwrap();
        assert_eq!(packets.len(), 2);
        for event in outgoing(&mut state) {
            if let rumqttc::Event::Outgoing(Outgoing::Publish(pkid)) = event {
                q.pubs.on_outgoing(pkid);
            }
        }
        // The broker acks 2 but not 1 (out of order): the window has room, pkid 1 is taken.
        state
            .handle_incoming_packet(Packet::PubAck(PubAck::new(2)))
            .unwrap();
        assert_eq!(q.pubs.on_puback(2).as_deref(), Some("o1"));
        outgoing(&mut state);
        packets.clear();
        take_publishes(&mut q, &mut state, 2, &mut packets).unwrap();
        assert!(
            packets.is_empty(),
            "wrote a publish over an unacked packet id"
        );
        assert!(state.collision.is_some());
        assert_eq!(
            outgoing(&mut state),
            [rumqttc::Event::Outgoing(Outgoing::AwaitAck(1))]
        );
        // Handed, and parked by the binding when that event is read; the next one waits.
        assert_eq!(q.pubs.next_to_hand().map(|p| p.topic.as_str()), Some("t/3"));
        q.pubs.on_await_ack(1);
        assert_eq!(q.pubs.unbound_len(), 1);
    }

    #[test]
    fn each_suback_is_read_as_the_subscribe_it_answers_across_reconnects() {
        let mut subs = SubRequests::default();
        subs.asked(SubKind::Inputs);
        subs.asked(SubKind::Sys);
        subs.sent(1);
        subs.sent(2);
        assert_eq!(subs.acked(2), Some(SubKind::Sys));
        assert_eq!(subs.acked(2), None, "answered once");
        // Lost before its SUBACK: never answered. One asked and not sent yet goes out
        // first on the next connection (rumqttc's queue for it), before the new ones.
        subs.asked(SubKind::Sys);
        subs.connection_gone();
        assert_eq!(subs.acked(1), None);
        subs.asked(SubKind::Inputs);
        subs.sent(7);
        subs.sent(8);
        assert_eq!(subs.acked(7), Some(SubKind::Sys));
        assert_eq!(subs.acked(8), Some(SubKind::Inputs));
        // A broker without our session: rumqttc dropped what it kept for it.
        subs.asked(SubKind::Inputs);
        subs.session_lost();
        subs.asked(SubKind::Sys);
        subs.sent(3);
        assert_eq!(subs.acked(3), Some(SubKind::Sys));
    }

    #[test]
    fn the_thread_rests_after_a_short_read_burst_under_load_only() {
        let soon = Duration::ZERO;
        assert_eq!(pause_after(0, soon), None, "a turn that read nothing");
        assert_eq!(pause_after(1, soon), Some(READ_PAUSE));
        assert_eq!(pause_after(FULL_BURST - 1, soon), Some(READ_PAUSE));
        assert_eq!(pause_after(FULL_BURST, soon), None, "more is waiting");
        assert_eq!(
            pause_after(1, BUSY_WAIT - Duration::from_micros(1)),
            Some(READ_PAUSE)
        );
        assert_eq!(pause_after(1, BUSY_WAIT), None, "after a quiet spell");
        assert!(READ_PAUSE <= Duration::from_micros(100));
    }

    #[test]
    fn the_pump_hands_one_publish_as_a_doorbell_and_none_while_one_awaits_a_packet_id() {
        let opts = rumqttc::MqttOptions::new("t", "127.0.0.1", 1);
        let (client, _eventloop) = AsyncClient::new(opts, 10);
        let inner = Inner {
            queues: std::sync::Mutex::new(queues(3)),
            wake: tokio::sync::Notify::new(),
            stop_wake: tokio::sync::Notify::new(),
            stop: Default::default(),
            rest: Default::default(),
            reconnect: Default::default(),
            reconnect_wake: tokio::sync::Notify::new(),
        };
        pump_once(&client, &inner, Some(1));
        assert_eq!(inner.lock().pubs.unbound_len(), 1);
        pump_once(&client, &inner, Some(1));
        let q = inner.lock();
        assert_eq!(
            q.pubs.unbound_len(),
            1,
            "a second publish went to the channel"
        );
        assert_eq!(q.pubs.next_to_hand().map(|p| p.topic.as_str()), Some("t/1"));
    }

    #[test]
    fn acks_waiting_with_none_leaving_are_reported_once_per_stall() {
        let mut w = AckWatch::default();
        let t0 = Instant::now();
        assert_eq!(w.stalled(true, t0), None, "the stall starts");
        w.turns += 3;
        assert_eq!(w.stalled(true, t0 + ACK_STALL / 2), None);
        assert_eq!(w.stalled(true, t0 + ACK_STALL), Some((ACK_STALL, 3)));
        assert_eq!(w.stalled(true, t0 + 2 * ACK_STALL), None, "once");
        // One ack leaves: a new stall starts from then.
        w.left += 1;
        assert_eq!(w.stalled(true, t0 + 2 * ACK_STALL), None);
        assert_eq!(w.stalled(true, t0 + 3 * ACK_STALL), Some((ACK_STALL, 0)));
        // Nothing waiting: no stall, whatever the time.
        assert_eq!(w.stalled(false, t0 + 10 * ACK_STALL), None);
        assert_eq!(w.stalled(true, t0 + 10 * ACK_STALL), None);
    }
}
