//! The segment files of the local log: spares made ahead of need and taken at a
//! roll, trimmed segments kept as spares, records read back in order across
//! segments and opens, a range read while open, torn tails and corrupt records, a
//! failed append healed, and trims of segments wholly applied.

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::segments::{
    closed_count, frame, parse, read_range, segment_counts, segment_name, trim_before,
    SegmentWriter, HEADER_BYTES,
};
use super::spares::{prepare_spare, SPARE, SPARES, SPARE_TMP};
use crate::error::StoreError;
use crate::log::Record;

fn payloads(range: std::ops::Range<u32>) -> Vec<Vec<u8>> {
    range.map(|i| format!("record {i}").into_bytes()).collect()
}

fn lsns(records: &[Record]) -> Vec<u64> {
    records.iter().map(|r| r.lsn).collect()
}

fn segment_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("list")
        .map(|e| e.expect("entry").path())
        .collect();
    v.sort();
    v
}

/// A spare made ahead of need becomes the next segment when the log rolls over
/// (the same file: its inode), one at a time; records written into it read back
/// after a reopen. A half-made spare (a crash while it was written) is removed at
/// open, and a spare of another segment size is replaced.
#[test]
fn the_next_segment_is_the_spare_made_ahead_of_need() {
    use std::os::unix::fs::MetadataExt;
    let dir = tempfile::tempdir().expect("tempdir");
    let seg = 256u64;
    let mut log = SegmentWriter::open(dir.path(), seg, 0).expect("open").log;
    let first = log.active.path.clone();
    assert!(prepare_spare(dir.path(), seg).expect("spare"));
    assert!(
        !prepare_spare(dir.path(), seg).expect("spare"),
        "one is ready"
    );
    let spare = dir.path().join(SPARE);
    let made = std::fs::metadata(&spare).expect("spare");
    assert_eq!(made.len(), seg);
    for p in payloads(0..20) {
        log.append_group(&[p], true).expect("append");
    }
    assert_ne!(log.active.path, first, "the log rolled over");
    assert!(!spare.exists(), "the roll took the spare");
    let active = std::fs::metadata(&log.active.path).expect("active");
    assert_eq!(active.ino(), made.ino(), "the new segment is the spare");
    drop(log);
    let o = SegmentWriter::open(dir.path(), seg, 0).expect("reopen");
    assert_eq!(lsns(&o.records), (1..=20).collect::<Vec<u64>>());
    let want: Vec<Vec<u8>> = payloads(0..20);
    let got: Vec<Vec<u8>> = o.records.into_iter().map(|r| r.payload).collect();
    assert_eq!(got, want);

    std::fs::write(dir.path().join(SPARE_TMP), b"cut short").expect("write");
    std::fs::write(&spare, b"another size").expect("write");
    drop(SegmentWriter::open(dir.path(), seg, 20).expect("open"));
    assert!(
        !dir.path().join(SPARE_TMP).exists(),
        "a half-made spare is removed"
    );
    assert!(prepare_spare(dir.path(), seg).expect("spare"), "replaced");
    assert_eq!(std::fs::metadata(&spare).expect("spare").len(), seg);
}

/// A segment trimmed while no spare is ready becomes the spare (the same file),
/// and is the next segment the log rolls over to. Its old records are never read
/// again: not after the new ones, not after a torn group written over them, and
/// not when a reopen finds it with nothing new in it.
#[test]
fn a_trimmed_segment_becomes_the_spare_and_its_old_records_are_never_read() {
    use std::os::unix::fs::MetadataExt;
    // Records of one size, so that the new records in a segment made from an old
    // one end exactly where an old record starts, whole and with a valid checksum.
    fn one(n: u64) -> Vec<Vec<u8>> {
        vec![format!("rec {n:04}").into_bytes()]
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let seg = 256u64;
    let spare = dir.path().join(SPARE);
    let mut log = SegmentWriter::open(dir.path(), seg, 0).expect("open").log;
    // The open made its first segment from a spare; the first roll-over reserves
    // the next with fallocate.
    let closed = log.closed();
    while closed_count(&closed) == 0 {
        log.append_group(&one(log.next_lsn()), true)
            .expect("append");
    }
    assert!(!spare.exists());
    let oldest = closed.lock().expect("lock").segments[0].path.clone();
    let ino = std::fs::metadata(&oldest).expect("oldest").ino();
    let last = log.next_lsn() - 1;
    assert_eq!(
        trim_before(dir.path(), &closed, last, seg).expect("trim"),
        1
    );
    assert!(!oldest.exists());
    assert_eq!(std::fs::metadata(&spare).expect("spare").ino(), ino);
    assert!(
        !prepare_spare(dir.path(), seg).expect("spare"),
        "one is ready"
    );
    // The next roll-over takes it: its first record is the one that rolled over.
    while spare.exists() {
        log.append_group(&one(log.next_lsn()), true)
            .expect("append");
    }
    assert_eq!(
        std::fs::metadata(&log.active.path).expect("active").ino(),
        ino
    );
    assert_eq!(log.offset, (HEADER_BYTES + 8) as u64);
    let first = log.next_lsn() - 1;
    drop(log);
    let o = SegmentWriter::open(dir.path(), seg, first - 1).expect("reopen");
    assert_eq!(lsns(&o.records), vec![first]);
    assert_eq!(
        o.log.next_lsn(),
        first + 1,
        "the old records are not counted"
    );
    drop(o);
    // A torn group in it: a header written, its payload still the old bytes.
    let path = dir.path().join(segment_name(first));
    let mut torn = Vec::new();
    frame(&mut torn, first + 1, b"torn rec").expect("frame");
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .expect("open")
        .write_all_at(&torn[..HEADER_BYTES], (HEADER_BYTES + 8) as u64)
        .expect("write");
    let o = SegmentWriter::open(dir.path(), seg, first - 1).expect("reopen");
    assert_eq!(lsns(&o.records), vec![first]);
    let mut log = o.log;
    log.append_group(&one(first + 1), true).expect("append");
    drop(log);
    let o = SegmentWriter::open(dir.path(), seg, first - 1).expect("reopen");
    assert_eq!(lsns(&o.records), vec![first, first + 1]);
    let got: Vec<Vec<u8>> = o.records.into_iter().map(|r| r.payload).collect();
    assert_eq!(got, [one(first), one(first + 1)].concat());
}

/// A trim that deletes several segments at once keeps two of them as spares, and
/// the next two roll-overs take them: no segment is begun with reserved blocks
/// while a trim has given the log spares. A third trimmed segment is deleted.
#[test]
fn a_trim_of_several_segments_keeps_two_spares_for_the_next_roll_overs() {
    use std::os::unix::fs::MetadataExt;
    let dir = tempfile::tempdir().expect("tempdir");
    let seg = 256u64;
    let mut log = SegmentWriter::open(dir.path(), seg, 0).expect("open").log;
    let closed = log.closed();
    while closed_count(&closed) < 3 {
        log.append_group(&payloads(0..1), true).expect("append");
    }
    let reserved = segment_counts(&closed).reserved;
    let trimmed: Vec<PathBuf> = closed
        .lock()
        .expect("lock")
        .segments
        .iter()
        .map(|s| s.path.clone())
        .collect();
    let inos: Vec<u64> = trimmed
        .iter()
        .map(|p| std::fs::metadata(p).expect("segment").ino())
        .collect();
    let last = log.next_lsn() - 1;
    assert_eq!(
        trim_before(dir.path(), &closed, last, seg).expect("trim"),
        3
    );
    let spares: Vec<u64> = SPARES
        .iter()
        .map(|n| {
            std::fs::metadata(dir.path().join(n))
                .expect("a spare")
                .ino()
        })
        .collect();
    assert_eq!(spares, inos[..2], "the first two trimmed are the spares");
    assert!(trimmed.iter().all(|p| !p.exists()));
    assert_eq!(segment_counts(&closed).recycled, 2);
    // The next two roll-overs take them, in order, and reserve nothing.
    let mut began = Vec::new();
    while began.len() < 2 {
        let active = log.active.path.clone();
        log.append_group(&payloads(0..1), true).expect("append");
        if log.active.path != active {
            began.push(std::fs::metadata(&log.active.path).expect("active").ino());
        }
    }
    assert_eq!(began, spares);
    assert_eq!(segment_counts(&closed).reserved, reserved);
    assert!(SPARES.iter().all(|n| !dir.path().join(n).exists()));
}

#[test]
fn records_read_back_in_order_across_segments_and_opens() {
    let dir = tempfile::tempdir().expect("tempdir");
    let o = SegmentWriter::open(dir.path(), 256, 0).expect("open");
    assert!(o.records.is_empty());
    let mut log = o.log;
    assert_eq!(log.append_group(&payloads(0..3), true).expect("append"), 1);
    // 10 records of ~25 bytes do not fit the 256-byte segment: a new one.
    assert_eq!(log.append_group(&payloads(3..13), true).expect("append"), 4);
    assert_eq!(
        log.append_group(&payloads(13..14), true).expect("append"),
        14
    );
    drop(log);
    let o = SegmentWriter::open(dir.path(), 256, 0).expect("reopen");
    assert_eq!(lsns(&o.records), (1..=14).collect::<Vec<_>>());
    assert_eq!(o.records[13].payload, b"record 13");
    assert_eq!(o.log.next_lsn(), 15);
    // Records at or before `applied` are not returned, and wholly applied
    // segments are deleted.
    drop(o);
    let before = segment_files(dir.path()).len();
    let o = SegmentWriter::open(dir.path(), 256, 13).expect("reopen");
    assert_eq!(lsns(&o.records), vec![14]);
    assert!(segment_files(dir.path()).len() < before);
}

/// While the log is open, any acknowledged range is read back from its segment
/// files (the active one included), and a range that is not all there is an
/// error rather than a short answer.
#[test]
fn a_range_of_records_reads_back_while_the_log_is_open() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut log = SegmentWriter::open(dir.path(), 256, 0).expect("open").log;
    log.append_group(&payloads(0..3), true).expect("append");
    log.append_group(&payloads(3..13), true).expect("append");
    log.append_group(&payloads(13..14), true).expect("append");
    assert!(segment_files(dir.path()).len() >= 2);
    let all = read_range(dir.path(), 0, 14).expect("read");
    assert_eq!(lsns(&all), (1..=14).collect::<Vec<_>>());
    assert_eq!(all[13].payload, b"record 13");
    assert_eq!(
        lsns(&read_range(dir.path(), 2, 5).expect("read")),
        vec![3, 4, 5]
    );
    assert!(read_range(dir.path(), 14, 14).expect("read").is_empty());
    assert!(
        read_range(dir.path(), 10, 15).is_err(),
        "15 was never written"
    );
    // Trimmed away: the range is not all there any more.
    let closed = log.closed();
    trim_before(dir.path(), &closed, 13, 256).expect("trim");
    assert!(read_range(dir.path(), 0, 14).is_err());
    assert_eq!(
        lsns(&read_range(dir.path(), 13, 14).expect("read")),
        vec![14]
    );
}

#[test]
fn a_torn_tail_ends_reading_and_is_never_read_later() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut log = SegmentWriter::open(dir.path(), 1 << 20, 0)
        .expect("open")
        .log;
    log.append_group(&payloads(0..5), true).expect("append");
    let path = log.active.path.clone();
    let offset = log.offset;
    drop(log);
    // A group whose sync never returned: its second record is complete and
    // valid, its first was not written whole (a byte of it is wrong).
    let mut torn = Vec::new();
    frame(&mut torn, 6, b"first of the torn group").expect("frame");
    frame(&mut torn, 7, b"second, complete").expect("frame");
    torn[HEADER_BYTES + 2] ^= 0xff;
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .expect("open seg");
    f.write_all_at(&torn, offset).expect("write");
    drop(f);
    let o = SegmentWriter::open(dir.path(), 1 << 20, 0).expect("reopen");
    assert_eq!(lsns(&o.records), vec![1, 2, 3, 4, 5]);
    let mut log = o.log;
    assert_eq!(log.append_group(&payloads(5..7), true).expect("append"), 6);
    drop(log);
    let o = SegmentWriter::open(dir.path(), 1 << 20, 0).expect("reopen");
    assert_eq!(lsns(&o.records), vec![1, 2, 3, 4, 5, 6, 7]);
    assert_eq!(o.records[5].payload, b"record 5");
}

#[test]
fn a_corrupted_record_ends_reading_and_a_later_gap_fails_the_open() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut log = SegmentWriter::open(dir.path(), 48, 0).expect("open").log;
    for i in 0..6 {
        log.append_group(&payloads(i..i + 1), true).expect("append");
    }
    drop(log);
    let files = segment_files(dir.path());
    assert!(files.len() >= 3, "{files:?}");
    // One flipped payload byte in the last record of the first segment.
    let mut data = std::fs::read(&files[0]).expect("read");
    let recs = parse(&data, 1);
    let last_end: usize = recs.iter().map(|r| HEADER_BYTES + r.payload.len()).sum();
    data[last_end - 1] ^= 0xff;
    std::fs::write(&files[0], &data).expect("write");
    match SegmentWriter::open(dir.path(), 48, 0) {
        Err(StoreError::Corrupt(m)) => assert!(m.contains("starts at lsn"), "{m}"),
        Err(e) => panic!("{e}"),
        Ok(o) => panic!("opened with records {:?}", lsns(&o.records)),
    }
}

#[test]
fn a_failed_append_is_zeroed_by_heal_and_appends_go_on() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut log = SegmentWriter::open(dir.path(), 1 << 20, 0)
        .expect("open")
        .log;
    log.append_group(&payloads(0..2), true).expect("append");
    // What a failed group may leave: valid-looking records 3 and 4.
    let start = log.offset;
    let mut left = Vec::new();
    frame(&mut left, 3, b"never acknowledged").expect("frame");
    frame(&mut left, 4, b"never acknowledged either").expect("frame");
    log.file.write_all_at(&left, start).expect("write");
    log.failed = Some((start, start + left.len() as u64));
    assert!(
        log.append_group(&payloads(9..10), true).is_err(),
        "refused until healed"
    );
    log.heal().expect("heal");
    assert_eq!(log.append_group(&[b"x".to_vec()], true).expect("append"), 3);
    drop(log);
    let o = SegmentWriter::open(dir.path(), 1 << 20, 0).expect("reopen");
    assert_eq!(lsns(&o.records), vec![1, 2, 3]);
    assert_eq!(o.records[2].payload, b"x");
}

#[test]
fn trimming_deletes_only_segments_wholly_applied() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut log = SegmentWriter::open(dir.path(), 50, 0).expect("open").log;
    for i in 0..8 {
        log.append_group(&payloads(i..i + 1), true).expect("append");
    }
    let closed = log.closed();
    let before = closed_count(&closed);
    assert!(before >= 3, "{before}");
    // Nothing before lsn 1 is applied: nothing goes.
    assert_eq!(trim_before(dir.path(), &closed, 0, 50).expect("trim"), 0);
    let first_seg_end = closed.lock().expect("lock").segments[1].first_lsn - 1;
    assert_eq!(
        trim_before(dir.path(), &closed, first_seg_end - 1, 50).expect("trim"),
        0
    );
    assert_eq!(
        trim_before(dir.path(), &closed, first_seg_end, 50).expect("trim"),
        1
    );
    assert_eq!(
        trim_before(dir.path(), &closed, 8, 50).expect("trim"),
        before - 1
    );
    drop(log);
    let o = SegmentWriter::open(dir.path(), 50, 8).expect("reopen");
    assert!(o.records.is_empty());
    assert_eq!(o.log.next_lsn(), 9);
}
