//! `powercut-fs --backing DIR --mount DIR --control SOCKET`
//!
//! A FUSE passthrough that forgets, on command, what a power cut would forget: writes since a
//! file's last fsync and entry changes since a directory's last fsync. SIGKILL cannot find a
//! missing fsync (the page cache survives it); this can. See README.md for the model.

mod control;
mod fs;
mod journal;

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::{Arc, Mutex};

use fuser::MountOption;
use log::{error, info};

struct Args {
    backing: PathBuf,
    mount: PathBuf,
    control: PathBuf,
}

const USAGE: &str = "usage: powercut-fs --backing DIR --mount DIR --control SOCKET";

fn parse_args() -> Result<Args, String> {
    let mut backing = None;
    let mut mount = None;
    let mut control = None;
    let mut args = std::env::args_os().skip(1);
    while let Some(flag) = args.next() {
        let slot = match flag.to_str() {
            Some("--backing") => &mut backing,
            Some("--mount") => &mut mount,
            Some("--control") => &mut control,
            _ => return Err(format!("unknown argument {flag:?}\n{USAGE}")),
        };
        let value = args
            .next()
            .ok_or_else(|| format!("{flag:?} needs a value\n{USAGE}"))?;
        *slot = Some(PathBuf::from(value));
    }
    match (backing, mount, control) {
        (Some(backing), Some(mount), Some(control)) => Ok(Args {
            backing,
            mount,
            control,
        }),
        _ => Err(USAGE.to_string()),
    }
}

/// Lazy unmount: works even while the process under test still holds files open.
fn detach(mountpoint: &Path) {
    let Ok(c) = CString::new(mountpoint.as_os_str().as_bytes()) else {
        return;
    };
    // SAFETY: valid NUL-terminated path.
    unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
}

/// Blocks SIGINT/SIGTERM in this thread (and every thread spawned after) and returns the set,
/// so `main` can wait for them synchronously instead of in a signal handler.
fn block_signals() -> libc::sigset_t {
    // SAFETY: sigset_t is plain data initialised by sigemptyset before use.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    }
}

fn run(args: Args) -> Result<(), String> {
    if !Path::new("/dev/fuse").exists() {
        return Err(
            "/dev/fuse is missing: load the fuse module or run with --device /dev/fuse".into(),
        );
    }
    let mount = args
        .mount
        .canonicalize()
        .map_err(|e| format!("--mount {:?}: {e}", args.mount))?;
    let mut entries = std::fs::read_dir(&mount).map_err(|e| format!("--mount {mount:?}: {e}"))?;
    if entries.next().is_some() {
        return Err(format!("refusing to mount over non-empty {mount:?}"));
    }
    let core =
        fs::Core::new(&args.backing).map_err(|e| format!("--backing {:?}: {e}", args.backing))?;
    let core = Arc::new(Mutex::new(core));

    let signals = block_signals();
    let listener =
        control::bind(&args.control).map_err(|e| format!("--control {:?}: {e}", args.control))?;

    // A panic anywhere must not leave a dead mount behind ("Transport endpoint is not
    // connected") for the next test to trip over.
    let hook_mount = mount.clone();
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        default_hook(info);
        detach(&hook_mount);
        std::process::exit(101);
    }));

    // No AutoUnmount: without fusermount it cannot work. We unmount on SIGINT/SIGTERM and on
    // panic; after SIGKILL the caller must `umount -l` the mountpoint.
    let options = [
        MountOption::FSName("powercut".into()),
        MountOption::Subtype("powercut".into()),
        MountOption::DefaultPermissions,
        MountOption::RW,
    ];
    let session = fuser::spawn_mount2(fs::PowercutFs::new(core.clone()), &mount, &options)
        .map_err(|e| format!("mount {mount:?}: {e}"))?;
    info!("mounted {:?} over {:?}", mount, args.backing);
    control::spawn(listener, core);
    // Tests wait for this line (and for `ping`) before touching the mount.
    println!("ready");

    let mut sig: libc::c_int = 0;
    // SAFETY: `signals` was initialised by block_signals; `sig` is a valid out-pointer.
    unsafe { libc::sigwait(&signals, &mut sig) };
    info!("signal {sig}: unmounting {mount:?}");
    detach(&mount);
    let _ = std::fs::remove_file(&args.control);
    // The session thread ends when the kernel drops the connection, which with a lazy unmount
    // waits for the last open file: do not join it, just exit.
    std::mem::forget(session);
    Ok(())
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            error!("{e}");
            eprintln!("powercut-fs: {e}");
            ExitCode::FAILURE
        }
    }
}
