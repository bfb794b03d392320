//! Handing freed memory back to the system. A burst (a replay, a drained backlog) frees
//! much at once; on an edge box the peak must not become the steady state. Two things hold
//! freed memory back: sled frees its write buffers and old page versions only when an
//! epoch collection runs, which needs later activity; and an allocator keeps freed pages for
//! reuse. The second is jemalloc's to do, on a timer (`src/main.rs`); the first is done here,
//! while work goes on and once it stops (issues 7 and 16).

use std::time::{Duration, Instant};

/// How often freed heap is handed back to the system while work goes on.
pub(crate) const TRIM_INTERVAL: Duration = Duration::from_secs(10);

/// How long work must have stopped before the heap is handed back at once: a drained
/// backlog should not wait out the rest of an interval at its peak (issue 16).
pub(crate) const TRIM_SETTLE: Duration = Duration::from_secs(1);

/// Rounds of sled's deferred drops run before a trim ([`crate::store::release_deferred`]):
/// each runs up to eight bags of 64, so this clears thousands of waiting frees in well under
/// a millisecond.
const RELEASE_ROUNDS: usize = 64;

/// When freed heap was last handed back, and the work done by then (checkpoints +
/// acknowledged results): an idle agent has nothing to give back.
pub(crate) struct Trim {
    at: Instant,
    work: u64,
    /// The work count last seen, and when it last changed.
    seen: u64,
    changed: Instant,
}

impl Trim {
    pub(crate) fn new(now: Instant) -> Trim {
        Trim {
            at: now,
            work: 0,
            seen: 0,
            changed: now,
        }
    }

    /// Whether to trim now, with `work` done so far: every [`TRIM_INTERVAL`] while work goes
    /// on, and once [`TRIM_SETTLE`] after it stops. Taking it starts the next interval.
    pub(crate) fn take(&mut self, now: Instant, work: u64) -> bool {
        if work != self.seen {
            (self.seen, self.changed) = (work, now);
        }
        let due = work != self.work
            && (now >= self.at + TRIM_INTERVAL || now >= self.changed + TRIM_SETTLE);
        if due {
            (self.at, self.work) = (now, work);
        }
        due
    }
}

/// Free what sled handed to deferred reclamation (see [`crate::store::release_deferred`]).
/// The allocator (jemalloc, set up in `src/main.rs`) then returns the freed pages to the
/// system by itself, a moment later.
pub(crate) fn return_free_memory() {
    crate::store::release_deferred(RELEASE_ROUNDS);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heap_is_trimmed_at_most_every_interval_and_only_after_work() {
        let t0 = Instant::now();
        let mut t = Trim::new(t0);
        let ms = Duration::from_millis;
        // Work every 100 ms: only the interval trims.
        for i in 1..100u32 {
            assert!(!t.take(t0 + ms(100) * i, u64::from(i)), "too soon at {i}");
        }
        assert!(t.take(t0 + TRIM_INTERVAL, 100));
        assert!(!t.take(t0 + 3 * TRIM_INTERVAL, 100), "no work since");
        assert!(
            !t.take(t0 + 4 * TRIM_INTERVAL, 100),
            "idle: nothing to give back"
        );
        assert!(t.take(t0 + 4 * TRIM_INTERVAL, 101));
    }

    #[test]
    fn heap_is_trimmed_once_when_work_stops() {
        let t0 = Instant::now();
        let mut t = Trim::new(t0);
        let ms = Duration::from_millis;
        assert!(!t.take(t0 + ms(100), 1));
        assert!(!t.take(t0 + ms(900), 2), "work goes on");
        assert!(!t.take(t0 + ms(1_800), 2), "stopped 0.9 s ago");
        assert!(t.take(t0 + ms(1_900), 2), "stopped 1 s ago: trim");
        assert!(!t.take(t0 + ms(5_000), 2), "once");
        assert!(!t.take(t0 + ms(20_000), 2), "and not again while idle");
    }
}
