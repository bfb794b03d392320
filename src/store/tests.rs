use super::*;
use crate::fsio::{self, TestSync};
use crate::model::Record;
use crate::pipeline::engine::Engine;
use crate::pipeline::spec::*;

fn spec() -> PipelineSpec {
    crate::config::pipeline_from_toml(
        r#"name = "balances"
topics = ["payments/#"]
format = "delimited"
event_id = "0"
key = "1"
value = "2"
aggregate = "sum"
output_topic = "balances/{key}"
max_key_len = 64
max_keys = 1000"#,
    )
    .unwrap()
}

fn rec(offset: u64, payload: &str) -> Record {
    Record {
        offset,
        received_at_ms: 1000 + offset,
        topic: "payments/x".into(),
        payload: payload.as_bytes().to_vec(),
        qos: 1,
        retain: false,
    }
}

#[test]
fn commit_advances_progress() {
    let dir = tempfile::tempdir().unwrap();
    let sync = TestSync::new();
    let store = Store::open(&dir.path().join("store"), 1 << 20, sync.clone()).unwrap();
    let mut engine = Engine::new(vec![spec()], store.progress().unwrap());
    engine.apply(&store, &rec(0, "E1/A/5")).unwrap();
    let before = sync.file_syncs();
    let cp = engine.take_checkpoint(&store).unwrap();
    let info = store.commit(&cp, 0).unwrap();
    assert!(sync.file_syncs() > before, "commit must fsync the db file");
    assert_eq!((info.id, info.prev_offset, info.next_offset), (1, 0, 1));
    let p = store.progress().unwrap();
    assert_eq!(p.next_offset, 1);
    assert_eq!(p.checkpoint_id, 1);
    engine.apply(&store, &rec(1, "E2/A/7")).unwrap();
    let info = store
        .commit(&engine.take_checkpoint(&store).unwrap(), 0)
        .unwrap();
    assert_eq!((info.id, info.prev_offset, info.next_offset), (2, 1, 2));
    assert_eq!(store.checkpoints().count(), 2);
    drop(store);
    let store = Store::open(&dir.path().join("store"), 1 << 20, fsio::real()).unwrap();
    assert_eq!(store.progress().unwrap().next_offset, 2);
    let st: Vec<_> = store.states(None).map(|r| r.unwrap()).collect();
    assert_eq!(st.len(), 1);
    assert_eq!(st[0].2.value_json(), serde_json::json!(12));
    assert_eq!(st[0].2.version, 2);
}

#[test]
fn outbox_insert_is_idempotent_by_id() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), 1 << 20, fsio::real()).unwrap();
    let mut engine = Engine::new(vec![spec()], store.progress().unwrap());
    engine.apply(&store, &rec(0, "E1/A/5")).unwrap();
    let mut cp = engine.take_checkpoint(&store).unwrap();
    assert_eq!(cp.batch.outputs.len(), 1);
    let dup = cp.batch.outputs[0].clone();
    cp.batch.outputs.push((dup.0 + 1, dup.1));
    store.commit(&cp, 0).unwrap();
    assert_eq!(store.outbox_len(), 1);
    let (seq, out) = store.outbox_from(0).next().unwrap().unwrap();
    assert_eq!(out.id, "balances/A/1");
    store.outbox_delete(seq, &out.id).unwrap();
    assert_eq!(store.outbox_len(), 0);
}

#[test]
fn incomplete_sled_snapshots_are_removed_before_open() {
    let dir = tempfile::tempdir().unwrap();
    drop(Store::open(dir.path(), 1 << 20, fsio::real()).unwrap());
    let junk = dir.path().join("snap.00000000000000AB.generating");
    std::fs::write(&junk, b"half a snapshot").unwrap();
    Store::open(dir.path(), 1 << 20, fsio::real()).unwrap();
    assert!(!junk.exists());
}

#[test]
fn a_failed_fsync_fails_the_commit() {
    let dir = tempfile::tempdir().unwrap();
    let sync = TestSync::new();
    let store = Store::open(dir.path(), 1 << 20, sync.clone()).unwrap();
    let mut engine = Engine::new(vec![spec()], store.progress().unwrap());
    engine.apply(&store, &rec(0, "E1/A/5")).unwrap();
    let cp = engine.take_checkpoint(&store).unwrap();
    sync.fail.store(true, std::sync::atomic::Ordering::SeqCst);
    assert!(store.commit(&cp, 0).is_err());
}
