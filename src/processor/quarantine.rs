//! The last line of defence against a crash loop: a log record whose processing panics
//! (a bug we have not found) is retried a bounded number of times, each attempt recorded
//! durably, and then set aside as a dead letter with reason `internal`.
//!
//! # Guarantees
//!
//! - **No crash loop.** A record that panics on every attempt stops the agent at most
//!   [`MAX_ATTEMPTS`] times; the start after the last attempt records it as an `internal`
//!   dead letter (without running it through the engine) and goes on.
//! - **Replay decides the same way.** The file is durable input to processing, consulted
//!   by log offset, exactly like the log: a record is either run through the engine or set
//!   aside, and which depends only on the file, never on timing.
//! - **A crash loses no attempt.** An attempt is recorded before the process exits:
//!   written to `quarantine.tmp`, fsynced, renamed over `quarantine`, directory fsynced,
//!   all through the [`crate::fsio`] seam. A crash in between leaves the previous count,
//!   which costs at most one more attempt.
//!
//! # Mechanism
//!
//! `data_dir/quarantine` is a small JSON document: one entry per log offset that panicked,
//! with the attempt count, the topic and the panic message (both cut to a few hundred
//! bytes). Entries below the durable checkpoint's `next_offset` are settled (the record
//! was applied or set aside, and that is committed) and are pruned; with none left the
//! file is removed. Why not exit at the first panic and skip the record at once: a panic
//! may come from the process rather than the record (an allocation failure, a bad page),
//! and those deserve a second try; three costs at most three restarts (systemd's default
//! start limit is five in ten seconds, and the unit waits five seconds between restarts).
//!
//! Tested by `tests/it/field.rs`
//! `a_record_that_panics_is_retried_then_set_aside_as_an_internal_dead_letter` and the unit
//! tests below.

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::fsio::Durability;
use crate::model::Offset;

/// Attempts after which a record is set aside as an `internal` dead letter.
pub(crate) const MAX_ATTEMPTS: u32 = 3;

/// The file's name inside the data directory.
pub const FILE_NAME: &str = "quarantine";

/// Longest topic or panic message kept per entry: the file stays small whatever a sender
/// or a bug puts there.
const MAX_TEXT: usize = 512;

const FORMAT_VERSION: u32 = 1;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    pub offset: Offset,
    pub attempts: u32,
    pub topic: String,
    pub panic: String,
}

#[derive(Debug, Serialize, Deserialize)]
struct Document {
    version: u32,
    entries: Vec<Entry>,
}

/// The failed attempts of records not yet covered by a durable checkpoint.
#[derive(Debug)]
pub struct Quarantine {
    path: PathBuf,
    sync: Durability,
    entries: BTreeMap<Offset, Entry>,
}

impl Quarantine {
    /// Read `data_dir/quarantine` (absent means empty). A file that does not parse cannot
    /// be one we wrote whole; it is moved aside to `quarantine.unreadable` with a warning
    /// (refusing to start over it would be the crash loop this file exists to prevent; the
    /// cost is that its records get their attempts again).
    pub fn open(data_dir: &Path, sync: Durability) -> io::Result<Quarantine> {
        let path = data_dir.join(FILE_NAME);
        let mut q = Quarantine {
            path,
            sync,
            entries: BTreeMap::new(),
        };
        let bytes = match std::fs::read(&q.path) {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(q),
            Err(e) => return Err(e),
        };
        match serde_json::from_slice::<Document>(&bytes) {
            Ok(doc) if doc.version == FORMAT_VERSION => {
                q.entries = doc.entries.into_iter().map(|e| (e.offset, e)).collect();
            }
            parsed => {
                let why = match parsed {
                    Ok(doc) => format!("unknown format version {}", doc.version),
                    Err(e) => e.to_string(),
                };
                let aside = data_dir.join(format!("{FILE_NAME}.unreadable"));
                std::fs::rename(&q.path, &aside)?;
                q.sync.sync_dir(data_dir)?;
                crate::event!(warn, "quarantine_file_unreadable";
                    "quarantine: {} is unreadable ({why}); moved it to {}. Records it named \
                     get their {MAX_ATTEMPTS} attempts again",
                    q.path.display(),
                    aside.display()
                );
            }
        }
        Ok(q)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Failed attempts recorded for the record at `offset`.
    pub fn attempts(&self, offset: Offset) -> u32 {
        self.entries.get(&offset).map_or(0, |e| e.attempts)
    }

    /// Whether the record at `offset` has used all its attempts: set it aside.
    pub(crate) fn exhausted(&self, offset: Offset) -> bool {
        self.attempts(offset) >= MAX_ATTEMPTS
    }

    /// The entry for `offset`, if any (for the dead letter's detail).
    pub fn entry(&self, offset: Offset) -> Option<&Entry> {
        self.entries.get(&offset)
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Durably count one more failed attempt at `offset`; returns the new count. The
    /// caller exits right after: the engine that panicked may be half-way through a change.
    pub(crate) fn record_attempt(
        &mut self,
        offset: Offset,
        topic: &str,
        panic: &str,
    ) -> io::Result<u32> {
        let e = self.entries.entry(offset).or_insert_with(|| Entry {
            offset,
            attempts: 0,
            topic: cut(topic),
            panic: String::new(),
        });
        e.attempts = e.attempts.saturating_add(1);
        e.panic = cut(panic);
        let attempts = e.attempts;
        self.write()?;
        Ok(attempts)
    }

    /// Forget entries below `next_offset` (settled by a durable checkpoint). Writes only
    /// when something was forgotten.
    pub(crate) fn prune_below(&mut self, next_offset: Offset) -> io::Result<()> {
        let before = self.entries.len();
        self.entries = self.entries.split_off(&next_offset);
        if self.entries.len() != before {
            self.write()?;
        }
        Ok(())
    }

    fn write(&self) -> io::Result<()> {
        if self.entries.is_empty() {
            return crate::fsio::remove_file_durable(&self.path, &self.sync);
        }
        let doc = Document {
            version: FORMAT_VERSION,
            entries: self.entries.values().cloned().collect(),
        };
        let mut bytes = serde_json::to_vec_pretty(&doc).map_err(io::Error::other)?;
        bytes.push(b'\n');
        crate::fsio::replace_file_durable(&self.path, &bytes, &self.sync)
    }
}

/// At most [`MAX_TEXT`] bytes, cut on a character boundary.
fn cut(s: &str) -> String {
    let mut end = s.len().min(MAX_TEXT);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fsio::TestSync;

    #[test]
    fn attempts_survive_a_reopen_until_a_checkpoint_settles_them() {
        let dir = tempfile::tempdir().unwrap();
        let seam = TestSync::new();
        let mut q = Quarantine::open(dir.path(), seam.clone()).unwrap();
        assert_eq!(q.attempts(7), 0);
        assert_eq!(q.record_attempt(7, "in/a", "boom").unwrap(), 1);
        assert_eq!(
            seam.file_syncs(),
            1,
            "each attempt is fsynced before the exit"
        );
        let mut q = Quarantine::open(dir.path(), seam.clone()).unwrap();
        assert_eq!(q.record_attempt(7, "in/a", "boom").unwrap(), 2);
        assert_eq!(q.record_attempt(9, "in/b", "bang").unwrap(), 1);
        assert_eq!(q.record_attempt(7, "in/a", "boom").unwrap(), 3);
        let mut q = Quarantine::open(dir.path(), seam.clone()).unwrap();
        assert!(q.exhausted(7) && !q.exhausted(9));
        assert_eq!(q.entry(7).unwrap().topic, "in/a");
        q.prune_below(8).unwrap();
        assert_eq!((q.attempts(7), q.attempts(9)), (0, 1));
        q.prune_below(10).unwrap();
        assert!(!dir.path().join(FILE_NAME).exists(), "empty: no file");
        let q = Quarantine::open(dir.path(), seam).unwrap();
        assert!(q.is_empty());
    }

    #[test]
    fn an_unreadable_file_is_moved_aside_not_a_refusal_to_start() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(FILE_NAME), b"{not json").unwrap();
        let q = Quarantine::open(dir.path(), TestSync::new()).unwrap();
        assert!(q.is_empty());
        assert!(dir.path().join("quarantine.unreadable").exists());
    }

    #[test]
    fn long_topics_and_messages_are_cut_on_a_character_boundary() {
        let dir = tempfile::tempdir().unwrap();
        let mut q = Quarantine::open(dir.path(), TestSync::new()).unwrap();
        let long = "é".repeat(1000);
        q.record_attempt(1, &long, &long).unwrap();
        let e = q.entry(1).unwrap();
        assert!(e.topic.len() <= MAX_TEXT && e.panic.len() <= MAX_TEXT);
        assert!(e.topic.chars().all(|c| c == 'é'));
    }
}
