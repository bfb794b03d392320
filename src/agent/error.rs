//! What can stop the agent, and the operator's reading of an out-of-space failure.

use std::path::{Path, PathBuf};

use crate::log::LogError;
use crate::mqtt::MqttError;
use crate::processor::ProcessError;

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("replay log: {0}")]
    Log(#[from] LogError),
    #[error("{0}")]
    Process(#[from] ProcessError),
    #[error("store: {0}")]
    Store(#[from] crate::store::StoreError),
    #[error("mqtt: {0}")]
    Mqtt(#[from] MqttError),
    #[error("the MQTT thread stopped unexpectedly")]
    MqttGone,
    #[error("metrics: cannot listen on {addr}: {source}")]
    Metrics {
        addr: String,
        source: std::io::Error,
    },
    #[error("{0}")]
    Failpoint(std::io::Error),
    #[error(transparent)]
    Disk(#[from] crate::disk::DiskError),
    #[error(
        "{source}. The filesystem under {} is out of space (bytes or inodes): free space there \
         and start the agent again. Nothing acknowledged is lost: it is in the log, and the \
         broker redelivers what was not acknowledged",
        .dir.display()
    )]
    DiskFull {
        dir: PathBuf,
        source: Box<AgentError>,
    },
}

impl AgentError {
    /// The OS error underneath, if this failure came from one.
    fn io_error(&self) -> Option<&std::io::Error> {
        match self {
            AgentError::Log(LogError::Io { source, .. })
            | AgentError::Process(ProcessError::Log(LogError::Io { source, .. })) => Some(source),
            AgentError::Store(e) | AgentError::Process(ProcessError::Store(e)) => e.io_error(),
            _ => None,
        }
    }

    /// An ENOSPC that got past the space guard is still fatal (a failed write may have
    /// poisoned the log), but the operator is told what it was and what to do.
    pub(super) fn explain_disk_full(self, dir: &Path) -> AgentError {
        if self.io_error().is_some_and(crate::disk::is_disk_full) {
            AgentError::DiskFull {
                dir: dir.to_path_buf(),
                source: Box::new(self),
            }
        } else {
            self
        }
    }
}

/// Pass a failpoint (a no-op unless built with the `failpoints` feature).
pub(super) fn failpoint(name: &str) -> Result<(), AgentError> {
    crate::failpoint::hit(name).map_err(AgentError::Failpoint)
}
