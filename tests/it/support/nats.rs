//! Private `nats-server` processes with JetStream for the sink tests (issue 30): one node, or
//! a three-node cluster (routes between them, its own store directory each) for replicated
//! streams. Every server listens on free 127.0.0.1 ports, and is killed when dropped.
//!
//! Reading and making streams goes through `async_nats` on a runtime of the test's own: the
//! crate's client, so what a test sees is what a consumer would.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use async_nats::jetstream;

use super::{free_port, require_tool};

pub fn nats_bin() -> PathBuf {
    require_tool("nats-server", "apt-get install nats-server")
}

/// One `nats-server`: its ports, config and store; stopped and started again at will.
pub struct NatsNode {
    pub name: String,
    pub port: u16,
    conf: PathBuf,
    log: PathBuf,
    child: Option<Child>,
}

impl NatsNode {
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    pub fn start(&mut self) {
        assert!(self.child.is_none(), "{} is running already", self.name);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("nats log");
        let child = Command::new(nats_bin())
            .arg("-c")
            .arg(&self.conf)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start nats-server");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(15);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "nats-server {} did not listen on {}: {}",
                self.name,
                self.port,
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILL: no goodbye to the cluster, as a power cut of the node.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for NatsNode {
    fn drop(&mut self) {
        self.kill();
    }
}

/// One node or a cluster of them, in a temporary directory.
pub struct Nats {
    pub nodes: Vec<NatsNode>,
    _dir: tempfile::TempDir,
}

fn write_conf(dir: &Path, name: &str, port: u16, cluster: Option<(u16, &[u16])>) -> PathBuf {
    let store = dir.join(format!("store-{name}"));
    let mut conf = format!(
        "server_name: {name}\nlisten: 127.0.0.1:{port}\n\
         jetstream {{\n  store_dir: \"{}\"\n  max_memory_store: 64MB\n  max_file_store: 2GB\n}}\n",
        store.display()
    );
    if let Some((cport, all)) = cluster {
        let routes: Vec<String> = all
            .iter()
            .filter(|p| **p != cport)
            .map(|p| format!("nats-route://127.0.0.1:{p}"))
            .collect();
        conf.push_str(&format!(
            "cluster {{\n  name: cairn-test\n  listen: 127.0.0.1:{cport}\n  routes: [{}]\n}}\n",
            routes.join(", ")
        ));
    }
    let path = dir.join(format!("{name}.conf"));
    std::fs::write(&path, conf).expect("write nats conf");
    path
}

impl Nats {
    /// One node with JetStream.
    pub fn single() -> Nats {
        let dir = tempfile::tempdir().expect("nats dir");
        let port = free_port();
        let conf = write_conf(dir.path(), "n1", port, None);
        let mut node = NatsNode {
            name: "n1".into(),
            port,
            conf,
            log: dir.path().join("n1.log"),
            child: None,
        };
        node.start();
        Nats {
            nodes: vec![node],
            _dir: dir,
        }
    }

    /// Three nodes in one cluster; returns once JetStream has a meta leader (a stream can be
    /// made).
    pub fn cluster() -> Nats {
        let dir = tempfile::tempdir().expect("nats dir");
        let cports: Vec<u16> = (0..3).map(|_| free_port()).collect();
        let mut nodes = Vec::new();
        for (i, cport) in cports.iter().enumerate() {
            let name = format!("n{}", i + 1);
            let port = free_port();
            let conf = write_conf(dir.path(), &name, port, Some((*cport, &cports)));
            nodes.push(NatsNode {
                log: dir.path().join(format!("{name}.log")),
                name,
                port,
                conf,
                child: None,
            });
        }
        for n in &mut nodes {
            n.start();
        }
        Nats { nodes, _dir: dir }
    }

    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(NatsNode::url).collect()
    }

    /// Every server's log, for an assertion message.
    pub fn logs(&self) -> String {
        self.nodes
            .iter()
            .map(|n| format!("--- {}\n{}", n.name, n.log_text()))
            .collect()
    }

    /// Make a stream, retrying while the cluster elects its leaders.
    pub fn create_stream(&self, name: &str, subjects: &[&str], replicas: usize, window: Duration) {
        let urls = self.urls();
        let result = block_on(async {
            let client = connect(&urls).await;
            let js = jetstream::new(client);
            let cfg = jetstream::stream::Config {
                name: name.to_string(),
                subjects: subjects.iter().map(|s| s.to_string()).collect(),
                num_replicas: replicas,
                duplicate_window: window,
                storage: jetstream::stream::StorageType::File,
                ..Default::default()
            };
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                match js.create_stream(cfg.clone()).await {
                    Ok(_) => return Ok(()),
                    Err(e) if Instant::now() < deadline => {
                        let _ = e;
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                    Err(e) => return Err(e.to_string()),
                }
            }
        });
        if let Err(e) = result {
            panic!("create stream {name}: {e}\n{}", self.logs());
        }
    }

    /// The index in `nodes` of the stream's leader (the node that orders its writes).
    pub fn stream_leader(&self, stream: &str) -> usize {
        let urls: Vec<String> = self.urls();
        let leader = block_on(async {
            let js = jetstream::new(connect(&urls).await);
            let mut s = js.get_stream(stream).await.expect("get stream");
            let info = s.info().await.expect("stream info");
            info.cluster.as_ref().and_then(|c| c.leader.clone())
        })
        .expect("a clustered stream has a leader");
        self.nodes
            .iter()
            .position(|n| n.name == leader)
            .unwrap_or_else(|| panic!("leader {leader} is none of the nodes"))
    }

    /// Every message of the stream in order: (subject, `Nats-Msg-Id`, data).
    pub fn messages(&self, stream: &str) -> Vec<(String, String, Vec<u8>)> {
        let urls: Vec<String> = self
            .nodes
            .iter()
            .filter(|n| n.is_running())
            .map(NatsNode::url)
            .collect();
        block_on(async {
            let client = connect(&urls).await;
            let js = jetstream::new(client);
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                match read_all(&js, stream).await {
                    Ok(all) => return all,
                    Err(e) => {
                        assert!(Instant::now() < deadline, "read stream {stream}: {e}");
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                }
            }
        })
    }
}

async fn read_all(
    js: &jetstream::Context,
    stream: &str,
) -> Result<Vec<(String, String, Vec<u8>)>, String> {
    let mut s = js.get_stream(stream).await.map_err(|e| e.to_string())?;
    let info = s.info().await.map_err(|e| e.to_string())?;
    let (first, last) = (info.state.first_sequence, info.state.last_sequence);
    let mut out = Vec::new();
    if info.state.messages == 0 {
        return Ok(out);
    }
    for seq in first..=last {
        let m = s.get_raw_message(seq).await.map_err(|e| e.to_string())?;
        let id = m
            .headers
            .get(async_nats::header::NATS_MESSAGE_ID)
            .map(|v| v.as_str().to_string())
            .unwrap_or_default();
        out.push((m.subject.to_string(), id, m.payload.to_vec()));
    }
    Ok(out)
}

async fn connect(urls: &[String]) -> async_nats::Client {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        match async_nats::connect(urls.to_vec()).await {
            Ok(c) => return c,
            Err(e) => {
                assert!(Instant::now() < deadline, "connect to {urls:?}: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// Run a future on a runtime of its own (tests are plain threads).
pub fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("test runtime")
        .block_on(f)
}
