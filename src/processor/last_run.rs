//! The pipelines the last run started with: `data_dir/pipelines.json`.
//!
//! Results leave before their checkpoint, so the records after the last checkpoint may
//! already have given results that went out. Replaying those records under a changed
//! pipeline (another `where`, `topics`, `dedup_window`, `max_keys`, `emit`, ...: everything
//! beyond the definition the store checks) could give one of those IDs a second payload. So
//! every start records the pipelines it runs with here (durably, before anything is
//! processed), and the next start compares the config with them: what differs is settled
//! first, or put in a new generation (the decision is [`super::plan`]'s).
//!
//! A file that exists but does not read stops the start (issue 26): without it the start
//! cannot tell what to settle, and going on would risk exactly the second payloads the file
//! is there to prevent.

use std::path::{Path, PathBuf};

use crate::fsio::Durability;
use crate::pipeline::spec::PipelineSpec;

/// File name below `data_dir`.
pub(crate) const FILE_NAME: &str = "pipelines.json";

/// What the last run left about its pipelines.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum LastRun {
    /// No record: a new data directory, or one from before the record existed.
    Unknown,
    /// The pipelines it started with, in config order.
    Ran(Vec<PipelineSpec>),
    /// The file is there but does not read: the start must not guess.
    Unreadable { file: PathBuf, why: String },
}

/// Read `data_dir/pipelines.json`.
pub(crate) fn read(data_dir: &Path) -> LastRun {
    let file = data_dir.join(FILE_NAME);
    let unreadable = |why: String| LastRun::Unreadable {
        file: file.clone(),
        why,
    };
    let text = match std::fs::read(&file) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return LastRun::Unknown,
        Err(e) => return unreadable(e.to_string()),
    };
    match serde_json::from_slice(&text) {
        Ok(specs) => LastRun::Ran(specs),
        Err(e) => unreadable(e.to_string()),
    }
}

/// Record the pipelines this start runs with (tmp, fsync, rename, fsync dir).
pub(crate) fn record(
    data_dir: &Path,
    specs: &[PipelineSpec],
    sync: &Durability,
) -> std::io::Result<()> {
    let text = serde_json::to_vec_pretty(specs).map_err(std::io::Error::other)?;
    crate::fsio::replace_file_durable(&data_dir.join(FILE_NAME), &text, sync)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_file_is_unknown_a_damaged_one_unreadable_and_a_record_reads_back() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(read(dir.path()), LastRun::Unknown);
        std::fs::write(dir.path().join(FILE_NAME), b"[{\"name\": ").unwrap();
        assert!(
            matches!(read(dir.path()), LastRun::Unreadable { ref why, .. } if why.contains("EOF")),
            "{:?}",
            read(dir.path())
        );
        record(dir.path(), &[], &crate::fsio::real()).unwrap();
        assert_eq!(read(dir.path()), LastRun::Ran(vec![]));
    }
}
