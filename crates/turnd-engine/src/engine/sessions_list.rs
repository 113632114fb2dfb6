//! `sessions.list`: the sessions with unfinished work, filtered, ordered and paged
//! from the wait index ([`crate::wait_index`]), and what the operator page shows
//! beside a page.
//!
//! The rows themselves are built under each listed session's lock with the same
//! `wait_of` as `session.inspect`, so a row shows the session as it is when the row is
//! built. A session that finished, or whose wait no longer matches the filters by
//! then, is left out of the page.

use std::collections::HashSet;

use turnd_proto::{SessionRow, SessionsListArgs, SessionsListOk};

use super::operator::LiveInvocation;
use super::{check_id, page_limit, read_failed, ApiResult, Engine};
use crate::error::EngineError;
use crate::session::SessionState;
use crate::view::wait_of;
use crate::wait_index::{Cursor, Query, StuckRule, WaitEntry};

impl Engine {
    /// `sessions.list`.
    pub async fn list_sessions(&self, args: SessionsListArgs) -> ApiResult<SessionsListOk> {
        Ok(self.sessions_page(args).await?.list)
    }

    /// A page of `sessions.list` with what the operator page shows beside it: why each
    /// stuck row is stuck, each row's live invocation, and the cursor of the page before.
    pub async fn sessions_page(&self, args: SessionsListArgs) -> ApiResult<SessionsPage> {
        let limit = page_limit(args.limit)?;
        if let Some(f) = &args.function_id {
            check_id("function_id", f)?;
        }
        let order = args.order.unwrap_or_default();
        let cursor = match &args.after {
            Some(a) => Some(Cursor::decode(a, order).ok_or(EngineError::BadCursor)?),
            None => None,
        };
        let stuck = args.stuck.unwrap_or(false);
        let now = self.now_ms();
        let served = self.served_functions();
        let page = {
            let index = self.inner.waits.lock();
            index.page(&Query {
                state: args.state,
                function_id: args.function_id.as_deref(),
                stuck,
                order,
                limit: limit as usize,
                cursor: cursor.as_ref(),
                now,
                served: &served,
            })
        };
        let fmt = self.fmt_ms();
        let mut rows = Vec::with_capacity(page.ids.len());
        let mut details = Vec::with_capacity(page.ids.len());
        for id in &page.ids {
            let Some(cell) = self.sessions().existing(id) else {
                continue;
            };
            let st = self.sessions().lock(&cell).await.map_err(read_failed)?;
            if let Some((row, detail)) = self.session_row(&st, &args, &served, now, &fmt) {
                rows.push(row);
                details.push(detail);
            }
        }
        Ok(SessionsPage {
            list: SessionsListOk {
                sessions: rows,
                next: page.next.map(|c| c.encode()),
                total: page.total,
                counts: page.counts,
            },
            details,
            previous: page.previous.map(|p| p.map(|c| c.encode())),
        })
    }

    /// Functions some connected worker serves. From the workers, not `functions()`,
    /// which counts the waiting sessions of every function.
    pub(super) fn served_functions(&self) -> HashSet<String> {
        self.workers()
            .into_iter()
            .filter(|w| w.connected)
            .flat_map(|w| w.functions)
            .collect()
    }
}

/// A page of `sessions.list` as the operator page shows it.
#[derive(Debug, Clone)]
pub struct SessionsPage {
    /// The page as `sessions.list` answers it.
    pub list: SessionsListOk,
    /// For each row of `list.sessions`, in the same order, what the page adds.
    pub details: Vec<RowDetail>,
    /// Where the page before starts: `None` on the first page, `Some(None)` when the
    /// page before is the first, else the cursor to pass as `after`.
    pub previous: Option<Option<String>>,
}

/// What the operator page shows of a row beyond [`SessionRow`].
#[derive(Debug, Clone)]
pub struct RowDetail {
    /// Why the row is stuck (`Some` exactly when `stuck` is true).
    pub stuck: Option<StuckRule>,
    /// The lock holder's live invocation, when one was dispatched.
    pub invocation: Option<LiveInvocation>,
}

impl Engine {
    /// A page's row for a session, read under its lock; `None` when it no longer has
    /// a lock holder or no longer matches the filters (it moved since the index was
    /// read).
    fn session_row(
        &self,
        st: &SessionState,
        args: &SessionsListArgs,
        served: &HashSet<String>,
        now: u64,
        fmt: &dyn Fn(u64) -> String,
    ) -> Option<(SessionRow, RowDetail)> {
        let h = st.holder()?;
        let wait = wait_of(
            st,
            h,
            self.inner.cfg.turns.dispatch_timeout_ms,
            fmt,
            Some(self.registry().supply(&h.function_id)),
        );
        let entry = WaitEntry::of(st, self.inner.cfg.turns.dispatch_timeout_ms);
        let stuck = entry.as_ref().and_then(|e| e.stuck(served, now));
        if args.state.is_some_and(|s| s != wait.state)
            || args
                .function_id
                .as_ref()
                .is_some_and(|f| *f != h.function_id)
            || (args.stuck.unwrap_or(false) && stuck.is_none())
        {
            return None;
        }
        let row = SessionRow {
            session_id: st.id.to_string(),
            turn_id: h.turn_id.clone(),
            function_id: h.function_id.clone(),
            step: h.step,
            attempt: h.attempt,
            locked_since_ms: h.locked_at_ms.unwrap_or(h.created_at_ms),
            queued: st.active.len().saturating_sub(1) as u64,
            stuck: stuck.is_some(),
            wait,
        };
        let detail = RowDetail {
            stuck,
            invocation: st.inv.as_deref().map(LiveInvocation::of),
        };
        Some((row, detail))
    }
}

/// The `after` of a page of `sessions.list` in `order` that ends with `row`: where
/// a node of a cluster, merging the pages of its partitions, resumes every one.
pub fn sessions_cursor(row: &SessionRow, order: turnd_proto::SessionOrder) -> String {
    match order {
        turnd_proto::SessionOrder::Wait => {
            Cursor::Wait(row.wait.since_ms, row.session_id.as_str().into()).encode()
        }
        turnd_proto::SessionOrder::Id => Cursor::Id(row.session_id.as_str().into()).encode(),
    }
}
