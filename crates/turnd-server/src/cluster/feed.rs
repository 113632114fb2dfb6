//! The leader's side of a relayed watch: partition `p`'s leader runs the watch on
//! its engine into a bounded queue of its own and publishes what it queues, in
//! order and numbered, on the subject the watching node named.
//!
//! The watching node ([`super::watch`]) answers its caller and delivers every
//! frame; this side keeps what is in flight bounded by the watching node's acks
//! (at most [`WINDOW`] frames published and not acknowledged), so a watcher that
//! does not read fills this queue and meets the protocol's own overflow rule here
//! (the queue closes as a slow reader's would, and the watching node closes its
//! caller's connection the same way). Between frames it sends a beat, so the
//! watching node can tell a leader that died from one with nothing to say; it stops
//! when the engine stops (the partition moved: the watching node resumes on the new
//! leader from the last event it delivered), when the watching node says stop, or
//! when that node has been silent too long.
//!
//! On the wire, each message's first line says what it is: `f <n>` then a frame
//! (the `n`th), `b <n>` (a beat: `n` frames so far), `e <n> <why>` (the end; `slow`
//! when the watcher fell behind). Acks are the count of frames received, as text,
//! or `x` to stop.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;
use tokio::time::Instant;
use turnd_engine::{CloseReason, Engine, Outbox};
use turnd_proto::{ErrorBody, ErrorCode, WatchArgs};

use super::rpc::ForwardReply;
use crate::router::decode;

/// Frames published and not yet acknowledged, at most.
pub(super) const WINDOW: u64 = 256;

/// Where a relayed watch's frames go, and where its acks come from.
#[derive(Serialize, Deserialize, Clone, Debug)]
pub(super) struct RelayTo {
    pub frames: String,
    pub acks: String,
}

/// The leader's answer to a relayed watch: where it starts.
#[derive(Serialize, Deserialize)]
pub(super) struct FeedOk {
    pub after: u64,
}

/// How a leader runs its feeds.
#[derive(Clone)]
pub(super) struct FeedCfg {
    /// Frames the feed's queue holds (`server.outbox_frames`).
    pub capacity: usize,
    /// A beat at least this often.
    pub beat: Duration,
    /// The watching node silent this long: the feed ends.
    pub silence: Duration,
    /// Feeds running on this node now.
    pub running: Arc<AtomicU64>,
}

/// One message of a feed, as the watching node reads it.
#[derive(Debug, PartialEq)]
pub(super) enum FeedMsg<'a> {
    Frame(u64, &'a str),
    Beat(u64),
    End(u64, &'a str),
}

impl<'a> FeedMsg<'a> {
    pub(super) fn parse(payload: &'a [u8]) -> Option<FeedMsg<'a>> {
        let text = std::str::from_utf8(payload).ok()?;
        let (head, body) = text.split_once('\n').unwrap_or((text, ""));
        let mut words = head.splitn(3, ' ');
        let kind = words.next()?;
        let n: u64 = words.next()?.parse().ok()?;
        match kind {
            "f" => Some(FeedMsg::Frame(n, body)),
            "b" => Some(FeedMsg::Beat(n)),
            "e" => Some(FeedMsg::End(n, words.next().unwrap_or(""))),
            _ => None,
        }
    }
}

/// Start a relayed watch of `args` on `engine`: its start (`after`), or the error
/// the watch met before it began (as the engine answers it).
pub(super) async fn open(
    client: &async_nats::Client,
    engine: &Engine,
    args: &str,
    to: RelayTo,
    cfg: FeedCfg,
) -> ForwardReply {
    let mut args: WatchArgs = match decode(args) {
        Ok(a) => a,
        Err(e) => return ForwardReply::Error(e),
    };
    let after = match engine.watch_cursor(&args).await {
        Ok(a) => a,
        Err(e) => return ForwardReply::Error(e.into()),
    };
    args.after = Some(after);
    let acks = match client.subscribe(to.acks.clone()).await {
        Ok(s) => s,
        Err(e) => {
            return ForwardReply::Error(ErrorBody::new(
                ErrorCode::Unavailable,
                format!("subscribe to a watch's acks: {e}"),
            ))
        }
    };
    let (outbox, rx) = Outbox::new(format!("feed-{}", to.acks), cfg.capacity);
    let (began, begun) = tokio::sync::oneshot::channel::<()>();
    let watching = {
        let (engine, outbox) = (engine.clone(), outbox.clone());
        tokio::spawn(async move {
            engine
                .watch(args, &outbox, 1, move |_| {
                    if began.send(()).is_err() {
                        tracing::debug!("cluster: a feed's start was not awaited");
                    }
                    // Not a frame for the watcher: the watching node answers it.
                    String::new()
                })
                .await
        })
    };
    if begun.await.is_err() {
        // The watch ended before it began: its error.
        return ForwardReply::Error(match watching.await {
            Ok(Err(e)) => e.into(),
            Ok(Ok(())) => ErrorBody::new(ErrorCode::Internal, "a watch ended before it began"),
            Err(j) => ErrorBody::new(ErrorCode::Internal, format!("a watch's task: {j}")),
        });
    }
    let feed = Feed {
        client: client.clone(),
        engine: engine.clone(),
        outbox,
        rx,
        acks,
        frames: to.frames,
        cfg,
    };
    tokio::spawn(feed.run());
    match serde_json::to_string(&FeedOk { after }) {
        Ok(text) => ForwardReply::Ok(text),
        Err(e) => ForwardReply::Error(ErrorBody::new(ErrorCode::Internal, e.to_string())),
    }
}

/// A running feed.
struct Feed {
    client: async_nats::Client,
    engine: Engine,
    outbox: Outbox,
    rx: mpsc::Receiver<String>,
    acks: async_nats::Subscriber,
    frames: String,
    cfg: FeedCfg,
}

impl Feed {
    /// Publish until the feed ends, then drop the watch.
    async fn run(mut self) {
        self.cfg.running.fetch_add(1, Ordering::Relaxed);
        let (sent, end) = self.pump().await;
        self.cfg.running.fetch_sub(1, Ordering::Relaxed);
        self.engine.connection_closed(&self.outbox.conn_id);
        if let Some(why) = end {
            self.publish(format!("e {sent} {why}")).await;
        }
    }

    /// The frames numbered and published, beats between; how many were sent, and
    /// why it ended (none when the watching node stopped it or is gone).
    async fn pump(&mut self) -> (u64, Option<&'static str>) {
        let (mut sent, mut acked) = (0u64, 0u64);
        let mut heard = Instant::now();
        let mut beat = tokio::time::interval(self.cfg.beat);
        beat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                biased;
                m = self.acks.next() => match m.as_ref().map(|m| &m.payload[..]) {
                    None | Some(b"x") => return (sent, None),
                    Some(n) => {
                        if let Some(n) = std::str::from_utf8(n).ok().and_then(|t| t.parse().ok()) {
                            acked = acked.max(n);
                            heard = Instant::now();
                        }
                    }
                },
                () = self.outbox.closed() => {
                    let why = match self.outbox.close_reason() {
                        Some(CloseReason::SlowReader) => "slow",
                        _ => "closed",
                    };
                    return (sent, Some(why));
                }
                f = self.rx.recv(), if sent - acked < WINDOW => match f {
                    None => return (sent, Some("ended")),
                    Some(f) if f.is_empty() => {}
                    Some(f) => {
                        sent += 1;
                        if !self.publish(format!("f {sent}\n{f}")).await {
                            return (sent, None);
                        }
                    }
                },
                _ = beat.tick() => {
                    if self.engine.is_shut_down() {
                        return (sent, Some("moved"));
                    }
                    if heard.elapsed() > self.cfg.silence {
                        return (sent, None);
                    }
                    if !self.publish(format!("b {sent}")).await {
                        return (sent, None);
                    }
                }
            }
        }
    }

    async fn publish(&self, text: String) -> bool {
        match self.client.publish(self.frames.clone(), text.into()).await {
            Ok(()) => true,
            Err(e) => {
                tracing::debug!("cluster: publish a watch's frame: {e}");
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::FeedMsg;

    #[test]
    fn messages_parse() {
        assert_eq!(
            FeedMsg::parse(b"f 3\n{\"a\":1}"),
            Some(FeedMsg::Frame(3, "{\"a\":1}"))
        );
        assert_eq!(FeedMsg::parse(b"b 7"), Some(FeedMsg::Beat(7)));
        assert_eq!(FeedMsg::parse(b"e 2 slow"), Some(FeedMsg::End(2, "slow")));
        assert_eq!(FeedMsg::parse(b"q 2"), None);
        assert_eq!(FeedMsg::parse(b"f x\n{}"), None);
    }
}
