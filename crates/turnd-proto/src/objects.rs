//! The protocol's objects: Turn, Wait, Session, Event, Stats, Worker, Function, and
//! the invoke push and step outcomes that workers exchange.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;

/// Lifecycle status of a turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TurnStatus {
    Queued,
    Running,
    Completed,
    Failed,
    Cancelled,
}

impl TurnStatus {
    pub const ALL: [TurnStatus; 5] = [
        TurnStatus::Queued,
        TurnStatus::Running,
        TurnStatus::Completed,
        TurnStatus::Failed,
        TurnStatus::Cancelled,
    ];

    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            TurnStatus::Completed | TurnStatus::Failed | TurnStatus::Cancelled
        )
    }

    pub fn as_str(self) -> &'static str {
        match self {
            TurnStatus::Queued => "queued",
            TurnStatus::Running => "running",
            TurnStatus::Completed => "completed",
            TurnStatus::Failed => "failed",
            TurnStatus::Cancelled => "cancelled",
        }
    }

    pub fn parse(s: &str) -> Option<TurnStatus> {
        TurnStatus::ALL.into_iter().find(|t| t.as_str() == s)
    }
}

/// Why a turn failed. Every failed turn has one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCause {
    HandlerFailed,
    OutcomeUnknown,
    TimedOut,
    NoWorker,
    AttemptsExhausted,
    StepLimit,
    InvalidResult,
    /// A suspended turn's input did not come by its deadline.
    InputTimeout,
}

impl ErrorCause {
    pub const ALL: [ErrorCause; 8] = [
        ErrorCause::HandlerFailed,
        ErrorCause::OutcomeUnknown,
        ErrorCause::TimedOut,
        ErrorCause::NoWorker,
        ErrorCause::AttemptsExhausted,
        ErrorCause::StepLimit,
        ErrorCause::InvalidResult,
        ErrorCause::InputTimeout,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCause::HandlerFailed => "handler_failed",
            ErrorCause::OutcomeUnknown => "outcome_unknown",
            ErrorCause::TimedOut => "timed_out",
            ErrorCause::NoWorker => "no_worker",
            ErrorCause::AttemptsExhausted => "attempts_exhausted",
            ErrorCause::StepLimit => "step_limit",
            ErrorCause::InvalidResult => "invalid_result",
            ErrorCause::InputTimeout => "input_timeout",
        }
    }
}

/// `Turn.error`: present on every failed turn.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TurnError {
    pub cause: ErrorCause,
    #[serde(default)]
    pub code: String,
    #[serde(default)]
    pub message: String,
    pub step: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub invocation_id: Option<String>,
}

/// `Turn.stop`: present once a stop was asked.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StopInfo {
    pub requested_at_ms: u64,
    pub reason: String,
}

/// What a non-terminal turn waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WaitState {
    QueuedBehind,
    AwaitingWorker,
    /// The holder is not dispatched while an invocation of an earlier turn, given up
    /// on a worker that cannot cancel it, may still be running.
    Held,
    AwaitingResult,
    AwaitingReconnect,
    BackingOff,
    Cancelling,
    Finalizing,
    /// The holder's last step suspended it: it waits for `turn.resume`.
    AwaitingInput,
}

impl WaitState {
    pub const ALL: [WaitState; 9] = [
        WaitState::QueuedBehind,
        WaitState::AwaitingWorker,
        WaitState::Held,
        WaitState::AwaitingResult,
        WaitState::AwaitingReconnect,
        WaitState::BackingOff,
        WaitState::Cancelling,
        WaitState::Finalizing,
        WaitState::AwaitingInput,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            WaitState::QueuedBehind => "queued_behind",
            WaitState::AwaitingWorker => "awaiting_worker",
            WaitState::Held => "held",
            WaitState::AwaitingResult => "awaiting_result",
            WaitState::AwaitingReconnect => "awaiting_reconnect",
            WaitState::BackingOff => "backing_off",
            WaitState::Cancelling => "cancelling",
            WaitState::Finalizing => "finalizing",
            WaitState::AwaitingInput => "awaiting_input",
        }
    }
}

/// What happens when a wait's deadline passes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnDeadline {
    Probe,
    Redispatch,
    Fail,
    Cancel,
    Retry,
    /// The wait ends and the turn is dispatched (or waits for a worker).
    Dispatch,
    /// A suspended turn's next step is dispatched without input.
    Continue,
}

impl OnDeadline {
    pub fn as_str(self) -> &'static str {
        match self {
            OnDeadline::Probe => "probe",
            OnDeadline::Redispatch => "redispatch",
            OnDeadline::Fail => "fail",
            OnDeadline::Cancel => "cancel",
            OnDeadline::Retry => "retry",
            OnDeadline::Dispatch => "dispatch",
            OnDeadline::Continue => "continue",
        }
    }
}

/// Why a non-terminal turn is not moving, and what happens next.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Wait {
    pub state: WaitState,
    pub reason: String,
    pub since_ms: u64,
    pub deadline_ms: Option<u64>,
    pub on_deadline: Option<OnDeadline>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub invocation_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ahead: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
}

/// A turn as the protocol shows it. `J` is the form of its input and output: a parsed
/// [`Value`] by default, or JSON text the daemon sends as it stores it, never parsed
/// into a tree and written again (the same JSON on the wire).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(bound(deserialize = "J: Deserialize<'de>"))]
pub struct Turn<J = Value> {
    pub turn_id: String,
    pub session_id: String,
    pub seq: u64,
    pub function_id: String,
    pub status: TurnStatus,
    pub step: u32,
    pub attempt: u32,
    pub input: J,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output: Option<J>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<TurnError>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop: Option<StopInfo>,
    /// Stopped by a later submit with `on_busy: "rollback"`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub superseded: bool,
    #[serde(default)]
    pub recovered: bool,
    pub created_at_ms: u64,
    pub updated_at_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at_ms: Option<u64>,
    /// While the turn awaits input: what its step asked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_request: Option<InputRequest>,
    /// The last progress of the turn's live invocation (in memory only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<ProgressView>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wait: Option<Wait>,
}

impl<J> Turn<J> {
    /// The same turn with its input and output in another form (`f` of each).
    pub fn map_json<K>(self, mut f: impl FnMut(J) -> K) -> Turn<K> {
        Turn {
            turn_id: self.turn_id,
            session_id: self.session_id,
            seq: self.seq,
            function_id: self.function_id,
            status: self.status,
            step: self.step,
            attempt: self.attempt,
            input: f(self.input),
            output: self.output.map(&mut f),
            error: self.error,
            stop: self.stop,
            superseded: self.superseded,
            recovered: self.recovered,
            created_at_ms: self.created_at_ms,
            updated_at_ms: self.updated_at_ms,
            finished_at_ms: self.finished_at_ms,
            input_request: self.input_request,
            progress: self.progress,
            wait: self.wait,
        }
    }
}

/// What ends a suspended turn's wait for input at its deadline.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnTimeout {
    /// The turn fails with cause `input_timeout`.
    #[default]
    Fail,
    /// The next step runs with `input: null`.
    Continue,
}

impl OnTimeout {
    pub fn as_str(self) -> &'static str {
        match self {
            OnTimeout::Fail => "fail",
            OnTimeout::Continue => "continue",
        }
    }
}

/// `Turn.input_request`: what a suspended turn waits for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InputRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt: Option<Value>,
    pub since_ms: u64,
    pub deadline_ms: Option<u64>,
    #[serde(default)]
    pub on_timeout: OnTimeout,
}

/// `Turn.progress`: the last progress frame of a live invocation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProgressView {
    pub invocation_id: String,
    pub step: u32,
    pub attempt: u32,
    pub seq: u64,
    pub data: Value,
    pub at_ms: u64,
}

/// The `previous` of an interrupting turn's first step: the lock holder it stopped
/// (`J`: see [`Turn`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PreviousTurn<J = Value> {
    pub turn_id: String,
    pub status: TurnStatus,
    /// Its last durable state: its last `continue` (or `suspend`) state, or its
    /// input at step 0.
    pub state: J,
}

/// `Session.lock`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SessionLock {
    pub turn_id: String,
    pub since_ms: u64,
    pub wait: Wait,
}

/// An entry of `Session.queued`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QueuedTurn {
    pub turn_id: String,
    pub seq: u64,
    pub function_id: String,
    pub created_at_ms: u64,
}

/// Turn counts by status.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TurnCounts {
    pub queued: u64,
    pub running: u64,
    pub completed: u64,
    pub failed: u64,
    pub cancelled: u64,
}

impl TurnCounts {
    pub fn get_mut(&mut self, s: TurnStatus) -> &mut u64 {
        match s {
            TurnStatus::Queued => &mut self.queued,
            TurnStatus::Running => &mut self.running,
            TurnStatus::Completed => &mut self.completed,
            TurnStatus::Failed => &mut self.failed,
            TurnStatus::Cancelled => &mut self.cancelled,
        }
    }

    pub fn get(&self, s: TurnStatus) -> u64 {
        match s {
            TurnStatus::Queued => self.queued,
            TurnStatus::Running => self.running,
            TurnStatus::Completed => self.completed,
            TurnStatus::Failed => self.failed,
            TurnStatus::Cancelled => self.cancelled,
        }
    }

    /// Move one turn from `from` (if any) to `to`.
    pub fn shift(&mut self, from: Option<TurnStatus>, to: TurnStatus) {
        if let Some(from) = from {
            let c = self.get_mut(from);
            *c = c.saturating_sub(1);
        }
        *self.get_mut(to) += 1;
    }
}

/// A session as `session.inspect` shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Session {
    pub session_id: String,
    pub lock: Option<SessionLock>,
    pub queued: Vec<QueuedTurn>,
    pub turns: TurnCounts,
    pub last_event: u64,
}

/// Kind of a session event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    Admitted,
    Dispatched,
    Result,
    RetryScheduled,
    Redispatched,
    OutcomeUnknown,
    ProbeSent,
    StopRequested,
    CancelSent,
    Completed,
    Failed,
    Cancelled,
    LateResult,
    Amended,
    /// A step suspended the turn for input.
    Suspended,
    /// A suspended turn's next step was let go (`turn.resume`, or its deadline).
    Resumed,
}

/// A durable, ordered session event. `D` is the form of its detail: a parsed
/// [`Value`] by default, or the JSON text the daemon writes once when the event
/// happens and stores and pushes as it is (the same JSON on the wire).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(bound(deserialize = "D: Deserialize<'de> + Default"))]
pub struct Event<D = Value> {
    pub seq: u64,
    pub session_id: String,
    pub turn_id: String,
    pub at_ms: u64,
    pub kind: EventKind,
    #[serde(default)]
    pub detail: D,
}

/// Daemon-wide counters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Stats {
    pub sessions: SessionStats,
    pub turns: TurnCounts,
    pub invocations_inflight: u64,
    pub workers_connected: u64,
    pub oldest_wait_ms: Option<u64>,
    pub storage: StorageHealth,
}

/// `Stats.sessions`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SessionStats {
    pub active: u64,
    pub blocked: BTreeMap<String, u64>,
}

/// `Stats.storage`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StorageHealth {
    pub writable: bool,
    pub last_error: Option<String>,
}

/// A worker as `workers.list` shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Worker {
    pub worker_id: String,
    pub name: String,
    pub connected: bool,
    pub instance_id: String,
    pub since_ms: u64,
    pub functions: Vec<String>,
    pub inflight: u64,
}

/// Delivery mode of a function.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Delivery {
    #[default]
    AtMostOnce,
    AtLeastOnce,
}

impl Delivery {
    pub fn default_max_attempts(self) -> u32 {
        match self {
            Delivery::AtMostOnce => 1,
            Delivery::AtLeastOnce => 3,
        }
    }
}

/// A function as `functions.list` shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Function {
    pub function_id: String,
    pub concurrency: u32,
    pub timeout_ms: u64,
    pub delivery: Delivery,
    pub max_attempts: u32,
    pub workers: u64,
    pub queued: u64,
    /// Whether a worker has registered the function since the daemon started. When
    /// not, it is known only from turns waiting for it, and `concurrency`,
    /// `timeout_ms`, `delivery` and `max_attempts` are placeholders, not settings.
    /// (Absent in answers of older daemons, which listed registered functions only.)
    #[serde(default = "registered_default")]
    pub registered: bool,
}

fn registered_default() -> bool {
    true
}

/// The `invoke` push: run one attempt of one step of a turn (`J`: see [`Turn`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(bound(deserialize = "J: Deserialize<'de>"))]
pub struct Invoke<J = Value> {
    pub invocation_id: String,
    pub function_id: String,
    pub session_id: String,
    pub turn_id: String,
    pub step: u32,
    pub attempt: u32,
    pub input: J,
    pub deadline_ms: u64,
    /// At step 0 of a turn that interrupted another: the lock holder it stopped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous: Option<PreviousTurn<J>>,
}

/// A worker-reported failure.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Failure {
    #[serde(default)]
    pub code: String,
    #[serde(default)]
    pub message: String,
    #[serde(default)]
    pub retryable: bool,
}

/// A worker-reported cancellation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct Cancelled {
    #[serde(default)]
    pub message: String,
}

/// A step that asks for input: the turn keeps its session's lock and waits for
/// `turn.resume`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct Suspend {
    /// Kept for the next step, which gets `{"state", "input"}`.
    #[serde(default)]
    pub state: Value,
    /// What is asked (shown to whoever resumes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt: Option<Value>,
    /// How long the turn waits for input; none: for good.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    #[serde(default)]
    pub on_timeout: OnTimeout,
}

impl Suspend {
    /// A suspend keeping `state` for the next step, without prompt or deadline.
    pub fn new(state: Value) -> Suspend {
        Suspend {
            state,
            ..Suspend::default()
        }
    }

    /// What is asked, shown to whoever resumes.
    pub fn prompt(mut self, prompt: impl Into<Value>) -> Suspend {
        self.prompt = Some(prompt.into());
        self
    }

    /// How long the turn waits, and what the end of the wait does.
    pub fn timeout(mut self, timeout_ms: u64, on_timeout: OnTimeout) -> Suspend {
        self.timeout_ms = Some(timeout_ms);
        self.on_timeout = on_timeout;
        self
    }
}

impl<J> From<Suspend> for Outcome<J> {
    fn from(s: Suspend) -> Outcome<J> {
        Outcome::Suspend(s)
    }
}

/// The outcome of one invocation, as a worker reports it (`J`: the form of a
/// `complete` or `continue` value, see [`Turn`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome<J = Value> {
    Complete(J),
    Continue(J),
    Fail(Failure),
    Cancelled(Cancelled),
    Suspend(Suspend),
}

impl<J> Outcome<J> {
    /// The same outcome with its value in another form.
    pub fn map_json<K>(self, f: impl FnOnce(J) -> K) -> Outcome<K> {
        match self {
            Outcome::Complete(v) => Outcome::Complete(f(v)),
            Outcome::Continue(v) => Outcome::Continue(f(v)),
            Outcome::Fail(x) => Outcome::Fail(x),
            Outcome::Cancelled(x) => Outcome::Cancelled(x),
            Outcome::Suspend(x) => Outcome::Suspend(x),
        }
    }

    pub fn kind(&self) -> &'static str {
        match self {
            Outcome::Complete(_) => "complete",
            Outcome::Continue(_) => "continue",
            Outcome::Fail(_) => "fail",
            Outcome::Cancelled(_) => "cancelled",
            Outcome::Suspend(_) => "suspend",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn outcome_wire_shapes() {
        let o: Outcome = serde_json::from_value(json!({"complete": {"a": 1}})).expect("complete");
        assert_eq!(o, Outcome::Complete(json!({"a": 1})));
        let o: Outcome = serde_json::from_value(json!({"complete": null})).expect("null");
        assert_eq!(o, Outcome::Complete(Value::Null));
        let o: Outcome = serde_json::from_value(
            json!({"fail": {"code": "x", "message": "m", "retryable": true}}),
        )
        .expect("fail");
        assert!(matches!(
            o,
            Outcome::Fail(Failure {
                retryable: true,
                ..
            })
        ));
        let o: Outcome = serde_json::from_value(json!({"cancelled": {}})).expect("cancelled");
        assert_eq!(o.kind(), "cancelled");
        let o: Outcome = serde_json::from_value(
            json!({"suspend": {"state": [1], "prompt": "ok?", "timeout_ms": 5, "on_timeout": "continue"}}),
        )
        .expect("suspend");
        assert_eq!(
            o,
            Outcome::Suspend(Suspend {
                state: json!([1]),
                prompt: Some(json!("ok?")),
                timeout_ms: Some(5),
                on_timeout: OnTimeout::Continue,
            })
        );
        let o: Outcome = serde_json::from_value(json!({"suspend": {}})).expect("bare suspend");
        assert_eq!(o, Outcome::Suspend(Suspend::default()));
        assert!(
            serde_json::from_value::<Outcome>(json!({"suspend": {"on_timeout": "later"}})).is_err()
        );
        assert!(serde_json::from_value::<Outcome>(json!({"nope": 1})).is_err());
        assert!(serde_json::from_value::<Outcome>(json!({"complete": 1, "fail": {}})).is_err());
    }

    #[test]
    fn turn_omits_absent_members() {
        let t = Turn {
            turn_id: "t_1".into(),
            session_id: "s".into(),
            seq: 1,
            function_id: "f".into(),
            status: TurnStatus::Queued,
            step: 0,
            attempt: 0,
            input: json!(null),
            output: None,
            error: None,
            stop: None,
            superseded: false,
            recovered: false,
            created_at_ms: 1,
            updated_at_ms: 1,
            finished_at_ms: None,
            input_request: None,
            progress: None,
            wait: None,
        };
        let v = serde_json::to_value(&t).expect("serialize");
        assert!(v.get("error").is_none());
        assert!(v.get("superseded").is_none());
        assert!(v.get("input_request").is_none());
        assert!(v.get("progress").is_none());
        assert_eq!(v["status"], "queued");
    }
}
