//! systemd's notify protocol (`sd_notify(3)`), spoken directly: one datagram of
//! `KEY=VALUE` lines to the `AF_UNIX` socket named by `$NOTIFY_SOCKET`.
//!
//! Guarantees, in order of importance:
//!
//! - **It never fails the agent.** Every send error is logged at debug level and dropped: a
//!   lost `STATUS=` line is harmless, and a lost `WATCHDOG=1` is what the watchdog is for.
//! - **It never blocks.** The socket is non-blocking; a full receive queue is an error like
//!   any other (see above), so a stuck PID 1 cannot stall ingest or the fsync path.
//! - **Without systemd it does nothing.** When `NOTIFY_SOCKET` is unset (a shell, a test, a
//!   container) every call returns at once without a syscall beyond the `getenv`.
//!
//! The socket path may start with `@`, meaning Linux's abstract namespace (systemd uses one
//! for `systemd-run --user`, containers use them for `--notify-ready`).
//!
//! No crate, decided twice. `libsystemd` bindings would pull a C library onto the edge box
//! for a single `sendto(2)`. The pure-Rust `sd-notify` crate (0.5, checked 2026-11-30,
//! issue 12) speaks the same messages but breaks two of the guarantees above: its socket is
//! blocking (a full queue at PID 1 would stall the loop that acks and fsyncs), and it hands
//! `$NOTIFY_SOCKET` to `connect(2)` as a path, so an `@name` abstract socket fails. What it
//! would replace here is a few `format!`s; the socket code it cannot replace. We send no
//! `MONOTONIC_USEC=` (the unit is `Type=notify`, not `notify-reload`), the one field whose
//! clock read a crate would have saved us.

use std::io;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::time::{Duration, Instant};

/// How often [`Heartbeat`] refreshes the `STATUS=` line that `systemctl status` shows.
pub(crate) const STATUS_INTERVAL: Duration = Duration::from_secs(10);

/// A connection-less sender to one notify socket.
#[derive(Debug)]
pub struct Notifier {
    socket: UnixDatagram,
    addr: SocketAddr,
}

impl Notifier {
    /// The notifier systemd asked for, or `None` when `NOTIFY_SOCKET` is unset or empty.
    pub(crate) fn from_env() -> Option<io::Result<Notifier>> {
        let path = std::env::var_os("NOTIFY_SOCKET")?;
        let path = path.to_str()?;
        if path.is_empty() {
            return None;
        }
        Some(Notifier::to(path))
    }

    /// A notifier for `path`: a filesystem path, or `@name` for the abstract namespace.
    pub fn to(path: &str) -> io::Result<Notifier> {
        let addr = match path.strip_prefix('@') {
            Some(name) => SocketAddr::from_abstract_name(name.as_bytes())?,
            None => SocketAddr::from_pathname(path)?,
        };
        let socket = UnixDatagram::unbound()?;
        socket.set_nonblocking(true)?;
        Ok(Notifier { socket, addr })
    }

    /// Send one message of `KEY=VALUE` lines.
    pub fn send(&self, state: &str) -> io::Result<()> {
        let sent = self.socket.send_to_addr(state.as_bytes(), &self.addr)?;
        if sent != state.len() {
            return Err(io::Error::new(
                io::ErrorKind::WriteZero,
                format!("sent {sent} of {} bytes", state.len()),
            ));
        }
        Ok(())
    }
}

/// Send `state` to `$NOTIFY_SOCKET` if there is one. Errors are logged at debug level.
fn notify(state: &str) {
    let result = match Notifier::from_env() {
        None => return,
        Some(n) => n.and_then(|n| n.send(state)),
    };
    if let Err(e) = result {
        let first = state.lines().next().unwrap_or("");
        log::debug!("notify: cannot send `{first}` to $NOTIFY_SOCKET: {e}");
    }
}

/// Recovery is done and the agent takes input: `systemctl start` returns now.
pub(crate) fn ready() {
    notify("READY=1");
}

/// A one-line status for `systemctl status`; newlines become spaces (a newline would start
/// a new assignment in the protocol).
pub(crate) fn status(text: &str) {
    notify(&format!("STATUS={}", one_line(text)));
}

/// The agent is draining; systemd waits up to `TimeoutStopSec=` for it to exit.
pub(crate) fn stopping() {
    notify("STOPPING=1");
}

/// A configuration reload began; send [`ready`] when it is done.
pub(crate) fn reloading() {
    notify("RELOADING=1");
}

/// Startup is making progress (a long replay): show `text` as the status, give the start
/// [`STARTUP_EXTENSION`] more time beyond `TimeoutStartSec=` (systemd 236 and later; older
/// versions ignore it), and feed the watchdog, in one message.
pub(crate) fn still_starting(text: &str) {
    notify(&format!(
        "STATUS={}\nEXTEND_TIMEOUT_USEC={}\nWATCHDOG=1",
        one_line(text),
        STARTUP_EXTENSION.as_micros()
    ));
}

/// How much more start time each sign of progress buys (see [`still_starting`]).
pub(crate) const STARTUP_EXTENSION: Duration = Duration::from_secs(30);

fn one_line(text: &str) -> String {
    text.replace(['\n', '\r'], " ")
}

/// How often to send `WATCHDOG=1`: half of `$WATCHDOG_USEC`, as `sd_watchdog_enabled(3)`
/// recommends, so one late ping is not yet a timeout. `None` when no watchdog is set, or it
/// is meant for another process (`$WATCHDOG_PID` names a different PID).
pub(crate) fn watchdog_interval() -> Option<Duration> {
    let usec = std::env::var("WATCHDOG_USEC").ok();
    let pid = std::env::var("WATCHDOG_PID").ok();
    watchdog_interval_from(usec.as_deref(), pid.as_deref(), std::process::id())
}

/// [`watchdog_interval`] on explicit values, for tests.
pub(crate) fn watchdog_interval_from(
    usec: Option<&str>,
    pid: Option<&str>,
    my_pid: u32,
) -> Option<Duration> {
    let usec: u64 = usec?.trim().parse().ok().filter(|&u| u > 0)?;
    if let Some(pid) = pid {
        if pid.trim().parse::<u32>().ok() != Some(my_pid) {
            return None;
        }
    }
    Some(Duration::from_micros(usec / 2))
}

/// Periodic notifications for an event loop: `WATCHDOG=1` at [`watchdog_interval`], and a
/// fresh `STATUS=` line every [`STATUS_INTERVAL`]. Call [`Heartbeat::beat`] on every turn of
/// the loop; it sends only when one is due, so the call is cheap. It keeps one socket for its
/// lifetime instead of opening one per message.
#[derive(Debug)]
pub struct Heartbeat {
    notifier: Option<Notifier>,
    watchdog_every: Option<Duration>,
    status_every: Duration,
    last_watchdog: Instant,
    last_status: Instant,
}

impl Heartbeat {
    /// What systemd asked for: nothing at all without `$NOTIFY_SOCKET`.
    pub(crate) fn from_env() -> Heartbeat {
        let notifier = match Notifier::from_env() {
            Some(Ok(n)) => Some(n),
            Some(Err(e)) => {
                log::debug!("notify: cannot open $NOTIFY_SOCKET: {e}");
                None
            }
            None => None,
        };
        Heartbeat::new(notifier, watchdog_interval(), STATUS_INTERVAL)
    }

    /// Explicit parts, for tests: ping `notifier` every `watchdog_every` (if any), status
    /// every `status_every`. Both clocks start now.
    pub fn new(
        notifier: Option<Notifier>,
        watchdog_every: Option<Duration>,
        status_every: Duration,
    ) -> Heartbeat {
        let now = Instant::now();
        Heartbeat {
            notifier,
            watchdog_every,
            status_every,
            last_watchdog: now,
            last_status: now,
        }
    }

    /// Send what is due at `now`; `describe` is called only when a status line is due.
    pub fn beat(&mut self, now: Instant, describe: impl FnOnce() -> String) {
        let Some(n) = &self.notifier else {
            return;
        };
        let mut message = String::new();
        if let Some(every) = self.watchdog_every {
            if now.saturating_duration_since(self.last_watchdog) >= every {
                message.push_str("WATCHDOG=1\n");
                self.last_watchdog = now;
            }
        }
        if now.saturating_duration_since(self.last_status) >= self.status_every {
            message.push_str(&format!("STATUS={}\n", one_line(&describe())));
            self.last_status = now;
        }
        if message.is_empty() {
            return;
        }
        if let Err(e) = n.send(&message) {
            log::debug!("notify: cannot send a heartbeat to $NOTIFY_SOCKET: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_watchdog_is_pinged_at_half_its_timeout() {
        let d = watchdog_interval_from(Some("30000000"), None, 7);
        assert_eq!(d, Some(Duration::from_secs(15)));
    }

    #[test]
    fn a_watchdog_meant_for_another_process_is_ignored() {
        assert_eq!(watchdog_interval_from(Some("30000000"), Some("8"), 7), None);
        assert_eq!(
            watchdog_interval_from(Some("30000000"), Some("7"), 7),
            Some(Duration::from_secs(15))
        );
    }

    #[test]
    fn no_or_bad_watchdog_usec_means_no_watchdog() {
        assert_eq!(watchdog_interval_from(None, None, 7), None);
        assert_eq!(watchdog_interval_from(Some("0"), None, 7), None);
        assert_eq!(watchdog_interval_from(Some("soon"), None, 7), None);
    }

    #[test]
    fn a_status_is_always_one_line() {
        assert_eq!(one_line("a\nb\r\nc"), "a b  c");
    }
}
