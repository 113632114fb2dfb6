//! The store's model: what is stored and under which key, independent of where it is
//! stored. The durable records ([`records`]), the layout of the one keyspace with the
//! routes of sessions' keys ([`keys`]), a transition's atomic [`Batch`] ([`batch`])
//! and how events are stored several to a value ([`events`]). Every store below the
//! typed [`crate::Store`] keeps these bytes as they are; nothing here knows of one.

pub mod batch;
pub mod events;
pub mod keys;
pub mod records;

pub use batch::{Batch, KvOp};
pub use events::{event_heads, event_value, EventHead, EVENTS_PER_VALUE};
pub use keys::{next_page, Entry};
pub use records::*;
