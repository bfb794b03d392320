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
            if let Some(note) = packet_size_note(cfg.log.max_payload) {
                println!("{note}");
            }
            let (lines, refused) = data_dir_report(&cfg);
            for line in lines {
                println!("{line}");
            }
            // What `run` refuses as a config error (exit 2), `validate` refuses alike: a
            // pipeline definition that would misread the state stored for it.
            if refused > 0 {
                return Err(Failure::usage(format!(
                    "{}: `cairn run` would refuse {refused} pipeline definition(s) (above); \
                     restore the old definition, or reset with `cairn run --reset-pipeline NAME`",
                    cfg.source.display()
                )));
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
/// config no longer names, and definitions a start would refuse (counted: those make
/// `validate` fail as they make `run` fail, with exit 2). A data directory with the wrong
/// owner or mode is reported only: it is the box's problem, not the config's.
fn data_dir_report(cfg: &Config) -> (Vec<String>, usize) {
    if let Some(problem) = super::owner::data_dir_problem(&cfg.storage.data_dir) {
        return (
            vec![format!("data_dir: `cairn run` will refuse: {problem}")],
            0,
        );
    }
    let dir = cfg.store_dir();
    if !dir.join("db").exists() {
        return (Vec::new(), 0);
    }
    let store = match Store::open(&dir, cfg.storage.cache_size, crate::fsio::real()) {
        Ok(s) => s,
        Err(crate::store::StoreError::Locked { .. }) => {
            return (
                vec![format!(
                    "data_dir: the agent holds the store at {}; its pipelines were not compared \
                     (`cairn status` lists them)",
                    dir.display()
                )],
                0,
            );
        }
        Err(e) => return (vec![format!("data_dir: {e}")], 0),
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
            let refused = refusals.len();
            for r in refusals {
                lines.push(format!("data_dir: `cairn run` will refuse: {r}"));
            }
            (lines, refused)
        }
        Err(e) => (vec![format!("data_dir: {e}")], 0),
    }
}

/// What the shipped `config/mosquitto.conf` adds to `log.max_payload` for `max_packet_size`:
/// the longest topic MQTT allows (65,535 bytes and its 2-byte length) and 1,023 bytes for
/// the fixed header, the packet id and an MQTT 5 sender's properties.
const PACKET_OVERHEAD: u64 = 65_537 + 1_023;
/// The `log.max_payload` the snippet's `max_packet_size 328704` is worked out for.
const SNIPPET_MAX_PAYLOAD: u64 = 256 * 1024;

/// With another `log.max_payload` than the snippet's, the broker's `max_packet_size` to use
/// instead: it is what bounds the agent's memory for oversized inputs (issue 26).
fn packet_size_note(max_payload: u64) -> Option<String> {
    (max_payload != SNIPPET_MAX_PAYLOAD).then(|| {
        format!(
            "note: log.max_payload is {max_payload} bytes: set mosquitto's max_packet_size to \
             {} (config/mosquitto.conf has {} for the default 256KiB); the broker then refuses \
             larger inputs, which the agent would otherwise read whole before refusing them",
            max_payload.saturating_add(PACKET_OVERHEAD),
            SNIPPET_MAX_PAYLOAD + PACKET_OVERHEAD
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The figure in the shipped snippet is the one this file works out.
    #[test]
    fn the_snippets_max_packet_size_is_max_payload_plus_the_overhead() {
        let snippet = include_str!("../../config/mosquitto.conf");
        let line = format!(
            "\nmax_packet_size {}\n",
            SNIPPET_MAX_PAYLOAD + PACKET_OVERHEAD
        );
        assert!(
            snippet.contains(&line),
            "no `{}` in the snippet",
            line.trim()
        );
        assert_eq!(packet_size_note(256 * 1024), None);
        let note = packet_size_note(64 * 1024).unwrap();
        assert!(
            note.contains("set mosquitto's max_packet_size to 132096"),
            "{note}"
        );
    }
}
