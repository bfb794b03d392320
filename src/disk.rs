//! Free space under the data directory, so that a nearly full disk becomes backpressure
//! instead of an `ENOSPC` that poisons the log and crash-loops the agent.
//!
//! # Guarantee
//!
//! The agent appends a message to the log only while every filesystem holding the log and
//! the store has at least [`SpaceGuard::reserve`] bytes free (as last measured, minus what
//! was appended since). Below it, the agent stops acknowledging and holds the message,
//! exactly as when the log reaches `max_size` (invariant 7); the broker queues. It resumes
//! once a new measurement shows the reserve again.
//!
//! # Why a reserve, and why `2 × log.segment_size`
//!
//! Stopping at zero is too late: a write that fails poisons the log (see [`crate::log`]),
//! and what was already ingested still has to be checkpointed into the store, whose sled
//! file grows while it does. The reserve keeps room for one full segment roll plus the
//! batch in flight (at most one segment), and the store's checkpoints of those records
//! (a few pages per key, far below a segment). It scales with the one size an operator
//! already chose for the disk. The measurement is `statvfs`'s `f_bavail` (space available
//! to an unprivileged user), so root's reserved blocks on ext4 do not count as free.
//!
//! # Cost
//!
//! One `statvfs` per distinct filesystem at most every [`REFRESH`]; between measurements the
//! guard subtracts the bytes it let through, and measures again early when that estimate
//! would cross the reserve. The agent's hot path pays a subtraction.
//!
//! Tests: `disk::tests` (unit), `tests/it/faults.rs`
//! `a_nearly_full_disk_is_backpressure_and_nothing_is_lost_when_space_returns`.

use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// How stale a free-space figure may get before the guard measures again.
pub(crate) const REFRESH: Duration = Duration::from_millis(100);

/// `statvfs` failed on a directory the guard watches.
#[derive(Debug, thiserror::Error)]
#[error("cannot measure the free space under {}: {source}", .path.display())]
pub struct DiskError {
    pub path: PathBuf,
    #[source]
    pub source: io::Error,
}

/// Bytes available to unprivileged writers on the filesystem holding `path`.
pub fn free_bytes(path: &Path) -> io::Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))?;
    // SAFETY: `c` is a valid NUL-terminated string and `st` a properly sized out-parameter
    // that statvfs fills completely when it returns 0.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    #[allow(clippy::unnecessary_cast)] // the field types differ between targets
    Ok((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
}

/// Is this the "no space left on device" error (`ENOSPC`, or `EDQUOT` for a quota)?
pub fn is_disk_full(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::StorageFull
        || e.kind() == io::ErrorKind::QuotaExceeded
        || matches!(e.raw_os_error(), Some(libc::ENOSPC) | Some(libc::EDQUOT))
}

/// Decides, cheaply, whether there is room to append (see the module docs).
#[derive(Debug)]
pub(crate) struct SpaceGuard {
    dirs: Vec<PathBuf>,
    reserve: u64,
    /// Lowest free figure over `dirs` at the last measurement, and the directory it was for.
    free: u64,
    lowest: usize,
    measured_at: Option<Instant>,
    /// Bytes let through since the last measurement.
    written: u64,
}

impl SpaceGuard {
    /// Watch the filesystems holding each of `dirs` (which must exist when measured).
    pub fn new(dirs: Vec<PathBuf>, reserve: u64) -> SpaceGuard {
        assert!(
            !dirs.is_empty(),
            "the space guard needs a directory to watch"
        );
        SpaceGuard {
            dirs,
            reserve,
            free: 0,
            lowest: 0,
            measured_at: None,
            written: 0,
        }
    }

    pub fn reserve(&self) -> u64 {
        self.reserve
    }

    /// The directory whose filesystem had the least room at the last measurement.
    pub(crate) fn lowest_dir(&self) -> &Path {
        &self.dirs[self.lowest]
    }

    /// `Ok(None)` if `bytes` more may be written now (and counts them); `Ok(Some(free))`
    /// with the measured free bytes if that would leave less than the reserve.
    pub fn check(&mut self, now: Instant, bytes: u64) -> Result<Option<u64>, DiskError> {
        self.check_with(now, bytes, free_bytes)
    }

    /// [`SpaceGuard::check`] with the measurement supplied (for tests).
    pub(crate) fn check_with(
        &mut self,
        now: Instant,
        bytes: u64,
        mut measure: impl FnMut(&Path) -> io::Result<u64>,
    ) -> Result<Option<u64>, DiskError> {
        let estimate = self.free.saturating_sub(self.written);
        let stale = self
            .measured_at
            .is_none_or(|t| now.saturating_duration_since(t) >= REFRESH);
        // A low estimate is measured again at once (other writers may have freed space, or
        // our estimate may be pessimistic), but a low measurement is trusted until stale, so
        // a held message retried on every loop turn costs nothing.
        let crossing = estimate < self.reserve.saturating_add(bytes) && self.written > 0;
        if stale || crossing {
            let mut lowest = (u64::MAX, 0);
            for (i, dir) in self.dirs.iter().enumerate() {
                let free = measure(dir).map_err(|source| DiskError {
                    path: dir.clone(),
                    source,
                })?;
                if free < lowest.0 {
                    lowest = (free, i);
                }
            }
            (self.free, self.lowest) = lowest;
            self.measured_at = Some(now);
            self.written = 0;
        }
        if self.free.saturating_sub(self.written) < self.reserve.saturating_add(bytes) {
            return Ok(Some(self.free.saturating_sub(self.written)));
        }
        self.written += bytes;
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    #[test]
    fn free_bytes_measures_a_real_directory_and_fails_on_a_missing_one() {
        let dir = tempfile::tempdir().unwrap();
        assert!(free_bytes(dir.path()).unwrap() > 0);
        let err = free_bytes(&dir.path().join("missing")).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::NotFound);
    }

    #[test]
    fn enospc_and_quota_errors_count_as_disk_full_and_others_do_not() {
        assert!(is_disk_full(&io::Error::from_raw_os_error(libc::ENOSPC)));
        assert!(is_disk_full(&io::Error::from_raw_os_error(libc::EDQUOT)));
        assert!(!is_disk_full(&io::Error::from_raw_os_error(libc::EIO)));
        assert!(!is_disk_full(&io::Error::other("x")));
    }

    #[test]
    fn the_guard_refuses_below_the_reserve_measures_at_most_every_refresh_and_resumes() {
        let free = Cell::new(10_000u64);
        let reads = Cell::new(0u32);
        let measure = |_: &Path| {
            reads.set(reads.get() + 1);
            Ok(free.get())
        };
        let mut g = SpaceGuard::new(vec!["/a".into()], 7_500);
        let t0 = Instant::now();
        // Room: one measurement, then the estimate carries the next appends.
        assert_eq!(g.check_with(t0, 1_000, measure).unwrap(), None);
        assert_eq!(g.check_with(t0, 1_000, measure).unwrap(), None);
        assert_eq!(reads.get(), 1);
        // The estimate (10,000 − 2,000 − 1,000) would cross the reserve: measure again at once.
        free.set(5_500);
        assert_eq!(g.check_with(t0, 1_000, measure).unwrap(), Some(5_500));
        assert_eq!(reads.get(), 2);
        // Low and fresh: trusted without another statvfs, even if space came back.
        free.set(50_000);
        assert_eq!(
            g.check_with(t0 + REFRESH / 2, 1_000, measure).unwrap(),
            Some(5_500)
        );
        assert_eq!(reads.get(), 2);
        // Stale: measured again, and there is room.
        assert_eq!(g.check_with(t0 + REFRESH, 1_000, measure).unwrap(), None);
        assert_eq!(reads.get(), 3);
    }

    #[test]
    fn the_guard_takes_the_lowest_filesystem_and_reports_measurement_errors_with_the_path() {
        let mut g = SpaceGuard::new(vec!["/log".into(), "/store".into()], 100);
        let by_dir = |p: &Path| Ok(if p == Path::new("/store") { 50 } else { 1_000 });
        assert_eq!(g.check_with(Instant::now(), 10, by_dir).unwrap(), Some(50));
        assert_eq!(g.lowest_dir(), Path::new("/store"));
        let mut g = SpaceGuard::new(vec!["/gone".into()], 100);
        let err = g
            .check_with(Instant::now(), 10, |_| {
                Err(io::Error::from_raw_os_error(libc::ENOENT))
            })
            .unwrap_err();
        assert!(err.to_string().contains("/gone"), "{err}");
    }
}
