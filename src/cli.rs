//! Command line: argument parsing, config loading, exit codes.
//!
//! Exit codes: 0 ok, 1 runtime failure, 2 usage or config error (DESIGN §3).

use std::io::Write;
use std::path::{Path, PathBuf};

use clap::{Args, Parser, Subcommand};
use serde_json::json;

use crate::config::{self, Config, ConfigError};
use crate::pipeline::spec::PipelineSpec;
use crate::store::Store;

pub const EXIT_OK: i32 = 0;
pub const EXIT_RUNTIME: i32 = 1;
pub const EXIT_USAGE: i32 = 2;

#[derive(Parser, Debug)]
#[command(
    name = "cairn",
    version,
    about = "Exactly-once MQTT aggregation for edge boxes"
)]
pub struct Cli {
    /// Configuration file.
    #[arg(
        long,
        short,
        global = true,
        env = "CAIRN_CONFIG",
        default_value = "/etc/cairn/cairn.toml"
    )]
    pub config: PathBuf,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Run the agent in the foreground until SIGINT/SIGTERM (drains, exits 0); SIGHUP
    /// reloads the safe parts of the config.
    Run {
        /// Drop this pipeline's stored state and start it empty, in a new generation of
        /// output IDs (after a change to its definition that would misread the old state).
        /// For a pipeline no longer configured, delete its stored state for good. Repeatable.
        #[arg(long = "reset-pipeline", value_name = "NAME")]
        reset_pipeline: Vec<String>,
    },
    /// Check the configuration; print every problem (exit 2) or a summary (exit 0).
    Validate,
    /// Look inside the log or the store (the store only while the agent is stopped).
    Inspect {
        #[command(subcommand)]
        what: Inspect,
    },
    /// Check the log (and the store against it); `--repair` moves damaged log segments aside.
    Verify {
        /// Move damaged segments aside (never deleting them) so the log opens again.
        #[arg(long)]
        repair: bool,
        #[arg(long)]
        json: bool,
    },
    /// The running agent's figures (via `[metrics] listen`), or the data directory's.
    Status {
        #[arg(long)]
        json: bool,
        /// Read the data directory even if the agent's metrics answer.
        #[arg(long)]
        offline: bool,
    },
    /// Portable snapshots of the store: create (agent stopped), list, restore.
    Savepoint {
        #[command(subcommand)]
        what: crate::savepoint::SavepointCommand,
    },
}

#[derive(Args, Debug, Clone)]
pub struct Filter {
    /// Only this pipeline.
    #[arg(long)]
    pub pipeline: Option<String>,
    /// Only this key.
    #[arg(long)]
    pub key: Option<String>,
    /// At most this many lines.
    #[arg(long)]
    pub limit: Option<usize>,
    /// One JSON object per line.
    #[arg(long)]
    pub json: bool,
}

#[derive(Subcommand, Debug)]
pub enum Inspect {
    /// Records in the replay log.
    Log {
        /// First offset to show.
        #[arg(long, default_value_t = 0)]
        from: u64,
        #[arg(long, default_value_t = 100)]
        limit: usize,
        #[arg(long)]
        json: bool,
    },
    /// Per-key aggregate state.
    State(Filter),
    /// The event-ID dedup ledger.
    Dedup(Filter),
    /// Results waiting for the broker's PUBACK.
    Outbox(Filter),
    /// Checkpoint history, newest last.
    Checkpoints(Filter),
    /// Refused inputs with offset, topic and reason.
    DeadLetters(Filter),
}

/// A failure with its exit code and message, for `main` to print.
#[derive(Debug)]
pub struct Failure {
    pub code: i32,
    pub message: String,
}

impl Failure {
    pub fn runtime(message: impl std::fmt::Display) -> Failure {
        Failure {
            code: EXIT_RUNTIME,
            message: message.to_string(),
        }
    }
    pub fn usage(message: impl std::fmt::Display) -> Failure {
        Failure {
            code: EXIT_USAGE,
            message: message.to_string(),
        }
    }
}

pub fn main() -> i32 {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() { EXIT_USAGE } else { EXIT_OK };
        }
    };
    init_logging();
    match dispatch(cli) {
        Ok(()) => EXIT_OK,
        Err(f) => {
            if !f.message.is_empty() {
                crate::logging::fatal(&f.message);
            }
            f.code
        }
    }
}

fn init_logging() {
    crate::logging::init();
}

pub fn load_config(path: &Path) -> Result<Config, Failure> {
    config::load(path).map_err(|e| match e {
        ConfigError::Invalid { problems, .. } => {
            let lines: Vec<String> = problems.iter().map(|p| p.to_string()).collect();
            Failure::usage(lines.join("\n"))
        }
        other => Failure::usage(other),
    })
}

fn dispatch(cli: Cli) -> Result<(), Failure> {
    if let Command::Validate = cli.command {
        return match config::load(&cli.config) {
            Ok(cfg) => {
                println!("{}", config::summary(&cfg));
                for w in cfg.warnings() {
                    println!("{}: warning: {w}", cfg.source.display());
                }
                for line in data_dir_report(&cfg) {
                    println!("{line}");
                }
                Ok(())
            }
            Err(ConfigError::Invalid { problems, file }) => {
                for p in &problems {
                    println!("{p}");
                }
                Err(Failure::usage(format!(
                    "{file}: {} problem(s)",
                    problems.len()
                )))
            }
            Err(e) => Err(Failure::usage(e)),
        };
    }
    let cfg = load_config(&cli.config)?;
    crate::logging::set_level(cfg.logging.level);
    match cli.command {
        Command::Validate => unreachable!(),
        Command::Run { reset_pipeline } => {
            for w in cfg.warnings() {
                log::warn!("config: {w}");
            }
            run(cfg, &reset_pipeline)
        }
        Command::Inspect { what } => inspect(&cfg, what),
        Command::Verify { repair, json } => verify(&cfg, repair, json),
        Command::Status { json, offline } => crate::status::run(&cfg, json, offline),
        Command::Savepoint { what } => crate::savepoint::run(&cfg, what),
    }
}

/// What `validate` says about the data directory, when there is one: stored pipelines the
/// config no longer names, and definitions a start would refuse. A report, not a problem:
/// the config itself is valid, and `run --reset-pipeline` is the way on.
fn data_dir_report(cfg: &Config) -> Vec<String> {
    let dir = cfg.store_dir();
    if !dir.join("db").exists() {
        return Vec::new();
    }
    let store = match Store::open(&dir, cfg.storage.cache_size, crate::fsio::real()) {
        Ok(s) => s,
        Err(crate::store::StoreError::Locked { .. }) => {
            return vec![format!(
                "data_dir: the agent holds the store at {}; its pipelines were not compared \
                 (`cairn status` lists them)",
                dir.display()
            )];
        }
        Err(e) => return vec![format!("data_dir: {e}")],
    };
    match crate::processor::audit(&store, &cfg.pipelines) {
        Ok((unconfigured, refusals)) => {
            let list = crate::status::unconfigured_json(&unconfigured);
            let mut lines: Vec<String> = list
                .as_array()
                .into_iter()
                .flatten()
                .map(|u| format!("data_dir: {}", crate::status::unconfigured_line(u)))
                .collect();
            for r in refusals {
                lines.push(format!("data_dir: `cairn run` will refuse: {r}"));
            }
            lines
        }
        Err(e) => vec![format!("data_dir: {e}")],
    }
}

fn out() -> std::io::StdoutLock<'static> {
    std::io::stdout().lock()
}

/// Print one line; a closed pipe (`| head`) ends the command quietly.
fn emit(line: &str) -> Result<(), Failure> {
    writeln!(out(), "{line}").map_err(|_| Failure {
        code: EXIT_OK,
        message: String::new(),
    })
}

/// `s` safe to print on a terminal, one line: control characters (an escape sequence in a
/// payload could rewrite the screen, a newline could fake a line) and the invisible
/// direction overrides are shown as escapes; a backslash is doubled so that an escape is
/// never ambiguous. Only the text output needs it: `--json` escapes for itself.
pub fn printable(s: &str) -> String {
    use std::fmt::Write as _;
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c.is_control()
                || matches!(c, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}') =>
            {
                let _ = write!(out, "\\u{{{:x}}}", c as u32);
            }
            c => out.push(c),
        }
    }
    out
}

/// Bytes as printable text (invalid UTF-8 shown as U+FFFD).
fn printable_bytes(b: &[u8]) -> String {
    printable(&String::from_utf8_lossy(b))
}

fn payload_json(payload: &[u8]) -> serde_json::Value {
    match std::str::from_utf8(payload) {
        Ok(s) => json!(s),
        Err(_) => json!({ "hex": payload.iter().map(|b| format!("{b:02x}")).collect::<String>() }),
    }
}

/// The store for `inspect`: a private copy, so that looking never writes to it (sled has no
/// read-only mode; see [`crate::store::StoreCopy`]).
fn open_store_readonly(cfg: &Config) -> Result<crate::store::StoreCopy, Failure> {
    let dir = cfg.store_dir();
    if !dir.join("db").exists() {
        return Err(Failure::runtime(format!(
            "no store at {} yet (the agent has not run with this data_dir)",
            dir.display()
        )));
    }
    Store::open_copy(&dir, cfg.storage.cache_size).map_err(|e| match e {
        crate::store::StoreError::Locked { .. } => {
            Failure::runtime(format!("{e}: stop it first, or use `cairn status`"))
        }
        e => Failure::runtime(e),
    })
}

fn spec_of<'a>(cfg: &'a Config, name: &str) -> Option<&'a PipelineSpec> {
    cfg.pipelines.iter().find(|p| p.name == name)
}

/// Split a stored key into (key, window bounds) using the window size of the definition
/// that wrote it (`None`: not windowed).
fn decode_skey(window_ms: Option<u64>, skey: &[u8]) -> (String, Option<(u64, u64)>) {
    match window_ms {
        Some(size) if skey.len() >= 8 => {
            let start = u64::from_be_bytes(skey[..8].try_into().expect("8 bytes"));
            (
                String::from_utf8_lossy(&skey[8..]).into_owned(),
                Some((start, start.saturating_add(size))),
            )
        }
        _ => (String::from_utf8_lossy(skey).into_owned(), None),
    }
}

/// The window size a pipeline's state was written with: from the config, or for a pipeline
/// no longer configured from the definition the store kept for it.
fn window_of(cfg: &Config, stored: &crate::pipeline::Progress, name: &str) -> Option<u64> {
    if let Some(spec) = spec_of(cfg, name) {
        return spec.window.map(|w| w.size_ms);
    }
    let p = stored.pipelines.iter().find(|p| p.name == name)?;
    let def: serde_json::Value = serde_json::from_str(&p.definition).ok()?;
    def["window"]["size_ms"].as_u64()
}

fn inspect(cfg: &Config, what: Inspect) -> Result<(), Failure> {
    if let Inspect::Log { from, limit, json } = what {
        return inspect_log(cfg, from, limit, json);
    }
    let store = open_store_readonly(cfg)?;
    let rt = |e: crate::store::StoreError| Failure::runtime(e);
    let keep = |f: &Filter, p: &str, k: Option<&str>| {
        f.pipeline.as_deref().is_none_or(|x| x == p) && (f.key.is_none() || f.key.as_deref() == k)
    };
    match what {
        Inspect::Log { .. } => unreachable!(),
        Inspect::State(f) => {
            let stored = store.progress().map_err(rt)?;
            let mut n = 0;
            for r in store.states(f.pipeline.as_deref()) {
                let (p, skey, st) = r.map_err(rt)?;
                let (key, window) = decode_skey(window_of(cfg, &stored, &p), &skey);
                if !keep(&f, &p, Some(&key)) || f.limit.is_some_and(|l| n >= l) {
                    continue;
                }
                n += 1;
                let mut v = json!({"pipeline": p, "key": key, "value": st.value_json(),
                                   "count": st.count, "version": st.version});
                if let Some((s, e)) = window {
                    v["window_start"] = s.into();
                    v["window_end"] = e.into();
                }
                if f.json {
                    emit(&v.to_string())?;
                } else {
                    let w = window
                        .map(|(s, e)| format!(" window=[{s},{e})"))
                        .unwrap_or_default();
                    emit(&format!(
                        "{}\t{}{w}\tvalue={}\tcount={}\tversion={}",
                        printable(&p),
                        printable(&key),
                        v["value"],
                        st.count,
                        st.version
                    ))?;
                }
            }
        }
        Inspect::Dedup(f) => {
            let mut n = 0;
            for r in store.dedup_entries(f.pipeline.as_deref()) {
                let (p, id, seen) = r.map_err(rt)?;
                if !keep(&f, &p, None) || f.limit.is_some_and(|l| n >= l) {
                    continue;
                }
                n += 1;
                if f.json {
                    emit(&json!({"pipeline": p, "event_id": id, "seen_ms": seen}).to_string())?;
                } else {
                    emit(&format!(
                        "{}\t{}\tseen_ms={seen}",
                        printable(&p),
                        printable(&id)
                    ))?;
                }
            }
        }
        Inspect::Outbox(f) => {
            let mut n = 0;
            for r in store.outbox_from(0) {
                let (seq, o) = r.map_err(rt)?;
                // `name/...`, or `name@generation/...` from generation 2 on.
                let p = o.id.split(['/', '@']).next().unwrap_or("").to_string();
                if !keep(&f, &p, None) || f.limit.is_some_and(|l| n >= l) {
                    continue;
                }
                n += 1;
                if f.json {
                    emit(
                        &json!({"seq": seq, "id": o.id, "topic": o.topic, "retain": o.retain,
                                 "payload": payload_json(&o.payload)})
                        .to_string(),
                    )?;
                } else {
                    emit(&format!(
                        "{seq}\t{}\t{}\t{}",
                        printable(&o.id),
                        printable(&o.topic),
                        printable_bytes(&o.payload)
                    ))?;
                }
            }
        }
        Inspect::Checkpoints(f) => {
            let all: Vec<_> = store.checkpoints().collect::<Result<_, _>>().map_err(rt)?;
            let skip = f.limit.map(|l| all.len().saturating_sub(l)).unwrap_or(0);
            for c in &all[skip..] {
                if f.json {
                    emit(&json!({"id": c.id, "prev_offset": c.prev_offset, "next_offset": c.next_offset,
                                 "records": c.records, "outputs": c.outputs, "dead_letters": c.dead_letters,
                                 "committed_at_ms": c.committed_at_ms}).to_string())?;
                } else {
                    emit(&format!(
                        "#{}\toffsets [{}, {})\trecords={}\toutputs={}\tdead_letters={}\tat_ms={}",
                        c.id,
                        c.prev_offset,
                        c.next_offset,
                        c.records,
                        c.outputs,
                        c.dead_letters,
                        c.committed_at_ms
                    ))?;
                }
            }
        }
        Inspect::DeadLetters(f) => {
            let mut n = 0;
            for r in store.dead_letters() {
                let d = r.map_err(rt)?;
                if !keep(&f, &d.pipeline, None) || f.limit.is_some_and(|l| n >= l) {
                    continue;
                }
                n += 1;
                if f.json {
                    emit(&json!({"offset": d.offset, "pipeline": d.pipeline, "topic": d.topic,
                                 "reason": d.reason, "detail": d.detail, "received_at_ms": d.received_at_ms,
                                 "payload": payload_json(&d.payload)}).to_string())?;
                } else {
                    emit(&format!(
                        "{}\t{}\t{}\t{}\t{}\t{}",
                        d.offset,
                        printable(&d.pipeline),
                        printable(&d.topic),
                        printable(&d.reason),
                        printable(&d.detail),
                        printable_bytes(&d.payload)
                    ))?;
                }
            }
        }
    }
    Ok(())
}

fn inspect_log(cfg: &Config, from: u64, limit: usize, json: bool) -> Result<(), Failure> {
    let dir = cfg.log_dir();
    if !dir.exists() {
        return Err(Failure::runtime(format!("no log at {} yet", dir.display())));
    }
    let reader = crate::log::read_dir(&dir, from).map_err(Failure::runtime)?;
    for rec in reader.take(limit) {
        let r = rec.map_err(Failure::runtime)?;
        // A stand-in for an oversized input shows what it stands for, not its header bytes.
        let (payload, too_large) = match r.too_large() {
            Some(t) => (t.prefix, json!({"size": t.size, "limit": t.limit})),
            None => (&r.payload[..], serde_json::Value::Null),
        };
        if json {
            let mut line = json!({"offset": r.offset, "received_at_ms": r.received_at_ms,
                                  "topic": r.topic, "qos": r.qos & !crate::model::QOS_TOO_LARGE,
                                  "retain": r.retain, "payload": payload_json(payload)});
            if !too_large.is_null() {
                line["too_large"] = too_large;
            }
            emit(&line.to_string())?;
        } else {
            let note = match r.too_large() {
                Some(t) => format!(" too_large({} bytes)", t.size),
                None => String::new(),
            };
            emit(&format!(
                "{}\t{}\t{}\tq{}{}{note}\t{}",
                r.offset,
                r.received_at_ms,
                printable(&r.topic),
                r.qos & !crate::model::QOS_TOO_LARGE,
                if r.retain { " retain" } else { "" },
                printable_bytes(payload)
            ))?;
        }
    }
    Ok(())
}

fn verify(cfg: &Config, repair: bool, json: bool) -> Result<(), Failure> {
    crate::verify::run(cfg, repair, json)
}

fn run(cfg: Config, reset: &[String]) -> Result<(), Failure> {
    use crate::agent::{Agent, Shutdown};
    let shutdown = Shutdown::new();
    let on_signal = shutdown.clone();
    ctrlc::set_handler(move || {
        if on_signal.request() >= 2 {
            // Everything acknowledged is already durable; exiting here is a crash we recover
            // from by replay, so it is safe to leave at once.
            log::warn!("second signal: exiting now");
            std::process::exit(EXIT_OK);
        }
        log::info!("signal: draining; send it again to exit at once");
    })
    .map_err(|e| Failure::runtime(format!("cannot install the signal handler: {e}")))?;
    crate::signals::install_reload_handler()
        .map_err(|e| Failure::runtime(format!("cannot install the SIGHUP handler: {e}")))?;
    let agent =
        Agent::start_with_reset(cfg, crate::fsio::real(), reset).map_err(Failure::runtime)?;
    // Recovery is done and the MQTT client runs: `systemctl start` may return.
    crate::notify::ready();
    crate::notify::status("running: recovery done");
    agent.run(&shutdown).map_err(Failure::runtime)
}

#[cfg(test)]
mod tests {
    use super::printable;

    #[test]
    fn printable_escapes_control_and_direction_characters_and_backslashes() {
        assert_eq!(printable("plain text/é"), "plain text/é");
        assert_eq!(printable("a\nb\tc\rd"), "a\\nb\\tc\\rd");
        assert_eq!(printable("\u{1b}[2J"), "\\u{1b}[2J");
        assert_eq!(printable("\u{7f}\u{0}"), "\\u{7f}\\u{0}");
        assert_eq!(printable("x\u{202e}y"), "x\\u{202e}y");
        assert_eq!(printable("back\\slash"), "back\\\\slash");
        // Unambiguous: an escaped text never equals another text's escape.
        assert_ne!(printable("\\n"), printable("\n"));
    }
}
