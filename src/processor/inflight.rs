//! The checkpoint in flight as a read layer (issue 33).
//!
//! A checkpoint's transaction and fsync run beside the agent's loop
//! (`agent/keeper/commit.rs`), and the loop goes on applying records meanwhile. Until the
//! commit is done, what that checkpoint writes is in neither the engine's overlay (taken
//! from it) nor, reliably, the store (being written). So every read the engine makes goes
//! through [`Layered`]: the checkpoint in flight first, then the store, exactly as if the
//! checkpoint had committed. A key the checkpoint writes is answered from it whatever the
//! store holds at that moment; any other key the commit does not touch.
//!
//! What a commit changes that the layer does not cover: it forgets wholly expired ledger
//! groups. A lookup of such an ID may then miss in the store while the commit runs; the
//! engine's answer does not change, since it compares the entry's own record time with
//! the window (`store::ledger`, "Expiry").

use std::cell::RefCell;

use crate::pipeline::engine::{Batch, ReadError, ReadState};
use crate::pipeline::sparkplug::session::Entry;
use crate::pipeline::state_key::at;
use crate::pipeline::value::KeyState;
use crate::store::LastRow;

/// `batch` (the checkpoint in flight, if any) over `base` (the store). Made for one record
/// (or one slice of records under the same checkpoint in flight) and then dropped: it keeps
/// the last stored row it read ([`LastRow`]), which is right only that long.
pub(crate) struct Layered<'a, R> {
    batch: Option<&'a Batch>,
    base: &'a R,
    last: RefCell<LastRow>,
}

/// What [`Layered`] reads below the layer: the store serves a row it read for one pipeline
/// to the next ([`LastRow`], `store/read.rs`); any other reader reads each state alone.
pub(crate) trait Below: ReadState {
    fn state_after(
        &self,
        pipeline: &str,
        skey: &[u8],
        last: &mut LastRow,
    ) -> Result<Option<KeyState>, ReadError> {
        let _ = last;
        self.state(pipeline, skey)
    }
}

impl<'a, R: Below> Layered<'a, R> {
    pub(crate) fn new(batch: Option<&'a Batch>, base: &'a R) -> Self {
        Layered {
            batch,
            base,
            last: RefCell::default(),
        }
    }

    /// Keys of `pipeline` in `[lo, ..)` from `base`, merged with the layer's writes in the
    /// same map: added where it writes a value, removed where it deletes. `within` says
    /// where the range ends.
    fn merge<V>(
        map: &std::collections::BTreeMap<(String, Vec<u8>), Option<V>>,
        pipeline: &str,
        lo: &[u8],
        within: impl Fn(&[u8]) -> bool,
        mut keys: Vec<Vec<u8>>,
    ) -> Vec<Vec<u8>> {
        let from = (pipeline.to_string(), lo.to_vec());
        let mut add = Vec::new();
        let mut gone = std::collections::BTreeSet::new();
        for ((p, k), v) in map.range(from..) {
            if p != pipeline || !within(k) {
                break;
            }
            match v {
                Some(_) => add.push(k.clone()),
                None => {
                    gone.insert(k.as_slice());
                }
            }
        }
        if add.is_empty() && gone.is_empty() {
            return keys;
        }
        keys.retain(|k| !gone.contains(k.as_slice()));
        keys.extend(add);
        keys.sort();
        keys.dedup();
        keys
    }
}

impl<R: Below> ReadState for Layered<'_, R> {
    fn state(&self, pipeline: &str, skey: &[u8]) -> Result<Option<KeyState>, ReadError> {
        if let Some(b) = self.batch {
            if let Some(v) = at(&b.state, pipeline, skey) {
                return Ok(v.clone());
            }
        }
        self.base
            .state_after(pipeline, skey, &mut self.last.borrow_mut())
    }

    fn dedup(&self, pipeline: &str, event_id: &str) -> Result<Option<u64>, ReadError> {
        if let Some(b) = self.batch {
            if let Some(seen) = b.dedup.get(0, pipeline, event_id) {
                return Ok(Some(seen));
            }
        }
        self.base.dedup(pipeline, event_id)
    }

    fn window_keys(&self, pipeline: &str, from: u64, to: u64) -> Result<Vec<Vec<u8>>, ReadError> {
        let keys = self.base.window_keys(pipeline, from, to)?;
        Ok(match self.batch {
            None => keys,
            Some(b) => Self::merge(
                &b.state,
                pipeline,
                &from.to_be_bytes(),
                |k| k.get(..8).is_some_and(|s| s < &to.to_be_bytes()[..]),
                keys,
            ),
        })
    }

    fn sparkplug(&self, pipeline: &str, key: &[u8]) -> Result<Option<Entry>, ReadError> {
        if let Some(b) = self.batch {
            if let Some(v) = at(&b.sparkplug, pipeline, key) {
                return Ok(v.clone());
            }
        }
        self.base.sparkplug(pipeline, key)
    }

    fn sparkplug_keys(&self, pipeline: &str, prefix: &[u8]) -> Result<Vec<Vec<u8>>, ReadError> {
        let keys = self.base.sparkplug_keys(pipeline, prefix)?;
        Ok(match self.batch {
            None => keys,
            Some(b) => Self::merge(
                &b.sparkplug,
                pipeline,
                prefix,
                |k| k.starts_with(prefix),
                keys,
            ),
        })
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    /// A base of state keys only (what `window_keys` and `state` read).
    struct Base(BTreeMap<(String, Vec<u8>), KeyState>);

    impl Below for Base {}

    impl ReadState for Base {
        fn state(&self, p: &str, k: &[u8]) -> Result<Option<KeyState>, ReadError> {
            Ok(self.0.get(&(p.to_string(), k.to_vec())).cloned())
        }
        fn dedup(&self, _: &str, _: &str) -> Result<Option<u64>, ReadError> {
            Ok(None)
        }
        fn window_keys(&self, p: &str, from: u64, to: u64) -> Result<Vec<Vec<u8>>, ReadError> {
            Ok(self
                .0
                .keys()
                .filter(|(q, k)| {
                    q == p && k[..8] >= from.to_be_bytes()[..] && k[..8] < to.to_be_bytes()[..]
                })
                .map(|(_, k)| k.clone())
                .collect())
        }
        fn sparkplug(&self, _: &str, _: &[u8]) -> Result<Option<Entry>, ReadError> {
            Ok(None)
        }
        fn sparkplug_keys(&self, _: &str, _: &[u8]) -> Result<Vec<Vec<u8>>, ReadError> {
            Ok(Vec::new())
        }
    }

    fn wkey(start: u64, key: &str) -> Vec<u8> {
        let mut k = start.to_be_bytes().to_vec();
        k.extend_from_slice(key.as_bytes());
        k
    }

    #[test]
    fn the_checkpoint_in_flight_answers_before_the_store_and_its_deletions_hide_keys() {
        let st = || KeyState {
            version: 1,
            count: 1,
            agg: crate::pipeline::value::Agg::Count,
        };
        let base = Base(BTreeMap::from([
            (("p".into(), wkey(10, "a")), st()),
            (("p".into(), wkey(20, "b")), st()),
            (("p".into(), wkey(30, "c")), st()),
            (("q".into(), wkey(20, "x")), st()),
        ]));
        let mut b = Batch::default();
        b.state.insert(("p".into(), wkey(20, "b")), None);
        b.state.insert(("p".into(), wkey(25, "n")), Some(st()));
        b.state.insert(("p".into(), wkey(40, "late")), Some(st()));
        b.dedup.insert(0, "p", "e1", 7);
        let l = Layered::new(Some(&b), &base);
        assert_eq!(
            l.window_keys("p", 0, 35).unwrap(),
            vec![wkey(10, "a"), wkey(25, "n"), wkey(30, "c")],
            "the deleted window is gone, the new one in, the one past the range not"
        );
        assert_eq!(l.window_keys("q", 0, 35).unwrap(), vec![wkey(20, "x")]);
        assert_eq!(l.state("p", &wkey(20, "b")).unwrap(), None);
        assert!(l.state("p", &wkey(25, "n")).unwrap().is_some());
        assert!(l.state("p", &wkey(10, "a")).unwrap().is_some());
        assert_eq!(l.dedup("p", "e1").unwrap(), Some(7));
        assert_eq!(l.dedup("q", "e1").unwrap(), None);
        let none = Layered::new(None, &base);
        assert_eq!(none.window_keys("p", 0, 35).unwrap().len(), 3);
    }
}
