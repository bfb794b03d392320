//! The kill test: Cairn and Node-RED get the same SIGKILL at the same input of the same
//! paced stream, are restarted at once, and their final per-key sums are compared with the
//! oracle (a fold over the stream).

use std::cell::RefCell;
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::agent::Cairn;
use crate::mqtt::{Latest, Publisher, Sink};
use crate::node_red::{NODE_RED_FLUSH_S, NodeRed};
use crate::stream::{SEED, event};
use crate::support::{Broker, wait_until};
use crate::{KEYS, KILL_AT, KILL_EVENTS, KILL_RATE, STEP_TIMEOUT};

/// Final per-key sums against the oracle after a SIGKILL at input [`KILL_AT`].
#[derive(Default, Clone, Copy)]
pub(crate) struct KillResult {
    pub(crate) lost: u64,
    pub(crate) doubled: u64,
    pub(crate) wrong_keys: u64,
    pub(crate) keys: u64,
}

pub(crate) fn kill_oracle() -> HashMap<usize, (u64, u64)> {
    let mut m: HashMap<usize, (u64, u64)> = HashMap::new();
    for i in 0..KILL_EVENTS {
        let (k, v) = event(SEED, i, KEYS);
        let e = m.entry(k as usize).or_default();
        e.0 += v;
        e.1 += 1;
    }
    m
}

/// Publish the paced kill stream in a thread; SIGKILL via `kill` when input [`KILL_AT`] has
/// been published; `restart` at once; then wait until the results settle.
pub(crate) fn kill_test(
    port: u16,
    prefix: &'static str,
    sink: &Sink,
    kill: &mut dyn FnMut(),
    restart: &mut dyn FnMut(),
    settled: &dyn Fn(&Latest) -> bool,
) -> KillResult {
    let progress = Arc::new(AtomicU64::new(0));
    let p2 = progress.clone();
    let publishing = std::thread::spawn(move || {
        let publisher = Publisher::start(port);
        let t0 = Instant::now();
        publisher.send(
            prefix,
            "kill",
            0..KILL_EVENTS,
            KEYS,
            KILL_RATE,
            None,
            t0,
            Some(&p2),
        );
    });
    wait_until(STEP_TIMEOUT, || progress.load(Ordering::SeqCst) >= KILL_AT);
    kill();
    restart();
    publishing.join().expect("kill-test publisher");
    let oracle = kill_oracle();
    // Settled: the system says so, or nothing new for 5 s (bounded by STEP_TIMEOUT).
    let deadline = Instant::now() + STEP_TIMEOUT;
    let mut last_change = (Instant::now(), sink.results());
    while Instant::now() < deadline {
        if settled(&sink.latest()) {
            break;
        }
        let n = sink.results();
        if n != last_change.1 {
            last_change = (Instant::now(), n);
        } else if last_change.0.elapsed() > Duration::from_secs(5) {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let latest = sink.latest();
    let mut r = KillResult {
        keys: oracle.len() as u64,
        ..Default::default()
    };
    for (k, (sum, count)) in &oracle {
        let (_, value, got) = latest.get(k).copied().unwrap_or((0, 0.0, 0));
        r.lost += count.saturating_sub(got);
        r.doubled += got.saturating_sub(*count);
        if value != *sum as f64 {
            r.wrong_keys += 1;
        }
    }
    r
}

/// Cairn through the kill test: settled once every key's count reached the oracle's.
pub(crate) fn cairn(port: u16, t0: Instant) -> KillResult {
    let mut c = Cairn::new(port, "changelog", 5_000);
    c.start_connected();
    let sink = Sink::start(port, "cairn", KEYS, t0);
    let c = RefCell::new(c);
    let oracle = kill_oracle();
    let r = kill_test(
        port,
        "cairn",
        &sink,
        &mut || c.borrow_mut().kill(),
        &mut || {
            let mut c = c.borrow_mut();
            c.start(None);
            c.wait_connected(Duration::from_secs(20));
        },
        &|latest| {
            oracle
                .iter()
                .all(|(k, (_, n))| latest.get(k).is_some_and(|l| l.2 >= *n))
        },
    );
    println!(
        "  cairn    lost {} doubled {} wrong keys {}/{}",
        r.lost, r.doubled, r.wrong_keys, r.keys
    );
    r
}

/// Node-RED through the kill test (it cannot say when it is settled: nothing new for 5 s
/// ends the wait). `None` if its flow did not connect.
pub(crate) fn node_red(
    root: &Path,
    red_js: &Path,
    broker: &Broker,
    t0: Instant,
) -> Option<KillResult> {
    let port = broker.port();
    let nr = RefCell::new(NodeRed::new(
        root,
        red_js.to_path_buf(),
        port,
        "node-red-kill",
    ));
    nr.borrow_mut().start();
    if !nr
        .borrow_mut()
        .wait_connected(broker, 1, Duration::from_secs(60))
    {
        return None;
    }
    let sink = Sink::start(port, "nr", KEYS, t0);
    let r = kill_test(
        port,
        "nr",
        &sink,
        &mut || nr.borrow_mut().kill(),
        &mut || {
            let mut n = nr.borrow_mut();
            n.start();
            n.wait_connected(broker, 2, Duration::from_secs(60));
        },
        &|_| false,
    );
    println!(
        "  node-red lost {} doubled {} wrong keys {}/{} (context flushInterval {NODE_RED_FLUSH_S} s)",
        r.lost, r.doubled, r.wrong_keys, r.keys
    );
    nr.borrow_mut().kill();
    Some(r)
}
