//! Retention on the in-memory store: sweeps, forgetting, window drops.

use super::drops::MINT_MARGIN_MS;
use super::*;
use crate::config::EngineConfig;
use serde_json::json;
use std::collections::HashMap;
use turnd_proto::EventKind;
use turnd_proto::{ListArgs, SubmitArgs, TurnStatus};
use turnd_store::Batch;
use turnd_store::Kv;

fn submit(session: &str, key: Option<&str>) -> SubmitArgs {
    SubmitArgs {
        session_id: session.into(),
        function_id: "f".into(),
        input: json!({"n": 1}),
        idempotency_key: key.map(str::to_string),
        turn_timeout_ms: None,
        on_busy: None,
    }
}

async fn engine(terminal_ms: u64) -> Engine {
    engine_on(Arc::new(turnd_store::mem::MemKv::new()), terminal_ms).await
}

/// An engine on `kv` keeping terminal turns `terminal_ms`, whose sweeps run only when
/// a test calls them.
async fn engine_on(kv: Arc<dyn Kv>, terminal_ms: u64) -> Engine {
    let cfg = EngineConfig {
        retention_terminal_ms: terminal_ms,
        retention_sweep_interval_ms: 3_600_000,
        ..EngineConfig::default()
    };
    Engine::open(Store::new(kv), cfg).await.expect("open")
}

/// The window length of [`windowed`]; the test sleeps between its windows by the
/// wall clock, so it is long enough for a loaded machine to write a turn in one.
const WINDOW_MS: u64 = 100;

/// An engine keeping turns 10 s on an in-memory store with [`WINDOW_MS`] windows.
async fn windowed() -> (Arc<turnd_store::mem::MemKv>, Engine) {
    windowed_by(WINDOW_MS).await
}

/// [`windowed`] with windows of `window_ms`.
async fn windowed_by(window_ms: u64) -> (Arc<turnd_store::mem::MemKv>, Engine) {
    let kv = Arc::new(turnd_store::mem::MemKv::with_windows(
        turnd_store::WindowOptions {
            window_ms,
            window_bytes: u64::MAX,
        },
    ));
    let e = engine_on(kv.clone(), 10_000).await;
    (kv, e)
}

/// The first window, made by a turn of session `p` that ends at once (stopped while
/// queued, before there is a worker), and then the worker.
async fn first_window(e: &Engine) -> (tokio::sync::mpsc::Receiver<String>, crate::Caller) {
    let first = e.submit(submit("p", None)).await.expect("submit").turn;
    e.stop_turn(&first.turn_id, None).await.expect("stop");
    worker(e).await
}

/// Sleep by the wall clock (which switches the windows).
fn wall(ms: u64) {
    std::thread::sleep(Duration::from_millis(ms));
}

/// The store's invariants hold.
fn checked(e: &Engine) {
    let found = turnd_store::check_store(&e.inner.store).expect("check");
    assert!(found.is_empty(), "{found:?}");
}

/// The start of the window a turn id falls in (None: minted before the first).
fn window_of(windows: &[turnd_store::WindowInfo], turn_id: &str) -> Option<u64> {
    let ms = turnd_store::windows::turn_ms(turn_id).expect("minted");
    windows
        .iter()
        .rev()
        .find(|w| w.start_ms <= ms)
        .map(|w| w.start_ms)
}

/// Time windows of finished turns: a window is dropped whole once every turn
/// minted in it is gone, never while one of its turns is unfinished, and never
/// the newest one.
#[tokio::test(start_paused = true)]
async fn a_window_is_dropped_once_all_its_turns_are_gone() {
    let (kv, e) = windowed().await;
    // A window is made when a turn is admitted or finished and the newest is older
    // than WINDOW_MS, starting after every turn id minted so far: the first turn
    // admitted after each sleep is the last of the older window.
    let mut ids = Vec::new();
    for sid in ["s0", "s1", "s2", "s3", "s4"] {
        let id = e
            .submit(submit(sid, None))
            .await
            .expect("submit")
            .turn
            .turn_id;
        if sid != "s2" {
            e.stop_turn(&id, None).await.expect("stop");
        }
        ids.push(id);
        if sid != "s2" {
            wall(WINDOW_MS + WINDOW_MS / 2);
        }
    }
    let starts: Vec<u64> = kv
        .windows()
        .expect("windows")
        .iter()
        .map(|w| w.start_ms)
        .collect();
    assert_eq!(starts.len(), 4, "{starts:?}");
    let window_of = |id: &str| {
        let ms = turnd_store::windows::turn_ms(id).expect("minted");
        starts.iter().rev().find(|s| **s <= ms).copied()
    };
    assert_eq!(window_of(&ids[0]), None, "minted before the first window");
    let (w_b, w_c, w_z) = (
        window_of(&ids[1]).expect("b"),
        window_of(&ids[2]).expect("c"),
        window_of(&ids[4]).expect("z"),
    );
    // s3 is admitted right after s2, which opened the next window: it falls in
    // either, by whether the wall clock's millisecond turned in between.
    let w_s3 = window_of(&ids[3]).expect("s3");
    assert!(w_s3 == w_c || w_s3 == w_z, "{starts:?} {w_s3}");
    assert!(w_b < w_c && w_c < w_z && w_z < starts[3], "{starts:?}");
    tokio::time::advance(Duration::from_millis(10_001)).await;
    wall(MINT_MARGIN_MS + 50);
    assert_eq!(e.sweep().await.expect("sweep"), 4);
    let state = |start: u64| {
        kv.windows()
            .expect("windows")
            .into_iter()
            .find(|w| w.start_ms == start)
            .map(|w| w.dropped)
    };
    assert_eq!(state(w_b), Some(true), "every turn of it is gone");
    assert_eq!(state(w_z), Some(true));
    assert_eq!(state(w_c), Some(false), "one of its turns is unfinished");
    assert!(e.get_turn(&ids[1]).await.is_err());
    e.stop_turn(&ids[2], None).await.expect("stop");
    tokio::time::advance(Duration::from_millis(10_001)).await;
    assert_eq!(e.sweep().await.expect("sweep"), 1);
    assert_eq!(state(w_c), Some(true));
    let newest = kv.windows().expect("windows").pop().expect("newest");
    assert!(!newest.dropped, "the newest window takes new turns");
    assert_eq!(
        e.inner
            .counters
            .windows_dropped
            .load(std::sync::atomic::Ordering::Relaxed),
        3
    );
}

/// A sweep's time is counted, and so is the time it held back while the store was
/// behind: up to [`HOLD_BACK_MAX`] for each session it deletes from, after which it
/// deletes anyway. A store that is not behind holds nothing back.
#[tokio::test(start_paused = true)]
async fn a_sweep_counts_its_time_and_the_time_it_held_back_for_a_busy_store() {
    use std::sync::atomic::Ordering;
    let (kv, faults) = turnd_store::faulty::FaultyKv::new(Arc::new(turnd_store::mem::MemKv::new()));
    let e = engine_on(Arc::new(kv), 10_000).await;
    for s in ["a", "b"] {
        let t = e.submit(submit(s, None)).await.expect("submit");
        e.stop_turn(&t.turn.turn_id, None).await.expect("stop");
    }
    tokio::time::advance(Duration::from_millis(10_001)).await;
    let counted = crate::metrics::Counters::get;
    faults.busy.store(true, Ordering::SeqCst);
    assert_eq!(e.sweep().await.expect("sweep"), 2, "it deletes anyway");
    let held = counted(&e.inner.counters.retention_held_back_micros);
    let swept = counted(&e.inner.counters.retention_sweep_micros);
    let most = HOLD_BACK_MAX.as_micros() as u64;
    assert!(
        (2 * most..2 * most + 10_000).contains(&held),
        "held back {held} µs for two sessions"
    );
    assert!(swept >= held, "the sweep's time {swept} µs holds its waits");

    faults.busy.store(false, Ordering::SeqCst);
    for s in ["c", "d"] {
        let t = e.submit(submit(s, None)).await.expect("submit");
        e.stop_turn(&t.turn.turn_id, None).await.expect("stop");
    }
    tokio::time::advance(Duration::from_millis(10_001)).await;
    assert_eq!(e.sweep().await.expect("sweep"), 2);
    assert_eq!(counted(&e.inner.counters.retention_held_back_micros), held);
}

/// Turns stopped while queued end at once, with no worker: terminal turns to
/// expire. Everything of an expired turn goes, the unfinished one stays, and a
/// session with no turns left is forgotten.
#[tokio::test(start_paused = true)]
async fn a_sweep_deletes_expired_turns_and_forgets_empty_sessions() {
    let e = engine(10_000).await;
    let old = e.submit(submit("s", Some("k1"))).await.expect("submit");
    let gone = e.submit(submit("gone", None)).await.expect("submit");
    e.stop_turn(&old.turn.turn_id, None).await.expect("stop");
    e.stop_turn(&gone.turn.turn_id, None).await.expect("stop");
    let kept = e.submit(submit("s", None)).await.expect("submit");
    assert_eq!(
        e.sweep().await.expect("sweep"),
        0,
        "nothing is old enough yet"
    );
    tokio::time::advance(Duration::from_millis(10_001)).await;
    assert_eq!(e.sweep().await.expect("sweep"), 2);

    let store = &e.inner.store;
    assert!(store.turn(&old.turn.turn_id).expect("read").is_none());
    let meta = store.session_meta("s").expect("read").expect("meta");
    assert!(store
        .idempotency(meta.keys(), "k1")
        .expect("read")
        .is_none());
    let listed = e
        .list_turns(ListArgs {
            session_id: "s".into(),
            status: None,
            limit: None,
            before_seq: None,
        })
        .await
        .expect("list");
    let ids: Vec<&str> = listed.turns.iter().map(|t| t.turn_id.as_str()).collect();
    assert_eq!(ids, vec![kept.turn.turn_id.as_str()]);
    assert_eq!(listed.turns[0].status, TurnStatus::Queued);
    let s = e.inspect("s").await.expect("inspect");
    assert_eq!((s.turns.cancelled, s.turns.queued), (0, 1));
    let events = store.events(meta.keys(), 0, usize::MAX).expect("events");
    assert!(
        events.iter().all(|ev| ev.turn_id == kept.turn.turn_id),
        "{events:?}"
    );
    assert!(!events.is_empty());

    // The session with nothing left is forgotten, in the store and in memory.
    assert!(store.session_meta("gone").expect("read").is_none());
    assert!(e.sessions().existing("gone").is_none());
    assert!(e.inspect("gone").await.is_err());
    // Its id and the freed key can be used again.
    let again = e.submit(submit("gone", None)).await.expect("submit");
    assert_eq!(again.turn.seq, 1);
    let reused = e.submit(submit("s", Some("k1"))).await.expect("submit");
    assert!(!reused.deduplicated);
    assert_ne!(reused.turn.turn_id, old.turn.turn_id);
}

/// A worker `w` serving `f` one invocation at a time, attached to `e`: its pushes,
/// and who it is when it answers.
async fn worker(e: &Engine) -> (tokio::sync::mpsc::Receiver<String>, crate::Caller) {
    use crate::{Caller, Outbox};
    use turnd_proto::{Delivery, HelloArgs, RegisterArgs, Role};
    let (ob, rx) = Outbox::new("c1".into(), 1024);
    let hello = HelloArgs {
        protocol: 1,
        role: Role::Worker,
        token: None,
        name: None,
        worker_id: Some("w".into()),
        instance_id: Some("i1".into()),
        inflight: vec![],
        finished: vec![],
    };
    e.worker_hello(&hello, ob).await.expect("hello");
    let reg = RegisterArgs {
        function_id: "f".into(),
        concurrency: Some(1),
        timeout_ms: None,
        delivery: Some(Delivery::AtLeastOnce),
        max_attempts: None,
    };
    e.register("w", &reg).expect("register");
    let caller = Caller {
        role: Role::Worker,
        worker_id: Some("w".into()),
    };
    (rx, caller)
}

/// The invocation id of the next `invoke` pushed to the worker.
async fn next_invocation(rx: &mut tokio::sync::mpsc::Receiver<String>) -> String {
    for _ in 0..100 {
        tokio::task::yield_now().await;
        while let Ok(f) = rx.try_recv() {
            let v: serde_json::Value = serde_json::from_str(&f).expect("JSON");
            if v["push"] == "invoke" {
                if let Some(id) = v["invocation_id"].as_str() {
                    return id.to_string();
                }
            }
        }
    }
    panic!("no turn was dispatched");
}

/// Complete the invocation with `output`.
async fn complete(e: &Engine, worker: &crate::Caller, invocation_id: String, output: u64) {
    use turnd_proto::{Outcome, ResultArgs};
    e.result(
        worker,
        ResultArgs {
            invocation_id,
            outcome: Outcome::Complete(json!({"i": output})),
        },
    )
    .await
    .expect("result");
}

/// Every delete a sweep plans is of a key that is there: a finished turn's own
/// record, its input stored apart and the invocations folded into its record went
/// when it was folded, and deleting them again would only load the commit log, the
/// overlay and the applier.
#[tokio::test(start_paused = true)]
async fn a_sweep_deletes_only_keys_that_are_there() {
    let e = engine(10_000).await;
    let (mut rx, worker) = worker(&e).await;
    // Three turns run to completion (each with an invocation folded into its
    // record), one with an idempotency key, and one cancelled while queued.
    for i in 0..3 {
        let key = (i == 1).then_some("k");
        e.submit(submit("s", key)).await.expect("submit");
        let invocation_id = next_invocation(&mut rx).await;
        complete(&e, &worker, invocation_id, i).await;
    }
    let blocker = e.submit(submit("s", None)).await.expect("submit");
    let queued = e.submit(submit("s", None)).await.expect("submit");
    e.stop_turn(&queued.turn.turn_id, None).await.expect("stop");
    tokio::time::advance(Duration::from_millis(10_001)).await;

    let store = &e.inner.store;
    let cutoff = e.now_ms() - 10_000;
    let (by_session, _) = gather(store, Store::FIRST.to_vec(), cutoff).expect("gather");
    let expired = by_session
        .into_values()
        .next()
        .expect("the session's turns");
    assert_eq!(expired.len(), 4, "three completed and one cancelled");
    let meta = store.session_meta("s").expect("meta").expect("meta");
    let at = Planned {
        counts: meta.counts.clone(),
        active_from: meta.active_from,
        open: Arc::new(Open::read(store).expect("windows")),
        early: Arc::new(early_invocations(store, cutoff).expect("invocations")),
    };
    let planned = plan(store, meta.keys(), expired, cutoff, &at).expect("plan");
    let kv = store.kv();
    let mut deletes = 0;
    for op in &planned.batch.ops {
        if let turnd_store::KvOp::Delete(k) = op {
            deletes += 1;
            assert!(
                kv.get(k).expect("read").is_some(),
                "a delete of a key that is not there: {}",
                String::from_utf8_lossy(k)
            );
        }
    }
    assert!(
        deletes >= 4 * 2,
        "each turn's record and list entry at least"
    );
    // And the sweep itself leaves the unfinished turn and nothing of the others.
    assert_eq!(e.sweep().await.expect("sweep"), 4);
    assert!(store.turn(&blocker.turn.turn_id).expect("read").is_some());
}

/// A session's list entries, events and idempotency keys are in the windows of
/// their turns, an event value in its newest turn's: when a turn ends and hands the
/// session to the next one in the same transition, the value of both is in the next
/// one's window. Dropping the first turn's window once it expired leaves nothing
/// behind (nothing is moved to the main database) and takes nothing of the turn that
/// remains; the store's invariants hold throughout, routes included.
#[tokio::test(start_paused = true)]
async fn a_window_drop_takes_only_what_belongs_to_its_deleted_turns() {
    let (kv, e) = windowed().await;
    // The first window, made by a turn that ends at once (stopped while queued, before
    // there is a worker).
    let (mut rx, worker) = first_window(&e).await;
    wall(WINDOW_MS + WINDOW_MS / 2);
    let x = e
        .submit(submit("s", Some("kx")))
        .await
        .expect("submit")
        .turn;
    let x_inv = next_invocation(&mut rx).await;
    wall(WINDOW_MS + WINDOW_MS / 2);
    let y = e
        .submit(submit("s", Some("ky")))
        .await
        .expect("submit")
        .turn;
    wall(WINDOW_MS + WINDOW_MS / 2);
    // Made by this admission: a window after both.
    e.submit(submit("q", None)).await.expect("submit");
    let windows = kv.windows().expect("windows");
    let window_of = |id: &str| window_of(&windows, id);
    let (w_x, w_y) = (window_of(&x.turn_id), window_of(&y.turn_id));
    assert!(w_x.is_some() && w_x < w_y, "{windows:?}");
    // X completes and Y is dispatched in the same transition.
    complete(&e, &worker, x_inv, 1).await;
    let y_inv = next_invocation(&mut rx).await;
    checked(&e);

    tokio::time::advance(Duration::from_millis(10_001)).await;
    wall(MINT_MARGIN_MS + 50);
    assert_eq!(e.sweep().await.expect("sweep"), 2, "X and the first turn");
    let dropped = |start: Option<u64>| {
        kv.windows()
            .expect("windows")
            .into_iter()
            .any(|w| Some(w.start_ms) == start && w.dropped)
    };
    assert!(dropped(w_x), "X's window goes with X");
    assert!(!dropped(w_y), "Y is unfinished");
    assert_eq!(kv.commit_stats().window_leftovers, 0);
    checked(&e);
    let events = |after| {
        e.events(turnd_proto::EventsArgs {
            session_id: "s".into(),
            after: Some(after),
            limit: None,
        })
    };
    let left = events(0).await.expect("events").events;
    assert!(left.iter().all(|ev| ev.turn_id == y.turn_id), "{left:?}");
    let kinds: Vec<_> = left.iter().map(|ev| ev.kind).collect();
    assert_eq!(
        kinds,
        [EventKind::Admitted, EventKind::Dispatched],
        "Y's events, the one written with X's included"
    );
    let meta = e
        .inner
        .store
        .session_meta("s")
        .expect("read")
        .expect("meta");
    let y_key = e.inner.store.idempotency(meta.keys(), "ky").expect("read");
    assert_eq!(y_key.map(|r| r.turn_id), Some(y.turn_id.clone()));

    // Y ends and expires: its window goes too, and the session is forgotten.
    complete(&e, &worker, y_inv, 2).await;
    tokio::time::advance(Duration::from_millis(10_001)).await;
    wall(MINT_MARGIN_MS + 50);
    assert_eq!(e.sweep().await.expect("sweep"), 1);
    assert!(dropped(w_y));
    assert_eq!(kv.commit_stats().window_leftovers, 0);
    assert!(e.inspect("s").await.is_err(), "forgotten");
    checked(&e);
}

/// Passes everything to a [`turnd_store::mem::MemKv`] and counts the reads of a
/// session's event values and the deletes of them, by whether the session was held
/// ([`Kv::hold_event_merges`]) then.
#[derive(Default)]
struct HoldWatch {
    inner: turnd_store::mem::MemKv,
    held: std::sync::Mutex<HashMap<String, u32>>,
    /// (held, not held) event reads and event deletes.
    reads: std::sync::Mutex<(u32, u32)>,
    deletes: std::sync::Mutex<(u32, u32)>,
}

impl HoldWatch {
    fn is_held(&self, key: &[u8]) -> bool {
        let sid = keys::session_of(key).unwrap_or_default();
        self.held
            .lock()
            .expect("lock")
            .get(&sid)
            .is_some_and(|n| *n > 0)
    }

    fn count(&self, which: &std::sync::Mutex<(u32, u32)>, key: &[u8]) {
        let held = self.is_held(key);
        let mut c = which.lock().expect("lock");
        if held {
            c.0 += 1;
        } else {
            c.1 += 1;
        }
    }
}

impl Kv for HoldWatch {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        self.inner.get(key)
    }
    fn scan(
        &self,
        start: &[u8],
        end: &[u8],
        reverse: bool,
        limit: usize,
    ) -> Result<Vec<turnd_store::Entry>, StoreError> {
        if start.first() == Some(&b'E') {
            self.count(&self.reads, start);
        }
        self.inner.scan(start, end, reverse, limit)
    }
    fn commit(&self, batch: Batch) -> turnd_store::CommitTicket {
        for op in &batch.ops {
            if let turnd_store::KvOp::Delete(k) = op {
                if k.first() == Some(&b'E') {
                    self.count(&self.deletes, k);
                }
            }
        }
        self.inner.commit(batch)
    }
    fn sync(&self) -> Result<(), StoreError> {
        self.inner.sync()
    }
    fn hold_event_merges(&self, session_id: &str) {
        *self
            .held
            .lock()
            .expect("lock")
            .entry(session_id.to_string())
            .or_insert(0) += 1;
    }
    fn release_event_merges(&self, session_id: &str) {
        if let Some(n) = self.held.lock().expect("lock").get_mut(session_id) {
            *n -= 1;
        }
    }
}

/// A sweep reads and writes a session's event values only while it holds the
/// store from writing several of them as one (which would move events to another
/// key between the sweep's reads and its writes), and lets go when it is done.
#[tokio::test(start_paused = true)]
async fn a_sweep_reads_and_rewrites_event_values_only_while_it_holds_the_session() {
    let kv = Arc::new(HoldWatch::default());
    let e = engine_on(kv.clone(), 10_000).await;
    let old = e.submit(submit("s", None)).await.expect("submit");
    e.stop_turn(&old.turn.turn_id, None).await.expect("stop");
    let _kept = e.submit(submit("s", None)).await.expect("submit");
    let gone = e.submit(submit("gone", None)).await.expect("submit");
    e.stop_turn(&gone.turn.turn_id, None).await.expect("stop");
    *kv.reads.lock().expect("lock") = (0, 0);
    tokio::time::advance(Duration::from_millis(10_001)).await;
    assert_eq!(e.sweep().await.expect("sweep"), 2);
    let (held_reads, free_reads) = *kv.reads.lock().expect("lock");
    let (held_deletes, free_deletes) = *kv.deletes.lock().expect("lock");
    assert!(
        held_reads > 0 && held_deletes > 0,
        "{held_reads} {held_deletes}"
    );
    assert_eq!((free_reads, free_deletes), (0, 0));
    assert!(
        kv.held.lock().expect("lock").values().all(|n| *n == 0),
        "every hold let go"
    );
}

/// The turn ids `turn.list` shows for a session, oldest first.
async fn listed(e: &Engine, session: &str) -> Vec<String> {
    let page = e
        .list_turns(ListArgs {
            session_id: session.into(),
            status: None,
            limit: None,
            before_seq: None,
        })
        .await
        .expect("list");
    page.turns.into_iter().rev().map(|t| t.turn_id).collect()
}

/// The turn ids of the events `session.events` shows for a session.
async fn event_turns(e: &Engine, session: &str) -> Vec<String> {
    let page = e
        .events(turnd_proto::EventsArgs {
            session_id: session.into(),
            after: None,
            limit: None,
        })
        .await
        .expect("events");
    page.events.into_iter().map(|ev| ev.turn_id).collect()
}

/// The turn list entries of a session as stored (whatever the turns).
fn stored_entries(kv: &turnd_store::mem::MemKv, session: &str) -> Vec<String> {
    let (s, e) = (
        keys::session_turn(session, 0),
        keys::session_turn(session, u64::MAX),
    );
    kv.scan(&s, &e, false, usize::MAX)
        .expect("scan")
        .into_iter()
        .map(|(_, v)| String::from_utf8(v).expect("id"))
        .collect()
}

/// An expired turn whose keys are in an open time window loses its record at the
/// sweep; its turn list entry and event values are left to the window's drop, and
/// reads pass over them from the sweep on (`turn.list`, `session.events`, the store's
/// invariants). The drop takes them; a session forgotten before deletes them all.
#[tokio::test(start_paused = true)]
async fn an_expired_turns_entry_and_events_are_left_to_its_window_and_hidden() {
    // Windows long enough for A and B to be minted in one on a loaded machine.
    const LONG_MS: u64 = 1_000;
    let (kv, e) = windowed_by(LONG_MS).await;
    // The first window, made by a turn minted before it; A and B are minted in it
    // (a window is made when a turn is admitted and the newest is older than
    // WINDOW_MS).
    let (mut rx, worker) = first_window(&e).await;
    // The window starts a millisecond after the admission that made it.
    wall(5);
    // A ends; B, after it in the same window, is still running at the sweep.
    let a = e.submit(submit("s", None)).await.expect("submit").turn;
    let a_inv = next_invocation(&mut rx).await;
    complete(&e, &worker, a_inv, 1).await;
    let b = e.submit(submit("s", None)).await.expect("submit").turn;
    let b_inv = next_invocation(&mut rx).await;
    wall(LONG_MS + LONG_MS / 2);
    // Makes the next window (Q is minted in the first, and stays unfinished).
    e.submit(submit("q", None)).await.expect("submit");
    let windows = kv.windows().expect("windows");
    let window_of = |id: &str| window_of(&windows, id);
    assert!(window_of(&a.turn_id).is_some(), "{windows:?}");
    assert_eq!(window_of(&a.turn_id), window_of(&b.turn_id), "{windows:?}");
    assert!(windows.len() >= 2, "{windows:?}");
    tokio::time::advance(Duration::from_millis(10_001)).await;
    wall(MINT_MARGIN_MS + 50);
    let a_events = event_turns(&e, "s").await;
    assert!(a_events.contains(&a.turn_id), "{a_events:?}");

    assert_eq!(e.sweep().await.expect("sweep"), 2, "A and the first turn");
    assert!(e.inner.store.turn(&a.turn_id).expect("read").is_none());
    assert_eq!(
        stored_entries(&kv, "s"),
        [a.turn_id.clone(), b.turn_id.clone()],
        "A's entry is left to its window"
    );
    assert_eq!(listed(&e, "s").await, std::slice::from_ref(&b.turn_id));
    let shown = event_turns(&e, "s").await;
    assert!(
        !shown.is_empty() && shown.iter().all(|t| *t == b.turn_id),
        "{shown:?}"
    );
    let windows = kv.windows().expect("windows");
    assert!(
        windows.iter().all(|w| !w.dropped),
        "B holds the window: {windows:?}"
    );
    checked(&e);

    // B ends and expires: the session is forgotten, with every entry of its list,
    // while Q still holds the window.
    complete(&e, &worker, b_inv, 2).await;
    tokio::time::advance(Duration::from_millis(10_001)).await;
    assert_eq!(e.sweep().await.expect("sweep"), 1);
    assert!(e.inspect("s").await.is_err(), "forgotten");
    assert_eq!(stored_entries(&kv, "s"), Vec::<String>::new());
    assert!(kv.windows().expect("windows").iter().all(|w| !w.dropped));
    checked(&e);

    // Used again, the session starts from `seq` 1: that the reads above passed over
    // A's events (seq 1 on) does not hide the new turn's.
    let c = e.submit(submit("s", None)).await.expect("submit").turn;
    assert_eq!(c.seq, 1);
    let shown = event_turns(&e, "s").await;
    assert!(
        !shown.is_empty() && shown.iter().all(|t| *t == c.turn_id),
        "{shown:?}"
    );
}

/// An event value is stored in the window of the newest turn among its events, and
/// the store's applier writes consecutive values of a session as one (`runs.rs`); so
/// a value in the window of a turn that is gone can hold events of an older turn that
/// is still stored (it ran while the newer one was queued and cancelled, and ended
/// after it). Before the window is dropped, such a value is written again with the
/// older turn's events only: none of them is lost with the window.
#[tokio::test(start_paused = true)]
async fn a_window_drop_keeps_the_events_of_an_older_turn_still_stored() {
    let (kv, e) = windowed().await;
    let (mut rx, worker) = first_window(&e).await;
    wall(WINDOW_MS + WINDOW_MS / 2);
    // X runs in the first window; Y, queued behind it in the next, is cancelled.
    let x = e.submit(submit("s", None)).await.expect("submit").turn;
    let x_inv = next_invocation(&mut rx).await;
    wall(WINDOW_MS + WINDOW_MS / 2);
    let y = e.submit(submit("s", None)).await.expect("submit").turn;
    e.stop_turn(&y.turn_id, None).await.expect("stop");
    wall(WINDOW_MS + WINDOW_MS / 2);
    e.submit(submit("q", None)).await.expect("submit");
    let windows = kv.windows().expect("windows");
    let window_of = |id: &str| window_of(&windows, id);
    let (w_x, w_y) = (window_of(&x.turn_id), window_of(&y.turn_id));
    assert!(w_x.is_some() && w_x < w_y, "{windows:?}");

    // X's last value and Y's admission written as one value, as a round of the
    // applier merges them: routed by Y, in Y's window.
    let store = &e.inner.store;
    let meta = store.session_meta("s").expect("read").expect("meta");
    let (values, _) = store
        .event_values_page(meta.keys(), None, 64)
        .expect("values");
    let j = values
        .iter()
        .position(|(_, evs)| {
            evs.iter()
                .any(|ev| ev.turn_id == y.turn_id && ev.kind == EventKind::Admitted)
        })
        .expect("Y's admission");
    let (k1, v1) = values[j - 1].clone();
    let (k2, v2) = values[j].clone();
    assert!(v1.iter().all(|ev| ev.turn_id == x.turn_id), "{v1:?}");
    let seqs_of = |turn_id: &str| -> Vec<u64> {
        store
            .events(meta.keys(), 0, usize::MAX)
            .expect("events")
            .into_iter()
            .filter(|ev| ev.turn_id == turn_id)
            .map(|ev| ev.seq)
            .collect()
    };
    let x_events = seqs_of(&x.turn_id);
    let mut b = Batch::new();
    b.delete(k1);
    b.delete(k2);
    b.put_events(&[v1, v2].concat());
    store.commit(b).await.expect("commit");
    checked(&e);

    // X ends after Y; Y expires first, and its window with it.
    tokio::time::advance(Duration::from_millis(5_000)).await;
    complete(&e, &worker, x_inv, 1).await;
    tokio::time::advance(Duration::from_millis(5_500)).await;
    wall(MINT_MARGIN_MS + 50);
    assert_eq!(e.sweep().await.expect("sweep"), 2, "Y and the first turn");
    let dropped = kv
        .windows()
        .expect("windows")
        .into_iter()
        .any(|w| Some(w.start_ms) == w_y && w.dropped);
    assert!(dropped, "Y's window goes with Y");
    let kept = seqs_of(&x.turn_id);
    assert!(
        x_events.iter().all(|s| kept.contains(s)),
        "X's events before the drop {x_events:?}, after {kept:?}"
    );
    assert_eq!(listed(&e, "s").await, std::slice::from_ref(&x.turn_id));
    checked(&e);
}

/// A finished turn's last invocation is folded into its record; its earlier steps'
/// invocations stay under their own keys. A turn whose events are not read (left to
/// its window) still has them deleted with it, found by their ids' dispatch time.
#[tokio::test(start_paused = true)]
async fn an_expired_turns_earlier_invocations_go_with_it() {
    use turnd_proto::{Outcome, ResultArgs};
    // Kept 300 ms: the invocation ids' time is the wall clock's, which the test
    // moves past the cutoff as well as tokio's.
    const KEEP_MS: u64 = 300;
    let kv = Arc::new(turnd_store::mem::MemKv::with_windows(
        turnd_store::WindowOptions {
            window_ms: WINDOW_MS,
            window_bytes: u64::MAX,
        },
    ));
    let e = engine_on(kv.clone(), KEEP_MS).await;
    let (mut rx, worker) = first_window(&e).await;
    wall(WINDOW_MS + WINDOW_MS / 2);
    // Two steps: the first one's invocation continues the turn.
    let t = e.submit(submit("s", None)).await.expect("submit").turn;
    let step1 = next_invocation(&mut rx).await;
    e.result(
        &worker,
        ResultArgs {
            invocation_id: step1.clone(),
            outcome: Outcome::Continue(json!({"step": 1})),
        },
    )
    .await
    .expect("continue");
    let step2 = next_invocation(&mut rx).await;
    complete(&e, &worker, step2, 2).await;
    // The session goes on (a session left with no turn is forgotten, every event of
    // it read).
    e.submit(submit("s", None)).await.expect("submit");
    assert!(
        kv.get(&keys::invocation(&step1)).expect("read").is_some(),
        "the first step's invocation is under its own key"
    );
    assert!(window_of(&kv.windows().expect("windows"), &t.turn_id).is_some());

    wall(KEEP_MS + 50);
    tokio::time::advance(Duration::from_millis(KEEP_MS + 50)).await;
    assert_eq!(
        e.sweep().await.expect("sweep"),
        2,
        "the turn and the first one"
    );
    assert!(e.inner.store.turn(&t.turn_id).expect("read").is_none());
    let (is, ie) = keys::invocation_range();
    let left: Vec<String> = kv
        .scan(&is, &ie, false, usize::MAX)
        .expect("scan")
        .into_iter()
        .map(|(_, v)| {
            let inv: turnd_store::InvocationRecord = serde_json::from_slice(&v).expect("JSON");
            inv.turn_id
        })
        .collect();
    assert!(
        !left.contains(&t.turn_id),
        "an invocation record of the deleted turn is left: {left:?}"
    );
    assert_eq!(left.len(), 1, "the next turn's, running");
    checked(&e);
}

/// Passes everything to a [`turnd_store::mem::MemKv`]; while `watching`, holds each
/// read 2 ms and records the most reads in flight at once.
#[derive(Default)]
struct ReadGauge {
    inner: turnd_store::mem::MemKv,
    watching: std::sync::atomic::AtomicBool,
    now: std::sync::atomic::AtomicUsize,
    most: std::sync::atomic::AtomicUsize,
}

impl ReadGauge {
    fn read<T>(&self, f: impl FnOnce() -> T) -> T {
        use std::sync::atomic::Ordering::SeqCst;
        if !self.watching.load(SeqCst) {
            return f();
        }
        let n = self.now.fetch_add(1, SeqCst) + 1;
        self.most.fetch_max(n, SeqCst);
        std::thread::sleep(Duration::from_millis(2));
        let r = f();
        self.now.fetch_sub(1, SeqCst);
        r
    }
}

impl Kv for ReadGauge {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        self.read(|| self.inner.get(key))
    }
    fn scan(
        &self,
        start: &[u8],
        end: &[u8],
        reverse: bool,
        limit: usize,
    ) -> Result<Vec<turnd_store::Entry>, StoreError> {
        self.read(|| self.inner.scan(start, end, reverse, limit))
    }
    fn commit(&self, batch: Batch) -> turnd_store::CommitTicket {
        self.inner.commit(batch)
    }
    fn sync(&self) -> Result<(), StoreError> {
        self.inner.sync()
    }
}

/// A sweep reads the store at most [`READS_AT_ONCE`] reads at a time, however many
/// sessions it deletes from at once: a blocking thread per session's read once took
/// the cores from live work at full load.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sweeps_store_reads_run_a_few_at_a_time() {
    use std::sync::atomic::Ordering::SeqCst;
    let kv = Arc::new(ReadGauge::default());
    let e = engine_on(kv.clone(), 50).await;
    // Each session keeps a queued turn, so that none is forgotten (a forget reads
    // under the session's lock, on the runtime's own threads).
    for i in 0..16 {
        let sid = format!("s{i}");
        let t = e.submit(submit(&sid, None)).await.expect("submit");
        e.stop_turn(&t.turn.turn_id, None).await.expect("stop");
        e.submit(submit(&sid, None)).await.expect("submit");
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    kv.watching.store(true, SeqCst);
    assert_eq!(e.sweep().await.expect("sweep"), 16);
    kv.watching.store(false, SeqCst);
    let most = kv.most.load(SeqCst);
    assert!(
        (1..=READS_AT_ONCE).contains(&most),
        "{most} reads in flight at once"
    );
}

/// What a sweep checks before it deletes a session's expired turns: an event written
/// after the reads it planned from that is about one of those turns (a late result
/// amending it) makes it leave the session to the next sweep; events of other turns,
/// or written before, do not. The check reads the events' turn ids only, as stored.
#[tokio::test(start_paused = true)]
async fn a_sweep_leaves_a_session_whose_expired_turn_has_a_new_event() {
    let e = engine(10_000).await;
    let a = e.submit(submit("s", None)).await.expect("submit").turn;
    e.stop_turn(&a.turn_id, None).await.expect("stop");
    let store = &e.inner.store;
    let planned_at = store
        .session_meta("s")
        .expect("read")
        .expect("meta")
        .last_event_seq;
    let gone = HashSet::from([a.turn_id.clone()]);
    e.submit(submit("s", None)).await.expect("submit");
    let meta = store.session_meta("s").expect("read").expect("meta");
    assert!(meta.last_event_seq > planned_at);
    assert!(
        !touched(store, meta.keys(), planned_at, &gone).expect("read"),
        "only another turn's events since"
    );

    let amended = turnd_proto::Event {
        seq: meta.last_event_seq + 1,
        session_id: "s".into(),
        turn_id: a.turn_id.clone(),
        at_ms: 1,
        kind: EventKind::Amended,
        detail: json!({"output": {"late": true}}),
    };
    let mut b = Batch::new();
    b.put_events(std::slice::from_ref(&amended));
    store.commit(b).await.expect("commit");
    assert!(touched(store, meta.keys(), planned_at, &gone).expect("read"));
    assert!(
        !touched(store, meta.keys(), amended.seq, &gone).expect("read"),
        "nothing after the amendment"
    );
    let others = HashSet::from(["t_other".to_string()]);
    assert!(!touched(store, meta.keys(), planned_at, &others).expect("read"));
}
