//! Offline tools for an operator: `verify_dir` (read-only) and `repair_dir`.
//!
//! Repair never deletes a byte: a damaged segment is hard-linked (or, where the filesystem
//! has no hard links, copied and synced) into `damaged/<name>.<n>` before a file holding only
//! its valid prefix is renamed over it. At every instant the segment's name points at either
//! the original or the repaired file, and once the damaged copy exists it stays.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

use super::scan::{self, DAMAGED_DIR, ProblemKind, SegmentScan, file_name, segment_file_name};
use super::{LogError, io_err};
use crate::fsio::{Durability, SyncKind};
use crate::model::Offset;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentReport {
    pub path: PathBuf,
    pub first_offset: Offset,
    /// One past the last record of the valid prefix.
    pub next_offset: Offset,
    pub records: u64,
    pub bytes: u64,
    pub valid_bytes: u64,
}

/// What `open` would truncate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TornTailReport {
    pub segment: PathBuf,
    pub byte_pos: u64,
    pub bytes: u64,
    pub records: u64,
}

/// Damage `open` refuses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CorruptionReport {
    pub segment: PathBuf,
    pub offset: Option<Offset>,
    pub byte_pos: u64,
    pub reason: String,
    /// CRC-valid frames after the damage, which a repair would also drop.
    pub good_records_after: u64,
    /// Bytes after the damage that are not CRC-valid frames.
    pub unknown_bytes: u64,
}

/// Offsets no segment holds, left behind by an earlier repair (accepted by `open`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GapReport {
    pub after: PathBuf,
    pub from: Offset,
    pub to: Offset,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifyReport {
    pub dir: PathBuf,
    pub segments: Vec<SegmentReport>,
    pub records: u64,
    pub first_offset: Offset,
    pub next_offset: Offset,
    pub torn_tail: Option<TornTailReport>,
    pub corruption: Vec<CorruptionReport>,
    pub repaired_gaps: Vec<GapReport>,
}

impl VerifyReport {
    /// True when `open` would succeed (a torn tail is an expected crash artefact).
    pub fn opens(&self) -> bool {
        self.corruption.is_empty()
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepairedSegment {
    pub segment: PathBuf,
    /// Where the original bytes now live.
    pub moved_to: PathBuf,
    pub kept_records: u64,
    pub kept_bytes: u64,
    /// Known-good frames after the damage that were dropped with it.
    pub dropped_good_records: u64,
    /// Bytes after the damage that were not valid frames (records they held are unknown).
    pub dropped_unknown_bytes: u64,
    /// Set when the repaired segment was the last: the empty segment created so that new
    /// appends never reuse an offset that a dropped record already had.
    pub new_active_segment: Option<PathBuf>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepairReport {
    pub repaired: Vec<RepairedSegment>,
    /// Missing offset ranges that were acknowledged (a note in `damaged/`) so `open` accepts
    /// them.
    pub acknowledged_gaps: Vec<GapReport>,
    /// Problems repair cannot fix (overlapping segments); `open` will still refuse.
    pub unrepaired: Vec<CorruptionReport>,
}

fn scan_dir(dir: &Path) -> Result<Vec<SegmentScan>, LogError> {
    use crate::logging::progress::{Unit, step};
    let listed = scan::list_segments(dir).map_err(io_err("list log directory", dir))?;
    // Progress for `cairn verify` on a terminal, segment by segment (by bytes).
    let size = |p: &Path| std::fs::metadata(p).map_or(0, |m| m.len());
    let total: u64 = listed.iter().map(|(_, p)| size(p)).sum();
    let mut done = 0;
    let mut out = Vec::with_capacity(listed.len());
    for (first, path) in &listed {
        step("reading the log", done, Some(total), Unit::Bytes);
        out.push(scan::scan_segment(path, *first).map_err(io_err("scan segment", path))?);
        done += size(path);
    }
    step("reading the log", total, Some(total), Unit::Bytes);
    Ok(out)
}

fn corruption_report(scans: &[SegmentScan], p: &scan::Problem) -> CorruptionReport {
    let (good, unknown) = match p.kind {
        ProblemKind::Damaged(i) => {
            let s = &scans[i];
            let d = s.damage.as_ref().expect("damaged scan has damage");
            (
                d.good_records_after,
                s.file_len - s.valid_end - d.good_bytes_after,
            )
        }
        _ => (0, 0),
    };
    CorruptionReport {
        segment: p.segment.clone(),
        offset: p.offset,
        byte_pos: p.byte_pos,
        reason: p.reason.clone(),
        good_records_after: good,
        unknown_bytes: unknown,
    }
}

/// Read-only scan of a log directory: what `open` would accept, truncate or refuse.
pub fn verify_dir(dir: &Path) -> Result<VerifyReport, LogError> {
    let scans = scan_dir(dir)?;
    let findings = scan::classify(dir, &scans);
    let torn_tail = if findings.torn_tail {
        let last = scans.last().expect("torn tail implies a segment");
        let d = last.damage.as_ref().expect("torn tail has damage");
        Some(TornTailReport {
            segment: last.path.clone(),
            byte_pos: last.valid_end,
            bytes: last.file_len - last.valid_end,
            records: d.torn_records,
        })
    } else {
        None
    };
    let next_offset = scans.last().map_or(0, |s| s.next_offset());
    Ok(VerifyReport {
        dir: dir.to_path_buf(),
        segments: scans
            .iter()
            .map(|s| SegmentReport {
                path: s.path.clone(),
                first_offset: s.first_offset,
                next_offset: s.next_offset(),
                records: s.records,
                bytes: s.file_len,
                valid_bytes: s.valid_end,
            })
            .collect(),
        records: scans.iter().map(|s| s.records).sum(),
        first_offset: scans.first().map_or(next_offset, |s| s.first_offset),
        next_offset,
        torn_tail,
        corruption: findings
            .problems
            .iter()
            .map(|p| corruption_report(&scans, p))
            .collect(),
        repaired_gaps: findings
            .repaired_gaps
            .into_iter()
            .map(|(after, from, to)| GapReport { after, from, to })
            .collect(),
    })
}

/// Repair a log directory so that `open` accepts it, losing as little as possible and
/// deleting nothing. Each damaged segment keeps its valid prefix; its original bytes move
/// to `damaged/<name>.<n>`. A torn tail is left for `open` to truncate. Not to be run while
/// an agent has the log open.
pub fn repair_dir(dir: &Path, sync: Durability) -> Result<RepairReport, LogError> {
    let scans = scan_dir(dir)?;
    let findings = scan::classify(dir, &scans);
    let mut report = RepairReport {
        repaired: Vec::new(),
        acknowledged_gaps: Vec::new(),
        unrepaired: Vec::new(),
    };
    if findings.problems.is_empty() {
        return Ok(report);
    }
    let damaged_dir = dir.join(DAMAGED_DIR);
    if !damaged_dir.exists() {
        fs::create_dir(&damaged_dir).map_err(io_err("create", &damaged_dir))?;
        sync.sync_dir(dir).map_err(io_err("fsync", dir))?;
    }
    let last = scans.len() - 1;
    for p in &findings.problems {
        match p.kind {
            ProblemKind::Damaged(i) => {
                let s = &scans[i];
                let d = s.damage.as_ref().expect("damaged scan has damage");
                let moved_to = keep_prefix(dir, &damaged_dir, s, &sync)?;
                let mut new_active_segment = None;
                if i == last {
                    if let Some(next) = d
                        .max_offset_after
                        .filter(|m| *m >= s.next_offset())
                        .and_then(|m| m.checked_add(1))
                    {
                        new_active_segment = Some(create_empty_segment(dir, next, &sync)?);
                    }
                }
                crate::event!(warn, "log_segment_repaired";
                    "log repair: {} kept {} records ({} bytes); dropped {} valid records after the damage and {} unknown bytes; original moved to {}",
                    s.path.display(),
                    s.records,
                    s.valid_end,
                    d.good_records_after,
                    s.file_len - s.valid_end - d.good_bytes_after,
                    moved_to.display()
                );
                report.repaired.push(RepairedSegment {
                    segment: s.path.clone(),
                    moved_to,
                    kept_records: s.records,
                    kept_bytes: s.valid_end,
                    dropped_good_records: d.good_records_after,
                    dropped_unknown_bytes: s.file_len - s.valid_end - d.good_bytes_after,
                    new_active_segment,
                });
            }
            ProblemKind::Missing { prev, from, to } => {
                // Records missing between segments: nothing to move, but the loss must be
                // acknowledged on disk so that open accepts the gap from now on.
                let prev = &scans[prev];
                let base = format!("{}.missing", file_name(&prev.path));
                let note = unused_name(&damaged_dir, &base);
                write_synced(&note, p.reason.as_bytes(), &sync)?;
                sync.sync_dir(&damaged_dir)
                    .map_err(io_err("fsync", &damaged_dir))?;
                report.acknowledged_gaps.push(GapReport {
                    after: prev.path.clone(),
                    from,
                    to,
                });
            }
            ProblemKind::Overlap => report.unrepaired.push(corruption_report(&scans, p)),
        }
    }
    Ok(report)
}

/// `dir/base.0`, `dir/base.1`, ...: the first that does not exist.
fn unused_name(dir: &Path, base: &str) -> PathBuf {
    (0u64..)
        .map(|n| dir.join(format!("{base}.{n}")))
        .find(|p| !p.exists())
        .expect("some numbered name is free")
}

fn write_synced(path: &Path, bytes: &[u8], sync: &Durability) -> Result<(), LogError> {
    let mut f = File::create(path).map_err(io_err("create", path))?;
    f.write_all(bytes).map_err(io_err("write", path))?;
    sync.sync_file(SyncKind::File, &f, path, false)
        .map_err(io_err("fsync", path))
}

/// Replace segment `s` by its valid prefix, keeping the original under `damaged/`.
fn keep_prefix(
    dir: &Path,
    damaged_dir: &Path,
    s: &SegmentScan,
    sync: &Durability,
) -> Result<PathBuf, LogError> {
    let name = file_name(&s.path);
    let tmp = dir.join(format!("{name}.repair.tmp"));
    if tmp.exists() {
        fs::remove_file(&tmp).map_err(io_err("remove stale", &tmp))?;
    }
    {
        let mut src = File::open(&s.path)
            .map_err(io_err("open", &s.path))?
            .take(s.valid_end);
        let mut dst = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .map_err(io_err("create", &tmp))?;
        let copied = io::copy(&mut src, &mut dst).map_err(io_err("copy valid prefix to", &tmp))?;
        assert_eq!(copied, s.valid_end, "segment shrank while being repaired");
        sync.sync_file(SyncKind::File, &dst, &tmp, false)
            .map_err(io_err("fsync", &tmp))?;
    }
    let moved_to = unused_name(damaged_dir, &name);
    if fs::hard_link(&s.path, &moved_to).is_err() {
        // No hard links here (e.g. vfat): copy, and make the copy durable before the
        // original's name is taken over.
        fs::copy(&s.path, &moved_to).map_err(io_err("copy damaged segment to", &moved_to))?;
        let f = File::open(&moved_to).map_err(io_err("open", &moved_to))?;
        sync.sync_file(SyncKind::File, &f, &moved_to, false)
            .map_err(io_err("fsync", &moved_to))?;
    }
    sync.sync_dir(damaged_dir)
        .map_err(io_err("fsync", damaged_dir))?;
    fs::rename(&tmp, &s.path).map_err(io_err("rename repaired segment onto", &s.path))?;
    sync.sync_dir(dir).map_err(io_err("fsync", dir))?;
    Ok(moved_to)
}

fn create_empty_segment(dir: &Path, first: Offset, sync: &Durability) -> Result<PathBuf, LogError> {
    let path = dir.join(segment_file_name(first));
    let f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&path)
        .map_err(io_err("create", &path))?;
    sync.sync_file(SyncKind::File, &f, &path, false)
        .map_err(io_err("fsync", &path))?;
    sync.sync_dir(dir).map_err(io_err("fsync", dir))?;
    Ok(path)
}
