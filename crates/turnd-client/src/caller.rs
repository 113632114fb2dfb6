//! The caller side: a client- or operator-role connection with one typed helper per
//! client op, and per-watch streams of events (and progress).
//!
//! A `Caller` takes its connection's push stream and routes every `event`,
//! `progress` and `progress_dropped` push to the [`WatchStream`] of its `watch_id`, so
//! several watches on one connection each see only their own, in order. A push can
//! arrive before the `watch` answer has been handed to the code that asked (the server
//! may push right after answering), so pushes for a watch id nobody has claimed yet are
//! held (bounded) until it is claimed.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tracing::{debug, warn};
use turnd_proto::{
    CheckOk, EventsArgs, EventsOk, FunctionsOk, HelloArgs, ListArgs, ListOk, Push, Role, Session,
    SessionIdArgs, SessionOk, SessionStopArgs, SessionsListArgs, SessionsListOk, StatsOk, StopArgs,
    SubmitArgs, SubmitOk, TurnIdArgs, TurnOk, TurnsOk, WaitArgs, WatchArgs, WatchIdArgs, WatchOk,
    WorkersOk, PROTOCOL_VERSION, WAIT_MAX_MS,
};
use turnd_proto::{Event, Function, OnBusy, ProgressPush, ResumeArgs, Stats, Turn, Violation};

use crate::connection::{lock, Connection};
use crate::error::ClientError;

/// Most events held for watch ids that no [`WatchStream`] has claimed yet.
const MAX_UNCLAIMED_EVENTS: usize = 4096;

/// Extra time given to the server's own answer of the last `turn.wait` of
/// [`Caller::wait_terminal`] before the client gives up on it.
const WAIT_ANSWER_GRACE: Duration = Duration::from_millis(1000);

/// What a watch delivers: its events and, when it asked for them, the progress of
/// the live invocations it watches and the count of progress frames it lost.
#[derive(Debug, Clone, PartialEq)]
pub enum WatchItem {
    Event(Event),
    Progress(ProgressPush),
    /// Progress frames of `invocation_id` this watch lost (it read too slowly).
    ProgressDropped {
        turn_id: String,
        invocation_id: String,
        count: u64,
    },
}

#[derive(Default)]
struct Routes {
    streams: HashMap<String, mpsc::UnboundedSender<WatchItem>>,
    unclaimed: HashMap<String, Vec<WatchItem>>,
    unclaimed_total: usize,
    /// The push stream ended: no more events will come.
    ended: bool,
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

    fn claim(&mut self, watch_id: &str) -> mpsc::UnboundedReceiver<WatchItem> {
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

    fn forget(&mut self, watch_id: &str) {
        self.streams.remove(watch_id);
        if let Some(held) = self.unclaimed.remove(watch_id) {
            self.unclaimed_total -= held.len();
        }
    }
}

/// The events (and progress) of one watch, in order. Ends (`next` returns `None`)
/// when the watch is removed with [`Caller::unwatch`] or the connection ends.
#[derive(Debug)]
pub struct WatchStream {
    /// The id the server gave this watch.
    pub watch_id: String,
    rx: mpsc::UnboundedReceiver<WatchItem>,
}

impl WatchStream {
    /// The next event of this watch (its progress skipped), or `None` once the watch
    /// or connection ended.
    pub async fn next(&mut self) -> Option<Event> {
        loop {
            if let WatchItem::Event(e) = self.rx.recv().await? {
                return Some(e);
            }
        }
    }

    /// The next event or progress of this watch, or `None` once it ended.
    pub async fn next_item(&mut self) -> Option<WatchItem> {
        self.rx.recv().await
    }
}

/// A client-role (or operator-role) connection with typed helpers for every client op.
#[derive(Debug)]
pub struct Caller {
    conn: Connection,
    routes: Arc<Mutex<Routes>>,
    /// Routes pushes; ends by itself with the connection.
    router: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Routes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Routes")
            .field("streams", &self.streams.len())
            .field("unclaimed", &self.unclaimed_total)
            .finish()
    }
}

impl Drop for Caller {
    fn drop(&mut self) {
        // The router ends with the connection; other clones of the connection may keep
        // it alive, and nobody can claim streams from a dropped caller.
        if let Some(router) = self.router.take() {
            router.abort();
        }
    }
}

impl Caller {
    /// Connect with role `client`.
    pub async fn connect(url: &str, token: Option<&str>) -> Result<Caller, ClientError> {
        Caller::connect_as(url, Role::Client, token).await
    }

    /// Connect with the given role (`client` or `operator`).
    pub async fn connect_as(
        url: &str,
        role: Role,
        token: Option<&str>,
    ) -> Result<Caller, ClientError> {
        let hello = HelloArgs {
            protocol: PROTOCOL_VERSION,
            role,
            token: token.map(str::to_string),
            name: Some("turnd-client".to_string()),
            worker_id: None,
            instance_id: None,
            inflight: Vec::new(),
            finished: Vec::new(),
        };
        let (conn, _hello_ok) = Connection::connect(url, hello).await?;
        Ok(Caller::from_connection(conn))
    }

    /// Wrap an already greeted connection. Takes its push stream: when the pushes were
    /// taken already, watches get no events.
    pub fn from_connection(conn: Connection) -> Caller {
        let routes = Arc::new(Mutex::new(Routes::default()));
        let router = match conn.pushes() {
            Some(rx) => Some(tokio::spawn(route_pushes(rx, routes.clone()))),
            None => {
                warn!("push stream already taken; watches on this caller will get no events");
                lock(&routes).ended = true;
                None
            }
        };
        Caller {
            conn,
            routes,
            router,
        }
    }

    /// The underlying connection (for raw requests). Its push stream belongs to the
    /// caller.
    pub fn connection(&self) -> &Connection {
        &self.conn
    }

    /// `turn.submit`.
    pub async fn submit(&self, args: SubmitArgs) -> Result<SubmitOk, ClientError> {
        self.conn.call("turn.submit", &args).await
    }

    /// `turn.submit` without idempotency key or turn timeout; returns the turn.
    pub async fn submit_simple(
        &self,
        session_id: &str,
        function_id: &str,
        input: Value,
    ) -> Result<Turn, ClientError> {
        let ok = self
            .submit_on_busy(session_id, function_id, input, OnBusy::Enqueue)
            .await?;
        Ok(ok.turn)
    }

    /// `turn.submit` with `on_busy`: what to do when the session has an unfinished
    /// turn (`reject` fails with the `busy` code and stores nothing).
    pub async fn submit_on_busy(
        &self,
        session_id: &str,
        function_id: &str,
        input: Value,
        on_busy: OnBusy,
    ) -> Result<SubmitOk, ClientError> {
        let args = SubmitArgs {
            session_id: session_id.to_string(),
            function_id: function_id.to_string(),
            input,
            idempotency_key: None,
            turn_timeout_ms: None,
            on_busy: Some(on_busy),
        };
        self.submit(args).await
    }

    /// `turn.resume`: the input a turn suspended for input waits for; answered once
    /// durable. `conflict` when the turn is not awaiting input.
    pub async fn resume(
        &self,
        turn_id: &str,
        input: Value,
        idempotency_key: Option<&str>,
    ) -> Result<SubmitOk, ClientError> {
        let args = ResumeArgs {
            turn_id: turn_id.to_string(),
            input,
            idempotency_key: idempotency_key.map(str::to_string),
        };
        self.conn.call("turn.resume", &args).await
    }

    /// A watch of one turn with its progress: its events and progress frames as they
    /// come ([`WatchStream::next_item`]).
    pub async fn watch_turn(&self, turn_id: &str) -> Result<WatchStream, ClientError> {
        self.watch(WatchArgs {
            session_id: None,
            turn_id: Some(turn_id.to_string()),
            after: None,
            progress: true,
        })
        .await
    }

    /// `turn.get`.
    pub async fn get(&self, turn_id: &str) -> Result<Turn, ClientError> {
        let args = TurnIdArgs {
            turn_id: turn_id.to_string(),
        };
        Ok(self.conn.call::<_, TurnOk>("turn.get", &args).await?.turn)
    }

    /// `turn.wait`: the turn as soon as it is terminal, or as it is when `timeout_ms`
    /// (server default 30000) passes.
    pub async fn wait(&self, turn_id: &str, timeout_ms: Option<u64>) -> Result<Turn, ClientError> {
        let args = WaitArgs {
            turn_id: turn_id.to_string(),
            timeout_ms,
        };
        Ok(self.conn.call::<_, TurnOk>("turn.wait", &args).await?.turn)
    }

    /// Repeat `turn.wait` until the turn is terminal; [`ClientError::Timeout`] when
    /// `overall` passes first.
    pub async fn wait_terminal(
        &self,
        turn_id: &str,
        overall: Duration,
    ) -> Result<Turn, ClientError> {
        let deadline = tokio::time::Instant::now() + overall;
        loop {
            let remaining = deadline.saturating_duration_since(tokio::time::Instant::now());
            if remaining.is_zero() {
                return Err(ClientError::Timeout);
            }
            let ms = u64::try_from(remaining.as_millis())
                .unwrap_or(u64::MAX)
                .clamp(1, WAIT_MAX_MS);
            let answer =
                tokio::time::timeout(remaining + WAIT_ANSWER_GRACE, self.wait(turn_id, Some(ms)));
            match answer.await {
                Ok(Ok(turn)) if turn.status.is_terminal() => return Ok(turn),
                Ok(Ok(_)) => {}
                Ok(Err(e)) => return Err(e),
                Err(_) => return Err(ClientError::Timeout),
            }
        }
    }

    /// `turn.stop`.
    pub async fn stop(&self, turn_id: &str, reason: &str) -> Result<Turn, ClientError> {
        let args = StopArgs {
            turn_id: turn_id.to_string(),
            reason: Some(reason.to_string()),
        };
        Ok(self.conn.call::<_, TurnOk>("turn.stop", &args).await?.turn)
    }

    /// `session.stop`: every non-terminal turn of the session, once stopping.
    pub async fn stop_session(
        &self,
        session_id: &str,
        reason: &str,
    ) -> Result<Vec<Turn>, ClientError> {
        let args = SessionStopArgs {
            session_id: session_id.to_string(),
            reason: Some(reason.to_string()),
        };
        Ok(self
            .conn
            .call::<_, TurnsOk>("session.stop", &args)
            .await?
            .turns)
    }

    /// `turn.list`.
    pub async fn list(&self, args: ListArgs) -> Result<ListOk, ClientError> {
        self.conn.call("turn.list", &args).await
    }

    /// `session.inspect`.
    pub async fn inspect(&self, session_id: &str) -> Result<Session, ClientError> {
        let args = SessionIdArgs {
            session_id: session_id.to_string(),
        };
        Ok(self
            .conn
            .call::<_, SessionOk>("session.inspect", &args)
            .await?
            .session)
    }

    /// `session.events`.
    pub async fn events(
        &self,
        session_id: &str,
        after: Option<u64>,
        limit: Option<u64>,
    ) -> Result<EventsOk, ClientError> {
        let args = EventsArgs {
            session_id: session_id.to_string(),
            after,
            limit,
        };
        self.conn.call("session.events", &args).await
    }

    /// `watch`: a stream of the session's (or turn's) new events.
    pub async fn watch(&self, args: WatchArgs) -> Result<WatchStream, ClientError> {
        let ok: WatchOk = self.conn.call("watch", &args).await?;
        let rx = lock(&self.routes).claim(&ok.watch_id);
        Ok(WatchStream {
            watch_id: ok.watch_id,
            rx,
        })
    }

    /// `unwatch`; the watch's stream ends.
    pub async fn unwatch(&self, watch_id: &str) -> Result<(), ClientError> {
        let args = WatchIdArgs {
            watch_id: watch_id.to_string(),
        };
        let result = self.conn.request("unwatch", to_args(&args)?).await;
        // Stop routing either way: after `not_found` there is nothing to route, and
        // after success the server sends no more.
        lock(&self.routes).forget(watch_id);
        result.map(|_| ())
    }

    /// `stats`.
    pub async fn stats(&self) -> Result<Stats, ClientError> {
        Ok(self
            .conn
            .call::<_, StatsOk>("stats", &json!({}))
            .await?
            .stats)
    }

    /// `workers.list`.
    pub async fn workers(&self) -> Result<Vec<turnd_proto::Worker>, ClientError> {
        Ok(self
            .conn
            .call::<_, WorkersOk>("workers.list", &json!({}))
            .await?
            .workers)
    }

    /// `functions.list`.
    pub async fn functions(&self) -> Result<Vec<Function>, ClientError> {
        Ok(self
            .conn
            .call::<_, FunctionsOk>("functions.list", &json!({}))
            .await?
            .functions)
    }

    /// `sessions.list`: sessions with unfinished work, filtered and paged.
    pub async fn sessions(&self, args: &SessionsListArgs) -> Result<SessionsListOk, ClientError> {
        self.conn
            .call::<_, SessionsListOk>("sessions.list", args)
            .await
    }

    /// `store.check` (operator role only).
    pub async fn store_check(&self) -> Result<Vec<Violation>, ClientError> {
        Ok(self
            .conn
            .call::<_, CheckOk>("store.check", &json!({}))
            .await?
            .violations)
    }

    /// `ping`.
    pub async fn ping(&self) -> Result<(), ClientError> {
        self.conn.request("ping", json!({})).await.map(|_| ())
    }
}

fn to_args<A: serde::Serialize>(args: &A) -> Result<Value, ClientError> {
    serde_json::to_value(args).map_err(|e| ClientError::Decode(format!("encode args: {e}")))
}

async fn route_pushes(mut rx: mpsc::UnboundedReceiver<Push>, routes: Arc<Mutex<Routes>>) {
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
