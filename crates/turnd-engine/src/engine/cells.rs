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

/// Give back what a map grew to in a burst once most of it is empty: a map keeps
/// its capacity, so 100,000 sessions queued at once and finished would hold some
/// MB of empty table for good. Shrinks to twice the entries left when fewer than a
/// quarter of its slots are used, so a map that shrank must lose half its entries
/// again before the next shrink: each shrink's rehash is paid for by the removals
/// before it. Small maps are left alone.
pub(crate) fn shrink_after_burst<K: Eq + std::hash::Hash, V, S: std::hash::BuildHasher>(
    m: &mut HashMap<K, V, S>,
) {
    const KEEP: usize = 1024;
    if m.capacity() > KEEP && m.len() < m.capacity() / 4 {
        m.shrink_to((m.len() * 2).max(KEEP));
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
                    shrink_after_burst(&mut m);
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

    /// The ids of the sessions whose state is in memory, sorted: which ones
    /// [`Engine::sessions_in_memory`] counts (for tests and diagnostics; read-only).
    pub fn session_ids_in_memory(&self) -> Vec<String> {
        let mut ids: Vec<String> = self
            .inner
            .sessions
            .lock()
            .keys()
            .map(|k| k.to_string())
            .collect();
        ids.sort();
        ids
    }

    /// Watches held by every connection (for `/metrics`).
    pub fn watch_count(&self) -> usize {
        self.inner.watches.lock().values().map(Vec::len).sum()
    }

    /// `turn.wait` requests registered for a turn's end (for `/metrics`).
    pub fn turn_wait_count(&self) -> usize {
        self.inner.waiters.lock().values().map(Vec::len).sum()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::shrink_after_burst;

    #[test]
    fn a_map_gives_back_its_burst_capacity() {
        let mut m: HashMap<u64, u64> = (0..100_000).map(|i| (i, i)).collect();
        let burst = m.capacity();
        let mut shrinks = 0;
        for i in 0..99_990 {
            m.remove(&i);
            let before = m.capacity();
            shrink_after_burst(&mut m);
            // (`capacity` also drops by one for a removal that leaves a tombstone.)
            if m.capacity() < before * 3 / 4 {
                shrinks += 1;
            }
            // Never more than four slots per entry once past the small size.
            assert!(
                m.capacity() <= 4 * m.len() + 2 * 1024 + 1,
                "{} for {}",
                m.capacity(),
                m.len()
            );
        }
        assert!(
            m.capacity() < burst / 50,
            "{} of {burst} kept",
            m.capacity()
        );
        // Shrinking is rare: a handful of rehashes for 100,000 removals.
        assert!((1..=8).contains(&shrinks), "{shrinks} shrinks");
        // Nothing is shrunk below 1,024 slots.
        assert!(m.capacity() >= 1024 - 16, "{}", m.capacity());
    }
}
