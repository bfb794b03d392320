//! A loopback TCP proxy whose client → broker direction can be held: while held, nothing the
//! agent sends (PUBACKs for inputs, its own PUBLISHes, pings) reaches the broker, but the
//! broker → agent direction keeps flowing. That freezes the agent's results in its outbox
//! without stopping its ingest, so a SIGKILL then leaves every one of them unsent.
//! [`Gate::cut`] closes every connection and drops whatever was held.

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

#[derive(Default)]
struct Shared {
    stop: AtomicBool,
    hold_upstream: AtomicBool,
    conns: Mutex<Vec<TcpStream>>,
}

pub struct Gate {
    port: u16,
    shared: Arc<Shared>,
    accept: Option<JoinHandle<()>>,
}

impl Gate {
    pub fn start(target_port: u16) -> Gate {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind gate");
        let port = listener.local_addr().expect("gate addr").port();
        listener.set_nonblocking(true).expect("nonblocking gate");
        let shared = Arc::new(Shared::default());
        let s = shared.clone();
        let accept = std::thread::spawn(move || accept_loop(listener, target_port, s));
        Gate {
            port,
            shared,
            accept: Some(accept),
        }
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Stop (true) or resume (false) forwarding what clients send to the broker.
    pub fn hold_upstream(&self, hold: bool) {
        self.shared.hold_upstream.store(hold, Ordering::SeqCst);
    }

    /// Close every current connection; bytes held back are dropped with it.
    pub fn cut(&self) {
        for c in std::mem::take(&mut *self.shared.conns.lock().unwrap()) {
            let _ = c.shutdown(Shutdown::Both);
        }
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.cut();
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
    }
}

fn accept_loop(listener: TcpListener, target: u16, shared: Arc<Shared>) {
    while !shared.stop.load(Ordering::SeqCst) {
        let client = match listener.accept() {
            Ok((c, _)) => c,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(2));
                continue;
            }
            Err(_) => continue,
        };
        let _ = client.set_nonblocking(false);
        let Ok(server) = TcpStream::connect(("127.0.0.1", target)) else {
            let _ = client.shutdown(Shutdown::Both);
            continue;
        };
        let _ = client.set_nodelay(true);
        let _ = server.set_nodelay(true);
        let (Ok(c1), Ok(s1), Ok(c2), Ok(s2)) = (
            client.try_clone(),
            server.try_clone(),
            client.try_clone(),
            server.try_clone(),
        ) else {
            continue;
        };
        shared.conns.lock().unwrap().extend([c1, s1]);
        let up = shared.clone();
        std::thread::spawn(move || pipe(client, server, Some(up)));
        std::thread::spawn(move || pipe(s2, c2, None));
    }
}

/// Copies `from` → `to`; while `hold` says so, stops reading `from` (the bytes wait in the
/// kernel's socket buffer and die with the connection if it is cut).
fn pipe(mut from: TcpStream, mut to: TcpStream, hold: Option<Arc<Shared>>) {
    let mut buf = [0u8; 16 * 1024];
    loop {
        if let Some(h) = &hold {
            while h.hold_upstream.load(Ordering::SeqCst) && !h.stop.load(Ordering::SeqCst) {
                // Notice a cut while holding: a zero-timeout peek fails once shut down.
                let _ = from.set_read_timeout(Some(Duration::from_millis(1)));
                let mut probe = [0u8; 1];
                match from.peek(&mut probe) {
                    Ok(0) => return close(&from, &to),
                    Err(e)
                        if e.kind() != ErrorKind::WouldBlock && e.kind() != ErrorKind::TimedOut =>
                    {
                        return close(&from, &to);
                    }
                    _ => {}
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            let _ = from.set_read_timeout(Some(Duration::from_millis(20)));
        }
        match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::TimedOut => {}
            Err(_) => break,
        }
    }
    close(&from, &to);
}

fn close(from: &TcpStream, to: &TcpStream) {
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
}
