//! The checkpoint store: the only module that imports sled.
//!
//! # Guarantees
//!
//! - A checkpoint is all or nothing. State, dedup ledger, outbox entries, dead letters and
//!   the progress record (`next_offset`, checkpoint id, counters) for the log range
//!   `[prev.next_offset, next_offset)` are written in **one** sled transaction over all the
//!   trees, then `Db::flush()`, then a real `fsync` of sled's `db` file. [`Store::commit`]
//!   returns only after that fsync; [`Store::commit_unsynced`] leaves it to a [`Syncer`]
//!   (the agent's fsync thread), and the checkpoint is durable only once that has run. A checkpoint that did not complete does not exist:
//!   recovery sees the previous one and replays from its `next_offset` (invariant 2;
//!   `tests/it/checkpoint.rs::a_crash_before_commit_leaves_the_previous_checkpoint`).
//!   One part goes before the transaction: the ledger's new chunks, new keys named by the
//!   checkpoint's ID (a large transaction held every write several times over; see
//!   `commit.rs`). Until the transaction commits they answer no lookup, and an open deletes
//!   any a crash left (`store::tests::ledger_chunks_of_a_checkpoint_that_never_committed_answer_nothing_and_go_at_open`,
//!   failpoint `checkpoint.ledger_written` in `tests/it/crash.rs`).
//! - `next_offset` never decreases and `checkpoint_id` rises by one per commit
//!   (`store::tests::commit_advances_progress`).
//! - Inserting an outbox entry whose ID is already waiting is a no-op
//!   (`store::tests::outbox_insert_is_idempotent_by_id`); a newer upsert of a key
//!   supersedes the older one still waiting (see [`outbox`]).
//! - Outbox deletions (on PUBACK) are not fsynced: losing one in a crash only re-sends
//!   entries with the same IDs, which consumers drop.
//! - A dedup lookup answers exactly what a per-ID ledger would
//!   (`store::tests::ledger_model::the_chunked_ledger_answers_like_a_map`,
//!   `store::tests::ledger_oracle`): the in-memory index only decides where to look, and
//!   costs about 4 bytes per ID (see [`ledger`]).
//! - The ledger stays about one dedup window long, a dormant pipeline's by its own window:
//!   each checkpoint drops the chunks whose entries have all expired, at least as many
//!   groups of them as it adds
//!   (`store::tests::expired_ledger_chunks_are_dropped_so_the_ledger_stays_bounded`,
//!   `store::tests::expiry_keeps_up_with_full_checkpoints`,
//!   `store::tests::a_dormant_pipelines_ledger_expires_by_its_own_window`).
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
//!   keep at most 1 KiB of payload. Every value a commit writes is checked against
//!   [`MAX_ENTRY_BYTES`] (key and value; [`MAX_META_BYTES`] in `meta`) before the
//!   transaction: over it is a bug upstream (a debug assertion) and, in release, the typed
//!   error [`StoreError::TooLarge`], never a blob file
//!   (`store::tests::a_value_over_the_entry_bound_is_refused_before_anything_is_written`).
//!
//! # Bounds the store keeps by itself ([`StoreBounds`])
//!
//! - Dead letters: at each commit the oldest (by log offset) go, first those received more
//!   than `max_age` before the checkpoint's log clock (record time, never the wall clock, so
//!   replay prunes the same ones), then as many as keep at most `max_entries`. How many went,
//!   by cause, is counted in `meta` with the commit that pruned them ([`DeadLetterStats`]).
//!   Nothing processing decides reads the dead-letter tree.
//! - The in-memory ledger index: at most `ledger_index_max` bytes (about 4.4 bytes per ID:
//!   the default holds ~15 million); beyond it chunks stay unindexed and lookups read them,
//!   slower but exact (see [`ledger`]).
//!
//! # Layout (store format 6)
//!
//! One tree per kind; pipeline-scoped keys start with `pipeline_name 0x00` (names cannot
//! contain NUL). `rows`: skey → every pipeline's state for that key ([`rows`]); `state`:
//! p·skey → KeyState, for a state too large to share its row; `dedup`: p·min_seen·checkpoint·part → a chunk
//! of ledger entries ([`ledger`]); `outbox`: first_seq → a chunk of outputs ([`outbox`]);
//! `dead`: offset·p → DeadLetter; `sparkplug`: p·key → a Sparkplug session entry (issue 31);
//! `meta`: `progress` → Progress, `format` → 6,
//! `dead_letters` → [`DeadLetterStats`], `ledger_windows` → each pipeline's dedup window,
//! `send_horizon` → a log offset (see `SEND_HORIZON_KEY`), `ledger_groups` → the shared
//! ledgers and their members (see `LEDGER_GROUPS_KEY`);
//! `checkpoints`: id → CheckpointInfo (the newest [`CHECKPOINT_HISTORY`]).
//!
//! Format 4 is format 3 with the states in rows: format 3 kept one `state` key per
//! pipeline and state key, so a checkpoint wrote each input key once per pipeline (issue
//! 33). A format-3 (or -2) store is read as it is and upgraded by the agent at start
//! ([`Store::upgrade_layout`], `store::rows::store_tests`); a build before format 4 refuses
//! a store or savepoint after it.
//!
//! Format 6 is format 5 with every percentile sketch stored packed, a varint distance and
//! count a bucket, instead of as a list of buckets and counts (`pipeline::sketch`): about
//! half the bytes, and a checkpoint rewrites a key's whole row. A list still reads, so a
//! format-5 store is read as it is and becomes format 6 at its first commit (every commit
//! writes the format, in its transaction); a build before format 6 refuses a store or
//! savepoint after it, whose sketches it would not read.
//!
//! Format 5 is format 4 with shared ledgers: the `dedup` tree's chunks may be owned by a
//! group of pipelines that read one stream (`ledger_groups`) instead of by one pipeline, so
//! 16 pipelines over one stream write one entry per input, not 16 (issue 33). A format-4
//! store is read as it is (it has no groups); a build before format 5 refuses a store or
//! savepoint after it.
//!
//! Format 3 is format 2 with a `generation` in each pipeline's progress (and the progress of
//! pipelines no longer configured kept): a format-2 store is read as generation 1 for every
//! pipeline, and its first commit rewrites the progress record and the format together, in
//! one transaction (`store::tests::a_format_2_store_loads_as_generation_1`). Only commits
//! write: reading a format-2 store (`cairn status`) leaves it format 2.
//!
//! Format 1 kept one sled key per ledger entry (plus an expiry index) and per output (plus
//! an ID index): about seven sled writes per event, the largest cost of processing
//! (issue 7's profile). Format 2 writes one value per chunk of a few hundred.

use parking_lot::{Mutex, MutexGuard};
use std::fs;
use std::hash::RandomState;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use serde::{Deserialize, Serialize};

use sled::Transactional;

use crate::fsio::{Durability, SyncKind};
use crate::model::{Backfill, DeadLetter, Output, Progress};
use crate::pipeline::engine::{ReadError, ReadState, in_generation};
use crate::pipeline::value::KeyState;

/// Checkpoint records kept for `cairn inspect checkpoints`.
pub(crate) const CHECKPOINT_HISTORY: u64 = 1000;

const PROGRESS_KEY: &[u8] = b"progress";
const FORMAT_KEY: &[u8] = b"format";
const DEAD_STATS_KEY: &[u8] = b"dead_letters";
/// The cursors of backfilling pipelines, `Vec<(name, Backfill)>`: written with the
/// progress record in the same transaction, kept apart so its layout stays unchanged.
const BACKFILL_KEY: &[u8] = b"backfill";
/// Each pipeline's dedup window, `Vec<(name, window_ms)>`, as last configured: a pipeline no
/// longer configured keeps expiring its ledger by it (see [`ledger`]). Kept apart from the
/// progress record so that its layout stays unchanged; older builds ignore it.
const LEDGER_WINDOWS_KEY: &[u8] = b"ledger_windows";
/// The send horizon, a log offset as a big-endian `u64`: results made from records below it
/// may have left before their checkpoint was durable, so a start replays at least that far
/// before it sends anything (`Processor::results_wait_for_checkpoint`). Written with each
/// checkpoint, and at start; older builds ignore it, and without it a start replays as
/// before.
const SEND_HORIZON_KEY: &[u8] = b"send_horizon";
/// The shared ledgers, `Vec<(name, members)>`: a group's name (`+` and a number, which no
/// pipeline name can be) owns the ledger entries of IDs that every one of its members
/// accepted at one record time ([`Store::ledger_group_name`]). A pipeline's lookup reads its
/// own ledger and those of the groups it is a member of. Written in the transaction of the
/// first checkpoint that writes a group's entries; a group no member of which is configured
/// any more is dormant and expires by its recorded window, as a pipeline's ledger does.
const LEDGER_GROUPS_KEY: &[u8] = b"ledger_groups";

// The bounds on one stored entry live in `model`, where the engine and config validation
// that make the values check them too: MAX_ENTRY_BYTES (7 KiB, key plus value, outside
// `meta`) and MAX_META_BYTES (96 KiB, one `meta` value).
pub(crate) use crate::model::{MAX_ENTRY_BYTES, MAX_META_BYTES};

/// The most bytes `progress` can take as the stored progress record (its key included)
/// once every count in it has grown to the largest a `u64` holds: what must fit in
/// [`MAX_META_BYTES`] for every checkpoint of these pipelines to be storable. The record
/// grows with the pipelines the store keeps (dormant ones too) and their definitions, so
/// the start checks it before anything is processed (`processor::plan`).
pub fn progress_bytes_at_most(progress: &Progress) -> usize {
    let mut worst = progress.clone();
    let most = u64::MAX;
    (worst.next_offset, worst.checkpoint_id, worst.log_clock_ms) = (most, most, most);
    (worst.records, worst.unmatched, worst.outbox_seq) = (most, most, most);
    for p in &mut worst.pipelines {
        (
            p.max_event_time_ms,
            p.evicted_below,
            p.keys,
            p.dedup_entries,
        ) = (most, most, most, most);
        (p.version_base, p.max_version, p.generation) = (most, most, u32::MAX);
        let c = &mut p.counters;
        (
            c.applied,
            c.duplicates,
            c.dead_letters,
            c.outputs,
            c.filtered,
        ) = (most, most, most, most, most);
    }
    PROGRESS_KEY.len() + encode(&worst).len()
}

/// The bound [`progress_bytes_at_most`] is held to.
pub const PROGRESS_MAX_BYTES: usize = MAX_META_BYTES;

/// Most dead letters pruned by age in one commit beyond those the batch adds (bounds the
/// transaction; the rest go at the next commits).
pub(crate) const DEAD_PRUNE_MAX: usize = 1024;
/// Most unindexed ledger groups indexed again in one commit, per pipeline.
const PROMOTE_MAX: usize = 16;

/// Limits the store applies by itself (config `[dead_letters]` and
/// `[storage] ledger_index_max`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreBounds {
    /// Keep at most this many dead letters (the oldest go first).
    pub dead_letters_max_entries: u64,
    /// Drop dead letters received longer than this before the checkpoint's log clock.
    pub dead_letters_max_age_ms: u64,
    /// Most bytes the in-memory ledger indexes of all pipelines may hold together.
    pub ledger_index_max_bytes: u64,
}

impl Default for StoreBounds {
    fn default() -> Self {
        StoreBounds {
            dead_letters_max_entries: 100_000,
            dead_letters_max_age_ms: 30 * 24 * 3600 * 1000,
            ledger_index_max_bytes: 64 << 20,
        }
    }
}

/// What the dead-letter tree holds and what pruning took out of it (kept in `meta`, written
/// by the commit that changes it).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct DeadLetterStats {
    /// Dead letters in the tree.
    pub stored: u64,
    /// Pruned because they were older than `max_age`.
    pub pruned_age: u64,
    /// Pruned to keep at most `max_entries`.
    pub pruned_count: u64,
}

/// Figures about the store's own bounds, for `/metrics` and `cairn status`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct BoundFigures {
    pub dead_letters: DeadLetterStats,
    /// Bytes of the ledger indexes (all pipelines).
    pub ledger_index_bytes: u64,
    /// Ledger chunks the memory bound left out of the index (lookups read them).
    pub ledger_unindexed_chunks: u64,
}

/// The layout this build writes (see the module docs).
/// Format 5 is format 6 with sketches stored as lists, and format 4 is format 5 without
/// shared ledgers: both read as they are, nothing to upgrade. An older build refuses format
/// 6, whose sketches it would not read, and format 5, whose shared ledgers it would not read
/// (it would take their entries for a dormant pipeline's, and count a duplicate of them
/// again).
pub(crate) const STORE_FORMAT: u32 = 6;
/// Format 3: format 4 with a key per pipeline and state key in `state` and no `rows`. Read
/// as it is, and upgraded by the agent before it processes ([`rows`]).
const STORE_FORMAT_V3: u32 = 3;
/// The older layout this build still reads: the same trees, a progress record without
/// generations and with counters that have no `filtered`.
const STORE_FORMAT_V2: u32 = 2;

mod commit;
mod copy;
#[doc(hidden)]
pub(crate) mod fuzz;
mod index;
mod ledger;
mod open;
mod read;
mod rows;
mod sinks;
mod v2;
pub use copy::StoreCopy;
mod lru;
mod outbox;
use ledger::Ledgers;
use outbox::OutboxMem;

mod savepoint;
pub(crate) use outbox::prefetch_chunks;
pub(crate) use rows::LastRow;
pub(crate) use savepoint::restore_savepoint;
pub use savepoint::{
    SAVEPOINT_FORMAT_VERSION, SAVEPOINT_PROGRESS_EVERY, SavepointInfo, list_savepoints,
    prune_savepoints, read_savepoint_header, verify_savepoint,
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
    #[error(
        "a {tree} entry of {bytes} bytes is over the store's bound of {limit} bytes (sled would \
         put it in a blob file it never fsyncs); nothing was written. This is a bug: please \
         report it with `cairn inspect log` around the checkpoint's offsets"
    )]
    TooLarge {
        tree: &'static str,
        bytes: usize,
        limit: usize,
    },
    #[error(
        "the store at {path} has layout {found}, this cairn reads layouts 2 to {STORE_FORMAT}. Move it \
         aside (`mv {path} {path}.old`) and start again: the state is rebuilt from the log if \
         it still starts at offset 0 (`cairn inspect log --limit 1`)"
    )]
    Format { path: PathBuf, found: u32 },
}

impl StoreError {
    /// The operating-system error underneath, if any: sled's errors do not expose it as a
    /// `source`, and the agent needs it to tell a full disk from other failures.
    pub(crate) fn io_error(&self) -> Option<&std::io::Error> {
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
    /// States that did not fit their row, and a format-3 store's states
    /// (`pipeline 0x00 skey` → KeyState).
    state: sled::Tree,
    /// Every pipeline's state for one stored key (skey → a row, see [`rows`]).
    rows: sled::Tree,
    /// The store's layout is older than format 4 (see [`rows`]).
    legacy: std::sync::atomic::AtomicBool,
    dedup: sled::Tree,
    outbox: sled::Tree,
    dead: sled::Tree,
    checkpoints: sled::Tree,
    /// Sparkplug B sessions of each pipeline (`pipeline 0x00 key` → an entry of
    /// [`crate::pipeline::sparkplug::session`]). A tree added after format 3 without a
    /// format change: a store that lacks it simply has no sessions.
    sparkplug: sled::Tree,
    /// What is kept in memory beside the trees, rebuilt from them at open. A mutex, not a
    /// `RefCell`, so that the store stays `Sync`; only the agent's thread takes it.
    mem: Mutex<Mem>,
    /// Hashes event IDs for the ledger index. Random per process: the index only decides
    /// where to look, never what is decided, and hostile IDs cannot aim at its buckets.
    hasher: RandomState,
    bounds: StoreBounds,
    /// Outbox chunks deleted so far, for [`Store::remove_outbox_chunk`].
    chunks_deleted: AtomicUsize,
    /// The ID of the last committed checkpoint: ledger chunks of a later one are not
    /// committed yet, or were left by a crash (see [`Store::ledger_range`]).
    committed_id: AtomicU64,
}

struct Mem {
    ledgers: Ledgers,
    outbox: OutboxMem,
    /// Reused by lookups.
    tags: Vec<u16>,
    groups: Vec<u64>,
    /// As of the last commit (the `meta` record).
    dead: DeadLetterStats,
    /// Each pipeline's dedup window, as last configured (the `meta` record
    /// [`LEDGER_WINDOWS_KEY`]): what a dormant pipeline's ledger expires by.
    windows: std::collections::BTreeMap<String, u64>,
    /// Dormant pipelines whose window is unknown, already named in the journal.
    warned_windows: std::collections::BTreeSet<String>,
    /// The sinks' settled positions for the next commit (`sinks.rs`), encoded.
    sinks: Option<Vec<u8>>,
    /// Outbox chunks emptied while a checkpoint commits beside the loop, deleted once it is
    /// done (`Some` while it runs: [`Store::hold_outbox_deletes`]).
    held_deletes: Option<Vec<u64>>,
    /// The shared ledgers: name → members (the `meta` record [`LEDGER_GROUPS_KEY`], and
    /// groups named since, which the next commit records).
    ledger_groups: std::collections::BTreeMap<String, Vec<String>>,
    /// Whether `ledger_groups` holds a group the record does not.
    groups_unrecorded: bool,
    /// Per pipeline, the groups it is a member of.
    member_of: std::collections::HashMap<String, Vec<String>>,
    /// The checkpoint whose ledger changes memory holds in full (`None` while a commit's
    /// are on the way): lookups may reuse [`Mem::memo`] only while it is the committed one.
    applied_id: Option<u64>,
    /// The last lookup in a shared ledger: the members of a group look the same ID up one
    /// after another for each record (16 pipelines over one stream: 16 times).
    memo: Option<GroupMemo>,
}

/// One answer of a shared ledger (see [`Mem::memo`]).
struct GroupMemo {
    /// The committed checkpoint it was read at.
    at: u64,
    group: String,
    id: Vec<u8>,
    seen: Option<u64>,
}

impl Mem {
    fn new(bounds: &StoreBounds) -> Mem {
        Mem {
            ledgers: Ledgers::new(bounds.ledger_index_bytes()),
            outbox: OutboxMem::default(),
            tags: Vec::new(),
            groups: Vec::new(),
            dead: DeadLetterStats::default(),
            windows: Default::default(),
            warned_windows: Default::default(),
            sinks: None,
            held_deletes: None,
            ledger_groups: Default::default(),
            groups_unrecorded: false,
            member_of: Default::default(),
            applied_id: None,
            memo: None,
        }
    }

    /// Set the shared ledgers, and who is a member of which.
    fn set_ledger_groups(&mut self, groups: std::collections::BTreeMap<String, Vec<String>>) {
        self.member_of.clear();
        for (g, members) in &groups {
            for m in members {
                self.member_of.entry(m.clone()).or_default().push(g.clone());
            }
        }
        self.ledger_groups = groups;
    }
}

impl StoreBounds {
    /// `ledger_index_max_bytes` as a size in memory.
    fn ledger_index_bytes(&self) -> usize {
        usize::try_from(self.ledger_index_max_bytes).unwrap_or(usize::MAX)
    }
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

/// `value` for `key` in `tree`, if the entry stays within the bound (see [`MAX_ENTRY_BYTES`]).
/// Over it is a bug upstream: loud in debug builds, a typed error in release, and either way
/// before anything is written.
fn bounded(tree: &'static str, key: &[u8], value: Vec<u8>) -> Result<Vec<u8>, StoreError> {
    let limit = if tree == "meta" {
        MAX_META_BYTES
    } else {
        MAX_ENTRY_BYTES
    };
    let bytes = key.len().saturating_add(value.len());
    debug_assert!(
        bytes <= limit,
        "a {tree} entry of {bytes} bytes is over the bound of {limit}"
    );
    if bytes > limit {
        return Err(StoreError::TooLarge { tree, bytes, limit });
    }
    Ok(value)
}

/// A dead letter's stored bytes: a topic (up to 64 KiB from the sender) or a detail too long
/// for one entry is cut, deterministically, so that a refusal never fails a checkpoint (the
/// engine already cuts what it makes: see [`DeadLetter::fitted`]).
fn dead_letter_value(key: &[u8], d: &DeadLetter) -> Vec<u8> {
    encode(&d.clone().fitted(key.len()))
}

/// The first key after every key of `pipeline` (they all start `pipeline 0x00`).
fn pipeline_end(pipeline: &str) -> Vec<u8> {
    let mut end = pkey(pipeline, &[]);
    *end.last_mut().expect("pkey ends in 0") = 1;
    end
}

fn bad_chunk() -> StoreError {
    StoreError::Corrupt("undecodable ledger chunk".into())
}

fn u64_of(bytes: &[u8]) -> Result<u64, StoreError> {
    Ok(u64::from_be_bytes(
        bytes
            .try_into()
            .map_err(|_| StoreError::Corrupt("bad u64".into()))?,
    ))
}

impl Store {
    /// Delete an outbox chunk nothing in it waits for any more (every entry acknowledged or
    /// superseded). Not fsynced: after a crash, loading marks the same entries again. Every
    /// [`DELETE_RELEASE_EVERY`]th runs a round of sled's deferred drops: each delete leaves
    /// the old copy of its leaf to them, outside any checkpoint, and a burst (a drained
    /// backlog's results, acknowledged together when mosquitto sends the PUBACKs it queued
    /// behind the backlog) deleted chunk after chunk with nothing running them.
    ///
    /// While a checkpoint commits beside the loop the delete is held until it is done
    /// ([`Store::hold_outbox_deletes`]).
    fn remove_outbox_chunk(&self, mem: &mut Mem, first: u64) -> Result<(), StoreError> {
        match mem.held_deletes.as_mut() {
            Some(held) => {
                held.push(first);
                Ok(())
            }
            None => self.delete_outbox_chunk(first),
        }
    }

    fn delete_outbox_chunk(&self, first: u64) -> Result<(), StoreError> {
        self.outbox.remove(first.to_be_bytes())?;
        let deleted = self.chunks_deleted.fetch_add(1, Ordering::Relaxed) + 1;
        if deleted % DELETE_RELEASE_EVERY == 0 {
            release_deferred(1);
        }
        Ok(())
    }

    fn lock(&self) -> MutexGuard<'_, Mem> {
        self.mem.lock()
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The last durable checkpoint's progress (empty for a new store). The layout is read
    /// from the format record each time: a savepoint restore replaces both under an open store.
    pub fn progress(&self) -> Result<Progress, StoreError> {
        let Some(v) = self.meta.get(PROGRESS_KEY)? else {
            return Ok(Progress::default());
        };
        let mut progress: Progress = match self.meta.get(FORMAT_KEY)? {
            Some(f) if f.as_ref() == STORE_FORMAT_V2.to_be_bytes() => {
                decode::<v2::Progress>("format-2 progress", &v)?.into()
            }
            _ => decode("progress", &v)?,
        };
        if let Some(v) = self.meta.get(BACKFILL_KEY)? {
            for (name, b) in decode::<Vec<(String, Backfill)>>("backfill cursors", &v)? {
                if let Some(pp) = progress.pipelines.iter_mut().find(|pp| pp.name == name) {
                    pp.backfill = Some(b);
                }
            }
        }
        Ok(progress)
    }

    /// The send horizon the last durable checkpoint (or start) recorded, if any was (see
    /// `SEND_HORIZON_KEY`).
    pub(crate) fn send_horizon(&self) -> Result<Option<u64>, StoreError> {
        match self.meta.get(SEND_HORIZON_KEY)? {
            None => Ok(None),
            Some(v) => u64_of(&v).map(Some),
        }
    }

    /// Record `offset` as the send horizon, durably, outside a checkpoint: the start does,
    /// before anything is sent, so that a crash before the first checkpoint replays what
    /// left.
    pub(crate) fn record_send_horizon(&self, offset: u64) -> Result<(), StoreError> {
        self.meta.insert(SEND_HORIZON_KEY, &offset.to_be_bytes())?;
        self.sync()
    }

    /// The durability seam this store syncs through (for files kept beside it).
    pub(crate) fn durability(&self) -> &Durability {
        &self.sync
    }

    /// An outbox chunk, from the cache or the tree.
    fn outbox_chunk(&self, mem: &mut Mem, first: u64) -> Result<outbox::ChunkEntries, StoreError> {
        if let Some(c) = mem.outbox.cached(first) {
            return Ok(c);
        }
        let v = self
            .outbox
            .get(first.to_be_bytes())?
            .ok_or_else(|| StoreError::Corrupt(format!("outbox chunk {first} is missing")))?;
        let c = Arc::new(decode::<Vec<(u64, Output)>>("outbox chunk", &v)?);
        mem.outbox.cache_put(first, c.clone());
        Ok(c)
    }

    /// The chunks of group `seq` of `pipeline` (number `pid`): one range scan of the tree.
    fn ledger_group(
        &self,
        ledgers: &Ledgers,
        pipeline: &str,
        pid: u32,
        seq: u64,
    ) -> Result<impl Iterator<Item = sled::Result<(sled::IVec, sled::IVec)>>, StoreError> {
        let range = ledgers
            .group_range(pid, seq)
            .ok_or_else(|| StoreError::Corrupt("a ledger group in memory is missing".into()))?;
        Ok(self.ledger_range(pipeline, range))
    }

    /// The committed chunks of `pipeline` in a group's key `range`: one range scan of the
    /// tree. A checkpoint's chunks are written before its transaction (`commit.rs`), so the
    /// newest group's open range can hold chunks of a checkpoint not committed yet: they
    /// are skipped, by the checkpoint ID in their key.
    fn ledger_range(
        &self,
        pipeline: &str,
        (first, next): ledger::GroupRange,
    ) -> impl Iterator<Item = sled::Result<(sled::IVec, sled::IVec)>> {
        let hi = match next {
            Some(n) => pkey(pipeline, &n),
            None => pipeline_end(pipeline),
        };
        let at = pipeline.len() + 1;
        let committed = self.committed_id.load(Ordering::Acquire);
        self.dedup
            .range(pkey(pipeline, &first)..hi)
            .filter(move |kv| match kv {
                Ok((k, _)) => k
                    .get(at..)
                    .and_then(ledger::chunk_checkpoint)
                    .is_none_or(|id| id <= committed),
                Err(_) => true,
            })
    }

    /// The keys of group `seq`'s chunks and the [`ledger::id_hash`]es of their entries:
    /// what dropping the group, or indexing it again, needs.
    fn ledger_group_hashes(
        &self,
        ledgers: &Ledgers,
        pipeline: &str,
        pid: u32,
        seq: u64,
    ) -> Result<(Vec<sled::IVec>, Vec<u64>), StoreError> {
        let range = ledgers
            .group_range(pid, seq)
            .ok_or_else(|| StoreError::Corrupt("a ledger group in memory is missing".into()))?;
        self.ledger_range_hashes(pipeline, range)
    }

    /// [`Store::ledger_group_hashes`] of the group whose key range is `range` (taken from
    /// memory before: a commit reads its expired groups without holding the lock).
    fn ledger_range_hashes(
        &self,
        pipeline: &str,
        range: ledger::GroupRange,
    ) -> Result<(Vec<sled::IVec>, Vec<u64>), StoreError> {
        let mut keys = Vec::new();
        let mut hashes = Vec::new();
        for kv in self.ledger_range(pipeline, range) {
            let (k, v) = kv?;
            ledger::scan_chunk(&v, |id, _| {
                hashes.push(ledger::id_hash(&self.hasher, pipeline, id));
                true
            })
            .map_err(|_| bad_chunk())?;
            keys.push(k);
        }
        // The oldest chunks, read from disk: their leaves counted in the cache.
        self.count_group_in_cache(&keys);
        Ok((keys, hashes))
    }

    /// [`count_in_cache`] for the leaves of a ledger group read: its first and last chunk
    /// (a group is two or three chunks, in one leaf or two neighbours).
    fn count_group_in_cache(&self, keys: &[sled::IVec]) {
        if let Some(first) = keys.first() {
            count_in_cache(&self.dedup, first);
        }
        if let Some(last) = keys.last().filter(|_| keys.len() > 1) {
            count_in_cache(&self.dedup, last);
        }
    }

    /// `flush()` and then the real fsync that `flush()` alone does not give.
    pub fn sync(&self) -> Result<(), StoreError> {
        self.syncer().sync()
    }

    /// A handle that makes durable, from another thread, everything committed so far (see
    /// [`Store::commit_unsynced`]).
    pub fn syncer(&self) -> Syncer {
        Syncer {
            db: self.db.clone(),
            dir: self.dir.clone(),
            sync: self.sync.clone(),
        }
    }
}

/// Run memory that sled's threads handed to epoch-based reclamation and nothing has
/// collected yet: each round moves this thread's bag of deferred drops to the global queue
/// and runs up to eight expired bags from it.
///
/// Why (issue 16): sled frees a sealed 512 KiB write buffer, and old page versions, only
/// through crossbeam-epoch's deferred drops, which run a few bags at a time on every 128th
/// pin. While a backlog drains, garbage is made faster than that, and once the agent goes
/// idle nothing pins at all: a heap profile after a 1M-input drain found 36 write buffers
/// (18 MiB) waiting. One round after each checkpoint fsync keeps up; an idle agent runs
/// many before it hands freed heap back to the system.
///
/// `sled::crossbeam_pin` is sled's own (hidden) re-export of the crossbeam-epoch it
/// collects with, so this reaches the same collector whatever else links crossbeam; the
/// exact sled version is pinned in Cargo.toml.
pub(crate) fn release_deferred(rounds: usize) {
    for _ in 0..rounds {
        sled::crossbeam_pin().flush();
    }
}

/// How many times sled 0.34 must hear of an access to a page before its cache counts it: its
/// LRU is 256 shards (by page ID), and each shard takes in accesses a block of 64 at a time;
/// until a block fills, the pages it names are in memory and in no one's count.
const SLED_LRU_BLOCK: usize = 64;

/// Make sled's cache count the page that holds `key` in `tree`, so that it can be evicted.
///
/// Why (issue 33): a page read once from disk and not again, as a dedup lookup's false
/// hit or duplicate and an expiry's read of old chunks are, waits in its shard's block
/// until 63 more accesses to that shard come along. Cold shards take minutes, so such
/// pages piled up beyond `cache_size`: a dedup leaf is up to 16 chunks of 4 KiB, and the
/// agent's steady run held ~27 MiB more at 7.9 million IDs in the window without this
/// (`docs/performance.md`). Looking the key up again fills its shard's block, which then
/// evicts down to the shard's share of the cache. It runs only after reads of old groups,
/// which are rare (false hits: 0.23% of lookups at ten million IDs) or batched (expiry).
pub(crate) fn count_in_cache(tree: &sled::Tree, key: &[u8]) {
    // Unit tests keep 5 bits of hash per entry so that false hits are common, and read a
    // group for a quarter of their lookups: a full count each time made them 7x slower.
    // What the count changes is sled's memory, which they do not measure.
    let times = if cfg!(test) { 2 } else { SLED_LRU_BLOCK + 1 };
    for _ in 0..times {
        // A failed read here is the caller's to see on its own next read; this only
        // touches the page.
        let _ = tree.get(key);
    }
}

/// A walk of a whole tree (open, savepoints, the live-data estimate) pulls every page it
/// passes through sled's cache, which evicts others; an evicted page is freed only when
/// deferred drops run. Every this many items the walk runs a round of them, or a walk of a
/// million-entry ledger held the pages of all of it at once.
const WALK_RELEASE_EVERY: usize = 256;

/// For walks: run a round of deferred drops at every [`WALK_RELEASE_EVERY`]th item.
pub(crate) fn release_while_walking(item: usize) {
    if item % WALK_RELEASE_EVERY == WALK_RELEASE_EVERY - 1 {
        release_deferred(1);
    }
}

/// Outbox chunks deleted between rounds of deferred drops ([`Store::remove_outbox_chunk`]).
const DELETE_RELEASE_EVERY: usize = 16;

/// [`Store::sync`], for another thread: the agent's checkpoint fsync runs beside its loop.
#[derive(Clone)]
pub struct Syncer {
    db: sled::Db,
    dir: PathBuf,
    sync: Durability,
}

impl Syncer {
    /// `flush()` and then the real fsync that `flush()` alone does not give.
    pub fn sync(&self) -> Result<(), StoreError> {
        self.db.flush()?;
        if crate::failpoint::enabled("unsafe.skip_store_fsync") {
            return Ok(()); // deliberately unsafe build for the crash harness's own test
        }
        // The flush sealed sled's write buffers; what it let go of waits in this thread's
        // deferred-drop bag until something collects it.
        release_deferred(1);
        let path = self.dir.join("db");
        let f = fs::File::open(&path).map_err(io_err(&path))?;
        self.sync
            .sync_file(SyncKind::Store, &f, &path, false)
            .map_err(io_err(&path))
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// What a start did to the restored outbox ([`Store::commit_start`]).
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Moved {
    /// Results moved into their pipeline's new generation.
    pub(crate) moved: u64,
    /// Results of pipelines reset or dropped, dropped.
    pub(crate) dropped: u64,
    /// Why the first result that could not be moved was not (it stays as it was).
    pub(crate) unmoved: Option<String>,
}

impl Store {
    /// The name of the shared ledger of `members` (pipeline names, two or more): the group
    /// recorded with exactly these members if there is one, else a new name (`+` and the
    /// next number), recorded by the next commit. A group's entries are IDs every member
    /// accepted, so a set of members that differs in any way (a pipeline added, or back
    /// from a backfill) is a new group, and the old one is dormant: its members still
    /// read it until it expires.
    pub fn ledger_group_name(&self, members: &[&str]) -> Option<String> {
        let mut want: Vec<String> = members.iter().map(|m| m.to_string()).collect();
        want.sort();
        want.dedup();
        let mut mem = self.lock();
        let found = (mem.ledger_groups.iter())
            .find(|(_, m)| {
                let mut m: Vec<&String> = m.iter().collect();
                m.sort();
                m == want.iter().collect::<Vec<_>>()
            })
            .map(|(g, _)| g.clone());
        if found.is_some() {
            return found;
        }
        let next = (mem.ledger_groups.keys().map(String::as_str))
            .chain(mem.ledgers.named().map(|(name, _)| name))
            .filter_map(|g| g.strip_prefix('+')?.parse::<u64>().ok())
            .max()
            .map_or(1, |n| n.saturating_add(1));
        let name = format!("+{next}");
        let mut groups = mem.ledger_groups.clone();
        groups.insert(name.clone(), want);
        // The record must fit one `meta` value with room to spare: past that the members
        // keep their own ledgers, as without groups (a start forgets groups whose entries
        // expired, so only a config changed hundreds of times within a window gets here).
        let list: Vec<(&String, &Vec<String>)> = groups.iter().collect();
        if encode(&list).len() > crate::model::MAX_META_BYTES / 2 {
            return None;
        }
        mem.set_ledger_groups(groups);
        mem.groups_unrecorded = true;
        Some(name)
    }

    /// Forget the state, dedup ledgers and Sparkplug sessions of `pipelines` (reset, or dropped because no
    /// longer configured) and record `progress`, all in one transaction followed by the
    /// fsync, like a checkpoint: after a crash either all of it happened or none. With no
    /// pipelines it only records `progress` (new pipelines and their generations).
    pub fn reset_pipelines(
        &self,
        pipelines: &[&str],
        progress: &Progress,
    ) -> Result<(), StoreError> {
        self.commit_start(pipelines, progress, &[]).map(|_| ())
    }

    /// [`Store::reset_pipelines`], and in the same transaction the outbox's waiting results
    /// of each pipeline in `outbox` moved into the generation it names ([`in_generation`]),
    /// or dropped for `None`. A savepoint restore asks for it: the restored outbox holds
    /// results of the old generation that newer versions may have followed before the
    /// restore, and sent again under their old IDs they would set those keys back
    /// (`processor::plan`). Returns what became of them.
    pub(crate) fn commit_start(
        &self,
        pipelines: &[&str],
        progress: &Progress,
        outbox: &[(String, Option<u32>)],
    ) -> Result<Moved, StoreError> {
        self.upgrade_layout()?;
        let (outbox_batch, moved) = self.outbox_into_generations(outbox)?;
        let (rows, spill) = self.forget_states(pipelines)?;
        let mut batches = [spill, sled::Batch::default(), sled::Batch::default()];
        // A reset pipeline leaves its groups: their entries stay its other members'. A group
        // left with no member goes with its entries.
        let (groups, gone_groups) = {
            let mem = self.lock();
            let mut groups = mem.ledger_groups.clone();
            for members in groups.values_mut() {
                members.retain(|m| !pipelines.contains(&m.as_str()));
            }
            let gone: Vec<String> = (groups.iter())
                .filter(|(_, m)| m.is_empty())
                .map(|(g, _)| g.clone())
                .collect();
            groups.retain(|_, m| !m.is_empty());
            let changed = groups != mem.ledger_groups || mem.groups_unrecorded;
            (changed.then_some(groups), gone)
        };
        let groups_record = match &groups {
            Some(g) => {
                let list: Vec<(&String, &Vec<String>)> = g.iter().collect();
                Some(bounded("meta", LEDGER_GROUPS_KEY, encode(&list))?)
            }
            None => None,
        };
        let owners = pipelines
            .iter()
            .copied()
            .chain(gone_groups.iter().map(String::as_str));
        for pipeline in owners {
            let prefix = pkey(pipeline, &[]);
            let trees = [&self.dedup, &self.sparkplug];
            for (i, tree) in trees.into_iter().enumerate() {
                for k in tree.scan_prefix(&prefix).keys() {
                    batches[i + 1].remove(k?);
                }
            }
        }
        let backfill = backfill_record(progress)?;
        let committed = progress.checkpoint_id;
        let progress = encode(progress);
        let trees = [
            &self.meta,
            &self.state,
            &self.dedup,
            &self.sparkplug,
            &self.rows,
            &self.outbox,
        ];
        trees[..]
            .transaction(|tx| {
                tx[1].apply_batch(&batches[0])?;
                tx[2].apply_batch(&batches[1])?;
                tx[3].apply_batch(&batches[2])?;
                tx[4].apply_batch(&rows)?;
                tx[5].apply_batch(&outbox_batch)?;
                tx[0].insert(PROGRESS_KEY, progress.as_slice())?;
                tx[0].insert(BACKFILL_KEY, backfill.as_slice())?;
                tx[0].insert(FORMAT_KEY, &STORE_FORMAT.to_be_bytes())?;
                if let Some(v) = &groups_record {
                    tx[0].insert(LEDGER_GROUPS_KEY, v.as_slice())?;
                }
                Ok::<(), sled::transaction::ConflictableTransactionError<()>>(())
            })
            .map_err(|e| match e {
                sled::transaction::TransactionError::Storage(e) => StoreError::Sled(e),
                sled::transaction::TransactionError::Abort(()) => unreachable!("never aborts"),
            })?;
        self.committed_id.store(committed, Ordering::Release);
        let mut mem = self.lock();
        if let Some(groups) = groups {
            mem.set_ledger_groups(groups);
            mem.groups_unrecorded = false;
        }
        // One index serves every pipeline, and dropping a pipeline's entries from it needs
        // their hashes, which are in the chunks just deleted: build it again from the tree.
        // A reset is an operator's request at start, rare; a walk is the simple way.
        let owners = pipelines
            .iter()
            .copied()
            .chain(gone_groups.iter().map(String::as_str));
        if owners.into_iter().any(|p| mem.ledgers.get(p).is_some()) {
            mem.ledgers = Ledgers::new(self.bounds.ledger_index_bytes());
            self.load_ledger(&mut mem)?;
        }
        mem.memo = None;
        mem.applied_id = Some(committed);
        if moved.moved + moved.dropped > 0 {
            // Keys changed with the IDs: count the waiting results again from the tree.
            mem.outbox = OutboxMem::default();
            self.load_outbox(&mut mem)?;
        }
        drop(mem);
        self.sync()?;
        Ok(moved)
    }

    /// The outbox chunks rewritten as [`Store::commit_start`] asks: a batch for the tree,
    /// and what became of the results. A chunk with dropped results is cut
    /// into runs of consecutive sequence numbers (each a chunk of its own, keyed by its
    /// first), as every chunk must be; a moved one keeps its sequence number, so the sinks'
    /// positions still say which results each has taken.
    fn outbox_into_generations(
        &self,
        outbox: &[(String, Option<u32>)],
    ) -> Result<(sled::Batch, Moved), StoreError> {
        let mut batch = sled::Batch::default();
        let mut moved = Moved::default();
        if outbox.is_empty() {
            return Ok((batch, moved));
        }
        let to = |id: &str| {
            let prefix = id.split('/').next().unwrap_or(id);
            let name = prefix.split('@').next().unwrap_or(prefix);
            outbox.iter().find(|(n, _)| n == name).map(|(n, g)| (n, *g))
        };
        for kv in self.outbox.iter() {
            let (k, v) = kv?;
            let entries: Vec<(u64, Output)> = decode("outbox chunk", &v)?;
            if !entries.iter().any(|(_, o)| to(&o.id).is_some()) {
                continue;
            }
            let mut kept = Vec::with_capacity(entries.len());
            for (seq, o) in entries {
                match to(&o.id) {
                    None => kept.push((seq, o)),
                    Some((_, None)) => moved.dropped += 1,
                    Some((name, Some(generation))) => match in_generation(&o, name, generation) {
                        Ok(o) => {
                            kept.push((seq, o));
                            moved.moved += 1;
                        }
                        // Not a body this build reads: sent as it is, as before the move
                        // existed, rather than a start that fails on it.
                        Err(why) => {
                            moved.unmoved.get_or_insert(why);
                            kept.push((seq, o));
                        }
                    },
                }
            }
            batch.remove(k);
            for (first, chunk) in outbox::make_chunks(kept) {
                let key = first.to_be_bytes();
                batch.insert(&key, bounded("outbox", &key, encode(&chunk))?);
            }
        }
        Ok((batch, moved))
    }
}

/// The backfill cursors of `progress`, as [`BACKFILL_KEY`] holds them.
fn backfill_record(progress: &Progress) -> Result<Vec<u8>, StoreError> {
    let cursors: Vec<(&str, Backfill)> = progress
        .pipelines
        .iter()
        .filter_map(|pp| pp.backfill.map(|b| (pp.name.as_str(), b)))
        .collect();
    bounded("meta", BACKFILL_KEY, encode(&cursors))
}

fn pkey_dead(offset: u64, pipeline: &str) -> Vec<u8> {
    let mut k = offset.to_be_bytes().to_vec();
    k.extend_from_slice(pipeline.as_bytes());
    k
}

#[cfg(test)]
mod groups_tests;
#[cfg(test)]
mod outbox_tests;
#[cfg(test)]
mod tests;
