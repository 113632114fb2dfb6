//! Durability: acknowledged writes survive SIGKILL of the real binary.
//!
//! The real `turnd` binary runs under load — several sessions, callers submitting
//! turns with idempotency keys and stopping some, a raw worker serving one
//! `at_least_once` and one `at_most_once` function with one- to three-step turns —
//! and is killed with SIGKILL at random moments, several times, each time restarted
//! on the same data directory. Everything the daemon acknowledged is recorded on the
//! test's side:
//!
//! - every `turn.submit` answer (turn id, session, function, idempotency key);
//! - every `turn.stop` / `session.stop` answer whose turn carried the stop;
//! - every `invocation.result` answered `applied` (and `late`) — the worker is a raw
//!   protocol peer precisely so that each acknowledgement can be seen.
//!
//! After every restart, before any worker or caller touches the new daemon, the test
//! checks: `store.check` is clean; every acknowledged submit exists in its session;
//! every acknowledged stop is on its turn; every applied result is in its session's
//! events (a `complete` one as the turn's output); each session's events are gap-free
//! and show FIFO dispatch (no turn dispatched before every earlier turn ended) and
//! never two invocations in flight; every turn is terminal or visibly waiting (a
//! `wait`, with a deadline whenever a timer is running); and no `at_most_once` step
//! was ever invoked twice. Unanswered submits are resent with their idempotency key.
//! At the end the load stops, every turn must end, the checks run once more with
//! every turn terminal, and the daemon must shut down cleanly.
//!
//! The daemon writes its commit log in segments of 64 KiB and its records to sled every
//! 20 ms, deleting each segment once sled holds it, and checkpoints sled (closes and
//! reopens it) after every MiB written to it, so kills fall during or between log
//! appends, writes to sled, log trims and checkpoints; finished turns go to time
//! windows of 50 ms (`storage.window_ms`), so kills also fall among window switches
//! and writes to several windows. The trims, checkpoints and windows each life made
//! before its kill are printed, and the test fails if no life trimmed or no life
//! wrote to more than one window. (Kills during retention sweeps and window drops:
//! `tests/e2e/retention.rs`.)
//!
//! The kill moments, functions, step counts and stops come from one seeded PRNG: the
//! seed is printed (`seed = …`) and `TURND_SEED` replays it.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one scenario from its setup to its last assertion"
)]

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, ensure, Context};
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use turnd_client::turnd_proto::{
    ErrorCode, Event, EventKind, Role, SubmitArgs, Turn, TurnStatus, WaitState,
};
use turnd_client::{Caller, ClientError};
use turnd_testkit::SplitMix64;
use turnd_tests::{all_events, http_get, metric, next_json, raw_peer, BinDaemon};

/// SIGKILLs (each followed by a restart on the same data directory).
const KILLS: usize = 4;
/// Sessions under load, each with its own caller connection.
const SESSIONS: usize = 6;
/// How long the load runs before a kill: a random moment in this range (ms).
const KILL_AFTER_MS: (u64, u64) = (300, 1_500);
/// The raw worker's handlers take a random time in this range (ms) per step.
const STEP_MS: (u64, u64) = (0, 25);
/// Attempts of the at_least_once function: enough that kills never exhaust them.
const ALO_ATTEMPTS: u32 = 50;
const WORKER_ID: &str = "crash-worker";
/// Filler in every input, so that each life writes several MiB and so checkpoints
/// several times (at `TURND_STORAGE__CHECKPOINT_MB=1`).
static PAD: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| "p".repeat(8 * 1024));

/// Daemon settings: short timers so that recovery after each kill is quick.
const ENV: &[(&str, &str)] = &[
    ("TURND_LOG", "error"),
    ("TURND_SERVER__HEARTBEAT_MS", "1000"),
    ("TURND_TURNS__PROBE_TIMEOUT_MS", "300"),
    ("TURND_TURNS__RECONNECT_GRACE_MS", "600"),
    ("TURND_TURNS__CANCEL_GRACE_MS", "300"),
    ("TURND_TURNS__RETRY_BACKOFF_MS", "20"),
    ("TURND_TURNS__DEFAULT_TIMEOUT_MS", "5000"),
    // Small log segments written to sled often, and a checkpoint (close and reopen
    // sled) after every MiB written to it, so that kills land among log trims, writes
    // to sled and checkpoints.
    ("TURND_STORAGE__CHECKPOINT_MB", "1"),
    ("TURND_STORAGE__LOG_SEGMENT_KB", "64"),
    ("TURND_STORAGE__APPLY_INTERVAL_MS", "20"),
    // A new time window of finished turns every 50 ms of load.
    ("TURND_STORAGE__WINDOW_MS", "50"),
];

// ---------------------------------------------------------------- the record

/// A turn the daemon acknowledged.
#[derive(Debug, Clone)]
struct AckedTurn {
    session_id: String,
    function_id: String,
    key: String,
}

/// A result the daemon acknowledged as `applied` (or `late`).
#[derive(Debug, Clone)]
struct AckedResult {
    invocation_id: String,
    session_id: String,
    turn_id: String,
    step: u32,
    /// The `complete` output, when the outcome was `complete`.
    output: Option<Value>,
}

/// An invoke the worker received.
#[derive(Debug, Clone)]
struct Seen {
    function_id: String,
    turn_id: String,
    step: u32,
}

/// Everything acknowledged, from every daemon life.
#[derive(Default)]
struct Record {
    turns: BTreeMap<String, AckedTurn>,
    /// Idempotency key → turn id.
    keys: HashMap<String, String>,
    /// Submits that got no answer (the daemon died): resent after the restart.
    unanswered: Vec<SubmitArgs>,
    deduplicated: u64,
    /// Turns whose acknowledged stop answer carried the stop.
    stops: BTreeMap<String, String>,
    session_stops: u64,
    applied: Vec<AckedResult>,
    late: Vec<AckedResult>,
    /// Other `invocation.result` answers by kind (duplicate, unknown, errors).
    other_answers: BTreeMap<String, u64>,
    invokes: Vec<Seen>,
    kills_after_ms: Vec<u64>,
    /// Store checkpoints of each life, read from /metrics just before its kill.
    checkpoints: Vec<u64>,
    /// Commit log segments each life deleted behind sled, likewise.
    trims: Vec<u64>,
    /// Time windows on disk just before each kill.
    windows: Vec<u64>,
}

type Shared = Arc<Mutex<Record>>;

fn rec(r: &Shared) -> std::sync::MutexGuard<'_, Record> {
    r.lock().unwrap_or_else(|p| p.into_inner())
}

fn rng(r: &Arc<Mutex<SplitMix64>>) -> std::sync::MutexGuard<'_, SplitMix64> {
    r.lock().unwrap_or_else(|p| p.into_inner())
}

// ---------------------------------------------------------------- raw worker

/// What the raw worker knows about one invocation of this life.
#[derive(Debug)]
enum InvState {
    Running {
        cancelled: bool,
    },
    /// Result sent, not yet answered.
    Sent,
    Answered,
}

struct WorkerLife {
    out: mpsc::UnboundedSender<String>,
    next_id: AtomicU64,
    invs: Mutex<HashMap<String, InvState>>,
    /// Request id of a sent result → what it reported.
    pending: Mutex<HashMap<u64, AckedResult>>,
}

impl WorkerLife {
    fn send(&self, op: &str, args: Value) -> u64 {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let frame = json!({"id": id, "op": op, "args": args}).to_string();
        if self.out.send(frame).is_err() {
            // The connection is gone; whatever was not answered is not acknowledged.
        }
        id
    }

    fn invs(&self) -> std::sync::MutexGuard<'_, HashMap<String, InvState>> {
        self.invs.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn pending(&self) -> std::sync::MutexGuard<'_, HashMap<u64, AckedResult>> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// One life of the raw worker: a new instance (as after a worker restart) that says
/// hello, registers `alo` (at_least_once) and `amo` (at_most_once), and serves until
/// its connection ends. Returns once registered.
async fn start_worker(
    url: &str,
    record: Shared,
    prng: Arc<Mutex<SplitMix64>>,
    tasks: &mut JoinSet<()>,
) -> anyhow::Result<()> {
    let (out, mut stream) = raw_peer(url, tasks).await.context("the raw worker")?;
    let life = Arc::new(WorkerLife {
        out,
        next_id: AtomicU64::new(1),
        invs: Mutex::new(HashMap::new()),
        pending: Mutex::new(HashMap::new()),
    });
    let instance = format!("inst-{}", prng_u64(&prng));
    let setup = [
        (
            "hello",
            json!({"protocol": 1, "role": "worker", "token": "t", "worker_id": WORKER_ID,
                   "instance_id": instance, "inflight": [], "finished": []}),
        ),
        (
            "function.register",
            json!({"function_id": "alo", "concurrency": 4, "timeout_ms": 3000,
                   "delivery": "at_least_once", "max_attempts": ALO_ATTEMPTS}),
        ),
        (
            "function.register",
            json!({"function_id": "amo", "concurrency": 4, "timeout_ms": 3000,
                   "delivery": "at_most_once"}),
        ),
    ];
    let mut early_pushes = Vec::new();
    for (op, args) in setup {
        let id = life.send(op, args);
        loop {
            let frame = next_json(&mut stream)
                .await
                .with_context(|| format!("raw worker {op}"))?;
            if frame.get("push").is_some() {
                early_pushes.push(frame);
                continue;
            }
            if frame.get("id") == Some(&json!(id)) {
                ensure!(
                    frame.get("ok").is_some(),
                    "raw worker {op} refused: {frame}"
                );
                break;
            }
        }
    }
    let serve_life = life.clone();
    tasks.spawn(async move {
        for frame in early_pushes {
            on_frame(&serve_life, &record, &prng, frame);
        }
        while let Ok(frame) = next_json(&mut stream).await {
            on_frame(&serve_life, &record, &prng, frame);
        }
    });
    Ok(())
}

fn prng_u64(prng: &Arc<Mutex<SplitMix64>>) -> u64 {
    rng(prng).next_u64()
}

fn str_of<'a>(v: &'a Value, key: &str) -> &'a str {
    v.get(key).and_then(Value::as_str).unwrap_or("")
}

fn on_frame(life: &Arc<WorkerLife>, record: &Shared, prng: &Arc<Mutex<SplitMix64>>, f: Value) {
    match f.get("push").and_then(Value::as_str) {
        Some("invoke") => on_invoke(life, record, prng, &f),
        Some("cancel") => {
            if let Some(InvState::Running { cancelled }) =
                life.invs().get_mut(str_of(&f, "invocation_id"))
            {
                *cancelled = true;
            }
        }
        Some("probe") => {
            let inv = str_of(&f, "invocation_id").to_string();
            let state = match life.invs().get(&inv) {
                Some(InvState::Running { .. }) => "running",
                Some(InvState::Sent) => "finished",
                // Answered, or never received by this instance.
                _ => "unknown",
            };
            life.send(
                "invocation.status",
                json!({"invocation_id": inv, "state": state}),
            );
        }
        Some(_) => {}
        None => {
            let Some(id) = f.get("id").and_then(Value::as_u64) else {
                return;
            };
            let Some(sent) = life.pending().remove(&id) else {
                return;
            };
            life.invs()
                .insert(sent.invocation_id.clone(), InvState::Answered);
            let answer = f
                .pointer("/ok/accepted")
                .and_then(Value::as_str)
                .map(str::to_string)
                .unwrap_or_else(|| format!("error {}", f.pointer("/error/code").unwrap_or(&f)));
            let mut r = rec(record);
            match answer.as_str() {
                "applied" => r.applied.push(sent),
                "late" => r.late.push(sent),
                other => *r.other_answers.entry(other.to_string()).or_default() += 1,
            }
        }
    }
}

fn on_invoke(life: &Arc<WorkerLife>, record: &Shared, prng: &Arc<Mutex<SplitMix64>>, f: &Value) {
    let inv = str_of(f, "invocation_id").to_string();
    let turn_id = str_of(f, "turn_id").to_string();
    let session_id = str_of(f, "session_id").to_string();
    let function_id = str_of(f, "function_id").to_string();
    let step = f.get("step").and_then(Value::as_u64).unwrap_or(0) as u32;
    let steps = f
        .pointer("/input/steps")
        .and_then(Value::as_u64)
        .unwrap_or(1);
    rec(record).invokes.push(Seen {
        function_id,
        turn_id: turn_id.clone(),
        step,
    });
    {
        let mut invs = life.invs();
        if invs.contains_key(&inv) {
            return;
        }
        invs.insert(inv.clone(), InvState::Running { cancelled: false });
    }
    let delay = rng(prng).range(STEP_MS.0, STEP_MS.1);
    let life = life.clone();
    let input = f.get("input").cloned().unwrap_or(Value::Null);
    // The handler: detached on purpose — it ends on its own within STEP_MS, and a
    // result it sends after its connection died is simply never acknowledged.
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(delay)).await;
        let cancelled = matches!(
            life.invs().get(&inv),
            Some(InvState::Running { cancelled: true })
        );
        let output = json!({"turn": turn_id, "step": step, "inv": inv});
        let (outcome, complete) = if cancelled {
            (json!({"cancelled": {"message": "stop"}}), None)
        } else if u64::from(step) + 1 < steps {
            (json!({"continue": input}), None)
        } else {
            (json!({"complete": output}), Some(output))
        };
        let sent = AckedResult {
            invocation_id: inv.clone(),
            session_id,
            turn_id,
            step,
            output: complete,
        };
        life.invs().insert(inv.clone(), InvState::Sent);
        // Register before sending so the answer always finds it.
        let id = life.next_id.fetch_add(1, Ordering::Relaxed);
        life.pending().insert(id, sent);
        let frame = json!({"id": id, "op": "invocation.result",
                           "args": {"invocation_id": inv, "outcome": outcome}})
        .to_string();
        if life.out.send(frame).is_err() {
            life.pending().remove(&id);
        }
    });
}

// ---------------------------------------------------------------- callers

/// One session's caller: submits turns (idempotency keys, random function and step
/// count), sometimes stops one, rarely stops the session, until told to stop or the
/// daemon dies.
async fn session_load(
    url: String,
    session: usize,
    record: Shared,
    prng: Arc<Mutex<SplitMix64>>,
    next_key: Arc<AtomicU64>,
    stop: CancellationToken,
) {
    let Ok(caller) = Caller::connect(&url, None).await else {
        return;
    };
    let session_id = format!("crash-{session}");
    let mut recent: Vec<String> = Vec::new();
    while !stop.is_cancelled() {
        let (alo, steps, pause, stop_one, stop_all) = {
            let mut g = rng(&prng);
            (
                g.chance(0.5),
                g.range(1, 3),
                g.range(10, 60),
                g.chance(0.1),
                g.chance(0.01),
            )
        };
        let n = next_key.fetch_add(1, Ordering::Relaxed);
        let args = SubmitArgs {
            session_id: session_id.clone(),
            function_id: if alo { "alo" } else { "amo" }.into(),
            input: json!({"steps": steps, "n": n, "pad": PAD.as_str()}),
            idempotency_key: Some(format!("{session_id}-k{n}")),
            turn_timeout_ms: None,
            on_busy: None,
        };
        match caller.submit(args.clone()).await {
            Ok(ok) => {
                note_submit(&record, &args, &ok.turn, ok.deduplicated);
                recent.push(ok.turn.turn_id);
            }
            Err(e) if dead(&e) => {
                rec(&record).unanswered.push(args);
                return;
            }
            Err(e) => panic!("submit refused: {e}"),
        }
        if stop_one && !recent.is_empty() {
            let i = rng(&prng).below(recent.len().min(5) as u64) as usize;
            let turn_id = recent[recent.len() - 1 - i].clone();
            match caller.stop(&turn_id, "crash test stop").await {
                Ok(t) => note_stop(&record, &t),
                Err(e) if dead(&e) => return,
                Err(e) => panic!("turn.stop refused: {e}"),
            }
        }
        if stop_all {
            match caller
                .stop_session(&session_id, "crash test session stop")
                .await
            {
                Ok(turns) => {
                    rec(&record).session_stops += 1;
                    for t in &turns {
                        note_stop(&record, t);
                    }
                }
                Err(e) if dead(&e) => return,
                Err(e) => panic!("session.stop refused: {e}"),
            }
        }
        tokio::select! {
            _ = stop.cancelled() => {}
            _ = tokio::time::sleep(Duration::from_millis(pause)) => {}
        }
    }
    caller.connection().close().await;
}

/// The daemon is gone (killed): the request may or may not have been acted on.
fn dead(e: &ClientError) -> bool {
    matches!(e, ClientError::Closed | ClientError::Connect(_))
        || e.code() == Some(ErrorCode::ShuttingDown)
}

fn note_submit(record: &Shared, args: &SubmitArgs, turn: &Turn, deduplicated: bool) {
    let mut r = rec(record);
    let key = args.idempotency_key.clone().unwrap_or_default();
    if let Some(known) = r.keys.get(&key) {
        assert_eq!(
            known, &turn.turn_id,
            "idempotency key {key} answered with a different turn"
        );
    }
    if deduplicated {
        r.deduplicated += 1;
    }
    r.keys.insert(key.clone(), turn.turn_id.clone());
    r.turns.insert(
        turn.turn_id.clone(),
        AckedTurn {
            session_id: args.session_id.clone(),
            function_id: args.function_id.clone(),
            key,
        },
    );
}

fn note_stop(record: &Shared, t: &Turn) {
    if let Some(stop) = &t.stop {
        rec(record)
            .stops
            .insert(t.turn_id.clone(), stop.reason.clone());
    }
}

// ---------------------------------------------------------------- checks

fn detail_str<'a>(e: &'a Event, key: &str) -> Option<&'a str> {
    e.detail.get(key).and_then(Value::as_str)
}

/// FIFO and single-flight over one session's events; returns the number of
/// dispatches seen.
fn check_session_events(session_id: &str, events: &[Event]) -> anyhow::Result<u64> {
    let mut seq_of: BTreeMap<String, u64> = BTreeMap::new();
    let mut terminal: HashSet<String> = HashSet::new();
    let mut inflight: HashMap<String, String> = HashMap::new();
    let mut dispatches = 0;
    for (i, e) in events.iter().enumerate() {
        ensure!(
            e.seq == i as u64 + 1,
            "{session_id}: event #{i} has seq {} (gap or reorder)",
            e.seq
        );
        match e.kind {
            EventKind::Admitted => {
                let seq = e
                    .detail
                    .get("seq")
                    .and_then(Value::as_u64)
                    .context("admitted event without seq")?;
                seq_of.insert(e.turn_id.clone(), seq);
            }
            EventKind::Dispatched | EventKind::Redispatched => {
                if let Some(prev) = detail_str(e, "previous_invocation_id") {
                    inflight.remove(prev);
                }
                let inv = detail_str(e, "invocation_id").context("dispatch without id")?;
                ensure!(
                    inflight.is_empty(),
                    "{session_id}: event {} dispatches {inv} while {:?} is in flight",
                    e.seq,
                    inflight
                );
                let seq = *seq_of
                    .get(&e.turn_id)
                    .with_context(|| format!("dispatch of unadmitted turn {}", e.turn_id))?;
                for (t, s) in &seq_of {
                    ensure!(
                        *s >= seq || terminal.contains(t),
                        "{session_id}: turn {} (seq {seq}) dispatched at event {} while earlier turn {t} (seq {s}) had not ended",
                        e.turn_id,
                        e.seq
                    );
                }
                ensure!(
                    !terminal.contains(&e.turn_id),
                    "{session_id}: terminal turn {} dispatched at event {}",
                    e.turn_id,
                    e.seq
                );
                inflight.insert(inv.to_string(), e.turn_id.clone());
                dispatches += 1;
            }
            EventKind::Result | EventKind::OutcomeUnknown | EventKind::RetryScheduled => {
                if let Some(inv) = detail_str(e, "invocation_id") {
                    inflight.remove(inv);
                }
            }
            EventKind::Completed | EventKind::Failed | EventKind::Cancelled => {
                ensure!(
                    terminal.insert(e.turn_id.clone()),
                    "{session_id}: turn {} has a second terminal event at {}",
                    e.turn_id,
                    e.seq
                );
                inflight.retain(|_, t| t != &e.turn_id);
            }
            _ => {}
        }
    }
    Ok(dispatches)
}

#[derive(Debug, Default)]
struct CheckCounts {
    turns: usize,
    by_status: BTreeMap<&'static str, usize>,
    stops: usize,
    applied: usize,
    late: usize,
    events: usize,
    dispatches: u64,
}

/// Every check of the module doc, against the daemon as it is now. With `all_done`,
/// every turn must also be terminal.
async fn check(op: &Caller, record: &Shared, all_done: bool) -> anyhow::Result<CheckCounts> {
    let mut counts = CheckCounts::default();
    let violations = op.store_check().await.context("store.check")?;
    ensure!(violations.is_empty(), "store.check: {violations:?}");

    let (turns, stops, applied, late, invokes) = {
        let r = rec(record);
        (
            r.turns.clone(),
            r.stops.clone(),
            r.applied.clone(),
            r.late.clone(),
            r.invokes.clone(),
        )
    };
    let mut now: HashMap<String, Turn> = HashMap::new();
    for (turn_id, acked) in &turns {
        let t = match op.get(turn_id).await {
            Ok(t) => t,
            Err(e) => bail!("acknowledged turn {turn_id} ({acked:?}) is gone: {e}"),
        };
        ensure!(
            t.session_id == acked.session_id && t.function_id == acked.function_id,
            "turn {turn_id} changed: {t:?} vs acknowledged {acked:?}"
        );
        if t.status.is_terminal() {
            ensure!(t.wait.is_none(), "terminal turn {turn_id} has a wait");
            if t.status == TurnStatus::Failed {
                ensure!(t.error.is_some(), "failed turn {turn_id} has no cause");
            }
        } else {
            ensure!(!all_done, "turn {turn_id} did not end: {t:?}");
            let wait = t
                .wait
                .as_ref()
                .with_context(|| format!("non-terminal turn {turn_id} shows no wait"))?;
            ensure!(
                !wait.reason.is_empty(),
                "turn {turn_id}: wait without reason"
            );
            let timed = matches!(
                wait.state,
                WaitState::AwaitingResult
                    | WaitState::AwaitingReconnect
                    | WaitState::BackingOff
                    | WaitState::Cancelling
            );
            ensure!(
                !timed || wait.deadline_ms.is_some(),
                "turn {turn_id} waits ({:?}) with no deadline",
                wait.state
            );
        }
        *counts.by_status.entry(t.status.as_str()).or_default() += 1;
        now.insert(turn_id.clone(), t);
    }
    counts.turns = now.len();

    for (turn_id, reason) in &stops {
        let t = now.get(turn_id).context("stopped turn not acknowledged")?;
        ensure!(
            t.stop.is_some(),
            "acknowledged stop ({reason}) of turn {turn_id} is not on the record: {t:?}"
        );
        counts.stops += 1;
    }

    let sessions: HashSet<String> = turns.values().map(|t| t.session_id.clone()).collect();
    let mut results_by_inv: HashMap<String, EventKind> = HashMap::new();
    for s in &sessions {
        let events = all_events(op, s).await?;
        counts.events += events.len();
        counts.dispatches += check_session_events(s, &events)?;
        let admitted: HashSet<&str> = events
            .iter()
            .filter(|e| e.kind == EventKind::Admitted)
            .map(|e| e.turn_id.as_str())
            .collect();
        for (turn_id, acked) in turns.iter().filter(|(_, a)| &a.session_id == s) {
            ensure!(
                admitted.contains(turn_id.as_str()),
                "acknowledged turn {turn_id} ({}) has no admitted event",
                acked.key
            );
        }
        for e in events {
            if matches!(e.kind, EventKind::Result | EventKind::LateResult) {
                if let Some(inv) = detail_str(&e, "invocation_id") {
                    results_by_inv.insert(inv.to_string(), e.kind);
                }
            }
        }
    }
    for a in &applied {
        ensure!(
            results_by_inv.get(&a.invocation_id) == Some(&EventKind::Result),
            "applied result of {} (turn {}, step {}) is not in {}'s events",
            a.invocation_id,
            a.turn_id,
            a.step,
            a.session_id
        );
        if let Some(output) = &a.output {
            let t = now
                .get(&a.turn_id)
                .with_context(|| format!("applied result for unknown turn {}", a.turn_id))?;
            ensure!(
                t.status == TurnStatus::Completed && t.output.as_ref() == Some(output),
                "applied `complete` of {} is not turn {}'s outcome: {t:?}",
                a.invocation_id,
                a.turn_id
            );
        }
        counts.applied += 1;
    }
    for a in &late {
        ensure!(
            results_by_inv.get(&a.invocation_id) == Some(&EventKind::LateResult),
            "acknowledged late result of {} is not in {}'s events",
            a.invocation_id,
            a.session_id
        );
        counts.late += 1;
    }

    let mut amo: HashMap<(String, u32), u32> = HashMap::new();
    for s in invokes.iter().filter(|s| s.function_id == "amo") {
        let n = amo.entry((s.turn_id.clone(), s.step)).or_default();
        *n += 1;
        ensure!(
            *n == 1,
            "at_most_once step {} of turn {} was invoked twice",
            s.step,
            s.turn_id
        );
    }
    Ok(counts)
}

// ---------------------------------------------------------------- the test

async fn restart(data: &Path) -> anyhow::Result<(BinDaemon, Caller)> {
    let d = BinDaemon::start(data, ENV).await.context("restart turnd")?;
    let op = Caller::connect_as(&d.url, Role::Operator, None)
        .await
        .context("operator")?;
    Ok((d, op))
}

/// Resend every submit that got no answer, with its idempotency key.
async fn resend_unanswered(url: &str, record: &Shared) -> anyhow::Result<usize> {
    let pending = std::mem::take(&mut rec(record).unanswered);
    if pending.is_empty() {
        return Ok(0);
    }
    let caller = Caller::connect(url, None).await?;
    for args in &pending {
        let ok = caller.submit(args.clone()).await.context("resend submit")?;
        note_submit(record, args, &ok.turn, ok.deduplicated);
    }
    caller.connection().close().await;
    Ok(pending.len())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_writes_survive_sigkill() -> anyhow::Result<()> {
    let seed = SplitMix64::seed_from_env();
    println!("seed = {seed} (TURND_SEED={seed} replays the same choices)");
    let prng = Arc::new(Mutex::new(SplitMix64::new(seed)));
    let dir = tempfile::tempdir()?;
    let data = dir.path().join("data");
    let record: Shared = Arc::default();
    let next_key = Arc::new(AtomicU64::new(0));
    let started = Instant::now();

    let (mut daemon, mut op) = restart(&data).await?;
    // The raw worker's tasks of the current life; they must outlive the loop.
    let mut worker_tasks = JoinSet::new();
    for cycle in 0..=KILLS {
        let checking = Instant::now();
        let c = check(&op, &record, false)
            .await
            .with_context(|| format!("checks after restart {cycle} (seed {seed})"))?;
        println!(
            "restart {cycle} at {:.1} s: {} turns {:?}, {} stops, {} applied + {} late results, {} events, {} dispatches: all checks pass ({:.1} s)",
            checking.duration_since(started).as_secs_f64(),
            c.turns, c.by_status, c.stops, c.applied, c.late, c.events, c.dispatches,
            checking.elapsed().as_secs_f64()
        );
        let resent = resend_unanswered(&daemon.url, &record).await?;
        start_worker(&daemon.url, record.clone(), prng.clone(), &mut worker_tasks).await?;
        if resent > 0 {
            println!("restart {cycle}: resent {resent} unanswered submits");
        }
        if cycle == KILLS {
            // The last life: no more load and no kill; every turn must end.
            break;
        }
        let load_stop = CancellationToken::new();
        let mut load = JoinSet::new();
        for s in 0..SESSIONS {
            load.spawn(session_load(
                daemon.url.clone(),
                s,
                record.clone(),
                prng.clone(),
                next_key.clone(),
                load_stop.clone(),
            ));
        }
        let after = rng(&prng).range(KILL_AFTER_MS.0, KILL_AFTER_MS.1);
        tokio::time::sleep(Duration::from_millis(after)).await;
        let (_, mut metrics) = http_get(&daemon.admin, "/metrics").await?;
        // A loaded machine writes less before each kill: when no life trimmed the
        // log yet, the last one goes on (up to 5 s) until it did, so that one kill
        // at least lands after a trim.
        let trimmed = |m: &str| metric(m, "turnd_storage_log_trims_total").is_some_and(|t| t > 0.0);
        if cycle + 1 == KILLS && rec(&record).trims.iter().sum::<u64>() == 0 {
            let waited = Instant::now();
            while !trimmed(&metrics) && waited.elapsed() < Duration::from_secs(5) {
                tokio::time::sleep(Duration::from_millis(50)).await;
                metrics = http_get(&daemon.admin, "/metrics").await?.1;
            }
            println!("life {cycle}: waited {:?} for a log trim", waited.elapsed());
        }
        let checkpoints = metric(&metrics, "turnd_storage_checkpoints_total")
            .context("turnd_storage_checkpoints_total in /metrics")?;
        let trims = metric(&metrics, "turnd_storage_log_trims_total")
            .context("turnd_storage_log_trims_total in /metrics")?;
        let windows = metric(&metrics, "turnd_storage_windows")
            .context("turnd_storage_windows in /metrics")?;
        daemon.kill().await.context("SIGKILL turnd")?;
        rec(&record).windows.push(windows as u64);
        rec(&record).checkpoints.push(checkpoints as u64);
        rec(&record).trims.push(trims as u64);
        rec(&record).kills_after_ms.push(after);
        load_stop.cancel();
        while let Some(r) = load.join_next().await {
            r.context("caller task")?;
        }
        worker_tasks.abort_all();
        while worker_tasks.join_next().await.is_some() {}
        (daemon, op) = restart(&data).await?;
    }

    // Drain: every acknowledged turn must end (short timers: a few seconds at most).
    let turn_ids: Vec<String> = rec(&record).turns.keys().cloned().collect();
    let drain_started = Instant::now();
    for turn_id in &turn_ids {
        if let Err(e) = op.wait_terminal(turn_id, Duration::from_secs(20)).await {
            let t = op.get(turn_id).await?;
            let events = all_events(&op, &t.session_id).await?;
            let tail: Vec<String> = events
                .iter()
                .rev()
                .take(12)
                .rev()
                .map(|e| format!("{} {:?} {} {}", e.seq, e.kind, e.turn_id, e.detail))
                .collect();
            bail!(
                "turn {turn_id} did not end ({e}; seed {seed}): {t:?}\nsession: {:?}\nlast events:\n{}",
                op.inspect(&t.session_id).await?,
                tail.join("\n")
            );
        }
    }
    let c = check(&op, &record, true)
        .await
        .with_context(|| format!("final checks (seed {seed})"))?;
    let status = daemon.terminate().await?;
    ensure!(status.success(), "turnd exited with {status} on SIGTERM");

    let r = rec(&record);
    println!(
        "crash test (seed {seed}): {} SIGKILLs at {:?} ms into the load, after {:?} store checkpoints, {:?} log trims and {:?} time windows; {} acknowledged submits ({} answered as deduplicated), {} acknowledged stops ({} session stops), {} applied + {} late results acknowledged, other result answers {:?}, {} invokes received; final: {} turns {:?}, {} events, {} dispatches; drain {:.1} s, total {:.1} s",
        r.kills_after_ms.len(),
        r.kills_after_ms,
        r.checkpoints,
        r.trims,
        r.windows,
        r.turns.len(),
        r.deduplicated,
        r.stops.len(),
        r.session_stops,
        r.applied.len(),
        r.late.len(),
        r.other_answers,
        r.invokes.len(),
        c.turns,
        c.by_status,
        c.events,
        c.dispatches,
        drain_started.elapsed().as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
    ensure!(r.kills_after_ms.len() == KILLS);
    ensure!(
        r.trims.iter().sum::<u64>() > 0,
        "no commit log segment was trimmed before the kills"
    );
    ensure!(
        r.windows.iter().any(|w| *w > 1),
        "no life wrote finished turns to more than one time window"
    );
    ensure!(r.turns.len() >= 50, "too little load to mean anything");
    ensure!(!r.applied.is_empty() && !r.stops.is_empty());
    Ok(())
}
