//! An in-memory checkpoint store: the reference the model tests and benchmarks compare the
//! sled store with. Applying a [`Checkpoint`] here means exactly what `store::Store::commit`
//! means on disk.

use std::collections::BTreeMap;

use super::engine::{Checkpoint, ReadError, ReadState};
use super::sparkplug::session::Entry;
use super::value::KeyState;
use crate::model::{DeadLetter, Output, Progress};

#[derive(Debug, Clone, Default, PartialEq)]
pub struct MemState {
    pub progress: Progress,
    pub state: BTreeMap<(String, Vec<u8>), KeyState>,
    pub dedup: BTreeMap<(String, String), u64>,
    pub outbox: BTreeMap<u64, Output>,
    pub dead: BTreeMap<(u64, String), DeadLetter>,
    pub sparkplug: BTreeMap<(String, Vec<u8>), Entry>,
}

impl MemState {
    pub fn commit(&mut self, cp: &Checkpoint) {
        for ((p, k), v) in &cp.batch.state {
            match v {
                Some(s) => self.state.insert((p.clone(), k.clone()), s.clone()),
                None => self.state.remove(&(p.clone(), k.clone())),
            };
        }
        for (p, id, seen) in cp.batch.dedup.iter() {
            self.dedup.insert((p.to_string(), id.to_string()), seen);
        }
        for (p, cutoff) in &cp.batch.dedup_expired_at_or_before {
            self.dedup.retain(|(q, _), seen| q != p || *seen > *cutoff);
        }
        for (seq, o) in &cp.batch.outputs {
            if !self.outbox.values().any(|x| x.id == o.id) {
                self.outbox.insert(*seq, o.clone());
            }
        }
        for ((p, k), v) in &cp.batch.sparkplug {
            match v {
                Some(e) => self.sparkplug.insert((p.clone(), k.clone()), e.clone()),
                None => self.sparkplug.remove(&(p.clone(), k.clone())),
            };
        }
        for d in &cp.batch.dead_letters {
            self.dead.insert((d.offset, d.pipeline.clone()), d.clone());
        }
        self.progress = cp.progress.clone();
        for pp in &mut self.progress.pipelines {
            pp.dedup_entries = self.dedup.keys().filter(|(q, _)| *q == pp.name).count() as u64;
        }
    }
}

impl ReadState for MemState {
    fn state(&self, pipeline: &str, skey: &[u8]) -> Result<Option<KeyState>, ReadError> {
        Ok(self
            .state
            .get(&(pipeline.to_string(), skey.to_vec()))
            .cloned())
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

    fn sparkplug(&self, pipeline: &str, key: &[u8]) -> Result<Option<Entry>, ReadError> {
        Ok(self
            .sparkplug
            .get(&(pipeline.to_string(), key.to_vec()))
            .cloned())
    }

    fn sparkplug_keys(&self, pipeline: &str, prefix: &[u8]) -> Result<Vec<Vec<u8>>, ReadError> {
        Ok(self
            .sparkplug
            .range((pipeline.to_string(), prefix.to_vec())..)
            .take_while(|((p, k), _)| p == pipeline && k.starts_with(prefix))
            .map(|((_, k), _)| k.clone())
            .collect())
    }
}
