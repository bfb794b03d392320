//! Savepoints: one portable file holding a consistent copy of every checkpoint tree, so the
//! state can be rebuilt when sled's own files cannot be opened (DESIGN §4: sled has been
//! reported corrupt after abrupt stops).
//!
//! # Guarantees
//!
//! - **A savepoint is exactly one checkpoint.** [`Store::write_savepoint`] copies every
//!   checkpoint tree (`meta`, `state`, `dedup`, `outbox`, `dead`, `checkpoints`, `sparkplug`, `rows`). It is consistent because nothing commits while it runs: the agent calls
//!   it on its own thread between two checkpoints (the same thread that commits and deletes
//!   outbox entries), and `cairn savepoint create` holds the store lock, so no agent runs.
//!   The progress record is read before and after the copy and must not have changed (an
//!   assertion: a concurrent commit would be a bug in the caller).
//! - **A savepoint exists under its name only complete and durable.** It is written to a
//!   `.savepoint-*.tmp` file in the savepoints directory, fsynced, its CRC checked by reading
//!   it back, then renamed to `savepoint-<seq, 20 digits>-<checkpoint id>-<next_offset>.cairn`,
//!   and the directory fsynced. A crash leaves at most a temp file, removed by the next write.
//! - **Savepoints are ordered by when they were taken**, by `seq`: one more than the highest
//!   in the directory. Not by checkpoint ID (IDs start again after a store is rebuilt, so a
//!   newer savepoint can carry a lower ID) and not by wall clock (edge boxes step theirs).
//!   Pruning keeps the newest, `restore --latest` and the agent's floor take the newest.
//!   Files named by older builds (`savepoint-<id, 20 digits>-<next_offset>.cairn`) count as
//!   `seq` 0, older than any new one.
//! - **The directory is bounded**: every write prunes to `[savepoint] keep`.
//! - **Restore trusts nothing it has not checked.** [`restore_savepoint`] reads the whole
//!   file before it builds or moves anything, and checks every entry as the store will read
//!   it, not only the CRC (`savepoint_check.rs`; a crafted file with valid checksums moved the
//!   good store aside and left one the agent refused, issue 27); it checks the CRC again
//!   while building, and that the built store's progress matches the header. Its memory is
//!   bounded by entry size and batch bytes, not by the file.
//! - **Restore never deletes a store.** The new store is built in `<store>.restoring` and
//!   made durable (the same fsyncs as [`Store::open`]); only then is an existing store
//!   renamed to `<store>.old-<n>` and the new one renamed into place, and the parent
//!   directory fsynced. A crash between the two renames leaves no `<store>`: run the restore
//!   again (the agent would otherwise start empty and refuse with a log gap).
//! - **Restore brings back a checkpoint, the log the rest.** After a restore the next start
//!   replays the log from the savepoint's `next_offset` (invariant 4), so the log must still
//!   reach back that far; `cairn savepoint restore` checks it and the agent's retention never
//!   deletes below the newest savepoint.
//!
//! Tests: `tests/it/savepoint.rs`.
//!
//! # Format (version 2; integers little-endian)
//!
//! ```text
//! header   "CAIRNSP\0" | version u32 | flags u32 (0) | checkpoint_id u64 | next_offset u64
//!          | entries u64 | created_at_ms u64 | crc32 u32 of the 48 bytes before it
//! entry*   tree u8 | key_len u32 | value_len u32 | key | value
//! trailer  "CAIRNEND" | crc32 u32 of every byte of the file before it
//! ```
//!
//! Keys and values are the trees' own bytes (big-endian integers and postcard), so the file
//! is independent of sled's on-disk format. Tree numbers are [`TREES`]' indices. Version 1
//! held store format 1's trees (a key per ledger entry and per output); this build refuses
//! it by its version number rather than misread it.

use std::fs::{self, File};
use std::io::{self, BufReader, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use super::{Store, StoreError, io_err, release_while_walking};

/// How often [`Store::write_savepoint_with`] reports, in entries written.
pub const SAVEPOINT_PROGRESS_EVERY: u64 = 4096;
use crate::fsio::{Durability, SyncKind};
use crate::text::Shown;

const MAGIC: &[u8; 8] = b"CAIRNSP\0";
const END_MAGIC: &[u8; 8] = b"CAIRNEND";
pub const SAVEPOINT_FORMAT_VERSION: u32 = 2;
const HEADER_LEN: usize = 52;
const TRAILER_LEN: u64 = 12;
/// No tree key or value comes near this (values stay below sled's 128 KiB blob threshold);
/// a larger length field is damage, refused before anything is allocated.
const MAX_FIELD_LEN: u32 = 1 << 20;
/// Entries per sled batch while restoring: bounds memory, keeps batches cheap.
const RESTORE_BATCH: usize = 10_000;
/// Bytes of keys and values per sled batch while restoring: with entries of up to the
/// store's bound, [`RESTORE_BATCH`] alone would let a batch hold 70 MiB.
const RESTORE_BATCH_BYTES: usize = 4 << 20;
/// Bytes restored between two reopenings of the store being built (see `Building`).
const RESTORE_REOPEN_BYTES: usize = 32 << 20;
const FILE_PREFIX: &str = "savepoint-";
const FILE_SUFFIX: &str = ".cairn";
const TMP_PREFIX: &str = ".savepoint-";

#[path = "savepoint_check.rs"]
mod check;

/// The checkpoint trees, in file order; an entry's tree byte is the index here.
/// `sparkplug` came last (issue 31), so savepoints written before it read unchanged.
/// `rows` came with store format 4 (issue 33).
pub(crate) const TREES: [&str; 8] = [
    "meta",
    "state",
    "dedup",
    "outbox",
    "dead",
    "checkpoints",
    "sparkplug",
    "rows",
];

/// What a savepoint file's header says, plus where it is and how big.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SavepointInfo {
    pub path: PathBuf,
    pub format_version: u32,
    pub checkpoint_id: u64,
    /// The first log offset the savepoint does not reflect: replay starts here.
    pub next_offset: u64,
    pub entries: u64,
    /// Wall clock when written (for operators only).
    pub created_at_ms: u64,
    pub bytes: u64,
    /// Order of writing, from the file name (see the module docs); 0 for older names.
    pub seq: u64,
}

struct Header {
    checkpoint_id: u64,
    next_offset: u64,
    entries: u64,
    created_at_ms: u64,
}

impl Header {
    fn encode(&self) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        h[0..8].copy_from_slice(MAGIC);
        h[8..12].copy_from_slice(&SAVEPOINT_FORMAT_VERSION.to_le_bytes());
        // 12..16: flags, zero in version 1.
        h[16..24].copy_from_slice(&self.checkpoint_id.to_le_bytes());
        h[24..32].copy_from_slice(&self.next_offset.to_le_bytes());
        h[32..40].copy_from_slice(&self.entries.to_le_bytes());
        h[40..48].copy_from_slice(&self.created_at_ms.to_le_bytes());
        let crc = crc32fast::hash(&h[..48]);
        h[48..52].copy_from_slice(&crc.to_le_bytes());
        h
    }

    fn decode(file: &Path, h: &[u8; HEADER_LEN]) -> Result<Header, StoreError> {
        let bad = |what: String| corrupt(file, what);
        if &h[0..8] != MAGIC {
            return Err(bad("not a Cairn savepoint (bad magic)".into()));
        }
        let u32_at = |i: usize| u32::from_le_bytes(h[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(h[i..i + 8].try_into().expect("8 bytes"));
        if u32_at(48) != crc32fast::hash(&h[..48]) {
            return Err(bad("header CRC mismatch".into()));
        }
        let version = u32_at(8);
        if version != SAVEPOINT_FORMAT_VERSION {
            return Err(bad(format!(
                "format version {version}, this cairn reads {SAVEPOINT_FORMAT_VERSION}"
            )));
        }
        if u32_at(12) != 0 {
            return Err(bad("unknown flags".into()));
        }
        Ok(Header {
            checkpoint_id: u64_at(16),
            next_offset: u64_at(24),
            entries: u64_at(32),
            created_at_ms: u64_at(40),
        })
    }
}

fn corrupt(file: &Path, what: impl std::fmt::Display) -> StoreError {
    StoreError::Corrupt(format!(
        "savepoint {} is damaged: {what}; choose another one (`cairn savepoint list`)",
        file.display()
    ))
}

fn now_ms() -> u64 {
    crate::clock::system_wall_ms()
}

/// For `crate::fuzzing` (through `store/fuzz.rs`): `body` (entries as the file holds them)
/// framed with a valid header (checkpoint 0 at offset 0, the count of whole entries), the
/// end marker and the CRC, so that a fuzzer reaches the checks of each entry.
pub(super) fn fuzz_frame(body: &[u8]) -> Vec<u8> {
    let mut entries = 0u64;
    let mut at = 0usize;
    while let Some(fixed) = body.get(at..at + 9) {
        let k = u32::from_le_bytes(fixed[1..5].try_into().expect("4 bytes")) as usize;
        let v = u32::from_le_bytes(fixed[5..9].try_into().expect("4 bytes")) as usize;
        match at.checked_add(9 + k.saturating_add(v)) {
            Some(end) if end <= body.len() => {
                entries += 1;
                at = end;
            }
            _ => break,
        }
    }
    let header = Header {
        checkpoint_id: 0,
        next_offset: 0,
        entries,
        created_at_ms: 0,
    };
    let mut out = header.encode().to_vec();
    out.extend_from_slice(body);
    out.extend_from_slice(END_MAGIC);
    let crc = crc32fast::hash(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

/// For `crate::fuzzing`: every check a restore runs before it builds anything.
pub(super) fn fuzz_check(file: &Path) -> Result<SavepointInfo, StoreError> {
    check::check_savepoint(file)
}

/// `savepoint-<seq, 20 digits>-<id>-<next_offset>.cairn`: names sort by when they were taken.
pub(crate) fn savepoint_file_name(seq: u64, checkpoint_id: u64, next_offset: u64) -> String {
    format!("{FILE_PREFIX}{seq:020}-{checkpoint_id}-{next_offset}{FILE_SUFFIX}")
}

/// The `seq` a savepoint name carries: `Some(0)` for the two-field names of older builds,
/// `None` for a name that is not a savepoint's.
fn seq_of_name(name: &str) -> Option<u64> {
    let middle = name.strip_prefix(FILE_PREFIX)?.strip_suffix(FILE_SUFFIX)?;
    let fields: Vec<&str> = middle.split('-').collect();
    if !fields
        .iter()
        .all(|f| !f.is_empty() && f.bytes().all(|b| b.is_ascii_digit()))
    {
        return None;
    }
    match fields.len() {
        2 => Some(0),
        3 => fields[0].parse().ok(),
        _ => None,
    }
}

/// One more than the highest `seq` named in `dir`, damaged files included (their number
/// must not be reused either).
fn next_seq(dir: &Path) -> Result<u64, StoreError> {
    let mut high = 0u64;
    for entry in fs::read_dir(dir).map_err(io_err(dir))? {
        let entry = entry.map_err(io_err(dir))?;
        if let Some(seq) = seq_of_name(&entry.file_name().to_string_lossy()) {
            high = high.max(seq);
        }
    }
    high.checked_add(1).ok_or_else(|| {
        StoreError::Corrupt(format!(
            "savepoint sequence exhausted in {}: a file claims seq {high}",
            dir.display()
        ))
    })
}

/// Hashes everything written through it.
struct CrcWriter<W: Write> {
    inner: W,
    crc: crc32fast::Hasher,
}

impl<W: Write> Write for CrcWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.crc.update(&buf[..n]);
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

impl Store {
    /// Every checkpoint tree, in one order: a savepoint copies these, and the checkpoint
    /// transaction (`commit.rs`) spans them, indexing them by this order.
    pub(super) fn trees(&self) -> [&sled::Tree; 8] {
        [
            &self.meta,
            &self.state,
            &self.dedup,
            &self.outbox,
            &self.dead,
            &self.checkpoints,
            &self.sparkplug,
            &self.rows,
        ]
    }

    /// Bytes of keys and values in the checkpoint trees: what a savepoint holds, and about
    /// what a store rebuilt from one needs. The agent compares sled's files with it to tell
    /// when sled keeps far more than the live data.
    ///
    /// The ledger and the outbox, the large trees, are counted as their chunks are written
    /// and deleted (rebuilt at open); the other trees are walked: call it rarely. Walking the
    /// ledger too pulled every chunk of a million-entry ledger through sled's cache at once,
    /// the largest single item of the agent's peak RSS (issue 16), and evicted the state the
    /// agent was working on. The walk hands sled's evicted pages back as it goes
    /// ([`release_while_walking`]).
    pub fn live_bytes(&self) -> Result<u64, StoreError> {
        let counted = {
            let mem = self.lock();
            let ledgers = mem.ledgers.values().map(super::ledger::Ledger::bytes);
            ledgers.fold(mem.outbox.bytes(), u64::saturating_add)
        };
        let mut total = counted;
        let trees = [
            &self.meta,
            &self.state,
            &self.rows,
            &self.dead,
            &self.checkpoints,
            &self.sparkplug,
        ];
        for tree in trees {
            for (i, kv) in tree.iter().enumerate() {
                let (k, v) = kv?;
                total = total.saturating_add((k.len() + v.len()) as u64);
                release_while_walking(i);
            }
        }
        Ok(total)
    }

    /// Write a savepoint of the last durable checkpoint into `dir` (created if needed).
    ///
    /// The caller must not commit while this runs (see the module docs); the agent calls it
    /// between checkpoints on its own thread.
    pub fn write_savepoint(
        &self,
        dir: &Path,
        sync: &Durability,
    ) -> Result<SavepointInfo, StoreError> {
        self.write_savepoint_with(dir, sync, &mut |_| {})
    }

    /// [`Store::write_savepoint`], calling `progress` with the entries written so far every
    /// [`SAVEPOINT_PROGRESS_EVERY`] entries: a long write on the agent's loop feeds the
    /// service manager's watchdog from there (issue 26).
    pub fn write_savepoint_with(
        &self,
        dir: &Path,
        sync: &Durability,
        progress: &mut dyn FnMut(u64),
    ) -> Result<SavepointInfo, StoreError> {
        if !dir.is_dir() {
            fs::create_dir_all(dir).map_err(io_err(dir))?;
            if let Some(parent) = dir.parent() {
                sync.sync_dir(parent).map_err(io_err(parent))?;
            }
        }
        remove_stale_temp_files(dir)?;
        let seq = next_seq(dir)?;
        let before = self.progress()?;
        let tmp = dir.join(format!("{TMP_PREFIX}{}.tmp", before.checkpoint_id));
        // New, private, never through a link planted under the name (issue 27); a temp file
        // of an earlier crash was removed just above.
        let file = crate::fsio::create_new_private(&tmp).map_err(io_err(&tmp))?;
        let mut header = Header {
            checkpoint_id: before.checkpoint_id,
            next_offset: before.next_offset,
            entries: 0,
            created_at_ms: now_ms(),
        };
        // The entry count is known only at the end: a placeholder header now, the real one
        // (and the CRC, combined from the header's and the body's) once the body is written.
        let mut out = BufWriter::with_capacity(1 << 16, file);
        out.write_all(&[0u8; HEADER_LEN]).map_err(io_err(&tmp))?;
        let mut body = CrcWriter {
            inner: out,
            crc: crc32fast::Hasher::new(),
        };
        for (i, tree) in self.trees().into_iter().enumerate() {
            for (n, kv) in tree.iter().enumerate() {
                release_while_walking(n);
                let (k, v) = kv?;
                let (klen, vlen) = (field_len(&k)?, field_len(&v)?);
                body.write_all(&[i as u8]).map_err(io_err(&tmp))?;
                body.write_all(&klen.to_le_bytes()).map_err(io_err(&tmp))?;
                body.write_all(&vlen.to_le_bytes()).map_err(io_err(&tmp))?;
                body.write_all(&k).map_err(io_err(&tmp))?;
                body.write_all(&v).map_err(io_err(&tmp))?;
                header.entries += 1;
                if header.entries % SAVEPOINT_PROGRESS_EVERY == 0 {
                    progress(header.entries);
                }
            }
        }
        body.write_all(END_MAGIC).map_err(io_err(&tmp))?;
        let after = self.progress()?;
        assert_eq!(
            (before.checkpoint_id, before.next_offset),
            (after.checkpoint_id, after.next_offset),
            "a checkpoint was committed while a savepoint was being written"
        );
        let header_bytes = header.encode();
        let mut crc = crc32fast::Hasher::new();
        crc.update(&header_bytes);
        crc.combine(&body.crc);
        let crc = crc.finalize();
        let mut out = body.inner;
        out.write_all(&crc.to_le_bytes()).map_err(io_err(&tmp))?;
        let mut file = out.into_inner().map_err(|e| io_err(&tmp)(e.into_error()))?;
        file.seek(SeekFrom::Start(0)).map_err(io_err(&tmp))?;
        file.write_all(&header_bytes).map_err(io_err(&tmp))?;
        sync.sync_file(SyncKind::File, &file, &tmp, false)
            .map_err(io_err(&tmp))?;
        drop(file);
        // Right after writing, read it back: a bug in the writer must not leave a savepoint
        // that would only be found bad on the day it is needed.
        verify_savepoint(&tmp)?;
        let path = dir.join(savepoint_file_name(
            seq,
            header.checkpoint_id,
            header.next_offset,
        ));
        fs::rename(&tmp, &path).map_err(io_err(&path))?;
        sync.sync_dir(dir).map_err(io_err(dir))?;
        read_savepoint_header(&path)
    }
}

fn field_len(bytes: &[u8]) -> Result<u32, StoreError> {
    u32::try_from(bytes.len())
        .ok()
        .filter(|&n| n <= MAX_FIELD_LEN)
        .ok_or_else(|| {
            StoreError::Corrupt(format!(
                "a tree entry of {} bytes is larger than a savepoint accepts",
                bytes.len()
            ))
        })
}

/// Temp files are left only by a crash during a write; they are never complete savepoints.
fn remove_stale_temp_files(dir: &Path) -> Result<(), StoreError> {
    for entry in fs::read_dir(dir).map_err(io_err(dir))? {
        let entry = entry.map_err(io_err(dir))?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with(TMP_PREFIX) && name.ends_with(".tmp") {
            crate::event!(warn, "savepoint_incomplete_removed";
                "savepoint: removing an incomplete savepoint {}",
                Shown(&name)
            );
            fs::remove_file(entry.path()).map_err(io_err(&entry.path()))?;
        }
    }
    Ok(())
}

/// Read and check a savepoint's header (magic, version, header CRC) without reading the
/// rest. [`verify_savepoint`] checks the whole file.
pub fn read_savepoint_header(file: &Path) -> Result<SavepointInfo, StoreError> {
    let mut f = File::open(file).map_err(io_err(file))?;
    let bytes = f.metadata().map_err(io_err(file))?.len();
    if bytes < HEADER_LEN as u64 + TRAILER_LEN {
        return Err(corrupt(file, format!("only {bytes} bytes long")));
    }
    let mut h = [0u8; HEADER_LEN];
    f.read_exact(&mut h).map_err(io_err(file))?;
    let header = Header::decode(file, &h)?;
    Ok(SavepointInfo {
        path: file.to_path_buf(),
        format_version: SAVEPOINT_FORMAT_VERSION,
        checkpoint_id: header.checkpoint_id,
        next_offset: header.next_offset,
        entries: header.entries,
        created_at_ms: header.created_at_ms,
        bytes,
        seq: file
            .file_name()
            .and_then(|n| seq_of_name(&n.to_string_lossy()))
            .unwrap_or(0),
    })
}

/// Check the whole file: header, CRC over everything, trailer. Reads it once.
pub fn verify_savepoint(file: &Path) -> Result<SavepointInfo, StoreError> {
    let info = read_savepoint_header(file)?;
    let mut r = BufReader::with_capacity(1 << 16, File::open(file).map_err(io_err(file))?);
    let covered = info.bytes - 4;
    let mut crc = crc32fast::Hasher::new();
    let mut left = covered;
    let mut buf = vec![0u8; 1 << 16];
    let mut tail = [0u8; 8];
    while left > 0 {
        crate::logging::progress::step(
            "checking the savepoint",
            covered - left,
            Some(covered),
            crate::logging::progress::Unit::Bytes,
        );
        let n = (left as usize).min(buf.len());
        r.read_exact(&mut buf[..n]).map_err(io_err(file))?;
        crc.update(&buf[..n]);
        // Keep the last 8 covered bytes: they must be the end marker.
        if n >= 8 {
            tail.copy_from_slice(&buf[n - 8..n]);
        } else {
            tail.rotate_left(n);
            tail[8 - n..].copy_from_slice(&buf[..n]);
        }
        left -= n as u64;
    }
    let mut stored = [0u8; 4];
    r.read_exact(&mut stored).map_err(io_err(file))?;
    if crc.finalize() != u32::from_le_bytes(stored) {
        return Err(corrupt(file, "CRC mismatch"));
    }
    if &tail != END_MAGIC {
        return Err(corrupt(file, "no end marker"));
    }
    Ok(info)
}

/// Savepoints in `dir`, oldest first (by `seq`, see the module docs). Files whose header does not check
/// out are skipped with a warning (and never pruned); a missing directory is an empty list.
pub fn list_savepoints(dir: &Path) -> Result<Vec<SavepointInfo>, StoreError> {
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_err(dir)(e)),
    };
    let mut out = Vec::new();
    for entry in entries {
        let entry = entry.map_err(io_err(dir))?;
        let name = entry.file_name();
        if seq_of_name(&name.to_string_lossy()).is_none() {
            continue;
        }
        match read_savepoint_header(&entry.path()) {
            Ok(info) => out.push(info),
            Err(e) => crate::event!(warn, "savepoint_skipped";
                "savepoint: skipping {}: {}",
                Shown(&entry.path().display().to_string()),
                Shown(&e.to_string())
            ),
        }
    }
    // Ties (only among older names, all seq 0) by when written, then by checkpoint.
    out.sort_by_key(|i| (i.seq, i.created_at_ms, i.checkpoint_id, i.next_offset));
    Ok(out)
}

/// Delete all but the `keep` newest savepoints in `dir`; returns the deleted paths.
///
/// The directory is not fsynced: a deleted savepoint that reappears after a power cut is
/// still a valid savepoint, and the next prune removes it.
pub fn prune_savepoints(dir: &Path, keep: usize) -> Result<Vec<PathBuf>, StoreError> {
    let all = list_savepoints(dir)?;
    let excess = all.len().saturating_sub(keep);
    let mut removed = Vec::new();
    for info in &all[..excess] {
        fs::remove_file(&info.path).map_err(io_err(&info.path))?;
        removed.push(info.path.clone());
    }
    Ok(removed)
}

/// `<dir>` with `suffix` appended to its last component.
fn sibling(dir: &Path, suffix: &str) -> PathBuf {
    let mut name = dir.file_name().unwrap_or_default().to_os_string();
    name.push(suffix);
    dir.with_file_name(name)
}

/// Rebuild the store at `store_dir` from a savepoint (see the module docs for the steps
/// and what a crash during them leaves). Refuses while another process holds the store.
pub(crate) fn restore_savepoint(
    file: &Path,
    store_dir: &Path,
    cache_bytes: u64,
    sync: Durability,
) -> Result<SavepointInfo, StoreError> {
    // Every entry, before anything is built or moved (see `savepoint_check.rs`).
    let info = check::check_savepoint(file)?;
    if store_dir.exists() {
        // An agent holding the store would go on writing to the directory we move aside.
        // A store that does not open is what a restore is for: it is moved aside below.
        match Store::open(store_dir, cache_bytes, sync.clone()) {
            Ok(store) => drop(store),
            Err(e @ StoreError::Locked { .. }) => return Err(e),
            Err(e) => {
                crate::event!(warn, "restore_store_unopenable"; "restore: the current store does not open ({e})")
            }
        }
    }
    let restoring = sibling(store_dir, ".restoring");
    if restoring.exists() {
        // Left by an interrupted restore; never a live store (only this step creates it).
        crate::event!(warn, "restore_incomplete_removed";
            "restore: removing the incomplete {} of an earlier restore",
            restoring.display()
        );
        fs::remove_dir_all(&restoring).map_err(io_err(&restoring))?;
    }
    let built = build_store(file, &info, &restoring, cache_bytes, sync.clone());
    if let Err(e) = built {
        let _ = fs::remove_dir_all(&restoring);
        return Err(e);
    }
    if store_dir.exists() {
        let old = (1u32..)
            .map(|n| sibling(store_dir, &format!(".old-{n}")))
            .find(|p| !p.exists())
            .expect("a free .old-<n> name");
        fs::rename(store_dir, &old).map_err(io_err(store_dir))?;
        crate::event!(info, "restore_store_moved_aside";
            "restore: moved the previous store aside to {}",
            old.display()
        );
    }
    fs::rename(&restoring, store_dir).map_err(io_err(store_dir))?;
    let parent = store_dir
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    sync.sync_dir(parent).map_err(io_err(parent))?;
    Ok(info)
}

/// Stream the entries into a fresh store at `dir`, checking the CRC again as it goes (the
/// file could have changed since it was checked), then make it durable.
fn build_store(
    file: &Path,
    info: &SavepointInfo,
    dir: &Path,
    cache_bytes: u64,
    sync: Durability,
) -> Result<(), StoreError> {
    // Created whole (see `Store::open`), then filled as bare trees.
    drop(Store::open(dir, cache_bytes, sync.clone())?);
    let mut building = Building::open(dir, cache_bytes)?;
    let mut r = BufReader::with_capacity(1 << 16, File::open(file).map_err(io_err(file))?);
    let mut crc = crc32fast::Hasher::new();
    let mut read = |buf: &mut [u8], crc: &mut crc32fast::Hasher| -> Result<(), StoreError> {
        r.read_exact(buf).map_err(io_err(file))?;
        crc.update(buf);
        Ok(())
    };
    let mut header = [0u8; HEADER_LEN];
    read(&mut header, &mut crc)?;
    let mut batches: Vec<sled::Batch> = (0..TREES.len()).map(|_| sled::Batch::default()).collect();
    let (mut pending, mut pending_bytes) = (0usize, 0usize);
    let mut entries = 0u64;
    let body_end = info.bytes - TRAILER_LEN;
    let mut pos = HEADER_LEN as u64;
    while pos < body_end {
        crate::logging::progress::step(
            "building the store",
            entries,
            Some(info.entries),
            crate::logging::progress::Unit::Entries,
        );
        let mut fixed = [0u8; 9];
        read(&mut fixed, &mut crc)?;
        let tree = fixed[0] as usize;
        let klen = u32::from_le_bytes(fixed[1..5].try_into().expect("4 bytes"));
        let vlen = u32::from_le_bytes(fixed[5..9].try_into().expect("4 bytes"));
        if tree >= TREES.len() || klen > MAX_FIELD_LEN || vlen > MAX_FIELD_LEN {
            return Err(corrupt(file, format!("bad entry header at byte {pos}")));
        }
        pos += 9 + u64::from(klen) + u64::from(vlen);
        if pos > body_end {
            return Err(corrupt(file, "an entry runs past the end"));
        }
        let mut k = vec![0u8; klen as usize];
        let mut v = vec![0u8; vlen as usize];
        read(&mut k, &mut crc)?;
        read(&mut v, &mut crc)?;
        pending_bytes += k.len() + v.len();
        batches[tree].insert(k, v);
        entries += 1;
        pending += 1;
        if pending >= RESTORE_BATCH || pending_bytes >= RESTORE_BATCH_BYTES {
            building = building.apply(&mut batches, pending_bytes)?;
            (pending, pending_bytes) = (0, 0);
        }
    }
    building.apply(&mut batches, pending_bytes)?.close()?;
    let mut end = [0u8; 8];
    read(&mut end, &mut crc)?;
    let mut stored = [0u8; 4];
    r.read_exact(&mut stored).map_err(io_err(file))?;
    if &end != END_MAGIC || crc.finalize() != u32::from_le_bytes(stored) {
        return Err(corrupt(file, "changed while it was being restored"));
    }
    if entries != info.entries {
        return Err(corrupt(
            file,
            format!("{entries} entries, the header says {}", info.entries),
        ));
    }
    let store = Store::open(dir, cache_bytes, sync)?;
    store.sync()?;
    store.make_files_durable()?;
    let p = store.progress()?;
    if (p.checkpoint_id, p.next_offset) != (info.checkpoint_id, info.next_offset) {
        return Err(corrupt(
            file,
            format!(
                "its progress record says checkpoint {} at offset {}, the header checkpoint {} \
                 at offset {}",
                p.checkpoint_id, p.next_offset, info.checkpoint_id, info.next_offset
            ),
        ));
    }
    Ok(())
}

/// The store being built, as bare sled trees (nothing loaded into memory beside them), closed
/// and opened again every [`RESTORE_REOPEN_BYTES`]: sled keeps what was inserted resident,
/// whatever its cache capacity, and a 270 MB savepoint took the restore to 322 MB of RSS with
/// its batches bounded (629 MB before); closing the database lets it go (73 MB).
struct Building {
    dir: PathBuf,
    cache_bytes: u64,
    db: sled::Db,
    trees: Vec<sled::Tree>,
    since_open: usize,
}

impl Building {
    fn open(dir: &Path, cache_bytes: u64) -> Result<Building, StoreError> {
        let db = super::open::open_sled(dir, cache_bytes)?;
        let trees = TREES
            .iter()
            .map(|name| db.open_tree(name))
            .collect::<Result<_, _>>()?;
        Ok(Building {
            dir: dir.to_path_buf(),
            cache_bytes,
            db,
            trees,
            since_open: 0,
        })
    }

    /// Apply one batch per tree (`bytes` of keys and values in all), and reopen when due.
    fn apply(mut self, batches: &mut [sled::Batch], bytes: usize) -> Result<Building, StoreError> {
        for (tree, batch) in self.trees.iter().zip(batches.iter_mut()) {
            tree.apply_batch(std::mem::take(batch))?;
        }
        self.since_open += bytes;
        if self.since_open < RESTORE_REOPEN_BYTES {
            return Ok(self);
        }
        self.db.flush()?;
        let Building {
            dir,
            cache_bytes,
            db,
            trees,
            ..
        } = self;
        // Closed before it is opened again: sled's file lock goes with the last handle.
        drop(trees);
        drop(db);
        Building::open(&dir, cache_bytes)
    }

    fn close(self) -> Result<(), StoreError> {
        self.db.flush()?;
        Ok(())
    }
}
