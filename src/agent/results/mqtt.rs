//! MQTT sinks: `local` publishes on the input connection of `[mqtt]`; `uplink` (issue 13)
//! and each `[[sink]]` of kind `mqtt` (issue 29) over a publish-only connection of their
//! own (3.1.1 for `[uplink]`, MQTT 5 by default for a `[[sink]]`), with `topic_prefix`
//! before each topic. The outbox is their store-and-forward queue: durable, bounded, and
//! drained in sequence order (each sink's [`Cursor`]) when a link returns.
//!
//! Every connection feeds the loop's one event channel (the uplink's events wrapped in
//! [`Event::Uplink`], a `[[sink]]`'s in [`Event::Sink`]), so the loop never waits on one
//! connection while another has events.
//!
//! [`Link`] and [`DrainRate`] do no IO: told what happened and when, they answer what
//! changed (for the journal) and the figures (for `status` and `/metrics`).

use std::borrow::Cow;
use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::Counts as Sent;
use super::cursor::{Cursor, Next};
use super::strikes::Strikes;
use super::waiting::Waiting;
use crate::agent::error::{AgentError, failpoint};
use crate::config::OutboxConfig;
use crate::mqtt::{Event, Link as MqttLink, Mqtt, MqttError};

/// The drain rate is measured over this much recent time...
const RATE_SPAN: Duration = Duration::from_secs(10);
/// ... from samples at least this far apart.
const RATE_STEP: Duration = Duration::from_millis(250);

/// Recent samples of (when, results waiting for the sink, results acknowledged so far): the
/// rate at which the broker acknowledges results, and the time left to drain at the net
/// rate (acks less new results).
#[derive(Debug, Default)]
pub(crate) struct DrainRate {
    samples: VecDeque<(Instant, u64, u64)>,
}

impl DrainRate {
    pub(crate) fn sample(&mut self, now: Instant, entries: u64, acked: u64) {
        if let Some(&(t, _, _)) = self.samples.back()
            && now.saturating_duration_since(t) < RATE_STEP
        {
            return;
        }
        self.samples.push_back((now, entries, acked));
        while self.samples.len() > 2
            && self
                .samples
                .front()
                .is_some_and(|&(t, _, _)| now.saturating_duration_since(t) > RATE_SPAN)
        {
            self.samples.pop_front();
        }
    }

    /// (entries, acked) at the first and the last sample, and the seconds between them.
    fn span(&self) -> Option<(Counts, Counts, f64)> {
        let (&(t0, e0, a0), &(t1, e1, a1)) = (self.samples.front()?, self.samples.back()?);
        let secs = t1.saturating_duration_since(t0).as_secs_f64();
        (secs > 0.0).then_some(((e0, a0), (e1, a1), secs))
    }

    /// Results acknowledged per second over the span (0 before two samples).
    pub(crate) fn acked_per_second(&self) -> f64 {
        self.span().map_or(0.0, |((_, a0), (_, a1), s)| {
            a1.saturating_sub(a0) as f64 / s
        })
    }

    /// Seconds until the outbox is empty if it keeps shrinking as it did over the span:
    /// 0 when empty, `None` when it is not shrinking (or not known yet).
    pub(crate) fn eta_seconds(&self) -> Option<f64> {
        let ((e0, _), (e1, _), secs) = self.span()?;
        if e1 == 0 {
            return Some(0.0);
        }
        let shrink = e0.checked_sub(e1).filter(|&d| d > 0)? as f64 / secs;
        Some(e1 as f64 / shrink)
    }
}

/// (outbox entries, results acknowledged so far) at one sample.
type Counts = (u64, u64);

/// A change of the uplink's state worth a journal line.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Change {
    /// Connected with this many results waiting: a backlog to drain.
    Draining { entries: u64 },
    /// The backlog is down to what the inflight window holds.
    Drained { took: Duration, from: u64 },
}

/// Connected or not and since when; a backlog being drained.
#[derive(Debug, Default)]
pub(crate) struct Link {
    connected: bool,
    since_ms: u64,
    reconnects: u64,
    /// Since when (monotonic) and from how many entries a backlog is being drained.
    draining: Option<(Instant, u64)>,
    pub(crate) rate: DrainRate,
}

impl Link {
    /// Connected at `wall_ms` with `entries` waiting: a backlog if more than one `window`.
    pub(crate) fn connected(
        &mut self,
        wall_ms: u64,
        now: Instant,
        entries: u64,
        window: u64,
    ) -> Option<Change> {
        self.connected = true;
        self.since_ms = wall_ms;
        (entries > window).then(|| {
            self.draining = Some((now, entries));
            Change::Draining { entries }
        })
    }

    /// Lost (or a first attempt failed) at `wall_ms`; `true` if it was up. A drain in
    /// progress ends unfinished.
    pub(crate) fn lost(&mut self, wall_ms: u64) -> bool {
        self.draining = None;
        if !std::mem::replace(&mut self.connected, false) {
            if self.since_ms == 0 {
                self.since_ms = wall_ms; // down since the first attempt
            }
            return false;
        }
        self.since_ms = wall_ms;
        self.reconnects += 1;
        true
    }

    /// Every tick: the outbox holds `entries`, `acked` results were acknowledged so far.
    pub(crate) fn observe(
        &mut self,
        now: Instant,
        entries: u64,
        acked: u64,
        window: u64,
    ) -> Option<Change> {
        self.rate.sample(now, entries, acked);
        let (began, from) = self.draining?;
        if !self.connected || entries > window {
            return None;
        }
        self.draining = None;
        Some(Change::Drained {
            took: now.saturating_duration_since(began),
            from,
        })
    }

    pub(crate) fn figures(&self) -> crate::metrics::UplinkFigures {
        crate::metrics::UplinkFigures {
            connected: self.connected,
            since_ms: self.since_ms,
            reconnects: self.reconnects,
        }
    }
}

/// At start, when the outbox entries already waiting were committed (for the oldest
/// entry's age, which otherwise would count from this start): checkpoint `k`'s results end
/// at the durable `outbox_seq` less the results of every later checkpoint in the history.
/// Entries older than the history (1000 checkpoints) get its oldest time: understated.
pub(crate) fn note_waiting_outbox(
    metrics: &crate::metrics::Metrics,
    store: &crate::store::Store,
) -> Result<(), crate::store::StoreError> {
    let history: Vec<_> = store.checkpoints().collect::<Result<_, _>>()?;
    let mut end = store.progress()?.outbox_seq;
    let mut marks = Vec::with_capacity(history.len());
    for c in history.iter().rev() {
        marks.push((end, c.committed_at_ms));
        end = end.saturating_sub(c.outputs);
    }
    for (end, at) in marks.into_iter().rev() {
        metrics.note_outbox_committed(end, at);
    }
    Ok(())
}

/// Where an MQTT sink's publishes go: the input connection (`local`), or a connection of
/// its own (`uplink`, a `[[sink]]`).
pub(crate) enum Conn {
    Input,
    Own(MqttLink),
    /// A sink whose client runs on a thread of its own (`dbsink.rs`: PostgreSQL,
    /// JetStream): its answers come back as this sink's events, as an MQTT sink's would.
    Thread(super::dbsink::ThreadConn),
}

/// A sink the broker refuses (MQTT 5 PUBACK reason >= 0x80): since when, why, and when to
/// try again.
#[derive(Debug, Clone)]
pub(crate) struct Refusing {
    pub(crate) since_ms: u64,
    pub(crate) code: u8,
    pub(crate) reason: &'static str,
    pub(crate) topic: String,
    pub(crate) retry_at: Instant,
    pub(crate) delay: Duration,
}

/// One MQTT sink: its name, cursor, connection and what it knows of it.
pub(crate) struct MqttSink {
    pub(crate) name: String,
    pub(crate) cursor: Cursor,
    pub(crate) conn: Conn,
    prefix: String,
    endpoint: String,
    /// Its connection's backoff bounds: refused results are retried within them.
    retry: (Duration, Duration),
    /// Drops of the connection against one publish (issue 27).
    pub(crate) strikes: Strikes,
    pub(crate) link: Link,
    pub(crate) refusing: Option<Refusing>,
    /// Refusals by reason name (`/metrics`), and the last journal line's time.
    pub(crate) refused: std::collections::BTreeMap<&'static str, u64>,
    refused_logged: Option<Instant>,
    refused_unlogged: u64,
    /// Results this sink settled, and results it sent.
    pub(crate) acked: u64,
    pub(crate) sent: u64,
    /// The outbox entries routed here that this sink has not settled (`waiting.rs`).
    pub(crate) waiting: Waiting,
    /// Configured pipelines whose results come here (0: a sink that gets nothing).
    pub(crate) pipelines: u64,
}

/// At most one journal line about a refusing sink per this long (the rest are counted).
const REFUSED_LOG_EVERY: Duration = Duration::from_secs(10);

impl MqttSink {
    /// A sink named `name` over `conn`, its cursor at `first_seq`.
    pub(crate) fn new(
        name: &str,
        first_seq: u64,
        conn: Conn,
        cfg: Option<(&crate::config::MqttConfig, &str)>,
    ) -> MqttSink {
        let (prefix, endpoint, retry) = match cfg {
            Some((m, prefix)) => (
                prefix.to_string(),
                format!("{}:{}", m.host, m.port),
                (
                    m.reconnect_min.max(Duration::from_millis(100)),
                    m.reconnect_max.max(Duration::from_millis(100)),
                ),
            ),
            None => (
                String::new(),
                String::new(),
                (Duration::from_secs(1), Duration::from_secs(30)),
            ),
        };
        MqttSink {
            name: name.to_string(),
            cursor: Cursor::new(first_seq),
            conn,
            prefix,
            endpoint,
            retry,
            strikes: Strikes::default(),
            link: Link::default(),
            refusing: None,
            refused: Default::default(),
            refused_logged: None,
            refused_unlogged: 0,
            acked: 0,
            sent: 0,
            waiting: Waiting::default(),
            pipelines: 0,
        }
    }

    /// Its cursor's settled prefix may have moved: what it passed waits here no more.
    pub(crate) fn follow_settled(&mut self) {
        self.waiting.settled_below(self.cursor.settled_below());
    }

    fn with_conn<T>(&self, input: &Mqtt, f: impl FnOnce(ConnRef<'_>) -> T) -> T {
        match &self.conn {
            Conn::Input => f(ConnRef::V311(input)),
            Conn::Own(MqttLink::V311(m)) => f(ConnRef::V311(m)),
            Conn::Own(MqttLink::V5(m)) => f(ConnRef::V5(m)),
            Conn::Thread(t) => f(ConnRef::Thread(t)),
        }
    }

    /// Give up `output_id` on this sink's connection.
    pub(crate) fn abandon(&self, output_id: &str, input: &Mqtt) {
        self.with_conn(input, |c| match c {
            ConnRef::V311(m) => m.abandon(output_id),
            ConnRef::V5(m) => m.abandon(output_id),
            ConnRef::Thread(_) => {}
        })
    }

    /// How many results may be sent now: none while disconnected or waiting to retry
    /// after a refusal, else what the inflight `window` has left.
    pub(crate) fn room(&self, window: u16, input: &Mqtt, now: Instant) -> usize {
        if self.refusing.as_ref().is_some_and(|r| now < r.retry_at) {
            return 0;
        }
        self.with_conn(input, |c| {
            let on_wire = || match c {
                ConnRef::V311(m) => m.inflight(),
                ConnRef::V5(m) => m.inflight(),
                ConnRef::Thread(t) => t.inflight(),
            };
            self.cursor.room(window, on_wire)
        })
    }

    /// The topic `topic` goes out as (with the sink's prefix).
    pub(crate) fn topic_of(&self, topic: &str) -> String {
        format!("{}{topic}", self.prefix)
    }

    /// Publish `batch` (from [`super::cursor::next_routed`]) in order,
    /// until the connection's window is full. `skip_to`: the cursor moves there when the
    /// whole batch went (entries between not routed here).
    pub(crate) fn send(
        &mut self,
        batch: Vec<Next>,
        skip_to: Option<u64>,
        input: &Mqtt,
        counts: &mut Sent,
        now: Instant,
    ) -> Result<(), AgentError> {
        let mut all = true;
        for (seq, out, fresh) in batch {
            failpoint("outbox.before_publish")?;
            let topic = if self.prefix.is_empty() {
                Cow::Borrowed(out.topic.as_str())
            } else {
                Cow::Owned(format!("{}{}", self.prefix, out.topic))
            };
            let sent = self.with_conn(input, |c| match c {
                ConnRef::V311(m) => m.publish(out.id.clone(), &topic, out.payload, out.retain),
                ConnRef::V5(m) => m.publish(out.id.clone(), &topic, out.payload, out.retain),
                ConnRef::Thread(t) => t.publish(seq, out.id.clone(), &topic, out.payload),
            });
            match sent {
                Ok(()) => {
                    self.cursor.sent(out.id, seq, now);
                    self.sent += 1;
                    counts.published += 1;
                    if fresh && counts.published_early == 0 {
                        crate::event!(info, "results_leave_early";
                            "publish: results now leave before their checkpoint (first: {})",
                            counts.published
                        );
                    }
                    counts.published_early += u64::from(fresh);
                    failpoint("outbox.after_publish")?;
                }
                Err(MqttError::InflightFull { .. }) => {
                    all = false;
                    break;
                }
                Err(e) => return Err(e.into()),
            }
        }
        if let (true, Some(to)) = (all, skip_to) {
            self.cursor.skip_to(to);
            self.follow_settled();
        }
        if let Conn::Thread(t) = &self.conn {
            // The batch goes to the sink's thread as one (one transaction, one burst).
            t.flush();
        }
        Ok(())
    }

    /// A connection results go out on ended (`unacked`, `up_for`: see
    /// [`Event::Disconnected`]): the output ID to set aside, if the broker refused it by
    /// dropping the connection once too often (`strikes.rs`).
    pub(crate) fn struck(
        &mut self,
        unacked: &[String],
        up_for: Option<Duration>,
        now: Instant,
    ) -> Option<String> {
        let cursor = &self.cursor;
        self.strikes
            .dropped(unacked, up_for, |id| cursor.since_sent(id, now))
    }

    /// The broker refused `output_id` (MQTT 5 PUBACK `code`): the sink is refusing; the
    /// cursor goes back to it so it and what followed are sent again, in order, once the
    /// retry delay has passed. Returns whether it was ours.
    pub(crate) fn refused(
        &mut self,
        output_id: &str,
        code: u8,
        reason: &'static str,
        topic: String,
        (wall, now): (u64, Instant),
    ) -> bool {
        if !self.cursor.rewind(output_id) {
            return false;
        }
        *self.refused.entry(reason).or_default() += 1;
        let delay = match &self.refusing {
            Some(r) => (r.delay * 2).min(self.retry.1),
            None => self.retry.0,
        };
        let since_ms = self.refusing.as_ref().map_or(wall, |r| r.since_ms);
        let due = self
            .refused_logged
            .is_none_or(|t| now.saturating_duration_since(t) >= REFUSED_LOG_EVERY);
        if due {
            let sink = self.name.as_str();
            crate::event!(warn, "sink_refused", sink = sink, reason = reason,
                suppressed = self.refused_unlogged;
                "sink `{sink}`: the broker {} refused {} on `{}`: 0x{code:02X} {reason}; \
                 the result stays in the outbox and is sent again in {:?} ({} more refusals \
                 since the last line)",
                self.endpoint,
                crate::text::Shown(output_id),
                crate::text::Shown(&topic),
                delay,
                self.refused_unlogged
            );
            self.refused_logged = Some(now);
            self.refused_unlogged = 0;
        } else {
            self.refused_unlogged += 1;
        }
        self.refusing = Some(Refusing {
            since_ms,
            code,
            reason,
            topic,
            retry_at: now + delay,
            delay,
        });
        true
    }

    /// A result of this sink was acknowledged: the sink takes results again.
    pub(crate) fn accepted(&mut self) {
        if let Some(r) = self.refusing.take() {
            let sink = self.name.as_str();
            crate::event!(info, "sink_accepting", sink = sink;
                "sink `{sink}`: the broker {} accepts results again (refused since {} ms, last \
                 0x{:02X} {} on `{}`)",
                self.endpoint, r.since_ms, r.code, r.reason, crate::text::Shown(&r.topic)
            );
        }
    }

    /// An event of this sink's own connection other than an outcome (`at`: the clocks,
    /// wall and monotonic).
    pub(crate) fn on_link_event(
        &mut self,
        ev: Event,
        cfg: &OutboxConfig,
        (wall, now): (u64, Instant),
    ) -> Result<(), MqttError> {
        let window = u64::from(cfg.inflight);
        let name = self.name.clone();
        let sink = name.as_str();
        let (entries, bytes) = (self.waiting.len(), self.waiting.bytes());
        match ev {
            Event::Connected { session_present } => {
                crate::event!(info, "uplink_connected", sink = sink;
                    "{sink}: connected to {} (session present: {session_present}); {entries} \
                     results waiting for it in the outbox",
                    self.endpoint
                );
                if let Some(Change::Draining { entries }) =
                    self.link.connected(wall, now, entries, window)
                {
                    crate::event!(info, "uplink_backlog_draining", sink = sink;
                        "{sink}: backlog draining: {entries} results, {bytes} payload bytes, in \
                         order"
                    );
                }
                self.cursor.connected();
            }
            Event::Disconnected { reason, .. } => {
                if self.link.lost(wall) {
                    crate::event!(warn, "uplink_lost", sink = sink;
                        "{sink}: lost {}: {reason}; its results wait in the outbox ({entries} \
                         now, up to outbox.max_size {} bytes for every sink)",
                        self.endpoint,
                        cfg.max_size
                    );
                } else {
                    crate::event!(warn, "uplink_connect_failed", sink = sink;
                        "{sink}: cannot connect to {}: {reason}", self.endpoint);
                }
                self.cursor.disconnected();
                if matches!(self.conn, Conn::Thread(_)) {
                    // Its thread answered what it could not deliver with this event alone.
                    self.cursor.rewind_unsettled();
                }
            }
            Event::Message(m) => {
                // No subscriptions are made on a sink; a session kept from a config that
                // had some may still deliver. Acknowledge and drop it.
                crate::event!(warn, "uplink_unexpected_message", sink = sink;
                    "{sink}: dropped a message on `{}`: the session at {} has a subscription \
                     it should not have",
                    crate::text::Shown(&m.topic),
                    self.endpoint
                );
                if let Conn::Own(l) = &self.conn {
                    l.ack(m.token)?;
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// Every tick: the drain's figures, and a journal line when a backlog has drained.
    pub(crate) fn observe(&mut self, now: Instant, window: u64) {
        if let Some(Change::Drained { took, from }) =
            self.link
                .observe(now, self.waiting.len(), self.acked, window)
        {
            let sink = self.name.as_str();
            crate::event!(info, "uplink_backlog_drained", sink = sink;
                "{sink}: backlog drained: {from} results in {:.1}s",
                took.as_secs_f64()
            );
        }
    }

    /// Its figures (`oldest_age_ms`: of the oldest result waiting for it).
    pub(crate) fn figures(&self, oldest_age_ms: u64) -> crate::metrics::SinkFigures {
        let link = self.link.figures();
        let connected = self.cursor.is_connected();
        let (state, since_ms) = match (&self.refusing, connected) {
            (Some(r), _) => ("refusing", r.since_ms),
            (None, true) => ("connected", link.since_ms),
            (None, false) => ("down", link.since_ms),
        };
        crate::metrics::SinkFigures {
            name: self.name.clone(),
            state,
            since_ms,
            waiting: self.waiting.len(),
            waiting_bytes: self.waiting.bytes(),
            oldest_age_ms,
            pipelines: self.pipelines,
            sent: self.sent,
            acked: self.acked,
            drain_rate: self.link.rate.acked_per_second(),
            refused: self.refused.clone(),
            refusing: self.refusing.as_ref().map(|r| (r.code, r.reason)),
            duplicate_window: match &self.conn {
                Conn::Thread(t) => t.duplicate_window(),
                _ => None,
            },
        }
    }

    /// Let its own connection's thread hand back its allocation caches.
    pub(crate) fn rest(&self) {
        if let Conn::Own(l) = &self.conn {
            l.rest();
        }
    }

    /// Close its own connection, if any.
    pub(crate) fn shutdown(&mut self) {
        match std::mem::replace(&mut self.conn, Conn::Input) {
            Conn::Own(l) => l.shutdown(),
            Conn::Thread(mut t) => t.shutdown(),
            Conn::Input => {}
        }
    }
}

/// A borrowed connection of either protocol.
enum ConnRef<'a> {
    V311(&'a Mqtt),
    V5(&'a crate::mqtt::Mqtt5),
    Thread(&'a super::dbsink::ThreadConn),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(t0: Instant, ms: u64) -> Instant {
        t0 + Duration::from_millis(ms)
    }

    #[test]
    fn the_rate_counts_acks_and_the_eta_follows_the_net_shrink() {
        let t0 = Instant::now();
        let mut r = DrainRate::default();
        assert_eq!(r.acked_per_second(), 0.0);
        assert_eq!(r.eta_seconds(), None, "nothing known yet");
        r.sample(at(t0, 0), 10_000, 0);
        r.sample(at(t0, 100), 9_000, 1_000); // closer than a step: ignored
        r.sample(at(t0, 1_000), 9_000, 2_000);
        // 2000 acked in 1s, while 1000 new results came in: net shrink 1000/s.
        assert_eq!(r.acked_per_second(), 2_000.0);
        assert_eq!(r.eta_seconds(), Some(9.0));
        r.sample(at(t0, 2_000), 9_500, 2_500);
        assert_eq!(r.eta_seconds(), Some(9_500.0 / 250.0));
        r.sample(at(t0, 3_000), 12_000, 2_500);
        assert_eq!(r.eta_seconds(), None, "growing: no estimate");
        r.sample(at(t0, 4_000), 0, 14_500);
        assert_eq!(r.eta_seconds(), Some(0.0), "empty");
    }

    #[test]
    fn the_rate_forgets_samples_older_than_its_span() {
        let t0 = Instant::now();
        let mut r = DrainRate::default();
        r.sample(t0, 100, 0);
        for s in 1..=30 {
            r.sample(at(t0, s * 1_000), 100, s * 10);
        }
        // Only the last 10 s: 10 acks/s, not diluted by the first sample.
        assert_eq!(r.acked_per_second(), 10.0);
        assert!(r.samples.len() <= 12, "{}", r.samples.len());
    }

    #[test]
    fn a_backlog_at_connect_drains_once_and_a_loss_is_counted_once() {
        let t0 = Instant::now();
        let mut l = Link::default();
        assert!(!l.lost(5), "never up: not a loss");
        assert_eq!(l.figures().reconnects, 0);
        assert_eq!(l.figures().since_ms, 5, "down since the first attempt");
        assert!(!l.lost(7));
        assert_eq!(l.figures().since_ms, 5, "still the same down period");
        assert_eq!(
            l.connected(10, t0, 50, 100),
            None,
            "within a window: no backlog"
        );
        assert!(l.lost(20));
        assert!(!l.lost(21), "already down");
        assert_eq!(l.figures().since_ms, 20);
        assert_eq!(
            l.connected(30, t0, 5_000, 100),
            Some(Change::Draining { entries: 5_000 })
        );
        assert!(l.figures().connected);
        assert_eq!(l.observe(at(t0, 500), 3_000, 2_000, 100), None);
        assert_eq!(
            l.observe(at(t0, 1_500), 80, 5_000, 100),
            Some(Change::Drained {
                took: Duration::from_millis(1_500),
                from: 5_000
            })
        );
        assert_eq!(l.observe(at(t0, 2_000), 0, 5_080, 100), None, "once");
        // Lost mid-drain: no "drained" until a new drain finishes.
        assert!(l.connected(40, t0, 1_000, 100).is_some());
        assert!(l.lost(50));
        assert_eq!(l.observe(at(t0, 3_000), 0, 6_000, 100), None);
        assert_eq!(l.figures().reconnects, 2);
    }
}
