//! Handing freed memory back to the system. A burst (a replay, a drained backlog) frees
//! much at once; on an edge box the peak must not become the steady state. Two things hold
//! freed memory back: sled frees its write buffers and old page versions only when an
//! epoch collection runs, which needs later activity; and an allocator keeps freed pages for
//! reuse. The second is jemalloc's to do, on a timer (`src/main.rs`); the first is done here,
//! while work goes on and once it stops (issues 7 and 16). And once work stops, the pages of
//! the binary's own code that start-up and the burst touched are handed to the kernel's
//! reclaim ([`reclaim_code_pages`]); an agent that never stops does the same a minute after
//! start and every ten minutes.

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

/// How long work must have stopped before the binary's code pages are reclaimed
/// ([`reclaim_code_pages`]): the next work faults back in what it runs (no delay that
/// could be measured from outside, `docs/performance.md`), but not at every pause of a
/// slow stream.
pub(crate) const CODE_SETTLE: Duration = Duration::from_secs(5);

/// When an agent that never rests reclaims its code pages anyway: first this long after
/// start (the start-up code, configuration, recovery and replay, is done by then and never
/// runs again), then every [`CODE_BUSY_INTERVAL`] (code that a rare event ran, a sink's
/// reconnect or a savepoint). The busy loop faults back in what it runs, once: at 7,000
/// inputs/s the 10 s holding it had p99 5-8 ms against 4.4-5.9 around it
/// (`docs/performance.md`).
pub(crate) const CODE_FIRST_BUSY: Duration = Duration::from_secs(60);
pub(crate) const CODE_BUSY_INTERVAL: Duration = Duration::from_secs(600);

/// When freed heap was last handed back, and the work done by then (checkpoints +
/// acknowledged results): an idle agent has nothing to give back, except once after start
/// (recovery and replay are work the count does not see).
pub(crate) struct Trim {
    at: Instant,
    work: u64,
    /// The work count last seen, and when it last changed.
    seen: u64,
    changed: Instant,
    /// Whether the code pages were reclaimed since the work count last changed.
    code_reclaimed: bool,
    /// When the code pages are reclaimed even if work goes on.
    code_busy_at: Instant,
}

impl Trim {
    pub(crate) fn new(now: Instant) -> Trim {
        Trim {
            at: now,
            work: u64::MAX,
            seen: 0,
            changed: now,
            code_reclaimed: false,
            code_busy_at: now + CODE_FIRST_BUSY,
        }
    }

    /// Whether to trim now, with `work` done so far: every [`TRIM_INTERVAL`] while work goes
    /// on, and once [`TRIM_SETTLE`] after it stops. Taking it starts the next interval.
    pub(crate) fn take(&mut self, now: Instant, work: u64) -> bool {
        self.see(now, work);
        let due = work != self.work
            && (now >= self.at + TRIM_INTERVAL || now >= self.changed + TRIM_SETTLE);
        if due {
            (self.at, self.work) = (now, work);
        }
        due
    }

    /// Whether to reclaim the code pages now: once each time work has stopped for
    /// [`CODE_SETTLE`] (and once after start, if no work comes); and, while work goes on,
    /// [`CODE_FIRST_BUSY`] after start and every [`CODE_BUSY_INTERVAL`] after the last.
    pub(crate) fn take_code(&mut self, now: Instant, work: u64) -> bool {
        self.see(now, work);
        let due =
            (!self.code_reclaimed && now >= self.changed + CODE_SETTLE) || now >= self.code_busy_at;
        if due {
            self.code_reclaimed = true;
            self.code_busy_at = now + CODE_BUSY_INTERVAL;
        }
        due
    }

    fn see(&mut self, now: Instant, work: u64) {
        if work != self.seen {
            (self.seen, self.changed, self.code_reclaimed) = (work, now, false);
        }
    }
}

/// Free what sled handed to deferred reclamation (see [`crate::store::release_deferred`]).
/// The allocator (jemalloc, set up in `src/main.rs`) then returns the freed pages to the
/// system by itself, a moment later.
pub(crate) fn return_free_memory() {
    crate::store::release_deferred(RELEASE_ROUNDS);
}

/// Ask the kernel to reclaim the pages of this process's own executable that it has mapped
/// (`madvise(MADV_PAGEOUT)`, Linux 5.4+), and return how many bytes of mappings were asked.
///
/// Why: at rest most of a small agent's resident set is not heap but the binary's code and
/// read-only data that start-up touched once (configuration, TLS, recovery) and the kernel's
/// fault-around mapped beside it: 7 of the 15 MiB of an agent idle with 1,000 keys
/// (`docs/performance.md`). Those pages are clean; the kernel would drop them under memory
/// pressure anyway, but only after it had unmapped them, and `RSS` (what an operator reads)
/// counts them until then. This is that reclaim done now: the pages the idle loop needs
/// fault back in from the file at the next turn, the rest stay out until used.
///
/// Only mappings of the executable are asked (its device and inode, or its path: on some
/// overlay file systems the two name the file differently). `MADV_PAGEOUT` reclaims, it
/// never discards: a page that was written (the relocated read-only data, a debugger's
/// breakpoint) is anonymous and, with no swap, stays (with swap it may go there, as under
/// pressure); a page another process maps is left alone.
pub(crate) fn reclaim_code_pages() -> std::io::Result<u64> {
    use std::os::unix::fs::MetadataExt;
    let exe = std::fs::metadata("/proc/self/exe")?;
    let path = std::fs::read_link("/proc/self/exe")?;
    let maps = std::fs::read_to_string("/proc/self/maps")?;
    let mut asked = 0u64;
    for (start, end) in exe_mappings(&maps, (exe.dev(), exe.ino()), &path) {
        let len = end - start;
        // SAFETY: the range is one whole mapping of this process, read from its own maps;
        // MADV_PAGEOUT only moves its pages out (reclaim), it changes no contents.
        let r = unsafe { libc::madvise(start as *mut libc::c_void, len, libc::MADV_PAGEOUT) };
        if r != 0 {
            return Err(std::io::Error::last_os_error());
        }
        asked += len as u64;
    }
    Ok(asked)
}

/// The `(start, end)` address ranges of the mappings in `maps` (the text of
/// `/proc/self/maps`) of the file with `(device, inode)` `file`, or at `path`.
fn exe_mappings(maps: &str, file: (u64, u64), path: &std::path::Path) -> Vec<(usize, usize)> {
    // A line: `start-end perms offset major:minor inode path`, numbers in hex but the inode;
    // the path (which may hold spaces) is the rest of the line after the inode's padding.
    let (dev, ino) = file;
    let major = u64::from(libc::major(dev));
    let minor = u64::from(libc::minor(dev));
    maps.lines()
        .filter_map(|line| {
            let mut f = line.splitn(6, ' ');
            let (range, _perms, _offset, device, inode) =
                (f.next()?, f.next()?, f.next()?, f.next()?, f.next()?);
            let named = f.next().map(str::trim_start);
            let (maj, min) = device.split_once(':')?;
            let same = (u64::from_str_radix(maj, 16).ok()? == major
                && u64::from_str_radix(min, 16).ok()? == minor
                && inode.parse::<u64>().ok()? == ino)
                || named.is_some_and(|n| !n.is_empty() && std::path::Path::new(n) == path);
            let (s, e) = range.split_once('-')?;
            let (s, e) = (
                usize::from_str_radix(s, 16).ok()?,
                usize::from_str_radix(e, 16).ok()?,
            );
            (same && e > s).then_some((s, e))
        })
        .collect()
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

    #[test]
    fn a_fresh_agent_with_no_work_trims_once_after_start() {
        let t0 = Instant::now();
        let mut t = Trim::new(t0);
        let ms = Duration::from_millis;
        assert!(!t.take(t0 + ms(500), 0), "start-up still settling");
        assert!(t.take(t0 + ms(1_000), 0), "recovery was work");
        assert!(!t.take(t0 + ms(60_000), 0));
    }

    #[test]
    fn code_pages_are_reclaimed_once_per_rest_of_five_seconds() {
        let t0 = Instant::now();
        let mut t = Trim::new(t0);
        let s = Duration::from_secs;
        assert!(!t.take_code(t0 + s(4), 0), "start-up still settling");
        assert!(t.take_code(t0 + s(5), 0), "after start");
        assert!(!t.take_code(t0 + s(6), 0), "once");
        // A slow stream: work every 4 s never rests long enough.
        for i in 2..10u32 {
            assert!(!t.take_code(t0 + s(4) * i, u64::from(i)), "at {i}");
        }
        assert!(!t.take_code(t0 + s(40), 9));
        assert!(t.take_code(t0 + s(41), 9), "rested 5 s");
        assert!(!t.take_code(t0 + s(100), 9), "once per rest");
        assert!(!t.take_code(t0 + s(101), 10));
        assert!(t.take_code(t0 + s(106), 10), "the next rest");
    }

    #[test]
    fn a_busy_agent_reclaims_a_minute_after_start_then_every_ten_minutes() {
        let t0 = Instant::now();
        let mut t = Trim::new(t0);
        let ms = Duration::from_millis;
        let mut at = Vec::new();
        // Work every 100 ms for 25 minutes: it never rests.
        for i in 1..=15_000u32 {
            if t.take_code(t0 + ms(100) * i, u64::from(i)) {
                at.push(i / 10);
            }
        }
        assert_eq!(at, vec![60, 660, 1260], "seconds after start");
        // And when it stops, the rest reclaims as before, whatever the busy schedule says.
        assert!(!t.take_code(t0 + ms(1_504_900), 15_000));
        assert!(t.take_code(t0 + ms(1_505_000), 15_000), "rested 5 s");
        assert!(!t.take_code(t0 + ms(1_600_000), 15_000), "once per rest");
    }

    #[test]
    fn only_the_executables_own_mappings_are_named() {
        let maps = "\
55d0c0a00000-55d0c0b00000 r--p 00000000 fe:01 1234 /usr/bin/cairn
55d0c0b00000-55d0c1000000 r-xp 00100000 fe:01 1234 /usr/bin/cairn
55d0c1000000-55d0c1001000 rw-p 00600000 fe:01 1234 /usr/bin/cairn
55d0c2000000-55d0c2100000 rw-p 00000000 00:00 0 [heap]
7f0000000000-7f0000100000 r-xp 00000000 fe:01 99 /usr/lib/x86_64-linux-gnu/libc.so.6
7f0000200000-7f0000300000 r-xp 00000000 fe:02 1234 /mnt/other/cairn
7f0000400000-7f0000500000 r-xp 00000000 fe:01 1234 /usr/bin/cairn (deleted)
bad line
";
        let dev = libc::makedev(0xfe, 0x01);
        let cairn = [
            (0x55d0c0a00000, 0x55d0c0b00000),
            (0x55d0c0b00000, 0x55d0c1000000),
            (0x55d0c1000000, 0x55d0c1001000),
        ];
        let nowhere = std::path::Path::new("/nowhere");
        let mut by_inode = cairn.to_vec();
        by_inode.push((0x7f0000400000, 0x7f0000500000));
        assert_eq!(exe_mappings(maps, (dev, 1234), nowhere), by_inode);
        let by_path = exe_mappings(maps, (dev, 4321), std::path::Path::new("/usr/bin/cairn"));
        assert_eq!(
            by_path,
            cairn.to_vec(),
            "an overlay's numbers, the same path"
        );
        assert!(exe_mappings(maps, (dev, 4321), nowhere).is_empty());
        let spaced = "7f0000200000-7f0000300000 r-xp 00000000 00:2a 7 /opt/my cairn/cairn\n";
        assert_eq!(
            exe_mappings(
                spaced,
                (dev, 1),
                std::path::Path::new("/opt/my cairn/cairn")
            ),
            vec![(0x7f0000200000, 0x7f0000300000)]
        );
    }

    #[test]
    fn the_test_binarys_resident_pages_fall_and_it_runs_on() {
        // The resident KiB of this binary's own mappings, from /proc/self/smaps.
        let resident = || {
            let exe = std::fs::read_link("/proc/self/exe").unwrap();
            let exe = exe.to_str().unwrap().to_owned();
            let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
            let mut ours = false;
            let mut kib = 0u64;
            for line in smaps.lines() {
                if let Some(rss) = line.strip_prefix("Rss:") {
                    if ours {
                        kib += rss.trim().trim_end_matches(" kB").parse::<u64>().unwrap();
                    }
                } else if line.split_once(" ").is_some_and(|(a, _)| a.contains("-")) {
                    ours = line.ends_with(&exe);
                }
            }
            kib
        };
        // Other tests run beside this one and fault their code back in between the reclaim
        // and the count; a reclaim that works halves the count in one of a few tries.
        let mut tries = Vec::new();
        for _ in 0..3 {
            let before = resident();
            let asked = reclaim_code_pages().expect("madvise(MADV_PAGEOUT) on our own mappings");
            assert!(asked > 0, "found no mapping of /proc/self/exe");
            let after = resident();
            tries.push((before, after));
            if after < before / 2 {
                return;
            }
        }
        panic!("resident KiB of the binary (before, after) did not halve: {tries:?}");
    }
}
