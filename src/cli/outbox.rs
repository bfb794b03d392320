//! `cairn outbox {list,drop}`: what waits to go out, and the operator's way to give up one
//! stuck result (issue 27).
//!
//! `drop` works on the stopped agent's store (the store's lock refuses it while the agent
//! runs): the entry is taken out of the outbox for every sink it waits for, durably (its
//! chunk is rewritten without it and the store fsynced), and recorded as a dead letter
//! `dropped_by_operator`, so `cairn inspect dead-letters` says what was dropped, when and
//! what it held. The agent, started again, sends what came after it.

use clap::Subcommand;

use super::failure::Failure;
use super::inspect::{Filter, Inspect};
use super::output::emit;
use crate::config::Config;
use crate::model::DeadLetter;
use crate::store::{Store, StoreError};

#[derive(Subcommand, Debug)]
pub(crate) enum OutboxCommand {
    /// Results waiting in the outbox: sequence, output ID, topic, payload (as `inspect
    /// outbox`).
    List(Filter),
    /// Give up one waiting result for good (agent stopped): it leaves the outbox for every
    /// sink and becomes a dead letter `dropped_by_operator`.
    Drop {
        /// The output ID, as `cairn outbox list` shows it.
        output_id: String,
        #[arg(long)]
        json: bool,
    },
}

pub(crate) fn run(cfg: &Config, cmd: OutboxCommand) -> Result<(), Failure> {
    match cmd {
        OutboxCommand::List(f) => super::inspect::run(cfg, Inspect::Outbox(f)),
        OutboxCommand::Drop { output_id, json } => drop_one(cfg, &output_id, json),
    }
}

fn store_failure(e: StoreError) -> Failure {
    match e {
        StoreError::Locked { .. } => Failure::runtime(format!(
            "{e}: stop the agent first (`systemctl stop cairn`); `cairn outbox list` works \
             while it runs"
        )),
        e => Failure::runtime(e),
    }
}

fn drop_one(cfg: &Config, output_id: &str, json: bool) -> Result<(), Failure> {
    let dir = cfg.store_dir();
    if !dir.join("db").exists() {
        return Err(Failure::runtime(format!(
            "no store at {} yet: nothing waits",
            dir.display()
        )));
    }
    let store =
        Store::open(&dir, cfg.storage.cache_size, crate::fsio::real()).map_err(store_failure)?;
    crate::logging::progress::done();
    let Some((seq, out)) = store.outbox_find(output_id).map_err(store_failure)? else {
        return Err(Failure::runtime(format!(
            "no result with ID {output_id:?} waits in the outbox (`cairn outbox list` shows \
             what does)"
        )));
    };
    let progress = store.progress().map_err(store_failure)?;
    let pipeline = crate::agent::pipeline_of(output_id).to_string();
    let max = crate::pipeline::engine::DEAD_LETTER_PAYLOAD_MAX;
    let letter = DeadLetter {
        offset: progress.next_offset,
        pipeline,
        topic: out.topic.clone(),
        reason: "dropped_by_operator".into(),
        detail: format!("result {output_id} (outbox entry {seq}) dropped with `cairn outbox drop`"),
        received_at_ms: crate::agent::wall_ms(),
        payload: out.payload[..out.payload.len().min(max)].to_vec(),
    };
    store
        .add_sink_dead_letter(&letter, "operator", seq)
        .map_err(store_failure)?;
    if !store
        .outbox_set_aside(seq, output_id)
        .map_err(store_failure)?
    {
        return Err(Failure::runtime(format!(
            "result {output_id:?} left the outbox while being dropped"
        )));
    }
    store.sync().map_err(store_failure)?;
    if json {
        emit(
            &serde_json::json!({"dropped": output_id, "seq": seq, "topic": out.topic}).to_string(),
        )?;
    } else {
        emit(&format!(
            "dropped {} (outbox entry {seq}, topic {}); recorded as a dead letter \
             `dropped_by_operator`",
            super::output::printable(output_id),
            super::output::printable(&out.topic)
        ))?;
    }
    Ok(())
}
