//! How a command ends: an exit code and a message for `main` to print.
//!
//! Its own file so that every command can name it without importing the dispatcher in
//! `cli/mod.rs` back (that was the crate's only import cycle).
//!
//! Exit codes: 0 ok, 1 runtime failure, 2 usage or config error (DESIGN §3).

pub(crate) const EXIT_OK: i32 = 0;
pub(crate) const EXIT_RUNTIME: i32 = 1;
pub(crate) const EXIT_USAGE: i32 = 2;

/// A failure with its exit code and message, for `main` to print.
#[derive(Debug)]
pub(crate) struct Failure {
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
    /// Not a failure to report: stdout was closed (`| head`), so the command ends quietly
    /// with success.
    pub(crate) fn quiet() -> Failure {
        Failure {
            code: EXIT_OK,
            message: String::new(),
        }
    }
}
