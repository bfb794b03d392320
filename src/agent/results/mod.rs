//! The outbox room: what waits to go out, where it goes, what an acknowledgement settles,
//! and the outbox's bound.
//!
//! - **What is waiting**: the durable outbox entries (the store's `outbox` tree) and the
//!   outputs processing made since the last checkpoint (the processor's memory): both may
//!   leave, since their inputs are durable in the log (`cursor.rs`). Except while a
//!   pipeline that emits upserts backfills: then only what a durable checkpoint holds
//!   leaves (`Processor::results_wait_for_checkpoint`, [`Results::publish`]).
//! - **Sinks** (issue 29): `local` (the input connection), `uplink` with `[uplink]`, then
//!   each `[[sink]]`, in that order ([`Results::new`]). Each has its own
//!   [`cursor::Cursor`] over the one queue and sends, in order, only the results of the
//!   pipelines that name it (`cursor::next_routed`; a pipeline no longer configured goes
//!   where results went by default). A sink that is down or refusing sends nothing and
//!   holds no other back: its results wait, up to the shared bound.
//! - **Settled**: a destination's positive answer settles, per sink, a contiguous prefix of
//!   what it was sent ([`Results::acked`]); an entry is deleted once every sink it is routed
//!   to has settled it ([`Results::settled_everywhere`]), and a checkpoint leaves such
//!   outputs out of the outbox ([`Results::settled`]). Each sink's settled position goes
//!   into every checkpoint's transaction ([`Results::positions`], the store's `sinks.rs`):
//!   after a crash each sink starts there, and entries every sink had settled are deleted
//!   at start ([`Results::start`]).
//! - **Refused**: an MQTT 5 PUBACK of 0x80 or more settles nothing; that sink goes back to
//!   the refused result and sends it and what followed again, in order, after a growing
//!   delay (`MqttSink::refused`). A result too large for a sink, or one its broker keeps
//!   refusing by closing the connection (`strikes.rs`), is a dead letter for that sink and
//!   settled there ([`Results::set_aside`]); the other sinks still get it.
//!
//! **A sink of another kind** (issue 30: PostgreSQL, JetStream) is a client that takes the
//! entries `next_routed` gives it, in order, and reports each one's outcome on the loop's
//! event channel as `Event::Sink(n, ..)`, through the hand-over `Mqtt::start_all` returns
//! (`mqtt::Sink::for_sink(n)`): `PubAcked` when the destination committed it (for
//! PostgreSQL, with the sink's settled position in the same transaction), `PubRefused` when
//! it said no (retried), `TooLarge` for a result it can never take (a dead letter), and
//! `Connected`/`Disconnected` for its link. Here it is one more [`mqtt::Conn`] variant:
//! publish, in-flight count and abandon are the three calls a sink's connection answers.
//! - **What waits for each sink** (`waiting.rs`): the outbox entries routed to it that it
//!   has not settled, their payload bytes and the oldest's age, kept exactly as entries are
//!   committed, settled, superseded and set aside ([`Results::checkpointed`]), and counted
//!   once from the outbox at start ([`Results::start`]).
//! - **The bound** ([`Results::full`], `outbox.max_entries` and `max_size`): past it,
//!   processing waits (live, catch-up, backfill and the replay at start alike: the `work`
//!   part asks here) and the log holds the input, which is still acknowledged (issue 16,
//!   invariant 7).
//!
//! Handed the IO it needs by the loop: the processor (its store's outbox, its fresh
//! outputs) and the input connection (the `local` sink's connection).

pub(crate) mod cursor;
pub(crate) mod dbsink;
pub(crate) mod mqtt;
pub(crate) mod strikes;
pub(crate) mod waiting;

use std::time::{Duration, Instant};

use std::collections::HashMap;

use crate::config::{Config, OutboxConfig};
use crate::metrics::Metrics;
use crate::model::Output;
use crate::mqtt::{Event, Mqtt};
use crate::processor::{Pending, Processor, Wait};

use super::error::{AgentError, failpoint};
use mqtt::MqttSink;

/// What the results room counts, for `/metrics` and the journal.
#[derive(Debug, Clone, Default)]
pub(crate) struct Counts {
    pub(crate) published: u64,
    pub(crate) pubacked: u64,
    /// Results published before the checkpoint that commits them (issue 14).
    pub(crate) published_early: u64,
    /// Results acknowledged before their checkpoint, so never written to the outbox.
    pub(crate) settled_early: u64,
    /// Results set aside for a destination that kept refusing them (dead letters).
    pub(crate) set_aside: u64,
}

/// The pipeline an output ID belongs to: `name/...`, or `name@generation/...`.
pub(crate) fn pipeline_of(output_id: &str) -> &str {
    output_id.split(['/', '@']).next().unwrap_or("")
}

/// The bound's rule: `entries` (stored and to come with the next checkpoint) and the
/// store's outbox `bytes` against `outbox.max_entries` and `max_size`.
fn full_at(cfg: &OutboxConfig, entries: u64, bytes: u64) -> Option<&'static str> {
    if entries >= cfg.max_entries {
        Some("outbox.max_entries")
    } else if bytes >= cfg.max_size {
        Some("outbox.max_size")
    } else {
        None
    }
}

/// One sink's routing bit: a pipeline's results go to the sinks whose bits its mask holds.
type Mask = u64;

pub(crate) struct Results {
    /// Every sink: `local` first (the input connection), then `uplink` if configured, then
    /// the `[[sink]]` tables in order ([`Results::sink_index`]).
    sinks: Vec<MqttSink>,
    /// Where `Event::Sink(0, ..)` sinks start in `sinks`.
    first_table: usize,
    /// Pipeline name → the sinks its results go to.
    routes: HashMap<String, Mask>,
    /// Results of a pipeline no longer configured go where results went by default.
    default_route: Mask,
    /// Results wait for their checkpoint (`Processor::results_wait_for_checkpoint`): said
    /// in the journal when it starts and ends.
    wait_for_checkpoint: Option<Wait>,
    pub(crate) counts: Counts,
}

impl Results {
    /// The sinks (in the order of [`Config::sink_names`]) and each pipeline's routes.
    pub(crate) fn new(cfg: &Config, mut sinks: Vec<MqttSink>) -> Results {
        let index = |name: &str| sinks.iter().position(|s| s.name == name);
        let mask = |names: &[String]| -> Mask {
            names
                .iter()
                .filter_map(|n| index(n))
                .fold(0, |m, i| m | (1 << i))
        };
        let default = if cfg.uplink.is_some() {
            crate::config::UPLINK_SINK
        } else {
            crate::config::LOCAL_SINK
        };
        let routes: HashMap<String, Mask> = cfg
            .pipelines
            .iter()
            .map(|p| (p.name.clone(), mask(&p.sinks)))
            .collect();
        let default_route = mask(&[default.to_string()]);
        for (i, s) in sinks.iter_mut().enumerate() {
            s.pipelines = routes.values().filter(|&&m| m & (1 << i) != 0).count() as u64;
            // `local` is the input connection, there whether results go to it or not.
            if i > 0 && s.pipelines == 0 {
                let sink = s.name.as_str();
                crate::event!(warn, "sink_unrouted", sink = sink;
                    "sink `{sink}`: no pipeline names it in `sinks`, so no results go to it \
                     (it still connects); `cairn status` shows it as `no pipelines`"
                );
            }
        }
        Results {
            default_route,
            first_table: 1 + usize::from(cfg.uplink.is_some()),
            sinks,
            routes,
            wait_for_checkpoint: None,
            counts: Counts::default(),
        }
    }

    /// The sinks' mask output `id` is routed to.
    fn route(&self, id: &str) -> Mask {
        *self
            .routes
            .get(pipeline_of(id))
            .unwrap_or(&self.default_route)
    }

    /// Whether output `seq` (`id`) is settled for every sink it is routed to.
    pub(crate) fn settled_everywhere(&self, seq: u64, id: &str) -> bool {
        let route = self.route(id);
        self.sinks
            .iter()
            .enumerate()
            .filter(|(i, _)| route & (1 << i) != 0)
            .all(|(_, s)| seq < s.cursor.settled_below())
    }

    /// Each sink's settled position, for the checkpoint to make durable.
    pub(crate) fn positions(&self) -> Vec<(String, u64)> {
        self.sinks
            .iter()
            .map(|s| (s.name.clone(), s.cursor.settled_below()))
            .collect()
    }

    /// At start: delete the outbox entries every sink they are routed to settled before
    /// the crash (deletions are not fsynced; the positions are, with the checkpoint), and
    /// count what waits for each sink from the rest: one walk of the outbox. Returns how
    /// many were deleted.
    pub(crate) fn start(&mut self, proc: &Processor) -> Result<u64, AgentError> {
        // What opening and replay superseded or added is in the outbox as it is now.
        let _ = proc.store().outbox_take_superseded();
        let _ = proc.store().outbox_take_added();
        let gone = self.count_waiting(proc, true)?;
        for (seq, id) in &gone {
            proc.store().outbox_delete(*seq, id)?;
        }
        Ok(gone.len() as u64)
    }

    /// Count what waits for each sink from the whole outbox; the entries every sink they
    /// are routed to has settled are returned instead when `settled` asks for them (at
    /// start, to delete; later there are none: they are deleted as they settle).
    fn count_waiting(
        &mut self,
        proc: &Processor,
        settled: bool,
    ) -> Result<Vec<(u64, String)>, AgentError> {
        for s in &mut self.sinks {
            s.waiting.clear();
        }
        let mut gone = Vec::new();
        for e in proc.store().outbox_from(0) {
            let (seq, out) = e?;
            if settled && self.settled_everywhere(seq, &out.id) {
                gone.push((seq, out.id));
            } else {
                self.count(seq, &out);
            }
        }
        Ok(gone)
    }

    /// Outbox entry `seq` waits for each sink it is routed to that has not settled it.
    fn count(&mut self, seq: u64, out: &crate::model::Output) {
        let route = self.route(&out.id);
        for (i, s) in self.sinks.iter_mut().enumerate() {
            if route & (1 << i) != 0 && seq >= s.cursor.settled_below() {
                s.waiting.add(seq, out.payload.len());
            }
        }
    }

    /// The index of `Event::Sink(n, ..)`'s sink.
    pub(crate) fn sink_index(&self, n: u16) -> usize {
        self.first_table + usize::from(n)
    }

    /// The index of the uplink's sink.
    pub(crate) fn uplink_index(&self) -> Option<usize> {
        (self.first_table == 2).then_some(1)
    }

    /// Whether the outbox is at its bound, and which: past it, processing waits. Results that
    /// processing made since the last checkpoint count as entries already (outputs, and
    /// upserts touched but not yet emitted): they enter the outbox with the next commit. Not
    /// counting them let a whole group commit's records in at once, and slices go on while a
    /// checkpoint waited for the previous one's fsync: a bound of 100 held 400 entries under
    /// load. Now it holds the bound plus the results of one record (live) or one slice
    /// (catch-up, backfill, replay). Their bytes are not known until they are encoded, so
    /// `max_size` counts the store's alone.
    pub(crate) fn full(cfg: &OutboxConfig, proc: &Processor) -> Option<&'static str> {
        let store = proc.store();
        let entries = (store.outbox_len() as u64).saturating_add(proc.pending_results() as u64);
        full_at(cfg, entries, store.outbox_bytes())
    }

    /// Each sink sends, in order and within its inflight window, the durable outbox entries
    /// routed to it from its cursor, then the outputs still waiting for their checkpoint
    /// (`cursor::next_routed`). A sink down or refusing sends nothing and holds no other.
    /// While results wait for their checkpoint (`Processor::results_wait_for_checkpoint`),
    /// only entries below the checkpoint in flight go, and no fresh output.
    pub(crate) fn publish(
        &mut self,
        proc: &Processor,
        input: &Mqtt,
        inflight: u16,
        now: Instant,
    ) -> Result<(), AgentError> {
        let wait = proc.results_wait_for_checkpoint();
        self.say_wait_for_checkpoint(wait, proc.next_offset());
        // Waiting, only what is durable goes: the outbox below the checkpoint in flight
        // (whose entries the store may show before its fsync ends), nothing fresh.
        let (durable_below, pending) = match wait {
            Some(Wait::ReplayOwed) => return Ok(()),
            Some(_) => (proc.pending_outputs().first_seq(), Pending::new(&[], &[])),
            None => (None, proc.pending_outputs()),
        };
        for i in 0..self.sinks.len() {
            let room = self.sinks[i].room(inflight, input, now);
            if room == 0 {
                continue;
            }
            let from = self.sinks[i].cursor.cursor();
            let bit: Mask = 1 << i;
            let (routes, default) = (&self.routes, self.default_route);
            let routed =
                |id: &str| routes.get(pipeline_of(id)).copied().unwrap_or(default) & bit != 0;
            let durable = |e: &Result<(u64, Output), _>| match (e, durable_below) {
                (Ok((seq, _)), Some(below)) => *seq < below,
                _ => true,
            };
            let (batch, next) = cursor::next_routed(
                from,
                room,
                proc.store().outbox_from(from).take_while(durable),
                pending,
                routed,
            )?;
            self.sinks[i].send(batch, Some(next), input, &mut self.counts, now)?;
        }
        Ok(())
    }

    fn say_wait_for_checkpoint(&mut self, wait: Option<Wait>, offset: u64) {
        if std::mem::replace(&mut self.wait_for_checkpoint, wait) == wait {
            return;
        }
        match wait {
            Some(Wait::UpsertBackfill) => crate::event!(info, "results_wait_for_checkpoint";
                "results: a pipeline that emits upserts backfills; until the checkpoint that \
                 records its end is durable, results leave once their checkpoint is durable \
                 instead of before it (a backfill resumed after a crash would emit other \
                 versions than the ones that went out)"
            ),
            Some(Wait::PastSendHorizon) => crate::event!(info, "results_wait_past_send_horizon";
                "results: processing is at offset {}, past the send horizon of the last \
                 durable checkpoint (checkpoints fall behind); results leave once their \
                 checkpoint is durable until one records a horizon past it (a restart replays \
                 only up to the horizon before it sends)",
                offset
            ),
            Some(Wait::ReplayOwed) => crate::event!(warn, "results_wait_for_replay";
                "results: the replay at start stopped at offset {} (the disk is nearly full), \
                 short of where results of the run before may have left from; nothing is sent \
                 until a checkpoint there is durable, so that no key goes back in version",
                offset
            ),
            None => crate::event!(info, "results_leave_early";
                "results: no backfill of upserts left to make durable and processing within \
                 the send horizon; results leave before their checkpoint again"
            ),
        }
    }

    /// Read ahead what each sink sends next from the outbox, before the commit of a
    /// checkpoint of `outputs` outputs keeps the store from the loop
    /// (`Store::outbox_prefetch`).
    pub(crate) fn prefetch(&self, proc: &Processor, outputs: usize) -> Result<(), AgentError> {
        let each = crate::store::prefetch_chunks(outputs, self.sinks.len());
        for s in &self.sinks {
            proc.store().outbox_prefetch(s.cursor.cursor(), each)?;
        }
        Ok(())
    }

    /// Sink `i`'s destination acknowledged a result: delete the outbox entries it settles
    /// for every sink they are routed to.
    pub(crate) fn acked(
        &mut self,
        i: usize,
        output_id: &str,
        proc: &Processor,
    ) -> Result<(), AgentError> {
        let Some(sink) = self.sinks.get_mut(i) else {
            return Ok(());
        };
        sink.strikes.cleared(output_id);
        let settled = sink.cursor.acked(output_id);
        if !settled.is_empty() {
            sink.accepted();
        }
        sink.acked += settled.len() as u64;
        sink.follow_settled();
        self.settle(settled, None, proc)
    }

    /// Outputs that became settled for one sink: those settled for every sink they are
    /// routed to leave the outbox (`aside`: the one set aside for good, whose chunk is
    /// rewritten at once).
    fn settle(
        &mut self,
        settled: Vec<(u64, String)>,
        aside: Option<u64>,
        proc: &Processor,
    ) -> Result<(), AgentError> {
        // Outputs from `fresh` on are not in the store yet: nothing to delete.
        let fresh = proc.pending_outputs().first_seq().unwrap_or(u64::MAX);
        for (seq, id) in settled {
            if seq >= fresh {
                // At the broker, its checkpoint not yet committed (tests/it/crash.rs).
                failpoint("publish.acked_before_checkpoint")?;
            } else if Some(seq) == aside {
                proc.store().outbox_set_aside(seq, &id)?;
            } else if self.settled_everywhere(seq, &id) {
                failpoint("outbox.before_delete")?;
                proc.store().outbox_delete(seq, &id)?;
                failpoint("outbox.after_delete")?;
            }
            if Some(seq) != aside {
                self.counts.pubacked += 1;
            }
        }
        Ok(())
    }

    /// A connection ended: the input connection (`input`), or sink `i`'s own. Strike the
    /// publish at the front of `unacked` for the sink that publishes on it, and set it
    /// aside if that was its last strike (`strikes.rs`).
    pub(crate) fn dropped(
        &mut self,
        i: usize,
        unacked: &[String],
        up_for: Option<Duration>,
        input: &Mqtt,
        proc: &Processor,
        (wall, now): (u64, Instant),
    ) -> Result<(), AgentError> {
        let Some(sink) = self.sinks.get_mut(i) else {
            return Ok(());
        };
        let Some(id) = sink.struck(unacked, up_for, now) else {
            return Ok(());
        };
        if sink.cursor.seq_of(&id).is_none() {
            return Ok(()); // not a result (the Sparkplug host's STATE)
        }
        sink.abandon(&id, input);
        let detail = format!(
            "the broker closed the connection {} times in a row within {:?} of this publish; \
             given up on this destination",
            strikes::STRIKES_MAX,
            strikes::STRIKE_WITHIN
        );
        self.set_aside(i, &id, "refused_by_disconnect", &detail, proc, wall)
    }

    /// Give up `output_id` for sink `i`: a dead letter for it (`reason`, `detail`), then
    /// settled there as if acknowledged, so the outbox moves on. Once no other sink it is
    /// routed to waits for it, its entry leaves the outbox for good at once
    /// (`Store::outbox_set_aside`), so a restart does not bring it back.
    pub(crate) fn set_aside(
        &mut self,
        i: usize,
        output_id: &str,
        reason: &str,
        detail: &str,
        proc: &Processor,
        wall: u64,
    ) -> Result<(), AgentError> {
        let Some(seq) = self.sinks[i].cursor.seq_of(output_id) else {
            return Ok(());
        };
        let store = proc.store();
        let out = match store.outbox_from(seq).next().transpose()? {
            Some((s, o)) if s == seq => Some(o),
            _ => proc.pending_outputs().find(seq).cloned(),
        };
        let sink = &self.sinks[i];
        let name = sink.name.clone();
        let pipeline = pipeline_of(output_id).to_string();
        let topic = out
            .as_ref()
            .map_or_else(String::new, |o| sink.topic_of(&o.topic));
        let payload = out.as_ref().map_or_else(Vec::new, |o| {
            o.payload[..o
                .payload
                .len()
                .min(crate::pipeline::engine::DEAD_LETTER_PAYLOAD_MAX)]
                .to_vec()
        });
        let letter = crate::model::DeadLetter {
            offset: proc.next_offset(),
            pipeline: pipeline.clone(),
            topic: topic.clone(),
            reason: reason.to_string(),
            detail: format!("sink `{name}`, result {output_id}: {detail}"),
            received_at_ms: wall,
            payload,
        };
        store.add_sink_dead_letter(&letter, &name, seq)?;
        crate::event!(error, "result_set_aside", pipeline = pipeline, sink = name, reason = reason;
            "results: set aside {} for sink `{name}` (topic `{}`): {detail}; it is a dead letter \
             (`cairn inspect dead-letters`), and the results after it go on",
            crate::text::Shown(output_id),
            crate::text::Shown(&topic)
        );
        self.counts.set_aside += 1;
        let settled = self.sinks[i].cursor.acked(output_id);
        self.sinks[i].follow_settled();
        // Set aside for good only once no other sink waits for it.
        let everywhere = self.settled_everywhere(seq, output_id);
        self.settle(settled, everywhere.then_some(seq), proc)
    }

    /// Every sink settled it, or its sinks do not take it: a checkpoint leaves it out of
    /// the outbox.
    pub(crate) fn settled(&self, seq: u64, out: &crate::model::Output) -> bool {
        self.settled_everywhere(seq, &out.id)
    }

    /// A checkpoint committed, leaving `settled` acknowledged outputs out of the outbox:
    /// the entries it superseded wait for no sink any more, and the ones it added wait for
    /// each sink they are routed to that has not settled them yet. `outputs`: the
    /// checkpoint's, in sequence order.
    ///
    /// The added entries are counted from `outputs`, which the loop holds until now, by the
    /// sequence numbers the store says the commit added and still wait. Read back from the
    /// outbox one by one they cost the loop ~1 µs each (its lock, the chunk, a copy of each
    /// output; chunks past the cache read from sled): 14-29 ms at every checkpoint of
    /// 20,000 whose sink lagged, stalling every result behind it, the p99 of the latency
    /// bench at 80% of its peak (issue 33).
    pub(crate) fn checkpointed(
        &mut self,
        settled: u64,
        proc: &Processor,
        outputs: &[(u64, crate::model::Output)],
    ) -> Result<(), AgentError> {
        self.counts.settled_early += settled;
        let added = proc.store().outbox_take_added();
        match proc.store().outbox_take_superseded() {
            Some(gone) => {
                for seq in gone {
                    for s in &mut self.sinks {
                        s.waiting.gone(seq);
                    }
                }
            }
            // More than it keeps: count again (one walk, rare).
            None => {
                self.count_waiting(proc, false)?;
                return Ok(());
            }
        }
        let mut rest = outputs;
        for seq in added {
            let at = rest.partition_point(|(s, _)| *s < seq);
            match rest.get(at) {
                Some((s, out)) if *s == seq => self.count(seq, out),
                // Not one of this checkpoint's outputs: never so, but the figures then
                // count again from the outbox rather than miss it.
                _ => {
                    self.count_waiting(proc, false)?;
                    return Ok(());
                }
            }
            rest = &rest[at + 1..];
        }
        Ok(())
    }

    /// Some connected sink has more than `slack` results before `next_seq` still to send:
    /// upserts are then better held back (see `Agent::flush_upserts`).
    pub(crate) fn behind(&self, next_seq: u64, slack: u64) -> bool {
        any_behind(self.sinks.iter().map(|s| &s.cursor), next_seq, slack)
    }

    /// Nothing awaits an acknowledgement.
    pub(crate) fn idle(&self) -> bool {
        self.sinks.iter().all(|s| s.cursor.idle())
    }

    /// Whether results can go out now (some sink is connected).
    pub(crate) fn connected(&self) -> bool {
        self.sinks.iter().any(|s| s.cursor.is_connected())
    }

    /// Some connected sink has outbox entries at or after its cursor: not yet sent.
    pub(crate) fn unsent(&self, proc: &Processor) -> Result<bool, AgentError> {
        for s in self.sinks.iter().filter(|s| s.cursor.is_connected()) {
            let from = s.cursor.cursor();
            if proc.store().outbox_from(from).next().transpose()?.is_some() {
                return Ok(true);
            }
        }
        Ok(false)
    }

    pub(crate) fn has_uplink(&self) -> bool {
        self.uplink_index().is_some()
    }

    /// Whether the input connection is up (the `local` sink follows it).
    pub(crate) fn input_connected(&self) -> bool {
        self.sinks[0].cursor.is_connected()
    }

    /// The input connection came up or went down; `true` for a reconnect to count.
    pub(crate) fn input_link(&mut self, up: bool) -> bool {
        let c = &mut self.sinks[0].cursor;
        if up {
            c.connected();
            false
        } else {
            c.disconnected()
        }
    }

    /// An event of sink `i`'s own client.
    pub(crate) fn on_sink_event(
        &mut self,
        i: usize,
        ev: Event,
        input: &Mqtt,
        proc: &Processor,
        cfg: &OutboxConfig,
        at: (u64, Instant),
    ) -> Result<(), AgentError> {
        if i >= self.sinks.len() {
            return Ok(());
        }
        match ev {
            Event::PubAcked { output_id } => return self.acked(i, &output_id, proc),
            Event::PubRefused {
                output_id,
                code,
                reason,
            } => {
                let topic = self.topic_of(i, &output_id, proc)?;
                self.sinks[i].refused(&output_id, code, reason, topic, at);
                return Ok(());
            }
            Event::SinkRejected {
                output_id,
                reason,
                detail,
            } => {
                return self.set_aside(i, &output_id, reason, &detail, proc, at.0);
            }
            Event::TooLarge {
                output_id,
                size,
                max,
            } => {
                let detail = format!(
                    "a PUBLISH of {size} bytes, over the broker's Maximum Packet Size of {max}"
                );
                return self.set_aside(i, &output_id, "too_large_for_sink", &detail, proc, at.0);
            }
            Event::Disconnected {
                ref unacked,
                up_for,
                ..
            } => {
                let unacked = unacked.clone();
                self.dropped(i, &unacked, up_for, input, proc, at)?;
            }
            _ => {}
        }
        Ok(self.sinks[i].on_link_event(ev, cfg, at)?)
    }

    /// The topic sink `i` publishes `output_id` on (for a journal line), if it is in the
    /// outbox or waiting for its checkpoint.
    fn topic_of(&self, i: usize, output_id: &str, proc: &Processor) -> Result<String, AgentError> {
        let Some(seq) = self.sinks[i].cursor.seq_of(output_id) else {
            return Ok(String::new());
        };
        let topic = match proc.store().outbox_from(seq).next().transpose()? {
            Some((s, o)) if s == seq => Some(o.topic),
            _ => proc.pending_outputs().find(seq).map(|o| o.topic.clone()),
        };
        Ok(topic.map_or_else(String::new, |t| self.sinks[i].topic_of(&t)))
    }

    /// Every tick: the outbox's, the drain's and each sink's figures (`wall_ms`: for the
    /// age of what waits, on the clock the outbox's own oldest age uses).
    pub(crate) fn refresh(
        &mut self,
        metrics: &Metrics,
        proc: &Processor,
        cfg: &OutboxConfig,
        (wall_ms, now): (u64, Instant),
    ) {
        let store = proc.store();
        let bytes = store.outbox_bytes();
        let window = u64::from(cfg.inflight);
        for s in &mut self.sinks {
            s.observe(now, window);
        }
        let (rate, eta, up) = match self.uplink_index() {
            Some(u) => {
                let l = &self.sinks[u].link;
                (
                    l.rate.acked_per_second(),
                    l.rate.eta_seconds(),
                    Some(l.figures()),
                )
            }
            None => (0.0, None, None),
        };
        let sinks: Vec<crate::metrics::SinkFigures> = self
            .sinks
            .iter()
            .map(|s| {
                let age = s
                    .waiting
                    .oldest()
                    .map_or(0, |seq| metrics.outbox_entry_age_ms(seq, wall_ms));
                s.figures(age)
            })
            .collect();
        let max = cfg.max_size;
        metrics.update(|f| {
            f.outbox_bytes = bytes;
            f.outbox_max_bytes = max;
            f.outbox_max_entries = cfg.max_entries;
            f.outbox_drain_rate = rate;
            f.outbox_drain_eta_seconds = eta;
            f.uplink = up;
            f.sinks = sinks;
        });
    }

    /// Let the sinks' connection threads hand back their allocation caches.
    pub(crate) fn rest(&self) {
        for s in &self.sinks {
            s.rest();
        }
    }

    /// Close the sinks' own connections.
    pub(crate) fn shutdown(&mut self) {
        for s in &mut self.sinks {
            s.shutdown();
        }
    }
}

/// See [`Results::behind`]: a sink that is not connected sends nothing either way, so it
/// holds nothing back.
fn any_behind<'a>(
    mut cursors: impl Iterator<Item = &'a cursor::Cursor>,
    next_seq: u64,
    slack: u64,
) -> bool {
    cursors.any(|c| c.is_connected() && c.cursor().saturating_add(slack) < next_seq)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upserts_wait_only_for_a_connected_sink_more_than_the_slack_behind() {
        let mut near = cursor::Cursor::new(1000);
        near.connected();
        let far = cursor::Cursor::new(0);
        assert!(
            !any_behind([&near, &far].into_iter(), 2024, 1024),
            "far is down"
        );
        assert!(any_behind([&near].into_iter(), 2025, 1024));
        let mut far = far;
        far.connected();
        assert!(any_behind([&near, &far].into_iter(), 1025, 1024));
        assert!(
            !any_behind([&far].into_iter(), u64::MAX, u64::MAX),
            "no overflow"
        );
    }

    #[test]
    fn the_outbox_is_full_at_its_entry_bound_or_its_byte_bound() {
        let cfg = OutboxConfig {
            max_entries: 100,
            max_size: 4096,
            inflight: 10,
            drain_timeout: std::time::Duration::from_secs(1),
        };
        assert_eq!(full_at(&cfg, 99, 4095), None);
        assert_eq!(
            full_at(&cfg, 100, 0),
            Some("outbox.max_entries"),
            "at, not past"
        );
        assert_eq!(full_at(&cfg, 0, 4096), Some("outbox.max_size"));
        assert_eq!(
            full_at(&cfg, u64::MAX, u64::MAX),
            Some("outbox.max_entries")
        );
    }
}
