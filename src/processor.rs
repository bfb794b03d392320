//! The processor: feeds log records through the pipeline engine and commits checkpoints to
//! the store. It decides nothing by the clock; the agent tells it when to checkpoint.
//!
//! Recovery is replay (invariant 4): [`Processor::open`] loads the last checkpoint, and
//! [`Processor::replay`] re-applies every durable log record from its `next_offset`. Nothing
//! else is read and nothing else is trusted.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;
use std::time::Instant;

use crate::log::{Log, LogError};
use crate::model::{Offset, Record};
use crate::pipeline::engine::{Engine, Outcome, PipelineProgress, definition};
use crate::pipeline::spec::PipelineSpec;
use crate::quarantine::{MAX_ATTEMPTS, Quarantine};
use crate::store::{CheckpointInfo, Store, StoreError};

#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Log(#[from] LogError),
    #[error("{0}")]
    Read(#[from] crate::pipeline::engine::ReadError),
    #[error("--reset-pipeline {name}: no pipeline of that name in the config")]
    UnknownReset { name: String },
    #[error(
        "pipeline `{name}` changed in a way that would misread its stored state \
         (was {stored}, now {current}); restore the old definition, or reset the pipeline's state \
         with `cairn run --reset-pipeline {name}`"
    )]
    IncompatiblePipeline {
        name: String,
        stored: String,
        current: String,
    },
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
}

pub struct Processor {
    engine: Engine,
    store: Store,
    /// Failed attempts per log offset (see [`crate::quarantine`]). Without one (library
    /// use, tests) a panic propagates as it always did.
    quarantine: Option<Quarantine>,
    /// Set when a panic was caught: the engine may be half-way through a change.
    poisoned: bool,
}

impl Processor {
    /// Load the last checkpoint. Refuses a pipeline whose stored definition differs from the
    /// configured one unless it is named in `reset` (issue 6 wires the reset itself).
    pub fn open(store: Store, specs: Vec<PipelineSpec>) -> Result<Processor, ProcessError> {
        Processor::open_with_reset(store, specs, &[])
    }

    /// Load the last checkpoint. A pipeline whose stored definition differs from the
    /// configured one is refused, unless it is named in `reset`: then its state and dedup
    /// ledger are dropped (durably, before anything else happens) and it starts empty from
    /// the checkpoint's offset, its versions continuing above the old ones.
    pub fn open_with_reset(
        store: Store,
        specs: Vec<PipelineSpec>,
        reset: &[String],
    ) -> Result<Processor, ProcessError> {
        let mut progress = store.progress()?;
        for name in reset {
            if !specs.iter().any(|s| &s.name == name) {
                return Err(ProcessError::UnknownReset { name: name.clone() });
            }
        }
        for spec in &specs {
            let Some(i) = progress.pipelines.iter().position(|p| p.name == spec.name) else {
                continue;
            };
            let current = definition(spec);
            if reset.contains(&spec.name) {
                let old = progress.pipelines[i].clone();
                progress.pipelines[i] = PipelineProgress::reset(&old, spec);
                store.reset_pipeline(&spec.name, &progress)?;
                log::warn!(
                    "pipeline `{}` reset: {} keys and {} dedup entries dropped; versions continue above {}",
                    spec.name,
                    old.keys,
                    old.dedup_entries,
                    old.max_version
                );
            } else if progress.pipelines[i].definition != current {
                return Err(ProcessError::IncompatiblePipeline {
                    name: spec.name.clone(),
                    stored: progress.pipelines[i].definition.clone(),
                    current,
                });
            }
        }
        Ok(Processor {
            engine: Engine::new(specs, progress),
            store,
            quarantine: None,
            poisoned: false,
        })
    }

    /// Consult `q` for every record applied from now on, and record a panic's attempt in
    /// it. Entries the checkpoint already settled are pruned first.
    pub fn set_quarantine(&mut self, mut q: Quarantine) -> Result<(), ProcessError> {
        let file = q.path().to_path_buf();
        q.prune_below(self.next_offset())
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

    /// Records applied since the last checkpoint.
    pub fn pending_records(&self) -> u64 {
        self.engine.pending_records()
    }

    /// Apply one record. A stand-in for an oversized input becomes a `too_large` dead
    /// letter; a record whose attempts are used up becomes an `internal` one; anything else
    /// goes through the engine, and a panic there is caught, its attempt recorded, and
    /// returned as [`ProcessError::Panicked`] (the caller must exit).
    pub fn apply(&mut self, rec: &Record) -> Result<Vec<Outcome>, ProcessError> {
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
            log::error!(
                "quarantine: log record {} (topic `{}`) set aside as a dead letter `internal` \
                 after {} failed attempts (last panic: {}); processing goes on. Please report \
                 this bug with the record (`cairn inspect dead-letters`)",
                rec.offset,
                rec.topic,
                e.attempts,
                e.panic
            );
            let keep = rec.too_large().map_or(&rec.payload[..], |t| t.prefix);
            return Ok(self
                .engine
                .refuse(&self.store, rec, "internal", &detail, keep)?);
        }
        let (engine, store) = (&mut self.engine, &self.store);
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
                    engine.refuse(store, rec, "too_large", &detail, t.prefix)
                }
                None => engine.apply(store, rec),
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
        if self.poisoned {
            return Err(ProcessError::Poisoned);
        }
        if self.engine.pending_records() == 0 {
            return Ok(None);
        }
        let cp = self.engine.take_checkpoint();
        let fp = |name| {
            crate::failpoint::hit(name).map_err(|source| StoreError::Io {
                path: self.store.dir().to_path_buf(),
                source,
            })
        };
        fp("checkpoint.before_commit")?;
        let info = self.store.commit(&cp, now_ms)?;
        let store = &self.store;
        self.engine.set_dedup_entries(|name| store.dedup_len(name));
        fp("checkpoint.after_commit")?;
        if let Some(q) = self.quarantine.as_mut() {
            // Settled records are never consulted again; a failed prune only leaves them
            // in the file a little longer (the next checkpoint tries again).
            if let Err(e) = q.prune_below(info.next_offset) {
                log::warn!("quarantine: cannot prune {}: {e}", q.path().display());
            }
        }
        Ok(Some(info))
    }

    /// Re-apply every durable record from the checkpoint's `next_offset`, committing every
    /// `max_records`. `progress` is called after each checkpoint (for STATUS lines).
    pub fn replay(
        &mut self,
        log: &Log,
        max_records: u64,
        now_ms: &dyn Fn() -> u64,
        progress: &mut dyn FnMut(&ReplayStats),
    ) -> Result<ReplayStats, ProcessError> {
        let started = Instant::now();
        let from = self.next_offset();
        if from < log.first_offset() && log.durable_next() > log.first_offset() {
            return Err(ProcessError::LogGap {
                needed: from,
                first: log.first_offset(),
            });
        }
        let mut stats = ReplayStats {
            from,
            to: from,
            ..Default::default()
        };
        for rec in log.read_from(from)? {
            let rec = rec?;
            self.apply(&rec)?;
            stats.records += 1;
            stats.to = rec.offset + 1;
            if self.pending_records() >= max_records {
                self.checkpoint(now_ms())?;
                stats.checkpoints += 1;
                stats.millis = started.elapsed().as_millis() as u64;
                progress(&stats);
            }
        }
        if self.checkpoint(now_ms())?.is_some() {
            stats.checkpoints += 1;
        }
        stats.millis = started.elapsed().as_millis() as u64;
        Ok(stats)
    }
}
