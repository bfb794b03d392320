//! Processing behind the log, carried out (issue 16; what a slice does is the processor's,
//! `processor/behind.rs`). When the outbox reaches its bound (`outbox.max_entries` or
//! `max_size`), input is still logged, fsynced and acknowledged, and its records stay in
//! the log; once results leave and the outbox has room again, the loop takes them back in
//! slices between its other work, until processing has reached the log's durable end and
//! records are applied as they are committed again.
//!
//! Before, a full outbox stopped acknowledging: the broker queued (mosquitto drops past
//! `max_queued_messages`), inputs it pushed anyway were held in memory up to
//! [`HELD_LIMIT`](super::HELD_LIMIT) and then let go, and each end of backpressure needed a
//! reconnect for the broker to send them again (measured: a backlog drained at ~12k
//! inputs/s with `max_entries = 20000`, most of it sent twice). Now only a full log or a
//! full disk stops acknowledging (invariant 7).

use std::time::{Duration, Instant};

use crate::config::OutboxConfig;
use crate::processor::Processor;

use super::{Agent, AgentError};

/// Records per slice at most, as for a backfill: acks, checkpoints and publishing keep
/// their pace beside it.
const SLICE_MAX: u64 = 512;

/// Whether the outbox is at its bound, and which: past it, processing waits. Results that
/// processing made since the last checkpoint count as entries already (outputs, and
/// upserts touched but not yet emitted): they enter the outbox with the next commit. Not
/// counting them let a whole group commit's records in at once, and slices go on while a
/// checkpoint waited for the previous one's fsync: a bound of 100 held 400 entries under
/// load. Now it holds the bound plus the results of one record (live) or one slice
/// (behind). Their bytes are not known until they are encoded, so `max_size` counts the
/// store's alone.
pub(super) fn outbox_full(cfg: &OutboxConfig, proc: &Processor) -> Option<&'static str> {
    let store = proc.store();
    let entries = (store.outbox_len() as u64).saturating_add(proc.pending_results() as u64);
    if entries >= cfg.max_entries {
        Some("outbox.max_entries")
    } else if store.outbox_bytes() >= cfg.max_size {
        Some("outbox.max_size")
    } else {
        None
    }
}

/// Whether processing is behind the log, and what the journal has been told.
#[derive(Debug)]
pub(super) struct Behind {
    active: bool,
    /// When processing last fell behind (for the journal line that says it caught up).
    since: Option<Instant>,
    /// One journal line a minute at most for falling behind: with a small bound, a drain
    /// fills the outbox again and again.
    journal: crate::logging::RateLimit,
}

impl Behind {
    /// Not behind: recovery replays the whole log tail before the loop starts, and a record
    /// past the live position later (none is expected) makes processing fall behind and
    /// take it from the log ([`Agent::apply_live`]).
    pub(super) fn new() -> Behind {
        Behind {
            active: false,
            since: None,
            journal: crate::logging::RateLimit::new(1, Duration::from_secs(60)),
        }
    }

    /// Whether live records must be left in the log for a later slice.
    pub(super) fn active(&self) -> bool {
        self.active
    }
}

impl Agent {
    /// Whether this committed record may be applied now. No when processing is behind (the
    /// record is in the log; a slice takes it) or the outbox is at its bound (processing
    /// falls behind here). A record the slices already took is skipped.
    pub(super) fn apply_live(&mut self, offset: u64) -> bool {
        let next = self.proc.next_offset();
        if offset < next {
            return false;
        }
        if self.behind.active {
            return false;
        }
        let full = outbox_full(&self.cfg.outbox, &self.proc);
        if offset == next && full.is_none() {
            return true;
        }
        self.fall_behind(full.unwrap_or("a gap in the log"));
        false
    }

    fn fall_behind(&mut self, why: &str) {
        self.behind.active = true;
        let now = self.now();
        self.behind.since = Some(now);
        self.behind
            .journal
            .warn(now, "processing behind the log", "times", || {
                format!(
                    "processing waits ({why}): input is still logged and acknowledged, and \
                     is processed from the log once results leave"
                )
            });
    }

    /// One slice from the log, if processing is behind and the outbox has room; then
    /// publish what it gave and checkpoint if enough records wait for one.
    pub(super) fn behind_step(&mut self) -> Result<(), AgentError> {
        if !self.behind.active || outbox_full(&self.cfg.outbox, &self.proc).is_some() {
            return Ok(());
        }
        let max = SLICE_MAX.min(self.cfg.checkpoint.max_records.max(1));
        let mut dead = Vec::new();
        let slice = self.proc.catch_up(&self.log, max, &mut |rec, outcome| {
            if let crate::pipeline::engine::Outcome::DeadLetter { reason } = outcome {
                dead.push((rec.clone(), reason));
            }
        })?;
        for (rec, reason) in dead {
            self.log_dead_letter(&rec, reason);
        }
        if slice.taken > 0 {
            let now = self.now();
            self.checkpointer.applied(now);
            self.proc.flush_upserts();
            self.publish()?;
        }
        if slice.caught_up {
            self.behind.active = false;
            let waited = self
                .behind
                .since
                .take()
                .map(|t| self.now().saturating_duration_since(t));
            log::info!(
                "processing caught up with the log at offset {}{}",
                self.proc.next_offset(),
                waited.map_or(String::new(), |w| format!(
                    " ({:.1} s after it fell behind)",
                    w.as_secs_f64()
                ))
            );
        }
        if self.checkpoint_size_due() {
            self.checkpoint()?;
        }
        Ok(())
    }

    /// Records logged and not processed yet.
    pub(super) fn records_behind(&self) -> u64 {
        self.log
            .durable_next()
            .saturating_sub(self.proc.next_offset())
    }
}
