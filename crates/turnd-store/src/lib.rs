//! turnd's durable model.
//!
//! Everything turnd promises survives a crash lives here: turns, per-session turn
//! lists, invocations, events and idempotency keys, in one keyspace with
//! kind-prefixed keys. Every state transition of the engine is one [`Batch`], applied
//! atomically, and acknowledged only once it is durable.
//!
//! The crate is built in layers, each naming only those below it (`docs/store.md`):
//!
//! - [`error`] and [`stats`]: the one error type and the commit path's counters;
//! - [`model`]: the records, the key layout, batches and stored events;
//! - [`windows`]: the time windows of finished turns, and where a key goes;
//! - [`kv`]: the raw [`Kv`] surface every store offers, with the in-memory
//!   [`MemKv`] and the fault-injecting [`FaultyKv`];
//! - [`log`]: the [`CommitLog`] in front of sled, with [`LocalLog`] and [`MemLog`];
//! - `sled`: the sled databases behind the log;
//! - [`logged`]: [`LoggedKv`], the durable store the daemon runs on;
//! - [`Store`]: the typed store the engine reads and writes through;
//! - [`check`]: the invariants `store.check` reports.

#![cfg_attr(
    test,
    allow(
        clippy::too_many_lines,
        reason = "a test reads as one scenario from its setup to its last assertion"
    )
)]

pub mod check;
pub mod error;
pub mod kv;
pub mod log;
pub mod logged;
pub mod model;
mod sled;
pub mod stats;
mod store;
pub mod windows;

pub use check::check_store;
pub use error::{IoOp, StoreError};
pub use kv::faulty::{self, FaultyKv};
pub use kv::mem::{self, MemKv};
pub use kv::{CommitReply, CommitTicket, Kv};
pub use log::{CommitLog, LocalLog, MemLog};
pub use logged::{
    LoggedKv, LoggedOptions, Replayed, DEFAULT_IDLE_REOPEN, DEFAULT_MARK_INTERVAL,
    DEFAULT_OVERLAY_BYTES, DEFAULT_OVERLAY_KEYS,
};
pub use model::records::*;
pub use model::{
    event_heads, event_value, keys, next_page, records, Batch, Entry, EventHead, KvOp,
    EVENTS_PER_VALUE,
};
pub use sled::{
    open_when_unlocked, SledOptions, SyncMode, DEFAULT_CACHE_MB, DEFAULT_CHECKPOINT_MB,
};
pub use stats::{CommitStats, SYNC_BUCKETS, SYNC_BUCKET_BOUNDS};
pub use store::Store;
pub use windows::{WindowInfo, WindowOptions};
