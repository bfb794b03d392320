//! The checkpoint's fsync, beside the loop (issue 14).
//!
//! Results no longer wait for their checkpoint, so nothing the loop does needs the
//! checkpoint durable at once: the loop commits the checkpoint's transaction (atomic and
//! visible) and hands the flush and fsync of sled's files to one thread, and goes on
//! ingesting and publishing while it runs. A checkpoint taken this way is durable only when
//! the thread says so; until then a crash leaves the previous one, and replay starts there.
//! What needs durability waits for it: retention deletes log segments only below
//! [`Fsync::durable`], the quarantine forgets records only then, and the next checkpoint
//! first waits for the previous fsync (at most one is outstanding, so they stay in order).
//! An fsync that fails stops the agent, as a failed checkpoint always did.
//!
//! Measured (`benches/compare/`, intervals): a 5 s checkpoint at ~7,000 events/s held
//! the loop for ~200 ms, long enough to make it the p99 latency of every result.

use std::sync::mpsc::{Receiver, SyncSender, TryRecvError, sync_channel};

use crate::model::Offset;
use crate::store::{StoreError, Syncer};

pub(crate) struct Fsync {
    /// `None` only while dropping.
    jobs: Option<SyncSender<Offset>>,
    /// Joined on drop, so that the store's last handle is gone when the agent is.
    thread: Option<std::thread::JoinHandle<()>>,
    done: Receiver<Result<Offset, StoreError>>,
    /// The `next_offset` and retention floor of the checkpoint being synced.
    pending: Option<(Offset, Offset)>,
    /// The `next_offset` of the newest durable checkpoint.
    durable: Offset,
    /// What retention must keep for the newest durable checkpoint: its `next_offset`, or a
    /// backfill cursor it holds below that (see `backfill::retention_floor`).
    floor: Offset,
    dir: std::path::PathBuf,
}

impl Fsync {
    /// Start the thread; `durable` is the checkpoint the store opened with, `floor` what
    /// retention must keep for it.
    pub(crate) fn start(syncer: Syncer, durable: Offset, floor: Offset) -> std::io::Result<Fsync> {
        let (jobs, rx) = sync_channel::<Offset>(1);
        let (tx, done) = sync_channel(1);
        let dir = syncer.dir().to_path_buf();
        let thread = std::thread::Builder::new()
            .name("cairn-fsync".into())
            .spawn(move || {
                while let Ok(next) = rx.recv() {
                    if tx.send(run(&syncer).map(|()| next)).is_err() {
                        break;
                    }
                }
            })?;
        Ok(Fsync {
            jobs: Some(jobs),
            thread: Some(thread),
            done,
            pending: None,
            durable,
            floor: floor.min(durable),
            dir,
        })
    }

    /// Everything below this offset is covered by a durable checkpoint.
    pub(crate) fn durable(&self) -> Offset {
        self.durable
    }

    /// Retention may delete below this: what the newest durable checkpoint no longer needs,
    /// live or backfill.
    pub(crate) fn floor(&self) -> Offset {
        self.floor
    }

    /// Make the checkpoint just committed (up to `next_offset`, needing the log from
    /// `floor`) durable. The previous one must be done (see [`Fsync::settle`]).
    pub(crate) fn begin(&mut self, next_offset: Offset, floor: Offset) -> Result<(), StoreError> {
        assert!(self.pending.is_none(), "one checkpoint fsync at a time");
        let jobs = self.jobs.as_ref().ok_or_else(|| self.gone())?;
        jobs.send(next_offset).map_err(|_| self.gone())?;
        self.pending = Some((next_offset, floor.min(next_offset)));
        Ok(())
    }

    /// The offset newly made durable, if the pending fsync finished (`wait`: wait for it).
    pub(crate) fn settle(&mut self, wait: bool) -> Result<Option<Offset>, StoreError> {
        if self.pending.is_none() {
            return Ok(None);
        }
        let r = if wait {
            self.done.recv().map_err(|_| self.gone())?
        } else {
            match self.done.try_recv() {
                Ok(r) => r,
                Err(TryRecvError::Empty) => return Ok(None),
                Err(TryRecvError::Disconnected) => return Err(self.gone()),
            }
        };
        let Some((_, floor)) = self.pending.take() else {
            unreachable!("checked above");
        };
        let next = r?;
        self.durable = self.durable.max(next);
        self.floor = self.floor.max(floor);
        Ok(Some(next))
    }

    fn gone(&self) -> StoreError {
        StoreError::Io {
            path: self.dir.clone(),
            source: std::io::Error::other("the checkpoint fsync thread stopped"),
        }
    }
}

impl Drop for Fsync {
    fn drop(&mut self) {
        self.jobs = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn run(syncer: &Syncer) -> Result<(), StoreError> {
    let fp = |name| {
        crate::failpoint::hit(name).map_err(|source| StoreError::Io {
            path: syncer.dir().to_path_buf(),
            source,
        })
    };
    fp("checkpoint.before_fsync")?;
    syncer.sync()?;
    fp("checkpoint.after_fsync")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_checkpoint_counts_as_durable_only_once_its_fsync_is_done() {
        let dir = tempfile::tempdir().unwrap();
        let sync = crate::fsio::TestSync::new();
        let store = crate::store::Store::open(dir.path(), 1 << 20, sync.clone()).unwrap();
        let mut f = Fsync::start(store.syncer(), 3, 2).unwrap();
        assert_eq!(f.settle(true).unwrap(), None, "nothing pending");
        let before = sync.file_syncs();
        f.begin(9, 5).unwrap();
        assert_eq!(f.durable(), 3, "not durable before the fsync is done");
        assert_eq!(
            f.floor(),
            2,
            "retention keeps what the durable checkpoint needs"
        );
        assert_eq!(f.settle(true).unwrap(), Some(9));
        assert!(sync.file_syncs() > before, "the thread fsynced the store");
        assert_eq!(f.durable(), 9);
        assert_eq!(
            f.floor(),
            5,
            "a backfill cursor below next_offset holds the log"
        );
        assert_eq!(f.settle(false).unwrap(), None);
        f.begin(12, 12).unwrap();
        assert!(
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f.begin(13, 13))).is_err(),
            "one fsync at a time"
        );
    }
}
