//! Format 2's progress record, read to load an older store (see the module docs).

use serde::Deserialize;

use crate::model;

/// Counters before `where` filters (issue 15) added `filtered`.
#[derive(Deserialize)]
struct Counters {
    applied: u64,
    duplicates: u64,
    dead_letters: u64,
    outputs: u64,
}

#[derive(Deserialize)]
pub(super) struct Progress {
    next_offset: u64,
    checkpoint_id: u64,
    log_clock_ms: u64,
    records: u64,
    unmatched: u64,
    outbox_seq: u64,
    pipelines: Vec<PipelineProgress>,
}

#[derive(Deserialize)]
struct PipelineProgress {
    name: String,
    max_event_time_ms: u64,
    evicted_below: u64,
    keys: u64,
    dedup_entries: u64,
    counters: Counters,
    definition: String,
    version_base: u64,
    max_version: u64,
}

impl From<Progress> for model::Progress {
    fn from(p: Progress) -> model::Progress {
        model::Progress {
            next_offset: p.next_offset,
            checkpoint_id: p.checkpoint_id,
            log_clock_ms: p.log_clock_ms,
            records: p.records,
            unmatched: p.unmatched,
            outbox_seq: p.outbox_seq,
            pipelines: p
                .pipelines
                .into_iter()
                .map(|pp| model::PipelineProgress {
                    name: pp.name,
                    max_event_time_ms: pp.max_event_time_ms,
                    evicted_below: pp.evicted_below,
                    keys: pp.keys,
                    dedup_entries: pp.dedup_entries,
                    counters: model::Counters {
                        applied: pp.counters.applied,
                        duplicates: pp.counters.duplicates,
                        dead_letters: pp.counters.dead_letters,
                        outputs: pp.counters.outputs,
                        filtered: 0,
                    },
                    definition: pp.definition,
                    version_base: pp.version_base,
                    max_version: pp.max_version,
                    // Every result a format-2 store made went out without a generation.
                    generation: 1,
                    backfill: None,
                })
                .collect(),
        }
    }
}
