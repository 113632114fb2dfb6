//! What the operator page reads beyond the protocol's own views: what a session's
//! lock holder is blocked on (with why it looks stuck and how many attempts it may
//! make), and a session's turns with the worker that ran each. Read-only, answered
//! under the session's lock like `session.inspect`.

use turnd_proto::ListArgs;
use turnd_store::InvocationRecord;

use super::{check_id, read_failed, ApiResult, Engine};
use crate::wait_index::{StuckRule, WaitEntry};
use crate::TurnView;

/// What a session's lock holder is blocked on, for an operator's view of one session.
#[derive(Debug, Clone)]
pub struct BlockedOn {
    /// The lock holder as `turn.get` shows it (with its wait).
    pub turn: TurnView,
    pub locked_since_ms: u64,
    /// The live invocation, when one was dispatched.
    pub invocation: Option<LiveInvocation>,
    /// The error of the last failed attempt, if any.
    pub last_failure: Option<String>,
    /// Why the session looks stuck, by the rule `sessions.list`'s `stuck` applies.
    pub stuck: Option<StuckRule>,
    /// Attempts the current step may make: the settings its last invocation was
    /// dispatched with, else the function's registration (`None`: not known yet).
    pub max_attempts: Option<u32>,
}

/// The lock holder's live invocation.
#[derive(Debug, Clone)]
pub struct LiveInvocation {
    pub invocation_id: String,
    pub worker_id: String,
    pub instance_id: String,
    pub step: u32,
    pub attempt: u32,
    pub dispatched_at_ms: u64,
    /// The last heartbeat, when one arrived after the dispatch.
    pub last_heartbeat_ms: Option<u64>,
    pub timeout_ms: u64,
    pub deadline_ms: u64,
}

impl LiveInvocation {
    pub(super) fn of(inv: &InvocationRecord) -> LiveInvocation {
        let timeout = inv.settings.timeout_ms;
        // A heartbeat moves the attempt's deadline to `timeout_ms` after it.
        let alive = inv.attempt_deadline_ms.saturating_sub(timeout);
        LiveInvocation {
            invocation_id: inv.invocation_id.clone(),
            worker_id: inv.worker_id.clone(),
            instance_id: inv.instance_id.clone(),
            step: inv.step,
            attempt: inv.attempt,
            dispatched_at_ms: inv.dispatched_at_ms,
            last_heartbeat_ms: (alive > inv.dispatched_at_ms).then_some(alive),
            timeout_ms: timeout,
            deadline_ms: inv.deadline_ms,
        }
    }

    /// The last sign of life: the last heartbeat, else the dispatch.
    pub fn last_sign_ms(&self) -> u64 {
        self.last_heartbeat_ms.unwrap_or(self.dispatched_at_ms)
    }
}

/// A turn of a session with the invocation that ran it last and its worker.
#[derive(Debug, Clone)]
pub struct TurnRun {
    pub turn: TurnView,
    /// The current (or last) invocation, when the turn was dispatched.
    pub invocation_id: Option<String>,
    /// Its worker, when the invocation's record is still there.
    pub worker_id: Option<String>,
}

/// A page of a session's turns, newest first, as `turn.list` pages them.
#[derive(Debug, Clone)]
pub struct TurnRuns {
    pub turns: Vec<TurnRun>,
    pub next_before_seq: Option<u64>,
}

impl Engine {
    /// The lock holder of `session_id` and what it is blocked on (`None`: the session
    /// has no unfinished turn). Answered from memory, under the session's lock.
    pub async fn blocked_on(&self, session_id: &str) -> ApiResult<Option<BlockedOn>> {
        check_id("session_id", session_id)?;
        let Some(cell) = self.sessions().existing(session_id) else {
            return Ok(None);
        };
        let served = self.served_functions();
        let now = self.now_ms();
        let st = self.sessions().lock(&cell).await.map_err(read_failed)?;
        let Some(h) = st.holder() else {
            return Ok(None);
        };
        let stuck = WaitEntry::of(&st, self.inner.cfg.turns.dispatch_timeout_ms)
            .and_then(|e| e.stuck(&served, now));
        let max_attempts = match (&st.inv, &h.invocation_id) {
            (Some(inv), _) => Some(inv.settings.max_attempts),
            (None, Some(id)) => self
                .inner
                .store
                .invocation(id)
                .map_err(read_failed)?
                .map(|inv| inv.settings.max_attempts),
            (None, None) => None,
        }
        .or_else(|| {
            self.functions()
                .into_iter()
                .find(|f| f.function_id == h.function_id && f.registered)
                .map(|f| f.max_attempts)
        });
        Ok(Some(BlockedOn {
            turn: self.turn_view(&st, h),
            locked_since_ms: h.locked_at_ms.unwrap_or(h.created_at_ms),
            invocation: st.inv.as_deref().map(LiveInvocation::of),
            last_failure: h.last_error.clone(),
            stuck,
            max_attempts,
        }))
    }

    /// `turn.list` with the invocation and worker that ran each turn last.
    pub async fn turn_runs(&self, args: ListArgs) -> ApiResult<TurnRuns> {
        let mut runs = Vec::new();
        let next_before_seq = self
            .list_turns_with(args, |st, t| {
                let worker_id = match (&st.inv, &t.invocation_id) {
                    (Some(inv), Some(id)) if inv.invocation_id == *id => {
                        Some(inv.worker_id.clone())
                    }
                    (_, Some(id)) => self
                        .inner
                        .store
                        .invocation(id)
                        .map_err(read_failed)?
                        .map(|inv| inv.worker_id),
                    (_, None) => None,
                };
                runs.push(TurnRun {
                    turn: self.turn_view(st, t),
                    invocation_id: t.invocation_id.clone(),
                    worker_id,
                });
                Ok(())
            })
            .await?;
        Ok(TurnRuns {
            turns: runs,
            next_before_seq,
        })
    }
}
