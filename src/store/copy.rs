//! `cairn inspect` reads the store without writing to it.
//!
//! sled 0.34 has no read-only mode: opening a database runs recovery, which writes a new
//! snapshot file whenever the log moved on since the last one (every time, in practice), and
//! dropping it flushes. So an inspection opens a private copy instead: the store's files are
//! copied (holding a shared `flock` on `db`, so that an agent cannot start writing halfway,
//! and a running agent's exclusive lock makes it fail as `Locked`) into a new directory under
//! the temporary directory (`$TMPDIR`, mode 0700), the copy is opened, and the copy is
//! removed when the [`StoreCopy`] is dropped. The cost is the store's size in temporary
//! space and copy time; the gain is that looking can never change what is looked at
//! (`tests/it/cli.rs::inspect_leaves_the_store_byte_for_byte_and_mtime_for_mtime_as_it_was`).

use std::fs;
use std::os::unix::fs::DirBuilderExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::open::LOCK_WAIT;
use super::{Store, StoreBounds, StoreError, io_err};
use crate::fsio::{SyncKind, SyncSeam};

/// A copy needs no fsync: it is thrown away.
#[derive(Debug)]
struct NoSync;

impl SyncSeam for NoSync {
    fn sync_file(&self, _: SyncKind, _: &fs::File, _: &Path, _: bool) -> std::io::Result<()> {
        Ok(())
    }
    fn sync_dir(&self, _: &Path) -> std::io::Result<()> {
        Ok(())
    }
}

/// A store opened on a private copy; derefs to [`Store`]; the copy goes when it is dropped.
pub struct StoreCopy {
    store: Option<Store>,
    copy: PathBuf,
}

impl std::ops::Deref for StoreCopy {
    type Target = Store;
    fn deref(&self) -> &Store {
        self.store.as_ref().expect("present until drop")
    }
}

impl Drop for StoreCopy {
    fn drop(&mut self) {
        drop(self.store.take());
        if let Err(e) = fs::remove_dir_all(&self.copy) {
            crate::event!(warn, "inspect_copy_not_removed";
                "store: cannot remove the copy at {}: {e}",
                self.copy.display()
            );
        }
    }
}

/// Shared `flock` on `path`, waiting up to [`LOCK_WAIT`] for an exclusive holder (sled's
/// lock, in a store being closed) to let go. Released when the file is closed.
fn lock_shared(path: &Path, dir: &Path) -> Result<fs::File, StoreError> {
    let f = fs::File::open(path).map_err(io_err(path))?;
    let deadline = std::time::Instant::now() + LOCK_WAIT;
    loop {
        // SAFETY: flock on a descriptor this function owns; no memory is involved.
        let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_SH | libc::LOCK_NB) };
        if rc == 0 {
            return Ok(f);
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
            return Err(StoreError::Io {
                path: path.to_path_buf(),
                source: e,
            });
        }
        if std::time::Instant::now() >= deadline {
            return Err(StoreError::Locked {
                path: dir.to_path_buf(),
            });
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// Bytes copied so far and in all, for the progress of `cairn inspect` on a terminal.
struct Copied {
    done: u64,
    total: u64,
}

/// Copied in chunks of this size (each in the kernel, as `fs::copy` does), so that a store
/// of one large `db` file still shows progress.
const COPY_CHUNK: u64 = 16 << 20;

fn copy_dir(from: &Path, to: &Path, copied: &mut Copied) -> Result<(), StoreError> {
    for entry in fs::read_dir(from).map_err(io_err(from))? {
        let entry = entry.map_err(io_err(from))?;
        let (src, name) = (entry.path(), entry.file_name());
        let dst = to.join(&name);
        let kind = entry.file_type().map_err(io_err(&src))?;
        if kind.is_dir() {
            fs::create_dir(&dst).map_err(|e| tmp_err(&dst, e))?;
            copy_dir(&src, &dst, copied)?;
        } else if kind.is_file() && !name.to_string_lossy().ends_with(".generating") {
            copy_file(&src, &dst, copied)?;
        }
    }
    Ok(())
}

/// An error making the copy: it names `$TMPDIR`, where the copy goes, and what to do (an
/// unusable or full `$TMPDIR` was not named before, issue 32).
fn tmp_err(path: &Path, e: std::io::Error) -> StoreError {
    let tmp = std::env::temp_dir();
    StoreError::Io {
        path: path.to_path_buf(),
        source: std::io::Error::new(
            e.kind(),
            format!(
                "{e}. `cairn inspect` reads the store from a copy in $TMPDIR ({}): point \
                 TMPDIR at a writable directory with room for a copy of the store",
                tmp.display()
            ),
        ),
    }
}

/// Bytes of the files below `dir` (what [`copy_dir`] will copy, give or take a snapshot
/// being generated); unreadable entries count as 0: it only sizes a progress line.
fn size_of(dir: &Path) -> u64 {
    let Ok(entries) = fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => size_of(&e.path()),
            Ok(t) if t.is_file() => e.metadata().map_or(0, |m| m.len()),
            _ => 0,
        })
        .sum()
}

fn copy_file(src: &Path, dst: &Path, copied: &mut Copied) -> Result<(), StoreError> {
    use std::io::Read;
    let from = fs::File::open(src).map_err(io_err(src))?;
    let mut to = fs::File::create(dst).map_err(|e| tmp_err(dst, e))?;
    loop {
        crate::logging::progress::step(
            "copying the store to read it",
            copied.done,
            Some(copied.total),
            crate::logging::progress::Unit::Bytes,
        );
        let n =
            std::io::copy(&mut (&from).take(COPY_CHUNK), &mut to).map_err(|e| tmp_err(dst, e))?;
        if n == 0 {
            return Ok(());
        }
        copied.done += n;
    }
}

impl Store {
    /// Open a private copy of the store in `dir` (see the module docs); `dir` is only read.
    pub(crate) fn open_copy(dir: &Path, cache_bytes: u64) -> Result<StoreCopy, StoreError> {
        let db = dir.join("db");
        let lock = lock_shared(&db, dir)?;
        let nanos = crate::clock::system_wall_ns() % 1_000_000_000;
        let copy =
            std::env::temp_dir().join(format!("cairn-inspect-{}-{nanos}", std::process::id()));
        // 0700: the copy holds the same data as the store.
        fs::DirBuilder::new()
            .mode(0o700)
            .create(&copy)
            .map_err(|e| tmp_err(&copy, e))?;
        let mut guard = StoreCopy { store: None, copy };
        let total = size_of(dir);
        copy_dir(dir, &guard.copy, &mut Copied { done: 0, total })?;
        drop(lock);
        let store = Store::open_with(
            &guard.copy,
            cache_bytes,
            Arc::new(NoSync),
            StoreBounds::default(),
        )
        .map_err(|e| match e {
            // Name the real store, not the copy, in what the user sees.
            StoreError::Open { source, .. } => StoreError::Open {
                path: dir.to_path_buf(),
                source,
            },
            e => e,
        })?;
        guard.store = Some(store);
        Ok(guard)
    }
}
