//! The outbox on disk as the uplink's queue (issue 13): its byte count, and that upserts
//! cost space per key, not per event, however long nothing is acknowledged.

use super::*;
use crate::fsio;
use crate::model::Record;
use crate::pipeline::engine::Engine;

fn spec(emit: &str) -> crate::pipeline::spec::PipelineSpec {
    crate::config::pipeline_from_toml(&format!(
        r#"name = "p"
topics = ["t/#"]
format = "delimited"
event_id = "0"
key = "1"
value = "2"
aggregate = "sum"
output_topic = "out/{{key}}"
emit = "{emit}""#
    ))
    .unwrap()
}

fn rec(offset: u64, key: u64) -> Record {
    Record {
        offset,
        received_at_ms: 1000 + offset,
        topic: "t/x".into(),
        payload: format!("E{offset}/K{key}/1").into_bytes(),
        qos: 1,
        retain: false,
    }
}

/// Apply `events` events over `keys` keys (scattered: key = a hash of the offset), a
/// checkpoint every 100, never acknowledging anything (the uplink is down).
fn outage(store: &Store, engine: &mut Engine, from: u64, events: u64, keys: u64) {
    for off in from..from + events {
        let key = off.wrapping_mul(0x9E37_79B9_7F4A_7C15) % keys;
        engine.apply(store, &rec(off, key)).unwrap();
        if off % 100 == 99 {
            store.commit(&engine.take_checkpoint(), 0).unwrap();
        }
    }
    store.commit(&engine.take_checkpoint(), 0).unwrap();
}

/// An engine over `store` with two pipelines on the same inputs: `p` emits upserts, `c` a
/// changelog.
fn upsert_and_changelog(store: &Store) -> Engine {
    let mut c = spec("changelog");
    c.name = "c".into();
    Engine::new(vec![spec("upsert"), c], store.progress().unwrap())
}

/// Keys and values of the outbox tree, as the byte count counts them.
fn tree_bytes(store: &Store) -> u64 {
    super::tests::tree_bytes(&store.outbox)
}

#[test]
fn upserts_cost_space_per_key_not_per_event_and_the_byte_count_follows_the_tree() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), 1 << 20, fsio::real()).unwrap();
    let mut engine = Engine::new(vec![spec("upsert")], store.progress().unwrap());
    outage(&store, &mut engine, 0, 5_000, 50);
    let (after_5k, chunks_5k) = (store.outbox_bytes(), store.outbox.len());
    assert_eq!(store.outbox_len(), 50, "one waiting result per key");
    assert_eq!(store.outbox_bytes(), tree_bytes(&store));
    outage(&store, &mut engine, 5_000, 45_000, 50);
    assert_eq!(store.outbox_len(), 50);
    assert_eq!(store.outbox_bytes(), tree_bytes(&store));
    // Ten times the events, the same keys: the chunks holding a key's newest result are
    // all that is left (at most one per key), so the space does not grow with the outage.
    assert!(store.outbox.len() <= 50, "{} chunks", store.outbox.len());
    assert!(
        store.outbox_bytes() <= after_5k.max(50 * 4096),
        "{} bytes after 50k events, {after_5k} after 5k ({chunks_5k} chunks)",
        store.outbox_bytes()
    );
    // Rebuilt at open from the tree, to the byte.
    let (len, bytes) = (store.outbox_len(), store.outbox_bytes());
    drop(engine);
    drop(store);
    let store = Store::open(dir.path(), 1 << 20, fsio::real()).unwrap();
    assert_eq!((store.outbox_len(), store.outbox_bytes()), (len, bytes));
    // Acknowledging everything deletes every chunk, and the count goes back to 0.
    let all: Vec<_> = store.outbox_from(0).map(Result::unwrap).collect();
    for (seq, out) in all {
        store.outbox_delete(seq, &out.id).unwrap();
    }
    assert_eq!((store.outbox_len(), store.outbox_bytes()), (0, 0));
    assert_eq!(store.outbox.len(), 0);
}

#[test]
fn changelog_results_all_wait_and_their_bytes_grow_with_the_events() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), 1 << 20, fsio::real()).unwrap();
    let mut engine = Engine::new(vec![spec("changelog")], store.progress().unwrap());
    outage(&store, &mut engine, 0, 2_000, 50);
    let b1 = store.outbox_bytes();
    outage(&store, &mut engine, 2_000, 2_000, 50);
    assert_eq!(store.outbox_len(), 4_000, "a changelog drops nothing");
    assert_eq!(store.outbox_bytes(), tree_bytes(&store));
    assert!(
        store.outbox_bytes() >= 2 * b1 - b1 / 10,
        "{b1} then {}",
        store.outbox_bytes()
    );
}

/// Issue 33: an upsert that a newer upsert of its key in the same checkpoint supersedes is
/// not written, and is reported as superseded as if it had been written and then dropped;
/// changelog outputs are all written.
#[test]
fn an_upsert_superseded_within_its_checkpoint_is_never_written_but_reported() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), 1 << 20, fsio::real()).unwrap();
    let mut engine = upsert_and_changelog(&store);
    for (off, key) in [(0, 1), (1, 2), (2, 1), (3, 1)] {
        engine.apply(&store, &rec(off, key)).unwrap();
        engine.flush_upserts(); // as the live loop does after each log commit
    }
    let cp = engine.take_checkpoint();
    let upserts: Vec<u64> = (cp.batch.outputs.iter())
        .filter(|(_, o)| o.latest_only)
        .map(|(s, _)| *s)
        .collect();
    assert_eq!(upserts.len(), 4, "one upsert per event, each flushed");
    let changelog = cp.batch.outputs.len() - upserts.len();
    assert_eq!(changelog, 4);
    store.commit(&cp, 0).unwrap();
    // Kept: K2's and K1's newest upserts, and every changelog output.
    assert_eq!(store.outbox_len(), 2 + changelog);
    let ids: Vec<String> = (store.outbox_from(0).map(|r| r.unwrap().1.id))
        .filter(|id| id.starts_with("p/"))
        .collect();
    assert_eq!(ids, ["p/K2/1", "p/K1/3"]);
    assert_eq!(
        store.outbox_take_superseded(),
        Some(vec![upserts[0], upserts[2]]),
        "K1's first two upserts, reported once"
    );
    assert_eq!(store.outbox_take_superseded(), Some(vec![]));
    drop(store);
    // Reopened: the same outbox.
    let store = Store::open(dir.path(), 1 << 20, fsio::real()).unwrap();
    assert_eq!(store.outbox_len(), 2 + changelog);
}

#[test]
fn deletes_held_while_a_checkpoint_commits_happen_when_it_is_done_and_a_crash_resends_them() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), 1 << 20, fsio::real()).unwrap();
    let mut engine = Engine::new(vec![spec("changelog")], store.progress().unwrap());
    outage(&store, &mut engine, 0, 300, 50);
    let chunks = store.outbox.len();
    assert!(chunks > 1, "{chunks} chunks");
    let all: Vec<_> = store.outbox_from(0).map(Result::unwrap).collect();
    store.hold_outbox_deletes(true).unwrap();
    for (seq, out) in &all {
        store.outbox_delete(*seq, &out.id).unwrap();
    }
    // Gone for everything that counts what waits; still on disk.
    assert_eq!((store.outbox_len(), store.outbox_bytes()), (0, 0));
    assert_eq!(store.outbox_from(0).count(), 0);
    assert_eq!(store.outbox.len(), chunks, "no delete while held");
    // A commit meanwhile (the one the hold is for) goes through as ever.
    outage(&store, &mut engine, 300, 10, 50);
    assert_eq!(store.outbox_len(), 10);
    store.hold_outbox_deletes(false).unwrap();
    assert_eq!(store.outbox_bytes(), tree_bytes(&store));
    assert_eq!(store.outbox_len(), 10);

    // Held and never released (a crash while a commit ran): the chunks come back at open,
    // with the same entries, to be sent again.
    let again: Vec<_> = store.outbox_from(0).map(Result::unwrap).collect();
    store.hold_outbox_deletes(true).unwrap();
    for (seq, out) in &again {
        store.outbox_delete(*seq, &out.id).unwrap();
    }
    assert_eq!(store.outbox_len(), 0);
    drop(engine);
    drop(store);
    let store = Store::open(dir.path(), 1 << 20, fsio::real()).unwrap();
    let back: Vec<_> = store.outbox_from(0).map(Result::unwrap).collect();
    assert_eq!(back, again, "the same entries, the same IDs");
}

#[test]
fn chunks_read_ahead_are_sent_from_memory_while_a_commit_would_keep_the_store() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), 1 << 20, fsio::real()).unwrap();
    let mut engine = Engine::new(vec![spec("changelog")], store.progress().unwrap());
    outage(&store, &mut engine, 0, 10_000, 50);
    let all: Vec<_> = store.outbox_from(0).map(Result::unwrap).collect();
    // The cursor somewhere in the middle; reopen so that no chunk is in memory yet.
    let from = all[1_000].0;
    drop(engine);
    drop(store);
    let store = Store::open(dir.path(), 1 << 20, fsio::real()).unwrap();
    let chunks = super::outbox::PREFETCH_CHUNKS;
    store.outbox_prefetch(from, chunks).unwrap();
    // Take the chunks out of the tree behind the store's back: what the read-ahead holds
    // is served from memory, and the first chunk past it is not there.
    let firsts: Vec<u64> = store
        .outbox
        .iter()
        .keys()
        .map(|k| u64::from_be_bytes(k.unwrap().as_ref().try_into().unwrap()))
        .collect();
    for f in &firsts {
        store.outbox.remove(f.to_be_bytes()).unwrap();
    }
    let mut read = 0;
    for e in store.outbox_from(from) {
        match e {
            Ok((seq, out)) => {
                assert_eq!((seq, &out), (all[1_000 + read].0, &all[1_000 + read].1));
                read += 1;
            }
            Err(_) => break,
        }
    }
    let at = firsts.partition_point(|f| *f <= from) - 1;
    assert!(
        firsts.len() - at > chunks,
        "the outage wrote {} chunks from the cursor on, no more than the read-ahead",
        firsts.len() - at
    );
    assert!(read >= chunks * 10, "{read} entries read from memory");
    assert!(read < all.len() - 1_000, "everything was in memory: {read}");
    assert!(
        store.outbox_from(from).nth(read).unwrap().is_err(),
        "past the read-ahead"
    );
}

/// A commit copies into memory only the chunks the outbox's cache keeps, its newest
/// [`super::outbox::CACHE_CHUNKS`], which is what the cache held when every chunk went
/// through it (issue 33: a copy of every output lived through the transaction beside the
/// batch's own); the rest are read from the store.
#[test]
fn a_commit_keeps_its_newest_chunks_in_memory_and_only_those() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), 1 << 20, fsio::real()).unwrap();
    let mut engine = Engine::new(vec![spec("changelog")], store.progress().unwrap());
    for off in 0..12_000 {
        engine.apply(&store, &rec(off, off % 50)).unwrap();
    }
    store.commit(&engine.take_checkpoint(), 0).unwrap();
    let all: Vec<_> = store.outbox_from(0).map(Result::unwrap).collect();
    assert_eq!(all.len(), 12_000);
    let firsts: Vec<u64> = (store.outbox.iter().keys())
        .map(|k| u64::from_be_bytes(k.unwrap().as_ref().try_into().unwrap()))
        .collect();
    let cached = super::outbox::CACHE_CHUNKS;
    assert!(firsts.len() > cached + 10, "{} chunks", firsts.len());
    // Behind the store's back, the tree loses every chunk: the newest are still read from
    // memory, as they were written; the one before them is not there.
    for f in &firsts {
        store.outbox.remove(f.to_be_bytes()).unwrap();
    }
    let newest = firsts[firsts.len() - cached];
    let from = all.partition_point(|(seq, _)| *seq < newest);
    let read: Vec<_> = store.outbox_from(newest).map(Result::unwrap).collect();
    assert_eq!(read, all[from..]);
    let before = firsts[firsts.len() - cached - 1];
    assert!(
        store.outbox_from(before).next().unwrap().is_err(),
        "not kept"
    );
}

/// Issue 33: what a commit says it added is what a walk of the outbox past the previous
/// commit's entries finds (the results room counts from it instead of that walk): no
/// upsert superseded within the batch, nothing acknowledged since, and each once.
#[test]
fn the_entries_a_commit_added_are_those_still_waiting_that_a_walk_past_it_finds() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), 1 << 20, fsio::real()).unwrap();
    let mut engine = upsert_and_changelog(&store);
    let seqs = |from: u64| -> Vec<u64> {
        (store.outbox_from(from))
            .map(|r| r.unwrap().0)
            .collect::<Vec<_>>()
    };
    let mut commit = |offsets: std::ops::Range<u64>| {
        for off in offsets {
            engine.apply(&store, &rec(off, off % 3)).unwrap();
            engine.flush_upserts();
        }
        let cp = engine.take_checkpoint();
        store.commit(&cp, 0).unwrap();
        cp
    };
    let first = commit(0..6);
    let added = store.outbox_take_added();
    assert_eq!(added, seqs(0), "the first commit: everything in the outbox");
    assert_eq!(
        added.len(),
        3 + 6,
        "3 keys' newest upserts, 6 changelog outputs"
    );
    assert_eq!(store.outbox_take_added(), Vec::<u64>::new(), "once");
    // Some of the first commit's entries acknowledged.
    for (seq, out) in first
        .batch
        .outputs
        .iter()
        .filter(|(s, _)| added[..4].contains(s))
    {
        store.outbox_delete(*seq, &out.id).unwrap();
    }
    // The second commit supersedes the first's upserts, and within itself all but the
    // newest upsert of each key; one of its entries is acknowledged before anyone asks.
    let second = commit(6..15);
    let end_of_first = added.last().unwrap() + 1;
    let written = seqs(end_of_first);
    assert_eq!(
        written.len(),
        3 + 9,
        "3 keys' newest upserts, 9 changelog outputs"
    );
    let seq = written[written.len() / 2];
    let out = &second
        .batch
        .outputs
        .iter()
        .find(|(s, _)| *s == seq)
        .unwrap()
        .1;
    store.outbox_delete(seq, &out.id).unwrap();
    let added = store.outbox_take_added();
    assert_eq!(
        added,
        seqs(end_of_first),
        "what a walk past the first finds"
    );
    assert_eq!(added.len(), 3 + 9 - 1);
    assert!(!added.contains(&seq), "the acknowledged one does not wait");
    assert!(
        (added.iter()).all(|s| second.batch.outputs.iter().any(|(o, _)| o == s)),
        "each one of the checkpoint's outputs"
    );
    assert!(added.windows(2).all(|w| w[0] < w[1]), "in order: {added:?}");
}
