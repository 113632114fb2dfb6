//! The `turn.wait` requests waiting for a turn's end, by turn id: each is sent the
//! turn, as committed, once it is terminal.

use std::collections::HashMap;

use parking_lot::Mutex;
use tokio::sync::oneshot;
use turnd_store::TurnRecord;

use crate::view::to_turn;
use crate::TurnView;

/// Waiters by turn id (see the module doc).
#[derive(Default)]
pub(crate) struct Waiters {
    by_turn: Mutex<HashMap<String, Vec<oneshot::Sender<TurnView>>>>,
}

impl Waiters {
    /// Wait for `turn_id` to end: the receiver gets the terminal turn.
    pub(crate) fn add(&self, turn_id: &str) -> oneshot::Receiver<TurnView> {
        let (tx, rx) = oneshot::channel();
        self.by_turn
            .lock()
            .entry(turn_id.to_string())
            .or_default()
            .push(tx);
        rx
    }

    /// Drop the waiters of `turn_id` that gave up (their receiver is gone).
    pub(crate) fn prune(&self, turn_id: &str) {
        let mut w = self.by_turn.lock();
        if let Some(v) = w.get_mut(turn_id) {
            v.retain(|s| !s.is_closed());
            if v.is_empty() {
                w.remove(turn_id);
            }
        }
    }

    /// Send each of `turns`, terminal as written, to its waiters.
    pub(crate) fn notify(&self, turns: &[TurnRecord]) {
        if turns.is_empty() {
            return;
        }
        let mut w = self.by_turn.lock();
        for t in turns {
            if let Some(v) = w.remove(&t.turn_id) {
                let turn = to_turn(t, None);
                for s in v {
                    // A waiter that gave up needs no notice.
                    if s.send(turn.clone()).is_err() {
                        tracing::trace!(turn_id = %t.turn_id, "turn.wait caller already gone");
                    }
                }
            }
        }
    }

    /// Waiters registered.
    pub(crate) fn count(&self) -> usize {
        self.by_turn.lock().values().map(Vec::len).sum()
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;
    use turnd_proto::TurnStatus;
    use turnd_store::{RawJson, TurnRecord};

    use super::Waiters;

    fn done(turn_id: &str) -> TurnRecord {
        let input = RawJson::from_value(&json!(1));
        let mut t = TurnRecord::admitted(turn_id.into(), "s", 1, "f", input, 0);
        t.status = TurnStatus::Completed;
        t
    }

    #[test]
    fn every_waiter_of_a_turn_gets_it_once_it_ends() {
        let w = Waiters::default();
        let mut first = w.add("t_a");
        let mut second = w.add("t_a");
        let mut other = w.add("t_b");
        assert_eq!(w.count(), 3);
        w.notify(&[done("t_a")]);
        for rx in [&mut first, &mut second] {
            let t = rx.try_recv().expect("notified");
            assert_eq!(
                (t.turn_id.as_str(), t.status),
                ("t_a", TurnStatus::Completed)
            );
        }
        assert!(other.try_recv().is_err(), "another turn's waiter waits on");
        assert_eq!(w.count(), 1);
    }

    #[test]
    fn a_waiter_that_gave_up_is_pruned() {
        let w = Waiters::default();
        let gone = w.add("t_a");
        let _kept = w.add("t_a");
        drop(gone);
        w.prune("t_a");
        assert_eq!(w.count(), 1);
        w.prune("t_b");
        assert_eq!(w.count(), 1);
    }
}
