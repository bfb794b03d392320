//! State rows (store format 4; issue 33, item 4): every pipeline's state for one stored key
//! in one sled value, `rows`: skey → [`Row`].
//!
//! # Why
//!
//! sled copies a leaf for every key a transaction writes and keeps the copies until it
//! ends, so `checkpoint.max_keys` bounds the keys one checkpoint writes (issue 16). With a
//! key per pipeline and state key, N pipelines over the same keys wrote N keys per input
//! key: a checkpoint came N times as often, and each one's fixed cost (a ledger chunk per
//! pipeline, the progress record, the fsync) grew with N too, so the cost per input grew
//! with N². In rows, the pipelines that share a key share one write, and a checkpoint holds
//! as many input keys at 16 pipelines as at one.
//!
//! # Guarantees
//!
//! - **Every row fits one entry** ([`MAX_ENTRY_BYTES`], key and value): a state that would
//!   not fit its row is *spilled*: it stays in the `state` tree under `pipeline 0x00 skey`
//!   (the layout of formats 2 and 3, where it fits: the engine bounds a state by that
//!   entry), and the row says that something is spilled.
//! - **A state is in exactly one place**, its row or the `state` tree, and a stored state
//!   that does not change never moves: only a state in the batch being committed changes
//!   place. The loop reads stored states while a checkpoint commits beside it, never the
//!   ones that checkpoint writes (they are in the checkpoint in flight, read first,
//!   `processor/inflight.rs`): a read that looked in the row and then in the tree can never
//!   miss a state that moved between the two looks.
//! - **A format-2 or -3 store is read as it is and rewritten by the agent before it
//!   processes** ([`Store::upgrade_layout`]): its states move into rows in transactions of
//!   [`UPGRADE_BATCH`], each whole or not at all, then the format record becomes 4. A crash
//!   part way leaves a store whose states are partly in rows and partly in the tree, which
//!   is read correctly (while the format is below 4 every read that misses a row looks in
//!   the tree too) and upgraded again at the next start. Reading (`cairn status`) never
//!   writes.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use sled::Transactional;

use super::{
    FORMAT_KEY, MAX_ENTRY_BYTES, PROGRESS_KEY, STORE_FORMAT, STORE_FORMAT_V2, Store, StoreError,
    bounded, decode, encode, pkey, split_pkey,
};
use crate::pipeline::value::KeyState;

/// States moved into rows per transaction while upgrading a store.
pub(super) const UPGRADE_BATCH: usize = 2048;

/// Every pipeline's state for one stored key that fits, as stored.
#[derive(Debug, Default, Serialize, Deserialize, PartialEq)]
pub(super) struct Row {
    /// Some pipeline's state for this key did not fit and is in the `state` tree. Set once
    /// and kept (clearing it would need to know that no spilled state is left).
    pub spilled: bool,
    /// (pipeline, the state as postcard), ordered by pipeline name.
    pub entries: Vec<(String, Vec<u8>)>,
}

/// A stored row read in place.
#[derive(Deserialize)]
struct RowRef<'a> {
    spilled: bool,
    #[serde(borrow)]
    entries: Vec<(&'a str, &'a [u8])>,
}

/// The last row [`Store::stored_state_after`] read, kept for the next read of the same key:
/// the pipelines that take one record read their states for its key one after another,
/// each from the same row (16 pipelines: 16 reads of it per record, a tenth of the agent's
/// CPU; issue 33).
///
/// Right only while no commit can write a state read through it, which is how
/// [`crate::processor::inflight::Layered`] keeps one: for one record, and under the
/// checkpoint in flight. A commit beside it writes only that checkpoint's states, which the
/// layer answers before the store, and leaves every other entry of a row, and where each
/// state is (row or `state` tree), as it was.
#[derive(Debug, Default)]
pub(crate) struct LastRow(Option<(Vec<u8>, Option<sled::IVec>)>);

/// One stored state: pipeline, stored key, state.
type StoredState = (String, Vec<u8>, KeyState);

/// A stored row, read in place.
fn row_ref(bytes: &[u8]) -> Result<RowRef<'_>, StoreError> {
    postcard::from_bytes(bytes)
        .map_err(|e| StoreError::Corrupt(format!("undecodable state row: {e}")))
}

fn varint_len(n: usize) -> usize {
    let bits = usize::BITS - n.leading_zeros();
    (bits.max(1) as usize).div_ceil(7)
}

fn entry_size(pipeline: &str, state: &[u8]) -> usize {
    varint_len(pipeline.len()) + pipeline.len() + varint_len(state.len()) + state.len()
}

impl Row {
    /// Bytes of key and value once stored under `skey` (postcard's own sizes).
    fn stored_size(&self, skey: &[u8]) -> usize {
        let entries: usize = self.entries.iter().map(|(p, s)| entry_size(p, s)).sum();
        skey.len() + 1 + varint_len(self.entries.len()) + entries
    }

    fn find(&self, pipeline: &str) -> Result<usize, usize> {
        self.entries
            .binary_search_by(|(p, _)| p.as_str().cmp(pipeline))
    }

    /// Put `state` in the row if the row still fits one entry with it, else leave it out
    /// and mark the row spilled: false if it did not fit.
    fn place(&mut self, skey: &[u8], pipeline: &str, state: &[u8]) -> bool {
        let at = match self.find(pipeline) {
            Ok(i) => {
                self.entries.remove(i);
                i
            }
            Err(i) => i,
        };
        // One more entry can make the count's varint a byte longer.
        let grown = self.stored_size(skey) + entry_size(pipeline, state) + 1;
        if grown > MAX_ENTRY_BYTES {
            self.spilled = true;
            return false;
        }
        self.entries
            .insert(at, (pipeline.to_string(), state.to_vec()));
        true
    }
}

/// A row's bytes as stored, within the entry bound.
fn row_value(skey: &[u8], row: &Row) -> Result<Vec<u8>, StoreError> {
    bounded("state", skey, encode(row))
}

impl Store {
    /// Whether this store may still hold states outside rows that no row marks (formats 2
    /// and 3, until [`Store::upgrade_layout`] ran).
    fn legacy_layout(&self) -> bool {
        self.legacy.load(std::sync::atomic::Ordering::Acquire)
    }

    fn row(&self, skey: &[u8]) -> Result<Row, StoreError> {
        match self.rows.get(skey)? {
            Some(v) => decode("state row", &v),
            None => Ok(Row::default()),
        }
    }

    /// One pipeline's stored state for `skey`: from its row, or the `state` tree when the
    /// row says something is spilled (or the store is not upgraded yet).
    pub(super) fn stored_state(
        &self,
        pipeline: &str,
        skey: &[u8],
    ) -> Result<Option<KeyState>, StoreError> {
        self.stored_state_after(pipeline, skey, &mut LastRow::default())
    }

    /// [`Store::stored_state`], reading the row again from `last` if that is the row of
    /// `skey`, and keeping the row read there for the next call. See [`LastRow`] for when
    /// that is right.
    pub(crate) fn stored_state_after(
        &self,
        pipeline: &str,
        skey: &[u8],
        last: &mut LastRow,
    ) -> Result<Option<KeyState>, StoreError> {
        let mut look_aside = self.legacy_layout();
        let row = match &last.0 {
            // Never while the layout is being upgraded: then the states of a key not being
            // written may move from the tree into its row between two reads.
            Some((k, row)) if k == skey && !look_aside => row.clone(),
            _ => {
                let row = self.rows.get(skey)?;
                last.0 = Some((skey.to_vec(), row.clone()));
                row
            }
        };
        if let Some(v) = row {
            let row: RowRef = row_ref(&v)?;
            if let Ok(i) = row.entries.binary_search_by(|(p, _)| (*p).cmp(pipeline)) {
                return decode("state", row.entries[i].1).map(Some);
            }
            look_aside |= row.spilled;
        }
        if !look_aside {
            return Ok(None);
        }
        match self.state.get(pkey(pipeline, skey))? {
            Some(v) => decode("state", &v).map(Some),
            None => Ok(None),
        }
    }

    /// The writes of one checkpoint's state changes: the rows they touch, and the `state`
    /// tree's spilled entries. Reads the rows as stored (only commits write them, one at a
    /// time, so they stay as read until this commit's transaction).
    pub(super) fn state_writes(
        &self,
        changes: &BTreeMap<(String, Vec<u8>), Option<KeyState>>,
    ) -> Result<(sled::Batch, sled::Batch), StoreError> {
        let mut by_key: BTreeMap<&[u8], Vec<(&str, Option<&KeyState>)>> = BTreeMap::new();
        for ((p, skey), v) in changes {
            by_key
                .entry(skey.as_slice())
                .or_default()
                .push((p.as_str(), v.as_ref()));
        }
        let legacy = self.legacy_layout();
        let (mut rows, mut spill) = (sled::Batch::default(), sled::Batch::default());
        for (skey, list) in by_key {
            let mut row = self.row(skey)?;
            let had_row = !row.entries.is_empty() || row.spilled;
            for (p, change) in list {
                let key = pkey(p, skey);
                let was_in_row = match row.find(p) {
                    Ok(i) => {
                        row.entries.remove(i);
                        true
                    }
                    Err(_) => false,
                };
                // Where it was not in the row, it may be in the tree.
                let maybe_spilled = !was_in_row && (row.spilled || legacy);
                match change {
                    None => {
                        if maybe_spilled {
                            spill.remove(key);
                        }
                    }
                    Some(s) => {
                        // Bounded alone first, as it was stored before rows.
                        let value = bounded("state", &key, encode(s))?;
                        if row.place(skey, p, &value) {
                            if maybe_spilled {
                                spill.remove(key);
                            }
                        } else {
                            spill.insert(key, value);
                        }
                    }
                }
            }
            if row.entries.is_empty() && !row.spilled {
                if had_row {
                    rows.remove(skey);
                }
            } else {
                rows.insert(skey, row_value(skey, &row)?);
            }
        }
        Ok((rows, spill))
    }

    /// Every stored state, optionally of one pipeline: the rows', then the `state` tree's
    /// (spilled, or not yet moved into rows).
    pub(super) fn all_states(
        &self,
        pipeline: Option<&str>,
    ) -> impl Iterator<Item = Result<StoredState, StoreError>> + '_ {
        let wanted = pipeline.map(str::to_string);
        let from_rows = self.rows.iter().flat_map(move |r| {
            let items: Vec<Result<StoredState, StoreError>> = match r
                .map_err(StoreError::from)
                .and_then(|(k, v)| Ok((k, decode::<Row>("state row", &v)?)))
            {
                Ok((k, row)) => row
                    .entries
                    .into_iter()
                    .filter(|(p, _)| wanted.as_deref().is_none_or(|w| w == p))
                    .map(|(p, s)| Ok((p, k.to_vec(), decode("state", &s)?)))
                    .collect(),
                Err(e) => vec![Err(e)],
            };
            items
        });
        let tree = match pipeline {
            Some(p) => self.state.scan_prefix(pkey(p, &[])),
            None => self.state.iter(),
        };
        let from_tree = tree.map(|r| {
            let (k, v) = r?;
            let (p, skey) = split_pkey(&k)?;
            Ok((p, skey.to_vec(), decode("state", &v)?))
        });
        from_rows.chain(from_tree)
    }

    /// The stored keys of `pipeline` in `[lo, hi)`, in order.
    pub(super) fn state_keys_in(
        &self,
        pipeline: &str,
        lo: &[u8],
        hi: &[u8],
    ) -> Result<Vec<Vec<u8>>, StoreError> {
        let mut keys = Vec::new();
        for r in self.rows.range(lo..hi) {
            let (k, v) = r?;
            let row = row_ref(&v)?;
            if row.entries.iter().any(|(p, _)| *p == pipeline) {
                keys.push(k.to_vec());
            }
        }
        let plen = pipeline.len() + 1;
        let before = keys.len();
        for r in self.state.range(pkey(pipeline, lo)..pkey(pipeline, hi)) {
            let (k, _) = r?;
            keys.push(k[plen..].to_vec());
        }
        if keys.len() > before {
            keys.sort();
            keys.dedup();
        }
        Ok(keys)
    }

    /// The pipelines that have a state in some row (walks the rows): an upgraded store's
    /// states are all there, those of a pipeline its progress record forgot too.
    pub(super) fn row_pipelines(&self) -> Result<std::collections::BTreeSet<String>, StoreError> {
        let mut names = std::collections::BTreeSet::new();
        for (n, r) in self.rows.iter().enumerate() {
            super::release_while_walking(n);
            let (_, v) = r?;
            for (p, _) in row_ref(&v)?.entries {
                if !names.contains(p) {
                    names.insert(p.to_string());
                }
            }
        }
        Ok(names)
    }

    /// States stored, over all pipelines (walks the rows).
    pub(super) fn count_states(&self) -> Result<usize, StoreError> {
        let mut n = self.state.len();
        for r in self.rows.iter() {
            let (_, v) = r?;
            n += row_ref(&v)?.entries.len();
        }
        Ok(n)
    }

    /// The writes that forget every state of `pipelines`: rows rewritten without them,
    /// their entries in the `state` tree removed.
    pub(super) fn forget_states(
        &self,
        pipelines: &[&str],
    ) -> Result<(sled::Batch, sled::Batch), StoreError> {
        let (mut rows, mut spill) = (sled::Batch::default(), sled::Batch::default());
        if pipelines.is_empty() {
            return Ok((rows, spill));
        }
        for r in self.rows.iter() {
            let (k, v) = r?;
            let mut row: Row = decode("state row", &v)?;
            let before = row.entries.len();
            row.entries
                .retain(|(p, _)| !pipelines.contains(&p.as_str()));
            if row.entries.len() == before {
                continue;
            }
            if row.entries.is_empty() && !row.spilled {
                rows.remove(k);
            } else {
                rows.insert(k.to_vec(), row_value(&k, &row)?);
            }
        }
        for p in pipelines {
            for k in self.state.scan_prefix(pkey(p, &[])).keys() {
                spill.remove(k?);
            }
        }
        Ok((rows, spill))
    }

    /// Move a format-2 or -3 store's states into rows and record format 4 (see the module
    /// docs). Nothing to do for a store in this build's layout. The agent runs it at start,
    /// before it reads any state, and every write runs it first (a commit, a reset).
    pub fn upgrade_layout(&self) -> Result<(), StoreError> {
        if !self.legacy_layout() {
            return Ok(());
        }
        let mut from: Option<sled::IVec> = None;
        let mut moved = 0u64;
        loop {
            let range = match &from {
                Some(k) => self.state.range::<&[u8], _>((
                    std::ops::Bound::Excluded(k.as_ref()),
                    std::ops::Bound::Unbounded,
                )),
                None => self.state.iter(),
            };
            let chunk: Vec<(sled::IVec, sled::IVec)> =
                range.take(UPGRADE_BATCH).collect::<Result<_, _>>()?;
            let Some((last, _)) = chunk.last() else {
                break;
            };
            from = Some(last.clone());
            let mut rows: BTreeMap<Vec<u8>, Row> = BTreeMap::new();
            let mut spill = sled::Batch::default();
            for (k, v) in &chunk {
                let (p, skey) = split_pkey(k)?;
                if !rows.contains_key(skey) {
                    rows.insert(skey.to_vec(), self.row(skey)?);
                }
                let row = rows.get_mut(skey).expect("just inserted");
                if row.find(&p).is_ok() {
                    // Cannot happen (a state is in one place); the row's is newer.
                    spill.remove(k.as_ref());
                } else if row.place(skey, &p, v) {
                    spill.remove(k.as_ref());
                    moved += 1;
                }
            }
            let mut batch = sled::Batch::default();
            for (skey, row) in &rows {
                batch.insert(skey.as_slice(), row_value(skey, row)?);
            }
            [&self.state, &self.rows][..]
                .transaction(|tx| {
                    tx[0].apply_batch(&spill)?;
                    tx[1].apply_batch(&batch)?;
                    Ok::<(), sled::transaction::ConflictableTransactionError<()>>(())
                })
                .map_err(tx_err)?;
        }
        // Format 2's progress record is read in its own layout: written in this one with
        // the format that says so.
        let old_v2 =
            self.meta.get(FORMAT_KEY)?.as_deref() == Some(&STORE_FORMAT_V2.to_be_bytes()[..]);
        let mut meta = sled::Batch::default();
        if old_v2 && self.meta.get(PROGRESS_KEY)?.is_some() {
            // Backfill cursors are not in it (`serde(skip)`): they keep their own record.
            let progress = self.progress()?;
            meta.insert(
                PROGRESS_KEY,
                bounded("meta", PROGRESS_KEY, encode(&progress))?,
            );
        }
        meta.insert(FORMAT_KEY, &STORE_FORMAT.to_be_bytes());
        self.meta.apply_batch(meta)?;
        self.sync()?;
        self.legacy
            .store(false, std::sync::atomic::Ordering::Release);
        crate::event!(info, "store_layout_upgraded";
            "store: states moved into rows (layout {STORE_FORMAT}): {moved} moved, the rest \
             stay where they were as too large for a row"
        );
        Ok(())
    }
}

pub(super) fn tx_err(e: sled::transaction::TransactionError<()>) -> StoreError {
    match e {
        sled::transaction::TransactionError::Storage(e) => StoreError::Sled(e),
        sled::transaction::TransactionError::Abort(()) => unreachable!("never aborts"),
    }
}

/// Check a stored row as a savepoint restore reads it: a row whose every state decodes.
pub(super) fn check_row(value: &[u8]) -> Result<(), StoreError> {
    let row = row_ref(value)?;
    for (_, s) in row.entries {
        decode::<KeyState>("state", s)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_row_reads_in_place_as_written() {
        let row = Row {
            spilled: true,
            entries: vec![("a".into(), vec![1, 2, 3]), ("b".into(), vec![0; 300])],
        };
        let bytes = encode(&row);
        assert_eq!(bytes.len() + 3, row.stored_size(b"key"));
        let r = row_ref(&bytes).unwrap();
        assert!(r.spilled);
        assert_eq!(
            r.entries,
            vec![("a", &[1u8, 2, 3][..]), ("b", &[0u8; 300][..])]
        );
    }

    #[test]
    fn a_state_at_the_entry_bound_is_spilled_and_every_row_stays_within_it() {
        for name in [1usize, 127, 128, 300] {
            let p = "p".repeat(name);
            let skey = vec![7u8; 200];
            let state = vec![1u8; MAX_ENTRY_BYTES - pkey(&p, &skey).len()];
            let mut row = Row::default();
            assert!(!row.place(&skey, &p, &state), "{name}");
            assert!(row.spilled && row.entries.is_empty());
            let mut row = Row::default();
            let mut n = 0;
            while row.place(&skey, &format!("{p}{n}"), &[3u8; 100]) {
                n += 1;
            }
            assert!(n > 10 && row.spilled, "{name}: {n}");
            assert!(encode(&row).len() + skey.len() <= MAX_ENTRY_BYTES, "{name}");
        }
    }

    #[test]
    fn a_state_that_does_not_fit_is_spilled_and_the_row_keeps_its_others() {
        let mut row = Row::default();
        assert!(row.place(b"k", "a", &[1; 4000]));
        assert!(!row.place(b"k", "b", &[2; 4000]));
        assert!(row.spilled);
        assert_eq!(row.entries.len(), 1);
        assert!(encode(&row).len() < MAX_ENTRY_BYTES);
    }
}

#[cfg(test)]
#[path = "rows_tests.rs"]
pub(super) mod store_tests;
