use super::*;
use crate::fsio::TestSync;

fn opts(dir: &Path, segment_size: u64, max_size: u64) -> LogOptions {
    LogOptions {
        dir: dir.join("log"),
        segment_size,
        max_size,
        max_payload: 1024,
    }
}

#[test]
fn an_empty_directory_opens_empty_and_records_roundtrip_in_order() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut log, rec) = Log::open(opts(tmp.path(), 200, 1 << 20), TestSync::new()).unwrap();
    assert_eq!((rec.records, rec.next_offset, rec.segments), (0, 0, 0));
    assert_eq!(log.commit().unwrap(), None);
    for i in 0..20u64 {
        assert_eq!(
            log.append(i, "t/x", &[i as u8; 30], 1, i % 2 == 0).unwrap(),
            i
        );
    }
    assert_eq!(log.pending(), 20);
    assert_eq!(
        log.read_from(0).unwrap().count(),
        0,
        "reads see only durable records"
    );
    assert_eq!(log.commit().unwrap(), Some(19));
    assert!(log.segments().len() > 1, "small segments roll");
    let got: Vec<Record> = log.read_from(5).unwrap().map(Result::unwrap).collect();
    assert_eq!(
        got.iter().map(|r| r.offset).collect::<Vec<_>>(),
        (5..20).collect::<Vec<_>>()
    );
    assert_eq!(got[0].payload, vec![5u8; 30]);
    drop(log);
    let (log, rec) = Log::open(opts(tmp.path(), 200, 1 << 20), TestSync::new()).unwrap();
    assert_eq!(
        (rec.records, rec.next_offset, rec.torn_bytes_dropped),
        (20, 20, 0)
    );
    assert_eq!(log.read_from(0).unwrap().count(), 20);
}

#[test]
fn full_and_too_large_refusals_leave_the_log_unchanged() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut log, _) = Log::open(opts(tmp.path(), 1000, 300), TestSync::new()).unwrap();
    log.append(1, "t", &[0; 100], 0, false).unwrap();
    let before = (log.next_offset(), log.size_bytes(), log.pending());
    assert!(matches!(
        log.append(1, "t", &[0; 2000], 0, false),
        Err(LogError::PayloadTooLarge {
            len: 2000,
            max: 1024
        })
    ));
    log.append(1, "t", &[0; 100], 0, false).unwrap();
    let before_full = (log.next_offset(), log.size_bytes(), log.pending());
    assert_ne!(before, before_full);
    assert!(matches!(
        log.append(1, "t", &[0; 100], 0, false),
        Err(LogError::Full { max: 300, .. })
    ));
    assert_eq!(
        before_full,
        (log.next_offset(), log.size_bytes(), log.pending())
    );
    assert_eq!(log.commit().unwrap(), Some(1));
}

#[test]
fn a_stand_in_is_bounded_by_its_own_limit_not_max_payload() {
    let tmp = tempfile::tempdir().unwrap();
    let mut o = opts(tmp.path(), 1 << 16, 1 << 20);
    o.max_payload = 16;
    let (mut log, _) = Log::open(o, TestSync::new()).unwrap();
    assert!(log.append(1, "t", &[0; 100], 1, false).is_err());
    assert_eq!(log.append_stand_in(1, "t", &[0; 100], 1, false).unwrap(), 0);
    let too_big = vec![0; STAND_IN_MAX_PAYLOAD as usize + 1];
    assert!(matches!(
        log.append_stand_in(1, "t", &too_big, 1, false),
        Err(LogError::PayloadTooLarge { .. })
    ));
    assert_eq!(log.commit().unwrap(), Some(0));
}

#[test]
fn reading_below_the_first_held_offset_is_an_error() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut log, _) = Log::open(opts(tmp.path(), 100, 1 << 20), TestSync::new()).unwrap();
    for _ in 0..10 {
        log.append(1, "t", &[0; 40], 0, false).unwrap();
    }
    log.commit().unwrap();
    assert!(log.truncate_before(6).unwrap() > 0);
    let first = log.first_offset();
    assert!(first > 0 && first <= 6);
    assert!(matches!(log.read_from(0), Err(LogError::Truncated { .. })));
    assert_eq!(log.read_from(first).unwrap().count() as u64, 10 - first);
}

/// 10 segments of 2 records each (`segment_size` 100, frames of ~50 bytes).
fn ten_segments(dir: &Path, max_size: u64) -> Log {
    let (mut log, _) = Log::open(opts(dir, 100, max_size), TestSync::new()).unwrap();
    for i in 0..20u64 {
        log.append(1000 + i, "t", &[0; 30], 0, false).unwrap();
    }
    log.commit().unwrap();
    assert_eq!(log.segments().len(), 10);
    log
}

#[test]
fn retention_plan_with_room_keeps_what_is_recent_or_above_the_floor_or_unprocessed() {
    let tmp = tempfile::tempdir().unwrap();
    let log = ten_segments(tmp.path(), 1 << 20);
    let plan = |durable, floor, cutoff| log.plan_retention(durable, floor, cutoff);
    // Everything old and processed: all sealed segments go, never the active one.
    assert_eq!(plan(20, u64::MAX, u64::MAX).below, 18);
    // Only durable progress counts: a checkpoint at 7 frees [0, 6).
    assert_eq!(plan(7, u64::MAX, u64::MAX).below, 6);
    // The savepoint floor at 5 holds from [4, 6) on.
    assert_eq!(plan(20, 5, u64::MAX).below, 4);
    // Records received after the cutoff (1005) stay: segment [4, 6) holds 1005.
    let p = plan(20, u64::MAX, 1004);
    assert_eq!((p.below, p.evicted, p.floor_blocks), (4, 0, false));
}

#[test]
fn retention_plan_short_of_room_evicts_processed_segments_oldest_first_but_never_unprocessed() {
    let tmp = tempfile::tempdir().unwrap();
    let mut log = ten_segments(tmp.path(), 1 << 20);
    let seg = log.segments()[0].bytes;
    assert!(log.segments().iter().all(|s| s.bytes == seg) && (90..180).contains(&seg));
    // Room for two segments (200) only once two segments (2 × seg >= 180) are gone.
    let size = log.size_bytes();
    log.set_max_size(size + 20);
    assert!(log.short_of_room());
    let plan = |durable, floor, cutoff| {
        let p = log.plan_retention(durable, floor, cutoff);
        (p.below, p.evicted, p.floor_blocks)
    };
    // Inside retention, yet processed: the two oldest go, and no more than needed.
    assert_eq!(plan(20, u64::MAX, 0), (4, 2, false));
    // Unprocessed records stay even when short of room.
    assert_eq!(plan(3, u64::MAX, 0), (2, 1, false));
    assert_eq!(plan(0, u64::MAX, u64::MAX), (0, 0, false));
    // Expired segments go first without counting as evicted.
    assert_eq!(plan(20, 4, 1001), (4, 1, false));
    // A savepoint floor in the way is reported, not silently obeyed or ignored.
    assert_eq!(plan(20, 1, 0), (0, 0, true));
    assert_eq!(plan(20, 2, 1001), (2, 0, true));
}

#[test]
fn invalid_options_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let mut o = opts(tmp.path(), 100, 100);
    o.max_payload = frame::MAX_PAYLOAD_LIMIT + 1;
    assert!(matches!(
        Log::open(o, TestSync::new()),
        Err(LogError::InvalidOptions(_))
    ));
}
