//! What every session's lock holder waits for, ordered for `sessions.list` and
//! counted for `stats`.
//!
//! Every change of a session ends in the engine's `after_change`, which records the
//! session's lock holder wait here: one entry per session with an unfinished turn,
//! in ordered sets by wait age and by id, overall, per wait state and per function.
//! A page is a range read of one of those sets from the cursor on, so it costs the
//! page's size (times the log of the number of sessions), not a sort of every
//! session; counts are the sets' sizes. Only the `stuck` filter walks every waiting
//! session (of the function, when one is given), since whether a wait is overdue
//! depends on the time of the request.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::ops::Bound;
use std::sync::Arc;

use turnd_proto::{SessionOrder, WaitState};
use turnd_store::InvWait;

use crate::session::SessionState;
use crate::view::wait_shape;

/// What the index records of one session's lock holder.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct WaitEntry<'a> {
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
    pub(crate) fn of(
        st: &'a SessionState,
        dispatch_timeout_ms: Option<u64>,
    ) -> Option<WaitEntry<'a>> {
        let h = st.holder()?;
        let w = wait_shape(st, h, dispatch_timeout_ms);
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
    pub(crate) fn stuck(&self, served: &HashSet<String>, now: u64) -> Option<StuckRule> {
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
pub(crate) struct Overview {
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
pub(crate) struct WaitIndex {
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
    pub(crate) fn set(&mut self, session_id: &Arc<str>, entry: Option<WaitEntry>) {
        let Some((id, old)) = self.entries.get_key_value(session_id) else {
            if let Some(e) = entry {
                self.insert(session_id.clone(), &e);
            }
            return;
        };
        let Some(e) = entry else {
            let id = id.clone();
            self.remove(&id);
            crate::sessions::shrink_after_burst(&mut self.entries);
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

    pub(crate) fn overview(&self) -> Overview {
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

    pub(crate) fn page(&self, q: &Query<'_>) -> Page {
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
pub(crate) enum Cursor {
    Wait(u64, Arc<str>),
    Id(Arc<str>),
}

impl Cursor {
    pub(crate) fn encode(&self) -> String {
        match self {
            Cursor::Wait(since, id) => format!("w:{since}:{id}"),
            Cursor::Id(id) => format!("i:{id}"),
        }
    }

    pub(crate) fn decode(s: &str, order: SessionOrder) -> Option<Cursor> {
        match order {
            SessionOrder::Wait => {
                let (since, id) = s.strip_prefix("w:")?.split_once(':')?;
                Some(Cursor::Wait(since.parse().ok()?, Arc::from(id)))
            }
            SessionOrder::Id => Some(Cursor::Id(Arc::from(s.strip_prefix("i:")?))),
        }
    }
}

/// What a page of `sessions.list` asks for.
pub(crate) struct Query<'a> {
    pub(crate) state: Option<WaitState>,
    pub(crate) function_id: Option<&'a str>,
    pub(crate) stuck: bool,
    pub(crate) order: SessionOrder,
    pub(crate) limit: usize,
    pub(crate) cursor: Option<&'a Cursor>,
    pub(crate) now: u64,
    /// Functions some connected worker serves.
    pub(crate) served: &'a HashSet<String>,
}

/// A page of session ids, with the cursors around it and the counts.
pub(crate) struct Page {
    pub(crate) ids: Vec<Arc<str>>,
    pub(crate) next: Option<Cursor>,
    /// See [`WaitIndex::previous`].
    pub(crate) previous: Option<Option<Cursor>>,
    pub(crate) total: u64,
    pub(crate) counts: BTreeMap<String, u64>,
}

#[cfg(test)]
mod tests;
