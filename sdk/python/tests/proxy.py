"""A WebSocket proxy for tests: relays protocol frames and drops or cuts on request.

It sits between an SDK connection and the daemon, relays each text frame as it is
(of any size, so the daemon sees what the SDK sent), and can drop chosen frames (a
result lost on its way to the daemon, an ``invoke`` lost on its way to the worker),
rewrite them (a ``hello`` answer announcing other limits), cut every connection
(cleanly or not), and refuse new connections for a while.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from websockets.asyncio.client import ClientConnection, connect
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed

Direction = Literal["up", "down"]
"""``up``: SDK to daemon; ``down``: daemon to SDK."""


@dataclass
class _Rule:
    direction: Direction
    match: Callable[[dict[str, Any]], bool]
    times: int
    delay: float | None = None  # None: drop; else: pass it on this much later
    edit: Callable[[dict[str, Any]], dict[str, Any]] | None = None  # pass this on instead


@dataclass(eq=False)
class _Pair:
    down: ServerConnection
    up: ClientConnection
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


class FrameProxy:
    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.url = ""
        self.refusing = False
        self.dropped: list[tuple[Direction, dict[str, Any]]] = []
        self.seen: list[tuple[Direction, dict[str, Any]]] = []
        self.connections = 0
        self._rules: list[_Rule] = []
        self._pairs: set[_Pair] = set()
        self._server: Server | None = None
        self._later: set[asyncio.Future[None]] = set()

    async def __aenter__(self) -> FrameProxy:
        # No size limit of its own: frames over the daemon's limit reach the daemon.
        self._server = await serve(self._handle, "127.0.0.1", 0, ping_interval=None, max_size=None)
        port = next(iter(self._server.sockets)).getsockname()[1]
        self.url = f"ws://127.0.0.1:{port}/v1"
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.cut(clean=False)
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def drop(
        self, direction: Direction, match: Callable[[dict[str, Any]], bool], times: int = 1
    ) -> None:
        """Drop the next ``times`` frames going ``direction`` that ``match``."""
        self._rules.append(_Rule(direction, match, times))

    def delay(
        self,
        direction: Direction,
        match: Callable[[dict[str, Any]], bool],
        seconds: float,
        times: int = 1,
    ) -> None:
        """Hold the next ``times`` matching frames back for ``seconds``; later frames
        overtake them."""
        self._rules.append(_Rule(direction, match, times, seconds))

    def rewrite(
        self,
        direction: Direction,
        match: Callable[[dict[str, Any]], bool],
        edit: Callable[[dict[str, Any]], dict[str, Any]],
        times: int = 1,
    ) -> None:
        """Pass ``edit(frame)`` on instead of the next ``times`` matching frames."""
        self._rules.append(_Rule(direction, match, times, edit=edit))

    async def cut(self, *, clean: bool = True, code: int = 1001) -> None:
        """End every relayed connection: a close handshake with ``code``, or the TCP
        stream aborted."""
        for pair in list(self._pairs):
            if clean:
                with contextlib.suppress(Exception):
                    await pair.down.close(code, "proxy going away")
            else:
                pair.down.transport.abort()
            with contextlib.suppress(Exception):
                await pair.up.close()
            for task in pair.tasks:
                task.cancel()
        self._pairs.clear()

    def _rule_for(self, direction: Direction, frame: dict[str, Any]) -> _Rule | None:
        for rule in self._rules:
            if rule.direction == direction and rule.times > 0 and rule.match(frame):
                rule.times -= 1
                if rule.delay is None and rule.edit is None:
                    self.dropped.append((direction, frame))
                return rule
        return None

    async def _handle(self, down: ServerConnection) -> None:
        if self.refusing:
            down.transport.abort()
            return
        try:
            up = await connect(self.upstream, max_size=None, ping_interval=None)
        except OSError:
            await down.close(1011, "upstream unreachable")
            return
        self.connections += 1
        pair = _Pair(down, up)
        self._pairs.add(pair)
        pair.tasks = [
            asyncio.ensure_future(self._relay(down, up, "up")),
            asyncio.ensure_future(self._relay(up, down, "down")),
        ]
        await asyncio.wait(pair.tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in pair.tasks:
            task.cancel()
        with contextlib.suppress(Exception):
            await up.close()
        with contextlib.suppress(Exception):
            await down.close()
        self._pairs.discard(pair)

    async def _relay(
        self,
        source: ServerConnection | ClientConnection,
        target: ServerConnection | ClientConnection,
        direction: Direction,
    ) -> None:
        with contextlib.suppress(ConnectionClosed):
            async for message in source:
                try:
                    frame = json.loads(message)
                except ValueError:
                    frame = None
                if isinstance(frame, dict):
                    self.seen.append((direction, frame))
                    rule = self._rule_for(direction, frame)
                    if rule is not None and rule.edit is not None:
                        message = json.dumps(rule.edit(frame))
                    elif rule is not None and rule.delay is None:
                        continue
                    if rule is not None and rule.delay is not None:
                        later = asyncio.ensure_future(_send_later(target, message, rule.delay))
                        self._later.add(later)
                        later.add_done_callback(self._later.discard)
                        continue
                await target.send(message)
        # Pass a close code on (e.g. 4001, 1009) as the daemon sent it.
        code = source.close_code or 1000
        with contextlib.suppress(Exception):
            await target.close(code if code in (1000, 1001, 1009, 4001) else 1000)


async def _send_later(
    target: ServerConnection | ClientConnection, message: Any, delay: float
) -> None:
    await asyncio.sleep(delay)
    with contextlib.suppress(ConnectionClosed):
        await target.send(message)


def is_op(op: str) -> Callable[[dict[str, Any]], bool]:
    return lambda frame: frame.get("op") == op


def is_push(kind: str) -> Callable[[dict[str, Any]], bool]:
    return lambda frame: frame.get("push") == kind
