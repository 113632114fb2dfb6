"""Exceptions of the turnd SDK.

Every error the daemon answers with becomes a :class:`ProtocolError` subclass that
carries the protocol's ``code``, ``message`` and ``retryable`` flag, so callers can
``except turnd.NotFound`` or look at ``err.code``.
"""

from __future__ import annotations

from typing import Any


class TurndError(Exception):
    """Base class of every exception raised by the SDK."""

    retryable: bool = False


class ConnectionLost(TurndError):
    """The connection closed (or could not be opened) before an answer arrived.

    Whether a request that was in flight took effect is unknown; the SDK only
    repeats requests on its own where repeating is safe. ``close_code`` is the code
    of the daemon's close frame (1006 when none came; ``None`` when the connection
    was not open): after 1001 every unanswered request was never read.
    """

    retryable = True

    def __init__(self, message: str = "connection lost", close_code: int | None = None) -> None:
        super().__init__(message)
        self.close_code = close_code


class BadEndpoint(TurndError):
    """The URL can never reach a turnd daemon, so connecting is not retried.

    Raised at once for a malformed URL (not ``ws://`` or ``wss://``) and for a
    server that answers the WebSocket upgrade with plain HTTP: a wrong path (turnd
    answers 404 ``no such path; protocol v1 is served at /v1``), a port that serves
    something else. The message names the URL and quotes the server's answer;
    ``status`` is the HTTP status (``None`` for a malformed URL) and ``body`` the
    answer's text. HTTP 408, 429 and 5xx (a proxy in front of a daemon that is
    restarting) are not this error: they are retried like a refused connection.
    """

    retryable = False

    def __init__(self, message: str, url: str, status: int | None = None, body: str = "") -> None:
        super().__init__(message)
        self.url = url
        self.status = status
        self.body = body

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.url, self.status, self.body))


class WorkerSuperseded(TurndError):
    """Another connection said ``hello`` with this worker's ``worker_id`` (close 4001)."""


class ProtocolError(TurndError):
    """An error answer from the daemon: ``{"code", "message", "retryable"}``."""

    code: str = "internal"

    def __init__(self, code: str, message: str, retryable: bool = False) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.retryable = retryable

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.code, self.message, self.retryable))


class BadFrame(ProtocolError):
    """``bad_frame``: the frame was not a valid request envelope."""


class BadRequest(ProtocolError):
    """``bad_request``: a missing or ill-typed field, or a value out of range."""


class UnknownOp(ProtocolError):
    """``unknown_op``: no such operation."""


class UnsupportedProtocol(ProtocolError):
    """``unsupported_protocol``: the daemon does not speak this protocol version."""


class NotAuthenticated(ProtocolError):
    """``not_authenticated``: no successful ``hello``, or the token was refused."""


class Forbidden(ProtocolError):
    """``forbidden``: this role may not use the operation."""


class NotFound(ProtocolError):
    """``not_found``: no such turn, session, invocation, watch or registration."""


class Conflict(ProtocolError):
    """``conflict``: an idempotency key reused with another function or input; a
    ``resume`` of a turn that is not awaiting input."""


class Busy(ProtocolError):
    """``busy``: a submit with ``on_busy="reject"`` while the session has an unfinished
    turn. Nothing was stored; not retryable (the session is busy until its turns end)."""


class TooLarge(ProtocolError):
    """``too_large``: a frame or value over the daemon's limits."""


class RateLimited(ProtocolError):
    """``rate_limited``: a request, connection, watch or queue limit (retryable)."""


class Unavailable(ProtocolError):
    """``unavailable``: the daemon could not write or read its store (retryable)."""


class ShuttingDown(ProtocolError):
    """``shutting_down``: the daemon is draining (retryable)."""


class Internal(ProtocolError):
    """``internal``: an invariant of the daemon broke."""


ERRORS_BY_CODE: dict[str, type[ProtocolError]] = {
    "bad_frame": BadFrame,
    "bad_request": BadRequest,
    "unknown_op": UnknownOp,
    "unsupported_protocol": UnsupportedProtocol,
    "not_authenticated": NotAuthenticated,
    "forbidden": Forbidden,
    "not_found": NotFound,
    "conflict": Conflict,
    "busy": Busy,
    "too_large": TooLarge,
    "rate_limited": RateLimited,
    "unavailable": Unavailable,
    "shutting_down": ShuttingDown,
    "internal": Internal,
}


def error_from_wire(error: Any) -> ProtocolError:
    """Build the exception for an ``error`` member of a response."""
    if not isinstance(error, dict):
        return Internal("internal", f"malformed error answer: {error!r}", True)
    code = str(error.get("code", "internal"))
    message = str(error.get("message", ""))
    retryable = bool(error.get("retryable", False))
    cls = ERRORS_BY_CODE.get(code, ProtocolError)
    return cls(code, message, retryable)
