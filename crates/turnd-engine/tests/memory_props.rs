//! Memory follows live work, whatever the order of requests: random sequences of
//! submits, results, reads of known and unknown ids and idle periods (on paused
//! time) leave in memory exactly the sessions with an unfinished turn, index exactly
//! the unfinished turns, keep no function nobody serves or waits for, and read
//! every evicted session back as it was.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one scenario from its setup to its last assertion"
)]

use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;
use serde_json::json;
use tokio::sync::mpsc::Receiver;
use turnd_engine::{Caller, Engine, Outbox};
use turnd_proto::*;
use turnd_store::mem::MemKv;
use turnd_store::{check_store, Store};

mod common;
use common::*;

const SESSIONS: usize = 4;

#[derive(Debug, Clone)]
enum Action {
    /// `turn.submit` to session `s{0}`.
    Submit(usize),
    /// The worker completes the invocation it was sent first, if any.
    Complete,
    /// The worker fails it (not retryable).
    Fail,
    /// `session.inspect` of a session that may or may not have run turns.
    Inspect(usize),
    /// Reads of ids that were never used: inspect, turn.list, session.events,
    /// turn.get, and a submit to a function nobody serves, stopped at once.
    Unknown(u16),
    /// Let paused time pass.
    Idle(u64),
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        4 => (0..SESSIONS).prop_map(Action::Submit),
        4 => Just(Action::Complete),
        1 => Just(Action::Fail),
        2 => (0..SESSIONS).prop_map(Action::Inspect),
        2 => any::<u16>().prop_map(Action::Unknown),
        1 => (1u64..120_000).prop_map(Action::Idle),
    ]
}

/// Turns submitted to each session (which ended how, timers decide as well).
type Submitted = [u64; SESSIONS];

fn session(i: usize) -> String {
    format!("s{i}")
}

/// The next `invoke` pushed to the worker (invocation id, session id), if any; other
/// pushes are skipped.
fn next_invocation(rx: &mut Receiver<String>) -> Option<(String, String)> {
    while let Ok(f) = rx.try_recv() {
        let v: serde_json::Value = serde_json::from_str(&f).expect("frames are JSON");
        if v["push"] == "invoke" {
            let id = v["invocation_id"].as_str()?.to_string();
            return Some((id, v["session_id"].as_str()?.to_string()));
        }
    }
    None
}

/// The store says which sessions have unfinished turns (every read is a real read
/// through the engine); memory must hold exactly those, and nothing more.
async fn check(e: &Engine, submitted: &Submitted) -> Result<(), TestCaseError> {
    let mut live = 0;
    let mut turns = 0;
    for (i, n) in submitted.iter().enumerate() {
        match e.inspect(&session(i)).await {
            Ok(got) => {
                let c = got.turns;
                prop_assert_eq!(
                    c.queued + c.running + c.completed + c.failed + c.cancelled,
                    *n
                );
                let unfinished = c.queued + c.running;
                turns += unfinished;
                live += usize::from(unfinished > 0);
            }
            Err(x) => {
                prop_assert!(
                    matches!(x, turnd_engine::EngineError::NoSession(_)),
                    "{x:?}"
                );
                prop_assert_eq!(*n, 0);
            }
        }
    }
    settle().await;
    prop_assert_eq!(
        e.sessions_in_memory(),
        live,
        "sessions in memory; submitted {:?}",
        submitted
    );
    prop_assert_eq!(e.live_turn_index_len() as u64, turns);
    let functions: Vec<String> = e.functions().into_iter().map(|f| f.function_id).collect();
    prop_assert_eq!(functions, vec!["f".to_string()]);
    Ok(())
}

async fn run(actions: Vec<Action>) -> Result<(), TestCaseError> {
    let store = Store::new(Arc::new(MemKv::new()));
    let e = open(&store).await;
    let (ob, mut rx) = Outbox::new("c1".into(), 1024);
    e.worker_hello(&hello("w", "i1"), ob)
        .await
        .map_err(|x| TestCaseError::fail(format!("{x:?}")))?;
    e.register("w", &register("f", Delivery::AtLeastOnce))
        .map_err(|x| TestCaseError::fail(format!("{x:?}")))?;
    let worker = Caller {
        role: Role::Worker,
        worker_id: Some("w".into()),
    };
    let mut submitted: Submitted = [0; SESSIONS];
    // Invocation id → session index, in dispatch order.
    let mut sent: Vec<(String, usize)> = Vec::new();
    // Sessions made for a turn to a function nobody serves, one per `Unknown`.
    let mut stopped = 0u32;
    for a in actions {
        match a {
            Action::Submit(s) => {
                e.submit(submit(&session(s), "f"))
                    .await
                    .map_err(|x| TestCaseError::fail(format!("submit: {x:?}")))?;
                submitted[s] += 1;
            }
            Action::Complete | Action::Fail => {
                settle().await;
                while let Some((inv, sid)) = next_invocation(&mut rx) {
                    let s = (0..SESSIONS).find(|i| session(*i) == sid);
                    prop_assert!(s.is_some(), "invoked for {}", sid);
                    sent.push((inv, s.unwrap_or_default()));
                }
                if sent.is_empty() {
                    continue;
                }
                // An invocation given up on meanwhile gets a late result.
                let (inv, _) = sent.remove(0);
                let outcome = if matches!(a, Action::Complete) {
                    Outcome::Complete(json!({"done": true}))
                } else {
                    Outcome::Fail(Failure {
                        code: "no".into(),
                        message: "failed on purpose".into(),
                        retryable: false,
                    })
                };
                e.result(
                    &worker,
                    ResultArgs {
                        invocation_id: inv,
                        outcome,
                    },
                )
                .await
                .map_err(|x| TestCaseError::fail(format!("result: {x:?}")))?;
            }
            Action::Inspect(s) => {
                // Read back while the worker may be mid-turn: the counts add up.
                if let Ok(got) = e.inspect(&session(s)).await {
                    let c = got.turns;
                    let all = c.queued + c.running + c.completed + c.failed + c.cancelled;
                    prop_assert_eq!(all, submitted[s]);
                } else {
                    prop_assert_eq!(submitted[s], 0);
                }
            }
            Action::Unknown(n) => {
                let id = format!("u{n}");
                prop_assert!(e.inspect(&id).await.is_err());
                let listed = e
                    .list_turns(ListArgs {
                        session_id: id.clone(),
                        status: None,
                        limit: None,
                        before_seq: None,
                    })
                    .await;
                prop_assert!(listed.map_or(true, |l| l.turns.is_empty()));
                let events = e
                    .events(EventsArgs {
                        session_id: id.clone(),
                        after: None,
                        limit: None,
                    })
                    .await;
                prop_assert!(events.map_or(true, |l| l.events.is_empty()));
                let turn_id = format!("t_{:032x}", u128::from(n) + 1);
                let got = e.get_turn(&turn_id).await;
                prop_assert!(got.is_err(), "turn.get of an unknown id: {:?}", got);
                // A function nobody serves is known while a session waits for it,
                // and forgotten once none does.
                stopped += 1;
                let id = format!("x{stopped}");
                let t = e
                    .submit(submit(&id, &format!("nobody{n}")))
                    .await
                    .map_err(|x| TestCaseError::fail(format!("submit: {x:?}")))?
                    .turn;
                e.stop_turn(&t.turn_id, None)
                    .await
                    .map_err(|x| TestCaseError::fail(format!("stop: {x:?}")))?;
                settle().await;
                // Its session ran a turn, so it is read back, then left again.
                let got = e
                    .inspect(&id)
                    .await
                    .map_err(|x| TestCaseError::fail(format!("inspect: {x:?}")))?;
                prop_assert_eq!(got.turns.cancelled, 1);
            }
            Action::Idle(ms) => {
                tokio::time::advance(Duration::from_millis(ms)).await;
            }
        }
        settle().await;
        check(&e, &submitted).await?;
    }
    let violations = check_store(&store).map_err(|x| TestCaseError::fail(format!("{x:?}")))?;
    prop_assert!(violations.is_empty(), "{:?}", violations);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn memory_holds_exactly_the_live_sessions(actions in prop::collection::vec(action(), 1..48)) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .map_err(|x| TestCaseError::fail(x.to_string()))?;
        rt.block_on(run(actions))?;
    }
}
