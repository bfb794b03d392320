//! Handing freed heap back to the system. glibc keeps what a burst freed (a replay, a
//! drained outbox) mapped for reuse; on an edge box the peak then looks like the steady
//! state. Measured (issue 7): steady RSS after replaying 1M events fell from 86.8 MiB to the
//! figure in the README.

use std::time::{Duration, Instant};

/// How often freed heap is handed back to the system.
pub(crate) const TRIM_INTERVAL: Duration = Duration::from_secs(10);

/// When freed heap was last handed back, and the work done by then (checkpoints +
/// acknowledged results): an idle agent has nothing to give back.
pub(crate) struct Trim {
    at: Instant,
    work: u64,
}

impl Trim {
    pub(crate) fn new(now: Instant) -> Trim {
        Trim { at: now, work: 0 }
    }

    /// Whether to trim now, with `work` done so far; taking it starts the next interval.
    pub(crate) fn take(&mut self, now: Instant, work: u64) -> bool {
        let due = now >= self.at + TRIM_INTERVAL && work != self.work;
        if due {
            (self.at, self.work) = (now, work);
        }
        due
    }
}

/// Hand freed heap back to the system; a no-op elsewhere than glibc.
pub(crate) fn return_free_memory() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim only walks the allocator's own free lists; it takes no pointers
    // and is safe to call at any time from any thread.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heap_is_trimmed_at_most_every_interval_and_only_after_work() {
        let t0 = Instant::now();
        let mut t = Trim::new(t0);
        assert!(!t.take(t0 + TRIM_INTERVAL / 2, 5), "too soon");
        assert!(!t.take(t0 + TRIM_INTERVAL, 0), "idle: nothing to give back");
        assert!(t.take(t0 + TRIM_INTERVAL, 5));
        assert!(!t.take(t0 + 3 * TRIM_INTERVAL, 5), "no work since");
        assert!(t.take(t0 + 3 * TRIM_INTERVAL, 6));
    }
}
