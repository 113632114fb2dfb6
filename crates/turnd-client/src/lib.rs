//! turnd client SDK: callers and workers over protocol v1.
//!
//! - [`Connection`]: one WebSocket connection with requests multiplexed by id and a
//!   push stream; the building block of everything else.
//! - [`Caller`]: a client- or operator-role connection with a typed helper per op and
//!   per-watch streams of events and progress ([`Caller::watch_turn`]), `turn.resume`
//!   and `on_busy` ([`Caller::resume`], [`Caller::submit_on_busy`]).
//!   [`Caller::connect_any`] takes a cluster's nodes' URLs: it connects to the first
//!   that answers and, when that connection is lost, the next request connects to
//!   the next URL that answers. A request lost in flight is sent again on the new
//!   connection only when that is safe (reads, stops, `watch`, a submit or resume
//!   with an idempotency key, or any request after a 1001 close, which says the
//!   server never read it); any other fails with [`ClientError::Closed`].
//! - [`WatchStream`]: one watch's events (and progress). When its caller reconnects,
//!   it opens the watch again on the new connection with `after` = the last event
//!   it delivered, so its reader sees each event once, in order, across lost
//!   connections; it ends when unwatched, or when no URL lets it open the watch
//!   again within [`RESUME_TIMEOUT`] (30 s).
//! - [`Worker`]: serves functions and does the worker's part of loss handling (stable
//!   instance id, `inflight`/`finished` lists on reconnect, result resend until
//!   acknowledged, truthful `probe` answers, `cancel` delivered to the handler); a
//!   handler streams progress with [`InvocationCtx::progress`] and asks for input by
//!   returning `Outcome::Suspend`.
//!
//! The CLI, the end-to-end tests and the benchmarks all talk to the daemon through
//! this crate, so it is also the reference for what a well-behaved peer does.
//!
//! ```no_run
//! use std::time::Duration;
//! use serde_json::json;
//! use tokio_util::sync::CancellationToken;
//! use turnd_client::{Caller, FunctionSpec, Worker, WorkerOptions};
//! use turnd_client::turnd_proto::Outcome;
//!
//! # async fn demo() -> Result<(), turnd_client::ClientError> {
//! let url = "ws://127.0.0.1:7420/v1";
//! let shutdown = CancellationToken::new();
//! let worker = Worker::new(WorkerOptions::new(url, "w-echo"))
//!     .function(FunctionSpec::new("echo"), |ctx| async move {
//!         if ctx.is_cancelled() {
//!             return Outcome::Cancelled(Default::default());
//!         }
//!         Outcome::Complete(ctx.invoke.input.clone())
//!     })
//!     .spawn(shutdown.clone());
//! worker.connected().await;
//!
//! let caller = Caller::connect(url, None).await?;
//! let turn = caller.submit_simple("s-1", "echo", json!({"hi": 1})).await?;
//! let done = caller.wait_terminal(&turn.turn_id, Duration::from_secs(10)).await?;
//! assert_eq!(done.output, Some(json!({"hi": 1})));
//!
//! shutdown.cancel();
//! worker.join().await?;
//! # Ok(())
//! # }
//! ```

#![cfg_attr(
    test,
    allow(
        clippy::too_many_lines,
        reason = "a test reads as one scenario from its setup to its last assertion"
    )
)]

mod caller;
mod connection;
mod dial;
mod error;
mod watch;
mod worker;

#[cfg(test)]
mod tests;

pub use caller::Caller;
pub use connection::Connection;
pub use dial::OPEN_TIMEOUT;
pub use error::ClientError;
pub use watch::{WatchItem, WatchStream, RESUME_TIMEOUT};
pub use worker::{
    new_instance_id, ConnectionState, FunctionSpec, Handler, InvocationCtx, Worker, WorkerHandle,
    WorkerOptions, WorkerStats,
};

/// Re-exported so users need not depend on the protocol crate for common types.
pub use turnd_proto;

pub mod url {
    //! Daemon URLs.

    use std::net::SocketAddr;

    pub use crate::dial::parse_url_list;

    /// The protocol v1 WebSocket URL of a daemon listening on `addr`:
    /// `ws://ADDR/v1`.
    pub fn ws_url(addr: SocketAddr) -> String {
        format!("ws://{addr}{}", turnd_proto::WS_PATH)
    }
}

pub use url::ws_url;
