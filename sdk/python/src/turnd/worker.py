"""The worker side: serve functions and do the worker's part of every loss rule.

The daemon can only reconcile losses (``docs/semantics.md``, "Loss") when the worker
does its part, and this module is that part:

- one ``instance_id`` for the life of a :class:`Worker`, sent in every ``hello`` with
  the invocations still running (``inflight``) and the results not yet acknowledged
  (``finished``), so a reconnect keeps work instead of losing it;
- every result is held until the daemon answers it: resent after
  ``result_ack_timeout`` without an answer, after a retryable error, after every
  reconnect, and at once when a ``probe``, ``cancel`` or repeated ``invoke`` shows the
  daemon is waiting for it;
- ``probe`` is answered from what the worker really knows (``running``, ``finished``,
  ``unknown``); ``cancel`` sets the handler's ``ctx.cancelled`` event and, after
  ``cancel_grace``, cancels the handler's task;
- while a handler runs the worker sends ``invocation.heartbeat`` on its own, so a
  long step outlives its ``timeout_ms`` as long as the process is alive;
- any close of a connection, clean or not, is a disconnect: the worker reconnects
  for good with capped, jittered backoff while handlers keep running, and registers
  its functions again;
- given several URLs (a cluster's nodes) it keeps a connection to each (``_links.py``)
  with these same tables: a probe on any connection is answered from all of them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import enum
import logging
import signal
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._connection import Connection, url_list
from ._handler import (
    Continue,
    Delivery,
    Fail,
    FunctionSpec,
    Handler,
    InvocationLog,
    Previous,
    Suspend,
    TurnContext,
    run_handler,
)
from ._links import Link, Links
from ._live import Live
from .errors import ConnectionLost, ProtocolError, TooLarge, TurndError
from .types import JSON, Reconciled

log = logging.getLogger("turnd.worker")


class WorkerState(str, enum.Enum):
    """The worker's connection state (``worker.state``, ``on_state`` callback)."""

    IDLE = "idle"
    CONNECTING = "connecting"
    CONNECTED = "connected"
    DISCONNECTED = "disconnected"
    DRAINING = "draining"
    STOPPED = "stopped"


@dataclass
class WorkerStats:
    """Counters of a worker since it was created."""

    invocations_started: int = 0
    results_sent: int = 0
    results_resent: int = 0
    results_acked: int = 0
    results_dropped: int = 0
    heartbeats_sent: int = 0
    progress_sent: int = 0
    """Progress frames the daemon accepted."""
    progress_dropped: int = 0
    """Progress frames not sent (disconnected, no longer current, a connection that
    took no more within ``progress_timeout``) or lost with the connection."""
    progress_refused: int = 0
    """Progress frames the daemon refused (``not_found``, ``too_large``)."""
    probes_answered: int = 0
    cancels_received: int = 0
    connections: int = 0


@dataclass
class _Running:
    ctx: TurnContext
    home: int
    """The index of the URL whose daemon last pushed about the invocation."""
    task: asyncio.Task[None] | None = None
    hard_cancel: asyncio.TimerHandle | None = None


@dataclass
class _Held:
    outcome: dict[str, Any]
    home: int
    resend_now: asyncio.Event = field(default_factory=asyncio.Event)


class Worker:
    """Serves functions to a turnd daemon.

    ::

        worker = Worker("ws://127.0.0.1:7420/v1", worker_id="agent-1")

        @worker.function("agent.step", concurrency=8, timeout_ms=300_000)
        async def step(ctx: TurnContext, input: dict[str, Any]) -> dict[str, Any] | Continue:
            ...

        worker.run()            # or: await worker.serve()

    ``instance_id`` defaults to a fresh id per ``Worker`` object: keep the object
    (the SDK does, across reconnects) to be recognised as the same instance.

    ``url`` may be a list: the URLs of a cluster's nodes. The worker then keeps a
    connection to each, with one ``worker_id`` and one ``instance_id``.
    """

    urls: list[str]
    """Every URL the worker connects to (``url`` sets them)."""

    def __init__(
        self,
        url: str | Sequence[str],
        worker_id: str,
        *,
        token: str | None = None,
        name: str | None = None,
        instance_id: str | None = None,
        result_ack_timeout: float = 2.0,
        reconnect_delay: float = 0.2,
        reconnect_max_delay: float = 5.0,
        cancel_grace: float | None = 2.0,
        auto_heartbeat: bool = True,
        drain_timeout: float = 30.0,
        max_threads: int | None = None,
        on_state: Callable[[WorkerState], None] | None = None,
        progress_timeout: float = 1.0,
    ) -> None:
        self.url = url
        self.worker_id = worker_id
        self.token = token
        self.name = name or worker_id
        self.instance_id = instance_id or uuid.uuid4().hex
        self.result_ack_timeout = result_ack_timeout
        self.reconnect_delay = reconnect_delay
        self.reconnect_max_delay = max(reconnect_max_delay, reconnect_delay)
        self.cancel_grace = cancel_grace
        self.auto_heartbeat = auto_heartbeat
        self.drain_timeout = drain_timeout
        self.on_state = on_state
        self.progress_timeout = progress_timeout
        self.stats = WorkerStats()
        self._live = Live(self)
        self.reconciled: Reconciled | None = None
        """What the daemon did with this worker's invocations at the last ``hello``."""
        self._functions: dict[str, FunctionSpec] = {}
        self._max_threads = max_threads
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._state = WorkerState.IDLE
        self._state_waiters: list[tuple[WorkerState, asyncio.Future[None]]] = []
        self._running: dict[str, _Running] = {}
        self._held: dict[str, _Held] = {}
        # Set whenever a handler ends or a result is acknowledged.
        self._changed = asyncio.Event()
        self._links: Links | None = None
        self._stopping: asyncio.Event | None = None
        self._draining = False
        self._fatal: TurndError | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------------ setup

    def function(
        self,
        function_id: str,
        *,
        concurrency: int = 1,
        timeout_ms: int | None = None,
        delivery: Delivery = "at_most_once",
        max_attempts: int | None = None,
    ) -> Callable[[Handler], Handler]:
        """Decorator: serve ``function_id`` with ``handler(ctx, input)``.

        ``async def`` handlers run on the event loop; plain ``def`` handlers on a
        thread pool. The return value completes the turn (dicts, lists, strings,
        numbers, ``None``, dataclasses, pydantic models), :class:`Continue` runs the
        next step, :class:`Suspend` waits for a caller's input (the next step gets
        ``{"state", "input"}``, see :class:`Resumed`), :class:`Fail` fails the step,
        ``asyncio.CancelledError`` answers ``cancelled``, and any other exception
        fails the step with the exception's type name as ``code`` and its text as
        ``message``. When the ``input``
        parameter is annotated with a pydantic model, the input is validated into it
        (a validation error fails the step with code ``invalid_input``).
        """
        if delivery not in ("at_most_once", "at_least_once"):
            raise ValueError(f"delivery must be at_most_once or at_least_once, not {delivery!r}")
        if not 1 <= concurrency <= 10_000:
            raise ValueError("concurrency must be 1 to 10000")
        if timeout_ms is not None and timeout_ms <= 0:
            raise ValueError("timeout_ms must be positive")
        if max_attempts is not None and not 1 <= max_attempts <= 1000:
            raise ValueError("max_attempts must be 1 to 1000")

        def register(handler: Handler) -> Handler:
            self._functions[function_id] = FunctionSpec.of(
                function_id,
                handler,
                concurrency=concurrency,
                timeout_ms=timeout_ms,
                delivery=delivery,
                max_attempts=max_attempts,
            )
            return handler

        return register

    @property
    def url(self) -> str:
        """The first of :attr:`urls` (the only one, for one daemon)."""
        return self.urls[0]

    @url.setter
    def url(self, url: str | Sequence[str]) -> None:
        """Set every URL the worker connects to (before it serves)."""
        self.urls = url_list(url)

    @property
    def state(self) -> WorkerState:
        """The connection state right now."""
        return self._state

    @property
    def functions(self) -> list[str]:
        return sorted(self._functions)

    def _set_state(self, state: WorkerState) -> None:
        if state == self._state:
            return
        self._state = state
        log.debug("worker %s: %s", self.worker_id, state.value)
        if self.on_state is not None:
            try:
                self.on_state(state)
            except Exception:
                log.exception("on_state callback failed")
        waiters, self._state_waiters = self._state_waiters, []
        for wanted, fut in waiters:
            if fut.done():
                continue
            if wanted == state:
                fut.set_result(None)
            else:
                self._state_waiters.append((wanted, fut))

    async def wait_state(self, state: WorkerState, timeout: float | None = None) -> None:
        """Wait until the worker is in ``state`` (e.g. ``WorkerState.CONNECTED``).

        Raises the error that ended :meth:`serve` (:class:`BadEndpoint`,
        :class:`NotAuthenticated`, :class:`WorkerSuperseded`, ...) when the worker
        stopped for good before reaching ``state``.
        """
        if self._state == state:
            return
        if self._state == WorkerState.STOPPED and self._fatal is not None:
            raise self._fatal
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._state_waiters.append((state, fut))
        await asyncio.wait_for(fut, timeout)

    @property
    def pending(self) -> tuple[list[str], list[str]]:
        """Invocation ids of the handlers running and of the results not yet acknowledged."""
        return sorted(self._running), sorted(self._held)

    async def settled(self, timeout: float | None = None) -> None:
        """Wait until no handler runs and the daemon acknowledged every result."""

        async def quiet() -> None:
            while self._running or self._held:
                self._changed.clear()
                await self._changed.wait()

        await asyncio.wait_for(quiet(), timeout)

    # ------------------------------------------------------------------ running

    def run(self) -> None:
        """Serve until SIGTERM or SIGINT, then drain and return (blocking).

        The first signal drains: functions are unregistered so nothing new is
        dispatched, running handlers get ``drain_timeout`` to finish and their
        results are delivered. A second signal stops at once.
        """
        asyncio.run(self._run_with_signals())

    async def _run_with_signals(self) -> None:
        loop = asyncio.get_running_loop()
        installed: list[signal.Signals] = []

        def on_signal() -> None:
            if self._draining:
                log.warning("second signal: stopping now")
                self.stop()
            else:
                log.info("signal received: draining")
                self.drain()

        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, on_signal)
                installed.append(sig)
        try:
            await self.serve()
        finally:
            for sig in installed:
                loop.remove_signal_handler(sig)

    def stop(self) -> None:
        """Stop at once: close the connection, cancel running handlers."""
        if self._stopping is not None:
            self._stopping.set()

    def drain(self) -> None:
        """Stop taking work, let running handlers finish, deliver results, then stop."""
        if self._loop is None or self._draining:
            return
        self._draining = True
        self._set_state(WorkerState.DRAINING)
        self._spawn(self._drain())

    async def _drain(self) -> None:
        for link in list(self._links.live.values()) if self._links is not None else []:
            for function_id in sorted(self._functions):
                with contextlib.suppress(TurndError):
                    await link.conn.call("function.unregister", {"function_id": function_id})
        with contextlib.suppress(asyncio.TimeoutError):
            await self.settled(self.drain_timeout)
        if self._running or self._held:
            log.warning(
                "drain timeout: %d handlers still running, %d results unacknowledged",
                len(self._running),
                len(self._held),
            )
        self.stop()

    async def serve(self) -> None:
        """Connect, register and serve until :meth:`stop` (or a finished drain).

        Raises :class:`WorkerSuperseded` when another connection takes this
        ``worker_id``, :class:`BadEndpoint` when the URL can never work (malformed,
        or answered with plain HTTP such as a 404 for a wrong path), and the daemon's
        error when it refuses the ``hello`` (e.g. :class:`NotAuthenticated`) or a
        registration (e.g. ``BadRequest``) for good. A daemon that cannot be reached,
        or that refuses with a retryable error (``shutting_down``), is tried again
        for good.
        """
        if not self._functions:
            raise ValueError("no function registered; use @worker.function(...)")
        if self._loop is not None:
            raise RuntimeError("this worker is already serving")
        self._loop = asyncio.get_running_loop()
        self._draining = False
        self._fatal = None
        self._stopping = asyncio.Event()
        self._links = Links(self)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=self._max_threads, thread_name_prefix=f"turnd-{self.worker_id}"
        )
        try:
            await self._links.supervise()
        except TurndError as e:
            self._fatal = e
            raise
        finally:
            await self._shutdown()
            if self._fatal is not None:
                self._fail_waiters(self._fatal)
        if self._fatal is not None:
            raise self._fatal

    def _fail_waiters(self, error: TurndError) -> None:
        waiters, self._state_waiters = self._state_waiters, []
        for _, fut in waiters:
            if not fut.done():
                fut.set_exception(error)

    async def __aenter__(self) -> Worker:
        """Serve in a background task for the duration of an ``async with`` block."""
        self._fatal = None  # an error of an earlier serve() is no answer to wait_state()
        self._serve_task = asyncio.get_running_loop().create_task(self.serve())
        return self

    async def __aexit__(self, *exc: object) -> None:
        """Stop, and raise the error that ended :meth:`serve` early, if the block
        itself raised nothing."""
        self.stop()
        try:
            await self._serve_task
        except asyncio.CancelledError:
            pass
        except TurndError:
            if exc[0] is None:
                raise

    def _refresh_state(self, *, trying: bool = False) -> None:
        """The state the connections make: connected when every URL's is up."""
        if self._stopping is None or self._stopping.is_set() or self._links is None:
            return
        if self._links.all_up:
            self._set_state(WorkerState.DRAINING if self._draining else WorkerState.CONNECTED)
        else:
            self._set_state(WorkerState.CONNECTING if trying else WorkerState.DISCONNECTED)

    async def _until_stopped(self, aw: Awaitable[Any]) -> Any:
        """Await ``aw`` unless the worker stops first (then ``None``)."""
        assert self._stopping is not None
        task = asyncio.ensure_future(aw)
        stop = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        return None

    async def _shutdown(self) -> None:
        self._set_state(WorkerState.STOPPED)
        if self._links is not None:
            await self._links.close()
        for running in list(self._running.values()):
            if running.task is not None:
                running.task.cancel()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=2.0)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self._loop = None

    def _spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ------------------------------------------------------------------ pushes

    def _on_push(self, index: int, conn: Connection, frame: dict[str, Any]) -> None:
        """A push on the connection to ``self.urls[index]``."""
        kind = frame.get("push")
        invocation_id = frame.get("invocation_id")
        if not isinstance(invocation_id, str):
            log.debug("ignoring push %r without invocation_id", kind)
            return
        if kind not in ("invoke", "cancel", "probe"):
            log.debug("ignoring push %r on a worker connection", kind)
            return
        # The daemon that pushes about an invocation is the one that waits for it
        # (after a cluster's takeover, the partition's new leader).
        known = self._running.get(invocation_id) or self._held.get(invocation_id)
        if known is not None:
            known.home = index
        if kind == "invoke":
            self._on_invoke(frame, invocation_id, index)
        elif kind == "cancel":
            self._on_cancel(invocation_id, str(frame.get("reason", "")), index)
        else:
            # Answered on the connection it came on, even before registration is done
            # (a probe can follow hello at once).
            self._on_probe(conn, invocation_id)

    def _home(self, invocation_id: str) -> int | None:
        """The URL index of the daemon that last pushed about an invocation."""
        known = self._running.get(invocation_id) or self._held.get(invocation_id)
        return known.home if known is not None else None

    def _link_for(self, invocation_id: str) -> Link | None:
        """The connection an invocation's requests go on now (``_links.py``)."""
        if self._links is None:
            return None
        return self._links.pick(self._home(invocation_id))

    def _on_invoke(self, frame: dict[str, Any], invocation_id: str, index: int) -> None:
        if invocation_id in self._running:
            log.debug("invoke %s already running; ignored", invocation_id)
            return
        held = self._held.get(invocation_id)
        if held is not None:
            log.debug("invoke %s already finished; resending its result", invocation_id)
            held.resend_now.set()
            return
        assert self._loop is not None
        function_id = str(frame.get("function_id", ""))
        ctx = TurnContext(
            session_id=str(frame.get("session_id", "")),
            turn_id=str(frame.get("turn_id", "")),
            function_id=function_id,
            step=int(frame.get("step", 0)),
            attempt=int(frame.get("attempt", 0)),
            invocation_id=invocation_id,
            deadline_ms=int(frame.get("deadline_ms", 0)),
            cancelled=asyncio.Event(),
            log=InvocationLog(
                logging.getLogger(f"turnd.handler.{function_id}"),
                {"invocation_id": invocation_id},
            ),
            _worker=self,
            _loop=self._loop,
            previous=Previous.from_wire(frame.get("previous")),
        )
        running = _Running(ctx, index)
        self._running[invocation_id] = running
        self.stats.invocations_started += 1
        running.task = self._loop.create_task(self._invoke(ctx, frame.get("input")))

    async def _invoke(self, ctx: TurnContext, input: JSON) -> None:
        spec = self._functions.get(ctx.function_id)
        heartbeats = None
        if spec is not None and self.auto_heartbeat:
            heartbeats = self._spawn(self._live.heartbeat_loop(ctx, spec))
        try:
            outcome = await run_handler(spec, ctx, input, self._pool, self._stopping)
        finally:
            if heartbeats is not None:
                heartbeats.cancel()
            running = self._running.get(ctx.invocation_id)
            if running is not None and running.hard_cancel is not None:
                running.hard_cancel.cancel()
        self._hold(ctx.invocation_id, outcome)

    def _on_cancel(self, invocation_id: str, reason: str, index: int) -> None:
        self.stats.cancels_received += 1
        running = self._running.get(invocation_id)
        if running is not None:
            log.info("cancel %s (%s): telling the handler", invocation_id, reason)
            self._cancel_running(running)
            return
        held = self._held.get(invocation_id)
        if held is not None:
            log.info("cancel %s: already finished; resending the result", invocation_id)
            held.resend_now.set()
            return
        log.info("cancel %s for an invocation this worker is not running", invocation_id)
        self._hold(invocation_id, {"cancelled": {"message": "not running"}}, index)

    def _cancel_running(self, running: _Running) -> None:
        running.ctx.cancelled.set()
        if self.cancel_grace is None or running.hard_cancel is not None:
            return
        task = running.task
        if task is None or task.done():
            return
        assert self._loop is not None
        running.hard_cancel = self._loop.call_later(self.cancel_grace, task.cancel)

    def _on_probe(self, conn: Connection, invocation_id: str) -> None:
        held = self._held.get(invocation_id)
        if invocation_id in self._running:
            state = "running"
        elif held is not None:
            state = "finished"
        else:
            state = "unknown"
        self.stats.probes_answered += 1
        log.debug("probe %s: %s", invocation_id, state)
        self._spawn(self._answer_probe(conn, invocation_id, state, held))

    async def _answer_probe(
        self, conn: Connection, invocation_id: str, state: str, held: _Held | None
    ) -> None:
        try:
            await conn.call("invocation.status", {"invocation_id": invocation_id, "state": state})
        except TurndError as e:
            log.warning("answering probe %s failed: %s", invocation_id, e)
        # Status first, then the result the status promised.
        if held is not None:
            held.resend_now.set()

    # ------------------------------------------------------------------ results

    def _hold(self, invocation_id: str, outcome: dict[str, Any], home: int = 0) -> None:
        """Keep a result until the daemon acknowledges it, and start delivering it."""
        running = self._running.pop(invocation_id, None)
        self._changed.set()
        if self._stopping is None or self._stopping.is_set():
            return
        held = _Held(outcome, running.home if running is not None else home)
        self._held[invocation_id] = held
        self._spawn(self._pump(invocation_id, held))

    def _release(self, invocation_id: str, held: _Held) -> None:
        if self._held.get(invocation_id) is held:
            del self._held[invocation_id]
            self._changed.set()

    async def _pump(self, invocation_id: str, held: _Held) -> None:
        """Deliver one result until the daemon acknowledges it (or refuses it for good)."""
        args = {"invocation_id": invocation_id, "outcome": held.outcome}
        assert self._links is not None
        # Generations of connections gone, or whose daemon never stored the invocation.
        dead: set[int] = set()
        first = True
        while True:
            link = await self._links.wait(lambda: held.home, dead)
            if first:
                self.stats.results_sent += 1
                first = False
            else:
                self.stats.results_resent += 1
            held.resend_now.clear()
            call = asyncio.ensure_future(link.conn.call("invocation.result", args))
            resend = asyncio.ensure_future(held.resend_now.wait())
            try:
                done, _ = await asyncio.wait(
                    {call, resend},
                    timeout=self.result_ack_timeout,
                    return_when=asyncio.FIRST_COMPLETED,
                )
            finally:
                resend.cancel()
                if not call.done():
                    call.cancel()
            if call not in done:
                with contextlib.suppress(asyncio.CancelledError, TurndError):
                    await call
                log.debug("result %s: resending (no answer yet)", invocation_id)
                continue
            try:
                ok = call.result()
            except ConnectionLost:
                dead.add(link.generation)
                continue
            except TooLarge as e:
                if "fail" in held.outcome and held.outcome["fail"].get("code") == "too_large":
                    log.error("result %s refused (%s); dropping it", invocation_id, e)
                    self.stats.results_dropped += 1
                    self._release(invocation_id, held)
                    return
                # Refused before it was sent (over the hello's max_frame_bytes) or by
                # the daemon: the same frame would be refused on every resend, so the
                # step is reported as failed instead.
                log.error("result %s is too large: %s", invocation_id, e.message)
                message = f"the result is too large: {e.message}"
                held.outcome = {"fail": {"code": "too_large", "message": message}}
                args["outcome"] = held.outcome
                continue
            except ProtocolError as e:
                if e.retryable:
                    log.warning("result %s not taken yet (%s); resending later", invocation_id, e)
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(held.resend_now.wait(), self.result_ack_timeout)
                    continue
                log.error("result %s refused (%s); dropping it", invocation_id, e)
                self.stats.results_dropped += 1
                self._release(invocation_id, held)
                return
            accepted = ok.get("accepted") if isinstance(ok, dict) else None
            if accepted == "unknown" and link.index != held.home:
                # Not a node of one cluster with the daemon that dispatched it (that
                # one would have forwarded it): wait for that daemon's connection.
                log.debug("result %s unknown to %s; waiting", invocation_id, link.index)
                dead.add(link.generation)
                continue
            self.stats.results_acked += 1
            log.debug("result %s acknowledged: %s", invocation_id, accepted)
            self._release(invocation_id, held)
            return


__all__ = ["Continue", "Fail", "Suspend", "TurnContext", "Worker", "WorkerState", "WorkerStats"]
