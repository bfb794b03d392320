//! Handing freed heap back to the system. glibc keeps what a burst freed (a replay, a
//! drained outbox) mapped for reuse; on an edge box the peak then looks like the steady
//! state. Measured (issue 7): steady RSS after replaying 1M events fell from 86.8 MiB to the
//! figure in the README.

use std::time::{Duration, Instant};

/// How often freed heap is handed back to the system while work goes on.
pub(crate) const TRIM_INTERVAL: Duration = Duration::from_secs(10);

/// How long work must have stopped before the heap is handed back at once: a drained
/// backlog should not wait out the rest of an interval at its peak (issue 16).
pub(crate) const TRIM_SETTLE: Duration = Duration::from_secs(1);

/// Rounds of sled's deferred drops run before a trim ([`crate::store::release_deferred`]):
/// each runs up to eight bags of 64, so this clears thousands of waiting frees in well under
/// a millisecond.
pub(crate) const RELEASE_ROUNDS: usize = 64;

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

/// Buffers at least this large get pages of their own from the system (glibc's
/// `M_MMAP_THRESHOLD`), returned whole when freed.
const MMAP_THRESHOLD: i32 = 256 * 1024;

/// Most glibc arenas (`M_ARENA_MAX`).
const ARENA_MAX: i32 = 2;

/// glibc's allocator, set for a small box (issue 16). Measured with `cargo bench --bench
/// compare` on a loaded 2-core box, two runs with these settings against five without:
/// 1,000 keys, RSS after 10 s idle 14.1 / 14.5 MiB against 16.0-16.7, peak during the live
/// runs 21-22 MiB against 26-29. On the 1M-input backlog the difference is within what
/// varies from run to run (peak 86-103 MiB with them, 98-117 without; at rest 52-55 both).
///
/// - A fixed mmap threshold: by default glibc raises it (up to 32 MiB) each time a large
///   mmapped block is freed, so the next large buffers (ledger index shards, a burst's ack
///   queue) come from the heap, and freeing them leaves holes that only a trim returns.
/// - At most two arenas: glibc gives each thread that allocates an arena of its own (sled's
///   flusher and I/O threads, the MQTT thread), and each keeps its own freed memory.
///
/// Another allocator was tried and not taken: mimalloc 0.1.52 (default settings) cut CPU per
/// event by a quarter but kept far more memory (peak 177 MiB, 124 MiB at rest, 67 MiB at
/// rest with 1,000 keys). A no-op elsewhere than glibc.
pub(crate) fn tune_allocator() {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt only sets the allocator's parameters; it takes no pointers. Both
    // settings apply to allocations made afterwards, from any thread.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD);
        libc::mallopt(libc::M_ARENA_MAX, ARENA_MAX);
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
