//! Retention: which whole segments may go, and deleting them (the rule is in the module
//! docs, "Retention: what may be deleted, and when").

use super::*;

impl Log {
    /// Delete whole segments whose records all lie below `offset`, oldest first, never the
    /// active one; then fsync the directory once. Returns how many were removed. The caller
    /// (the agent) decides `offset` from the durable checkpoint and retention.
    pub fn truncate_before(&mut self, offset: Offset) -> Result<usize, LogError> {
        self.check_usable()?;
        let removable = self
            .segments
            .iter()
            .take(self.segments.len().saturating_sub(1))
            .take_while(|s| s.next_offset <= offset)
            .count();
        let mut removed = 0;
        let mut result = Ok(());
        for seg in &self.segments[..removable] {
            if let Err(e) = fs::remove_file(&seg.path) {
                result = Err(io_err("remove segment", &seg.path)(e));
                break;
            }
            removed += 1;
        }
        for seg in self.segments.drain(..removed) {
            self.disk_bytes -= seg.bytes;
        }
        if removed > 0 {
            let synced = failpoint::hit("log.segment_delete")
                .and_then(|()| self.sync.sync_dir(&self.opts.dir));
            if let Err(e) = synced {
                self.failed = true;
                return Err(io_err("fsync log directory", &self.opts.dir)(e));
            }
        }
        result.map(|()| removed)
    }

    /// Is the log short of room: do fewer than two more segments fit under `max_size` (one,
    /// in a log of fewer than three)?
    pub(crate) fn short_of_room(&self) -> bool {
        self.needs_room(self.size_bytes())
    }

    /// Room for two more segments (one in a log of fewer than three): with only one, a
    /// burst between two checkpoints fills it before retention runs again, and ingest
    /// flaps in and out of backpressure (seen in `benches/longrun.rs`).
    fn needs_room(&self, size: u64) -> bool {
        let (seg, max) = (self.opts.segment_size, self.opts.max_size);
        let want = seg
            .saturating_mul(2)
            .min(max.saturating_sub(seg))
            .max(seg.min(max));
        size.saturating_add(want) > max
    }

    /// Decide what retention deletes (the rule is in the module docs). `durable` is the
    /// `next_offset` of the last committed checkpoint: nothing at or above it is ever chosen.
    /// `floor` is the newest savepoint's offset (`u64::MAX` for none); `cutoff_ms` the
    /// newest `received_at_ms` a segment may hold to count as outside retention.
    pub(crate) fn plan_retention(
        &self,
        durable: Offset,
        floor: Offset,
        cutoff_ms: u64,
    ) -> RetentionPlan {
        let mut plan = RetentionPlan {
            below: self.first_offset(),
            evicted: 0,
            floor_blocks: false,
        };
        let mut size = self.size_bytes();
        let sealed = self.segments.len().saturating_sub(1);
        for s in &self.segments[..sealed] {
            if s.next_offset > durable {
                break;
            }
            let expired = s.next_offset <= floor && s.max_received_at_ms <= cutoff_ms;
            if !expired {
                if !self.needs_room(size) {
                    break;
                }
                if s.next_offset > floor {
                    plan.floor_blocks = true;
                    break;
                }
                plan.evicted += 1;
            }
            plan.below = s.next_offset;
            size = size.saturating_sub(s.bytes);
        }
        plan
    }
}
