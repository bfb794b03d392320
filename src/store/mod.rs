//! The checkpoint store: the only module that imports sled.
//!
//! # Guarantees
//!
//! - A checkpoint is all or nothing. State, dedup ledger, outbox entries, dead letters and
//!   the progress record (`next_offset`, checkpoint id, counters) for the log range
//!   `[prev.next_offset, next_offset)` are written in **one** sled transaction over all the
//!   trees, then `Db::flush()`, then a real `fsync` of sled's `db` file. [`Store::commit`]
//!   returns only after that fsync. A checkpoint that did not complete does not exist:
//!   recovery sees the previous one and replays from its `next_offset` (invariant 2;
//!   `tests/checkpoint.rs::a_crash_before_commit_leaves_the_previous_checkpoint`).
//! - `next_offset` never decreases and `checkpoint_id` rises by one per commit
//!   (`store::tests::commit_advances_progress`).
//! - Inserting an outbox entry whose ID is already there is a no-op
//!   (`store::tests::outbox_insert_is_idempotent_by_id`).
//! - Outbox deletions (on PUBACK) are not fsynced: losing one in a crash only re-sends an
//!   entry with the same ID, which consumers drop.
//!
//! # Why the extra fsyncs (DESIGN §4)
//!
//! - `Db::flush()` ends in `sync_file_range`, which persists neither the file size nor the
//!   device cache; without the `fsync` of `db`, acknowledged checkpoints were lost in
//!   simulated power cuts.
//! - A freshly created sled directory has not fsynced `conf`, `db`, `blobs/` or itself; a torn
//!   `conf` makes the store unopenable. [`Store::open`] fsyncs them (and the parent) every time.
//! - A kill during `open()` can leave `snap.*.generating`, which sled then picks and refuses
//!   to open; such files are deleted before opening.
//! - Values stay far below sled's ~128 KiB blob threshold (blob files are never fsynced):
//!   keys are bounded by `max_key_len`, outputs by the key and a few numbers, dead letters
//!   keep at most 1 KiB of payload.
//!
//! # Layout
//!
//! One tree per kind; pipeline-scoped keys start with `pipeline_name 0x00` (names cannot
//! contain NUL). `state`: p·skey → KeyState; `dedup`: p·event_id → seen_ms;
//! `dedup_exp`: p·seen_ms·event_id → () (the expiry index); `outbox`: seq → Output;
//! `outbox_ids`: id → seq; `dead`: offset·p → DeadLetter; `meta`: `progress` → Progress;
//! `checkpoints`: id → CheckpointInfo (the newest [`CHECKPOINT_HISTORY`]).

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;

use serde::{Deserialize, Serialize};

use sled::Transactional;

use crate::fsio::{Durability, SyncKind};
use crate::pipeline::engine::{Checkpoint, DeadLetter, Output, Progress, ReadError, ReadState};
use crate::pipeline::value::KeyState;

/// Checkpoint records kept for `cairn inspect checkpoints`.
pub const CHECKPOINT_HISTORY: u64 = 1000;

const PROGRESS_KEY: &[u8] = b"progress";

mod savepoint;
pub use savepoint::{
    SAVEPOINT_FORMAT_VERSION, SavepointInfo, list_savepoints, prune_savepoints,
    read_savepoint_header, restore_savepoint, savepoint_file_name, verify_savepoint,
};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("store I/O error at {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "the store at {path} cannot be opened: {source}. The replay log is not affected. Move \
         the store aside (`mv {path} {path}.broken`) and start again: the state is rebuilt from \
         the log, if it still starts at offset 0 (`cairn inspect log --limit 1`). Otherwise \
         restore a savepoint (`cairn savepoint restore --latest`), and the log replays from there"
    )]
    Open { path: PathBuf, source: sled::Error },
    #[error("the store at {path} is in use by another process (is the agent running?)")]
    Locked { path: PathBuf },
    #[error("store error: {0}")]
    Sled(#[from] sled::Error),
    #[error("the store is corrupt: {0}")]
    Corrupt(String),
}

impl StoreError {
    /// The operating-system error underneath, if any: sled's errors do not expose it as a
    /// `source`, and the agent needs it to tell a full disk from other failures.
    pub fn io_error(&self) -> Option<&std::io::Error> {
        match self {
            StoreError::Io { source, .. } => Some(source),
            StoreError::Open {
                source: sled::Error::Io(e),
                ..
            }
            | StoreError::Sled(sled::Error::Io(e)) => Some(e),
            _ => None,
        }
    }
}

/// One line of checkpoint history.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointInfo {
    pub id: u64,
    pub prev_offset: u64,
    pub next_offset: u64,
    pub records: u64,
    pub outputs: u64,
    pub dead_letters: u64,
    /// Wall clock at commit (for operators only; never read by processing).
    pub committed_at_ms: u64,
}

pub struct Store {
    db: sled::Db,
    dir: PathBuf,
    sync: Durability,
    meta: sled::Tree,
    state: sled::Tree,
    dedup: sled::Tree,
    dedup_exp: sled::Tree,
    outbox: sled::Tree,
    outbox_ids: sled::Tree,
    dead: sled::Tree,
    checkpoints: sled::Tree,
    /// Entries in `outbox`, kept here because sled's `len()` walks the whole tree and the
    /// agent asks for it every loop pass.
    outbox_count: std::sync::atomic::AtomicUsize,
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> StoreError + '_ {
    move |source| StoreError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn pkey(pipeline: &str, rest: &[u8]) -> Vec<u8> {
    let mut k = Vec::with_capacity(pipeline.len() + 1 + rest.len());
    k.extend_from_slice(pipeline.as_bytes());
    k.push(0);
    k.extend_from_slice(rest);
    k
}

fn split_pkey(k: &[u8]) -> Result<(String, &[u8]), StoreError> {
    let i = k
        .iter()
        .position(|&b| b == 0)
        .ok_or_else(|| StoreError::Corrupt("key without pipeline".into()))?;
    let p = String::from_utf8(k[..i].to_vec())
        .map_err(|_| StoreError::Corrupt("pipeline name not UTF-8".into()))?;
    Ok((p, &k[i + 1..]))
}

fn decode<T: for<'a> Deserialize<'a>>(what: &str, bytes: &[u8]) -> Result<T, StoreError> {
    postcard::from_bytes(bytes).map_err(|e| StoreError::Corrupt(format!("undecodable {what}: {e}")))
}

fn encode<T: Serialize>(v: &T) -> Vec<u8> {
    postcard::to_stdvec(v).expect("postcard encodes plain data")
}

fn u64_of(bytes: &[u8]) -> Result<u64, StoreError> {
    Ok(u64::from_be_bytes(
        bytes
            .try_into()
            .map_err(|_| StoreError::Corrupt("bad u64".into()))?,
    ))
}

impl Store {
    /// Open (or create) the store in `dir`. See the module docs for the fsyncs it does.
    pub fn open(dir: &Path, cache_bytes: u64, sync: Durability) -> Result<Store, StoreError> {
        if !dir.exists() {
            create(dir, cache_bytes, &sync)?;
        }
        // A kill during sled's snapshot write leaves `snap.*.generating`, which sled would
        // pick and then refuse to open (upstream #1527/#1533). It is never needed.
        for entry in fs::read_dir(dir).map_err(io_err(dir))? {
            let entry = entry.map_err(io_err(dir))?;
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if name.starts_with("snap.") && name.ends_with(".generating") {
                log::warn!("store: removing incomplete sled snapshot {name}");
                fs::remove_file(entry.path()).map_err(io_err(&entry.path()))?;
            }
        }
        let db = open_sled(dir, cache_bytes)?;
        let t = |name: &str| db.open_tree(name);
        let store = Store {
            meta: t("meta")?,
            state: t("state")?,
            dedup: t("dedup")?,
            dedup_exp: t("dedup_exp")?,
            outbox: t("outbox")?,
            outbox_ids: t("outbox_ids")?,
            dead: t("dead")?,
            checkpoints: t("checkpoints")?,
            outbox_count: Default::default(),
            db,
            dir: dir.to_path_buf(),
            sync,
        };
        store.make_files_durable()?;
        store
            .outbox_count
            .store(store.outbox.len(), Ordering::SeqCst);
        Ok(store)
    }

    /// sled never fsyncs `conf`, `blobs/` or its directory; do it so a power cut right after
    /// creation cannot leave a store that will not open.
    fn make_files_durable(&self) -> Result<(), StoreError> {
        self.db.flush()?;
        for name in ["conf", "db"] {
            let path = self.dir.join(name);
            if path.exists() {
                let f = fs::File::open(&path).map_err(io_err(&path))?;
                self.sync
                    .sync_file(SyncKind::Store, &f, &path, false)
                    .map_err(io_err(&path))?;
            }
        }
        let blobs = self.dir.join("blobs");
        if blobs.is_dir() {
            self.sync.sync_dir(&blobs).map_err(io_err(&blobs))?;
        }
        self.sync.sync_dir(&self.dir).map_err(io_err(&self.dir))?;
        Ok(())
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The last durable checkpoint's progress (empty for a new store).
    pub fn progress(&self) -> Result<Progress, StoreError> {
        match self.meta.get(PROGRESS_KEY)? {
            None => Ok(Progress::default()),
            Some(v) => decode("progress", &v),
        }
    }

    /// Commit one checkpoint atomically and durably (see the module docs).
    pub fn commit(
        &self,
        cp: &Checkpoint,
        committed_at_ms: u64,
    ) -> Result<CheckpointInfo, StoreError> {
        let prev = self.progress()?;
        assert!(
            cp.progress.next_offset >= prev.next_offset,
            "checkpoint would move next_offset back"
        );
        assert_eq!(
            cp.progress.checkpoint_id,
            prev.checkpoint_id + 1,
            "checkpoint ids are consecutive"
        );
        let b = &cp.batch;
        let mut state = sled::Batch::default();
        for ((p, skey), v) in &b.state {
            match v {
                Some(s) => state.insert(pkey(p, skey), encode(s)),
                None => state.remove(pkey(p, skey)),
            }
        }
        let mut dedup = sled::Batch::default();
        let mut dedup_exp = sled::Batch::default();
        for ((p, id), w) in &b.dedup {
            if let Some(old) = w.old_seen_ms {
                dedup_exp.remove(pkey(p, &[&old.to_be_bytes()[..], id.as_bytes()].concat()));
            }
            match w.new_seen_ms {
                Some(seen) => {
                    dedup.insert(pkey(p, id.as_bytes()), &seen.to_be_bytes());
                    dedup_exp.insert(
                        pkey(p, &[&seen.to_be_bytes()[..], id.as_bytes()].concat()),
                        &[],
                    );
                }
                None => dedup.remove(pkey(p, id.as_bytes())),
            }
        }
        let mut dead = sled::Batch::default();
        for d in &b.dead_letters {
            dead.insert(pkey_dead(d.offset, &d.pipeline), encode(d));
        }
        let info = CheckpointInfo {
            id: cp.progress.checkpoint_id,
            prev_offset: prev.next_offset,
            next_offset: cp.progress.next_offset,
            records: b.records,
            outputs: b.outputs.len() as u64,
            dead_letters: b.dead_letters.len() as u64,
            committed_at_ms,
        };
        let progress = encode(&cp.progress);
        let inserted = std::cell::Cell::new(0usize);
        let trees = [
            &self.meta,
            &self.state,
            &self.dedup,
            &self.dedup_exp,
            &self.outbox,
            &self.outbox_ids,
            &self.dead,
            &self.checkpoints,
        ];
        trees[..]
            .transaction(|tx| {
                let (meta, st, dd, dx, ob, oi, dl, ck) = (
                    &tx[0], &tx[1], &tx[2], &tx[3], &tx[4], &tx[5], &tx[6], &tx[7],
                );
                st.apply_batch(&state)?;
                dd.apply_batch(&dedup)?;
                dx.apply_batch(&dedup_exp)?;
                dl.apply_batch(&dead)?;
                inserted.set(0); // the closure may run again after a conflict
                for (seq, out) in &b.outputs {
                    // Invariant 6: an ID already in the outbox is not inserted again.
                    if oi.get(out.id.as_bytes())?.is_none() {
                        oi.insert(out.id.as_bytes(), &seq.to_be_bytes())?;
                        ob.insert(&seq.to_be_bytes(), encode(out))?;
                        inserted.set(inserted.get() + 1);
                    }
                }
                ck.insert(&info.id.to_be_bytes(), encode(&info))?;
                if info.id > CHECKPOINT_HISTORY {
                    ck.remove(&(info.id - CHECKPOINT_HISTORY).to_be_bytes())?;
                }
                meta.insert(PROGRESS_KEY, progress.as_slice())?;
                Ok::<(), sled::transaction::ConflictableTransactionError<()>>(())
            })
            .map_err(|e| match e {
                sled::transaction::TransactionError::Storage(e) => StoreError::Sled(e),
                sled::transaction::TransactionError::Abort(()) => unreachable!("never aborts"),
            })?;
        self.outbox_count
            .fetch_add(inserted.get(), Ordering::SeqCst);
        let fp = |name| crate::failpoint::hit(name).map_err(io_err(&self.dir));
        fp("checkpoint.before_fsync")?;
        self.sync()?;
        fp("checkpoint.after_fsync")?;
        Ok(info)
    }

    /// `flush()` and then the real fsync that `flush()` alone does not give.
    pub fn sync(&self) -> Result<(), StoreError> {
        self.db.flush()?;
        if crate::failpoint::enabled("unsafe.skip_store_fsync") {
            return Ok(()); // deliberately unsafe build for the crash harness's own test
        }
        let path = self.dir.join("db");
        let f = fs::File::open(&path).map_err(io_err(&path))?;
        self.sync
            .sync_file(SyncKind::Store, &f, &path, false)
            .map_err(io_err(&path))
    }

    /// Forget one pipeline's state and dedup ledger, and record `progress` (in which that
    /// pipeline starts over), in one transaction followed by the fsync. Its outbox entries
    /// and dead letters stay: they were results and refusals of the old definition.
    pub fn reset_pipeline(&self, pipeline: &str, progress: &Progress) -> Result<(), StoreError> {
        let prefix = pkey(pipeline, &[]);
        let mut batches = [
            sled::Batch::default(),
            sled::Batch::default(),
            sled::Batch::default(),
        ];
        for (i, tree) in [&self.state, &self.dedup, &self.dedup_exp]
            .into_iter()
            .enumerate()
        {
            for k in tree.scan_prefix(&prefix).keys() {
                batches[i].remove(k?);
            }
        }
        let progress = encode(progress);
        let trees = [&self.meta, &self.state, &self.dedup, &self.dedup_exp];
        trees[..]
            .transaction(|tx| {
                tx[1].apply_batch(&batches[0])?;
                tx[2].apply_batch(&batches[1])?;
                tx[3].apply_batch(&batches[2])?;
                tx[0].insert(PROGRESS_KEY, progress.as_slice())?;
                Ok::<(), sled::transaction::ConflictableTransactionError<()>>(())
            })
            .map_err(|e| match e {
                sled::transaction::TransactionError::Storage(e) => StoreError::Sled(e),
                sled::transaction::TransactionError::Abort(()) => unreachable!("never aborts"),
            })?;
        self.sync()
    }

    // ---- outbox (publisher side) ----

    /// Outbox entries with sequence number ≥ `from`, in order.
    pub fn outbox_from(
        &self,
        from: u64,
    ) -> impl Iterator<Item = Result<(u64, Output), StoreError>> + '_ {
        self.outbox.range(from.to_be_bytes()..).map(|r| {
            let (k, v) = r?;
            Ok((u64_of(&k)?, decode("outbox entry", &v)?))
        })
    }

    /// Delete a published entry (on PUBACK). Not fsynced: see the module docs.
    pub fn outbox_delete(&self, seq: u64, id: &str) -> Result<(), StoreError> {
        if self.outbox.remove(seq.to_be_bytes())?.is_some() {
            self.outbox_count.fetch_sub(1, Ordering::SeqCst);
        }
        self.outbox_ids.remove(id.as_bytes())?;
        Ok(())
    }

    /// Entries waiting in the outbox (O(1)).
    pub fn outbox_len(&self) -> usize {
        self.outbox_count.load(Ordering::SeqCst)
    }

    // ---- inspection ----

    /// Every state entry, optionally of one pipeline: (pipeline, stored key, state).
    pub fn states(
        &self,
        pipeline: Option<&str>,
    ) -> impl Iterator<Item = Result<(String, Vec<u8>, KeyState), StoreError>> + '_ {
        let it = match pipeline {
            Some(p) => self.state.scan_prefix(pkey(p, &[])),
            None => self.state.iter(),
        };
        it.map(|r| {
            let (k, v) = r?;
            let (p, skey) = split_pkey(&k)?;
            Ok((p, skey.to_vec(), decode("state", &v)?))
        })
    }

    pub fn state_len(&self) -> usize {
        self.state.len()
    }

    /// Every ledger entry: (pipeline, event ID, seen_ms).
    pub fn dedup_entries(
        &self,
        pipeline: Option<&str>,
    ) -> impl Iterator<Item = Result<(String, String, u64), StoreError>> + '_ {
        let it = match pipeline {
            Some(p) => self.dedup.scan_prefix(pkey(p, &[])),
            None => self.dedup.iter(),
        };
        it.map(|r| {
            let (k, v) = r?;
            let (p, id) = split_pkey(&k)?;
            Ok((p, String::from_utf8_lossy(id).into_owned(), u64_of(&v)?))
        })
    }

    pub fn dead_letters(&self) -> impl Iterator<Item = Result<DeadLetter, StoreError>> + '_ {
        self.dead.iter().map(|r| decode("dead letter", &r?.1))
    }

    pub fn dead_letter_len(&self) -> usize {
        self.dead.len()
    }

    pub fn checkpoints(
        &self,
    ) -> impl DoubleEndedIterator<Item = Result<CheckpointInfo, StoreError>> + '_ {
        self.checkpoints
            .iter()
            .map(|r| decode("checkpoint record", &r?.1))
    }

    /// Bytes sled reports on disk.
    pub fn size_on_disk(&self) -> u64 {
        self.db.size_on_disk().unwrap_or(0)
    }
}

/// Create a store so that it either exists whole or not at all: sled writes `conf` and `db`
/// without fsync while it creates them, and a power cut then leaves a torn `conf` that sled
/// refuses to open (DESIGN §4). So build it under `<dir>.creating`, fsync every file and the
/// directory, and only then rename it into place and fsync the parent. A leftover
/// `<dir>.creating` is a creation a power cut interrupted; it held nothing yet.
fn create(dir: &Path, cache_bytes: u64, sync: &Durability) -> Result<(), StoreError> {
    let tmp = dir.with_extension("creating");
    if tmp.exists() {
        log::warn!(
            "store: removing {}, left by an interrupted creation",
            tmp.display()
        );
        fs::remove_dir_all(&tmp).map_err(io_err(&tmp))?;
    }
    crate::fsio::create_dir_all_durable(&tmp, sync).map_err(io_err(&tmp))?;
    {
        let db = open_sled(&tmp, cache_bytes)?;
        db.flush()?;
        for name in ["conf", "db"] {
            let path = tmp.join(name);
            if path.exists() {
                let f = fs::File::open(&path).map_err(io_err(&path))?;
                sync.sync_file(SyncKind::Store, &f, &path, false)
                    .map_err(io_err(&path))?;
            }
        }
        let blobs = tmp.join("blobs");
        if blobs.is_dir() {
            sync.sync_dir(&blobs).map_err(io_err(&blobs))?;
        }
        sync.sync_dir(&tmp).map_err(io_err(&tmp))?;
    }
    fs::rename(&tmp, dir).map_err(io_err(dir))?;
    let parent = dir
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    sync.sync_dir(parent).map_err(io_err(parent))?;
    Ok(())
}

/// How long `open` waits for sled's file lock. A store dropped in this process releases its
/// lock only when sled's flusher thread lets go of it, a moment later; another live process
/// (the agent, while `cairn inspect` runs) keeps it, and then `open` fails with `Locked`.
const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

fn open_sled(dir: &Path, cache_bytes: u64) -> Result<sled::Db, StoreError> {
    let deadline = std::time::Instant::now() + LOCK_WAIT;
    loop {
        match sled::Config::new()
            .path(dir)
            .cache_capacity(cache_bytes)
            .open()
        {
            Ok(db) => return Ok(db),
            Err(sled::Error::Io(e)) if e.to_string().contains("could not acquire lock") => {
                if std::time::Instant::now() >= deadline {
                    return Err(StoreError::Locked {
                        path: dir.to_path_buf(),
                    });
                }
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            Err(source) => {
                return Err(StoreError::Open {
                    path: dir.to_path_buf(),
                    source,
                });
            }
        }
    }
}

fn pkey_dead(offset: u64, pipeline: &str) -> Vec<u8> {
    let mut k = offset.to_be_bytes().to_vec();
    k.extend_from_slice(pipeline.as_bytes());
    k
}

fn read_err(e: StoreError) -> ReadError {
    ReadError(e.to_string())
}

impl ReadState for Store {
    fn state(&self, pipeline: &str, skey: &[u8]) -> Result<Option<KeyState>, ReadError> {
        match self
            .state
            .get(pkey(pipeline, skey))
            .map_err(|e| read_err(e.into()))?
        {
            None => Ok(None),
            Some(v) => decode("state", &v).map(Some).map_err(read_err),
        }
    }

    fn dedup(&self, pipeline: &str, event_id: &str) -> Result<Option<u64>, ReadError> {
        match self
            .dedup
            .get(pkey(pipeline, event_id.as_bytes()))
            .map_err(|e| read_err(e.into()))?
        {
            None => Ok(None),
            Some(v) => u64_of(&v).map(Some).map_err(read_err),
        }
    }

    fn window_keys(&self, pipeline: &str, from: u64, to: u64) -> Result<Vec<Vec<u8>>, ReadError> {
        let lo = pkey(pipeline, &from.to_be_bytes());
        let hi = pkey(pipeline, &to.to_be_bytes());
        let plen = pipeline.len() + 1;
        self.state
            .range(lo..hi)
            .map(|r| {
                r.map(|(k, _)| k[plen..].to_vec())
                    .map_err(|e| read_err(e.into()))
            })
            .collect()
    }

    fn dedup_expired(
        &self,
        pipeline: &str,
        before_ms: u64,
        limit: usize,
    ) -> Result<Vec<(u64, String)>, ReadError> {
        let lo = pkey(pipeline, &[]);
        let hi = pkey(pipeline, &before_ms.to_be_bytes());
        let plen = pipeline.len() + 1;
        self.dedup_exp
            .range(lo..hi)
            .take(limit)
            .map(|r| {
                let (k, _) = r.map_err(|e| read_err(e.into()))?;
                let rest = &k[plen..];
                let seen = u64_of(&rest[..8]).map_err(read_err)?;
                Ok((seen, String::from_utf8_lossy(&rest[8..]).into_owned()))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests;
