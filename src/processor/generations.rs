//! Output-ID generations: `data_dir/generations`, beside `log/` and `store/`.
//!
//! A pipeline's output IDs are `name/key[/window]/version`. Versions count changes of one
//! lineage of state, so two lineages can give the same ID two payloads: a reset drops the
//! state and starts again; moving the store aside and rebuilding from the log replays old
//! records under today's definition from version 1; a pipeline dropped and added again
//! starts empty. Each new lineage therefore gets a new generation number, and IDs of
//! generation 2 and later say which (`name@2/key/version`).
//!
//! Why a file, and not the store or a hash of the definition:
//! - The store cannot remember it: moving the store aside is one of the events that must
//!   start a new generation. This file stays where it is when the store is replaced.
//! - A tag derived from the definition would not change on a reset or a rebuild under the
//!   same definition, yet both restart versions (a rebuild from 1, a reset above the old
//!   highest, which a later rebuild no longer knows) and can give an ID a second payload.
//!
//! The file holds, per pipeline, the highest generation ever started. The store's progress
//! holds the generation its state belongs to, and is what the engine uses; the file only
//! decides the number of the next new one. Order at start: the store records the new
//! generation first, then this file is replaced (tmp, fsync, rename, fsync dir). A crash
//! between the two leaves the file one behind a store that emitted nothing yet in the new
//! generation; the next start raises the file to the store's figure. Losing the file and
//! the store together loses the count: keep them in the same data directory (README).

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};

use crate::fsio::Durability;

/// File name below `data_dir`.
pub const FILE_NAME: &str = "generations";

/// The per-pipeline highest generations, loaded from and saved to one file.
#[derive(Debug, Default, Clone)]
pub(crate) struct Generations {
    path: Option<PathBuf>,
    highest: BTreeMap<String, u32>,
    dirty: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum GenerationsError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error(
        "{path}:{line}: not `NAME GENERATION` ({text:?}). This file numbers the generations of \
         output IDs; fix the line, or if the file is lost, restore it from a backup of the data \
         directory: without it a rebuilt store could reuse output IDs"
    )]
    Parse {
        path: PathBuf,
        line: usize,
        text: String,
    },
}

impl Generations {
    /// Kept only in memory (tests and tools that have no data directory).
    pub(crate) fn in_memory() -> Generations {
        Generations::default()
    }

    /// Read the file; a missing file is an empty registry (a new data directory, or one from
    /// before generations existed, whose results are all generation 1).
    pub fn load(path: &Path) -> Result<Generations, GenerationsError> {
        let mut g = Generations {
            path: Some(path.to_path_buf()),
            ..Default::default()
        };
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(g),
            Err(source) => {
                return Err(GenerationsError::Io {
                    path: path.to_path_buf(),
                    source,
                });
            }
        };
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let bad = || GenerationsError::Parse {
                path: path.to_path_buf(),
                line: i + 1,
                text: line.to_string(),
            };
            let mut parts = line.split_whitespace();
            let (Some(name), Some(n), None) = (parts.next(), parts.next(), parts.next()) else {
                return Err(bad());
            };
            let n: u32 = n.parse().map_err(|_| bad())?;
            if n == 0 {
                return Err(bad());
            }
            let e = g.highest.entry(name.to_string()).or_default();
            *e = (*e).max(n);
        }
        Ok(g)
    }

    /// The highest generation ever started for `name`, if any.
    pub fn highest(&self, name: &str) -> Option<u32> {
        self.highest.get(name).copied()
    }

    /// The store holds state of `name` in `generation`: never number a new one at or below.
    pub(crate) fn observe(&mut self, name: &str, generation: u32) {
        let generation = generation.max(1);
        let e = self.highest.entry(name.to_string()).or_default();
        if *e < generation {
            *e = generation;
            self.dirty = true;
        }
    }

    /// Start a new lineage of `name`: 1 if the pipeline was never seen, else one above every
    /// generation it had (and above `at_least`, what the store knows). Saturates at
    /// `u32::MAX`, four billion resets away.
    pub(crate) fn start_new(&mut self, name: &str, at_least: u32) -> u32 {
        let next = self.next(name, at_least);
        self.observe(name, next);
        next
    }

    /// The generation [`Generations::start_new`] would start, without starting it.
    pub(crate) fn next(&self, name: &str, at_least: u32) -> u32 {
        match self.highest(name) {
            None if at_least == 0 => 1,
            h => h.unwrap_or(0).max(at_least).saturating_add(1),
        }
    }

    /// Replace the file if anything changed, durably (tmp, fsync, rename, fsync dir).
    pub fn save(&mut self, sync: &Durability) -> Result<(), GenerationsError> {
        let Some(path) = self.path.clone().filter(|_| self.dirty) else {
            return Ok(());
        };
        let mut text = String::from(
            "# Generations of output IDs, per pipeline: the highest started (see README,\n\
             # \"Consumers\"). Written by cairn; keep it with the data directory.\n",
        );
        for (name, n) in &self.highest {
            text.push_str(&format!("{name} {n}\n"));
        }
        crate::fsio::replace_file_durable(&path, text.as_bytes(), sync)
            .map_err(|source| GenerationsError::Io { path, source })?;
        self.dirty = false;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_generations_count_up_from_what_the_file_and_the_store_know() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(FILE_NAME);
        let mut g = Generations::load(&path).unwrap();
        assert_eq!(g.start_new("a", 0), 1, "a pipeline never seen starts at 1");
        g.observe("b", 4);
        g.save(&crate::fsio::real()).unwrap();
        let mut g = Generations::load(&path).unwrap();
        assert_eq!((g.highest("a"), g.highest("b")), (Some(1), Some(4)));
        assert_eq!(g.start_new("a", 0), 2, "seen before: a new lineage");
        assert_eq!(g.start_new("b", 7), 8, "the store knew a higher one");
        assert_eq!(
            g.start_new("c", 3),
            4,
            "the file was lost, the store was not"
        );
    }

    #[test]
    fn a_damaged_file_is_refused_with_its_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(FILE_NAME);
        std::fs::write(&path, "# ok\na 2\nb two\n").unwrap();
        let err = Generations::load(&path).unwrap_err().to_string();
        assert!(err.contains(":3:") && err.contains("b two"), "{err}");
    }
}
