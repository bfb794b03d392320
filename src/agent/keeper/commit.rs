//! The checkpoint's commit and fsync, beside the loop (issues 14 and 33).
//!
//! Results do not wait for their checkpoint, so nothing the loop does needs a checkpoint
//! committed or durable at once. The loop takes the checkpoint from the processor (a few
//! microseconds: the write set changes hands) and this thread runs its sled transaction,
//! then the flush and fsync of sled's files, while the loop goes on ingesting, processing
//! and publishing. Until the thread says it is done, the checkpoint is a read layer for the
//! engine and the first of the outputs the sinks send (`processor/inflight.rs`); a crash
//! leaves the previous checkpoint, and replay starts there.
//!
//! What needs the checkpoint waits for it: retention deletes log segments only below
//! [`Committer::durable`], the quarantine forgets records only then, a savepoint is taken
//! only when none is in flight, and the next checkpoint first waits for this one (at most
//! one is in flight, so they stay in order). A size-triggered checkpoint may so make the loop
//! wait for the previous one; a timed one finds it done long before. A commit or fsync that
//! fails stops the agent, as a failed checkpoint always did.
//!
//! The failpoints around it, in order, on this thread: `checkpoint.before_commit`,
//! `checkpoint.after_commit`, `checkpoint.before_fsync`, `checkpoint.after_fsync`.
//!
//! Measured (`benches/compare/`, intervals): a 5 s checkpoint at ~7,000 events/s held the
//! loop for ~200 ms with its fsync on the loop, and 75-90 ms with only its transaction
//! there: long enough to make it the p99 latency of every result.
//!
//! **Beside is not apart.** sled's transaction holds a process-wide lock from its first
//! write to its commit, and every `get`, `insert`, `remove` and iterator step of any tree
//! waits for it. So the loop stays off the store while a commit runs: outbox deletes on
//! PUBACK are held until it is done (`Store::hold_outbox_deletes`), and the chunks the
//! sinks send next are read before it starts (`Results::prefetch`). What still waits is a
//! dedup lookup whose in-memory index cannot rule an ID out (a false hit, or a ledger past
//! the index bound): it must read the ledger chunk (`docs/performance.md`, "The loop and
//! sled's transaction lock"). The store's own lock is the other thing the two share: after
//! the transaction the commit brings the ledger index up to date a few pages at a time and
//! hands the lock to a waiting lookup between them (`store/commit.rs`, `index_added`).

use std::sync::Arc;
use std::sync::mpsc::{Receiver, SyncSender, TryRecvError, sync_channel};

use crate::model::Offset;
use crate::pipeline::engine::Checkpoint;
use crate::store::{CheckpointInfo, Store, StoreError};

/// What the thread is given.
enum Job {
    /// One checkpoint to commit: its write set and the wall-clock time it records.
    Commit { cp: Arc<Checkpoint>, at_ms: u64 },
    /// A checkpoint the loop is done with, committed and durable: freed here, not on the
    /// loop (see [`Committer::release`]).
    Release(Arc<Checkpoint>),
}

pub(crate) struct Committer {
    /// `None` only while dropping.
    jobs: Option<SyncSender<Job>>,
    /// Joined on drop, so that the store's last handle is gone when the agent is.
    thread: Option<std::thread::JoinHandle<()>>,
    done: Receiver<Result<CheckpointInfo, StoreError>>,
    /// The `next_offset` and retention floor of the checkpoint in flight.
    pending: Option<(Offset, Offset)>,
    /// The `next_offset` of the newest durable checkpoint.
    durable: Offset,
    /// What retention must keep for the newest durable checkpoint: its `next_offset`, or a
    /// backfill cursor it holds below that (see `backfill::retention_floor`).
    floor: Offset,
    dir: std::path::PathBuf,
}

impl Committer {
    /// Start the thread over `store`; `durable` is the checkpoint the store opened with,
    /// `floor` what retention must keep for it.
    pub(crate) fn start(
        store: Arc<Store>,
        durable: Offset,
        floor: Offset,
    ) -> std::io::Result<Committer> {
        // A release and the next commit, sent one after the other while the thread may
        // still be freeing the one before: neither send waits.
        let (jobs, rx) = sync_channel::<Job>(2);
        let (tx, done) = sync_channel(1);
        let dir = store.dir().to_path_buf();
        let thread = std::thread::Builder::new()
            .name("cairn-commit".into())
            .spawn(move || {
                // A commit allocates and frees much (encoding, sled's batches and pages)
                // while the loop does the same: without a cache of its own, both queued on
                // the one arena's lock (16 pipelines: ~1/6 of the loop's CPU samples in
                // that lock; issue 33). Handed back after each commit, as the MQTT
                // threads do when idle (`src/alloc.rs`).
                crate::alloc::cache_this_thread(true);
                while let Ok(job) = rx.recv() {
                    let r = match job {
                        Job::Commit { cp, at_ms } => run(&store, &cp, at_ms),
                        Job::Release(cp) => {
                            drop(cp);
                            crate::alloc::flush_this_thread();
                            continue;
                        }
                    };
                    crate::alloc::flush_this_thread();
                    if tx.send(r).is_err() {
                        break;
                    }
                }
            })?;
        Ok(Committer {
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

    /// Whether a checkpoint is being committed or synced.
    pub(crate) fn in_flight(&self) -> bool {
        self.pending.is_some()
    }

    /// Commit `cp` (recording `at_ms`) and make it durable; it needs the log from `floor`.
    /// The previous one must be done (see [`Committer::settle`]).
    pub(crate) fn begin(
        &mut self,
        cp: Arc<Checkpoint>,
        at_ms: u64,
        floor: Offset,
    ) -> Result<(), StoreError> {
        assert!(self.pending.is_none(), "one checkpoint in flight at a time");
        let next_offset = cp.progress.next_offset;
        let jobs = self.jobs.as_ref().ok_or_else(|| self.gone())?;
        jobs.send(Job::Commit { cp, at_ms })
            .map_err(|_| self.gone())?;
        self.pending = Some((next_offset, floor.min(next_offset)));
        Ok(())
    }

    /// The checkpoint newly committed and durable, if the one in flight is done (`wait`:
    /// wait for it).
    pub(crate) fn settle(&mut self, wait: bool) -> Result<Option<CheckpointInfo>, StoreError> {
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
        let Some((next, floor)) = self.pending.take() else {
            unreachable!("checked above");
        };
        let info = r?;
        debug_assert_eq!(info.next_offset, next);
        self.durable = self.durable.max(next);
        self.floor = self.floor.max(floor);
        Ok(Some(info))
    }

    /// The loop is done with `cp`, committed and durable (it read it as a layer until now):
    /// this thread frees it. The loop held the last reference, and freeing a checkpoint of
    /// 20,000 results (an ID, a topic and a payload each) took it ~2 ms at every checkpoint
    /// (issue 33). If the thread cannot take it, it is freed here.
    pub(crate) fn release(&self, cp: Arc<Checkpoint>) {
        if let Some(jobs) = &self.jobs {
            let _ = jobs.try_send(Job::Release(cp));
        }
    }

    fn gone(&self) -> StoreError {
        StoreError::Io {
            path: self.dir.clone(),
            source: std::io::Error::other("the checkpoint commit thread stopped"),
        }
    }
}

impl Drop for Committer {
    fn drop(&mut self) {
        self.jobs = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Commit and fsync one checkpoint.
fn run(store: &Store, cp: &Checkpoint, at_ms: u64) -> Result<CheckpointInfo, StoreError> {
    let fp = |name| {
        crate::failpoint::hit(name).map_err(|source| StoreError::Io {
            path: store.dir().to_path_buf(),
            source,
        })
    };
    fp("checkpoint.before_commit")?;
    let info = store.commit_unsynced(cp, at_ms)?;
    fp("checkpoint.after_commit")?;
    fp("checkpoint.before_fsync")?;
    store.sync()?;
    fp("checkpoint.after_fsync")?;
    Ok(info)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Progress;
    use crate::pipeline::engine::Batch;

    fn checkpoint(id: u64, next_offset: Offset) -> Arc<Checkpoint> {
        Arc::new(Checkpoint {
            progress: Progress {
                checkpoint_id: id,
                next_offset,
                ..Default::default()
            },
            batch: Batch {
                records: 1,
                ..Default::default()
            },
        })
    }

    #[test]
    fn a_checkpoint_commits_beside_the_caller_and_counts_as_durable_only_once_synced() {
        let dir = tempfile::tempdir().unwrap();
        let sync = crate::fsio::TestSync::new();
        let store = Arc::new(Store::open(dir.path(), 1 << 20, sync.clone()).unwrap());
        let mut c = Committer::start(store.clone(), 3, 2).unwrap();
        assert_eq!(c.settle(true).unwrap(), None, "nothing in flight");
        let before = sync.file_syncs();
        c.begin(checkpoint(1, 9), 77, 5).unwrap();
        assert!(c.in_flight());
        assert_eq!(c.durable(), 3, "not durable before the loop hears it is");
        assert_eq!(
            c.floor(),
            2,
            "retention keeps what the durable checkpoint needs"
        );
        let info = c.settle(true).unwrap().expect("done");
        assert_eq!(
            (info.id, info.next_offset, info.committed_at_ms),
            (1, 9, 77)
        );
        assert_eq!(store.progress().unwrap().next_offset, 9, "committed");
        assert!(sync.file_syncs() > before, "the thread fsynced the store");
        assert_eq!(c.durable(), 9);
        assert_eq!(
            c.floor(),
            5,
            "a backfill cursor below next_offset holds the log"
        );
        assert!(!c.in_flight());
        assert_eq!(c.settle(false).unwrap(), None);
        c.begin(checkpoint(2, 12), 78, 12).unwrap();
        assert!(
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| c.begin(
                checkpoint(3, 13),
                79,
                13
            )))
            .is_err(),
            "one checkpoint in flight at a time"
        );
    }

    #[test]
    fn a_released_checkpoint_is_freed_by_the_thread_and_the_next_commit_hears_only_itself() {
        let dir = tempfile::tempdir().unwrap();
        let store =
            Arc::new(Store::open(dir.path(), 1 << 20, crate::fsio::TestSync::new()).unwrap());
        let mut c = Committer::start(store.clone(), 0, 0).unwrap();
        let first = checkpoint(1, 4);
        let freed = Arc::downgrade(&first);
        c.begin(first.clone(), 1, 4).unwrap();
        assert_eq!(c.settle(true).unwrap().map(|i| i.id), Some(1));
        assert!(freed.upgrade().is_some(), "the caller still reads it");
        c.release(first);
        // The release and the next commit back to back: neither waits, and the release
        // gives the loop nothing to hear.
        c.begin(checkpoint(2, 8), 2, 8).unwrap();
        let info = c.settle(true).unwrap().expect("done");
        assert_eq!((info.id, info.next_offset), (2, 8));
        assert!(freed.upgrade().is_none(), "freed before the next commit");
        assert_eq!(c.settle(false).unwrap(), None);
    }

    #[test]
    fn a_commit_that_fails_is_reported_and_the_checkpoint_stays_undone() {
        let dir = tempfile::tempdir().unwrap();
        let store =
            Arc::new(Store::open(dir.path(), 1 << 20, crate::fsio::TestSync::new()).unwrap());
        let mut c = Committer::start(store.clone(), 0, 0).unwrap();
        // Checkpoint ids are consecutive: 5 after 0 is refused by the store (a panic on
        // the thread, which then stops: the loop hears it as an error, never as done).
        c.begin(checkpoint(5, 9), 1, 9).unwrap();
        assert!(c.settle(true).is_err());
        assert_eq!(c.durable(), 0);
        assert_eq!(store.progress().unwrap().next_offset, 0);
    }
}
