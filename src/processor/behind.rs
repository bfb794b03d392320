//! Processing behind the log (issue 16). While the outbox is at its bound the agent still
//! logs, fsyncs and acknowledges input, and leaves the new records in the log; once results
//! leave, it takes them back from there in slices, from the live position to the log's
//! durable end. The log is the buffer (bounded by `log.max_size`), not the broker's queue
//! and not memory: what the outbox bound promises then holds, and the broker never has to
//! send anything twice.
//!
//! Records read back are the very records that were logged (time of receipt, topic, payload,
//! stand-ins alike), so processing them later gives what processing them on arrival would
//! have: processing is deterministic and the order is the log's.

use crate::log::Log;
use crate::model::Record;
use crate::pipeline::engine::Outcome;

use super::{ProcessError, Processor};

/// What one slice did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CatchUp {
    /// Records applied in this slice.
    pub taken: u64,
    /// The live position reached the log's durable end: records arriving from now on can be
    /// applied as they are committed.
    pub caught_up: bool,
}

impl Processor {
    /// Apply up to `max` durable records from the live position on, read back from `log`;
    /// `outcome` hears what each gave. The reader is kept between slices.
    pub fn catch_up(
        &mut self,
        log: &Log,
        max: u64,
        outcome: &mut dyn FnMut(&Record, Outcome),
    ) -> Result<CatchUp, ProcessError> {
        let mut taken = 0;
        let mut fresh = false;
        while taken < max {
            if self.next_offset() >= log.durable_next() {
                self.behind_reader = None;
                return Ok(CatchUp {
                    taken,
                    caught_up: true,
                });
            }
            if self.behind_reader.is_none() {
                self.behind_reader = Some(log.read_from(self.next_offset())?);
                fresh = true;
            }
            let next = self.behind_reader.as_mut().and_then(|r| r.next());
            match next {
                // This reader's view of the log ends here; records made durable since are
                // seen by a new one. A new reader that finds nothing although the log says
                // there is more means a repair removed it: nothing is left to take.
                None if fresh => {
                    self.behind_reader = None;
                    log::warn!(
                        "processing: the log ends at offset {} although its durable end is {}; \
                         going on from there",
                        self.next_offset(),
                        log.durable_next()
                    );
                    return Ok(CatchUp {
                        taken,
                        caught_up: true,
                    });
                }
                None => self.behind_reader = None,
                Some(Err(e)) => {
                    self.behind_reader = None;
                    return Err(e.into());
                }
                // Taken already (the caller applied live records meanwhile).
                Some(Ok(rec)) if rec.offset < self.next_offset() => fresh = false,
                Some(Ok(rec)) => {
                    fresh = false;
                    for o in self.apply(&rec)? {
                        outcome(&rec, o);
                    }
                    taken += 1;
                }
            }
        }
        Ok(CatchUp {
            taken,
            caught_up: self.next_offset() >= log.durable_next(),
        })
    }
}
