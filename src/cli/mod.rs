//! The `cairn` command: argument parsing, config loading, and one file per command.
//!
//! - `run.rs`, `validate.rs`, `inspect.rs`, `verify.rs`, `status.rs`, `savepoint.rs`,
//!   `outbox.rs`: the commands, each `run(..) -> Result<(), Failure>`;
//! - `failure.rs`: [`Failure`] and the exit codes (0 ok, 1 runtime failure, 2 usage or
//!   config error; DESIGN §3), which every command imports from there, never from here;
//! - `output.rs`: line printing that ends quietly on a closed pipe, terminal-safe text;
//! - `owner.rs`: root runs as the data directory's owner, and the directory is checked
//!   before any command uses it; `checks.rs`: the security warnings `validate` prints and
//!   `run` logs (anonymous or clear-text broker logins, keys others can read, secrets the
//!   service cannot read).

use std::path::{Path, PathBuf};

use clap::{Parser, Subcommand};

use crate::config::{self, Config, ConfigError};

mod checks;
mod failure;
#[cfg(test)]
mod generated;
mod inspect;
mod outbox;
mod output;
mod owner;
mod progress;
mod run;
mod savepoint;
mod status;
mod validate;
mod verify;

pub(crate) use failure::{EXIT_OK, EXIT_USAGE, Failure};
pub(crate) use inspect::Inspect;
pub(crate) use savepoint::SavepointCommand;

/// The end of `cairn --help` and of the man page `cairn(1)`.
const AFTER_HELP: &str = "\
Exit status: 0 ok, 1 runtime failure, 2 usage or configuration error.

Files: /etc/cairn/cairn.toml (the configuration), /var/lib/cairn (the data directory of the \
packaged service: log/, store/, savepoints/, and cairn.sock, where a running agent answers \
`cairn status`).

The journal: under systemd every line carries CAIRN_EVENT and, where they apply, \
CAIRN_PIPELINE, CAIRN_SINK, CAIRN_REASON, CAIRN_OFFSET, CAIRN_KEY: `journalctl -u cairn \
CAIRN_EVENT=dead_letter CAIRN_REASON=late`.

Documentation: /usr/share/doc/cairn/ (README.md and docs/).";

#[derive(Parser, Debug)]
#[command(
    name = "cairn",
    version,
    about = "Exactly-once MQTT aggregation for edge boxes",
    after_long_help = AFTER_HELP
)]
pub(crate) struct Cli {
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
pub(crate) enum Command {
    /// Run the agent in the foreground until SIGINT/SIGTERM (drains, exits 0); SIGHUP
    /// reloads the safe parts of the config.
    Run {
        /// Drop this pipeline's stored state, its dedup ledger included (an event ID it saw
        /// before is applied again), and start it empty, in a new generation of output IDs
        /// (after a change to its definition that would misread the old state).
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
    /// The running agent's figures (from its socket in the data directory, or `[metrics]
    /// listen`), or the data directory's.
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
        what: SavepointCommand,
    },
    /// Results waiting to go out: list them, or drop one stuck result (agent stopped).
    Outbox {
        #[command(subcommand)]
        what: outbox::OutboxCommand,
    },
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
            crate::logging::progress::done();
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

pub(crate) fn load_config(path: &Path) -> Result<Config, Failure> {
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
        return validate::run(&cli.config);
    }
    let cfg = load_config(&cli.config)?;
    crate::logging::set_level(cfg.logging.level);
    // Before anything touches the data directory: root runs as its owner, and a directory
    // others could write (or holding another user's files) is refused (issue 27). `status`
    // only reads, and often as a monitoring user through the agent's endpoint: it switches
    // like the others, but is not refused.
    owner::become_data_dir_owner(&cfg)?;
    if !matches!(cli.command, Command::Status { .. })
        && let Some(problem) = owner::data_dir_problem(&cfg.storage.data_dir)
    {
        return Err(Failure::runtime(problem));
    }
    if matches!(
        cli.command,
        Command::Verify { .. }
            | Command::Savepoint { .. }
            | Command::Inspect { .. }
            | Command::Outbox { .. }
    ) {
        progress::install_if_terminal();
    }
    match cli.command {
        Command::Validate => unreachable!(),
        Command::Run { reset_pipeline } => {
            for w in cfg
                .warnings()
                .iter()
                .chain(&checks::security_warnings(&cfg))
            {
                crate::event!(warn, "config_warning"; "config: {}", crate::text::Shown(w));
            }
            run::run(cfg, &reset_pipeline)
        }
        Command::Inspect { what } => inspect::run(&cfg, what),
        Command::Verify { repair, json } => verify::run(&cfg, repair, json),
        Command::Status { json, offline } => status::run(&cfg, json, offline),
        Command::Savepoint { what } => savepoint::run(&cfg, what),
        Command::Outbox { what } => outbox::run(&cfg, what),
    }
}
