//! turnd wire protocol, version 1.
//!
//! This crate owns everything that crosses the wire: the request/response/push
//! envelopes, the error codes, the argument and result shapes of every op and the
//! objects (`Turn`, `Wait`, `Session`, `Event`, `Stats`, `Worker`, `Function`).
//! It depends on serde only, so the daemon, the SDK, the CLI and the tests share one
//! definition and cannot drift apart.

#![cfg_attr(
    test,
    allow(
        clippy::too_many_lines,
        reason = "a test reads as one scenario from its setup to its last assertion"
    )
)]

pub mod frame;
pub mod ids;
pub mod json_text;
pub mod objects;
pub mod ops;
pub mod partition;
pub mod url_list;

pub use frame::{
    decode_raw_request, decode_request, ErrorBody, ErrorCode, FrameError, ProgressPush, Push,
    RawRequest, Request,
};
pub use ids::{
    invocation_turn_id, new_connection_id, new_invocation_id, new_invocation_id_of, new_turn_id,
    new_watch_id, turn_id_bits,
};
pub use objects::*;
pub use ops::*;
pub use partition::{
    invocation_partition, new_turn_id_in, session_partition, turn_partition, MAX_PARTITIONS,
};

/// The only protocol version this crate speaks.
pub const PROTOCOL_VERSION: u64 = 1;
/// WebSocket path of protocol v1.
pub const WS_PATH: &str = "/v1";
/// Close code sent to a worker connection superseded by a newer `hello` with the
/// same `worker_id`.
pub const CLOSE_SUPERSEDED: u16 = 4001;
/// Close code for a server that shuts down (or a peer silent for 3 heartbeats).
/// It promises that every request the server read on the connection was answered
/// before the close frame: a request with no answer was never read and changed
/// nothing, so a client may send it again, as it was, on another connection.
/// When the server cannot keep that promise it closes with 1011 instead.
pub const CLOSE_GOING_AWAY: u16 = 1001;
/// Close code for a peer that sent too many bad frames in a row (policy violation).
pub const CLOSE_POLICY: u16 = 1008;
/// Close code for a frame over `max_frame_bytes`.
pub const CLOSE_TOO_BIG: u16 = 1009;
/// Bad frames in a row after which the server closes the connection.
pub const MAX_BAD_FRAMES: u32 = 16;
