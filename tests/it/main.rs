//! The one integration test binary (issue 12, item 3). Each module is one concern; every
//! test that runs the agent, a broker or a config goes through [`support`]: one process
//! wrapper (`support::agent::CairnProcess`), one broker wrapper (`support::Broker`), one
//! config builder (`support::agent::AgentConfig`). One binary links the crate and its
//! dependencies once instead of once per file.
//!
//! Run one module with a filter: `cargo test --all-features --test it crash::`.
//! `tests/powercut-fs` is a separate workspace crate with its own tests.

mod support;

mod backfill;
mod checkpoint;
mod cli;
mod commit_beside;
mod config_errors;
mod crash;
mod dbsinks;
mod dbsinks_e2e;
mod definitions;
mod docs;
mod e2e;
mod early;
mod faults;
mod field;
mod fuzz_corpus;
mod hostile;
mod journal;
mod layering;
mod log_corruption;
mod log_crash;
mod model;
mod monitoring;
mod mqtt5;
mod mqtt_client;
mod mqtt_flaps;
mod mqtt_flow;
mod mqtt_sys;
mod ops;
mod outbox_bound;
mod pipeline;
mod progress;
mod readme;
mod reload;
mod retention;
mod reused_ids;
mod savepoint;
mod sinks;
mod snippet;
mod sparkplug;
mod start_plan;
mod status;
mod uplink;
