from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import pytest_asyncio

from turnd import Client, Event
from turnd.testing import TurndServer

# Short daemon timers, so every loss rule plays out within a second or two.
FAST: dict[str, Any] = {
    "turns.probe_timeout_ms": 300,
    "turns.reconnect_grace_ms": 3000,
    "turns.cancel_grace_ms": 1500,
    "turns.retry_backoff_ms": 50,
    "turns.retry_backoff_max_ms": 200,
}

ServerFactory = Callable[..., Awaitable[TurndServer]]


@pytest.fixture(scope="session", autouse=True)
def _binary() -> None:
    if not os.environ.get("TURND_BIN"):
        pytest.fail("set TURND_BIN to a built turnd binary (make test-sdk-python does)")


@pytest_asyncio.fixture
async def make_server() -> AsyncIterator[ServerFactory]:
    """Start daemons with FAST timers plus the given ``section.key`` overrides."""
    started: list[TurndServer] = []

    async def start(**overrides: Any) -> TurndServer:
        config = dict(FAST)
        config.update({k.replace("__", "."): v for k, v in overrides.items()})
        server = TurndServer(config)
        await server.__aenter__()
        started.append(server)
        return server

    yield start
    for server in started:
        await server.__aexit__(None, None, None)


@pytest_asyncio.fixture
async def server(make_server: ServerFactory) -> TurndServer:
    return await make_server()


@pytest_asyncio.fixture
async def client(server: TurndServer) -> AsyncIterator[Client]:
    async with Client(server.url) as c:
        yield c


@pytest.fixture
def sid() -> str:
    return f"s-{uuid.uuid4().hex[:10]}"


def kinds(events: list[Event]) -> list[str]:
    return [e.kind for e in events]


# The package's own fixture, used as a user's conftest would.
from turnd.testing import turnd_server  # noqa: E402, F401
