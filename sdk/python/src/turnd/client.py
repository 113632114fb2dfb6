"""The caller side: submit turns (with what to do when the session is busy), resume
turns that wait for input, read them, stop them, and watch their events and progress
(one turn's until it ends, with :meth:`Client.stream`)."""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import random
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from typing import Any, Generic, Literal, TypeVar, overload

from ._connection import CLOSE_GOING_AWAY, PROTOCOL_VERSION, Connection, url_list
from .errors import ConnectionLost, NotFound, ShuttingDown, TurndError
from .types import (
    JSON,
    TERMINAL_STATUSES,
    Event,
    EventPage,
    FunctionInfo,
    Progress,
    ProgressDropped,
    Session,
    SessionPage,
    SessionRow,
    Submitted,
    Turn,
    TurnPage,
    WatchItem,
    WorkerInfo,
)

log = logging.getLogger("turnd.client")

Role = Literal["client", "operator"]
SessionOrder = Literal["wait", "id"]
OnBusy = Literal["enqueue", "reject", "interrupt", "rollback"]
T = TypeVar("T", Event, WatchItem)

# turn.wait takes at most this per request.
_WAIT_MAX_MS = 300_000
# Extra time for the daemon's own answer of a turn.wait before giving up on it.
_WAIT_ANSWER_GRACE_S = 5.0


class _Lost:
    """Put into a watch's queue when its connection ended."""


_LOST = _Lost()


def _watch_item(frame: dict[str, Any]) -> WatchItem | None:
    """The item of an ``event``, ``progress`` or ``progress_dropped`` push."""
    kind = frame.get("push")
    if kind == "event":
        raw = frame.get("event")
        return Event.from_wire(raw) if isinstance(raw, dict) else None
    if kind == "progress":
        return Progress.from_wire(frame)
    if kind == "progress_dropped":
        return ProgressDropped.from_wire(frame)
    return None


class _Link:
    """One connection of a client and the watch routes that live on it."""

    def __init__(self) -> None:
        self.conn: Connection | None = None
        self.routes: dict[str, asyncio.Queue[WatchItem | _Lost]] = {}
        self.unclaimed: dict[str, list[WatchItem]] = {}

    def on_push(self, conn: Connection, frame: dict[str, Any]) -> None:
        watch_id = frame.get("watch_id")
        item = _watch_item(frame)
        if not isinstance(watch_id, str) or item is None:
            return
        queue = self.routes.get(watch_id)
        if queue is not None:
            queue.put_nowait(item)
        else:
            # The push can be read before the code that asked for the watch has
            # seen its answer: hold it until the watch is claimed.
            self.unclaimed.setdefault(watch_id, []).append(item)

    def claim(self, watch_id: str) -> asyncio.Queue[WatchItem | _Lost]:
        queue: asyncio.Queue[WatchItem | _Lost] = asyncio.Queue()
        for event in self.unclaimed.pop(watch_id, []):
            queue.put_nowait(event)
        if self.conn is None or self.conn.closed.is_set():
            queue.put_nowait(_LOST)
        else:
            self.routes[watch_id] = queue
        return queue

    def lost(self) -> None:
        for queue in self.routes.values():
            queue.put_nowait(_LOST)
        self.routes.clear()
        self.unclaimed.clear()


class Client:
    """A caller connection: ``async with Client(url) as c: ...``.

    Reads (``get``, ``wait``, ``list``, ``inspect``, ``events``, ``stats``, ...),
    stops, ``watch`` and submits with an ``idempotency_key`` are repeated on a new
    connection when the connection is lost, for up to ``reconnect_timeout`` seconds.
    A submit (or resume) without a key is not repeated (it could run twice): it
    raises :class:`ConnectionLost` and the caller decides. Except after a close with
    code 1001 (the daemon shuts down, or a cluster node drains): the daemon answered
    every request it read before it, so one with no answer was never read, and every
    such request is repeated, whatever its op.

    ``url`` may be a list (a cluster's nodes): the client connects to the first
    that answers, and moves on to the next when a connection cannot be opened,
    when reconnecting too.
    """

    urls: list[str]
    """Every URL the client may connect to, in the order it tries them."""

    def __init__(
        self,
        url: str | Sequence[str],
        *,
        token: str | None = None,
        role: Role = "client",
        name: str | None = None,
        reconnect_timeout: float = 30.0,
        open_timeout: float = 10.0,
    ) -> None:
        self.url = url
        self.token = token
        self.role = role
        self.name = name
        self.reconnect_timeout = reconnect_timeout
        self.open_timeout = open_timeout
        self._link: _Link | None = None
        self._connecting = asyncio.Lock()
        self._closed = False
        self.connections = 0
        """How many connections this client opened so far."""

    async def __aenter__(self) -> Client:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def connect(self) -> None:
        """Open the connection now (otherwise the first request opens it)."""
        await self._ensure(deadline=time.monotonic() + self.reconnect_timeout)

    async def close(self) -> None:
        self._closed = True
        link, self._link = self._link, None
        if link is not None and link.conn is not None:
            await link.conn.close()
            link.lost()

    @property
    def url(self) -> str:
        """The URL of the current connection (or of the next one tried)."""
        return self.urls[self._at]

    @url.setter
    def url(self, url: str | Sequence[str]) -> None:
        """Set every URL the client may connect to, in the order it tries them."""
        self.urls = url_list(url)
        self._at = 0

    @property
    def hello(self) -> dict[str, Any]:
        """The daemon's ``hello`` answer on the current connection."""
        if self._link is None or self._link.conn is None:
            return {}
        return self._link.conn.hello

    # ------------------------------------------------------------------ connection

    async def _open(self) -> _Link:
        hello: dict[str, Any] = {"protocol": PROTOCOL_VERSION, "role": self.role}
        if self.token is not None:
            hello["token"] = self.token
        if self.name is not None:
            hello["name"] = self.name
        link = _Link()
        link.conn = await self._open_any(hello, link)
        conn = link.conn

        async def watch_close() -> None:
            await conn.closed.wait()
            link.lost()

        self._watcher = asyncio.get_running_loop().create_task(watch_close())
        self.connections += 1
        return link

    async def _open_any(self, hello: dict[str, Any], link: _Link) -> Connection:
        """Open a connection to the current URL, else to the next ones in turn (each
        once); the last retryable failure when none answers."""
        start = self._at
        failure: TurndError | None = None
        for step in range(len(self.urls)):
            self._at = (start + step) % len(self.urls)
            try:
                return await Connection.open(self.url, hello, link.on_push, self.open_timeout)
            except TurndError as e:
                if not e.retryable:
                    raise
                log.debug("cannot connect to %s (%s); trying the next URL", self.url, e)
                failure = e
        self._at = (start + 1) % len(self.urls)  # the next round starts there
        assert failure is not None
        raise failure

    async def _ensure(self, deadline: float) -> _Link:
        """The current link, opening a new connection (with backoff) when needed."""
        if self._closed:
            raise ConnectionLost("client closed")
        async with self._connecting:
            delay = 0.05
            while True:
                link = self._link
                if link is not None and link.conn is not None and not link.conn.closed.is_set():
                    return link
                try:
                    self._link = await self._open()
                    return self._link
                except TurndError as e:
                    # A wrong URL or a refused hello fail the same way every time.
                    if not e.retryable:
                        raise
                    if time.monotonic() + delay > deadline:
                        if isinstance(e, ConnectionLost):
                            raise
                        raise ConnectionLost(str(e)) from e  # names the URL already
                    log.debug("connect failed (%s); retrying in %.2fs", e, delay)
                    await asyncio.sleep(delay / 2 + random.uniform(0, delay / 2))
                    delay = min(delay * 2, 2.0)

    async def _call(self, op: str, args: dict[str, Any], *, repeatable: bool = True) -> Any:
        deadline = time.monotonic() + self.reconnect_timeout
        while True:
            link = await self._ensure(deadline)
            assert link.conn is not None
            try:
                return await link.conn.call(op, args)
            except (ConnectionLost, ShuttingDown) as e:
                # After a 1001 close the daemon had answered every request it read:
                # one with no answer was never read and changed nothing, whatever its op.
                unread = isinstance(e, ConnectionLost) and e.close_code == CLOSE_GOING_AWAY
                if not (repeatable or unread) or time.monotonic() >= deadline or self._closed:
                    raise
                log.debug("%s: connection lost; repeating on a new connection", op)
                if link is self._link:
                    # shutting_down: the daemon closes the connection once it drained.
                    left = max(0.0, deadline - time.monotonic())
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(link.conn.closed.wait(), left)
                    if not link.conn.closed.is_set():
                        raise

    # ------------------------------------------------------------------ turns

    async def submit(
        self,
        session_id: str,
        function_id: str,
        input: JSON = None,
        *,
        idempotency_key: str | None = None,
        turn_timeout_ms: int | None = None,
        on_busy: OnBusy | None = None,
    ) -> Submitted:
        """Admit a turn to a session (``turn.submit``).

        ``on_busy`` says what to do when the session has an unfinished turn:
        ``"enqueue"`` (the daemon's default) queues behind it, ``"reject"`` raises
        :class:`Busy` and stores nothing, ``"interrupt"`` stops the unfinished turns
        (reason ``interrupted``) and gives this turn's step 0 the stopped one as
        ``ctx.previous``, ``"rollback"`` does the same and marks them ``superseded``.
        """
        args: dict[str, Any] = {
            "session_id": session_id,
            "function_id": function_id,
            "input": input,
        }
        if idempotency_key is not None:
            args["idempotency_key"] = idempotency_key
        if turn_timeout_ms is not None:
            args["turn_timeout_ms"] = turn_timeout_ms
        if on_busy is not None:
            args["on_busy"] = on_busy
        ok = await self._call("turn.submit", args, repeatable=idempotency_key is not None)
        return Submitted(Turn.from_wire(ok["turn"]), bool(ok.get("deduplicated", False)))

    async def resume(
        self, turn_id: str, input: JSON = None, *, idempotency_key: str | None = None
    ) -> Submitted:
        """Answer a turn awaiting input (``turn.resume``): its next step runs with
        ``{"state": <the suspend's state>, "input": input}``. Returns once the resume is
        durable. A turn that is not awaiting input raises :class:`Conflict` and
        nothing changes; of two resumes exactly one wins. The same
        ``idempotency_key`` with the same ``input`` returns the winner's turn with
        ``deduplicated=True`` (and makes the call safe to repeat after a lost
        connection, which the client then does on its own)."""
        args: dict[str, Any] = {"turn_id": turn_id, "input": input}
        if idempotency_key is not None:
            args["idempotency_key"] = idempotency_key
        ok = await self._call("turn.resume", args, repeatable=idempotency_key is not None)
        return Submitted(Turn.from_wire(ok["turn"]), bool(ok.get("deduplicated", False)))

    async def run(
        self,
        session_id: str,
        function_id: str,
        input: JSON = None,
        *,
        idempotency_key: str | None = None,
        turn_timeout_ms: int | None = None,
        on_busy: OnBusy | None = None,
        timeout: float | None = None,
    ) -> Turn:
        """Submit a turn and wait until it is terminal (or ``timeout`` seconds pass)."""
        submitted = await self.submit(
            session_id,
            function_id,
            input,
            idempotency_key=idempotency_key,
            turn_timeout_ms=turn_timeout_ms,
            on_busy=on_busy,
        )
        return await self.wait(submitted.turn_id, timeout)

    async def get(self, turn_id: str) -> Turn:
        """The turn as it is now (``turn.get``)."""
        ok = await self._call("turn.get", {"turn_id": turn_id})
        return Turn.from_wire(ok["turn"])

    async def wait(self, turn_id: str, timeout: float | None = None) -> Turn:
        """Wait until the turn is terminal, or ``timeout`` seconds pass (then the turn
        as it is; check ``turn.done``). ``None`` waits for good."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left_ms = _WAIT_MAX_MS
            if deadline is not None:
                left_ms = max(0, min(_WAIT_MAX_MS, int((deadline - time.monotonic()) * 1000)))
            ok = await asyncio.wait_for(
                self._call("turn.wait", {"turn_id": turn_id, "timeout_ms": left_ms}),
                left_ms / 1000 + _WAIT_ANSWER_GRACE_S + self.reconnect_timeout,
            )
            turn = Turn.from_wire(ok["turn"])
            if turn.done or (deadline is not None and time.monotonic() >= deadline):
                return turn

    async def stop(self, turn_id: str, reason: str | None = None) -> Turn:
        """Stop a turn (``turn.stop``); returns the turn after the stop is durable."""
        args: dict[str, Any] = {"turn_id": turn_id}
        if reason is not None:
            args["reason"] = reason
        ok = await self._call("turn.stop", args)
        return Turn.from_wire(ok["turn"])

    async def stop_session(self, session_id: str, reason: str | None = None) -> builtins.list[Turn]:
        """Stop every unfinished turn of a session (``session.stop``)."""
        args: dict[str, Any] = {"session_id": session_id}
        if reason is not None:
            args["reason"] = reason
        ok = await self._call("session.stop", args)
        return [Turn.from_wire(t) for t in ok["turns"]]

    async def list(
        self,
        session_id: str,
        *,
        status: str | None = None,
        limit: int | None = None,
        before_seq: int | None = None,
    ) -> TurnPage:
        """One page of a session's turns, newest first (``turn.list``)."""
        args: dict[str, Any] = {"session_id": session_id}
        if status is not None:
            args["status"] = status
        if limit is not None:
            args["limit"] = limit
        if before_seq is not None:
            args["before_seq"] = before_seq
        ok = await self._call("turn.list", args)
        return TurnPage(
            [Turn.from_wire(t) for t in ok["turns"]],
            None if ok.get("next_before_seq") is None else int(ok["next_before_seq"]),
        )

    async def inspect(self, session_id: str) -> Session:
        """A session's lock, queue and counts (``session.inspect``)."""
        ok = await self._call("session.inspect", {"session_id": session_id})
        return Session.from_wire(ok["session"])

    async def events(
        self, session_id: str, *, after: int = 0, limit: int | None = None
    ) -> EventPage:
        """One page of a session's events with ``seq > after`` (``session.events``)."""
        args: dict[str, Any] = {"session_id": session_id, "after": after}
        if limit is not None:
            args["limit"] = limit
        ok = await self._call("session.events", args)
        return EventPage([Event.from_wire(e) for e in ok["events"]], int(ok["next"]))

    async def all_events(self, session_id: str, *, after: int = 0) -> builtins.list[Event]:
        """Every event of a session after ``after``, reading page by page."""
        out: builtins.list[Event] = []
        while True:
            page = await self.events(session_id, after=after, limit=1000)
            out.extend(page.events)
            if not page.events:
                return out
            after = page.next

    @overload
    def watch(
        self,
        session_id: str | None = None,
        *,
        turn_id: str | None = None,
        after: int | None = None,
        progress: Literal[False] = False,
    ) -> Watch[Event]: ...

    @overload
    def watch(
        self,
        session_id: str | None = None,
        *,
        turn_id: str | None = None,
        after: int | None = None,
        progress: Literal[True],
    ) -> Watch[WatchItem]: ...

    def watch(
        self,
        session_id: str | None = None,
        *,
        turn_id: str | None = None,
        after: int | None = None,
        progress: bool = False,
    ) -> Watch[Event] | Watch[WatchItem]:
        """Events of a session (or of one turn) as an async iterator.

        ``after``: replay events with ``seq > after`` first. ``None`` starts at the
        present for a session and at the turn's first event for a turn. After a lost
        connection the watch is opened again from the last event it yielded, so the
        stream has no gap and no repeat. Use ``async with`` (or ``aclose()``) to end it.
        With ``progress=True`` it also yields :class:`Progress` frames and
        :class:`ProgressDropped` markers (progress is not stored: what was sent while
        the watch replayed or reconnected comes as a marker, never as a silent gap).
        """
        if (session_id is None) == (turn_id is None):
            raise ValueError("give exactly one of session_id and turn_id")
        return Watch(self, session_id, turn_id, after, progress=progress)

    def stream(self, turn_id: str, *, after: int = 0) -> Watch[WatchItem]:
        """One turn's events and progress, from its first event (``after=0``), as an
        async iterator that ends after the event that makes the turn terminal
        (``completed``, ``failed``, ``cancelled``), at once for a turn already done.
        It resumes after a lost connection like :meth:`watch`."""
        return Watch(self, None, turn_id, after, progress=True, until_done=True)

    # ------------------------------------------------------------------ daemon

    async def stats(self) -> dict[str, Any]:
        ok = await self._call("stats", {})
        stats: dict[str, Any] = ok["stats"]
        return stats

    async def workers(self) -> builtins.list[WorkerInfo]:
        ok = await self._call("workers.list", {})
        return [WorkerInfo.from_wire(w) for w in ok["workers"]]

    async def functions(self) -> builtins.list[FunctionInfo]:
        ok = await self._call("functions.list", {})
        return [FunctionInfo.from_wire(f) for f in ok["functions"]]

    async def sessions(
        self,
        *,
        state: str | None = None,
        function_id: str | None = None,
        stuck: bool | None = None,
        order: SessionOrder | None = None,
        limit: int | None = None,
        after: str | None = None,
    ) -> SessionPage:
        """One page of the sessions with an unfinished turn (``sessions.list``).

        Filters: ``state`` (the lock holder's wait state, e.g. ``"awaiting_worker"``),
        ``function_id`` (the holder's function), ``stuck=True`` (sessions that look
        stuck). ``order`` is ``"wait"`` (oldest wait first, the daemon's default) or
        ``"id"``; ``after`` is the ``next`` of the previous page, with the same order.
        """
        args: dict[str, Any] = {}
        for key, value in (
            ("state", state),
            ("function_id", function_id),
            ("stuck", stuck),
            ("order", order),
            ("limit", limit),
            ("after", after),
        ):
            if value is not None:
                args[key] = value
        ok = await self._call("sessions.list", args)
        return SessionPage.from_wire(ok)

    async def iter_sessions(
        self,
        *,
        state: str | None = None,
        function_id: str | None = None,
        stuck: bool | None = None,
        order: SessionOrder | None = None,
        page_size: int = 1000,
    ) -> AsyncIterator[SessionRow]:
        """Every session :meth:`sessions` lists, page after page:
        ``async for row in client.iter_sessions(stuck=True): ...``.

        Each page is taken live, so a session whose wait changes between two pages
        can be seen twice or not at all in ``order="wait"``; ``order="id"`` yields
        each session that matches throughout once.
        """
        after: str | None = None
        while True:
            page = await self.sessions(
                state=state,
                function_id=function_id,
                stuck=stuck,
                order=order,
                limit=page_size,
                after=after,
            )
            for row in page.sessions:
                yield row
            if page.next is None:
                return
            after = page.next

    async def ping(self) -> None:
        await self._call("ping", {})

    async def store_check(self) -> builtins.list[dict[str, Any]]:
        """Invariant violations of the whole store (operator role only)."""
        ok = await self._call("store.check", {})
        violations: builtins.list[dict[str, Any]] = ok["violations"]
        return violations


class Watch(Generic[T]):
    """An async iterator of :class:`Event` (and, when it asked for progress, of
    :class:`Progress` and :class:`ProgressDropped`), resumed across reconnects."""

    def __init__(
        self,
        client: Client,
        session_id: str | None,
        turn_id: str | None,
        after: int | None,
        *,
        progress: bool = False,
        until_done: bool = False,
    ) -> None:
        self._client = client
        self._session_id = session_id
        self._turn_id = turn_id
        self._last: int | None = after
        self._progress = progress
        self._until_done = until_done
        self._queue: asyncio.Queue[WatchItem | _Lost] | None = None
        self._watch: tuple[_Link, str] | None = None
        self._closed = False
        self._ending = False
        # Per invocation, the progress seq this watch expects next; and items to
        # yield before the next one read (a marker put before a frame).
        self._expected: dict[str, int] = {}
        self._ready: deque[WatchItem] = deque()
        self.starts = 0
        """How many times the watch was opened (1 + resumes after a lost connection)."""

    @property
    def last_seq(self) -> int | None:
        """The ``seq`` of the last event yielded (or the starting point)."""
        return self._last

    async def __aenter__(self) -> Watch[T]:
        await self._start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __aiter__(self) -> AsyncIterator[T]:
        return self

    async def __anext__(self) -> T:
        while True:
            if self._ending:
                await self.aclose()
            if self._closed:
                raise StopAsyncIteration
            if self._ready:
                return self._yield(self._ready.popleft())
            if self._queue is None:
                await self._start()
            assert self._queue is not None
            item = await self._queue.get()
            if isinstance(item, _Lost):
                self._queue = None
                self._watch = None
                continue
            if isinstance(item, Event):
                if self._last is not None and item.seq <= self._last:
                    continue  # already yielded before a resume
                self._last = item.seq
            elif isinstance(item, ProgressDropped):
                if item.invocation_id in self._expected:
                    self._expected[item.invocation_id] += item.count
            else:
                expected = self._expected.get(item.invocation_id)
                self._expected[item.invocation_id] = item.seq + 1
                if expected is not None and item.seq > expected:
                    # Frames sent while this watch was away (a lost connection) were
                    # counted by no one: say so, as the daemon would.
                    self._ready.append(item)
                    item = ProgressDropped(item.turn_id, item.invocation_id, item.seq - expected)
            return self._yield(item)

    def _yield(self, item: WatchItem) -> T:
        if self._until_done and isinstance(item, Event) and item.kind in TERMINAL_STATUSES:
            self._ending = True  # the next call ends the iteration (and unwatches)
        return item  # type: ignore[return-value]  # T is Event unless progress was asked

    async def _start(self) -> None:
        client = self._client
        if self._last is None:
            if self._turn_id is not None:
                self._last = 0
            else:
                assert self._session_id is not None
                try:
                    self._last = (await client.inspect(self._session_id)).last_event
                except NotFound:
                    self._last = 0
        args: dict[str, Any] = {"after": self._last}
        if self._turn_id is not None:
            args["turn_id"] = self._turn_id
        else:
            args["session_id"] = self._session_id
        if self._progress:
            args["progress"] = True
        deadline = time.monotonic() + client.reconnect_timeout
        while True:
            link = await client._ensure(deadline)
            assert link.conn is not None
            try:
                ok = await link.conn.call("watch", args)
            except ConnectionLost:
                if time.monotonic() >= deadline:
                    raise
                with contextlib.suppress(Exception):
                    await link.conn.closed.wait()
                continue
            watch_id = str(ok["watch_id"])
            self._queue = link.claim(watch_id)
            self._watch = (link, watch_id)
            self.starts += 1
            return

    async def aclose(self) -> None:
        """End the watch (``unwatch`` when the connection is still up)."""
        if self._closed:
            return
        self._closed = True
        current = self._watch
        self._watch = None
        if current is not None:
            link, watch_id = current
            link.routes.pop(watch_id, None)
            if link.conn is not None and not link.conn.closed.is_set():
                with contextlib.suppress(TurndError):
                    await link.conn.call("unwatch", {"watch_id": watch_id})
        if self._queue is not None:
            self._queue.put_nowait(_LOST)
