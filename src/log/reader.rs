//! Sequential reads of durable records, segment by segment, through a bounded window.

use std::collections::VecDeque;
use std::fs::File;
use std::path::{Path, PathBuf};

use super::scan::{self, Window};
use super::{LogError, io_err};
use crate::model::{Offset, Record};

/// The durable extent of one segment when the reader was created.
#[derive(Debug, Clone)]
pub(crate) struct SegmentExtent {
    pub path: PathBuf,
    pub first_offset: Offset,
    pub next_offset: Offset,
    pub bytes: u64,
}

struct Cursor {
    extent: SegmentExtent,
    window: Window,
    pos: u64,
    expected: Offset,
}

/// Iterator over durable records with offset `>= from`, in offset order. Offsets are
/// consecutive within a segment; between segments a repair may have left a gap, which the
/// reader steps over.
///
/// The reader works on a snapshot of segment extents taken by [`super::Log::read_from`]:
/// records committed later are not seen, and bytes past each extent are never read. If
/// `truncate_before` deletes a segment the reader has not opened yet, the reader yields an
/// I/O error for it. After the first error the iterator ends.
pub struct LogReader {
    pending: VecDeque<SegmentExtent>,
    current: Option<Cursor>,
    from: Offset,
    /// Yielded after the last extent: damage `open_dir` found where the extents end.
    trailing_error: Option<LogError>,
    done: bool,
}

impl LogReader {
    pub(crate) fn new(extents: Vec<SegmentExtent>, from: Offset) -> Self {
        LogReader {
            pending: extents.into(),
            current: None,
            from,
            trailing_error: None,
            done: false,
        }
    }

    /// A read-only reader over a log directory, for tools (`cairn inspect log`) that must
    /// not take the log from a running agent: it never writes, truncates or syncs. Each
    /// segment that can hold offsets `>= from` is scanned first and only its valid prefix
    /// is read, so a torn (or still being written) tail is simply not shown. Damage that
    /// `Log::open` would refuse is yielded as `LogError::Corrupt` after the records before
    /// it. Costs two reads of the segments it covers.
    pub(crate) fn open_dir(dir: &Path, from: Offset) -> Result<LogReader, LogError> {
        let listed = scan::list_segments(dir).map_err(io_err("list log directory", dir))?;
        let mut extents = Vec::new();
        let mut trailing_error = None;
        for (i, (first, path)) in listed.iter().enumerate() {
            let last = i + 1 == listed.len();
            // Segment i holds offsets below the next segment's name.
            if !last && listed[i + 1].0 <= from {
                continue;
            }
            let s = scan::scan_segment(path, *first).map_err(io_err("scan segment", path))?;
            if s.records > 0 {
                extents.push(SegmentExtent {
                    path: path.clone(),
                    first_offset: s.first_offset,
                    next_offset: s.next_offset(),
                    bytes: s.valid_end,
                });
            }
            if let Some(d) = s.damage.filter(|d| !last || d.durable_after) {
                trailing_error = Some(LogError::Corrupt {
                    segment: path.clone(),
                    offset: Some(d.offset),
                    byte_pos: d.byte_pos,
                    reason: d.reason,
                });
                break;
            }
        }
        let mut reader = LogReader::new(extents, from);
        reader.trailing_error = trailing_error;
        Ok(reader)
    }

    fn step(&mut self) -> Result<Option<Record>, LogError> {
        loop {
            let cursor = match &mut self.current {
                Some(c) => c,
                None => {
                    let Some(extent) = self.pending.pop_front() else {
                        return match self.trailing_error.take() {
                            Some(e) => Err(e),
                            None => Ok(None),
                        };
                    };
                    let file = File::open(&extent.path).map_err(|source| LogError::Io {
                        op: "open segment for reading",
                        path: extent.path.clone(),
                        source,
                    })?;
                    let window = Window::new(file, extent.bytes);
                    self.current.insert(Cursor {
                        expected: extent.first_offset,
                        extent,
                        window,
                        pos: 0,
                    })
                }
            };
            if cursor.pos >= cursor.extent.bytes {
                if cursor.expected != cursor.extent.next_offset {
                    return Err(corrupt(
                        cursor,
                        format!(
                            "segment ends at offset {} but recovery counted records up to {}",
                            cursor.expected, cursor.extent.next_offset
                        ),
                    ));
                }
                self.current = None;
                continue;
            }
            let frame = cursor
                .window
                .frame_at(cursor.pos)
                .map_err(|source| LogError::Io {
                    op: "read segment",
                    path: cursor.extent.path.clone(),
                    source,
                })?;
            // The check right after reading: a frame that was valid at recovery and is not
            // now means the disk or page cache changed under us.
            let (record, n) = frame.map_err(|e| corrupt(cursor, e.to_string()))?;
            if record.offset != cursor.expected {
                let reason = format!(
                    "record holds offset {} where {} was expected",
                    record.offset, cursor.expected
                );
                return Err(corrupt(cursor, reason));
            }
            cursor.pos += n;
            cursor.expected += 1;
            if record.offset >= self.from {
                return Ok(Some(record));
            }
        }
    }
}

fn corrupt(cursor: &Cursor, reason: String) -> LogError {
    LogError::Corrupt {
        segment: cursor.extent.path.clone(),
        offset: Some(cursor.expected),
        byte_pos: cursor.pos,
        reason,
    }
}

impl Iterator for LogReader {
    type Item = Result<Record, LogError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        match self.step() {
            Ok(Some(r)) => Some(Ok(r)),
            Ok(None) => {
                self.done = true;
                None
            }
            Err(e) => {
                self.done = true;
                Some(Err(e))
            }
        }
    }
}
