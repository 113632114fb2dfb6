//! The engine's own progress: [`Engine::drive`] does whatever is due for a session
//! (dispatch, probe, give up, retry, fail on a deadline), up to 16 transitions in a
//! row, and retries a write that failed with backoff. The timer queue's task, the
//! registry's wake hook, worker disconnects and recovery all just drive sessions.

use std::sync::{Arc, Weak};

use super::{Engine, Inner};
use crate::machine;
use crate::session::Pending;
use crate::workers::WakeHook;

/// Delay before retrying a failed internal write: starts small, doubles, capped.
const RETRY_FIRST_MS: u64 = 50;
const RETRY_MAX_MS: u64 = 2_000;

impl Engine {
    /// The hook through which the registry hands back sessions to drive, for an
    /// engine that drives them itself (it holds them all).
    pub(super) fn drives_woken(&self) -> WakeHook {
        let weak: Weak<Inner> = Arc::downgrade(&self.inner);
        Arc::new(move |session_id| {
            if let Some(inner) = weak.upgrade() {
                Engine { inner }.spawn_drive(session_id);
            }
        })
    }

    /// Start the timer queue's task: each due entry spawns a drive of its session.
    pub(super) fn spawn_timers(&self) {
        let weak: Weak<Inner> = Arc::downgrade(&self.inner);
        let queue = self.inner.timers.clone();
        let clock = self.inner.clock;
        let shutdown = self.inner.shutdown.clone();
        tokio::spawn(async move {
            queue
                .run(clock, shutdown, |sid, due| {
                    let Some(inner) = weak.upgrade() else {
                        return false;
                    };
                    let engine = Engine { inner };
                    tokio::spawn(async move { engine.drive_timer(&sid, due).await });
                    true
                })
                .await
        });
    }

    /// Spawn a drive of a session (used where the caller must not wait for it).
    pub(super) fn spawn_drive(&self, session_id: Arc<str>) {
        let engine = self.clone();
        tokio::spawn(async move { engine.drive(&session_id).await });
    }

    /// The timer queue fired the session's entry for `due`.
    pub(super) async fn drive_timer(&self, session_id: &str, due: u64) {
        let Some(cell) = self.sessions().existing(session_id) else {
            return;
        };
        {
            // The entry left the queue: forget it, so the drive arms the next one.
            let mut st = cell.state.lock().await;
            if st.timer == Some(due) {
                st.timer = None;
            }
        }
        self.drive(session_id).await;
    }

    /// Do whatever is due for a session, until nothing is.
    pub async fn drive(&self, session_id: &str) {
        let cell = self.sessions().cell(session_id);
        let mut st = match self.sessions().lock(&cell).await {
            Ok(st) => st,
            Err(e) => {
                tracing::error!(session_id, "failed to load session: {e}");
                return;
            }
        };
        for _ in 0..16 {
            let now = self.now_ms();
            if let Some(p) = &st.pending {
                if p.retry_at_ms > now {
                    break;
                }
            }
            let (settled, ()) = self.transition(&st, now, machine::due);
            if settled.is_empty() {
                st.pending = None;
                self.after_change(&mut st, Vec::new());
                break;
            }
            if let Err(e) = self.commit(&cell, &mut st, settled).await {
                let delay = st
                    .pending
                    .as_ref()
                    .map(|p| (p.delay_ms * 2).min(RETRY_MAX_MS))
                    .unwrap_or(RETRY_FIRST_MS);
                let since = st.pending.as_ref().map(|p| p.since_ms).unwrap_or(now);
                tracing::warn!(
                    session_id,
                    delay_ms = delay,
                    disk_full = e.is_disk_full(),
                    "failed to write a state change, retrying: {e}"
                );
                st.pending = Some(Box::new(Pending {
                    error: e.to_string(),
                    since_ms: since,
                    retry_at_ms: now + delay,
                    delay_ms: delay,
                }));
                self.after_change(&mut st, Vec::new());
                break;
            }
        }
    }
}
