//! Queries: `turn.get`, `turn.wait`, `turn.list`, `session.inspect`, `session.events`,
//! stats, the registry views and `store.check`, and the view of a turn they share.

use std::collections::HashSet;
use std::time::Duration;

use turnd_proto::{
    EventsArgs, EventsOk, Function, ListArgs, ListOk, QueuedTurn, Session, SessionLock,
    SessionStats, Stats, TurnCounts, Violation, Worker, WAIT_DEFAULT_MS, WAIT_MAX_MS,
};
use turnd_store::{check_store, RawJson, StoreError, TurnRecord};

use super::{check_id, page_limit, read_failed, ApiResult, Engine};
use crate::clock::fmt_time;
use crate::error::EngineError;
use crate::registry::Supply;
use crate::session::SessionState;
use crate::view::{to_turn, wait_of};
use crate::TurnView;

impl Engine {
    /// A turn as the session (locked) knows it: from memory if non-terminal, else
    /// from the store.
    pub(super) fn turn_record_locked(
        &self,
        st: &SessionState,
        turn_id: &str,
    ) -> Result<Option<TurnRecord>, StoreError> {
        if let Some(t) = st.find(turn_id) {
            return Ok(Some(t.clone()));
        }
        self.inner.store.turn(turn_id)
    }

    /// A turn's stored record, or `not_found`.
    pub(super) fn stored_turn(&self, turn_id: &str) -> ApiResult<TurnRecord> {
        check_id("turn_id", turn_id)?;
        self.inner
            .store
            .turn(turn_id)
            .map_err(read_failed)?
            .ok_or_else(|| EngineError::NoTurn(turn_id.to_string()))
    }

    /// `turn.get`.
    pub async fn get_turn(&self, turn_id: &str) -> ApiResult<TurnView> {
        // A live turn's id is one this daemon minted, so only ids that pass
        // `check_id` (in `stored_turn`) can be found here.
        if let Some(cell) = self.sessions().of_live_turn(turn_id) {
            let st = self.sessions().lock(&cell).await.map_err(read_failed)?;
            if let Some(t) = st.find(turn_id) {
                return Ok(self.turn_view(&st, t));
            }
            // It ended while we waited for the lock: the store has it.
        }
        let rec = self.stored_turn(turn_id)?;
        if rec.status.is_terminal() {
            return Ok(to_turn(&rec, None));
        }
        let cell = self.sessions().cell(&rec.session_id);
        let st = self.sessions().lock(&cell).await.map_err(read_failed)?;
        let t = self
            .turn_record_locked(&st, turn_id)
            .map_err(read_failed)?
            .unwrap_or(rec);
        Ok(self.turn_view(&st, &t))
    }

    /// `turn.wait`.
    pub async fn wait_turn(&self, turn_id: &str, timeout_ms: Option<u64>) -> ApiResult<TurnView> {
        let timeout = timeout_ms.unwrap_or(WAIT_DEFAULT_MS);
        if timeout > WAIT_MAX_MS {
            return Err(EngineError::out_of_range(
                "timeout_ms",
                format!("at most {WAIT_MAX_MS}"),
            ));
        }
        let rx = self.inner.waiters.add(turn_id);
        // A turn in the index of unfinished turns is waited for without building its
        // view: the notice brings the terminal turn. The waiter is registered first,
        // and a turn leaves the index before its waiters are notified, so a turn found
        // here is notified to this waiter when it ends.
        // What this future holds while it waits is kept small (the rare reads and the
        // turn seen boxed): a daemon may hold one per unfinished turn.
        let seen = if self.sessions().is_live(turn_id) {
            None
        } else {
            match Box::pin(self.get_turn(turn_id)).await {
                Ok(t) if !t.status.is_terminal() => Some(Box::new(t)),
                other => {
                    // The waiter is pruned once its receiver is gone: the turn ended
                    // before the waiter was registered (or is unknown), and no notice
                    // will take it out of the map.
                    drop(rx);
                    self.inner.waiters.prune(turn_id);
                    return other;
                }
            }
        };
        let done = tokio::select! {
            t = rx => t.ok(),
            _ = tokio::time::sleep(Duration::from_millis(timeout)) => None,
            _ = self.inner.shutdown.cancelled() => None,
        };
        self.inner.waiters.prune(turn_id);
        // The terminal turn comes with the notice, as committed; otherwise (timeout,
        // shutdown) the turn as it stands now.
        if let Some(done) = done {
            return Ok(done);
        }
        match (Box::pin(self.get_turn(turn_id)).await, seen) {
            (Ok(t), _) => Ok(t),
            (Err(EngineError::NoTurn(_)), Some(t)) => Ok(*t),
            (Err(e), _) => Err(e),
        }
    }

    /// `turn.list`.
    pub async fn list_turns(&self, args: ListArgs) -> ApiResult<ListOk<RawJson>> {
        let mut turns = Vec::new();
        let next_before_seq = self
            .list_turns_with(args, |st, t| {
                turns.push(self.turn_view(st, t));
                Ok(())
            })
            .await?;
        Ok(ListOk {
            turns,
            next_before_seq,
        })
    }

    /// The page of `turn.list` that `args` asks for, newest first: each turn is
    /// handed to `take` under the session's lock; the answer is `next_before_seq`.
    pub(super) async fn list_turns_with(
        &self,
        args: ListArgs,
        mut take: impl FnMut(&SessionState, &TurnRecord) -> ApiResult<()>,
    ) -> ApiResult<Option<u64>> {
        check_id("session_id", &args.session_id)?;
        let limit = page_limit(args.limit)? as usize;
        let cell = self.sessions().cell(&args.session_id);
        let st = self.sessions().lock(&cell).await.map_err(read_failed)?;
        let mut before = args.before_seq.unwrap_or(u64::MAX);
        let (mut taken, mut last_seq) = (0, None);
        let mut more = true;
        while taken < limit && more {
            let ids = self
                .inner
                .store
                .session_turn_ids(st.meta.keys(), before, 256)
                .map_err(read_failed)?;
            more = ids.len() == 256;
            for (seq, id) in ids {
                before = seq;
                let Some(t) = self.turn_record_locked(&st, &id).map_err(read_failed)? else {
                    continue;
                };
                if args.status.map(|s| s == t.status).unwrap_or(true) {
                    take(&st, &t)?;
                    taken += 1;
                    last_seq = Some(t.seq);
                    if taken == limit {
                        more = seq > 1;
                        break;
                    }
                }
            }
        }
        Ok(if more && before > 1 { last_seq } else { None })
    }

    /// `session.inspect`.
    pub async fn inspect(&self, session_id: &str) -> ApiResult<Session> {
        check_id("session_id", session_id)?;
        let cell = self.sessions().cell(session_id);
        let st = self.sessions().lock(&cell).await.map_err(read_failed)?;
        if st.meta.last_turn_seq == 0 {
            return Err(EngineError::NoSession(session_id.to_string()));
        }
        let fmt = self.fmt_ms();
        let lock = st.holder().map(|h| SessionLock {
            turn_id: h.turn_id.clone(),
            since_ms: h.locked_at_ms.unwrap_or(h.created_at_ms),
            wait: wait_of(
                &st,
                h,
                self.inner.cfg.turns.dispatch_timeout_ms,
                &fmt,
                Some(self.registry().supply(&h.function_id)),
            ),
        });
        let queued = st
            .active
            .iter()
            .skip(1)
            .map(|t| QueuedTurn {
                turn_id: t.turn_id.clone(),
                seq: t.seq,
                function_id: t.function_id.clone(),
                created_at_ms: t.created_at_ms,
            })
            .collect();
        Ok(Session {
            session_id: session_id.to_string(),
            lock,
            queued,
            turns: st.meta.counts.clone(),
            last_event: st.meta.last_event_seq,
        })
    }

    /// `session.events`.
    pub async fn events(&self, args: EventsArgs) -> ApiResult<EventsOk> {
        check_id("session_id", &args.session_id)?;
        let limit = page_limit(args.limit)?;
        let after = args.after.unwrap_or(0);
        let meta = self
            .inner
            .store
            .session_meta(&args.session_id)
            .map_err(read_failed)?;
        let Some(meta) = meta else {
            return Err(EngineError::NoSession(args.session_id.clone()));
        };
        let events = self
            .inner
            .store
            .events(meta.keys(), after, limit as usize)
            .map_err(read_failed)?;
        let next = events.last().map(|e| e.seq).unwrap_or(after);
        Ok(EventsOk { events, next })
    }

    /// `stats`.
    pub fn stats(&self) -> Stats {
        let now = self.now_ms();
        let o = self.inner.waits.lock().overview();
        let blocked = o
            .by_state
            .iter()
            .map(|(s, n)| (s.as_str().to_string(), *n))
            .collect();
        let reg = self.registry();
        Stats {
            sessions: SessionStats {
                active: o.active,
                blocked,
            },
            turns: self.inner.counts.lock().clone(),
            invocations_inflight: o.inflight,
            workers_connected: reg.connected_count(),
            oldest_wait_ms: o.oldest_since_ms.map(|since| now.saturating_sub(since)),
            storage: self.storage_health(),
        }
    }

    pub fn workers(&self) -> Vec<Worker> {
        self.registry().workers()
    }

    pub fn functions(&self) -> Vec<Function> {
        self.registry().functions()
    }

    /// Who could run `function_id` now, and when a worker last served it.
    pub fn supply(&self, function_id: &str) -> Supply {
        self.registry().supply(function_id)
    }

    /// `store.check` on the live store. Its whole-store reads are not one snapshot, so
    /// a turn that moves on between them (it finishes after the turns were read and
    /// before the invocations and metas were) can look inconsistent. A violation is
    /// therefore reported only when a second check, made after the first, finds it
    /// again for the same turn and session: a real one stays until something repairs
    /// it, a torn read does not repeat.
    pub fn check(&self) -> ApiResult<Vec<Violation>> {
        let first = check_store(&self.inner.store).map_err(read_failed)?;
        if first.is_empty() {
            return Ok(first);
        }
        let again = check_store(&self.inner.store).map_err(read_failed)?;
        let key = |v: &Violation| (v.invariant.clone(), v.turn_id.clone(), v.session_id.clone());
        let seen: HashSet<_> = again.iter().map(key).collect();
        Ok(first
            .into_iter()
            .filter(|v| seen.contains(&key(v)))
            .collect())
    }

    /// Turns by status (the counts of `stats`, without its walk over every session).
    pub fn turn_counts(&self) -> TurnCounts {
        self.inner.counts.lock().clone()
    }

    /// Unix ms as a reason string shows them, relative to now.
    pub(super) fn fmt_ms(&self) -> impl Fn(u64) -> String + '_ {
        move |ms| fmt_time(ms, self.now_ms())
    }

    /// The protocol view of a turn of the locked session `st`, with its wait.
    pub(super) fn turn_view(&self, st: &SessionState, t: &TurnRecord) -> TurnView {
        let wait = if t.status.is_terminal() {
            None
        } else {
            Some(wait_of(
                st,
                t,
                self.inner.cfg.turns.dispatch_timeout_ms,
                &self.fmt_ms(),
                Some(self.registry().supply(&t.function_id)),
            ))
        };
        let mut turn = to_turn(t, wait);
        if t.phase == turnd_store::Phase::Invoked {
            turn.progress = self.inner.progress.last(&st.id, &t.turn_id);
        }
        turn
    }
}
