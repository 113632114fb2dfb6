//! The caller side: a client- or operator-role connection with one typed helper per
//! client op.
//!
//! A `Caller` made from URLs connects again when its connection is lost, at the next
//! request, along its list of URLs (a cluster's nodes); `dial.rs` walks the list.
//! Only requests that are safe to repeat are sent again when their connection is
//! lost with them in flight. Each connection's pushes are routed to the watches open
//! on it (`watch.rs`); what a caller and its watch streams share (`Shared`) lives
//! behind an `Arc`, so a stream can open its watch again through the caller's
//! reconnecting.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};
use tokio::task::JoinHandle;
use tracing::{debug, warn};
use turnd_proto::{
    CheckOk, ErrorCode, EventsArgs, EventsOk, FunctionsOk, HelloArgs, ListArgs, ListOk, Role,
    Session, SessionIdArgs, SessionOk, SessionStopArgs, SessionsListArgs, SessionsListOk, StatsOk,
    StopArgs, SubmitArgs, SubmitOk, TurnIdArgs, TurnOk, TurnsOk, WaitArgs, WatchArgs, WatchIdArgs,
    WatchOk, WorkersOk, WAIT_MAX_MS,
};
use turnd_proto::{Function, OnBusy, ResumeArgs, Stats, Turn, Violation, CLOSE_GOING_AWAY};

use crate::connection::{lock, Connection};
use crate::dial::Dial;
use crate::error::ClientError;
use crate::watch::Routes;
use crate::watch::{Opening, WatchState, WatchStream};

/// Extra time given to the server's own answer of the last `turn.wait` of
/// [`Caller::wait_terminal`] before the client gives up on it.
const WAIT_ANSWER_GRACE: Duration = Duration::from_millis(1000);

/// A client-role (or operator-role) connection with typed helpers for every client op.
///
/// Made with [`Caller::connect_any`] it knows several URLs (a cluster's nodes): it
/// connects to the first that answers, and when its connection is lost the next
/// request connects again, trying the URLs in order from the one after the lost
/// one's. A request whose connection was lost while it was in flight is sent again
/// on the new connection only when that is safe: reads, stops, `watch`, and a
/// submit or resume with an idempotency key, and any request at all when the server
/// closed the connection with 1001 ([`turnd_proto::CLOSE_GOING_AWAY`]: it shuts down,
/// and it answered every request it read). Any other fails with
/// [`ClientError::Closed`]: whether the daemon acted on it is unknown.
///
/// Its watches ([`WatchStream`]) are opened again on the new connection from the
/// last event they delivered, so they go on with no gap and no repeat; see
/// [`WatchStream`]. A caller made with [`Caller::from_connection`] does not
/// reconnect, and its watches end with its connection.
#[derive(Debug)]
pub struct Caller {
    shared: Arc<Shared>,
}

/// What a caller and its watch streams share: where to connect, the current link,
/// and the watches open through it.
#[derive(Debug)]
pub(crate) struct Shared {
    /// Where to connect again; `None` for a caller made from a given connection,
    /// which does not reconnect.
    dial: Option<Dial>,
    link: Mutex<Link>,
    /// Held while connecting again, so that concurrent requests open one connection.
    reconnecting: tokio::sync::Mutex<()>,
    /// Each live stream's watch, by the id it was first opened with.
    watches: Mutex<HashMap<String, Arc<Mutex<WatchState>>>>,
}

/// One connection of a caller, with the routing of its pushes.
#[derive(Debug)]
struct Link {
    conn: Connection,
    routes: Arc<Mutex<Routes>>,
    /// Routes pushes; ends by itself with the connection.
    router: Option<JoinHandle<()>>,
    /// The index of its URL in the caller's list.
    at: usize,
}

impl Link {
    /// Take `conn`'s push stream: when the pushes were taken already, watches get no
    /// events.
    fn new(conn: Connection, at: usize) -> Link {
        let routes = Arc::new(Mutex::new(Routes::default()));
        let router = match conn.pushes() {
            Some(rx) => Some(tokio::spawn(crate::watch::route_pushes(rx, routes.clone()))),
            None => {
                warn!("push stream already taken; watches on this caller will get no events");
                lock(&routes).ended = true;
                None
            }
        };
        Link {
            conn,
            routes,
            router,
            at,
        }
    }

    fn live(&self) -> Live {
        Live {
            conn: self.conn.clone(),
            routes: self.routes.clone(),
            at: self.at,
        }
    }
}

/// What a request needs of the link it goes on.
struct Live {
    conn: Connection,
    routes: Arc<Mutex<Routes>>,
    at: usize,
}

/// Whether a request may be sent again on a new connection after its connection was
/// lost while it was in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Resend {
    /// It changes nothing, or nothing more the second time.
    Safe,
    /// It could act twice.
    Never,
}

impl Drop for Link {
    fn drop(&mut self) {
        // The router ends with the connection; other clones of the connection may keep
        // it alive, and nobody can claim streams from a dropped link.
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
        Caller::connect_any_as(&[url], role, token).await
    }

    /// Connect with role `client` to the first of `urls` that answers (a cluster's
    /// nodes), and to the next ones when the connection is lost (see [`Caller`]).
    /// Each URL gets [`OPEN_TIMEOUT`](crate::OPEN_TIMEOUT) to answer. Fails with [`ClientError::Connect`]
    /// naming every URL when none answers, and at once with the refusal when one
    /// refuses the `hello` for good (e.g. `not_authenticated`).
    pub async fn connect_any<S: AsRef<str>>(
        urls: &[S],
        token: Option<&str>,
    ) -> Result<Caller, ClientError> {
        Caller::connect_any_as(urls, Role::Client, token).await
    }

    /// [`Caller::connect_any`] with the given role (`client` or `operator`).
    pub async fn connect_any_as<S: AsRef<str>>(
        urls: &[S],
        role: Role,
        token: Option<&str>,
    ) -> Result<Caller, ClientError> {
        let hello = HelloArgs {
            token: token.map(str::to_string),
            name: Some("turnd-client".to_string()),
            ..HelloArgs::new(role)
        };
        let urls = urls.iter().map(|u| u.as_ref().to_string()).collect();
        let dial = Dial::new(urls, hello)?;
        let opened = dial.open_from(0).await?;
        Ok(Caller::new(Some(dial), Link::new(opened.conn, opened.at)))
    }

    /// Wrap an already greeted connection. Takes its push stream: when the pushes were
    /// taken already, watches get no events. Such a caller does not reconnect.
    pub fn from_connection(conn: Connection) -> Caller {
        Caller::new(None, Link::new(conn, 0))
    }

    fn new(dial: Option<Dial>, link: Link) -> Caller {
        let shared = Shared {
            dial,
            link: Mutex::new(link),
            reconnecting: tokio::sync::Mutex::new(()),
            watches: Mutex::new(HashMap::new()),
        };
        Caller {
            shared: Arc::new(shared),
        }
    }

    /// The current connection (for raw requests); it may have ended (the next
    /// request through the caller then connects again). Its push stream belongs to
    /// the caller.
    pub fn connection(&self) -> Connection {
        lock(&self.shared.link).conn.clone()
    }

    /// The URL of the current connection; `None` for a caller made with
    /// [`Caller::from_connection`].
    pub fn url(&self) -> Option<String> {
        let at = lock(&self.shared.link).at;
        self.shared
            .dial
            .as_ref()
            .and_then(|d| d.urls.get(at).cloned())
    }

    /// [`Shared::exchange`] of a request that is safe to send again.
    async fn call<A: serde::Serialize, R: serde::de::DeserializeOwned>(
        &self,
        op: &str,
        args: &A,
    ) -> Result<R, ClientError> {
        Ok(self.shared.exchange(op, args, Resend::Safe).await?.0)
    }

    /// `turn.submit`.
    pub async fn submit(&self, args: SubmitArgs) -> Result<SubmitOk, ClientError> {
        let resend = if args.idempotency_key.is_some() {
            Resend::Safe
        } else {
            Resend::Never
        };
        Ok(self.shared.exchange("turn.submit", &args, resend).await?.0)
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
        let resend = if args.idempotency_key.is_some() {
            Resend::Safe
        } else {
            Resend::Never
        };
        Ok(self.shared.exchange("turn.resume", &args, resend).await?.0)
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
        Ok(self.call::<_, TurnOk>("turn.get", &args).await?.turn)
    }

    /// `turn.wait`: the turn as soon as it is terminal, or as it is when `timeout_ms`
    /// (server default 30000) passes.
    pub async fn wait(&self, turn_id: &str, timeout_ms: Option<u64>) -> Result<Turn, ClientError> {
        let args = WaitArgs {
            turn_id: turn_id.to_string(),
            timeout_ms,
        };
        Ok(self.call::<_, TurnOk>("turn.wait", &args).await?.turn)
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
        Ok(self.call::<_, TurnOk>("turn.stop", &args).await?.turn)
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
        Ok(self.call::<_, TurnsOk>("session.stop", &args).await?.turns)
    }

    /// `turn.list`.
    pub async fn list(&self, args: ListArgs) -> Result<ListOk, ClientError> {
        self.call("turn.list", &args).await
    }

    /// `session.inspect`.
    pub async fn inspect(&self, session_id: &str) -> Result<Session, ClientError> {
        let args = SessionIdArgs {
            session_id: session_id.to_string(),
        };
        Ok(self
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
        self.call("session.events", &args).await
    }

    /// `watch`: a stream of the session's (or turn's) new events.
    ///
    /// Without `after`, a caller that reconnects starts it at the session's last
    /// event as it reads it first (`session.inspect`, after `turn.get` for a turn
    /// watch; 0 for a session with no events yet), so that a reopening after a lost
    /// connection knows where it started even before it delivered an event.
    pub async fn watch(&self, mut args: WatchArgs) -> Result<WatchStream, ClientError> {
        if args.after.is_none() && self.shared.reconnects() {
            args.after = self.last_event_of(&args).await?;
        }
        let opening = self.shared.open_watch(&args).await?;
        Ok(WatchStream::new(self.shared.clone(), args, opening))
    }

    /// The last event's `seq` of the session a watch's `args` name (0 when it has
    /// none); `None` when they name neither a session nor a turn.
    async fn last_event_of(&self, args: &WatchArgs) -> Result<Option<u64>, ClientError> {
        let session_id = match (&args.session_id, &args.turn_id) {
            (Some(s), None) => s.clone(),
            (None, Some(t)) => self.get(t).await?.session_id,
            _ => return Ok(None),
        };
        match self.inspect(&session_id).await {
            Ok(session) => Ok(Some(session.last_event)),
            Err(e) if e.code() == Some(ErrorCode::NotFound) => Ok(Some(0)),
            Err(e) => Err(e),
        }
    }

    /// `unwatch`, by the id the watch was first opened with ([`WatchStream`]'s
    /// `watch_id`, which stays that id when the watch is opened again on a new
    /// connection); the watch's stream ends. A watch whose stream is open through
    /// this caller ends even when its connection is being replaced, and is answered
    /// `Ok` then; an id of no such stream is sent as it is, on the current
    /// connection.
    pub async fn unwatch(&self, watch_id: &str) -> Result<(), ClientError> {
        self.shared.unwatch(watch_id).await
    }

    /// `stats`.
    pub async fn stats(&self) -> Result<Stats, ClientError> {
        Ok(self.call::<_, StatsOk>("stats", &json!({})).await?.stats)
    }

    /// `workers.list`.
    pub async fn workers(&self) -> Result<Vec<turnd_proto::Worker>, ClientError> {
        Ok(self
            .call::<_, WorkersOk>("workers.list", &json!({}))
            .await?
            .workers)
    }

    /// `functions.list`.
    pub async fn functions(&self) -> Result<Vec<Function>, ClientError> {
        Ok(self
            .call::<_, FunctionsOk>("functions.list", &json!({}))
            .await?
            .functions)
    }

    /// `sessions.list`: sessions with unfinished work, filtered and paged.
    pub async fn sessions(&self, args: &SessionsListArgs) -> Result<SessionsListOk, ClientError> {
        self.call::<_, SessionsListOk>("sessions.list", args).await
    }

    /// `store.check` (operator role only).
    pub async fn store_check(&self) -> Result<Vec<Violation>, ClientError> {
        Ok(self
            .call::<_, CheckOk>("store.check", &json!({}))
            .await?
            .violations)
    }

    /// `ping`.
    pub async fn ping(&self) -> Result<(), ClientError> {
        self.call::<_, Value>("ping", &json!({})).await.map(|_| ())
    }
}

impl Shared {
    /// Whether it connects again when its connection is lost.
    pub(crate) fn reconnects(&self) -> bool {
        self.dial.is_some()
    }

    pub(crate) fn register(&self, first_id: &str, state: Arc<Mutex<WatchState>>) {
        lock(&self.watches).insert(first_id.to_string(), state);
    }

    pub(crate) fn unregister(&self, first_id: &str) {
        lock(&self.watches).remove(first_id);
    }

    /// `watch` on the live connection (on a new one when it is lost in flight), its
    /// events claimed.
    pub(crate) async fn open_watch(&self, args: &WatchArgs) -> Result<Opening, ClientError> {
        let (ok, live): (WatchOk, Live) = self.exchange("watch", args, Resend::Safe).await?;
        let rx = lock(&live.routes).claim(&ok.watch_id);
        Ok(Opening {
            watch_id: ok.watch_id,
            rx,
            conn: live.conn,
        })
    }

    /// [`Caller::unwatch`].
    pub(crate) async fn unwatch(&self, watch_id: &str) -> Result<(), ClientError> {
        let state = lock(&self.watches).get(watch_id).cloned();
        // Whether this unwatch ends a stream of this caller that was not unwatched.
        let mut ends_stream = false;
        let current = match &state {
            Some(state) => {
                let mut state = lock(state);
                ends_stream = !state.unwatched;
                state.unwatched = true;
                state.current.clone()
            }
            None => watch_id.to_string(),
        };
        let args = WatchIdArgs {
            watch_id: current.clone(),
        };
        let live = lock(&self.link).live();
        let result = live.conn.request("unwatch", to_args(&args)?).await;
        // Stop routing either way: after `not_found` there is nothing to route, and
        // after success the server sends no more.
        lock(&live.routes).forget(&current);
        match result {
            // The stream ends all the same: its connection is gone, or it is being
            // opened again and unwatches itself once it is.
            Err(e)
                if ends_stream
                    && (e == ClientError::Closed || e.code() == Some(ErrorCode::NotFound)) =>
            {
                debug!(watch_id, error = %e, "unwatch of a watch between connections");
                Ok(())
            }
            r => r.map(|_| ()),
        }
    }

    /// The current link, or, when its connection has ended and the caller knows its
    /// URLs, a new one to the first URL that answers after the ended one's.
    async fn live(&self) -> Result<Live, ClientError> {
        let current = lock(&self.link).live();
        let Some(dial) = &self.dial else {
            return Ok(current);
        };
        if !current.conn.is_closed() {
            return Ok(current);
        }
        let _one = self.reconnecting.lock().await;
        let current = lock(&self.link).live();
        if !current.conn.is_closed() {
            return Ok(current);
        }
        // Boxed: dialing's state (a TCP connect and a WebSocket handshake) is several
        // KB, and every request's future would carry room for it, while a request
        // dials only after its connection was lost.
        let opened = Box::pin(dial.open_from(current.at + 1)).await?;
        debug!(url = ?dial.urls.get(opened.at), "connected again");
        let link = Link::new(opened.conn, opened.at);
        let live = link.live();
        *lock(&self.link) = link;
        Ok(live)
    }

    /// Send `op` on the live connection; when that connection is lost with the
    /// request in flight and `resend` allows it, once more on a new connection.
    /// Returns the answer and the link that gave it.
    async fn exchange<A: serde::Serialize, R: serde::de::DeserializeOwned>(
        &self,
        op: &str,
        args: &A,
        resend: Resend,
    ) -> Result<(R, Live), ClientError> {
        let live = self.live().await?;
        match live.conn.call(op, args).await {
            Ok(r) => Ok((r, live)),
            Err(ClientError::Closed)
                if self.dial.is_some()
                    && (resend == Resend::Safe
                        || live.conn.close_code() == Some(CLOSE_GOING_AWAY)) =>
            {
                // After a 1001 the server read no request it did not answer: this
                // one changed nothing, whatever its op.
                debug!(
                    op,
                    close_code = live.conn.close_code(),
                    "connection lost with the request in flight; sending it again"
                );
                // The request fails before the connection is marked ended.
                live.conn.closed().await;
                let again = self.live().await?;
                let r = again.conn.call(op, args).await?;
                Ok((r, again))
            }
            Err(e) => Err(e),
        }
    }
}

fn to_args<A: serde::Serialize>(args: &A) -> Result<Value, ClientError> {
    serde_json::to_value(args).map_err(|e| ClientError::Decode(format!("encode args: {e}")))
}
