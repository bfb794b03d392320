//! Recovery from a SIGKILL with 100,000 logged but unprocessed records (pre-filled with
//! `cairn::log::Log` while the agent is stopped), READY timed on a fake `NOTIFY_SOCKET`.

use std::os::unix::net::UnixDatagram;
use std::time::{Duration, Instant};

use crate::agent::Cairn;
use crate::mqtt::Sink;
use crate::support::wait_until;
use crate::{KEYS, RECOVERY_RECORDS, STEP_TIMEOUT};

/// Milliseconds from the start to READY, as the agent logged its recovery, and to the last
/// result out; `None` where it did not run or did not happen in time.
#[derive(Default)]
pub(crate) struct Recovery {
    pub(crate) ready_ms: Option<f64>,
    pub(crate) replay_ms: Option<f64>,
    pub(crate) caught_up_ms: Option<f64>,
}

impl Recovery {
    /// Records replayed per second up to READY.
    pub(crate) fn replay_rate(&self) -> Option<f64> {
        self.ready_ms.map(|ms| RECOVERY_RECORDS as f64 / (ms / 1e3))
    }
}

/// Subscribe the agent, stop it, fill its log, and start it as systemd would.
pub(crate) fn run(port: u16, t0: Instant) -> Recovery {
    let mut c = Cairn::new(port, "changelog", 5_000);
    c.start_connected();
    c.kill();
    c.prefill_log("rec", RECOVERY_RECORDS, KEYS);
    let sink = Sink::start(port, "cairn", KEYS, t0);
    let sock_dir = tempfile::tempdir().expect("a dir for the fake NOTIFY_SOCKET");
    let sock_path = sock_dir.path().join("notify.sock");
    let sock = UnixDatagram::bind(&sock_path).expect("bind the fake NOTIFY_SOCKET");
    sock.set_read_timeout(Some(Duration::from_millis(200)))
        .expect("timeout");
    let started = Instant::now();
    c.start(Some(&sock_path));
    let mut ready = None;
    let mut buf = [0u8; 4096];
    while started.elapsed() < STEP_TIMEOUT * 2 {
        if let Ok(n) = sock.recv(&mut buf)
            && String::from_utf8_lossy(&buf[..n])
                .lines()
                .any(|l| l == "READY=1")
        {
            ready = Some(started.elapsed());
            break;
        }
    }
    let caught = wait_until(STEP_TIMEOUT * 2, || {
        sink.results() >= RECOVERY_RECORDS as usize
    })
    .then(|| started.elapsed());
    c.kill();
    Recovery {
        ready_ms: ready.map(|d| d.as_secs_f64() * 1e3),
        replay_ms: c.recovery_ms().map(|v| v as f64),
        caught_up_ms: caught.map(|d| d.as_secs_f64() * 1e3),
    }
}
