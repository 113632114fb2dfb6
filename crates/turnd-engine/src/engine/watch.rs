//! `watch` and `unwatch`: registering a watch at its session's last event, its
//! paged replay of stored events outside the session's lock, and its switch to live
//! (the watch table itself is [`crate::watches`]).

use turnd_proto::{Event, Push, WatchArgs, WatchOk};
use turnd_store::SessionKeys;

use super::{check_id, read_failed, ApiResult, Engine};
use crate::error::EngineError;
use crate::registry::{push_frame, CloseReason, Outbox};
use crate::watches::{PageEnd, Replay};

/// Events read per page of a watch's replay.
const REPLAY_PAGE: usize = 256;

impl Engine {
    /// `watch`: replays events after `after` (when given), then pushes every new
    /// event once, in order. `respond` builds the response frame, which is queued
    /// before any event so the peer learns the watch id first.
    ///
    /// The watch is registered under the session's lock at its last event `seq` (the
    /// watermark), and the lock is let go at once. The replay then reads stored
    /// events in pages and queues each, waiting for room in the connection's queue
    /// (so a reading client can replay any session, and one that does not read holds
    /// up only this request). Events committed meanwhile are not pushed but noted;
    /// once the replay has read everything noted, the watch goes live in one step
    /// under the watch table's lock, pushing only events after the last one
    /// replayed: no gap, no repeat.
    pub async fn watch(
        &self,
        args: WatchArgs,
        outbox: &Outbox,
        max_watches: usize,
        respond: impl FnOnce(&WatchOk) -> String,
    ) -> ApiResult<()> {
        let (session_id, turn_id) = match (&args.session_id, &args.turn_id) {
            (Some(s), None) => {
                check_id("session_id", s)?;
                (s.clone(), None)
            }
            (None, Some(t)) => {
                let rec = self.stored_turn(t)?;
                (rec.session_id, Some(t.clone()))
            }
            _ => return Err(EngineError::WatchTarget),
        };
        let (watch_id, start, from_ms) = {
            let cell = self.sessions().cell(&session_id);
            let st = self.sessions().lock(&cell).await.map_err(read_failed)?;
            let watermark = st.meta.last_event_seq;
            let start = args.after.unwrap_or(watermark);
            let watches = &self.inner.watches;
            let id = watches.add(
                &session_id,
                outbox,
                (turn_id.clone(), args.progress),
                (start, watermark),
                max_watches,
            )?;
            (id, start, st.meta.routed_from_ms)
        };
        let keys = SessionKeys {
            id: &session_id,
            from_ms,
        };
        let first = match self.inner.store.events(keys, start, REPLAY_PAGE) {
            Ok(page) => page,
            Err(e) => {
                self.inner.watches.remove(&session_id, &watch_id);
                return Err(read_failed(e));
            }
        };
        let sent = outbox
            .send(respond(&WatchOk {
                watch_id: watch_id.clone(),
            }))
            .await;
        let tid = turn_id.as_deref();
        if !sent
            || !self
                .replay(keys, &watch_id, tid, start, first, outbox)
                .await
        {
            // The connection is gone (its watches may already have been dropped).
            self.inner.watches.remove(&session_id, &watch_id);
        }
        Ok(())
    }

    /// Queue the stored events of a registered watch after `cursor` (the first page
    /// already read), page by page, then switch it to live (see [`Engine::watch`]).
    /// False when the connection closed or the watch was dropped meanwhile. A later
    /// page that cannot be read closes the connection (the watch cannot go on
    /// without a gap; the client resumes with `after` on a new one).
    async fn replay(
        &self,
        keys: SessionKeys<'_>,
        watch_id: &str,
        turn_id: Option<&str>,
        mut cursor: u64,
        first: Vec<Event>,
        outbox: &Outbox,
    ) -> bool {
        let session_id = keys.id;
        let mut next = Some(first);
        loop {
            let page = match next.take() {
                Some(p) => p,
                None => match self.inner.store.events(keys, cursor, REPLAY_PAGE) {
                    Ok(p) => p,
                    Err(e) => {
                        tracing::warn!(
                            session_id,
                            watch_id,
                            "watch replay could not read events; closing its connection: {e}"
                        );
                        outbox.close_with(CloseReason::Unavailable);
                        return false;
                    }
                },
            };
            let end = match page.last() {
                None => PageEnd::Empty,
                Some(_) if page.len() == REPLAY_PAGE => PageEnd::Full,
                Some(_) => PageEnd::Short,
            };
            let read_to = page.last().map(|e| e.seq);
            for e in page {
                if turn_id.is_some_and(|t| t != e.turn_id) {
                    continue;
                }
                let frame = push_frame(&Push::Event {
                    watch_id: watch_id.to_string(),
                    event: e,
                });
                if !outbox.send(frame).await {
                    return false;
                }
            }
            if let Some(seq) = read_to {
                cursor = seq;
            }
            match self
                .inner
                .watches
                .after_page(session_id, watch_id, cursor, end)
            {
                Replay::Gone => return false,
                Replay::Live => return true,
                Replay::More => {}
            }
        }
    }

    /// Where a watch of `args` would start: its `after`, or else its session's last
    /// event `seq` now. A watch given this as `after` misses nothing the watch without
    /// it would have sent (a node of a cluster relays a watch this way, so that it can
    /// resume it elsewhere from the last event it delivered).
    pub async fn watch_cursor(&self, args: &WatchArgs) -> ApiResult<u64> {
        if let Some(after) = args.after {
            return Ok(after);
        }
        let session_id = match (&args.session_id, &args.turn_id) {
            (Some(s), None) => {
                check_id("session_id", s)?;
                s.clone()
            }
            (None, Some(t)) => self.stored_turn(t)?.session_id,
            _ => return Err(EngineError::WatchTarget),
        };
        let cell = self.sessions().cell(&session_id);
        let st = self.sessions().lock(&cell).await.map_err(read_failed)?;
        Ok(st.meta.last_event_seq)
    }

    /// `unwatch`.
    pub fn unwatch(&self, conn_id: &str, watch_id: &str) -> ApiResult<()> {
        if self.inner.watches.unwatch(conn_id, watch_id) {
            Ok(())
        } else {
            Err(EngineError::NoWatch(watch_id.to_string()))
        }
    }

    /// A connection ended: drop its watches.
    pub fn connection_closed(&self, conn_id: &str) {
        self.inner.watches.connection_closed(conn_id);
    }
}
