//! The agent into PostgreSQL and JetStream (issue 30), end to end: inputs on a private
//! mosquitto, the `cairn` process killed (SIGKILL), or its power cut on the FUSE filesystem
//! under tests/powercut-fs, again and again while it writes, and the destination checked
//! against the oracle (the fold of the inputs): the table holds each key's sum and count and
//! nothing else, a reader polling it all along never sees a version go back nor a row the
//! oracle does not compute, and the stream holds one message per result ID, each the
//! oracle's.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::support::agent::{AgentConfig, CairnProcess};
use crate::support::nats::Nats;
use crate::support::pg::{PgConn, PrivatePg, TestDb};
use crate::support::powercut::PowerCut;
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
fn balances(db: &PgConn, source: &str) -> BTreeMap<String, (f64, u64)> {
    keyed_pairs(
        db,
        &format!(
            "SELECT key, payload->>'value', payload->>'count' FROM cairn_balances \
             WHERE source = '{source}'"
        ),
    )
}

/// Per key, the number of `moves` rows of `source` and their highest version.
fn moves(db: &PgConn, source: &str) -> BTreeMap<String, (u64, u64)> {
    keyed_pairs(
        db,
        &format!(
            "SELECT key, count(*), max(version) FROM cairn_moves WHERE source = '{source}' \
             GROUP BY key"
        ),
    )
}

/// Rows `key|a|b` of `sql` as a map (empty when the database does not answer).
fn keyed_pairs<A: std::str::FromStr, B: std::str::FromStr>(
    db: &PgConn,
    sql: &str,
) -> BTreeMap<String, (A, B)>
where
    A::Err: std::fmt::Debug,
    B::Err: std::fmt::Debug,
{
    db.try_query(sql)
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

/// The progress row of `box-1`'s sink `warehouse` (`None`: none, or no answer).
fn settled_position(db: &PgConn) -> Option<u64> {
    db.try_query(
        "SELECT position FROM cairn_progress WHERE source = 'box-1' AND sink = 'warehouse'",
    )
    .ok()
    .and_then(|p| p.parse().ok())
}

/// How many `moves` rows there are (`None`: the database did not answer).
fn moves_rows(db: &PgConn) -> Option<u64> {
    db.try_query("SELECT count(*) FROM cairn_moves")
        .ok()
        .and_then(|n| n.parse().ok())
}

/// The sum of the amounts of the first `count` events of account `acc-k`, in publish order.
fn prefix_sum(k: usize, count: u64, keys: usize) -> f64 {
    (0..count as usize)
        .map(|j| ((k + j * keys) % 7 + 1) as f64)
        .sum()
}

/// `Ok` if the result body of `id` (`pipeline/key/version`) is what the oracle computes:
/// the body names that ID, key and version; a `moves` result's count is its version; a
/// `balances` result with count `c` holds the sum of its key's first `c` events. A result
/// sent again with another payload, or computed from a lost or doubled event, fails here.
fn oracle_says(id: &str, body: &[u8], keys: usize) -> Result<(), String> {
    let bad = |what: &str| Err(format!("{id}: {what}: {}", String::from_utf8_lossy(body)));
    let Ok(v) = serde_json::from_slice::<Value>(body) else {
        return bad("not JSON");
    };
    let parts: Vec<&str> = id.split('/').collect();
    let (Some(k), Some(version), Some(count)) = (
        parts
            .get(1)
            .and_then(|k| k.strip_prefix("acc-"))
            .and_then(|k| k.parse::<usize>().ok()),
        parts.get(2).and_then(|v| v.parse::<u64>().ok()),
        v["count"].as_u64(),
    ) else {
        return bad("not pipeline/acc-N/version with a count");
    };
    if parts.len() != 3
        || v["id"] != id
        || v["key"] != parts[1]
        || v["version"].as_u64() != Some(version)
    {
        return bad("the body's id, key or version is not its ID's");
    }
    match parts[0] {
        "moves" if count != version => bad("a changelog count that is not its version"),
        "balances" if v["value"].as_f64() != Some(prefix_sum(k, count, keys)) => bad(&format!(
            "not the sum of the key's first {count} events ({})",
            prefix_sum(k, count, keys)
        )),
        "moves" | "balances" => Ok(()),
        _ => bad("an unknown pipeline"),
    }
}

/// A reader polling the `balances` table: per (source, key), (generation, version) never
/// goes back, and every row it sees is the oracle's (see [`oracle_says`]).
struct Reader {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<ReaderSaw>>,
}

#[derive(Default)]
struct ReaderSaw {
    polls: usize,
    /// Polls that got no answer (the database down).
    failed: usize,
    /// `source/key: (generation, version) -> (generation, version)`, each time one went back.
    back: Vec<String>,
    /// Rows the oracle does not compute.
    wrong: Vec<String>,
}

impl Reader {
    fn start(db: &PgConn, keys: usize) -> Reader {
        use std::sync::atomic::Ordering;
        let db = db.clone();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stop2 = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut last: BTreeMap<String, (u64, u64)> = BTreeMap::new();
            let mut saw = ReaderSaw::default();
            while !stop2.load(Ordering::SeqCst) {
                let polled = db.try_query(
                    "SELECT source || '/' || key, generation, version, id, payload::text \
                     FROM cairn_balances",
                );
                if polled.is_err() {
                    saw.failed += 1;
                }
                if let Ok(text) = polled {
                    saw.polls += 1;
                    for l in text.lines().filter(|l| !l.is_empty()) {
                        let f: Vec<&str> = l.splitn(5, '|').collect();
                        let gv = (f[1].parse().unwrap(), f[2].parse().unwrap());
                        if let Some(prev) = last.insert(f[0].to_string(), gv)
                            && prev > gv
                        {
                            saw.back.push(format!("{}: {prev:?} -> {gv:?}", f[0]));
                        }
                        if let Err(e) = oracle_says(f[3], f[4].as_bytes(), keys)
                            && saw.wrong.len() < 10
                        {
                            saw.wrong.push(e);
                        }
                    }
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            saw
        });
        Reader {
            stop,
            thread: Some(thread),
        }
    }

    fn finish(mut self) -> ReaderSaw {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        self.thread.take().unwrap().join().unwrap()
    }
}

/// What strikes the agent after each part of a run but the last, while it still takes in,
/// processes and flushes that part.
enum Fault {
    /// SIGKILL: what was written survives in the page cache, synced or not.
    Kill,
    /// A power cut on the FUSE filesystem under the agent's data dir (tests/powercut-fs):
    /// everything not fsynced is forgotten (`cut all`), or a random prefix of it is kept,
    /// with the first dropped write torn or not; then SIGKILL and thaw.
    PowerCut(PowerCut),
}

impl Fault {
    fn power_cut() -> Fault {
        Fault::PowerCut(PowerCut::mount())
    }

    /// Where the agent's data goes: on the power-cut mount for [`Fault::PowerCut`].
    fn data_dir(&self) -> Option<std::path::PathBuf> {
        match self {
            Fault::Kill => None,
            Fault::PowerCut(c) => Some(c.mount.join("data")),
        }
    }

    /// Strike in round `round`; the agent is down after it. Says what it did.
    fn strike(&self, agent: &mut CairnProcess, round: usize) -> String {
        match self {
            Fault::Kill => {
                agent.kill();
                "kill".into()
            }
            Fault::PowerCut(c) => {
                let seed = 0x5eed + round;
                // `cut random` keeps later unsynced writes of the log and drops earlier ones
                // (a page cache writes back in any order): the torn commit it leaves must
                // read as a torn tail (this test found the agent refusing to start on it).
                let mode = match round % 5 {
                    0 => "cut all".to_string(),
                    1 => format!("cut prefix {seed} tear"),
                    2 => format!("cut random {seed} tear"),
                    3 => format!("cut prefix {seed}"),
                    _ => format!("cut random {seed}"),
                };
                // Cut when the agent has written something it has not synced yet (it syncs
                // within milliseconds), so that the cut has something to forget.
                let deadline = Instant::now() + Duration::from_secs(2);
                while Instant::now() < deadline && !unsynced(&c.command("status")) {
                    std::thread::sleep(Duration::from_micros(300));
                }
                let reply = c.command(&mode);
                agent.note(&format!("power cut `{mode}`: {reply}"));
                agent.kill();
                c.command("thaw");
                format!("`{mode}`: {reply}")
            }
        }
    }
}

/// Whether a powercut-fs `status` reply (`ok files=N bytes=B held=H dirs=D ...`) counts
/// files or directories with changes not synced yet.
fn unsynced(status: &str) -> bool {
    status.split_whitespace().any(|f| {
        f.split_once('=')
            .is_some_and(|(k, v)| (k == "files" || k == "dirs") && v != "0")
    })
}

/// Work a fault interrupts, as `cairn status` says: results waiting in the outbox, plus
/// records no durable checkpoint reflects yet (their results are made again after a crash
/// and must reach the sink once). Results leave before their checkpoint and enter the
/// outbox only with it, so the outbox alone read 0 at every strike in one loaded CI run.
fn unsettled(agent: &CairnProcess) -> Option<u64> {
    let (st, out, _) = agent.command(&["status", "--json"]);
    let s: Value = serde_json::from_str(&out).ok().filter(|_| st.success())?;
    let entries = s["outbox"]["entries"].as_u64()?;
    Some(entries + s["checkpoint"]["records_unchecked"].as_u64().unwrap_or(0))
}

/// The results waiting in the outbox (not settled by every sink), as `cairn status` says.
/// The agent must serve `[metrics]`: on the power-cut mount there is no status socket (the
/// FUSE filesystem makes no socket files), and `status` asks the metrics listener instead.
fn outbox_entries(agent: &CairnProcess) -> Option<u64> {
    let (st, out, _) = agent.command(&["status", "--json"]);
    st.success()
        .then(|| serde_json::from_str::<Value>(&out).ok())
        .flatten()
        .and_then(|s| s["outbox"]["entries"].as_u64())
}

/// The state of sink `name` (`connected`, `down`, `refusing`), as `cairn status` says.
fn sink_state(agent: &CairnProcess, name: &str) -> Option<String> {
    let (st, out, _) = agent.command(&["status", "--json"]);
    let status: Value = serde_json::from_str(&out).ok().filter(|_| st.success())?;
    status["sinks"]
        .as_array()?
        .iter()
        .find(|k| k["name"] == name)
        .and_then(|k| k["state"].as_str().map(str::to_string))
}

/// Every result settled by every sink leaves the outbox.
fn assert_outbox_drains(agent: &CairnProcess) {
    assert!(
        wait_until(Duration::from_secs(20), || outbox_entries(agent) == Some(0)),
        "the outbox holds {:?} entries\n{}",
        outbox_entries(agent),
        agent.stderr_tail(20)
    );
}

/// `[metrics]` on a free loopback port, for [`outbox_entries`].
fn metrics() -> String {
    format!(
        "[metrics]\nlisten = \"127.0.0.1:{}\"\n\n",
        crate::support::free_port()
    )
}

/// Publish `total` events in `rounds` parts, each from its own thread; after each part but
/// the last, `fault` strikes a moment later (while the agent still takes in, processes and
/// flushes the part), `between(round)` runs, and the agent starts again. Returns, per
/// fault, the outbox entries at that moment (`None`: status did not answer) and what it did.
fn run_with_faults(
    agent: &mut CairnProcess,
    broker: &Broker,
    (total, keys, rounds): (usize, usize, usize),
    fault: &Fault,
    mut between: impl FnMut(usize),
) -> Vec<(Option<u64>, String)> {
    let per = total / rounds;
    let mut struck = Vec::new();
    for r in 0..rounds {
        let end = if r + 1 == rounds {
            total
        } else {
            (r + 1) * per
        };
        let events: Vec<_> = (r * per..end).map(|i| event(i, keys)).collect();
        let port = broker.port();
        let publisher = std::thread::spawn(move || publish_all(port, &events));
        if r + 1 == rounds {
            publisher.join().expect("publisher");
            break;
        }
        // Mid-flush: the agent takes in, processes and writes a part in well under 150 ms
        // here, so the faults strike early in it, at a different point each round.
        std::thread::sleep(Duration::from_millis([40, 90, 15, 130, 65][r % 5]));
        let waiting = unsettled(agent);
        let what = fault.strike(agent, r);
        publisher.join().expect("publisher");
        between(r);
        struck.push((waiting, what));
        agent.start_connected();
    }
    struck
}

/// At least one fault struck while results waited for a sink or for their checkpoint (the
/// faults hit mid-flush), and, of power cuts, at least one forgot writes that were not
/// synced (else it was a kill).
fn assert_some_struck_mid_flush(struck: &[(Option<u64>, String)]) {
    for (waiting, what) in struck {
        eprintln!("fault with {waiting:?} outbox entries and unchecked records: {what}");
    }
    assert!(
        struck.iter().any(|(w, _)| w.is_some_and(|w| w > 0)),
        "no fault struck while results waited for the sink or their checkpoint: {struck:?}"
    );
    let cuts: Vec<&String> = struck
        .iter()
        .map(|(_, what)| what)
        .filter(|w| w.contains("ok cut"))
        .collect();
    assert!(
        cuts.is_empty()
            || cuts
                .iter()
                .any(|w| !w.contains(" dropped=0 ") || !w.contains(" dirops_dropped=0 ")),
        "no power cut forgot anything: {cuts:?}"
    );
}

/// An agent with the `balances` and `moves` pipelines into the PostgreSQL database at
/// `url` (source `box-1`), serving `[metrics]`, started and its tables made.
fn agent_into_postgres(
    broker: &Broker,
    url: &str,
    data_dir: Option<std::path::PathBuf>,
) -> CairnProcess {
    let mut cfg = AgentConfig::new(broker.port(), &pipelines("warehouse"));
    cfg.extra = metrics() + &pg_sink(url, "box-1");
    cfg.data_dir = data_dir;
    let mut agent = CairnProcess::new(&cfg);
    agent.set_log_filter(Some("info"));
    agent.start_connected();
    agent.wait_for_stderr("sink `warehouse`: tables", Duration::from_secs(20));
    agent
}

/// After `total` events of `box-1`: the `balances` table becomes the oracle's fold; the
/// reader (stopped here) never saw a version go back nor a row the oracle does not compute;
/// `moves` holds one row per event, each key's versions 1..=count, each row the oracle's;
/// the progress row is set; the outbox drains; the agent stops cleanly with no dead letter.
/// Returns what the reader saw.
fn assert_postgres_holds_the_fold(
    db: &PgConn,
    agent: &mut CairnProcess,
    reader: Reader,
    (total, keys): (usize, usize),
) -> ReaderSaw {
    let want = fold(total, keys);
    let settled = wait_until(Duration::from_secs(90), || balances(db, "box-1") == want);
    let saw = reader.finish();
    assert!(
        settled,
        "the table is not the fold:\n got {:?}\nwant {want:?}\n{}",
        balances(db, "box-1"),
        agent.stderr_tail(40)
    );
    assert!(saw.back.is_empty(), "a version went back: {:?}", saw.back);
    assert!(
        saw.wrong.is_empty(),
        "the reader saw rows the oracle does not compute: {:?}",
        saw.wrong
    );
    assert!(
        saw.polls >= 10,
        "the reader polled only {} times",
        saw.polls
    );
    // Changelog: one row per event, each key's versions 1..=count, each row the oracle's.
    let want_moves: BTreeMap<String, (u64, u64)> = want
        .iter()
        .map(|(k, (_, c))| (k.clone(), (*c, *c)))
        .collect();
    assert!(
        wait_until(Duration::from_secs(30), || moves(db, "box-1") == want_moves),
        "moves: {:?}",
        moves(db, "box-1")
    );
    assert_eq!(
        db.query("SELECT count(*), count(DISTINCT id) FROM cairn_moves"),
        format!("{total}|{total}"),
        "moves: not one row per event"
    );
    let rows = db.query("SELECT id, payload::text FROM cairn_moves WHERE source = 'box-1'");
    let wrong: Vec<String> = rows
        .lines()
        .filter_map(|l| l.split_once('|'))
        .filter_map(|(id, body)| oracle_says(id, body.as_bytes(), keys).err())
        .take(10)
        .collect();
    assert!(wrong.is_empty(), "moves rows: {wrong:?}");
    // The progress row is the sink's settled position.
    assert!(settled_position(db).is_some_and(|p| p > 0));
    assert_outbox_drains(agent);
    assert_eq!(agent.terminate().code(), Some(0));
    assert!(
        agent.inspect("dead-letters").is_empty(),
        "{:?}",
        agent.inspect("dead-letters")
    );
    saw
}

/// The agent writes `total` events into PostgreSQL while `fault` strikes after each of
/// `rounds` parts but the last; a reader polls the table all along. The table ends as the
/// oracle's fold.
fn postgres_through(fault: Fault, tag: &str, (total, rounds): (usize, usize)) {
    let broker = Broker::start();
    let guard = TestDb::create(tag);
    let db = guard.conn();
    let keys = 25;
    let mut agent = agent_into_postgres(&broker, &db.url(), fault.data_dir());
    let started = Instant::now();
    let reader = Reader::start(&db, keys);
    let struck = run_with_faults(&mut agent, &broker, (total, keys, rounds), &fault, |_| {});
    let saw = assert_postgres_holds_the_fold(&db, &mut agent, reader, (total, keys));
    eprintln!(
        "{tag}: {} polls, settled in {:?}",
        saw.polls,
        started.elapsed()
    );
    assert_some_struck_mid_flush(&struck);
}

#[test]
fn agent_to_postgres_the_table_is_the_oracles_fold_across_kills_mid_flush() {
    postgres_through(Fault::Kill, "e2e_pg", (3000, 6));
}

#[test]
fn agent_to_postgres_the_table_is_the_oracles_fold_across_power_cuts_mid_flush() {
    postgres_through(Fault::power_cut(), "e2e_pg_cut", (20_000, 16));
}

/// The database itself crashes mid-stream, three times: a server of the test's own (the
/// shared one at 5432 is never restarted by a test) stopped with `pg_ctl stop -m immediate`
/// (every backend killed, nothing kept but what the WAL holds; WAL recovery at the next
/// start). First inside a batch's transaction: its rows written, the progress row waiting on
/// a lock the test holds; started again at once. Then with a batch's commit durable but not
/// answered (it waits for a synchronous standby that does not exist): after recovery the
/// batch is committed and the sink, never told, sends it again; started again at once. Then
/// at whatever moment the sink is writing, left down for seconds with connections refused. The table ends as the oracle's fold,
/// `moves` one row per event, a reader polling all along never sees a version go back,
/// status says the sink is down while the database is, and the outbox drains.
#[test]
fn a_real_database_crash_and_restart_mid_stream_loses_nothing_and_no_version_goes_back() {
    const DOWN: Duration = Duration::from_secs(4);
    let pg = PrivatePg::start();
    let db = pg.create_db("cairn_restart");
    let broker = Broker::start();
    let (total, keys) = (5000, 20);
    let mut agent = agent_into_postgres(&broker, &db.url(), None);
    let started = Instant::now();
    let reader = Reader::start(&db, keys);
    let events: Vec<_> = (0..total).map(|i| event(i, keys)).collect();
    let part = |p: usize| events[p * total / 5..(p + 1) * total / 5].to_vec();
    let publish = |events: Vec<_>| {
        let port = broker.port();
        std::thread::spawn(move || publish_all(port, &events))
    };
    // The settled position the sink read at start and at each reconnect.
    let ups = |agent: &CairnProcess| -> Vec<Option<u64>> {
        agent
            .stderr()
            .lines()
            .filter(|l| l.contains("sink `warehouse`: tables"))
            .map(|l| {
                l.rsplit_once("settled position ")
                    .and_then(|(_, p)| p.trim().parse().ok())
            })
            .collect()
    };
    // 0: the first part settles, so that the crashes strike rows that exist.
    publish_all(broker.port(), &part(0));
    assert!(
        wait_until(Duration::from_secs(30), || balances(&db, "box-1")
            == fold(total / 5, keys)),
        "the first part: {:?}\n{}",
        balances(&db, "box-1"),
        agent.stderr_tail(30)
    );
    // 1: the progress table locked, the sink's next batch writes its rows and waits for the
    // progress row; the database crashes with that transaction open, and starts again.
    let lock = db.session("BEGIN; LOCK TABLE cairn_progress IN EXCLUSIVE MODE;");
    let locked = wait_until(Duration::from_secs(10), || {
        db.try_query(
            "SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation \
             WHERE c.relname = 'cairn_progress' AND l.mode = 'ExclusiveLock' AND l.granted",
        )
        .is_ok_and(|n| n == "1")
    });
    assert!(locked, "the test could not lock cairn_progress");
    let publisher = publish(part(1));
    let blocked = wait_until(Duration::from_secs(10), || {
        db.try_query(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
             AND backend_type = 'client backend'",
        )
        .is_ok_and(|n| n == "1")
    });
    assert!(blocked, "the sink never waited on the progress row");
    let waiting_at_first = outbox_entries(&agent);
    pg.crash();
    agent.note("the database crashed (pg_ctl stop -m immediate) inside a batch");
    drop(lock);
    pg.start_server();
    agent.note("the database started again");
    publisher.join().expect("publisher");
    assert!(
        wait_until(Duration::from_secs(30), || ups(&agent).len() == 2),
        "the sink did not reconnect after the first crash:\n{}",
        agent.stderr_tail(30)
    );
    // 2: every commit now waits for a synchronous standby that is not there, after it is
    // durable here: the sink's next commit hangs unanswered; the database crashes then, the
    // setting gone at the next start (written to postgresql.auto.conf, not reloaded).
    db.query("ALTER SYSTEM SET synchronous_standby_names = 'nobody'");
    db.query("SELECT pg_reload_conf()");
    let publisher = publish(part(2));
    let unanswered = wait_until(Duration::from_secs(10), || {
        db.try_query("SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'")
            .is_ok_and(|n| n != "0")
    });
    assert!(unanswered, "no commit waited for the standby");
    db.query("ALTER SYSTEM RESET synchronous_standby_names");
    let committed_at_crash = moves_rows(&db);
    let position_at_crash = settled_position(&db);
    pg.crash();
    agent.note("the database crashed (pg_ctl stop -m immediate) with a commit unanswered");
    pg.start_server();
    agent.note("the database started again");
    publisher.join().expect("publisher");
    assert!(
        wait_until(Duration::from_secs(30), || ups(&agent).len() == 3),
        "the sink did not reconnect after the second crash:\n{}",
        agent.stderr_tail(30)
    );
    // 3: a crash at whatever moment the sink is writing the next part, down for DOWN:
    // status says so, and what comes in meanwhile waits in the outbox.
    let publisher = publish(part(3));
    let writing = wait_until(Duration::from_secs(10), || {
        sink_state(&agent, "warehouse").as_deref() == Some("connected")
            && outbox_entries(&agent).is_some_and(|w| w > 0)
    });
    assert!(writing, "the sink never wrote:\n{}", agent.stderr_tail(30));
    let waiting_at_third = outbox_entries(&agent);
    pg.crash();
    agent.note("the database crashed (pg_ctl stop -m immediate)");
    let down_at = Instant::now();
    let said_down = wait_until(DOWN, || {
        sink_state(&agent, "warehouse").as_deref() == Some("down")
    });
    publisher.join().expect("publisher");
    std::thread::sleep(DOWN.saturating_sub(down_at.elapsed()));
    let waiting_while_down = outbox_entries(&agent);
    let down_for = down_at.elapsed();
    pg.start_server();
    agent.note("the database started again");
    // 4: the rest, on the database back up.
    publish_all(broker.port(), &part(4));
    let saw = assert_postgres_holds_the_fold(&db, &mut agent, reader, (total, keys));
    // Where each crash struck the sink, as its journal says (`lost : begin: ..`).
    let journal = agent.stderr();
    let lost: Vec<&str> = journal
        .lines()
        .filter_map(|l| l.split_once("warehouse: lost : ").map(|(_, why)| why))
        .map(|why| why.split(';').next().unwrap_or(why))
        .collect();
    eprintln!(
        "the sink lost the database at: {lost:?}, with {waiting_at_first:?} and \
         {waiting_at_third:?} results waiting at the first and third; {committed_at_crash:?} \
         moves rows visible and position {position_at_crash:?} at the second, \
         position {:?} after; {waiting_while_down:?} waited while it was \
         down for {down_for:?}; {} polls ({} refused); settled in {:?}",
        ups(&agent)[2],
        saw.polls,
        saw.failed,
        started.elapsed()
    );
    assert_eq!(pg.recoveries(), 3, "{}", pg.log_tail(40));
    assert_eq!(
        lost.len(),
        3,
        "the sink did not see every crash:\n{journal}"
    );
    assert!(
        lost[0].starts_with("write:"),
        "the first crash did not strike inside the batch's transaction: {lost:?}"
    );
    assert!(
        lost[1].starts_with("write:"),
        "the second crash did not strike an unanswered commit: {lost:?}"
    );
    let ups = ups(&agent);
    assert_eq!(ups.len(), 4, "{journal}");
    // The unanswered commit was durable: after recovery the progress row is past where it
    // was before that crash.
    assert!(
        ups[2] > position_at_crash,
        "the second crash struck no durable unanswered commit: position {position_at_crash:?} \
         before it, {:?} after:\n{journal}",
        ups[2]
    );
    assert!(
        said_down,
        "status never said the sink was down in {DOWN:?} of the database down:\n{journal}"
    );
    assert!(
        waiting_while_down.is_some_and(|w| w > 0),
        "nothing waited in the outbox while the database was down: {waiting_while_down:?}"
    );
    assert!(
        saw.failed > 0,
        "the reader never polled while the database was down"
    );
}

/// The distinct IDs of the `moves` (changelog) messages the stream holds whose ID contains
/// `part` (`box-1/moves/`, or `/moves/` for every box).
fn stream_move_ids(nats: &Nats, part: &str) -> BTreeSet<String> {
    nats.messages("RESULTS")
        .into_iter()
        .map(|(_, id, _)| id)
        .filter(|id| id.contains(part))
        .collect()
}

/// The IDs of the `moves` results of `total` events: `moves/acc-k/1..=count`.
fn move_ids(total: usize, keys: usize, source: &str) -> BTreeSet<String> {
    fold(total, keys)
        .iter()
        .flat_map(|(k, (_, c))| (1..=*c).map(move |v| format!("{source}/moves/{k}/{v}")))
        .collect()
}

/// The agent writes `total` events into an R3 stream on a three-node cluster while `fault`
/// strikes after each of `rounds` parts but the last (and, after the second, the stream's
/// leader is killed). The stream holds one message per ID, each the oracle's, the latest
/// per key the fold.
fn jetstream_through(fault: Fault, (total, rounds): (usize, usize)) {
    let broker = Broker::start();
    let mut nats = Nats::cluster();
    nats.create_stream("RESULTS", &["site.>"], 3, Duration::from_secs(120));
    let keys = 20;
    let mut cfg = AgentConfig::new(broker.port(), &pipelines("stream"));
    cfg.extra = metrics() + &js_sink(&nats.urls(), "box-1");
    cfg.data_dir = fault.data_dir();
    let mut agent = CairnProcess::new(&cfg);
    agent.set_log_filter(Some("info"));
    agent.start_connected();
    agent.wait_for_stderr("duplicate window 2m", Duration::from_secs(30));
    let started = Instant::now();
    let struck = run_with_faults(&mut agent, &broker, (total, keys, rounds), &fault, |r| {
        if r == 1 {
            let leader = nats.stream_leader("RESULTS");
            nats.nodes[leader].kill();
        }
    });
    let want = move_ids(total, keys, "box-1");
    let done = wait_until(Duration::from_secs(120), || {
        stream_move_ids(&nats, "box-1/moves/") == want
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
    // Every message is the oracle's; the latest `balances` version per key is the fold.
    let wrong: Vec<String> = msgs
        .iter()
        .filter_map(|(_, id, data)| match id.strip_prefix("box-1/") {
            Some(id) => oracle_says(id, data, keys).err(),
            None => Some(format!("{id}: not this box's")),
        })
        .take(10)
        .collect();
    assert!(
        wrong.is_empty(),
        "messages the oracle does not compute: {wrong:?}"
    );
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
    assert_outbox_drains(&agent);
    assert_eq!(agent.terminate().code(), Some(0));
    eprintln!(
        "{} messages, settled in {:?}",
        msgs.len(),
        started.elapsed()
    );
    assert_some_struck_mid_flush(&struck);
}

#[test]
fn agent_to_an_r3_jetstream_stream_one_message_per_id_across_agent_kills_and_a_node_kill() {
    jetstream_through(Fault::Kill, (2000, 4));
}

#[test]
fn agent_to_an_r3_jetstream_stream_one_message_per_id_across_power_cuts_and_a_node_kill() {
    jetstream_through(Fault::power_cut(), (8000, 8));
}

#[test]
fn a_fleet_of_three_boxes_writes_each_its_own_oracle_into_one_database_and_one_stream() {
    let guard = TestDb::create("e2e_fleet");
    let db = guard.conn();
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
            stream_move_ids(&nats, "/moves/") == want
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
    let guard = TestDb::create("e2e_outage");
    let db = guard.conn();
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
        sink_state(&agent, "warehouse").as_deref() == Some("down")
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
        stream_move_ids(&nats, "box-1/moves/") == want
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
