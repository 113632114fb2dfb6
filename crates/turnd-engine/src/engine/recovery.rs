//! Recovery at start-up: every session meta read in pages, every unfinished turn
//! brought back into memory and its session driven.

use std::collections::{HashSet, VecDeque};
use std::sync::atomic::Ordering;

use turnd_proto::{TurnCounts, TurnStatus};
use turnd_store::{
    CommitTicket, InvocationRecord, Phase, SessionMeta, Store, StoreError, TurnRecord,
};

use super::Engine;
use crate::machine::{self, Tx};
use crate::registry::Assignment;
use crate::sessions::session_hash;

/// A session's write of its recovery, committed while the next sessions are read.
type Recovering = (String, Tx, CommitTicket);

impl Engine {
    /// Install one session's unfinished turns (in `seq` order) at start-up, and queue
    /// the write of its `recovered` transition (a fresh reconnect grace for its
    /// invocation in flight).
    async fn recover_session(
        &self,
        ts: Vec<TurnRecord>,
        meta: SessionMeta,
        now: u64,
        pending: &mut Vec<Recovering>,
    ) -> Result<(), StoreError> {
        let Some(sid) = ts.first().map(|t| t.session_id.clone()) else {
            return Ok(());
        };
        let inv = self.live_invocation(ts.first(), now)?;
        let cell = self.sessions().cell(&sid);
        let st = self.sessions().lock_recovered(&cell, meta, ts, inv).await;
        let mut tx = Tx::new(&st, now);
        machine::recovered(&self.ctx(&st), &mut tx);
        if !tx.is_empty() {
            let batch = tx.batch(&st);
            pending.push((sid, tx, self.inner.store.kv().commit(batch)));
        }
        Ok(())
    }

    /// The live invocation of a recovered lock holder, if it has one, noted in the
    /// registry as assigned to its worker.
    fn live_invocation(
        &self,
        holder: Option<&TurnRecord>,
        now: u64,
    ) -> Result<Option<InvocationRecord>, StoreError> {
        let Some((h, id)) = holder
            .filter(|h| h.phase == Phase::Invoked)
            .and_then(|h| Some((h, h.invocation_id.as_deref()?)))
        else {
            return Ok(None);
        };
        let Some(inv) = self.inner.store.invocation(id)?.filter(|i| i.is_active()) else {
            return Ok(None);
        };
        self.registry().remember_assignment(
            &inv.worker_id,
            &inv.instance_id,
            &inv.invocation_id,
            Assignment {
                session_id: h.session_id.clone(),
                function_id: inv.function_id.clone(),
            },
            now,
        );
        Ok(Some(inv))
    }

    /// Load every non-terminal turn, give every in-flight invocation a fresh reconnect
    /// grace, and re-arm every timer from its stored absolute time.
    pub(super) async fn recover(&self) -> Result<(), StoreError> {
        let store = &self.inner.store;
        let now = self.now_ms();
        let mut pending = Vec::new();
        // One pass over the session metas, page by page: every session is counted, and
        // a session with unfinished turns gets them from its turn list, from the meta's
        // `active_from` on. Memory is bounded by a page.
        let mut metas = MetaCursor::new(store);
        while let Some(meta) = metas.pop()? {
            if meta.active_from.is_none() {
                continue;
            }
            let ts = store.unfinished_turns(&meta)?;
            self.recover_session(ts, meta, now, &mut pending).await?;
        }
        let (totals, known) = metas.finish();
        {
            let mut c = self.inner.counts.lock();
            *c = totals;
        }
        self.sessions().set_stored(known);
        for (sid, tx, ticket) in pending {
            match ticket.await {
                Ok(Ok(())) => {
                    let cell = self.sessions().cell(&sid);
                    let mut st = cell.state.lock().await;
                    let _applied = tx.apply(&mut st);
                }
                Ok(Err(e)) => return Err(e),
                Err(_) => return Err(StoreError::Closed),
            }
        }
        for c in self.sessions().all() {
            let mut st = c.state.lock().await;
            self.after_change(&mut st, Vec::new());
            let sid = st.id.clone();
            let has_holder = st.holder().is_some();
            drop(st);
            if has_holder {
                self.spawn_drive(sid);
            }
        }
        self.inner.recovered.store(true, Ordering::SeqCst);
        Ok(())
    }
}

/// Entries per page when recovery reads the session metas.
const RECOVERY_PAGE: usize = 4096;

/// Walks the session metas in key order, page by page, adding every meta to the
/// totals.
struct MetaCursor<'a> {
    store: &'a Store,
    page: VecDeque<SessionMeta>,
    next: Option<Vec<u8>>,
    totals: TurnCounts,
    /// [`session_hash`] of every meta read.
    known: HashSet<u64>,
}

impl<'a> MetaCursor<'a> {
    fn new(store: &'a Store) -> Self {
        MetaCursor {
            store,
            page: Default::default(),
            next: Some(Store::FIRST.to_vec()),
            totals: TurnCounts::default(),
            known: HashSet::new(),
        }
    }

    /// The next meta in key order, counted into the totals.
    fn pop(&mut self) -> Result<Option<SessionMeta>, StoreError> {
        if self.page.is_empty() {
            let Some(from) = self.next.take() else {
                return Ok(None);
            };
            let (metas, next) = self.store.session_metas_page(&from, RECOVERY_PAGE)?;
            self.page = metas.into();
            self.next = next;
        }
        let m = self.page.pop_front();
        if let Some(m) = &m {
            self.known.insert(session_hash(&m.session_id));
            for s in TurnStatus::ALL {
                *self.totals.get_mut(s) += m.counts.get(s);
            }
        }
        Ok(m)
    }

    /// The totals and the hashes of the session ids of every meta popped (recovery
    /// pops them all).
    fn finish(self) -> (TurnCounts, HashSet<u64>) {
        (self.totals, self.known)
    }
}
