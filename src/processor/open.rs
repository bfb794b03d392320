//! The start plan carried out (the decision is [`super::plan`]'s): read what the last run
//! left, decide, settle the log tail under the last run's pipelines if the plan says so,
//! commit the plan's changes to the progress record in one transaction, then the generations
//! file, then remove a restore marker, then record the pipelines this run starts with. Each
//! step only after the one before is durable, so a crash between two of them leaves a start
//! that decides the same again (or, at worst, one generation more than needed).

use std::path::Path;

use super::generations::{self, Generations};
use super::last_run;
use super::plan::{self, Note, Plan};
use super::quarantine::{self, Quarantine};
use super::restored;
use super::{ProcessError, Processor};
use crate::fsio::Durability;
use crate::pipeline::spec::PipelineSpec;
use crate::store::Store;

/// What a start reads besides the store and the config's pipelines.
pub(crate) struct StartFrom<'a> {
    /// Where `generations`, `pipelines.json`, `quarantine` and the restore marker are.
    pub(crate) data_dir: &'a Path,
    pub(crate) sync: &'a Durability,
    /// `--reset-pipeline` names.
    pub(crate) reset: &'a [String],
}

/// Put the plan's notes in the journal.
pub(super) fn note(notes: &[Note]) {
    for n in notes {
        log::log!(n.level, "{}", n.text);
    }
}

/// Commit `plan` to `store` (one transaction, then the generations file) and open the
/// processor under `specs`.
pub(super) fn commit(
    store: Store,
    specs: Vec<PipelineSpec>,
    mut plan: Plan,
) -> Result<Processor, ProcessError> {
    let progress = plan.apply(&store.progress()?, &specs);
    if plan.changes_progress() {
        let wiped: Vec<&str> = plan.wipe.iter().map(String::as_str).collect();
        let done = store.commit_start(&wiped, &progress, &plan.outbox)?;
        if done.moved + done.dropped > 0 {
            crate::event!(warn, "restored_outbox_moved";
                "savepoint restored: {} waiting results of the restored outbox go out in \
                 their pipeline's new generation, not under the IDs of the generation the \
                 restore ended (newer versions of those may have gone out since the \
                 savepoint); {} of pipelines reset or dropped at this start were dropped",
                done.moved,
                done.dropped
            );
        }
        if let Some(why) = done.unmoved {
            crate::event!(warn, "restored_outbox_unmoved";
                "savepoint restored: some waiting results of the restored outbox stay in their \
                 old generation ({why}); a consumer keeping the highest (generation, version) \
                 per key is not affected"
            );
        }
    }
    plan.generations.save(store.durability())?;
    Processor::over(store, specs, progress)
}

impl Processor {
    /// The agent's start: read what the last run left, decide ([`plan::decide`]), and carry
    /// the plan out. `settle` replays the log tail under the last run's pipelines when the
    /// plan asks for it, and says why it stopped before the log's end, if it did (then the
    /// changed pipelines go on in a new generation instead). The quarantine file is attached
    /// to both processors.
    pub(crate) fn start<E: From<ProcessError>>(
        store: Store,
        specs: Vec<PipelineSpec>,
        from: StartFrom<'_>,
        settle: &mut dyn FnMut(&mut Processor) -> Result<Option<String>, E>,
    ) -> Result<Processor, E> {
        let data_dir = from.data_dir;
        let file = |name: &str| data_dir.join(name);
        let found = plan::Found {
            progress: store.progress().map_err(ProcessError::from)?,
            with_data: store.pipelines_with_data().map_err(ProcessError::from)?,
            generations: Generations::load(&file(generations::FILE_NAME))
                .map_err(ProcessError::from)?,
            last_run: last_run::read(data_dir),
            restored: restored::read(data_dir).map_err(|source| ProcessError::DataFile {
                op: "read the savepoint-restore marker",
                file: file(restored::FILE_NAME),
                source,
            })?,
        };
        let mut plan = plan::decide(&found, &specs, from.reset).map_err(ProcessError::from)?;
        note(&plan.notes);
        let mut quarantine = open_quarantine(data_dir, from.sync)?;
        let mut store = store;
        if let Some(s) = &plan.settle {
            let progress = store.progress().map_err(ProcessError::from)?;
            let mut old = Processor::over(store, s.specs.clone(), progress)?;
            old.set_quarantine(quarantine)?;
            let held = settle(&mut old)?;
            quarantine = old.quarantine.take().expect("attached above");
            store = std::sync::Arc::into_inner(old.store)
                .expect("nothing else holds the store while the last run's pipelines settle");
            if let Some(why) = held {
                let before = plan.notes.len();
                plan.settle_held(&why);
                note(&plan.notes[before..]);
            }
        }
        let clear_restored = plan.clear_restored;
        let running = specs.clone();
        let mut proc = commit(store, specs, plan)?;
        crate::failpoint::hit("start.plan_committed").map_err(|source| ProcessError::DataFile {
            op: "pass the failpoint after the start plan's commit, before",
            file: file(restored::FILE_NAME),
            source,
        })?;
        if clear_restored {
            restored::clear(data_dir, from.sync).map_err(|source| ProcessError::DataFile {
                op: "remove the savepoint-restore marker",
                file: file(restored::FILE_NAME),
                source,
            })?;
        }
        last_run::record(data_dir, &running, from.sync).map_err(|source| {
            ProcessError::DataFile {
                op: "record the running pipelines in",
                file: file(last_run::FILE_NAME),
                source,
            }
        })?;
        proc.set_quarantine(quarantine)?;
        if let Some(q) = proc.quarantine().filter(|q| !q.is_empty()) {
            crate::event!(warn, "quarantine_retrying";
                "recovery: {} names log records whose processing panicked before; each is \
                 retried up to {} times, then set aside as a dead letter with reason `internal`",
                q.path().display(),
                quarantine::MAX_ATTEMPTS
            );
        }
        Ok(proc)
    }
}

fn open_quarantine(data_dir: &Path, sync: &Durability) -> Result<Quarantine, ProcessError> {
    Quarantine::open(data_dir, sync.clone()).map_err(|source| ProcessError::Quarantine {
        file: data_dir.join(quarantine::FILE_NAME),
        source,
    })
}
