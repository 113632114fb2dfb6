//! The sessions in memory: each session's cell (its state behind its async mutex),
//! loading a session's meta on first use, letting an idle session go, and the index
//! of every unfinished turn's session.
//!
//! A session is held only while it is in use or has live work. Every user of a
//! session gets its cell as a [`CellRef`]. When the last `CellRef` of a cell is
//! dropped and the session is idle (no unfinished turn, no live invocation, no timer,
//! no pending write), the cell leaves memory; the session's meta in the store,
//! written by every transition, holds all there is to know about it, and its next
//! use reads it back. A read of an unknown session id thus allocates nothing that
//! outlives the request. What stays is the 8-byte hash of each evicted session id
//! that has a meta, so that a session that never existed is still known not to have
//! a meta without a store read.
//!
//! The count of references is checked and dropped under the map's lock, under which
//! every `CellRef` of the map's cells is also made, so two users letting go at once
//! cannot both see the other and leave an idle cell behind. Other holders of the
//! cell (the index of live turns, which only holds sessions with an unfinished turn)
//! simply keep it.

use std::collections::{HashMap, HashSet};
use std::ops::Deref;
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;
use tokio::sync::MutexGuard;
use turnd_proto::turn_id_bits;
use turnd_store::{InvocationRecord, SessionMeta, Store, StoreError, TurnRecord};

use crate::session::SessionState;

/// One session in memory: its state behind the mutex its single writer holds.
pub(crate) struct SessionCell {
    pub(crate) state: tokio::sync::Mutex<SessionState>,
}

/// The sessions in memory (see the module doc).
pub(crate) struct Sessions {
    store: Store,
    /// The sessions in use, by id.
    cells: Mutex<HashMap<Arc<str>, Arc<SessionCell>>>,
    /// The session of every unfinished turn, by the 128 bits of its id, so
    /// `turn.get` and `turn.wait` find a live turn without a store read (a sled read
    /// waits for any group commit being applied). A hint only: a turn missing here,
    /// or no longer in its session, is read from the store.
    live: Mutex<HashMap<u128, Arc<SessionCell>>>,
    /// Hashes of the ids of every session with a meta in the store at start-up, set
    /// once recovery has read them all. A session missing here, from `evicted` and
    /// from memory has no meta, so its first use reads nothing. A collision only
    /// costs a read.
    stored: OnceLock<HashSet<u64>>,
    /// Hashes of the ids of sessions with a meta that left memory since start-up
    /// (8 bytes each, the only trace an idle session leaves in memory).
    evicted: Mutex<HashSet<u64>>,
}

/// A counted use of a session cell; see the module doc.
pub(crate) struct CellRef {
    sessions: Arc<Sessions>,
    cell: Option<Arc<SessionCell>>,
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
            self.sessions.release(cell);
        }
    }
}

impl Sessions {
    /// No session in memory yet; metas are read from `store`.
    pub(crate) fn new(store: Store) -> Sessions {
        Sessions {
            store,
            cells: Mutex::new(HashMap::new()),
            live: Mutex::new(HashMap::new()),
            stored: OnceLock::new(),
            evicted: Mutex::new(HashSet::new()),
        }
    }

    fn counted(self: &Arc<Self>, cell: Arc<SessionCell>) -> CellRef {
        CellRef {
            sessions: self.clone(),
            cell: Some(cell),
        }
    }

    /// The session's cell, made (not yet loaded) when it is not in memory. It leaves
    /// memory again when the returned reference is the last one dropped and the
    /// session is idle.
    pub(crate) fn cell(self: &Arc<Self>, session_id: &str) -> CellRef {
        let mut m = self.cells.lock();
        let cell = match m.get(session_id) {
            Some(cell) => cell.clone(),
            None => {
                let id: Arc<str> = Arc::from(session_id);
                let cell = Arc::new(SessionCell {
                    state: tokio::sync::Mutex::new(SessionState::new(id.clone())),
                });
                m.insert(id, cell.clone());
                cell
            }
        };
        self.counted(cell)
    }

    /// The session's cell if it is in memory.
    pub(crate) fn existing(self: &Arc<Self>, session_id: &str) -> Option<CellRef> {
        let cell = self.cells.lock().get(session_id).cloned()?;
        Some(self.counted(cell))
    }

    /// The session cell of an unfinished turn, if the live-turn index knows it.
    pub(crate) fn of_live_turn(self: &Arc<Self>, turn_id: &str) -> Option<CellRef> {
        let k = turn_id_bits(turn_id)?;
        let cell = self.live.lock().get(&k).cloned()?;
        Some(self.counted(cell))
    }

    /// Whether the live-turn index holds `turn_id`.
    pub(crate) fn is_live(&self, turn_id: &str) -> bool {
        turn_id_bits(turn_id).is_some_and(|k| self.live.lock().contains_key(&k))
    }

    /// Lock a session, loading its meta from the store on first use.
    pub(crate) async fn lock<'a>(
        &self,
        cell: &'a Arc<SessionCell>,
    ) -> Result<MutexGuard<'a, SessionState>, StoreError> {
        // The guard borrows the cell, which the caller keeps alive.
        let mut st = cell.state.lock().await;
        if !st.loaded {
            let maybe_stored = self
                .stored
                .get()
                .is_none_or(|known| known.contains(&session_hash(&st.id)))
                || self.was_evicted(&st.id);
            if maybe_stored {
                if let Some(meta) = self.store.session_meta(&st.id)? {
                    st.meta = meta;
                }
            }
            st.loaded = true;
        }
        Ok(st)
    }

    /// Lock a session with what recovery read of it: its meta, its unfinished turns
    /// (in `seq` order, indexed as live) and the lock holder's live invocation.
    pub(crate) async fn lock_recovered<'a>(
        &self,
        cell: &'a Arc<SessionCell>,
        meta: SessionMeta,
        turns: Vec<TurnRecord>,
        inv: Option<InvocationRecord>,
    ) -> MutexGuard<'a, SessionState> {
        let mut st = cell.state.lock().await;
        if !st.loaded {
            st.meta = meta;
            st.loaded = true;
        }
        let bits: Vec<u128> = turns
            .iter()
            .filter_map(|t| turn_id_bits(&t.turn_id))
            .collect();
        self.track_live(cell, &bits, &[]);
        for t in turns {
            st.active.insert(t);
        }
        if let Some(inv) = inv {
            st.inv = Some(Box::new(inv));
        }
        st
    }

    /// Recovery read every session meta: these are the hashes of their ids.
    pub(crate) fn set_stored(&self, mut known: HashSet<u64>) {
        known.shrink_to_fit();
        if self.stored.set(known).is_err() {
            tracing::warn!("session ids read twice at recovery; keeping the first set");
        }
    }

    /// Every cell in memory.
    pub(crate) fn all(&self) -> Vec<Arc<SessionCell>> {
        self.cells.lock().values().cloned().collect()
    }

    /// Keep the live-turn index in step with a transition: admitted turns in, ended
    /// turns out.
    pub(crate) fn track_live(
        &self,
        cell: &Arc<SessionCell>,
        admitted: &[u128],
        ended: &[TurnRecord],
    ) {
        if admitted.is_empty() && ended.is_empty() {
            return;
        }
        let mut live = self.live.lock();
        for k in admitted {
            live.insert(*k, cell.clone());
        }
        for t in ended {
            if let Some(k) = turn_id_bits(&t.turn_id) {
                live.remove(&k);
            }
        }
        if !ended.is_empty() {
            shrink_after_burst(&mut live);
        }
    }

    /// Entries of the live-turn index.
    pub(crate) fn live_len(&self) -> usize {
        self.live.lock().len()
    }

    /// Sessions in memory.
    pub(crate) fn len(&self) -> usize {
        self.cells.lock().len()
    }

    /// The ids of the sessions in memory, sorted.
    pub(crate) fn ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = self.cells.lock().keys().map(|k| k.to_string()).collect();
        ids.sort();
        ids
    }

    /// Drop a forgotten session's cell from memory, unless someone else holds it
    /// (they would go on with a cell the map no longer knows while a new one could be
    /// made for the same session). The check and the removal happen under the map's
    /// lock, under which every other holder got its reference.
    pub(crate) fn forget(&self, session_id: &str, cell: &Arc<SessionCell>) {
        let mut m = self.cells.lock();
        let ours = m.get(session_id).is_some_and(|c| Arc::ptr_eq(c, cell));
        // The map's reference and the caller's.
        if ours && Arc::strong_count(cell) == 2 {
            m.remove(session_id);
        }
    }

    /// Let go of a cell: evict it when this was its last user and it is idle.
    fn release(&self, cell: Arc<SessionCell>) {
        let mut m = self.cells.lock();
        // The map's reference and this one: nobody else uses the session. A user
        // holding its lock would hold a reference too; `try_lock` never waits.
        if Arc::strong_count(&cell) == 2 {
            if let Ok(st) = cell.state.try_lock() {
                let ours = m.get(&st.id).is_some_and(|c| Arc::ptr_eq(c, &cell));
                if ours && idle(&st) {
                    m.remove(&st.id);
                    shrink_after_burst(&mut m);
                    if st.loaded && st.meta.last_turn_seq > 0 {
                        self.evicted.lock().insert(session_hash(&st.id));
                    }
                }
            }
        }
        // Dropped under the map's lock (see the module doc).
        drop(cell);
        drop(m);
    }

    /// Whether the session left memory with a meta in the store.
    fn was_evicted(&self, session_id: &str) -> bool {
        self.evicted.lock().contains(&session_hash(session_id))
    }
}

/// Whether a session holds nothing that its stored meta does not.
fn idle(st: &SessionState) -> bool {
    st.active.len() == 0 && st.inv.is_none() && st.timer.is_none() && st.pending.is_none()
}

/// A session id's hash for [`Sessions::set_stored`] (SipHash with fixed keys, so the
/// same throughout the process; a collision only costs a store read).
pub(crate) fn session_hash(session_id: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::hash::DefaultHasher::new();
    session_id.hash(&mut h);
    h.finish()
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

#[cfg(test)]
mod tests;
