//! Entry points for `crate::fuzzing` into what the store reads back from disk: one tree
//! entry (key and value) decoded as the store decodes it, and the ledger's allocation-free
//! chunk walk checked against the plain decode of the same bytes.

use super::ledger::{Chunk, chunk_get, scan_chunk};
use super::{
    CheckpointInfo, DeadLetterStats, StoreError, decode, encode, progress_bytes_at_most,
    split_pkey, u64_of, v2,
};
use crate::model::{Backfill, DeadLetter, Output, Progress};
use crate::pipeline::sparkplug::session::Entry;
use crate::pipeline::value::KeyState;

/// Decode `value` (and `key`) as an entry of tree `tree` (the savepoint's numbering: meta,
/// state, dedup, outbox, dead, checkpoints, sparkplug), then use what decoded as a start
/// would. Returns the decoded state, if it was one, for the caller to exercise.
pub(crate) fn stored_entry(
    tree: u8,
    key: &[u8],
    value: &[u8],
) -> Result<Option<KeyState>, StoreError> {
    match tree % 11 {
        0 => {
            let p: Progress = decode("progress", value)?;
            progress_bytes_at_most(&p);
            round_trip(&p)?;
        }
        1 => {
            let p: Progress = decode::<v2::Progress>("format-2 progress", value)?.into();
            progress_bytes_at_most(&p);
        }
        2 => {
            decode::<Vec<(String, Backfill)>>("backfill cursors", value)?;
            decode::<DeadLetterStats>("dead-letter counts", key)?;
            decode::<Vec<(String, u64)>>("ledger windows", value)?;
        }
        3 => {
            split_pkey(key)?;
            let st: KeyState = decode("state", value)?;
            return Ok(Some(st));
        }
        4 => ledger_chunk(key, value)?,
        5 => {
            u64_of(key)?;
            let outs: Vec<(u64, Output)> = decode("outbox chunk", value)?;
            round_trip(&outs)?;
        }
        6 => {
            decode::<DeadLetter>("dead letter", value)?;
        }
        7 => {
            decode::<CheckpointInfo>("checkpoint record", value)?;
        }
        8 => {
            split_pkey(key)?;
            let e: Entry = decode("Sparkplug session entry", value)?;
            round_trip(&e)?;
        }
        _ => {
            let st: KeyState = decode("state", value)?;
            return Ok(Some(st));
        }
    }
    Ok(None)
}

/// Encoding what decoded and decoding it again gives the same bytes (the store rewrites
/// entries it read: a value that changed on the way would be a silent edit).
fn round_trip<T: serde::Serialize + for<'a> serde::Deserialize<'a>>(
    v: &T,
) -> Result<(), StoreError> {
    let once = encode(v);
    let again = encode(&decode::<T>("round trip", &once)?);
    assert_eq!(once, again, "a stored value does not encode stably");
    Ok(())
}

/// The walk every ledger lookup takes ([`scan_chunk`], [`chunk_get`]) agrees with postcard's
/// decode of the same bytes: the same entries, or both refuse (the walk accepts IDs that
/// are not UTF-8, which postcard refuses; then only the walk's own consistency is checked).
fn ledger_chunk(id: &[u8], value: &[u8]) -> Result<(), StoreError> {
    let mut walked = Vec::new();
    let scanned = scan_chunk(value, |e, seen| {
        walked.push((e.to_vec(), seen));
        true
    });
    let got = chunk_get(value, id);
    // The store decodes with `from_bytes`, which leaves trailing bytes unread; the walk
    // refuses them. Both are told apart only on damage, so compare whole decodes.
    let whole = postcard::take_from_bytes::<Chunk>(value).map(|(c, rest)| (c, rest.is_empty()));
    match whole {
        Ok((chunk, true)) => {
            let (max_seen, n) = scanned.expect("a chunk postcard decodes must scan");
            assert_eq!(max_seen, chunk.max_seen_ms);
            assert_eq!(n as usize, chunk.entries.len());
            let decoded: Vec<(Vec<u8>, u64)> = chunk
                .entries
                .iter()
                .map(|(i, s)| (i.as_bytes().to_vec(), *s))
                .collect();
            assert_eq!(
                walked, decoded,
                "the walk reads other entries than postcard"
            );
            // The lookup stops at the first greater ID: on sorted unique IDs it finds
            // exactly what a search finds.
            if decoded.windows(2).all(|w| w[0].0 < w[1].0) {
                let want = decoded.iter().find(|(i, _)| i == id).map(|e| e.1);
                assert_eq!(got.ok().flatten(), want);
            }
            Ok(())
        }
        _ => {
            if let Ok((_, n)) = scanned {
                assert_eq!(n as usize, walked.len());
            }
            decode::<Chunk>("ledger chunk", value).map(|_| ())
        }
    }
}

/// See `savepoint.rs`'s `fuzz_frame`.
pub(crate) fn frame_savepoint(body: &[u8]) -> Vec<u8> {
    super::savepoint::fuzz_frame(body)
}

/// A savepoint's file name as `cairn savepoint create` gives it.
pub(crate) fn savepoint_name() -> String {
    super::savepoint::savepoint_file_name(1, 0, 0)
}

/// Every check a restore runs on `file` before it builds anything.
pub(crate) fn check_savepoint(file: &std::path::Path) -> Result<(), StoreError> {
    super::savepoint::fuzz_check(file).map(|_| ())
}
