//! A warm standby's store ([`super::Follower`]): a leader's records, applied in
//! pieces (some twice, across a close), leave a store whose every key equals the
//! leader's, and a [`LoggedKv`] opened on it replays only the records past its mark.

use super::tests::slow;
use super::{Follower, LoggedKv};
use crate::kv::Kv;
use crate::log::{CommitLog, MemLog, Opened, Record};
use crate::model::{keys, Batch};

/// Batch `i`: a session meta written, one rewritten, one deleted, events added.
fn batch(i: u64) -> Batch {
    let mut b = Batch::new();
    b.put_raw(
        keys::session_meta(&format!("s{i}")),
        format!("v{i}").into_bytes(),
    );
    b.put_raw(
        keys::session_meta("shared"),
        format!("last {i}").into_bytes(),
    );
    if i.is_multiple_of(3) && i > 0 {
        b.delete(keys::session_meta(&format!("s{}", i - 1)));
    }
    b.put_raw(keys::event("shared", i), vec![b'e'; (i as usize % 7) * 100]);
    b
}

/// Every key and value a store holds (past the applied mark, which is where each
/// store is, not what it holds).
fn every_key(kv: &LoggedKv) -> Vec<(Vec<u8>, Vec<u8>)> {
    kv.scan(b"\x01", &[0xff; 4], false, usize::MAX)
        .expect("scan")
}

/// The first key where two stores differ, if any (a short message, not two dumps).
fn first_difference(a: &[(Vec<u8>, Vec<u8>)], b: &[(Vec<u8>, Vec<u8>)]) -> Option<String> {
    let at = a.iter().zip(b).position(|(x, y)| x != y);
    match at {
        Some(i) => Some(format!(
            "key {:?} differs",
            String::from_utf8_lossy(&a[i].0)
        )),
        None if a.len() != b.len() => Some(format!("{} keys against {}", a.len(), b.len())),
        None => None,
    }
}

/// A log holding `records` at their lsns (which start at 1, without a gap).
fn log_of(records: &[Record]) -> MemLog {
    let log = MemLog::new();
    for r in records {
        let lsn = log.append(&[&r.payload], true).expect("append");
        assert_eq!(lsn, r.lsn);
    }
    log
}

/// A leader's store on a [`MemLog`] in a directory of its own, after batches
/// `0..n` were committed.
struct Leader {
    _dir: tempfile::TempDir,
    log: MemLog,
    kv: LoggedKv,
}

async fn leader_after(n: u64) -> Leader {
    let dir = tempfile::tempdir().expect("tempdir");
    let log = MemLog::new();
    let (kv, _) = LoggedKv::open_with_log(dir.path(), slow(), |a| log.open(a).map(Opened::boxed))
        .expect("open the leader");
    for i in 0..n {
        kv.commit(batch(i))
            .await
            .expect("answered")
            .expect("committed");
    }
    Leader { _dir: dir, log, kv }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_holds_what_the_leader_holds_and_a_takeover_replays_the_rest() {
    let standby_dir = tempfile::tempdir().expect("tempdir");
    // `_dir` bound, so that the leader's directory lives as long as the test.
    let Leader {
        _dir,
        log,
        kv: leader,
    } = leader_after(60).await;
    let records = log.read_range(0, log.next_lsn() - 1).expect("read the log");
    assert_eq!(records.len(), 60);

    let mut f = Follower::open(standby_dir.path(), slow()).expect("open a follower");
    f.apply(&records[..20]).expect("apply");
    // Handed again, overlapping what it has: passed over.
    f.apply(&records[10..40]).expect("apply");
    assert_eq!(f.applied(), records[39].lsn);
    f.close();
    let mut f = Follower::open(standby_dir.path(), slow()).expect("open the follower again");
    assert_eq!(f.applied(), records[39].lsn, "the applied mark is durable");
    f.apply(&records[40..50]).expect("apply");
    f.close();

    // A takeover: the standby's directory opened on the whole log replays only the
    // records past the follower's mark.
    let copy = log_of(&records);
    let (standby, replayed) = crate::sled::open_when_unlocked(|| {
        LoggedKv::open_with_log(standby_dir.path(), slow(), |a| {
            copy.open(a).map(Opened::boxed)
        })
    })
    .expect("open the standby's store");
    assert_eq!(
        replayed.records, 10,
        "only the records past the follower's mark"
    );
    let lead_keys = every_key(&leader);
    assert!(lead_keys.len() > 40);
    assert_eq!(first_difference(&lead_keys, &every_key(&standby)), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_installed_elsewhere_replays_only_what_came_after_it() {
    let other = tempfile::tempdir().expect("tempdir");
    // `_dir` bound, so that the leader's directory lives as long as the test.
    let Leader {
        _dir,
        log,
        kv: leader,
    } = leader_after(30).await;
    let mut records = log.read_range(0, log.next_lsn() - 1).expect("read the log");
    // Applied to sled; the log is trimmed.
    leader.flush_now().expect("apply to sled");
    let mut ckpt = Vec::new();
    let info = leader
        .write_checkpoint(&mut ckpt)
        .expect("write a checkpoint");
    assert_eq!(info.mark, log.next_lsn() - 1, "the mark sled was at");
    for i in 30..50 {
        leader
            .commit(batch(i))
            .await
            .expect("answered")
            .expect("committed");
    }
    let after = records.last().map_or(0, |r| r.lsn);
    records.extend(
        log.read_range(after, log.next_lsn() - 1)
            .expect("read the log"),
    );

    // A cut checkpoint is refused, and what the directory held stays.
    let dir = other.path().join("p0");
    let mut f = Follower::open(&dir, slow()).expect("open a follower");
    f.apply(&records[..3]).expect("apply");
    f.close();
    let cut = &ckpt[..ckpt.len() - 9];
    let e = super::install_checkpoint(&dir, &mut &cut[..], slow()).expect_err("cut short");
    assert!(e.to_string().contains("checkpoint"), "{e}");
    let f = Follower::open(&dir, slow()).expect("the old store");
    assert_eq!(f.applied(), records[2].lsn);
    f.close();

    let got = super::install_checkpoint(&dir, &mut &ckpt[..], slow()).expect("install");
    assert_eq!(got, info);
    let copy = log_of(&records);
    // The install's own sled handle may hold the file lock a moment after it closed.
    let (installed, replayed) = crate::sled::open_when_unlocked(|| {
        LoggedKv::open_with_log(&dir, slow(), |a| copy.open(a).map(Opened::boxed))
    })
    .expect("open the installed store");
    assert_eq!(
        replayed.records, 20,
        "only the records after the checkpoint"
    );
    assert_eq!(
        first_difference(&every_key(&leader), &every_key(&installed)),
        None
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_followers_writes_are_durable_within_a_mark_interval_when_asked_and_at_close() {
    let standby_dir = tempfile::tempdir().expect("tempdir");
    let leader = leader_after(30).await;
    let log = &leader.log;
    let records = log.read_range(0, log.next_lsn() - 1).expect("read the log");
    let hourly = super::LoggedOptions {
        mark_interval: std::time::Duration::from_secs(3600),
        ..slow()
    };
    let mut f = Follower::open(standby_dir.path(), hourly).expect("open a follower");
    f.apply(&records[..10]).expect("apply");
    assert_eq!(f.applied(), records[9].lsn);
    assert_eq!(f.durable(), 0, "not synced within the mark interval");
    f.sync().expect("sync");
    assert_eq!(f.durable(), records[9].lsn, "synced when asked");
    f.apply(&records[10..20]).expect("apply");
    assert_eq!(f.durable(), records[9].lsn);
    f.close();
    let f = Follower::open(standby_dir.path(), hourly).expect("open it again");
    assert_eq!(f.durable(), records[19].lsn, "synced as it closed");
    f.close();

    // With the interval past at every write, each apply is durable on return.
    let every = super::LoggedOptions {
        mark_interval: std::time::Duration::ZERO,
        ..slow()
    };
    let mut f = Follower::open(standby_dir.path(), every).expect("open it again");
    f.apply(&records[20..]).expect("apply");
    assert_eq!(f.durable(), records[29].lsn);
    f.close();
}
