//! Retention through the real binary: terminal turns are deleted within
//! `terminal_ms + 2 × sweep_interval_ms` with everything that belongs to them, a
//! session left with no turn is forgotten, unfinished turns stay however old, a freed
//! idempotency key can be used again, and all of it holds across a restart and
//! across SIGKILL in the middle of sweeps.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one scenario from its setup to its last assertion"
)]

use std::time::{Duration, Instant};

use anyhow::Context;

use serde_json::json;
use turnd_client::turnd_proto::{ErrorCode, ListArgs, SubmitArgs, TurnStatus};
use turnd_client::Caller;
use turnd_tests::{echo_worker, http_get, metric, BinDaemon};

const TERMINAL_MS: u64 = 400;
const SWEEP_MS: u64 = 100;
/// Time windows of finished turns this short: turns of a test fall in several, and
/// windows are dropped while it runs.
const WINDOW_MS: u64 = 150;

fn env() -> Vec<(&'static str, String)> {
    vec![
        ("TURND_RETENTION__TERMINAL_MS", TERMINAL_MS.to_string()),
        ("TURND_RETENTION__SWEEP_INTERVAL_MS", SWEEP_MS.to_string()),
        ("TURND_STORAGE__WINDOW_MS", WINDOW_MS.to_string()),
        ("TURND_LOG", "warn".to_string()),
    ]
}

async fn start(data: &std::path::Path) -> anyhow::Result<BinDaemon> {
    let env = env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    BinDaemon::start(data, &env).await
}

fn submit(session: &str, function: &str, key: Option<&str>, n: u64) -> SubmitArgs {
    SubmitArgs {
        session_id: session.into(),
        function_id: function.into(),
        input: json!({"n": n}),
        idempotency_key: key.map(str::to_string),
        turn_timeout_ms: None,
        on_busy: None,
    }
}

fn list(session: &str) -> ListArgs {
    ListArgs {
        session_id: session.into(),
        status: None,
        limit: Some(100),
        before_seq: None,
    }
}

fn is_not_found<T: std::fmt::Debug>(r: Result<T, turnd_client::ClientError>) -> bool {
    match r {
        Err(e) => e.code() == Some(ErrorCode::NotFound),
        Ok(_) => false,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminal_turns_expire_and_unfinished_ones_stay() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let data = dir.path().join("data");
    let d = start(&data).await?;
    let w = echo_worker(&d.url, "w-ret", 4).await;
    let c = Caller::connect(&d.url, None).await?;

    // Two finished turns in "done"; in "mixed", a finished one ahead of one that
    // waits for a worker nobody serves.
    let mut finished = Vec::new();
    // Before the last finished turn was submitted: it finished after this.
    let mut last_submitted = Instant::now();
    for (i, session) in ["done", "done", "mixed"].into_iter().enumerate() {
        let key = format!("k{i}");
        last_submitted = Instant::now();
        let t = c
            .submit(submit(session, "echo", Some(&key), i as u64))
            .await?;
        let done = c
            .wait_terminal(&t.turn.turn_id, Duration::from_secs(10))
            .await?;
        assert_eq!(done.status, TurnStatus::Completed);
        finished.push(t.turn.turn_id);
    }
    let waiting = c.submit(submit("mixed", "nobody", None, 9)).await?;
    let finished_at = Instant::now();

    // Deleted within terminal_ms + 2 × sweep_interval_ms, and slack for a busy
    // machine (a sweep's delete is a durable commit, and it holds back while the
    // store is busy).
    let bound = Duration::from_millis(TERMINAL_MS + 2 * SWEEP_MS + 5_000);
    loop {
        let mut left = 0;
        for id in &finished {
            if !is_not_found(c.get(id).await) {
                left += 1;
            }
        }
        if left == 0 {
            break;
        }
        assert!(
            finished_at.elapsed() < bound,
            "{left} terminal turns still there {:?} after they finished",
            finished_at.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Measured from before the last turn was submitted, not from after its answer
    // and the next submit (two durable commits later, which a slow disk can make
    // longer than any slack): the turn finished after that instant.
    assert!(
        last_submitted.elapsed() >= Duration::from_millis(TERMINAL_MS - 50),
        "deleted before terminal_ms had passed"
    );

    // "done" has nothing left: forgotten.
    assert!(is_not_found(c.inspect("done").await), "session done");
    assert!(is_not_found(c.events("done", Some(0), Some(10)).await));
    assert!(c.list(list("done")).await?.turns.is_empty());
    // "mixed" keeps its unfinished turn and only that turn's events.
    let s = c.inspect("mixed").await?;
    assert_eq!((s.turns.completed, s.turns.queued), (0, 1), "{s:?}");
    let listed = c.list(list("mixed")).await?;
    let ids: Vec<&str> = listed.turns.iter().map(|t| t.turn_id.as_str()).collect();
    assert_eq!(ids, vec![waiting.turn.turn_id.as_str()]);
    let events = c.events("mixed", Some(0), Some(100)).await?.events;
    assert!(!events.is_empty());
    assert!(
        events.iter().all(|e| e.turn_id == waiting.turn.turn_id),
        "{events:?}"
    );
    let (_, metrics) = http_get(&d.admin, "/metrics").await?;
    assert_eq!(
        metric(&metrics, "turnd_retention_deleted_turns_total"),
        Some(3.0)
    );

    // A freed idempotency key admits a new turn; "done" starts again at seq 1.
    let again = c.submit(submit("done", "echo", Some("k0"), 100)).await?;
    assert!(!again.deduplicated);
    assert_eq!(again.turn.seq, 1);
    c.wait_terminal(&again.turn.turn_id, Duration::from_secs(10))
        .await?;

    // Across a restart: the unfinished turn is still there (older than terminal_ms by
    // now), the new one expires in turn.
    drop(c);
    w.shutdown();
    let status = d.terminate().await?;
    assert!(status.success(), "turnd exited with {status}");
    let d = start(&data).await?;
    let c = Caller::connect(&d.url, None).await?;
    tokio::time::sleep(Duration::from_millis(TERMINAL_MS + 3 * SWEEP_MS)).await;
    let kept = c.get(&waiting.turn.turn_id).await?;
    assert_eq!(kept.status, TurnStatus::Queued);
    turnd_tests::eventually(5, "the turn admitted before the restart expires", || {
        let c = &c;
        let id = again.turn.turn_id.clone();
        async move { is_not_found(c.get(&id).await).then_some(()) }
    })
    .await?;
    checks_out_and_stops(d).await
}

/// What the test saw of one acknowledged turn.
#[derive(Debug, Clone)]
struct Acked {
    session: String,
    /// Seen terminal by its caller, or ended when a restart's checks read it.
    done: bool,
}

/// After a restart: every acknowledged turn is there, unless retention deleted it,
/// which it may only have done to a turn that had ended; each session's counts
/// match its listed turns; no event is left of a deleted turn; `store.check` is
/// clean. Returns how many acknowledged turns were gone, and the ids of those found
/// ended (which may expire from now on, seen or not).
async fn check_after_kill(
    c: &Caller,
    op: &Caller,
    acked: &std::collections::BTreeMap<String, Acked>,
) -> anyhow::Result<(usize, Vec<String>)> {
    let mut gone = 0;
    let mut ended = Vec::new();
    let mut sessions = std::collections::BTreeSet::new();
    // The turns not seen ended first: one that ended just before the kill expires
    // `terminal_ms` after it ended, and is read well before that.
    let (open, seen): (Vec<_>, Vec<_>) = acked.iter().partition(|(_, a)| !a.done);
    for (id, a) in open.into_iter().chain(seen) {
        sessions.insert(a.session.clone());
        match c.get(id).await {
            Ok(t) => {
                anyhow::ensure!(
                    !a.done || t.status.is_terminal(),
                    "a turn seen ended is {t:?}"
                );
                if t.status.is_terminal() {
                    ended.push(id.clone());
                }
            }
            Err(e) if e.code() == Some(ErrorCode::NotFound) => {
                anyhow::ensure!(a.done, "turn {id} was deleted but never ended");
                gone += 1;
            }
            Err(e) => return Err(e.into()),
        }
    }
    let v = op.store_check().await?;
    anyhow::ensure!(v.is_empty(), "store.check: {v:?}");
    for s in &sessions {
        // Sweeps go on meanwhile: the counts are read before and after the list,
        // and the list again until they did not change in between.
        let mut tries = 0;
        let listed = loop {
            tries += 1;
            let before = match c.inspect(s).await {
                Ok(info) => Some(info.turns),
                Err(e) if e.code() == Some(ErrorCode::NotFound) => None,
                Err(e) => return Err(e.into()),
            };
            let mut listed = Vec::new();
            let mut args = list(s);
            loop {
                let page = c.list(args.clone()).await?;
                listed.extend(page.turns);
                match page.next_before_seq {
                    Some(b) => args.before_seq = Some(b),
                    None => break,
                }
            }
            let after = match c.inspect(s).await {
                Ok(info) => Some(info.turns),
                Err(e) if e.code() == Some(ErrorCode::NotFound) => None,
                Err(e) => return Err(e.into()),
            };
            if before != after && tries < 50 {
                continue;
            }
            match after {
                None => anyhow::ensure!(listed.is_empty(), "forgotten {s} lists {listed:?}"),
                Some(counts) => {
                    let total = counts.queued
                        + counts.running
                        + counts.completed
                        + counts.failed
                        + counts.cancelled;
                    anyhow::ensure!(
                        total == listed.len() as u64,
                        "{s}: counts {counts:?} against {} listed turns",
                        listed.len()
                    );
                }
            }
            break listed;
        };
        if listed.is_empty() {
            continue;
        }
        let ids: std::collections::HashSet<&str> =
            listed.iter().map(|t| t.turn_id.as_str()).collect();
        // Forgotten meanwhile (its last turns expired since it was listed): nothing
        // left to compare.
        let events = match c.inspect(s).await {
            Err(e) if e.code() == Some(ErrorCode::NotFound) => continue,
            _ => match turnd_tests::all_events(c, s).await {
                Ok(events) => events,
                Err(_) if is_not_found(c.inspect(s).await) => continue,
                Err(e) => return Err(e),
            },
        };
        for e in &events {
            anyhow::ensure!(
                ids.contains(e.turn_id.as_str()),
                "{s}: event {} of turn {} that is gone",
                e.seq,
                e.turn_id
            );
        }
    }
    Ok((gone, ended))
}

/// SIGKILL while retention sweeps (every 20 ms, with turns expiring all the time)
/// and the load runs, three times: after each kill (read on a restart whose turns
/// expire later) nothing acknowledged is
/// missing unless it had ended and expired, counts and events agree with the turns
/// left, and `store.check` is clean; every life deleted turns, so the kills fell
/// among sweeps. The kill moments come from a seeded PRNG (`TURND_SEED` replays).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_during_retention_sweeps_leaves_a_consistent_store() -> anyhow::Result<()> {
    use std::collections::BTreeMap;
    use std::sync::{Arc, Mutex};
    use turnd_testkit::SplitMix64;
    let seed = SplitMix64::seed_from_env();
    println!("seed = {seed} (TURND_SEED={seed} replays the same choices)");
    let mut prng = SplitMix64::new(seed);
    let dir = tempfile::tempdir()?;
    let data = dir.path().join("data");
    let env = [
        ("TURND_LOG", "error"),
        // Turns expire while the load runs (the checks after a kill run with a
        // longer terminal_ms: `check_env` below).
        ("TURND_RETENTION__TERMINAL_MS", "1500"),
        ("TURND_RETENTION__SWEEP_INTERVAL_MS", "20"),
        ("TURND_STORAGE__LOG_SEGMENT_KB", "64"),
        ("TURND_STORAGE__APPLY_INTERVAL_MS", "20"),
        // Windows switch and are dropped all the time, so kills fall among those too.
        ("TURND_STORAGE__WINDOW_MS", "100"),
    ];
    // The checks after a kill run on a daemon whose turns expire only after a
    // minute, killed once they are done: a turn that ended unseen just before the
    // kill is still there to be read, however long the restart and the reads take
    // on a busy machine. The load then runs on one that expires turns after 1.5 s.
    let check_env: Vec<(&str, &str)> = env
        .iter()
        .map(|&(k, v)| match k {
            "TURND_RETENTION__TERMINAL_MS" => (k, "60000"),
            _ => (k, v),
        })
        .collect();
    let acked: Arc<Mutex<BTreeMap<String, Acked>>> = Arc::default();
    for life in 0..4 {
        if life > 0 {
            let d = BinDaemon::start(&data, &check_env).await?;
            let c = Caller::connect(&d.url, None).await?;
            let op =
                Caller::connect_as(&d.url, turnd_client::turnd_proto::Role::Operator, None).await?;
            let snapshot = acked
                .lock()
                .map_err(|_| anyhow::anyhow!("poisoned"))?
                .clone();
            let (gone, ended) = check_after_kill(&c, &op, &snapshot).await?;
            println!(
                "life {life}: {gone} of {} acknowledged turns expired",
                snapshot.len()
            );
            {
                let mut a = acked.lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
                for id in ended {
                    if let Some(t) = a.get_mut(&id) {
                        t.done = true;
                    }
                }
            }
            d.kill().await?;
        }
        if life == 3 {
            break;
        }
        let d = BinDaemon::start(&data, &env).await?;
        let c = std::sync::Arc::new(Caller::connect(&d.url, None).await?);
        let w = echo_worker(&d.url, "w-kill", 16).await;
        let mut load = tokio::task::JoinSet::new();
        // Turns a kill left unfinished end in this life: seen, they may expire.
        let open: Vec<String> = acked
            .lock()
            .map_err(|_| anyhow::anyhow!("poisoned"))?
            .iter()
            .filter(|(_, a)| !a.done)
            .map(|(id, _)| id.clone())
            .collect();
        for id in open {
            let (c, acked) = (c.clone(), acked.clone());
            load.spawn(async move {
                if let Ok(t) = c.wait_terminal(&id, Duration::from_secs(10)).await {
                    if let (true, Ok(mut a)) = (t.status.is_terminal(), acked.lock()) {
                        if let Some(a) = a.get_mut(&id) {
                            a.done = true;
                        }
                    }
                }
            });
        }
        for s in 0..6 {
            let (c, acked) = (c.clone(), acked.clone());
            load.spawn(async move {
                let session = format!("kill-{s}");
                for i in 0.. {
                    let Ok(t) = c.submit(submit(&session, "echo", None, i)).await else {
                        return;
                    };
                    let id = t.turn.turn_id.clone();
                    if let Ok(mut a) = acked.lock() {
                        a.insert(
                            id.clone(),
                            Acked {
                                session: session.clone(),
                                done: false,
                            },
                        );
                    }
                    match c.wait_terminal(&id, Duration::from_secs(10)).await {
                        Ok(done) if done.status.is_terminal() => {
                            if let Ok(mut a) = acked.lock() {
                                if let Some(a) = a.get_mut(&id) {
                                    a.done = true;
                                }
                            }
                        }
                        _ => return,
                    }
                }
            });
        }
        tokio::time::sleep(Duration::from_millis(1_800 + prng.below(800))).await;
        // The kill falls among sweeps once one has deleted a turn: on a slow machine
        // the first turns of a life may finish too late for one by then.
        let (deleted, m) = turnd_tests::eventually(10, "a turn deleted", || async {
            let (_, m) = http_get(&d.admin, "/metrics").await.ok()?;
            let deleted = metric(&m, "turnd_retention_deleted_turns_total")?;
            (deleted > 0.0).then_some((deleted, m))
        })
        .await?;
        d.kill().await?;
        w.shutdown();
        load.abort_all();
        while load.join_next().await.is_some() {}
        let dropped = metric(&m, "turnd_retention_dropped_windows_total").unwrap_or(0.0);
        println!("life {life}: killed after deleting {deleted} turns and {dropped} windows");
    }
    // A last life, after the last checks: everything ends and expires.
    let d = BinDaemon::start(&data, &env).await?;
    let c = Caller::connect(&d.url, None).await?;
    let op = Caller::connect_as(&d.url, turnd_client::turnd_proto::Role::Operator, None).await?;
    let snapshot = acked
        .lock()
        .map_err(|_| anyhow::anyhow!("poisoned"))?
        .clone();
    let w = echo_worker(&d.url, "w-kill", 16).await;
    for id in snapshot.keys() {
        match c.wait_terminal(id, Duration::from_secs(10)).await {
            // A turn in flight at a kill may have failed (`outcome_unknown`).
            Ok(t) => assert!(t.status.is_terminal(), "{t:?}"),
            Err(e) => assert_eq!(e.code(), Some(ErrorCode::NotFound), "{e}"),
        }
    }
    turnd_tests::eventually(10, "every session forgotten", || {
        let c = &c;
        async move {
            for s in 0..6 {
                if !is_not_found(c.inspect(&format!("kill-{s}")).await) {
                    return None;
                }
            }
            Some(())
        }
    })
    .await?;
    let v = op.store_check().await?;
    assert!(v.is_empty(), "store.check: {v:?}");
    w.shutdown();
    let status = d.terminate().await?;
    assert!(status.success(), "turnd exited with {status}");
    Ok(())
}

/// Bytes of the files under `dir`.
fn dir_bytes(dir: &std::path::Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .filter_map(Result::ok)
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => dir_bytes(&e.path()),
            _ => e.metadata().map(|m| m.len()).unwrap_or(0),
        })
        .sum()
}

/// Under steady work with retention shorter than the run, the time windows of
/// expired turns are deleted from disk, not only from reads: equal rounds of turns
/// with 8 KiB inputs, each expiring before the next round is measured, leave at most
/// three window directories (the newest, which takes new turns, and those not yet
/// past the margin after their end) and `windows/` at most 1.3 × its largest size
/// over the first two rounds (and 1 MiB). The sessions' turn lists, events and idempotency keys
/// are in the windows with their turns and go with them: no dropped window held
/// anything still (which the daemon would have moved to the main database). Each
/// session submits its turns two at a time, so that the transition that ends one
/// also dispatches the next (one event value about two turns), and every turn has an
/// idempotency key. (The main database's size is printed: at this scale it follows
/// sled's own start, not the turns; the soak benchmark measures it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn equal_rounds_of_work_leave_the_windows_flat() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let data = dir.path().join("data");
    let mut env = env();
    env.push(("TURND_STORAGE__LOG_SEGMENT_KB", "256".to_string()));
    env.push(("TURND_STORAGE__APPLY_INTERVAL_MS", "20".to_string()));
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let d = BinDaemon::start(&data, &env).await?;
    let w = echo_worker(&d.url, "w-flat", 16).await;
    let c = std::sync::Arc::new(Caller::connect(&d.url, None).await?);
    let big = "x".repeat(8 * 1024);
    let mut sizes = Vec::new();
    let started = Instant::now();
    for round in 0..5u64 {
        let mut load = tokio::task::JoinSet::new();
        for s in 0..6 {
            let (c, big) = (c.clone(), big.clone());
            load.spawn(async move {
                for pair in 0..8u64 {
                    let mut ids = Vec::new();
                    for i in [2 * pair, 2 * pair + 1] {
                        let args = SubmitArgs {
                            session_id: format!("flat-{s}"),
                            function_id: "echo".into(),
                            input: json!({"n": i, "round": round, "pad": big}),
                            idempotency_key: Some(format!("r{round}-{i}")),
                            turn_timeout_ms: None,
                            on_busy: None,
                        };
                        ids.push(c.submit(args).await?.turn.turn_id);
                    }
                    for id in ids {
                        c.wait_terminal(&id, Duration::from_secs(10)).await?;
                    }
                }
                anyhow::Ok(())
            });
        }
        while let Some(r) = load.join_next().await {
            r??;
        }
        // Everything of the round expires, its sessions are forgotten and its
        // windows are dropped.
        turnd_tests::eventually(10, "the round expires and its windows go", || {
            let c = &c;
            let data = &data;
            async move {
                for s in 0..6 {
                    if !is_not_found(c.inspect(&format!("flat-{s}")).await) {
                        return None;
                    }
                }
                let windows = std::fs::read_dir(data.join("windows")).ok()?.count();
                (windows <= 3).then_some(())
            }
        })
        .await?;
        let (all, windows) = (dir_bytes(&data), dir_bytes(&data.join("windows")));
        let main = all.saturating_sub(windows + dir_bytes(&data.join("log")));
        sizes.push((all, windows, main));
    }
    let (_, m) = http_get(&d.admin, "/metrics").await?;
    let dropped = metric(&m, "turnd_retention_dropped_windows_total").unwrap_or(0.0);
    let leftovers = metric(&m, "turnd_storage_window_leftover_keys_total");
    println!(
        "(data directory, windows/, main database) after each round: {sizes:?}; {dropped} windows dropped in {:?}",
        started.elapsed()
    );
    assert!(dropped >= 4.0, "{dropped} windows dropped");
    assert_eq!(leftovers, Some(0.0), "keys left in dropped windows");
    // With 1 MiB of slack: once every window of a round is dropped, what is left is
    // a few new windows, of a few KiB each, and a ratio of those means nothing. A
    // round writes about 0.8 MB of turns, so windows that were not dropped would
    // pass the bound by the fifth round.
    let base = sizes[..2].iter().map(|s| s.1).max().unwrap_or(0) as f64;
    let slack = 1024.0 * 1024.0;
    for (i, (_, w, _)) in sizes.iter().enumerate().skip(2) {
        assert!(
            *w as f64 <= 1.3 * base + slack,
            "after round {}: windows/ holds {w} bytes, more than 1.3 × {base} + 1 MiB ({sizes:?})",
            i + 1
        );
    }
    w.shutdown();
    checks_out_and_stops(d).await
}

/// The threads of process `pid` named `name`.
fn threads_named(pid: u32, name: &str) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|tasks| {
            tasks
                .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
                .filter(|comm| comm.trim() == name)
                .count()
        })
        .unwrap_or(0)
}

/// The daemon's environment for [`turns_for_a_dozen_windows`]: windows of 100 ms,
/// applied every 20 ms, and `more`.
fn windows_env<'a>(more: &[(&'a str, &'a str)]) -> Vec<(&'a str, &'a str)> {
    let mut env = vec![
        ("TURND_STORAGE__WINDOW_MS", "100"),
        ("TURND_STORAGE__APPLY_INTERVAL_MS", "20"),
        ("TURND_LOG", "warn"),
    ];
    env.extend_from_slice(more);
    env
}

/// Stop `d`, start it again on the same data directory and environment: every turn
/// of `ids` reads back completed, and `store.check` finds nothing.
async fn restart_and_read_back(
    mut d: BinDaemon,
    env: &[(&str, &str)],
    ids: &[String],
) -> anyhow::Result<()> {
    let data = d.data_dir.clone();
    let status = d.terminate().await?;
    assert!(status.success(), "turnd exited with {status}");
    d = BinDaemon::start(&data, env).await?;
    let c = Caller::connect(&d.url, None).await?;
    for id in ids {
        assert_eq!(c.get(id).await?.status, TurnStatus::Completed, "{id}");
    }
    checks_out_and_stops(d).await
}

/// `store.check` of `d` finds nothing, and `d` stops cleanly.
async fn checks_out_and_stops(d: BinDaemon) -> anyhow::Result<()> {
    let op = Caller::connect_as(&d.url, turnd_client::turnd_proto::Role::Operator, None).await?;
    let v = op.store_check().await?;
    assert!(v.is_empty(), "store.check: {v:?}");
    let status = d.terminate().await?;
    assert!(status.success(), "turnd exited with {status}");
    Ok(())
}

/// One-step turns of session `win`, one after another over about 1.2 s: a dozen
/// windows of 100 ms. Their ids, in order.
async fn turns_for_a_dozen_windows(c: &Caller) -> anyhow::Result<Vec<String>> {
    let mut ids = Vec::new();
    let began = Instant::now();
    let mut n = 0;
    while began.elapsed() < Duration::from_millis(1200) {
        let t = c.submit(submit("win", "echo", None, n)).await?;
        c.wait_terminal(&t.turn.turn_id, Duration::from_secs(10))
            .await?;
        ids.push(t.turn.turn_id);
        n += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(ids)
}

/// A time window that no longer takes writes runs no sled flusher thread (with
/// retention of days and windows of an hour or of 256 MiB, hundreds are open), and
/// its turns still read back, across a restart too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn windows_past_their_writes_run_no_flusher_thread() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let data = dir.path().join("data");
    let env = windows_env(&[]);
    let d = BinDaemon::start(&data, &env).await?;
    let w = echo_worker(&d.url, "w-windows", 16).await;
    let c = Caller::connect(&d.url, None).await?;
    let ids = turns_for_a_dozen_windows(&c).await?;
    let windows = std::fs::read_dir(data.join("windows"))?.count();
    assert!(windows >= 6, "only {windows} windows were made");
    let pid = d.child.id().context("daemon pid")?;
    // Once writes pause for 5 s the store reopens each idle window without one: then
    // the main database's flusher and the newest window's are left.
    let flushers = turnd_tests::eventually(30, "idle windows lose their flushers", || async {
        let n = threads_named(pid, "log flusher");
        (n <= 2).then_some(n)
    })
    .await
    .map_err(|e| {
        anyhow::anyhow!(
            "{e}: {} sled flusher threads with {windows} windows",
            threads_named(pid, "log flusher")
        )
    })?;
    println!("{flushers} sled flusher threads with {windows} windows");
    for id in [&ids[0], &ids[ids.len() / 2], &ids[ids.len() - 1]] {
        let t = c.get(id).await?;
        assert_eq!(t.status, TurnStatus::Completed, "{id}");
    }
    let listed = c.list(list("win")).await?;
    assert_eq!(listed.turns.len(), ids.len().min(100));
    w.shutdown();
    restart_and_read_back(d, &env, &ids).await
}

/// The time windows under `data` (their directory names) whose sled file process
/// `pid` has open now (a closed window keeps only its value file open).
fn windows_with_sled_open(pid: u32, data: &std::path::Path) -> std::collections::BTreeSet<String> {
    let windows = data.join("windows");
    let windows = std::fs::canonicalize(&windows).unwrap_or(windows);
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return std::collections::BTreeSet::new();
    };
    fds.filter_map(|fd| std::fs::read_link(fd.ok()?.path()).ok())
        .filter(|target| target.file_name().is_some_and(|f| f == "db"))
        .filter_map(|target| {
            let window = target.parent()?.strip_prefix(&windows).ok()?;
            Some(window.to_string_lossy().into_owned())
        })
        .collect()
}

/// A window no read or write used for `storage.window_close_ms` is closed (its sled
/// files too) and opened again by the reads that need it: a session's list spread
/// over many closed windows reads back whole, and every turn after a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unused_windows_are_closed_and_opened_again_by_a_read() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let data = dir.path().join("data");
    let env = windows_env(&[("TURND_STORAGE__WINDOW_CLOSE_MS", "300")]);
    let d = BinDaemon::start(&data, &env).await?;
    let w = echo_worker(&d.url, "w-close", 16).await;
    let c = Caller::connect(&d.url, None).await?;
    let ids = turns_for_a_dozen_windows(&c).await?;
    let pid = d.child.id().context("daemon pid")?;
    // The applier makes the window of the last turns' records in a round after
    // they finished (a round of `apply_interval_ms`, later on a loaded machine): the
    // open windows are read once it has applied every write (the live records'
    // `apply_delay_ms` too), so no window is made after, and every one it counts
    // is open.
    let open_before = turnd_tests::eventually(10, "every window made and open", || async {
        let (_, m) = http_get(&d.admin, "/metrics").await.ok()?;
        let unapplied = metric(&m, "turnd_storage_unapplied_keys")?;
        let n = metric(&m, "turnd_storage_windows")?;
        let open = windows_with_sled_open(pid, &data);
        (unapplied == 0.0 && open.len() as f64 >= n).then_some(open)
    })
    .await?;
    let closed_gauge = || async {
        let (_, m) = http_get(&d.admin, "/metrics").await.ok()?;
        Some((
            metric(&m, "turnd_storage_windows")?,
            metric(&m, "turnd_storage_windows_closed")?,
            metric(&m, "turnd_storage_window_reopens_total")?,
        ))
    };
    // A window is closed once it was opened again after its last write (5 s after
    // writes pause) and then not used for 300 ms: every one but the newest.
    // Only the windows still open have their sled files open: read with the gauge,
    // since a window counts as closed just before its sled files are closed.
    let got = turnd_tests::eventually(30, "unused windows are closed", || async {
        closed_gauge()
            .await
            .filter(|(n, closed, _)| *n >= 6.0 && *closed >= *n - 1.0)
            .map(|g| (g, windows_with_sled_open(pid, &data)))
            .filter(|((n, closed, _), open)| open.len() as f64 == n - closed)
    })
    .await;
    let ((windows, closed, reopens), open_after) = match got {
        Ok(v) => v,
        Err(e) => anyhow::bail!(
            "{e}: windows, closed, reopens = {:?}, with sled open {:?}",
            closed_gauge().await,
            windows_with_sled_open(pid, &data)
        ),
    };
    assert_eq!(reopens, 0.0, "nothing read them yet");
    println!("{closed} of {windows} windows closed; windows with sled open {open_before:?} -> {open_after:?}");
    assert!(open_before.len() as f64 >= windows, "{open_before:?}");
    // The session's list reads the windows its turns are in, each opened again as
    // it is read.
    let listed = c
        .list(list("win"))
        .await
        .context("list the session over its closed windows")?;
    assert_eq!(listed.turns.len(), ids.len().min(100));
    let (_, still_closed, reopens) = closed_gauge()
        .await
        .context("the window gauges after the list")?;
    assert!(
        reopens >= 1.0 && still_closed < closed,
        "{reopens} reopens, {still_closed} of {windows} still closed"
    );
    for id in [&ids[ids.len() / 2], &ids[ids.len() - 1]] {
        let got = c.get(id).await.with_context(|| format!("get {id}"))?;
        assert_eq!(got.status, TurnStatus::Completed, "{id}");
    }
    w.shutdown();
    restart_and_read_back(d, &env, &ids).await
}
