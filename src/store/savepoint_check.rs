//! The whole savepoint checked before a restore builds or moves anything (issue 27).
//!
//! The CRCs only say that a file is the one that was written, not that a store built from
//! it would open: a crafted savepoint with valid checksums was restored, the good store was
//! moved aside, and the agent then refused to start. So before anything is built, one
//! streaming pass reads every entry and checks it as the store will read it:
//!
//! - its tree exists, and key plus value stay within the bound every commit keeps
//!   ([`MAX_ENTRY_BYTES`], [`MAX_META_BYTES`] in `meta`): a larger entry was never written
//!   by a store, and sled would put it in a blob file it never fsyncs;
//! - keys ascend within a tree and trees come in order, as the writer walks them;
//! - each key and value decodes as its tree's type (`state`: a pipeline-scoped key and a
//!   `KeyState`; `rows`: a row of states; `dedup`: a ledger chunk; `outbox`: a sequence number and a chunk of outputs;
//!   `dead`: a dead letter; `checkpoints`: a checkpoint record; `meta`: the layout, the
//!   progress record under that layout, the backfill cursors, the dead-letter counts, the
//!   send horizon);
//! - the layout is one this build reads, and the progress record names the header's
//!   checkpoint and offset;
//! - the entry count, the end marker and the CRC of the whole file.
//!
//! Memory is one entry at a time (at most [`MAX_META_BYTES`]), the previous key, and the
//! progress record until the pass ends: it does not grow with the file.

use std::fs::File;
use std::io::{BufReader, Read};
use std::path::Path;

use super::super::{
    BACKFILL_KEY, CheckpointInfo, DEAD_STATS_KEY, DeadLetterStats, FORMAT_KEY, LEDGER_GROUPS_KEY,
    LEDGER_WINDOWS_KEY, MAX_ENTRY_BYTES, MAX_META_BYTES, PROGRESS_KEY, SEND_HORIZON_KEY,
    STORE_FORMAT, STORE_FORMAT_V2, StoreError, decode, io_err, split_pkey, u64_of, v2,
};
use super::{END_MAGIC, HEADER_LEN, SavepointInfo, TRAILER_LEN, TREES, corrupt};
use crate::model::{Backfill, DeadLetter, Output, Progress};
use crate::pipeline::value::KeyState;

/// Reads through a CRC.
struct CrcReader<R: Read> {
    inner: R,
    crc: crc32fast::Hasher,
}

impl<R: Read> CrcReader<R> {
    fn read_exact(&mut self, buf: &mut [u8]) -> std::io::Result<()> {
        self.inner.read_exact(buf)?;
        self.crc.update(buf);
        Ok(())
    }
}

/// What the `meta` tree held, kept for the checks at the end.
#[derive(Default)]
struct Meta {
    format: Option<u32>,
    progress: Option<Vec<u8>>,
}

/// Check every byte of `file` (see the module docs); its header on success.
pub(crate) fn check_savepoint(file: &Path) -> Result<SavepointInfo, StoreError> {
    let info = super::read_savepoint_header(file)?;
    let mut r = CrcReader {
        inner: BufReader::with_capacity(1 << 16, File::open(file).map_err(io_err(file))?),
        crc: crc32fast::Hasher::new(),
    };
    let mut header = [0u8; HEADER_LEN];
    r.read_exact(&mut header).map_err(io_err(file))?;
    let body_end = info.bytes - TRAILER_LEN;
    let mut pos = HEADER_LEN as u64;
    let mut entries = 0u64;
    let mut meta = Meta::default();
    let (mut key, mut value, mut prev) = (Vec::new(), Vec::new(), None::<(usize, Vec<u8>)>);
    while pos < body_end {
        crate::logging::progress::step(
            "checking every entry of the savepoint",
            pos,
            Some(body_end),
            crate::logging::progress::Unit::Bytes,
        );
        let at = pos;
        let bad = |what: String| corrupt(file, format!("entry {entries} (byte {at}): {what}"));
        let mut fixed = [0u8; 9];
        r.read_exact(&mut fixed).map_err(io_err(file))?;
        let tree = usize::from(fixed[0]);
        let klen = u32::from_le_bytes(fixed[1..5].try_into().expect("4 bytes")) as usize;
        let vlen = u32::from_le_bytes(fixed[5..9].try_into().expect("4 bytes")) as usize;
        let Some(name) = TREES.get(tree) else {
            return Err(bad(format!("no tree number {tree}")));
        };
        let limit = if tree == 0 {
            MAX_META_BYTES
        } else {
            MAX_ENTRY_BYTES
        };
        let size = klen.saturating_add(vlen);
        if size > limit {
            return Err(bad(format!(
                "a {name} entry of {size} bytes, over the {limit} bytes a store ever writes"
            )));
        }
        pos += 9 + size as u64;
        if pos > body_end {
            return Err(bad("it runs past the end".into()));
        }
        key.resize(klen, 0);
        value.resize(vlen, 0);
        r.read_exact(&mut key).map_err(io_err(file))?;
        r.read_exact(&mut value).map_err(io_err(file))?;
        if let Some((t, k)) = &prev
            && (*t > tree || (*t == tree && k.as_slice() >= key.as_slice()))
        {
            return Err(bad(format!("a {name} entry out of order")));
        }
        check_entry(tree, &key, &value, &mut meta)
            .map_err(|e| bad(format!("{name}: {}", what(e))))?;
        match &mut prev {
            Some((t, k)) => {
                *t = tree;
                k.clear();
                k.extend_from_slice(&key);
            }
            None => prev = Some((tree, key.clone())),
        }
        entries += 1;
    }
    let mut end = [0u8; 8];
    r.read_exact(&mut end).map_err(io_err(file))?;
    let mut stored = [0u8; 4];
    r.inner.read_exact(&mut stored).map_err(io_err(file))?;
    if r.crc.finalize() != u32::from_le_bytes(stored) {
        return Err(corrupt(file, "CRC mismatch"));
    }
    if &end != END_MAGIC {
        return Err(corrupt(file, "no end marker"));
    }
    if entries != info.entries {
        return Err(corrupt(
            file,
            format!("{entries} entries, the header says {}", info.entries),
        ));
    }
    let (checkpoint_id, next_offset) = match (&meta.progress, meta.format) {
        (None, _) => (0, 0),
        (Some(_), None) => {
            return Err(corrupt(
                file,
                "a progress record without a layout record (layout 1, which this cairn does \
                 not read)",
            ));
        }
        (Some(p), Some(format)) => {
            let decoded = if format == STORE_FORMAT_V2 {
                decode::<v2::Progress>("format-2 progress", p).map(Progress::from)
            } else {
                decode::<Progress>("progress", p)
            };
            let p = decoded.map_err(|e| corrupt(file, format!("meta: {}", what(e))))?;
            (p.checkpoint_id, p.next_offset)
        }
    };
    if (checkpoint_id, next_offset) != (info.checkpoint_id, info.next_offset) {
        return Err(corrupt(
            file,
            format!(
                "its progress record says checkpoint {checkpoint_id} at offset {next_offset}, \
                 the header checkpoint {} at offset {}",
                info.checkpoint_id, info.next_offset
            ),
        ));
    }
    Ok(info)
}

/// One entry, as the store reads its tree.
fn check_entry(tree: usize, k: &[u8], v: &[u8], meta: &mut Meta) -> Result<(), StoreError> {
    match tree {
        0 => match k {
            FORMAT_KEY => {
                let f = u32::from_be_bytes(
                    v.try_into()
                        .map_err(|_| StoreError::Corrupt("bad layout record".into()))?,
                );
                if !(STORE_FORMAT_V2..=STORE_FORMAT).contains(&f) {
                    return Err(StoreError::Corrupt(format!(
                        "layout {f}, this cairn reads layouts {STORE_FORMAT_V2} to {STORE_FORMAT}"
                    )));
                }
                meta.format = Some(f);
            }
            PROGRESS_KEY => meta.progress = Some(v.to_vec()),
            BACKFILL_KEY => {
                decode::<Vec<(String, Backfill)>>("backfill cursors", v)?;
            }
            DEAD_STATS_KEY => {
                decode::<DeadLetterStats>("dead-letter counts", v)?;
            }
            LEDGER_WINDOWS_KEY => {
                decode::<Vec<(String, u64)>>("ledger windows", v)?;
            }
            SEND_HORIZON_KEY => {
                u64_of(v)?;
            }
            LEDGER_GROUPS_KEY => {
                decode::<Vec<(String, Vec<String>)>>("ledger groups", v)?;
            }
            // A record a later build of this format adds is left to it.
            _ => {}
        },
        1 => {
            split_pkey(k)?;
            decode::<KeyState>("state", v)?;
        }
        7 => super::super::rows::check_row(v)?,
        2 => {
            split_pkey(k)?;
            decode::<super::super::ledger::Chunk>("ledger chunk", v)?;
        }
        3 => {
            u64_of(k)?;
            decode::<Vec<(u64, Output)>>("outbox chunk", v)?;
        }
        4 => {
            if k.len() < 8 {
                return Err(StoreError::Corrupt(
                    "a dead-letter key of fewer than 8 bytes".into(),
                ));
            }
            decode::<DeadLetter>("dead letter", v)?;
        }
        5 => {
            u64_of(k)?;
            decode::<CheckpointInfo>("checkpoint record", v)?;
        }
        _ => {
            split_pkey(k)?;
            decode::<crate::pipeline::sparkplug::session::Entry>("Sparkplug session entry", v)?;
        }
    }
    Ok(())
}

/// The message of a store error without its "the store is corrupt" prefix: the savepoint's
/// own message says what is damaged.
fn what(e: StoreError) -> String {
    match e {
        StoreError::Corrupt(m) => m,
        e => e.to_string(),
    }
}
