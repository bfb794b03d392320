//! Node-RED 4 (from npm, under `target/node-red`; `benches/install-node-red.sh` installs it
//! when missing): mqtt in → keyed sum in a `localfilesystem` context store → mqtt out.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::measure::System;
use crate::procs::{Proc, Stats};
use crate::support::{Broker, free_port, wait_until};

/// Node-RED's `localfilesystem` context flush interval, seconds (its default).
pub(crate) const NODE_RED_FLUSH_S: u64 = 30;

pub(crate) struct NodeRed {
    pub(crate) red_js: PathBuf,
    pub(crate) user_dir: PathBuf,
    pub(crate) client_id: String,
    pub(crate) proc: Option<Proc>,
}

impl NodeRed {
    pub(crate) fn new(root: &Path, red_js: PathBuf, broker_port: u16, name: &str) -> NodeRed {
        let user_dir = root.join(name);
        let _ = std::fs::remove_dir_all(&user_dir);
        std::fs::create_dir_all(&user_dir).expect("node-red user dir");
        let client_id = format!("cmp_{name}_{}", std::process::id());
        let settings = format!(
            "module.exports = {{\n  uiHost: \"127.0.0.1\",\n  uiPort: {},\n  \
             flowFile: \"flows.json\",\n  credentialSecret: false,\n  \
             httpAdminRoot: false,\n  httpNodeRoot: false,\n  \
             logging: {{ console: {{ level: \"warn\", metrics: false, audit: false }} }},\n  \
             contextStorage: {{\n    default: {{ module: \"memory\" }},\n    \
             file: {{ module: \"localfilesystem\", config: {{ flushInterval: {NODE_RED_FLUSH_S} }} }}\n  }},\n  \
             editorTheme: {{ tours: false }},\n}};\n",
            free_port()
        );
        std::fs::write(user_dir.join("settings.js"), settings).expect("settings.js");
        let func = "const p = msg.payload;\n\
                    const s = context.get(p.k, \"file\") || { sum: 0, count: 0 };\n\
                    s.sum += p.v; s.count += 1;\n\
                    context.set(p.k, s, \"file\");\n\
                    return { topic: \"nr/out/\" + p.k, payload: { key: p.k, value: s.sum, count: s.count, id: p.id } };";
        let flows = serde_json::json!([
            {"id": "cmp_tab", "type": "tab", "label": "cairn-compare"},
            {"id": "cmp_broker", "type": "mqtt-broker", "name": "bench",
             "broker": "127.0.0.1", "port": broker_port.to_string(), "clientid": client_id,
             "autoConnect": true, "usetls": false, "protocolVersion": "4", "keepalive": "10",
             "cleansession": false, "autoUnsubscribe": false,
             "birthTopic": "", "closeTopic": "", "willTopic": ""},
            {"id": "cmp_in", "type": "mqtt in", "z": "cmp_tab", "name": "", "topic": "nr/in/#",
             "qos": "1", "datatype": "json", "broker": "cmp_broker", "nl": false, "rap": true,
             "rh": 0, "inputs": 0, "x": 100, "y": 100, "wires": [["cmp_sum"]]},
            {"id": "cmp_sum", "type": "function", "z": "cmp_tab", "name": "keyed sum",
             "func": func, "outputs": 1, "timeout": 0, "noerr": 0, "initialize": "",
             "finalize": "", "libs": [], "x": 300, "y": 100, "wires": [["cmp_out"]]},
            {"id": "cmp_out", "type": "mqtt out", "z": "cmp_tab", "name": "", "topic": "",
             "qos": "1", "retain": "false", "broker": "cmp_broker", "x": 500, "y": 100,
             "wires": []}
        ]);
        std::fs::write(user_dir.join("flows.json"), flows.to_string()).expect("flows.json");
        NodeRed {
            red_js,
            user_dir,
            client_id,
            proc: None,
        }
    }

    pub(crate) fn start(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.user_dir.join("node-red.log"))
            .expect("node-red log");
        self.proc = Some(Proc::spawn(
            Command::new("node")
                .arg(&self.red_js)
                .arg("--userDir")
                .arg(&self.user_dir)
                .arg("--settings")
                .arg(self.user_dir.join("settings.js"))
                .stdin(Stdio::null())
                .stdout(Stdio::from(log.try_clone().expect("log")))
                .stderr(Stdio::from(log)),
        ));
    }

    /// Wait for the broker to see connection number `n` of this flow, then a moment for
    /// its SUBSCRIBE.
    pub(crate) fn wait_connected(&mut self, broker: &Broker, n: usize, timeout: Duration) -> bool {
        let ok = wait_until(timeout, || broker.connections(&self.client_id) >= n);
        std::thread::sleep(Duration::from_millis(500));
        ok
    }

    pub(crate) fn kill(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.kill();
        }
    }
}

impl System for NodeRed {
    fn name(&self) -> &'static str {
        "node-red"
    }
    fn prefix(&self) -> &'static str {
        "nr"
    }
    fn stats(&self) -> Option<Stats> {
        self.proc.as_ref().map(Proc::stats)
    }
}

/// `target/node-red/node_modules/node-red/red.js`, installing it with
/// `benches/install-node-red.sh` when missing. `Err` says why it is not available.
pub(crate) fn node_red(target: &Path) -> Result<PathBuf, String> {
    let prefix = target.join("node-red");
    let red = prefix.join("node_modules/node-red/red.js");
    if red.is_file() {
        return Ok(red);
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/install-node-red.sh");
    println!("Node-RED not found under {}: installing", prefix.display());
    let out = Command::new("sh")
        .arg(&script)
        .arg(&prefix)
        .output()
        .map_err(|e| format!("cannot run {}: {e}", script.display()))?;
    if red.is_file() {
        Ok(red)
    } else {
        Err(format!(
            "`{}` failed ({}): {}",
            script.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .rev()
                .take(5)
                .collect::<Vec<_>>()
                .join(" | ")
        ))
    }
}
