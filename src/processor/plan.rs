//! Start-up as one plan (issue 28, item 6): what the last run left, against the config,
//! decided once, by one pure function.
//!
//! [`Found`] is everything a start reads before it processes anything: the store's durable
//! progress and which pipelines hold state there, the generations file, the pipelines the
//! last run started with (`pipelines.json`) and a savepoint-restore marker. [`decide`]
//! answers, with no IO: which pipelines settle the log tail under the definitions of the
//! last run, which continue, start empty, are reset, dropped or kept dormant, which go on in
//! a new generation of output IDs, which backfill, and what is refused with which error.
//! `processor/open.rs` carries the plan out in that order.
//!
//! ## The rules, and why
//!
//! 1. **An ID never gets a second payload** (invariant 6). After a crash, results of the
//!    records past the last durable checkpoint may have gone out. Whatever the start
//!    computes again differently must first be *settled* under the settings that computed
//!    it, or go out in a *new generation*:
//!    - the last run's pipelines differ from the config, and the store is the one they ran
//!      on: the log tail is replayed under the old pipelines and checkpointed first
//!      ([`Settle`]); if processing must wait before the tail is done (the outbox bound, a
//!      nearly full disk), the changed pipelines go on in a new generation instead;
//!    - a pipeline still *backfilling* whose settings changed goes on in a new generation,
//!      its state kept and its backfill resumed from its durable cursor. Settling it would
//!      mean backfilling under the old settings as far as the last run may have got, which
//!      can be the whole retained log, at start and before the outbox can drain (issue 26,
//!      finding 3: the settle skipped these, and resumed backfills gave thousands of
//!      published IDs a second payload);
//!    - a pipeline backfilling in the last run that is not configured now goes dormant in a
//!      new generation: its unsettled results are then never recomputed under the settings
//!      it may come back with;
//!    - after a savepoint restore, every stored pipeline goes on in a new generation.
//! 2. **State is never read under another definition** (invariant 9): a changed definition
//!    is refused unless reset; state whose definition the store does not know likewise.
//! 3. **A new lineage is a new generation**: a reset, a pipeline new to the store that ran
//!    here before (its store was moved aside, or it was dropped).
//! 4. **What cannot be decided safely is refused**: a `pipelines.json` that does not read, a
//!    reset of a pipeline that does not exist, and a set of pipelines (dormant ones
//!    included) whose progress record could not be stored once its counts grow.

use std::path::PathBuf;

use super::generations::Generations;
use super::last_run::LastRun;
use crate::model::{Backfill, PipelineProgress, Progress};
use crate::pipeline::engine::definition;
use crate::pipeline::spec::{PipelineSpec, Start};

/// What a start reads before it processes anything.
#[derive(Debug, Clone)]
pub(crate) struct Found {
    /// The store's durable progress.
    pub(crate) progress: Progress,
    /// Pipelines with state or dedup entries in the store.
    pub(crate) with_data: Vec<String>,
    /// The generations file: the highest generation ever started, per pipeline.
    pub(crate) generations: Generations,
    pub(crate) last_run: LastRun,
    /// The savepoint-restore marker, with what was restored.
    pub(crate) restored: Option<String>,
}

/// Why a start is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Refusal {
    UnknownReset {
        name: String,
    },
    IncompatiblePipeline {
        name: String,
        stored: String,
        current: String,
    },
    UnknownDefinition {
        name: String,
    },
    LastRunUnreadable {
        file: PathBuf,
        why: String,
    },
    ProgressTooLarge {
        bytes: usize,
        limit: usize,
        configured: usize,
        dormant: Vec<String>,
    },
}

/// What becomes of one pipeline.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Action {
    /// Its stored state goes on (a backfill resumes).
    Continue,
    /// It starts empty in `generation`: new to the store. `backfill`: it first takes the
    /// retained log (`start = "earliest"`).
    Fresh { generation: u32, backfill: bool },
    /// `--reset-pipeline`: state and ledger dropped, versions continue above the old ones.
    Reset { generation: u32, backfill: bool },
    /// State kept; its output IDs go on in `generation`.
    NewGeneration { generation: u32 },
    /// Not configured, kept as it is.
    Dormant,
    /// Not configured, `--reset-pipeline`: progress, state and ledger dropped.
    Drop,
}

/// Replay the log tail under the last run's pipelines and checkpoint, before anything else.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Settle {
    pub(crate) specs: Vec<PipelineSpec>,
    /// The pipelines that differ, for the journal.
    pub(crate) changed: String,
    /// If the settle cannot finish (processing must wait), these go on in a new generation:
    /// the configured pipelines whose settings changed and that otherwise continue.
    pub(crate) fallback: Vec<(String, u32)>,
}

/// A journal line the plan asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Note {
    pub(crate) level: log::Level,
    pub(crate) text: String,
}

/// What a start does, decided by [`decide`].
#[derive(Debug, Clone)]
pub(crate) struct Plan {
    pub(crate) settle: Option<Settle>,
    /// Per pipeline, configured ones in config order, then the stored ones not configured.
    pub(crate) actions: Vec<(String, Action)>,
    /// Pipelines whose stored state and ledger are deleted (resets, drops, and state of an
    /// unknown definition named in a reset).
    pub(crate) wipe: Vec<String>,
    /// The generations file after this start.
    pub(crate) generations: Generations,
    pub(crate) notes: Vec<Note>,
    /// A restore marker was read: remove it once the plan is committed.
    pub(crate) clear_restored: bool,
    /// After a restore, what becomes of the restored outbox's waiting results, per
    /// pipeline: moved into its new generation, or dropped (`None`) with a reset or dropped
    /// pipeline. Results of other pipelines (none stored) stay as they are.
    pub(crate) outbox: Vec<(String, Option<u32>)>,
}

impl Plan {
    /// The settle could not finish: its fallback pipelines go on in a new generation.
    pub(crate) fn settle_held(&mut self, why: &str) {
        let Some(settle) = self.settle.take() else {
            return;
        };
        for (name, generation) in settle.fallback {
            self.generations.observe(&name, generation);
            self.notes.push(Note {
                level: log::Level::Warn,
                text: format!(
                    "pipeline `{name}` goes on in generation {generation} (output IDs \
                     `{name}@{generation}/...`): its settings changed, and the log tail could \
                     not be settled under the old ones first ({why})"
                ),
            });
            if let Some(a) = self.actions.iter_mut().find(|(n, _)| *n == name) {
                a.1 = Action::NewGeneration { generation };
            }
        }
    }

    /// Whether carrying the plan out changes the stored progress record (or the outbox).
    pub(crate) fn changes_progress(&self) -> bool {
        !self.wipe.is_empty()
            || !self.outbox.is_empty()
            || self
                .actions
                .iter()
                .any(|(_, a)| !matches!(a, Action::Continue | Action::Dormant))
    }

    /// The progress record after the plan: `stored` (the store's, after any settle) with
    /// each action applied. Configured pipelines first, in config order, then dormant ones.
    pub(crate) fn apply(&self, stored: &Progress, specs: &[PipelineSpec]) -> Progress {
        let mut out = Progress {
            pipelines: Vec::with_capacity(stored.pipelines.len().max(specs.len())),
            ..stored.clone()
        };
        let find = |name: &str| stored.pipelines.iter().find(|p| p.name == name);
        let spec = |name: &str| specs.iter().find(|s| s.name == name);
        for (name, action) in &self.actions {
            let pp = match (action, find(name), spec(name)) {
                (Action::Drop, _, _) => continue,
                (Action::Continue | Action::Dormant, Some(old), _) => old.clone(),
                (Action::NewGeneration { generation }, Some(old), _) => PipelineProgress {
                    generation: *generation,
                    ..old.clone()
                },
                (
                    Action::Fresh {
                        generation,
                        backfill,
                    },
                    _,
                    Some(s),
                ) => with_backfill(PipelineProgress::new(s, *generation), *backfill),
                (
                    Action::Reset {
                        generation,
                        backfill,
                    },
                    old,
                    Some(s),
                ) => {
                    let p = match old {
                        Some(old) => PipelineProgress::reset(old, s, *generation),
                        None => PipelineProgress::new(s, *generation),
                    };
                    with_backfill(p, *backfill)
                }
                _ => unreachable!("decide gives each action what it needs: {name} {action:?}"),
            };
            out.pipelines.push(pp);
        }
        out
    }
}

fn with_backfill(mut p: PipelineProgress, backfill: bool) -> PipelineProgress {
    p.backfill = backfill.then(Backfill::default);
    p
}

/// Decide what this start does with what the last run left. Pure: no IO, no clock.
pub(crate) fn decide(
    found: &Found,
    specs: &[PipelineSpec],
    reset: &[String],
) -> Result<Plan, Refusal> {
    if let LastRun::Unreadable { file, why } = &found.last_run {
        return Err(Refusal::LastRunUnreadable {
            file: file.clone(),
            why: why.clone(),
        });
    }
    let progress = &found.progress;
    let stored = |name: &str| progress.pipelines.iter().find(|p| p.name == name);
    let configured = |name: &str| specs.iter().any(|s| s.name == name);
    let has_data = |name: &str| found.with_data.iter().any(|n| n == name);
    let mut reset: Vec<&String> = reset.iter().collect();
    reset.sort();
    reset.dedup();
    for name in &reset {
        if !configured(name) && stored(name).is_none() && !has_data(name) {
            return Err(Refusal::UnknownReset {
                name: name.to_string(),
            });
        }
    }
    let asked = |name: &str| reset.iter().any(|r| *r == name);
    let mut gens = found.generations.clone();
    for pp in &progress.pipelines {
        gens.observe(&pp.name, pp.generation);
    }
    let last: &[PipelineSpec] = match &found.last_run {
        LastRun::Ran(specs) => specs,
        _ => &[],
    };
    let last_spec = |name: &str| last.iter().find(|s| s.name == name);
    let restored = found.restored.is_some();
    let mut notes = Vec::new();
    let mut note = |level, text: String| notes.push(Note { level, text });
    if let Some(what) = &found.restored {
        note(
            log::Level::Warn,
            format!(
                "savepoint restored ({what}): every stored pipeline goes on in a new generation \
                 of output IDs, so that replay under today's settings never gives an ID that \
                 went out after the savepoint a second payload"
            ),
        );
    }

    let mut actions = Vec::new();
    let mut wipe = Vec::new();
    for spec in specs {
        let name = spec.name.as_str();
        let earliest = spec.start == Start::Earliest;
        let action = match stored(name) {
            Some(old) if asked(name) => {
                let generation = gens.start_new(name, old.generation);
                note(
                    log::Level::Warn,
                    format!(
                        "pipeline `{name}` reset: {} keys and {} dedup entries dropped; versions \
                         continue above {}, in generation {generation} (output IDs \
                         `{name}@{generation}/...`)",
                        old.keys, old.dedup_entries, old.max_version
                    ),
                );
                wipe.push(name.to_string());
                note_begin(&mut note, spec);
                Action::Reset {
                    generation,
                    backfill: earliest,
                }
            }
            Some(old) if old.definition != definition(spec) => {
                return Err(Refusal::IncompatiblePipeline {
                    name: name.to_string(),
                    stored: old.definition.clone(),
                    current: definition(spec),
                });
            }
            Some(old) => {
                let backfill_changed =
                    old.backfill.is_some() && last_spec(name).is_some_and(|s| s != spec);
                note_stored(&mut note, spec, old);
                if restored || backfill_changed {
                    let generation = gens.start_new(name, old.generation);
                    if backfill_changed && !restored {
                        note(
                            log::Level::Warn,
                            format!(
                                "pipeline `{name}` changed while it was still backfilling: it \
                                 goes on from its last checkpoint in generation {generation} \
                                 (output IDs `{name}@{generation}/...`), since results of its \
                                 backfill past that checkpoint may have gone out under the old \
                                 settings"
                            ),
                        );
                    }
                    Action::NewGeneration { generation }
                } else {
                    if old.generation > 1 {
                        note(
                            log::Level::Info,
                            format!("pipeline `{name}`: generation {}", old.generation),
                        );
                    }
                    Action::Continue
                }
            }
            None => {
                // Not in the progress record: new here, or its state was forgotten or moved.
                let mut at_least = 0;
                if has_data(name) {
                    if !asked(name) {
                        return Err(Refusal::UnknownDefinition {
                            name: name.to_string(),
                        });
                    }
                    note(
                        log::Level::Warn,
                        format!("pipeline `{name}` reset: state of an unknown definition dropped"),
                    );
                    wipe.push(name.to_string());
                    // That state's results went out in generation 1 (it predates generations).
                    at_least = 1;
                }
                let generation = gens.start_new(name, at_least);
                if generation > 1 {
                    note(
                        log::Level::Warn,
                        format!(
                            "pipeline `{name}` starts empty in generation {generation}: results \
                             of an earlier generation went out under this name (its store was \
                             moved aside, or it was dropped), so its output IDs are now \
                             `{name}@{generation}/...`"
                        ),
                    );
                }
                note_begin(&mut note, spec);
                Action::Fresh {
                    generation,
                    backfill: earliest,
                }
            }
        };
        actions.push((name.to_string(), action));
    }
    for old in progress.pipelines.iter().filter(|p| !configured(&p.name)) {
        let name = old.name.as_str();
        let action = if asked(name) {
            note(
                log::Level::Warn,
                format!(
                    "pipeline `{name}` dropped (not configured): its state and dedup ledger are \
                     deleted ({} keys, {} dedup entries)",
                    old.keys, old.dedup_entries
                ),
            );
            wipe.push(name.to_string());
            Action::Drop
        } else {
            note(
                log::Level::Warn,
                format!(
                    "pipeline `{name}` is not configured, and its stored state is kept ({} keys, \
                     {} dedup entries): add it back with the same definition to continue it, or \
                     drop it with `cairn run --reset-pipeline {name}`",
                    old.keys, old.dedup_entries
                ),
            );
            if restored || (old.backfill.is_some() && last_spec(name).is_some()) {
                Action::NewGeneration {
                    generation: gens.start_new(name, old.generation),
                }
            } else {
                Action::Dormant
            }
        };
        actions.push((name.to_string(), action));
    }
    for name in found
        .with_data
        .iter()
        .filter(|n| !configured(n) && stored(n).is_none())
    {
        if asked(name) {
            note(
                log::Level::Warn,
                format!(
                    "pipeline `{name}` dropped (not configured): its state and dedup ledger are \
                     deleted"
                ),
            );
            wipe.push(name.clone());
        } else {
            note(
                log::Level::Warn,
                format!(
                    "the store holds state of pipeline `{name}`, which is not configured and \
                     whose definition is unknown: drop it with `cairn run --reset-pipeline \
                     {name}`"
                ),
            );
        }
    }

    let settle = settle(found, specs, &actions, &gens, restored);
    if let Some(s) = &settle {
        note(
            log::Level::Info,
            format!(
                "pipelines changed since the last run ({}): replaying the log tail under the \
                 old definitions and checkpointing first, so that no result that may have gone \
                 out is computed again differently",
                s.changed
            ),
        );
    }
    let outbox = if restored {
        restored_outbox(&actions, &wipe)
    } else {
        Vec::new()
    };
    let plan = Plan {
        settle,
        actions,
        wipe,
        generations: gens,
        notes,
        clear_restored: restored,
        outbox,
    };
    let after = plan.apply(progress, specs);
    let bytes = crate::store::progress_bytes_at_most(&after);
    if bytes > crate::store::PROGRESS_MAX_BYTES {
        return Err(Refusal::ProgressTooLarge {
            bytes,
            limit: crate::store::PROGRESS_MAX_BYTES,
            configured: specs.len(),
            dormant: after
                .pipelines
                .iter()
                .filter(|p| !configured(&p.name))
                .map(|p| p.name.clone())
                .collect(),
        });
    }
    Ok(plan)
}

/// After a restore: the restored outbox's results go on in their pipeline's new generation,
/// or go with a pipeline reset or dropped at this start. Sent again under their old IDs,
/// they would follow newer versions that went out after the savepoint, in the generation
/// the restore ended, and set those keys back for a consumer that applies every new ID.
fn restored_outbox(actions: &[(String, Action)], wipe: &[String]) -> Vec<(String, Option<u32>)> {
    let mut out: Vec<(String, Option<u32>)> = actions
        .iter()
        .filter_map(|(name, a)| match a {
            Action::NewGeneration { generation } => Some((name.clone(), Some(*generation))),
            _ => None,
        })
        .collect();
    out.extend(wipe.iter().map(|name| (name.clone(), None)));
    out
}

/// Whether the log tail is settled under the last run's pipelines first: they differ from
/// the config, and the store holds exactly their definitions (it is the store they ran on,
/// not one restored or moved aside since). A pipeline the config adds therefore starts at
/// that checkpoint boundary, like every other change.
fn settle(
    found: &Found,
    specs: &[PipelineSpec],
    actions: &[(String, Action)],
    gens: &Generations,
    restored: bool,
) -> Option<Settle> {
    let LastRun::Ran(old) = &found.last_run else {
        return None;
    };
    if restored || old.as_slice() == specs || old.is_empty() {
        return None;
    }
    let stored_as_run = old.iter().all(|spec| {
        found
            .progress
            .pipelines
            .iter()
            .any(|p| p.name == spec.name && p.definition == definition(spec))
    });
    if !stored_as_run {
        return None;
    }
    let fallback = specs
        .iter()
        .filter(|s| old.iter().any(|o| o.name == s.name && o != *s))
        .filter(|s| {
            actions
                .iter()
                .any(|(n, a)| *n == s.name && *a == Action::Continue)
        })
        .map(|s| {
            let at = found
                .progress
                .pipelines
                .iter()
                .find(|p| p.name == s.name)
                .map_or(0, |p| p.generation);
            (s.name.clone(), gens.next(&s.name, at))
        })
        .collect();
    Some(Settle {
        specs: old.clone(),
        changed: changed_names(old, specs),
        fallback,
    })
}

/// For the journal: the names of the pipelines that differ.
fn changed_names(old: &[PipelineSpec], new: &[PipelineSpec]) -> String {
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

/// A pipeline that starts empty: with `start = "earliest"`, it backfills.
fn note_begin(note: &mut impl FnMut(log::Level, String), spec: &PipelineSpec) {
    if spec.start == Start::Earliest {
        note(
            log::Level::Info,
            format!(
                "pipeline `{}` starts empty with start = \"earliest\": it processes the retained \
                 log first, then joins live processing",
                spec.name
            ),
        );
    }
}

/// A pipeline the store already holds: `start` does not apply; a backfill resumes.
fn note_stored(
    note: &mut impl FnMut(log::Level, String),
    spec: &PipelineSpec,
    stored: &PipelineProgress,
) {
    match (stored.backfill, spec.start) {
        (Some(b), _) => note(
            log::Level::Info,
            format!(
                "pipeline `{}`: resuming its backfill at log offset {}",
                spec.name, b.next
            ),
        ),
        (None, Start::Earliest) => note(
            log::Level::Info,
            format!(
                "pipeline `{}`: start = \"earliest\" ignored: the pipeline has stored state \
                 (start applies only to a pipeline new to the store, or reset)",
                spec.name
            ),
        ),
        (None, Start::Latest) => {}
    }
}

#[cfg(test)]
mod tests;
