//! The terminal's side of [`crate::logging::progress`]: one line on stderr, redrawn in place
//! at most every [`REDRAW`], erased when the phase is over, so the command's result (on
//! stdout) starts on a clean line. Installed only when stderr is a terminal.

use std::io::Write;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::logging::progress::{Reporter, Step, Unit};

/// Often enough to look alive, rarely enough to cost nothing next to the work.
const REDRAW: Duration = Duration::from_millis(100);

/// Draw progress if stderr is a terminal; otherwise (piped, a file, the journal) stay
/// quiet.
pub(crate) fn install_if_terminal() {
    // SAFETY: isatty only inspects a descriptor number.
    if unsafe { libc::isatty(2) } == 1 {
        crate::logging::progress::install(Box::new(Terminal::default()));
    }
}

#[derive(Default)]
struct Terminal {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    phase: Option<&'static str>,
    drawn_at: Option<Instant>,
    drawn: bool,
}

impl Reporter for Terminal {
    fn step(&self, s: Step) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        let new_phase = st.phase != Some(s.what);
        let finished = s.total.is_some_and(|t| s.done >= t);
        if !new_phase && !finished && st.drawn_at.is_some_and(|at| now - at < REDRAW) {
            return;
        }
        st.phase = Some(s.what);
        st.drawn_at = Some(now);
        st.drawn = true;
        let mut err = std::io::stderr().lock();
        let _ = write!(err, "\r\x1b[K{}", line(s));
        let _ = err.flush();
    }

    fn done(&self) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if st.drawn {
            let mut err = std::io::stderr().lock();
            let _ = write!(err, "\r\x1b[K");
            let _ = err.flush();
        }
        *st = State::default();
    }
}

/// `reading the log: 45% (1.2 GiB of 2.6 GiB)`, or without a total `writing the savepoint:
/// 120000 entries`.
pub(crate) fn line(s: Step) -> String {
    let amount = |n: u64| match s.unit {
        Unit::Bytes => super::status::human_bytes(n),
        Unit::Entries => format!("{n} entries"),
    };
    match s.total {
        Some(total) if total > 0 => {
            let pct = (u128::from(s.done.min(total)) * 100 / u128::from(total)) as u64;
            format!(
                "{}: {pct}% ({} of {})",
                s.what,
                amount(s.done),
                amount(total)
            )
        }
        _ => format!("{}: {}", s.what, amount(s.done)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_reads_as_a_share_and_amounts() {
        let s = |done, total, unit| Step {
            what: "reading the log",
            done,
            total,
            unit,
        };
        assert_eq!(
            line(s(1 << 29, Some(1 << 31), Unit::Bytes)),
            "reading the log: 25% (512 MiB of 2 GiB)"
        );
        assert_eq!(
            line(s(7, None, Unit::Entries)),
            "reading the log: 7 entries"
        );
        assert_eq!(
            line(s(u64::MAX, Some(u64::MAX), Unit::Entries)),
            format!(
                "reading the log: 100% ({} entries of {} entries)",
                u64::MAX,
                u64::MAX
            )
        );
        assert_eq!(line(s(0, Some(0), Unit::Bytes)), "reading the log: 0 B");
    }
}
