//! turnd across machines, the log layer: a partition's commit log on a NATS
//! JetStream stream, made safe by a validity rule every reader applies rather than
//! by trust in the servers, with the primitives the node layer builds on.
//!
//! - [`log`]: [`JetStreamLog`], a `turnd_store::log::CommitLog` on stream
//!   `TURND_P<p>`: leading by a fence, appends settled before they are answered,
//!   reads, trims that wait for the replicas;
//! - [`envelope`]: what a message carries; [`fence`]: the validity rule;
//! - [`standby`]: a warm standby tailing a partition into a local store;
//! - [`marks`]: nodes' durable applied marks (`turnd_marks`), for trims;
//! - [`checkpoint`]: checkpoints of stores on their way between nodes
//!   (`turnd_checkpoints`), for a node behind a trimmed stream;
//! - [`lease`]: who tries to lead (`turnd_owners`), liveness only;
//! - [`members`]: who is in the cluster now (`turnd_nodes`), for placement;
//! - [`records`]: the endpoints' own records every node shares
//!   (`turnd_endpoints`): the iii endpoint's reattach secret and queues;
//! - [`checks`]: what the NATS servers must do (sync before they acknowledge);
//! - [`nats`]: the connection, on a runtime of its own;
//! - [`testing`]: a rig of 1 or 3 `nats-server` processes for tests.
//!
//! `docs/cluster.md`, "The log", is this crate's map.

pub mod checkpoint;
pub mod checks;
pub mod envelope;
mod error;
pub mod fence;
pub mod lease;
pub mod log;
pub mod marks;
pub mod members;
pub mod nats;
pub mod records;
pub mod standby;
pub mod testing;

pub use error::LogError;
pub use log::{JetStreamLog, LogConfig, LogStatus};
pub use nats::Nats;
