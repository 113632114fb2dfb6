//! Where each session's visible events start, as far as reads have found out.
//!
//! Retention leaves the event values of the turns it deletes to their time window's
//! drop (`engine/retention`), and [`crate::Store::events`] passes over them: it checks
//! each event's turn. A long-lived session can hold up to a window's worth of such
//! events before its first visible one, and a read from `after = 0` would pass over
//! all of them every time. So a read that finds a run of hidden events right at the
//! start of what it may skip remembers where the run ends, and the next read starts
//! there.
//!
//! A mark `m` of a session says: no event of it with `seq <= m` will ever be visible
//! again. Retention only deletes turns, and new events take higher sequence numbers,
//! so that stays true until the session is forgotten and used again from `seq` 1.
//! [`Marks::forgot`] is called once that forgetting is committed: it drops the mark
//! and moves the generation on, so that a read which started before (and may have
//! read the old session's events) does not record its mark afterwards.
//!
//! Marks are memory only (a start begins with none) and bounded: when the map is
//! full it is emptied, which only makes the next reads of those sessions pass over
//! their hidden events once more.

use std::collections::HashMap;

use parking_lot::Mutex;

/// Sessions with a mark at most; beyond, the map starts again empty.
const MAX_MARKED: usize = 16_384;

#[derive(Default)]
pub(crate) struct Marks {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    /// Moves on with every forgotten session.
    generation: u64,
    by_session: HashMap<String, u64>,
}

/// What a read learned at its start: its session's mark (0: none) and the
/// generation it must still see when it records a new one.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Start {
    pub mark: u64,
    generation: u64,
}

impl Marks {
    pub(crate) fn start(&self, session_id: &str) -> Start {
        let g = self.inner.lock();
        Start {
            mark: g.by_session.get(session_id).copied().unwrap_or(0),
            generation: g.generation,
        }
    }

    /// Record that no event of the session up to `mark` is visible, unless a session
    /// was forgotten since `start` (the read may have seen the old session's events).
    pub(crate) fn record(&self, session_id: &str, start: Start, mark: u64) {
        let mut g = self.inner.lock();
        if g.generation != start.generation {
            return;
        }
        if let Some(m) = g.by_session.get_mut(session_id) {
            *m = (*m).max(mark);
            return;
        }
        if g.by_session.len() >= MAX_MARKED {
            g.by_session = HashMap::new();
        }
        g.by_session.insert(session_id.to_string(), mark);
    }

    /// The session was forgotten (committed): its sequence numbers may start again.
    pub(crate) fn forgot(&self, session_id: &str) {
        let mut g = self.inner.lock();
        g.generation = g.generation.wrapping_add(1);
        g.by_session.remove(session_id);
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.inner.lock().by_session.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_read_started_before_a_forget_records_nothing() {
        let m = Marks::default();
        let s = m.start("a");
        m.record("a", s, 7);
        assert_eq!(m.start("a").mark, 7);
        let before = m.start("a");
        m.forgot("a");
        assert_eq!(m.start("a").mark, 0);
        m.record("a", before, 9);
        assert_eq!(m.start("a").mark, 0, "a read from before the forget");
        let after = m.start("a");
        m.record("a", after, 3);
        assert_eq!(m.start("a").mark, 3);
    }

    #[test]
    fn marks_only_move_forward_and_stay_bounded() {
        let m = Marks::default();
        let s = m.start("a");
        m.record("a", s, 7);
        m.record("a", s, 5);
        assert_eq!(m.start("a").mark, 7);
        for i in 0..MAX_MARKED + 10 {
            let id = format!("s{i}");
            let s = m.start(&id);
            m.record(&id, s, 1);
        }
        assert!(m.len() <= MAX_MARKED);
    }
}
