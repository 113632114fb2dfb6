//! Folded records in [`super::LoggedKv`]'s time windows: routed by their turn's
//! time, found by reads and scans through deletes, moved out when their window is
//! dropped, and neither lost nor brought back by a replay after a crash.

use std::sync::Arc;
use std::time::Duration;

use super::tests::{commit, copy_dir, in_sled, opts, put, turn_at};
use super::{LoggedKv, LoggedOptions};
use crate::kv::Kv;
use crate::model::{keys, Batch};
use crate::sled::open_when_unlocked;
use crate::windows::{self, WindowOptions};

/// A store in `dir` with windows of 1 ms applied by hand, and two windows made: its
/// options and the first window's start and end.
async fn two_windows(dir: &std::path::Path) -> (LoggedKv, LoggedOptions, u64, u64) {
    let manual = LoggedOptions {
        apply_interval: Duration::from_secs(3600),
        windows: WindowOptions {
            window_ms: 1,
            window_bytes: u64::MAX,
        },
        ..opts()
    };
    let (kv, _) = LoggedKv::open(dir, manual).expect("open");
    // Windows are made when finished turns are to be written.
    let far = turn_at(u64::from(u32::MAX) << 8, 9);
    commit(&kv, put(&keys::finished(&far), &far)).await;
    kv.sync().expect("round: first window");
    std::thread::sleep(Duration::from_millis(5));
    commit(&kv, put(&keys::finished(&far), &far)).await;
    kv.sync().expect("round: second window");
    let list = kv.windows().expect("windows");
    assert!(list.len() >= 2, "{list:?}");
    (kv, manual, list[0].start_ms, list[0].end_ms.expect("end"))
}

/// Folded records go to the window of their turn id's time, everything else (and
/// turns minted before the first window) to the main database. A drop moves what
/// the window still holds to the main database, and its directory goes once the
/// drop is durable; a start after a crash does not re-create it from the log and
/// loses nothing committed, before the drop or after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn windows_route_by_turn_time_and_a_drop_survives_a_replay() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (kv, manual, a, b) = two_windows(dir.path()).await;
    let put_f = |id: &str| put(&keys::finished(id), id);
    assert!(dir.path().join("windows").join(a.to_string()).is_dir());

    let (old, early, late, after) = (
        turn_at(a - 1, 0),
        turn_at(a, 1),
        turn_at(b - 1, 2),
        turn_at(a, 3),
    );
    commit(&kv, put_f(&old)).await;
    commit(&kv, put_f(&early)).await;
    commit(&kv, put(&keys::session_meta("s"), "m")).await;
    kv.sync().expect("apply");
    let wa = kv.inner.windows.get(a).expect("window a");
    assert!(in_sled(&wa, &keys::finished(&early)));
    assert!(!in_sled(&kv.inner.sled, &keys::finished(&early)));
    assert!(
        in_sled(&kv.inner.sled, &keys::finished(&old)),
        "minted before any window"
    );
    assert!(in_sled(&kv.inner.sled, &keys::session_meta("s")));
    assert!(!in_sled(&wa, &keys::session_meta("s")));
    let (fs, fe) = keys::finished_range();
    assert_eq!(kv.scan(&fs, &fe, false, usize::MAX).expect("scan").len(), 3);
    assert_eq!(
        kv.get(&keys::finished(&early)).expect("get"),
        Some(early.clone().into_bytes())
    );
    // A scan of few entries whose first ones the overlay deletes still finds the
    // window's next record.
    let (ws, we) = windows::finished_key_range(a, Some(b));
    let mut del = Batch::new();
    del.delete(keys::finished(&early));
    commit(&kv, del).await;
    let second = turn_at(a, 5);
    commit(&kv, put_f(&second)).await;
    kv.sync().expect("apply");
    commit(&kv, {
        let mut d = Batch::new();
        d.delete(keys::finished(&second));
        d
    })
    .await;
    commit(&kv, put_f(&early)).await;
    kv.sync().expect("apply");
    let mut d = Batch::new();
    d.delete(keys::finished(&early));
    commit(&kv, d).await;
    assert!(kv.scan(&ws, &we, false, 1).expect("scan").is_empty());
    commit(&kv, put_f(&second)).await;
    kv.sync().expect("apply");
    let mut d = Batch::new();
    d.delete(keys::finished(&early));
    d.put_raw(keys::finished(&early), early.clone().into_bytes());
    commit(&kv, d).await;
    kv.sync().expect("apply");
    let mut d = Batch::new();
    d.delete(keys::finished(&early));
    commit(&kv, d).await;
    let found = kv.scan(&ws, &we, false, 1).expect("scan");
    assert_eq!(found.len(), 1, "the record after a deleted one");
    assert_eq!(found[0].0, keys::finished(&second));
    commit(&kv, put_f(&early)).await;
    let mut d = Batch::new();
    d.delete(keys::finished(&second));
    commit(&kv, d).await;
    kv.sync().expect("apply");
    drop(wa);

    // Not applied before the "crash": a record of the window, its drop, and a
    // record of the window written after the drop.
    commit(&kv, put_f(&late)).await;
    let mut b2 = Batch::new();
    b2.drop_window(a);
    commit(&kv, b2).await;
    assert!(kv.windows().expect("windows")[0].dropped);
    commit(&kv, put_f(&after)).await;
    std::mem::forget(kv);
    let copy = tempfile::tempdir().expect("tempdir");
    copy_dir(dir.path(), copy.path());
    let (kv, replayed) = LoggedKv::open(copy.path(), manual).expect("reopen");
    assert_eq!(replayed.records, 3);
    let window_a = copy.path().join("windows").join(a.to_string());
    assert!(
        !window_a.exists(),
        "the dropped window's directory is deleted"
    );
    for id in [&old, &early, &late, &after] {
        assert_eq!(
            kv.get(&keys::finished(id)).expect("get"),
            Some(id.clone().into_bytes()),
            "{id}"
        );
        assert!(in_sled(&kv.inner.sled, &keys::finished(id)), "{id} in main");
    }
    let listed = kv.windows().expect("windows");
    assert!(listed[0].dropped && listed[0].start_ms == a, "{listed:?}");
    // Deleting a record of the dropped window deletes it where it is now.
    let mut del = Batch::new();
    del.delete(keys::finished(&early));
    commit(&kv, del).await;
    kv.close().expect("close");
    drop(kv);
    let (kv, replayed) =
        open_when_unlocked(|| LoggedKv::open(copy.path(), manual)).expect("reopen");
    assert_eq!(replayed.records, 0);
    assert!(!window_a.exists());
    assert!(kv.windows().expect("windows")[0].dropped);
    assert_eq!(
        kv.get(&keys::finished(&after)).expect("get"),
        Some(after.into_bytes())
    );
    assert_eq!(kv.get(&keys::finished(&early)).expect("get"), None);
    assert_eq!(kv.scan(&fs, &fe, false, usize::MAX).expect("scan").len(), 4);
    // `store.check` reports a dropped window whose files are still there. (The
    // records above are not JSON: deleted first.)
    let mut d = Batch::new();
    for (k, _) in kv.scan(&fs, &fe, false, usize::MAX).expect("scan") {
        d.delete(k);
    }
    d.delete(keys::session_meta("s"));
    commit(&kv, d).await;
    let store = crate::Store::new(Arc::new(kv));
    let dropped_on_disk = |store: &crate::Store| {
        crate::check_store(store)
            .expect("check")
            .iter()
            .any(|v| v.invariant == "dropped_window_on_disk")
    };
    assert!(!dropped_on_disk(&store));
    std::fs::create_dir_all(&window_a).expect("mkdir");
    std::fs::write(window_a.join("db"), b"left over").expect("write");
    assert!(dropped_on_disk(&store));
}

/// A drop committed after a round began waits for the next round: that round does
/// not write it to sled (its key lies past the walk's end), so deleting the window
/// then would leave a power loss a window directory cut in half and a main
/// database that does not know it was dropped (a start refused it). Whenever the
/// window's directory is gone, the main database's files hold the drop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drop_committed_as_a_round_begins_is_taken_by_the_next() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (kv, _, a, _) = two_windows(dir.path()).await;
    let put_f = |id: &str| put(&keys::finished(id), id);
    let window_a = dir.path().join("windows").join(a.to_string());
    commit(&kv, put_f(&turn_at(a, 1))).await;
    kv.sync().expect("apply");
    assert!(window_a.is_dir());

    let drops_in_sled = || super::apply::recorded_drops(&kv.inner.sled).expect("drops");
    let mut drop_a = Batch::new();
    drop_a.drop_window(a);
    let made = super::tests::commit_as_next_round_begins(&kv, drop_a);
    commit(&kv, put(&keys::session_meta("s"), "m")).await;
    kv.round_with(Duration::ZERO);
    assert_eq!(
        *made.lock().expect("lock"),
        Some(true),
        "the drop committed"
    );
    assert!(
        window_a.is_dir() || drops_in_sled().contains_key(&a),
        "the window's directory went before the main database held its drop"
    );
    // The next round takes it.
    kv.round_with(Duration::ZERO);
    assert!(drops_in_sled().contains_key(&a));
    assert!(
        !window_a.exists(),
        "the dropped window's directory is deleted"
    );
}
