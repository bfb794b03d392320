//! The savepoint-restore marker: `data_dir/restored`.
//!
//! A restored store is the state of an older checkpoint, and the next start replays the log
//! from there under today's settings. Results of those records went out once already, under
//! whatever settings ran then (and after the savepoint the settings may have changed any
//! number of times), so replay could give their IDs second payloads. A restore therefore
//! starts a new generation of output IDs for every pipeline the restored store holds, and
//! moves the restored outbox's waiting results into it (`plan::restored_outbox`): under
//! their old IDs they could follow newer versions that went out after the savepoint.
//!
//! `cairn savepoint restore` writes this marker *before* it replaces the store, and the next
//! start ([`super::plan`]) reads it, commits the new generations into the store and only
//! then removes it. A crash anywhere in between leaves the marker, so the worst case is one
//! generation more than needed (harmless: every generation's IDs are distinct), never one
//! too few.

use std::io;
use std::path::Path;

use crate::fsio::Durability;

/// File name below `data_dir`.
pub const FILE_NAME: &str = "restored";

/// Leave the marker: the next start puts every stored pipeline in a new generation. `what`
/// says what was restored, for that start's journal line.
pub fn mark(data_dir: &Path, what: &str, sync: &Durability) -> io::Result<()> {
    let text = format!("{what}\n");
    crate::fsio::replace_file_durable(&data_dir.join(FILE_NAME), text.as_bytes(), sync)
}

/// What the marker says, if there is one. Its presence is what counts: content that is not
/// text is shown as well as it can be.
pub(crate) fn read(data_dir: &Path) -> io::Result<Option<String>> {
    match std::fs::read(data_dir.join(FILE_NAME)) {
        Ok(b) => Ok(Some(String::from_utf8_lossy(&b).trim().to_string())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// The new generations are in the store: remove the marker.
pub(crate) fn clear(data_dir: &Path, sync: &Durability) -> io::Result<()> {
    crate::fsio::remove_file_durable(&data_dir.join(FILE_NAME), sync)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_marker_reads_back_until_cleared() {
        let dir = tempfile::tempdir().unwrap();
        let sync = crate::fsio::real();
        assert_eq!(read(dir.path()).unwrap(), None);
        mark(dir.path(), "checkpoint 7 at offset 50", &sync).unwrap();
        assert_eq!(
            read(dir.path()).unwrap().as_deref(),
            Some("checkpoint 7 at offset 50")
        );
        clear(dir.path(), &sync).unwrap();
        assert_eq!(read(dir.path()).unwrap(), None);
    }
}
