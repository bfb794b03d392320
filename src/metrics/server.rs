//! The loopback HTTP/1.1 server for `/metrics` and `/status.json` (its bounds, the bind
//! retry and the `Host` check are in the module docs of [`super`]), on the `[metrics]
//! listen` address and on the data directory's unix socket ([`serve_local`]). Both feed one
//! set of bounded connections and one handler.

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::{
    BIND_RETRY_MAX, BIND_RETRY_MIN, BIND_WARN_EVERY, MAX_HANDLER_THREADS, MAX_HANDLERS,
    MAX_REQUEST_BYTES, Metrics, REQUEST_DEADLINE, lock,
};

/// Serve `GET /metrics` and `GET /status.json` on `addr` (loopback only) from one thread.
///
/// Fails only for an address that is not loopback. A bind that fails (another process holds
/// the port) is retried on the server's thread until it succeeds or the server is stopped:
/// the figures are for operators, and no local user may stop the agent by taking its port.
pub fn serve(addr: SocketAddr, metrics: Arc<Metrics>) -> io::Result<JoinHandle<()>> {
    if !addr.ip().is_loopback() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("metrics listen address {addr} is not loopback"),
        ));
    }
    let mut binder = Binder {
        addr,
        failures: 0,
        warned_at: None,
    };
    // The first try here, so that a free port is bound (and `server_addr` known) on return.
    let first = binder.try_bind(&metrics);
    std::thread::Builder::new()
        .name("cairn-metrics".into())
        .spawn(move || {
            let listener = match first {
                Some(l) => l,
                None => match binder.retry(&metrics) {
                    Some(l) => l,
                    None => return,
                },
            };
            accept_loop(listener.incoming(), &metrics);
        })
}

/// The bind, its failures and their (rate-limited) warnings.
struct Binder {
    addr: SocketAddr,
    failures: u64,
    warned_at: Option<Instant>,
}

impl Binder {
    fn try_bind(&mut self, metrics: &Metrics) -> Option<TcpListener> {
        let addr = self.addr;
        match TcpListener::bind(addr) {
            Ok(listener) => {
                let at = listener.local_addr().unwrap_or(addr);
                *lock(&metrics.server) = Some(at);
                metrics.update(|f| f.metrics_listener_up = true);
                if self.failures == 0 {
                    crate::event!(info, "metrics_listening"; "metrics: serving http://{at}/metrics");
                } else {
                    crate::event!(warn, "metrics_listening";
                        "metrics: serving http://{at}/metrics, after {} failed attempts to bind",
                        self.failures
                    );
                }
                Some(listener)
            }
            Err(e) => {
                self.failures += 1;
                metrics.update(|f| f.metrics_bind_failures += 1);
                let now = Instant::now();
                if self
                    .warned_at
                    .is_none_or(|t| now.duration_since(t) >= BIND_WARN_EVERY)
                {
                    self.warned_at = Some(now);
                    if self.failures == 1 {
                        crate::event!(warn, "metrics_bind_failed";
                            "metrics: cannot listen on {addr}: {e}; the agent goes on without \
                             /metrics and tries again every {}s at most (does another process \
                             hold the port? `ss -ltnp`)",
                            BIND_RETRY_MAX.as_secs()
                        );
                    } else {
                        crate::event!(warn, "metrics_bind_failed";
                            "metrics: still cannot listen on {addr} after {} attempts: {e}",
                            self.failures
                        );
                    }
                }
                None
            }
        }
    }

    /// Try again with a doubling wait until the bind succeeds; `None` once the server is
    /// stopped.
    fn retry(&mut self, metrics: &Metrics) -> Option<TcpListener> {
        let mut wait = BIND_RETRY_MIN;
        loop {
            let until = Instant::now() + wait;
            while Instant::now() < until {
                if metrics.stop.load(Ordering::SeqCst) {
                    return None;
                }
                std::thread::sleep(Duration::from_millis(50).min(wait));
            }
            if let Some(listener) = self.try_bind(metrics) {
                return Some(listener);
            }
            wait = (wait * 2).min(BIND_RETRY_MAX);
        }
    }
}

/// Serve the same answers on a unix socket at `path` (the data directory's `cairn.sock`, see
/// [`super::local_socket`]): `cairn status` finds the running agent there with no
/// configuration. A socket left by an agent that was killed is replaced; anything else at
/// the path is an error. The socket is `0600`, in a data directory that is `0700`: its owner
/// (and root) may connect.
///
/// The caller must hold the data directory (the store's lock), so that the socket it
/// replaces is never a running agent's.
pub fn serve_local(path: &Path, metrics: Arc<Metrics>) -> io::Result<JoinHandle<()>> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => std::fs::remove_file(path)?,
        Ok(_) => {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!("{} exists and is not a socket", path.display()),
            ));
        }
        Err(_) => {}
    }
    let listener = UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    *lock(&metrics.local) = Some(path.to_path_buf());
    std::thread::Builder::new()
        .name("cairn-status-socket".into())
        .spawn(move || accept_loop(listener.incoming(), &metrics))
}

/// A connection either listener accepted: what the handler needs of it.
trait Client: Read + Write + Send + Sized + 'static {
    fn set_read_timeout(&self, d: Option<Duration>) -> io::Result<()>;
    fn set_write_timeout(&self, d: Option<Duration>) -> io::Result<()>;
    /// A second handle on the same socket, to cut it from another thread.
    fn cutter(&self) -> io::Result<Box<dyn Cut>>;
}

/// Cut a connection (both directions): its handler's next read or write fails at once.
trait Cut: Send + std::fmt::Debug {
    fn cut(&self);
}

macro_rules! client {
    ($t:ty) => {
        impl Client for $t {
            fn set_read_timeout(&self, d: Option<Duration>) -> io::Result<()> {
                <$t>::set_read_timeout(self, d)
            }
            fn set_write_timeout(&self, d: Option<Duration>) -> io::Result<()> {
                <$t>::set_write_timeout(self, d)
            }
            fn cutter(&self) -> io::Result<Box<dyn Cut>> {
                Ok(Box::new(self.try_clone()?))
            }
        }
        impl Cut for $t {
            fn cut(&self) {
                let _ = self.shutdown(Shutdown::Both);
            }
        }
    };
}
client!(TcpStream);
client!(UnixStream);

fn accept_loop<S: Client>(incoming: impl Iterator<Item = io::Result<S>>, metrics: &Arc<Metrics>) {
    for conn in incoming {
        if metrics.stop.load(Ordering::SeqCst) {
            break;
        }
        match conn {
            Ok(stream) => dispatch(stream, metrics),
            Err(e) => {
                // e.g. EMFILE: back off instead of spinning.
                crate::event!(warn, "metrics_accept_failed"; "metrics: accept: {e}");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

/// The connections being served, oldest first.
#[derive(Debug, Default)]
pub(crate) struct Conns {
    next_id: u64,
    live: VecDeque<Conn>,
}

#[derive(Debug)]
struct Conn {
    id: u64,
    /// Still waiting for its request head: an idle connection, which a newcomer may cut.
    waiting: bool,
    /// A handle on the same socket, to cut it from the accepting thread.
    socket: Box<dyn Cut>,
}

impl Conns {
    /// A place for a connection whose socket `socket` is a handle on: its id, after cutting
    /// the oldest connection that has not sent its request yet if every place is taken; `None`
    /// when every place is answering a request.
    fn admit(&mut self, socket: Box<dyn Cut>) -> Option<u64> {
        if self.live.len() >= MAX_HANDLERS {
            let idle = self.live.iter().position(|c| c.waiting)?;
            let cut = self.live.remove(idle).expect("found above");
            cut.socket.cut();
        }
        let id = self.next_id;
        self.next_id += 1;
        self.live.push_back(Conn {
            id,
            waiting: true,
            socket,
        });
        Some(id)
    }

    /// The connection has sent its request and is answered now; false if it was cut.
    fn answering(&mut self, id: u64) -> bool {
        match self.live.iter_mut().find(|c| c.id == id) {
            Some(c) => {
                c.waiting = false;
                true
            }
            None => false,
        }
    }

    fn finish(&mut self, id: u64) {
        self.live.retain(|c| c.id != id);
    }
}

/// Give the connection a handler thread of its own, or answer 503 when every place is busy
/// answering (or too many cut handlers have not ended yet), so the accepting thread never
/// waits on a client.
fn dispatch<S: Client>(stream: S, metrics: &Arc<Metrics>) {
    let deadline = Instant::now() + REQUEST_DEADLINE;
    let admitted = {
        let mut conns = lock(&metrics.conns);
        let threads = metrics.threads.load(Ordering::SeqCst);
        match stream.cutter() {
            Ok(handle) if threads < MAX_HANDLER_THREADS => conns.admit(handle).inspect(|_| {
                metrics.threads.fetch_add(1, Ordering::SeqCst);
            }),
            _ => None,
        }
    };
    let Some(id) = admitted else {
        // The answer fits in the socket's send buffer: the write does not wait on the client,
        // and the short timeout bounds it if it ever did.
        let mut stream = stream;
        let _ = stream.set_write_timeout(Some(Duration::from_millis(100)));
        let _ = respond(
            &mut stream,
            "503 Service Unavailable",
            "text/plain",
            "busy\n",
            Instant::now() + Duration::from_millis(100),
        );
        return;
    };
    let m = metrics.clone();
    let done = move |m: &Metrics| {
        lock(&m.conns).finish(id);
        m.threads.fetch_sub(1, Ordering::SeqCst);
    };
    let spawned = std::thread::Builder::new()
        .name("cairn-metrics-conn".into())
        .spawn(move || {
            if let Err(e) = handle(stream, &m, deadline, id) {
                log::debug!("metrics: connection: {e}");
            }
            done(&m);
        });
    if let Err(e) = spawned {
        lock(&metrics.conns).finish(id);
        metrics.threads.fetch_sub(1, Ordering::SeqCst);
        crate::event!(warn, "metrics_handler_failed"; "metrics: cannot start a handler thread: {e}");
    }
}

/// Whether a `Host` header names this server as only a local client would: `localhost` or a
/// loopback address, with or without a port. A web page that rebinds its own name to
/// 127.0.0.1 sends that name, and is refused.
pub(crate) fn host_allowed(host: &str) -> bool {
    let host = host.trim();
    // `[::1]` or `[::1]:9108`.
    if let Some(rest) = host.strip_prefix('[') {
        let Some((ip, port)) = rest.split_once(']') else {
            return false;
        };
        let port_ok = port.is_empty()
            || port
                .strip_prefix(':')
                .is_some_and(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()));
        return port_ok && ip.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback());
    }
    let name = match host.rsplit_once(':') {
        Some((name, port)) if !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) => name,
        Some(_) => return false,
        None => host,
    };
    name.eq_ignore_ascii_case("localhost")
        || name.eq_ignore_ascii_case("localhost.")
        || name.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// Time left before `deadline`, or a `TimedOut` error once it has passed. Never zero: a zero
/// socket timeout means "wait forever".
fn remaining(deadline: Instant) -> io::Result<Duration> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(io::Error::new(
            io::ErrorKind::TimedOut,
            "request deadline passed",
        ));
    }
    Ok(left)
}

fn handle<S: Client>(
    mut stream: S,
    metrics: &Metrics,
    deadline: Instant,
    id: u64,
) -> io::Result<()> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break Some(i);
        }
        if buf.len() >= MAX_REQUEST_BYTES {
            break None;
        }
        // Each read may wait only for what is left of the whole request's time.
        stream.set_read_timeout(Some(remaining(deadline)?))?;
        let n = stream.read(&mut chunk)?;
        if n == 0 {
            return Ok(());
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let Some(head_end) = head_end else {
        return respond(
            &mut stream,
            "431 Request Header Fields Too Large",
            "text/plain",
            "",
            deadline,
        );
    };
    if !lock(&metrics.conns).answering(id) {
        // Cut for a newcomer while its request was arriving.
        return Ok(());
    }
    let head = String::from_utf8_lossy(&buf[..head_end]);
    let hosts: Vec<&str> = head
        .lines()
        .skip(1)
        .filter_map(|l| l.split_once(':'))
        .filter(|(name, _)| name.trim().eq_ignore_ascii_case("host"))
        .map(|(_, value)| value)
        .collect();
    // No `Host` is an HTTP/1.0 tool (a browser always sends one); two are a malformed request.
    if hosts.len() > 1 || hosts.first().is_some_and(|h| !host_allowed(h)) {
        return respond(
            &mut stream,
            "421 Misdirected Request",
            "text/plain",
            "only requests for localhost or a loopback address are answered\n",
            deadline,
        );
    }
    let mut parts = head.lines().next().unwrap_or("").split_whitespace();
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let path = target.split('?').next().unwrap_or("");
    match (method, path) {
        ("GET", "/metrics") => respond(
            &mut stream,
            "200 OK",
            "text/plain; version=0.0.4; charset=utf-8",
            &super::render(metrics),
            deadline,
        ),
        // For `cairn status`: the same moment as a scrape, as JSON it need not parse back.
        ("GET", "/status.json") => respond(
            &mut stream,
            "200 OK",
            "application/json",
            &super::status(metrics).to_string(),
            deadline,
        ),
        ("GET", _) => respond(
            &mut stream,
            "404 Not Found",
            "text/plain",
            "not found\n",
            deadline,
        ),
        _ => respond(
            &mut stream,
            "405 Method Not Allowed",
            "text/plain",
            "only GET\n",
            deadline,
        ),
    }
}

/// Write the response by `deadline`: a client that reads slowly is cut like one that writes
/// slowly.
fn respond<S: Client>(
    stream: &mut S,
    status: &str,
    ctype: &str,
    body: &str,
    deadline: Instant,
) -> io::Result<()> {
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let mut out = head.into_bytes();
    out.extend_from_slice(body.as_bytes());
    let mut rest = &out[..];
    while !rest.is_empty() {
        stream.set_write_timeout(Some(remaining(deadline)?))?;
        match stream.write(rest) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => rest = &rest[n..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    stream.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A client trickling one byte every 1.5 s (under any per-read timeout) holds its
    /// connection while a second scrape is answered promptly, and is cut at the deadline.
    #[test]
    fn a_slow_loris_client_is_cut_at_the_deadline_and_does_not_block_other_scrapes() {
        let m = Metrics::new();
        m.update(|f| f.received = 7);
        let t = serve("127.0.0.1:0".parse().unwrap(), m.clone()).unwrap();
        let addr = m.server_addr().unwrap();

        let started = Instant::now();
        let slow = std::thread::spawn(move || {
            let mut s = TcpStream::connect(addr).unwrap();
            s.set_read_timeout(Some(Duration::from_millis(100)))
                .unwrap();
            let request = b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n";
            let mut last = Instant::now() - Duration::from_secs(2);
            let mut sent = 0;
            let mut probe = [0u8; 64];
            // Until the server closes on us (or a generous 10 s pass: a failure).
            while started.elapsed() < Duration::from_secs(10) {
                if sent < request.len() && last.elapsed() >= Duration::from_millis(1500) {
                    if s.write_all(&request[sent..sent + 1]).is_err() {
                        return (started.elapsed(), sent, String::new());
                    }
                    sent += 1;
                    last = Instant::now();
                }
                match s.read(&mut probe) {
                    Ok(0) => return (started.elapsed(), sent, String::new()),
                    Ok(n) => {
                        return (
                            started.elapsed(),
                            sent,
                            String::from_utf8_lossy(&probe[..n]).into_owned(),
                        );
                    }
                    Err(e)
                        if matches!(
                            e.kind(),
                            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                        ) => {}
                    Err(_) => return (started.elapsed(), sent, String::new()),
                }
            }
            (started.elapsed(), sent, String::new())
        });

        // The slow client has its connection; a scrape now must not wait for it.
        std::thread::sleep(Duration::from_millis(300));
        let asked = Instant::now();
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n")
            .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        let took = asked.elapsed();
        assert!(out.starts_with("HTTP/1.1 200 OK"), "{out}");
        assert!(out.contains("\ncairn_received_total 7\n"), "{out}");
        assert!(took < Duration::from_millis(500), "scrape took {took:?}");

        let (cut_after, sent, answer) = slow.join().unwrap();
        assert!(answer.is_empty(), "the slow client got an answer: {answer}");
        assert!(
            sent < 5,
            "the slow client could send {sent} bytes before being cut"
        );
        assert!(
            cut_after >= REQUEST_DEADLINE && cut_after < REQUEST_DEADLINE + Duration::from_secs(2),
            "cut after {cut_after:?}"
        );
        m.stop_server();
        t.join().unwrap();
    }

    /// One scrape: the whole answer, or what came before the connection ended.
    fn get(addr: SocketAddr, req: &[u8]) -> String {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let _ = s.write_all(req);
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        out
    }

    /// Issue 27: 8 idle local connections got most scrapes refused. Now idle ones give
    /// their place up: with three times as many idle connections as places, every scrape is
    /// answered at once, and the oldest idle connections were cut.
    #[test]
    fn scrapes_are_answered_while_more_idle_connections_than_places_are_open() {
        let m = Metrics::new();
        let t = serve("127.0.0.1:0".parse().unwrap(), m.clone()).unwrap();
        let addr = m.server_addr().unwrap();
        let mut idle: Vec<TcpStream> = (0..3 * MAX_HANDLERS)
            .map(|_| TcpStream::connect(addr).unwrap())
            .collect();
        std::thread::sleep(Duration::from_millis(200));
        for i in 0..20 {
            let asked = Instant::now();
            let out = get(addr, b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n");
            assert!(out.starts_with("HTTP/1.1 200 OK"), "scrape {i}: {out:?}");
            let took = asked.elapsed();
            assert!(took < Duration::from_secs(1), "scrape {i} took {took:?}");
        }
        // The first idle connection was cut (not answered) long before the deadline.
        idle[0]
            .set_read_timeout(Some(Duration::from_millis(100)))
            .unwrap();
        let mut buf = [0u8; 16];
        assert!(
            matches!(idle[0].read(&mut buf), Ok(0)),
            "the oldest idle connection still holds its place"
        );
        drop(idle);
        m.stop_server();
        t.join().unwrap();
    }

    /// The data directory's socket answers as the port does; a dead agent's socket is
    /// replaced, anything else at the path refused, and a stop removes the socket.
    #[test]
    fn the_status_socket_answers_replaces_a_dead_agents_socket_and_goes_at_stop() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cairn.sock");
        std::fs::write(&path, "not a socket").unwrap();
        let err = serve_local(&path, Metrics::new()).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::AlreadyExists, "{err}");
        std::fs::remove_file(&path).unwrap();
        // What a SIGKILLed agent leaves: a socket file nobody listens on.
        drop(UnixListener::bind(&path).unwrap());
        let m = Metrics::new();
        m.update(|f| f.received = 9);
        let t = serve_local(&path, m.clone()).unwrap();
        let mut s = UnixStream::connect(&path).unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n")
            .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        assert!(out.starts_with("HTTP/1.1 200 OK"), "{out}");
        assert!(out.contains("\ncairn_received_total 9\n"), "{out}");
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        m.stop_server();
        t.join().unwrap();
        assert!(!path.exists());
    }

    /// The 503 is left for a full house of connections being answered.
    #[test]
    fn a_newcomer_takes_the_place_of_the_oldest_idle_connection_never_of_one_being_answered() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let mut clients = Vec::new();
        let mut sockets = || -> Box<dyn Cut> {
            clients.push(TcpStream::connect(addr).unwrap());
            Box::new(listener.accept().unwrap().0)
        };
        let mut conns = Conns::default();
        let ids: Vec<u64> = (0..MAX_HANDLERS)
            .map(|_| conns.admit(sockets()).unwrap())
            .collect();
        for &id in &ids[..MAX_HANDLERS - 2] {
            assert!(conns.answering(id));
        }
        // Two idle ones: the older goes first, then the younger.
        let new = conns.admit(sockets()).unwrap();
        assert!(
            !conns.answering(ids[MAX_HANDLERS - 2]),
            "the older idle one was cut"
        );
        conns.admit(sockets()).unwrap();
        assert!(!conns.answering(ids[MAX_HANDLERS - 1]));
        assert!(conns.answering(new));
        // Now every place answers: a newcomer is refused, and a place frees when one ends.
        assert!(conns.answering(new + 1));
        assert_eq!(conns.admit(sockets()), None);
        conns.finish(ids[0]);
        assert!(conns.admit(sockets()).is_some());
    }

    #[test]
    fn requests_for_another_host_are_refused_and_loopback_hosts_answered() {
        for ok in [
            "localhost",
            "LOCALHOST:9108",
            "localhost.",
            "127.0.0.1",
            "127.0.0.1:9108",
            " 127.1.2.3:1 ",
            "[::1]",
            "[::1]:9108",
        ] {
            assert!(host_allowed(ok), "{ok}");
        }
        for refused in [
            "evil.example",
            "evil.example:9108",
            "localhost.evil.example",
            "127.0.0.1.nip.io",
            "10.0.0.1:9108",
            "[::2]:9108",
            "[::1]9108",
            "localhost:",
            "localhost:x",
            "",
        ] {
            assert!(!host_allowed(refused), "{refused}");
        }
        let m = Metrics::new();
        let t = serve("127.0.0.1:0".parse().unwrap(), m.clone()).unwrap();
        let addr = m.server_addr().unwrap();
        let port = addr.port();
        for (req, status) in [
            (
                format!("GET /status.json HTTP/1.1\r\nHost: rebound.example:{port}\r\n\r\n"),
                "421",
            ),
            (
                "GET /metrics HTTP/1.1\r\nhost: a\r\nHost: localhost\r\n\r\n".into(),
                "421",
            ),
            (
                format!("GET /metrics HTTP/1.1\r\nHOST: 127.0.0.1:{port}\r\n\r\n"),
                "200",
            ),
            ("GET /metrics HTTP/1.0\r\n\r\n".into(), "200"),
        ] {
            let out = get(addr, req.as_bytes());
            assert!(
                out.starts_with(&format!("HTTP/1.1 {status}")),
                "{req:?}: {out}"
            );
        }
        m.stop_server();
        t.join().unwrap();
    }

    /// Issue 27: a local user holding the port stopped the agent from starting. Now the
    /// server waits for the port: up 0 and failures counted meanwhile, served once it is free.
    #[test]
    fn a_port_held_by_another_socket_is_bound_once_it_is_freed() {
        let holder = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = holder.local_addr().unwrap();
        let m = Metrics::new();
        let t = serve(addr, m.clone()).expect("a held port is not an error");
        assert_eq!(m.server_addr(), None);
        assert!(!m.snapshot().metrics_listener_up);
        assert!(
            wait(Duration::from_secs(5), || m
                .snapshot()
                .metrics_bind_failures
                >= 2),
            "the bind is retried"
        );
        drop(holder);
        assert!(
            wait(BIND_RETRY_MAX * 3, || m.server_addr() == Some(addr)),
            "not bound once the port was free"
        );
        let out = get(addr, b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n");
        assert!(out.contains("\ncairn_metrics_listener_up 1\n"), "{out}");
        let failures = m.snapshot().metrics_bind_failures;
        assert!(
            out.contains(&format!("\ncairn_metrics_bind_failures_total {failures}\n")),
            "{out}"
        );
        m.stop_server();
        t.join().unwrap();
    }

    #[test]
    fn stopping_a_server_that_waits_for_its_port_ends_its_thread() {
        let holder = TcpListener::bind("127.0.0.1:0").unwrap();
        let m = Metrics::new();
        let t = serve(holder.local_addr().unwrap(), m.clone()).unwrap();
        m.stop_server();
        let stopped = Instant::now();
        t.join().unwrap();
        assert!(stopped.elapsed() < Duration::from_secs(2));
        assert_eq!(m.server_addr(), None);
    }

    fn wait(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
        let until = Instant::now() + timeout;
        while Instant::now() < until {
            if cond() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        cond()
    }

    #[test]
    fn the_server_answers_metrics_status_404_and_refuses_oversized_requests() {
        let m = Metrics::new();
        m.update(|f| f.received = 42);
        let t = serve("127.0.0.1:0".parse().unwrap(), m.clone()).unwrap();
        let addr = m.server_addr().unwrap();
        let get = |req: &[u8]| get(addr, req);
        let ok = get(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n");
        assert!(ok.starts_with("HTTP/1.1 200 OK"), "{ok}");
        assert!(ok.contains("text/plain; version=0.0.4"), "{ok}");
        assert!(ok.contains("\ncairn_received_total 42\n"), "{ok}");
        let status = get(b"GET /status.json HTTP/1.1\r\n\r\n");
        assert!(status.starts_with("HTTP/1.1 200 OK"), "{status}");
        assert!(status.contains("application/json"), "{status}");
        let body = status.split_once("\r\n\r\n").unwrap().1;
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["metrics"]["cairn_received_total"], 42, "{v}");
        assert!(get(b"GET / HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 404"));
        let big = vec![b'a'; MAX_REQUEST_BYTES + 10];
        assert!(get(&big).starts_with("HTTP/1.1 431"));
        assert!(serve("0.0.0.0:0".parse().unwrap(), m.clone()).is_err());
        m.stop_server();
        t.join().unwrap();
    }
}
