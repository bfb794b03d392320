//! SIGHUP means "reload the config" (systemd's `ExecReload=`), not "terminate".
//!
//! `ctrlc` with its `termination` feature treats SIGINT, SIGTERM and SIGHUP alike (drain and
//! exit). [`install_reload_handler`] runs after it and takes SIGHUP back: the handler only
//! sets a flag (async-signal-safe), and the agent loop picks it up with [`take_reload`].

use std::sync::atomic::{AtomicBool, Ordering};

static RELOAD: AtomicBool = AtomicBool::new(false);

extern "C" fn on_hup(_signal: libc::c_int) {
    RELOAD.store(true, Ordering::SeqCst);
}

/// Route SIGHUP to [`take_reload`]. Call after `ctrlc::set_handler`.
pub(crate) fn install_reload_handler() -> std::io::Result<()> {
    // SAFETY: `sigaction` with a zeroed struct, an empty mask and a handler that only stores
    // to an atomic, which is async-signal-safe.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = on_hup as *const () as usize;
        action.sa_flags = libc::SA_RESTART;
        libc::sigemptyset(&mut action.sa_mask);
        if libc::sigaction(libc::SIGHUP, &action, std::ptr::null_mut()) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Was a reload requested since the last call?
pub(crate) fn take_reload() -> bool {
    RELOAD.swap(false, Ordering::SeqCst)
}
