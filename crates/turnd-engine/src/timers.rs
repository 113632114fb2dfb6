//! One timer queue for every session's next deadline.
//!
//! A session's next due time (from [`crate::machine::next_due`]) is kept in one
//! ordered set and in the session's state ([`crate::session::SessionState::timer`]),
//! both changed only under the session's lock. One task sleeps until the earliest entry and, when it
//! is due, spawns a drive of that session; moving a timer is an update of the set,
//! never a new task.

use parking_lot::Mutex;
use std::collections::BTreeSet;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::clock::Clock;

#[derive(Debug, Default)]
pub(crate) struct TimerQueue {
    /// (due Unix ms, session id), earliest first.
    entries: Mutex<BTreeSet<(u64, String)>>,
    /// Wakes the queue's task when the earliest entry may have changed.
    changed: Notify,
}

impl TimerQueue {
    fn entries(&self) -> parking_lot::MutexGuard<'_, BTreeSet<(u64, String)>> {
        self.entries.lock()
    }

    /// Move session `session_id`'s timer from `old` to `new` (None: none armed).
    pub(crate) fn set(&self, session_id: &str, old: Option<u64>, new: Option<u64>) {
        if old == new {
            return;
        }
        let wake = {
            let mut e = self.entries();
            if let Some(o) = old {
                e.remove(&(o, session_id.to_string()));
            }
            if let Some(n) = new {
                e.insert((n, session_id.to_string()));
            }
            // The task only needs to know when the earliest entry moved earlier.
            new.is_some_and(|n| e.first().is_some_and(|f| f.0 == n))
        };
        if wake {
            self.changed.notify_one();
        }
    }

    /// Entries armed.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.entries().len()
    }

    /// Take the earliest entry if it is due at `now`; else the time it is due.
    fn pop_due(&self, now: u64) -> Result<(u64, String), Option<u64>> {
        let mut e = self.entries();
        match e.first() {
            Some((due, _)) if *due <= now => e.pop_first().ok_or(None),
            Some((due, _)) => Err(Some(*due)),
            None => Err(None),
        }
    }

    /// The queue's task: call `fire(session_id, due)` for every entry when it is due,
    /// until `shutdown`.
    pub(crate) async fn run(
        &self,
        clock: Clock,
        shutdown: CancellationToken,
        mut fire: impl FnMut(String, u64) -> bool,
    ) {
        loop {
            let next = match self.pop_due(clock.now_ms()) {
                Ok((due, sid)) => {
                    if !fire(sid, due) {
                        return;
                    }
                    continue;
                }
                Err(next) => next,
            };
            let sleep = async {
                match next {
                    Some(due) => tokio::time::sleep_until(clock.instant_at(due)).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = sleep => {}
                _ = self.changed.notified() => {}
                _ = shutdown.cancelled() => return,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;
    use tokio::sync::mpsc;

    /// A queue and its task on paused time; fired entries come out of the receiver.
    fn start() -> (
        Arc<TimerQueue>,
        Clock,
        mpsc::UnboundedReceiver<(String, u64)>,
        CancellationToken,
    ) {
        let q = Arc::new(TimerQueue::default());
        let clock = Clock::new();
        let stop = CancellationToken::new();
        let (tx, rx) = mpsc::unbounded_channel();
        let task_q = q.clone();
        let task_stop = stop.clone();
        tokio::spawn(async move {
            task_q
                .run(clock, task_stop, |sid, due| tx.send((sid, due)).is_ok())
                .await
        });
        (q, clock, rx, stop)
    }

    async fn advance(ms: u64) {
        tokio::time::advance(Duration::from_millis(ms)).await;
        // Let the queue's task run.
        for _ in 0..4 {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn fires_each_session_at_its_due_time_in_order() {
        let (q, clock, mut rx, _stop) = start();
        let t0 = clock.now_ms();
        q.set("b", None, Some(t0 + 300));
        q.set("a", None, Some(t0 + 100));
        q.set("c", None, Some(t0 + 200));
        advance(99).await;
        assert!(rx.try_recv().is_err(), "nothing fires early");
        advance(1).await;
        assert_eq!(rx.try_recv().ok(), Some(("a".into(), t0 + 100)));
        advance(200).await;
        assert_eq!(rx.try_recv().ok(), Some(("c".into(), t0 + 200)));
        assert_eq!(rx.try_recv().ok(), Some(("b".into(), t0 + 300)));
        assert_eq!(q.len(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_moved_or_cleared_timer_fires_only_at_its_new_time() {
        let (q, clock, mut rx, _stop) = start();
        let t0 = clock.now_ms();
        q.set("a", None, Some(t0 + 500));
        q.set("b", None, Some(t0 + 100));
        advance(10).await;
        // Earlier than the task sleeps for: it wakes for it.
        q.set("a", Some(t0 + 500), Some(t0 + 50));
        q.set("b", Some(t0 + 100), None);
        assert_eq!(q.len(), 1);
        advance(39).await;
        assert!(rx.try_recv().is_err());
        advance(1).await;
        assert_eq!(rx.try_recv().ok(), Some(("a".into(), t0 + 50)));
        advance(1_000).await;
        assert!(rx.try_recv().is_err(), "the cleared timer never fires");
    }

    #[tokio::test(start_paused = true)]
    async fn an_empty_queue_waits_for_the_first_timer_and_stops_on_shutdown() {
        let (q, clock, mut rx, stop) = start();
        advance(10_000).await;
        let t = clock.now_ms() + 20;
        q.set("a", None, Some(t));
        advance(20).await;
        assert_eq!(rx.try_recv().ok(), Some(("a".into(), t)));
        stop.cancel();
        advance(1).await;
        q.set("b", None, Some(clock.now_ms()));
        advance(1).await;
        assert!(rx.try_recv().is_err(), "no timer fires after shutdown");
    }
}
