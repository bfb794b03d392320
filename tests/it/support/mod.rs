//! Shared helpers for the integration tests (`tests/it`) and the benches: a private
//! mosquitto per test (the one broker wrapper), a TCP proxy that can cut connections, a test
//! publisher and a retained-message collector, certificates and password files, signals;
//! [`agent`] is the one wrapper of the `cairn` process and its config. Benches include this
//! module by `#[path]`; not every bench uses every helper.
//!
//! Everything listens on 127.0.0.1 only. Missing tools (`mosquitto`, `openssl`) make the test
//! panic with the install command: a test that silently skips proves nothing.
//!
//! Why ~690 lines: the one harness every test and bench shares (broker, proxy, collector,
//! certificates, publishing); the agent wrapper is in `agent.rs`, the power cut in
//! `powercut.rs`, the central broker in `central.rs`.
#![allow(dead_code)]

pub mod agent;
pub mod central;
pub mod nats;
pub mod pg;
pub mod powercut;

use std::collections::BTreeMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long a broker may take to accept connections after start.
const BROKER_START_TIMEOUT: Duration = Duration::from_secs(10);

/// Routes `log` output to the test harness (shown for failing tests; `RUST_LOG` filters).
pub fn init_log() {
    let _ = env_logger::builder().is_test(true).try_init();
}

/// Polls `cond` every 5 ms until it holds or `timeout` passes; returns whether it held.
pub fn wait_until(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Sends `sig` (a name such as `TERM`, `HUP`, or a number) to `pid`. No libc in the tests:
/// `kill` is on every box. Returns whether `kill` succeeded.
pub fn signal(pid: u32, sig: &str) -> bool {
    Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status()
        .is_ok_and(|s| s.success())
}

/// A client id no other test client in this process uses.
pub fn unique_id(prefix: &str) -> String {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, Ordering::SeqCst);
    format!("{prefix}-{}-{n}", std::process::id())
}

/// A loopback port that was free a moment ago.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("bind an ephemeral loopback port")
        .port()
}

/// Settings of a connection made by `cairn::mqtt` directly (no agent) to a test broker:
/// fast reconnects (50 ms to 400 ms), a 5 s keep-alive (the shortest rumqttc's MQTT 5 client
/// takes), anonymous, plain TCP. Logging goes to the test harness.
pub fn mqtt_config(port: u16, client_id: &str) -> cairn::config::MqttConfig {
    init_log();
    cairn::config::MqttConfig {
        host: "127.0.0.1".into(),
        port,
        client_id: client_id.into(),
        keep_alive: Duration::from_secs(5),
        username: None,
        password_file: None,
        tls: None,
        ingest_batch: 20,
        reconnect_min: Duration::from_millis(50),
        reconnect_max: Duration::from_millis(400),
        channel_capacity: 256,
        will: None,
    }
}

/// Finds a tool on PATH or in the sbin directories (mosquitto lives in /usr/sbin).
fn find_tool(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/usr/local/sbin", "/sbin"].map(PathBuf::from))
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}

fn require_tool(name: &str, install: &str) -> PathBuf {
    find_tool(name).unwrap_or_else(|| {
        panic!("`{name}` is not installed (looked on PATH and in /usr/sbin); install it with `{install}`")
    })
}

pub fn mosquitto_bin() -> PathBuf {
    require_tool("mosquitto", "apt-get install mosquitto mosquitto-clients")
}

/// Extra broker settings; [`Default`] is an anonymous plain-TCP broker.
#[derive(Debug, Clone)]
pub struct BrokerConfig {
    pub allow_anonymous: bool,
    /// A file made by [`password_file`].
    pub password_file: Option<PathBuf>,
    /// Serve TLS on the listener with these files.
    pub tls: Option<Certs>,
    /// `max_inflight_messages`: how many QoS 1 messages a subscriber may hold unacknowledged.
    pub max_inflight: u32,
    /// `autosave_interval` in seconds.
    pub autosave_interval_s: u32,
    /// `log_type` lines; the log feeds assertion messages and [`Broker::connections`] (which
    /// needs `notice`). A benchmark logs less so that logging does not cost throughput.
    pub log_types: Vec<&'static str>,
    /// Raw lines appended to `mosquitto.conf` (options not set above: mosquitto refuses some
    /// options given twice).
    pub extra: Vec<String>,
}

impl Default for BrokerConfig {
    fn default() -> Self {
        BrokerConfig {
            allow_anonymous: true,
            password_file: None,
            tls: None,
            max_inflight: 20,
            autosave_interval_s: 1,
            log_types: vec!["all"],
            extra: Vec::new(),
        }
    }
}

/// A private mosquitto on a free loopback port, with persistence in its own temp dir.
/// Dropping it kills the broker.
pub struct Broker {
    dir: tempfile::TempDir,
    port: u16,
    child: Option<Child>,
}

impl Broker {
    pub fn start() -> Broker {
        Broker::start_with(BrokerConfig::default())
    }

    pub fn start_with(cfg: BrokerConfig) -> Broker {
        mosquitto_bin(); // fail early, with the install hint
        let dir = tempfile::tempdir().expect("broker temp dir");
        let port = free_port();
        let data = dir.path().join("data");
        std::fs::create_dir(&data).expect("broker data dir");
        let mut conf = format!(
            "listener {port} 127.0.0.1\n\
             allow_anonymous {}\n\
             persistence true\n\
             persistence_location {}/\n\
             autosave_interval {}\n\
             max_queued_messages 1000000\n\
             max_inflight_messages {}\n\
             log_dest file {}\n",
            cfg.allow_anonymous,
            data.display(),
            cfg.autosave_interval_s,
            cfg.max_inflight,
            dir.path().join("mosquitto.log").display(),
        );
        for t in &cfg.log_types {
            conf.push_str(&format!("log_type {t}\n"));
        }
        if let Some(tls) = &cfg.tls {
            conf.push_str(&format!(
                "cafile {}\ncertfile {}\nkeyfile {}\n",
                tls.ca.display(),
                tls.server_cert.display(),
                tls.server_key.display()
            ));
        }
        if let Some(file) = &cfg.password_file {
            conf.push_str(&format!("password_file {}\n", file.display()));
        }
        if running_as_root() {
            // Otherwise mosquitto drops to user `mosquitto`, which cannot write our temp dir.
            conf.push_str("user root\n");
        }
        for line in &cfg.extra {
            conf.push_str(line);
            conf.push('\n');
        }
        std::fs::write(dir.path().join("mosquitto.conf"), conf).expect("write mosquitto.conf");
        let mut broker = Broker {
            dir,
            port,
            child: None,
        };
        broker.spawn();
        broker
    }

    fn spawn(&mut self) {
        let child = Command::new(mosquitto_bin())
            .arg("-c")
            .arg(self.dir.path().join("mosquitto.conf"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn mosquitto");
        self.child = Some(child);
        let port = self.port;
        let up = wait_until(BROKER_START_TIMEOUT, || {
            if let Some(Ok(Some(status))) = self.child.as_mut().map(|c| c.try_wait()) {
                panic!("mosquitto exited at start ({status}); log:\n{}", self.log());
            }
            TcpStream::connect(("127.0.0.1", port)).is_ok()
        });
        assert!(
            up,
            "mosquitto did not listen on {port}; log:\n{}",
            self.log()
        );
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The broker's log so far (for assertion messages).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("mosquitto.log")).unwrap_or_default()
    }

    /// The last `n` lines of the broker's log that name `client_id`: what it sent that
    /// client and what it heard back (for a failure message about a stalled client).
    pub fn log_tail_of(&self, client_id: &str, n: usize) -> String {
        let log = self.log();
        let lines: Vec<&str> = log.lines().filter(|l| l.contains(client_id)).collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// How often the broker logged a new connection for `client_id` (needs `notice` logging).
    pub fn connections(&self, client_id: &str) -> usize {
        let needle = format!(" as {client_id} ");
        self.log()
            .lines()
            .filter(|l| l.contains("New client connected") && l.contains(&needle))
            .count()
    }

    /// The broker's process id while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// SIGKILL: no final save, like a power cut of the broker.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERM and wait: mosquitto saves its persistence file and exits. Sent again every
    /// half second: mosquitto listens before it enters its main loop, which sets its `run`
    /// flag, so a SIGTERM soon after the port answers can be lost (a test hung 45 minutes in
    /// `wait` on that). SIGKILL and a panic if it is still up after 30 s.
    pub fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            signal(child.id(), "TERM");
            let resend = Instant::now() + Duration::from_millis(500);
            while Instant::now() < resend {
                if !matches!(child.try_wait(), Ok(None)) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        let _ = child.kill();
        let _ = child.wait();
        panic!(
            "mosquitto (port {}) did not exit on SIGTERM within 30 s",
            self.port
        );
    }

    /// SIGTERM (mosquitto saves its persistence file), then start again on the same port
    /// with the same persistence directory: a broker restarted by its operator.
    pub fn restart_clean(&mut self) {
        self.stop();
        self.spawn();
    }

    /// Starts again on the same port with the same persistence directory.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    pub fn is_running(&mut self) -> bool {
        matches!(self.child.as_mut().map(|c| c.try_wait()), Some(Ok(None)))
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        self.kill();
    }
}

fn running_as_root() -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self")
        .map(|m| m.uid() == 0)
        .unwrap_or(false)
}

/// A password file for mosquitto (`mosquitto_passwd -b -c`), written into `dir`.
pub fn password_file(dir: &Path, user: &str, password: &str) -> PathBuf {
    let tool = require_tool("mosquitto_passwd", "apt-get install mosquitto");
    let file = dir.join("mosquitto.passwd");
    let out = Command::new(tool)
        .arg("-b")
        .arg("-c")
        .arg(&file)
        .arg(user)
        .arg(password)
        .output()
        .expect("run mosquitto_passwd");
    assert!(
        out.status.success(),
        "mosquitto_passwd failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    file
}

/// A throwaway CA and a server certificate for 127.0.0.1, made with the `openssl` CLI.
#[derive(Debug, Clone)]
pub struct Certs {
    pub ca: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
}

impl Certs {
    pub fn generate(dir: &Path) -> Certs {
        let openssl = require_tool("openssl", "apt-get install openssl");
        let run = |args: &[&str]| {
            let out = Command::new(&openssl)
                .args(args)
                .current_dir(dir)
                .output()
                .expect("run openssl");
            assert!(
                out.status.success(),
                "openssl {args:?} failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        run(&[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=cairn test CA",
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
        ]);
        run(&[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            "/CN=127.0.0.1",
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
        ]);
        std::fs::write(
            dir.join("server.ext"),
            "subjectAltName=IP:127.0.0.1,DNS:localhost\n\
             basicConstraints=CA:FALSE\n\
             keyUsage=digitalSignature,keyEncipherment\n\
             extendedKeyUsage=serverAuth\n",
        )
        .expect("write server.ext");
        run(&[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            "server.ext",
            "-out",
            "server.pem",
        ]);
        Certs {
            ca: dir.join("ca.pem"),
            server_cert: dir.join("server.pem"),
            server_key: dir.join("server.key"),
        }
    }
}

/// A TCP proxy on a free loopback port that forwards to `127.0.0.1:target`, and can cut
/// every current connection, refuse new ones, or hold the client → target direction (see
/// [`Proxy::hold_upstream`]). Dropping it stops it.
pub struct Proxy {
    port: u16,
    shared: Arc<ProxyShared>,
    accept: Option<JoinHandle<()>>,
}

#[derive(Default)]
struct ProxyShared {
    stop: AtomicBool,
    paused: AtomicBool,
    hold_upstream: AtomicBool,
    /// Connections accepted so far, refused ones included (counts client attempts).
    accepted: AtomicUsize,
    /// Both ends of every live connection, so `cut` can shut them down.
    conns: Mutex<Vec<TcpStream>>,
}

impl Proxy {
    pub fn start(target_port: u16) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind proxy");
        let port = listener.local_addr().expect("proxy addr").port();
        listener.set_nonblocking(true).expect("nonblocking proxy");
        let shared = Arc::new(ProxyShared::default());
        let accept_shared = shared.clone();
        let accept = std::thread::spawn(move || accept_loop(listener, target_port, accept_shared));
        Proxy {
            port,
            shared,
            accept: Some(accept),
        }
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Closes every current connection (both directions, both sides).
    pub fn cut(&self) {
        let conns = std::mem::take(&mut *self.shared.conns.lock().unwrap());
        for c in conns {
            let _ = c.shutdown(Shutdown::Both);
        }
    }

    /// Connection attempts seen so far (including those refused while paused).
    pub fn accepted(&self) -> usize {
        self.shared.accepted.load(Ordering::SeqCst)
    }

    /// While paused, new connections are accepted and closed at once.
    pub fn pause(&self, paused: bool) {
        self.shared.paused.store(paused, Ordering::SeqCst);
    }

    /// Stop (true) or resume (false) forwarding what clients send to the target, while the
    /// target → client direction keeps flowing: an agent then still ingests, but none of its
    /// PUBACKs, PUBLISHes or pings reach the broker. Held bytes wait in the kernel's socket
    /// buffer and die with the connection if it is cut.
    pub fn hold_upstream(&self, hold: bool) {
        self.shared.hold_upstream.store(hold, Ordering::SeqCst);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.cut();
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
    }
}

fn accept_loop(listener: TcpListener, target: u16, shared: Arc<ProxyShared>) {
    while !shared.stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((client, _)) => {
                shared.accepted.fetch_add(1, Ordering::SeqCst);
                if shared.paused.load(Ordering::SeqCst) {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                }
                let _ = client.set_nonblocking(false);
                let Ok(server) = TcpStream::connect(("127.0.0.1", target)) else {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                let clones = (
                    client.try_clone(),
                    server.try_clone(),
                    client.try_clone(),
                    server.try_clone(),
                );
                let (Ok(c1), Ok(s1), Ok(c2), Ok(s2)) = clones else {
                    continue;
                };
                {
                    let mut conns = shared.conns.lock().unwrap();
                    conns.push(c1);
                    conns.push(s1);
                }
                let up = shared.clone();
                std::thread::spawn(move || pipe(client, server, Some(up)));
                std::thread::spawn(move || pipe(s2, c2, None));
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(_) => std::thread::sleep(Duration::from_millis(2)),
        }
    }
}

/// Copies `from` → `to` until either side closes, then closes both. With `hold`, stops
/// reading `from` while the proxy holds the upstream direction, and keeps back what a read
/// returned if the hold began during it (a read waits up to 20 ms): forwarded after the
/// hold, dropped if the connection closes meanwhile.
fn pipe(mut from: TcpStream, mut to: TcpStream, hold: Option<Arc<ProxyShared>>) {
    let mut buf = [0u8; 16 * 1024];
    loop {
        if let Some(h) = &hold {
            if !wait_while_held(&from, h) {
                return close_both(&from, &to);
            }
            let _ = from.set_read_timeout(Some(Duration::from_millis(20)));
        }
        match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                if let Some(h) = &hold
                    && !wait_while_held(&from, h)
                {
                    return close_both(&from, &to);
                }
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::TimedOut => {}
            Err(_) => break,
        }
    }
    close_both(&from, &to);
}

/// Waits while the proxy holds the upstream direction; false once `from` is closed or cut
/// meanwhile (a short peek fails once the socket is shut down, or reads its end).
fn wait_while_held(from: &TcpStream, h: &ProxyShared) -> bool {
    while h.hold_upstream.load(Ordering::SeqCst) && !h.stop.load(Ordering::SeqCst) {
        let _ = from.set_read_timeout(Some(Duration::from_millis(1)));
        let mut probe = [0u8; 1];
        match from.peek(&mut probe) {
            Ok(0) => return false,
            Err(e) if e.kind() != ErrorKind::WouldBlock && e.kind() != ErrorKind::TimedOut => {
                return false;
            }
            _ => {}
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    true
}

fn close_both(from: &TcpStream, to: &TcpStream) {
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
}

/// Publishes QoS 1 messages with a separate rumqttc client and waits for every PUBACK.
pub fn publish_all(port: u16, messages: &[(String, Vec<u8>, bool)]) {
    use rumqttc::{Client, Event, MqttOptions, Packet, QoS};
    let id = unique_id("test-pub");
    let mut opts = MqttOptions::new(id, "127.0.0.1", port);
    opts.set_keep_alive(Duration::from_secs(5))
        .set_max_packet_size(1 << 20, 1 << 20)
        .set_inflight(100);
    let (client, mut conn) = Client::new(opts, 64);
    let total = messages.len();
    let reader = std::thread::spawn(move || {
        let mut acked = 0;
        let deadline = Instant::now() + Duration::from_secs(30);
        while acked < total && Instant::now() < deadline {
            match conn.recv_timeout(Duration::from_millis(100)) {
                Ok(Ok(Event::Incoming(Packet::PubAck(_)))) => acked += 1,
                Ok(Ok(_)) => {}
                Ok(Err(e)) => panic!("test publisher lost its connection: {e}"),
                Err(_) => {}
            }
        }
        acked
    });
    for (topic, payload, retain) in messages {
        client
            .publish(topic.clone(), QoS::AtLeastOnce, *retain, payload.clone())
            .expect("queue test publish");
    }
    let acked = reader.join().expect("test publisher thread");
    assert_eq!(
        acked, total,
        "test publisher got {acked} of {total} PUBACKs"
    );
    let _ = client.disconnect();
}

/// One message as seen by a [`Collector`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    pub topic: String,
    pub payload: Vec<u8>,
    pub retain: bool,
}

/// Subscribes (QoS 1, clean session) to a filter and records every message, plus the latest
/// payload per topic (the retained view). Stops on drop.
pub struct Collector {
    seen: Arc<Mutex<Vec<Seen>>>,
    latest: Arc<Mutex<BTreeMap<String, Vec<u8>>>>,
    client: rumqttc::Client,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Collector {
    /// Returns once the broker confirmed the subscription (retained messages follow).
    pub fn start(port: u16, filter: &str) -> Collector {
        use rumqttc::{Client, Event, MqttOptions, Packet, QoS};
        let id = unique_id("test-sub");
        let mut opts = MqttOptions::new(id, "127.0.0.1", port);
        opts.set_keep_alive(Duration::from_secs(5))
            .set_max_packet_size(1 << 20, 1 << 20);
        let (client, mut conn) = Client::new(opts, 64);
        client
            .subscribe(filter, QoS::AtLeastOnce)
            .expect("queue test subscribe");
        let seen = Arc::new(Mutex::new(Vec::new()));
        let latest = Arc::new(Mutex::new(BTreeMap::new()));
        let subscribed = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let (seen2, latest2, subscribed2) = (seen.clone(), latest.clone(), subscribed.clone());
        let stop2 = stop.clone();
        let thread = std::thread::spawn(move || {
            while !stop2.load(Ordering::SeqCst) {
                let Ok(event) = conn.recv_timeout(Duration::from_millis(50)) else {
                    continue;
                };
                match event {
                    Ok(Event::Incoming(Packet::SubAck(_))) => {
                        subscribed2.store(true, Ordering::SeqCst)
                    }
                    Ok(Event::Incoming(Packet::Publish(p))) => {
                        latest2
                            .lock()
                            .unwrap()
                            .insert(p.topic.clone(), p.payload.to_vec());
                        seen2.lock().unwrap().push(Seen {
                            topic: p.topic,
                            payload: p.payload.to_vec(),
                            retain: p.retain,
                        });
                    }
                    Ok(Event::Outgoing(rumqttc::Outgoing::Disconnect)) => break,
                    Ok(_) => {}
                    Err(_) => std::thread::sleep(Duration::from_millis(50)),
                }
            }
        });
        assert!(
            wait_until(Duration::from_secs(10), || subscribed
                .load(Ordering::SeqCst)),
            "test collector did not get its SUBACK"
        );
        Collector {
            seen,
            latest,
            client,
            stop,
            thread: Some(thread),
        }
    }

    pub fn messages(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    /// Latest payload per topic.
    pub fn latest(&self) -> BTreeMap<String, Vec<u8>> {
        self.latest.lock().unwrap().clone()
    }

    pub fn wait_for_count(&self, n: usize, timeout: Duration) -> bool {
        wait_until(timeout, || self.seen.lock().unwrap().len() >= n)
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        let _ = self.client.try_disconnect();
        std::thread::sleep(Duration::from_millis(20));
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// One MQTT packet from a scripted broker's client: the fixed header's first byte and the
/// body (`None` at the end of the stream). For tests that play a broker on loopback
/// (`mqtt_flow.rs`, `reused_ids.rs`).
pub fn read_mqtt_packet(s: &mut std::net::TcpStream) -> Option<(u8, Vec<u8>)> {
    use std::io::Read;
    let mut head = [0u8; 1];
    s.read_exact(&mut head).ok()?;
    let (mut len, mut shift) = (0usize, 0);
    loop {
        let mut b = [0u8; 1];
        s.read_exact(&mut b).ok()?;
        len |= usize::from(b[0] & 0x7f) << shift;
        shift += 7;
        if b[0] & 0x80 == 0 || shift > 21 {
            break;
        }
    }
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).ok()?;
    Some((head[0], body))
}
