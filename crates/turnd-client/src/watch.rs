//! A caller's watches: the routing of a connection's pushes to the stream of each
//! watch, and the stream that opens its watch again when its connection is lost.
//!
//! A connection's push stream is routed by `watch_id`, so several watches on one
//! connection each see only their own, in order. A push can arrive before the `watch`
//! answer has been handed to the code that asked (the server may push right after
//! answering), so pushes for a watch id nobody has claimed yet are held (bounded)
//! until it is claimed.
//!
//! A watch belongs to one connection and the server ends it with that connection. A
//! [`WatchStream`] of a caller that reconnects opens its watch again through the
//! caller, with `after` = the `seq` of the last event it delivered, and drops any
//! event it delivered already: its reader sees every event once, in order, across any
//! number of lost connections. Progress frames sent while it was away are counted by
//! nobody, so it says so with a `ProgressDropped` of their number, as the daemon does
//! for a slow reader.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::mpsc;
use tracing::{debug, warn};
use turnd_proto::{Event, ProgressPush, Push, WatchArgs};

use crate::caller::Shared;
use crate::connection::{lock, Connection};
use crate::error::ClientError;

/// Most events held for watch ids that no [`WatchStream`] has claimed yet.
const MAX_UNCLAIMED_EVENTS: usize = 4096;

/// How long a [`WatchStream`] whose connection was lost goes on trying to open its
/// watch again (every URL of its caller, round after round, with a pause from 50 ms
/// doubling to 1 s between rounds) before it ends: no round starts after it, and a
/// round gives each URL at most [`OPEN_TIMEOUT`](crate::OPEN_TIMEOUT). The Python
/// client's `reconnect_timeout` default. A stream keeps its connection open while
/// it lives, even when its caller was dropped.
pub const RESUME_TIMEOUT: Duration = Duration::from_secs(30);

/// The first pause between two rounds of reopening a watch; it doubles up to
/// [`RESUME_PAUSE_MAX`].
const RESUME_PAUSE_MIN: Duration = Duration::from_millis(50);
const RESUME_PAUSE_MAX: Duration = Duration::from_secs(1);

/// What a watch delivers: its events and, when it asked for them, the progress of
/// the live invocations it watches and the count of progress frames it lost.
#[derive(Debug, Clone, PartialEq)]
pub enum WatchItem {
    Event(Event),
    Progress(ProgressPush),
    /// Progress frames of `invocation_id` this watch lost (it read too slowly, or
    /// they were sent while its connection was lost).
    ProgressDropped {
        turn_id: String,
        invocation_id: String,
        count: u64,
    },
}

#[derive(Default)]
pub(crate) struct Routes {
    streams: HashMap<String, mpsc::UnboundedSender<WatchItem>>,
    unclaimed: HashMap<String, Vec<WatchItem>>,
    unclaimed_total: usize,
    /// The push stream ended: no more events will come.
    pub(crate) ended: bool,
}

impl std::fmt::Debug for Routes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Routes")
            .field("streams", &self.streams.len())
            .field("unclaimed", &self.unclaimed_total)
            .finish()
    }
}

impl Routes {
    fn route(&mut self, watch_id: String, item: WatchItem) {
        if let Some(tx) = self.streams.get(&watch_id) {
            if tx.send(item).is_err() {
                debug!(%watch_id, "watch stream dropped; no longer routing its events");
                self.streams.remove(&watch_id);
            }
            return;
        }
        if self.unclaimed_total >= MAX_UNCLAIMED_EVENTS {
            warn!(%watch_id, ?item, "dropping a push for an unclaimed watch (too many held)");
            return;
        }
        self.unclaimed_total += 1;
        self.unclaimed.entry(watch_id).or_default().push(item);
    }

    pub(crate) fn claim(&mut self, watch_id: &str) -> mpsc::UnboundedReceiver<WatchItem> {
        let (tx, rx) = mpsc::unbounded_channel();
        if let Some(held) = self.unclaimed.remove(watch_id) {
            self.unclaimed_total -= held.len();
            for event in held {
                if tx.send(event).is_err() {
                    debug!("receiver dropped while replaying held events");
                }
            }
        }
        if !self.ended {
            self.streams.insert(watch_id.to_string(), tx);
        }
        rx
    }

    pub(crate) fn forget(&mut self, watch_id: &str) {
        self.streams.remove(watch_id);
        if let Some(held) = self.unclaimed.remove(watch_id) {
            self.unclaimed_total -= held.len();
        }
    }
}

pub(crate) async fn route_pushes(
    mut rx: mpsc::UnboundedReceiver<Push>,
    routes: Arc<Mutex<Routes>>,
) {
    while let Some(push) = rx.recv().await {
        match push {
            Push::Event { watch_id, event } => {
                lock(&routes).route(watch_id, WatchItem::Event(event))
            }
            Push::Progress(p) => lock(&routes).route(p.watch_id.clone(), WatchItem::Progress(p)),
            Push::ProgressDropped {
                watch_id,
                turn_id,
                invocation_id,
                count,
            } => lock(&routes).route(
                watch_id,
                WatchItem::ProgressDropped {
                    turn_id,
                    invocation_id,
                    count,
                },
            ),
            other => debug!(?other, "ignoring a non-event push on a caller connection"),
        }
    }
    let mut routes = lock(&routes);
    routes.ended = true;
    routes.streams.clear();
}

/// What a stream and its caller share of one watch: the id the server gave its
/// current opening, and whether it was unwatched.
#[derive(Debug)]
pub(crate) struct WatchState {
    pub(crate) current: String,
    pub(crate) unwatched: bool,
}

/// One opening of a watch: its id, its events and the connection it is on.
pub(crate) struct Opening {
    pub(crate) watch_id: String,
    pub(crate) rx: mpsc::UnboundedReceiver<WatchItem>,
    pub(crate) conn: Connection,
}

/// The events (and progress) of one watch, in order, each once.
///
/// When its connection is lost and its caller reconnects (one made from URLs, not
/// with [`Caller::from_connection`](crate::Caller::from_connection)), it opens the
/// watch again through the caller with `after` = the `seq` of the last event it
/// delivered, so its events go on with no gap and no repeat; progress frames sent
/// meanwhile come as one [`WatchItem::ProgressDropped`] of their number. It ends
/// (`next` returns `None`) when it is unwatched ([`WatchStream::unwatch`],
/// [`Caller::unwatch`](crate::Caller::unwatch)), when its caller does not reconnect
/// and its connection ends, or when the watch cannot be opened again: a refusal
/// (e.g. `rate_limited`), or no URL answering for [`RESUME_TIMEOUT`].
#[derive(Debug)]
pub struct WatchStream {
    /// The id the server gave this watch when it was first opened; the id
    /// [`Caller::unwatch`](crate::Caller::unwatch) takes, across reopenings too.
    pub watch_id: String,
    rx: mpsc::UnboundedReceiver<WatchItem>,
    conn: Connection,
    shared: Arc<Shared>,
    state: Arc<Mutex<WatchState>>,
    /// What it was opened with; `after` is replaced when opened again.
    args: WatchArgs,
    /// The `seq` of the last event delivered (or the starting `after`).
    last: Option<u64>,
    /// Per invocation, the progress `seq` expected next.
    expected: HashMap<String, u64>,
    /// Items to deliver before the next one received.
    ready: VecDeque<WatchItem>,
    starts: u32,
}

impl WatchStream {
    pub(crate) fn new(shared: Arc<Shared>, args: WatchArgs, opening: Opening) -> WatchStream {
        let state = Arc::new(Mutex::new(WatchState {
            current: opening.watch_id.clone(),
            unwatched: false,
        }));
        shared.register(&opening.watch_id, state.clone());
        WatchStream {
            watch_id: opening.watch_id,
            rx: opening.rx,
            conn: opening.conn,
            shared,
            state,
            last: args.after,
            args,
            expected: HashMap::new(),
            ready: VecDeque::new(),
            starts: 1,
        }
    }

    /// The next event of this watch (its progress skipped), or `None` once it ended.
    pub async fn next(&mut self) -> Option<Event> {
        loop {
            if let WatchItem::Event(e) = self.next_item().await? {
                return Some(e);
            }
        }
    }

    /// The next event or progress of this watch, or `None` once it ended.
    pub async fn next_item(&mut self) -> Option<WatchItem> {
        loop {
            if let Some(item) = self.ready.pop_front() {
                return Some(item);
            }
            match self.rx.recv().await {
                Some(item) => {
                    if let Some(item) = self.admit(item) {
                        return Some(item);
                    }
                }
                None => {
                    if !self.reopen().await {
                        return None;
                    }
                }
            }
        }
    }

    /// The `seq` of the last event delivered (or the `after` it started from).
    pub fn last_seq(&self) -> Option<u64> {
        self.last
    }

    /// How many times the watch was opened: 1, plus one per reopening after a lost
    /// connection.
    pub fn starts(&self) -> u32 {
        self.starts
    }

    /// `unwatch` of this watch (its current opening); the stream ends.
    pub async fn unwatch(&mut self) -> Result<(), ClientError> {
        let first = self.watch_id.clone();
        self.shared.unwatch(&first).await
    }

    /// An item as it is delivered: `None` for an event delivered already; a
    /// progress frame after a gap comes after a `ProgressDropped` of the gap.
    fn admit(&mut self, item: WatchItem) -> Option<WatchItem> {
        match &item {
            WatchItem::Event(e) => {
                if self.last.is_some_and(|last| e.seq <= last) {
                    return None;
                }
                self.last = Some(e.seq);
            }
            WatchItem::ProgressDropped {
                invocation_id,
                count,
                ..
            } => {
                if let Some(next) = self.expected.get_mut(invocation_id) {
                    *next += count;
                }
            }
            WatchItem::Progress(p) => {
                let expected = self.expected.insert(p.invocation_id.clone(), p.seq + 1);
                if let Some(expected) = expected.filter(|&x| p.seq > x) {
                    let marker = WatchItem::ProgressDropped {
                        turn_id: p.turn_id.clone(),
                        invocation_id: p.invocation_id.clone(),
                        count: p.seq - expected,
                    };
                    self.ready.push_back(item);
                    return Some(marker);
                }
            }
        }
        Some(item)
    }

    /// After its events ended: open the watch again when its connection was lost
    /// and its caller reconnects, trying for [`RESUME_TIMEOUT`]; whether it did.
    async fn reopen(&mut self) -> bool {
        if lock(&self.state).unwatched || !self.shared.reconnects() || !self.conn.is_closed() {
            return false;
        }
        let mut args = self.args.clone();
        args.after = self.last;
        let deadline = tokio::time::Instant::now() + RESUME_TIMEOUT;
        let mut pause = RESUME_PAUSE_MIN;
        let opening = loop {
            match self.shared.open_watch(&args).await {
                Ok(opening) => break opening,
                Err(e) if e.is_retryable() && tokio::time::Instant::now() + pause < deadline => {
                    debug!(error = %e, "cannot open the watch again yet");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(RESUME_PAUSE_MAX);
                }
                Err(e) => {
                    warn!(watch_id = %self.watch_id, error = %e, "watch lost: cannot open it again");
                    return false;
                }
            }
        };
        let unwatched = {
            let mut state = lock(&self.state);
            state.current.clone_from(&opening.watch_id);
            state.unwatched
        };
        self.rx = opening.rx;
        self.conn = opening.conn;
        self.starts += 1;
        debug!(watch_id = %self.watch_id, now = %opening.watch_id, after = ?args.after, "watch opened again");
        if unwatched {
            // Unwatched while it was being opened again.
            if let Err(e) = self.shared.unwatch(&self.watch_id).await {
                debug!(error = %e, "unwatch of a watch opened again");
            }
            return false;
        }
        true
    }
}

impl Drop for WatchStream {
    fn drop(&mut self) {
        self.shared.unregister(&self.watch_id);
    }
}
