//! Truthful terminal states under storage faults, and store.check.
//!
//! Each test starts the real daemon on the fault-injecting store and cuts one write:
//! a request whose write fails is answered `unavailable` and changes nothing; an
//! internal transition whose write fails shows `finalizing` (and `/readyz` fails) and
//! is retried until written, without running any step twice.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one scenario from its setup to its last assertion"
)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;
use turnd_client::{Caller, ClientError, FunctionSpec, Worker, WorkerHandle};
use turnd_proto::{ErrorCode, EventKind, Outcome, SubmitArgs, TurnStatus, WaitState};
use turnd_store::faulty::Faults;
use turnd_store::{keys, Batch, LoggedKv, LoggedOptions, Phase, Store, TurnRecord};
use turnd_tests::{eventually, wait_done, worker_options, Raw, TestDaemon};

const T: u64 = 15;

/// The status code of a GET on the admin listener.
async fn http_status(admin: &str, path: &str) -> anyhow::Result<u16> {
    Ok(turnd_tests::http_get(admin, path).await?.0)
}

/// An echo worker that counts its executions.
async fn counting_worker(url: &str, id: &str, runs: Arc<AtomicUsize>) -> WorkerHandle {
    let w = Worker::new(worker_options(url, id)).function(FunctionSpec::new("echo"), move |ctx| {
        let runs = runs.clone();
        async move {
            runs.fetch_add(1, Ordering::SeqCst);
            Outcome::Complete(ctx.invoke.input.clone())
        }
    });
    let h = w.spawn(CancellationToken::new());
    h.connected().await;
    h
}

fn faults(td: &TestDaemon) -> Arc<Faults> {
    td.faults.clone().expect("faulty daemon")
}

async fn kinds(c: &Caller, session: &str) -> anyhow::Result<Vec<EventKind>> {
    Ok(c.events(session, None, Some(1000))
        .await?
        .events
        .iter()
        .map(|e| e.kind)
        .collect())
}

async fn assert_clean(td: &TestDaemon) -> anyhow::Result<()> {
    let v = td.operator().await?.store_check().await?;
    assert!(v.is_empty(), "store.check found {v:?}");
    Ok(())
}

fn unavailable(e: ClientError) {
    assert_eq!(e.code(), Some(ErrorCode::Unavailable), "{e}");
    assert!(e.is_retryable());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admission_write_fails_then_nothing_exists() -> anyhow::Result<()> {
    let td = TestDaemon::start_faulty(|_| {}).await?;
    let c = td.caller().await?;
    faults(&td).fail_nth(1);
    let args = SubmitArgs {
        session_id: "adm".into(),
        function_id: "echo".into(),
        input: json!(1),
        idempotency_key: Some("k1".into()),
        turn_timeout_ms: None,
        on_busy: None,
    };
    unavailable(c.submit(args.clone()).await.expect_err("write refused"));
    // Nothing was admitted: no session, no idempotency key taken.
    assert_eq!(
        c.inspect("adm").await.expect_err("no session").code(),
        Some(ErrorCode::NotFound)
    );
    let ok = c.submit(args).await?;
    assert!(
        !ok.deduplicated,
        "the failed submit must not have taken the key"
    );
    assert_eq!(ok.turn.seq, 1);
    let ev = c.events("adm", None, None).await?;
    assert_eq!(ev.events.first().map(|e| e.seq), Some(1));
    assert_clean(&td).await?;
    td.shutdown().await
}

/// A submit that finds no worker notes its session as waiting for the function
/// while the transition is built; when the write fails, that note goes too, so the
/// function is not listed (and kept in memory) with a waiting session that holds
/// nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_submit_leaves_no_waiting_session_behind() -> anyhow::Result<()> {
    let td = TestDaemon::start_faulty(|_| {}).await?;
    let c = td.caller().await?;
    faults(&td).fail_nth(1);
    let args = SubmitArgs {
        session_id: "nobody-serves".into(),
        function_id: "unserved".into(),
        input: json!(1),
        idempotency_key: None,
        turn_timeout_ms: None,
        on_busy: None,
    };
    unavailable(c.submit(args.clone()).await.expect_err("write refused"));
    let listed = c.functions().await?;
    assert!(
        listed.iter().all(|f| f.function_id != "unserved"),
        "a refused submit left its function listed: {listed:?}"
    );
    // The same submit written: the session waits for the function, as it should.
    c.submit(args).await?;
    let listed = c.functions().await?;
    let f = listed
        .iter()
        .find(|f| f.function_id == "unserved")
        .expect("listed while a session waits for it");
    assert_eq!(f.queued, 1, "{listed:?}");
    td.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dispatch_write_fails_session_finalizing_then_proceeds() -> anyhow::Result<()> {
    let td = TestDaemon::start_faulty(|_| {}).await?;
    let c = td.caller().await?;
    let f = faults(&td);
    let t = c.submit_simple("disp", "echo", json!("x")).await?;
    assert_eq!(http_status(&td.admin, "/readyz").await?, 200);
    f.set_fail_writes(true);
    let runs = Arc::new(AtomicUsize::new(0));
    let w = counting_worker(&td.url, "w-disp", runs.clone()).await;
    // The dispatch cannot be written: the session shows finalizing with the error,
    // and readiness fails meanwhile.
    let waiting = eventually(T, "finalizing", || {
        let c = &c;
        let id = t.turn_id.clone();
        async move {
            let t = c.get(&id).await.ok()?;
            t.wait.filter(|w| w.state == WaitState::Finalizing)
        }
    })
    .await?;
    assert!(
        waiting
            .last_error
            .as_deref()
            .unwrap_or("")
            .contains("injected"),
        "{waiting:?}"
    );
    assert!(waiting.deadline_ms.is_some());
    assert_eq!(http_status(&td.admin, "/readyz").await?, 503);
    assert_eq!(
        runs.load(Ordering::SeqCst),
        0,
        "nothing dispatched without a durable record"
    );
    let stats = c.stats().await?;
    assert!(!stats.storage.writable);
    f.set_fail_writes(false);
    let done = wait_done(&c, &t.turn_id, T).await?;
    assert_eq!(done.status, TurnStatus::Completed);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(http_status(&td.admin, "/readyz").await?, 200);
    let k = kinds(&c, "disp").await?;
    assert_eq!(
        k.iter().filter(|k| **k == EventKind::Dispatched).count(),
        1,
        "{k:?}"
    );
    assert_clean(&td).await?;
    w.shutdown();
    td.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn result_write_fails_worker_resends_applied_once() -> anyhow::Result<()> {
    let td = TestDaemon::start_faulty(|_| {}).await?;
    let c = td.caller().await?;
    let runs = Arc::new(AtomicUsize::new(0));
    let w = counting_worker(&td.url, "w-res", runs.clone()).await;
    // Two turns: the first one's result write also hands the lock to the second.
    faults(&td).fail_matching(b"\"kind\":\"result\"", 2);
    let a = c.submit_simple("res", "echo", json!("a")).await?;
    let b = c.submit_simple("res", "echo", json!("b")).await?;
    let a = wait_done(&c, &a.turn_id, T).await?;
    let b = wait_done(&c, &b.turn_id, T).await?;
    assert_eq!(a.status, TurnStatus::Completed);
    assert_eq!(a.output, Some(json!("a")));
    assert_eq!(b.status, TurnStatus::Completed);
    assert_eq!(
        faults(&td).matching_left(),
        0,
        "both injected faults were hit"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 2, "each step ran once");
    let k = kinds(&c, "res").await?;
    assert_eq!(
        k.iter().filter(|k| **k == EventKind::Result).count(),
        2,
        "{k:?}"
    );
    assert_eq!(
        k.iter().filter(|k| **k == EventKind::Completed).count(),
        2,
        "{k:?}"
    );
    assert!(
        w.stats().results_resent >= 2,
        "the worker resent after unavailable"
    );
    assert_clean(&td).await?;
    w.shutdown();
    td.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_write_fails_turn_unchanged() -> anyhow::Result<()> {
    let td = TestDaemon::start_faulty(|_| {}).await?;
    let c = td.caller().await?;
    let t = c.submit_simple("stopf", "nobody", json!(null)).await?;
    faults(&td).fail_nth(1);
    unavailable(c.stop(&t.turn_id, "first try").await.expect_err("refused"));
    let now = c.get(&t.turn_id).await?;
    assert_eq!(now.status, TurnStatus::Queued);
    assert!(now.stop.is_none(), "a refused stop leaves no trace");
    assert!(!kinds(&c, "stopf")
        .await?
        .contains(&EventKind::StopRequested));
    let stopped = c.stop(&t.turn_id, "second try").await?;
    assert_eq!(stopped.status, TurnStatus::Cancelled);
    assert_eq!(
        stopped.stop.map(|s| s.reason),
        Some("second try".to_string())
    );
    assert_clean(&td).await?;
    td.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amendment_write_fails_then_late_result_amends() -> anyhow::Result<()> {
    let td = TestDaemon::start_faulty(|c| {
        c.turns.reconnect_grace_ms = 200;
    })
    .await?;
    let c = td.caller().await?;
    let hello = json!({"worker_id": "w-late", "instance_id": "inst-1"});
    let (mut w, _) = Raw::hello(&td.url, "worker", hello.clone()).await?;
    w.ok("function.register", json!({"function_id": "slow"}))
        .await?;
    let t = c.submit_simple("amend", "slow", json!(7)).await?;
    let invoke = w.next_push().await?;
    let inv = invoke["invocation_id"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(inv.starts_with("inv_"), "{invoke}");
    // The worker vanishes past the grace: outcome unknown, at_most_once fails.
    drop(w);
    let failed = wait_done(&c, &t.turn_id, T).await?;
    assert_eq!(failed.status, TurnStatus::Failed);
    let err = failed.error.clone().expect("cause");
    assert_eq!(err.invocation_id.as_deref(), Some(inv.as_str()));
    // It comes back with the result; the first write of the amendment fails.
    faults(&td).fail_matching(b"\"kind\":\"amended\"", 1);
    let mut hello2 = hello.clone();
    hello2["finished"] = json!([inv]);
    let (mut w2, _) = Raw::hello(&td.url, "worker", hello2).await?;
    let args = json!({"invocation_id": inv, "outcome": {"complete": {"answer": 42}}});
    let code = w2.error_code("invocation.result", args.clone()).await?;
    assert_eq!(code, "unavailable");
    assert_eq!(
        c.get(&t.turn_id).await?.status,
        TurnStatus::Failed,
        "nothing changed"
    );
    let ok = w2.ok("invocation.result", args.clone()).await?;
    assert_eq!(ok["accepted"], "late");
    let amended = c.get(&t.turn_id).await?;
    assert_eq!(amended.status, TurnStatus::Completed);
    assert!(amended.recovered);
    assert_eq!(amended.output, Some(json!({"answer": 42})));
    let again = w2.ok("invocation.result", args).await?;
    assert_eq!(again["accepted"], "duplicate");
    let k = kinds(&c, "amend").await?;
    assert_eq!(
        k.iter().filter(|k| **k == EventKind::Amended).count(),
        1,
        "{k:?}"
    );
    assert_clean(&td).await?;
    td.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_frames_during_outage_get_unavailable_and_nothing_runs_twice() -> anyhow::Result<()>
{
    let td = TestDaemon::start_faulty(|_| {}).await?;
    let c = td.caller().await?;
    let runs = Arc::new(AtomicUsize::new(0));
    let w = counting_worker(&td.url, "w-out", runs.clone()).await;
    let f = faults(&td);
    // A dispatched step whose result arrives while every write fails.
    f.fail_matching(b"\"kind\":\"result\"", u64::MAX);
    let t = c.submit_simple("outage", "echo", json!(3)).await?;
    eventually(T, "the first refused result", || {
        let f = f.clone();
        async move { (f.refused.load(Ordering::SeqCst) >= 1).then_some(()) }
    })
    .await?;
    f.set_fail_writes(true);
    f.fail_matching(b"never", 0);
    let second = c.submit_simple("outage", "echo", json!(4)).await;
    unavailable(second.expect_err("admission refused"));
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(c.get(&t.turn_id).await?.status, TurnStatus::Running);
    f.set_fail_writes(false);
    let done = wait_done(&c, &t.turn_id, T).await?;
    assert_eq!(done.status, TurnStatus::Completed);
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "the step ran once across the outage"
    );
    let list = c
        .list(turnd_proto::ListArgs {
            session_id: "outage".into(),
            status: None,
            limit: None,
            before_seq: None,
        })
        .await?;
    assert_eq!(list.turns.len(), 1, "the refused submit left nothing");
    assert_clean(&td).await?;
    w.shutdown();
    td.shutdown().await
}

/// Write a turn record straight into a stopped daemon's store.
async fn corrupt(dir: &std::path::Path, f: impl FnOnce(&Store) -> Batch) -> anyhow::Result<()> {
    let kv = Arc::new(LoggedKv::open(dir, LoggedOptions::default())?.0);
    let store = Store::new(kv.clone());
    let batch = f(&store);
    store.commit(batch).await?;
    kv.close()?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_check_names_a_corrupted_store() -> anyhow::Result<()> {
    let td = TestDaemon::start(|_| {}).await?;
    let dir = td.dir.clone();
    let c = td.caller().await?;
    let t = c.submit_simple("bad", "nobody", json!(null)).await?;
    let t2 = c.submit_simple("bad", "nobody", json!(null)).await?;
    let t3 = c.submit_simple("bad", "nobody", json!(null)).await?;
    assert_clean(&td).await?;
    drop(c);
    td.shutdown().await?;
    let data = dir.path().join("data");
    let (id, id2) = (t.turn_id.clone(), t2.turn_id.clone());
    corrupt(&data, move |store| {
        let mut rec: TurnRecord = store.turn(&id).ok().flatten().expect("turn stored");
        rec.status = TurnStatus::Running;
        rec.phase = Phase::Invoked;
        rec.invocation_id = Some("inv_missing".into());
        let mut rec2: TurnRecord = store.turn(&id2).ok().flatten().expect("turn stored");
        rec2.status = TurnStatus::Failed;
        rec2.error = None;
        let mut b = Batch::new();
        b.put_turn(&rec);
        b.put_raw(
            keys::turn(&rec2.turn_id),
            serde_json::to_vec(&rec2).expect("json"),
        );
        let mut meta = store
            .session_meta("bad")
            .ok()
            .flatten()
            .expect("meta stored");
        // The first event goes (keys as stored: with their routes).
        let (values, _) = store
            .event_values_page(meta.keys(), None, 1)
            .expect("events");
        let (first, _) = values.into_iter().next().expect("an event value");
        b.delete(first);
        // The third, still queued, drops out of its session's turn list.
        let third = store
            .list_entries(meta.keys(), 3, 4, false, 1)
            .expect("list")
            .into_iter()
            .next()
            .expect("listed");
        b.delete(third.0);
        // The meta says the first unfinished turn is the second one (now failed), so
        // recovery would skip the first.
        meta.active_from = Some(2);
        b.put_session_meta(&meta);
        b
    })
    .await?;
    let kv = Arc::new(LoggedKv::open(&data, LoggedOptions::default())?.0);
    let v = turnd_store::check_store(&Store::new(kv.clone()))?;
    kv.close()?;
    drop(kv);
    let names: Vec<(&str, Option<&str>)> = v
        .iter()
        .map(|x| (x.invariant.as_str(), x.turn_id.as_deref()))
        .collect();
    assert!(
        names.contains(&("running_without_path", Some(t.turn_id.as_str()))),
        "{v:?}"
    );
    assert!(
        names.contains(&("failed_without_cause", Some(t2.turn_id.as_str()))),
        "{v:?}"
    );
    assert!(v.iter().any(|x| x.invariant == "event_gap"), "{v:?}");
    assert!(
        names.contains(&("unindexed_active_turn", Some(t.turn_id.as_str()))),
        "{v:?}"
    );
    assert!(
        names.contains(&("terminal_lock_holder", Some(t2.turn_id.as_str()))),
        "{v:?}"
    );
    assert!(
        names.contains(&("unindexed_active_turn", Some(t3.turn_id.as_str()))),
        "{v:?}"
    );
    let detail: Value = serde_json::to_value(&v)?;
    assert!(detail.to_string().contains("inv_missing"), "{detail}");
    // The live `store.check` of a daemon on that store reports what stays broken (a
    // failed turn without its cause is terminal: nothing at start-up touches it).
    let td = TestDaemon::start_in(dir, |_| {}, false).await?;
    let live = td.operator().await?.store_check().await?;
    assert!(
        live.iter().any(|x| x.invariant == "failed_without_cause"
            && x.turn_id.as_deref() == Some(t2.turn_id.as_str())),
        "{live:?}"
    );
    td.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_faults_answer_unavailable_and_change_nothing() -> anyhow::Result<()> {
    let td = TestDaemon::start_faulty(|_| {}).await?;
    let c = td.caller().await?;
    let t = c.submit_simple("reads", "nobody", json!(1)).await?;
    let f = faults(&td);
    f.set_fail_reads(true);
    unavailable(c.stop(&t.turn_id, "x").await.expect_err("read refused"));
    unavailable(
        c.events("reads", None, None)
            .await
            .expect_err("read refused"),
    );
    f.set_fail_reads(false);
    let now = c.get(&t.turn_id).await?;
    assert_eq!(now.status, TurnStatus::Queued);
    assert!(now.stop.is_none(), "the refused stop changed nothing");
    assert_clean(&td).await?;
    td.shutdown().await
}

/// A session's first use reads its meta only if the store may hold one: recovery
/// notes every stored session, so with every store read failing a brand-new session
/// still takes a submit, while a session stored before the restart (and not in memory,
/// having no unfinished turn) needs its meta read and is refused until reads work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_sessions_first_submit_reads_nothing() -> anyhow::Result<()> {
    let td = TestDaemon::start_faulty(|_| {}).await?;
    let dir = td.dir.clone();
    let runs = Arc::new(AtomicUsize::new(0));
    let w = counting_worker(&td.url, "w-first", runs.clone()).await;
    let c = td.caller().await?;
    let t = c.submit_simple("stored", "echo", json!(1)).await?;
    wait_done(&c, &t.turn_id, T).await?;
    drop(c);
    w.shutdown();
    td.shutdown().await?;

    let td = TestDaemon::start_in(dir, |_| {}, true).await?;
    let c = td.caller().await?;
    let f = faults(&td);
    f.set_fail_reads(true);
    let fresh = c.submit_simple("brand-new", "echo", json!(2)).await?;
    assert_eq!(fresh.seq, 1);
    unavailable(
        c.submit_simple("stored", "echo", json!(3))
            .await
            .expect_err("the stored session's meta must be read"),
    );
    f.set_fail_reads(false);
    let next = c.submit_simple("stored", "echo", json!(4)).await?;
    assert_eq!(next.seq, 2, "the stored session continues its sequence");
    assert_clean(&td).await?;
    td.shutdown().await
}

/// An unfinished turn and its live invocation are served from memory: with every
/// store read failing, `turn.get` and `turn.wait` of the turn still answer, and the
/// worker's result is applied. (A sled read waits while a group commit is applied,
/// so the hot path of a turn reads nothing.) A finished turn is read from the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_turns_and_their_results_need_no_store_read() -> anyhow::Result<()> {
    let td = TestDaemon::start_faulty(|_| {}).await?;
    let c = td.caller().await?;
    let (mut w, _) = Raw::hello(
        &td.url,
        "worker",
        json!({"worker_id": "mem", "instance_id": "i1"}),
    )
    .await?;
    w.ok("function.register", json!({"function_id": "f"}))
        .await?;
    let t = c.submit_simple("mem", "f", json!(1)).await?;
    let inv = w.next_push().await?["invocation_id"].clone();
    let f = faults(&td);
    f.set_fail_reads(true);
    let now = c.get(&t.turn_id).await?;
    assert_eq!(now.status, TurnStatus::Running);
    let waited = c.wait(&t.turn_id, Some(20)).await?;
    assert_eq!(waited.status, TurnStatus::Running);
    let ok = w
        .ok(
            "invocation.result",
            json!({"invocation_id": inv, "outcome": {"complete": "done"}}),
        )
        .await?;
    assert_eq!(ok["accepted"], "applied");
    // Finished, the turn is no longer in memory: its read is refused.
    unavailable(c.get(&t.turn_id).await.expect_err("read refused"));
    f.set_fail_reads(false);
    let done = c.get(&t.turn_id).await?;
    assert_eq!(done.status, TurnStatus::Completed);
    assert_eq!(done.output, Some(json!("done")));
    assert_clean(&td).await?;
    td.shutdown().await
}
