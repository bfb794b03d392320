//! The processor: feeds log records through the pipeline engine and commits checkpoints to
//! the store. It decides nothing by the clock; the agent tells it when to checkpoint.
//!
//! Recovery is replay (invariant 4): [`Processor::open`] loads the last checkpoint, and
//! [`Processor::replay`] re-applies every durable log record from its `next_offset`. Nothing
//! else is read and nothing else is trusted.
//!
//! Why ~700 lines: most of it is [`ProcessError`], whose messages tell an operator what to
//! do, and the determinism audit below (issue 14), kept beside the code it is about. What a
//! start does with what the last run left is decided in `processor/plan.rs` and carried out
//! in `processor/open.rs`; slices of the log (replay, catch-up, backfill) are read in
//! `processor/slice.rs`.
//!
//! ## Replay gives every ID the payload it had (audit for issue 14)
//!
//! Results go out before their checkpoint, so a replay after a crash must compute, for every
//! output ID the first run computed, the same payload. What processing reads, and why replay
//! reads the same:
//!
//! - **Records**: the log, fsynced before they are applied; times come from the record
//!   (`received_at_ms`, the payload), never the clock.
//! - **State and ledger** at the checkpoint, then the overlay of every record since: the
//!   same on both runs. A dedup decision is by record time: an ID is a duplicate iff
//!   `log_clock - seen < dedup_window`; whether the store has already forgotten an expired
//!   chunk does not change it (an expired entry accepts either way). The ledger's memory
//!   bound (`ledger_index_max`) only decides where a lookup reads, not its answer.
//! - **Where checkpoints fall**: changes which upsert versions are emitted (one per key per
//!   flush or checkpoint), never what one carries: an ID names a version, and the payload is
//!   that version's state. Sequence numbers may differ; they are not part of a result.
//! - **Windows**: closed by the watermark, the greatest event time applied (record data);
//!   `emit = "final"` emits a window's state when that closes it, on both runs alike.
//! - **Dead letters**: their caps prune the stored tree by log offset and record time;
//!   nothing processing decides reads that tree. A refusal is deduplicated through the
//!   ledger like an event.
//! - **Quarantine**: a record whose processing panics stops the process before anything
//!   after it is published; after the attempts it is set aside on every later run alike.
//! - **Definitions**: the store refuses a changed definition; the rest of a pipeline
//!   (`where`, `topics`, `dedup_window`, `emit`, limits) changes only at a checkpoint
//!   boundary: the start plan settles the tail under the last run's pipelines, or starts a
//!   new generation (a pipeline changed while backfilling, a savepoint restored:
//!   `processor/plan.rs`); `--reset-pipeline` starts a new generation of IDs.
//! - **Backfills**: a backfilling pipeline reads the log in order from its own cursor with
//!   its own dedup clock; where its slices fall between live work changes nothing it
//!   computes (property test `tests/it/backfill.rs`).
//! - **Counters** (`outputs` in upsert mode) depend on where flushes fell; they are figures,
//!   and no decision reads them.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};

use crate::log::LogError;
use crate::model::{Offset, Output, Progress, Record};
use crate::pipeline::describe::explain_changes;
use crate::pipeline::engine::{Checkpoint, Engine, Outcome, Target, definition};
use crate::pipeline::spec::PipelineSpec;
use crate::store::{CheckpointInfo, Store, StoreError};

#[cfg(test)]
mod changes_model;
pub mod generations;
pub(crate) mod inflight;
pub(crate) mod last_run;
mod open;
pub(crate) mod plan;
pub(crate) mod quarantine;
pub mod restored;
mod slice;

use generations::{Generations, GenerationsError};
pub(crate) use open::StartFrom;
use quarantine::{MAX_ATTEMPTS, Quarantine};
pub(crate) use slice::Hold;
pub use slice::{BackfillSlice, CatchUp};

#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Log(#[from] LogError),
    #[error("{0}")]
    Read(#[from] crate::pipeline::engine::ReadError),
    #[error("--reset-pipeline {name}: no pipeline of that name in the config or in the store")]
    UnknownReset { name: String },
    /// `stored` and `current` are the definitions as the store keeps them (JSON); the
    /// message shows the settings that differ as the config writes them.
    #[error(
        "pipeline `{name}` changed in a way that would misread its stored state:\n{}\nRestore \
         the old definition, or reset the pipeline's state with `cairn run --reset-pipeline \
         {name}` (its results then continue in a new generation of output IDs)",
        explain_changes(stored, current)
    )]
    IncompatiblePipeline {
        name: String,
        stored: String,
        current: String,
    },
    /// State under a configured pipeline's name, but no progress record says which
    /// definition wrote it: an earlier cairn forgot removed pipelines' progress and kept
    /// their state. It cannot be trusted to be this definition's.
    #[error(
        "pipeline `{name}` has state in the store but no record of the definition that wrote \
         it (an earlier cairn forgot it when the pipeline was removed from the config), so it \
         will not be read as this definition's. Drop it with `cairn run --reset-pipeline {name}`"
    )]
    UnknownDefinition { name: String },
    #[error(transparent)]
    Generations(#[from] GenerationsError),
    /// The log no longer reaches back to where the store's checkpoint ends, so replay
    /// cannot rebuild the state (DESIGN §4: keep the log back to the newest savepoint).
    #[error(
        "{}, but the log starts at offset {first}: records [{needed}, {first}) were deleted by retention or moved aside by \
         `cairn verify --repair`, so replay cannot rebuild the state and the agent will not \
         start. Put back the store that belongs to this log, or restore a savepoint taken at \
         or after offset {first} (`cairn savepoint list`, then `cairn savepoint restore FILE`) \
         and start again; `cairn verify` shows where the log and the store stand",
        replay_start(*.needed)
    )]
    LogGap { needed: Offset, first: Offset },
    /// The log ends before the store's checkpoint: records the store already counted are
    /// gone from the log, and new records would reuse their offsets.
    #[error(
        "the store's checkpoint covers the log up to offset {checkpoint}, but the log ends at \
         offset {log_next}: the log lost records the store already counted (its directory was \
         replaced or its newest segments removed), and new records would reuse their offsets, \
         so the agent will not start. Put back the log that belongs to this store, or restore \
         a savepoint taken at or before offset {log_next} (`cairn savepoint list`, then \
         `cairn savepoint restore FILE`)"
    )]
    LogBehind {
        checkpoint: Offset,
        log_next: Offset,
    },
    /// Applying one record panicked: a bug. The attempt is on disk; the process must exit
    /// (the engine may be half-way through a change) and a restart replays.
    #[error(
        "processing log record {offset} (topic `{topic}`) panicked: {message}. This is a bug \
         in Cairn; the record is kept in the log (`cairn inspect log --from {offset} --limit 1`). \
         Attempt {attempts} of {MAX_ATTEMPTS} is recorded in {}; exiting so that the service \
         manager restarts the agent, which replays from the last checkpoint{}",
        .file.display(),
        what_next(*.attempts)
    )]
    Panicked {
        offset: Offset,
        topic: String,
        message: String,
        attempts: u32,
        file: PathBuf,
    },
    #[error(
        "{}: {source}; the quarantine file records failed attempts so that one bad record \
         cannot stop the agent forever",
        .file.display()
    )]
    Quarantine {
        file: PathBuf,
        source: std::io::Error,
    },
    /// A panic left the engine in an unknown state; nothing more may be applied.
    #[error("an earlier record panicked during processing; restart the agent")]
    Poisoned,
    /// `pipelines.json` exists but does not read (issue 26): the start cannot tell what to
    /// settle.
    #[error(
        "{}: {why}. This file records the pipelines the last run started with; the start \
         needs it to settle, under those pipelines, results that may have gone out before a \
         config change applies, and will not guess. Put back the file (or the config) of the \
         last run and start again. If the last run stopped cleanly (`shutdown: done` in its \
         journal), or if you accept that results not yet checkpointed may go out again with \
         different payloads, remove the file and start again",
        .file.display()
    )]
    LastRunUnreadable { file: PathBuf, why: String },
    /// The pipelines the store would keep (configured and dormant) could outgrow the one
    /// progress record every checkpoint writes.
    #[error(
        "the progress record of {configured} configured and {} dormant pipeline(s) could take \
         {bytes} bytes once their counts grow, over the store's bound of {limit} bytes, so a \
         later checkpoint would fail: the agent will not start. Drop dormant pipelines with \
         `cairn run --reset-pipeline NAME` (dormant: {}), or configure fewer pipelines or \
         shorter definitions",
        .dormant.len(),
        if .dormant.is_empty() { "none".to_string() } else { .dormant.join(", ") }
    )]
    ProgressTooLarge {
        bytes: usize,
        limit: usize,
        configured: usize,
        dormant: Vec<String>,
    },
    /// A file of the data directory that a start reads or writes.
    #[error("{op} {}: {source}", .file.display())]
    DataFile {
        op: &'static str,
        file: PathBuf,
        source: std::io::Error,
    },
}

impl From<plan::Refusal> for ProcessError {
    fn from(r: plan::Refusal) -> ProcessError {
        use plan::Refusal as R;
        match r {
            R::UnknownReset { name } => ProcessError::UnknownReset { name },
            R::IncompatiblePipeline {
                name,
                stored,
                current,
            } => ProcessError::IncompatiblePipeline {
                name,
                stored,
                current,
            },
            R::UnknownDefinition { name } => ProcessError::UnknownDefinition { name },
            R::LastRunUnreadable { file, why } => ProcessError::LastRunUnreadable { file, why },
            R::ProgressTooLarge {
                bytes,
                limit,
                configured,
                dormant,
            } => ProcessError::ProgressTooLarge {
                bytes,
                limit,
                configured,
                dormant,
            },
        }
    }
}

fn what_next(attempts: u32) -> String {
    if attempts >= MAX_ATTEMPTS {
        "; that start sets the record aside as a dead letter with reason `internal` and goes on"
            .into()
    } else {
        format!(
            "; after {MAX_ATTEMPTS} failed attempts the record is set aside as a dead letter \
             with reason `internal`"
        )
    }
}

/// The text of a panic's payload (`panic!` gives a `&str` or a `String`).
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into())
}

/// A pipeline whose state the store holds but the config does not name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unconfigured {
    pub name: String,
    pub keys: u64,
    pub dedup_entries: u64,
    /// `None` when the store has state but no progress record for it (see
    /// [`ProcessError::UnknownDefinition`]).
    pub generation: Option<u32>,
}

/// What the store holds against the config, without changing either: the pipelines it
/// keeps that are not configured, and why a start would refuse (one message each). For
/// `cairn status` and `cairn validate`.
pub fn audit(
    store: &Store,
    specs: &[PipelineSpec],
) -> Result<(Vec<Unconfigured>, Vec<String>), StoreError> {
    let progress = store.progress()?;
    let with_data = store.pipelines_with_data()?;
    let mut unconfigured = Vec::new();
    for p in &progress.pipelines {
        if !specs.iter().any(|s| s.name == p.name) {
            unconfigured.push(Unconfigured {
                name: p.name.clone(),
                keys: p.keys,
                dedup_entries: p.dedup_entries,
                generation: Some(p.generation.max(1)),
            });
        }
    }
    let mut refusals = Vec::new();
    for name in &with_data {
        if progress.pipelines.iter().any(|p| &p.name == name) {
            continue;
        }
        if specs.iter().any(|s| &s.name == name) {
            refusals.push(ProcessError::UnknownDefinition { name: name.clone() }.to_string());
        } else {
            unconfigured.push(Unconfigured {
                name: name.clone(),
                keys: store.states(Some(name)).count() as u64,
                dedup_entries: store.dedup_entries(Some(name)).count() as u64,
                generation: None,
            });
        }
    }
    for spec in specs {
        if let Some(p) = progress.pipelines.iter().find(|p| p.name == spec.name) {
            if p.definition != definition(spec) {
                let e = ProcessError::IncompatiblePipeline {
                    name: spec.name.clone(),
                    stored: p.definition.clone(),
                    current: definition(spec),
                };
                refusals.push(e.to_string());
            }
        }
    }
    Ok((unconfigured, refusals))
}

fn replay_start(needed: Offset) -> String {
    if needed == 0 {
        "the store is empty (new, or moved aside), so replay must start at log offset 0".into()
    } else {
        format!("the store's checkpoint ends at log offset {needed}, so replay must start there")
    }
}

/// What a replay did, for the journal and `READY`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReplayStats {
    pub from: Offset,
    pub to: Offset,
    pub records: u64,
    pub checkpoints: u64,
    pub millis: u64,
    /// Why the replay stopped before the log's end (see [`Processor::replay`]): the rest is
    /// taken later, as catch-up.
    pub held: Option<String>,
}

pub struct Processor {
    engine: Engine,
    /// Shared with the thread that commits checkpoints beside the agent's loop.
    store: std::sync::Arc<Store>,
    /// The checkpoint whose commit runs beside the caller, until it is done
    /// ([`Processor::begin_checkpoint`]): a read layer under the engine's overlay, and the
    /// first of the outputs not yet in the store.
    inflight: Option<std::sync::Arc<Checkpoint>>,
    /// Failed attempts per log offset (see [`quarantine`]). Without one (library
    /// use, tests) a panic propagates as it always did.
    quarantine: Option<Quarantine>,
    /// Set when a panic was caught: the engine may be half-way through a change.
    poisoned: bool,
    /// The log readers kept between slices (`processor/slice.rs`).
    readers: slice::Readers,
    /// Checkpoints leave their fsync to the caller (only in the changes model: see
    /// `defer_sync`).
    defer_sync: bool,
    /// For each committed checkpoint whose fsync is still to come: its `next_offset` and
    /// where the quarantine may prune once it is durable (below every backfill cursor that
    /// checkpoint holds, which the engine may have passed by the time the fsync is done).
    unsynced_prunes: std::collections::VecDeque<(Offset, Offset)>,
    /// A slice read back from the log stops once the batch writes this many state keys
    /// (`checkpoint.max_keys`, [`Processor::set_batch_bound`]); unbounded until set.
    key_bound: u64,
    /// ... or once it has made this many results (`checkpoint.max_records`); unbounded
    /// until set.
    result_bound: u64,
    /// Whether the last durable checkpoint has a pipeline that emits upserts backfilling
    /// (see [`Processor::results_wait_for_checkpoint`]).
    durable_upsert_backfill: bool,
    /// How far past a checkpoint's `next_offset` the send horizon it records reaches
    /// ([`Processor::set_send_slack`]); 0 until set, as while the start replays.
    send_slack: u64,
    /// The send horizon recorded last: by the checkpoint in flight, the last one committed,
    /// or the start. It never goes back.
    send_horizon: Offset,
    /// The send horizon of the last durable checkpoint or of the start's record: a restart
    /// replays at least up to it before it sends anything, so results of records below it
    /// may leave early (see [`Processor::results_wait_for_checkpoint`]).
    durable_send_horizon: Offset,
    /// Where the run before may have sent results from, while the replay at start stopped
    /// short of it ([`Processor::owe_send_horizon`]); 0: nothing owed.
    owed_send_horizon: Offset,
    /// The last durable checkpoint's `next_offset`.
    durable_next_offset: Offset,
}

/// Why results wait for their checkpoint to be durable before they leave (see
/// [`Processor::results_wait_for_checkpoint`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Wait {
    /// A pipeline that emits upserts backfills, here or in the last durable checkpoint.
    UpsertBackfill,
    /// Processing is past the send horizon of the last durable checkpoint.
    PastSendHorizon,
    /// The replay at start stopped short of where the run before may have sent results
    /// from: nothing leaves, not even what is durable, until a checkpoint there is durable.
    ReplayOwed,
}

impl Processor {
    /// Load the last checkpoint. Refuses a pipeline whose stored definition differs from the
    /// configured one unless it is named in `reset` (issue 6 wires the reset itself).
    pub fn open(store: Store, specs: Vec<PipelineSpec>) -> Result<Processor, ProcessError> {
        Processor::open_with_reset(store, specs, &[])
    }

    /// As [`Processor::open_with`], with generations counted in memory only (no data
    /// directory: tests and tools).
    pub fn open_with_reset(
        store: Store,
        specs: Vec<PipelineSpec>,
        reset: &[String],
    ) -> Result<Processor, ProcessError> {
        Processor::open_with(store, specs, reset, None)
    }

    /// Load the last checkpoint, after comparing every configured pipeline with what the
    /// store holds for it (including a pipeline that was removed and comes back):
    ///
    /// - a stored definition that differs is refused, unless the pipeline is named in
    ///   `reset`: then its state and dedup ledger are dropped and it starts empty in a new
    ///   generation, its versions continuing above the old ones;
    /// - state under its name whose definition the store does not know is refused likewise;
    /// - a pipeline the store does not know starts empty: in generation 1 if it never ran
    ///   here, else in a new generation (its store was moved aside, or it was dropped);
    ///   with `start = "earliest"` (also after a reset) it first backfills the retained log
    ///   ([`Processor::backfill_slice`]); on a pipeline with state `start` is ignored;
    /// - a stored pipeline that is not configured stays dormant (kept, reported in the
    ///   journal), unless named in `reset`: then its state, ledger and progress are dropped.
    ///
    /// Everything this changes in the store commits in one transaction before anything else
    /// happens, then `generations` (the file beside the store, see [`generations`])
    /// records the new generations.
    pub fn open_with(
        store: Store,
        specs: Vec<PipelineSpec>,
        reset: &[String],
        generations: Option<&Path>,
    ) -> Result<Processor, ProcessError> {
        let generations = match generations {
            Some(path) => Generations::load(path)?,
            None => Generations::in_memory(),
        };
        let found = plan::Found {
            progress: store.progress()?,
            with_data: store.pipelines_with_data()?,
            generations,
            last_run: last_run::LastRun::Unknown,
            restored: None,
        };
        let plan = plan::decide(&found, &specs, reset)?;
        open::note(&plan.notes);
        open::commit(store, specs, plan)
    }

    /// A processor over `store` as it is, under `specs` (no plan: the settle of a start).
    fn over(
        store: Store,
        specs: Vec<PipelineSpec>,
        progress: Progress,
    ) -> Result<Processor, ProcessError> {
        // Without a record (a new store, or one an older build wrote) nothing is known to
        // have left past the checkpoint.
        let horizon = (store.send_horizon()?.unwrap_or(0)).max(progress.next_offset);
        let durable_next_offset = progress.next_offset;
        let mut engine = Engine::new(specs, progress);
        // Pipelines over one stream share a dedup ledger (issue 33): one entry per input.
        let groups = (engine.ledger_group_candidates().into_iter())
            .filter_map(|members| {
                let names: Vec<&str> = (members.iter())
                    .map(|&p| engine.specs()[p].name.as_str())
                    .collect();
                Some((store.ledger_group_name(&names)?, members))
            })
            .collect();
        engine.set_ledger_groups(groups);
        Ok(Processor {
            // What the store holds is where a crash would resume.
            durable_upsert_backfill: engine.upsert_backfilling(engine.progress()),
            engine,
            store: std::sync::Arc::new(store),
            inflight: None,
            quarantine: None,
            poisoned: false,
            readers: slice::Readers::default(),
            defer_sync: false,
            unsynced_prunes: std::collections::VecDeque::new(),
            key_bound: u64::MAX,
            result_bound: u64::MAX,
            send_slack: 0,
            send_horizon: horizon,
            durable_send_horizon: horizon,
            owed_send_horizon: 0,
            durable_next_offset,
        })
    }

    /// Consult `q` for every record applied from now on, and record a panic's attempt in
    /// it. Entries the checkpoint already settled are pruned first.
    pub(crate) fn set_quarantine(&mut self, mut q: Quarantine) -> Result<(), ProcessError> {
        let file = q.path().to_path_buf();
        q.prune_below(self.settled_below())
            .map_err(|source| ProcessError::Quarantine { file, source })?;
        self.quarantine = Some(q);
        Ok(())
    }

    pub fn quarantine(&self) -> Option<&Quarantine> {
        self.quarantine.as_ref()
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// The next log offset to apply.
    pub fn next_offset(&self) -> Offset {
        self.engine.progress().next_offset
    }

    /// Below this offset every record is settled for every configured pipeline: the live
    /// position, or a backfill's cursor behind it.
    pub fn settled_below(&self) -> Offset {
        settled_below(&self.engine, self.next_offset())
    }

    /// Records applied since the last checkpoint.
    pub fn pending_records(&self) -> u64 {
        self.engine.pending_records()
    }

    /// Results made since the last checkpoint (not those of the checkpoint in flight): see
    /// [`Engine::pending_results`].
    pub fn results_since_checkpoint(&self) -> u64 {
        self.engine.pending_results() as u64
    }

    /// State keys the next checkpoint writes (see [`Engine::pending_keys`]).
    pub fn pending_keys(&self) -> u64 {
        self.engine.pending_keys()
    }

    /// Bound the batch that records applied from the log back (the replay at start,
    /// catch-up, backfill) may build before its checkpoint: the state keys it writes
    /// (`checkpoint.max_keys`) and the results it makes (`checkpoint.max_records`, as the
    /// live loop's schedule counts them). A slice stops at either as at its record count,
    /// and the replay checkpoints there. Without the key bound a slice of 512 records over
    /// 16 pipelines wrote up to 8,192 keys before anyone looked, and the replay at start
    /// looked only at `max_records`: 16 pipelines over 100,000 keys held ~7,000 keys a
    /// checkpoint in a drain and could hold 320,000 in a replay, where the bound says 1,536.
    /// Without the results bound a replay over 16 pipelines held up to 16 × `max_records`
    /// results (issue 33).
    pub fn set_batch_bound(&mut self, max_keys: u64, max_results: u64) {
        self.key_bound = max_keys.max(1);
        self.result_bound = max_results.max(1);
    }

    /// The batch writes as many state keys, or has made as many results, as a slice may
    /// let it (see [`Processor::set_batch_bound`]).
    pub(crate) fn batch_full(&self) -> bool {
        self.pending_keys() >= self.key_bound
            || self.results_since_checkpoint() >= self.result_bound
    }

    /// Apply one record. A stand-in for an oversized input becomes a `too_large` dead
    /// letter; a record whose attempts are used up becomes an `internal` one; anything else
    /// goes through the engine, and a panic there is caught, its attempt recorded, and
    /// returned as [`ProcessError::Panicked`] (the caller must exit).
    pub fn apply(&mut self, rec: &Record) -> Result<Vec<Outcome>, ProcessError> {
        self.apply_at(Target::Live, rec)
    }

    /// [`Processor::apply`] for `target`: live, or one backfilling pipeline (see
    /// [`Processor::backfill_slice`]).
    fn apply_at(&mut self, target: Target, rec: &Record) -> Result<Vec<Outcome>, ProcessError> {
        if self.poisoned {
            return Err(ProcessError::Poisoned);
        }
        if let Some(e) = self.quarantine.as_ref().and_then(|q| {
            q.exhausted(rec.offset)
                .then(|| q.entry(rec.offset))
                .flatten()
        }) {
            let detail = format!(
                "processing panicked on {} attempts (last: {}); set aside so that processing \
                 goes on. This is a bug in Cairn: please report it with this record",
                e.attempts, e.panic
            );
            crate::event!(error, "quarantine_set_aside", offset = rec.offset;
                "quarantine: log record {} (topic `{}`) set aside as a dead letter `internal` \
                 after {} failed attempts (last panic: {}); processing goes on. Please report \
                 this bug with the record (`cairn inspect dead-letters`)",
                rec.offset,
                rec.topic,
                e.attempts,
                e.panic
            );
            let keep = rec.too_large().map_or(&rec.payload[..], |t| t.prefix);
            let base =
                inflight::Layered::new(self.inflight.as_deref().map(|c| &c.batch), &*self.store);
            return Ok(self
                .engine
                .refuse_at(&base, target, rec, "internal", &detail, keep)?);
        }
        let engine = &mut self.engine;
        // The checkpoint in flight, if any, reads as if it had committed.
        let store =
            &inflight::Layered::new(self.inflight.as_deref().map(|c| &c.batch), &*self.store);
        // Unwind safety: after a panic the engine is never used again (`poisoned`), and
        // the store is only read here, so nothing half-changed is observed.
        let run = catch_unwind(AssertUnwindSafe(|| {
            crate::failpoint::panic_at("engine.panic_at_offset", rec.offset);
            match rec.too_large() {
                Some(t) => {
                    let detail = format!(
                        "payload of {} bytes is over log.max_payload ({} bytes); its first {} \
                         bytes are kept",
                        t.size,
                        t.limit,
                        t.prefix.len()
                    );
                    engine.refuse_at(store, target, rec, "too_large", &detail, t.prefix)
                }
                None => engine.apply_at(store, target, rec),
            }
        }));
        match run {
            Ok(outcomes) => Ok(outcomes?),
            Err(payload) => {
                self.poisoned = true;
                let Some(q) = self.quarantine.as_mut() else {
                    std::panic::resume_unwind(payload);
                };
                let message = panic_message(payload.as_ref());
                let file = q.path().to_path_buf();
                let attempts =
                    q.record_attempt(rec.offset, &rec.topic, &message)
                        .map_err(|source| ProcessError::Quarantine {
                            file: file.clone(),
                            source,
                        })?;
                Err(ProcessError::Panicked {
                    offset: rec.offset,
                    topic: rec.topic.clone(),
                    message,
                    attempts,
                    file,
                })
            }
        }
    }

    /// Commit everything applied since the last checkpoint. `None` if nothing was.
    /// On error the engine is ahead of the store: the caller must stop and restart.
    pub fn checkpoint(&mut self, now_ms: u64) -> Result<Option<CheckpointInfo>, ProcessError> {
        self.checkpoint_settled(now_ms, &|_, _| false)
            .map(|c| c.map(|(info, _)| info))
    }

    /// [`Processor::checkpoint`], leaving out of the outbox the outputs `settled` says are
    /// settled: every sink each is routed to sent it before this checkpoint and had it and
    /// everything sent before it acknowledged (issue 14: the outbox stores only
    /// what still needs it). Also returns how many were left out.
    pub fn checkpoint_settled(
        &mut self,
        now_ms: u64,
        settled: &dyn Fn(u64, &crate::model::Output) -> bool,
    ) -> Result<Option<(CheckpointInfo, u64)>, ProcessError> {
        let Some((cp, settled)) = self.begin_checkpoint(settled)? else {
            return Ok(None);
        };
        let dir = self.store.dir().to_path_buf();
        let fp = |name| {
            crate::failpoint::hit(name).map_err(|source| StoreError::Io {
                path: dir.clone(),
                source,
            })
        };
        fp("checkpoint.before_commit")?;
        let info = if self.defer_sync {
            self.store.commit_unsynced(&cp, now_ms)?
        } else {
            self.store.commit(&cp, now_ms)?
        };
        self.checkpoint_committed(&info);
        fp("checkpoint.after_commit")?;
        if !self.defer_sync {
            self.synced(info.next_offset);
        }
        Ok(Some((info, settled)))
    }

    /// Take the checkpoint of everything applied, leaving out the outputs `settled` says
    /// are settled (see [`Processor::checkpoint_settled`]), for a commit beside the caller:
    /// until [`Processor::checkpoint_committed`] it stays a read layer for the engine and
    /// the first part of [`Processor::pending_outputs`], so that processing and publishing
    /// go on while it commits. `None` if nothing was applied. Also returns how many outputs
    /// were left out. One at a time.
    pub(crate) fn begin_checkpoint(
        &mut self,
        settled: &dyn Fn(u64, &crate::model::Output) -> bool,
    ) -> Result<Option<(std::sync::Arc<Checkpoint>, u64)>, ProcessError> {
        if self.poisoned {
            return Err(ProcessError::Poisoned);
        }
        assert!(
            self.inflight.is_none(),
            "one checkpoint in flight at a time"
        );
        if self.engine.pending_records() == 0 {
            return Ok(None);
        }
        let mut cp = self.engine.take_checkpoint();
        let reach = (cp.progress.next_offset).saturating_add(self.send_slack);
        self.send_horizon = self.send_horizon.max(reach);
        cp.batch.send_horizon = Some(self.send_horizon);
        let before = cp.batch.outputs.len();
        cp.batch.outputs.retain(|(seq, out)| !settled(*seq, out));
        let settled = (before - cp.batch.outputs.len()) as u64;
        let cp = std::sync::Arc::new(cp);
        self.inflight = Some(cp.clone());
        Ok(Some((cp, settled)))
    }

    /// The checkpoint in flight committed as `info` (visible in the store; durable once
    /// [`Processor::synced`] says so): the layer goes, and is returned for the caller to
    /// free where it costs least (the agent: on the commit thread).
    pub(crate) fn checkpoint_committed(
        &mut self,
        info: &CheckpointInfo,
    ) -> Option<std::sync::Arc<Checkpoint>> {
        let layer = self.inflight.take();
        if let Some(cp) = &layer {
            self.durable_upsert_backfill = self.engine.upsert_backfilling(&cp.progress);
            let horizon = cp.batch.send_horizon.unwrap_or(0);
            self.durable_send_horizon = self.durable_send_horizon.max(horizon);
        }
        self.durable_next_offset = info.next_offset;
        let store = &self.store;
        self.engine.set_dedup_entries(|name| store.dedup_len(name));
        // The engine's progress is this checkpoint's now; it moves on before the fsync ends.
        let prune = self::settled_below(&self.engine, info.next_offset);
        self.unsynced_prunes.push_back((info.next_offset, prune));
        layer
    }

    /// The checkpoint in flight, if one is.
    pub(crate) fn inflight(&self) -> Option<&Checkpoint> {
        self.inflight.as_deref()
    }

    /// The store, for the thread that commits checkpoints beside the caller.
    pub(crate) fn shared_store(&self) -> std::sync::Arc<Store> {
        self.store.clone()
    }

    /// From now on [`Processor::checkpoint_settled`] leaves the fsync to the caller, who then
    /// calls [`Processor::synced`]: the changes model, which syncs the store itself as the
    /// keeper's thread does for the agent (whose checkpoints go through
    /// [`Processor::begin_checkpoint`] instead). Replay always syncs itself.
    #[cfg(test)]
    pub(crate) fn defer_sync(&mut self) {
        self.defer_sync = true;
    }

    /// Where the quarantine may prune once the checkpoint up to `next_offset` is durable:
    /// below what that checkpoint settled, live and backfill alike.
    fn prune_point(&mut self, next_offset: Offset) -> Offset {
        take_prune_point(&mut self.unsynced_prunes, next_offset)
    }

    /// The checkpoint up to `next_offset` is durable: the quarantine forgets what it settled.
    pub(crate) fn synced(&mut self, next_offset: Offset) {
        let below = self.prune_point(next_offset);
        if let Some(q) = self.quarantine.as_mut() {
            // Settled records are never consulted again; a failed prune only leaves them
            // in the file a little longer (the next checkpoint tries again).
            if let Err(e) = q.prune_below(below) {
                crate::event!(warn, "quarantine_prune_failed"; "quarantine: cannot prune {}: {e}", q.path().display());
            }
        }
    }

    /// Whether results must wait for their checkpoint to be durable before they leave: while
    /// a pipeline that emits upserts backfills, here or in the last durable checkpoint.
    ///
    /// Results leave before their checkpoint because a restart recomputes them: the replay
    /// at start takes every record up to the log's durable end, past anything the run before
    /// applied, and only then is anything sent, so the newest version per key goes out last.
    /// A backfill is not replayed so: a restart resumes it at the last durable cursor and
    /// takes it on between live work, flushing its upserts wherever its slices and the loop
    /// then fall. Those are other points than the run before flushed at, so it emits
    /// versions that run never did, below ones it already sent: a key's results would go
    /// back in version (seen in the soak of 2026-12-07: `win@29/k26/…/119` after `…/121`).
    /// So while one backfills, nothing leaves before it is durable, and a restart resumes
    /// behind everything that went out. Until the checkpoint that records the end of the
    /// backfill is durable too: a crash before it resumes the backfill, whose flushes would
    /// fall behind live results already sent. Changelog and final results do not depend on
    /// flushes, and a backfill of those leaves results early as before.
    ///
    /// The replay at start stops short of the log's end where the outbox is at its bound
    /// (a bound lowered while the agent was down, or deletions of settled results lost in
    /// the crash, put it there sooner than the run before got), and the rest is caught up
    /// with flushes per slice: then too a restart would send versions below ones that went
    /// out. So each checkpoint records a *send horizon*, [`Processor::set_send_slack`] past
    /// its offset, the replay at start goes past the outbox bound up to the last durable
    /// one ([`Processor::replay_owes_send_horizon`]), and results of records at or past it
    /// wait for their checkpoint. The slack covers how far processing runs ahead of the
    /// last durable checkpoint, so live results wait only when checkpoints fall behind.
    pub(crate) fn results_wait_for_checkpoint(&self) -> Option<Wait> {
        if self.owes_send_horizon() {
            return Some(Wait::ReplayOwed);
        }
        if self.durable_upsert_backfill || self.engine.upsert_backfilling(self.engine.progress()) {
            return Some(Wait::UpsertBackfill);
        }
        (self.engine.emits_upserts() && self.next_offset() > self.durable_send_horizon)
            .then_some(Wait::PastSendHorizon)
    }

    /// Whether the replay at start must go on past the outbox bound: a pipeline emits
    /// upserts and the log's records up to the last durable send horizon are not all
    /// applied yet. Results of the run before may have left from any of them (see
    /// [`Processor::results_wait_for_checkpoint`]). It goes at most the slack of that run
    /// past its last durable checkpoint.
    pub(crate) fn replay_owes_send_horizon(&self) -> bool {
        self.engine.emits_upserts() && self.next_offset() < self.durable_send_horizon
    }

    /// After the replay at start, before [`Processor::record_send_horizon`]: whether it
    /// stopped short of where results of the run before may have left from, the last
    /// durable send horizon or `log_end` (the log's durable end at start: the run before
    /// applied nothing past it), with a pipeline that emits upserts. It goes past the
    /// outbox bound, so only a nearly full disk stops it there. Then, until processing gets
    /// there, nothing is sent (durable results too would go back in version) and the
    /// outbox bound does not hold processing ([`Processor::owes_send_horizon`]). Until a
    /// checkpoint there is durable, not only until processing gets there: catch-up flushes
    /// every slice, and the outputs of the last checkpoints before it still hold versions
    /// below the newest; once one is durable, the outbox holds the newest of each key only
    /// (a newer upsert supersedes a waiting one), and what follows is newer still.
    pub(crate) fn owe_send_horizon(&mut self, log_end: Offset) {
        let owed = self.durable_send_horizon.min(log_end);
        if self.engine.emits_upserts() && self.next_offset() < owed {
            self.owed_send_horizon = owed;
        }
    }

    /// Whether the durable checkpoint is still short of what the replay at start owed (see
    /// [`Processor::owe_send_horizon`]).
    pub(crate) fn owes_send_horizon(&self) -> bool {
        self.durable_next_offset < self.owed_send_horizon
    }

    /// The send horizon of the last durable checkpoint (see
    /// [`Processor::results_wait_for_checkpoint`]).
    pub(crate) fn durable_send_horizon(&self) -> Offset {
        self.durable_send_horizon
    }

    /// Results of records up to `2 × max_records` (and a few slices) past a durable
    /// checkpoint may leave before their own checkpoint is durable: what processing runs
    /// ahead at most while one checkpoint commits and the next fills (a size-triggered
    /// checkpoint makes it wait then). Set after the replay at start, which sends nothing.
    pub(crate) fn set_send_slack(&mut self, max_records: u64) {
        self.send_slack = max_records.saturating_mul(2).saturating_add(4096);
    }

    /// Record the send horizon for the live loop, durably, before anything is sent: the
    /// slack past where processing is. Without it, results would wait for the first
    /// checkpoint after a start. Nothing may be in flight (a commit would write its own).
    pub(crate) fn record_send_horizon(&mut self) -> Result<(), ProcessError> {
        assert!(self.inflight.is_none(), "no checkpoint in flight at start");
        let reach = self.next_offset().saturating_add(self.send_slack);
        if reach > self.durable_send_horizon {
            self.store.record_send_horizon(reach)?;
            self.send_horizon = self.send_horizon.max(reach);
            self.durable_send_horizon = reach;
        }
        Ok(())
    }

    /// See [`Engine::upserts_waiting`].
    pub fn upserts_waiting(&self) -> bool {
        self.engine.upserts_waiting()
    }

    /// See [`Engine::next_output_seq`].
    pub fn next_output_seq(&self) -> u64 {
        self.engine.next_output_seq()
    }

    /// Emit the upserts touched since the last flush (see [`Engine::flush_upserts`]).
    pub fn flush_upserts(&mut self) {
        self.engine.flush_upserts();
    }

    /// Outputs not yet in the store, in sequence order: the checkpoint in flight's, then
    /// the engine's (see [`Engine::pending_outputs`]).
    pub fn pending_outputs(&self) -> Pending<'_> {
        Pending::new(
            self.inflight.as_ref().map_or(&[], |c| &c.batch.outputs[..]),
            self.engine.pending_outputs(),
        )
    }

    /// See [`Engine::pending_results`]; with the outputs of the checkpoint in flight.
    pub fn pending_results(&self) -> usize {
        let inflight = self.inflight.as_ref().map_or(0, |c| c.batch.outputs.len());
        self.engine.pending_results().saturating_add(inflight)
    }

    /// What Sparkplug sessions reported since the last call (see [`Engine::take_notices`]):
    /// the live loop acts on them; after the replay at start they are dropped, since a
    /// rebirth request is sent only for what the live loop saw.
    pub fn take_notices(&mut self) -> Vec<crate::pipeline::sparkplug::Notice> {
        self.engine.take_notices()
    }
}

/// Outputs not yet in the store, in sequence order (see [`Processor::pending_outputs`]):
/// those of the checkpoint in flight, then those applied since.
#[derive(Debug, Clone, Copy)]
pub struct Pending<'a>(&'a [(u64, Output)], &'a [(u64, Output)]);

impl<'a> Pending<'a> {
    /// `inflight`'s outputs, then `applied`'s (each in sequence order, the first all below
    /// the second).
    pub(crate) fn new(inflight: &'a [(u64, Output)], applied: &'a [(u64, Output)]) -> Self {
        Pending(inflight, applied)
    }

    /// All of them, in sequence order.
    pub fn iter(self) -> impl Iterator<Item = &'a (u64, Output)> {
        self.0.iter().chain(self.1)
    }

    /// Those with a sequence number from `seq` on.
    pub fn from(self, seq: u64) -> impl Iterator<Item = &'a (u64, Output)> {
        let a = self.0.partition_point(|(s, _)| *s < seq);
        let b = self.1.partition_point(|(s, _)| *s < seq);
        self.0[a..].iter().chain(&self.1[b..])
    }

    /// The output with sequence number `seq`, if it is here.
    pub fn find(self, seq: u64) -> Option<&'a Output> {
        self.from(seq)
            .next()
            .filter(|(s, _)| *s == seq)
            .map(|(_, o)| o)
    }

    /// The lowest sequence number here.
    pub fn first_seq(self) -> Option<u64> {
        self.iter().next().map(|(s, _)| *s)
    }

    pub fn len(self) -> usize {
        self.0.len() + self.1.len()
    }

    pub fn is_empty(self) -> bool {
        self.len() == 0
    }
}

/// The lowest of `live` and the backfill cursors of the configured pipelines.
/// Pop the checkpoints made durable by the one up to `next_offset` (each committed one is
/// queued with what it settled) and return where the quarantine may prune: what the newest
/// of them settled. None queued (not expected): prune nothing.
fn take_prune_point(
    queue: &mut std::collections::VecDeque<(Offset, Offset)>,
    next_offset: Offset,
) -> Offset {
    let mut below = 0;
    while let Some(&(next, prune)) = queue.front() {
        if next > next_offset {
            break;
        }
        below = prune.min(next_offset);
        queue.pop_front();
    }
    below
}

fn settled_below(engine: &Engine, live: Offset) -> Offset {
    engine
        .backfills()
        .map(|(_, b)| b.next)
        .fold(live, Offset::min)
}

#[cfg(test)]
mod tests {
    use super::{Processor, Wait, take_prune_point};
    use crate::model::Record;
    use crate::store::Store;
    use std::collections::VecDeque;

    fn spec(emit: &str) -> crate::pipeline::spec::PipelineSpec {
        crate::config::pipeline_from_toml(&format!(
            "name = \"p\"\ntopics = [\"t/#\"]\nformat = \"delimited\"\nevent_id = \"0\"\n\
             key = \"1\"\nvalue = \"2\"\naggregate = \"sum\"\nemit = \"{emit}\"\n\
             output_topic = \"p/{{key}}\"\n"
        ))
        .unwrap()
    }

    fn apply(proc: &mut Processor, offsets: std::ops::Range<u64>) {
        for offset in offsets {
            let rec = Record {
                offset,
                received_at_ms: 1,
                topic: "t/x".into(),
                payload: format!("e{offset},k{},1", offset % 3).into_bytes(),
                qos: 1,
                retain: false,
            };
            proc.apply(&rec).unwrap();
        }
    }

    /// Results of records past the last durable send horizon wait for their checkpoint; a
    /// checkpoint records a horizon past its offset, the start records one before anything
    /// is sent, it survives a reopen and never goes back, and a config without upserts
    /// ignores it (their IDs do not depend on where flushes fall).
    #[test]
    fn results_past_the_durable_send_horizon_wait_until_a_checkpoint_records_one_past_them() {
        let dir = tempfile::tempdir().unwrap();
        let open = || Store::open(dir.path(), 1 << 20, crate::fsio::real()).unwrap();
        let mut proc = Processor::open(open(), vec![spec("upsert")]).unwrap();
        assert_eq!(proc.durable_send_horizon(), 0, "a new store records none");
        // The replay at start: no slack, nothing sent.
        apply(&mut proc, 0..3);
        assert_eq!(
            proc.results_wait_for_checkpoint(),
            Some(Wait::PastSendHorizon)
        );
        proc.set_send_slack(3);
        assert_eq!(proc.send_slack, 4102, "2 × max_records + 4,096");
        proc.send_slack = 10;
        proc.record_send_horizon().unwrap();
        assert_eq!(proc.durable_send_horizon(), 13);
        assert_eq!(proc.results_wait_for_checkpoint(), None);
        apply(&mut proc, 3..13);
        assert_eq!(
            proc.results_wait_for_checkpoint(),
            None,
            "record 12 is below 13"
        );
        apply(&mut proc, 13..14);
        assert_eq!(
            proc.results_wait_for_checkpoint(),
            Some(Wait::PastSendHorizon)
        );
        proc.checkpoint(0).unwrap().unwrap();
        assert_eq!(proc.durable_send_horizon(), 24, "14 + 10");
        assert_eq!(proc.results_wait_for_checkpoint(), None);
        // A smaller slack later (a reload) never moves the horizon back.
        proc.send_slack = 1;
        apply(&mut proc, 14..16);
        proc.checkpoint(0).unwrap().unwrap();
        assert_eq!(proc.durable_send_horizon(), 24);
        drop(proc);

        let mut proc = Processor::open(open(), vec![spec("upsert")]).unwrap();
        assert_eq!(proc.durable_send_horizon(), 24, "read back from the store");
        assert!(proc.replay_owes_send_horizon(), "offset 16 is below 24");
        // A replay stopped at 16 (the disk) with the log's end at 20: nothing leaves until a
        // checkpoint at 20 is durable, not when processing gets there.
        proc.owe_send_horizon(20);
        assert_eq!(proc.results_wait_for_checkpoint(), Some(Wait::ReplayOwed));
        apply(&mut proc, 16..20);
        assert!(proc.owes_send_horizon());
        proc.checkpoint(0).unwrap().unwrap();
        assert!(!proc.owes_send_horizon());
        assert_eq!(proc.results_wait_for_checkpoint(), None);
        drop(proc);
        let proc = Processor::open(open(), vec![spec("changelog")]).unwrap();
        assert!(!proc.replay_owes_send_horizon());
        assert_eq!(proc.results_wait_for_checkpoint(), None);
    }

    #[test]
    fn the_quarantine_prunes_only_what_a_durable_checkpoint_settled() {
        // Two checkpoints committed before the fsync ends: up to 100 (a backfill cursor
        // holding 40) and up to 200 (the cursor at 150).
        let mut q = VecDeque::from([(100, 40), (200, 150)]);
        assert_eq!(
            take_prune_point(&mut q, 100),
            40,
            "the backfill cursor, not 100"
        );
        assert_eq!(q.len(), 1, "the later checkpoint is not durable yet");
        assert_eq!(take_prune_point(&mut q, 200), 150);
        assert!(q.is_empty());
        assert_eq!(
            take_prune_point(&mut q, 300),
            0,
            "nothing queued: nothing pruned"
        );
        let mut q = VecDeque::from([(100, 100), (200, 200)]);
        assert_eq!(take_prune_point(&mut q, 250), 200, "one fsync covers both");
    }
}
