//! Watch: `watch`/`unwatch`, publishing committed events to watchers, and a closed
//! connection's watches.

use super::*;

impl Engine {
    /// `watch`: replays events after `after` (when given), then pushes every new
    /// event once, in order. `respond` builds the response frame, which is queued
    /// before any event so the peer learns the watch id first.
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
            _ => {
                return Err(err(
                    ErrorCode::BadRequest,
                    "give exactly one of `session_id` and `turn_id`",
                ))
            }
        };
        {
            let w = self
                .inner
                .watches
                .lock()
                .map_err(|_| err(ErrorCode::Internal, "watch table poisoned"))?;
            let mine = w
                .values()
                .flatten()
                .filter(|x| x.conn_id == outbox.conn_id)
                .count();
            if mine >= max_watches {
                return Err(err(
                    ErrorCode::RateLimited,
                    format!("at most {max_watches} watches per connection"),
                ));
            }
        }
        let cell = self.cell(&session_id);
        let st = self.lock(&cell).await.map_err(read_failed)?;
        let watch_id = new_watch_id();
        let replay = match args.after {
            Some(after) => self
                .inner
                .store
                .events(&session_id, after, usize::MAX)
                .map_err(read_failed)?,
            None => Vec::new(),
        };
        if !outbox
            .send(respond(&WatchOk {
                watch_id: watch_id.clone(),
            }))
            .await
        {
            return Ok(());
        }
        for e in replay {
            if turn_id.as_ref().map(|t| *t == e.turn_id).unwrap_or(true) {
                outbox.push(push_frame(&Push::Event {
                    watch_id: watch_id.clone(),
                    event: e,
                }));
            }
        }
        if let Ok(mut w) = self.inner.watches.lock() {
            w.entry(session_id).or_default().push(Watch {
                watch_id,
                conn_id: outbox.conn_id.clone(),
                outbox: outbox.clone(),
                turn_id,
            });
        }
        drop(st);
        Ok(())
    }

    /// `unwatch`.
    pub fn unwatch(&self, conn_id: &str, watch_id: &str) -> ApiResult<()> {
        let mut w = self
            .inner
            .watches
            .lock()
            .map_err(|_| err(ErrorCode::Internal, "watch table poisoned"))?;
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
            Err(err(
                ErrorCode::NotFound,
                format!("no watch {watch_id} on this connection"),
            ))
        }
    }

    pub(super) fn publish(&self, session_id: &str, events: &[Event]) {
        if events.is_empty() {
            return;
        }
        let Ok(w) = self.inner.watches.lock() else {
            return;
        };
        let Some(subs) = w.get(session_id) else {
            return;
        };
        for sub in subs {
            for e in events {
                if sub
                    .turn_id
                    .as_ref()
                    .map(|t| *t == e.turn_id)
                    .unwrap_or(true)
                {
                    sub.outbox.push(push_frame(&Push::Event {
                        watch_id: sub.watch_id.clone(),
                        event: e.clone(),
                    }));
                }
            }
        }
    }

    /// A connection ended: drop its watches.
    pub fn connection_closed(&self, conn_id: &str) {
        if let Ok(mut w) = self.inner.watches.lock() {
            for v in w.values_mut() {
                v.retain(|x| x.conn_id != conn_id);
            }
            w.retain(|_, v| !v.is_empty());
        }
    }
}
