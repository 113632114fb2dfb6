//! The watches of every connection, by session: which events each has been sent,
//! publishing committed events to the live ones, and the switch of a replaying
//! watch to live without a gap or a repeat.
//!
//! A watch is registered at its session's last event `seq` (the watermark) and
//! first replays stored events, read by the engine outside the session's lock
//! (`engine/watch.rs`). Events committed meanwhile are not pushed to it but noted;
//! once its replay has read everything noted, it goes live in one step under this
//! table's lock, and from then on gets only events after the last one replayed.

use std::collections::HashMap;

use parking_lot::Mutex;
use turnd_proto::{new_watch_id, Event, Push};

use crate::error::EngineError;
use crate::registry::{push_frame, Outbox};

struct Watch {
    watch_id: String,
    conn_id: String,
    outbox: Outbox,
    turn_id: Option<String>,
    /// Events up to this `seq` were replayed (or were before the watch began); live
    /// pushes are of later events only.
    sent: u64,
    /// While the watch replays stored events: the last `seq` published meanwhile,
    /// which the replay reads back from the store. `None` once the watch is live.
    replaying: Option<u64>,
}

/// How a page of a replay ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PageEnd {
    /// The page was full: more may be stored.
    Full,
    /// The page was short: the replay read all that was stored when it read it.
    Short,
    /// The page held no event.
    Empty,
}

/// What a replay does after a page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Replay {
    /// Unwatched (or its connection ended) meanwhile: nothing more to send.
    Gone,
    /// Read the next page.
    More,
    /// Caught up: the watch is live.
    Live,
}

/// Every watch, by session (see the module doc).
#[derive(Default)]
pub(crate) struct Watches {
    by_session: Mutex<HashMap<String, Vec<Watch>>>,
}

impl Watches {
    /// Register a watch of `session_id` (of one turn of it with `turn_id`) on the
    /// connection of `outbox`, replaying from after `start`, at the session's last
    /// event `watermark`; at most `max` per connection. Its new id.
    pub(crate) fn add(
        &self,
        session_id: &str,
        outbox: &Outbox,
        turn_id: Option<String>,
        (start, watermark): (u64, u64),
        max: usize,
    ) -> Result<String, EngineError> {
        let mut w = self.by_session.lock();
        let mine = w
            .values()
            .flatten()
            .filter(|x| x.conn_id == outbox.conn_id)
            .count();
        if mine >= max {
            return Err(EngineError::TooManyWatches { max });
        }
        let watch_id = new_watch_id();
        w.entry(session_id.to_string()).or_default().push(Watch {
            watch_id: watch_id.clone(),
            conn_id: outbox.conn_id.clone(),
            outbox: outbox.clone(),
            turn_id,
            sent: start,
            replaying: Some(watermark),
        });
        Ok(watch_id)
    }

    /// After a page of a watch's replay read up to `cursor`: go on, go live or stop.
    pub(crate) fn after_page(
        &self,
        session_id: &str,
        watch_id: &str,
        cursor: u64,
        page: PageEnd,
    ) -> Replay {
        let mut w = self.by_session.lock();
        let Some(watch) = w
            .get_mut(session_id)
            .and_then(|v| v.iter_mut().find(|x| x.watch_id == watch_id))
        else {
            return Replay::Gone;
        };
        if page == PageEnd::Full {
            return Replay::More;
        }
        let noted = watch.replaying.unwrap_or(0);
        if noted <= cursor || page == PageEnd::Empty {
            // Caught up. (Events noted but no longer stored were deleted by
            // retention in the meantime; there is nothing to replay of them.)
            watch.sent = cursor.max(noted);
            watch.replaying = None;
            return Replay::Live;
        }
        Replay::More
    }

    /// Drop one watch.
    pub(crate) fn remove(&self, session_id: &str, watch_id: &str) {
        let mut w = self.by_session.lock();
        if let Some(v) = w.get_mut(session_id) {
            v.retain(|x| x.watch_id != watch_id);
            if v.is_empty() {
                w.remove(session_id);
            }
        }
    }

    /// `unwatch`: drop the connection's watch `watch_id`. Whether it had one.
    pub(crate) fn unwatch(&self, conn_id: &str, watch_id: &str) -> bool {
        let mut w = self.by_session.lock();
        let mut found = false;
        for v in w.values_mut() {
            let before = v.len();
            v.retain(|x| !(x.watch_id == watch_id && x.conn_id == conn_id));
            found |= v.len() != before;
        }
        w.retain(|_, v| !v.is_empty());
        found
    }

    /// Push a committed transition's events to the session's live watches (a
    /// replaying one notes them, to read them back).
    pub(crate) fn publish(&self, session_id: &str, events: &[Event]) {
        let Some(last) = events.last().map(|e| e.seq) else {
            return;
        };
        let mut w = self.by_session.lock();
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
    pub(crate) fn connection_closed(&self, conn_id: &str) {
        let mut w = self.by_session.lock();
        for v in w.values_mut() {
            v.retain(|x| x.conn_id != conn_id);
        }
        w.retain(|_, v| !v.is_empty());
    }

    /// Watches held by every connection.
    pub(crate) fn count(&self) -> usize {
        self.by_session.lock().values().map(Vec::len).sum()
    }

    /// Whether a watch is on the session.
    pub(crate) fn watched(&self, session_id: &str) -> bool {
        self.by_session
            .lock()
            .get(session_id)
            .is_some_and(|v| !v.is_empty())
    }
}

#[cfg(test)]
mod tests;
