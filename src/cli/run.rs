//! `cairn run`: the agent in the foreground, with its signal handlers.

use super::failure::{EXIT_OK, Failure};
use crate::config::Config;

/// A start that fails. A pipeline definition that would misread its stored state, or a
/// `--reset-pipeline` naming no pipeline, is the config's or the command line's to fix:
/// exit 2, as `validate` does for the same config; anything else is a runtime failure.
fn start_failure(e: crate::agent::AgentError) -> Failure {
    use crate::agent::AgentError;
    use crate::processor::ProcessError;
    match e {
        AgentError::Process(
            ProcessError::IncompatiblePipeline { .. }
            | ProcessError::UnknownDefinition { .. }
            | ProcessError::UnknownReset { .. },
        ) => Failure::usage(e),
        e => Failure::runtime(e),
    }
}

pub(crate) fn run(cfg: Config, reset: &[String]) -> Result<(), Failure> {
    use crate::agent::{Agent, Shutdown};
    let shutdown = Shutdown::new();
    let on_signal = shutdown.clone();
    ctrlc::set_handler(move || {
        if on_signal.request() >= 2 {
            // Everything acknowledged is already durable; exiting here is a crash we recover
            // from by replay, so it is safe to leave at once.
            crate::event!(warn, "signal_exit_now"; "second signal: exiting now");
            std::process::exit(EXIT_OK);
        }
        crate::event!(info, "signal_draining"; "signal: draining; send it again to exit at once");
    })
    .map_err(|e| Failure::runtime(format!("cannot install the signal handler: {e}")))?;
    crate::signals::install_reload_handler()
        .map_err(|e| Failure::runtime(format!("cannot install the SIGHUP handler: {e}")))?;
    let agent = Agent::start_with_reset(cfg, crate::fsio::real(), reset).map_err(start_failure)?;
    // Recovery is done and the MQTT client runs: `systemctl start` may return.
    crate::notify::ready();
    crate::notify::status("running: recovery done");
    agent.run(&shutdown).map_err(Failure::runtime)
}
