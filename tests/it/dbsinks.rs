//! The PostgreSQL and JetStream sinks' clients (issue 30) against real servers: the shared
//! PostgreSQL (each test its own database, dropped after) and `nats-server` processes each
//! test starts (`support::nats`), a three-node cluster with an R3 stream included.
//!
//! The sinks are driven as the outbox drives them ([`Driver`]): batches in sequence order,
//! what is answered `Retry` sent again, the rest forgotten. A database outage is made two
//! ways: `pg_terminate_backend` on the sink's connections (what a database restart looks like
//! to a client: the shared PostgreSQL itself is never restarted), and a TCP proxy the test
//! pauses and cuts (the database unreachable for a while).

use std::collections::BTreeMap;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cairn::sink::jetstream::{JetStream, JetStreamConfig};
use cairn::sink::postgres::{PipelineTable, Postgres, PostgresConfig};
use cairn::sink::subject::{decode, encode};
use cairn::sink::{Batch, Destination, SinkEvent, SinkResult, SinkThread, Verdict};
use proptest::prelude::*;

use crate::support::nats::{Nats, block_on};

/// A runtime that outlives the calls of one test: a client's connection task runs on it.
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}
use crate::support::pg::TestDb;
use crate::support::{Proxy, init_log};

/// A result as the engine renders it (`pipeline/engine.rs`): sorted keys, the same fields.
pub fn result(
    seq: u64,
    pipeline: &str,
    key: &str,
    window: Option<u64>,
    generation: u32,
    version: u64,
) -> SinkResult {
    let id = match window {
        Some(w) => format!("{pipeline}/{key}/{w}/{version}"),
        None => format!("{pipeline}/{key}/{version}"),
    };
    let mut body = serde_json::json!({
        "count": version, "generation": generation, "id": id, "key": key,
        "pipeline": pipeline, "value": version as f64 * 1.5, "version": version,
    });
    if let Some(w) = window {
        body["window_start"] = w.into();
        body["window_end"] = (w + 60_000).into();
    }
    SinkResult {
        seq,
        id,
        pipeline: pipeline.into(),
        key: key.into(),
        window_start: window,
        generation,
        version,
        topic: format!("{pipeline}/{key}"),
        payload: body.to_string().into_bytes(),
    }
}

fn pg_config(url: String) -> PostgresConfig {
    PostgresConfig {
        name: "warehouse".into(),
        url,
        password_file: None,
        tls: None,
        source: "box-17".into(),
        table_prefix: "cairn_".into(),
    }
}

fn tables() -> Vec<PipelineTable> {
    vec![
        PipelineTable {
            pipeline: "balances".into(),
            windowed: false,
            changelog: false,
        },
        PipelineTable {
            pipeline: "per_minute".into(),
            windowed: true,
            changelog: false,
        },
        PipelineTable {
            pipeline: "ledger".into(),
            windowed: false,
            changelog: true,
        },
    ]
}

/// The outbox's side of a sink thread: what is not settled yet, sent again until it is.
pub struct Driver {
    pub thread: SinkThread,
    pub events: mpsc::Receiver<SinkEvent>,
    pub seen: Arc<Mutex<Vec<SinkEvent>>>,
}

impl Driver {
    pub fn start<D: Destination + Send + 'static>(dest: D) -> Driver {
        let (tx, events) = mpsc::channel();
        let tx = Mutex::new(tx);
        let seen = Arc::new(Mutex::new(Vec::new()));
        let seen2 = seen.clone();
        let notify: cairn::sink::Notify = Arc::new(move |ev: SinkEvent| {
            seen2.lock().unwrap().push(ev.clone());
            let _ = tx.lock().unwrap().send(ev);
        });
        Driver {
            thread: SinkThread::spawn("test", dest, notify).expect("spawn sink thread"),
            events,
            seen,
        }
    }

    /// Deliver `results` (in order, `batch` at a time) until every one has a final verdict;
    /// `between` runs after each answer with how many results have a final verdict (to kill
    /// something mid-stream). Returns the verdicts.
    pub fn deliver_all(
        &self,
        results: &[SinkResult],
        batch: usize,
        timeout: Duration,
        mut between: impl FnMut(usize),
    ) -> BTreeMap<u64, Verdict> {
        let deadline = Instant::now() + timeout;
        let mut done: BTreeMap<u64, Verdict> = BTreeMap::new();
        loop {
            let todo: Vec<SinkResult> = results
                .iter()
                .filter(|r| !done.contains_key(&r.seq))
                .take(batch)
                .cloned()
                .collect();
            if todo.is_empty() {
                return done;
            }
            assert!(
                Instant::now() < deadline,
                "{} results still unsettled; events: {:?}",
                results.len() - done.len(),
                self.seen.lock().unwrap()
            );
            let position = todo.last().map_or(0, |r| r.seq + 1);
            let mut b = Batch {
                position,
                results: todo,
            };
            while let Err(back) = self.thread.try_deliver(b) {
                b = back;
                std::thread::sleep(Duration::from_millis(5));
            }
            // Wait for this batch's answer.
            loop {
                match self.events.recv_timeout(Duration::from_secs(60)) {
                    Ok(SinkEvent::Answered { verdicts }) => {
                        let mut retry = false;
                        for (seq, v) in verdicts {
                            if v == Verdict::Retry {
                                retry = true;
                            } else {
                                done.insert(seq, v);
                            }
                        }
                        between(done.len());
                        if retry {
                            std::thread::sleep(Duration::from_millis(50));
                        }
                        break;
                    }
                    Ok(_) => {}
                    Err(_) => panic!("no answer in 60 s: {:?}", self.seen.lock().unwrap()),
                }
            }
        }
    }

    /// Wait for an event that `pred` holds for.
    pub fn wait_for(&self, timeout: Duration, pred: impl Fn(&SinkEvent) -> bool) -> SinkEvent {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(ev) = self.seen.lock().unwrap().iter().find(|e| pred(e)) {
                return ev.clone();
            }
            assert!(
                Instant::now() < deadline,
                "no such event in {timeout:?}: {:?}",
                self.seen.lock().unwrap()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// The fold of upsert results: the highest (generation, version) per (key, window).
fn upsert_fold(results: &[SinkResult]) -> BTreeMap<(String, Option<u64>), (u32, u64)> {
    let mut m = BTreeMap::new();
    for r in results {
        let e = m
            .entry((r.key.clone(), r.window_start))
            .or_insert((r.generation, r.version));
        *e = (*e).max((r.generation, r.version));
    }
    m
}

fn rows(db: &TestDb, table: &str) -> BTreeMap<(String, Option<u64>), (u32, u64)> {
    let windowed = table.contains("per_minute");
    let w = if windowed { "window_start" } else { "NULL" };
    db.query(&format!(
        "SELECT key, {w}, generation, version FROM {table} ORDER BY 1, 2"
    ))
    .lines()
    .filter(|l| !l.is_empty())
    .map(|l| {
        let f: Vec<&str> = l.split('|').collect();
        (
            (f[0].to_string(), f[1].parse().ok()),
            (f[2].parse().unwrap(), f[3].parse().unwrap()),
        )
    })
    .collect()
}

#[test]
fn postgres_a_resent_batch_changes_nothing_and_an_older_version_never_overwrites_a_newer() {
    init_log();
    let rt = runtime();
    let db = TestDb::create("pg_resend");
    let mut pg = Postgres::new(pg_config(db.url()), &tables()).unwrap();
    let detail = rt.block_on(pg.connect()).expect("connect");
    assert!(detail.contains("cairn_balances"), "{detail}");
    let batch: Vec<SinkResult> = (1..=3)
        .map(|v| result(v, "balances", "acc-1", None, 1, v))
        .chain([
            result(4, "per_minute", "acc-1", Some(0), 1, 1),
            result(5, "per_minute", "acc-1", Some(60_000), 1, 1),
            result(6, "per_minute", "acc-1", Some(0), 1, 2),
        ])
        .collect();
    let v = rt.block_on(pg.deliver(&batch, 7)).unwrap();
    assert!(v.iter().all(|v| *v == Verdict::Settled), "{v:?}");
    let before = db.query("SELECT key, version, id, payload::text FROM cairn_balances");
    // Re-sent whole, then an old version alone: nothing changes.
    rt.block_on(pg.deliver(&batch, 7)).unwrap();
    rt.block_on(pg.deliver(&[result(2, "balances", "acc-1", None, 1, 2)], 7))
        .unwrap();
    assert_eq!(
        db.query("SELECT key, version, id, payload::text FROM cairn_balances"),
        before
    );
    assert_eq!(rows(&db, "cairn_balances"), upsert_fold(&batch[..3]));
    assert_eq!(rows(&db, "cairn_per_minute"), upsert_fold(&batch[3..]));
    // The payload is the MQTT result's JSON.
    let payload = db.query("SELECT payload::text FROM cairn_balances");
    let stored: serde_json::Value = serde_json::from_str(&payload).unwrap();
    let sent: serde_json::Value = serde_json::from_slice(&batch[2].payload).unwrap();
    assert_eq!(stored, sent);
    // A new generation wins over a higher version of an older one.
    rt.block_on(pg.deliver(&[result(8, "balances", "acc-1", None, 2, 1)], 9))
        .unwrap();
    rt.block_on(pg.deliver(&[result(3, "balances", "acc-1", None, 1, 3)], 9))
        .unwrap();
    assert_eq!(
        db.query("SELECT generation, version FROM cairn_balances"),
        "2|1"
    );
    assert_eq!(
        db.query("SELECT source FROM cairn_balances"),
        "box-17",
        "the source is written into every row"
    );
}

#[test]
fn postgres_changelog_rows_are_inserted_once_per_id_and_the_position_commits_with_them() {
    init_log();
    let rt = runtime();
    let db = TestDb::create("pg_changelog");
    let mut pg = Postgres::new(pg_config(db.url()), &tables()).unwrap();
    rt.block_on(pg.connect()).expect("connect");
    assert_eq!(pg.position(), None);
    let batch: Vec<SinkResult> = (0..5)
        .map(|v| result(v, "ledger", "acc-1", None, 1, v + 1))
        .collect();
    rt.block_on(pg.deliver(&batch, 5)).unwrap();
    rt.block_on(pg.deliver(&batch[2..], 5)).unwrap();
    assert_eq!(
        db.query("SELECT count(*), count(DISTINCT id) FROM cairn_ledger"),
        "5|5"
    );
    assert_eq!(
        db.query("SELECT source, sink, position FROM cairn_progress"),
        "box-17|warehouse|5"
    );
    // A second connect reads the position back.
    let mut again = Postgres::new(pg_config(db.url()), &tables()).unwrap();
    rt.block_on(again.connect()).expect("connect");
    assert_eq!(again.position(), Some(5));
}

#[test]
fn postgres_an_existing_table_that_does_not_fit_is_refused_naming_what_is_wrong() {
    init_log();
    let rt = runtime();
    let db = TestDb::create("pg_mismatch");
    db.query(
        "CREATE TABLE cairn_balances (source text, key integer, generation bigint, \
         version bigint, id text, payload jsonb)",
    );
    let mut pg = Postgres::new(pg_config(db.url()), &tables()).unwrap();
    let err = rt
        .block_on(pg.connect())
        .expect_err("a table that does not fit");
    let text = err.to_string();
    assert!(
        matches!(err, cairn::sink::SinkError::Refused(_)),
        "refused, not down: {err:?}"
    );
    assert!(
        text.contains("cairn_balances: column `key` is integer, not text"),
        "{text}"
    );
    assert!(text.contains("no unique index on (key, source)"), "{text}");
    // A changelog table where an upsert one should be: the unique index gives it away.
    let db2 = TestDb::create("pg_mismatch2");
    db2.query(
        "CREATE TABLE cairn_balances (source text NOT NULL, key text NOT NULL, \
         generation bigint NOT NULL, version bigint NOT NULL, id text NOT NULL, \
         payload jsonb NOT NULL, PRIMARY KEY (source, id))",
    );
    let mut pg = Postgres::new(pg_config(db2.url()), &tables()).unwrap();
    let text = rt.block_on(pg.connect()).unwrap_err().to_string();
    assert!(text.contains("no unique index on (key, source)"), "{text}");
    // The tables Cairn made itself fit on the next start.
    let db3 = TestDb::create("pg_fits");
    for _ in 0..2 {
        let mut pg = Postgres::new(pg_config(db3.url()), &tables()).unwrap();
        rt.block_on(pg.connect()).expect("fits");
    }
}

#[test]
fn postgres_a_value_the_database_cannot_hold_is_a_dead_letter_and_the_rest_of_the_batch_commits() {
    init_log();
    let rt = runtime();
    let db = TestDb::create("pg_dead");
    let mut pg = Postgres::new(pg_config(db.url()), &tables()).unwrap();
    rt.block_on(pg.connect()).expect("connect");
    let mut nul = result(2, "ledger", "acc-2", None, 1, 1);
    nul.payload = br#"{"id":"ledger/acc-2/1","key":"acc-2","note":"a\u0000b","pipeline":"ledger","version":1}"#.to_vec();
    let huge = result(3, "balances", "acc-3", None, 1, u64::MAX);
    let batch = vec![
        result(1, "ledger", "acc-1", None, 1, 1),
        nul,
        huge,
        result(4, "balances", "acc-4", None, 1, 1),
    ];
    let v = rt.block_on(pg.deliver(&batch, 5)).unwrap();
    assert_eq!(v[0], Verdict::Settled);
    assert!(
        matches!(
            &v[1],
            Verdict::DeadLetter {
                reason: "postgres_rejected",
                ..
            }
        ),
        "{:?}",
        v[1]
    );
    assert!(
        matches!(
            &v[2],
            Verdict::DeadLetter {
                reason: "postgres_out_of_range",
                ..
            }
        ),
        "{:?}",
        v[2]
    );
    assert_eq!(v[3], Verdict::Settled);
    assert_eq!(db.query("SELECT key FROM cairn_ledger"), "acc-1");
    assert_eq!(db.query("SELECT key FROM cairn_balances"), "acc-4");
    assert_eq!(db.query("SELECT position FROM cairn_progress"), "5");
}

/// A reader polling the table all along: per key, (generation, version) never goes back.
struct Reader {
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<(usize, Vec<String>)>>,
}

impl Reader {
    fn start(db: &TestDb, table: &str) -> Reader {
        let name = db.name.clone();
        let table = table.to_string();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stop2 = stop.clone();
        let thread = std::thread::spawn(move || {
            let db = TestDb { name };
            let mut last: BTreeMap<String, (u64, u64)> = BTreeMap::new();
            let mut polls = 0;
            let mut back = Vec::new();
            while !stop2.load(std::sync::atomic::Ordering::SeqCst) {
                if let Ok(text) = db.try_query(&format!(
                    "SELECT source || '/' || key, generation, version FROM {table}"
                )) {
                    polls += 1;
                    for l in text.lines().filter(|l| !l.is_empty()) {
                        let f: Vec<&str> = l.split('|').collect();
                        let gv = (f[1].parse().unwrap(), f[2].parse().unwrap());
                        if let Some(prev) = last.insert(f[0].to_string(), gv)
                            && prev > gv
                        {
                            back.push(format!("{}: {prev:?} -> {gv:?}", f[0]));
                        }
                    }
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            // Not the owner: the test drops the database.
            std::mem::forget(db);
            (polls, back)
        });
        Reader {
            stop,
            thread: Some(thread),
        }
    }

    fn finish(mut self) -> (usize, Vec<String>) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        self.thread.take().unwrap().join().unwrap()
    }
}

#[test]
fn postgres_a_database_outage_holds_the_results_and_the_table_ends_as_the_fold() {
    init_log();
    let db = TestDb::create("pg_outage");
    let proxy = Proxy::start(crate::support::pg::PG_PORT);
    let pg = Postgres::new(pg_config(db.url_via(proxy.port())), &tables()).unwrap();
    let driver = Driver::start(pg);
    driver.wait_for(Duration::from_secs(20), |e| {
        matches!(e, SinkEvent::Up { .. })
    });
    // Versions 1..=400 over 20 keys, each key's versions in order, with re-sends of older
    // versions mixed in (what a restart's replay sends).
    let mut results = Vec::new();
    let mut seq = 0;
    for v in 1..=20u64 {
        for k in 0..20 {
            results.push(result(seq, "balances", &format!("k{k}"), None, 1, v));
            seq += 1;
            if v > 3 && k % 7 == 0 {
                results.push(result(seq, "balances", &format!("k{k}"), None, 1, v - 3));
                seq += 1;
            }
        }
    }
    let reader = Reader::start(&db, "cairn_balances");
    // Outages by how far the run has got: a restart as the sink sees it (its connections
    // terminated), then the database unreachable for 2 s (connections cut, new ones refused).
    let mut phase = 0;
    let mut paused_at = Instant::now();
    let mut settled = 0usize;
    let verdicts = driver.deliver_all(&results, 25, Duration::from_secs(120), |done| {
        settled = done;
        if phase == 0 && settled >= 100 {
            assert!(db.terminate_backends() >= 1, "no backend to terminate");
            phase = 1;
        } else if phase == 1 && settled >= 250 {
            proxy.pause(true);
            proxy.cut();
            paused_at = Instant::now();
            phase = 2;
        } else if phase == 2 && paused_at.elapsed() > Duration::from_secs(2) {
            proxy.pause(false);
            phase = 3;
        }
    });
    assert_eq!(phase, 3, "the run ended before every outage was made");
    let (polls, back) = reader.finish();
    assert!(
        verdicts.values().all(|v| *v == Verdict::Settled),
        "{verdicts:?}"
    );
    assert_eq!(rows(&db, "cairn_balances"), upsert_fold(&results));
    assert!(back.is_empty(), "a version went back: {back:?}");
    assert!(polls > 10, "the reader polled only {polls} times");
    let seen = driver.seen.lock().unwrap().clone();
    let downs = seen
        .iter()
        .filter(|e| matches!(e, SinkEvent::Down { .. }))
        .count();
    let ups = seen
        .iter()
        .filter(|e| matches!(e, SinkEvent::Up { .. }))
        .count();
    assert!(downs >= 2 && ups >= 3, "downs {downs}, ups {ups}: {seen:?}");
    assert_eq!(
        db.query("SELECT position FROM cairn_progress"),
        seq.to_string()
    );
}

fn js_config(urls: Vec<String>, stream: &str) -> JetStreamConfig {
    JetStreamConfig {
        name: "stream".into(),
        servers: urls,
        stream: stream.into(),
        subject_prefix: "site.box-17".into(),
        source: "box-17".into(),
        ..Default::default()
    }
}

fn one_per_id(msgs: &[(String, String, Vec<u8>)]) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for (_, id, _) in msgs {
        *m.entry(id.clone()).or_insert(0) += 1;
    }
    m
}

#[test]
fn jetstream_a_resent_result_is_stored_once_and_its_duplicate_ack_settles_it() {
    init_log();
    let rt = runtime();
    let nats = Nats::single();
    nats.create_stream("RESULTS", &["site.>"], 1, Duration::from_secs(120));
    let mut js = JetStream::new(js_config(nats.urls(), "RESULTS")).unwrap();
    let detail = rt.block_on(js.connect()).expect("connect");
    assert!(detail.contains("duplicate window 2m"), "{detail}");
    let mut batch: Vec<SinkResult> = (0..10)
        .map(|v| result(v, "balances", "acc 1.x", None, 1, v + 1))
        .collect();
    batch[3].topic = "odd/*/>/%//end".into();
    let v = rt.block_on(js.deliver(&batch, 10)).unwrap();
    assert!(v.iter().all(|v| *v == Verdict::Settled), "{v:?}");
    let v = rt.block_on(js.deliver(&batch, 10)).unwrap();
    assert!(
        v.iter().all(|v| *v == Verdict::Settled),
        "a duplicate ack settles: {v:?}"
    );
    let msgs = nats.messages("RESULTS");
    assert_eq!(msgs.len(), 10, "{msgs:?}");
    for ((subject, id, data), r) in msgs.iter().zip(&batch) {
        assert_eq!(id, &format!("box-17/{}", r.id));
        assert_eq!(data, &r.payload);
        let tokens = subject.strip_prefix("site.box-17.").unwrap();
        assert_eq!(decode(tokens).as_deref(), Some(r.topic.as_str()));
    }
    assert_eq!(msgs[0].0, "site.box-17.balances.acc%201%2Ex");
    assert_eq!(msgs[3].0, "site.box-17.odd.%2A.%3E.%25.%.end");
}

#[test]
fn jetstream_a_missing_stream_or_one_that_does_not_cover_the_subjects_is_refused() {
    init_log();
    let rt = runtime();
    let nats = Nats::single();
    let mut js = JetStream::new(js_config(nats.urls(), "NOPE")).unwrap();
    let err = rt.block_on(js.connect()).unwrap_err();
    assert!(
        matches!(&err, cairn::sink::SinkError::Refused(t) if t.contains("does not exist")),
        "{err:?}"
    );
    nats.create_stream(
        "OTHER",
        &["elsewhere.>", "site.box-17.*"],
        1,
        Duration::from_secs(60),
    );
    let mut js = JetStream::new(js_config(nats.urls(), "OTHER")).unwrap();
    let err = rt.block_on(js.connect()).unwrap_err();
    assert!(
        matches!(&err, cairn::sink::SinkError::Refused(t) if t.contains("none covering `site.box-17.>`")),
        "{err:?}"
    );
}

#[test]
fn jetstream_a_subject_over_the_limit_and_a_message_over_the_stream_maximum_are_dead_letters() {
    init_log();
    let rt = runtime();
    let nats = Nats::single();
    let urls = nats.urls();
    block_on(async {
        let c = async_nats::connect(urls.clone()).await.unwrap();
        let js = async_nats::jetstream::new(c);
        js.create_stream(async_nats::jetstream::stream::Config {
            name: "SMALL".into(),
            subjects: vec!["site.>".into()],
            max_message_size: 600,
            ..Default::default()
        })
        .await
        .unwrap();
    });
    let mut js = JetStream::new(js_config(nats.urls(), "SMALL")).unwrap();
    rt.block_on(js.connect()).expect("connect");
    let mut long = result(1, "balances", "k", None, 1, 1);
    long.topic = "t/".repeat(2000);
    let mut big = result(2, "balances", "k", None, 1, 2);
    big.payload = format!("{{\"pad\":\"{}\"}}", "x".repeat(700)).into_bytes();
    let ok = result(3, "balances", "k", None, 1, 3);
    let v = rt.block_on(js.deliver(&[long, big, ok], 4)).unwrap();
    assert!(
        matches!(
            &v[0],
            Verdict::DeadLetter {
                reason: "jetstream_subject_too_long",
                ..
            }
        ),
        "{v:?}"
    );
    assert!(
        matches!(
            &v[1],
            Verdict::DeadLetter {
                reason: "jetstream_too_large",
                ..
            }
        ),
        "{v:?}"
    );
    assert_eq!(v[2], Verdict::Settled);
    assert_eq!(nats.messages("SMALL").len(), 1);
}

#[test]
fn jetstream_reports_the_duplicate_window_and_warns_when_an_outage_outlasts_it() {
    init_log();
    let mut nats = Nats::single();
    nats.create_stream("RESULTS", &["site.>"], 1, Duration::from_secs(1));
    let driver = Driver::start(JetStream::new(js_config(nats.urls(), "RESULTS")).unwrap());
    let up = driver.wait_for(Duration::from_secs(20), |e| {
        matches!(e, SinkEvent::Up { .. })
    });
    assert!(
        matches!(&up, SinkEvent::Up { detail, duplicate_window: Some(w) }
            if detail.contains("duplicate window 1s") && *w == Duration::from_secs(1)),
        "{up:?}"
    );
    let first: Vec<SinkResult> = (0..5)
        .map(|v| result(v, "balances", "k", None, 1, v + 1))
        .collect();
    driver.deliver_all(&first, 5, Duration::from_secs(30), |_| {});
    nats.nodes[0].kill();
    let later: Vec<SinkResult> = (5..10)
        .map(|v| result(v, "balances", "k", None, 1, v + 1))
        .collect();
    let mut restarted = false;
    let verdicts = driver.deliver_all(&later, 5, Duration::from_secs(60), |_| {
        if !restarted
            && driver
                .seen
                .lock()
                .unwrap()
                .iter()
                .any(|e| matches!(e, SinkEvent::Warning { .. }))
        {
            restarted = true;
            nats.nodes[0].start();
        }
    });
    assert!(verdicts.values().all(|v| *v == Verdict::Settled));
    let warning = driver.wait_for(Duration::from_secs(1), |e| {
        matches!(e, SinkEvent::Warning { .. })
    });
    assert!(
        matches!(&warning, SinkEvent::Warning { name: "jetstream_outage_outlasted_duplicate_window", message } if message.contains("duplicate window of 1s")),
        "{warning:?}"
    );
    let msgs = nats.messages("RESULTS");
    assert_eq!(msgs.len(), 10, "{:?}", one_per_id(&msgs));
}

#[test]
fn jetstream_a_node_of_an_r3_cluster_killed_mid_stream_leaves_one_message_per_id() {
    init_log();
    let mut nats = Nats::cluster();
    nats.create_stream("RESULTS", &["site.>"], 3, Duration::from_secs(120));
    // The stream's leader is killed: the stream elects another from the two replicas left,
    // and acks pending at the kill time out (those results are sent again).
    let leader = nats.stream_leader("RESULTS");
    let driver = Driver::start(JetStream::new(js_config(nats.urls(), "RESULTS")).unwrap());
    driver.wait_for(Duration::from_secs(30), |e| {
        matches!(e, SinkEvent::Up { .. })
    });
    let results: Vec<SinkResult> = (0..2000)
        .map(|i| result(i, "balances", &format!("k{}", i % 50), None, 1, i / 50 + 1))
        .collect();
    let verdicts = driver.deliver_all(&results, 50, Duration::from_secs(180), |n| {
        if n >= 700 && nats.nodes[leader].is_running() {
            nats.nodes[leader].kill();
        }
    });
    assert!(
        !nats.nodes[leader].is_running(),
        "the leader was killed mid-stream"
    );
    assert!(verdicts.values().all(|v| *v == Verdict::Settled));
    let msgs = nats.messages("RESULTS");
    let counts = one_per_id(&msgs);
    assert_eq!(counts.len(), results.len(), "every ID is there");
    let twice: Vec<_> = counts.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "stored more than once: {twice:?}");
    for r in &results {
        assert!(
            counts.contains_key(&format!("box-17/{}", r.id)),
            "{} missing",
            r.id
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    /// One-to-one: every topic reads back from its subject, and every token is a valid NATS
    /// token (not empty, no `.`, `*`, `>` or white space).
    #[test]
    fn subject_escaping_is_one_to_one_and_yields_valid_tokens(
        topic in "([a-c./*> %\t\u{7f}é]{0,4}/?){0,5}"
    ) {
        let enc = encode(&topic);
        prop_assert_eq!(decode(&enc), Some(topic.clone()));
        for token in enc.split('.') {
            prop_assert!(!token.is_empty());
            prop_assert!(!token.contains(['*', '>']) && !token.contains(char::is_whitespace));
            prop_assert!(!token.chars().any(|c| c.is_control()));
        }
    }

    #[test]
    fn two_topics_never_share_a_subject(a in "[a./%* ]{0,6}(/[a./%* ]{0,3}){0,2}", b in "[a./%* ]{0,6}(/[a./%* ]{0,3}){0,2}") {
        prop_assert_eq!(a == b, encode(&a) == encode(&b));
    }
}
