//! Reading segment files: a bounded read window, the per-segment scan that recovery,
//! `verify_dir` and `repair_dir` share, and the torn-tail / corruption classification.
//!
//! One scanner, three callers: `open`, `verify` and `repair` must agree on what is torn and
//! what is corrupt, or an operator would be told to repair a log that opens fine (or the
//! reverse).

use std::fs::{self, File};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::frame::{self, FrameError, HEADER_LEN, MAX_BODY_LEN};
use crate::model::{Offset, Record};

/// Read granularity. The window grows beyond this only to hold one frame, which is bounded
/// by [`MAX_BODY_LEN`].
const CHUNK: usize = 64 * 1024;

/// Subdirectory where `repair_dir` keeps damaged segments.
pub(crate) const DAMAGED_DIR: &str = "damaged";

pub(crate) fn segment_file_name(first_offset: Offset) -> String {
    format!("{first_offset:020}.log")
}

/// `Some(offset)` for names of the form `00000000000000000042.log`.
pub(crate) fn parse_segment_name(name: &str) -> Option<Offset> {
    let digits = name.strip_suffix(".log")?;
    if digits.len() != 20 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// Segment files in `dir`, sorted by first offset. Other entries are ignored.
pub(crate) fn list_segments(dir: &Path) -> io::Result<Vec<(Offset, PathBuf)>> {
    let mut out = Vec::new();
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name();
        let Some(first) = name.to_str().and_then(parse_segment_name) else {
            continue;
        };
        if entry.file_type()?.is_file() {
            out.push((first, entry.path()));
        }
    }
    out.sort_by_key(|(first, _)| *first);
    Ok(out)
}

/// A sliding read buffer over the first `len` bytes of a file.
pub struct Window {
    file: File,
    len: u64,
    start: u64,
    buf: Vec<u8>,
}

impl Window {
    pub fn new(file: File, len: u64) -> Self {
        Window {
            file,
            len,
            start: 0,
            buf: Vec::new(),
        }
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    /// Bytes `[pos, pos + n)`; the caller guarantees they lie within `len`.
    fn bytes(&mut self, pos: u64, n: usize) -> io::Result<&[u8]> {
        assert!(pos + n as u64 <= self.len, "read past the window's end");
        let end = pos + n as u64;
        if pos < self.start || end > self.start + self.buf.len() as u64 {
            let want = (n.max(CHUNK) as u64).min(self.len - pos) as usize;
            self.buf.resize(want, 0);
            self.file.read_exact_at(&mut self.buf[..want], pos)?;
            self.start = pos;
        }
        let at = (pos - self.start) as usize;
        Ok(&self.buf[at..at + n])
    }

    /// The frame at `pos`: the record and frame length, or why it is not a frame.
    pub(crate) fn frame_at(&mut self, pos: u64) -> io::Result<Result<(Record, u64), FrameError>> {
        Ok(self.frame_marked_at(pos)?.map(|(r, n, _)| (r, n)))
    }

    /// As [`Self::frame_at`], also whether the frame starts a commit ([`frame::COMMIT_START`]).
    fn frame_marked_at(&mut self, pos: u64) -> io::Result<Result<(Record, u64, bool), FrameError>> {
        let avail = self.len - pos;
        let header_n = avail.min(HEADER_LEN as u64) as usize;
        let header = self.bytes(pos, header_n)?;
        let widen = |(r, n, start): (Record, usize, bool)| (r, n as u64, start);
        if header_n < HEADER_LEN {
            return Ok(frame::check_marked(header).map(widen));
        }
        let len = frame::declared_len(header);
        let body_fits =
            len != 0 && len <= MAX_BODY_LEN && HEADER_LEN as u64 + u64::from(len) <= avail;
        if !body_fits {
            return Ok(match frame::check_marked(header) {
                Err(FrameError::PastEnd { len, .. }) => Err(FrameError::PastEnd {
                    len,
                    have: (avail - HEADER_LEN as u64) as usize,
                }),
                other => other.map(widen),
            });
        }
        let bytes = self.bytes(pos, HEADER_LEN + len as usize)?;
        Ok(frame::check_marked(bytes).map(widen))
    }

    /// A resync probe: the frame length if the bytes at `pos` are a CRC-valid frame whose
    /// offset could follow `min_offset` within the bytes left. The offset test is cheap and
    /// rejects almost every random position before the CRC is computed.
    fn probe(&mut self, pos: u64, min_offset: Offset) -> io::Result<Option<u64>> {
        let avail = self.len - pos;
        if avail < HEADER_LEN as u64 + 1 {
            return Ok(None);
        }
        let header = self.bytes(pos, HEADER_LEN)?;
        let len = frame::declared_len(header);
        if len == 0 || len > MAX_BODY_LEN || HEADER_LEN as u64 + u64::from(len) > avail {
            return Ok(None);
        }
        let prefix = self.bytes(pos + HEADER_LEN as u64, (len as usize).min(10))?;
        match frame::body_offset_prefix(prefix) {
            Some(o) if o >= min_offset && o - min_offset <= avail => {}
            _ => return Ok(None),
        }
        let bytes = self.bytes(pos, HEADER_LEN + len as usize)?;
        Ok(frame::checked_len(bytes)
            .ok()
            .map(|len| HEADER_LEN as u64 + u64::from(len)))
    }

    fn find_good(&mut self, from: u64, min_offset: Offset) -> io::Result<Option<(u64, u64)>> {
        let mut pos = from;
        while pos + HEADER_LEN as u64 <= self.len {
            if let Some(n) = self.probe(pos, min_offset)? {
                return Ok(Some((pos, n)));
            }
            pos += 1;
        }
        Ok(None)
    }
}

/// The first invalid frame of a segment and what lies after it.
#[derive(Debug, Clone)]
pub(crate) struct Damage {
    pub byte_pos: u64,
    /// The offset the damaged frame should have had.
    pub offset: Offset,
    pub reason: String,
    /// Something at or after the damage proves the damaged bytes were once durable: a frame
    /// a later commit wrote ([`frame::COMMIT_START`]), or a CRC-valid frame at the damage
    /// itself (bytes some writer wrote whole, yet wrong). A crash cannot produce that; damage
    /// followed only by frames of its own commit it can, since the page cache may write
    /// an unsynced commit's pages back in any order.
    pub durable_after: bool,
    /// Torn-tail accounting: frames from the damage on whose length header was complete, and
    /// at least the offsets up to the last good frame after it (a commit torn out of order:
    /// the length walk stops at a hole's zeros).
    pub torn_records: u64,
    /// CRC-valid frames at or after the damage (all dropped by a truncation or repair).
    pub good_records_after: u64,
    pub good_bytes_after: u64,
    /// Highest record offset among those frames.
    pub max_offset_after: Option<Offset>,
}

/// What a scan found in one segment file.
#[derive(Debug, Clone)]
pub(crate) struct SegmentScan {
    pub path: PathBuf,
    pub first_offset: Offset,
    pub file_len: u64,
    /// End of the valid prefix.
    pub valid_end: u64,
    pub records: u64,
    pub max_received_at_ms: u64,
    pub damage: Option<Damage>,
}

impl SegmentScan {
    pub fn next_offset(&self) -> Offset {
        self.first_offset + self.records
    }
}

/// Scan one segment: walk frames from byte 0, checking CRC, decoding, and that offsets run
/// consecutively from the one in the file name. Stops at the first invalid frame and
/// characterises what follows it.
pub(crate) fn scan_segment(path: &Path, first_offset: Offset) -> io::Result<SegmentScan> {
    let file = File::open(path)?;
    let len = file.metadata()?.len();
    let mut w = Window::new(file, len);
    let mut pos = 0;
    let mut expected = first_offset;
    let mut max_received_at_ms = 0;
    let mut damage = None;
    while pos < len {
        match w.frame_at(pos)? {
            // `u64::MAX` is never an offset we wrote (2^64 records), and would leave no next.
            Ok((record, n)) if record.offset == expected && expected < Offset::MAX => {
                max_received_at_ms = max_received_at_ms.max(record.received_at_ms);
                pos += n;
                expected += 1;
            }
            Ok((record, _)) => {
                let reason = format!(
                    "record holds offset {} where {expected} was expected",
                    record.offset
                );
                damage = Some(characterise(&mut w, pos, expected, reason, true)?);
                break;
            }
            Err(e) => {
                damage = Some(characterise(
                    &mut w,
                    pos,
                    expected,
                    e.to_string(),
                    e.crc_valid(),
                )?);
                break;
            }
        }
    }
    Ok(SegmentScan {
        path: path.to_path_buf(),
        first_offset,
        file_len: len,
        valid_end: pos,
        records: expected - first_offset,
        max_received_at_ms,
        damage,
    })
}

fn characterise(
    w: &mut Window,
    pos: u64,
    expected: Offset,
    reason: String,
    crc_valid_here: bool,
) -> io::Result<Damage> {
    // Torn accounting: follow length fields while they are plausible.
    let mut torn_records = 0;
    let mut p = pos;
    while w.len() - p >= 4 {
        let n = w.bytes(p, 4)?;
        let len = frame::declared_len(n);
        if len == 0 {
            break;
        }
        torn_records += 1;
        if len > MAX_BODY_LEN {
            break;
        }
        p += HEADER_LEN as u64 + u64::from(len);
        if p >= w.len() {
            break;
        }
    }

    // Known-good frames after the damage (resync by scanning forward byte by byte). Offsets
    // only grow, so a candidate must carry an offset at or above the damaged one.
    let mut good_records_after = 0;
    let mut good_bytes_after = 0;
    let mut max_offset_after = None;
    let mut durable_after = crc_valid_here;
    let mut cursor = if crc_valid_here {
        let n = match w.frame_at(pos)? {
            Ok((_, n)) => n,
            Err(_) => HEADER_LEN as u64 + u64::from(frame::declared_len(w.bytes(pos, 4)?)),
        };
        Some((pos, n))
    } else {
        w.find_good(pos + 1, expected)?
    };
    while let Some((q, n)) = cursor {
        good_records_after += 1;
        good_bytes_after += n;
        if let Ok((record, _, start)) = w.frame_marked_at(q)? {
            max_offset_after = max_offset_after.max(Some(record.offset));
            durable_after |= start;
        }
        let next = q + n;
        let floor = max_offset_after.map_or(expected, |o| o.saturating_add(1));
        cursor = match w.probe_at_boundary(next, floor)? {
            Some(n) => Some((next, n)),
            None => w.find_good(next + 1, floor)?,
        };
    }
    Ok(Damage {
        byte_pos: pos,
        offset: expected,
        reason,
        durable_after,
        // Checked: a CRC-valid frame at the damage may hold any offset, below `expected` or
        // `u64::MAX` included.
        torn_records: max_offset_after.map_or(torn_records, |m| {
            torn_records.max(m.saturating_add(1).saturating_sub(expected))
        }),
        good_records_after,
        good_bytes_after,
        max_offset_after,
    })
}

impl Window {
    fn probe_at_boundary(&mut self, pos: u64, min_offset: Offset) -> io::Result<Option<u64>> {
        if pos >= self.len {
            return Ok(None);
        }
        self.probe(pos, min_offset)
    }
}

/// A problem `open` refuses to start with.
#[derive(Debug, Clone)]
pub struct Problem {
    pub segment: PathBuf,
    pub offset: Option<Offset>,
    pub byte_pos: u64,
    pub reason: String,
    pub kind: ProblemKind,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ProblemKind {
    /// Bytes of `scans[i]` are damaged.
    Damaged(usize),
    /// Offsets `from..to` between `scans[prev]` and the next segment are in no segment.
    Missing {
        prev: usize,
        from: Offset,
        to: Offset,
    },
    /// A segment starts below the end of the previous one.
    Overlap,
}

/// The classification shared by open, verify and repair.
#[derive(Debug, Default)]
pub(crate) struct Findings {
    /// The last segment's damage is a torn tail: truncate it at `valid_end`.
    pub torn_tail: bool,
    pub problems: Vec<Problem>,
    /// Gaps between segments that a repair left behind: (previous segment, from, to).
    pub repaired_gaps: Vec<(PathBuf, Offset, Offset)>,
}

/// Whether `damaged/` holds a file for the segment `name` (left by `repair_dir`), which is
/// what makes a gap in offsets after that segment expected.
pub(crate) fn has_damaged_copy(dir: &Path, name: &str) -> bool {
    let Ok(entries) = fs::read_dir(dir.join(DAMAGED_DIR)) else {
        return false;
    };
    let prefix = format!("{name}.");
    entries.flatten().any(|e| {
        e.file_name()
            .to_str()
            .is_some_and(|n| n.starts_with(&prefix))
    })
}

pub(crate) fn classify(dir: &Path, scans: &[SegmentScan]) -> Findings {
    let mut f = Findings::default();
    let last = scans.len().saturating_sub(1);
    for (i, s) in scans.iter().enumerate() {
        if let Some(d) = &s.damage {
            if i == last && !d.durable_after {
                f.torn_tail = true;
            } else {
                let why = if i == last {
                    "a frame of a later commit follows the damage, so the damaged bytes were \
                     synced and it is not a torn write"
                } else {
                    "damage in a segment that is not the last"
                };
                f.problems.push(Problem {
                    segment: s.path.clone(),
                    offset: Some(d.offset),
                    byte_pos: d.byte_pos,
                    reason: format!(
                        "{} ({why}; {} valid records after it)",
                        d.reason, d.good_records_after
                    ),
                    kind: ProblemKind::Damaged(i),
                });
            }
        }
        if i > 0 {
            let prev = &scans[i - 1];
            let prev_next = prev.next_offset();
            if prev_next > s.first_offset {
                f.problems.push(Problem {
                    segment: s.path.clone(),
                    offset: Some(s.first_offset),
                    byte_pos: 0,
                    reason: format!(
                        "segment starts at offset {} but the previous segment already holds records up to {}",
                        s.first_offset,
                        prev_next - 1
                    ),
                    kind: ProblemKind::Overlap,
                });
            } else if prev_next < s.first_offset {
                let prev_name = file_name(&prev.path);
                if has_damaged_copy(dir, &prev_name) {
                    f.repaired_gaps
                        .push((prev.path.clone(), prev_next, s.first_offset));
                } else {
                    f.problems.push(Problem {
                        segment: s.path.clone(),
                        offset: Some(prev_next),
                        byte_pos: 0,
                        reason: format!(
                            "records {prev_next}..{} are missing: no segment holds them and no repair recorded their loss",
                            s.first_offset
                        ),
                        kind: ProblemKind::Missing {
                            prev: i - 1,
                            from: prev_next,
                            to: s.first_offset,
                        },
                    });
                }
            }
        }
    }
    f
}

pub fn file_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}
