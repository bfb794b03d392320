//! A model of what may change between runs (issue 26, item 2): random sequences of live
//! input (with broker redeliveries), backfill slices, flushes, checkpoints, syncs,
//! savepoints, kills, power cuts and clean restarts, each restart with config edits of every
//! kind (a pipeline's definition with its `--reset-pipeline`, `where`, windows, `emit`,
//! `dedup_window`, `max_keys`, `start`, a pipeline removed and added back, a savepoint
//! restored) and, at some starts, processing held part-way (the outbox at its bound), over
//! the real log, store and processor, started the way the agent starts
//! (`agent/start.rs`: [`Processor::start`] with its settle, then the replay).
//!
//! The oracle:
//! - **no ID ever carries two payloads**: every result that could have gone out (each
//!   output pending in the engine, every outbox entry) is recorded for the whole case;
//! - **nothing acknowledged is lost or counted twice within a generation**: pipeline `a`
//!   (never filtering, every edit but its definition neutral to its counts, `start =
//!   "earliest"` after each reset) ends with, per key, a count equal to the distinct event
//!   IDs the log holds for that key (redeliveries included);
//! - **the agent always comes back up**: no start fails.
//!
//! A power cut puts the store back to its last synced checkpoint (a copy taken at each
//! sync: sled's files after its flush, which is what a power cut right after the sync
//! leaves) and tears the log's tail (bytes of a frame that never finished); the data
//! directory's small files are written durably whenever they change, so they stay. A kill
//! drops the processes' memory: the store keeps what it committed.
//!
//! `PROPTEST_CASES` raises the number of cases (default below, sized for CI).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};

use proptest::prelude::*;

use super::{Hold, ProcessError, Processor, StartFrom};
use crate::fsio::{Durability, TestSync};
use crate::log::{Log, LogOptions};
use crate::pipeline::spec::PipelineSpec;
use crate::store::Store;

const CASES: u32 = 48;

/// `checkpoint.max_keys` for the replays at start: small, so that a replay checkpoints
/// every record or two (the pipelines share a key's row, and a windowed one writes its
/// window's: a record writes one or two rows) and its checkpoints fall between the records
/// of a batch, as the agent's do at the bound.
const REPLAY_KEYS: u64 = 2;

/// What the cases did, summed over a run: printed after each case when `CAIRN_MODEL_STATS`
/// is set (for the report: that the cases reach what they are about).
mod stats {
    use std::sync::atomic::{AtomicU64, Ordering};
    pub(super) static NAMES: [&str; 11] = [
        "cases",
        "steps",
        "starts",
        "settles",
        "held",
        "power cuts",
        "kills",
        "resets",
        "restores",
        "checkpoints in flight",
        "replay checkpoints",
    ];
    pub(super) static COUNTS: [AtomicU64; 11] = [const { AtomicU64::new(0) }; 11];
    pub(super) fn add(i: usize, n: u64) {
        COUNTS[i].fetch_add(n, Ordering::Relaxed);
    }
    pub(super) fn print() {
        if std::env::var_os("CAIRN_MODEL_STATS").is_some() {
            let line: Vec<String> = NAMES
                .iter()
                .zip(&COUNTS)
                .map(|(n, c)| format!("{n} {}", c.load(Ordering::Relaxed)))
                .collect();
            eprintln!("model_changes: {}", line.join(", "));
        }
    }
}

/// One pipeline's settings. Pipeline `a` reads `agg` and the neutral variants of the rest;
/// `b` and `c` read all of them.
#[derive(Debug, Clone, PartialEq)]
struct Settings {
    /// Definition: the aggregate.
    agg: u8,
    /// Definition: no window, tumbling, hopping.
    window: u8,
    filter: u8,
    emit: u8,
    dedup: u8,
    limit: u8,
    earliest: bool,
}

impl Settings {
    fn definition(&self) -> (u8, u8) {
        (self.agg % 3, self.window % 3)
    }
}

fn spec(name: &str, s: &Settings) -> PipelineSpec {
    let neutral = name == "a";
    let aggregate = match (neutral, s.agg % 3) {
        (true, 0) => "[\"count\", \"sum\"]",
        (true, 1) => "[\"count\", \"max\"]",
        (true, _) => "[\"count\", \"min\"]",
        (false, 0) => "\"sum\"",
        (false, 1) => "\"max\"",
        (false, _) => "[\"avg\", \"p90\"]",
    };
    let window = match (neutral, s.window % 3) {
        (true, _) | (false, 0) => "",
        (false, 1) => "window = { size = \"100ms\", allowed_lateness = \"50ms\" }\n",
        (false, _) => {
            "window = { size = \"200ms\", slide = \"100ms\", allowed_lateness = \"50ms\" }\n"
        }
    };
    // `a`'s filters let every input through; they differ only in their text.
    let filter = match (neutral, s.filter % 3) {
        (_, 0) => "",
        (true, 1) => "where = '{2} > -100000'\n",
        (true, _) => "where = 'not ({2} < -100000)'\n",
        (false, 1) => "where = '{2} > 0'\n",
        (false, _) => "where = '{2} < 500 and {1} != \"K3\"'\n",
    };
    let emit = match (s.emit % 3, window.is_empty()) {
        (0, _) => "upsert",
        (2, false) => "final",
        _ => "changelog",
    };
    let dedup = match (neutral, s.dedup % 2) {
        (true, 0) | (false, 0) => "366d",
        (true, _) => "300d",
        (false, _) => "1m",
    };
    let max_keys = match (neutral, s.limit % 2) {
        (true, 0) | (false, 0) => 1000,
        (true, _) => 900,
        (false, _) => 2,
    };
    let start = if neutral || s.earliest {
        "earliest"
    } else {
        "latest"
    };
    crate::config::pipeline_from_toml(&format!(
        "name = \"{name}\"\ntopics = [\"t/#\"]\nformat = \"delimited\"\nevent_id = \"0\"\n\
         key = \"1\"\nvalue = \"2\"\nevent_time = \"3\"\naggregate = {aggregate}\n{window}{filter}\
         emit = \"{emit}\"\ndedup_window = \"{dedup}\"\nmax_keys = {max_keys}\n\
         start = \"{start}\"\noutput_topic = \"{name}/{{key}}\"\n"
    ))
    .unwrap_or_else(|e| panic!("pipeline {name} {s:?}: {e}"))
}

fn settings() -> impl Strategy<Value = Settings> {
    (
        0u8..3,
        0u8..3,
        0u8..3,
        0u8..3,
        0u8..2,
        0u8..2,
        any::<bool>(),
    )
        .prop_map(
            |(agg, window, filter, emit, dedup, limit, earliest)| Settings {
                agg,
                window,
                filter,
                emit,
                dedup,
                limit,
                earliest,
            },
        )
}

#[derive(Debug, Clone)]
enum Edit {
    /// The definition (aggregate, window) of pipeline 0..3; the start resets it.
    Definition(usize, u8, u8),
    Where(usize, u8),
    Emit(usize, u8),
    Dedup(usize, u8),
    Limit(usize, u8),
    Start(usize, bool),
    /// Pipeline `c` leaves the config (dormant) or comes back with these settings.
    RemoveC,
    AddC(Settings),
    /// The newest savepoint is restored (`cairn savepoint restore --latest`), if any.
    Restore,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stop {
    Kill,
    PowerCut,
    Clean,
}

/// One input: a new event (key, value), or a redelivery of the input `back` inputs ago.
#[derive(Debug, Clone)]
enum Input {
    New(u8, i16),
    Again(u8),
}

#[derive(Debug, Clone)]
enum Step {
    Live(Vec<Input>),
    Backfill(u8),
    Flush,
    /// A checkpoint; with `true` it is taken as the agent takes it, to commit beside the
    /// loop: it stays in flight (a read layer, its outputs pending) while the next steps
    /// apply records, until a later checkpoint, sync or clean stop commits it; a kill or
    /// power cut loses it uncommitted.
    Checkpoint(bool),
    /// The store's fsync; with `true`, a savepoint of that checkpoint is written after it.
    Sync(bool),
    /// Stop, edit, start; processing at start held after this many records, if set.
    Restart(Stop, Vec<Edit>, Option<u8>),
}

fn edit() -> impl Strategy<Value = Edit> {
    let p = 0usize..3;
    prop_oneof![
        2 => (p.clone(), 0u8..3, 0u8..3).prop_map(|(p, a, w)| Edit::Definition(p, a, w)),
        3 => (p.clone(), 0u8..3).prop_map(|(p, f)| Edit::Where(p, f)),
        2 => (p.clone(), 0u8..3).prop_map(|(p, e)| Edit::Emit(p, e)),
        2 => (p.clone(), 0u8..2).prop_map(|(p, d)| Edit::Dedup(p, d)),
        2 => (p.clone(), 0u8..2).prop_map(|(p, l)| Edit::Limit(p, l)),
        1 => (p, any::<bool>()).prop_map(|(p, e)| Edit::Start(p, e)),
        1 => Just(Edit::RemoveC),
        1 => settings().prop_map(Edit::AddC),
        1 => Just(Edit::Restore),
    ]
}

fn input() -> impl Strategy<Value = Input> {
    prop_oneof![
        6 => (0u8..5, -1000i16..1000).prop_map(|(k, v)| Input::New(k, v)),
        1 => (1u8..20).prop_map(Input::Again),
    ]
}

fn step() -> impl Strategy<Value = Step> {
    let stop = prop_oneof![Just(Stop::Kill), Just(Stop::PowerCut), Just(Stop::Clean)];
    prop_oneof![
        6 => proptest::collection::vec(input(), 1..12).prop_map(Step::Live),
        2 => (1u8..30).prop_map(Step::Backfill),
        1 => Just(Step::Flush),
        3 => any::<bool>().prop_map(Step::Checkpoint),
        2 => any::<bool>().prop_map(Step::Sync),
        3 => (
            stop,
            proptest::collection::vec(edit(), 0..3),
            proptest::option::weighted(0.25, 0u8..20)
        )
            .prop_map(|(s, e, h)| Step::Restart(s, e, h)),
    ]
}

/// Commit the checkpoint in flight, if there is one, as the keeper's thread does (not
/// synced: that is [`Step::Sync`]'s).
fn commit_in_flight(proc: &mut Processor) {
    if let Some(cp) = proc.inflight() {
        let info = proc.store().commit_unsynced(cp, 0).unwrap();
        proc.checkpoint_committed(&info);
    }
}

/// The case's world: the data directory and what the oracle has seen.
struct World {
    dir: tempfile::TempDir,
    sync: Durability,
    /// The config: `a`, `b`, `c` (`c` may be absent).
    config: [Option<Settings>; 3],
    /// The definition each pipeline last ran with (to know when adding `c` back needs a
    /// reset, as an operator would be told).
    ran: [Option<(u8, u8)>; 3],
    reset: Vec<String>,
    /// Every payload each output ID was seen with.
    published: HashMap<String, Vec<u8>>,
    /// (event ID, key) of every input the log holds, in log order: all acknowledged, since
    /// every step commits what it appends before it processes anything.
    logged: Vec<(String, String)>,
    /// The last event ID given to a new input.
    next_id: u64,
}

const NAMES: [&str; 3] = ["a", "b", "c"];

impl World {
    fn new() -> World {
        let sync = TestSync::new();
        sync.drop_syncs
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let a = Settings {
            agg: 0,
            window: 0,
            filter: 0,
            emit: 0,
            dedup: 0,
            limit: 0,
            earliest: true,
        };
        World {
            dir: tempfile::tempdir().unwrap(),
            sync,
            config: [Some(a.clone()), Some(a.clone()), None],
            ran: [None; 3],
            reset: Vec::new(),
            published: HashMap::new(),
            logged: Vec::new(),
            next_id: 0,
        }
    }

    fn data(&self) -> &Path {
        self.dir.path()
    }

    fn store_dir(&self) -> PathBuf {
        self.data().join("store")
    }

    fn snapshot_dir(&self) -> PathBuf {
        self.data().join("store.synced")
    }

    fn savepoints(&self) -> PathBuf {
        self.data().join("savepoints")
    }

    fn specs(&self) -> Vec<PipelineSpec> {
        self.config
            .iter()
            .zip(NAMES)
            .filter_map(|(s, n)| s.as_ref().map(|s| spec(n, s)))
            .collect()
    }

    fn log_options(&self) -> LogOptions {
        LogOptions {
            dir: self.data().join("log"),
            segment_size: 4096,
            max_size: 1 << 30,
            max_payload: 1024,
        }
    }

    fn record(&mut self, id: &str, payload: &[u8]) -> Result<(), TestCaseError> {
        match self.published.get(id) {
            Some(old) if old.as_slice() != payload => Err(TestCaseError::fail(format!(
                "output ID {id} carries two payloads:\n  {}\n  {}",
                String::from_utf8_lossy(old),
                String::from_utf8_lossy(payload)
            ))),
            Some(_) => Ok(()),
            None => {
                self.published.insert(id.to_string(), payload.to_vec());
                Ok(())
            }
        }
    }

    /// Everything that could have gone out: pending outputs and the whole outbox.
    fn record_all(&mut self, proc: &Processor) -> Result<(), TestCaseError> {
        let pending: Vec<_> = proc
            .pending_outputs()
            .iter()
            .map(|(_, o)| (o.id.clone(), o.payload.clone()))
            .collect();
        for (id, p) in pending {
            self.record(&id, &p)?;
        }
        let outbox: Vec<_> = proc
            .store()
            .outbox_from(0)
            .map(|r| r.unwrap().1)
            .map(|o| (o.id, o.payload))
            .collect();
        for (id, p) in outbox {
            self.record(&id, &p)?;
        }
        Ok(())
    }

    /// The store as a power cut right now would leave it: copied after a sync.
    fn snapshot(&self) {
        let to = self.snapshot_dir();
        let _ = std::fs::remove_dir_all(&to);
        copy_dir(&self.store_dir(), &to);
    }

    /// Start as the agent does (`agent/start.rs`): the plan with its settle, the replay,
    /// then the rest of the log as catch-up once the hold is over.
    fn start(&mut self, log: &Log, hold_after: Option<u8>) -> Result<Processor, TestCaseError> {
        let store = Store::open(&self.store_dir(), 1 << 20, self.sync.clone())
            .map_err(|e| TestCaseError::fail(format!("the store does not open: {e}")))?;
        // Resets name configured pipelines only (an operator resets what the start would
        // refuse; a reset of a pipeline neither configured nor stored is refused itself).
        let mut reset = std::mem::take(&mut self.reset);
        let configured: Vec<&str> = NAMES
            .iter()
            .zip(&self.config)
            .filter(|(_, s)| s.is_some())
            .map(|(n, _)| *n)
            .collect();
        reset.retain(|r| configured.contains(&r.as_str()));
        reset.dedup();
        stats::add(2, 1);
        stats::add(7, reset.len() as u64);
        let from = StartFrom {
            data_dir: self.dir.path(),
            sync: &self.sync,
            reset: &reset,
        };
        let mut taken = 0u64;
        let mut hold = |p: &Processor| {
            let limit = u64::from(hold_after?);
            let _ = p;
            taken += 1;
            if taken == limit + 1 {
                stats::add(4, 1);
            }
            (taken > limit).then(|| Hold {
                why: "the outbox is at its bound (model)".into(),
                commit: true,
            })
        };
        let mut settled = Vec::new();
        let started = Processor::start::<ProcessError>(store, self.specs(), from, &mut |old| {
            stats::add(3, 1);
            if log.next_offset() <= old.next_offset() {
                return Ok(None);
            }
            old.set_batch_bound(REPLAY_KEYS, 50);
            let stats = old.replay_held(log, 50, &|| 0, &mut |_| {}, &mut hold)?;
            stats::add(10, stats.checkpoints);
            settled.extend(
                old.store()
                    .outbox_from(0)
                    .map(|r| r.unwrap().1)
                    .map(|o| (o.id, o.payload)),
            );
            Ok(stats.held)
        });
        let mut proc = started
            .map_err(|e| TestCaseError::fail(format!("the agent does not come back up: {e}")))?;
        for (id, p) in settled {
            self.record(&id, &p)?;
        }
        if log.next_offset() < proc.next_offset() {
            return Err(TestCaseError::fail("the log is behind the store"));
        }
        proc.set_batch_bound(REPLAY_KEYS, 50);
        let replayed = proc
            .replay_held(log, 50, &|| 0, &mut |_| {}, &mut hold)
            .map_err(|e| TestCaseError::fail(format!("replay at start failed: {e}")))?;
        stats::add(10, replayed.checkpoints);
        self.record_all(&proc)?;
        // The held rest, as the loop's catch-up takes it once results leave (in one slice:
        // the steps below apply live records after it).
        proc.set_batch_bound(u64::MAX, u64::MAX);
        proc.catch_up(log, u64::MAX, &mut |_, _| {})
            .map_err(|e| TestCaseError::fail(format!("catch-up failed: {e}")))?;
        self.record_all(&proc)?;
        for (i, s) in self.config.iter().enumerate() {
            if let Some(s) = s {
                self.ran[i] = Some(s.definition());
            }
        }
        proc.defer_sync();
        proc.store().sync().unwrap();
        self.snapshot();
        Ok(proc)
    }

    fn edit(&mut self, e: &Edit) {
        fn set(config: &mut [Option<Settings>; 3], p: usize, f: &mut dyn FnMut(&mut Settings)) {
            if let Some(s) = config[p].as_mut() {
                f(s);
            }
        }
        let c = &mut self.config;
        match e {
            Edit::Definition(p, agg, window) => {
                let before = c[*p].as_ref().map(Settings::definition);
                set(c, *p, &mut |s| {
                    s.agg = *agg;
                    s.window = *window;
                });
                let after = self.config[*p].as_ref().map(Settings::definition);
                if before != after && self.ran[*p].is_some() {
                    self.reset.push(NAMES[*p].to_string());
                }
            }
            Edit::Where(p, f) => set(c, *p, &mut |s| s.filter = *f),
            Edit::Emit(p, v) => set(c, *p, &mut |s| s.emit = *v),
            Edit::Dedup(p, v) => set(c, *p, &mut |s| s.dedup = *v),
            Edit::Limit(p, v) => set(c, *p, &mut |s| s.limit = *v),
            Edit::Start(p, v) => set(c, *p, &mut |s| s.earliest = *v),
            Edit::RemoveC => self.config[2] = None,
            Edit::AddC(s) => {
                if self.config[2].is_none() {
                    if self.ran[2].is_some_and(|d| d != s.definition()) {
                        self.reset.push("c".into());
                    }
                    self.config[2] = Some(s.clone());
                }
            }
            Edit::Restore => {
                let Some(newest) = crate::store::list_savepoints(&self.savepoints())
                    .unwrap()
                    .pop()
                else {
                    return;
                };
                stats::add(8, 1);
                super::restored::mark(self.data(), "model restore", &self.sync).unwrap();
                crate::store::restore_savepoint(
                    &newest.path,
                    &self.store_dir(),
                    1 << 20,
                    self.sync.clone(),
                )
                .unwrap();
                // The restored store's pipelines as they were: a reset named now would
                // name the store's, which the restore may have changed. Keep the resets
                // only for what the restored store still holds under another definition:
                // the start refuses the rest, and says so.
                let store = Store::open(&self.store_dir(), 1 << 20, self.sync.clone()).unwrap();
                let progress = store.progress().unwrap();
                drop(store);
                self.reset.clear();
                for (i, name) in NAMES.iter().enumerate() {
                    let stored = progress.pipelines.iter().find(|p| p.name == *name);
                    if let (Some(stored), Some(s)) = (stored, &self.config[i])
                        && stored.definition != crate::pipeline::engine::definition(&spec(name, s))
                    {
                        self.reset.push(name.to_string());
                    }
                }
                let _ = std::fs::remove_dir_all(self.snapshot_dir());
                self.snapshot();
            }
        }
    }
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let target = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &target);
        } else {
            std::fs::copy(e.path(), &target).unwrap();
        }
    }
}

fn run(steps: &[Step]) -> Result<(), TestCaseError> {
    let mut w = World::new();
    let (mut log, _) = Log::open(w.log_options(), w.sync.clone()).unwrap();
    let mut proc = w.start(&log, None)?;
    let final_steps = [Step::Restart(Stop::Clean, Vec::new(), None)];
    for step in steps.iter().chain(&final_steps) {
        match step {
            Step::Live(inputs) => {
                let first = log.next_offset();
                for inp in inputs {
                    let (id, key) = match inp {
                        Input::New(k, _) => {
                            w.next_id += 1;
                            (format!("E{}", w.next_id), format!("K{k}"))
                        }
                        Input::Again(back) => match w.logged.len().checked_sub(*back as usize) {
                            Some(i) => w.logged[i].clone(),
                            None => continue,
                        },
                    };
                    let value = match inp {
                        Input::New(_, v) => *v,
                        Input::Again(b) => i16::from(*b),
                    };
                    // Event times follow the ID: a redelivery carries its old time.
                    let t: u64 = id[1..].parse::<u64>().unwrap() * 10;
                    let at = 1_000 + 10_000 * log.next_offset();
                    let payload = format!("{id}/{key}/{value}/{t}");
                    log.append(at, "t/run", payload.as_bytes(), 1, false)
                        .unwrap();
                    w.logged.push((id, key));
                }
                // Acknowledged only once durable; then processed as the loop does.
                log.commit().unwrap();
                if proc.next_offset() < first {
                    proc.catch_up(&log, u64::MAX, &mut |_, _| {}).unwrap();
                } else {
                    for rec in log.read_from(first).unwrap() {
                        proc.apply(&rec.unwrap()).unwrap();
                    }
                }
            }
            Step::Backfill(n) => {
                proc.backfill_slice(&log, u64::from(*n)).unwrap();
            }
            Step::Flush => proc.flush_upserts(),
            Step::Checkpoint(beside) => {
                w.record_all(&proc)?;
                commit_in_flight(&mut proc);
                if *beside {
                    if proc.begin_checkpoint(&|_, _| false).unwrap().is_some() {
                        stats::add(9, 1);
                    }
                } else {
                    proc.checkpoint(0).unwrap();
                }
                w.record_all(&proc)?;
            }
            Step::Sync(savepoint) => {
                commit_in_flight(&mut proc);
                proc.store().sync().unwrap();
                let next = proc.store().progress().unwrap().next_offset;
                proc.synced(next);
                w.snapshot();
                if *savepoint {
                    proc.store()
                        .write_savepoint(&w.savepoints(), &w.sync)
                        .unwrap();
                }
            }
            Step::Restart(stop, edits, hold) => {
                // Whatever was computed may have gone out before the stop.
                w.record_all(&proc)?;
                if *stop == Stop::Clean {
                    commit_in_flight(&mut proc);
                    proc.checkpoint(0).unwrap();
                    proc.store().sync().unwrap();
                    w.record_all(&proc)?;
                }
                drop(proc);
                drop(log);
                stats::add(if *stop == Stop::PowerCut { 5 } else { 6 }, 1);
                if *stop == Stop::PowerCut {
                    let store = w.store_dir();
                    std::fs::remove_dir_all(&store).unwrap();
                    copy_dir(&w.snapshot_dir(), &store);
                    tear_log_tail(&w.log_options().dir);
                }
                for e in edits {
                    w.edit(e);
                }
                log = Log::open(w.log_options(), w.sync.clone())
                    .map_err(|e| TestCaseError::fail(format!("the log does not open: {e}")))?
                    .0;
                proc = w.start(&log, *hold)?;
            }
        }
    }
    // Drain: every backfill to its end, everything checkpointed.
    while proc.backfill_slice(&log, 1000).unwrap().is_some() {}
    proc.catch_up(&log, u64::MAX, &mut |_, _| {}).unwrap();
    w.record_all(&proc)?;
    commit_in_flight(&mut proc);
    proc.checkpoint(0).unwrap();
    w.record_all(&proc)?;

    // `a` counts every distinct event ID of each key once: nothing lost, nothing twice.
    let mut want: BTreeMap<String, HashSet<String>> = BTreeMap::new();
    for (id, key) in &w.logged {
        want.entry(key.clone()).or_default().insert(id.clone());
    }
    let want: BTreeMap<String, u64> = want
        .into_iter()
        .map(|(k, ids)| (k, ids.len() as u64))
        .collect();
    let got: BTreeMap<String, u64> = proc
        .store()
        .states(Some("a"))
        .map(|r| r.unwrap())
        .map(|(_, k, st)| (String::from_utf8(k).unwrap(), st.count))
        .collect();
    prop_assert_eq!(got, want, "pipeline a's counts per key against the log");
    stats::add(0, 1);
    stats::add(1, steps.len() as u64);
    stats::print();
    Ok(())
}

/// Bytes of a frame that never finished at the end of the newest segment.
fn tear_log_tail(dir: &Path) {
    let Some(last) = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "log"))
        .max()
    else {
        return;
    };
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new().append(true).open(last).unwrap();
    f.write_all(&[40, 0, 0, 0, 1, 2, 3]).unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(CASES),
        ..ProptestConfig::default()
    })]

    #[test]
    fn across_crashes_power_cuts_and_config_edits_no_id_gets_two_payloads_and_nothing_is_lost(
        steps in proptest::collection::vec(step(), 1..40),
    ) {
        run(&steps)?;
    }
}
