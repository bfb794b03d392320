//! `cairn savepoint {create,list,restore}`: the operator's side of savepoints (the format
//! and the guarantees are in `store::savepoint`).
//!
//! `create` and `restore` need the store to themselves, so they refuse while the agent runs
//! (the store lock says so); the running agent takes savepoints itself when
//! `[savepoint] interval` is set. `restore` refuses a savepoint the log can no longer
//! complete: the next start replays the log from the savepoint's `next_offset`.

use std::io::Write;
use std::path::PathBuf;

use clap::Subcommand;
use serde_json::json;

use super::failure::Failure;
use crate::config::Config;
use crate::store::{self, SavepointInfo, Store, StoreError};

#[derive(Subcommand, Debug)]
pub(crate) enum SavepointCommand {
    /// Write a savepoint of the last checkpoint (only while the agent is stopped).
    Create {
        #[arg(long)]
        json: bool,
    },
    /// Savepoints in the data directory, oldest first (in the order they were taken).
    List {
        #[arg(long)]
        json: bool,
    },
    /// Rebuild the store from a savepoint; the previous store is moved aside, never deleted.
    Restore {
        /// The savepoint file (`cairn savepoint list` shows them); or `--latest`.
        #[arg(conflicts_with = "latest")]
        file: Option<PathBuf>,
        /// The newest savepoint in the data directory (the last taken, whatever its checkpoint ID).
        #[arg(long)]
        latest: bool,
        #[arg(long)]
        json: bool,
    },
}

fn line(s: &str) -> Result<(), Failure> {
    writeln!(std::io::stdout().lock(), "{s}").map_err(|_| Failure {
        code: super::failure::EXIT_OK,
        message: String::new(),
    })
}

fn info_json(i: &SavepointInfo) -> serde_json::Value {
    json!({"seq": i.seq, "checkpoint_id": i.checkpoint_id, "next_offset": i.next_offset, "entries": i.entries,
           "bytes": i.bytes, "created_at_ms": i.created_at_ms, "file": i.path.display().to_string()})
}

fn info_line(i: &SavepointInfo) -> String {
    format!(
        "checkpoint {}\tnext_offset {}\t{} bytes\t{} entries\t{}",
        i.checkpoint_id,
        i.next_offset,
        i.bytes,
        i.entries,
        i.path.display()
    )
}

fn store_failure(e: StoreError) -> Failure {
    match e {
        StoreError::Locked { .. } => Failure::runtime(format!(
            "{e}: stop the agent first (with `[savepoint] interval` set it takes savepoints itself)"
        )),
        e => Failure::runtime(e),
    }
}

pub(crate) fn run(cfg: &Config, cmd: SavepointCommand) -> Result<(), Failure> {
    match cmd {
        SavepointCommand::Create { json } => create(cfg, json),
        SavepointCommand::List { json } => list(cfg, json),
        SavepointCommand::Restore { file, latest, json } => restore(cfg, file, latest, json),
    }
}

fn create(cfg: &Config, json: bool) -> Result<(), Failure> {
    let dir = cfg.store_dir();
    if !dir.join("db").exists() {
        return Err(Failure::runtime(format!(
            "no store at {} yet: nothing to save",
            dir.display()
        )));
    }
    let sync = crate::fsio::real();
    let store = Store::open(&dir, cfg.storage.cache_size, sync.clone()).map_err(store_failure)?;
    // Drawn at once (the callback comes every few thousand entries).
    crate::logging::progress::step(
        "writing the savepoint",
        0,
        None,
        crate::logging::progress::Unit::Entries,
    );
    let info = store
        .write_savepoint_with(&cfg.savepoint_dir(), &sync, &mut |n| {
            crate::logging::progress::step(
                "writing the savepoint",
                n,
                None,
                crate::logging::progress::Unit::Entries,
            )
        })
        .map_err(store_failure)?;
    crate::logging::progress::done();
    store::prune_savepoints(&cfg.savepoint_dir(), cfg.savepoint.keep).map_err(store_failure)?;
    if json {
        line(&info_json(&info).to_string())
    } else {
        line(&format!("wrote {}", info_line(&info)))
    }
}

fn list(cfg: &Config, json: bool) -> Result<(), Failure> {
    for i in store::list_savepoints(&cfg.savepoint_dir()).map_err(store_failure)? {
        if json {
            line(&info_json(&i).to_string())?;
        } else {
            line(&info_line(&i))?;
        }
    }
    Ok(())
}

fn restore(cfg: &Config, file: Option<PathBuf>, latest: bool, json: bool) -> Result<(), Failure> {
    let file = match (file, latest) {
        (Some(f), _) => f,
        (None, false) => {
            return Err(Failure::usage(format!(
                "savepoint restore needs a savepoint: a FILE (`cairn savepoint list` shows those \
                 in {}), or --latest for the newest",
                cfg.savepoint_dir().display()
            )));
        }
        (None, true) => store::list_savepoints(&cfg.savepoint_dir())
            .map_err(store_failure)?
            .pop()
            .map(|i| i.path)
            .ok_or_else(|| {
                Failure::runtime(format!("no savepoint in {}", cfg.savepoint_dir().display()))
            })?,
    };
    let header = store::verify_savepoint(&file).map_err(store_failure)?;
    // The restored checkpoint is only half of the state: the log must hold every record
    // from its next_offset on, or the next start would refuse (or state would be lost).
    let log_dir = cfg.log_dir();
    let (first, next) = if log_dir.is_dir() {
        let r = crate::log::verify_dir(&log_dir).map_err(Failure::runtime)?;
        (r.first_offset, r.next_offset)
    } else {
        (0, 0)
    };
    if header.next_offset < first || header.next_offset > next {
        return Err(Failure::runtime(format!(
            "cannot restore {}: it needs the log from offset {} on, but the log holds offsets \
             [{first}, {next}); choose a savepoint within that range (`cairn savepoint list`)",
            file.display(),
            header.next_offset
        )));
    }
    // Before the store is replaced: the next start puts every restored pipeline in a new
    // generation of output IDs (`processor::restored`), so replay under settings changed
    // since the savepoint never gives an ID that went out a second payload.
    let what = format!(
        "{}: checkpoint {}, log offset {}",
        file.display(),
        header.checkpoint_id,
        header.next_offset
    );
    crate::processor::restored::mark(&cfg.storage.data_dir, &what, &crate::fsio::real()).map_err(
        |e| {
            Failure::runtime(format!(
                "cannot write {}: {e}",
                cfg.storage
                    .data_dir
                    .join(crate::processor::restored::FILE_NAME)
                    .display()
            ))
        },
    )?;
    let info = store::restore_savepoint(
        &file,
        &cfg.store_dir(),
        cfg.storage.cache_size,
        crate::fsio::real(),
    )
    .map_err(store_failure)?;
    crate::logging::progress::done();
    if json {
        line(&info_json(&info).to_string())
    } else {
        line(&format!(
            "restored {}; the next start replays the log from offset {} (log ends at {next})",
            info_line(&info),
            info.next_offset
        ))
    }
}
