//! The progress of live invocations: which invocation of each session may send
//! `invocation.progress` now, the `seq` it has reached and its last frame.
//!
//! Progress is not durable and not a step, so it is kept here, beside the sessions
//! rather than in them: a progress frame is taken under this table's short lock,
//! never a session's, and so never waits for a session's write (and never holds
//! back its turn). The table follows the sessions: after every change of a session
//! the engine tells it which invocation, if any, is the session's live one whose
//! turn has no stop request ([`ProgressTable::sync`]); a frame from any other
//! invocation is refused. A new invocation starts again at `seq` 1; the last frame
//! goes with its invocation.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;
use serde_json::value::RawValue;
use turnd_proto::ProgressView;
use turnd_store::RawJson;

use crate::session::SessionState;

/// The invocation of a session that may send progress, and what it sent last.
#[derive(Debug)]
struct Live {
    invocation_id: String,
    turn_id: String,
    worker_id: String,
    step: u32,
    attempt: u32,
    seq: u64,
    /// The last frame's data and when it came (Unix ms).
    last: Option<(RawJson, u64)>,
}

/// A progress frame taken: where it belongs and its number.
#[derive(Debug, Clone)]
pub(crate) struct Taken {
    pub session_id: Arc<str>,
    pub turn_id: String,
    pub invocation_id: String,
    pub step: u32,
    pub attempt: u32,
    pub seq: u64,
}

/// Why a frame was not taken.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Refused {
    /// No session's live invocation (any more), or its turn is being stopped.
    NotCurrent,
    /// Live, but dispatched to another worker.
    OtherWorker,
}

#[derive(Default)]
struct Table {
    by_session: HashMap<Arc<str>, Live>,
    /// Invocation id → its session, for the sessions in `by_session`.
    sessions: HashMap<String, Arc<str>>,
}

/// Every session's live invocation's progress (see the module doc).
#[derive(Default)]
pub(crate) struct ProgressTable {
    inner: Mutex<Table>,
}

impl ProgressTable {
    /// Bring the session's entry in step with its state: its live invocation, while
    /// its turn has no stop request, may send progress; any other entry goes.
    pub(crate) fn sync(&self, st: &SessionState) {
        let live = st.inv.as_deref().filter(|i| {
            i.is_active()
                && st
                    .find(&i.turn_id)
                    .is_some_and(|t| t.stop.is_none() && !t.status.is_terminal())
        });
        let mut t = self.inner.lock();
        let same = t
            .by_session
            .get(&st.id)
            .map(|l| Some(l.invocation_id.as_str()) == live.map(|i| i.invocation_id.as_str()));
        match (same, live) {
            (Some(true), _) | (None, None) => {}
            (_, live) => {
                if let Some(old) = t.by_session.remove(&st.id) {
                    t.sessions.remove(&old.invocation_id);
                }
                if let Some(i) = live {
                    t.sessions.insert(i.invocation_id.clone(), st.id.clone());
                    t.by_session.insert(
                        st.id.clone(),
                        Live {
                            invocation_id: i.invocation_id.clone(),
                            turn_id: i.turn_id.clone(),
                            worker_id: i.worker_id.clone(),
                            step: i.step,
                            attempt: i.attempt,
                            seq: 0,
                            last: None,
                        },
                    );
                }
            }
        }
    }

    /// Take a frame of `invocation_id` from `worker` (`None`: an operator, who may
    /// send it for any), then hand it to `publish` under the table's lock, so that
    /// frames reach watchers in `seq` order.
    pub(crate) fn take<R>(
        &self,
        invocation_id: &str,
        worker: Option<&str>,
        data: RawJson,
        now: u64,
        publish: impl FnOnce(&Taken, &RawValue) -> R,
    ) -> Result<R, Refused> {
        let mut t = self.inner.lock();
        let sid = t
            .sessions
            .get(invocation_id)
            .cloned()
            .ok_or(Refused::NotCurrent)?;
        let live = t.by_session.get_mut(&sid).ok_or(Refused::NotCurrent)?;
        if worker.is_some_and(|w| w != live.worker_id) {
            return Err(Refused::OtherWorker);
        }
        live.seq += 1;
        let taken = Taken {
            session_id: sid,
            turn_id: live.turn_id.clone(),
            invocation_id: live.invocation_id.clone(),
            step: live.step,
            attempt: live.attempt,
            seq: live.seq,
        };
        let (data, _) = live.last.insert((data, now));
        Ok(publish(&taken, data.as_raw()))
    }

    /// The last progress frame of the turn `turn_id` of session `session_id`, while
    /// its invocation is live.
    pub(crate) fn last(&self, session_id: &str, turn_id: &str) -> Option<ProgressView> {
        let t = self.inner.lock();
        let live = t.by_session.get(session_id)?;
        let (data, at_ms) = live.last.as_ref().filter(|_| live.turn_id == turn_id)?;
        Some(ProgressView {
            invocation_id: live.invocation_id.clone(),
            step: live.step,
            attempt: live.attempt,
            seq: live.seq,
            data: serde_json::from_str(data.as_str()).unwrap_or_default(),
            at_ms: *at_ms,
        })
    }

    /// Invocations that may send progress now (for `/metrics`).
    pub(crate) fn len(&self) -> usize {
        self.inner.lock().by_session.len()
    }
}
