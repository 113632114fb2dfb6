"""Typed views of the protocol's objects (``docs/protocol.md``, "Objects").

Each class keeps the wire object it was built from in ``raw``, so fields added by
a newer daemon are still reachable.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

JSON = Any
"""A JSON value as ``json.loads`` returns it."""

TERMINAL_STATUSES = frozenset({"completed", "failed", "cancelled"})
"""Turn statuses that are final, and the kinds of the events that make them."""


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


@dataclass(frozen=True)
class Wait:
    """What an unfinished turn waits for, and what happens at its deadline."""

    state: str
    reason: str
    since_ms: int
    deadline_ms: int | None
    on_deadline: str | None
    invocation_id: str | None = None
    worker_id: str | None = None
    ahead: int | None = None
    last_error: str | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> Wait:
        return cls(
            state=str(obj["state"]),
            reason=str(obj.get("reason", "")),
            since_ms=int(obj.get("since_ms", 0)),
            deadline_ms=_opt_int(obj.get("deadline_ms")),
            on_deadline=obj.get("on_deadline"),
            invocation_id=obj.get("invocation_id"),
            worker_id=obj.get("worker_id"),
            ahead=_opt_int(obj.get("ahead")),
            last_error=obj.get("last_error"),
            raw=obj,
        )


@dataclass(frozen=True)
class TurnError:
    """Why a turn failed: ``cause`` (e.g. ``handler_failed``) and the worker's ``code``."""

    cause: str
    code: str
    message: str
    step: int
    invocation_id: str | None = None

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> TurnError:
        return cls(
            cause=str(obj.get("cause", "")),
            code=str(obj.get("code", "")),
            message=str(obj.get("message", "")),
            step=int(obj.get("step", 0)),
            invocation_id=obj.get("invocation_id"),
        )


@dataclass(frozen=True)
class Stop:
    """A stop request recorded on a turn."""

    requested_at_ms: int
    reason: str


@dataclass(frozen=True)
class TurnProgress:
    """The last progress frame of a turn's live invocation (``turn.progress``): kept in
    the daemon's memory only, gone when the invocation ends."""

    invocation_id: str
    step: int
    attempt: int
    seq: int
    data: JSON
    at_ms: int

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> TurnProgress:
        return cls(
            invocation_id=str(obj.get("invocation_id", "")),
            step=int(obj.get("step", 0)),
            attempt=int(obj.get("attempt", 0)),
            seq=int(obj.get("seq", 0)),
            data=obj.get("data"),
            at_ms=int(obj.get("at_ms", 0)),
        )


@dataclass(frozen=True)
class InputRequest:
    """What a turn awaiting input asks (``turn.input_request``): answer it with
    ``Client.resume``. ``on_timeout`` is ``fail`` or ``continue``."""

    prompt: JSON
    since_ms: int
    deadline_ms: int | None
    on_timeout: str

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> InputRequest:
        return cls(
            prompt=obj.get("prompt"),
            since_ms=int(obj.get("since_ms", 0)),
            deadline_ms=_opt_int(obj.get("deadline_ms")),
            on_timeout=str(obj.get("on_timeout", "fail")),
        )


@dataclass(frozen=True)
class Turn:
    """A turn as the daemon reports it."""

    turn_id: str
    session_id: str
    seq: int
    function_id: str
    status: str
    step: int
    attempt: int
    input: JSON
    output: JSON = None
    error: TurnError | None = None
    stop: Stop | None = None
    recovered: bool = False
    created_at_ms: int = 0
    updated_at_ms: int = 0
    finished_at_ms: int | None = None
    wait: Wait | None = None
    progress: TurnProgress | None = field(default=None, compare=False)
    """The live invocation's last progress frame (not durable, so not compared)."""
    input_request: InputRequest | None = None
    """What the turn asks while it is awaiting input."""
    superseded: bool = False
    """Stopped by a submit with ``on_busy="rollback"``."""
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def done(self) -> bool:
        """Whether the turn is terminal (completed, failed or cancelled)."""
        return self.status in TERMINAL_STATUSES

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> Turn:
        error = obj.get("error")
        stop = obj.get("stop")
        wait = obj.get("wait")
        progress = obj.get("progress")
        asked = obj.get("input_request")
        return cls(
            turn_id=str(obj["turn_id"]),
            session_id=str(obj["session_id"]),
            seq=int(obj["seq"]),
            function_id=str(obj["function_id"]),
            status=str(obj["status"]),
            step=int(obj.get("step", 0)),
            attempt=int(obj.get("attempt", 0)),
            input=obj.get("input"),
            output=obj.get("output"),
            error=TurnError.from_wire(error) if isinstance(error, dict) else None,
            stop=(
                Stop(int(stop.get("requested_at_ms", 0)), str(stop.get("reason", "")))
                if isinstance(stop, dict)
                else None
            ),
            recovered=bool(obj.get("recovered", False)),
            created_at_ms=int(obj.get("created_at_ms", 0)),
            updated_at_ms=int(obj.get("updated_at_ms", 0)),
            finished_at_ms=_opt_int(obj.get("finished_at_ms")),
            wait=Wait.from_wire(wait) if isinstance(wait, dict) else None,
            progress=TurnProgress.from_wire(progress) if isinstance(progress, dict) else None,
            input_request=InputRequest.from_wire(asked) if isinstance(asked, dict) else None,
            superseded=bool(obj.get("superseded", False)),
            raw=obj,
        )


@dataclass(frozen=True)
class Submitted:
    """The answer of ``turn.submit`` (and ``turn.resume``): the turn, and whether an
    earlier request with the same idempotency key made it."""

    turn: Turn
    deduplicated: bool

    @property
    def turn_id(self) -> str:
        return self.turn.turn_id


@dataclass(frozen=True)
class QueuedTurn:
    """A turn waiting behind a session's lock holder."""

    turn_id: str
    seq: int
    function_id: str
    created_at_ms: int


@dataclass(frozen=True)
class SessionLock:
    """The session's lock holder and what it waits for."""

    turn_id: str
    since_ms: int
    wait: Wait | None


@dataclass(frozen=True)
class Session:
    """A session as ``session.inspect`` reports it."""

    session_id: str
    lock: SessionLock | None
    queued: list[QueuedTurn]
    turns: dict[str, int]
    last_event: int
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> Session:
        lock = obj.get("lock")
        lock_wait = lock.get("wait") if isinstance(lock, dict) else None
        return cls(
            session_id=str(obj["session_id"]),
            lock=(
                SessionLock(
                    turn_id=str(lock["turn_id"]),
                    since_ms=int(lock.get("since_ms", 0)),
                    wait=Wait.from_wire(lock_wait) if isinstance(lock_wait, dict) else None,
                )
                if isinstance(lock, dict)
                else None
            ),
            queued=[
                QueuedTurn(
                    turn_id=str(q["turn_id"]),
                    seq=int(q["seq"]),
                    function_id=str(q["function_id"]),
                    created_at_ms=int(q.get("created_at_ms", 0)),
                )
                for q in obj.get("queued") or []
            ],
            turns={str(k): int(v) for k, v in (obj.get("turns") or {}).items()},
            last_event=int(obj.get("last_event", 0)),
            raw=obj,
        )


@dataclass(frozen=True)
class Event:
    """One entry of a session's event log."""

    seq: int
    session_id: str
    turn_id: str
    at_ms: int
    kind: str
    detail: dict[str, Any]

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> Event:
        detail = obj.get("detail")
        return cls(
            seq=int(obj["seq"]),
            session_id=str(obj["session_id"]),
            turn_id=str(obj.get("turn_id", "")),
            at_ms=int(obj.get("at_ms", 0)),
            kind=str(obj["kind"]),
            detail=detail if isinstance(detail, dict) else {},
        )


@dataclass(frozen=True)
class Progress:
    """A progress frame pushed to a watch that asked for progress: partial output of
    the invocation ``invocation_id``; ``seq`` counts that invocation's frames from 1."""

    turn_id: str
    invocation_id: str
    step: int
    attempt: int
    seq: int
    data: JSON

    @property
    def kind(self) -> Literal["progress"]:
        return "progress"

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> Progress:
        return cls(
            turn_id=str(obj.get("turn_id", "")),
            invocation_id=str(obj.get("invocation_id", "")),
            step=int(obj.get("step", 0)),
            attempt=int(obj.get("attempt", 0)),
            seq=int(obj.get("seq", 0)),
            data=obj.get("data"),
        )


@dataclass(frozen=True)
class ProgressDropped:
    """``count`` progress frames of ``invocation_id`` this watch did not get (it read
    too slowly, was still replaying, or was reconnecting)."""

    turn_id: str
    invocation_id: str
    count: int

    @property
    def kind(self) -> Literal["progress_dropped"]:
        return "progress_dropped"

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> ProgressDropped:
        return cls(
            turn_id=str(obj.get("turn_id", "")),
            invocation_id=str(obj.get("invocation_id", "")),
            count=int(obj.get("count", 0)),
        )


WatchItem: TypeAlias = Event | Progress | ProgressDropped
"""What a watch with ``progress=True`` yields."""


@dataclass(frozen=True)
class TurnPage:
    """One page of ``turn.list`` (newest first)."""

    turns: list[Turn]
    next_before_seq: int | None


@dataclass(frozen=True)
class EventPage:
    """One page of ``session.events`` (ascending ``seq``)."""

    events: list[Event]
    next: int


@dataclass(frozen=True)
class WorkerInfo:
    """An entry of ``workers.list``."""

    worker_id: str
    name: str
    connected: bool
    instance_id: str | None
    since_ms: int
    functions: list[str]
    inflight: int

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> WorkerInfo:
        return cls(
            worker_id=str(obj["worker_id"]),
            name=str(obj.get("name", "")),
            connected=bool(obj.get("connected", False)),
            instance_id=obj.get("instance_id"),
            since_ms=int(obj.get("since_ms", 0)),
            functions=[str(f) for f in obj.get("functions") or []],
            inflight=int(obj.get("inflight", 0)),
        )


@dataclass(frozen=True)
class FunctionInfo:
    """An entry of ``functions.list``."""

    function_id: str
    concurrency: int
    timeout_ms: int
    delivery: str
    max_attempts: int
    workers: int
    queued: int
    registered: bool = True
    """False for a function no worker registered, listed because turns wait for
    it; its ``concurrency``, ``timeout_ms``, ``delivery`` and ``max_attempts`` are
    then placeholders, not settings."""

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> FunctionInfo:
        concurrency = int(obj.get("concurrency", 0))
        # A daemon without the field lists a function nobody registered with
        # concurrency 0, and a registration has at least 1.
        registered = obj.get("registered", concurrency > 0)
        return cls(
            function_id=str(obj["function_id"]),
            concurrency=concurrency,
            timeout_ms=int(obj.get("timeout_ms", 0)),
            delivery=str(obj.get("delivery", "")),
            max_attempts=int(obj.get("max_attempts", 0)),
            workers=int(obj.get("workers", 0)),
            queued=int(obj.get("queued", 0)),
            registered=bool(registered),
        )


@dataclass(frozen=True)
class SessionRow:
    """A session with an unfinished turn, as ``sessions.list`` shows its lock holder."""

    session_id: str
    turn_id: str
    """The lock holder."""
    function_id: str
    step: int
    attempt: int
    locked_since_ms: int
    """When the holder took the session's lock."""
    queued: int
    """Unfinished turns behind the holder."""
    stuck: bool
    """Past its wait's deadline, waiting for a function no connected worker serves,
    or running an invocation with no heartbeat for over half its ``timeout_ms``."""
    wait: Wait
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> SessionRow:
        return cls(
            session_id=str(obj["session_id"]),
            turn_id=str(obj["turn_id"]),
            function_id=str(obj.get("function_id", "")),
            step=int(obj.get("step", 0)),
            attempt=int(obj.get("attempt", 0)),
            locked_since_ms=int(obj.get("locked_since_ms", 0)),
            queued=int(obj.get("queued", 0)),
            stuck=bool(obj.get("stuck", False)),
            wait=Wait.from_wire(obj["wait"]),
            raw=obj,
        )


@dataclass(frozen=True)
class SessionPage:
    """One page of ``sessions.list``."""

    sessions: list[SessionRow]
    next: str | None
    """Pass as ``after`` (with the same ``order``) for the next page; ``None`` on the last."""
    total: int
    """Sessions matching every filter when the page was taken."""
    counts: dict[str, int]
    """Sessions matching ``function_id`` and ``stuck``, by wait state (non-zero only)."""

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> SessionPage:
        after = obj.get("next")
        return cls(
            sessions=[SessionRow.from_wire(r) for r in obj.get("sessions") or []],
            next=None if after is None else str(after),
            total=int(obj.get("total", 0)),
            counts={str(k): int(v) for k, v in (obj.get("counts") or {}).items()},
        )


@dataclass(frozen=True)
class Reconciled:
    """What the daemon did with this worker's invocations at ``hello``."""

    kept: list[str]
    redispatched: list[str]
    unknown: list[str]

    @classmethod
    def from_wire(cls, obj: Any) -> Reconciled:
        if not isinstance(obj, dict):
            return cls([], [], [])
        return cls(
            kept=[str(i) for i in obj.get("kept") or []],
            redispatched=[str(i) for i in obj.get("redispatched") or []],
            unknown=[str(i) for i in obj.get("unknown") or []],
        )
