//! The SDK's one error type.
//!
//! Callers must tell apart a refusal by the server (with its protocol error code) from
//! a connection that is gone, a reply that could not be decoded and a client-side
//! timeout, because each calls for a different reaction (fix the request, reconnect,
//! report a bug, wait longer).

use turnd_proto::{ErrorBody, ErrorCode};

/// Everything a request through the SDK can end in, other than success.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ClientError {
    /// The server answered the request with an error response.
    #[error("server refused the request: {0}")]
    Protocol(ErrorBody),
    /// The WebSocket connection could not be established (or a worker had to stop
    /// because its connection can no longer be used, e.g. it was superseded).
    #[error("failed to connect: {0}")]
    Connect(String),
    /// The connection ended before the answer arrived. Whether the server acted on the
    /// request is unknown.
    #[error("connection closed before the answer arrived")]
    Closed,
    /// The server's answer could not be decoded into the expected shape.
    #[error("failed to decode the server's answer: {0}")]
    Decode(String),
    /// A client-side time limit passed (e.g. [`crate::Caller::wait_terminal`]).
    #[error("timed out")]
    Timeout,
}

impl ClientError {
    /// The protocol error code, when the server refused the request.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            ClientError::Protocol(body) => Some(body.code),
            _ => None,
        }
    }

    /// Whether trying the same request again later may succeed: a retryable server
    /// error, a lost connection or a timeout.
    pub fn is_retryable(&self) -> bool {
        match self {
            ClientError::Protocol(body) => body.retryable || body.code.retryable(),
            ClientError::Connect(_) | ClientError::Closed | ClientError::Timeout => true,
            ClientError::Decode(_) => false,
        }
    }
}

impl From<ErrorBody> for ClientError {
    fn from(body: ErrorBody) -> Self {
        ClientError::Protocol(body)
    }
}
