//! Watch: `watch`/`unwatch`, publishing committed events to watchers, and a closed
//! connection's watches.

use super::*;
use turnd_store::SessionKeys;

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
        let watch_id = new_watch_id();
        let (start, from_ms) = {
            let cell = self.cell(&session_id);
            let st = self.lock(&cell).await.map_err(read_failed)?;
            let watermark = st.meta.last_event_seq;
            let from_ms = st.meta.routed_from_ms;
            let mut w = self.inner.watches.lock();
            let mine = w
                .values()
                .flatten()
                .filter(|x| x.conn_id == outbox.conn_id)
                .count();
            if mine >= max_watches {
                return Err(EngineError::TooManyWatches { max: max_watches });
            }
            let start = args.after.unwrap_or(watermark);
            w.entry(session_id.clone()).or_default().push(Watch {
                watch_id: watch_id.clone(),
                conn_id: outbox.conn_id.clone(),
                outbox: outbox.clone(),
                turn_id: turn_id.clone(),
                sent: start,
                replaying: Some(watermark),
            });
            (start, from_ms)
        };
        let keys = SessionKeys {
            id: &session_id,
            from_ms,
        };
        let first = match self.inner.store.events(keys, start, REPLAY_PAGE) {
            Ok(page) => page,
            Err(e) => {
                self.drop_watch(&session_id, &watch_id);
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
            self.drop_watch(&session_id, &watch_id);
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
            let full = page.len() == REPLAY_PAGE;
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
            let mut w = self.inner.watches.lock();
            // Unwatched (or its connection ended) meanwhile: nothing more to send.
            let Some(watch) = w
                .get_mut(session_id)
                .and_then(|v| v.iter_mut().find(|x| x.watch_id == watch_id))
            else {
                return false;
            };
            if full {
                continue;
            }
            let noted = watch.replaying.unwrap_or(0);
            if noted <= cursor || read_to.is_none() {
                // Caught up. (Events noted but no longer stored were deleted by
                // retention in the meantime; there is nothing to replay of them.)
                watch.sent = cursor.max(noted);
                watch.replaying = None;
                return true;
            }
        }
    }

    fn drop_watch(&self, session_id: &str, watch_id: &str) {
        {
            let mut w = self.inner.watches.lock();
            if let Some(v) = w.get_mut(session_id) {
                v.retain(|x| x.watch_id != watch_id);
                if v.is_empty() {
                    w.remove(session_id);
                }
            }
        }
    }

    /// `unwatch`.
    pub fn unwatch(&self, conn_id: &str, watch_id: &str) -> ApiResult<()> {
        let mut w = self.inner.watches.lock();
        let mut found = false;
        for v in w.values_mut() {
            let before = v.len();
            v.retain(|x| !(x.watch_id == watch_id && x.conn_id == conn_id));
            found |= v.len() != before;
        }
        w.retain(|_, v| !v.is_empty());
        if found {
            Ok(())
        } else {
            Err(EngineError::NoWatch(watch_id.to_string()))
        }
    }

    pub(super) fn publish(&self, session_id: &str, events: &[Event]) {
        let Some(last) = events.last().map(|e| e.seq) else {
            return;
        };
        let mut w = self.inner.watches.lock();
        let Some(subs) = w.get_mut(session_id) else {
            return;
        };
        for sub in subs {
            if let Some(noted) = &mut sub.replaying {
                // The replay reads these from the store.
                *noted = (*noted).max(last);
                continue;
            }
            for e in events {
                if e.seq > sub.sent && sub.turn_id.as_ref().is_none_or(|t| *t == e.turn_id) {
                    sub.outbox.push(push_frame(&Push::Event {
                        watch_id: sub.watch_id.clone(),
                        event: e.clone(),
                    }));
                }
            }
            sub.sent = sub.sent.max(last);
        }
    }

    /// A connection ended: drop its watches.
    pub fn connection_closed(&self, conn_id: &str) {
        {
            let mut w = self.inner.watches.lock();
            for v in w.values_mut() {
                v.retain(|x| x.conn_id != conn_id);
            }
            w.retain(|_, v| !v.is_empty());
        }
    }
}
