//! The contract of [`CommitLog`], held against both implementations: groups take
//! consecutive positions and read back in order after a crash, the next append
//! follows both the log and the store's position, a range reads back while open
//! and a range past the end is refused, a trim keeps what follows it. Then what only
//! the in-memory log shows: a crash drops what was never made durable, and a group
//! torn by a crash leaves a prefix of whole records.

use std::time::{Duration, Instant};

use super::{CommitLog, LocalLog, MemLog, Opened, Record};

/// A log the tests open, use, crash and open again.
trait Harness {
    type Log: CommitLog;
    /// Open the log at `applied`, the last position its store holds.
    fn open(&mut self, applied: u64) -> Opened<Self::Log>;
    /// Crash with `log` open: what is left is opened next.
    fn crash(&mut self, log: Self::Log);
}

/// Segment files in a directory: a crash is dropping the handle.
struct Local(tempfile::TempDir);

impl Harness for Local {
    type Log = LocalLog;
    fn open(&mut self, applied: u64) -> Opened<LocalLog> {
        LocalLog::open(self.0.path(), 256, applied).expect("open")
    }
    fn crash(&mut self, log: LocalLog) {
        drop(log);
    }
}

/// In memory: a crash keeps the durable records alone.
struct Mem(MemLog);

impl Harness for Mem {
    type Log = MemLog;
    fn open(&mut self, applied: u64) -> Opened<MemLog> {
        self.0.open(applied).expect("open")
    }
    fn crash(&mut self, log: MemLog) {
        self.0 = log.crash();
    }
}

fn local() -> Local {
    Local(tempfile::tempdir().expect("tempdir"))
}

fn mem() -> Mem {
    Mem(MemLog::new())
}

fn payload(n: u64) -> Vec<u8> {
    format!("record {n}").into_bytes()
}

/// Append records `from..to` as one group, with sync; returns the first position.
fn append(log: &impl CommitLog, from: u64, to: u64) -> u64 {
    let payloads: Vec<Vec<u8>> = (from..to).map(payload).collect();
    let group: Vec<&[u8]> = payloads.iter().map(Vec::as_slice).collect();
    log.append(&group, true).expect("append")
}

fn lsns(records: &[Record]) -> Vec<u64> {
    records.iter().map(|r| r.lsn).collect()
}

fn groups_read_back<H: Harness>(mut h: H) {
    let o = h.open(0);
    assert!(o.records.is_empty());
    let log = o.log;
    assert_eq!(log.next_lsn(), 1);
    assert_eq!(append(&log, 1, 2), 1);
    assert_eq!(append(&log, 2, 6), 2);
    assert_eq!(append(&log, 6, 8), 6);
    h.crash(log);
    let o = h.open(0);
    assert_eq!(lsns(&o.records), (1..=7).collect::<Vec<_>>());
    for r in &o.records {
        assert_eq!(r.payload, payload(r.lsn));
    }
    assert_eq!(o.log.next_lsn(), 8);
    assert_eq!(append(&o.log, 8, 9), 8);
}

#[test]
fn groups_take_consecutive_positions_and_read_back_in_order_after_a_crash() {
    groups_read_back(local());
    groups_read_back(mem());
}

fn next_after_store<H: Harness>(mut h: H) {
    let o = h.open(5);
    assert!(o.records.is_empty());
    assert_eq!(o.log.next_lsn(), 6);
    assert_eq!(append(&o.log, 6, 7), 6);
}

#[test]
fn the_next_append_follows_the_position_the_store_holds() {
    next_after_store(local());
    next_after_store(mem());
}

fn range_and_trim<H: Harness>(mut h: H) {
    let log = h.open(0).log;
    for n in 1..=20 {
        append(&log, n, n + 1);
    }
    assert_eq!(lsns(&log.read_range(2, 5).expect("read")), vec![3, 4, 5]);
    assert_eq!(
        log.read_range(0, 20).expect("read")[19].payload,
        payload(20)
    );
    assert!(log.read_range(15, 21).is_err(), "21 was never written");
    log.trim(12).expect("trim");
    assert_eq!(
        lsns(&log.read_range(12, 20).expect("read")),
        (13..=20).collect::<Vec<_>>()
    );
    h.crash(log);
    let o = h.open(12);
    assert_eq!(lsns(&o.records), (13..=20).collect::<Vec<_>>());
    assert_eq!(o.log.next_lsn(), 21);
}

#[test]
fn a_range_reads_back_while_open_and_a_trim_keeps_what_follows_it() {
    range_and_trim(local());
    range_and_trim(mem());
}

/// Appends without sync are durable once a later one with sync or a flush comes; a
/// crash before that drops them, and the log goes on after what it kept.
#[test]
fn a_crash_drops_what_the_in_memory_log_never_made_durable() {
    let log = MemLog::new();
    let o = log.open(0).expect("open");
    o.log.append(&[b"a"], true).expect("append");
    o.log.append(&[b"b", b"c"], false).expect("append");
    let log = log.crash();
    let o = log.open(0).expect("open");
    assert_eq!(lsns(&o.records), vec![1]);
    assert_eq!(o.log.next_lsn(), 2);
    o.log.append(&[b"b"], false).expect("append");
    o.log.flush().expect("flush");
    o.log.append(&[b"c"], false).expect("append");
    o.log.append(&[b"d"], true).expect("append");
    o.log.append(&[b"e"], false).expect("append");
    let survivor = log.crash();
    assert!(
        o.log.append(&[b"f"], true).is_err(),
        "a crashed log refuses"
    );
    assert!(o.log.health().is_err());
    let back = survivor.open(0).expect("open");
    let payloads: Vec<&[u8]> = back.records.iter().map(|r| &r.payload[..]).collect();
    assert_eq!(payloads, [&b"a"[..], b"b", b"c", b"d"]);
}

/// A group torn by a crash: its first records reach the log whole, the append never
/// returns before the crash, and returns an error after it.
#[test]
fn a_torn_group_leaves_a_prefix_of_whole_records() {
    let log = MemLog::new();
    let o = log.open(0).expect("open");
    o.log.append(&[b"a"], true).expect("append");
    log.tear_next_append(2);
    let appending = {
        let l = o.log.clone();
        std::thread::spawn(move || l.append(&[b"b", b"c", b"d"], true))
    };
    let until = Instant::now() + Duration::from_secs(10);
    while log.lsns().len() < 3 {
        assert!(
            Instant::now() < until,
            "the torn group wrote {:?}",
            log.lsns()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(
        !appending.is_finished(),
        "the torn append waits for the crash"
    );
    let survivor = log.crash();
    assert!(appending.join().expect("thread").is_err());
    let back = survivor.open(0).expect("open");
    let payloads: Vec<&[u8]> = back.records.iter().map(|r| &r.payload[..]).collect();
    assert_eq!(payloads, [&b"a"[..], b"b", b"c"]);
    assert_eq!(back.log.next_lsn(), 4);
}
