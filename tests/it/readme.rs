//! What a check of the README against the binary found (issue 32, item 7): where behaviour
//! was changed to agree with the docs, the behaviour is held here; where the docs were
//! wrong, `tests/it/docs.rs` holds the docs to the behaviour.

use std::time::Duration;

use crate::support::agent::{AgentConfig, CairnProcess};
use crate::support::{Broker, publish_all, wait_until};

const BALANCES: &str = "[[pipeline]]\nname = \"balances\"\ntopics = [\"payments/#\"]\n\
     format = \"json\"\nevent_id = \"/id\"\nkey = \"/account\"\nvalue = \"/amount\"\n\
     aggregate = \"sum\"\noutput_topic = \"balances/{key}\"\n";

/// An agent that took `payloads` on `payments/in` (checkpointed) and stopped, and its config.
fn ran_once(broker: &Broker, payloads: &[&str]) -> (CairnProcess, AgentConfig) {
    let cfg = AgentConfig::new(broker.port(), BALANCES);
    let mut agent = CairnProcess::new(&cfg);
    agent.start_connected();
    send(broker, payloads);
    let n = payloads.len() as u64;
    let done = wait_until(Duration::from_secs(20), || {
        agent.checkpointed_offset().is_some_and(|o| o >= n)
    });
    assert!(done, "{}", agent.stderr_tail(20));
    assert_eq!(agent.terminate().code(), Some(0));
    (agent, cfg)
}

fn send(broker: &Broker, payloads: &[&str]) {
    let msgs: Vec<_> = payloads
        .iter()
        .map(|p| ("payments/in".to_string(), p.as_bytes().to_vec(), false))
        .collect();
    publish_all(broker.port(), &msgs);
}

/// `savepoint restore` with neither a file nor `--latest` said only that FILE was missing.
#[test]
fn savepoint_restore_without_a_file_points_to_latest_and_exits_2() {
    let agent = CairnProcess::new(&AgentConfig::new(crate::support::free_port(), BALANCES));
    let (status, out, err) = agent.command(&["savepoint", "restore"]);
    assert_eq!(status.code(), Some(2), "{out}{err}");
    assert!(err.contains("--latest"), "{err}");
    assert!(err.contains("cairn savepoint list"), "{err}");
}

/// `cache_size = 1000000` was answered with the hint "1000000MiB" (about a terabyte).
#[test]
fn a_size_without_a_unit_is_hinted_in_bytes() {
    let mut cfg = AgentConfig::new(crate::support::free_port(), BALANCES);
    cfg.storage = "cache_size = 1000000\n".into();
    let agent = CairnProcess::new(&cfg);
    let (status, out, err) = agent.command(&["validate"]);
    assert_eq!(status.code(), Some(2), "{out}{err}");
    assert!(out.contains("\"1000000B\""), "{out}");
    assert!(!out.contains("1000000MiB"), "{out}");
}

/// `validate` passed a config that `run` then refused (a definition that would misread the
/// stored state), and `run` exited 1 there: both now refuse it as a config error, exit 2.
#[test]
fn validate_refuses_what_run_refuses_and_both_exit_2() {
    let broker = Broker::start();
    let (mut agent, mut cfg) = ran_once(&broker, &[r#"{"id":"e1","account":"A","amount":5}"#]);
    cfg.pipelines = BALANCES.replace("aggregate = \"sum\"", "aggregate = \"max\"");
    agent.rewrite_config(&cfg);
    let (status, out, err) = agent.command(&["validate"]);
    assert_eq!(status.code(), Some(2), "validate: {out}{err}");
    assert!(out.contains("`cairn run` will refuse"), "{out}");
    assert!(err.contains("--reset-pipeline"), "{err}");
    agent.start();
    let code = agent.expect_exit(Duration::from_secs(20));
    assert_eq!(code.code(), Some(2), "run: {}", agent.stderr_tail(10));
    assert!(
        agent.run_stderr().contains("pipeline `balances` changed"),
        "{}",
        agent.stderr_tail(10)
    );
}

/// An unusable `$TMPDIR` made `inspect` fail without naming it.
#[test]
fn inspect_names_an_unusable_tmpdir_and_what_to_do() {
    let broker = Broker::start();
    let (agent, _) = ran_once(&broker, &[r#"{"id":"e1","account":"A","amount":5}"#]);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_cairn"))
        .arg("--config")
        .arg(agent.config_path())
        .args(["inspect", "state"])
        .env("TMPDIR", "/nonexistent/cairn-tmp")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("$TMPDIR (/nonexistent/cairn-tmp)"), "{err}");
    assert!(
        err.contains("point TMPDIR at a writable directory"),
        "{err}"
    );
}

/// `--reset-pipeline` drops the dedup ledger with the state (now said in its help and the
/// docs): an event ID seen before the reset is applied again after it.
#[test]
fn reset_pipeline_also_forgets_the_event_ids_it_saw() {
    let broker = Broker::start();
    let e1 = r#"{"id":"e1","account":"A","amount":5}"#;
    let (mut agent, _) = ran_once(&broker, &[e1]);
    agent.start_with_args(&["--reset-pipeline", "balances"]);
    agent.wait_connected(Duration::from_secs(20));
    send(&broker, &[e1]);
    let applied = wait_until(Duration::from_secs(20), || {
        agent.checkpointed_offset().is_some_and(|o| o >= 2)
    });
    assert!(applied, "{}", agent.stderr_tail(20));
    assert_eq!(agent.terminate().code(), Some(0));
    let state = agent.inspect("state");
    assert_eq!(state.len(), 1, "{state:?}");
    assert_eq!(state[0]["key"], "A");
    assert_eq!(state[0]["value"], 5, "e1 was applied again: {state:?}");
    assert_eq!(state[0]["count"], 1, "{state:?}");
    let (_, help, _) = agent.command(&["run", "--help"]);
    assert!(help.contains("dedup ledger"), "{help}");
}
