//! The processor core: `apply(record)` over a read-only view of the last checkpoint plus
//! an in-memory overlay of everything applied since. Pure and deterministic: the same
//! checkpoint and the same log records give the same write set, byte for byte (with the
//! upserts flushed at the same points: a flush changes which versions are emitted, never an
//! ID's payload).
//!
//! Why one file of ~780 lines: the apply path (dedup, slots, next state, emit, eviction,
//! and the backfill target that routes a record to one pipeline) is one state machine over
//! the engine's private overlay; split across files, each step would need that overlay
//! opened to its siblings. The plain data it produces lives in
//! [`crate::model`].

use std::collections::BTreeMap;

use super::batch_ledger::BatchLedger;
use super::bound::{KeyBytes, result_bytes};
use super::field::Format;
use super::num::Num;
use super::parse::{Parsed, parse};
use super::refusal::Refusal;
use super::sparkplug::session::{Entry, Notice};
use super::spec::{Aggregate, Emit, PipelineSpec};
use super::state_key::{at, at_mut};
use super::topic::{check_publish_topic, escape_key, matches, render};
use super::value::{Extra, KeyState};

/// The Sparkplug B room of the engine: one record, many events (`sparkplug/records.rs`).
#[path = "sparkplug/records.rs"]
mod sparkplug_records;
use crate::model::{Backfill, DeadLetter, Output, PipelineProgress, Progress};
use crate::model::{DEAD_LETTER_KEY_ROOM, MAX_ENTRY_BYTES, Record};

/// Longest payload prefix kept in a dead letter.
pub(crate) const DEAD_LETTER_PAYLOAD_MAX: usize = 1024;

/// How many windows back a new twa window looks for the value in effect at its start (and
/// forward, to hand a changed end value on): a metric that reports by exception may be
/// silent for many windows. Each step is one state lookup, made only when a window is new
/// or an older window's end value changes.
pub(crate) const TWA_LOOKBACK_WINDOWS: usize = 32;

/// Most Sparkplug notices kept for the live loop between two takes (more are dropped: they
/// only ask for rebirths, which are rate limited anyway).
pub const NOTICES_MAX: usize = 1024;

/// A failure to read the checkpointed state (an I/O or corruption error in the store).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("reading checkpointed state: {0}")]
pub struct ReadError(pub String);

/// Read-only access to the last durable checkpoint. The store implements it over sled; the
/// model tests over a `BTreeMap`.
pub trait ReadState {
    fn state(&self, pipeline: &str, skey: &[u8]) -> Result<Option<KeyState>, ReadError>;
    /// Record time (ms) at which `event_id` was first accepted, if it is in the ledger.
    fn dedup(&self, pipeline: &str, event_id: &str) -> Result<Option<u64>, ReadError>;
    /// State keys of a windowed pipeline whose window start lies in `[from, to)`.
    fn window_keys(&self, pipeline: &str, from: u64, to: u64) -> Result<Vec<Vec<u8>>, ReadError>;
    /// A Sparkplug session entry of `pipeline` (see [`super::sparkplug::session`]).
    fn sparkplug(&self, pipeline: &str, key: &[u8]) -> Result<Option<Entry>, ReadError>;
    /// The keys of `pipeline`'s Sparkplug entries that start with `prefix`, in order.
    fn sparkplug_keys(&self, pipeline: &str, prefix: &[u8]) -> Result<Vec<Vec<u8>>, ReadError>;
}

impl PipelineProgress {
    /// The progress of a pipeline that starts empty in `generation`.
    pub fn new(spec: &PipelineSpec, generation: u32) -> PipelineProgress {
        PipelineProgress {
            name: spec.name.clone(),
            definition: definition(spec),
            generation,
            ..Default::default()
        }
    }

    /// The progress of a pipeline whose state is reset: empty, in a new `generation`, with
    /// versions continuing above everything it emitted before.
    pub fn reset(old: &PipelineProgress, spec: &PipelineSpec, generation: u32) -> PipelineProgress {
        PipelineProgress {
            version_base: old.max_version,
            max_version: old.max_version,
            ..PipelineProgress::new(spec, generation)
        }
    }

    /// What output IDs start with: the name, and from generation 2 on `@generation`.
    /// Pipeline names cannot contain `@`, so no generation's prefix is another pipeline's.
    pub(crate) fn id_prefix(&self) -> String {
        if self.generation > 1 {
            format!("{}@{}", self.name, self.generation)
        } else {
            self.name.clone()
        }
    }
}

/// The write set of one checkpoint, in a deterministic order. It stays here, beside the
/// engine, rather than in [`crate::model`]: it holds the pipeline's [`KeyState`], and `model`
/// depends on no other module.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Batch {
    /// `None` deletes (an evicted window).
    pub state: BTreeMap<(String, Vec<u8>), Option<KeyState>>,
    /// Ledger entries recorded by this batch: (pipeline, event ID) → record time (ms) it
    /// was accepted at. An ID accepted again after its entry expired is recorded again.
    pub dedup: BatchLedger,
    /// Per pipeline: ledger entries first seen at or before this record time have expired
    /// (no later record can be their duplicate) and may be forgotten. The store forgets them
    /// in whole chunks, so some live on a little longer; dedup decisions never depend on
    /// when an entry is forgotten, only on its recorded time.
    pub dedup_expired_at_or_before: Vec<(String, u64)>,
    /// Every configured pipeline's dedup window (ms): the store records them, so that the
    /// ledger of a pipeline no longer configured still expires by its own window.
    pub dedup_windows: Vec<(String, u64)>,
    pub outputs: Vec<(u64, Output)>,
    pub dead_letters: Vec<DeadLetter>,
    /// Records applied into this batch.
    pub records: u64,
    /// Sparkplug session entries: (pipeline, key) → entry; `None` deletes.
    pub sparkplug: BTreeMap<(String, Vec<u8>), Option<Entry>>,
    /// The send horizon to record (a log offset; `None`: leave the stored one), set by the
    /// processor (see `Processor::results_wait_for_checkpoint`).
    pub send_horizon: Option<u64>,
    /// The shared ledgers the store writes this batch's entries into (see
    /// [`Engine::set_ledger_groups`]): each one's name and its members' pipeline names.
    pub ledger_groups: Vec<(String, Vec<String>)>,
}

/// A complete checkpoint: the progress after it, and the writes that reach it.
#[derive(Debug, Clone, PartialEq)]
pub struct Checkpoint {
    pub progress: Progress,
    pub batch: Batch,
}

/// The parts of a definition that give stored state its meaning. A change to any of them
/// would misread what is stored.
pub fn definition(spec: &PipelineSpec) -> String {
    serde_json::json!({
        "format": spec.format, "event_id": spec.event_id, "key": spec.key, "value": spec.value,
        "event_time": spec.event_time, "aggregate": spec.aggregate, "window": spec.window,
    })
    .to_string()
}

/// Most bytes the progress record takes with `specs` configured and nothing dormant, whatever
/// its counters reach: every number at its longest varint, each pipeline's name and
/// definition as they are (see [`Progress`] and [`PipelineProgress`] for the layout).
pub fn progress_bytes(specs: &[PipelineSpec]) -> usize {
    // next_offset, checkpoint_id, log_clock_ms, records, unmatched, outbox_seq; the list's
    // length.
    let fixed = 6 * 10 + 5;
    specs.iter().fold(fixed, |sum, spec| {
        // Eight u64 (times, keys, ledger entries, two versions), five counters, a u32
        // generation, two string lengths.
        let numbers = 8 * 10 + 5 * 10 + 5 + 2 * 5;
        sum.saturating_add(numbers + spec.name.len() + definition(spec).len())
    })
}

/// Which pipelines a record goes to: every matching one that is live, or one backfilling
/// pipeline (which takes records behind the live position, in log order, until it joins).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    Live,
    Backfill(usize),
}

/// What became of one record in one pipeline.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Applied {
        key: String,
        version: u64,
    },
    Duplicate,
    DeadLetter {
        reason: &'static str,
    },
    /// The `where` filter did not match: skipped, counted, not a dead letter.
    Filtered,
}

pub struct Engine {
    specs: Vec<PipelineSpec>,
    progress: Progress,
    batch: Batch,
    /// Upsert mode: each key touched since the last flush, with its output topic. Its
    /// newest state is the batch's, read at the flush; a state evicted from the batch
    /// before then (a window closed) is kept here instead. Holding a second copy of every
    /// touched state cost a clone per pipeline and event: 8 KiB for a full percentile
    /// sketch before sketches were packed (issue 33).
    touched: BTreeMap<(usize, Vec<u8>), (String, Option<KeyState>)>,
    /// What Sparkplug sessions had to say since the live loop last took them (see
    /// [`Engine::take_notices`]); not part of any checkpoint.
    notices: Vec<Notice>,
    /// Shared ledgers: each one's name and its members (indexes into `specs`).
    ledger_groups: Vec<(String, Vec<usize>)>,
    /// The batch's stored rows (a key's states of every pipeline): per key, its states in
    /// the batch and their bytes at most when they entered it; and their weight in all
    /// ([`Engine::pending_keys`]).
    rows: std::collections::HashMap<Vec<u8>, (u64, u64)>,
    rows_weight: u64,
}

impl Engine {
    /// Start from a checkpoint's progress. Pipelines new to the checkpoint start empty (in
    /// generation 1; [`crate::processor::Processor`] assigns generations before this). The
    /// progress of stored pipelines that are not configured is kept, untouched, after the
    /// configured ones: dropping it would forget which definition wrote their state.
    pub fn new(specs: Vec<PipelineSpec>, mut progress: Progress) -> Engine {
        let mut stored = std::mem::take(&mut progress.pipelines);
        let mut pipelines = Vec::with_capacity(specs.len().max(stored.len()));
        for spec in &specs {
            let p = match stored.iter().position(|p| p.name == spec.name) {
                Some(i) => stored.remove(i),
                None => PipelineProgress::new(spec, 1),
            };
            pipelines.push(p);
        }
        pipelines.append(&mut stored);
        progress.pipelines = pipelines;
        let batch = fresh_batch(&specs);
        Engine {
            specs,
            progress,
            batch,
            touched: BTreeMap::new(),
            notices: Vec::new(),
            ledger_groups: Vec::new(),
            rows: Default::default(),
            rows_weight: 0,
        }
    }

    /// The pipelines that may share a dedup ledger, as sets of two or more (indexes into the
    /// specs, in order): those that read the same topics, live (not backfilling: a backfill
    /// has a clock of its own) and not Sparkplug B (whose entries are a session's, not a
    /// stream's). Pipelines that read one stream nearly always accept the same IDs at the
    /// same record time; the store then writes one ledger entry per ID for all of them,
    /// instead of one per pipeline (issue 33: 16 pipelines over one stream held 16 entries
    /// per input, in memory and on disk, and 16 lookups).
    pub fn ledger_group_candidates(&self) -> Vec<Vec<usize>> {
        let mut by_topics: BTreeMap<Vec<String>, Vec<usize>> = BTreeMap::new();
        for (p, spec) in self.specs.iter().enumerate() {
            if spec.format == Format::SparkplugB || self.progress.pipelines[p].backfill.is_some() {
                continue;
            }
            let mut topics = spec.topics.clone();
            topics.sort();
            topics.dedup();
            by_topics.entry(topics).or_default().push(p);
        }
        by_topics.into_values().filter(|m| m.len() >= 2).collect()
    }

    /// Share dedup ledgers: from now on, an ID that every member of a group accepts at one
    /// record time is one ledger entry in the store, owned by the group's name (which the
    /// store gives, [`crate::store::Store::ledger_group_name`]). Decisions do not change:
    /// the store answers a pipeline's lookup from its own entries and its groups'
    /// ([`ReadState::dedup`]). Members must be live and stay so for the engine's life: a
    /// group's entries expire by the log clock.
    pub fn set_ledger_groups(&mut self, groups: Vec<(String, Vec<usize>)>) {
        self.ledger_groups = groups;
        self.batch.ledger_groups = self.ledger_group_names();
    }

    /// The configured pipelines, in order.
    pub fn specs(&self) -> &[PipelineSpec] {
        &self.specs
    }

    fn ledger_group_names(&self) -> Vec<(String, Vec<String>)> {
        (self.ledger_groups.iter())
            .map(|(g, m)| {
                let names = m.iter().map(|&p| self.specs[p].name.clone()).collect();
                (g.clone(), names)
            })
            .collect()
    }

    /// What Sparkplug sessions reported (seq gaps, unknown metrics, DATA without a session)
    /// since the last call, for the live loop to count, log and answer; at most
    /// [`NOTICES_MAX`] wait (replay's are dropped by the caller: a rebirth request is sent
    /// only by the live loop).
    pub fn take_notices(&mut self) -> Vec<Notice> {
        std::mem::take(&mut self.notices)
    }

    pub fn progress(&self) -> &Progress {
        &self.progress
    }

    /// Records applied since the last checkpoint.
    pub fn pending_records(&self) -> u64 {
        self.batch.records
    }

    /// What the next checkpoint writes, in keys: each stored row it writes (a key's states
    /// of every pipeline) weighs one per KiB of its states, at least one and at most one per
    /// state; Sparkplug session entries one each.
    ///
    /// A checkpoint's transaction holds a copy of a row's leaf per row written, so memory
    /// grows with the bytes of the rows, not their states: counted per state, 16 pipelines
    /// of a few numbers each over 1,000 keys took a checkpoint every ~96 records and wrote
    /// nearly every state they touched, where one pipeline writes each key once per 20
    /// records (issue 33: ×32 one pipeline's CPU). Counted per row regardless of size,
    /// rows of 16 percentile sketches took the peak to 157 MiB; so large rows still count
    /// by their bytes, and no row counts more than its states did.
    pub fn pending_keys(&self) -> u64 {
        self.rows_weight + self.batch.sparkplug.len() as u64
    }

    /// Count a state the batch did not hold into its row's weight.
    fn weigh_row(&mut self, skey: &[u8], state: Option<&KeyState>) {
        let bytes = state.map_or(0, |s| s.stored_bound() as u64);
        let weight = |(states, bytes): (u64, u64)| bytes.div_ceil(1024).clamp(1, states.max(1));
        let (before, after) = match self.rows.get_mut(skey) {
            Some(row) => {
                let before = weight(*row);
                *row = (row.0 + 1, row.1.saturating_add(bytes));
                (before, weight(*row))
            }
            None => {
                self.rows.insert(skey.to_vec(), (1, bytes));
                (0, weight((1, bytes)))
            }
        };
        self.rows_weight = self.rows_weight.saturating_sub(before) + after;
    }

    /// Apply one log record to every pipeline whose topic filter matches it. The record must
    /// be the next one in the log: `record.offset >= progress.next_offset` (gaps are allowed
    /// only where a repair removed records).
    pub fn apply<R: ReadState>(
        &mut self,
        base: &R,
        rec: &Record,
    ) -> Result<Vec<Outcome>, ReadError> {
        self.apply_at(base, Target::Live, rec)
    }

    /// [`Engine::apply`] for `target`: live, or one backfilling pipeline. A backfill record
    /// must be the pipeline's next (`>= backfill.next`) and lie behind the live position.
    pub fn apply_at<R: ReadState>(
        &mut self,
        base: &R,
        target: Target,
        rec: &Record,
    ) -> Result<Vec<Outcome>, ReadError> {
        self.each_matching(target, rec, |e, p| e.apply_one(base, p, rec))
    }

    /// The configured pipelines still backfilling, in config order, with their cursors.
    pub fn backfills(&self) -> impl Iterator<Item = (usize, Backfill)> + '_ {
        self.progress.pipelines[..self.specs.len()]
            .iter()
            .enumerate()
            .filter_map(|(p, pp)| pp.backfill.map(|b| (p, b)))
    }

    /// Whether `progress` (the engine's own, or a checkpoint's) has a configured pipeline
    /// that emits upserts backfilling. Which of its versions go out depends on where its
    /// flushes fall, and a backfill resumed after a crash flushes elsewhere than the run
    /// before it did (see `Processor::results_wait_for_checkpoint`).
    pub fn upsert_backfilling(&self, progress: &Progress) -> bool {
        (self.specs.iter().zip(&progress.pipelines))
            .any(|(spec, pp)| pp.backfill.is_some() && spec.emit == Emit::Upsert)
    }

    /// Whether a configured pipeline emits upserts: which of its versions go out depends on
    /// where its flushes fall (see `Processor::results_wait_for_checkpoint`).
    pub fn emits_upserts(&self) -> bool {
        self.specs.iter().any(|spec| spec.emit == Emit::Upsert)
    }

    /// End pipeline `p`'s backfill: it has taken every record behind the live position, and
    /// takes live records from now on. Replay decides the same: the ending is part of the
    /// progress the next checkpoint records.
    pub fn finish_backfill(&mut self, p: usize) {
        self.progress.pipelines[p].backfill = None;
    }

    /// The record time pipeline `p` measures its dedup window with: the log clock, or while
    /// it backfills, the newest time of receipt it has taken.
    fn clock(&self, p: usize) -> u64 {
        match self.progress.pipelines[p].backfill {
            Some(b) => b.clock_ms,
            None => self.progress.log_clock_ms,
        }
    }

    /// Move progress past `rec` and run `f` for every pipeline whose topic filter matches
    /// it. [`Engine::apply`] and [`Engine::refuse`] both go through here, so a record set
    /// aside moves progress exactly as a processed one does, and replay agrees.
    fn each_matching(
        &mut self,
        target: Target,
        rec: &Record,
        mut f: impl FnMut(&mut Engine, usize) -> Result<Outcome, ReadError>,
    ) -> Result<Vec<Outcome>, ReadError> {
        if let Target::Backfill(p) = target {
            return self.backfill_one(p, rec, f);
        }
        assert!(
            rec.offset >= self.progress.next_offset,
            "record {} applied twice (next is {})",
            rec.offset,
            self.progress.next_offset
        );
        self.progress.next_offset = rec.offset + 1;
        self.progress.records += 1;
        self.progress.log_clock_ms = self.progress.log_clock_ms.max(rec.received_at_ms);
        self.batch.records += 1;
        let mut outcomes = Vec::new();
        let mut matched = false;
        for p in 0..self.specs.len() {
            if self.specs[p].topics.iter().any(|t| matches(t, &rec.topic)) {
                matched = true;
                // A backfilling pipeline takes this record later, from the log, in order.
                if self.progress.pipelines[p].backfill.is_none() {
                    outcomes.push(f(self, p)?);
                }
            }
        }
        if !matched {
            self.progress.unmatched += 1;
        }
        Ok(outcomes)
    }

    /// One record behind the live position, for backfilling pipeline `p` alone: move its
    /// cursor and clock, apply if its topic filter matches, and join live processing once
    /// the cursor reaches the live position.
    fn backfill_one(
        &mut self,
        p: usize,
        rec: &Record,
        mut f: impl FnMut(&mut Engine, usize) -> Result<Outcome, ReadError>,
    ) -> Result<Vec<Outcome>, ReadError> {
        let live = self.progress.next_offset;
        let b = self.progress.pipelines[p]
            .backfill
            .as_mut()
            .expect("backfill record for a pipeline that is not backfilling");
        assert!(
            rec.offset >= b.next && rec.offset < live,
            "backfill record {} out of order (next {}, live position {live})",
            rec.offset,
            b.next
        );
        b.next = rec.offset + 1;
        b.clock_ms = b.clock_ms.max(rec.received_at_ms);
        self.batch.records += 1;
        let mut outcomes = Vec::new();
        if self.specs[p].topics.iter().any(|t| matches(t, &rec.topic)) {
            outcomes.push(f(self, p)?);
        }
        if rec.offset + 1 >= live {
            self.finish_backfill(p);
        }
        Ok(outcomes)
    }

    /// Set a whole record aside as a dead letter in every pipeline it matches, without
    /// parsing it: a stand-in for an oversized input (`too_large`), or a record whose
    /// processing kept panicking (`internal`). `payload` is what the dead letter keeps (cut
    /// to [`DEAD_LETTER_PAYLOAD_MAX`]); the identity for dedup is still the record's bytes.
    pub fn refuse<R: ReadState>(
        &mut self,
        base: &R,
        rec: &Record,
        reason: &'static str,
        detail: &str,
        payload: &[u8],
    ) -> Result<Vec<Outcome>, ReadError> {
        self.refuse_at(base, Target::Live, rec, reason, detail, payload)
    }

    /// [`Engine::refuse`] for `target` (see [`Engine::apply_at`]).
    pub fn refuse_at<R: ReadState>(
        &mut self,
        base: &R,
        target: Target,
        rec: &Record,
        reason: &'static str,
        detail: &str,
        payload: &[u8],
    ) -> Result<Vec<Outcome>, ReadError> {
        self.each_matching(target, rec, |e, p| {
            let r = Refusal {
                reason,
                detail: detail.to_string(),
            };
            e.dead_with(base, p, rec, r, payload)
        })
    }

    /// Record a refusal as a dead letter, once: a copy with the same topic and payload
    /// within the dedup window (a broker redelivery after a crash, or the same bad message
    /// published twice) is counted as a duplicate instead. Refused inputs may have no
    /// trustworthy event ID, so their identity is a hash of their bytes.
    fn dead<R: ReadState>(
        &mut self,
        base: &R,
        p: usize,
        rec: &Record,
        r: Refusal,
    ) -> Result<Outcome, ReadError> {
        self.dead_with(base, p, rec, r, &rec.payload)
    }

    /// [`Engine::dead`], keeping `payload` (not the record's) in the dead letter.
    fn dead_with<R: ReadState>(
        &mut self,
        base: &R,
        p: usize,
        rec: &Record,
        r: Refusal,
        payload: &[u8],
    ) -> Result<Outcome, ReadError> {
        let name = self.specs[p].name.clone();
        let content_id = dead_letter_id(&rec.topic, &rec.payload);
        let now = self.clock(p);
        if self.seen_within_window(base, p, &content_id)? {
            self.progress.pipelines[p].counters.duplicates += 1;
            return Ok(Outcome::Duplicate);
        }
        self.remember(p, &content_id, now);
        self.progress.pipelines[p].counters.dead_letters += 1;
        // Bounded here, where it is made: a topic may be 64 KiB and a detail may quote a
        // sender's field; cut, the letter fits one stored entry (invariant 7).
        let letter = DeadLetter {
            offset: rec.offset,
            pipeline: name,
            topic: rec.topic.clone(),
            reason: r.reason.to_string(),
            detail: r.detail,
            received_at_ms: rec.received_at_ms,
            payload: payload[..payload.len().min(DEAD_LETTER_PAYLOAD_MAX)].to_vec(),
        };
        self.batch
            .dead_letters
            .push(letter.fitted(DEAD_LETTER_KEY_ROOM));
        Ok(Outcome::DeadLetter { reason: r.reason })
    }

    /// Put an ID in the dedup ledger at record time `now`.
    fn remember(&mut self, p: usize, id: &str, now: u64) {
        self.batch.dedup.insert(p, &self.specs[p].name, id, now);
    }

    fn apply_one<R: ReadState>(
        &mut self,
        base: &R,
        p: usize,
        rec: &Record,
    ) -> Result<Outcome, ReadError> {
        if self.specs[p].format == Format::SparkplugB {
            return self.apply_sparkplug(base, p, rec);
        }
        let spec = &self.specs[p];
        let ev = match parse(spec, &rec.topic, &rec.payload) {
            Ok(None) => {
                self.progress.pipelines[p].counters.filtered += 1;
                return Ok(Outcome::Filtered);
            }
            Ok(Some(ev)) => check_key(spec, ev),
            Err(r) => Err(r),
        };
        let ev = match ev {
            Ok(ev) => ev,
            Err(r) => return self.dead(base, p, rec, r),
        };
        match self.apply_event(base, p, rec, ev, Given::default())? {
            EventOutcome::Applied { key, version } => Ok(Outcome::Applied { key, version }),
            EventOutcome::Duplicate => Ok(Outcome::Duplicate),
            EventOutcome::Refused(r) => self.dead(base, p, rec, r),
        }
    }

    /// One event (of a record that may hold many): dedup, the windows it lands in, their next
    /// states, and what is emitted. A refusal changes nothing; the caller makes it a dead
    /// letter.
    fn apply_event<R: ReadState>(
        &mut self,
        base: &R,
        p: usize,
        rec: &Record,
        ev: Parsed,
        given: Given,
    ) -> Result<EventOutcome, ReadError> {
        let now = self.clock(p);

        // Invariant 5: an event ID seen within the window (in record time) is skipped.
        if self.seen_within_window(base, p, &ev.event_id)? {
            self.progress.pipelines[p].counters.duplicates += 1;
            return Ok(EventOutcome::Duplicate);
        }

        let (time_ms, slots) = match self.slots(p, &ev, rec) {
            Ok(s) => s,
            Err(r) => return Ok(EventOutcome::Refused(r)),
        };
        // Every window the event lands in takes it, or none does.
        let mut states = Vec::with_capacity(slots.len());
        let mut new_keys = 0u64;
        for slot in &slots {
            let at = (time_ms, ev.value, &given);
            match self.next_state(base, p, &slot.skey, at, new_keys)? {
                Ok((st, new_key)) => {
                    new_keys += u64::from(new_key);
                    states.push(st);
                }
                Err(r) => return Ok(EventOutcome::Refused(r)),
            }
        }
        // A twa window whose value at its end changed hands it to the next one.
        let carried = self.carry_on(base, p, &ev.key, &slots, &states)?;

        // Accepted: remember the ID, store the states, emit.
        let pp = &mut self.progress.pipelines[p];
        pp.counters.applied += 1;
        pp.keys += new_keys;
        pp.max_event_time_ms = pp.max_event_time_ms.max(time_ms);
        self.remember(p, &ev.event_id, now);
        let mut version = 0;
        for (slot, new) in slots.into_iter().zip(states) {
            version = new.version;
            self.store_state(p, slot, new);
        }
        for (slot, new) in carried {
            self.store_state(p, slot, new);
        }
        if self.specs[p].window.is_some() {
            self.evict_closed(base, p)?;
        }
        Ok(EventOutcome::Applied {
            key: ev.key,
            version,
        })
    }

    /// Write (`None`: delete) one key's state in the checkpoint's batch.
    /// The name is copied only for a key new to the batch.
    fn put_state(&mut self, p: usize, skey: Vec<u8>, state: Option<KeyState>) {
        let name = &self.specs[p].name;
        match at_mut(&mut self.batch.state, name, &skey) {
            Some(v) => *v = state,
            None => {
                let name = name.clone();
                self.weigh_row(&skey, state.as_ref());
                self.batch.state.insert((name, skey), state);
            }
        }
    }

    /// Write one key's (or window's) new state and emit it as the pipeline's mode says.
    fn store_state(&mut self, p: usize, slot: Slot, new: KeyState) {
        let pp = &mut self.progress.pipelines[p];
        pp.max_version = pp.max_version.max(new.version);
        match self.specs[p].emit {
            Emit::Changelog => self.emit(p, &slot.skey, &new, slot.topic),
            Emit::Upsert => {
                self.touched
                    .insert((p, slot.skey.clone()), (slot.topic, None));
            }
            // Emitted once, when the watermark closes the window (`evict_closed`).
            Emit::Final => {}
        }
        self.put_state(p, slot.skey, Some(new));
    }

    /// For a twa pipeline with tumbling windows: each window of `slots` whose value at its
    /// end changes from `old` to its new state hands that value to the key's next window
    /// that has state (within [`TWA_LOOKBACK_WINDOWS`], never beyond the newest window an
    /// event reached): its carried-in value (a store-and-forward value that lands in an
    /// earlier window after a later one began). One step is enough: a window's own end
    /// value comes from its own points, never from its carry. In-order live values are in
    /// the newest window, so they look nowhere.
    fn carry_on<R: ReadState>(
        &self,
        base: &R,
        p: usize,
        key: &str,
        slots: &[Slot],
        states: &[KeyState],
    ) -> Result<Vec<(Slot, KeyState)>, ReadError> {
        let spec = &self.specs[p];
        let Some(w) = spec.window.filter(|w| w.slide_ms.is_none()) else {
            return Ok(Vec::new());
        };
        let mut out = Vec::new();
        for (slot, new) in slots.iter().zip(states) {
            let Some(end) = new.twa().map(super::value::Twa::end_value) else {
                continue;
            };
            let old = self.state_get(base, &spec.name, &slot.skey)?;
            if old
                .as_ref()
                .and_then(KeyState::twa)
                .map(super::value::Twa::end_value)
                == Some(end)
            {
                continue;
            }
            let newest = self.progress.pipelines[p].max_event_time_ms;
            let newest = newest - newest % w.size_ms.max(1);
            let mut next = start_of(&slot.skey);
            for _ in 0..TWA_LOOKBACK_WINDOWS {
                match next.checked_add(w.size_ms) {
                    Some(n) if n <= newest => next = n,
                    _ => break,
                }
                if slots.iter().any(|s| start_of(&s.skey) == next) {
                    break;
                }
                let Ok(next_slot) = self.slot_for(p, key, Some(next)) else {
                    break;
                };
                let Some(st) = self.state_get(base, &spec.name, &next_slot.skey)? else {
                    continue;
                };
                if let Some(st) = st.with_twa(|t| Some(t.with_carry(end))) {
                    out.push((next_slot, st));
                }
                break;
            }
        }
        Ok(out)
    }

    /// Where an event goes: its time, and for each window that covers it and is still open
    /// (one slot when unwindowed or tumbling) its state key and output topic; or why it can
    /// go nowhere. Every bound here is checked arithmetic, since the event time is whatever
    /// the sender wrote.
    fn slots(&self, p: usize, ev: &Parsed, rec: &Record) -> Result<(u64, Vec<Slot>), Refusal> {
        let spec = &self.specs[p];
        let time_ms = match ev.event_time_ms {
            None => rec.received_at_ms,
            Some(t) => {
                let ahead = t.saturating_sub(rec.received_at_ms);
                if ahead > spec.max_future_ms {
                    return Err(Refusal {
                        reason: "future",
                        detail: format!(
                            "event time {t} is {ahead} ms after the time of receipt {}; \
                             max_future allows {} ms",
                            rec.received_at_ms, spec.max_future_ms
                        ),
                    });
                }
                t
            }
        };
        let slot = |start: Option<u64>| self.slot_for(p, &ev.key, start);
        let Some(w) = spec.window else {
            return Ok((time_ms, vec![slot(None)?]));
        };
        // The newest window covering the event ends last: if its end fits, all do.
        let newest = time_ms - time_ms % w.slide();
        let Some(end) = newest.checked_add(w.size_ms) else {
            return Err(Refusal {
                reason: "bad_event_time",
                detail: format!(
                    "event time {time_ms} falls in a window starting at {newest} that ends \
                     beyond the largest time this pipeline can represent"
                ),
            });
        };
        let open_from = w.open_from(self.progress.pipelines[p].max_event_time_ms);
        // Windows covering the event: starts in (time - size, time], a multiple of the slide,
        // oldest first. At most MAX_WINDOWS_PER_EVENT (config validation).
        let mut starts = Vec::new();
        let mut start = newest;
        loop {
            if start < open_from {
                break;
            }
            starts.push(start);
            match start.checked_sub(w.slide()) {
                Some(s) if s + w.size_ms > time_ms => start = s,
                _ => break,
            }
        }
        if starts.is_empty() {
            let watermark = self.progress.pipelines[p]
                .max_event_time_ms
                .saturating_sub(w.allowed_lateness_ms);
            return Err(Refusal {
                reason: "late",
                detail: format!(
                    "event time {time_ms} falls in window [{newest}, {end}), closed at \
                     watermark {watermark}"
                ),
            });
        }
        starts.reverse();
        let slots = starts
            .into_iter()
            .map(|s| slot(Some(s)))
            .collect::<Result<_, _>>()?;
        Ok((time_ms, slots))
    }

    /// The state key and output topic of `key` in the window starting at `start` (`None`
    /// unwindowed), or why no result of it could be stored or published.
    fn slot_for(&self, p: usize, key: &str, start: Option<u64>) -> Result<Slot, Refusal> {
        let spec = &self.specs[p];
        let escaped = escape_key(key);
        let key_bytes = KeyBytes::of(key, &escaped);
        let mut skey = Vec::with_capacity(8 + key.len());
        if let Some(start) = start {
            skey.extend_from_slice(&start.to_be_bytes());
        }
        skey.extend_from_slice(key.as_bytes());
        let topic = render(&spec.output_topic, &escaped, start);
        check_publish_topic(&topic)?;
        // Decided from the key and the topic alone, before any state changes, so replay
        // decides the same; a result the store would refuse would fail every checkpoint,
        // replay's included (issue 26).
        let bytes = result_bytes(spec, topic.len(), key_bytes);
        if bytes > MAX_ENTRY_BYTES {
            return Err(Refusal {
                reason: "result_too_large",
                detail: format!(
                    "a result for this key would take up to {bytes} bytes in the store, \
                     which holds at most {MAX_ENTRY_BYTES} per entry (a key of {} bytes, a \
                     topic of {}): lower max_key_len or shorten output_topic",
                    key.len(),
                    topic.len()
                ),
            });
        }
        Ok(Slot { skey, topic })
    }

    /// The state after applying `value` to the state at `skey`, and whether the key is new;
    /// or why the event cannot be applied (a new key beyond `max_keys`, counting
    /// `pending_new` keys this event already adds; an overflow).
    fn next_state<R: ReadState>(
        &self,
        base: &R,
        p: usize,
        skey: &[u8],
        (time_ms, value, given): (u64, Num, &Given),
        pending_new: u64,
    ) -> Result<Result<(KeyState, bool), Refusal>, ReadError> {
        let spec = &self.specs[p];
        let pp = &self.progress.pipelines[p];
        let mut extra = Extra {
            historical: given.historical,
            ..Extra::default()
        };
        let overflow = || Refusal {
            reason: "overflow",
            detail: format!(
                "adding {value:?} overflows the aggregate (64-bit integers; floats below 2^53), \
                 its count or its version"
            ),
        };
        // The batch's state is read in place: the next state is a new value either way, and a
        // clone of the old one (a sketch of up to 512 buckets) would be thrown away at once.
        let stored;
        let old = match at(&self.batch.state, &spec.name, skey) {
            Some(v) => v.as_ref(),
            None => {
                stored = base.state(&spec.name, skey)?;
                stored.as_ref()
            }
        };
        Ok(match old {
            None if pp.keys.saturating_add(pending_new) >= spec.max_keys => Err(Refusal {
                reason: "key_limit",
                detail: format!("{} keys held, the limit is {}", pp.keys, spec.max_keys),
            }),
            None => {
                if spec.aggregate.all().contains(&Aggregate::Twa) {
                    (extra.span, extra.carry) = self.twa_start(base, p, skey, given)?;
                }
                match KeyState::first_with(&spec.aggregate, value, time_ms, &extra) {
                    Ok(mut first) => match first.version.checked_add(pp.version_base) {
                        Some(v) => {
                            first.version = v;
                            Ok((first, true))
                        }
                        None => Err(overflow()),
                    },
                    Err(_) => Err(overflow()),
                }
            }
            Some(old) => old
                .apply_with(value, time_ms, &extra)
                .map(|s| (s, false))
                .map_err(|_| match old.twa().and_then(|t| t.folded) {
                    Some(f) if time_ms < f.to => Refusal {
                        reason: "twa_folded",
                        detail: format!(
                            "time {time_ms} is before {}, where this window's time-weighted \
                             average already folded its older points into a sum",
                            f.to
                        ),
                    },
                    _ => overflow(),
                }),
        }
        .and_then(|(st, new_key)| {
            check_state_size(&spec.name, skey, &st)?;
            Ok((st, new_key))
        }))
    }

    /// A new twa state's window and the value carried into it: the metric's latest value
    /// before the window's start if the input says it (a Sparkplug session keeps it), else
    /// the value at the end of the window before, if that one has state.
    fn twa_start<R: ReadState>(
        &self,
        base: &R,
        p: usize,
        skey: &[u8],
        given: &Given,
    ) -> Result<TwaStart, ReadError> {
        let spec = &self.specs[p];
        let Some(w) = spec.window else {
            return Ok((None, None));
        };
        let start = start_of(skey);
        let span = Some((start, start.saturating_add(w.size_ms)));
        if let Some((t, v)) = given.prior {
            if t < start {
                return Ok((span, v));
            }
        }
        if w.slide_ms.is_some() {
            return Ok((span, None));
        }
        // The nearest earlier window of the key that still has state (a metric silent for a
        // while has none in between), not below the windows already closed and dropped.
        let floor = self.progress.pipelines[p].evicted_below;
        let mut before = start;
        for _ in 0..TWA_LOOKBACK_WINDOWS {
            match before.checked_sub(w.size_ms) {
                Some(b) if b >= floor => before = b,
                _ => break,
            }
            let mut prev = before.to_be_bytes().to_vec();
            prev.extend_from_slice(&skey[8..]);
            if let Some(st) = self.state_get(base, &spec.name, &prev)? {
                return Ok((span, st.twa().and_then(super::value::Twa::end_value)));
            }
        }
        Ok((span, None))
    }

    /// Drop windows the watermark has closed: no event can change them any more. With
    /// `emit = "final"`, this is when each one's single result is emitted.
    fn evict_closed<R: ReadState>(&mut self, base: &R, p: usize) -> Result<(), ReadError> {
        let w = self.specs[p].window.expect("windowed");
        let pp = &self.progress.pipelines[p];
        let close_bound = w.open_from(pp.max_event_time_ms);
        if close_bound <= pp.evicted_below {
            return Ok(());
        }
        let from = pp.evicted_below;
        let name = self.specs[p].name.clone();
        let mut keys = base.window_keys(&name, from, close_bound)?;
        let lo = (name.clone(), from.to_be_bytes().to_vec());
        for ((pn, k), v) in self.batch.state.range(lo..) {
            if *pn != name || k.len() < 8 || start_of(k) >= close_bound {
                break;
            }
            if v.is_some() {
                keys.push(k.clone());
            }
        }
        keys.sort();
        keys.dedup();
        for k in keys {
            if let Some(st) = self.state_get(base, &name, &k)? {
                if self.specs[p].emit == Emit::Final {
                    // Rendered and checked when the window took its first event.
                    let key = String::from_utf8_lossy(&k[8..]);
                    let topic = render(
                        &self.specs[p].output_topic,
                        &escape_key(&key),
                        Some(start_of(&k)),
                    );
                    self.emit(p, &k, &st, topic);
                } else if let Some((_, held)) = self.touched.get_mut(&(p, k.clone())) {
                    // Its upsert is still to be flushed, and the batch forgets it now.
                    *held = Some(st);
                }
                self.put_state(p, k, None);
                self.progress.pipelines[p].keys -= 1;
            }
        }
        self.progress.pipelines[p].evicted_below = close_bound;
        Ok(())
    }

    /// Queue the output of one key (and window) state. `topic` was rendered and checked when
    /// the event was applied, so nothing here can refuse it.
    fn emit(&mut self, p: usize, skey: &[u8], st: &KeyState, topic: String) {
        let spec = &self.specs[p];
        let (window, key) = match spec.window {
            Some(w) => (Some((start_of(skey), w.size_ms)), &skey[8..]),
            None => (None, skey),
        };
        let key = String::from_utf8_lossy(key);
        let ek = escape_key(&key);
        let generation = self.progress.pipelines[p].generation;
        let prefix = self.progress.pipelines[p].id_prefix();
        let id = match window {
            Some((start, _)) => format!("{prefix}/{ek}/{start}/{}", st.version),
            None => format!("{prefix}/{ek}/{}", st.version),
        };
        let value = st.value_json();
        let multi = st.is_multi();
        let body = ResultBody {
            count: st.count,
            generation: (generation > 1).then_some(generation),
            id: &id,
            key: &key,
            pipeline: &spec.name,
            value: (!multi).then_some(&value),
            values: multi.then_some(&value),
            version: st.version,
            window_end: window.map(|(start, size)| start.saturating_add(size)),
            window_start: window.map(|(start, _)| start),
        };
        let payload = serde_json::to_vec(&body).expect("a result body always serializes");
        let seq = self.progress.outbox_seq;
        self.progress.outbox_seq += 1;
        self.progress.pipelines[p].counters.outputs += 1;
        let out = Output {
            id,
            topic,
            payload,
            retain: spec.retain,
            latest_only: spec.emit == Emit::Upsert,
        };
        self.batch.outputs.push((seq, out));
    }

    fn state_get<R: ReadState>(
        &self,
        base: &R,
        p: &str,
        skey: &[u8],
    ) -> Result<Option<KeyState>, ReadError> {
        match at(&self.batch.state, p, skey) {
            Some(v) => Ok(v.clone()),
            None => base.state(p, skey),
        }
    }

    /// Whether pipeline `p` accepted `id` within its dedup window (in record time).
    fn seen_within_window<R: ReadState>(
        &self,
        base: &R,
        p: usize,
        id: &str,
    ) -> Result<bool, ReadError> {
        let spec = &self.specs[p];
        Ok(self
            .dedup_get(base, p, id)?
            .is_some_and(|seen| self.clock(p).saturating_sub(seen) < spec.dedup_window_ms))
    }

    fn dedup_get<R: ReadState>(
        &self,
        base: &R,
        p: usize,
        id: &str,
    ) -> Result<Option<u64>, ReadError> {
        let name = &self.specs[p].name;
        match self.batch.dedup.get(p, name, id) {
            Some(seen) => Ok(Some(seen)),
            None => base.dedup(name, id),
        }
    }

    /// Close the batch: emit upserts, say which dedup entries have expired, and hand over
    /// everything the checkpoint must write. The engine's progress is already the
    /// checkpoint's; if the commit then fails, the engine is stale and the process must
    /// restart from the store.
    pub fn take_checkpoint(&mut self) -> Checkpoint {
        self.flush_upserts();
        for (p, spec) in self.specs.iter().enumerate() {
            self.batch
                .dedup_windows
                .push((spec.name.clone(), spec.dedup_window_ms));
            // Expired: `now - seen >= window`, and the pipeline's clock never goes back (a
            // backfill's clock stays below the log clock, which it then joins).
            let now = match self.progress.pipelines[p].backfill {
                Some(b) => b.clock_ms,
                None => self.progress.log_clock_ms,
            };
            if let Some(cutoff) = now.checked_sub(spec.dedup_window_ms) {
                self.batch
                    .dedup_expired_at_or_before
                    .push((spec.name.clone(), cutoff));
            }
        }
        // A group's entries are kept for its longest window, by the log clock (its members
        // are live); each member still judges an entry by its own window.
        for (g, members) in &self.ledger_groups {
            let window = (members.iter())
                .map(|&p| self.specs[p].dedup_window_ms)
                .max()
                .unwrap_or(0);
            self.batch.dedup_windows.push((g.clone(), window));
            if let Some(cutoff) = self.progress.log_clock_ms.checked_sub(window) {
                self.batch
                    .dedup_expired_at_or_before
                    .push((g.clone(), cutoff));
            }
        }
        self.progress.checkpoint_id += 1;
        self.rows.clear();
        self.rows_weight = 0;
        let mut next = fresh_batch(&self.specs);
        next.ledger_groups = self.ledger_group_names();
        Checkpoint {
            progress: self.progress.clone(),
            batch: std::mem::replace(&mut self.batch, next),
        }
    }

    /// Emit the upserts of the keys touched since the last flush: one output per key (and
    /// window), its newest version. The agent flushes after each processed log commit, so
    /// upserts leave at log-commit latency; replay flushes only at its checkpoints. Either
    /// way an ID's payload is the state at that version, so where the flushes fall changes
    /// which versions are emitted, never what one ID carries.
    pub fn flush_upserts(&mut self) {
        let touched = std::mem::take(&mut self.touched);
        // Room for them all at once: grown by doubling, the list of 16,000 upserts of 16
        // pipelines over 1,000 keys held up to twice its size, and both while it moved
        // (1.44 MB at the peak of a drain, heaptrack; issue 33).
        self.batch.outputs.reserve(touched.len());
        for ((p, skey), (topic, held)) in touched {
            let st = match held {
                Some(st) => st,
                None => match at(&self.batch.state, &self.specs[p].name, &skey) {
                    Some(Some(st)) => st.clone(),
                    // Not reached: only an eviction takes a touched state out of the batch,
                    // and it leaves the state here. A bug must not stop the agent.
                    _ => {
                        debug_assert!(false, "a touched state left the batch");
                        let name = &self.specs[p].name;
                        crate::event!(error, "upsert_state_missing", pipeline = name; "an upsert of pipeline {name} lost its state");
                        continue;
                    }
                },
            };
            self.emit(p, &skey, &st, topic);
        }
    }

    /// Outputs emitted since the last checkpoint, in sequence order. Their inputs are
    /// durable in the log (records are applied only after their fsync); they are not yet in
    /// the store.
    pub fn pending_outputs(&self) -> &[(u64, Output)] {
        &self.batch.outputs
    }

    /// Upserts touched since the last flush, not yet emitted.
    pub fn upserts_waiting(&self) -> bool {
        !self.touched.is_empty()
    }

    /// The sequence number the next output gets.
    pub fn next_output_seq(&self) -> u64 {
        self.progress.outbox_seq
    }

    /// Dead letters made since the last checkpoint, in log order: the journal names each
    /// one's pipeline and reason (`CAIRN_PIPELINE`, `CAIRN_REASON`) from here.
    pub fn pending_dead_letters(&self) -> &[crate::model::DeadLetter] {
        &self.batch.dead_letters
    }

    /// Results the outbox will receive with the next checkpoint, at most: the outputs
    /// emitted since the last one, and one per (pipeline, key) an upsert touched since the
    /// last flush (see [`Engine::flush_upserts`]). What a full outbox's bound counts.
    pub fn pending_results(&self) -> usize {
        self.batch.outputs.len().saturating_add(self.touched.len())
    }

    /// Ledger sizes as the store counts them after a commit (they depend on when the store
    /// forgets expired entries, so the store, not the engine, knows them).
    pub fn set_dedup_entries(&mut self, count: impl Fn(&str) -> u64) {
        for pp in &mut self.progress.pipelines {
            pp.dedup_entries = count(&pp.name);
        }
    }
}

/// A new twa state's window `[start, end)` (`None` unwindowed) and its carried-in value.
type TwaStart = (Option<(u64, u64)>, Option<f64>);

/// What an input gives an event beyond its parsed fields (a Sparkplug metric value gives
/// both; a JSON event neither).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Given {
    /// A store-and-forward value: it never moves `last`.
    pub historical: bool,
    /// The metric's latest point before this one, `(time, value)`, `None` as the value
    /// when it was dead (or null) from that time: what a twa window that starts after it
    /// carries in.
    pub prior: Option<(u64, Option<f64>)>,
}

/// What became of one event of a record.
#[derive(Debug)]
enum EventOutcome {
    Applied { key: String, version: u64 },
    Duplicate,
    Refused(Refusal),
}

/// Where an accepted event lands (one of possibly several windows).
struct Slot {
    /// State key: the window start (big-endian, when windowed) then the key.
    skey: Vec<u8>,
    topic: String,
}

/// An empty batch whose ledger names the pipelines in the engine's order.
fn fresh_batch(specs: &[PipelineSpec]) -> Batch {
    Batch {
        dedup: BatchLedger::with_names(specs.iter().map(|s| s.name.as_str())),
        ..Batch::default()
    }
}

/// Refuse a state that would not fit one stored entry beside its key (the pipeline's name,
/// a separator, the window start and the key): a sketch with many buckets under a long key
/// can outgrow it. The cheap bound decides almost always; the exact size only near it.
fn check_state_size(pipeline: &str, skey: &[u8], st: &KeyState) -> Result<(), Refusal> {
    let key = pipeline.len() + 1 + skey.len();
    if key + st.stored_bound() <= MAX_ENTRY_BYTES {
        return Ok(());
    }
    let bytes = key + postcard::experimental::serialized_size(st).unwrap_or(usize::MAX);
    if bytes <= MAX_ENTRY_BYTES {
        return Ok(());
    }
    Err(Refusal {
        reason: "state_too_large",
        detail: format!(
            "the key's state would take {bytes} bytes in the store, which holds at most \
             {MAX_ENTRY_BYTES} per entry: lower max_key_len, or drop a percentile aggregate"
        ),
    })
}

/// Refuse keys that cannot name a state entry, a topic level and an output-ID segment: empty,
/// too long, or holding a code point an MQTT receiver may refuse ([`crate::text`]).
fn check_key(spec: &PipelineSpec, ev: Parsed) -> Result<Parsed, Refusal> {
    let refuse = |reason, detail: String| Err(Refusal { reason, detail });
    if ev.key.is_empty() {
        return refuse("bad_key", "the key is empty".into());
    }
    if ev.key.len() > spec.max_key_len {
        let (len, max) = (ev.key.len(), spec.max_key_len);
        return refuse(
            "key_too_long",
            format!("key is {len} bytes, the limit is {max}"),
        );
    }
    // The key becomes a topic level: a code point a receiver may treat as malformed gets the
    // publish refused by disconnecting, again after every reconnect (issue 27).
    if let Some(c) = crate::text::first_refusable(&ev.key) {
        let what = if c.is_control() {
            "a control character (NUL, newline, ...)"
        } else {
            "a Unicode non-character"
        };
        return refuse(
            "bad_key",
            format!(
                "the key contains U+{:04X}, {what}, which an MQTT receiver may refuse in a topic",
                u32::from(c)
            ),
        );
    }
    Ok(ev)
}

/// The ledger identity of a refused input: FNV-1a (64-bit) over its topic and payload, in a
/// namespace no event ID can enter (event IDs with control characters are refused).
/// Written by hand so it never changes with a toolchain: the ledger outlives builds.
pub(crate) fn dead_letter_id(topic: &str, payload: &[u8]) -> String {
    let bytes = topic
        .as_bytes()
        .iter()
        .chain([0xffu8].iter())
        .chain(payload);
    let h = crate::model::fnv1a(bytes);
    format!("\u{1}dead:{h:016x}:{}", payload.len())
}

/// A result's JSON body. Fields in this order, absent ones left out: the order of the sorted
/// map the body was first built as (`serde_json::json!`), so the bytes of a result are the
/// same across versions, and a result re-created after an upgrade matches the one sent
/// before it. Built with borrowed fields in one pass: the map took about 15 allocations per
/// result, the largest share of the agent's (issue 16).
#[derive(serde::Serialize)]
struct ResultBody<'a> {
    count: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    generation: Option<u32>,
    id: &'a str,
    key: &'a str,
    pipeline: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    value: Option<&'a serde_json::Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    values: Option<&'a serde_json::Value>,
    version: u64,
    // Never saturates: `slot` refused every window whose end does not fit.
    #[serde(skip_serializing_if = "Option::is_none")]
    window_end: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    window_start: Option<u64>,
}

/// `out`, a result of pipeline `pipeline`, as the engine would have emitted it in
/// `generation`: its ID's prefix and the body's `id` and `generation` changed, nothing else
/// (the topic carries no generation). A savepoint restore moves the restored outbox into
/// the pipeline's new generation with this (`processor::plan`). Errors when `out` is not a
/// result of `pipeline` the engine wrote.
pub(crate) fn in_generation(
    out: &Output,
    pipeline: &str,
    generation: u32,
) -> Result<Output, String> {
    let (prefix, rest) = out
        .id
        .split_once('/')
        .ok_or_else(|| format!("output ID `{}` has no key", out.id))?;
    let name = prefix.split_once('@').map_or(prefix, |(n, _)| n);
    if name != pipeline {
        return Err(format!(
            "output ID `{}` is not of pipeline `{pipeline}`",
            out.id
        ));
    }
    // The body's fields in the order of their names, as `ResultBody` writes them (and the
    // sorted map before it did), each value's bytes as they are: nothing is parsed and
    // printed again but the two fields that change.
    let mut body: BTreeMap<String, &serde_json::value::RawValue> =
        serde_json::from_slice(&out.payload)
            .map_err(|e| format!("result `{}` does not read as a result body: {e}", out.id))?;
    let said = body
        .get("id")
        .map(|v| serde_json::from_str::<String>(v.get()));
    if !matches!(said, Some(Ok(ref id)) if *id == out.id) {
        return Err(format!(
            "result `{}` carries another ID in its body",
            out.id
        ));
    }
    let new = PipelineProgress {
        name: pipeline.to_string(),
        generation,
        ..PipelineProgress::default()
    };
    let id = format!("{}/{rest}", new.id_prefix());
    let id_json = serde_json::value::to_raw_value(&id).expect("a string serializes");
    let gen_json = serde_json::value::to_raw_value(&generation).expect("a number serializes");
    body.insert("id".into(), &id_json);
    if generation > 1 {
        body.insert("generation".into(), &gen_json);
    } else {
        body.remove("generation");
    }
    let payload = serde_json::to_vec(&body).expect("a result body always serializes");
    Ok(Output {
        id,
        payload,
        ..out.clone()
    })
}

fn start_of(skey: &[u8]) -> u64 {
    u64::from_be_bytes(skey[..8].try_into().expect("windowed key has 8-byte start"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The body as it was first built: a sorted `serde_json` map.
    fn as_map(b: &ResultBody) -> Vec<u8> {
        let mut m = serde_json::json!({
            "id": b.id, "pipeline": b.pipeline, "key": b.key, "version": b.version,
            "count": b.count,
        });
        if let Some(v) = b.value {
            m["value"] = v.clone();
        }
        if let Some(v) = b.values {
            m["values"] = v.clone();
        }
        if let Some(g) = b.generation {
            m["generation"] = g.into();
        }
        if let (Some(s), Some(e)) = (b.window_start, b.window_end) {
            m["window_start"] = s.into();
            m["window_end"] = e.into();
        }
        m.to_string().into_bytes()
    }

    #[test]
    fn a_result_body_has_the_bytes_of_the_sorted_map_it_replaced() {
        let one = serde_json::json!(-12.5);
        let multi = serde_json::json!({"avg": 2.5, "max": null, "sum": 10});
        let key = "k \"q\" / é \u{1}";
        for value in [Some(&one), None] {
            for generation in [None, Some(2), Some(u32::MAX)] {
                for window in [None, Some((0, 60_000)), Some((u64::MAX - 5, u64::MAX))] {
                    let b = ResultBody {
                        count: u64::MAX,
                        generation,
                        id: "p@2/k%20/7",
                        key,
                        pipeline: "p",
                        value,
                        values: value.is_none().then_some(&multi),
                        version: 7,
                        window_end: window.map(|(_, e)| e),
                        window_start: window.map(|(s, _)| s),
                    };
                    assert_eq!(
                        String::from_utf8(serde_json::to_vec(&b).unwrap()).unwrap(),
                        String::from_utf8(as_map(&b)).unwrap()
                    );
                }
            }
        }
    }

    /// A result moved into another generation (a savepoint restore) has the bytes the
    /// engine emits for the same state in that generation: the ID and the body's `id` and
    /// `generation`, nothing else; the value's bytes are never parsed and printed again.
    #[test]
    fn a_result_moved_into_a_generation_is_the_one_the_engine_emits_there() {
        let aggs = [r#""sum""#, r#""min""#, r#"["avg", "max", "p95"]"#];
        for agg in aggs {
            for window in ["", "window = { size = \"1m\" }"] {
                let spec = crate::config::pipeline_from_toml(&format!(
                    "name = \"p_1\"\ntopics = [\"in/#\"]\nevent_id = \"/id\"\nkey = \"/k\"\n\
                     value = \"/v\"\naggregate = {agg}\noutput_topic = \"o/{{key}}\"\n\
                     emit = \"changelog\"\n{window}\n"
                ))
                .unwrap();
                let emitted = |generation: u32| {
                    let progress = Progress {
                        pipelines: vec![PipelineProgress::new(&spec, generation)],
                        ..Progress::default()
                    };
                    let mut e = Engine::new(vec![spec.clone()], progress);
                    let mut outs = Vec::new();
                    for (i, v) in ["0.1", "-1e-3", "12345.678", "-7"].iter().enumerate() {
                        let rec = Record {
                            offset: i as u64,
                            received_at_ms: 1,
                            topic: "in/a".into(),
                            payload: format!(r#"{{"id":"e{i}","k":"k \"q\" / é","v":{v},"t":1}}"#)
                                .into_bytes(),
                            qos: 1,
                            retain: false,
                        };
                        let state = crate::pipeline::memory::MemState::default();
                        let got = e.apply(&state, &rec).unwrap();
                        assert!(matches!(got[..], [Outcome::Applied { .. }]), "{got:?}");
                        outs.extend(e.take_checkpoint().batch.outputs);
                    }
                    outs
                };
                let (one, seven) = (emitted(1), emitted(7));
                assert_eq!(one.len(), 4);
                for ((_, a), (_, b)) in one.iter().zip(&seven) {
                    assert_eq!(&in_generation(a, "p_1", 7).unwrap(), b, "{agg} {window}");
                    assert_eq!(&in_generation(b, "p_1", 1).unwrap(), a, "{agg} {window}");
                    let nine = in_generation(b, "p_1", 9).unwrap();
                    assert!(nine.id.starts_with("p_1@9/"), "{}", nine.id);
                    assert_eq!(
                        in_generation(&nine, "p_1", 7).as_ref(),
                        Ok(b),
                        "{agg} {window}"
                    );
                }
                let (_, a) = &one[0];
                assert!(in_generation(a, "p_2", 7).is_err(), "another pipeline's");
                let null = serde_json::Value::Null;
                let body = |id: &str, generation| {
                    serde_json::to_vec(&ResultBody {
                        count: 0,
                        generation,
                        id,
                        key: "k",
                        pipeline: "p_1",
                        value: Some(&null),
                        values: None,
                        version: 3,
                        window_end: None,
                        window_start: None,
                    })
                    .unwrap()
                };
                let nulled = Output {
                    payload: body("p_1/k/3", None),
                    id: "p_1/k/3".into(),
                    ..a.clone()
                };
                assert_eq!(
                    in_generation(&nulled, "p_1", 2).unwrap().payload,
                    body("p_1@2/k/3", Some(2)),
                    "a null value stays"
                );
                // A body of another shape (an older build's, say) keeps its other fields.
                let older = Output {
                    payload: br#"{"id":"p_1/k/3","key":"k","value":1.50}"#.to_vec(),
                    id: "p_1/k/3".into(),
                    ..a.clone()
                };
                assert_eq!(
                    in_generation(&older, "p_1", 2).unwrap().payload,
                    br#"{"generation":2,"id":"p_1@2/k/3","key":"k","value":1.50}"#
                );
                let mut bad = a.clone();
                bad.payload = b"{}".to_vec();
                assert!(in_generation(&bad, "p_1", 7).is_err(), "not a result body");
            }
        }
    }

    /// The bound the engine and config validation use is at least what a result takes in
    /// the store (one outbox entry of one result), and not far above it.
    #[test]
    fn the_result_bound_holds_the_stored_entry_and_is_close() {
        use crate::model::MAX_ENTRY_BYTES;
        use crate::pipeline::bound::{KeyBytes, result_bytes, worst_result_bytes};
        let all = r#"["count", "sum", "min", "max", "avg", "last", "stddev", "variance", "p1", "p95", "p99.9"]"#;
        for agg in ["\"sum\"", all] {
            for window in ["", "window = { size = \"1ms\" }"] {
                let mut spec = crate::config::pipeline_from_toml(&format!(
                    "name = \"{}\"\ntopics = [\"in/#\"]\nevent_id = \"/id\"\nkey = \"/k\"\n\
                     value = \"/v\"\naggregate = {agg}\noutput_topic = \"o/{{key}}\"\n\
                     emit = \"changelog\"\n{window}\n",
                    "n".repeat(64)
                ))
                .unwrap();
                spec.max_key_len = 400;
                for unit in ["/", "\"", "a", "é"] {
                    let key = unit.repeat(400 / unit.len());
                    let payload = serde_json::json!({"id": "e", "k": key, "v": -0.125e-300});
                    let mut e = Engine::new(vec![spec.clone()], Progress::default());
                    let rec = Record {
                        offset: 0,
                        received_at_ms: 1,
                        topic: "in/a".into(),
                        payload: payload.to_string().into_bytes(),
                        qos: 1,
                        retain: false,
                    };
                    let outcome = e.apply(&crate::pipeline::memory::MemState::default(), &rec);
                    assert!(matches!(outcome.unwrap()[..], [Outcome::Applied { .. }]));
                    let (_, out) = e.take_checkpoint().batch.outputs.remove(0);
                    let stored = 8 + postcard::to_stdvec(&vec![(u64::MAX, out.clone())])
                        .unwrap()
                        .len();
                    let bound = result_bytes(
                        &spec,
                        out.topic.len(),
                        KeyBytes::of(&key, &escape_key(&key)),
                    );
                    assert!(stored <= bound, "{agg} {window} {unit}: {stored} > {bound}");
                    // Counted at their longest: the numbers this one-event result holds short.
                    let slack = 200 + 36 * spec.aggregate.all().len();
                    assert!(
                        bound - stored < slack,
                        "{agg} {window} {unit}: {stored}, {bound}"
                    );
                    assert!(bound <= worst_result_bytes(&spec));
                    assert!(worst_result_bytes(&spec) <= MAX_ENTRY_BYTES);
                }
            }
        }
    }
}
