//! The watches of every connection, by session: which events each has been sent,
//! publishing committed events to the live ones, and the switch of a replaying
//! watch to live without a gap or a repeat.
//!
//! A watch is registered at its session's last event `seq` (the watermark) and
//! first replays stored events, read by the engine outside the session's lock
//! (`engine/watch.rs`). Events committed meanwhile are not pushed to it but noted;
//! once its replay has read everything noted, it goes live in one step under this
//! table's lock, and from then on gets only events after the last one replayed.
//!
//! A watch that asked for progress also gets the progress frames of its session (or
//! turn) as they are taken, and loses them before it loses events: while its
//! connection's queue is more than half full, or while it still replays, its
//! progress frames are dropped and counted per invocation, and the count goes out
//! as a `progress_dropped` push before the next frame it is sent on that watch.

use std::collections::HashMap;

use parking_lot::Mutex;
use serde::Serialize;
use serde_json::value::RawValue;
use turnd_proto::{new_watch_id, Event, Push};
use turnd_store::RawJson;

use crate::error::EngineError;
use crate::progress::Taken;
use crate::registry::{event_frame, push_frame, Outbox};

/// Progress frames a watch lost, of one invocation.
struct Dropped {
    turn_id: String,
    invocation_id: String,
    count: u64,
}

/// The `progress` push, with its data as the worker sent it.
#[derive(Serialize)]
struct ProgressFrame<'a> {
    push: &'static str,
    watch_id: &'a str,
    turn_id: &'a str,
    invocation_id: &'a str,
    step: u32,
    attempt: u32,
    seq: u64,
    data: &'a RawValue,
}

/// What became of a progress frame, over the watches it was for.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Fanout {
    pub pushed: u64,
    pub dropped: u64,
}

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
    /// Whether it asked for progress frames.
    progress: bool,
    /// Progress frames it lost, to announce before its next frame.
    dropped: Vec<Dropped>,
}

impl Watch {
    /// Queue the `progress_dropped` pushes it owes.
    fn announce_dropped(&mut self) {
        for d in self.dropped.drain(..) {
            self.outbox.push(push_frame(&Push::ProgressDropped {
                watch_id: self.watch_id.clone(),
                turn_id: d.turn_id,
                invocation_id: d.invocation_id,
                count: d.count,
            }));
        }
    }

    /// Count a progress frame it lost.
    fn drop_progress(&mut self, p: &Taken) {
        match self
            .dropped
            .iter_mut()
            .find(|d| d.invocation_id == p.invocation_id)
        {
            Some(d) => d.count += 1,
            None => self.dropped.push(Dropped {
                turn_id: p.turn_id.clone(),
                invocation_id: p.invocation_id.clone(),
                count: 1,
            }),
        }
    }
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
    /// Register a watch of `session_id` (of one turn of it with `turn_id`; with
    /// progress frames when `progress`) on the connection of `outbox`, replaying from
    /// after `start`, at the session's last event `watermark`; at most `max` per
    /// connection. Its new id.
    pub(crate) fn add(
        &self,
        session_id: &str,
        outbox: &Outbox,
        (turn_id, progress): (Option<String>, bool),
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
            progress,
            dropped: Vec::new(),
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
    pub(crate) fn publish(&self, session_id: &str, events: &[Event<RawJson>]) {
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
                    sub.announce_dropped();
                    sub.outbox
                        .push(event_frame(sub.watch_id.clone(), e.clone()));
                }
            }
            sub.sent = sub.sent.max(last);
        }
    }

    /// Push a progress frame to the session's watches that asked for progress (of
    /// its turn, for a watch of one turn); a watch that replays, or whose connection's
    /// queue is more than half full, loses it (counted, announced later).
    pub(crate) fn publish_progress(&self, p: &Taken, data: &RawValue) -> Fanout {
        let mut out = Fanout::default();
        let mut w = self.by_session.lock();
        let Some(subs) = w.get_mut(&*p.session_id) else {
            return out;
        };
        for sub in subs {
            if !sub.progress || sub.turn_id.as_ref().is_some_and(|t| *t != p.turn_id) {
                continue;
            }
            if sub.replaying.is_some() || sub.outbox.crowded() {
                sub.drop_progress(p);
                out.dropped += 1;
                continue;
            }
            sub.announce_dropped();
            let frame = ProgressFrame {
                push: "progress",
                watch_id: &sub.watch_id,
                turn_id: &p.turn_id,
                invocation_id: &p.invocation_id,
                step: p.step,
                attempt: p.attempt,
                seq: p.seq,
                data,
            };
            let sent = serde_json::to_string(&frame).is_ok_and(|text| sub.outbox.push(text));
            if sent {
                out.pushed += 1;
            } else {
                out.dropped += 1;
            }
        }
        out
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
