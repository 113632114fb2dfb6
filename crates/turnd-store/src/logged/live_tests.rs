//! Live records held back past the applied mark ([`LoggedOptions::live_hold`]): a
//! put of an unfinished turn's record waits in the overlay while the other keys of
//! its time go to sled and the applied mark passes it; the replay mark stays before
//! it, so that the log keeps its record, a start after a crash reads it back
//! without writing again what sled has, and one deleted within the hold never
//! reaches sled.

use std::sync::Arc;
use std::time::Duration;

use super::apply::{applied_mark, REPLAY_KEY};
use super::overlay::{EAGER_OVERLAY_KEYS, HELD_OVERLAY_KEYS};
use super::runs_tests::{events, seqs, sled_event_keys, turn_at};
use super::tests::{commit, copy_dir, delete, in_sled, put, put_new};
use super::{LoggedKv, LoggedOptions};
use crate::{keys, Batch, Kv, Store};

/// Rounds only when asked, a mark at each, live records held for an hour.
fn held() -> LoggedOptions {
    LoggedOptions {
        segment_bytes: 4096,
        apply_interval: Duration::from_secs(3600),
        apply_delay: Duration::from_millis(1),
        live_hold: Duration::from_secs(3600),
        mark_interval: Duration::ZERO,
        ..LoggedOptions::default()
    }
}

/// The replay mark the main database records, if any.
fn replay_mark(kv: &LoggedKv) -> Option<u64> {
    let v = kv
        .inner
        .sled
        .with(|h| {
            h.db.get(REPLAY_KEY)
                .map_err(|e| crate::StoreError::Read(e.to_string()))
        })
        .expect("read");
    v.map(|v| u64::from_be_bytes(v.as_ref().try_into().expect("8 bytes")))
}

/// A round with the options' delay, once the writes so far are older than it.
async fn round(kv: &LoggedKv) {
    tokio::time::sleep(Duration::from_millis(5)).await;
    kv.round_with(Duration::from_millis(1));
}

/// A queued turn's record stays in the overlay while its session's events (written
/// as one value), list entry and meta reach sled and the applied mark passes it.
/// The log is not trimmed past it; a crash then replays it from the log and leaves
/// the events sled has as they are (written again one by one, the value that holds
/// the first would be overwritten by the last one's own). Once the turn is deleted,
/// the delete is dropped and the log is trimmed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_turn_record_stays_in_the_log_past_the_applied_mark() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (kv, _) = LoggedKv::open(dir.path(), held()).expect("open");
    let kv = Arc::new(kv);
    let store = Store::new(kv.clone());
    let t = turn_at(1000, 1);
    let queued = keys::turn("t_queued");
    store.commit(events("s", 1..=1, &t)).await.expect("commit");
    commit(&kv, put_new(&queued, "queued")).await;
    store.commit(events("s", 2..=2, &t)).await.expect("commit");
    store.commit(events("s", 3..=3, &t)).await.expect("commit");
    let meta = keys::session_meta("s");
    let mut lsn = 4;
    while kv.commit_stats().log_segments < 2 {
        commit(&kv, put(&meta, &format!("{lsn:0>200}"))).await;
        lsn += 1;
    }
    round(&kv).await;
    round(&kv).await;
    let sled = &kv.inner.sled;
    assert!(!in_sled(sled, &queued), "the queued turn's record is held");
    assert_eq!(kv.overlay_len(), 1);
    assert_eq!(
        sled_event_keys(&kv, "s"),
        vec![3],
        "the events as one value"
    );
    assert!(in_sled(sled, &meta));
    assert_eq!(applied_mark(sled).expect("mark"), lsn);
    assert_eq!(
        replay_mark(&kv),
        Some(1),
        "a start reads from the held record"
    );
    assert_eq!(kv.commit_stats().log_trims, 0, "the log keeps it");
    // sled's files as a crash now would leave them, marks included.
    sled.with(|h| sled.sync_files(h)).expect("sync sled");
    let copy = tempfile::tempdir().expect("tempdir");
    copy_dir(dir.path(), copy.path());
    {
        let (crashed, replayed) = LoggedKv::open(copy.path(), held()).expect("open copy");
        assert_eq!(replayed.records as u64, lsn - 1);
        assert_eq!(crashed.get(&queued).expect("get"), Some(b"queued".to_vec()));
        let crashed = Store::new(Arc::new(crashed));
        assert_eq!(seqs(&crashed, "s"), vec![1, 2, 3]);
    }
    // The turn ends: its record's delete is dropped, nothing is held any more.
    let dropped = kv.commit_stats().dropped_deletes;
    commit(&kv, delete(&queued)).await;
    round(&kv).await;
    assert_eq!(kv.commit_stats().dropped_deletes, dropped + 1);
    assert!(!in_sled(sled, &queued));
    assert_eq!(replay_mark(&kv), None);
    assert!(kv.commit_stats().log_trims > 0, "the log is trimmed");
    assert_eq!(seqs(&store, "s"), vec![1, 2, 3]);
}

/// A live record older than the hold goes to sled (a turn waiting for input for
/// days holds back neither the log nor a start), and the replay mark follows the
/// applied mark again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_record_older_than_the_hold_goes_to_sled() {
    let dir = tempfile::tempdir().expect("tempdir");
    let opts = LoggedOptions {
        live_hold: Duration::from_millis(100),
        ..held()
    };
    let (kv, _) = LoggedKv::open(dir.path(), opts).expect("open");
    let waiting = keys::turn("t_waiting");
    commit(&kv, put_new(&waiting, "awaiting input")).await;
    commit(&kv, put(&keys::session_meta("s"), "m")).await;
    round(&kv).await;
    assert!(!in_sled(&kv.inner.sled, &waiting));
    assert_eq!(replay_mark(&kv), Some(0));
    tokio::time::sleep(Duration::from_millis(150)).await;
    round(&kv).await;
    assert!(in_sled(&kv.inner.sled, &waiting));
    assert_eq!(applied_mark(&kv.inner.sled).expect("mark"), 2);
    assert_eq!(replay_mark(&kv), None);
    assert_eq!(kv.overlay_len(), 0);
}

/// Held records do not make the store count as behind (which would take them to
/// sled at once): a queue of more turns than [`EAGER_OVERLAY_KEYS`] stays held.
/// Past [`HELD_OVERLAY_KEYS`] of them the rest counts again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_held_records_do_not_count_as_behind() {
    let dir = tempfile::tempdir().expect("tempdir");
    let opts = LoggedOptions {
        segment_bytes: 1 << 20,
        ..held()
    };
    let (kv, _) = LoggedKv::open(dir.path(), opts).expect("open");
    let queued = EAGER_OVERLAY_KEYS + 100;
    let mut b = Batch::new();
    for i in 0..queued {
        b.put_raw(keys::turn(&format!("t_{i:08}")), b"queued".to_vec());
        b.created_last();
    }
    commit(&kv, b).await;
    round(&kv).await;
    assert_eq!(kv.overlay_len(), queued, "all of them held");
    kv.overlay_bytes();
    assert!(!kv.busy(), "held records are not a backlog");
    let mut b = Batch::new();
    for i in 0..HELD_OVERLAY_KEYS {
        b.put_raw(keys::turn(&format!("u_{i:08}")), b"queued".to_vec());
        b.created_last();
    }
    commit(&kv, b).await;
    assert!(kv.busy(), "past the held share, they count");
    // Finished: their deletes leave nothing held.
    let mut b = Batch::new();
    for i in 0..queued {
        b.delete(keys::turn(&format!("t_{i:08}")));
    }
    commit(&kv, b).await;
    kv.overlay_bytes();
}
