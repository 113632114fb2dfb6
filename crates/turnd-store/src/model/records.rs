//! The durable records: what is written for turns, invocations, sessions and
//! idempotency keys. Times are Unix milliseconds, so deadlines survive a restart and
//! are re-armed from their absolute value.

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::Value;
use turnd_proto::{Delivery, OnTimeout, StopInfo, TurnCounts, TurnError, TurnStatus};

use crate::error::StoreError;

/// A stored record decoded as `T`; `what` names it in the error when it is not one.
pub(crate) fn decode<'a, T: serde::Deserialize<'a>>(
    what: &str,
    bytes: &'a [u8],
) -> Result<T, StoreError> {
    serde_json::from_slice(bytes).map_err(|e| StoreError::Corrupt(format!("{what}: {e}")))
}

/// A JSON value the daemon stores and forwards but never looks into (a turn's input,
/// state and output), kept as its compact text. The engine holds every live turn in
/// memory, and a parsed `Value` costs several hundred bytes per small object where the
/// text costs its length; the text is also written to the store and sent to workers
/// without being rebuilt.
///
/// A text of [`SHARED_FROM`] bytes or more is shared: a clone is a reference count,
/// not a copy. A transition builds on copies of the records it changes (the
/// session's own stay as they were until its write is durable), and a one-step
/// turn's record is copied four times or more, its input with it. A shorter text
/// (an event's detail, a small input) is copied: that costs less than the second
/// allocation a shared one takes when it is made.
#[derive(Clone)]
pub struct RawJson(Text);

/// Texts at least this long are shared by reference count (see [`RawJson`]).
pub const SHARED_FROM: usize = 256;

#[derive(Clone)]
enum Text {
    Copied(Box<RawValue>),
    Shared(Arc<RawValue>),
}

impl From<Box<RawValue>> for RawJson {
    fn from(b: Box<RawValue>) -> RawJson {
        if b.get().len() >= SHARED_FROM {
            RawJson(Text::Shared(Arc::from(b)))
        } else {
            RawJson(Text::Copied(b))
        }
    }
}

impl Serialize for RawJson {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.as_raw().serialize(s)
    }
}

impl<'de> Deserialize<'de> for RawJson {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<RawJson, D::Error> {
        Box::<RawValue>::deserialize(d).map(RawJson::from)
    }
}

impl RawJson {
    /// The compact text of `t`: a [`Value`], or one of the daemon's own typed values
    /// (an event's detail), written without building a [`Value`] tree first.
    pub fn of<T: serde::Serialize>(t: &T) -> RawJson {
        // The daemon's own types and `Value`s serialize: their maps have string keys
        // and their numbers are finite.
        RawJson::from(serde_json::value::to_raw_value(t).expect("a typed value serializes"))
    }

    /// The compact text of `v`.
    pub fn from_value(v: &Value) -> RawJson {
        RawJson::of(v)
    }

    /// The value, parsed.
    pub fn to_value(&self) -> Value {
        // The text was produced by serializing a `Value` or validated as JSON when the
        // record was read, so it parses.
        serde_json::from_str(self.as_str()).unwrap_or_else(|e| {
            tracing::error!("stored JSON value does not parse: {e}");
            Value::Null
        })
    }

    /// Length of the JSON text in bytes.
    pub fn len(&self) -> usize {
        self.as_str().len()
    }

    pub fn is_empty(&self) -> bool {
        self.as_str().is_empty()
    }

    /// `Some(self)` unless the value is JSON `null`. An optional field holding `null`
    /// is read back from the store as absent, so the engine keeps it absent in memory
    /// too, and a turn reads the same from memory and from disk.
    pub fn non_null(self) -> Option<RawJson> {
        (self.as_str() != "null").then_some(self)
    }

    /// The compact JSON text.
    pub fn as_str(&self) -> &str {
        self.as_raw().get()
    }

    /// The text as serde_json's raw value.
    pub fn as_raw(&self) -> &RawValue {
        match &self.0 {
            Text::Copied(b) => b,
            Text::Shared(a) => a,
        }
    }

    /// JSON text a request carried, in the form the daemon keeps: as it is when it is
    /// compact (no whitespace outside its strings: what every SDK sends), else written
    /// again compact. Either way the daemon keeps and measures compact text; text taken
    /// as it is keeps the caller's member order and number spelling, and is never built
    /// into a tree.
    pub fn compacted(self) -> RawJson {
        if self.is_compact() {
            self
        } else {
            RawJson::from_value(&self.to_value())
        }
    }

    /// Whether the text has no whitespace outside its strings.
    pub fn is_compact(&self) -> bool {
        turnd_proto::json_text::is_compact(self.as_str())
    }

    /// A value read back from the store as JSON text; `None` if it is not JSON.
    pub fn from_stored(bytes: &[u8]) -> Option<RawJson> {
        serde_json::from_slice::<RawJson>(bytes).ok()
    }
}

/// Inputs whose JSON text is at least this long are stored under a key of their own,
/// written once at admission, rather than in the turn's record, which every transition
/// rewrites (a one-step turn's record is written three times).
pub const INPUT_APART_BYTES: usize = 4096;

/// A turn's input, and whether it is stored apart from the turn's record (see
/// [`INPUT_APART_BYTES`]). It dereferences to the input.
///
/// In a stored record the input of a turn whose input is stored apart is absent, and
/// an absent input reads as `Default`: stored apart, not yet read
/// ([`crate::Store::turn`] reads it).
#[derive(Clone, PartialEq, Debug)]
pub struct TurnInput {
    raw: RawJson,
    apart: bool,
}

impl TurnInput {
    pub fn new(raw: RawJson) -> TurnInput {
        let apart = raw.len() >= INPUT_APART_BYTES;
        TurnInput { raw, apart }
    }

    /// Whether the input is stored under its own key instead of in the record.
    pub fn is_apart(&self) -> bool {
        self.apart
    }

    /// Put the input read from its own key into a record read from the store.
    pub(crate) fn fill(&mut self, raw: RawJson) {
        self.raw = raw;
    }

    /// The same input, stored inline (in a finished turn's folded record).
    pub fn inline(&self) -> TurnInput {
        TurnInput {
            raw: self.raw.clone(),
            apart: false,
        }
    }
}

impl Default for TurnInput {
    fn default() -> TurnInput {
        TurnInput {
            raw: RawJson::from_value(&Value::Null),
            apart: true,
        }
    }
}

impl std::ops::Deref for TurnInput {
    type Target = RawJson;
    fn deref(&self) -> &RawJson {
        &self.raw
    }
}

impl Serialize for TurnInput {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.raw.serialize(s)
    }
}

impl<'de> Deserialize<'de> for TurnInput {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<TurnInput, D::Error> {
        RawJson::deserialize(d).map(|raw| TurnInput { raw, apart: false })
    }
}

impl PartialEq for RawJson {
    fn eq(&self, other: &Self) -> bool {
        self.as_str() == other.as_str()
    }
}

/// JSON `null`: what an absent `input` is.
impl Default for RawJson {
    fn default() -> RawJson {
        RawJson::from_value(&Value::Null)
    }
}

/// The same JSON as a parsed value (compared parsed: the text's spacing and key
/// order do not count).
impl PartialEq<Value> for RawJson {
    fn eq(&self, other: &Value) -> bool {
        self.to_value() == *other
    }
}

impl std::fmt::Debug for RawJson {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where a non-terminal turn stands, durably. (`finalizing` is not stored: it is the
/// in-memory state of a transition whose write is being retried.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// In the session queue behind the lock holder.
    Queued,
    /// Holds the session lock; no invocation yet: waiting for a worker with capacity.
    AwaitingWorker,
    /// Holds the lock; its current invocation is live (see the invocation's wait).
    Invoked,
    /// Holds the lock; a retryable failure is waiting out its backoff until
    /// `retry_at_ms`.
    BackingOff,
    /// Holds the lock; its last step suspended it and it waits for `turn.resume` (or
    /// its input deadline): see [`TurnRecord::input_request`].
    AwaitingInput,
    /// Terminal.
    Done,
}

/// A turn, as stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TurnRecord {
    pub turn_id: String,
    pub session_id: String,
    pub seq: u64,
    pub function_id: String,
    pub status: TurnStatus,
    /// Current step (0-based).
    pub step: u32,
    /// Current (or last) attempt of the current step; 0 before the first dispatch.
    pub attempt: u32,
    /// The turn's input (step 0's input). Not in the stored record when it is stored
    /// apart (see [`TurnInput`]).
    #[serde(default, skip_serializing_if = "TurnInput::is_apart")]
    pub input: TurnInput,
    /// The current step's input when it is not `input`: the state of the last
    /// `continue`. `None` (and not stored) until then, so that a turn's record, which
    /// every transition rewrites, holds its input once; see [`TurnRecord::state`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<RawJson>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output: Option<RawJson>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<Box<TurnError>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop: Option<Box<StopInfo>>,
    #[serde(default)]
    pub recovered: bool,
    pub created_at_ms: u64,
    pub updated_at_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
    /// Absolute deadline of the whole turn (`turn_timeout_ms` after admission).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline_ms: Option<u64>,
    pub phase: Phase,
    /// When the turn entered its current phase.
    pub phase_since_ms: u64,
    /// When the turn took its session's lock.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub locked_at_ms: Option<u64>,
    /// The current (or last) invocation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub invocation_id: Option<String>,
    /// With `BackingOff`: when the next attempt is dispatched.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_at_ms: Option<u64>,
    /// The last retryable failure (shown while backing off).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    /// The settings of the function at its last dispatch, for the backoff and attempt
    /// accounting of retries.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub settings: Option<FunctionSettings>,
    /// Backoff of the next retry, doubled per retry.
    #[serde(default)]
    pub backoff_ms: u64,
    /// Dispatch settings the turn was admitted with, in place of its function's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dispatch: Option<Box<TurnDispatch>>,
    /// With `AwaitingInput`: what the suspended step asked, and until when. The
    /// suspend's state is the record's `state`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_request: Option<Box<InputWait>>,
    /// The lock holder this turn interrupted (`on_busy` `interrupt` or `rollback`),
    /// given to every dispatch of its step 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous: Option<Box<PreviousState>>,
    /// Stopped by a later submit with `on_busy: "rollback"`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub superseded: bool,
    /// The idempotency keys of the resumes that let its suspended steps go.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub resume_keys: Vec<ResumeKey>,
}

/// What a suspended turn waits for ([`Phase::AwaitingInput`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InputWait {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt: Option<RawJson>,
    pub since_ms: u64,
    /// When the wait ends by itself (Unix ms).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline_ms: Option<u64>,
    #[serde(default)]
    pub on_timeout: OnTimeout,
}

/// The lock holder a turn interrupted: its id, its status after the interrupt and
/// its last durable state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PreviousState {
    pub turn_id: String,
    pub status: TurnStatus,
    pub state: RawJson,
}

/// A resume's idempotency key, with the CRC-32 of the input it came with: the same
/// key with another input is a conflict.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResumeKey {
    pub key: String,
    pub input_crc: u32,
}

impl ResumeKey {
    pub fn new(key: String, input: &RawJson) -> ResumeKey {
        ResumeKey {
            key,
            input_crc: crc32fast::hash(input.as_str().as_bytes()),
        }
    }

    /// Whether `input` is the one this key came with.
    pub fn same_input(&self, input: &RawJson) -> bool {
        self.input_crc == crc32fast::hash(input.as_str().as_bytes())
    }
}

/// Dispatch settings given to one turn at admission (by the iii endpoint: a queue's
/// settings for its messages, a bound for a call): each one set replaces the
/// function's registration for every dispatch of the turn.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TurnDispatch {
    /// Attempt deadline of each dispatch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delivery: Option<Delivery>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_attempts: Option<u32>,
    /// Whether a handler's failure may be retried, in place of the `retryable` its
    /// worker reports.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retryable: Option<bool>,
    /// While the turn waits for a worker it fails with cause `no_worker` at this
    /// time (Unix ms): it is never dispatched from that wait later.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dispatch_by_ms: Option<u64>,
}

impl TurnDispatch {
    /// `registered` with the settings given here in place.
    pub fn apply(&self, registered: FunctionSettings) -> FunctionSettings {
        FunctionSettings {
            timeout_ms: self.timeout_ms.unwrap_or(registered.timeout_ms),
            delivery: self.delivery.unwrap_or(registered.delivery),
            max_attempts: self.max_attempts.unwrap_or(registered.max_attempts),
        }
    }
}

impl TurnRecord {
    /// The current step's input: `input` at step 0, then the state of the last
    /// `continue`.
    pub fn state(&self) -> &RawJson {
        self.state.as_ref().unwrap_or(&self.input.raw)
    }

    /// A turn as admitted: queued, before its first dispatch.
    pub fn admitted(
        turn_id: String,
        session_id: &str,
        seq: u64,
        function_id: &str,
        input: RawJson,
        now: u64,
    ) -> TurnRecord {
        TurnRecord {
            turn_id,
            session_id: session_id.to_string(),
            seq,
            function_id: function_id.to_string(),
            status: TurnStatus::Queued,
            step: 0,
            attempt: 0,
            state: None,
            input: TurnInput::new(input),
            output: None,
            error: None,
            stop: None,
            recovered: false,
            created_at_ms: now,
            updated_at_ms: now,
            finished_at_ms: None,
            idempotency_key: None,
            deadline_ms: None,
            phase: Phase::Queued,
            phase_since_ms: now,
            locked_at_ms: None,
            invocation_id: None,
            retry_at_ms: None,
            last_error: None,
            settings: None,
            backoff_ms: 0,
            dispatch: None,
            input_request: None,
            previous: None,
            superseded: false,
            resume_keys: Vec::new(),
        }
    }
}

/// What retention reads of a stored turn ([`TurnRecord`] or the `turn` of a
/// [`FoldedTurn`]): whether and when it ended, and what of it is stored under other
/// keys. The rest of the record (its input, output, settings, …) is passed over
/// without being built.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct TurnHead {
    pub turn_id: String,
    pub session_id: String,
    pub seq: u64,
    pub status: TurnStatus,
    pub created_at_ms: u64,
    #[serde(default)]
    pub finished_at_ms: Option<u64>,
    #[serde(default)]
    pub idempotency_key: Option<String>,
    #[serde(default)]
    pub invocation_id: Option<String>,
}

/// What retention reads of a [`FoldedTurn`]: its turn's [`TurnHead`] and the ids of
/// the invocations folded into it.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct FoldedHead {
    pub turn: TurnHead,
    #[serde(default)]
    pub invocations: Vec<InvocationId>,
}

/// An invocation record's id, the rest passed over.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct InvocationId {
    pub invocation_id: String,
}

/// A finished turn as stored: written once when the turn becomes terminal (and again
/// when a late result amends it), in place of its record, its input stored apart and
/// the invocation records it had in memory. Its record holds the input inline.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FoldedTurn {
    pub turn: TurnRecord,
    /// Its invocations folded in (its last one at least, when it had one; invocations
    /// of earlier attempts may still be under their own keys).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub invocations: Vec<InvocationRecord>,
}

impl FoldedTurn {
    /// `turn` with its input made inline.
    pub fn new(turn: &TurnRecord, invocations: Vec<InvocationRecord>) -> FoldedTurn {
        let mut turn = turn.clone();
        turn.input = turn.input.inline();
        FoldedTurn { turn, invocations }
    }

    /// Put `inv` in, in place of an earlier version of it.
    pub fn put_invocation(&mut self, inv: InvocationRecord) {
        match self
            .invocations
            .iter_mut()
            .find(|i| i.invocation_id == inv.invocation_id)
        {
            Some(slot) => *slot = inv,
            None => self.invocations.push(inv),
        }
    }
}

/// The settings a function was dispatched under.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FunctionSettings {
    pub timeout_ms: u64,
    pub delivery: Delivery,
    pub max_attempts: u32,
}

/// What a live invocation waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum InvWait {
    /// Dispatched; waiting for the result until the attempt deadline.
    AwaitingResult,
    /// Deadline passed; `probe` sent, waiting for `invocation.status`.
    Probing,
    /// The worker said `finished`; waiting for the resent result.
    AwaitingResend,
    /// `cancel` sent (stop or timeout); waiting for the answer until the grace ends.
    Cancelling,
    /// The worker's connection is gone; waiting for it to come back.
    AwaitingReconnect,
}

/// Lifecycle of an invocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum InvState {
    /// Dispatched and not given up; see `wait`.
    Active,
    /// Its result was taken.
    Finished,
    /// Given up with its outcome unknown (may have run).
    Unknown,
    /// Confirmed never received by the worker; dispatched again.
    Lost,
    /// Still running past its deadline, cancelled, grace passed.
    TimedOut,
    /// Given up because the turn was stopped while it may have been running.
    Abandoned,
}

impl InvState {
    pub fn as_str(self) -> &'static str {
        match self {
            InvState::Active => "active",
            InvState::Finished => "finished",
            InvState::Unknown => "unknown",
            InvState::Lost => "lost",
            InvState::TimedOut => "timed_out",
            InvState::Abandoned => "abandoned",
        }
    }
}

/// An invocation, as stored: one attempt of one step, with the identity that fences
/// every signal about it and the settings it was dispatched under.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InvocationRecord {
    pub invocation_id: String,
    pub turn_id: String,
    pub session_id: String,
    pub function_id: String,
    pub step: u32,
    pub attempt: u32,
    pub worker_id: String,
    pub instance_id: String,
    pub settings: FunctionSettings,
    pub state: InvState,
    /// With `Active`: what it waits for, since when and until when.
    pub wait: InvWait,
    pub wait_since_ms: u64,
    pub deadline_ms: u64,
    /// The attempt's own deadline (`timeout_ms` after dispatch or the last
    /// heartbeat), kept while `deadline_ms` follows other waits.
    #[serde(default)]
    pub attempt_deadline_ms: u64,
    pub dispatched_at_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended_at_ms: Option<u64>,
    /// Kind of the outcome that was taken (`complete`, `continue`, `fail`, `cancelled`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome: Option<String>,
    /// Whether a result arrived after the invocation was given up.
    #[serde(default)]
    pub late: bool,
}

impl InvocationRecord {
    pub fn is_active(&self) -> bool {
        self.state == InvState::Active
    }
}

/// An idempotency key of a session.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct IdempotencyRecord {
    pub turn_id: String,
}

/// Per-session counters that must survive restarts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionMeta {
    pub session_id: String,
    /// `seq` of the last admitted turn.
    pub last_turn_seq: u64,
    /// `seq` of the last event.
    pub last_event_seq: u64,
    /// Turns of the session by status.
    #[serde(default)]
    pub counts: TurnCounts,
    /// `seq` of the session's first unfinished turn (its lock holder); None when every
    /// turn is terminal. Recovery reads the session's turn list from here on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub active_from: Option<u64>,
    /// Retention deleted events of this session, so its stored events may start
    /// after 1 and have holes (those of deleted turns).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub events_pruned: bool,
    /// At or before the route of every routed key of the session (its turn list
    /// entries, event values and idempotency keys; see [`crate::keys`]): the earliest
    /// time of a turn any of them was written for. Reads of the session's keys look
    /// only in the time windows from this one on. None: the session has no routed key
    /// (every key of it is in the main database).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routed_from_ms: Option<u64>,
    /// An invocation the session waits out before it dispatches anything again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held: Option<Box<Held>>,
}

/// An invocation of an ended turn that may still be running: it was given up
/// without its result (a stop, the turn's deadline) on a worker that cannot cancel
/// it (an iii worker). The session dispatches nothing until its result arrives or
/// its attempt deadline passes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Held {
    pub invocation_id: String,
    pub turn_id: String,
    pub worker_id: String,
    pub since_ms: u64,
    /// The invocation's attempt deadline: the hold ends then at the latest.
    pub until_ms: u64,
}

impl SessionMeta {
    pub fn new(session_id: &str) -> Self {
        SessionMeta {
            session_id: session_id.to_string(),
            last_turn_seq: 0,
            last_event_seq: 0,
            counts: TurnCounts::default(),
            active_from: None,
            events_pruned: false,
            routed_from_ms: None,
            held: None,
        }
    }

    /// Lower [`SessionMeta::routed_from_ms`] to `ms` (a batch wrote routed keys for
    /// turns of that time: [`crate::Batch::routed_from`]).
    pub fn routed_at(&mut self, ms: Option<u64>) {
        if let Some(ms) = ms {
            self.routed_from_ms = Some(self.routed_from_ms.map_or(ms, |m| m.min(ms)));
        }
    }

    /// Where this session's keys are.
    pub fn keys(&self) -> SessionKeys<'_> {
        SessionKeys {
            id: &self.session_id,
            from_ms: self.routed_from_ms,
        }
    }
}

/// A session's id and where its routed keys can be ([`SessionMeta::routed_from_ms`]):
/// what a read of its turn list, events or idempotency keys needs.
#[derive(Debug, Clone, Copy)]
pub struct SessionKeys<'a> {
    pub id: &'a str,
    pub from_ms: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A copy of a long text is the same text in memory (a reference count); a short
    /// one is copied. Either way it reads, compares and writes as the text it was
    /// read from.
    #[test]
    fn long_texts_are_shared_and_short_ones_copied() {
        let long = format!(r#"{{"messages":"{}"}}"#, "x".repeat(SHARED_FROM));
        for (text, shared) in [(long.as_str(), true), (r#"{"t":1}"#, false)] {
            let a = RawJson::from_stored(text.as_bytes()).expect("JSON");
            let b = a.clone();
            assert_eq!(
                a.as_str().as_ptr() == b.as_str().as_ptr(),
                shared,
                "{} bytes",
                text.len()
            );
            assert_eq!(b.as_str(), text);
            assert!(a == b);
            assert_eq!(serde_json::to_string(&b).expect("serialize"), text);
            let typed = RawJson::of(&serde_json::from_str::<Value>(text).expect("parse"));
            assert_eq!(typed.as_str(), text);
        }
    }

    /// Text a request carried is kept as it is when it has no whitespace outside its
    /// strings (escaped quotes and backslashes inside them included), and written
    /// again compact when it has.
    #[test]
    fn request_text_is_kept_when_compact() {
        let text = |t: &str| RawJson::from_stored(t.as_bytes()).expect("JSON");
        for kept in [
            r#"{"z":1,"a":"x y \" z\\","b":[1.50,1e2]}"#,
            r#""\\""#,
            "[]",
            "12345678901234567890123",
        ] {
            let raw = text(kept);
            assert!(raw.is_compact(), "{kept}");
            assert_eq!(raw.compacted().as_str(), kept);
        }
        for (spaced, compact) in [
            ("{ \"b\":1,\"a\":2}", r#"{"a":2,"b":1}"#),
            ("[1,\n2]", "[1,2]"),
            (
                "{\"a\":\"\\\\\",\t\"b\":\"x y\"}",
                r#"{"a":"\\","b":"x y"}"#,
            ),
            ("[\"\\\"\" ,\r1]", r#"["\"",1]"#),
        ] {
            let raw = text(spaced);
            assert!(!raw.is_compact(), "{spaced}");
            assert_eq!(raw.compacted().as_str(), compact);
        }
    }

    #[test]
    fn raw_json_keeps_the_value_and_its_stored_form() {
        let v = json!({"b": [1, 2.5, "x"], "a": {"nested": null}});
        let raw = RawJson::from_value(&v);
        assert_eq!(raw.to_value(), v);
        assert_eq!(
            raw.len(),
            serde_json::to_string(&v).expect("serialize").len()
        );
        // Inside a record it is stored as the JSON value itself, not as a string.
        let rec = serde_json::to_value(IdRaw {
            id: "t".into(),
            input: raw.clone(),
        })
        .expect("serialize");
        assert_eq!(rec, json!({"id": "t", "input": v}));
        let back: IdRaw = serde_json::from_slice(&serde_json::to_vec(&rec).expect("serialize"))
            .expect("deserialize");
        assert_eq!(back.input, raw);
        assert_ne!(
            RawJson::from_value(&json!(1)),
            RawJson::from_value(&json!(2))
        );
    }

    /// A turn's record holds its input once until a `continue` gives the next step
    /// another one; a record that stores the state beside an equal input reads the
    /// same.
    #[test]
    fn a_turn_record_stores_its_input_once() {
        let input = RawJson::from_value(&json!({"prompt": "p".repeat(100)}));
        let mut t = TurnRecord::admitted("t_1".into(), "s", 1, "f", input.clone(), 5);
        let stored = serde_json::to_string(&t).expect("serialize");
        assert_eq!(stored.matches(&"p".repeat(100)).count(), 1, "{stored}");
        let back: TurnRecord = serde_json::from_str(&stored).expect("deserialize");
        assert_eq!(back.state(), &input);

        let next = RawJson::from_value(&json!({"step": 2}));
        t.state = Some(next.clone());
        let stored = serde_json::to_value(&t).expect("serialize");
        assert_eq!(stored["state"], json!({"step": 2}));
        let back: TurnRecord = serde_json::from_value(stored.clone()).expect("deserialize");
        assert_eq!(back.state(), &next);

        let mut beside = stored;
        beside["state"] = beside["input"].clone();
        let back: TurnRecord = serde_json::from_value(beside).expect("deserialize");
        assert_eq!(back.state(), &input);
    }

    /// Retention reads stored records as heads: the fields it needs, the same as
    /// the whole record's, with the rest passed over.
    #[test]
    fn heads_read_what_retention_needs_of_stored_records() {
        let input = RawJson::from_value(&json!({"prompt": "p".repeat(50)}));
        let mut t = TurnRecord::admitted("t_1".into(), "s", 3, "f", input, 5);
        t.status = TurnStatus::Completed;
        t.finished_at_ms = Some(9);
        t.idempotency_key = Some("k".into());
        t.invocation_id = Some("i_2".into());
        t.output = Some(RawJson::from_value(&json!({"out": [1, {"x": "y"}]})));
        let mut folded = serde_json::to_value(FoldedTurn::new(&t, vec![])).expect("serialize");
        folded["invocations"] = json!([
            {"invocation_id": "i_1", "state": "ended", "settings": {"timeout_ms": 1}},
            {"invocation_id": "i_2"}
        ]);
        let head: FoldedHead = serde_json::from_value(folded).expect("head");
        let want = TurnHead {
            turn_id: "t_1".into(),
            session_id: "s".into(),
            seq: 3,
            status: TurnStatus::Completed,
            created_at_ms: 5,
            finished_at_ms: Some(9),
            idempotency_key: Some("k".into()),
            invocation_id: Some("i_2".into()),
        };
        assert_eq!(head.turn, want);
        let ids: Vec<&str> = head
            .invocations
            .iter()
            .map(|i| i.invocation_id.as_str())
            .collect();
        assert_eq!(ids, ["i_1", "i_2"]);

        // A queued turn under its own key: none of the optional fields.
        let q = TurnRecord::admitted("t_2".into(), "s", 4, "f", RawJson::from_value(&json!(1)), 6);
        let head: TurnHead =
            serde_json::from_str(&serde_json::to_string(&q).expect("serialize")).expect("head");
        assert_eq!(
            (
                head.status,
                head.finished_at_ms,
                head.idempotency_key,
                head.invocation_id
            ),
            (TurnStatus::Queued, None, None, None)
        );
    }

    #[derive(Serialize, Deserialize)]
    struct IdRaw {
        id: String,
        input: RawJson,
    }
}
