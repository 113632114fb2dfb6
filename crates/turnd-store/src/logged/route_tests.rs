//! The routed keys of sessions in [`crate::LoggedKv`]'s time windows: where they are
//! written, which windows a read of a session looks in, and what a window's drop and
//! a replay after a crash do with them.

use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use turnd_proto::{Event, EventKind};

use crate::windows::WindowOptions;
use crate::{
    Batch, IdempotencyRecord, Kv, LoggedKv, LoggedOptions, RawJson, SessionKeys, SessionMeta,
    Store, TurnRecord,
};

fn turn_at(ms: u64, n: u8) -> String {
    format!("t_{ms:012x}7000800000000000{n:04x}")
}

fn event(seq: u64, turn_id: &str) -> Event {
    Event {
        seq,
        session_id: "s".into(),
        turn_id: turn_id.into(),
        at_ms: seq,
        kind: EventKind::Admitted,
        detail: json!({}),
    }
}

async fn commit(store: &Store, b: Batch) {
    store.commit(b).await.expect("committed");
}

/// Admit `turn_id` at `seq` into the meta's session and store it as finished: its
/// list entry, an event, an idempotency key named after it, its folded record, and
/// the meta recording where its keys are.
fn admission(meta: &mut SessionMeta, seq: u64, turn_id: &str) -> Batch {
    let input = RawJson::from_value(&json!(null));
    let mut t = TurnRecord::admitted(turn_id.into(), &meta.session_id, seq, "f", input, 0);
    t.idempotency_key = Some(format!("k{seq}"));
    let mut b = Batch::new();
    b.put_finished(&crate::FoldedTurn::new(&t, Vec::new()), false);
    b.put_list_entry(&t);
    b.put_events(&[Event {
        session_id: meta.session_id.clone(),
        ..event(seq, turn_id)
    }]);
    b.put_idempotency(
        &meta.session_id,
        &format!("k{seq}"),
        &IdempotencyRecord {
            turn_id: turn_id.into(),
        },
    );
    meta.last_turn_seq = seq;
    meta.last_event_seq = seq;
    meta.routed_at(b.routed_from());
    b.put_session_meta(meta);
    b
}

/// A store whose windows are switched by hand: 1 ms windows, applied only by
/// `sync`.
fn manual() -> LoggedOptions {
    LoggedOptions {
        segment_bytes: 4096,
        apply_interval: Duration::from_secs(3600),
        windows: WindowOptions {
            window_ms: 1,
            window_bytes: u64::MAX,
        },
        ..LoggedOptions::default()
    }
}

/// A store in `dir` ([`manual`]) with at least `n` windows, made by a turn admitted
/// far in the future (a window is made only when turns are admitted or finished),
/// and the windows.
async fn with_windows(
    dir: &std::path::Path,
    n: usize,
) -> (Arc<LoggedKv>, Store, Vec<crate::WindowInfo>) {
    with_windows_as(dir, n, manual()).await
}

/// [`with_windows`] with the store opened with `opts`.
async fn with_windows_as(
    dir: &std::path::Path,
    n: usize,
    opts: LoggedOptions,
) -> (Arc<LoggedKv>, Store, Vec<crate::WindowInfo>) {
    let (kv, _) = LoggedKv::open(dir, opts).expect("open");
    let kv = Arc::new(kv);
    let store = Store::new(kv.clone());
    let far = turn_at(u64::from(u32::MAX) << 8, 9);
    let mut scratch = SessionMeta::new("far");
    for _ in 0..n {
        let mut b = admission(&mut scratch, 1, &far);
        b.ops
            .retain(|op| matches!(op, crate::KvOp::Put(k, _) if k[0] == b'L'));
        commit(&store, b).await;
        kv.sync().expect("round: a window");
        std::thread::sleep(Duration::from_millis(5));
    }
    let list = kv.windows().expect("windows");
    assert!(list.len() >= n, "{list:?}");
    (kv, store, list)
}

fn listed(store: &Store, s: SessionKeys<'_>) -> Vec<String> {
    let mut ids: Vec<String> = store
        .session_turn_ids(s, u64::MAX, usize::MAX)
        .expect("list")
        .into_iter()
        .map(|(_, id)| id)
        .collect();
    ids.reverse();
    ids
}

fn event_turns(store: &Store, s: SessionKeys<'_>) -> Vec<String> {
    store
        .stored_events(s, 0, usize::MAX)
        .expect("events")
        .into_iter()
        .map(|e| e.turn_id)
        .collect()
}

fn refs(ids: &[&String]) -> Vec<String> {
    ids.iter().map(|s| s.to_string()).collect()
}

/// A session's turn list entries, event values and idempotency keys go to the
/// window of their turn (an event value to its newest turn's), those of turns minted
/// before the first window to the main database. A read of the session looks in the
/// windows from its meta's `routed_from_ms` on, and finds each of them; a window
/// before that is not read. A dropped window's keys move to the main database and
/// read the same, also after a replay of the log from before the drop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sessions_keys_live_in_their_turns_windows_and_reads_reach_them() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (kv, store, list) = with_windows(dir.path(), 2).await;
    let (a, b) = (list[0].start_ms, list[0].end_ms.expect("end"));

    let (old, early, late) = (turn_at(a - 1, 0), turn_at(a, 1), turn_at(b, 2));
    let mut meta = SessionMeta::new("s");
    for (seq, id) in [(1, &old), (2, &early), (3, &late)] {
        commit(&store, admission(&mut meta, seq, id)).await;
        // Applied one by one: values of one round would be written as one, routed
        // by the newest turn among them (`logged::runs`).
        kv.sync().expect("apply");
    }
    // One transition's events about two turns: routed by the newer one.
    let mut both = Batch::new();
    both.put_events(&[event(4, &early), event(5, &late)]);
    meta.last_event_seq = 5;
    meta.routed_at(both.routed_from());
    both.put_session_meta(&meta);
    commit(&store, both).await;
    kv.sync().expect("apply");
    assert_eq!(
        meta.routed_from_ms,
        crate::keys::route_of(&old),
        "the meta records the earliest turn of a routed key (in the main database here)"
    );

    let all = [old.clone(), early.clone(), late.clone()];
    assert_eq!(listed(&store, meta.keys()), all);
    assert_eq!(
        event_turns(&store, meta.keys()),
        refs(&[&old, &early, &late, &early, &late])
    );
    for (seq, id) in [(1, &old), (2, &early), (3, &late)] {
        let rec = store
            .idempotency(meta.keys(), &format!("k{seq}"))
            .expect("read");
        assert_eq!(rec.map(|r| r.turn_id).as_ref(), Some(id));
    }
    // Where each is: the main database alone holds the turn minted before any window;
    // from the second window on, the first window's keys are not read.
    let main_only = SessionKeys {
        id: "s",
        from_ms: None,
    };
    assert_eq!(listed(&store, main_only), std::slice::from_ref(&old));
    let from_b = SessionKeys {
        id: "s",
        from_ms: Some(b),
    };
    assert_eq!(listed(&store, from_b), [old.clone(), late.clone()]);
    assert_eq!(
        event_turns(&store, from_b),
        refs(&[&old, &late, &early, &late]),
        "the value of both turns is in the second window"
    );
    assert!(store.idempotency(from_b, "k2").expect("read").is_none());
    // The one entry at a seq, found wherever it is (the main database, either window),
    // and not in a window the session's keys cannot be in.
    for (seq, id) in [(1, &old), (2, &early), (3, &late)] {
        let at = store.list_entry(meta.keys(), seq).expect("read");
        assert_eq!(at.as_ref(), Some(id), "seq {seq}");
    }
    assert_eq!(store.list_entry(from_b, 2).expect("read"), None);
    assert_eq!(store.list_entry(meta.keys(), 4).expect("read"), None);
    // A plain scan reads every window.
    let (ls, le) = crate::keys::session_turn_range();
    let scanned = kv.scan(&ls, &le, false, usize::MAX).expect("scan");
    assert_eq!(scanned.len(), 4, "three turns of s and the far one");

    // Not applied before the "crash": one more event of the first window's turn, then
    // the window's drop.
    let mut more = Batch::new();
    more.put_events(&[event(6, &early)]);
    meta.last_event_seq = 6;
    more.put_session_meta(&meta);
    commit(&store, more).await;
    let mut d = Batch::new();
    d.drop_window(a);
    commit(&store, d).await;
    let crashed = tempfile::tempdir().expect("tempdir");
    super::tests::copy_dir(dir.path(), crashed.path());

    kv.sync().expect("apply the drop");
    assert!(!dir.path().join("windows").join(a.to_string()).exists());
    let wanted_events = refs(&[&old, &early, &late, &early, &late, &early]);
    for s in [meta.keys(), main_only] {
        assert_eq!(listed(&store, s)[..2], [old.clone(), early.clone()]);
        assert!(store.idempotency(s, "k2").expect("read").is_some());
    }
    assert_eq!(event_turns(&store, meta.keys()), wanted_events);
    drop(store);
    kv.close().expect("close");
    drop(kv);

    let (kv, replayed) = LoggedKv::open(crashed.path(), manual()).expect("reopen");
    assert_eq!(replayed.records, 2, "the event and the drop");
    assert!(!crashed.path().join("windows").join(a.to_string()).exists());
    let store = Store::new(Arc::new(kv));
    assert_eq!(listed(&store, meta.keys()), all);
    assert_eq!(event_turns(&store, meta.keys()), wanted_events);
    assert_eq!(listed(&store, main_only), [old.clone(), early.clone()]);
    assert_eq!(
        store.list_entry(meta.keys(), 2).expect("read").as_ref(),
        Some(&early),
        "moved to the main database by the drop"
    );
    // A delete not yet applied hides the entry in its window.
    let mut del = Batch::new();
    del.delete(crate::keys::session_turn_of("s", 3, &late));
    commit(&store, del).await;
    assert_eq!(store.list_entry(meta.keys(), 3).expect("read"), None);
}

/// Event values of turns of two windows taken in one round are written as one value,
/// routed by the newest turn: in the newer window, where a read of the session finds
/// every event, and where `store.check` finds it routed as a value must be.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_of_event_values_goes_to_its_newest_turns_window() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (kv, store, list) = with_windows(dir.path(), 2).await;
    let (a, b) = (list[0].start_ms, list[1].start_ms);
    let (early, late) = (turn_at(a, 1), turn_at(b, 2));
    let mut meta = SessionMeta::new("s");
    commit(&store, admission(&mut meta, 1, &early)).await;
    commit(&store, admission(&mut meta, 2, &late)).await;
    kv.sync().expect("apply");
    let event_keys = |start: u64| -> Vec<u64> {
        let w = kv.inner_window(start).expect("window open");
        w.with(|h| {
            Ok(h.db
                .range(crate::keys::event("s", 0)..crate::keys::event_end("s"))
                .keys()
                .map(|k| crate::keys::seq_suffix(&k.expect("key")).expect("seq"))
                .collect())
        })
        .expect("read")
    };
    assert_eq!(event_keys(a), Vec::<u64>::new());
    assert_eq!(event_keys(b), vec![2]);
    assert_eq!(
        event_turns(&store, meta.keys()),
        [early.clone(), late.clone()]
    );
    let violations = crate::check::check_store(&store).expect("check");
    assert!(
        !violations
            .iter()
            .any(|v| v.invariant == "event_value_misrouted"),
        "{violations:?}"
    );
}

/// A read that took its sources (the overlay's range and the windows to read) just
/// before a window among them was dropped is made again: the drop moved the window's
/// keys to the main database and closed it, so a read of it fails, and the read made
/// again finds them in the main database. Both kinds of read: a session's list and
/// the one entry at a seq.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_that_meets_a_window_dropped_meanwhile_is_made_again() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (kv, store, list) = with_windows(dir.path(), 3).await;
    let (a, b) = (list[0].start_ms, list[1].start_ms);
    let (x, y) = (turn_at(a, 1), turn_at(b, 2));
    let mut meta = SessionMeta::new("s");
    commit(&store, admission(&mut meta, 1, &x)).await;
    commit(&store, admission(&mut meta, 2, &y)).await;
    kv.sync().expect("apply");

    // Each drop is committed now and applied by the next read, between its sources
    // and its reading them.
    let drop_during_next_read = |start: u64| {
        let (store, kv) = (store.clone(), kv.clone());
        async move {
            let mut d = Batch::new();
            d.drop_window(start);
            commit(&store, d).await;
            let applier = kv.clone();
            kv.after_sources(move || applier.sync().expect("apply the drop"));
        }
    };
    let gone = |start: u64| !dir.path().join("windows").join(start.to_string()).exists();
    drop_during_next_read(a).await;
    assert_eq!(listed(&store, meta.keys()), [x.clone(), y.clone()]);
    assert!(gone(a), "the read applied the drop");
    drop_during_next_read(b).await;
    assert_eq!(
        store.list_entry(meta.keys(), 2).expect("read").as_ref(),
        Some(&y)
    );
    assert!(gone(b), "the read applied the drop");
    assert!(kv.commit_stats().window_leftovers > 0, "moved, not deleted");
}

/// A window's drop passes on to the main database only what belongs to turns still
/// stored: a folded record left in it (a turn that ended after retention judged it
/// empty) with its list entry, its idempotency key and its session's event values,
/// and likewise the keys of an unfinished turn minted in it (admitted late).
/// The list entries, event values and idempotency keys of turns whose records are
/// gone (retention leaves them to the drop) go with the window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drop_passes_on_only_what_belongs_to_stored_turns() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (kv, store, list) = with_windows(dir.path(), 2).await;
    let a = list[0].start_ms;
    let (gone, late) = (turn_at(a, 1), turn_at(a, 2));
    let mut g = SessionMeta::new("g");
    commit(&store, admission(&mut g, 1, &gone)).await;
    let mut del = Batch::new();
    del.delete(crate::keys::finished(&gone));
    commit(&store, del).await;
    let mut s = SessionMeta::new("s");
    commit(&store, admission(&mut s, 1, &late)).await;
    // An unfinished turn minted in the window, admitted after retention found none
    // there: its record is in the main database, its other keys in the window.
    let open = turn_at(a, 3);
    let mut u = SessionMeta::new("u");
    let mut b = admission(&mut u, 1, &open);
    b.ops
        .retain(|op| !matches!(op, crate::KvOp::Put(k, _) if k[0] == b'F'));
    let input = RawJson::from_value(&json!(null));
    let mut rec = TurnRecord::admitted(open.clone(), "u", 1, "f", input, 0);
    rec.idempotency_key = Some("k1".into());
    b.put_turn(&rec);
    commit(&store, b).await;
    kv.sync().expect("apply");
    let mut d = Batch::new();
    d.drop_window(a);
    commit(&store, d).await;
    kv.sync().expect("apply the drop");
    assert!(!dir.path().join("windows").join(a.to_string()).exists());

    let main = kv.main_keys();
    let of = |sid: &str| {
        main.iter()
            .filter(|k| {
                matches!(k.first(), Some(b'L' | b'E' | b'K'))
                    && k.get(1..=sid.len()) == Some(sid.as_bytes())
                    && k.get(sid.len() + 1) == Some(&0)
            })
            .count()
    };
    assert!(
        main.contains(&crate::keys::finished(&late)),
        "the stored turn's record"
    );
    assert_eq!(
        of("s"),
        3,
        "its list entry, event value and idempotency key"
    );
    assert_eq!(of("g"), 0, "nothing of the deleted turn");
    assert_eq!(
        of("u"),
        3,
        "the unfinished turn's list entry, event value and key"
    );
    assert_eq!(kv.commit_stats().window_leftovers, 7);
    assert_eq!(listed(&store, u.keys()), std::slice::from_ref(&open));
    assert_eq!(listed(&store, s.keys()), std::slice::from_ref(&late));
    assert_eq!(event_turns(&store, s.keys()), std::slice::from_ref(&late));
}

/// A finished turn's record in a window is kept in the window's value file, and sled
/// holds a pointer to it: read back whole, also after a restart; moved to the main
/// database as the value itself when its window is dropped while it is stored
/// (also by a replay of the drop after a crash); and a changed byte of the file
/// is a `Corrupt` read, never a wrong turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_windows_large_values_live_in_its_value_file_behind_pointers() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (kv, store, list) = with_windows(dir.path(), 2).await;
    let a = list[0].start_ms;
    let big = turn_at(a, 1);
    // Text LZ4 cannot shrink below the value file's threshold.
    let text: String = (0..3000u32)
        .map(|i| char::from(b'a' + (i.wrapping_mul(2_654_435_761) >> 27) as u8 % 26))
        .collect();
    let mut meta = SessionMeta::new("s");
    let mut t = TurnRecord::admitted(
        big.clone(),
        "s",
        1,
        "f",
        RawJson::from_value(&json!(text)),
        0,
    );
    t.idempotency_key = Some("k1".into());
    let mut b = admission(&mut meta, 1, &big);
    b.put_finished(&crate::FoldedTurn::new(&t, Vec::new()), false);
    commit(&store, b).await;
    kv.sync().expect("apply");

    let raw = |kv: &LoggedKv, start: u64| {
        kv.inner_window(start)
            .expect("window open")
            .with(|h| {
                Ok(h.db
                    .get(crate::keys::finished(&big))
                    .expect("get")
                    .map(|v| v.to_vec()))
            })
            .expect("read")
    };
    let stored = raw(&kv, a).expect("the record is in its window");
    assert!(
        crate::sled::values::is_pointer(&stored),
        "{} bytes",
        stored.len()
    );
    let values_file = dir
        .path()
        .join("windows")
        .join(a.to_string())
        .join(crate::sled::values::FILE_NAME);
    let file_len = std::fs::metadata(&values_file).expect("value file").len();
    assert!(
        file_len >= crate::sled::values::OUT_FROM as u64,
        "{file_len} bytes"
    );
    let input_of = |store: &Store| {
        store
            .finished(&big)
            .expect("read")
            .expect("stored")
            .turn
            .input
    };
    assert_eq!(input_of(&store), t.input);
    let (fs, fe) = crate::keys::finished_range();
    let scanned = kv.scan(&fs, &fe, false, usize::MAX).expect("scan");
    let hit = scanned
        .iter()
        .find(|(k, _)| k.as_slice() == crate::keys::finished(&big).as_slice())
        .expect("scanned");
    assert!(
        String::from_utf8_lossy(&hit.1).contains(&text),
        "a scan reads the value"
    );

    // The window dropped: the record goes to the main database whole.
    let mut d = Batch::new();
    d.drop_window(a);
    commit(&store, d).await;
    let crashed = tempfile::tempdir().expect("tempdir");
    super::tests::copy_dir(dir.path(), crashed.path());
    let corrupt = tempfile::tempdir().expect("tempdir");
    super::tests::copy_dir(dir.path(), corrupt.path());
    kv.sync().expect("apply the drop");
    assert!(!values_file.exists());
    assert_eq!(input_of(&store), t.input);
    drop(store);
    kv.close().expect("close");
    drop(kv);

    let (kv, replayed) = LoggedKv::open(crashed.path(), manual()).expect("reopen");
    assert_eq!(replayed.records, 1, "the drop");
    let store = Store::new(Arc::new(kv));
    assert_eq!(input_of(&store), t.input);
    drop(store);

    // A copy taken before the drop, with one byte of the value file changed: the
    // drop's replay reads the record to move it and fails; nothing is made up.
    let bad = corrupt
        .path()
        .join("windows")
        .join(a.to_string())
        .join(crate::sled::values::FILE_NAME);
    let mut bytes = std::fs::read(&bad).expect("read");
    bytes[10] ^= 0x20;
    std::fs::write(&bad, &bytes).expect("write");
    let opened = LoggedKv::open(corrupt.path(), manual());
    assert!(
        matches!(opened, Err(crate::StoreError::Corrupt(_))),
        "{:?}",
        opened.err()
    );
}

/// A window no read or write used for `window_close_after` is parked (its sled
/// closed) once it was opened again after its last write; never the newest. A read
/// of one of its turns opens it again, and so does a write to it (a turn that ends
/// late in it); a start leaves it parked, its turns read back after the restart,
/// and its drop, while parked, moves its records to the main database as any drop
/// does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn windows_unused_for_a_while_are_parked_and_opened_again_by_use() {
    let dir = tempfile::tempdir().expect("tempdir");
    let opts = LoggedOptions {
        idle_reopen: Duration::from_millis(1),
        window_close_after: Some(Duration::from_millis(30)),
        ..manual()
    };
    let (kv, store, list) = with_windows_as(dir.path(), 2, opts).await;
    let a = list[0].start_ms;
    let (x, y) = (turn_at(a, 1), turn_at(a, 2));
    let mut meta = SessionMeta::new("s");
    commit(&store, admission(&mut meta, 1, &x)).await;
    kv.sync().expect("apply");
    let parked = |kv: &LoggedKv, start: u64| kv.inner_window(start).expect("open").is_parked();
    let unused_then_round = |kv: &LoggedKv| {
        std::thread::sleep(Duration::from_millis(40));
        kv.sync().expect("round");
    };
    unused_then_round(&kv);
    assert!(parked(&kv, a), "unused for 40 ms");
    let newest = kv.windows().expect("windows").last().expect("one").start_ms;
    assert!(!parked(&kv, newest), "the newest window takes writes");
    let stats = kv.commit_stats();
    assert!(stats.windows_closed >= 1, "{stats:?}");
    // (A slow machine may have parked it already while the windows were made, and
    // the write of `x` opened it again.)
    let reopens = stats.window_reopens;

    // A read opens it again.
    assert!(store.finished(&x).expect("read").is_some());
    assert!(!parked(&kv, a));
    assert_eq!(kv.commit_stats().window_reopens, reopens + 1);
    assert_eq!(listed(&store, meta.keys()), std::slice::from_ref(&x));

    // Parked again (a read leaves its snapshot as it is), then a write to it.
    unused_then_round(&kv);
    assert!(parked(&kv, a));
    commit(&store, admission(&mut meta, 2, &y)).await;
    kv.sync().expect("apply to the parked window");
    assert!(!parked(&kv, a), "opened again by the write");
    assert!(kv.commit_stats().window_reopens >= reopens + 2);
    assert_eq!(listed(&store, meta.keys()), [x.clone(), y.clone()]);
    drop(store);
    kv.close().expect("close");
    drop(kv);

    let (kv, _) = LoggedKv::open(dir.path(), opts).expect("reopen");
    let kv = Arc::new(kv);
    let store = Store::new(kv.clone());
    // A start leaves every window but the newest parked, for its first use to open.
    assert!(parked(&kv, a), "left parked by the start");
    let newest = kv.windows().expect("windows").last().expect("one").start_ms;
    assert!(!parked(&kv, newest), "the newest is opened at start");
    assert_eq!(listed(&store, meta.keys()), [x.clone(), y.clone()]);
    assert!(!parked(&kv, a), "opened by the read");
    unused_then_round(&kv);
    unused_then_round(&kv);
    assert!(parked(&kv, a));
    let mut d = Batch::new();
    d.drop_window(a);
    commit(&store, d).await;
    kv.sync().expect("apply the drop");
    assert!(!dir.path().join("windows").join(a.to_string()).exists());
    for id in [&x, &y] {
        assert!(store.finished(id).expect("read").is_some(), "{id}");
    }
    assert_eq!(listed(&store, meta.keys()), [x.clone(), y.clone()]);
}
