"""One WebSocket connection speaking protocol v1: requests, answers and pushes.

It also owns the rules both sides share about what can never work, so the client's
and the worker's retry loops need not know them: a URL that cannot reach a daemon
(:class:`BadEndpoint`), a ``hello`` refused for good, and a request frame over the
daemon's ``max_frame_bytes`` (:class:`TooLarge`, raised before anything is sent).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import (
    ConnectionClosed,
    InvalidHandshake,
    InvalidHeader,
    InvalidStatus,
    InvalidURI,
)

from .errors import (
    BadEndpoint,
    ConnectionLost,
    ProtocolError,
    TooLarge,
    TurndError,
    error_from_wire,
)

log = logging.getLogger("turnd")

PROTOCOL_VERSION = 1
CLOSE_SUPERSEDED = 4001
# The daemon shuts down (or a cluster node drains): every request it read on the
# connection was answered before this close frame, so one with no answer was never read.
CLOSE_GOING_AWAY = 1001
CLOSE_TOO_BIG = 1009
# Answers (turn.list, session.events) can be far larger than any request the daemon
# takes; bound them all the same.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# HTTP answers to the upgrade that a proxy in front of a restarting daemon gives:
# worth another try. Any other answer means the URL is wrong.
_TRANSIENT_HTTP = frozenset({408, 429})
# How long a request whose send failed waits for the reader to settle it.
_READER_GRACE_S = 5.0
# Longest part of a refused upgrade's HTTP body quoted in an error.
_BODY_QUOTED = 200

_CLOSED_TOO_BIG = {
    "code": "too_large",
    "message": "the daemon closed the connection with 1009, a frame over its max_frame_bytes",
}

PushHandler = Callable[["Connection", dict[str, Any]], None]


def url_list(url: str | Sequence[str]) -> list[str]:
    """One URL, or a cluster's nodes' URLs, as a list (never empty)."""
    urls = [url] if isinstance(url, str) else list(url)
    if not urls:
        raise ValueError("at least one URL is needed")
    return urls


def check_url(url: str) -> None:
    """Raise :class:`BadEndpoint` for a URL that is not ``ws://`` or ``wss://`` with a host."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port out of range
    except ValueError as e:
        raise BadEndpoint(f"{url!r} is not a WebSocket URL: {e}", url) from e
    if parts.scheme not in ("ws", "wss"):
        raise BadEndpoint(
            f"{url!r} is not a WebSocket URL: the scheme must be ws or wss"
            " (e.g. ws://127.0.0.1:7420/v1)",
            url,
        )
    if not parts.hostname:
        raise BadEndpoint(f"{url!r} is not a WebSocket URL: it names no host", url)


def _refused(url: str, e: InvalidStatus) -> TurndError:
    """The error for an upgrade answered with plain HTTP, quoting the server's words."""
    status = e.response.status_code
    body = bytes(e.response.body or b"").decode("utf-8", "replace").strip()
    said = f"the server refused the WebSocket upgrade with HTTP {status}"
    if body:
        said += f": {body[:_BODY_QUOTED]}"
    message = f"cannot connect to {url}: {said}"
    if status in _TRANSIENT_HTTP or status >= 500:
        return ConnectionLost(message)
    return BadEndpoint(message, url, status, body)


async def _open_socket(url: str, open_timeout: float) -> ClientConnection:
    check_url(url)
    try:
        return await connect(
            url,
            open_timeout=open_timeout,
            max_size=MAX_MESSAGE_BYTES,
            ping_interval=20,
            ping_timeout=20,
            close_timeout=2,
        )
    except InvalidURI as e:
        raise BadEndpoint(f"{url!r} is not a WebSocket URL: {e.msg}", url) from e
    except InvalidStatus as e:
        raise _refused(url, e) from e
    except InvalidHeader as e:
        # An answer to the upgrade that is not a WebSocket one: not turnd.
        raise BadEndpoint(f"cannot connect to {url}: {e}", url) from e
    except (OSError, InvalidHandshake, asyncio.TimeoutError) as e:
        raise ConnectionLost(f"cannot connect to {url}: {str(e) or type(e).__name__}") from e


class Connection:
    """A connected, authenticated protocol connection.

    A single reader task takes every frame: answers complete the future of their
    request id, pushes go to ``on_push(connection, frame)`` in arrival order. When
    the socket closes, for whatever reason, every pending request fails with
    :class:`ConnectionLost`, ``closed`` is set, and ``on_push`` is not called again,
    except the request the daemon refused as too large (``{"id": null, "error":
    {"code": "too_large"}}``, then close 1009), which fails with :class:`TooLarge`.
    """

    def __init__(self, ws: ClientConnection, on_push: PushHandler | None) -> None:
        self._ws = ws
        self._on_push = on_push
        self._ids = itertools.count(1)
        # Request id -> (future of its answer, size of its frame in bytes).
        self._pending: dict[int, tuple[asyncio.Future[Any], int]] = {}
        # Size of the request failed as the frame the daemon refused as too large.
        self._refused_size: int | None = None
        self._close_error: Any = None
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
        """Connect, say ``hello`` and return the connection (``hello`` answer in ``.hello``).

        Raises :class:`BadEndpoint` when the URL can never work, the daemon's
        :class:`ProtocolError` (its message naming the URL) when it refuses the
        ``hello``, and :class:`ConnectionLost` for what another try may cure.
        """
        conn = cls(await _open_socket(url, open_timeout), on_push)
        try:
            conn.hello = await asyncio.wait_for(conn.call("hello", hello), open_timeout)
        except ProtocolError as e:
            await conn.close()
            raise type(e)(e.code, f"{url} refused hello: {e.message}", e.retryable) from e
        except (ConnectionLost, asyncio.TimeoutError) as e:
            await conn.close()
            raise ConnectionLost(
                f"cannot connect to {url}: no answer to hello ({str(e) or 'timed out'})",
                conn.close_code,
            ) from e
        except BaseException:
            await conn.close()
            raise
        return conn

    @property
    def max_frame_bytes(self) -> int | None:
        """The daemon's ``max_frame_bytes`` from its ``hello`` answer."""
        limit = self.hello.get("max_frame_bytes")
        return limit if isinstance(limit, int) and limit > 0 else None

    def encode(self, rid: int, op: str, args: dict[str, Any] | None) -> str:
        """The request frame, refused with :class:`TooLarge` when the daemon could not
        take it (it would close the connection, and again on every resend)."""
        # Raises TypeError / ValueError for values JSON cannot carry (NaN included).
        # ensure_ascii (the default) makes the length the size in bytes.
        frame = json.dumps(
            {"id": rid, "op": op, "args": args or {}}, separators=(",", ":"), allow_nan=False
        )
        limit = self.max_frame_bytes
        if limit is not None and len(frame) > limit:
            raise TooLarge(
                "too_large",
                f"the {op} request is {len(frame)} bytes, over the daemon's"
                f" max_frame_bytes {limit} (not sent)",
            )
        return frame

    async def call(self, op: str, args: dict[str, Any] | None = None) -> Any:
        """Send one request and return its ``ok`` member, or raise its error."""
        fut = await self.send(op, args)
        try:
            return await fut
        finally:
            fut.cancel()  # a caller that stops waiting leaves nothing pending

    async def send(self, op: str, args: dict[str, Any] | None = None) -> asyncio.Future[Any]:
        """Send one request without waiting for its answer: returns the future of its
        ``ok`` member, which fails with the error answer or :class:`ConnectionLost`.

        Requests sent one after the other by one task reach the daemon in that order.
        Cancelled while the socket's buffer drains, the frame still goes out and its
        answer is ignored.
        """
        if self.closed.is_set():
            raise ConnectionLost(self._lost_message(), self.close_code)
        rid = next(self._ids)
        frame = self.encode(rid, op, args)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[rid] = (fut, len(frame))
        fut.add_done_callback(lambda _: self._pending.pop(rid, None))
        try:
            await self._ws.send(frame)
        except ConnectionClosed as e:
            # The daemon may have refused this very frame as too large: the reader,
            # which still has that answer to read, settles the future.
            await asyncio.wait({fut}, timeout=_READER_GRACE_S)
            if not fut.done():
                fut.set_exception(ConnectionLost(f"connection closed: {e}", self.close_code))
        except BaseException:
            fut.cancel()
            raise
        return fut

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
            self._fail_pending()

    def _fail_pending(self) -> None:
        """Fail every request still waiting: the connection is gone.

        After a close for a frame over the daemon's limit (1009), a request as large
        as the one refused (or, when the refusal was not read, the largest) would be
        refused again on every resend: it fails with :class:`TooLarge`, not with the
        retryable :class:`ConnectionLost`.
        """
        if self.close_code == CLOSE_TOO_BIG and self._refused_size is None:
            self._fail_largest(_CLOSED_TOO_BIG)
        lost = ConnectionLost(self._lost_message(), self.close_code)
        for fut, size in self._pending.values():
            if fut.done():
                continue
            refused = self._refused_size
            if self.close_code == CLOSE_TOO_BIG and refused is not None and size >= refused:
                fut.set_exception(
                    TooLarge(
                        "too_large",
                        f"the request is {size} bytes; the daemon refused one of"
                        f" {refused} bytes as over its max_frame_bytes",
                    )
                )
            else:
                fut.set_exception(lost)
        self._pending.clear()

    def _lost_message(self) -> str:
        said = ""
        if isinstance(self._close_error, dict):
            said = f" after {self._close_error.get('code')}: {self._close_error.get('message')}"
        code = "" if self.close_code is None else f" (close {self.close_code})"
        return f"connection closed{code}{said}"

    def _fail_largest(self, error: dict[str, Any]) -> None:
        """Fail the largest pending request with ``error``: the daemon refused a frame
        as too large without reading its id, and of the requests it may be, the
        largest is certainly over the limit (so it must not be sent again)."""
        pending = [(size, fut) for fut, size in self._pending.values() if not fut.done()]
        if not pending:
            return
        size, fut = max(pending, key=lambda p: p[0])
        self._refused_size = size
        fut.set_exception(error_from_wire({**error, "retryable": False}))

    def _answer(self, frame: dict[str, Any]) -> None:
        rid = frame.get("id")
        if not isinstance(rid, int):
            # {"id": null, "error": ...}: an error about a frame the daemon could not
            # read the id of, often right before it closes.
            error = frame.get("error")
            if isinstance(error, dict) and error.get("code") == "too_large":
                self._fail_largest(error)
            else:
                log.warning("daemon reported a connection error: %s", error)
            self._close_error = error
            return
        entry = self._pending.get(rid)
        if entry is None or entry[0].done():
            return  # the caller stopped waiting for it
        fut = entry[0]
        if "error" in frame:
            fut.set_exception(error_from_wire(frame["error"]))
        else:
            fut.set_result(frame.get("ok"))


__all__ = [
    "CLOSE_SUPERSEDED",
    "PROTOCOL_VERSION",
    "Connection",
    "ConnectionLost",
    "TurndError",
    "check_url",
]
