//! `cairn validate`: check the configuration; print every problem (exit 2) or a summary and
//! what the data directory would make of it (exit 0).

use std::path::Path;

use super::failure::Failure;
use crate::config::{self, Config, ConfigError};
use crate::store::Store;

pub(crate) fn run(path: &Path) -> Result<(), Failure> {
    match config::load(path) {
        Ok(cfg) => {
            // As `run` would be: the data directory's owner (see `owner.rs`), so that the
            // files it checks are read as the service reads them.
            super::owner::become_data_dir_owner(&cfg)?;
            println!("{}", config::summary(&cfg));
            let warnings = cfg.warnings();
            for w in warnings
                .iter()
                .chain(&super::checks::security_warnings(&cfg))
            {
                println!("{}: warning: {w}", cfg.source.display());
            }
            for line in data_dir_report(&cfg) {
                println!("{line}");
            }
            Ok(())
        }
        Err(ConfigError::Invalid { problems, file }) => {
            for p in &problems {
                println!("{p}");
            }
            Err(Failure::usage(format!(
                "{file}: {} problem(s)",
                problems.len()
            )))
        }
        Err(e) => Err(Failure::usage(e)),
    }
}

/// What `validate` says about the data directory, when there is one: stored pipelines the
/// config no longer names, and definitions a start would refuse. A report, not a problem:
/// the config itself is valid, and `run --reset-pipeline` is the way on.
fn data_dir_report(cfg: &Config) -> Vec<String> {
    if let Some(problem) = super::owner::data_dir_problem(&cfg.storage.data_dir) {
        return vec![format!("data_dir: `cairn run` will refuse: {problem}")];
    }
    let dir = cfg.store_dir();
    if !dir.join("db").exists() {
        return Vec::new();
    }
    let store = match Store::open(&dir, cfg.storage.cache_size, crate::fsio::real()) {
        Ok(s) => s,
        Err(crate::store::StoreError::Locked { .. }) => {
            return vec![format!(
                "data_dir: the agent holds the store at {}; its pipelines were not compared \
                 (`cairn status` lists them)",
                dir.display()
            )];
        }
        Err(e) => return vec![format!("data_dir: {e}")],
    };
    match crate::processor::audit(&store, &cfg.pipelines) {
        Ok((unconfigured, refusals)) => {
            let list = super::status::unconfigured_json(&unconfigured);
            let mut lines: Vec<String> = list
                .as_array()
                .into_iter()
                .flatten()
                .map(|u| format!("data_dir: {}", super::status::unconfigured_line(u)))
                .collect();
            for r in refusals {
                lines.push(format!("data_dir: `cairn run` will refuse: {r}"));
            }
            lines
        }
        Err(e) => vec![format!("data_dir: {e}")],
    }
}
