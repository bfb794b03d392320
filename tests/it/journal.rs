//! The structured journal against a real `systemd-journald` (issue 32, item 1): the agent,
//! run as systemd would run it (stderr is the journal stream), sends each line over the
//! native protocol with its event name and fields, and `journalctl` finds lines by field.
//!
//! Each test starts its own journald, private to it: a journal namespace of its own
//! (`systemd-journald NAMESPACE`), its sockets under a temp dir (`$RUNTIME_DIRECTORY`), and
//! its files in a temp dir too: journald writes a namespace's files under `/var/log/journal/`,
//! so it runs in a mount namespace of its own (`unshare --mount`) where a temp dir is bound
//! over `/var/log`. The machine's own journal (and `/run/systemd/journal`) is never touched,
//! and the tests can run in parallel. Needs root (CI runs as root) for the mount namespace.

use std::collections::BTreeSet;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::Value;

use crate::support::{self, Broker, agent::AgentConfig, agent::CairnProcess};

const JOURNALD: &str = "/lib/systemd/systemd-journald";

/// A private journald; killed on drop.
struct Journald {
    child: Child,
    dir: tempfile::TempDir,
    namespace: String,
}

impl Journald {
    fn start() -> Journald {
        assert!(
            Path::new(JOURNALD).exists(),
            "{JOURNALD} is missing: install Debian's `systemd` package (`.ci/test` does)"
        );
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("varlog/journal")).unwrap();
        let namespace = support::unique_id("cairntest").replace('_', "-");
        let child = Command::new("unshare")
            .args(["--mount", "--propagation", "private", "--", "sh", "-c"])
            .arg("mount --bind \"$1\" /var/log && exec \"$2\" \"$3\"")
            .arg("sh")
            .arg(dir.path().join("varlog"))
            .arg(JOURNALD)
            .arg(&namespace)
            .env("RUNTIME_DIRECTORY", dir.path().join("run"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(
                std::fs::File::create(dir.path().join("journald.stderr")).unwrap(),
            ))
            .spawn()
            .expect("run `unshare` (util-linux) to start a private journald");
        let mut j = Journald {
            child,
            dir,
            namespace,
        };
        let up = support::wait_until(Duration::from_secs(15), || {
            j.socket().exists() && j.files_dir().is_some()
        });
        if !up {
            let said = std::fs::read_to_string(j.dir.path().join("journald.stderr"));
            let exited = j.child.try_wait().ok().flatten();
            panic!(
                "the private journald did not start (exit {exited:?}; it needs root for its \
                 mount namespace): {said:?}"
            );
        }
        j
    }

    /// The native socket.
    fn socket(&self) -> PathBuf {
        self.dir.path().join("run/socket")
    }

    /// `varlog/journal/<machine-id>.<namespace>`, once journald made it.
    fn files_dir(&self) -> Option<PathBuf> {
        let suffix = format!(".{}", self.namespace);
        std::fs::read_dir(self.dir.path().join("varlog/journal"))
            .ok()?
            .flatten()
            .map(|e| e.path())
            .find(|p| p.to_string_lossy().ends_with(&suffix))
    }

    /// `journalctl -D DIR -o json MATCHES...`: the entries, oldest first.
    fn query(&self, matches: &[&str]) -> Vec<Value> {
        let dir = self.files_dir().expect("journal files");
        let out = Command::new("journalctl")
            .arg("-D")
            .arg(&dir)
            .args(["-o", "json", "--no-pager"])
            .args(matches)
            .output()
            .expect("run journalctl");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }

    /// Waits until `query(matches)` finds at least `n` entries, and returns them.
    fn wait_for(&self, matches: &[&str], n: usize) -> Vec<Value> {
        let mut found = Vec::new();
        support::wait_until(Duration::from_secs(20), || {
            found = self.query(matches);
            found.len() >= n
        });
        found
    }
}

impl Drop for Journald {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The `JOURNAL_STREAM` value systemd would set for a stderr that is this file.
fn journal_stream(path: &Path) -> String {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .unwrap();
    let m = std::fs::metadata(path).unwrap();
    format!("{}:{}", m.dev(), m.ino())
}

fn field<'a>(entry: &'a Value, name: &str) -> &'a str {
    entry[name].as_str().unwrap_or("")
}

/// An agent as systemd would run it, its journal being `journald`.
fn agent_under(journald: &Journald, cfg: &AgentConfig) -> CairnProcess {
    let mut agent = CairnProcess::new(cfg);
    agent.set_log_filter(Some("info"));
    let stream = journal_stream(&agent.stderr_path());
    agent.set_env("JOURNAL_STREAM", &stream);
    agent.set_env("CAIRN_JOURNAL_SOCKET", &journald.socket().to_string_lossy());
    agent
}

const WINDOWED: &str = "[[pipeline]]\nname = \"rooms\"\ntopics = [\"rooms/#\"]\n\
     format = \"json\"\nevent_id = \"/id\"\nkey = \"/room\"\nvalue = \"/t\"\n\
     event_time = \"/ts\"\naggregate = \"max\"\n\
     window = { size = \"1m\", allowed_lateness = \"0s\" }\noutput_topic = \"max/rooms/{key}\"\n";

#[test]
fn journalctl_finds_the_late_dead_letters_by_event_and_reason() {
    let journald = Journald::start();
    let broker = Broker::start();
    let mut agent = agent_under(&journald, &AgentConfig::new(broker.port(), WINDOWED));
    agent.start();
    let connected = support::wait_until(Duration::from_secs(20), || {
        journald
            .query(&["SYSLOG_IDENTIFIER=cairn"])
            .iter()
            .any(|e| field(e, "MESSAGE").starts_with("mqtt: connected"))
    });
    assert!(
        connected,
        "no connection in the journal; stderr:\n{}",
        agent.stderr()
    );
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let msg = |id: &str, ts: u64| {
        let body = format!(r#"{{"id":"{id}","room":"r1","t":20,"ts":{ts}}}"#);
        ("rooms/r1".to_string(), body.into_bytes(), false)
    };
    // Offset 0 sets the watermark; 1 and 2 are an hour late; 3 is not JSON.
    support::publish_all(
        broker.port(),
        &[
            msg("a", now),
            msg("b", now - 3_600_000),
            msg("c", now - 7_200_000),
            ("rooms/r1".into(), b"not json".to_vec(), false),
        ],
    );
    let late = journald.wait_for(
        &[
            "CAIRN_EVENT=dead_letter",
            "CAIRN_PIPELINE=rooms",
            "CAIRN_REASON=late",
        ],
        2,
    );
    let all = journald.wait_for(&["CAIRN_EVENT=dead_letter"], 3);
    agent.terminate();
    let stderr = agent.stderr();
    assert_eq!(
        late.len(),
        2,
        "late dead letters: {late:#?}\nstderr:\n{stderr}"
    );
    let offsets: Vec<&str> = late.iter().map(|e| field(e, "CAIRN_OFFSET")).collect();
    assert_eq!(offsets, ["1", "2"], "{late:#?}");
    for e in &late {
        assert_eq!(field(e, "PRIORITY"), "4", "a warning: {e}");
        assert_eq!(field(e, "SYSLOG_IDENTIFIER"), "cairn", "{e}");
        assert_eq!(
            field(e, "_TRANSPORT"),
            "journal",
            "native, not the stream: {e}"
        );
        assert!(
            field(e, "MESSAGE").starts_with("dead letter: offset "),
            "{e}"
        );
    }
    assert_eq!(all.len(), 3, "every dead letter: {all:#?}");
    assert_eq!(field(&all[2], "CAIRN_REASON"), "not_json", "{all:#?}");
    // The lines went to the journal natively, not also to stderr.
    assert!(!stderr.contains("dead letter"), "{stderr}");
    // A reason nothing had matches nothing.
    assert!(
        journald
            .query(&["CAIRN_EVENT=dead_letter", "CAIRN_REASON=future"])
            .is_empty()
    );
}

#[test]
fn a_fatal_error_reaches_the_journal_at_error_priority_with_its_event() {
    let journald = Journald::start();
    let mut agent = agent_under(&journald, &AgentConfig::new(support::free_port(), WINDOWED));
    agent.write_config_text("[mqtt]\nclient_id = \"x\"\nport = \"many\"\n");
    agent.start();
    let status = agent.expect_exit(Duration::from_secs(20));
    assert_eq!(status.code(), Some(2), "{}", agent.stderr());
    let fatal = journald.wait_for(&["CAIRN_EVENT=fatal"], 1);
    assert_eq!(fatal.len(), 1, "{fatal:#?}\nstderr:\n{}", agent.stderr());
    assert_eq!(field(&fatal[0], "PRIORITY"), "3");
    assert!(
        field(&fatal[0], "MESSAGE").starts_with("cairn: "),
        "{}",
        fatal[0]
    );
    assert!(field(&fatal[0], "MESSAGE").contains("port"), "{}", fatal[0]);
}

#[test]
fn an_entry_too_large_for_a_datagram_reaches_journald_through_a_sealed_memfd() {
    let journald = Journald::start();
    // Far over the datagram limit (the send buffer, ~208 KiB): only the memfd way fits.
    let big = "x".repeat(2 << 20);
    cairn::logging::send_entry(
        &journald.socket(),
        &[("MESSAGE", big.as_bytes()), ("CAIRN_EVENT", b"memfd_probe")],
    )
    .expect("send");
    let found = journald.wait_for(&["CAIRN_EVENT=memfd_probe", "--all"], 1);
    assert_eq!(found.len(), 1, "journald took no entry from the memfd");
    assert_eq!(field(&found[0], "MESSAGE").len(), big.len());
}

// ---------------------------------------------------------------------------------------------
// Every line has an event name

/// `src/**/*.rs`, path relative to `src/` and text.
fn sources() -> Vec<(String, String)> {
    fn walk(dir: &Path, root: &Path, out: &mut Vec<(String, String)>) {
        for e in std::fs::read_dir(dir).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                walk(&p, root, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                let rel = p.strip_prefix(root).unwrap().to_string_lossy().into_owned();
                out.push((rel, std::fs::read_to_string(&p).unwrap()));
            }
        }
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut out = Vec::new();
    walk(&root, &root, &mut out);
    out.sort();
    out
}

/// `info!`, `warn!` and `error!` calls (with or without `log::`) outside comments: lines
/// that bypass `crate::event!` and would reach the journal without a `CAIRN_EVENT`.
fn unnamed_lines(text: &str) -> Vec<usize> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let code = line.trim_start();
        if code.starts_with("//") {
            continue;
        }
        for level in ["info!", "warn!", "error!"] {
            let mut from = 0;
            while let Some(at) = code[from..].find(level) {
                let start = from + at;
                let before = code[..start].chars().next_back();
                let word_start = before.is_none_or(|c| !(c.is_alphanumeric() || c == '_'));
                let rest = code[start + level.len()..].trim_start();
                if word_start && rest.starts_with('(') {
                    out.push(i + 1);
                }
                from = start + level.len();
            }
        }
    }
    out
}

/// The event names `text` gives its lines: `event!(LEVEL, "name"` (over line breaks too),
/// and the fatal line's `CAIRN_EVENT`.
fn event_names_in(text: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("event!(") {
        rest = &rest[at + "event!(".len()..];
        let Some((level, after)) = rest.split_once(',') else {
            break;
        };
        if !["error", "warn", "info", "debug", "trace"].contains(&level.trim()) {
            continue;
        }
        let after = after.trim_start();
        if let Some(name) = after.strip_prefix('"').and_then(|a| a.split_once('"')) {
            names.push(name.0.to_string());
        }
    }
    let mut rest = text;
    while let Some(at) = rest.find("(\"CAIRN_EVENT\", b\"") {
        rest = &rest[at + "(\"CAIRN_EVENT\", b\"".len()..];
        if let Some((name, _)) = rest.split_once('"') {
            names.push(name.to_string());
        }
    }
    names
}

/// Every event name the agent's lines carry (for the docs test too).
pub(crate) fn event_names() -> BTreeSet<String> {
    sources()
        .iter()
        .flat_map(|(_, text)| event_names_in(text))
        .collect()
}

#[test]
fn every_info_warn_and_error_line_in_src_has_an_event_name() {
    // Negative control: the scanner sees both spellings, and not the macro.
    let sample =
        "log::warn!(\"a\");\n    error!(\n// info!(\"x\")\ncrate::event!(warn, \"x_y\"; \"b\");\n";
    assert_eq!(unnamed_lines(sample), [1, 2]);
    assert_eq!(event_names_in(sample), ["x_y"]);

    let mut unnamed = Vec::new();
    for (file, text) in sources() {
        for line in unnamed_lines(&text) {
            unnamed.push(format!("src/{file}:{line}"));
        }
    }
    assert!(
        unnamed.is_empty(),
        "log lines without an event name (write `crate::event!(warn, \"snake_case_name\", \
         pipeline = .., reason = ..; \"message\", args)`, see src/logging.rs):\n{}",
        unnamed.join("\n")
    );
    let names = event_names();
    assert!(names.len() >= 60, "{names:?}");
    for name in &names {
        let ok = name.starts_with(|c: char| c.is_ascii_lowercase())
            && name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
        assert!(ok, "event name `{name}` is not snake_case");
    }
    for want in [
        "checkpoint_failed",
        "dead_letter",
        "backpressure_on",
        "uplink_lost",
        "fatal",
    ] {
        assert!(names.contains(want), "no event {want}");
    }
}
