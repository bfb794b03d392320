//! The MQTT sink: results published to the local broker of `[mqtt]`, or with `[uplink]`
//! (issue 13) over a second, publish-only connection to a central broker, with
//! `topic_prefix` before each topic; inputs still come from `[mqtt]`. The outbox is its
//! store-and-forward queue: durable, bounded, and drained in sequence order (its
//! [`Cursor`]) when the link returns.
//!
//! Both connections feed the loop's one event channel (the uplink's events wrapped in
//! [`Event::Uplink`]), so the loop never waits on one connection while the other has
//! events.
//!
//! [`Link`] and [`DrainRate`] do no IO: told what happened and when, they answer what
//! changed (for the journal) and the figures (for `status` and `/metrics`).

use std::borrow::Cow;
use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::Counts as Sent;
use super::cursor::{Cursor, Next};
use super::strikes::Strikes;
use crate::agent::error::{AgentError, failpoint};
use crate::config::{OutboxConfig, UplinkConfig};
use crate::mqtt::{Event, Mqtt, MqttError};

/// The drain rate is measured over this much recent time...
const RATE_SPAN: Duration = Duration::from_secs(10);
/// ... from samples at least this far apart.
const RATE_STEP: Duration = Duration::from_millis(250);

/// The MQTT sink: its cursor, and the uplink if results go to one.
pub(crate) struct MqttSink {
    pub(crate) cursor: Cursor,
    uplink: Option<Uplink>,
    /// Drops of the connection against one publish (issue 27).
    pub(crate) strikes: Strikes,
}

/// The uplink connection and what the sink knows of it.
struct Uplink {
    mqtt: Mqtt,
    prefix: String,
    endpoint: String,
    /// The input connection (`[mqtt]`): the cursor follows the uplink instead.
    input_connected: bool,
    link: Link,
}

impl Uplink {
    fn new(cfg: &UplinkConfig, mqtt: Mqtt) -> Uplink {
        Uplink {
            mqtt,
            prefix: cfg.topic_prefix.clone(),
            endpoint: format!("{}:{}", cfg.mqtt.host, cfg.mqtt.port),
            input_connected: false,
            link: Link::default(),
        }
    }
}

/// Recent samples of (when, outbox entries, results acknowledged so far): the rate at which
/// the broker acknowledges results, and the time left to drain at the net rate (acks less
/// new results).
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

impl MqttSink {
    /// The sink over the input connection, or over `uplink` (with its config) if there is
    /// one; `first_seq`: where its cursor starts (the oldest outbox entry).
    pub(crate) fn new(first_seq: u64, uplink: Option<(&UplinkConfig, Mqtt)>) -> MqttSink {
        MqttSink {
            cursor: Cursor::new(first_seq),
            uplink: uplink.map(|(cfg, mqtt)| Uplink::new(cfg, mqtt)),
            strikes: Strikes::default(),
        }
    }

    /// The connection results go out on: the uplink if configured, else `input`.
    pub(crate) fn conn<'a>(&'a self, input: &'a Mqtt) -> &'a Mqtt {
        self.uplink.as_ref().map_or(input, |u| &u.mqtt)
    }

    /// How many results may be sent now: none while disconnected, else what the inflight
    /// `window` has left beside what the connection still holds.
    pub(crate) fn room(&self, window: u16, input: &Mqtt) -> usize {
        let conn = self.conn(input);
        self.cursor.room(window, || conn.inflight())
    }

    /// Publish `batch` (from [`super::cursor::next_batch`]) in order, until the connection's
    /// window is full.
    pub(crate) fn send(
        &mut self,
        batch: Vec<Next>,
        input: &Mqtt,
        counts: &mut Sent,
        now: Instant,
    ) -> Result<(), AgentError> {
        let (conn, prefix) = match &self.uplink {
            Some(u) => (&u.mqtt, u.prefix.as_str()),
            None => (input, ""),
        };
        for (seq, out, fresh) in batch {
            failpoint("outbox.before_publish")?;
            let topic = if prefix.is_empty() {
                Cow::Borrowed(out.topic.as_str())
            } else {
                Cow::Owned(format!("{prefix}{}", out.topic))
            };
            match conn.publish(out.id.clone(), &topic, out.payload, out.retain) {
                Ok(()) => {
                    self.cursor.sent(out.id, seq, now);
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
                Err(MqttError::InflightFull { .. }) => break,
                Err(e) => return Err(e.into()),
            }
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

    /// The sink's name in the journal, the dead letters and the figures: `uplink` with an
    /// uplink, else `local`.
    pub(crate) fn name(&self) -> &'static str {
        if self.uplink.is_some() {
            "uplink"
        } else {
            "local"
        }
    }

    /// The topic `topic` goes out as (with the uplink's prefix).
    pub(crate) fn topic_of(&self, topic: &str) -> String {
        match &self.uplink {
            Some(u) => format!("{}{topic}", u.prefix),
            None => topic.to_owned(),
        }
    }

    /// Whether results go to an uplink.
    pub(crate) fn has_uplink(&self) -> bool {
        self.uplink.is_some()
    }

    /// Whether the input connection (`[mqtt]`) is up.
    pub(crate) fn input_connected(&self) -> bool {
        self.uplink
            .as_ref()
            .map_or(self.cursor.is_connected(), |u| u.input_connected)
    }

    /// The input connection came up (`true`) or went down; `true` if that was a change to
    /// count as a reconnect. Without an uplink the cursor follows it.
    pub(crate) fn input_link(&mut self, up: bool) -> bool {
        match (&mut self.uplink, up) {
            (Some(u), up) => std::mem::replace(&mut u.input_connected, up) && !up,
            (None, true) => {
                self.cursor.connected();
                false
            }
            (None, false) => self.cursor.disconnected(),
        }
    }

    /// An event of the uplink connection other than a PUBACK (`entries` and `bytes`: the
    /// outbox now; `at`: the clocks, wall and monotonic).
    pub(crate) fn on_uplink_event(
        &mut self,
        ev: Event,
        (entries, bytes): (u64, u64),
        cfg: &OutboxConfig,
        (wall, now): (u64, Instant),
    ) -> Result<(), MqttError> {
        let window = u64::from(cfg.inflight);
        let Some(u) = self.uplink.as_mut() else {
            return Ok(());
        };
        match ev {
            Event::PubAcked { .. }
            | Event::Uplink(_)
            | Event::BrokerDrops(_)
            | Event::PubRefused { .. }
            | Event::TooLarge { .. } => {}
            Event::Connected { session_present } => {
                crate::event!(info, "uplink_connected";
                    "uplink: connected to {} (session present: {session_present}); {entries} \
                     results waiting in the outbox",
                    u.endpoint
                );
                if let Some(Change::Draining { entries }) =
                    u.link.connected(wall, now, entries, window)
                {
                    crate::event!(info, "uplink_backlog_draining";
                        "uplink: backlog draining: {entries} results, {bytes} bytes, in order"
                    );
                }
                self.cursor.connected();
            }
            Event::Disconnected { reason, .. } => {
                // (What `unacked` says was struck by the caller, `Results::dropped`.)
                if u.link.lost(wall) {
                    crate::event!(warn, "uplink_lost";
                        "uplink: lost {}: {reason}; results wait in the outbox ({entries} now, \
                         up to outbox.max_size {} bytes)",
                        u.endpoint,
                        cfg.max_size
                    );
                } else {
                    crate::event!(warn, "uplink_connect_failed"; "uplink: cannot connect to {}: {reason}", u.endpoint);
                }
                self.cursor.disconnected();
            }
            Event::Message(m) => {
                // No subscriptions are made on the uplink; a session kept from a config
                // that had some may still deliver. Acknowledge and drop it.
                crate::event!(warn, "uplink_unexpected_message";
                    "uplink: dropped a message on `{}`: the uplink's session {} has a \
                     subscription it should not have",
                    crate::text::Shown(&m.topic),
                    u.endpoint
                );
                u.mqtt.ack(m.token)?;
            }
        }
        Ok(())
    }

    /// Every tick: the drain's figures (rate, time left, the link), and a journal line when
    /// a backlog has drained.
    pub(crate) fn observe(
        &mut self,
        now: Instant,
        entries: u64,
        acked: u64,
        window: u64,
    ) -> (f64, Option<f64>, Option<crate::metrics::UplinkFigures>) {
        let Some(u) = self.uplink.as_mut() else {
            return (0.0, None, None);
        };
        if let Some(Change::Drained { took, from }) = u.link.observe(now, entries, acked, window) {
            crate::event!(info, "uplink_backlog_drained";
                "uplink: backlog drained: {from} results in {:.1}s",
                took.as_secs_f64()
            );
        }
        let r = &u.link.rate;
        (
            r.acked_per_second(),
            r.eta_seconds(),
            Some(u.link.figures()),
        )
    }

    /// Let the uplink's thread hand back its allocation caches.
    pub(crate) fn rest(&self) {
        if let Some(u) = &self.uplink {
            u.mqtt.rest();
        }
    }

    /// Close the uplink, if any.
    pub(crate) fn shutdown(&mut self) {
        if let Some(u) = self.uplink.take() {
            u.mqtt.shutdown();
        }
    }
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
