//! The outbox room: what waits to go out, where it goes, what an acknowledgement settles,
//! and the outbox's bound.
//!
//! - **What is waiting**: the durable outbox entries (the store's `outbox` tree) and the
//!   outputs processing made since the last checkpoint (the processor's memory): both may
//!   leave, since their inputs are durable in the log (`cursor.rs`).
//! - **Sinks**: each destination has its own [`cursor::Cursor`] over that one queue, and
//!   one file per kind of destination. Today there is one, the MQTT sink (`mqtt.rs`): the
//!   local broker of `[mqtt]`, or with `[uplink]` a central one, with `topic_prefix` before
//!   each topic. An entry is deleted once every sink it is routed to has settled it; with
//!   one sink, once it has.
//! - **Settled**: a PUBACK settles a contiguous prefix of what was sent ([`Results::acked`]);
//!   a checkpoint leaves settled outputs out of the outbox ([`Results::settled_below`]).
//! - **The bound** ([`Results::full`], `outbox.max_entries` and `max_size`): past it,
//!   processing waits (live, catch-up, backfill and the replay at start alike: the `work`
//!   part asks here) and the log holds the input, which is still acknowledged (issue 16,
//!   invariant 7).
//!
//! Handed the IO it needs by the loop: the processor (its store's outbox, its fresh
//! outputs) and the input connection (the sink's connection without an uplink).

pub(crate) mod cursor;
pub(crate) mod mqtt;
pub(crate) mod strikes;

use std::time::{Duration, Instant};

use crate::config::OutboxConfig;
use crate::metrics::Metrics;
use crate::mqtt::{Event, Mqtt};
use crate::processor::Processor;

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

pub(crate) struct Results {
    /// The sink `local`: the MQTT broker results go to.
    local: MqttSink,
    pub(crate) counts: Counts,
}

impl Results {
    pub(crate) fn new(local: MqttSink) -> Results {
        Results {
            local,
            counts: Counts::default(),
        }
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

    /// Send, in order and within the inflight window, the durable outbox entries from the
    /// cursor, then the outputs still waiting for their checkpoint (`cursor::next_batch`).
    pub(crate) fn publish(
        &mut self,
        proc: &Processor,
        input: &Mqtt,
        inflight: u16,
        now: Instant,
    ) -> Result<(), AgentError> {
        let room = self.local.room(inflight, input);
        if room == 0 {
            return Ok(());
        }
        let from = self.local.cursor.cursor();
        let batch = cursor::next_batch(
            from,
            room,
            proc.store().outbox_from(from),
            proc.pending_outputs(),
        )?;
        self.local.send(batch, input, &mut self.counts, now)
    }

    /// The broker acknowledged a result: delete the outbox entries it settles.
    pub(crate) fn acked(&mut self, output_id: &str, proc: &Processor) -> Result<(), AgentError> {
        // Outputs from `fresh` on are not in the store yet: nothing to delete.
        let fresh = proc.pending_outputs().first().map_or(u64::MAX, |o| o.0);
        self.local.strikes.cleared(output_id);
        for (seq, id) in self.local.cursor.acked(output_id) {
            if seq >= fresh {
                // At the broker, its checkpoint not yet committed (tests/it/crash.rs).
                failpoint("publish.acked_before_checkpoint")?;
            } else {
                failpoint("outbox.before_delete")?;
                proc.store().outbox_delete(seq, &id)?;
                failpoint("outbox.after_delete")?;
            }
            self.counts.pubacked += 1;
        }
        Ok(())
    }

    /// A connection results go out on ended (`input`: the input connection, which carries
    /// them without an uplink): strike the publish at the front of `unacked`, and set it
    /// aside if that was its last strike (`strikes.rs`).
    pub(crate) fn dropped(
        &mut self,
        input: bool,
        unacked: &[String],
        up_for: Option<Duration>,
        conn: &Mqtt,
        proc: &Processor,
        (wall, now): (u64, Instant),
    ) -> Result<(), AgentError> {
        if input == self.local.has_uplink() {
            return Ok(()); // results do not go out on that connection
        }
        let Some(id) = self.local.struck(unacked, up_for, now) else {
            return Ok(());
        };
        if self.local.cursor.seq_of(&id).is_none() {
            return Ok(()); // not a result (the Sparkplug host's STATE)
        }
        self.local.conn(conn).abandon(&id);
        let detail = format!(
            "the broker closed the connection {} times in a row within {:?} of this publish; \
             given up on this destination",
            strikes::STRIKES_MAX,
            strikes::STRIKE_WITHIN
        );
        self.set_aside(&id, "refused_by_disconnect", &detail, proc, wall)
    }

    /// Give up `output_id` for this sink: a dead letter for it (`reason`, `detail`), then
    /// settled as if acknowledged, so the outbox moves on. Its entry leaves the outbox for
    /// good at once (`Store::outbox_set_aside`), so a restart does not bring it back.
    fn set_aside(
        &mut self,
        output_id: &str,
        reason: &str,
        detail: &str,
        proc: &Processor,
        wall: u64,
    ) -> Result<(), AgentError> {
        let Some(seq) = self.local.cursor.seq_of(output_id) else {
            return Ok(());
        };
        let store = proc.store();
        let out = match store.outbox_from(seq).next().transpose()? {
            Some((s, o)) if s == seq => Some(o),
            _ => proc
                .pending_outputs()
                .iter()
                .find(|(s, _)| *s == seq)
                .map(|(_, o)| o.clone()),
        };
        let sink = self.local.name();
        let pipeline = pipeline_of(output_id).to_string();
        let topic = out
            .as_ref()
            .map_or_else(String::new, |o| self.local.topic_of(&o.topic));
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
            detail: format!("sink `{sink}`, result {output_id}: {detail}"),
            received_at_ms: wall,
            payload,
        };
        store.add_sink_dead_letter(&letter, sink, seq)?;
        crate::event!(error, "result_set_aside", pipeline = pipeline, sink = sink, reason = reason;
            "results: set aside {} for sink `{sink}` (topic `{}`): {detail}; it is a dead letter \
             (`cairn inspect dead-letters`), and the results after it go on",
            crate::text::Shown(output_id),
            crate::text::Shown(&topic)
        );
        self.counts.set_aside += 1;
        let fresh = proc.pending_outputs().first().map_or(u64::MAX, |o| o.0);
        for (s, id) in self.local.cursor.acked(output_id) {
            if s >= fresh {
                continue; // the checkpoint leaves it out: settled
            }
            if s == seq {
                store.outbox_set_aside(s, &id)?;
            } else {
                store.outbox_delete(s, &id)?;
                self.counts.pubacked += 1;
            }
        }
        Ok(())
    }

    /// Every output with a lower sequence is settled: a checkpoint leaves these out of the
    /// outbox.
    pub(crate) fn settled_below(&self) -> u64 {
        self.local.cursor.settled_below()
    }

    /// A checkpoint left `settled` acknowledged outputs out of the outbox.
    pub(crate) fn checkpointed(&mut self, settled: u64) {
        self.counts.settled_early += settled;
    }

    /// Nothing awaits an acknowledgement.
    pub(crate) fn idle(&self) -> bool {
        self.local.cursor.idle()
    }

    /// Whether results can go out now.
    pub(crate) fn connected(&self) -> bool {
        self.local.cursor.is_connected()
    }

    /// Outbox entries at or after the cursor: not yet sent.
    pub(crate) fn unsent(&self, proc: &Processor) -> Result<bool, AgentError> {
        let from = self.local.cursor.cursor();
        Ok(proc.store().outbox_from(from).next().transpose()?.is_some())
    }

    pub(crate) fn has_uplink(&self) -> bool {
        self.local.has_uplink()
    }

    /// Whether the input connection is up (with an uplink, the sink keeps track of it).
    pub(crate) fn input_connected(&self) -> bool {
        self.local.input_connected()
    }

    /// The input connection came up or went down; `true` for a reconnect to count.
    pub(crate) fn input_link(&mut self, up: bool) -> bool {
        self.local.input_link(up)
    }

    /// An event of the uplink connection.
    pub(crate) fn on_uplink_event(
        &mut self,
        ev: Event,
        input: &Mqtt,
        proc: &Processor,
        cfg: &OutboxConfig,
        at: (u64, Instant),
    ) -> Result<(), AgentError> {
        match &ev {
            Event::PubAcked { output_id } => return self.acked(output_id, proc),
            Event::Disconnected {
                unacked, up_for, ..
            } => self.dropped(false, unacked, *up_for, input, proc, at)?,
            _ => {}
        }
        let store = proc.store();
        let outbox = (store.outbox_len() as u64, store.outbox_bytes());
        Ok(self.local.on_uplink_event(ev, outbox, cfg, at)?)
    }

    /// Every tick: the outbox's and the drain's figures.
    pub(crate) fn refresh(
        &mut self,
        metrics: &Metrics,
        proc: &Processor,
        cfg: &OutboxConfig,
        now: Instant,
    ) {
        let store = proc.store();
        let (entries, bytes) = (store.outbox_len() as u64, store.outbox_bytes());
        let window = u64::from(cfg.inflight);
        let (rate, eta, up) = self
            .local
            .observe(now, entries, self.counts.pubacked, window);
        let max = cfg.max_size;
        metrics.update(|f| {
            f.outbox_bytes = bytes;
            f.outbox_max_bytes = max;
            f.outbox_max_entries = cfg.max_entries;
            f.outbox_drain_rate = rate;
            f.outbox_drain_eta_seconds = eta;
            f.uplink = up;
        });
    }

    /// Let the sinks' connection threads hand back their allocation caches.
    pub(crate) fn rest(&self) {
        self.local.rest();
    }

    /// Close the sinks' own connections.
    pub(crate) fn shutdown(&mut self) {
        self.local.shutdown();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
