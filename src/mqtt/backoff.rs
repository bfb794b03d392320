//! The reconnect backoff of every connection: a pure rule, no IO; the worker passes the time.
//! What a failed poll means ([`Reconnects::poll_failed`]: the journal line, the event, the
//! delay) is decided here once for both workers (3.1.1 and MQTT 5); each only describes its
//! protocol's error and carries the decision out.
//!
//! Bounded exponential backoff with equal jitter: each delay is uniform in `[b/2, b]`, then
//! `b` doubles up to the maximum. rumqttc has none of its own (DESIGN §4): without it a dead
//! broker is a tight loop.
//!
//! **It starts again from the minimum only after a connection has stayed up for
//! [`STABLE_AFTER`]**, not on every CONNACK. A broker that accepts the connection and then
//! drops it because of something we send on it (mosquitto closes the socket on a topic with a
//! Unicode non-character, issue 27; an ACL or a size limit can do the same) does so within
//! one round trip of our first packets: on loopback 1-2 ms after the CONNACK. Reset on the
//! CONNACK, the backoff never grew: the agent reconnected, re-sent the same publish and was
//! dropped again about 13 times a second, with four journal lines each. Now each such
//! round goes through the whole backoff and settles at `reconnect_max` between attempts.
//!
//! Why 10 s: far longer than any broker takes to refuse what we send right after the CONNACK
//! (our unacknowledged publishes are re-sent first thing, and rumqttc's connect timeout of
//! 5 s bounds the round trip of a slow link), and short enough that after a genuine outage
//! followed by a good connection, the next outage starts again from fast retries. It is not
//! the keep-alive interval: that defaults to 30 s and may be off altogether.

use std::time::{Duration, Instant};

use log::debug;

use super::Event;

/// How long a connection must stay up before the next outage starts from the minimum delay.
pub const STABLE_AFTER: Duration = Duration::from_secs(10);

/// Floor for the delays, so that a zero in the config cannot make a tight loop.
const FLOOR: Duration = Duration::from_millis(10);

#[derive(Debug)]
pub(crate) struct Backoff {
    min: Duration,
    max: Duration,
    /// The upper bound of the next delay.
    next: Duration,
    rng: u64,
    /// When the live connection came up; `None` while down.
    up_since: Option<Instant>,
}

impl Backoff {
    /// Delays from `min` (at least 10 ms) doubling to `max` (at least `min`); `seed` makes
    /// the jitter differ between agents restarting together.
    pub(crate) fn new(min: Duration, max: Duration, seed: u64) -> Backoff {
        let min = min.max(FLOOR);
        Backoff {
            min,
            max: max.max(min),
            next: min,
            rng: seed | 1,
            up_since: None,
        }
    }

    pub(crate) fn min(&self) -> Duration {
        self.min
    }

    pub(crate) fn max(&self) -> Duration {
        self.max
    }

    /// A connection came up (CONNACK accepted). The delays do not start again from the
    /// minimum yet: see [`Self::lost`].
    pub(crate) fn connected(&mut self, now: Instant) {
        self.up_since = Some(now);
    }

    /// The live connection is gone; returns how long it was up (`None` if none was). If that
    /// was at least [`STABLE_AFTER`], the next delay is the minimum again.
    pub(crate) fn lost(&mut self, now: Instant) -> Option<Duration> {
        let up_for = now.saturating_duration_since(self.up_since.take()?);
        if up_for >= STABLE_AFTER {
            self.next = self.min;
        }
        Some(up_for)
    }

    /// The delay before the next connect attempt; the one after it is up to twice as long.
    pub(crate) fn next_delay(&mut self) -> Duration {
        let base = self.next;
        self.next = base.saturating_mul(2).min(self.max);
        // xorshift: the jitter only has to differ between agents, not be unpredictable.
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        let frac = (self.rng % 1024) as f64 / 1024.0;
        base.mul_f64(0.5 + 0.5 * frac)
    }
}

/// What every connection does between two of its connections, whichever protocol: the
/// backoff, one `Disconnected` per down period (not per retry), and journal lines that say a
/// new failure once and repeat themselves only at debug level.
#[derive(Debug)]
pub(crate) struct Reconnects {
    backoff: Backoff,
    /// Broker address and client id, for the journal.
    endpoint: String,
    ever_connected: bool,
    /// `Disconnected` was emitted for the current down period.
    announced: bool,
    last_reason: Option<String>,
    /// Failed connect attempts since the connection was last up.
    attempts: u32,
}

impl Reconnects {
    pub(crate) fn new(endpoint: String, min: Duration, max: Duration) -> Reconnects {
        Reconnects {
            backoff: Backoff::new(min, max, seed()),
            endpoint,
            ever_connected: false,
            announced: false,
            last_reason: None,
            attempts: 0,
        }
    }

    pub(crate) fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Whether a connection was ever up in this process.
    pub(crate) fn ever_connected(&self) -> bool {
        self.ever_connected
    }

    /// A CONNACK was accepted at `now`. Returns what the journal line adds to "connected to
    /// ...": " again after N attempt(s)", or nothing for the first connection. The backoff
    /// is not reset yet (see [`Backoff::lost`]).
    pub(crate) fn up(&mut self, now: Instant) -> String {
        let again = if self.ever_connected || self.attempts > 0 {
            format!(" again after {} attempt(s)", self.attempts + 1)
        } else {
            String::new()
        };
        self.ever_connected = true;
        self.announced = false;
        self.last_reason = None;
        self.attempts = 0;
        self.backoff.connected(now);
        again
    }

    /// The live connection is gone at `now`; how long it was up.
    pub(crate) fn lost(&mut self, now: Instant) -> Option<Duration> {
        self.backoff.lost(now)
    }

    /// A poll failed for `reason` (`refused`: the broker refused the connection). `lost` is
    /// `Some` when it ended a live connection: how long that was up (from [`Self::lost`]) and
    /// the output IDs it leaves unacknowledged. Logs it; returns the `Disconnected` to hand
    /// the caller when it starts a down period, and the delay before the next attempt.
    pub(crate) fn poll_failed(
        &mut self,
        reason: String,
        refused: bool,
        lost: Option<(Option<Duration>, Vec<String>)>,
    ) -> (Option<Event>, Duration) {
        let (up_for, unacked) = lost.unwrap_or_default();
        let disconnected = self
            .failed(&reason, up_for, refused)
            .then_some(Event::Disconnected {
                reason,
                unacked,
                up_for,
            });
        (disconnected, self.backoff.next_delay())
    }

    /// A poll failed for `reason`: `up_for` is `Some` when it ended a live connection (from
    /// [`Self::lost`]), `refused` when the broker refused the connection. Logs it, and
    /// returns whether it starts a down period the caller must announce.
    fn failed(&mut self, reason: &str, up_for: Option<Duration>, refused: bool) -> bool {
        let endpoint = &self.endpoint;
        if let Some(up) = up_for {
            crate::event!(warn, "mqtt_connection_lost";
                "lost connection to {endpoint} after {up:.1?} up: {reason}; reconnecting with \
                 backoff {:?}..{:?}{}",
                self.backoff.min(),
                self.backoff.max(),
                if up < STABLE_AFTER {
                    " (not reset: the connection was not up for long)"
                } else {
                    ""
                }
            );
        } else {
            self.attempts += 1;
            if self.last_reason.as_deref() == Some(reason) {
                debug!(
                    "connect attempt {} to {endpoint} failed: {reason}",
                    self.attempts
                );
            } else if refused {
                crate::event!(error, "mqtt_connect_failed"; "{reason} ({endpoint}); retrying with backoff");
            } else {
                crate::event!(warn, "mqtt_connect_failed"; "cannot connect to {endpoint}: {reason}; retrying with backoff");
            }
        }
        self.last_reason = Some(reason.to_owned());
        !std::mem::replace(&mut self.announced, true)
    }

    /// A down period of our own making, announced by the caller.
    pub(crate) fn announced(&mut self) {
        self.announced = true;
    }
}

/// Jitter only has to differ between agents restarting together, not be unpredictable.
fn seed() -> u64 {
    let nanos = crate::clock::system_wall_ns() as u64;
    (nanos ^ (u64::from(std::process::id()) << 32)) | 1
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    /// The upper bounds of `n` delays in a row (each delay lies in `[b/2, b]`).
    fn delays(b: &mut Backoff, n: usize) -> Vec<Duration> {
        (0..n).map(|_| b.next_delay()).collect()
    }

    #[test]
    fn delays_double_from_the_minimum_to_the_maximum_with_jitter_of_at_most_half() {
        let mut b = Backoff::new(100 * MS, 1000 * MS, 7);
        let bounds = [100, 200, 400, 800, 1000, 1000, 1000];
        for (d, bound) in delays(&mut b, bounds.len()).into_iter().zip(bounds) {
            assert!(
                d <= bound * MS && d >= bound * MS / 2,
                "{d:?} for {bound} ms"
            );
        }
        let mut zero = Backoff::new(Duration::ZERO, Duration::ZERO, 7);
        assert!(
            zero.next_delay() >= FLOOR / 2,
            "a zero config is no tight loop"
        );
    }

    #[test]
    fn a_connection_dropped_right_after_its_connack_does_not_reset_the_backoff() {
        let t0 = Instant::now();
        let mut b = Backoff::new(100 * MS, 1000 * MS, 7);
        let mut now = t0;
        let mut last = Duration::ZERO;
        for _ in 0..6 {
            last = b.next_delay();
            now += last;
            b.connected(now);
            now += 2 * MS; // the broker drops us as soon as we re-send
            assert_eq!(b.lost(now), Some(2 * MS));
        }
        assert!(last >= 500 * MS, "still growing, then capped: {last:?}");
        assert!(b.next_delay() >= 500 * MS);
    }

    #[test]
    fn one_announcement_per_down_period_and_again_after_the_attempts_it_took() {
        let t0 = Instant::now();
        let mut r = Reconnects::new("b".into(), 100 * MS, 1000 * MS);
        assert!(
            r.failed("refused", None, true),
            "the first failure is announced"
        );
        assert!(!r.failed("refused", None, true), "a retry is not");
        assert_eq!(r.up(t0), " again after 3 attempt(s)");
        assert!(r.ever_connected());
        let up_for = r.lost(t0 + 2 * MS);
        assert_eq!(up_for, Some(2 * MS));
        assert!(r.failed("reset", up_for, false), "a new down period");
        assert_eq!(r.up(t0), " again after 1 attempt(s)");
        r.announced(); // a reconnect of our own
        let up_for = r.lost(t0);
        assert!(!r.failed("eof", up_for, false));
        let mut first = Reconnects::new("b".into(), 100 * MS, 1000 * MS);
        assert_eq!(first.up(t0), "", "the first connection");
    }

    #[test]
    fn a_failed_poll_hands_over_what_the_lost_connection_left_once_and_then_backs_off() {
        let t0 = Instant::now();
        let mut r = Reconnects::new("b".into(), 100 * MS, 1000 * MS);
        r.up(t0);
        let up_for = r.lost(t0 + 2 * MS);
        let (event, delay) =
            r.poll_failed("reset".into(), false, Some((up_for, vec!["o1".into()])));
        let Some(Event::Disconnected {
            reason,
            unacked,
            up_for,
        }) = event
        else {
            panic!("the first failure starts a down period: {event:?}");
        };
        assert_eq!(
            (reason.as_str(), unacked, up_for),
            ("reset", vec!["o1".to_string()], Some(2 * MS))
        );
        assert!(delay <= 100 * MS && delay >= 50 * MS, "{delay:?}");
        let (event, delay) = r.poll_failed("refused".into(), true, None);
        assert!(
            event.is_none(),
            "a retry in the same down period: {event:?}"
        );
        assert!(delay >= 100 * MS, "the next delay is longer: {delay:?}");
    }

    #[test]
    fn a_connection_that_stayed_up_resets_the_backoff_to_the_minimum() {
        let t0 = Instant::now();
        let mut b = Backoff::new(100 * MS, 1000 * MS, 7);
        delays(&mut b, 5);
        b.connected(t0);
        assert_eq!(b.lost(t0 + STABLE_AFTER - MS), Some(STABLE_AFTER - MS));
        assert!(b.next_delay() >= 500 * MS, "not up long enough");
        b.connected(t0);
        assert_eq!(b.lost(t0 + STABLE_AFTER), Some(STABLE_AFTER));
        assert!(
            b.next_delay() <= 100 * MS,
            "up long enough: fast retries again"
        );
        assert_eq!(b.lost(t0), None, "nothing was up");
    }
}
