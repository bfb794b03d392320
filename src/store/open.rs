//! Opening a store: creating it whole or not at all, waiting for sled's lock, checking
//! its format and loading the ledger index and outbox into memory.

use super::*;

/// Ledger entries loaded into the index at a time.
const LOAD_BATCH: usize = 1 << 16;

impl Store {
    /// Open (or create) the store in `dir` with the default [`StoreBounds`]. See the module
    /// docs for the fsyncs it does.
    pub fn open(dir: &Path, cache_bytes: u64, sync: Durability) -> Result<Store, StoreError> {
        Store::open_with(dir, cache_bytes, sync, StoreBounds::default())
    }

    /// [`Store::open`] with the configured bounds.
    pub fn open_with(
        dir: &Path,
        cache_bytes: u64,
        sync: Durability,
        bounds: StoreBounds,
    ) -> Result<Store, StoreError> {
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
                crate::event!(warn, "store_snapshot_removed"; "store: removing incomplete sled snapshot {name}");
                fs::remove_file(entry.path()).map_err(io_err(&entry.path()))?;
            }
        }
        let db = open_sled(dir, cache_bytes)?;
        let t = |name: &str| db.open_tree(name);
        let store = Store {
            meta: t("meta")?,
            state: t("state")?,
            rows: t("rows")?,
            legacy: Default::default(),
            dedup: t("dedup")?,
            outbox: t("outbox")?,
            dead: t("dead")?,
            checkpoints: t("checkpoints")?,
            sparkplug: t("sparkplug")?,
            mem: Mutex::new(Mem::new(&bounds)),
            hasher: RandomState::new(),
            bounds,
            chunks_deleted: Default::default(),
            committed_id: Default::default(),
            db,
            dir: dir.to_path_buf(),
            sync,
        };
        store.check_format()?;
        store.make_files_durable()?;
        store.load()?;
        Ok(store)
    }

    /// A store without a progress record is new and gets this build's layout; one with a
    /// progress record but another layout is refused, never misread.
    fn check_format(&self) -> Result<(), StoreError> {
        let found = match self.meta.get(FORMAT_KEY)? {
            Some(v) => u32::from_be_bytes(
                v.as_ref()
                    .try_into()
                    .map_err(|_| StoreError::Corrupt("bad format record".into()))?,
            ),
            None if self.meta.get(PROGRESS_KEY)?.is_none() => {
                self.meta.insert(FORMAT_KEY, &STORE_FORMAT.to_be_bytes())?;
                STORE_FORMAT
            }
            None => 1,
        };
        if !(STORE_FORMAT_V2..=STORE_FORMAT).contains(&found) {
            return Err(StoreError::Format {
                path: self.dir.clone(),
                found,
            });
        }
        self.legacy.store(
            found <= STORE_FORMAT_V3,
            std::sync::atomic::Ordering::Release,
        );
        Ok(())
    }

    /// Rebuild the ledger's groups and index from the tree (see [`ledger`]): every chunk
    /// is read once, its entries hashed, none decoded into strings. Chunks of a checkpoint
    /// after the last committed one were written before a transaction that a crash (or an
    /// error) stopped: they are deleted, and never indexed. Kept, they would answer for IDs
    /// no checkpoint recorded, and replay (after a config edit, of other records) would
    /// drop those IDs as duplicates.
    pub(super) fn load_ledger(&self, mem: &mut Mem) -> Result<(), StoreError> {
        let bound = self.bounds.ledger_index_bytes();
        let committed = self.progress()?.checkpoint_id;
        self.committed_id
            .store(committed, std::sync::atomic::Ordering::Release);
        mem.memo = None;
        mem.applied_id = Some(committed);
        let mut uncommitted = sled::Batch::default();
        let mut removed = 0u64;
        // Chunks go in a batch at a time, sorted into the index together.
        let mut batch: Vec<ledger::NewChunk> = Vec::new();
        let mut pending = 0;
        for (n, kv) in self.dedup.iter().enumerate() {
            release_while_walking(n);
            let (k, v) = kv?;
            let (p, suffix) = split_pkey(&k)?;
            let suffix: ledger::Suffix = suffix
                .try_into()
                .map_err(|_| StoreError::Corrupt("a ledger key of another length".into()))?;
            if ledger::chunk_checkpoint(&suffix).is_some_and(|id| id > committed) {
                uncommitted.remove(k);
                removed += 1;
                continue;
            }
            let mut hashes = Vec::new();
            let (max_seen, _) = ledger::scan_chunk(&v, |id, _| {
                hashes.push(ledger::id_hash(&self.hasher, &p, id));
                true
            })
            .map_err(|_| bad_chunk())?;
            pending += hashes.len();
            batch.push(ledger::NewChunk {
                pipeline: p,
                suffix,
                max_seen,
                bytes: (k.len() + v.len()) as u64,
                hashes,
            });
            if pending >= LOAD_BATCH {
                mem.ledgers.add_chunks(&batch, bound);
                (batch, pending) = (Vec::new(), 0);
            }
        }
        mem.ledgers.add_chunks(&batch, bound);
        if removed > 0 {
            self.dedup.apply_batch(uncommitted)?;
            self.sync()?;
            crate::event!(info, "ledger_uncommitted_removed";
                "store: deleted {removed} dedup ledger chunks of a checkpoint that never \
                 committed (written before its transaction, which a crash stopped)"
            );
        }
        let unindexed = mem.ledgers.unindexed_chunks();
        if unindexed > 0 {
            crate::event!(warn, "ledger_index_full";
                "store: the dedup ledger index is at storage.ledger_index_max ({bound} bytes): \
                 {unindexed} chunks are not indexed, and every lookup reads them (exact, but \
                 slower); raise the bound or shorten dedup_window"
            );
        }
        Ok(())
    }

    /// Rebuild the in-memory ledger index and outbox bookkeeping from the trees.
    fn load(&self) -> Result<(), StoreError> {
        let mut mem = self.lock();
        self.load_ledger(&mut mem)?;
        let groups = match self.meta.get(LEDGER_GROUPS_KEY)? {
            Some(v) => decode::<Vec<(String, Vec<String>)>>("ledger groups", &v)?,
            None => Vec::new(),
        };
        // A group with no entries left (expired, or never written) is forgotten: the
        // record only grows with the sets of pipelines that shared a stream lately.
        let recorded = groups.len();
        let groups: std::collections::BTreeMap<String, Vec<String>> = (groups.into_iter())
            .filter(|(g, _)| mem.ledgers.get(g).is_some_and(|l| l.entries() > 0))
            .collect();
        mem.groups_unrecorded = groups.len() != recorded;
        mem.set_ledger_groups(groups);
        if let Some(v) = self.meta.get(LEDGER_WINDOWS_KEY)? {
            mem.windows = decode::<Vec<(String, u64)>>("ledger windows", &v)?
                .into_iter()
                .collect();
        }
        mem.dead = match self.meta.get(DEAD_STATS_KEY)? {
            Some(v) => decode("dead-letter counts", &v)?,
            // A store from before the counts: they start from what the tree holds.
            None => DeadLetterStats {
                stored: self.dead.len() as u64,
                ..DeadLetterStats::default()
            },
        };
        self.load_outbox(&mut mem)
    }

    /// Count the outbox's waiting results from the tree into `mem` (empty before).
    pub(super) fn load_outbox(&self, mem: &mut Mem) -> Result<(), StoreError> {
        let mut emptied = Vec::new();
        for kv in self.outbox.iter() {
            let (k, v) = kv?;
            let entries: Vec<(u64, Output)> = decode("outbox chunk", &v)?;
            let bytes = (k.len() + v.len()) as u64;
            emptied.extend(mem.outbox.add_chunk(u64_of(&k)?, Arc::new(entries), bytes));
        }
        // Superseded whole before a crash let their deletion be forgotten.
        for first in emptied {
            self.delete_outbox_chunk(first)?;
        }
        Ok(())
    }

    /// sled never fsyncs `conf`, `blobs/` or its directory; do it so a power cut right after
    /// creation cannot leave a store that will not open.
    pub(super) fn make_files_durable(&self) -> Result<(), StoreError> {
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
}

/// Create a store so that it either exists whole or not at all: sled writes `conf` and `db`
/// without fsync while it creates them, and a power cut then leaves a torn `conf` that sled
/// refuses to open (DESIGN §4). So build it under `<dir>.creating`, fsync every file and the
/// directory, and only then rename it into place and fsync the parent. A leftover
/// `<dir>.creating` is a creation a power cut interrupted; it held nothing yet.
fn create(dir: &Path, cache_bytes: u64, sync: &Durability) -> Result<(), StoreError> {
    let tmp = dir.with_extension("creating");
    if tmp.exists() {
        crate::event!(warn, "store_incomplete_removed";
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
pub(super) const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

pub(super) fn open_sled(dir: &Path, cache_bytes: u64) -> Result<sled::Db, StoreError> {
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
