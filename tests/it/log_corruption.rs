//! Corruption, torn tails, repair, and the fsync seam of the replay log.

use std::fs::{self, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use cairn::fsio::TestSync;
use cairn::log::{Log, LogError, LogOptions, repair_dir, verify_dir};
use cairn::model::Record;

/// Three of the test frames (70 bytes each) fit in a segment.
const SEG: u64 = 210;

fn options(dir: &Path, segment_size: u64) -> LogOptions {
    LogOptions {
        dir: dir.to_path_buf(),
        segment_size,
        max_size: 1 << 30,
        max_payload: 64 * 1024,
    }
}

fn open(dir: &Path, segment_size: u64) -> Result<Log, LogError> {
    Log::open(options(dir, segment_size), TestSync::new()).map(|(log, _)| log)
}

/// A log of `n` equal-sized records (payload 50 bytes, offsets < 128 so every frame has the
/// same length); returns the frame length.
/// `n` records, one commit each: every frame is then a commit's first, so damage followed by
/// any of them is damage to synced bytes (see `records_of_one_commit`).
fn write_records(dir: &Path, segment_size: u64, n: u64) -> u64 {
    let mut log = open(dir, segment_size).unwrap();
    for i in 0..n {
        log.append(1_000 + i, "dev/1", &[i as u8; 50], 1, false)
            .unwrap();
        log.commit().unwrap();
    }
    let segs = log.segments();
    segs[0].bytes / (segs[0].next_offset - segs[0].first_offset)
}

fn seg(dir: &Path, first: u64) -> PathBuf {
    dir.join(format!("{first:020}.log"))
}

fn flip(path: &Path, pos: u64) {
    let mut bytes = fs::read(path).unwrap();
    bytes[pos as usize] ^= 0x40;
    fs::write(path, bytes).unwrap();
}

fn offsets(log: &Log) -> Vec<u64> {
    log.read_from(log.first_offset())
        .unwrap()
        .map(|r| r.unwrap().offset)
        .collect()
}

fn expect_corrupt(err: LogError, segment: &Path, offset: u64) -> String {
    let msg = err.to_string();
    match err {
        LogError::Corrupt {
            segment: s,
            offset: o,
            ..
        } => {
            assert_eq!(s, segment);
            assert_eq!(o, Some(offset));
        }
        other => panic!("expected Corrupt, got {other:?}"),
    }
    assert!(msg.contains(&segment.file_name().unwrap().to_string_lossy().into_owned()));
    assert!(msg.contains("cairn verify --repair"), "{msg}");
    msg
}

#[test]
fn a_flipped_byte_followed_by_good_frames_is_refused_naming_segment_and_offset() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let frame = write_records(dir, 1 << 20, 10);
    flip(&seg(dir, 0), 3 * frame + 12);
    let msg = expect_corrupt(open(dir, 1 << 20).unwrap_err(), &seg(dir, 0), 3);
    assert!(msg.contains(&format!("byte {}", 3 * frame)), "{msg}");

    let report = verify_dir(dir).unwrap();
    assert!(!report.opens());
    assert!(report.torn_tail.is_none());
    assert_eq!(report.corruption.len(), 1);
    assert_eq!(report.corruption[0].byte_pos, 3 * frame);
    assert_eq!(report.corruption[0].good_records_after, 6);
    assert_eq!(report.corruption[0].unknown_bytes, frame);
}

/// One commit's frames, and its pages reached the disk out of order (a power cut before its
/// fsync): frames of it are lost in the middle while later ones of the same commit made it.
/// Nothing of that commit was acknowledged, so this is a torn tail, not corruption: the log
/// opens with the records before the hole, and `verify` says so. (Seen with powercut-fs's
/// `cut random`: the agent used to refuse to start.)
#[test]
fn records_of_one_commit_lost_out_of_order_are_a_torn_tail_not_corruption() {
    for damage in ["zeros", "flip"] {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        // Two commits: 3 records, then 7 (the one in flight when the power went).
        let mut log = open(dir, 1 << 20).unwrap();
        for (from, to) in [(0, 3), (3, 10)] {
            for i in from..to {
                log.append(1_000 + i, "dev/1", &[i as u8; 50], 1, false)
                    .unwrap();
            }
            log.commit().unwrap();
        }
        drop(log);
        let frame = fs::metadata(seg(dir, 0)).unwrap().len() / 10;
        let mut bytes = fs::read(seg(dir, 0)).unwrap();
        // Record 5 (the third of the second commit) lost; 6..10 of that commit survived.
        let hole = (5 * frame) as usize..(6 * frame) as usize;
        match damage {
            "zeros" => bytes[hole].fill(0),
            _ => bytes[hole.start + 12] ^= 0x40,
        }
        fs::write(seg(dir, 0), &bytes).unwrap();

        let report = verify_dir(dir).unwrap();
        assert!(report.opens(), "{damage}: {report:?}");
        let torn = report.torn_tail.as_ref().expect("a torn tail");
        assert_eq!(
            torn.records, 5,
            "{damage}: records 5..10 are dropped: {report:?}"
        );
        let log = open(dir, 1 << 20).unwrap();
        assert_eq!(offsets(&log), (0..5).collect::<Vec<_>>(), "{damage}");
        assert_eq!(fs::metadata(seg(dir, 0)).unwrap().len(), 5 * frame);
        // Records read back never show the commit mark.
        let recs: Vec<Record> = log.read_from(0).unwrap().collect::<Result<_, _>>().unwrap();
        assert!(recs.iter().all(|r| r.qos == 1), "{damage}: {recs:?}");

        // The same hole in the first commit, with the second commit's frames after it: those
        // began only after the first was synced, so this is damage to synced bytes.
        let tmp = tempfile::tempdir().unwrap();
        let dir2 = tmp.path();
        let mut log = open(dir2, 1 << 20).unwrap();
        for (from, to) in [(0, 3), (3, 10)] {
            for i in from..to {
                log.append(1_000 + i, "dev/1", &[i as u8; 50], 1, false)
                    .unwrap();
            }
            log.commit().unwrap();
        }
        drop(log);
        let mut bytes = fs::read(seg(dir2, 0)).unwrap();
        let hole = frame as usize..(2 * frame) as usize;
        match damage {
            "zeros" => bytes[hole].fill(0),
            _ => bytes[hole.start + 12] ^= 0x40,
        }
        fs::write(seg(dir2, 0), &bytes).unwrap();
        expect_corrupt(open(dir2, 1 << 20).unwrap_err(), &seg(dir2, 0), 1);
    }
}

/// A whole, CRC-valid frame at the end that holds an earlier offset (a frame written twice,
/// bytes copied by hand): refused as corruption, and counting what follows it must not
/// underflow on an offset below the expected one.
#[test]
fn a_valid_frame_with_an_earlier_offset_at_the_tail_is_refused_without_panicking() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let frame = write_records(dir, 1 << 20, 3);
    let bytes = fs::read(seg(dir, 0)).unwrap();
    append_bytes(&seg(dir, 0), &bytes[..frame as usize]);
    let report = verify_dir(dir).unwrap();
    assert!(!report.opens(), "{report:?}");
    expect_corrupt(open(dir, 1 << 20).unwrap_err(), &seg(dir, 0), 3);
}

#[test]
fn damage_in_a_sealed_segment_is_refused_even_at_its_tail() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let frame = write_records(dir, SEG, 9);
    assert_eq!(SEG / frame, 3, "three frames per segment");
    // The last byte of the first segment: a tail, but of a sealed segment.
    flip(&seg(dir, 0), 3 * frame - 1);
    expect_corrupt(open(dir, SEG).unwrap_err(), &seg(dir, 0), 2);
}

#[test]
fn a_missing_middle_segment_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    write_records(dir, SEG, 9);
    fs::remove_file(seg(dir, 3)).unwrap();
    let msg = expect_corrupt(open(dir, SEG).unwrap_err(), &seg(dir, 6), 3);
    assert!(msg.contains("missing"), "{msg}");
    // Repair can only acknowledge the loss, after which the log opens with the gap.
    let report = repair_dir(dir, TestSync::new()).unwrap();
    assert_eq!(report.acknowledged_gaps.len(), 1);
    let log = open(dir, SEG).unwrap();
    assert_eq!(offsets(&log), vec![0, 1, 2, 6, 7, 8]);
}

#[test]
fn repair_moves_the_damaged_segment_aside_byte_identical_and_keeps_the_valid_prefix() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let frame = write_records(dir, SEG, 9);
    flip(&seg(dir, 0), frame + 20);
    let original = fs::read(seg(dir, 0)).unwrap();

    let sync = TestSync::new();
    let report = repair_dir(dir, sync.clone()).unwrap();
    assert_eq!(report.repaired.len(), 1);
    let r = &report.repaired[0];
    assert_eq!(r.segment, seg(dir, 0));
    assert_eq!(
        r.moved_to,
        dir.join("damaged").join("00000000000000000000.log.0")
    );
    assert_eq!(
        fs::read(&r.moved_to).unwrap(),
        original,
        "damaged bytes kept verbatim"
    );
    assert_eq!((r.kept_records, r.kept_bytes), (1, frame));
    assert_eq!(
        (r.dropped_good_records, r.dropped_unknown_bytes),
        (1, frame)
    );
    assert!(r.new_active_segment.is_none());
    assert!(sync.dir_syncs() >= 2 && sync.file_syncs() >= 1);

    let (mut log, recovery) = Log::open(options(dir, SEG), TestSync::new()).unwrap();
    assert_eq!(recovery.records, 7);
    assert_eq!(
        offsets(&log),
        vec![0, 3, 4, 5, 6, 7, 8],
        "read_from steps over the gap"
    );
    assert_eq!(log.append(1, "dev/1", b"x", 1, false).unwrap(), 9);
    log.commit().unwrap();
    drop(log);
    let report = verify_dir(dir).unwrap();
    assert!(report.opens());
    assert_eq!(report.repaired_gaps.len(), 1);
    assert_eq!(
        (report.repaired_gaps[0].from, report.repaired_gaps[0].to),
        (1, 3)
    );
}

#[test]
fn repair_of_the_last_segment_never_reuses_an_offset() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let frame = write_records(dir, 1 << 20, 10);
    flip(&seg(dir, 0), 3 * frame + 12);
    let report = repair_dir(dir, TestSync::new()).unwrap();
    assert_eq!(report.repaired[0].dropped_good_records, 6);
    assert_eq!(report.repaired[0].new_active_segment, Some(seg(dir, 10)));
    let mut log = open(dir, 1 << 20).unwrap();
    assert_eq!(offsets(&log), vec![0, 1, 2]);
    assert_eq!(
        log.next_offset(),
        10,
        "offsets 3..10 may have been acknowledged"
    );
    assert_eq!(log.append(1, "t", b"", 0, false).unwrap(), 10);
    log.commit().unwrap();
    assert_eq!(offsets(&log), vec![0, 1, 2, 10]);
}

fn append_bytes(path: &Path, bytes: &[u8]) {
    OpenOptions::new()
        .append(true)
        .open(path)
        .unwrap()
        .write_all(bytes)
        .unwrap();
}

/// Mangles a segment file given the frame length.
type Damager = Box<dyn Fn(&Path, u64)>;

#[test]
fn a_torn_tail_is_truncated_counted_and_made_durable() {
    // (what the crash left after 4 good frames, bytes dropped, records dropped)
    let cases: Vec<(&str, Damager, u64, u64)> = vec![
        (
            "zero fill",
            Box::new(|p, _| append_bytes(p, &[0; 100])),
            100,
            0,
        ),
        (
            "short length",
            Box::new(|p, _| append_bytes(p, &[7, 0, 0])),
            3,
            0,
        ),
        (
            "length only",
            Box::new(|p, _| append_bytes(p, &[7, 0, 0, 0, 1])),
            5,
            1,
        ),
        (
            "length past end",
            Box::new(|p, _| append_bytes(p, &[200, 0, 0, 0, 1, 2, 3, 4, 5, 6])),
            10,
            1,
        ),
        (
            "half a frame",
            Box::new(|p, frame| {
                let f = OpenOptions::new().write(true).open(p).unwrap();
                f.set_len(4 * frame + frame / 2).unwrap();
            }),
            0, // filled in below: frame / 2
            1,
        ),
    ];
    for (name, damage, bytes, records) in cases {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let frame = write_records(dir, 1 << 20, 5);
        let path = seg(dir, 0);
        if name != "half a frame" {
            fs::OpenOptions::new()
                .write(true)
                .open(&path)
                .unwrap()
                .set_len(4 * frame)
                .unwrap();
        }
        damage(&path, frame);
        let bytes = if bytes == 0 { frame / 2 } else { bytes };

        let report = verify_dir(dir).unwrap();
        assert!(report.opens(), "{name}");
        let torn = report.torn_tail.expect(name);
        assert_eq!(
            (torn.byte_pos, torn.bytes, torn.records),
            (4 * frame, bytes, records),
            "{name}"
        );

        let sync = TestSync::new();
        let (mut log, rec) = Log::open(options(dir, 1 << 20), sync.clone()).unwrap();
        assert_eq!(
            (rec.torn_bytes_dropped, rec.torn_records_dropped),
            (bytes, records),
            "{name}"
        );
        assert_eq!((rec.records, rec.next_offset), (4, 4), "{name}");
        assert_eq!(fs::metadata(&path).unwrap().len(), 4 * frame, "{name}");
        assert_eq!(
            (sync.file_syncs(), sync.dir_syncs()),
            (1, 1),
            "{name}: truncation synced"
        );
        assert_eq!(log.append(1, "t", b"", 0, false).unwrap(), 4);
        log.commit().unwrap();
        assert_eq!(offsets(&log), vec![0, 1, 2, 3, 4], "{name}");
    }
}

#[test]
fn commit_syncs_each_touched_segment_once_and_the_dir_only_when_a_segment_is_created() {
    let tmp = tempfile::tempdir().unwrap();
    let sync = TestSync::new();
    let (mut log, _) = Log::open(options(tmp.path(), SEG), sync.clone()).unwrap();
    let mut last = (sync.file_syncs(), sync.dir_syncs());
    let mut step = |log: &mut Log, appends: usize| {
        for _ in 0..appends {
            log.append(1, "dev/1", &[0; 50], 1, false).unwrap();
        }
        log.commit().unwrap();
        let now = (sync.file_syncs(), sync.dir_syncs());
        let delta = (now.0 - last.0, now.1 - last.1);
        last = now;
        delta
    };
    assert_eq!(
        step(&mut log, 1),
        (1, 1),
        "first record creates the first segment"
    );
    assert_eq!(
        step(&mut log, 1),
        (1, 0),
        "same segment: one data sync, no dir sync"
    );
    assert_eq!(step(&mut log, 0), (0, 0), "nothing pending: no sync at all");
    assert_eq!(
        step(&mut log, 2),
        (2, 1),
        "fills segment 0 and rolls: two segments touched"
    );
    assert_eq!(
        step(&mut log, 7),
        (3, 2),
        "spans three segments, two of them new"
    );
    assert_eq!(log.segments().len(), 4);
}

#[test]
fn truncate_before_removes_whole_sealed_segments_and_syncs_the_dir_once() {
    let tmp = tempfile::tempdir().unwrap();
    let sync = TestSync::new();
    let (mut log, _) = Log::open(options(tmp.path(), SEG), sync.clone()).unwrap();
    for _ in 0..9 {
        log.append(1, "dev/1", &[0; 50], 1, false).unwrap();
    }
    log.commit().unwrap();
    let before = (sync.file_syncs(), sync.dir_syncs());
    assert_eq!(
        log.truncate_before(5).unwrap(),
        1,
        "segment 3..6 still holds offset 5"
    );
    assert_eq!(
        (sync.file_syncs(), sync.dir_syncs()),
        (before.0, before.1 + 1)
    );
    assert_eq!(log.truncate_before(2).unwrap(), 0);
    assert_eq!(
        sync.dir_syncs(),
        before.1 + 1,
        "nothing removed: no dir sync"
    );
    assert_eq!(
        log.truncate_before(u64::MAX).unwrap(),
        1,
        "never the active segment"
    );
    assert_eq!(offsets(&log), vec![6, 7, 8]);
    assert!(!seg(tmp.path(), 0).exists() && !seg(tmp.path(), 3).exists());
}

#[test]
fn a_failing_sync_poisons_the_log_until_reopened() {
    let tmp = tempfile::tempdir().unwrap();
    let sync = TestSync::new();
    let (mut log, _) = Log::open(options(tmp.path(), 1 << 20), sync.clone()).unwrap();
    log.append(1, "t", b"kept", 1, false).unwrap();
    log.commit().unwrap();
    log.append(2, "t", b"in flight", 1, false).unwrap();
    sync.fail.store(true, Ordering::SeqCst);
    assert!(matches!(log.commit(), Err(LogError::Io { .. })));
    sync.fail.store(false, Ordering::SeqCst);
    assert!(matches!(log.commit(), Err(LogError::Failed)));
    assert!(matches!(
        log.append(3, "t", b"", 1, false),
        Err(LogError::Failed)
    ));
    assert!(matches!(log.read_from(0), Err(LogError::Failed)));
    assert!(matches!(log.truncate_before(1), Err(LogError::Failed)));
    drop(log);
    let (log, _) = Log::open(options(tmp.path(), 1 << 20), Arc::new(TestSync::default())).unwrap();
    let records: Vec<Record> = log.read_from(0).unwrap().map(Result::unwrap).collect();
    assert_eq!(records[0].payload, b"kept");
    assert!(records.len() <= 2, "at most the in-flight record besides");
}

#[test]
fn read_dir_shows_the_valid_prefix_without_touching_the_files() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let frame = write_records(dir, SEG, 9);
    append_bytes(&seg(dir, 6), &[9, 0, 0]); // a torn (or in-progress) tail
    let before = fs::read(seg(dir, 6)).unwrap();
    let got: Vec<u64> = cairn::log::read_dir(dir, 4)
        .unwrap()
        .map(|r| r.unwrap().offset)
        .collect();
    assert_eq!(got, vec![4, 5, 6, 7, 8]);
    assert_eq!(fs::read(seg(dir, 6)).unwrap(), before, "read-only");

    flip(&seg(dir, 3), frame + 9);
    let got: Vec<Result<Record, LogError>> = cairn::log::read_dir(dir, 0).unwrap().collect();
    assert_eq!(got.len(), 5, "offsets 0..4, then the damage");
    assert!(matches!(
        got.last(),
        Some(Err(LogError::Corrupt {
            offset: Some(4),
            ..
        }))
    ));
}
