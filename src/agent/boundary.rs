//! Pipeline changes take effect at a checkpoint boundary (issue 14).
//!
//! Results leave before their checkpoint, so the records after the last checkpoint may
//! already have given results that went out. Replaying those records under a changed
//! pipeline (another `where`, `topics`, `dedup_window`, `max_keys`, `emit`, ...: everything
//! beyond the definition the store checks) could give one of those IDs a second payload. So
//! the pipelines the agent last ran with are kept in `data_dir/pipelines.json` (written
//! durably at every start, before anything is processed), and a start whose config differs
//! from them first replays the log tail under the old pipelines and checkpoints, and only
//! then opens the store under the new ones. A SIGHUP never applies pipeline changes (they
//! need a restart, [`super::reload`]); a clean stop checkpoints everything, so the tail is
//! then empty and the change applies at once. `--reset-pipeline` starts a new generation of
//! output IDs, so no ID of the old lineage is ever computed again.

use std::path::PathBuf;

use crate::config::Config;
use crate::fsio::Durability;
use crate::pipeline::engine::definition;
use crate::pipeline::spec::PipelineSpec;
use crate::store::{Store, StoreError};

/// File name below `data_dir`.
pub(crate) const FILE_NAME: &str = "pipelines.json";

fn path(cfg: &Config) -> PathBuf {
    cfg.storage.data_dir.join(FILE_NAME)
}

/// The pipelines the last start ran with, if the file is there and readable (a file that
/// does not read is reported and ignored: the worst it costs is this safeguard).
pub(crate) fn last_run(cfg: &Config) -> Option<Vec<PipelineSpec>> {
    let p = path(cfg);
    let text = match std::fs::read(&p) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => {
            log::warn!(
                "{}: {e}; pipeline changes apply without settling the log tail first",
                p.display()
            );
            return None;
        }
    };
    match serde_json::from_slice(&text) {
        Ok(specs) => Some(specs),
        Err(e) => {
            log::warn!(
                "{}: {e}; pipeline changes apply without settling the log tail first",
                p.display()
            );
            None
        }
    }
}

/// Record the pipelines this start runs with (tmp, fsync, rename, fsync dir).
pub(crate) fn record(cfg: &Config, sync: &Durability) -> std::io::Result<()> {
    let text = serde_json::to_vec_pretty(&cfg.pipelines).expect("plain data");
    crate::fsio::replace_file_durable(&path(cfg), &text, sync)
}

/// Whether the old pipelines must settle the tail first: they differ from the config, and
/// the store holds exactly their definitions (it is the store they ran on: not one restored
/// or moved aside since, which the start handles as before). A pipeline the config adds
/// therefore starts at that checkpoint boundary, like every other change.
pub(crate) fn must_settle(
    store: &Store,
    old: &[PipelineSpec],
    new: &[PipelineSpec],
) -> Result<bool, StoreError> {
    if old == new || old.is_empty() {
        return Ok(false);
    }
    let progress = store.progress()?;
    Ok(old.iter().all(|spec| {
        progress
            .pipelines
            .iter()
            .any(|p| p.name == spec.name && p.definition == definition(spec))
    }))
}

/// For the journal: the names of the pipelines that differ.
pub(crate) fn changed_names(old: &[PipelineSpec], new: &[PipelineSpec]) -> String {
    let mut names: Vec<&str> = Vec::new();
    for s in old {
        if !new.contains(s) {
            names.push(&s.name);
        }
    }
    for s in new {
        if !old.iter().any(|o| o.name == s.name) {
            names.push(&s.name);
        }
    }
    names.sort();
    names.dedup();
    names.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::processor::Processor;

    fn spec(filter: &str) -> PipelineSpec {
        crate::config::pipeline_from_toml(&format!(
            "name = \"sums\"\ntopics = [\"in/#\"]\nformat = \"json\"\nevent_id = \"/id\"\n\
             key = \"/k\"\nvalue = \"/v\"\naggregate = \"sum\"\noutput_topic = \"s/{{key}}\"\n{filter}"
        ))
        .unwrap()
    }

    #[test]
    fn only_a_changed_config_over_the_store_its_pipelines_wrote_settles_the_tail() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), 1 << 20, crate::fsio::real()).unwrap();
        let (old, new) = (vec![spec("")], vec![spec("where = '/v > 2'")]);
        // An empty store wrote none of the old definitions: a restored or new store.
        assert!(!must_settle(&store, &old, &new).unwrap());
        let store = Processor::open(store, old.clone()).unwrap().into_store();
        assert!(must_settle(&store, &old, &new).unwrap());
        assert!(!must_settle(&store, &old, &old).unwrap(), "unchanged");
        assert!(
            !must_settle(&store, &[], &new).unwrap(),
            "no record of a last run"
        );
        assert_eq!(changed_names(&old, &new), "sums");
        let mut other = spec("");
        other.name = "other".into();
        assert_eq!(changed_names(&old, &[old[0].clone(), other]), "other");
    }
}
