//! # Cairn
//!
//! A single-process agent for an edge box: it consumes MQTT messages, keeps keyed
//! aggregates, and publishes results, so that a power cut at any instant only causes replay.
//!
//! ## Bird's-eye view
//!
//! ```text
//!  broker ─PUBLISH q1─▶ mqtt ─▶ agent: append to log ─(fsync)─▶ PUBACK, in receipt order
//!                                 │
//!                                 ▼
//!                        processor: pipeline engine (parse → dedup → aggregate → window)
//!                                 │   pure: same checkpoint + same records ⇒ same writes
//!                                 ▼
//!                        store: ONE sled transaction {state, dedup, outbox (what the
//!                                 broker has not acknowledged yet), dead letters,
//!                                 progress(next_offset)} + a real fsync
//!                                 │
//!  broker ◀─PUBLISH q1 (id)── agent: publish outbox entries, then results not yet
//!                             checkpointed (their inputs are durable); settle on PUBACK
//! ```
//!
//! Recovery is replay: open the log (truncating a torn tail), load the last checkpoint,
//! re-apply the log from its `next_offset`.
//!
//! ## Codemap
//!
//! - [`model`]: plain data: `Record`, `Offset`, and what a checkpoint persists (`Progress`,
//!   `PipelineProgress`, `Counters`, `Output`, `DeadLetter`), and the bounds on one stored
//!   entry that the engine, config validation and the store all check.
//! - [`pipeline`]: pipeline definitions, payload parsing, `where` filters, dedup, aggregates
//!   (with a deterministic quantile sketch and a time-weighted average), tumbling and hopping
//!   windows, output IDs; the [`pipeline::engine::Engine`] and an in-memory reference store.
//!   `pipeline/sparkplug/`: Sparkplug B in (issue 31): the protobuf schema and the one
//!   decode entry point, edge node sessions (stored in the store's `sparkplug` tree, in the
//!   same checkpoint), and the engine's room where one record becomes many events.
//! - [`log`]: the segmented, CRC-framed replay log: group commit, torn-tail recovery,
//!   corruption detection and repair, retention.
//! - [`store`]: the sled checkpoint store (`store/commit.rs` the one transaction,
//!   `store/open.rs`, `store/read.rs`, `store/v2.rs` for format-2 stores), savepoints,
//!   inspection through a private copy (`store/copy.rs`).
//! - [`processor`]: log records → engine → checkpoints. `processor/slice.rs`: the one
//!   log-slice reader (the replay at start, catch-up behind the log, backfills for
//!   `start = "earliest"`). Start-up as one plan: `processor/plan.rs` decides, with no IO,
//!   from what the last run left (the store, `processor/generations.rs`, the last run's
//!   pipelines `processor/last_run.rs`, a savepoint restore `processor/restored.rs`) and the
//!   config, what settles, continues, starts empty or over, goes dormant, goes on in a new
//!   generation, backfills, or is refused; `processor/open.rs` carries it out.
//!   `processor/quarantine.rs`: a record whose processing panics is retried a bounded
//!   number of times, then set aside. `processor/inflight.rs`: a checkpoint committing
//!   beside the loop, read as a layer until it is done.
//! - [`clock`]: the time of receipt stamped on new records, monotonic across clock steps;
//!   the only place the wall clock is read.
//! - [`mqtt`]: the rumqttc facade: manual acks, packet-id binding, reconnect backoff (reset
//!   only after a connection stayed up), TLS; the broker's own count of dropped messages
//!   (`mqtt/sys.rs`); MQTT 5 result connections whose PUBACK can refuse (`mqtt/v5/`).
//! - [`agent`]: one event loop (`agent/mod.rs`, the one `impl Agent`, at most 12 fields)
//!   over parts it owns and hands the IO they need, carrying out what they return; no part
//!   imports the loop. `agent/ingest.rs` (group commit, ack order, held input and
//!   backpressure, the free-space guard, times of receipt, `too_large` stand-ins);
//!   `agent/results/` (the outbox room: `cursor.rs` what goes out next and what a PUBACK
//!   settles, `mqtt.rs` the MQTT sink and the uplink with its prefix and drain figures,
//!   `waiting.rs` what waits for each sink, exactly, for the figures; the outbox bound in
//!   `mod.rs`); `agent/work.rs` (when catch-up or backfill takes a slice:
//!   never past the outbox bound); `agent/keeper/` (`schedule.rs` when to checkpoint,
//!   retention's cutoff, savepoint schedule and floor, the store watch; `commit.rs` the
//!   checkpoint's transaction and fsync on their own thread; retention, savepoints and
//!   checkpoints waiting for disk room in `mod.rs`); `agent/figures.rs` (`/metrics`, `STATUS=`, the watchdog);
//!   `agent/start.rs` (recovery); SIGHUP carries out `config::reload`'s plan;
//!   `agent/memory.rs` (heap trimming); `agent/host.rs` (Cairn as a Sparkplug host: STATE
//!   with its will, rebirth requests, never from replay).
//! - [`config`]: TOML → validated [`config::Config`], every problem with file and line;
//!   every key's default, range, reload behaviour and reason once, in `config/keys.rs`
//!   (validation, `validate`'s summary, `docs/configuration.md` and the SIGHUP plan of
//!   `config/reload.rs` read it).
//! - [`cli`]: the `cairn` command, one file per command in `cli/` (`run`, `validate`,
//!   `inspect`, `verify`, `status`, `savepoint`), and `cli/failure.rs` for the exit codes
//!   every command shares; `cli/progress.rs` draws long commands' progress on a terminal;
//!   the man pages and completions in `dist/` are generated from it (`cli/generated.rs`).
//! - [`fsio`]: the durability seam every fsync goes through; [`failpoint`]: crash injection
//!   (feature `failpoints`); [`disk`]: free-space guard; [`notify`], [`logging`]: systemd
//!   notify, logging (under systemd natively to the journal, each line with its
//!   `CAIRN_EVENT` and fields: [`event!`], `logging/journal.rs`), and the progress facade
//!   of long commands (`logging/progress.rs`); [`text`]: the code points an MQTT receiver may refuse,
//!   and sender-controlled strings escaped for the journal.
//! - [`metrics`]: the figures, as Prometheus text (`/metrics`) and as the JSON `cairn
//!   status` reads (`/status.json`), both from one table built from one copy
//!   (`metrics/render.rs`, `metrics/status.rs`); the bounded server in `metrics/server.rs`,
//!   on the `[metrics] listen` loopback address and always on the data directory's
//!   `cairn.sock`, where `cairn status` finds a running agent.
//!
//! ## Invariants, as absences
//!
//! 1. The agent never PUBACKs an input before its log record is fsynced
//!    (`tests/it/crash.rs`, `tests/it/log_crash.rs`).
//! 2. No checkpoint is ever partly visible: the store never commits state without the dedup
//!    entries, outbox entries and `next_offset` that go with it (`tests/it/checkpoint.rs`,
//!    `tests/it/model.rs`).
//! 3. [`pipeline`] never reads the clock, never draws a random number, and never sees sled,
//!    rumqttc, tokio or the file system (`tests/it/model.rs`, `tests/it/pipeline.rs`).
//! 4. Recovery never trusts anything but the log and the last checkpoint.
//! 5. An event ID inside the dedup window is never applied twice, whoever sent it twice.
//! 6. The publisher never sends a result whose inputs are not durable in the log, and an ID
//!    never carries two payloads, across any crash. Results leave at log-commit latency, before
//!    their checkpoint; after a restart no key's result goes back to an older version
//!    (`tests/it/crash.rs`: repeated IDs carry one payload, first-seen versions ascend per
//!    key, the last retained value is the oracle's, and a kill after a result's PUBACK and
//!    before its checkpoint re-sends it unchanged); nor across a config edit after a crash,
//!    a backfill included, or a savepoint restore: the start plan settles the log tail
//!    under the last run's pipelines or starts a new generation (`tests/it/early.rs`,
//!    `tests/it/start_plan.rs`, and the plan's table of cases in `processor/plan/tests.rs`).
//! 7. No queue, log, ledger or batch grows without a configured bound; reaching one stops
//!    acknowledging instead of dropping (`tests/it/faults.rs`, `tests/it/e2e.rs`), except the
//!    outbox's: at it processing waits and the log holds the input, which is still
//!    acknowledged (`e2e::a_small_outbox_bound_holds_processing_back_not_input_and_survives_a_kill`,
//!    `uplink::a_full_outbox_pauses_processing_not_input_...`); backfills and the replay at
//!    start wait at it too (`tests/it/outbox_bound.rs`), and a checkpoint on a disk below
//!    the free-space reserve waits instead of failing (`agent/keeper`). A full log
//!    first deletes segments every durable checkpoint covers, so it never stays full
//!    (`tests/it/retention.rs`; the rule is in `log`'s docs), except those an unfinished
//!    backfill still needs (`tests/it/backfill.rs`).
//! 8. Bad input never stops processing: it becomes a dead letter with a reason, and no
//!    record can make the engine panic or the agent crash-loop (`tests/it/pipeline.rs`,
//!    `tests/it/hostile.rs`; oversized inputs and records whose processing panics:
//!    `tests/it/field.rs`).
//! 9. State is never read under a definition other than the one that wrote it, even for a
//!    pipeline removed from the config and added back; and a reset, a rebuilt store or a
//!    pipeline added back never gives an output ID that went out a second payload: each new
//!    lineage is a new generation of IDs (`tests/it/definitions.rs`).
//!
//! Only [`store`] imports sled; only [`mqtt`] imports rumqttc or tokio; [`pipeline`] touches
//! no file, socket, thread or clock; [`store`], [`log`] and [`pipeline`] never import
//! [`agent`] or [`mqtt`]; nothing imports [`cli`]; no part of the agent imports
//! `agent/mod.rs`; only [`clock`] reads the wall clock (`tests/it/layering.rs` fails on a
//! forbidden import, an `impl Agent` outside `agent/mod.rs`, or an `Agent` of more than 12
//! fields).

pub mod agent;
pub(crate) mod alloc;
pub mod cli;
pub(crate) mod clock;
pub mod config;
pub mod disk;
pub(crate) mod failpoint;
pub mod fsio;
#[doc(hidden)]
pub mod fuzzing;
pub mod log;
pub mod logging;
pub mod metrics;
pub mod model;
pub mod mqtt;
pub mod notify;
pub mod pipeline;
pub mod processor;
pub(crate) mod signals;
pub mod sink;
pub mod store;
pub mod text;
