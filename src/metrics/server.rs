//! The loopback HTTP/1.1 server for `/metrics` and `/status.json` (bounds in the module
//! docs of [`super`]).

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::{MAX_HANDLERS, MAX_REQUEST_BYTES, Metrics, REQUEST_DEADLINE, lock};

/// Serve `GET /metrics` and `GET /status.json` on `addr` (loopback only) from one thread.
pub fn serve(addr: SocketAddr, metrics: Arc<Metrics>) -> io::Result<JoinHandle<()>> {
    if !addr.ip().is_loopback() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("metrics listen address {addr} is not loopback"),
        ));
    }
    let listener = TcpListener::bind(addr)?;
    *lock(&metrics.server) = Some(listener.local_addr()?);
    std::thread::Builder::new()
        .name("cairn-metrics".into())
        .spawn(move || {
            for conn in listener.incoming() {
                if metrics.stop.load(Ordering::SeqCst) {
                    break;
                }
                match conn {
                    Ok(stream) => dispatch(stream, &metrics),
                    Err(e) => {
                        // e.g. EMFILE: back off instead of spinning.
                        log::warn!("metrics: accept: {e}");
                        std::thread::sleep(Duration::from_millis(100));
                    }
                }
            }
        })
}

/// Give the connection a handler thread of its own, or answer 503 when [`MAX_HANDLERS`] are
/// busy, so the accepting thread never waits on a client.
fn dispatch(stream: TcpStream, metrics: &Arc<Metrics>) {
    let deadline = Instant::now() + REQUEST_DEADLINE;
    let busy = metrics
        .handlers
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
            (n < MAX_HANDLERS).then_some(n + 1)
        })
        .is_err();
    if busy {
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
    }
    let m = metrics.clone();
    let spawned = std::thread::Builder::new()
        .name("cairn-metrics-conn".into())
        .spawn(move || {
            if let Err(e) = handle(stream, &m, deadline) {
                log::debug!("metrics: connection: {e}");
            }
            m.handlers.fetch_sub(1, Ordering::SeqCst);
        });
    if let Err(e) = spawned {
        metrics.handlers.fetch_sub(1, Ordering::SeqCst);
        log::warn!("metrics: cannot start a handler thread: {e}");
    }
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

fn handle(mut stream: TcpStream, metrics: &Metrics, deadline: Instant) -> io::Result<()> {
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
    let head = String::from_utf8_lossy(&buf[..head_end]);
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
fn respond(
    stream: &mut TcpStream,
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
            let request = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n";
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
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
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

    #[test]
    fn more_connections_than_handlers_get_503_while_a_slot_frees_within_the_deadline() {
        let m = Metrics::new();
        let t = serve("127.0.0.1:0".parse().unwrap(), m.clone()).unwrap();
        let addr = m.server_addr().unwrap();
        // Idle clients fill every handler.
        let idle: Vec<TcpStream> = (0..MAX_HANDLERS)
            .map(|_| TcpStream::connect(addr).unwrap())
            .collect();
        std::thread::sleep(Duration::from_millis(200));
        let get = || {
            let mut s = TcpStream::connect(addr).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            s.write_all(b"GET /metrics HTTP/1.1\r\n\r\n").unwrap();
            let mut out = String::new();
            let _ = s.read_to_string(&mut out);
            out
        };
        let busy = get();
        assert!(busy.starts_with("HTTP/1.1 503"), "{busy}");
        // The idle ones are cut at the deadline, and scrapes are served again.
        std::thread::sleep(REQUEST_DEADLINE + Duration::from_millis(300));
        let ok = get();
        assert!(ok.starts_with("HTTP/1.1 200 OK"), "{ok}");
        drop(idle);
        m.stop_server();
        t.join().unwrap();
    }

    #[test]
    fn the_server_answers_metrics_status_404_and_refuses_oversized_requests() {
        let m = Metrics::new();
        m.update(|f| f.received = 42);
        let t = serve("127.0.0.1:0".parse().unwrap(), m.clone()).unwrap();
        let addr = m.server_addr().unwrap();
        let get = |req: &[u8]| {
            let mut s = TcpStream::connect(addr).unwrap();
            let _ = s.write_all(req);
            let mut out = String::new();
            let _ = s.read_to_string(&mut out);
            out
        };
        let ok = get(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
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
