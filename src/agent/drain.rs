//! Shutdown: the first signal drains (log commit, checkpoint, the outbox for a bounded
//! time), a second ends the wait.

use std::sync::mpsc::RecvTimeoutError;
use std::time::Duration;

use super::{Agent, AgentError, Shutdown};
use crate::mqtt::Event;

impl Agent {
    /// First signal: stop taking input, make everything durable, give the outbox a bounded
    /// time, exit. A second signal ends the wait at once; nothing is lost either way.
    pub(super) fn drain(mut self, shutdown: &Shutdown) -> Result<(), AgentError> {
        crate::notify::stopping();
        crate::notify::status("stopping: draining");
        let mut beat = crate::notify::Heartbeat::from_env();
        log::info!(
            "shutdown: draining (log commit, checkpoint, outbox for up to {:?})",
            self.cfg.outbox.drain_timeout
        );
        self.tick(true)?;
        let deadline = self.now() + self.cfg.outbox.drain_timeout;
        while !self.publisher.idle() || self.publish_cursor_behind()? {
            if shutdown.requested() >= 2 || self.now() >= deadline {
                break;
            }
            match self.events.recv_timeout(Duration::from_millis(20)) {
                Ok(Event::Message(_)) => {} // not acked: the broker redelivers after restart
                Ok(ev) => self.on_event(ev)?,
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => break,
            }
            self.publish()?;
            beat.beat(self.now(), || "stopping: publishing the outbox".into());
        }
        let left = self.proc.store().outbox_len();
        self.settle_fsync(true)?;
        self.proc.store().sync()?;
        log::info!(
            "shutdown: done; {left} outbox entries left for the next start; {} results \
             published before their checkpoint, {} of them acknowledged before it",
            self.stats.published_early,
            self.stats.settled_early
        );
        self.metrics.stop_server();
        if let Some(u) = self.uplink.take() {
            u.mqtt.shutdown();
        }
        self.mqtt.shutdown();
        Ok(())
    }

    /// Outbox entries at or after the cursor: not yet sent.
    pub(super) fn publish_cursor_behind(&self) -> Result<bool, AgentError> {
        Ok(self
            .proc
            .store()
            .outbox_from(self.publisher.cursor())
            .next()
            .transpose()?
            .is_some())
    }
}
