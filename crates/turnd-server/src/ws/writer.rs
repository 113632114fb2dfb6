//! The writer task of a connection: it drains the outbox (every frame queued goes
//! out with one flush), pings every heartbeat, and ends the connection with the
//! close frame of whichever cause closed it first, the reader's or the engine's.

use std::time::Duration;

use futures_util::{Sink, SinkExt};
use tokio::sync::{mpsc, oneshot};
use tokio_tungstenite::tungstenite::{Error as WsError, Message};
use turnd_engine::{CloseReason, Outbox};
use turnd_proto::{CLOSE_GOING_AWAY, CLOSE_SUPERSEDED};

use super::reader::Close;

/// Most frames a connection's writer takes from its queue before it flushes them.
const WRITE_BATCH_FRAMES: usize = 64;

/// The close frame (code, reason) for why the engine closed a connection; `None`:
/// send none.
fn engine_close_frame(r: CloseReason) -> Close {
    let (code, reason) = match r {
        CloseReason::Superseded => (
            CLOSE_SUPERSEDED,
            "superseded by a newer connection of this worker_id",
        ),
        CloseReason::SlowReader => (
            1008,
            "outgoing queue full: the peer does not read fast enough",
        ),
        CloseReason::Unavailable => (
            1011,
            "a watch's events could not be read from the store; watch again with `after`",
        ),
        CloseReason::ServerClosing => (CLOSE_GOING_AWAY, "server closing"),
        CloseReason::InDoubt => (
            1011,
            "a request's outcome is in doubt (its partition changed leader): reconnect and \
             read it back (turn.get, or resubmit with the same idempotency_key)",
        ),
        CloseReason::ReaderEnded => return None,
    };
    Some((code, reason.to_string()))
}

/// The close frame of a closed connection: the first cause that tagged its outbox
/// decides. The reader tags it ([`CloseReason::ReaderEnded`]) just before it sends
/// its own choice on `from_reader` (`None`: the peer is gone, no frame); any other
/// tag is the engine's.
async fn close_frame(outbox: &Outbox, from_reader: &mut oneshot::Receiver<Close>) -> Close {
    match outbox.close_reason() {
        Some(CloseReason::ReaderEnded) => from_reader.await.ok().flatten(),
        Some(r) => engine_close_frame(r),
        None => Some((CLOSE_GOING_AWAY, "server closing".to_string())),
    }
}

/// Write `first` and the frames already queued behind it with one flush (one send
/// syscall) for the lot. When the queue runs dry the writer yields once before it
/// flushes, so that the tasks already woken on this thread (answers and pushes being
/// made) add theirs to the same write; with nothing else to run the yield returns at
/// once. Under `turnd-bench sessions` this cut the process's CPU per turn by 16 -
/// 20 % (docs/benchmarks.md).
async fn write_batch<S>(
    sink: &mut S,
    first: String,
    out_rx: &mut mpsc::Receiver<String>,
) -> Result<(), WsError>
where
    S: Sink<Message, Error = WsError> + Unpin,
{
    sink.feed(Message::text(first)).await?;
    let mut batched = 1;
    let mut yielded = false;
    while batched < WRITE_BATCH_FRAMES {
        let Ok(more) = out_rx.try_recv() else {
            if yielded {
                break;
            }
            yielded = true;
            tokio::task::yield_now().await;
            continue;
        };
        sink.feed(Message::text(more)).await?;
        batched += 1;
    }
    sink.flush().await
}

/// The writer of a connection: drains the outbox, pings, and sends the close
/// frame. Every write must finish within `stall`: a peer that does not read fills
/// the socket's buffers, and the connection is then closed (1008) rather than
/// holding its queue and every request waiting for room in it.
///
/// The connection ends when its outbox is closed, by the engine or by the reader
/// (which tags it, then sends its close frame on `from_reader`). Only that one arm
/// ends the loop, and the frame is the first tag's whichever way it was woken, so
/// the peer gets the same close code however the arms race.
pub(super) async fn write_loop<S>(
    mut sink: S,
    mut out_rx: mpsc::Receiver<String>,
    outbox: Outbox,
    mut from_reader: oneshot::Receiver<Close>,
    heartbeat: Duration,
    stall: Duration,
) -> S
where
    S: Sink<Message, Error = WsError> + Unpin,
{
    let mut ping = tokio::time::interval(heartbeat);
    ping.tick().await;
    let close = loop {
        let wrote = tokio::select! {
            frame = out_rx.recv() => match frame {
                Some(f) => tokio::time::timeout(stall, write_batch(&mut sink, f, &mut out_rx)).await,
                None => break None,
            },
            _ = ping.tick() => {
                tokio::time::timeout(stall, sink.send(Message::Ping(Vec::new().into()))).await
            }
            _ = outbox.closed() => break close_frame(&outbox, &mut from_reader).await,
        };
        match wrote {
            Ok(Ok(())) => {}
            Ok(Err(_)) => break None,
            Err(_) => break stalled(&outbox, &mut from_reader, stall).await,
        }
    };
    finish(&mut sink, &mut out_rx, close, stall).await;
    sink
}

/// A write that did not finish within `stall`: the connection closes as a slow
/// reader's (1008), unless another cause closed it first.
async fn stalled(
    outbox: &Outbox,
    from_reader: &mut oneshot::Receiver<Close>,
    stall: Duration,
) -> Close {
    outbox.close_with(CloseReason::SlowReader);
    match outbox.close_reason() {
        Some(CloseReason::SlowReader) => Some((
            1008,
            format!(
                "nothing could be written for {} ms: the peer does not read",
                stall.as_millis()
            ),
        )),
        _ => close_frame(outbox, from_reader).await,
    }
}

/// Flush what is queued (responses already promised), then close; a peer that does
/// not read gets no longer than `stall` for all of it.
async fn finish<S>(sink: &mut S, out_rx: &mut mpsc::Receiver<String>, close: Close, stall: Duration)
where
    S: Sink<Message, Error = WsError> + Unpin,
{
    let finish = async {
        while let Ok(f) = out_rx.try_recv() {
            if sink.send(Message::text(f)).await.is_err() {
                break;
            }
        }
        turnd_socket::close(sink, close.as_ref().map(|(c, r)| (*c, r.as_str()))).await;
    };
    if tokio::time::timeout(stall, finish).await.is_err() {
        tracing::debug!("connection closed without its last frames: the peer does not read");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::StreamExt;
    use turnd_proto::CLOSE_TOO_BIG;

    /// The close code a peer receives when the reader's close and the engine's both
    /// have happened before the writer looks: every arm of its `select!` is then
    /// ready, and the code must be the first cause's whichever arm wins.
    async fn close_code_seen(
        first_engine: Option<CloseReason>,
        reader: Option<(u16, &str)>,
        then_engine: Option<CloseReason>,
    ) -> Option<u16> {
        use tokio_tungstenite::tungstenite::protocol::Role;
        use tokio_tungstenite::WebSocketStream;
        let (server_io, client_io) = tokio::io::duplex(1 << 16);
        let server = WebSocketStream::from_raw_socket(server_io, Role::Server, None).await;
        let mut client = WebSocketStream::from_raw_socket(client_io, Role::Client, None).await;
        let (outbox, out_rx) = Outbox::new("c".into(), 8);
        // A frame queued before the close, as a response would be.
        assert!(outbox.push("{\"id\":1}".into()));
        let (close_tx, close_rx) = oneshot::channel();
        if let Some(r) = first_engine {
            outbox.close_with(r);
        }
        outbox.close_with(CloseReason::ReaderEnded);
        close_tx
            .send(reader.map(|(c, r)| (c, r.to_string())))
            .expect("the writer is not started yet");
        if let Some(r) = then_engine {
            outbox.close_with(r);
        }
        let (sink, _stream) = server.split();
        let writer = tokio::spawn(write_loop(
            sink,
            out_rx,
            outbox,
            close_rx,
            Duration::from_millis(1),
            Duration::from_secs(5),
        ));
        let mut code = None;
        let mut texts = 0;
        while let Some(Ok(m)) = client.next().await {
            match m {
                Message::Text(_) => texts += 1,
                Message::Close(c) => {
                    code = c.map(|c| u16::from(c.code));
                    break;
                }
                _ => {}
            }
        }
        drop(writer.await.expect("the writer ends"));
        assert_eq!(texts, 1, "the queued frame goes out before the close");
        code
    }

    #[tokio::test]
    async fn the_first_cause_of_a_close_decides_its_code_whichever_arm_wins() {
        // `select!` picks among ready arms at random: many rounds of each.
        for _ in 0..40 {
            // The reader closed first (a frame over the limit), then the engine
            // (an overflowing push): 1009.
            let code = close_code_seen(
                None,
                Some((CLOSE_TOO_BIG, "frame too large")),
                Some(CloseReason::SlowReader),
            )
            .await;
            assert_eq!(code, Some(CLOSE_TOO_BIG));
            // The engine closed first (a newer connection of the worker), then the
            // reader saw the outbox close: 4001.
            let code = close_code_seen(Some(CloseReason::Superseded), None, None).await;
            assert_eq!(code, Some(CLOSE_SUPERSEDED));
            // The engine first, then the reader with a code of its own: 4001.
            let code = close_code_seen(
                Some(CloseReason::Superseded),
                Some((1001, "server shutting down")),
                None,
            )
            .await;
            assert_eq!(code, Some(CLOSE_SUPERSEDED));
            // The reader first, shutting down, then the engine: 1001.
            let code = close_code_seen(
                None,
                Some((1001, "server shutting down")),
                Some(CloseReason::Unavailable),
            )
            .await;
            assert_eq!(code, Some(1001));
            // The peer went away: no close frame of ours.
            assert_eq!(close_code_seen(None, None, None).await, None);
        }
    }
}
