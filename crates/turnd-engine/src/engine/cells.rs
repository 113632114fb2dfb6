//! Session cells in memory: a session is held only while it is in use or has live
//! work.
//!
//! Every user of a session gets its cell as a [`CellRef`]. When the last `CellRef`
//! of a cell is dropped and the session is idle (no unfinished turn, no live
//! invocation, no timer, no pending write), the cell leaves memory; the session's
//! meta in the store, written by every transition, holds all there is to know about
//! it, and its next use reads it back. A read of an unknown session id thus
//! allocates nothing that outlives the request. What stays is the 8-byte hash of
//! each evicted session id that has a meta (`Inner::evicted`), so that a session
//! that never existed is still known not to have a meta without a store read.
//!
//! The count of references is checked and dropped under the map's lock, under which
//! every `CellRef` of the map's cells is also made, so two users letting go at once
//! cannot both see the other and leave an idle cell behind. Other holders of the
//! cell (the index of live turns, which only holds sessions with an unfinished turn)
//! simply keep it.

use std::ops::Deref;

use super::*;

/// A counted use of a session cell; see the module doc.
pub(super) struct CellRef {
    engine: Engine,
    cell: Option<Arc<SessionCell>>,
}

impl CellRef {
    pub(super) fn new(engine: &Engine, cell: Arc<SessionCell>) -> CellRef {
        CellRef {
            engine: engine.clone(),
            cell: Some(cell),
        }
    }
}

impl Deref for CellRef {
    type Target = Arc<SessionCell>;

    fn deref(&self) -> &Arc<SessionCell> {
        // Only `drop` takes the cell out.
        self.cell
            .as_ref()
            .expect("a CellRef holds its cell until dropped")
    }
}

impl Drop for CellRef {
    fn drop(&mut self) {
        if let Some(cell) = self.cell.take() {
            self.engine.release(cell);
        }
    }
}

/// Whether a session holds nothing that its stored meta does not.
fn idle(st: &SessionState) -> bool {
    st.active.len() == 0 && st.inv.is_none() && st.timer.is_none() && st.pending.is_none()
}

impl Engine {
    /// Let go of a cell: evict it when this was its last user and it is idle.
    fn release(&self, cell: Arc<SessionCell>) {
        let mut m = self.inner.sessions.lock();
        // The map's reference and this one: nobody else uses the session. A user
        // holding its lock would hold a reference too; `try_lock` never waits.
        if Arc::strong_count(&cell) == 2 {
            if let Ok(st) = cell.state.try_lock() {
                let ours = m.get(&st.id).is_some_and(|c| Arc::ptr_eq(c, &cell));
                if ours && idle(&st) {
                    m.remove(&st.id);
                    if st.loaded && st.meta.last_turn_seq > 0 {
                        self.inner.evicted.lock().insert(session_hash(&st.id));
                    }
                }
            }
        }
        // Dropped under the map's lock (see the module doc).
        drop(cell);
        drop(m);
    }

    /// Whether the session left memory with a meta in the store.
    pub(super) fn was_evicted(&self, session_id: &str) -> bool {
        self.inner
            .evicted
            .lock()
            .contains(&session_hash(session_id))
    }

    /// Sessions whose state is in memory (for `/metrics`).
    pub fn sessions_in_memory(&self) -> usize {
        self.inner.sessions.lock().len()
    }

    /// Watches held by every connection (for `/metrics`).
    pub fn watch_count(&self) -> usize {
        self.inner.watches.lock().values().map(Vec::len).sum()
    }
}
