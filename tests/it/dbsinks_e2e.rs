//! The agent into PostgreSQL and JetStream (issue 30), end to end: inputs on a private
//! mosquitto, the `cairn` process killed (SIGKILL) again and again while it writes, and the
//! destination checked against the oracle (the fold of the inputs): the table holds each
//! key's sum and count and nothing else, a reader polling it all along never sees a version
//! go back, and the stream holds one message per result ID.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::support::agent::{AgentConfig, CairnProcess};
use crate::support::nats::Nats;
use crate::support::pg::TestDb;
use crate::support::{Broker, publish_all, wait_until};

/// `balances`: the sum per key, upsert (one row per key); `moves`: every event, changelog
/// (one row per result ID). Both go to the local broker and to `sink`.
fn pipelines(sink: &str) -> String {
    format!(
        r#"
[[pipeline]]
name = "balances"
topics = ["pay/#"]
event_id = "/id"
key = "/acc"
value = "/amt"
aggregate = "sum"
output_topic = "balances/{{key}}"
sinks = ["local", "{sink}"]

[[pipeline]]
name = "moves"
topics = ["pay/#"]
event_id = "/id"
key = "/acc"
aggregate = "count"
emit = "changelog"
output_topic = "moves/{{key}}"
sinks = ["local", "{sink}"]
"#
    )
}

fn pg_sink(url: &str, source: &str) -> String {
    format!(
        "[[sink]]\nname = \"warehouse\"\nkind = \"postgres\"\nurl = \"{url}\"\n\
         source = \"{source}\"\ntable_prefix = \"cairn_\"\n"
    )
}

fn js_sink(servers: &[String], source: &str) -> String {
    let list: Vec<String> = servers.iter().map(|s| format!("\"{s}\"")).collect();
    format!(
        "[[sink]]\nname = \"stream\"\nkind = \"jetstream\"\nservers = [{}]\n\
         stream = \"RESULTS\"\nsubject_prefix = \"site.{source}\"\nsource = \"{source}\"\n",
        list.join(", ")
    )
}

/// Event `i` of a box: account `acc-(i % keys)`, amount `i % 7 + 1`.
fn event(i: usize, keys: usize) -> (String, Vec<u8>, bool) {
    let acc = format!("acc-{}", i % keys);
    (
        format!("pay/{acc}"),
        format!(r#"{{"id":"e{i}","acc":"{acc}","amt":{}}}"#, i % 7 + 1).into_bytes(),
        false,
    )
}

/// The oracle: per account, (sum, count) of the first `n` events.
fn fold(n: usize, keys: usize) -> BTreeMap<String, (f64, u64)> {
    let mut m = BTreeMap::new();
    for i in 0..n {
        let e = m.entry(format!("acc-{}", i % keys)).or_insert((0.0, 0));
        e.0 += (i % 7 + 1) as f64;
        e.1 += 1;
    }
    m
}

/// What the `balances` table holds for `source`: per key, (value, count) of its payload.
fn balances(db: &TestDb, source: &str) -> BTreeMap<String, (f64, u64)> {
    db.try_query(&format!(
        "SELECT key, payload->>'value', payload->>'count' FROM cairn_balances \
         WHERE source = '{source}'"
    ))
    .unwrap_or_default()
    .lines()
    .filter(|l| !l.is_empty())
    .map(|l| {
        let f: Vec<&str> = l.split('|').collect();
        (
            f[0].to_string(),
            (f[1].parse().unwrap(), f[2].parse().unwrap()),
        )
    })
    .collect()
}

/// Per key, the number of `moves` rows of `source` and their highest version.
fn moves(db: &TestDb, source: &str) -> BTreeMap<String, (u64, u64)> {
    db.try_query(&format!(
        "SELECT key, count(*), max(version) FROM cairn_moves WHERE source = '{source}' \
         GROUP BY key"
    ))
    .unwrap_or_default()
    .lines()
    .filter(|l| !l.is_empty())
    .map(|l| {
        let f: Vec<&str> = l.split('|').collect();
        (
            f[0].to_string(),
            (f[1].parse().unwrap(), f[2].parse().unwrap()),
        )
    })
    .collect()
}

/// A reader polling the `balances` table: per (source, key), (generation, version) never
/// goes back.
struct Reader {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<(usize, Vec<String>)>>,
}

impl Reader {
    fn start(db: &TestDb) -> Reader {
        use std::sync::atomic::Ordering;
        let name = db.name.clone();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stop2 = stop.clone();
        let thread = std::thread::spawn(move || {
            let db = TestDb { name };
            let mut last: BTreeMap<String, (u64, u64)> = BTreeMap::new();
            let (mut polls, mut back) = (0, Vec::new());
            while !stop2.load(Ordering::SeqCst) {
                if let Ok(text) = db.try_query(
                    "SELECT source || '/' || key, generation, version FROM cairn_balances",
                ) {
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
                std::thread::sleep(Duration::from_millis(20));
            }
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

/// Publish `total` events in `rounds` parts; after each part but the last, SIGKILL the
/// agent a moment later (while it writes) and start it again.
fn run_with_kills(
    agent: &mut CairnProcess,
    broker: &Broker,
    total: usize,
    keys: usize,
    rounds: usize,
) {
    let per = total / rounds;
    for r in 0..rounds {
        let end = if r + 1 == rounds {
            total
        } else {
            (r + 1) * per
        };
        let events: Vec<_> = (r * per..end).map(|i| event(i, keys)).collect();
        publish_all(broker.port(), &events);
        if r + 1 < rounds {
            // Mid-flush: results of this part are still being written.
            std::thread::sleep(Duration::from_millis(150 + 70 * r as u64));
            agent.kill();
            agent.start_connected();
        }
    }
}

#[test]
fn agent_to_postgres_the_table_is_the_oracles_fold_across_kills_mid_flush() {
    let broker = Broker::start();
    let db = TestDb::create("e2e_pg");
    let (total, keys) = (3000, 25);
    let mut cfg = AgentConfig::new(broker.port(), &pipelines("warehouse"));
    cfg.extra = pg_sink(&db.url(), "box-1");
    let mut agent = CairnProcess::new(&cfg);
    agent.set_log_filter(Some("info"));
    agent.start_connected();
    agent.wait_for_stderr("sink `warehouse`: tables", Duration::from_secs(20));
    let reader = Reader::start(&db);
    run_with_kills(&mut agent, &broker, total, keys, 6);
    let want = fold(total, keys);
    let settled = wait_until(Duration::from_secs(90), || balances(&db, "box-1") == want);
    let (polls, back) = reader.finish();
    assert!(
        settled,
        "the table is not the fold:\n got {:?}\nwant {want:?}\n{}",
        balances(&db, "box-1"),
        agent.stderr_tail(40)
    );
    assert!(back.is_empty(), "a version went back: {back:?}");
    assert!(polls > 20, "the reader polled only {polls} times");
    // Changelog: one row per event, each key's versions 1..=count.
    let want_moves: BTreeMap<String, (u64, u64)> = want
        .iter()
        .map(|(k, (_, c))| (k.clone(), (*c, *c)))
        .collect();
    assert!(
        wait_until(Duration::from_secs(30), || moves(&db, "box-1")
            == want_moves),
        "moves: {:?}",
        moves(&db, "box-1")
    );
    // The progress row is the sink's settled position.
    let position: u64 = db
        .query("SELECT position FROM cairn_progress WHERE source = 'box-1' AND sink = 'warehouse'")
        .parse()
        .unwrap();
    assert!(position > 0);
    assert_eq!(agent.terminate().code(), Some(0));
    assert!(
        agent.inspect("dead-letters").is_empty(),
        "{:?}",
        agent.inspect("dead-letters")
    );
}

/// The IDs of the `moves` results of `total` events: `moves/acc-k/1..=count`.
fn move_ids(total: usize, keys: usize, source: &str) -> BTreeSet<String> {
    fold(total, keys)
        .iter()
        .flat_map(|(k, (_, c))| (1..=*c).map(move |v| format!("{source}/moves/{k}/{v}")))
        .collect()
}

#[test]
fn agent_to_an_r3_jetstream_stream_one_message_per_id_across_agent_kills_and_a_node_kill() {
    let broker = Broker::start();
    let mut nats = Nats::cluster();
    nats.create_stream("RESULTS", &["site.>"], 3, Duration::from_secs(120));
    let (total, keys) = (2000, 20);
    let mut cfg = AgentConfig::new(broker.port(), &pipelines("stream"));
    cfg.extra = js_sink(&nats.urls(), "box-1");
    let mut agent = CairnProcess::new(&cfg);
    agent.set_log_filter(Some("info"));
    agent.start_connected();
    agent.wait_for_stderr("duplicate window 2m", Duration::from_secs(30));
    let per = total / 4;
    for r in 0..4 {
        let events: Vec<_> = (r * per..(r + 1) * per).map(|i| event(i, keys)).collect();
        publish_all(broker.port(), &events);
        std::thread::sleep(Duration::from_millis(200));
        match r {
            1 => {
                let leader = nats.stream_leader("RESULTS");
                nats.nodes[leader].kill();
            }
            3 => {}
            _ => {
                agent.kill();
                agent.start_connected();
            }
        }
    }
    let want = move_ids(total, keys, "box-1");
    let done = wait_until(Duration::from_secs(120), || {
        let ids: BTreeSet<String> = nats
            .messages("RESULTS")
            .into_iter()
            .map(|(_, id, _)| id)
            .filter(|id| id.starts_with("box-1/moves/"))
            .collect();
        ids == want
    });
    let msgs = nats.messages("RESULTS");
    let mut count: BTreeMap<String, usize> = BTreeMap::new();
    for (_, id, _) in &msgs {
        *count.entry(id.clone()).or_default() += 1;
    }
    assert!(
        done,
        "missing: {:?}\n{}",
        want.iter()
            .filter(|i| !count.contains_key(*i))
            .take(10)
            .collect::<Vec<_>>(),
        agent.stderr_tail(40)
    );
    let twice: Vec<_> = count.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "stored more than once: {twice:?}");
    // Each `balances` message's data is its MQTT result, latest version per key the fold.
    let mut latest: BTreeMap<String, (u64, Value)> = BTreeMap::new();
    for (_, id, data) in &msgs {
        if id.starts_with("box-1/balances/") {
            let v: Value = serde_json::from_slice(data).unwrap();
            let key = v["key"].as_str().unwrap().to_string();
            let ver = v["version"].as_u64().unwrap();
            if latest.get(&key).is_none_or(|(lv, _)| *lv < ver) {
                latest.insert(key, (ver, v));
            }
        }
    }
    let want_fold = fold(total, keys);
    let got: BTreeMap<String, (f64, u64)> = latest
        .iter()
        .map(|(k, (_, v))| {
            (
                k.clone(),
                (v["value"].as_f64().unwrap(), v["count"].as_u64().unwrap()),
            )
        })
        .collect();
    assert_eq!(got, want_fold);
    assert_eq!(agent.terminate().code(), Some(0));
}

#[test]
fn a_fleet_of_three_boxes_writes_each_its_own_oracle_into_one_database_and_one_stream() {
    let db = TestDb::create("e2e_fleet");
    let nats = Nats::cluster();
    nats.create_stream("RESULTS", &["site.>"], 3, Duration::from_secs(120));
    let keys = 10;
    let totals = [600, 900, 1200];
    let mut boxes = Vec::new();
    for (b, total) in totals.iter().enumerate() {
        let source = format!("box-{}", b + 1);
        let broker = Broker::start();
        let mut cfg = AgentConfig::new(
            broker.port(),
            &pipelines("warehouse").replace(
                "sinks = [\"local\", \"warehouse\"]",
                "sinks = [\"local\", \"warehouse\", \"stream\"]",
            ),
        );
        cfg.extra = format!(
            "{}\n{}",
            pg_sink(&db.url(), &source),
            js_sink(&nats.urls(), &source)
        );
        let mut agent = CairnProcess::new(&cfg);
        agent.set_log_filter(Some("info"));
        agent.start_connected();
        boxes.push((source, broker, agent, *total));
    }
    let started = Instant::now();
    for (_, broker, agent, total) in &mut boxes {
        let (total, port) = (*total, broker.port());
        let events: Vec<_> = (0..total).map(|i| event(i, keys)).collect();
        publish_all(port, &events[..total / 2]);
        agent.kill();
        agent.start_connected();
        publish_all(port, &events[total / 2..]);
    }
    for (source, _, agent, total) in &boxes {
        let want = fold(*total, keys);
        assert!(
            wait_until(Duration::from_secs(90), || balances(&db, source) == want),
            "{source}: {:?}\n{}",
            balances(&db, source),
            agent.stderr_tail(30)
        );
        let want_moves: BTreeMap<String, (u64, u64)> = want
            .iter()
            .map(|(k, (_, c))| (k.clone(), (*c, *c)))
            .collect();
        assert!(
            wait_until(Duration::from_secs(30), || moves(&db, source) == want_moves),
            "{source} moves: {:?}",
            moves(&db, source)
        );
    }
    // The stream: every box's changelog IDs, each once.
    let want: BTreeSet<String> = boxes
        .iter()
        .flat_map(|(source, _, _, total)| move_ids(*total, keys, source))
        .collect();
    assert!(
        wait_until(Duration::from_secs(60), || {
            let ids: BTreeSet<String> = nats
                .messages("RESULTS")
                .into_iter()
                .map(|(_, id, _)| id)
                .filter(|id| id.contains("/moves/"))
                .collect();
            ids == want
        }),
        "the stream misses changelog IDs"
    );
    let msgs = nats.messages("RESULTS");
    let distinct: BTreeSet<&String> = msgs.iter().map(|(_, id, _)| id).collect();
    assert_eq!(distinct.len(), msgs.len(), "an ID stored twice");
    assert_eq!(
        db.query("SELECT count(DISTINCT source) FROM cairn_progress"),
        "3"
    );
    for (_, _, agent, _) in &mut boxes {
        assert_eq!(agent.terminate().code(), Some(0));
    }
    eprintln!("fleet run took {:?}", started.elapsed());
}

#[test]
fn a_long_database_outage_holds_the_results_in_the_outbox_and_status_says_so() {
    let broker = Broker::start();
    let db = TestDb::create("e2e_outage");
    let proxy = crate::support::Proxy::start(crate::support::pg::PG_PORT);
    let (total, keys) = (1200, 15);
    let mut cfg = AgentConfig::new(broker.port(), &pipelines("warehouse"));
    cfg.extra = pg_sink(&db.url_via(proxy.port()), "box-1");
    let mut agent = CairnProcess::new(&cfg);
    agent.set_log_filter(Some("info"));
    agent.start_connected();
    agent.wait_for_stderr("sink `warehouse`: tables", Duration::from_secs(20));
    let events: Vec<_> = (0..total).map(|i| event(i, keys)).collect();
    publish_all(broker.port(), &events[..total / 3]);
    // The database goes away: connections cut, new ones refused.
    proxy.pause(true);
    proxy.cut();
    publish_all(broker.port(), &events[total / 3..2 * total / 3]);
    let down = wait_until(Duration::from_secs(30), || {
        let (ok, out, _) = agent.command(&["status", "--json"]);
        ok.success()
            && serde_json::from_str::<Value>(&out).is_ok_and(|s| {
                s["sinks"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|k| k["name"] == "warehouse" && k["state"] == "down")
            })
    });
    assert!(
        down,
        "status never showed the sink down:\n{}",
        agent.stderr_tail(30)
    );
    // A kill during the outage: the outbox holds what the database has not settled.
    agent.kill();
    agent.start_connected();
    publish_all(broker.port(), &events[2 * total / 3..]);
    std::thread::sleep(Duration::from_secs(3));
    assert_ne!(
        balances(&db, "box-1"),
        fold(total, keys),
        "written while away?"
    );
    proxy.pause(false);
    let want = fold(total, keys);
    assert!(
        wait_until(Duration::from_secs(90), || balances(&db, "box-1") == want),
        "after the outage: {:?}\n{}",
        balances(&db, "box-1"),
        agent.stderr_tail(30)
    );
    let want_moves: BTreeMap<String, (u64, u64)> = want
        .iter()
        .map(|(k, (_, c))| (k.clone(), (*c, *c)))
        .collect();
    assert!(
        wait_until(Duration::from_secs(30), || moves(&db, "box-1")
            == want_moves),
        "moves: {:?}",
        moves(&db, "box-1")
    );
    assert_eq!(agent.terminate().code(), Some(0));
}

#[test]
fn an_outage_longer_than_the_duplicate_window_is_said_in_the_journal_and_nothing_is_lost() {
    // The outage is a proxy that cuts and refuses connections, not a killed server: a
    // single node killed loses messages it had acknowledged (JetStream acknowledges before
    // its store is flushed; measured here, the first 85 of 600), which no client can help.
    let broker = Broker::start();
    let nats = Nats::single();
    nats.create_stream("RESULTS", &["site.>"], 1, Duration::from_secs(1));
    let proxy = crate::support::Proxy::start(nats.nodes[0].port);
    let (total, keys) = (600, 10);
    let mut cfg = AgentConfig::new(broker.port(), &pipelines("stream"));
    cfg.extra = js_sink(&[format!("nats://127.0.0.1:{}", proxy.port())], "box-1");
    let mut agent = CairnProcess::new(&cfg);
    agent.set_log_filter(Some("info"));
    agent.start_connected();
    agent.wait_for_stderr("duplicate window 1s", Duration::from_secs(30));
    let events: Vec<_> = (0..total).map(|i| event(i, keys)).collect();
    publish_all(broker.port(), &events[..total / 2]);
    proxy.pause(true);
    proxy.cut();
    publish_all(broker.port(), &events[total / 2..]);
    agent.wait_for_stderr(
        "longer than its duplicate window of 1s",
        Duration::from_secs(60),
    );
    proxy.pause(false);
    let want = move_ids(total, keys, "box-1");
    let all_there = wait_until(Duration::from_secs(90), || {
        let ids: BTreeSet<String> = nats
            .messages("RESULTS")
            .into_iter()
            .map(|(_, id, _)| id)
            .filter(|id| id.starts_with("box-1/moves/"))
            .collect();
        ids == want
    });
    let msgs = nats.messages("RESULTS");
    let ids: BTreeSet<String> = msgs.iter().map(|(_, id, _)| id.clone()).collect();
    assert!(
        all_there,
        "{} messages, {} of {} changelog IDs; missing e.g. {:?}\n{}",
        msgs.len(),
        want.iter().filter(|i| ids.contains(*i)).count(),
        want.len(),
        want.iter()
            .filter(|i| !ids.contains(*i))
            .take(5)
            .collect::<Vec<_>>(),
        agent.stderr_tail(30)
    );
    assert_eq!(agent.terminate().code(), Some(0));
}
