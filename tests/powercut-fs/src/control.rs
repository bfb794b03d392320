//! Control socket: one line in, one line out.
//!
//! `ping` | `status` | `cut all` | `cut prefix SEED [tear]` | `cut random SEED [tear]` | `thaw`

use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::thread;

use log::warn;

use crate::fs::Shared;
use crate::journal::CutMode;

/// Longest accepted command line, so a confused client cannot grow our memory.
const LINE_BYTES_MAX: u64 = 256;

pub fn bind(path: &Path) -> io::Result<UnixListener> {
    // A socket file left by a killed run would make bind fail with EADDRINUSE.
    if path.exists() {
        std::fs::remove_file(path)?;
    }
    UnixListener::bind(path)
}

pub fn spawn(listener: UnixListener, core: Shared) {
    thread::spawn(move || {
        for stream in listener.incoming() {
            match stream {
                Ok(stream) => {
                    let core = core.clone();
                    thread::spawn(move || {
                        if let Err(e) = serve(stream, &core) {
                            warn!("control connection: {e}");
                        }
                    });
                }
                Err(e) => warn!("control accept: {e}"),
            }
        }
    });
}

fn serve(stream: UnixStream, core: &Shared) -> io::Result<()> {
    let mut out = stream.try_clone()?;
    let mut reader = BufReader::new(stream);
    loop {
        let mut line = String::new();
        if (&mut reader).take(LINE_BYTES_MAX).read_line(&mut line)? == 0 {
            return Ok(());
        }
        let reply = execute(line.trim(), core);
        out.write_all(reply.as_bytes())?;
        out.write_all(b"\n")?;
    }
}

pub fn execute(line: &str, core: &Shared) -> String {
    let words: Vec<&str> = line.split_whitespace().collect();
    let mut core = core.lock().unwrap_or_else(|p| p.into_inner());
    match words.as_slice() {
        ["ping"] => "pong".to_string(),
        ["status"] => core.status(),
        ["thaw"] => core.thaw(),
        ["cut", "all"] => core.cut(CutMode::All, 0, false),
        ["cut", mode, seed, rest @ ..] => {
            let mode = match *mode {
                "prefix" => CutMode::Prefix,
                "random" => CutMode::Random,
                _ => return format!("err unknown cut mode {mode:?}"),
            };
            let Ok(seed) = seed.parse::<u64>() else {
                return format!("err bad seed {seed:?}");
            };
            let tear = match rest {
                [] => false,
                ["tear"] => true,
                _ => return format!("err unexpected {rest:?}"),
            };
            core.cut(mode, seed, tear)
        }
        _ => format!("err unknown command {line:?}"),
    }
}
