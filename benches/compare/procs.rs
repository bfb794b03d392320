//! What a system's process costs, read from `/proc/<pid>` (CPU ticks, RSS, bytes written,
//! per-thread time), and a child process killed on drop for the systems that are not the
//! agent (the relay, Node-RED). The agent runs under the tests' wrapper,
//! `support::agent::CairnProcess`; [`Stats`] reads any of them by pid.

use std::collections::BTreeMap;
use std::process::{Child, Command};
use std::time::Duration;

use crate::support::{self, wait_until};

/// A child process that is not the agent, SIGKILLed on drop.
pub(crate) struct Proc {
    pub(crate) child: Option<Child>,
    pub(crate) pid: u32,
}

impl Proc {
    pub(crate) fn spawn(cmd: &mut Command) -> Proc {
        let child = cmd.spawn().expect("spawn a bench child process");
        let pid = child.id();
        Proc {
            child: Some(child),
            pid,
        }
    }

    pub(crate) fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM, then SIGKILL after `grace`.
    pub(crate) fn terminate(&mut self, grace: Duration) {
        if let Some(mut c) = self.child.take() {
            support::signal(c.id(), "TERM");
            let exited = wait_until(grace, || matches!(c.try_wait(), Ok(Some(_))));
            if !exited {
                let _ = c.kill();
            }
            let _ = c.wait();
        }
    }

    pub(crate) fn stats(&self) -> Stats {
        Stats { pid: self.pid }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Readings of one process by pid; a process that is gone reads as zeros.
#[derive(Clone, Copy)]
pub(crate) struct Stats {
    pub(crate) pid: u32,
}

impl Stats {
    pub(crate) fn status_kib(&self, field: &str) -> u64 {
        let s = std::fs::read_to_string(format!("/proc/{}/status", self.pid)).unwrap_or_default();
        s.lines()
            .find(|l| l.starts_with(field))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    }

    pub(crate) fn rss_mib(&self) -> f64 {
        self.status_kib("VmRSS:") as f64 / 1024.0
    }

    pub(crate) fn hwm_mib(&self) -> f64 {
        self.status_kib("VmHWM:") as f64 / 1024.0
    }

    /// Bytes this process caused to be written to the block layer.
    pub(crate) fn write_bytes(&self) -> u64 {
        let s = std::fs::read_to_string(format!("/proc/{}/io", self.pid)).unwrap_or_default();
        s.lines()
            .find(|l| l.starts_with("write_bytes:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    }

    /// utime + stime, in clock ticks.
    pub(crate) fn cpu_ticks(&self) -> u64 {
        let s = std::fs::read_to_string(format!("/proc/{}/stat", self.pid)).unwrap_or_default();
        // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
        let rest = s.rsplit(')').next().unwrap_or("");
        let f: Vec<&str> = rest.split_whitespace().collect();
        let at = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
        at(11) + at(12)
    }

    /// Per thread (by name): CPU ticks (utime + stime), voluntary and involuntary context
    /// switches, for where a process's time goes.
    pub(crate) fn threads(&self) -> BTreeMap<String, (u64, u64, u64)> {
        let mut out = BTreeMap::new();
        let Ok(dir) = std::fs::read_dir(format!("/proc/{}/task", self.pid)) else {
            return out;
        };
        for t in dir.flatten() {
            let p = t.path();
            let stat = std::fs::read_to_string(p.join("stat")).unwrap_or_default();
            let name = stat
                .split_once('(')
                .and_then(|(_, r)| r.rsplit_once(')'))
                .map(|(n, _)| n.to_string())
                .unwrap_or_default();
            let rest = stat.rsplit(')').next().unwrap_or("");
            let f: Vec<&str> = rest.split_whitespace().collect();
            let at = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
            let status = std::fs::read_to_string(p.join("status")).unwrap_or_default();
            let switches = |field: &str| {
                status
                    .lines()
                    .find(|l| l.starts_with(field))
                    .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
                    .unwrap_or(0)
            };
            let e = out.entry(name).or_insert((0, 0, 0));
            e.0 += at(11) + at(12);
            e.1 += switches("voluntary_ctxt_switches:");
            e.2 += switches("nonvoluntary_ctxt_switches:");
        }
        out
    }

    /// CPU used over `span` of idleness, as % of one core.
    pub(crate) fn idle_cpu_percent(&self, span: Duration) -> f64 {
        let hz = ticks_per_second();
        let a = self.cpu_ticks();
        std::thread::sleep(span);
        let b = self.cpu_ticks();
        (b - a) as f64 / hz / span.as_secs_f64() * 100.0
    }
}

/// The whole box's CPU time so far, from `/proc/stat`'s `cpu` line, in ticks: (busy,
/// stolen, all). Busy is everything but idle and I/O wait; stolen is time the hypervisor
/// gave to another guest while this one wanted to run. `None` off Linux.
pub(crate) fn box_ticks() -> Option<(u64, u64, u64)> {
    let s = std::fs::read_to_string("/proc/stat").ok()?;
    let line = s.lines().find(|l| l.starts_with("cpu "))?;
    // user nice system idle iowait irq softirq steal (guest time is inside user already).
    let f: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .take(8)
        .map(|v| v.parse().unwrap_or(0))
        .collect();
    if f.len() < 8 {
        return None;
    }
    let all: u64 = f.iter().sum();
    let idle = f[3] + f[4];
    Some((all - idle - f[7], f[7], all))
}

/// What the box did between two [`box_ticks`]: (busy, stolen), each in % of one core (a
/// 2-core box saturated is 200).
pub(crate) fn box_percent(a: (u64, u64, u64), b: (u64, u64, u64)) -> (f64, f64) {
    let all = b.2.saturating_sub(a.2) as f64;
    if all == 0.0 {
        return (f64::NAN, f64::NAN);
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    let pct = |x: u64, y: u64| y.saturating_sub(x) as f64 / all * cores * 100.0;
    (pct(a.0, b.0), pct(a.1, b.1))
}

pub(crate) fn ticks_per_second() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 { t as f64 } else { 100.0 }
}
