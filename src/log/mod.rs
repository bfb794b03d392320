//! The durable replay log: every accepted input, in order, surviving a power cut at any byte.
//!
//! # Guarantees
//!
//! - **Committed means durable.** When [`Log::commit`] returns `Ok`, every record appended
//!   before it is on stable storage: its segment was `fdatasync`ed and, if the segment is
//!   new, the directory was fsynced before any record went into it. The agent PUBACKs only
//!   after this (DESIGN invariant 1).
//! - **A crash only loses what was never committed.** After a power cut at any byte, [`Log::open`]
//!   recovers every committed record, in order, possibly followed by some records of the
//!   commit that was in flight (in order, a prefix of it), and nothing else: no garbage, no
//!   reordering, no holes. Appends continue at the next offset (invariant 4).
//! - **Corruption stops the process, loudly.** Damage that a crash cannot produce (a bad
//!   frame followed by a frame of a later commit, a bad frame in a sealed segment, missing
//!   or overlapping offsets) makes `open` refuse with [`LogError::Corrupt`] naming the segment, offset and
//!   byte. [`repair_dir`] moves damaged bytes aside (never deletes them) and keeps the valid
//!   prefix (invariant 8: only a corrupt store stops the process).
//! - **Bounded.** Appends beyond `max_size` are refused with [`LogError::Full`]
//!   (backpressure), payloads beyond `max_payload` with [`LogError::PayloadTooLarge`]; both
//!   leave the log unchanged. Memory holds only what was appended and not yet committed;
//!   readers use a window bounded by one frame (invariant 7).
//! - **A failed commit poisons the log.** If a write or fsync fails, the kernel may have
//!   dropped the dirty pages and marked them clean, so a retried fsync could "succeed" over
//!   lost data. The log therefore answers [`LogError::Failed`] to every later call; the
//!   process must exit and restart so recovery re-reads what is really on disk.
//!
//! # Retention: what may be deleted, and when (invariant 7)
//!
//! The log decides nothing by itself; the agent calls [`Log::plan_retention`] after every
//! checkpoint and while input is held back, then [`Log::truncate_before`]. The rule:
//!
//! 1. **Records no durable checkpoint covers are never deleted.** The bound is the
//!    `next_offset` of the last *committed* checkpoint (the store's progress), never what
//!    the engine has applied in memory: a crash replays from the committed checkpoint, so
//!    everything from there on must still be in the log. A backfill (`start = "earliest"`)
//!    counts as unprocessed: the agent passes the lowest committed backfill cursor when it
//!    is lower (`agent/keeper/mod.rs`), so 3 never evicts what a backfill still needs.
//! 2. **`retention` is how long processed records are kept when there is room.** While the
//!    log has room (see 3), a processed segment goes once its newest
//!    record is older than `retention` and it lies below the savepoint floor (the newest
//!    savepoint's offset: restoring it replays the log from there).
//! 3. **When the log is short of room, processed segments go oldest first regardless of
//!    age**, until there is room for two segments again (one, in a log of fewer than
//!    three: room for the active segment to roll, and for the input between checkpoints). Each such segment is counted
//!    (`cairn_log_segments_evicted_total`) and the agent warns (rate-limited). So sustained
//!    input never stalls on a full log: it needs only `max_size >= 2 × segment_size`, one
//!    sealed segment to delete and the active one.
//! 4. **A savepoint holds the floor only while there is room.** When it is what keeps a
//!    short log from freeing space, [`RetentionPlan::floor_blocks`] says so, and the agent
//!    takes a fresh savepoint of the durable checkpoint (the rebuild path stays whole), or,
//!    if that fails, lets the floor go with an error in the journal.
//!
//! The active segment is never deleted. Tests: `tests/it/retention.rs`, and
//! `retention_plan_*` below.
//!
//! # Mechanism
//!
//! Segment files in one directory are named by their first offset,
//! `00000000000000000000.log`. Each holds frames
//! `[len u32 LE][crc32 u32 LE over len bytes + body][body = postcard(Record)]`
//! (see [`frame`]); the record carries its own offset. Offsets are dense `u64`s starting at 0.
//!
//! Write path: `append` encodes the frame and decides in memory which segment it goes to
//! (rolling when the frame would push the active segment past `segment_size`). `commit`
//! then, for each buffered chunk in order: if it starts a new segment, `fdatasync`s the
//! segment being sealed (if this commit wrote to it), creates the new file and fsyncs the
//! directory; then writes the chunk (checking every frame's CRC right before the write).
//! Last, it `fdatasync`s the active segment. Hence one data sync per touched segment and one
//! directory sync per created segment, and at every instant only the last segment can hold
//! unsynced bytes, and a segment exists on disk only after everything before it is durable.
//!
//! Recovery (`open`) scans every segment: CRC, decode, consecutive offsets starting at the
//! file name's. The first bad frame of the *last* segment is a torn tail unless a frame of a
//! later commit follows it: the first frame each commit writes into a segment carries
//! [`frame::COMMIT_START`] in its qos byte, and a later commit begins only after the earlier
//! one's `fdatasync`, so such a frame proves the damaged bytes were synced. Good frames of
//! the damaged frame's own commit after it prove nothing: the page cache writes an unsynced
//! commit's pages back in any order, so a power cut can keep its end and lose its middle
//! (`tests/it/log_corruption.rs` `records_of_one_commit_lost_out_of_order_are_a_torn_tail_not_corruption`,
//! and `Tail::Holes` in the crash property). A torn tail is truncated (`ftruncate` + sync)
//! and logged with the bytes and records dropped; none of them was acknowledged. Anything
//! else bad is corruption. `open` then syncs the last segment
//! and the directory once, so whatever it recovered is durable before anyone reads it.
//! Every sync goes through the [`Durability`] seam.
//!
//! # Invariants and the tests that guard them
//!
//! 1. Committed records survive any crash; recovery yields committed ++ a prefix of the
//!    in-flight commit, nothing else: `tests/it/log_crash.rs`
//!    `a_crash_keeps_every_committed_record_and_only_a_prefix_of_the_rest`.
//! 2. One data sync per touched segment per commit; a directory sync only when a segment is
//!    created or removed: `tests/it/log_corruption.rs`
//!    `commit_syncs_each_touched_segment_once_and_the_dir_only_when_a_segment_is_created`,
//!    `truncate_before_removes_whole_sealed_segments_and_syncs_the_dir_once`.
//! 3. A failed sync poisons the log: `a_failing_sync_poisons_the_log_until_reopened`.
//! 4. A torn tail is truncated and counted, never refused:
//!    `a_torn_tail_is_truncated_counted_and_made_durable` (and the crash property).
//! 5. A bad frame followed by a frame of a later commit, or in a non-last segment, is
//!    refused naming the segment and offset: `a_flipped_byte_followed_by_good_frames_is_refused_naming_segment_and_offset`,
//!    `damage_in_a_sealed_segment_is_refused_even_at_its_tail`,
//!    `a_missing_middle_segment_is_refused`.
//! 6. Repair never deletes bytes and leaves an openable log with the valid prefix; offsets
//!    never repeat after it: `repair_moves_the_damaged_segment_aside_byte_identical_and_keeps_the_valid_prefix`,
//!    `repair_of_the_last_segment_never_reuses_an_offset`.
//! 7. Refusals (`Full`, `PayloadTooLarge`) leave the log unchanged:
//!    `full_and_too_large_refusals_leave_the_log_unchanged` (unit test below).
//! 8. Frames: roundtrip, CRC mismatch, short frames and zero fill are detected:
//!    `frame::tests`.
//! 9. `verify_dir` and `read_dir` never modify the directory; `read_dir` shows only valid
//!    prefixes and reports damage after the records before it:
//!    `read_dir_shows_the_valid_prefix_without_touching_the_files`.
//!
//! The crash property runs 1200 cases by default; `CAIRN_LOG_CRASH_CASES` raises it.

pub(crate) mod frame;
mod open;
mod reader;
mod retention;
mod scan;
mod verify;

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use crate::failpoint;
use crate::fsio::{Durability, SyncKind};
use crate::model::{Offset, Record};

pub use reader::LogReader;
pub use verify::{
    CorruptionReport, GapReport, RepairReport, RepairedSegment, SegmentReport, TornTailReport,
    VerifyReport, repair_dir, verify_dir,
};

use reader::SegmentExtent;
use scan::segment_file_name;

/// Largest payload of a record appended with [`Log::append_stand_in`].
pub(crate) const STAND_IN_MAX_PAYLOAD: u64 = 4096;

/// Limits and location. All sizes in bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogOptions {
    pub dir: PathBuf,
    /// Roll to a new segment when a frame would push the active one past this. A single
    /// frame larger than this gets a segment of its own.
    pub segment_size: u64,
    /// Bytes on disk plus buffered; an append beyond it is refused with [`LogError::Full`].
    pub max_size: u64,
    /// Largest payload accepted; at most [`frame::MAX_PAYLOAD_LIMIT`].
    pub max_payload: u64,
}

/// What `open` found and did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recovery {
    pub segments: usize,
    pub records: u64,
    pub torn_bytes_dropped: u64,
    /// Frames in the dropped tail whose length header was complete.
    pub torn_records_dropped: u64,
    pub first_offset: Offset,
    pub next_offset: Offset,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentInfo {
    pub path: PathBuf,
    pub first_offset: Offset,
    /// One past the last durable record in the segment.
    pub next_offset: Offset,
    /// Durable bytes.
    pub bytes: u64,
    /// Highest `received_at_ms` in the segment (0 if empty): retention decides on it.
    pub max_received_at_ms: u64,
}

/// What retention may delete now; see the module docs, "Retention".
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RetentionPlan {
    /// Delete the segments wholly below this offset ([`Log::truncate_before`]).
    pub below: Offset,
    /// How many of them go only because the log is short of room (inside `retention`).
    pub evicted: usize,
    /// The log is short of room and the next processed segment is held only by the
    /// savepoint floor: take a fresh savepoint, or plan again without the floor.
    pub floor_blocks: bool,
}

/// Errors of the log. `Io` and `Failed` are operational; `Corrupt` needs an operator.
#[derive(thiserror::Error, Debug)]
pub enum LogError {
    /// A filesystem call failed.
    #[error("log: cannot {op} {}: {source}", .path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// The append would take the log past `max_size`; the log is unchanged. Apply
    /// backpressure until `truncate_before` frees space.
    #[error("log full: {size} bytes held, limit {max}")]
    Full { size: u64, max: u64 },
    /// The payload exceeds `max_payload`; the log is unchanged.
    #[error("payload of {len} bytes exceeds the log limit of {max}")]
    PayloadTooLarge { len: u64, max: u64 },
    /// The topic exceeds the MQTT limit; the log is unchanged.
    #[error("topic of {len} bytes exceeds the limit of {max}")]
    TopicTooLong { len: u64, max: u64 },
    /// Damage a crash cannot produce. `open` refuses to start.
    #[error(
        "log segment {} is corrupt at byte {byte_pos}{}: {reason}. The log will not open; run `cairn verify --repair` to move the damaged segment aside (its bytes are kept) and keep its valid prefix",
        .segment.display(),
        at_offset(.offset)
    )]
    Corrupt {
        segment: PathBuf,
        offset: Option<Offset>,
        byte_pos: u64,
        reason: String,
    },
    /// An earlier write or fsync failed; the page cache can no longer be trusted. Restart
    /// the process so `open` recovers from what is on disk.
    #[error(
        "log poisoned by an earlier failed write or fsync: restart so recovery re-reads the disk"
    )]
    Failed,
    /// `read_from` asked for records that `truncate_before` already deleted.
    #[error("offset {from} is no longer in the log; the oldest record held is {first}")]
    Truncated { from: Offset, first: Offset },
    #[error("invalid log options: {0}")]
    InvalidOptions(String),
}

fn at_offset(offset: &Option<Offset>) -> String {
    offset.map(|o| format!(" (offset {o})")).unwrap_or_default()
}

fn io_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> LogError + 'a {
    move |source| LogError::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}

#[derive(Debug, Clone)]
struct Segment {
    path: PathBuf,
    first_offset: Offset,
    next_offset: Offset,
    bytes: u64,
    max_received_at_ms: u64,
}

/// Frames appended but not committed, all bound for one segment.
#[derive(Debug)]
struct Chunk {
    /// Create the segment (named `first_offset`) before writing.
    new_segment: bool,
    first_offset: Offset,
    next_offset: Offset,
    buf: Vec<u8>,
    max_received_at_ms: u64,
}

/// The replay log. Single writer; see the module docs for guarantees.
#[derive(Debug)]
pub struct Log {
    opts: LogOptions,
    sync: Durability,
    /// On-disk segments in offset order; the last is the active one.
    segments: Vec<Segment>,
    /// Append handle to the last segment.
    active: Option<File>,
    pending: Vec<Chunk>,
    pending_records: usize,
    pending_bytes: u64,
    disk_bytes: u64,
    next_offset: Offset,
    durable_next: Offset,
    failed: bool,
}

impl Log {
    /// Buffer one record in memory and return its offset. Nothing reaches the disk until
    /// [`Log::commit`]. Refusals (`Full`, `PayloadTooLarge`, `TopicTooLong`) leave the log
    /// unchanged.
    pub fn append(
        &mut self,
        received_at_ms: u64,
        topic: &str,
        payload: &[u8],
        qos: u8,
        retain: bool,
    ) -> Result<Offset, LogError> {
        let max = self.opts.max_payload;
        self.append_within(received_at_ms, topic, payload, qos, retain, max)
    }

    /// As [`Log::append`], for a small record the caller builds (the stand-in for a
    /// refused input): its payload is bounded by [`STAND_IN_MAX_PAYLOAD`] rather than by
    /// `max_payload`, so that a refusal is durable whatever limit is configured.
    pub(crate) fn append_stand_in(
        &mut self,
        received_at_ms: u64,
        topic: &str,
        payload: &[u8],
        qos: u8,
        retain: bool,
    ) -> Result<Offset, LogError> {
        let max = STAND_IN_MAX_PAYLOAD;
        self.append_within(received_at_ms, topic, payload, qos, retain, max)
    }

    fn append_within(
        &mut self,
        received_at_ms: u64,
        topic: &str,
        payload: &[u8],
        qos: u8,
        retain: bool,
        max_payload: u64,
    ) -> Result<Offset, LogError> {
        self.check_usable()?;
        if payload.len() as u64 > max_payload {
            return Err(LogError::PayloadTooLarge {
                len: payload.len() as u64,
                max: max_payload,
            });
        }
        if topic.len() as u64 > frame::MAX_TOPIC_LEN {
            return Err(LogError::TopicTooLong {
                len: topic.len() as u64,
                max: frame::MAX_TOPIC_LEN,
            });
        }
        let offset = self.next_offset;
        let Some(after) = offset.checked_add(1) else {
            // Only a segment named by hand gets here (2^64 records are never written).
            return Err(LogError::Corrupt {
                segment: self
                    .segments
                    .last()
                    .map(|s| s.path.clone())
                    .unwrap_or_default(),
                offset: Some(offset),
                byte_pos: 0,
                reason: "no offset is left after it: a segment name claims offsets no log reaches"
                    .into(),
            });
        };
        let bytes = frame::encode(&Record {
            offset,
            received_at_ms,
            topic: topic.to_string(),
            payload: payload.to_vec(),
            qos: qos & !frame::COMMIT_START,
            retain,
        });
        let frame_len = bytes.len() as u64;
        let size = self.size_bytes();
        if size + frame_len > self.opts.max_size {
            return Err(LogError::Full {
                size,
                max: self.opts.max_size,
            });
        }

        // Bytes the frame's segment would already hold: buffered for it plus, when the
        // buffer targets the existing active segment, what that segment has on disk.
        let tail = match self.pending.last() {
            Some(c) if c.new_segment => Some(c.buf.len() as u64),
            Some(c) => Some(c.buf.len() as u64 + self.segments.last().map_or(0, |s| s.bytes)),
            None => self.segments.last().map(|s| s.bytes),
        };
        let roll = match tail {
            None => true,
            Some(t) => t > 0 && t + frame_len > self.opts.segment_size,
        };
        // The first frame a commit writes into a segment is marked: recovery tells a torn
        // commit (its pages written back in any order) from damage to synced bytes by it.
        let bytes = if roll || self.pending.is_empty() {
            frame::encode(&Record {
                offset,
                received_at_ms,
                topic: topic.to_string(),
                payload: payload.to_vec(),
                qos: qos | frame::COMMIT_START,
                retain,
            })
        } else {
            bytes
        };
        debug_assert_eq!(
            bytes.len() as u64,
            frame_len,
            "postcard writes a u8 as one byte"
        );
        if roll || self.pending.is_empty() {
            self.pending.push(Chunk {
                new_segment: roll,
                first_offset: offset,
                next_offset: offset,
                buf: Vec::new(),
                max_received_at_ms: 0,
            });
        }
        let chunk = self.pending.last_mut().expect("chunk pushed above");
        chunk.buf.extend_from_slice(&bytes);
        chunk.next_offset = after;
        chunk.max_received_at_ms = chunk.max_received_at_ms.max(received_at_ms);
        self.pending_records += 1;
        self.pending_bytes += frame_len;
        self.next_offset = after;
        Ok(offset)
    }

    /// Write everything appended so far and make it durable (see the module docs for the
    /// order of writes and syncs). Returns the highest durable offset, or `None` if no
    /// record was ever made durable. On failure the log is poisoned.
    pub fn commit(&mut self) -> Result<Option<Offset>, LogError> {
        self.check_usable()?;
        if !self.pending.is_empty() {
            if let Err(e) = self.write_pending() {
                self.failed = true;
                return Err(e);
            }
            self.durable_next = self.next_offset;
        }
        Ok(self.durable_next.checked_sub(1))
    }

    fn write_pending(&mut self) -> Result<(), LogError> {
        let chunks = std::mem::take(&mut self.pending);
        self.pending_records = 0;
        self.pending_bytes = 0;
        let mut dirty = false;
        for chunk in chunks {
            if chunk.new_segment {
                if dirty {
                    // Seal the old segment before the new one exists: a crash then never
                    // leaves a torn segment that is not the last.
                    self.sync_active()?;
                }
                self.create_segment(chunk.first_offset)?;
            }
            let seg = self
                .segments
                .last_mut()
                .expect("a segment exists to write to");
            assert_eq!(
                seg.next_offset, chunk.first_offset,
                "buffered chunk does not continue its segment"
            );
            // The check right before writing: the bytes we built are the bytes we write.
            let frames = frame::assert_frames(&chunk.buf);
            assert_eq!(frames, chunk.next_offset - chunk.first_offset);
            let file = self.active.as_mut().expect("active segment is open");
            file.write_all(&chunk.buf)
                .map_err(io_err("write segment", &seg.path))?;
            seg.bytes += chunk.buf.len() as u64;
            seg.next_offset = chunk.next_offset;
            seg.max_received_at_ms = seg.max_received_at_ms.max(chunk.max_received_at_ms);
            self.disk_bytes += chunk.buf.len() as u64;
            dirty = true;
        }
        if dirty {
            self.sync_active()?;
        }
        Ok(())
    }

    fn sync_active(&self) -> Result<(), LogError> {
        let seg = self.segments.last().expect("active segment exists");
        let file = self.active.as_ref().expect("active segment is open");
        let fsync = || {
            failpoint::hit("log.before_fsync")?;
            self.sync
                .sync_file(SyncKind::LogData, file, &seg.path, true)?;
            failpoint::hit("log.after_fsync")
        };
        fsync().map_err(io_err("fdatasync segment", &seg.path))
    }

    fn create_segment(&mut self, first_offset: Offset) -> Result<(), LogError> {
        let path = self.opts.dir.join(segment_file_name(first_offset));
        let file = OpenOptions::new()
            .append(true)
            .create_new(true)
            .open(&path)
            .map_err(io_err("create segment", &path))?;
        failpoint::hit("log.segment_roll").map_err(io_err("create segment", &path))?;
        // The entry must be durable before any record in it is acknowledged, and before a
        // later segment can exist (recovery relies on segments never vanishing mid-log).
        self.sync
            .sync_dir(&self.opts.dir)
            .map_err(io_err("fsync log directory", &self.opts.dir))?;
        self.segments.push(Segment {
            path,
            first_offset,
            next_offset: first_offset,
            bytes: 0,
            max_received_at_ms: 0,
        });
        self.active = Some(file);
        Ok(())
    }

    /// Offset the next append gets.
    pub fn next_offset(&self) -> Offset {
        self.next_offset
    }

    /// One past the highest durable offset.
    pub fn durable_next(&self) -> Offset {
        self.durable_next
    }

    /// Oldest offset still held: the first segment's; with no segment yet, the offset the
    /// first durable record will have.
    pub fn first_offset(&self) -> Offset {
        self.segments
            .first()
            .map_or(self.durable_next, |s| s.first_offset)
    }

    /// Records appended but not yet committed.
    pub fn pending(&self) -> usize {
        self.pending_records
    }

    /// Bytes on disk plus bytes buffered.
    pub fn size_bytes(&self) -> u64 {
        self.disk_bytes + self.pending_bytes
    }

    /// Durable segments, oldest first; the last is the active one.
    pub fn segments(&self) -> Vec<SegmentInfo> {
        self.segments
            .iter()
            .map(|s| SegmentInfo {
                path: s.path.clone(),
                first_offset: s.first_offset,
                next_offset: s.next_offset,
                bytes: s.bytes,
                max_received_at_ms: s.max_received_at_ms,
            })
            .collect()
    }

    /// Durable records with offset `>= from`, in order, read from the files. Asking for an
    /// offset below [`Log::first_offset`] while the log holds records is an error
    /// ([`LogError::Truncated`]) rather than a silent skip.
    pub fn read_from(&self, from: Offset) -> Result<LogReader, LogError> {
        self.check_usable()?;
        let first = self.first_offset();
        if from < first && self.durable_next > first {
            return Err(LogError::Truncated { from, first });
        }
        let extents = self
            .segments
            .iter()
            .filter(|s| s.next_offset > from && s.bytes > 0)
            .map(|s| SegmentExtent {
                path: s.path.clone(),
                first_offset: s.first_offset,
                next_offset: s.next_offset,
                bytes: s.bytes,
            })
            .collect();
        Ok(LogReader::new(extents, from))
    }

    /// Change the size bound (a config reload). Lowering it below the current size only
    /// refuses appends until retention frees space; nothing is deleted for it.
    pub(crate) fn set_max_size(&mut self, max_size: u64) {
        self.opts.max_size = max_size.max(1);
    }

    /// Options the log was opened with.
    pub fn options(&self) -> &LogOptions {
        &self.opts
    }

    fn check_usable(&self) -> Result<(), LogError> {
        if self.failed {
            Err(LogError::Failed)
        } else {
            Ok(())
        }
    }
}

/// Read the valid records of a log directory without opening it for writing (safe while
/// an agent runs, e.g. `cairn inspect log`); see [`LogReader::open_dir`].
pub fn read_dir(dir: &Path, from: Offset) -> Result<LogReader, LogError> {
    LogReader::open_dir(dir, from)
}

#[cfg(test)]
mod tests;
