//! Argument and result shapes of every op, and which role may use which op.

use crate::objects::*;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;

/// The role a connection declared in `hello`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Worker,
    Client,
    Operator,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Worker => "worker",
            Role::Client => "client",
            Role::Operator => "operator",
        }
    }
}

/// Every op of protocol v1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    Hello,
    Ping,
    FunctionRegister,
    FunctionUnregister,
    InvocationResult,
    InvocationHeartbeat,
    InvocationStatus,
    TurnSubmit,
    TurnGet,
    TurnWait,
    TurnStop,
    TurnList,
    SessionInspect,
    SessionStop,
    SessionEvents,
    Watch,
    Unwatch,
    Stats,
    WorkersList,
    FunctionsList,
    StoreCheck,
    SessionsList,
    InvocationProgress,
    TurnResume,
}

impl Op {
    pub const ALL: [Op; 24] = [
        Op::Hello,
        Op::Ping,
        Op::FunctionRegister,
        Op::FunctionUnregister,
        Op::InvocationResult,
        Op::InvocationHeartbeat,
        Op::InvocationStatus,
        Op::TurnSubmit,
        Op::TurnGet,
        Op::TurnWait,
        Op::TurnStop,
        Op::TurnList,
        Op::SessionInspect,
        Op::SessionStop,
        Op::SessionEvents,
        Op::Watch,
        Op::Unwatch,
        Op::Stats,
        Op::WorkersList,
        Op::FunctionsList,
        Op::StoreCheck,
        Op::SessionsList,
        Op::InvocationProgress,
        Op::TurnResume,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Op::Hello => "hello",
            Op::Ping => "ping",
            Op::FunctionRegister => "function.register",
            Op::FunctionUnregister => "function.unregister",
            Op::InvocationResult => "invocation.result",
            Op::InvocationHeartbeat => "invocation.heartbeat",
            Op::InvocationStatus => "invocation.status",
            Op::TurnSubmit => "turn.submit",
            Op::TurnGet => "turn.get",
            Op::TurnWait => "turn.wait",
            Op::TurnStop => "turn.stop",
            Op::TurnList => "turn.list",
            Op::SessionInspect => "session.inspect",
            Op::SessionStop => "session.stop",
            Op::SessionEvents => "session.events",
            Op::Watch => "watch",
            Op::Unwatch => "unwatch",
            Op::Stats => "stats",
            Op::WorkersList => "workers.list",
            Op::FunctionsList => "functions.list",
            Op::StoreCheck => "store.check",
            Op::SessionsList => "sessions.list",
            Op::InvocationProgress => "invocation.progress",
            Op::TurnResume => "turn.resume",
        }
    }

    pub fn parse(name: &str) -> Option<Op> {
        Op::ALL.into_iter().find(|o| o.name() == name)
    }

    /// Whether a connection of `role` may use this op. `hello` is handled before roles
    /// exist; `ping` is open to every role.
    pub fn allowed_for(self, role: Role) -> bool {
        match self {
            Op::Hello | Op::Ping => true,
            Op::FunctionRegister
            | Op::FunctionUnregister
            | Op::InvocationResult
            | Op::InvocationHeartbeat
            | Op::InvocationStatus
            | Op::InvocationProgress => matches!(role, Role::Worker | Role::Operator),
            Op::StoreCheck => role == Role::Operator,
            Op::TurnSubmit
            | Op::TurnGet
            | Op::TurnWait
            | Op::TurnStop
            | Op::TurnResume
            | Op::TurnList
            | Op::SessionInspect
            | Op::SessionStop
            | Op::SessionEvents
            | Op::Watch
            | Op::Unwatch
            | Op::Stats
            | Op::WorkersList
            | Op::FunctionsList
            | Op::SessionsList => matches!(role, Role::Client | Role::Operator),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HelloArgs {
    pub protocol: u64,
    pub role: Role,
    #[serde(default)]
    pub token: Option<String>,
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub worker_id: Option<String>,
    #[serde(default)]
    pub instance_id: Option<String>,
    #[serde(default)]
    pub inflight: Vec<String>,
    #[serde(default)]
    pub finished: Vec<String>,
}

impl HelloArgs {
    /// A hello of protocol [`crate::PROTOCOL_VERSION`] with `role`, and nothing else
    /// (no token, name, worker id or invocations).
    pub fn new(role: Role) -> HelloArgs {
        HelloArgs {
            protocol: crate::PROTOCOL_VERSION,
            role,
            token: None,
            name: None,
            worker_id: None,
            instance_id: None,
            inflight: Vec::new(),
            finished: Vec::new(),
        }
    }
}

/// What the server concluded about every invocation assigned to a reconnecting worker.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Reconciled {
    pub kept: Vec<String>,
    pub redispatched: Vec<String>,
    pub unknown: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HelloOk {
    pub server: String,
    pub version: String,
    pub boot_id: String,
    pub connection_id: String,
    pub heartbeat_ms: u64,
    pub max_frame_bytes: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reconciled: Option<Reconciled>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RegisterArgs {
    pub function_id: String,
    #[serde(default)]
    pub concurrency: Option<u32>,
    #[serde(default)]
    pub timeout_ms: Option<u64>,
    #[serde(default)]
    pub delivery: Option<Delivery>,
    #[serde(default)]
    pub max_attempts: Option<u32>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RegisterOk {
    pub function_id: String,
    pub workers: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FunctionIdArgs {
    pub function_id: String,
}

/// `invocation.result` (`J`: the form of a `complete` or `continue` value, see
/// [`Turn`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResultArgs<J = Value> {
    pub invocation_id: String,
    pub outcome: Outcome<J>,
}

impl<J> ResultArgs<J> {
    /// The same result with its value in another form.
    pub fn map_json<K>(self, f: impl FnOnce(J) -> K) -> ResultArgs<K> {
        ResultArgs {
            invocation_id: self.invocation_id,
            outcome: self.outcome.map_json(f),
        }
    }
}

/// How the server took an `invocation.result`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Accepted {
    Applied,
    Duplicate,
    Late,
    Unknown,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResultOk {
    pub accepted: Accepted,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InvocationIdArgs {
    pub invocation_id: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HeartbeatOk {
    pub deadline_ms: u64,
}

/// A worker's answer to a `probe`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum InvocationState {
    Running,
    Finished,
    Unknown,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StatusArgs {
    pub invocation_id: String,
    pub state: InvocationState,
}

/// `invocation.progress`: a live invocation's partial output (`J`: the form of its
/// `data`, see [`Turn`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProgressArgs<J = Value> {
    pub invocation_id: String,
    pub data: J,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProgressOk {
    /// The frame's number among its invocation's progress, from 1.
    pub seq: u64,
}

/// What `turn.submit` does when the session has an unfinished turn.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnBusy {
    /// Queue behind it.
    #[default]
    Enqueue,
    /// Refuse with `busy`; nothing is stored.
    Reject,
    /// Stop every unfinished turn (reason `interrupted`); the new turn gets the
    /// holder's last state as `previous`.
    Interrupt,
    /// As `Interrupt`, and the stopped turns are marked superseded.
    Rollback,
}

impl OnBusy {
    pub fn as_str(self) -> &'static str {
        match self {
            OnBusy::Enqueue => "enqueue",
            OnBusy::Reject => "reject",
            OnBusy::Interrupt => "interrupt",
            OnBusy::Rollback => "rollback",
        }
    }

    /// Whether the session's unfinished turns are stopped for the new one.
    pub fn interrupts(self) -> bool {
        matches!(self, OnBusy::Interrupt | OnBusy::Rollback)
    }
}

/// `turn.submit` (`J`: the form of its input, see [`Turn`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(bound(deserialize = "J: Deserialize<'de> + Default"))]
pub struct SubmitArgs<J = Value> {
    pub session_id: String,
    pub function_id: String,
    #[serde(default)]
    pub input: J,
    #[serde(default)]
    pub idempotency_key: Option<String>,
    #[serde(default)]
    pub turn_timeout_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_busy: Option<OnBusy>,
}

impl<J> SubmitArgs<J> {
    /// The same submit with its input in another form.
    pub fn map_input<K>(self, f: impl FnOnce(J) -> K) -> SubmitArgs<K> {
        SubmitArgs {
            session_id: self.session_id,
            function_id: self.function_id,
            input: f(self.input),
            idempotency_key: self.idempotency_key,
            turn_timeout_ms: self.turn_timeout_ms,
            on_busy: self.on_busy,
        }
    }
}

/// `turn.resume`: the input a suspended turn waits for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResumeArgs {
    pub turn_id: String,
    #[serde(default)]
    pub input: Value,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SubmitOk<J = Value> {
    pub turn: Turn<J>,
    pub deduplicated: bool,
}

impl<J> SubmitOk<J> {
    /// The same answer with its turn's input and output in another form.
    pub fn map_json<K>(self, f: impl FnMut(J) -> K) -> SubmitOk<K> {
        SubmitOk {
            turn: self.turn.map_json(f),
            deduplicated: self.deduplicated,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TurnIdArgs {
    pub turn_id: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TurnOk<J = Value> {
    pub turn: Turn<J>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WaitArgs {
    pub turn_id: String,
    #[serde(default)]
    pub timeout_ms: Option<u64>,
}

/// Default and maximum of `turn.wait`'s `timeout_ms`.
pub const WAIT_DEFAULT_MS: u64 = 30_000;
pub const WAIT_MAX_MS: u64 = 300_000;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StopArgs {
    pub turn_id: String,
    #[serde(default)]
    pub reason: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SessionStopArgs {
    pub session_id: String,
    #[serde(default)]
    pub reason: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TurnsOk<J = Value> {
    pub turns: Vec<Turn<J>>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ListArgs {
    pub session_id: String,
    #[serde(default)]
    pub status: Option<TurnStatus>,
    #[serde(default)]
    pub limit: Option<u64>,
    #[serde(default)]
    pub before_seq: Option<u64>,
}

/// Default and maximum page size of `turn.list` and `session.events`.
pub const PAGE_DEFAULT: u64 = 100;
pub const PAGE_MAX: u64 = 1000;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ListOk<J = Value> {
    pub turns: Vec<Turn<J>>,
    pub next_before_seq: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SessionIdArgs {
    pub session_id: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SessionOk {
    pub session: Session,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EventsArgs {
    pub session_id: String,
    #[serde(default)]
    pub after: Option<u64>,
    #[serde(default)]
    pub limit: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EventsOk {
    pub events: Vec<Event>,
    pub next: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WatchArgs {
    #[serde(default)]
    pub session_id: Option<String>,
    #[serde(default)]
    pub turn_id: Option<String>,
    /// Resume: replay events with `seq` greater than this before live ones.
    #[serde(default)]
    pub after: Option<u64>,
    /// Also push the progress of the session's (or turn's) live invocations.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub progress: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WatchOk {
    pub watch_id: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WatchIdArgs {
    pub watch_id: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StatsOk {
    pub stats: Stats,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkersOk {
    pub workers: Vec<Worker>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FunctionsOk {
    pub functions: Vec<Function>,
}

/// One invariant violation found by `store.check`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Violation {
    pub invariant: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub turn_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<String>,
    pub detail: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckOk {
    pub violations: Vec<Violation>,
}

/// The order of `sessions.list`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SessionOrder {
    /// Oldest wait first (by `wait.since_ms`, then by session id).
    #[default]
    Wait,
    /// By session id, ascending (byte order).
    Id,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SessionsListArgs {
    /// Only sessions whose lock holder waits in this state.
    #[serde(default)]
    pub state: Option<WaitState>,
    /// Only sessions whose lock holder runs this function.
    #[serde(default)]
    pub function_id: Option<String>,
    /// Only sessions that look stuck: past their wait's deadline, waiting for a
    /// worker of a function no connected worker serves, or running an invocation
    /// with no heartbeat for more than half its `timeout_ms`.
    #[serde(default)]
    pub stuck: Option<bool>,
    #[serde(default)]
    pub order: Option<SessionOrder>,
    #[serde(default)]
    pub limit: Option<u64>,
    /// The `next` of the previous page.
    #[serde(default)]
    pub after: Option<String>,
}

/// One session with unfinished work, as `sessions.list` shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SessionRow {
    pub session_id: String,
    /// The lock holder.
    pub turn_id: String,
    pub function_id: String,
    pub step: u32,
    pub attempt: u32,
    /// When the holder took the session's lock.
    pub locked_since_ms: u64,
    /// Unfinished turns behind the holder.
    pub queued: u64,
    pub stuck: bool,
    pub wait: Wait,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SessionsListOk {
    pub sessions: Vec<SessionRow>,
    /// Pass as `after` for the next page; `null` on the last page.
    pub next: Option<String>,
    /// Sessions matching every filter, when the page was taken.
    pub total: u64,
    /// Sessions matching `function_id` (and `stuck`), by wait state, when the page
    /// was taken (non-zero states only).
    pub counts: BTreeMap<String, u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn op_names_round_trip_and_roles() {
        for op in Op::ALL {
            assert_eq!(Op::parse(op.name()), Some(op));
            assert!(op.allowed_for(Role::Operator));
        }
        assert!(!Op::TurnSubmit.allowed_for(Role::Worker));
        assert!(!Op::InvocationResult.allowed_for(Role::Client));
        assert!(!Op::StoreCheck.allowed_for(Role::Client));
        assert!(Op::Ping.allowed_for(Role::Worker));
        assert_eq!(Op::parse("nope"), None);
    }
}
