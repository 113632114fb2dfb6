//! How a transition's events are stored and read back: consecutive events of one
//! session as values of up to [`EVENTS_PER_VALUE`] events ([`super::Batch::put_events`]
//! writes them), each a single event or an array, and the two reads of such a value
//! (whole events, or only each event's `seq` and turn).

use turnd_proto::Event;

use super::records::decode;
use crate::error::StoreError;

/// Most events stored in one value (see [`super::Batch::put_events`]).
pub const EVENTS_PER_VALUE: usize = 64;

/// The events of a stored event value: one event, or an array of them.
pub fn event_value(v: &[u8]) -> Result<Vec<Event>, StoreError> {
    value_items(v)
}

/// The items of a stored event value as `T`: one, or an array of them.
fn value_items<'a, T: serde::Deserialize<'a>>(v: &'a [u8]) -> Result<Vec<T>, StoreError> {
    if v.first() == Some(&b'[') {
        decode("events", v)
    } else {
        Ok(vec![decode("event", v)?])
    }
}

/// What retention reads of a stored event: its `seq` and its turn. The rest of the
/// event (its kind and detail) is passed over without being built.
#[derive(Debug, serde::Deserialize)]
pub struct EventHead<'a> {
    pub seq: u64,
    #[serde(borrow)]
    pub turn_id: std::borrow::Cow<'a, str>,
}

/// The [`EventHead`]s of a stored event value.
pub fn event_heads(v: &[u8]) -> Result<Vec<EventHead<'_>>, StoreError> {
    value_items(v)
}
