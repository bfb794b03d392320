//! Power-cut property test for the replay log.
//!
//! A seam records, per file, how many bytes the last successful fsync covered and, per
//! directory, which entries the last directory fsync covered. It can be armed to "lose
//! power" after N more syncs, which makes the commit in flight fail. A crash then keeps each
//! file's synced bytes plus a random part of the rest (a prefix, maybe followed by zeros or
//! garbage, or with blocks of it lost out of order, as a page cache writing back in any order
//! leaves it), and may make a file whose directory entry was never synced vanish. The model is
//! a `Vec` of committed records: after reopening, the log must hold exactly those, in order,
//! then possibly a prefix of the commit that was in flight, and nothing else.
//!
//! `CAIRN_LOG_CRASH_CASES` raises the number of cases (default 1200, ~10 s in debug).

use std::collections::{HashMap, HashSet};
use std::ffi::OsString;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use cairn::fsio::{SyncKind, SyncSeam};
use cairn::log::{Log, LogError, LogOptions};
use cairn::model::Record;
use proptest::prelude::*;

#[derive(Debug, Default)]
struct Power {
    /// Bytes of each file covered by its last successful sync.
    synced: HashMap<PathBuf, u64>,
    /// Entries of each directory covered by its last successful sync.
    entries: HashMap<PathBuf, HashSet<OsString>>,
    /// Syncs that may still succeed before the power fails; `None` = unlimited.
    budget: Option<u32>,
    down: bool,
}

#[derive(Debug, Default)]
struct CrashSeam {
    power: Mutex<Power>,
}

impl CrashSeam {
    fn spend(p: &mut Power) -> io::Result<()> {
        match p.budget {
            _ if p.down => Err(io::Error::other("power is out")),
            Some(0) => {
                p.down = true;
                Err(io::Error::other("power cut during sync"))
            }
            Some(n) => {
                p.budget = Some(n - 1);
                Ok(())
            }
            None => Ok(()),
        }
    }
}

impl SyncSeam for CrashSeam {
    fn sync_file(&self, _: SyncKind, file: &File, path: &Path, _: bool) -> io::Result<()> {
        let mut p = self.power.lock().unwrap();
        Self::spend(&mut p)?;
        let len = file.metadata()?.len();
        p.synced.insert(path.to_path_buf(), len);
        Ok(())
    }

    fn sync_dir(&self, path: &Path) -> io::Result<()> {
        let mut p = self.power.lock().unwrap();
        Self::spend(&mut p)?;
        let names = fs::read_dir(path)?
            .map(|e| e.map(|e| e.file_name()))
            .collect::<io::Result<HashSet<_>>>()?;
        p.entries.insert(path.to_path_buf(), names);
        Ok(())
    }
}

#[derive(Debug, Clone, Copy)]
enum Tail {
    Clean,
    Zeros(u64),
    Garbage(u64, u64),
    /// The page cache wrote the unsynced bytes back in any order: of the kept part, each
    /// 64-byte block is lost (zeros) or not, by the seed, holes before kept bytes included.
    Holes(u64),
}

#[derive(Debug, Clone, Copy)]
struct Cut {
    keep: u64,
    tail: Tail,
    vanish: bool,
}

/// The unit in which [`Tail::Holes`] loses unsynced bytes.
const HOLE_BLOCK: u64 = 64;

/// What a power cut leaves of the directory.
fn power_cut(seam: &CrashSeam, dir: &Path, cut: Cut) {
    let mut p = seam.power.lock().unwrap();
    let durable_names = p.entries.get(dir).cloned().unwrap_or_default();
    for entry in fs::read_dir(dir).unwrap() {
        let entry = entry.unwrap();
        let path = entry.path();
        if !entry.file_type().unwrap().is_file() {
            continue;
        }
        if !durable_names.contains(&entry.file_name()) && cut.vanish {
            fs::remove_file(&path).unwrap();
            p.synced.remove(&path);
            continue;
        }
        let len = entry.metadata().unwrap().len();
        let synced = p.synced.get(&path).copied().unwrap_or(0).min(len);
        let unsynced = len - synced;
        if unsynced == 0 {
            continue;
        }
        let keep = synced + cut.keep % (unsynced + 1);
        let f = OpenOptions::new().write(true).open(&path).unwrap();
        f.set_len(keep).unwrap();
        let room = len - keep;
        if let Tail::Holes(seed) = cut.tail {
            let mut bytes = fs::read(&path).unwrap();
            let mut x = seed | 1;
            let mut block = synced / HOLE_BLOCK * HOLE_BLOCK;
            while block < keep {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                if x & 1 == 1 {
                    let (from, to) = (block.max(synced), (block + HOLE_BLOCK).min(keep));
                    bytes[from as usize..to as usize].fill(0);
                }
                block += HOLE_BLOCK;
            }
            fs::write(&path, bytes).unwrap();
        }
        let junk: Vec<u8> = match cut.tail {
            Tail::Clean | Tail::Holes(_) => vec![],
            Tail::Zeros(n) => vec![0; n.min(room) as usize],
            Tail::Garbage(seed, n) => {
                let mut x = seed | 1;
                (0..n.min(room))
                    .map(|_| {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        x as u8
                    })
                    .collect()
            }
        };
        OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap()
            .write_all(&junk)
            .unwrap();
        p.synced.insert(path, synced);
    }
    p.budget = None;
    p.down = false;
}

#[derive(Debug, Clone)]
enum Op {
    Append {
        len: usize,
        at: u64,
    },
    Commit,
    Truncate {
        permille: u64,
    },
    Crash {
        commit_first: bool,
        syncs_before_cut: u32,
        cut: Cut,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let len = prop_oneof![
        2 => Just(0usize),
        4 => 1..64usize,
        3 => 64..700usize,
        1 => 1500..3000usize,
    ];
    let tail = prop_oneof![
        Just(Tail::Clean),
        (1..300u64).prop_map(Tail::Zeros),
        (any::<u64>(), 1..300u64).prop_map(|(s, n)| Tail::Garbage(s, n)),
        any::<u64>().prop_map(Tail::Holes),
    ];
    let cut = (any::<u64>(), tail, any::<bool>()).prop_map(|(keep, tail, vanish)| Cut {
        keep,
        tail,
        vanish,
    });
    prop_oneof![
        12 => (len, 0..1_000_000u64).prop_map(|(len, at)| Op::Append { len, at }),
        4 => Just(Op::Commit),
        1 => (0..=1000u64).prop_map(|permille| Op::Truncate { permille }),
        3 => (prop::bool::weighted(0.8), 0..5u32, cut).prop_map(|(commit_first, syncs_before_cut, cut)| {
            Op::Crash { commit_first, syncs_before_cut, cut }
        }),
    ]
}

fn options(dir: &Path) -> LogOptions {
    LogOptions {
        dir: dir.to_path_buf(),
        segment_size: 2048,
        max_size: 48 * 1024,
        max_payload: 3000,
    }
}

fn all_records(log: &Log) -> Vec<Record> {
    log.read_from(log.first_offset())
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap()
}

fn run(ops: Vec<Op>) -> Result<(), TestCaseError> {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("log");
    let seam = Arc::new(CrashSeam::default());
    let (mut log, _) = Log::open(options(&dir), seam.clone()).unwrap();
    let mut durable: Vec<Record> = Vec::new();
    let mut pending: Vec<Record> = Vec::new();
    let mut first = 0;

    for op in ops {
        match op {
            Op::Append { len, at } => {
                let offset = log.next_offset();
                let rec = Record {
                    offset,
                    received_at_ms: at,
                    topic: format!("s/{}", offset % 3),
                    payload: (0..len).map(|i| (i as u64 ^ offset) as u8).collect(),
                    qos: (offset % 3) as u8,
                    retain: offset % 2 == 0,
                };
                let before = (log.size_bytes(), log.pending());
                match log.append(
                    rec.received_at_ms,
                    &rec.topic,
                    &rec.payload,
                    rec.qos,
                    rec.retain,
                ) {
                    Ok(o) => {
                        prop_assert_eq!(o, offset);
                        pending.push(rec);
                    }
                    Err(LogError::Full { .. }) => {
                        prop_assert_eq!(before, (log.size_bytes(), log.pending()));
                        prop_assert_eq!(log.next_offset(), offset);
                    }
                    Err(e) => return Err(TestCaseError::fail(format!("append: {e}"))),
                }
            }
            Op::Commit => {
                let highest = log.commit().unwrap();
                durable.append(&mut pending);
                prop_assert_eq!(highest, durable.last().map(|r| r.offset));
            }
            Op::Truncate { permille } => {
                let span = log.durable_next() - first;
                let upto = first + span * permille / 1000;
                log.truncate_before(upto).unwrap();
                prop_assert!(log.first_offset() <= upto.max(first));
                first = log.first_offset();
                let held: Vec<Record> = durable
                    .iter()
                    .filter(|r| r.offset >= first)
                    .cloned()
                    .collect();
                prop_assert_eq!(all_records(&log), held);
            }
            Op::Crash {
                commit_first,
                syncs_before_cut,
                cut,
            } => {
                let mut in_flight = Vec::new();
                if commit_first && !pending.is_empty() {
                    seam.power.lock().unwrap().budget = Some(syncs_before_cut);
                    match log.commit() {
                        Ok(_) => durable.append(&mut pending),
                        Err(_) => {
                            in_flight = std::mem::take(&mut pending);
                            prop_assert!(matches!(
                                log.append(0, "t", b"", 0, false),
                                Err(LogError::Failed)
                            ));
                        }
                    }
                }
                pending.clear(); // appended but never written: lost, and never acknowledged
                drop(log);
                power_cut(&seam, &dir, cut);
                let (reopened, recovery) = Log::open(options(&dir), seam.clone()).map_err(|e| {
                    TestCaseError::fail(format!("recovery refused after a crash: {e}"))
                })?;
                log = reopened;
                let got = all_records(&log);
                prop_assert_eq!(recovery.next_offset, log.next_offset());
                if !durable.is_empty() {
                    prop_assert_eq!(log.first_offset(), first);
                }
                let held: Vec<&Record> = durable.iter().filter(|r| r.offset >= first).collect();
                prop_assert!(
                    got.len() >= held.len(),
                    "lost committed records: {} < {}",
                    got.len(),
                    held.len()
                );
                for (g, h) in got.iter().zip(&held) {
                    prop_assert_eq!(g, *h);
                }
                let extra = &got[held.len()..];
                prop_assert!(
                    extra.len() <= in_flight.len(),
                    "records that were never written"
                );
                prop_assert_eq!(extra, &in_flight[..extra.len()]);
                durable.extend_from_slice(extra);
                let expected_next = durable.last().map_or(log.first_offset(), |r| r.offset + 1);
                prop_assert_eq!(log.next_offset(), expected_next);
                prop_assert_eq!(log.durable_next(), expected_next);
            }
        }
    }

    log.commit().unwrap();
    durable.append(&mut pending);
    drop(log);
    let (log, recovery) = Log::open(options(&dir), seam).unwrap();
    prop_assert_eq!(recovery.torn_bytes_dropped, 0);
    let held: Vec<Record> = durable.into_iter().filter(|r| r.offset >= first).collect();
    prop_assert_eq!(all_records(&log), held);
    Ok(())
}

fn cases() -> u32 {
    std::env::var("CAIRN_LOG_CRASH_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1200)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn a_crash_keeps_every_committed_record_and_only_a_prefix_of_the_rest(
        ops in prop::collection::vec(op(), 1..80)
    ) {
        run(ops)?;
    }
}
