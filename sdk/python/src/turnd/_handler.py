"""What a handler sees and what it returns: :class:`TurnContext` (with the
:class:`Previous` turn an interrupting submit stopped), :class:`Continue`,
:class:`Suspend`, :class:`Fail`, :class:`Resumed` (the input of a step after a
suspend), a served function's :class:`FunctionSpec`, and :func:`run_handler`, which
calls a handler and turns whatever it did into the outcome the daemon takes.

Kept apart from the worker's connection and loss handling (``worker.py``), which
only needs the outcome.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import dataclasses
import functools
import inspect
import json
import logging
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from .types import JSON

if TYPE_CHECKING:
    from .worker import Worker

Delivery = Literal["at_most_once", "at_least_once"]


class Continue:
    """Return ``Continue(state)`` from a handler to run another step with ``state`` as input."""

    __slots__ = ("state",)

    def __init__(self, state: Any = None) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"Continue({self.state!r})"


OnTimeout = Literal["fail", "continue"]


class Suspend:
    """Return ``Suspend(state, prompt=..., timeout_ms=..., on_timeout=...)`` from a
    handler to wait for input from a caller without holding a worker.

    The invocation ends (the worker's slot is free) and the turn waits in the wait
    state ``awaiting_input``, keeping its session's lock, until a caller's
    ``resume(turn_id, input)``; the next step then gets ``{"state": state, "input":
    input}`` (read it with :meth:`Resumed.parse`). ``prompt`` (any JSON) says what is
    asked and is shown in the turn's ``input_request``. Past ``timeout_ms`` the turn
    fails with cause ``input_timeout`` (``on_timeout="fail"``, the default) or its
    next step runs with ``input`` ``None`` (``on_timeout="continue"``).
    """

    __slots__ = ("on_timeout", "prompt", "state", "timeout_ms")

    def __init__(
        self,
        state: Any = None,
        *,
        prompt: Any = None,
        timeout_ms: int | None = None,
        on_timeout: OnTimeout = "fail",
    ) -> None:
        if timeout_ms is not None and (isinstance(timeout_ms, bool) or timeout_ms <= 0):
            raise ValueError("timeout_ms must be a positive number of milliseconds")
        if on_timeout not in ("fail", "continue"):
            raise ValueError(f"on_timeout must be fail or continue, not {on_timeout!r}")
        self.state = state
        self.prompt = prompt
        self.timeout_ms = timeout_ms
        self.on_timeout = on_timeout

    def __repr__(self) -> str:
        return (
            f"Suspend({self.state!r}, prompt={self.prompt!r}, timeout_ms={self.timeout_ms!r},"
            f" on_timeout={self.on_timeout!r})"
        )

    def outcome(self) -> dict[str, Any]:
        """The ``suspend`` outcome: members left at their default are not sent."""
        suspend: dict[str, Any] = {"state": _to_json(self.state)}
        if self.prompt is not None:
            suspend["prompt"] = _to_json(self.prompt)
        if self.timeout_ms is not None:
            suspend["timeout_ms"] = self.timeout_ms
        if self.on_timeout != "fail":
            suspend["on_timeout"] = self.on_timeout
        return {"suspend": suspend}


@dataclass(frozen=True)
class Resumed:
    """The input of the step after a :class:`Suspend`: the suspend's ``state`` and the
    ``input`` a caller resumed it with (``None`` when the wait timed out with
    ``on_timeout="continue"``)."""

    state: Any
    input: Any

    @classmethod
    def parse(cls, value: Any) -> Resumed | None:
        """``Resumed`` when ``value`` has the shape ``{"state", "input"}`` a resumed step
        gets, else ``None``. The daemon does not mark a resumed step: a handler that
        suspends should say in its state that it waits, so that a ``Continue`` state
        of the same shape is not taken for an answer."""
        if isinstance(value, dict) and set(value) == {"state", "input"}:
            return cls(value["state"], value["input"])
        return None


@dataclass(frozen=True)
class Previous:
    """The turn a submit with ``on_busy="interrupt"`` (or ``"rollback"``) stopped, as
    step 0 of the new turn sees it: ``status`` after the stop (``cancelled``) and its
    last durable ``state`` (its last ``Continue`` or ``Suspend`` state, the
    ``{"state", "input"}`` of its last resume, or its input when it never left step 0).
    """

    turn_id: str
    status: str
    state: Any

    @classmethod
    def from_wire(cls, obj: Any) -> Previous | None:
        if not isinstance(obj, dict) or not isinstance(obj.get("turn_id"), str):
            return None
        return cls(obj["turn_id"], str(obj.get("status", "")), obj.get("state"))


class Fail(Exception):
    """Raise ``Fail(code, message, retryable=...)`` from a handler to fail the step.

    With ``retryable=True`` and attempts left the daemon backs off and runs the step
    again; otherwise the turn fails with cause ``handler_failed`` (or
    ``attempts_exhausted``) and this ``code``.
    """

    def __init__(self, code: str, message: str = "", *, retryable: bool = False) -> None:
        super().__init__(f"{code}: {message}" if message else code)
        self.code = code
        self.message = message
        self.retryable = retryable


if typing.TYPE_CHECKING:
    _LoggerAdapter = logging.LoggerAdapter[logging.Logger]
else:  # LoggerAdapter is subscriptable at run time from Python 3.11 on
    _LoggerAdapter = logging.LoggerAdapter


class InvocationLog(_LoggerAdapter):
    """Prefixes each message with the invocation id (also in ``extra``)."""

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        extra = self.extra or {}
        kwargs.setdefault("extra", {}).update(extra)
        return f"[{extra.get('invocation_id', '')}] {msg}", kwargs


@dataclass
class TurnContext:
    """What a handler gets besides its input, for one invocation."""

    session_id: str
    turn_id: str
    function_id: str
    step: int
    attempt: int
    invocation_id: str
    deadline_ms: int
    cancelled: asyncio.Event
    """Set when the daemon sends ``cancel`` (a stop, or a deadline passed), or when
    a heartbeat learns the invocation is no longer current. Raise
    ``asyncio.CancelledError`` (or return) once it is set."""
    log: logging.LoggerAdapter[logging.Logger]
    _worker: Worker = field(repr=False)
    _loop: asyncio.AbstractEventLoop = field(repr=False)
    previous: Previous | None = None
    """At step 0 of a turn submitted with ``on_busy="interrupt"`` or ``"rollback"``
    that stopped a running turn: that turn and its last durable state; else ``None``."""
    progress_seq: int = 0
    """The ``seq`` the daemon gave the last progress frame it accepted (0: none yet)."""
    stale: bool = field(default=False, repr=False)
    """The daemon said this invocation is no longer current (to a heartbeat or a
    progress frame): later progress is not sent."""

    @property
    def idempotency_key(self) -> str:
        """Stable across redispatches and retries of this step of this turn.

        Use it for side effects that must happen once per step (a payment, an
        e-mail): attempts and redispatches of the same step share it.
        """
        return f"{self.turn_id}:{self.step}"

    @property
    def is_cancelled(self) -> bool:
        """``cancelled.is_set()``, safe to read from a thread-pool handler."""
        return self.cancelled.is_set()

    async def heartbeat(self) -> int:
        """Move this invocation's deadline now; returns the new deadline (Unix ms).

        The worker already heartbeats on its own while the handler runs; call this to
        renew at a moment of your choosing. Raises :class:`NotFound` (and sets
        ``cancelled``) when the invocation is no longer current, and
        :class:`ConnectionLost` while the worker is disconnected.
        """
        return await self._worker._live.heartbeat(self)

    def heartbeat_threadsafe(self, timeout: float = 10.0) -> int:
        """:meth:`heartbeat` for a plain ``def`` handler running on the thread pool."""
        future = asyncio.run_coroutine_threadsafe(self.heartbeat(), self._loop)
        return future.result(timeout)

    async def progress(self, data: Any) -> None:
        """Stream partial output (a model's tokens) to the watchers of this turn.

        Sent as ``invocation.progress`` in call order, without waiting for the
        daemon's answer: the handler is held at most ``Worker(progress_timeout=…)``
        when the connection cannot take more, and never raises for what the daemon
        does with the frame. A frame sent while the worker is disconnected, or that
        the daemon refuses (``too_large``), is dropped and counted in
        ``worker.stats``; when the daemon answers ``not_found`` (the invocation is no
        longer current) ``cancelled`` is set and later frames are not sent. Raises
        ``TypeError`` or ``ValueError`` at once for ``data`` that is not JSON.
        """
        await self._worker._live.progress(self, data)

    def progress_threadsafe(self, data: Any, timeout: float = 10.0) -> None:
        """:meth:`progress` for a plain ``def`` handler running on the thread pool."""
        future = asyncio.run_coroutine_threadsafe(self.progress(data), self._loop)
        future.result(timeout)


Handler = Callable[..., Any]


@dataclass
class FunctionSpec:
    """A function this worker serves and the settings it registers it with."""

    function_id: str
    handler: Handler
    concurrency: int = 1
    timeout_ms: int | None = None
    delivery: Delivery = "at_most_once"
    max_attempts: int | None = None
    is_async: bool = True
    input_model: Any = None

    @classmethod
    def of(
        cls,
        function_id: str,
        handler: Handler,
        *,
        concurrency: int,
        timeout_ms: int | None,
        delivery: Delivery,
        max_attempts: int | None,
    ) -> FunctionSpec:
        """The spec of ``handler``: how to call it, and its input model when the
        ``input`` parameter is annotated with a pydantic model."""
        input_model = None
        try:
            hints = typing.get_type_hints(handler)
        except Exception:
            hints = {}
        params = list(inspect.signature(handler).parameters)
        if len(params) >= 2:
            input_model = _pydantic_model(hints.get(params[1]))
        return cls(
            function_id=function_id,
            handler=handler,
            concurrency=concurrency,
            timeout_ms=timeout_ms,
            delivery=delivery,
            max_attempts=max_attempts,
            is_async=inspect.iscoroutinefunction(handler),
            input_model=input_model,
        )

    def register_args(self) -> dict[str, Any]:
        args: dict[str, Any] = {
            "function_id": self.function_id,
            "concurrency": self.concurrency,
            "delivery": self.delivery,
        }
        if self.timeout_ms is not None:
            args["timeout_ms"] = self.timeout_ms
        if self.max_attempts is not None:
            args["max_attempts"] = self.max_attempts
        return args


def _pydantic_model(annotation: Any) -> Any:
    """The annotation when it is a pydantic model class (pydantic being installed)."""
    if not isinstance(annotation, type):
        return None
    try:
        from pydantic import BaseModel
    except ImportError:
        return None
    return annotation if issubclass(annotation, BaseModel) else None


def _to_json(value: Any) -> Any:
    """Make a handler's return value JSON: pydantic models and dataclasses included."""
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        return dump(mode="json")
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return value


def _outcome_of(value: Any) -> dict[str, Any]:
    if isinstance(value, Continue):
        return {"continue": _to_json(value.state)}
    if isinstance(value, Suspend):
        return value.outcome()
    return {"complete": _to_json(value)}


async def run_handler(
    spec: FunctionSpec | None,
    ctx: TurnContext,
    input: JSON,
    pool: concurrent.futures.Executor | None,
    stopping: asyncio.Event | None,
) -> dict[str, Any]:
    """Call the handler of ``spec`` and return its outcome: ``complete``, ``continue``,
    ``suspend``, ``fail`` or ``cancelled``. A cancellation while ``stopping`` is set is raised."""
    if spec is None:
        return {
            "fail": {
                "code": "unknown_function",
                "message": f"this worker does not serve {ctx.function_id}",
                "retryable": False,
            }
        }
    try:
        if spec.input_model is not None:
            try:
                input = spec.input_model.model_validate(input)
            except Exception as e:
                raise Fail("invalid_input", str(e)) from e
        if spec.is_async:
            value = await spec.handler(ctx, input)
        else:
            call = functools.partial(contextvars.copy_context().run, spec.handler, ctx, input)
            value = await asyncio.get_running_loop().run_in_executor(pool, call)
        if inspect.isawaitable(value):
            value = await value
        outcome = _outcome_of(value)
        try:
            json.dumps(outcome, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise Fail("invalid_output", f"the handler's value is not JSON: {e}") from e
        return outcome
    except Fail as f:
        return {"fail": {"code": f.code, "message": f.message, "retryable": f.retryable}}
    except asyncio.CancelledError:
        if stopping is not None and stopping.is_set():
            raise
        reason = "cancelled" if ctx.cancelled.is_set() else "handler cancelled itself"
        return {"cancelled": {"message": reason}}
    except Exception as e:
        ctx.log.warning("handler raised %s: %s", type(e).__name__, e)
        return {"fail": {"code": type(e).__name__, "message": str(e), "retryable": False}}
