"""One WebSocket connection speaking protocol v1: requests, answers and pushes."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
from collections.abc import Callable
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI

from .errors import ConnectionLost, TurndError, error_from_wire

log = logging.getLogger("turnd")

PROTOCOL_VERSION = 1
CLOSE_SUPERSEDED = 4001
# Answers (turn.list, session.events) can be far larger than any request the daemon
# takes; bound them all the same.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

PushHandler = Callable[["Connection", dict[str, Any]], None]


class Connection:
    """A connected, authenticated protocol connection.

    A single reader task takes every frame: answers complete the future of their
    request id, pushes go to ``on_push(connection, frame)`` in arrival order. When
    the socket closes, for whatever reason, every pending request fails with
    :class:`ConnectionLost`, ``closed`` is set, and ``on_push`` is not called again.
    """

    def __init__(self, ws: ClientConnection, on_push: PushHandler | None) -> None:
        self._ws = ws
        self._on_push = on_push
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self.closed = asyncio.Event()
        self.close_code: int | None = None
        self.hello: dict[str, Any] = {}
        self._reader = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def open(
        cls,
        url: str,
        hello: dict[str, Any],
        on_push: PushHandler | None = None,
        open_timeout: float = 10.0,
    ) -> Connection:
        """Connect, say ``hello`` and return the connection (``hello`` answer in ``.hello``)."""
        try:
            ws = await connect(
                url,
                open_timeout=open_timeout,
                max_size=MAX_MESSAGE_BYTES,
                ping_interval=20,
                ping_timeout=20,
                close_timeout=2,
            )
        except (OSError, InvalidHandshake, InvalidURI, asyncio.TimeoutError) as e:
            raise ConnectionLost(f"cannot connect to {url}: {e}") from e
        conn = cls(ws, on_push)
        try:
            conn.hello = await asyncio.wait_for(conn.call("hello", hello), open_timeout)
        except BaseException:
            await conn.close()
            raise
        return conn

    async def call(self, op: str, args: dict[str, Any] | None = None) -> Any:
        """Send one request and return its ``ok`` member, or raise its error."""
        if self.closed.is_set():
            raise ConnectionLost("connection closed", self.close_code)
        rid = next(self._ids)
        # Raises TypeError / ValueError for values JSON cannot carry (NaN included).
        frame = json.dumps(
            {"id": rid, "op": op, "args": args or {}}, separators=(",", ":"), allow_nan=False
        )
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        try:
            try:
                await self._ws.send(frame)
            except ConnectionClosed as e:
                raise ConnectionLost(f"connection closed: {e}", self.close_code) from e
            return await fut
        finally:
            self._pending.pop(rid, None)

    async def close(self) -> None:
        """Close the socket and wait for the reader to finish."""
        with contextlib.suppress(Exception):
            await self._ws.close()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._reader

    async def _read(self) -> None:
        try:
            async for message in self._ws:
                if not isinstance(message, str):
                    log.warning("ignoring a binary frame from the daemon")
                    continue
                try:
                    frame = json.loads(message)
                except ValueError:
                    log.warning("ignoring an undecodable frame from the daemon")
                    continue
                if not isinstance(frame, dict):
                    continue
                if "push" in frame:
                    if self._on_push is not None:
                        try:
                            self._on_push(self, frame)
                        except Exception:
                            log.exception("push handler failed")
                    continue
                self._answer(frame)
        except ConnectionClosed:
            pass
        except Exception:
            log.exception("connection reader failed")
        finally:
            self.close_code = self._ws.close_code
            self.closed.set()
            lost = ConnectionLost("connection closed", self.close_code)
            for fut in self._pending.values():
                if not fut.done():
                    fut.set_exception(lost)
            self._pending.clear()

    def _answer(self, frame: dict[str, Any]) -> None:
        rid = frame.get("id")
        if not isinstance(rid, int):
            # {"id": null, "error": ...}: a frame-level error before a close.
            log.warning("daemon reported a connection error: %s", frame.get("error"))
            return
        fut = self._pending.get(rid)
        if fut is None or fut.done():
            return  # the caller stopped waiting for it
        if "error" in frame:
            fut.set_exception(error_from_wire(frame["error"]))
        else:
            fut.set_result(frame.get("ok"))


__all__ = ["CLOSE_SUPERSEDED", "PROTOCOL_VERSION", "Connection", "ConnectionLost", "TurndError"]
