//! The power-cut filesystem (tests/powercut-fs) mounted for one test: what the agent writes
//! under [`PowerCut::mount`] survives a cut only if it was fsynced. Used by tests/it/crash.rs,
//! tests/it/uplink.rs, tests/it/sinks.rs and tests/it/dbsinks_e2e.rs; [`kill_rounds`] is the
//! long outage of uplink.rs and sinks.rs.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::agent::CairnProcess;
use super::{publish_all, signal, wait_until};

pub struct PowerCut {
    child: Child,
    /// Where the agent's data goes: everything under it is forgotten at a cut unless synced.
    pub mount: PathBuf,
    control: PathBuf,
    _dir: tempfile::TempDir,
}

impl PowerCut {
    pub fn mount() -> PowerCut {
        assert!(
            Path::new("/dev/fuse").exists(),
            "/dev/fuse is missing: the power-cut tests need FUSE (load the `fuse` module, run as root)"
        );
        let bin = powercut_bin();
        let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
        let (backing, mount, control) = (
            dir.path().join("backing"),
            dir.path().join("mnt"),
            dir.path().join("ctl.sock"),
        );
        std::fs::create_dir_all(&backing).unwrap();
        std::fs::create_dir_all(&mount).unwrap();
        let mut child = Command::new(bin)
            .arg("--backing")
            .arg(&backing)
            .arg("--mount")
            .arg(&mount)
            .arg("--control")
            .arg(&control)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn powercut-fs");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line.trim(), "ready", "powercut-fs did not mount");
        PowerCut {
            child,
            mount,
            control,
            _dir: dir,
        }
    }

    /// A control command (`cut all`, `cut prefix N`, `thaw`, ...); panics unless it is `ok`.
    pub fn command(&self, cmd: &str) -> String {
        let mut s = UnixStream::connect(&self.control).expect("powercut control socket");
        writeln!(s, "{cmd}").unwrap();
        let mut line = String::new();
        BufReader::new(s).read_line(&mut line).unwrap();
        assert!(
            line.starts_with("ok") || line.starts_with("pong"),
            "powercut `{cmd}`: {line}"
        );
        line.trim().to_string()
    }
}

impl Drop for PowerCut {
    fn drop(&mut self) {
        let _ = self.command_quiet("thaw");
        signal(self.child.id(), "TERM");
        let _ = wait_until(Duration::from_secs(5), || {
            matches!(self.child.try_wait(), Ok(Some(_)))
        });
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = Command::new("umount")
            .arg("-l")
            .arg(&self.mount)
            .stderr(Stdio::null())
            .status();
    }
}

impl PowerCut {
    fn command_quiet(&self, cmd: &str) -> std::io::Result<()> {
        let mut s = UnixStream::connect(&self.control)?;
        writeln!(s, "{cmd}")?;
        let mut line = String::new();
        BufReader::new(s).read_line(&mut line)?;
        Ok(())
    }
}

/// The kills of a long outage: five rounds in which the agent (started again after the
/// first, and connected to its broker at `port`) is killed while `per_round` new inputs
/// stream to that broker from another thread; with `cut`, its disk loses power just before
/// the kill in two rounds: everything unsynced in round 2, a torn prefix in round 4.
/// `events(from, to)` makes the inputs, numbered on from `next`; returns the number after
/// the last. The agent is left stopped.
pub fn kill_rounds(
    agent: &mut CairnProcess,
    cut: Option<&PowerCut>,
    port: u16,
    mut next: u64,
    per_round: u64,
    events: impl Fn(u64, u64) -> Vec<(String, Vec<u8>, bool)>,
) -> u64 {
    for round in 0..5u64 {
        if round > 0 {
            agent.start_connected();
        }
        let batch = events(next, next + per_round);
        next += per_round;
        let publisher = std::thread::spawn(move || publish_all(port, &batch));
        std::thread::sleep(Duration::from_millis(150 + 100 * round));
        let mode = match round {
            2 => Some("cut all".to_string()),
            4 => Some(format!("cut prefix {} tear", 0x5eed + next)),
            _ => None,
        };
        let power = cut.zip(mode);
        if let Some((c, mode)) = &power {
            let reply = c.command(mode);
            agent.note(&format!("power cut `{mode}`: {reply}"));
        }
        agent.kill();
        publisher.join().expect("publisher");
        if let Some((c, _)) = &power {
            c.command("thaw");
        }
    }
    next
}

/// The powercut-fs binary, built from this workspace if it is not there yet: beside the
/// `cairn` binary of this test or bench, so in the profile that built it (a bench's
/// `cairn` is under `target/release`).
fn powercut_bin() -> PathBuf {
    let cairn = PathBuf::from(env!("CARGO_BIN_EXE_cairn"));
    let bin = cairn.with_file_name("powercut-fs");
    if !bin.exists() {
        let release = cairn
            .parent()
            .is_some_and(|d| d.file_name().is_some_and(|n| n == "release"));
        let mut args = vec!["build", "-q", "-p", "powercut-fs"];
        if release {
            args.push("--release");
        }
        let mut cargo = Command::new(env!("CARGO"));
        cargo.args(&args).current_dir(env!("CARGO_MANIFEST_DIR"));
        // Run outside cargo (a bench binary started by hand), rustup's proxies would honour
        // the `rust-toolchain` file of the `fuser` crate (1.74, not installed here) while
        // building it: pin the toolchain this binary was built with, as cargo does.
        if let (None, Some(t)) = (
            std::env::var_os("RUSTUP_TOOLCHAIN"),
            option_env!("RUSTUP_TOOLCHAIN"),
        ) {
            cargo.env("RUSTUP_TOOLCHAIN", t);
        }
        let st = cargo.status().expect("run cargo to build powercut-fs");
        assert!(st.success(), "building powercut-fs failed");
    }
    bin
}
