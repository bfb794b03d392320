//! Mounts the real binary and checks the power-cut model with plain `std::fs`.
//!
//! Needs root and /dev/fuse; without them every test fails loudly (never skips).
//!
//! Why ~600 lines: one test per rule of the power-cut model, plus the sled child-process
//! checks that show the model is faithful to what sled needs.

use std::fs::{self, File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

/// A mounted powercut-fs; unmounts and stops the process on drop, even when a test panics.
struct Mounted {
    child: Child,
    /// Held for its drop, which runs after ours: removed only once nothing is mounted in it.
    _root: tempfile::TempDir,
    mount: PathBuf,
    socket: PathBuf,
}

impl Mounted {
    fn start() -> Mounted {
        assert!(
            Path::new("/dev/fuse").exists(),
            "/dev/fuse is missing: these tests need FUSE (run as root with /dev/fuse available)"
        );
        let root = tempfile::tempdir().expect("temp dir");
        let backing = root.path().join("backing");
        let mount = root.path().join("mnt");
        let socket = root.path().join("control.sock");
        fs::create_dir(&backing).unwrap();
        fs::create_dir(&mount).unwrap();
        let mut child = Command::new(env!("CARGO_BIN_EXE_powercut-fs"))
            .arg("--backing")
            .arg(&backing)
            .arg("--mount")
            .arg(&mount)
            .arg("--control")
            .arg(&socket)
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn powercut-fs");
        let stdout: ChildStdout = child.stdout.take().unwrap();
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line).unwrap();
        let mounted = Mounted {
            child,
            _root: root,
            mount,
            socket,
        };
        assert_eq!(
            line.trim(),
            "ready",
            "powercut-fs did not start (see its stderr above)"
        );
        assert_eq!(mounted.ctl("ping"), "pong");
        mounted
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.mount.join(rel)
    }

    fn ctl(&self, command: &str) -> String {
        let mut stream = UnixStream::connect(&self.socket).expect("connect control socket");
        stream.write_all(format!("{command}\n").as_bytes()).unwrap();
        let mut line = String::new();
        BufReader::new(stream).read_line(&mut line).unwrap();
        line.trim().to_string()
    }

    fn cut(&self, command: &str) {
        let reply = self.ctl(command);
        assert!(
            reply.starts_with("ok cut") && reply.ends_with("errors=0"),
            "{command}: {reply}"
        );
        assert_eq!(self.ctl("thaw"), "ok thawed");
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        // SAFETY: plain kill(2) on our own child's pid.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        // Belt and braces: a killed daemon leaves its mount behind.
        let c = std::ffi::CString::new(self.mount.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: valid NUL-terminated path.
        unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
    }
}

#[test]
fn refuses_to_mount_over_a_non_empty_directory() {
    let root = tempfile::tempdir().unwrap();
    fs::create_dir(root.path().join("mnt")).unwrap();
    fs::write(root.path().join("mnt/occupied"), b"x").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_powercut-fs"))
        .arg("--backing")
        .arg(root.path())
        .arg("--mount")
        .arg(root.path().join("mnt"))
        .arg("--control")
        .arg(root.path().join("sock"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("non-empty"), "{stderr}");
}

fn fsync_dir(dir: &Path) {
    File::open(dir).unwrap().sync_all().unwrap();
}

fn write_synced(path: &Path, data: &[u8]) {
    let mut f = File::create(path).unwrap();
    f.write_all(data).unwrap();
    f.sync_all().unwrap();
}

fn read(path: &Path) -> Vec<u8> {
    fs::read(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

#[test]
fn a_synced_file_survives_cut_all_and_unsynced_writes_revert_content_and_size() {
    let m = Mounted::start();
    write_synced(&m.path("synced"), b"0123456789");
    write_synced(&m.path("later"), b"abcdefghij");
    fsync_dir(&m.mount);
    // Overwrite the middle and extend, never synced.
    let f = OpenOptions::new()
        .write(true)
        .open(m.path("later"))
        .unwrap();
    f.write_all_at(b"XYZ", 4).unwrap();
    f.write_all_at(b"tail", 40).unwrap();
    drop(f);
    // And a synced file shrunk without sync.
    File::options()
        .write(true)
        .open(m.path("synced"))
        .unwrap()
        .set_len(3)
        .unwrap();
    assert_eq!(fs::metadata(m.path("later")).unwrap().len(), 44);
    assert!(m.ctl("status").contains("files=2"), "{}", m.ctl("status"));

    m.cut("cut all");

    assert_eq!(read(&m.path("synced")), b"0123456789");
    assert_eq!(read(&m.path("later")), b"abcdefghij");
    assert_eq!(fs::metadata(m.path("later")).unwrap().len(), 10);
}

#[test]
fn a_fsynced_file_vanishes_unless_its_directory_was_fsynced() {
    let m = Mounted::start();
    fs::create_dir(m.path("d")).unwrap();
    fsync_dir(&m.mount);
    write_synced(&m.path("d/lost"), b"data");
    m.cut("cut all");
    assert!(
        !m.path("d/lost").exists(),
        "created without a directory fsync, yet survived"
    );
    assert!(
        m.path("d").is_dir(),
        "the directory itself was synced in its parent"
    );

    write_synced(&m.path("d/kept"), b"data");
    fsync_dir(&m.path("d"));
    m.cut("cut all");
    assert_eq!(read(&m.path("d/kept")), b"data");
    assert_eq!(fs::read_dir(m.path("d")).unwrap().count(), 1);
}

#[test]
fn a_rename_over_an_existing_file_reverts_to_the_old_file_without_a_directory_fsync() {
    let m = Mounted::start();
    write_synced(&m.path("config"), b"old");
    fsync_dir(&m.mount);

    write_synced(&m.path("config.tmp"), b"new");
    fs::rename(m.path("config.tmp"), m.path("config")).unwrap();
    assert_eq!(read(&m.path("config")), b"new");
    m.cut("cut all");
    assert_eq!(read(&m.path("config")), b"old");
    assert!(!m.path("config.tmp").exists());

    // The full atomic-replace recipe does survive.
    write_synced(&m.path("config.tmp"), b"new");
    fs::rename(m.path("config.tmp"), m.path("config")).unwrap();
    fsync_dir(&m.mount);
    m.cut("cut all");
    assert_eq!(read(&m.path("config")), b"new");
    assert!(!m.path("config.tmp").exists());
}

#[test]
fn unlink_and_rmdir_without_a_directory_fsync_come_back() {
    let m = Mounted::start();
    fs::create_dir(m.path("sub")).unwrap();
    write_synced(&m.path("file"), b"still here");
    fsync_dir(&m.mount);
    fs::remove_file(m.path("file")).unwrap();
    fs::remove_dir(m.path("sub")).unwrap();
    m.cut("cut all");
    assert_eq!(read(&m.path("file")), b"still here");
    assert!(m.path("sub").is_dir());
}

#[test]
fn every_operation_fails_with_eio_between_cut_and_thaw() {
    let m = Mounted::start();
    write_synced(&m.path("f"), b"x");
    fsync_dir(&m.mount);
    let reply = m.ctl("cut all");
    assert!(reply.starts_with("ok cut"), "{reply}");
    let eio = |r: std::io::Result<()>, what: &str| {
        let e = r.expect_err(what);
        assert_eq!(e.raw_os_error(), Some(libc::EIO), "{what}: {e}");
    };
    eio(fs::read(m.path("f")).map(drop), "read");
    eio(fs::metadata(m.path("f")).map(drop), "stat");
    eio(File::create(m.path("g")).map(drop), "create");
    eio(
        fs::read_dir(&m.mount)
            .and_then(|mut d| d.next().transpose())
            .map(drop),
        "readdir",
    );
    assert!(m.ctl("status").contains("frozen=true"));
    assert_eq!(m.ctl("thaw"), "ok thawed");
    assert_eq!(read(&m.path("f")), b"x");
}

/// The history used by the prefix tests: a synced 64-byte base, then `WRITES` unsynced
/// 8-byte writes, each at a distinct offset, some overwriting the base, some extending it.
const WRITES: usize = 12;

fn write_history(m: &Mounted) {
    write_synced(&m.path("log"), &[b'.'; 64]);
    fsync_dir(&m.mount);
    let f = OpenOptions::new().write(true).open(m.path("log")).unwrap();
    for i in 0..WRITES {
        f.write_all_at(&[b'a' + i as u8; 8], (i * 8) as u64)
            .unwrap();
    }
}

/// The file after the first `k` writes of the history, plus `torn` bytes of write `k`.
fn after_writes(k: usize, torn: usize) -> Vec<u8> {
    let mut v = vec![b'.'; 64];
    for i in 0..=k.min(WRITES - 1) {
        let n = if i < k { 8 } else { torn };
        let end = i * 8 + n;
        if end > v.len() && n > 0 {
            v.resize(end, 0);
        }
        v[i * 8..i * 8 + n].fill(b'a' + i as u8);
    }
    v
}

fn prefix_outcome(command: &str) -> Vec<u8> {
    let m = Mounted::start();
    write_history(&m);
    m.cut(command);
    read(&m.path("log"))
}

#[test]
fn cut_prefix_keeps_the_durable_base_plus_a_prefix_of_later_writes_deterministically() {
    let mut seen = std::collections::BTreeSet::new();
    for seed in 1..=6 {
        let got = prefix_outcome(&format!("cut prefix {seed}"));
        let k = (0..=WRITES)
            .find(|&k| after_writes(k, 0) == got)
            .unwrap_or_else(|| {
                panic!(
                    "seed {seed}: not a prefix: {:?}",
                    String::from_utf8_lossy(&got)
                )
            });
        seen.insert(k);
        assert_eq!(
            got,
            prefix_outcome(&format!("cut prefix {seed}")),
            "seed {seed} not deterministic"
        );
    }
    assert!(seen.len() > 1, "every seed kept the same prefix {seen:?}");

    for seed in 1..=4 {
        let got = prefix_outcome(&format!("cut prefix {seed} tear"));
        let ok = (0..=WRITES).any(|k| (0..8).any(|t| after_writes(k, t) == got));
        assert!(
            ok,
            "seed {seed}: not a torn prefix: {:?}",
            String::from_utf8_lossy(&got)
        );
    }
}

#[test]
fn cut_random_keeps_a_subset_of_writes_deterministically() {
    for seed in 1..=3 {
        let got = prefix_outcome(&format!("cut random {seed}"));
        assert!(got.len() >= 64 && got.len() <= WRITES * 8);
        for (i, chunk) in got.chunks(8).enumerate() {
            let write = vec![b'a' + i as u8; 8];
            let base = if i * 8 < 64 {
                vec![b'.'; 8]
            } else {
                vec![0; 8]
            };
            assert!(
                chunk == write || chunk == base,
                "seed {seed} chunk {i}: {chunk:?}"
            );
        }
        assert_eq!(
            got,
            prefix_outcome(&format!("cut random {seed}")),
            "seed {seed}"
        );
    }
}

/// sled right after creation has fsynced none of its files or directories (DESIGN §4).
fn fsync_tree(dir: &Path) {
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            fsync_tree(&path);
        } else {
            File::open(&path).unwrap().sync_all().unwrap();
        }
    }
    fsync_dir(dir);
}

/// No periodic flusher: its `sync_all` every 500 ms (and at drop) would make the outcome
/// depend on timing. With it off, the only fsyncs are the ones the test does.
fn open_sled(path: &Path) -> sled::Db {
    sled::Config::new()
        .path(path)
        .cache_capacity(8 << 20)
        .flush_every_ms(None)
        .open()
        .expect("open sled")
}

/// Creates a sled db at `name` and makes its skeleton durable, so a cut can only lose data.
fn durable_empty_sled(m: &Mounted, name: &str) -> PathBuf {
    let path = m.path(name);
    drop(open_sled(&path));
    fsync_tree(&path);
    fsync_dir(&m.mount);
    path
}

/// Set in the child process that plays the sled user: path of the db.
const SLED_CHILD_DB: &str = "POWERCUT_SLED_CHILD_DB";
/// Set to "1" in that child to fsync `db` and its directory after `flush()`.
const SLED_CHILD_FSYNC: &str = "POWERCUT_SLED_CHILD_FSYNC";

/// Not a test on its own: the body of the child process spawned by `sled_after_cut` (a power
/// cut kills the process; dropping a sled Db would be a clean shutdown, and sled panics in
/// drop on EIO). Without the variable it returns at once.
#[test]
fn sled_child_process_inserts_and_flushes_when_asked() {
    let Some(path) = std::env::var_os(SLED_CHILD_DB) else {
        return;
    };
    let path = PathBuf::from(path);
    let db = open_sled(&path);
    db.insert(b"key", b"value").unwrap();
    db.flush().unwrap();
    if std::env::var(SLED_CHILD_FSYNC).as_deref() == Ok("1") {
        File::open(path.join("db")).unwrap().sync_all().unwrap();
        fsync_dir(&path);
    }
    println!("flushed");
    std::io::stdout().flush().unwrap();
    // Wait to be SIGKILLed with the Db still open.
    std::thread::sleep(Duration::from_secs(60));
    panic!("sled child was not killed");
}

/// A child process inserts one key and flushes (optionally fsyncing `db` and the directory),
/// is SIGKILLed, the power is cut, and the db is reopened after `thaw`.
fn sled_after_cut(m: &Mounted, name: &str, fsync_after_flush: bool) -> String {
    let path = durable_empty_sled(m, name);
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "sled_child_process_inserts_and_flushes_when_asked",
            "--nocapture",
        ])
        .env(SLED_CHILD_DB, &path)
        .env(SLED_CHILD_FSYNC, if fsync_after_flush { "1" } else { "0" })
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    while line.trim() != "flushed" {
        line.clear();
        if out.read_line(&mut line).unwrap() == 0 {
            let _ = child.kill();
            panic!("sled child exited before flushing: {:?}", child.wait());
        }
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let status = m.ctl("status");
    m.cut("cut all");
    let outcome = match sled::Config::new().path(&path).flush_every_ms(None).open() {
        Ok(db) => match db.get(b"key") {
            Ok(Some(v)) if v.as_ref() == b"value" => "present".to_string(),
            Ok(Some(v)) => format!("wrong value {v:?}"),
            Ok(None) => "lost".to_string(),
            Err(e) => format!("get failed: {e}"),
        },
        Err(e) => format!("reopen failed: {e}"),
    };
    println!(
        "sled, fsync after flush = {fsync_after_flush}: unsynced before cut: {status}; key {outcome}"
    );
    outcome
}

#[test]
fn sled_data_survives_cut_all_with_an_fsync_after_flush_and_plain_flush_is_reported() {
    let m = Mounted::start();
    assert_eq!(
        sled_after_cut(&m, "durable", true),
        "present",
        "flush + fsync lost data"
    );
    // DESIGN §4 says flush() alone is not power-cut durable; report, do not assert.
    let outcome = sled_after_cut(&m, "flush-only", false);
    println!("sled insert + flush() without fsync, then cut all: key {outcome}");
}

#[test]
fn cut_prefix_keeps_a_prefix_of_a_directorys_entry_changes() {
    let outcome = |seed: u64| {
        let m = Mounted::start();
        fs::create_dir(m.path("d")).unwrap();
        fsync_dir(&m.mount);
        for i in 0..8 {
            write_synced(&m.path(&format!("d/f{i}")), b"x");
        }
        m.cut(&format!("cut prefix {seed}"));
        let mut names: Vec<String> = fs::read_dir(m.path("d"))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        names
    };
    let mut kept = std::collections::BTreeSet::new();
    for seed in 1..=5 {
        let names = outcome(seed);
        let expected: Vec<String> = (0..names.len()).map(|i| format!("f{i}")).collect();
        assert_eq!(names, expected, "seed {seed}: not a prefix of the creates");
        assert_eq!(names, outcome(seed), "seed {seed} not deterministic");
        kept.insert(names.len());
    }
    assert!(
        kept.len() > 1,
        "every seed kept the same number of entries {kept:?}"
    );
}

/// Deterministic test-side randomness (not the daemon's: the two must not share a stream).
struct Lcg(u64);

impl Lcg {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % n
    }
}

/// What POSIX promises after a cut, for files in one directory: the model the daemon must
/// match exactly under `cut all`.
#[derive(Default)]
struct Model {
    /// Current name → file id, and what the kernel shows for each id.
    names: std::collections::BTreeMap<String, usize>,
    contents: Vec<Vec<u8>>,
    /// Name → id as of the last directory fsync, and each id's bytes as of its last fsync.
    durable_names: std::collections::BTreeMap<String, usize>,
    durable: Vec<Vec<u8>>,
}

impl Model {
    fn after_cut(&mut self) {
        self.names = self.durable_names.clone();
        for id in self.names.values() {
            self.contents[*id] = self.durable[*id].clone();
        }
    }
}

#[test]
fn cut_all_matches_the_posix_model_over_random_histories() {
    // More histories on demand: POWERCUT_MODEL_SEEDS=200 cargo test -p powercut-fs
    let seeds: u64 = std::env::var("POWERCUT_MODEL_SEEDS").map_or(4, |s| s.parse().unwrap());
    for seed in 1..=seeds {
        let m = Mounted::start();
        let mut rng = Lcg(seed);
        let mut model = Model::default();
        let names = ["a", "b", "c", "d"];
        for round in 0..3 {
            for _ in 0..60 {
                let name = names[rng.below(4) as usize];
                let path = m.path(name);
                match (rng.below(7), model.names.get(name).copied()) {
                    (0, None) => {
                        File::create(&path).unwrap();
                        model.contents.push(Vec::new());
                        model.durable.push(Vec::new());
                        model
                            .names
                            .insert(name.to_string(), model.contents.len() - 1);
                    }
                    (1 | 2, Some(id)) => {
                        let off = rng.below(48) as usize;
                        let data = vec![b'A' + rng.below(26) as u8; 1 + rng.below(20) as usize];
                        let f = OpenOptions::new().write(true).open(&path).unwrap();
                        f.write_all_at(&data, off as u64).unwrap();
                        let c = &mut model.contents[id];
                        if c.len() < off + data.len() {
                            c.resize(off + data.len(), 0);
                        }
                        c[off..off + data.len()].copy_from_slice(&data);
                    }
                    (3, Some(id)) => {
                        let len = rng.below(64) as usize;
                        File::options()
                            .write(true)
                            .open(&path)
                            .unwrap()
                            .set_len(len as u64)
                            .unwrap();
                        model.contents[id].resize(len, 0);
                    }
                    (4, Some(id)) => {
                        File::open(&path).unwrap().sync_all().unwrap();
                        model.durable[id] = model.contents[id].clone();
                    }
                    (5, Some(id)) => {
                        let to = names[rng.below(4) as usize];
                        if rng.below(2) == 0 {
                            fs::remove_file(&path).unwrap();
                            model.names.remove(name);
                        } else if to != name {
                            fs::rename(&path, m.path(to)).unwrap();
                            model.names.remove(name);
                            model.names.insert(to.to_string(), id);
                        }
                    }
                    (6, _) => {
                        fsync_dir(&m.mount);
                        model.durable_names = model.names.clone();
                    }
                    _ => {}
                }
            }
            m.cut("cut all");
            model.after_cut();
            let mut listed: Vec<String> = fs::read_dir(&m.mount)
                .unwrap()
                .map(|e| e.unwrap().file_name().into_string().unwrap())
                .collect();
            listed.sort();
            let expected: Vec<String> = model.names.keys().cloned().collect();
            assert_eq!(listed, expected, "seed {seed} round {round}: entries");
            for (name, id) in &model.names {
                let got = read(&m.path(name));
                assert_eq!(
                    got, model.contents[*id],
                    "seed {seed} round {round}: {name}"
                );
            }
        }
    }
}
