//! The reconnect backoff of every connection: a pure rule, no IO; the worker passes the time.
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

/// Jitter only has to differ between agents restarting together, not be unpredictable.
pub(crate) fn seed() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    nanos ^ (u64::from(std::process::id()) << 32)
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
