"""turnd: Python SDK for the turnd turn-orchestration daemon.

Workers serve functions (:class:`Worker`), callers submit and follow turns
(:class:`Client`). See ``docs/sdk-python.md``.
"""

from ._connection import PROTOCOL_VERSION
from .client import Client, Watch
from .errors import (
    BadEndpoint,
    BadFrame,
    BadRequest,
    Conflict,
    ConnectionLost,
    Forbidden,
    Internal,
    NotAuthenticated,
    NotFound,
    ProtocolError,
    RateLimited,
    ShuttingDown,
    TooLarge,
    TurndError,
    Unavailable,
    UnknownOp,
    UnsupportedProtocol,
    WorkerSuperseded,
)
from .types import (
    Event,
    EventPage,
    FunctionInfo,
    Reconciled,
    Session,
    SessionPage,
    SessionRow,
    Submitted,
    Turn,
    TurnError,
    TurnPage,
    Wait,
    WorkerInfo,
)
from .worker import Continue, Fail, TurnContext, Worker, WorkerState, WorkerStats

__version__ = "0.1.0"

__all__ = [
    "PROTOCOL_VERSION",
    "BadEndpoint",
    "BadFrame",
    "BadRequest",
    "Client",
    "Conflict",
    "ConnectionLost",
    "Continue",
    "Event",
    "EventPage",
    "Fail",
    "Forbidden",
    "FunctionInfo",
    "Internal",
    "NotAuthenticated",
    "NotFound",
    "ProtocolError",
    "RateLimited",
    "Reconciled",
    "Session",
    "SessionPage",
    "SessionRow",
    "ShuttingDown",
    "Submitted",
    "TooLarge",
    "Turn",
    "TurnContext",
    "TurnError",
    "TurnPage",
    "TurndError",
    "Unavailable",
    "UnknownOp",
    "UnsupportedProtocol",
    "Wait",
    "Watch",
    "Worker",
    "WorkerInfo",
    "WorkerState",
    "WorkerStats",
    "WorkerSuperseded",
    "__version__",
]
