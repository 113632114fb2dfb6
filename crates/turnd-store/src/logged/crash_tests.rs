//! The whole store on the in-memory log ([`MemLog`]): the commit path works on any
//! [`crate::log::CommitLog`]. Batches are committed, some applied to sled and
//! trimmed from the log, some in the log only; a group is torn by a crash; the
//! store is reopened on what the crash left of sled and of the log. Every
//! acknowledged batch is there, and each one never acknowledged is there whole or
//! not at all.

use std::time::{Duration, Instant};

use super::tests::{copy_dir, slow};
use super::{LoggedKv, LoggedOptions};
use crate::kv::{CommitTicket, Kv};
use crate::log::{MemLog, Opened};
use crate::model::{keys, Batch};

/// The keys batch `i` writes (three, so that a torn batch would show).
fn batch_keys(i: u64) -> [Vec<u8>; 3] {
    ["a", "b", "c"].map(|k| keys::session_meta(&format!("s{i}-{k}")))
}

fn batch(i: u64) -> Batch {
    let mut b = Batch::new();
    for k in batch_keys(i) {
        b.put_raw(k, format!("v{i}").into_bytes());
    }
    b
}

/// Whether batch `i` is in the store: `Some(true)` whole, `Some(false)` not at all,
/// `None` torn.
fn present(kv: &LoggedKv, i: u64) -> Option<bool> {
    let found: Vec<bool> = batch_keys(i)
        .iter()
        .map(|k| kv.get(k).expect("get") == Some(format!("v{i}").into_bytes()))
        .collect();
    if found.iter().all(|f| *f) {
        Some(true)
    } else if found.iter().all(|f| !*f) {
        Some(false)
    } else {
        None
    }
}

fn open_on(dir: &std::path::Path, opts: LoggedOptions, log: &MemLog) -> (LoggedKv, usize) {
    let (kv, replayed) =
        LoggedKv::open_with_log(dir, opts, |applied| log.open(applied).map(Opened::boxed))
            .expect("open");
    (kv, replayed.records)
}

async fn acknowledged(kv: &LoggedKv, b: Batch) {
    kv.commit(b).await.expect("answered").expect("committed");
}

/// Commit batches `from..to` at once, unanswered.
fn queue(kv: &LoggedKv, from: u64, to: u64) -> Vec<CommitTicket> {
    (from..to).map(|i| kv.commit(batch(i))).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_on_an_in_memory_log_keeps_every_acknowledged_batch_through_a_crash() {
    let dir = tempfile::tempdir().expect("tempdir");
    let log = MemLog::new();
    let (kv, replayed) = open_on(dir.path(), slow(), &log);
    assert_eq!(replayed, 0);
    // Acknowledged, then applied to sled and trimmed from the log.
    for i in 0..20 {
        acknowledged(&kv, batch(i)).await;
    }
    kv.sync().expect("apply and trim");
    assert!(log.lsns().is_empty(), "trimmed: {:?}", log.lsns());
    // Acknowledged, in the log only; one of them deletes a key sled holds.
    for i in 20..30 {
        acknowledged(&kv, batch(i)).await;
    }
    let mut delete = Batch::new();
    delete.delete(batch_keys(3)[0].clone());
    acknowledged(&kv, delete).await;
    assert_eq!(log.lsns(), (21..=31).collect::<Vec<_>>());
    // Never acknowledged: the next group is torn by the crash after two records,
    // and what queues behind it is never written.
    log.tear_next_append(2);
    let unanswered = queue(&kv, 30, 40);
    let until = Instant::now() + Duration::from_secs(10);
    while log.lsns().len() <= 11 {
        assert!(Instant::now() < until, "no torn group: {:?}", log.lsns());
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    // The crash: what sled's files hold now, and the log's durable records.
    let survivor = log.crash();
    let copy = tempfile::tempdir().expect("tempdir");
    copy_dir(dir.path(), copy.path());
    for t in unanswered {
        let answer = tokio::time::timeout(Duration::from_secs(10), t)
            .await
            .expect("answered once the log crashed");
        assert!(
            !matches!(answer, Ok(Ok(()))),
            "acknowledged after the crash"
        );
    }
    std::mem::forget(kv);

    let kept = survivor.lsns();
    assert_eq!(
        kept[..kept.len().min(11)],
        (21..=31).collect::<Vec<_>>(),
        "the log keeps every acknowledged record"
    );
    let torn = kept.len() as u64 - 11;
    assert!((1..=2).contains(&torn), "{kept:?}");
    let (kv, replayed) = open_on(copy.path(), slow(), &survivor);
    assert_eq!(replayed as u64, 11 + torn);
    for i in 0..30 {
        let whole = if i == 3 {
            // Its first key deleted by an acknowledged batch, the others there.
            let [a, b, c] = batch_keys(3);
            kv.get(&a).expect("get").is_none()
                && [b, c].iter().all(|k| kv.get(k).is_ok_and(|v| v.is_some()))
        } else {
            present(&kv, i) == Some(true)
        };
        assert!(whole, "acknowledged batch {i} is there");
    }
    for i in 30..40 {
        let p = present(&kv, i).unwrap_or_else(|| panic!("batch {i} is torn"));
        assert_eq!(
            p,
            i < 30 + torn,
            "batch {i}: the group's records that reached the log"
        );
    }
    // The store goes on after the records the crash left, and a clean close leaves
    // the log empty.
    acknowledged(&kv, batch(40)).await;
    assert_eq!(survivor.lsns().last(), Some(&(31 + torn + 1)));
    kv.close().expect("close");
    drop(kv);
    assert!(survivor.lsns().is_empty());
    let (kv, replayed) = crate::sled::open_when_unlocked(|| {
        LoggedKv::open_with_log(copy.path(), slow(), |applied| {
            survivor.open(applied).map(Opened::boxed)
        })
    })
    .expect("reopen");
    assert_eq!(replayed.records, 0);
    assert_eq!(present(&kv, 40), Some(true));
    acknowledged(&kv, batch(41)).await;
    assert_eq!(present(&kv, 41), Some(true));
}

/// A crash of `kv`, whose sled lives in `dir`, on `log`: the store opened again on
/// a copy of sled's files as they are and on the records the log kept. Returns the
/// copy's directory, the log, the store and the records it replayed.
fn crash_and_reopen(
    kv: LoggedKv,
    log: &MemLog,
    dir: &std::path::Path,
) -> (tempfile::TempDir, MemLog, LoggedKv, usize) {
    let survivor = log.crash();
    let copy = tempfile::tempdir().expect("tempdir");
    copy_dir(dir, copy.path());
    std::mem::forget(kv);
    let (kv, replayed) = open_on(copy.path(), slow(), &survivor);
    (copy, survivor, kv, replayed)
}

/// A start puts what the log holds past sled's mark in the overlay and serves from
/// there at once; the applier writes it to sled afterwards, and only then is it
/// trimmed from the log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_serves_the_logs_tail_from_the_overlay_and_writes_it_to_sled_after() {
    let dir = tempfile::tempdir().expect("tempdir");
    let log = MemLog::new();
    let (kv, _) = open_on(dir.path(), slow(), &log);
    for i in 0..10 {
        acknowledged(&kv, batch(i)).await;
    }
    // The crash: the applier never ran, so sled holds none of them.
    let (copy, survivor, kv, replayed) = crash_and_reopen(kv, &log, dir.path());
    assert_eq!(replayed, 10);
    assert_eq!(
        kv.overlay_len(),
        30,
        "the log's tail waits in the overlay: the start wrote none of it to sled"
    );
    for i in 0..10 {
        assert_eq!(present(&kv, i), Some(true), "batch {i} is read at once");
    }
    assert_eq!(
        survivor.lsns(),
        (1..=10).collect::<Vec<_>>(),
        "kept until applied"
    );
    kv.sync().expect("apply and trim");
    assert_eq!(kv.overlay_len(), 0);
    assert!(survivor.lsns().is_empty(), "trimmed once sled has it");

    // Another crash now: sled has every batch, and the log nothing to replay.
    let (_again, _log, kv, replayed) = crash_and_reopen(kv, &survivor, copy.path());
    assert_eq!(replayed, 0);
    for i in 0..10 {
        assert_eq!(present(&kv, i), Some(true), "batch {i} is in sled");
    }
    kv.close().expect("close");
}
