//! A `watch` on a node of a cluster: relayed from the leader of its session's
//! partition to the caller's connection, whichever node that is on (the leader
//! itself included, so a watch outlives its partition's move the same way
//! everywhere).
//!
//! The node asks the leader for a feed ([`super::feed`]) on a subject of its own,
//! answers the caller with a watch id of its own, and delivers the feed's frames in
//! order with that id, waiting for room in the caller's queue (a reading caller can
//! replay any session; one that does not read fills the leader's queue and is
//! closed as a slow reader). It keeps the `seq` of the last event it delivered. When
//! the feed ends without a stop (the partition moved, its leader fell silent past a
//! lease, a frame went missing), it asks the partition's leader now for a new feed
//! from that `seq` (with `after`), and delivers only events past it: each event
//! once, in order, across any number of moves. A caller whose watch cannot resume
//! within [`RESUME_FOR`] has its connection closed with 1011 (it watches again with
//! `after`), as when a replay cannot read the store.

use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::Duration;

use futures_util::StreamExt;
use parking_lot::Mutex;
use serde_json::Value;
use tokio_util::sync::CancellationToken;
use turnd_engine::{Caller, CloseReason, EngineError, Outbox};
use turnd_proto::frame::encode_ok;
use turnd_proto::{new_watch_id, ErrorBody, ErrorCode, Op, WatchArgs, WatchOk};

use super::feed::{FeedMsg, FeedOk, RelayTo, WINDOW};
use super::route::Keys;
use super::rpc::Forwarded;
use super::Node;
use crate::router::{self, decode, Answer, Origin};

/// How long a relayed watch tries to resume on its partition's next leader.
pub(super) const RESUME_FOR: Duration = Duration::from_secs(30);

/// How long a new watch waits for its partition to have a leader (a takeover in
/// progress) before it is refused `unavailable`.
const OPEN_FOR: Duration = Duration::from_secs(10);

/// The longest a leader takes to answer a watch (its first page read).
const OPEN_TIMEOUT: Duration = Duration::from_secs(10);

/// The relayed watches of every connection of this node, by connection and id.
#[derive(Default)]
pub(crate) struct Relays {
    by_conn: Mutex<HashMap<String, HashMap<String, CancellationToken>>>,
}

impl Relays {
    /// Hold a place for watch `watch_id` of connection `conn`, at most `max` a
    /// connection.
    fn reserve(&self, conn: &str, watch_id: &str, max: usize) -> Option<CancellationToken> {
        let mut m = self.by_conn.lock();
        let mine = m.entry(conn.to_string()).or_default();
        if mine.len() >= max {
            return None;
        }
        let token = CancellationToken::new();
        mine.insert(watch_id.to_string(), token.clone());
        Some(token)
    }

    /// `unwatch`: stop it. Whether the connection had it.
    pub(super) fn stop(&self, conn: &str, watch_id: &str) -> bool {
        let t = self.take(conn, watch_id);
        t.as_ref().map(CancellationToken::cancel);
        t.is_some()
    }

    fn take(&self, conn: &str, watch_id: &str) -> Option<CancellationToken> {
        let mut m = self.by_conn.lock();
        let mine = m.get_mut(conn)?;
        let t = mine.remove(watch_id);
        if mine.is_empty() {
            m.remove(conn);
        }
        t
    }

    /// A connection ended: its watches stop.
    pub(super) fn connection_closed(&self, conn: &str) {
        let gone = self.by_conn.lock().remove(conn);
        for t in gone.into_iter().flat_map(HashMap::into_values) {
            t.cancel();
        }
    }

    /// Watches held by every connection.
    pub(crate) fn count(&self) -> usize {
        self.by_conn.lock().values().map(HashMap::len).sum()
    }
}

/// A feed as the watching node reads it.
struct Feed {
    sub: async_nats::Subscriber,
    acks: String,
    after: u64,
}

/// Why delivering a feed stopped.
#[derive(Debug)]
enum End {
    /// `unwatch`, or the caller's connection ended.
    Stopped,
    /// The caller fell behind: closed as a slow reader.
    Slow,
    /// The feed was lost: resume on the partition's leader now.
    Lost(&'static str),
}

/// One relayed watch.
struct Relay {
    node: Weak<Node>,
    p: u32,
    caller: Caller,
    args: WatchArgs,
    watch_id: String,
    outbox: Outbox,
    token: CancellationToken,
    /// The `seq` of the last event delivered (or where the watch began).
    cursor: u64,
    client: async_nats::Client,
    /// A feed silent this long is lost; acks go at least this often.
    silence: Duration,
    beat: Duration,
}

impl Node {
    /// `watch` (see the module documentation).
    pub(super) async fn watch(
        self: &Arc<Self>,
        caller: &Caller,
        args: &str,
        origin: Option<&Origin<'_>>,
    ) -> Result<Answer, ErrorBody> {
        let origin = router::connection(origin)?;
        let args: WatchArgs = decode(args)?;
        if args.session_id.is_some() == args.turn_id.is_some() {
            return Err(EngineError::WatchTarget.into());
        }
        let p = self.partition_of(&Keys {
            session_id: args.session_id.clone(),
            turn_id: args.turn_id.clone(),
            invocation_id: None,
        });
        let conn = origin.outbox.conn_id.clone();
        let watch_id = new_watch_id();
        let Some(token) = self.relays.reserve(&conn, &watch_id, origin.max_watches) else {
            return Err(EngineError::TooManyWatches {
                max: origin.max_watches,
            }
            .into());
        };
        let until = tokio::time::Instant::now() + OPEN_FOR;
        let feed = match self.open_until(p, caller, &args, until, &token).await {
            Ok(f) => f,
            Err(e) => {
                self.relays.take(&conn, &watch_id);
                return Err(e);
            }
        };
        let ok = serde_json::to_value(WatchOk {
            watch_id: watch_id.clone(),
        })
        .unwrap_or(Value::Null);
        let lease = Duration::from_millis(self.cluster.lease_ms);
        let relay = Relay {
            node: Arc::downgrade(self),
            p,
            caller: caller.clone(),
            cursor: feed.after,
            args,
            watch_id,
            outbox: origin.outbox.clone(),
            token,
            client: self.nats.client().clone(),
            silence: lease + lease / 3,
            beat: lease / 3,
        };
        if origin.outbox.send(encode_ok(origin.request_id, &ok)).await {
            tokio::spawn(relay.run(feed));
        } else {
            relay.stop_feed(&feed).await;
            self.relays.take(&conn, &relay.watch_id);
        }
        Ok(Answer::Queued)
    }

    /// [`Node::open_feed`], again while nobody leads the partition (a takeover in
    /// progress), every 20 ms doubling to 500 ms, until `until` or `stop`.
    async fn open_until(
        &self,
        p: u32,
        caller: &Caller,
        args: &WatchArgs,
        until: tokio::time::Instant,
        stop: &CancellationToken,
    ) -> Result<Feed, ErrorBody> {
        let mut pause = Duration::from_millis(20);
        loop {
            match self.open_feed(p, caller, args).await {
                Err(e) if e.code == ErrorCode::Unavailable || e.in_doubt => {
                    if tokio::time::Instant::now() + pause > until {
                        return Err(e);
                    }
                    tracing::debug!(partition = p, "cluster: open a watch: {}", e.message);
                }
                done => return done,
            }
            tokio::select! {
                () = stop.cancelled() => return Err(ErrorBody::new(ErrorCode::Unavailable, "the watch ended")),
                () = tokio::time::sleep(pause) => {}
            }
            pause = (pause * 2).min(Duration::from_millis(500));
        }
    }

    /// Ask partition `p`'s leader for a feed of `args`.
    async fn open_feed(
        &self,
        p: u32,
        caller: &Caller,
        args: &WatchArgs,
    ) -> Result<Feed, ErrorBody> {
        let rid = uuid::Uuid::new_v4().simple().to_string();
        let to = RelayTo {
            frames: format!("turnd.w.{}.{rid}", self.id),
            acks: format!("turnd.wa.{rid}"),
        };
        let sub = self
            .nats
            .client()
            .subscribe(to.frames.clone())
            .await
            .map_err(|e| ErrorBody::new(ErrorCode::Unavailable, format!("subscribe: {e}")))?;
        let f = Forwarded {
            role: caller.role,
            worker_id: caller.worker_id.clone(),
            op: Op::Watch.name().to_string(),
            args: serde_json::to_string(args)
                .map_err(|e| ErrorBody::new(ErrorCode::Internal, format!("encode a watch: {e}")))?,
            relay: Some(to.clone()),
            settings: None,
        };
        let text = self.ask_leader(p, Op::Watch, &f, OPEN_TIMEOUT).await?;
        let ok: FeedOk = decode(&text)?;
        Ok(Feed {
            sub,
            acks: to.acks,
            after: ok.after,
        })
    }
}

impl Relay {
    /// Deliver feeds until the watch stops.
    async fn run(mut self, mut feed: Feed) {
        loop {
            let end = self.deliver(&mut feed).await;
            self.stop_feed(&feed).await;
            match end {
                End::Stopped => break,
                End::Slow => {
                    self.outbox.close_with(CloseReason::SlowReader);
                    break;
                }
                End::Lost(why) => {
                    tracing::info!(
                        partition = self.p,
                        watch_id = self.watch_id,
                        after = self.cursor,
                        "cluster: a watch's feed was lost ({why}); resuming"
                    );
                    match self.resume().await {
                        Some(f) => feed = f,
                        None => {
                            if !self.token.is_cancelled() {
                                self.outbox.close_with(CloseReason::Unavailable);
                            }
                            break;
                        }
                    }
                }
            }
        }
        if let Some(node) = self.node.upgrade() {
            node.relays.take(&self.outbox.conn_id, &self.watch_id);
        }
    }

    /// A new feed from the last event delivered, from the partition's leader now;
    /// none when the watch stopped or no leader answered within [`RESUME_FOR`].
    async fn resume(&mut self) -> Option<Feed> {
        self.args.after = Some(self.cursor);
        let node = self.node.upgrade()?;
        node.counters.watch_resumes.inc();
        let until = tokio::time::Instant::now() + RESUME_FOR;
        let opened = node
            .open_until(self.p, &self.caller, &self.args, until, &self.token)
            .await;
        match opened {
            Ok(f) => Some(f),
            Err(e) => {
                if !self.token.is_cancelled() {
                    tracing::warn!(
                        partition = self.p,
                        "cluster: a watch cannot resume: {}",
                        e.message
                    );
                }
                None
            }
        }
    }

    /// Deliver one feed's frames until it ends.
    async fn deliver(&mut self, feed: &mut Feed) -> End {
        let (mut got, mut acked) = (0u64, 0u64);
        loop {
            let msg = tokio::select! {
                () = self.token.cancelled() => return End::Stopped,
                () = self.outbox.closed() => return End::Stopped,
                m = tokio::time::timeout(self.silence, feed.sub.next()) => match m {
                    Err(_) => return End::Lost("the leader fell silent"),
                    Ok(None) => return End::Lost("the subscription ended"),
                    Ok(Some(m)) => m,
                },
            };
            match FeedMsg::parse(&msg.payload) {
                Some(FeedMsg::Frame(n, frame)) if n == got + 1 => {
                    got = n;
                    if let Some(end) = self.frame(frame, feed, got).await {
                        return end;
                    }
                    if got - acked >= WINDOW / 4 {
                        self.ack(feed, got).await;
                        acked = got;
                    }
                }
                Some(FeedMsg::Beat(n)) if n == got => {
                    self.ack(feed, got).await;
                    acked = got;
                }
                Some(FeedMsg::End(_, "slow")) => return End::Slow,
                Some(FeedMsg::End(..)) => return End::Lost("the leader ended it"),
                _ => return End::Lost("a frame went missing"),
            }
        }
    }

    /// Deliver one frame with this watch's id: an event only once, past the cursor.
    async fn frame(&mut self, frame: &str, feed: &Feed, got: u64) -> Option<End> {
        let Ok(mut v) = serde_json::from_str::<Value>(frame) else {
            return Some(End::Lost("an unreadable frame"));
        };
        if v["push"] == "event" {
            let Some(seq) = v["event"]["seq"].as_u64() else {
                return Some(End::Lost("an event without a seq"));
            };
            if seq <= self.cursor {
                return None;
            }
            self.cursor = seq;
        } else if v.get("push").is_none() {
            return None;
        }
        v["watch_id"] = Value::String(self.watch_id.clone());
        let send = self.outbox.send(v.to_string());
        tokio::pin!(send);
        // A caller that reads slowly holds this up; the leader hears from us meanwhile.
        loop {
            tokio::select! {
                ok = &mut send => return (!ok).then_some(End::Stopped),
                () = self.token.cancelled() => return Some(End::Stopped),
                () = tokio::time::sleep(self.beat) => self.ack(feed, got).await,
            }
        }
    }

    async fn ack(&self, feed: &Feed, n: u64) {
        if let Err(e) = self
            .client
            .publish(feed.acks.clone(), n.to_string().into())
            .await
        {
            tracing::debug!("cluster: ack a watch's feed: {e}");
        }
    }

    /// Tell the leader to stop the feed (it also stops once it hears nothing).
    async fn stop_feed(&self, feed: &Feed) {
        if let Err(e) = self.client.publish(feed.acks.clone(), "x".into()).await {
            tracing::debug!("cluster: stop a watch's feed: {e}");
        }
    }
}
