//! An in-memory checkpoint store: the reference the model tests and benchmarks compare the
//! sled store with. Applying a [`Checkpoint`] here means exactly what `store::Store::commit`
//! means on disk.

use std::collections::BTreeMap;

use super::engine::{Checkpoint, DeadLetter, Output, Progress, ReadError, ReadState};
use super::value::KeyState;

#[derive(Debug, Clone, Default, PartialEq)]
pub struct MemState {
    pub progress: Progress,
    pub state: BTreeMap<(String, Vec<u8>), KeyState>,
    pub dedup: BTreeMap<(String, String), u64>,
    pub outbox: BTreeMap<u64, Output>,
    pub dead: BTreeMap<(u64, String), DeadLetter>,
}

impl MemState {
    pub fn commit(&mut self, cp: &Checkpoint) {
        for ((p, k), v) in &cp.batch.state {
            match v {
                Some(s) => self.state.insert((p.clone(), k.clone()), *s),
                None => self.state.remove(&(p.clone(), k.clone())),
            };
        }
        for ((p, id), w) in &cp.batch.dedup {
            match w.new_seen_ms {
                Some(t) => self.dedup.insert((p.clone(), id.clone()), t),
                None => self.dedup.remove(&(p.clone(), id.clone())),
            };
        }
        for (seq, o) in &cp.batch.outputs {
            if !self.outbox.values().any(|x| x.id == o.id) {
                self.outbox.insert(*seq, o.clone());
            }
        }
        for d in &cp.batch.dead_letters {
            self.dead.insert((d.offset, d.pipeline.clone()), d.clone());
        }
        self.progress = cp.progress.clone();
    }
}

impl ReadState for MemState {
    fn state(&self, pipeline: &str, skey: &[u8]) -> Result<Option<KeyState>, ReadError> {
        Ok(self
            .state
            .get(&(pipeline.to_string(), skey.to_vec()))
            .copied())
    }

    fn dedup(&self, pipeline: &str, event_id: &str) -> Result<Option<u64>, ReadError> {
        Ok(self
            .dedup
            .get(&(pipeline.to_string(), event_id.to_string()))
            .copied())
    }

    fn window_keys(&self, pipeline: &str, from: u64, to: u64) -> Result<Vec<Vec<u8>>, ReadError> {
        let lo = (pipeline.to_string(), from.to_be_bytes().to_vec());
        let hi = (pipeline.to_string(), to.to_be_bytes().to_vec());
        Ok(self
            .state
            .range(lo..hi)
            .map(|((_, k), _)| k.clone())
            .collect())
    }

    fn dedup_expired(
        &self,
        pipeline: &str,
        before_ms: u64,
        limit: usize,
    ) -> Result<Vec<(u64, String)>, ReadError> {
        let mut v: Vec<(u64, String)> = self
            .dedup
            .iter()
            .filter(|((p, _), t)| p == pipeline && **t < before_ms)
            .map(|((_, id), t)| (*t, id.clone()))
            .collect();
        v.sort();
        v.truncate(limit);
        Ok(v)
    }
}
