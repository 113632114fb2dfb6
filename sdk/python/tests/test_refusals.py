"""What can never work fails at once, with the daemon's words, and is never repeated:
a request over the daemon's ``max_frame_bytes``, a URL that cannot reach a daemon (a
refused token: ``test_basic``). A daemon that is down stays a retryable
``ConnectionLost``.
"""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import pytest

import turnd
from turnd import BadEndpoint, Client, ConnectionLost, TooLarge, TurnContext, Worker, WorkerState
from turnd.testing import TurndServer

from .proxy import FrameProxy

BIG_INPUT = {"b": "x" * 1_300_000}  # over the daemon's default 1 MiB max_frame_bytes
DAEMON_LIMIT = 1_048_576

# "At once" is measured against retries made long on purpose: a client that retried
# would go on for ``RETRY_FOR`` seconds, a worker would wait at least ``RETRY_DELAY``
# / 2 before its second try. A failure within ``AT_ONCE`` seconds was not retried, even
# when a loaded machine stalls the test for a few seconds.
RETRY_FOR = 60.0
RETRY_DELAY = 30.0
AT_ONCE = 10.0
# How long a call that should fail at once may take before it is cut off (a retrying
# one would take longer).
CUT_OFF = 20.0


def sent(proxy: FrameProxy, op: str) -> list[tuple[int, dict[str, Any]]]:
    """(id, args without input) of each ``op`` request the proxy passed to the daemon
    (without the megabytes, which would make an assertion's report unreadable)."""
    return [
        (f["id"], {k: v for k, v in f["args"].items() if k not in ("input", "outcome")})
        for d, f in proxy.seen
        if d == "up" and f.get("op") == op
    ]


def submits(proxy: FrameProxy) -> list[tuple[int, dict[str, Any]]]:
    return sent(proxy, "turn.submit")


def announce_larger_limit(proxy: FrameProxy) -> None:
    """Every hello answer says 64 MiB: a daemon whose real limit is lower than it says."""

    def is_hello_answer(frame: dict[str, Any]) -> bool:
        ok = frame.get("ok")
        return isinstance(ok, dict) and "max_frame_bytes" in ok

    def larger(frame: dict[str, Any]) -> dict[str, Any]:
        return {**frame, "ok": {**frame["ok"], "max_frame_bytes": 64 * 1024 * 1024}}

    proxy.rewrite("down", is_hello_answer, larger, times=1000)


async def test_oversized_request_is_refused_before_it_is_sent(
    server: TurndServer, sid: str
) -> None:
    async with (
        FrameProxy(server.url) as proxy,
        Client(proxy.url, reconnect_timeout=RETRY_FOR) as c,
    ):
        for key in (None, "k-big"):
            started = time.monotonic()
            with pytest.raises(TooLarge) as err:
                await asyncio.wait_for(c.submit(sid, "fn", BIG_INPUT, idempotency_key=key), CUT_OFF)
            assert time.monotonic() - started < AT_ONCE
            assert not err.value.retryable and err.value.code == "too_large"
            assert f"over the daemon's max_frame_bytes {DAEMON_LIMIT}" in str(err.value)
        await c.ping()  # the same connection, still up
        assert submits(proxy) == []
        assert c.connections == 1 and proxy.connections == 1
        with pytest.raises(turnd.NotFound):
            await c.inspect(sid)  # nothing was admitted


@pytest.mark.parametrize("error_frame", ["answered", "lost"])
async def test_frame_the_daemon_refuses_as_too_large_is_not_resent(
    server: TurndServer, sid: str, error_frame: str
) -> None:
    """The daemon's own refusal: {"id": null, "error": too_large}, then close 1009
    (or the close alone, when the error frame is lost)."""
    async with FrameProxy(server.url) as proxy:
        announce_larger_limit(proxy)
        if error_frame == "lost":
            proxy.drop("down", lambda f: f.get("id", 0) is None, times=1000)
        async with Client(proxy.url, reconnect_timeout=RETRY_FOR) as c:
            for key in (None, "k-big"):
                started = time.monotonic()
                with pytest.raises(TooLarge) as err:
                    # Awaited directly: in a task of its own (asyncio.wait_for) the
                    # second frame goes out a turn of the loop later, often after the
                    # proxy dropped the connection the daemon closes, unseen by it.
                    await c.submit(sid, "fn", BIG_INPUT, idempotency_key=key)
                assert time.monotonic() - started < AT_ONCE
                assert not err.value.retryable
                assert "max_frame_bytes" in str(err.value)
            # Each oversized frame was sent once and never again. The first reached
            # the daemon (which refused it). The second can go out on the next
            # connection; or on the one the daemon is closing, where the proxy may
            # not read it before the close; or not at all, when the client sees that
            # connection closing as it sends (then it fails as large as the one the
            # daemon refused): at most once, whatever the timing.
            keys = [args.get("idempotency_key") for _, args in submits(proxy)]
            assert keys.count(None) == 1, keys
            assert keys.count("k-big") <= 1, keys
            assert len(keys) <= 2, keys
            assert c.connections <= 2
            await c.ping()  # a new connection, for a request that fits
            with pytest.raises(turnd.NotFound):
                await c.inspect(sid)


async def test_worker_result_the_daemon_refuses_fails_the_step(
    server: TurndServer, client: Client, sid: str
) -> None:
    async with FrameProxy(server.url) as proxy:
        announce_larger_limit(proxy)
        worker = Worker(proxy.url, "w-huge", reconnect_delay=0.05)

        @worker.function("huge")
        async def huge(ctx: TurnContext, input: Any) -> Any:
            return "x" * 1_100_000

        async with worker:
            await worker.wait_state(WorkerState.CONNECTED, 10)
            turn = await client.run(sid, "huge", None, timeout=10)
        outcomes = [
            next(iter(f["args"]["outcome"]))
            for d, f in proxy.seen
            if d == "up" and f.get("op") == "invocation.result"
        ]
    assert turn.status == "failed" and turn.error is not None
    assert turn.error.code == "too_large" and "max_frame_bytes" in turn.error.message
    # The big result once, then the step's failure in its place (sent again when the
    # connection the daemon was closing lost it).
    assert outcomes[0] == "complete" and set(outcomes[1:]) == {"fail"}


def url_without_path(server: TurndServer) -> str:
    return server.url.removesuffix("/v1")


def serving_worker(url: str, **options: Any) -> Worker:
    worker = Worker(url, "w-refused", **options)

    @worker.function("f")
    async def f(ctx: TurnContext, input: Any) -> Any:
        return input

    return worker


async def test_wrong_path_fails_at_once_with_the_daemons_words(server: TurndServer) -> None:
    for path in ("/v2", "", "/"):
        url = url_without_path(server) + path
        started = time.monotonic()
        with pytest.raises(BadEndpoint) as err:
            async with Client(url, reconnect_timeout=RETRY_FOR) as c:
                await c.ping()
        assert time.monotonic() - started < AT_ONCE
        message = str(err.value)
        assert message.startswith(f"cannot connect to {url}: ")
        assert message.count("no such path; protocol v1 is served at /v1") == 1
        assert err.value.status == 404 and err.value.url == url and not err.value.retryable

        worker = serving_worker(url, reconnect_delay=RETRY_DELAY)
        started = time.monotonic()
        with pytest.raises(BadEndpoint) as werr:
            await asyncio.wait_for(worker.serve(), CUT_OFF)
        assert time.monotonic() - started < AT_ONCE
        assert str(werr.value) == message and worker.state == WorkerState.STOPPED

    # Served in the background: waiting for it, and leaving the block, say why it ended.
    worker = serving_worker(url_without_path(server) + "/v2")
    with pytest.raises(BadEndpoint):
        async with worker:
            await worker.wait_state(WorkerState.CONNECTED, 5)
    with pytest.raises(BadEndpoint):
        await worker.wait_state(WorkerState.CONNECTED, 5)  # stopped for good: at once


async def test_refused_upgrade_fails_at_once(server: TurndServer) -> None:
    """The admin listener answers HTTP, not a WebSocket upgrade."""
    url = server.admin_url.replace("http://", "ws://", 1).rstrip("/") + "/v1"
    started = time.monotonic()
    with pytest.raises(BadEndpoint) as err:
        await Client(url, reconnect_timeout=RETRY_FOR).connect()
    assert time.monotonic() - started < AT_ONCE
    assert err.value.status is not None and url in str(err.value)


@pytest.mark.parametrize(
    "url",
    [
        "not a url at all",
        "http://127.0.0.1:7420/v1",
        "ws://127.0.0.1:99999/v1",
        "ws:///v1",
        "ws://[::1/v1",
    ],
)
async def test_malformed_url_fails_at_once(url: str) -> None:
    started = time.monotonic()
    with pytest.raises(BadEndpoint) as err:
        await Client(url, reconnect_timeout=RETRY_FOR).connect()
    assert repr(url) in str(err.value) and err.value.status is None
    with pytest.raises(BadEndpoint):
        await asyncio.wait_for(serving_worker(url, reconnect_delay=RETRY_DELAY).serve(), CUT_OFF)
    assert time.monotonic() - started < AT_ONCE


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def test_daemon_down_stays_retryable() -> None:
    url = f"ws://127.0.0.1:{free_port()}/v1"
    started = time.monotonic()
    with pytest.raises(ConnectionLost) as err:
        await Client(url, reconnect_timeout=0.6).connect()
    # Tried again until reconnect_timeout, and not until the default of 30 s.
    assert 0.15 < time.monotonic() - started < AT_ONCE
    assert err.value.retryable
    assert str(err.value).count("cannot connect to") == 1 and url in str(err.value)


async def test_worker_waits_for_a_daemon_that_is_down() -> None:
    url = f"ws://127.0.0.1:{free_port()}/v1"
    worker = serving_worker(url, reconnect_delay=0.05, reconnect_max_delay=0.1)
    serve = asyncio.ensure_future(worker.serve())
    await asyncio.sleep(0.5)
    assert not serve.done() and worker.stats.connections == 0
    worker.stop()
    await asyncio.wait_for(serve, 5)
