//! The checks after a power loss, against the daemon restarted on what the loss left:
//! `store.check` is clean; every turn an acknowledgement received before the crash
//! point names (its submit; a result of it answered `applied`, which may come before
//! the submit's answer does; a stop of it) is there (unless retention may have
//! deleted it), in its session, with its `admitted` event; every acknowledged stop
//! is on its turn; every result answered `applied` is in its session's events, a
//! `complete` one as the turn's output; each session's events are in `seq` order;
//! and work goes on: a new instance of the worker connects, every unfinished turn
//! ends, and a new turn completes.
//!
//! Turns are read a session's page at a time (`turn.list`); only a turn missing from
//! its session's list is asked for alone (`turn.get`), for the exact answer.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use anyhow::{bail, ensure, Context};
use serde_json::json;
use tokio::task::JoinSet;
use turnd_client::turnd_proto::{
    ErrorCode, EventKind, ListArgs, SubmitArgs, Turn, TurnStatus, PAGE_MAX,
};
use turnd_client::Caller;
use turnd_tests::all_events;

use super::load::{self, Acks, Shared, FUNCTION};

/// What a state must hold.
pub struct Expect<'a> {
    pub acks: &'a Acks,
    /// Acknowledgements received before this time (`CLOCK_MONOTONIC` ns) must have
    /// survived: the crash point's.
    pub before: u64,
    /// Retention may have deleted a turn the test could have ended before this
    /// time: `before`, or the check's own time when retention runs after the restart.
    pub deletable_before: u64,
    /// Retention's `terminal_ms`, in ns.
    pub terminal_ns: u64,
}

impl Expect<'_> {
    fn deletable(&self, turn_id: &str) -> bool {
        self.acks
            .ends_from
            .get(turn_id)
            .is_some_and(|t| t.saturating_add(self.terminal_ns) < self.deletable_before)
    }

    /// The turns an acknowledgement received before the point names (its submit, a
    /// result of it answered `applied`, a stop of it), with their session when known.
    fn required(&self) -> BTreeMap<&str, Option<&str>> {
        let mut out = BTreeMap::new();
        for s in self.acks.submits.iter().filter(|s| s.t_ack < self.before) {
            out.insert(s.turn_id.as_str(), Some(s.session_id.as_str()));
        }
        for a in self.acks.applied.iter().filter(|a| a.t_ack < self.before) {
            out.insert(a.turn_id.as_str(), Some(a.session_id.as_str()));
        }
        for (turn_id, _) in self.acks.stops.iter().filter(|(_, t)| *t < self.before) {
            out.entry(turn_id.as_str()).or_insert(None);
        }
        out
    }

    /// The sessions the acknowledged turns are in.
    fn sessions(&self) -> BTreeSet<&str> {
        self.required().into_values().flatten().collect()
    }

    /// How long before the point the first acknowledgement naming `turn_id` came.
    fn ms_before(&self, turn_id: &str) -> u64 {
        let a = &self.acks;
        let submits = a
            .submits
            .iter()
            .filter(|s| s.turn_id == turn_id)
            .map(|s| s.t_ack);
        let applied = a
            .applied
            .iter()
            .filter(|x| x.turn_id == turn_id)
            .map(|x| x.t_ack);
        let stops = a.stops.iter().filter(|s| s.0 == turn_id).map(|s| s.1);
        let first = submits
            .chain(applied)
            .chain(stops)
            .min()
            .unwrap_or(self.before);
        self.before.saturating_sub(first) / 1_000_000
    }
}

/// What the checks saw.
#[derive(Debug, Default)]
pub struct Counts {
    pub turns: usize,
    /// Acknowledged turns gone, each one retention may have deleted.
    pub retained_away: usize,
    pub stops: usize,
    pub applied: usize,
    pub events: usize,
}

/// Every turn of `session` (with `status`, when given), by id.
async fn list(
    op: &Caller,
    session: &str,
    status: Option<TurnStatus>,
) -> anyhow::Result<HashMap<String, Turn>> {
    let mut out = HashMap::new();
    let mut before_seq = None;
    loop {
        let page = op
            .list(ListArgs {
                session_id: session.to_string(),
                status,
                limit: Some(PAGE_MAX),
                before_seq,
            })
            .await
            .with_context(|| format!("turn.list {session}"))?;
        out.extend(page.turns.into_iter().map(|t| (t.turn_id.clone(), t)));
        match page.next_before_seq {
            Some(seq) => before_seq = Some(seq),
            None => return Ok(out),
        }
    }
}

/// The acknowledged turns there now, by id; Err names one that is gone and that
/// retention cannot have deleted.
async fn present_turns(
    op: &Caller,
    e: &Expect<'_>,
    counts: &mut Counts,
) -> anyhow::Result<HashMap<String, Turn>> {
    let mut listed = HashMap::new();
    for s in e.sessions() {
        listed.extend(list(op, s, None).await?);
    }
    let mut present = HashMap::new();
    for (turn_id, session) in e.required() {
        let got = match listed.remove(turn_id) {
            Some(t) => Ok(t),
            None => op.get(turn_id).await,
        };
        match got {
            Ok(t) => {
                ensure!(
                    session.is_none_or(|s| s == t.session_id),
                    "turn {turn_id} moved: {t:?}"
                );
                present.insert(turn_id.to_string(), t);
            }
            Err(err) if err.code() == Some(ErrorCode::NotFound) && e.deletable(turn_id) => {
                counts.retained_away += 1;
            }
            Err(err) => bail!(
                "acknowledged turn {turn_id} of {} ({} ms before the crash point) is gone: {err}",
                session.unwrap_or("?"),
                e.ms_before(turn_id)
            ),
        }
    }
    Ok(present)
}

/// Every check but the last (work goes on), against the daemon `op` talks to.
pub async fn check(op: &Caller, e: &Expect<'_>) -> anyhow::Result<Counts> {
    let mut counts = Counts::default();
    let violations = op.store_check().await.context("store.check")?;
    ensure!(violations.is_empty(), "store.check: {violations:?}");
    let present = present_turns(op, e, &mut counts).await?;
    counts.turns = present.len();
    for (turn_id, t_ack) in e.acks.stops.iter().filter(|(_, t)| *t < e.before) {
        if let Some(t) = present.get(turn_id) {
            ensure!(
                t.stop.is_some(),
                "acknowledged stop of {turn_id} ({} ms before the crash point) is not on it: {t:?}",
                (e.before - t_ack) / 1_000_000
            );
            counts.stops += 1;
        }
    }
    let mut seen: HashMap<String, EventKind> = HashMap::new();
    for s in e.sessions() {
        let events = all_events(op, s).await?;
        counts.events += events.len();
        ensure!(
            events.windows(2).all(|w| w[0].seq < w[1].seq),
            "{s}: events out of seq order"
        );
        for ev in events {
            match ev.kind {
                EventKind::Admitted => {
                    seen.insert(ev.turn_id, ev.kind);
                }
                EventKind::Result | EventKind::LateResult => {
                    if let Some(inv) = ev.detail.get("invocation_id").and_then(|v| v.as_str()) {
                        seen.insert(inv.to_string(), ev.kind);
                    }
                }
                _ => {}
            }
        }
    }
    for turn_id in present.keys() {
        ensure!(
            seen.get(turn_id) == Some(&EventKind::Admitted),
            "acknowledged turn {turn_id} has no admitted event"
        );
    }
    for a in e.acks.applied.iter().filter(|a| a.t_ack < e.before) {
        // Not there: retention deleted it (`present_turns` let nothing else pass).
        let Some(t) = present.get(&a.turn_id) else {
            continue;
        };
        ensure!(
            seen.get(&a.invocation_id) == Some(&EventKind::Result),
            "applied result {} of turn {} ({} ms before the crash point) is not in {}'s events",
            a.invocation_id,
            a.turn_id,
            (e.before - a.t_ack) / 1_000_000,
            a.session_id
        );
        if let Some(output) = &a.output {
            ensure!(
                t.status == TurnStatus::Completed && t.output.as_ref() == Some(output),
                "applied `complete` {} is not turn {}'s outcome: {t:?}",
                a.invocation_id,
                a.turn_id
            );
        }
        counts.applied += 1;
    }
    Ok(counts)
}

/// The unfinished turns of the acknowledged turns' sessions.
async fn unfinished(op: &Caller, e: &Expect<'_>) -> anyhow::Result<Vec<String>> {
    let mut out = Vec::new();
    for s in e.sessions() {
        for status in [TurnStatus::Queued, TurnStatus::Running] {
            out.extend(list(op, s, Some(status)).await?.into_keys());
        }
    }
    Ok(out)
}

/// Work goes on: a new instance of the worker connects (its tasks on `tasks`), every
/// unfinished turn of the sessions ends, and a new turn completes; within `secs`.
/// Returns how many turns were unfinished at the start.
pub async fn work_goes_on(
    url: &str,
    op: &Caller,
    e: &Expect<'_>,
    record: &Shared,
    tasks: &mut JoinSet<()>,
    secs: u64,
) -> anyhow::Result<usize> {
    load::worker(url, record.clone(), e.before, (0, 5), tasks).await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    let waiting = unfinished(op, e).await?.len();
    loop {
        let left = unfinished(op, e).await?;
        if left.is_empty() {
            break;
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "{} turns did not end after the restart, among them {}",
            left.len(),
            left[0]
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let caller = Caller::connect(url, None).await?;
    let t = caller
        .submit(SubmitArgs {
            session_id: format!("after-{}", e.before),
            function_id: FUNCTION.into(),
            input: json!({"steps": 2}),
            idempotency_key: None,
            turn_timeout_ms: None,
            on_busy: None,
        })
        .await
        .context("a new turn after the restart")?;
    let left = deadline.saturating_duration_since(tokio::time::Instant::now());
    let done = caller.wait_terminal(&t.turn.turn_id, left).await?;
    ensure!(
        done.status == TurnStatus::Completed,
        "the new turn ended {done:?}"
    );
    caller.connection().close().await;
    Ok(waiting)
}
