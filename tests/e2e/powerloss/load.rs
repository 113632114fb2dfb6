//! The load of the power-loss test and its record of every acknowledgement, each
//! with the `CLOCK_MONOTONIC` time it was received, the clock of the recorder's
//! journal: an acknowledgement received before a crash point was sent before it, so
//! what it acknowledged must survive a power loss there.
//!
//! A raw worker (a protocol peer, so that each `invocation.result` answer is seen)
//! serves `pl`, `at_least_once`, with one- to three-step turns; callers submit turns
//! with idempotency keys to a few sessions and stop some.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{ensure, Context};
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use turnd_client::turnd_proto::{ErrorCode, SubmitArgs};
use turnd_client::{Caller, ClientError};
use turnd_powerloss::journal::now_ns;
use turnd_testkit::SplitMix64;
use turnd_tests::{next_json, raw_peer};

pub const FUNCTION: &str = "pl";
const WORKER_ID: &str = "pl-worker";

/// A submit the daemon acknowledged.
#[derive(Debug, Clone)]
pub struct Submit {
    pub turn_id: String,
    pub session_id: String,
    pub t_ack: u64,
}

/// A result the daemon acknowledged as `applied`.
#[derive(Debug, Clone)]
pub struct Applied {
    pub invocation_id: String,
    pub turn_id: String,
    pub session_id: String,
    /// The `complete` output, when it completed the turn.
    pub output: Option<Value>,
    pub t_ack: u64,
}

/// Everything acknowledged, over every life of the daemon.
#[derive(Debug, Default)]
pub struct Acks {
    pub submits: Vec<Submit>,
    /// Turns whose acknowledged stop carried the stop, with the answer's time.
    pub stops: Vec<(String, u64)>,
    pub applied: Vec<Applied>,
    /// The earliest time the test sent anything that could end a turn (a `complete`
    /// result, a stop): retention cannot delete it before that plus its delay.
    pub ends_from: HashMap<String, u64>,
}

impl Acks {
    fn may_end(&mut self, turn_id: &str, t: u64) {
        let e = self.ends_from.entry(turn_id.to_string()).or_insert(t);
        *e = (*e).min(t);
    }
}

pub type Shared = Arc<Mutex<Acks>>;

pub fn acks(a: &Shared) -> std::sync::MutexGuard<'_, Acks> {
    a.lock().unwrap_or_else(|p| p.into_inner())
}

fn dice(r: &Mutex<SplitMix64>) -> std::sync::MutexGuard<'_, SplitMix64> {
    r.lock().unwrap_or_else(|p| p.into_inner())
}

/// What the worker knows of an invocation of its current life.
enum Inv {
    Running { cancelled: bool },
    Sent,
}

struct WorkerLife {
    out: mpsc::UnboundedSender<String>,
    next_id: AtomicU64,
    invs: Mutex<HashMap<String, Inv>>,
    /// Request id of a sent result → what it reported.
    pending: Mutex<HashMap<u64, Applied>>,
}

impl WorkerLife {
    fn invs(&self) -> std::sync::MutexGuard<'_, HashMap<String, Inv>> {
        self.invs.lock().unwrap_or_else(|p| p.into_inner())
    }
    fn pending(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Applied>> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }
    fn send(&self, id: u64, op: &str, args: Value) {
        let frame = json!({"id": id, "op": op, "args": args}).to_string();
        if self.out.send(frame).is_err() {
            // The connection is gone: what it did not take is never acknowledged.
        }
    }
}

/// Connect a new instance of the raw worker, register `pl` and serve it on `tasks`
/// until the connection ends, each step taking a time in `step_ms`.
pub async fn worker(
    url: &str,
    record: Shared,
    seed: u64,
    step_ms: (u64, u64),
    tasks: &mut JoinSet<()>,
) -> anyhow::Result<()> {
    let (out, mut stream) = raw_peer(url, tasks).await?;
    let life = Arc::new(WorkerLife {
        out,
        next_id: AtomicU64::new(1),
        invs: Mutex::new(HashMap::new()),
        pending: Mutex::new(HashMap::new()),
    });
    let setup = [
        (
            "hello",
            json!({"protocol": 1, "role": "worker", "token": "t", "worker_id": WORKER_ID,
                        "instance_id": format!("i-{seed}-{}", now_ns()), "inflight": [], "finished": []}),
        ),
        (
            "function.register",
            json!({"function_id": FUNCTION, "concurrency": 8, "timeout_ms": 5000,
                                     "delivery": "at_least_once", "max_attempts": 50}),
        ),
    ];
    let mut early = Vec::new();
    for (op, args) in setup {
        let id = life.next_id.fetch_add(1, Ordering::Relaxed);
        life.send(id, op, args);
        loop {
            let f = next_json(&mut stream)
                .await
                .with_context(|| format!("worker {op}"))?;
            if f.get("push").is_some() {
                early.push(f);
            } else if f.get("id") == Some(&json!(id)) {
                ensure!(f.get("ok").is_some(), "worker {op} refused: {f}");
                break;
            }
        }
    }
    let serve = Serve {
        life,
        record,
        prng: Mutex::new(SplitMix64::new(seed)),
        step_ms,
    };
    let serve = Arc::new(serve);
    tasks.spawn(async move {
        for f in early {
            on_frame(&serve, &f);
        }
        while let Ok(f) = next_json(&mut stream).await {
            on_frame(&serve, &f);
        }
    });
    Ok(())
}

fn str_of<'a>(v: &'a Value, key: &str) -> &'a str {
    v.get(key).and_then(Value::as_str).unwrap_or("")
}

/// What serving one worker life needs.
struct Serve {
    life: Arc<WorkerLife>,
    record: Shared,
    prng: Mutex<SplitMix64>,
    step_ms: (u64, u64),
}

fn on_frame(serve: &Arc<Serve>, f: &Value) {
    let (life, record) = (&serve.life, &serve.record);
    match f.get("push").and_then(Value::as_str) {
        Some("invoke") => on_invoke(serve, f),
        Some("cancel") => {
            if let Some(Inv::Running { cancelled }) =
                life.invs().get_mut(str_of(f, "invocation_id"))
            {
                *cancelled = true;
            }
        }
        Some("probe") => {
            let inv = str_of(f, "invocation_id").to_string();
            let state = match life.invs().get(&inv) {
                Some(Inv::Running { .. }) => "running",
                Some(Inv::Sent) => "finished",
                None => "unknown",
            };
            let id = life.next_id.fetch_add(1, Ordering::Relaxed);
            life.send(
                id,
                "invocation.status",
                json!({"invocation_id": inv, "state": state}),
            );
        }
        Some(_) => {}
        None => {
            let t_ack = now_ns();
            let Some(id) = f.get("id").and_then(Value::as_u64) else {
                return;
            };
            let Some(mut sent) = life.pending().remove(&id) else {
                return;
            };
            if f.pointer("/ok/accepted").and_then(Value::as_str) == Some("applied") {
                sent.t_ack = t_ack;
                acks(record).applied.push(sent);
            }
        }
    }
}

fn on_invoke(serve: &Arc<Serve>, f: &Value) {
    let (life, record) = (&serve.life, &serve.record);
    let inv = str_of(f, "invocation_id").to_string();
    if life
        .invs()
        .insert(inv.clone(), Inv::Running { cancelled: false })
        .is_some()
    {
        return;
    }
    let turn_id = str_of(f, "turn_id").to_string();
    let session_id = str_of(f, "session_id").to_string();
    let step = f.get("step").and_then(Value::as_u64).unwrap_or(0);
    let steps = f
        .pointer("/input/steps")
        .and_then(Value::as_u64)
        .unwrap_or(1);
    let input = f.get("input").cloned().unwrap_or(Value::Null);
    let delay = dice(&serve.prng).range(serve.step_ms.0, serve.step_ms.1);
    let (life, record) = (life.clone(), record.clone());
    // Detached on purpose: it ends within `delay`, and a result sent after its
    // connection died is simply never acknowledged.
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(delay)).await;
        let cancelled = matches!(
            life.invs().get(&inv),
            Some(Inv::Running { cancelled: true })
        );
        let done = json!({"turn": turn_id, "step": step});
        let (outcome, output) = if cancelled {
            (json!({"cancelled": {"message": "stop"}}), None)
        } else if step + 1 < steps {
            (json!({"continue": input}), None)
        } else {
            acks(&record).may_end(&turn_id, now_ns());
            (json!({"complete": done.clone()}), Some(done))
        };
        life.invs().insert(inv.clone(), Inv::Sent);
        let id = life.next_id.fetch_add(1, Ordering::Relaxed);
        life.pending().insert(
            id,
            Applied {
                invocation_id: inv.clone(),
                turn_id,
                session_id,
                output,
                t_ack: 0,
            },
        );
        life.send(
            id,
            "invocation.result",
            json!({"invocation_id": inv, "outcome": outcome}),
        );
    });
}

/// The daemon is gone: a request may or may not have been acted on.
fn dead(e: &ClientError) -> bool {
    matches!(e, ClientError::Closed | ClientError::Connect(_))
        || e.code() == Some(ErrorCode::ShuttingDown)
}

/// The load's shape.
pub struct Shape {
    /// Bytes of filler in each input, random hexadecimal digits (LZ4 does not make
    /// them much smaller), so that sled checkpoints and the commit log rolls over
    /// within a short run.
    pub pad: usize,
    /// Pause between two submits of one session (ms, at random in the range).
    pub pause_ms: (u64, u64),
    /// Time the worker takes for a step (ms, at random in the range).
    pub step_ms: (u64, u64),
}

/// One session's caller: submits turns (idempotency keys, one to three steps),
/// sometimes stops a recent one, until `stop` or the daemon dies.
pub async fn caller(
    url: String,
    session_id: String,
    shape: Arc<Shape>,
    record: Shared,
    seed: u64,
    stop: CancellationToken,
) {
    let Ok(caller) = Caller::connect(&url, None).await else {
        return;
    };
    let mut prng = SplitMix64::new(seed);
    let pad: String = (0..shape.pad.div_ceil(16))
        .map(|_| format!("{:016x}", prng.next_u64()))
        .collect();
    let mut recent: Vec<String> = Vec::new();
    for n in 0u64.. {
        if stop.is_cancelled() {
            break;
        }
        let args = SubmitArgs {
            session_id: session_id.clone(),
            function_id: FUNCTION.into(),
            input: json!({"steps": prng.range(1, 3), "n": n, "pad": pad}),
            idempotency_key: Some(format!("{session_id}-{seed}-{n}")),
            turn_timeout_ms: None,
            on_busy: None,
        };
        match caller.submit(args).await {
            Ok(ok) => {
                let t_ack = now_ns();
                recent.push(ok.turn.turn_id.clone());
                acks(&record).submits.push(Submit {
                    turn_id: ok.turn.turn_id,
                    session_id: session_id.clone(),
                    t_ack,
                });
            }
            Err(e) if dead(&e) => return,
            Err(e) => panic!("submit refused: {e}"),
        }
        if prng.chance(0.1) {
            let turn_id =
                recent[recent.len() - 1 - prng.below(recent.len().min(4) as u64) as usize].clone();
            acks(&record).may_end(&turn_id, now_ns());
            match caller.stop(&turn_id, "power-loss test stop").await {
                Ok(t) if t.stop.is_some() => acks(&record).stops.push((turn_id, now_ns())),
                Ok(_) => {}
                Err(e) if dead(&e) => return,
                Err(e) => panic!("turn.stop refused: {e}"),
            }
        }
        let pause = prng.range(shape.pause_ms.0, shape.pause_ms.1);
        tokio::select! {
            () = stop.cancelled() => {}
            () = tokio::time::sleep(Duration::from_millis(pause)) => {}
        }
    }
    caller.connection().close().await;
}
