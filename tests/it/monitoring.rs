//! The shipped alerting rules and Grafana dashboard (`monitoring/`, issue 32, item 2),
//! proven with the real Prometheus (Debian's `prometheus` package, `.ci/test` installs it):
//! `promtool check rules`, `promtool test rules` with a case per alert, and a live check: a
//! private Prometheus (its own port on loopback and its own data dir) scrapes a running
//! agent, and every dashboard query, and every series an alert reads, returns data. An alert
//! expression itself is a condition, empty while the agent is healthy; what it must never be
//! is blind, reading a series the agent does not export, which is what the live check finds.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use serde_json::Value;

use crate::support::agent::{AgentConfig, CairnProcess};
use crate::support::{Broker, free_port, publish_all, unique_id, wait_until};

fn monitoring() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("monitoring")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// `promtool ARGS`, failing with what to install when it is missing.
fn promtool(args: &[&str]) -> Output {
    match Command::new("promtool").args(args).output() {
        Ok(out) => out,
        Err(e) => panic!(
            "promtool is missing ({e}): install Debian's `prometheus` package \
             (`apt-get install prometheus`; `.ci/test` does)"
        ),
    }
}

/// The alert names of the rules file, and each one's expression.
fn alerts() -> Vec<(String, String)> {
    // The file's shape is ours: `- alert: NAME`, then `expr:` on one line or folded (`>-`)
    // over the indented lines below it.
    let rules = std::fs::read_to_string(monitoring().join("cairn.rules.yml")).unwrap();
    let lines: Vec<&str> = rules.lines().collect();
    let mut out = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let Some(name) = line.trim().strip_prefix("- alert: ") else {
            continue;
        };
        let at = (i..lines.len())
            .find(|&j| lines[j].trim().starts_with("expr:"))
            .expect("an expr");
        let first = lines[at].trim().trim_start_matches("expr:").trim();
        let expr = if first == ">-" {
            lines[at + 1..]
                .iter()
                .take_while(|l| l.starts_with("          "))
                .map(|l| l.trim())
                .collect::<Vec<_>>()
                .join(" ")
        } else {
            first.to_string()
        };
        out.push((name.to_string(), expr));
    }
    out
}

/// Every query of the dashboard, with Grafana's variables given values Prometheus takes.
fn dashboard_queries() -> Vec<(String, String)> {
    let dash: Value = serde_json::from_str(
        &std::fs::read_to_string(monitoring().join("cairn.dashboard.json")).unwrap(),
    )
    .expect("the dashboard is JSON");
    let mut out = Vec::new();
    for panel in dash["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"].as_str().unwrap();
            let expr = expr
                .replace("$__rate_interval", "30s")
                .replace("$instance", ".*");
            out.push((panel["title"].as_str().unwrap().to_string(), expr));
        }
    }
    out
}

/// The metric names an expression reads.
fn series_in(expr: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let bytes = expr.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let word_start = i == 0 || !(bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_');
        if word_start && (expr[i..].starts_with("cairn_") || expr[i..].starts_with("up{")) {
            let end = expr[i..]
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .map_or(expr.len(), |n| i + n);
            names.insert(expr[i..end].to_string());
            i = end;
        } else {
            i += 1;
        }
    }
    names
}

#[test]
fn the_alerting_rules_pass_promtool_check_and_a_unit_test_per_alert() {
    let rules = monitoring().join("cairn.rules.yml");
    let out = promtool(&["check", "rules", rules.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    let alerts = alerts();
    assert!(
        text(&out.stdout).contains(&format!("SUCCESS: {} rules found", alerts.len())),
        "{}",
        text(&out.stdout)
    );
    let tests = monitoring().join("cairn.rules.test.yml");
    let out = promtool(&["test", "rules", tests.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    // A case per alert, each with a time at which it fires (its labels are expected there).
    let cases = std::fs::read_to_string(&tests).unwrap();
    for (name, _) in &alerts {
        assert!(
            cases.contains(&format!("alertname: {name}\n")),
            "no promtool case for {name}"
        );
        assert!(
            cases.contains(&format!(
                "alertname: {name}\n    exp_alerts:\n    - exp_labels:"
            )),
            "no case where {name} fires"
        );
        assert!(
            cases.contains(&format!("alertname: {name}\n    exp_alerts: []")),
            "no case where {name} stays quiet"
        );
    }
    // The issue's list: each kind of trouble has its alert.
    for want in [
        "CairnUplinkDown",
        "CairnBrokerDisconnected",
        "CairnResultsNotLeaving",
        "CairnOutboxNearFull",
        "CairnCheckpointFailing",
        "CairnCheckpointOld",
        "CairnDeadLettersRising",
        "CairnLogNearFull",
        "CairnReplayImpossible",
    ] {
        assert!(alerts.iter().any(|(n, _)| n == want), "no {want}");
    }
}

#[test]
fn the_dashboard_has_throughput_latency_lag_outbox_checkpoint_and_memory_panels() {
    let dash: Value = serde_json::from_str(
        &std::fs::read_to_string(monitoring().join("cairn.dashboard.json")).unwrap(),
    )
    .unwrap();
    let titles: Vec<String> = dash["panels"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["title"].as_str().unwrap().to_lowercase())
        .collect();
    for want in [
        "throughput",
        "latency",
        "lag",
        "outbox",
        "checkpoint",
        "memory",
    ] {
        assert!(
            titles.iter().any(|t| t.contains(want)),
            "no {want}: {titles:?}"
        );
    }
    let ids: BTreeSet<u64> = dash["panels"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["id"].as_u64().unwrap())
        .collect();
    assert_eq!(ids.len(), titles.len(), "panel ids are unique");
    assert!(dashboard_queries().len() >= 20);
}

/// A private Prometheus scraping one target every second; killed on drop.
struct Prometheus {
    child: Child,
    url: String,
    _dir: tempfile::TempDir,
}

impl Prometheus {
    fn start(target_port: u16) -> Prometheus {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
                 rule_files:\n  - {}\n\
                 scrape_configs:\n  - job_name: cairn\n    static_configs:\n      \
                 - targets: ['127.0.0.1:{target_port}']\n",
                monitoring().join("cairn.rules.yml").display()
            ),
        )
        .unwrap();
        let port = free_port();
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .arg("--log.level=warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(
                std::fs::File::create(dir.path().join("stderr")).unwrap(),
            ))
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot run prometheus ({e}): install Debian's `prometheus` package \
                     (`.ci/test` does)"
                )
            });
        Prometheus {
            child,
            url: format!("http://127.0.0.1:{port}"),
            _dir: dir,
        }
    }

    /// The result vector of an instant query (`promtool query instant -o json`); `Err` with
    /// promtool's words when the query fails.
    fn query(&self, expr: &str) -> Result<Vec<Value>, String> {
        let out = promtool(&["query", "instant", "-o", "json", &self.url, expr]);
        if !out.status.success() {
            return Err(format!("{}{}", text(&out.stdout), text(&out.stderr)));
        }
        match serde_json::from_slice::<Value>(&out.stdout) {
            Ok(Value::Array(v)) => Ok(v),
            Ok(Value::Null) => Ok(Vec::new()),
            Ok(other) => Ok(vec![other]),
            Err(e) => Err(format!("not JSON ({e}): {}", text(&out.stdout))),
        }
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn every_dashboard_query_and_every_series_an_alert_reads_returns_data_from_a_live_agent() {
    let broker = Broker::start();
    let mport = free_port();
    let pipeline = "[[pipeline]]\nname = \"balances\"\ntopics = [\"payments/#\"]\n\
                    format = \"json\"\nevent_id = \"/id\"\nkey = \"/account\"\n\
                    value = \"/amount\"\naggregate = \"sum\"\noutput_topic = \"balances/{key}\"\n";
    // With an uplink (to the same broker, as its own client), so its panel has data too.
    let cfg = AgentConfig::new(broker.port(), pipeline).with_uplink(
        broker.port(),
        &unique_id("uplink"),
        "site/",
    );
    let mut cfg = cfg;
    cfg.extra = format!("[metrics]\nlisten = \"127.0.0.1:{mport}\"\n");
    let mut agent = CairnProcess::new(&cfg);
    agent.start_connected();
    let prometheus = Prometheus::start(mport);
    let scraped = wait_until(Duration::from_secs(30), || {
        prometheus
            .query("up{job=\"cairn\"} == 1")
            .is_ok_and(|v| !v.is_empty())
    });
    assert!(
        scraped,
        "prometheus never scraped the agent; agent:\n{}",
        agent.stderr_tail(20)
    );
    // Input over several scrapes, so that every rate and histogram has a change to show;
    // one input is a dead letter.
    for round in 0..6 {
        let mut batch: Vec<(String, Vec<u8>, bool)> = (0..50)
            .map(|i| {
                let body = format!(
                    r#"{{"id":"{round}-{i}","account":"a{}","amount":1}}"#,
                    i % 5
                );
                ("payments/in".to_string(), body.into_bytes(), false)
            })
            .collect();
        batch.push(("payments/in".into(), b"not json".to_vec(), false));
        publish_all(broker.port(), &batch);
        std::thread::sleep(Duration::from_millis(1500));
    }
    let mut blind = Vec::new();
    for (panel, expr) in dashboard_queries() {
        match prometheus.query(&expr) {
            Ok(v) if !v.is_empty() => {}
            Ok(_) => blind.push(format!("dashboard `{panel}`: no data for {expr}")),
            Err(e) => blind.push(format!("dashboard `{panel}`: {expr} fails: {e}")),
        }
    }
    for (alert, expr) in alerts() {
        if let Err(e) = prometheus.query(&expr) {
            blind.push(format!("alert {alert}: {expr} fails: {e}"));
        }
        for series in series_in(&expr) {
            let selector = if series == "up" {
                "up{job=\"cairn\"}".to_string()
            } else {
                format!("{series}{{job=\"cairn\"}}")
            };
            match prometheus.query(&selector) {
                Ok(v) if !v.is_empty() => {}
                other => blind.push(format!("alert {alert}: no {series} ({other:?})")),
            }
        }
    }
    // A healthy agent fires nothing (the rules are loaded: a broken one would show here).
    let firing = prometheus.query("ALERTS{alertstate=\"firing\"}");
    agent.terminate();
    assert!(blind.is_empty(), "{}", blind.join("\n"));
    assert_eq!(firing, Ok(Vec::new()), "alerts firing on a healthy agent");
}
