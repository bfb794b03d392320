//! The PostgreSQL and JetStream sinks (issue 30): results per second into each, this
//! process's CPU time per result (the sink thread's client work: building statements or
//! messages, TLS-free loopback IO, answering), and the drain after an outage.
//!
//! The sinks are driven as the outbox would drive them, through [`SinkThread`]: batches of
//! `CAIRN_DBSINK_BATCH` results (default 500) in sequence order, at most two waiting, what
//! comes back `Retry` sent again. Results are upserts over 1,000 keys (the version rising by
//! one per result of a key) or changelog rows, each a ~190-byte JSON body as the engine
//! renders it.
//!
//! Runs, each on a fresh database or server:
//! - `postgres upsert`, `postgres changelog`: the shared PostgreSQL at 127.0.0.1:5432, a
//!   database made for the run and dropped after;
//! - `jetstream R1`: one `nats-server`, a file-stored stream; `jetstream R3`: a three-node
//!   cluster and a replicated stream;
//! - `drain`: a backlog of N results waiting while the destination is away (PostgreSQL:
//!   behind a proxy that refuses connections; JetStream: its server killed), then the time
//!   from its return to the last result settled.
//!
//! `cargo bench --bench dbsink`; `CAIRN_DBSINK_RESULTS` sets N (default 100,000).

#[path = "../tests/it/support/mod.rs"]
mod support;

use std::collections::VecDeque;
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use cairn::sink::jetstream::{JetStream, JetStreamConfig};
use cairn::sink::postgres::{PipelineTable, Postgres, PostgresConfig};
use cairn::sink::{Batch, Destination, SinkEvent, SinkResult, SinkThread, Verdict};
use support::Proxy;
use support::nats::Nats;
use support::pg::{PG_PORT, TestDb};

const KEYS: u64 = 1_000;

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// This process's CPU time (user + system).
fn cpu() -> Duration {
    // SAFETY: getrusage writes the struct it is given and nothing else.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(u.ru_utime) + tv(u.ru_stime)
}

fn results(n: usize, pipeline: &str) -> Vec<SinkResult> {
    (0..n as u64)
        .map(|seq| {
            let key = format!("device-{:04}", seq % KEYS);
            let version = seq / KEYS + 1;
            let id = format!("{pipeline}/{key}/{version}");
            let body = serde_json::json!({
                "count": version, "generation": 1, "id": id, "key": key,
                "pipeline": pipeline, "value": seq as f64 * 0.25, "version": version,
            });
            SinkResult {
                seq,
                id,
                pipeline: pipeline.into(),
                key: key.clone(),
                window_start: None,
                generation: 1,
                version,
                topic: format!("{pipeline}/{key}"),
                payload: body.to_string().into_bytes(),
            }
        })
        .collect()
}

struct Run {
    thread: SinkThread,
    events: mpsc::Receiver<SinkEvent>,
}

impl Run {
    fn start<D: Destination + Send + 'static>(dest: D) -> Run {
        let (tx, events) = mpsc::channel();
        let tx = std::sync::Mutex::new(tx);
        let notify: cairn::sink::Notify = Arc::new(move |ev| {
            let _ = tx.lock().unwrap().send(ev);
        });
        Run {
            thread: SinkThread::spawn("bench", dest, notify).expect("sink thread"),
            events,
        }
    }

    fn wait_up(&self) {
        loop {
            match self.events.recv_timeout(Duration::from_secs(60)) {
                Ok(SinkEvent::Up { .. }) => return,
                Ok(_) => {}
                Err(_) => panic!("the sink did not come up in 60 s"),
            }
        }
    }

    /// Deliver everything; returns when the last result is settled. `Up` events seen on the
    /// way are counted into `ups`.
    fn deliver(&self, all: &[SinkResult], batch: usize, ups: &mut usize) {
        let mut todo: VecDeque<SinkResult> = all.iter().cloned().collect();
        let mut outstanding = 0usize;
        let mut settled = 0usize;
        while settled < all.len() {
            while outstanding < 2 && !todo.is_empty() {
                let take = batch.min(todo.len());
                let results: Vec<SinkResult> = todo.drain(..take).collect();
                let position = results.last().map_or(0, |r| r.seq + 1);
                let mut b = Batch { position, results };
                loop {
                    match self.thread.try_deliver(b) {
                        Ok(()) => break,
                        Err(back) => {
                            b = back;
                            std::thread::sleep(Duration::from_millis(1));
                        }
                    }
                }
                outstanding += 1;
            }
            match self.events.recv_timeout(Duration::from_secs(120)) {
                Ok(SinkEvent::Answered { verdicts }) => {
                    outstanding -= 1;
                    let mut again = Vec::new();
                    for (seq, v) in verdicts {
                        match v {
                            Verdict::Retry => again.push(all[seq as usize].clone()),
                            Verdict::Settled => settled += 1,
                            Verdict::DeadLetter { reason, .. } => panic!("dead letter: {reason}"),
                        }
                    }
                    if !again.is_empty() {
                        // Sent again first, in order, as the cursor would rewind.
                        for r in again.into_iter().rev() {
                            todo.push_front(r);
                        }
                        todo.make_contiguous().sort_by_key(|r| r.seq);
                        std::thread::sleep(Duration::from_millis(20));
                    }
                }
                Ok(SinkEvent::Up { .. }) => *ups += 1,
                Ok(_) => {}
                Err(_) => panic!("no answer in 120 s ({settled} of {} settled)", all.len()),
            }
        }
    }
}

fn measure<D: Destination + Send + 'static>(
    label: &str,
    dest: D,
    all: &[SinkResult],
    batch: usize,
) {
    let run = Run::start(dest);
    run.wait_up();
    let c0 = cpu();
    let t0 = Instant::now();
    run.deliver(all, batch, &mut 0);
    let secs = t0.elapsed().as_secs_f64();
    let cpu_us = (cpu() - c0).as_secs_f64() * 1e6 / all.len() as f64;
    println!(
        "{label:<22} {:>9.0} results/s  {cpu_us:>6.1} µs CPU/result  ({} results in {secs:.2} s)",
        all.len() as f64 / secs,
        all.len()
    );
}

fn pg_config(url: String) -> PostgresConfig {
    PostgresConfig {
        name: "bench".into(),
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
            pipeline: "upserts".into(),
            windowed: false,
            changelog: false,
        },
        PipelineTable {
            pipeline: "changes".into(),
            windowed: false,
            changelog: true,
        },
    ]
}

fn js_config(urls: Vec<String>) -> JetStreamConfig {
    JetStreamConfig {
        name: "bench".into(),
        servers: urls,
        stream: "RESULTS".into(),
        subject_prefix: "site.box-17".into(),
        source: "box-17".into(),
        ..Default::default()
    }
}

fn main() {
    let n = env("CAIRN_DBSINK_RESULTS", 100_000);
    let batch = env("CAIRN_DBSINK_BATCH", 500);
    println!("{n} results, batches of {batch}, at most 2 batches waiting\n");

    let db = TestDb::create("bench");
    let pg = Postgres::new(pg_config(db.url()), &tables()).unwrap();
    measure("postgres upsert", pg, &results(n, "upserts"), batch);
    let pg = Postgres::new(pg_config(db.url()), &tables()).unwrap();
    measure("postgres changelog", pg, &results(n, "changes"), batch);
    drop(db);

    let nats = Nats::single();
    nats.create_stream("RESULTS", &["site.>"], 1, Duration::from_secs(120));
    let js = JetStream::new(js_config(nats.urls())).unwrap();
    measure("jetstream R1", js, &results(n, "upserts"), batch);
    drop(nats);

    let nats = Nats::cluster();
    nats.create_stream("RESULTS", &["site.>"], 3, Duration::from_secs(120));
    let js = JetStream::new(js_config(nats.urls())).unwrap();
    measure("jetstream R3", js, &results(n, "upserts"), batch);
    drop(nats);

    println!();
    // Drain: PostgreSQL behind a proxy that refuses connections while the backlog waits.
    let db = TestDb::create("bench_drain");
    let proxy = Proxy::start(PG_PORT);
    let run = Run::start(Postgres::new(pg_config(db.url_via(proxy.port())), &tables()).unwrap());
    run.wait_up();
    proxy.pause(true);
    proxy.cut();
    let backlog = results(n, "upserts");
    std::thread::sleep(Duration::from_secs(3));
    proxy.pause(false);
    let t0 = Instant::now();
    run.deliver(&backlog, batch, &mut 0);
    println!(
        "{:<22} {n} results waiting: settled {:.2} s after the database came back ({:.0} results/s, reconnect included)",
        "drain postgres",
        t0.elapsed().as_secs_f64(),
        n as f64 / t0.elapsed().as_secs_f64()
    );
    drop(run);
    drop(db);

    // Drain: JetStream with its server killed, started again on the same store.
    let mut nats = Nats::single();
    nats.create_stream("RESULTS", &["site.>"], 1, Duration::from_secs(120));
    let run = Run::start(JetStream::new(js_config(nats.urls())).unwrap());
    run.wait_up();
    nats.nodes[0].kill();
    std::thread::sleep(Duration::from_secs(1));
    nats.nodes[0].start();
    let t0 = Instant::now();
    run.deliver(&results(n, "upserts"), batch, &mut 0);
    println!(
        "{:<22} {n} results waiting: settled {:.2} s after the server came back ({:.0} results/s, reconnect included)",
        "drain jetstream",
        t0.elapsed().as_secs_f64(),
        n as f64 / t0.elapsed().as_secs_f64()
    );
}
