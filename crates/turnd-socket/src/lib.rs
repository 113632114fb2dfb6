//! WebSocket plumbing that turnd's two listeners share: protocol v1
//! (`turnd-server`'s `ws`) and the iii endpoint (`turnd-iii`). It sits below both,
//! so neither edge depends on the other for it (`turnd-server` depends on
//! `turnd-iii`, which starts inside the daemon).
//!
//! What is here is how a connection's writer ends its connection: the close frame
//! with the code the connection chose, then the end of the stream.

use futures_util::{Sink, SinkExt};
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::{Error as WsError, Message};

/// Close a connection from its writer: send a close frame with `frame`'s code and
/// reason, if there is one (`None`: the peer is gone, or the connection ends without
/// saying why), then close the sink. Failures are logged, not returned: the
/// connection is over either way.
pub async fn close<S>(sink: &mut S, frame: Option<(u16, &str)>)
where
    S: Sink<Message, Error = WsError> + Unpin,
{
    if let Some((code, reason)) = frame {
        let frame = CloseFrame {
            code: CloseCode::from(code),
            reason: reason.into(),
        };
        if let Err(e) = sink.send(Message::Close(Some(frame))).await {
            tracing::debug!("close frame not sent: {e}");
        }
    }
    if let Err(e) = sink.close().await {
        tracing::trace!("socket close: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::StreamExt;
    use tokio_tungstenite::tungstenite::protocol::Role;
    use tokio_tungstenite::WebSocketStream;

    /// The close frame the peer of a connection closed with `frame` reads: its code
    /// and reason (`None`: a close frame without a code).
    async fn peer_reads(frame: Option<(u16, &str)>) -> Option<(u16, String)> {
        let (server_io, client_io) = tokio::io::duplex(1 << 12);
        let mut server = WebSocketStream::from_raw_socket(server_io, Role::Server, None).await;
        let mut client = WebSocketStream::from_raw_socket(client_io, Role::Client, None).await;
        close(&mut server, frame).await;
        match client.next().await {
            Some(Ok(Message::Close(c))) => c.map(|c| (u16::from(c.code), c.reason.to_string())),
            other => panic!("expected a close frame, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn the_peer_reads_the_code_and_the_reason() {
        let got = peer_reads(Some((4001, "superseded"))).await;
        assert_eq!(got, Some((4001, "superseded".to_string())));
        // Without a frame of ours the sink's own close says no code.
        assert_eq!(peer_reads(None).await, None);
    }
}
