//! `sessions.list`: the sessions with unfinished work, filtered, ordered and paged
//! from an index kept in memory.
//!
//! Every change of a session ends in `Engine::after_change`, which also records what
//! the session's lock holder waits for in a [`WaitIndex`]: one entry per session with
//! an unfinished turn, in ordered sets by wait age and by id, overall, per wait state
//! and per function. A page is a range read of one of those sets from the cursor on,
//! so it costs the page's size (times the log of the number of sessions), not a sort
//! of every session; counts are the sets' sizes. Only the `stuck` filter walks every
//! waiting session (of the function, when one is given), since whether a wait is
//! overdue depends on the time of the request.
//!
//! The rows themselves are built under each listed session's lock with the same
//! `wait_of` as `session.inspect`, so a row shows the session as it is when the row is
//! built. A session that finished, or whose wait no longer matches the filters by
//! then, is left out of the page.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::ops::Bound;
use std::sync::Arc;

use turnd_proto::{SessionOrder, SessionRow, SessionsListArgs, SessionsListOk, WaitState};
use turnd_store::InvWait;

use super::operator::LiveInvocation;
use super::{check_id, page_limit, read_failed, ApiResult, Engine, EngineError, SessionState};
use crate::view::wait_of;

/// What the index records of one session's lock holder.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct WaitEntry<'a> {
    pub state: WaitState,
    pub since_ms: u64,
    pub function_id: &'a str,
    pub deadline_ms: Option<u64>,
    /// For an invocation awaiting its result: when its last sign of life (dispatch or
    /// heartbeat) becomes older than half its `timeout_ms`.
    pub stale_at_ms: Option<u64>,
    /// The lock holder has a live invocation (for `stats`).
    pub inflight: bool,
}

impl<'a> WaitEntry<'a> {
    /// The entry of a session's current lock holder, if it has one.
    pub(super) fn of(
        st: &'a SessionState,
        dispatch_timeout_ms: Option<u64>,
    ) -> Option<WaitEntry<'a>> {
        let h = st.holder()?;
        let w = wait_of(st, h, dispatch_timeout_ms, &|_| String::new(), None);
        let stale_at_ms = match (&st.inv, w.state) {
            (Some(inv), WaitState::AwaitingResult) if inv.wait == InvWait::AwaitingResult => {
                let timeout = inv.settings.timeout_ms;
                let alive = if inv.attempt_deadline_ms >= timeout && inv.attempt_deadline_ms > 0 {
                    inv.attempt_deadline_ms - timeout
                } else {
                    inv.dispatched_at_ms
                };
                Some(alive + timeout / 2)
            }
            _ => None,
        };
        Some(WaitEntry {
            state: w.state,
            since_ms: w.since_ms,
            function_id: &h.function_id,
            deadline_ms: w.deadline_ms,
            stale_at_ms,
            inflight: st.inv.is_some(),
        })
    }
}

/// Which rule makes a wait look stuck: the one `sessions.list`'s `stuck` filter
/// applies, named so that the operator page can say why.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StuckRule {
    /// The wait's deadline has passed and nothing has acted on it yet.
    PastDeadline { deadline_ms: u64 },
    /// It waits for a worker of a function no connected worker serves.
    NoWorker,
    /// Its invocation has shown no sign of life (dispatch or heartbeat) for more than
    /// half its timeout: silent since `stale_at_ms`.
    Silent { stale_at_ms: u64 },
}

impl StuckRule {
    /// The rule in words.
    pub fn describe(&self) -> &'static str {
        match self {
            StuckRule::PastDeadline { .. } => "its wait's deadline has passed",
            StuckRule::NoWorker => "no connected worker serves its function",
            StuckRule::Silent { .. } => {
                "its invocation sent no heartbeat for more than half its timeout"
            }
        }
    }
}

/// Which rule, if any, makes a wait look stuck at `now`: past its deadline, waiting
/// for a worker of a function no connected worker serves, or an invocation silent for
/// more than half its timeout (the first that holds, in that order).
fn stuck_rule(
    state: WaitState,
    deadline_ms: Option<u64>,
    stale_at_ms: Option<u64>,
    served: bool,
    now: u64,
) -> Option<StuckRule> {
    if let Some(d) = deadline_ms.filter(|d| now > *d) {
        return Some(StuckRule::PastDeadline { deadline_ms: d });
    }
    if state == WaitState::AwaitingWorker && !served {
        return Some(StuckRule::NoWorker);
    }
    stale_at_ms
        .filter(|s| now > *s)
        .map(|s| StuckRule::Silent { stale_at_ms: s })
}

impl WaitEntry<'_> {
    /// Which rule, if any, makes this wait look stuck at `now`.
    pub(super) fn stuck(&self, served: &HashSet<String>, now: u64) -> Option<StuckRule> {
        stuck_rule(
            self.state,
            self.deadline_ms,
            self.stale_at_ms,
            served.contains(self.function_id),
            now,
        )
    }
}

struct Indexed {
    state: WaitState,
    since_ms: u64,
    function_id: Arc<str>,
    deadline_ms: Option<u64>,
    stale_at_ms: Option<u64>,
    inflight: bool,
}

impl Indexed {
    fn same(&self, e: &WaitEntry) -> bool {
        self.state == e.state
            && self.since_ms == e.since_ms
            && *self.function_id == *e.function_id
            && self.deadline_ms == e.deadline_ms
            && self.stale_at_ms == e.stale_at_ms
            && self.inflight == e.inflight
    }
}

/// What `stats` reports of the sessions with unfinished work, read from the index's
/// counts and its oldest wait instead of a walk over every session.
#[derive(Debug, Default, PartialEq)]
pub(super) struct Overview {
    /// Sessions with an unfinished turn.
    pub active: u64,
    /// Of those, the ones whose lock holder has a live invocation.
    pub inflight: u64,
    /// Sessions by what their lock holder waits for (states with none left out).
    pub by_state: BTreeMap<WaitState, u64>,
    /// The earliest time a current wait began.
    pub oldest_since_ms: Option<u64>,
}

/// One ordered list of sessions: by wait age and by id.
#[derive(Default)]
struct Lists {
    by_wait: BTreeSet<(u64, Arc<str>)>,
    by_id: BTreeSet<Arc<str>>,
}

impl Lists {
    fn insert(&mut self, since_ms: u64, id: &Arc<str>) {
        self.by_wait.insert((since_ms, id.clone()));
        self.by_id.insert(id.clone());
    }

    fn remove(&mut self, since_ms: u64, id: &Arc<str>) {
        self.by_wait.remove(&(since_ms, id.clone()));
        self.by_id.remove(id);
    }

    /// A listed session's wait started at another time.
    fn move_wait(&mut self, from_ms: u64, to_ms: u64, id: &Arc<str>) {
        self.by_wait.remove(&(from_ms, id.clone()));
        self.by_wait.insert((to_ms, id.clone()));
    }

    fn len(&self) -> u64 {
        self.by_id.len() as u64
    }

    /// Session ids in `order`, strictly after `cursor`.
    fn iter_from<'a>(
        &'a self,
        order: SessionOrder,
        cursor: Option<&'a Cursor>,
    ) -> Box<dyn Iterator<Item = (u64, &'a Arc<str>)> + 'a> {
        match (order, cursor) {
            (SessionOrder::Wait, Some(Cursor::Wait(since, id))) => Box::new(
                self.by_wait
                    .range((Bound::Excluded((*since, id.clone())), Bound::Unbounded))
                    .map(|(s, id)| (*s, id)),
            ),
            (SessionOrder::Id, Some(Cursor::Id(id))) => Box::new(
                self.by_id
                    .range::<Arc<str>, _>((Bound::Excluded(id), Bound::Unbounded))
                    .map(|id| (0, id)),
            ),
            (SessionOrder::Wait, _) => Box::new(self.by_wait.iter().map(|(s, id)| (*s, id))),
            (SessionOrder::Id, _) => Box::new(self.by_id.iter().map(|id| (0, id))),
        }
    }
}

/// Every session with an unfinished turn, by what its lock holder waits for.
#[derive(Default)]
pub(super) struct WaitIndex {
    entries: HashMap<Arc<str>, Indexed>,
    all: Lists,
    by_state: HashMap<WaitState, Lists>,
    by_function: HashMap<Arc<str>, Lists>,
    /// Per function: sessions by wait state.
    function_counts: HashMap<Arc<str>, BTreeMap<WaitState, u64>>,
    /// Entries whose lock holder has a live invocation.
    inflight: u64,
}

static EMPTY: Lists = Lists {
    by_wait: BTreeSet::new(),
    by_id: BTreeSet::new(),
};

impl WaitIndex {
    /// Record a session's lock holder wait (`None`: no unfinished turn). The index
    /// keeps `session_id` itself (the session's one shared id), not a copy.
    pub(super) fn set(&mut self, session_id: &Arc<str>, entry: Option<WaitEntry>) {
        let Some((id, old)) = self.entries.get_key_value(session_id) else {
            if let Some(e) = entry {
                self.insert(session_id.clone(), &e);
            }
            return;
        };
        let Some(e) = entry else {
            let id = id.clone();
            self.remove(&id);
            crate::engine::shrink_after_burst(&mut self.entries);
            return;
        };
        if old.same(&e) {
            return;
        }
        let id = id.clone();
        if *old.function_id != *e.function_id {
            // Another function: every list but the overall one changes.
            self.remove(&id);
            self.insert(id, &e);
            return;
        }
        self.update(&id, &e);
    }

    /// Add a session that has no entry.
    fn insert(&mut self, id: Arc<str>, e: &WaitEntry) {
        let function_id: Arc<str> = match self.by_function.get_key_value(e.function_id) {
            Some((k, _)) => k.clone(),
            None => Arc::from(e.function_id),
        };
        self.all.insert(e.since_ms, &id);
        self.by_state
            .entry(e.state)
            .or_default()
            .insert(e.since_ms, &id);
        self.by_function
            .entry(function_id.clone())
            .or_default()
            .insert(e.since_ms, &id);
        self.count(function_id.clone(), e.state);
        self.inflight += u64::from(e.inflight);
        self.entries.insert(
            id,
            Indexed {
                state: e.state,
                since_ms: e.since_ms,
                function_id,
                deadline_ms: e.deadline_ms,
                stale_at_ms: e.stale_at_ms,
                inflight: e.inflight,
            },
        );
    }

    /// Take a session's entry out of every list.
    fn remove(&mut self, id: &Arc<str>) {
        let Some(o) = self.entries.remove(id) else {
            return;
        };
        self.all.remove(o.since_ms, id);
        if let Some(l) = self.by_state.get_mut(&o.state) {
            l.remove(o.since_ms, id);
        }
        if let Some(l) = self.by_function.get_mut(&*o.function_id) {
            l.remove(o.since_ms, id);
            if l.by_id.is_empty() {
                self.by_function.remove(&*o.function_id);
            }
        }
        self.uncount(&o.function_id, o.state);
        self.inflight -= u64::from(o.inflight);
    }

    fn count(&mut self, function_id: Arc<str>, state: WaitState) {
        *self
            .function_counts
            .entry(function_id)
            .or_default()
            .entry(state)
            .or_insert(0) += 1;
    }

    fn uncount(&mut self, function_id: &str, state: WaitState) {
        if let Some(c) = self.function_counts.get_mut(function_id) {
            if let Some(n) = c.get_mut(&state) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    c.remove(&state);
                }
            }
            if c.is_empty() {
                self.function_counts.remove(function_id);
            }
        }
    }

    /// A new wait of the same function: only what changed moves (the lists by id
    /// of the overall and the function's sets stay as they are).
    fn update(&mut self, id: &Arc<str>, e: &WaitEntry) {
        let Some(o) = self.entries.get_mut(id) else {
            return;
        };
        let (old_state, old_since) = (o.state, o.since_ms);
        self.inflight = self.inflight - u64::from(o.inflight) + u64::from(e.inflight);
        o.state = e.state;
        o.since_ms = e.since_ms;
        o.deadline_ms = e.deadline_ms;
        o.stale_at_ms = e.stale_at_ms;
        o.inflight = e.inflight;
        let function_id = o.function_id.clone();
        if old_since != e.since_ms {
            self.all.move_wait(old_since, e.since_ms, id);
            if let Some(l) = self.by_function.get_mut(&function_id) {
                l.move_wait(old_since, e.since_ms, id);
            }
        }
        if old_state != e.state {
            if let Some(l) = self.by_state.get_mut(&old_state) {
                l.remove(old_since, id);
            }
            self.by_state
                .entry(e.state)
                .or_default()
                .insert(e.since_ms, id);
            self.uncount(&function_id, old_state);
            self.count(function_id, e.state);
        } else if old_since != e.since_ms {
            if let Some(l) = self.by_state.get_mut(&e.state) {
                l.move_wait(old_since, e.since_ms, id);
            }
        }
    }

    /// Sessions in the index (sessions with an unfinished turn).
    #[cfg(test)]
    fn len(&self) -> usize {
        self.entries.len()
    }

    pub(super) fn overview(&self) -> Overview {
        Overview {
            active: self.all.len(),
            inflight: self.inflight,
            by_state: self
                .by_state
                .iter()
                .map(|(s, l)| (*s, l.len()))
                .filter(|(_, n)| *n > 0)
                .collect(),
            oldest_since_ms: self.all.by_wait.first().map(|(since, _)| *since),
        }
    }

    /// Whether a listed session looks stuck at the query's time.
    fn is_stuck(&self, q: &Query<'_>, id: &str) -> bool {
        self.entries.get(id).is_some_and(|e| {
            stuck_rule(
                e.state,
                e.deadline_ms,
                e.stale_at_ms,
                q.served.contains(&*e.function_id),
                q.now,
            )
            .is_some()
        })
    }

    /// Whether a session of the query's source list passes its other filters.
    fn matches(&self, q: &Query<'_>, id: &str) -> bool {
        if let (Some(_), Some(s)) = (q.function_id, q.state) {
            if self.entries.get(id).map(|e| e.state) != Some(s) {
                return false;
            }
        }
        !q.stuck || self.is_stuck(q, id)
    }

    /// The list a query reads: the function's, the state's, or every session.
    fn source(&self, q: &Query<'_>) -> &Lists {
        match (q.function_id, q.state) {
            (Some(f), _) => self.by_function.get(f).unwrap_or(&EMPTY),
            (None, Some(s)) => self.by_state.get(&s).unwrap_or(&EMPTY),
            (None, None) => &self.all,
        }
    }

    /// The cursor of the page before the one the query's cursor starts: `None` for
    /// the first page (no cursor), `Some(None)` when the page before is the first.
    fn previous(&self, q: &Query<'_>) -> Option<Option<Cursor>> {
        let cursor = q.cursor?;
        let source = self.source(q);
        // The page before ends with the cursor's session (inclusive); the session
        // before that page, if any, is the cursor that starts it.
        let back: Box<dyn Iterator<Item = (u64, &Arc<str>)>> = match cursor {
            Cursor::Wait(since, id) => Box::new(
                source
                    .by_wait
                    .range((Bound::Unbounded, Bound::Included((*since, id.clone()))))
                    .rev()
                    .map(|(s, id)| (*s, id)),
            ),
            Cursor::Id(id) => Box::new(
                source
                    .by_id
                    .range::<Arc<str>, _>((Bound::Unbounded, Bound::Included(id)))
                    .rev()
                    .map(|id| (0, id)),
            ),
        };
        let mut seen = 0;
        for (since, id) in back {
            if !self.matches(q, id) {
                continue;
            }
            if seen == q.limit {
                return Some(Some(match q.order {
                    SessionOrder::Wait => Cursor::Wait(since, id.clone()),
                    SessionOrder::Id => Cursor::Id(id.clone()),
                }));
            }
            seen += 1;
        }
        Some(None)
    }

    fn page(&self, q: &Query<'_>) -> Page {
        let source = self.source(q);
        let stuck = |id: &str| self.is_stuck(q, id);
        let mut ids = Vec::new();
        let mut next = None;
        for (since, id) in source.iter_from(q.order, q.cursor) {
            if !self.matches(q, id) {
                continue;
            }
            if ids.len() == q.limit {
                let (since, id) = ids
                    .last()
                    .map(|(s, i): &(u64, Arc<str>)| (*s, i.clone()))
                    .unwrap_or((since, id.clone()));
                next = Some(match q.order {
                    SessionOrder::Wait => Cursor::Wait(since, id),
                    SessionOrder::Id => Cursor::Id(id),
                });
                break;
            }
            ids.push((since, id.clone()));
        }
        let (counts, total) = self.counts(q, source, &stuck);
        Page {
            ids: ids.into_iter().map(|(_, id)| id).collect(),
            next,
            previous: self.previous(q),
            total,
            counts: counts
                .into_iter()
                .map(|(s, n)| (s.as_str().to_string(), n))
                .collect(),
        }
    }

    /// The sessions by wait state a page reports, and the total of its filters:
    /// counted over the stuck ones when only those are asked for.
    fn counts(
        &self,
        q: &Query<'_>,
        source: &Lists,
        stuck: &dyn Fn(&str) -> bool,
    ) -> (BTreeMap<WaitState, u64>, u64) {
        let function = q.function_id;
        let mut counts = BTreeMap::new();
        let total;
        if q.stuck {
            let scope: &Lists = match function {
                Some(f) => self.by_function.get(f).unwrap_or(&EMPTY),
                None => &self.all,
            };
            for id in &scope.by_id {
                if stuck(id) {
                    if let Some(e) = self.entries.get(id) {
                        *counts.entry(e.state).or_insert(0u64) += 1;
                    }
                }
            }
            total = match q.state {
                Some(s) => counts.get(&s).copied().unwrap_or(0),
                None => counts.values().sum(),
            };
        } else {
            match function {
                Some(f) => {
                    if let Some(c) = self.function_counts.get(f) {
                        counts = c.clone();
                    }
                }
                None => {
                    for (s, l) in &self.by_state {
                        if l.len() > 0 {
                            counts.insert(*s, l.len());
                        }
                    }
                }
            }
            total = match q.state {
                Some(s) => counts.get(&s).copied().unwrap_or(0),
                None => source.len(),
            };
        }
        (counts, total)
    }
}

/// Where the previous page ended.
#[derive(Debug, Clone, PartialEq)]
enum Cursor {
    Wait(u64, Arc<str>),
    Id(Arc<str>),
}

impl Cursor {
    fn encode(&self) -> String {
        match self {
            Cursor::Wait(since, id) => format!("w:{since}:{id}"),
            Cursor::Id(id) => format!("i:{id}"),
        }
    }

    fn decode(s: &str, order: SessionOrder) -> Option<Cursor> {
        match order {
            SessionOrder::Wait => {
                let (since, id) = s.strip_prefix("w:")?.split_once(':')?;
                Some(Cursor::Wait(since.parse().ok()?, Arc::from(id)))
            }
            SessionOrder::Id => Some(Cursor::Id(Arc::from(s.strip_prefix("i:")?))),
        }
    }
}

struct Query<'a> {
    state: Option<WaitState>,
    function_id: Option<&'a str>,
    stuck: bool,
    order: SessionOrder,
    limit: usize,
    cursor: Option<&'a Cursor>,
    now: u64,
    /// Functions some connected worker serves.
    served: &'a HashSet<String>,
}

struct Page {
    ids: Vec<Arc<str>>,
    next: Option<Cursor>,
    /// See [`WaitIndex::previous`].
    previous: Option<Option<Cursor>>,
    total: u64,
    counts: BTreeMap<String, u64>,
}

impl Engine {
    /// Turns by status (the counts of `stats`, without its walk over every session).
    pub fn turn_counts(&self) -> turnd_proto::TurnCounts {
        self.inner.counts.lock().clone()
    }

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
            let index = self.wait_index();
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
            let Some(cell) = self.existing_cell(id) else {
                continue;
            };
            let st = self.lock(&cell).await.map_err(read_failed)?;
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

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(state: WaitState, since_ms: u64, f: &str) -> Option<WaitEntry<'_>> {
        Some(WaitEntry {
            state,
            since_ms,
            function_id: f,
            deadline_ms: None,
            stale_at_ms: None,
            inflight: state == WaitState::AwaitingResult,
        })
    }

    fn query<'a>(served: &'a HashSet<String>, order: SessionOrder, limit: usize) -> Query<'a> {
        Query {
            state: None,
            function_id: None,
            stuck: false,
            order,
            limit,
            cursor: None,
            now: 1_000,
            served,
        }
    }

    #[test]
    fn entries_move_between_lists_and_leave() {
        let served = HashSet::new();
        let mut ix = WaitIndex::default();
        ix.set(&Arc::from("s1"), entry(WaitState::AwaitingWorker, 30, "f"));
        ix.set(&Arc::from("s2"), entry(WaitState::AwaitingResult, 10, "g"));
        ix.set(&Arc::from("s3"), entry(WaitState::AwaitingWorker, 20, "f"));
        let p = ix.page(&query(&served, SessionOrder::Wait, 10));
        let ids: Vec<&str> = p.ids.iter().map(|i| &**i).collect();
        assert_eq!(ids, ["s2", "s3", "s1"]);
        assert_eq!(p.total, 3);
        assert_eq!(
            ix.overview(),
            Overview {
                active: 3,
                inflight: 1,
                by_state: [
                    (WaitState::AwaitingWorker, 2),
                    (WaitState::AwaitingResult, 1)
                ]
                .into(),
                oldest_since_ms: Some(10),
            }
        );
        // s2 moves to another state and function; s1 finishes.
        ix.set(&Arc::from("s2"), entry(WaitState::BackingOff, 40, "f"));
        ix.set(&Arc::from("s1"), None);
        let mut q = query(&served, SessionOrder::Wait, 10);
        q.function_id = Some("f");
        let p = ix.page(&q);
        let ids: Vec<&str> = p.ids.iter().map(|i| &**i).collect();
        assert_eq!(ids, ["s3", "s2"]);
        assert_eq!(p.counts.get("backing_off"), Some(&1));
        assert_eq!(p.counts.get("awaiting_worker"), Some(&1));
        assert!(!ix.by_function.contains_key("g"));
        assert!(!ix.function_counts.contains_key("g"));
        assert_eq!(ix.len(), 2);
        assert_eq!(
            ix.overview(),
            Overview {
                active: 2,
                inflight: 0,
                by_state: [(WaitState::AwaitingWorker, 1), (WaitState::BackingOff, 1)].into(),
                oldest_since_ms: Some(20),
            }
        );
    }

    /// Every list and count of an index, without the lists left empty.
    #[allow(clippy::type_complexity)]
    fn contents(
        ix: &WaitIndex,
    ) -> (
        Vec<(u64, String)>,
        Vec<(String, Vec<(u64, String)>, Vec<String>)>,
        Vec<(String, Vec<(WaitState, u64)>)>,
        Vec<(String, WaitState, u64, String)>,
    ) {
        let list = |l: &Lists| -> (Vec<(u64, String)>, Vec<String>) {
            (
                l.by_wait.iter().map(|(s, i)| (*s, i.to_string())).collect(),
                l.by_id.iter().map(|i| i.to_string()).collect(),
            )
        };
        let (all, all_ids) = list(&ix.all);
        assert_eq!(all.len(), all_ids.len());
        let mut lists: Vec<(String, Vec<(u64, String)>, Vec<String>)> = Vec::new();
        for (k, l) in &ix.by_state {
            let (w, i) = list(l);
            if !i.is_empty() {
                lists.push((format!("state {}", k.as_str()), w, i));
            }
        }
        for (k, l) in &ix.by_function {
            let (w, i) = list(l);
            lists.push((format!("function {k}"), w, i));
        }
        lists.sort();
        let mut counts: Vec<(String, Vec<(WaitState, u64)>)> = ix
            .function_counts
            .iter()
            .map(|(f, c)| (f.to_string(), c.iter().map(|(s, n)| (*s, *n)).collect()))
            .collect();
        counts.sort();
        let mut entries: Vec<(String, WaitState, u64, String)> = ix
            .entries
            .iter()
            .map(|(i, e)| {
                (
                    i.to_string(),
                    e.state,
                    e.since_ms,
                    e.function_id.to_string(),
                )
            })
            .collect();
        entries.sort();
        (all, lists, counts, entries)
    }

    /// Entries set over and over (new waits, other states, other functions, ends)
    /// leave the index as one made from the last entries alone.
    #[test]
    fn an_index_changed_in_place_equals_one_built_afresh() {
        let functions = ["f", "g", "h"];
        let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = |n: u64| {
            seed = seed
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (seed >> 33) % n
        };
        let mut ix = WaitIndex::default();
        let mut last: HashMap<String, (WaitState, u64, &str, bool)> = HashMap::new();
        // Whether the holder has a live invocation, apart from its state, so that
        // a change of that alone is a change too.
        let with =
            |e: Option<WaitEntry<'static>>, inflight: bool| e.map(|e| WaitEntry { inflight, ..e });
        for step in 0..5_000 {
            let sid: Arc<str> = Arc::from(format!("s{}", next(12)));
            if next(6) == 0 {
                ix.set(&sid, None);
                last.remove(&*sid);
            } else {
                let state = WaitState::ALL[next(WaitState::ALL.len() as u64) as usize];
                // Few distinct times, so that some changes keep the time.
                let since = next(4);
                let spread = if next(5) == 0 { 3 } else { 1 };
                let f = functions[next(spread) as usize];
                let inflight = next(2) == 0;
                ix.set(&sid, with(entry(state, since, f), inflight));
                last.insert(sid.to_string(), (state, since, f, inflight));
            }
            let mut fresh = WaitIndex::default();
            for (sid, (state, since, f, inflight)) in &last {
                fresh.set(
                    &Arc::from(sid.as_str()),
                    with(entry(*state, *since, f), *inflight),
                );
            }
            assert_eq!(contents(&ix), contents(&fresh), "after step {step}");
            assert_eq!(ix.overview(), fresh.overview(), "after step {step}");
        }
    }

    /// Each page's `previous` is the cursor the page before was read with (`None`
    /// for the first page), in both orders and with a filter that skips sessions.
    #[test]
    fn previous_leads_back_to_the_page_before() {
        let served = HashSet::new();
        let mut ix = WaitIndex::default();
        for i in 0..25u64 {
            let state = if i % 3 == 0 {
                WaitState::BackingOff
            } else {
                WaitState::AwaitingWorker
            };
            ix.set(
                &Arc::from(format!("s{i:02}")),
                entry(state, 100 - i % 5, "f"),
            );
        }
        for (order, state) in [
            (SessionOrder::Wait, None),
            (SessionOrder::Id, None),
            (SessionOrder::Id, Some(WaitState::AwaitingWorker)),
        ] {
            let mut cursors: Vec<Option<Cursor>> = vec![None];
            loop {
                let mut q = query(&served, order, 4);
                q.state = state;
                q.cursor = cursors.last().and_then(|c| c.as_ref());
                let p = ix.page(&q);
                let back = p.previous.clone();
                match cursors.len() {
                    1 => assert_eq!(back, None, "{order:?}: the first page"),
                    n => assert_eq!(back, Some(cursors[n - 2].clone()), "{order:?} page {n}"),
                }
                match p.next {
                    Some(c) => cursors.push(Some(c)),
                    None => break,
                }
            }
            assert!(cursors.len() >= 4, "{order:?}: {}", cursors.len());
        }
    }

    #[test]
    fn pages_follow_the_cursor_without_gaps_or_repeats() {
        let served = HashSet::new();
        let mut ix = WaitIndex::default();
        for i in 0..25u64 {
            ix.set(
                &Arc::from(format!("s{i:02}")),
                entry(WaitState::AwaitingWorker, 100 - i % 5, "f"),
            );
        }
        for order in [SessionOrder::Wait, SessionOrder::Id] {
            let mut seen = Vec::new();
            let mut cursor: Option<Cursor> = None;
            loop {
                let mut q = query(&served, order, 7);
                q.cursor = cursor.as_ref();
                let p = ix.page(&q);
                seen.extend(p.ids.iter().map(|i| i.to_string()));
                match p.next {
                    Some(c) => {
                        let text = c.encode();
                        cursor = Some(Cursor::decode(&text, order).expect("round trip"));
                    }
                    None => break,
                }
            }
            let mut sorted = seen.clone();
            sorted.sort();
            sorted.dedup();
            assert_eq!(sorted.len(), 25, "{order:?}: {seen:?}");
            if order == SessionOrder::Id {
                assert_eq!(seen, sorted);
            }
        }
    }
}
