//! What a power cut may forget, kept as plain data with no IO.
//!
//! Guarantee modelled: after a cut, a file holds the bytes and size it had at its last
//! `fsync`/`fdatasync` plus some selection of the writes made since; a directory holds the
//! entries it had at its last `fsync` plus some selection of the entry changes made since.
//! Nothing else is promised, exactly like POSIX without a journalling file system's extras.
//!
//! Mechanism: the backing directory always holds the newest contents (so reads, readdir and
//! getattr are plain passthrough). Per dirty file we keep the pre-images of the durable bytes
//! the unsynced changes overwrote, the durable size, and a redo log of the unsynced changes.
//! Per dirty directory we keep a log of its unsynced entry changes, which can be undone by
//! name because removed or replaced entries are parked in an attic instead of being deleted.

use std::collections::BTreeMap;
use std::ffi::OsString;

/// One unsynced change to a file's contents or size, in the order the kernel sent it.
#[derive(Debug, Clone)]
pub enum FileOp {
    Write { offset: u64, data: Vec<u8> },
    SetLen(u64),
}

/// Everything needed to rebuild a file from its last sync point.
#[derive(Debug)]
pub struct FileLog {
    /// Order of first dirtying, so a seed picks the same fate for the same history.
    pub seq: u64,
    pub durable_size: u64,
    /// Original bytes of `[0, durable_size)` overwritten since the sync, non-overlapping.
    pub saved: BTreeMap<u64, Vec<u8>>,
    pub ops: Vec<FileOp>,
}

impl FileLog {
    pub fn new(seq: u64, durable_size: u64) -> Self {
        FileLog {
            seq,
            durable_size,
            saved: BTreeMap::new(),
            ops: Vec::new(),
        }
    }

    /// Sub-ranges of `[start, end)` (clamped to the durable size) whose original bytes are not
    /// saved yet. The caller reads them from the backing file *before* modifying it: a byte
    /// below `durable_size` that is not saved has not been touched since the sync.
    pub fn unsaved_ranges(&self, start: u64, end: u64) -> Vec<(u64, u64)> {
        let end = end.min(self.durable_size);
        let mut gaps = Vec::new();
        if start >= end {
            return gaps;
        }
        let mut cursor = start;
        // A saved range starting before `start` may still cover it.
        let first = self
            .saved
            .range(..=start)
            .next_back()
            .map(|(k, _)| *k)
            .unwrap_or(start);
        for (&off, bytes) in self.saved.range(first..end) {
            let range_end = off + bytes.len() as u64;
            if range_end <= cursor {
                continue;
            }
            if off > cursor {
                gaps.push((cursor, off));
            }
            cursor = cursor.max(range_end);
            if cursor >= end {
                break;
            }
        }
        if cursor < end {
            gaps.push((cursor, end));
        }
        gaps
    }

    /// Memory this log holds: redo data plus saved pre-images.
    pub fn held_bytes(&self) -> u64 {
        self.unsynced_bytes() + self.saved.values().map(|v| v.len() as u64).sum::<u64>()
    }

    pub fn unsynced_bytes(&self) -> u64 {
        self.ops
            .iter()
            .map(|op| match op {
                FileOp::Write { data, .. } => data.len() as u64,
                FileOp::SetLen(_) => 0,
            })
            .sum()
    }
}

/// One unsynced change to a directory's entry set. Inode numbers are the FUSE ones.
#[derive(Debug, Clone)]
pub enum DirOp {
    /// `name` now refers to `ino` (create, mkdir, the target half of a cross-directory
    /// rename); `replaced` is what `name` referred to before, now parked in the attic.
    Link {
        name: OsString,
        ino: u64,
        replaced: Option<u64>,
    },
    /// `name` (which referred to `ino`) is gone: unlink, rmdir, source half of a rename.
    Unlink { name: OsString, ino: u64 },
    /// Rename inside one directory: a single entry change, kept or dropped as a whole.
    Rename {
        from: OsString,
        to: OsString,
        ino: u64,
        replaced: Option<u64>,
    },
}

impl DirOp {
    /// Inodes this op could bring back if it were undone.
    pub fn referenced(&self) -> impl Iterator<Item = u64> {
        let (a, b) = match self {
            DirOp::Link { ino, replaced, .. } | DirOp::Rename { ino, replaced, .. } => {
                (Some(*ino), *replaced)
            }
            DirOp::Unlink { ino, .. } => (Some(*ino), None),
        };
        a.into_iter().chain(b)
    }
}

#[derive(Debug)]
pub struct DirLog {
    pub seq: u64,
    pub ops: Vec<DirOp>,
}

pub type Entries = BTreeMap<OsString, u64>;

/// The entry set at the last sync: the current set with every logged op undone, newest first.
pub fn durable_entries(current: &Entries, ops: &[DirOp]) -> Entries {
    let mut entries = current.clone();
    for op in ops.iter().rev() {
        match op {
            DirOp::Link { name, replaced, .. } => {
                entries.remove(name);
                if let Some(old) = replaced {
                    entries.insert(name.clone(), *old);
                }
            }
            DirOp::Unlink { name, ino } => {
                entries.insert(name.clone(), *ino);
            }
            DirOp::Rename {
                from,
                to,
                ino,
                replaced,
            } => {
                entries.remove(to);
                if let Some(old) = replaced {
                    entries.insert(to.clone(), *old);
                }
                entries.insert(from.clone(), *ino);
            }
        }
    }
    entries
}

/// Replays the kept ops, in order, over the durable entry set.
pub fn replay_entries(durable: &Entries, ops: &[DirOp], keep: &[Fate]) -> Entries {
    let mut entries = durable.clone();
    for (op, fate) in ops.iter().zip(keep) {
        if matches!(fate, Fate::Drop) {
            continue;
        }
        match op {
            DirOp::Link { name, ino, .. } => {
                entries.insert(name.clone(), *ino);
            }
            DirOp::Unlink { name, .. } => {
                entries.remove(name);
            }
            DirOp::Rename { from, to, ino, .. } => {
                entries.remove(from);
                entries.insert(to.clone(), *ino);
            }
        }
    }
    entries
}

/// What a cut does to one unsynced op.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fate {
    Keep,
    Drop,
    /// Only the first `n` bytes of a write reached the platter.
    Torn(usize),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CutMode {
    All,
    Prefix,
    Random,
}

/// splitmix64: tiny, well-mixed, and ours, so a seed means the same thing forever.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform-enough integer in `[0, n)`; `n` must be non-zero.
    pub fn below(&mut self, n: u64) -> u64 {
        assert!(n > 0, "Rng::below(0)");
        self.next_u64() % n
    }
}

/// Decides the fate of each of `lens.len()` ops; `lens[i]` is the byte length of a write, or
/// `None` for ops that cannot tear (size changes, directory ops).
pub fn choose(mode: CutMode, tear: bool, lens: &[Option<usize>], rng: &mut Rng) -> Vec<Fate> {
    let n = lens.len();
    let torn = |rng: &mut Rng, len: Option<usize>| match len {
        Some(len) if tear && len > 0 => Fate::Torn(rng.below(len as u64) as usize),
        _ => Fate::Drop,
    };
    match mode {
        CutMode::All => vec![Fate::Drop; n],
        CutMode::Prefix => {
            let k = rng.below(n as u64 + 1) as usize;
            let mut fates = vec![Fate::Keep; k];
            if k < n {
                fates.push(torn(rng, lens[k]));
            }
            fates.resize(n, Fate::Drop);
            fates
        }
        CutMode::Random => lens
            .iter()
            .map(|len| {
                if rng.next_u64() & 1 == 1 {
                    Fate::Keep
                } else {
                    torn(rng, *len)
                }
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unsaved_ranges_skip_saved_bytes_and_stop_at_durable_size() {
        let mut log = FileLog::new(0, 100);
        assert_eq!(log.unsaved_ranges(10, 20), vec![(10, 20)]);
        log.saved.insert(5, vec![0; 10]);
        log.saved.insert(30, vec![0; 5]);
        assert_eq!(
            log.unsaved_ranges(0, 200),
            vec![(0, 5), (15, 30), (35, 100)]
        );
        assert_eq!(log.unsaved_ranges(7, 12), vec![]);
        assert_eq!(log.unsaved_ranges(120, 130), vec![]);
    }

    #[test]
    fn undoing_then_replaying_every_op_gives_back_the_current_entries() {
        let name = |s: &str| OsString::from(s);
        let ops = vec![
            DirOp::Link {
                name: name("a"),
                ino: 5,
                replaced: None,
            },
            DirOp::Rename {
                from: name("a"),
                to: name("b"),
                ino: 5,
                replaced: Some(4),
            },
            DirOp::Unlink {
                name: name("c"),
                ino: 6,
            },
        ];
        let current: Entries = [(name("b"), 5)].into_iter().collect();
        let durable = durable_entries(&current, &ops);
        let expected: Entries = [(name("b"), 4), (name("c"), 6)].into_iter().collect();
        assert_eq!(durable, expected);
        assert_eq!(replay_entries(&durable, &ops, &[Fate::Keep; 3]), current);
    }

    #[test]
    fn prefix_cut_keeps_a_prefix_and_tears_only_the_boundary() {
        for seed in 0..50 {
            let fates = choose(CutMode::Prefix, true, &[Some(8); 6], &mut Rng::new(seed));
            let k = fates.iter().take_while(|f| **f == Fate::Keep).count();
            assert!(
                fates[k..].iter().skip(1).all(|f| *f == Fate::Drop),
                "{fates:?}"
            );
        }
    }
}
