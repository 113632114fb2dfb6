"""Turns through the real daemon: outcomes, steps, retries, idempotency, errors."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pydantic
import pytest

import turnd
from turnd import Client, Continue, Fail, TurnContext, Worker, WorkerState
from turnd.testing import TurndServer

from .conftest import ServerFactory, kinds


async def serving(worker: Worker) -> Worker:
    await worker.__aenter__()
    await worker.wait_state(WorkerState.CONNECTED, 10)
    return worker


async def test_happy_path_async_and_sync_handlers(turnd_server: TurndServer, sid: str) -> None:
    worker = Worker(turnd_server.url, "w-happy")
    threads: list[str] = []

    @worker.function("echo")
    async def echo(ctx: TurnContext, input: Any) -> Any:
        return {"echo": input, "session": ctx.session_id, "step": ctx.step}

    @worker.function("shout")
    def shout(ctx: TurnContext, input: str) -> str:
        threads.append(threading.current_thread().name)
        return input.upper()

    await serving(worker)
    try:
        async with Client(turnd_server.url) as c:
            turn = await c.run(sid, "echo", {"a": 1}, timeout=10)
            assert turn.status == "completed"
            assert turn.output == {"echo": {"a": 1}, "session": sid, "step": 0}
            shouted = await c.run(sid, "shout", "hi", timeout=10)
            assert shouted.status == "completed" and shouted.output == "HI"
            assert threads and threads[0] != threading.main_thread().name
            got = await c.get(turn.turn_id)
            assert got == turn
            page = await c.list(sid)
            assert [t.turn_id for t in page.turns] == [shouted.turn_id, turn.turn_id]
            session = await c.inspect(sid)
            assert session.turns["completed"] == 2 and session.lock is None
    finally:
        await worker.__aexit__(None, None, None)
    assert worker.state == WorkerState.STOPPED


async def test_multi_step_turn(server: TurndServer, client: Client, sid: str) -> None:
    worker = Worker(server.url, "w-steps")
    seen: list[tuple[int, Any]] = []

    @worker.function("count")
    async def count(ctx: TurnContext, input: dict[str, int]) -> Any:
        seen.append((ctx.step, input))
        if input["n"] < 3:
            return Continue({"n": input["n"] + 1})
        return {"done": input["n"]}

    await serving(worker)
    try:
        turn = await client.run(sid, "count", {"n": 0}, timeout=10)
    finally:
        await worker.__aexit__(None, None, None)
    assert turn.status == "completed" and turn.output == {"done": 3} and turn.step == 3
    assert seen == [(0, {"n": 0}), (1, {"n": 1}), (2, {"n": 2}), (3, {"n": 3})]


async def test_fail_and_exceptions(server: TurndServer, client: Client, sid: str) -> None:
    worker = Worker(server.url, "w-fail")

    @worker.function("refuse")
    async def refuse(ctx: TurnContext, input: Any) -> Any:
        raise Fail("no_budget", "out of tokens")

    @worker.function("crash")
    def crash(ctx: TurnContext, input: Any) -> Any:
        raise KeyError("missing")

    await serving(worker)
    try:
        refused = await client.run(sid, "refuse", None, timeout=10)
        crashed = await client.run(sid, "crash", None, timeout=10)
    finally:
        await worker.__aexit__(None, None, None)
    assert refused.status == "failed" and refused.error is not None
    assert (refused.error.cause, refused.error.code) == ("handler_failed", "no_budget")
    assert refused.error.message == "out of tokens"
    assert crashed.status == "failed" and crashed.error is not None
    assert (crashed.error.cause, crashed.error.code) == ("handler_failed", "KeyError")
    assert "missing" in crashed.error.message


async def test_retryable_failure_is_retried(server: TurndServer, client: Client, sid: str) -> None:
    worker = Worker(server.url, "w-retry")
    attempts: list[int] = []

    @worker.function("flaky", delivery="at_least_once", max_attempts=3)
    async def flaky(ctx: TurnContext, input: Any) -> Any:
        attempts.append(ctx.attempt)
        if len(attempts) < 3:
            raise Fail("busy", "try later", retryable=True)
        return {"attempt": ctx.attempt}

    @worker.function("hopeless", delivery="at_least_once", max_attempts=2)
    async def hopeless(ctx: TurnContext, input: Any) -> Any:
        raise Fail("busy", "still busy", retryable=True)

    await serving(worker)
    try:
        turn = await client.run(sid, "flaky", None, timeout=10)
        exhausted = await client.run(sid, "hopeless", None, timeout=10)
    finally:
        await worker.__aexit__(None, None, None)
    assert turn.status == "completed" and turn.output == {"attempt": 3}
    assert attempts == [1, 2, 3]
    events = await client.all_events(sid)
    assert kinds(events).count("retry_scheduled") == 3  # 2 for flaky, 1 for hopeless
    assert exhausted.status == "failed" and exhausted.error is not None
    assert exhausted.error.cause == "attempts_exhausted" and exhausted.error.code == "busy"


class Question(pydantic.BaseModel):
    text: str
    depth: int = 1


class Answer(pydantic.BaseModel):
    reply: str


async def test_pydantic_models(server: TurndServer, client: Client, sid: str) -> None:
    worker = Worker(server.url, "w-pydantic")

    @worker.function("ask")
    async def ask(ctx: TurnContext, input: Question) -> Answer:
        assert isinstance(input, Question)
        return Answer(reply=input.text * input.depth)

    await serving(worker)
    try:
        ok = await client.run(sid, "ask", {"text": "ab", "depth": 2}, timeout=10)
        bad = await client.run(sid, "ask", {"depth": "deep"}, timeout=10)
    finally:
        await worker.__aexit__(None, None, None)
    assert ok.output == {"reply": "abab"}
    assert bad.status == "failed" and bad.error is not None
    assert bad.error.code == "invalid_input"


async def test_idempotent_submit(server: TurndServer, client: Client, sid: str) -> None:
    first = await client.submit(sid, "nobody", {"x": 1}, idempotency_key="k1")
    again = await client.submit(sid, "nobody", {"x": 1}, idempotency_key="k1")
    assert not first.deduplicated and again.deduplicated
    assert again.turn_id == first.turn_id
    with pytest.raises(turnd.Conflict) as err:
        await client.submit(sid, "nobody", {"x": 2}, idempotency_key="k1")
    assert err.value.code == "conflict" and not err.value.retryable
    assert (await client.inspect(sid)).turns["queued"] == 1
    stopped = await client.stop_session(sid, "test over")
    assert [t.status for t in stopped] == ["cancelled"]
    assert stopped[0].stop is not None and stopped[0].stop.reason == "test over"


async def test_errors_are_typed(make_server: ServerFactory, sid: str) -> None:
    server = await make_server()
    async with Client(server.url) as c:
        with pytest.raises(turnd.NotFound) as not_found:
            await c.get("t_00000000000000000000000000")
        assert not_found.value.code == "not_found"
        with pytest.raises(turnd.NotFound):
            await c.inspect(sid)
        with pytest.raises(turnd.BadRequest) as bad:
            await c.list(sid, limit=0)
        assert bad.value.code == "bad_request" and not bad.value.retryable
        with pytest.raises(turnd.BadRequest):
            await c.submit(sid, "f", None, turn_timeout_ms=0)
        with pytest.raises(turnd.Forbidden):
            await c.store_check()  # operator only
        with pytest.raises(turnd.TooLarge):
            await c.submit(sid, "f", "x" * 600_000)
        assert (await c.list(sid)).turns == []  # bad input changed nothing


async def test_tokens_refused_as_not_authenticated(
    make_server: ServerFactory, tmp_path: Path
) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("client client-secret-1\nworker worker-secret-1\n", encoding="utf-8")
    server = await make_server(**{"auth.token_file": str(tokens)})
    # Retrying would be slow on purpose: the worker's second try would come 15 s or
    # more after its first, the client's tries go on for a minute.
    worker = Worker(server.url, "w-auth", token="wrong-token-0", reconnect_delay=30)

    @worker.function("echo")
    async def echo(ctx: TurnContext, input: Any) -> Any:
        return input

    # Refused for good, at once: no retrying a token that cannot change.
    started = time.monotonic()
    with pytest.raises(turnd.NotAuthenticated) as err:
        async with Client(server.url, token="wrong-token-0", reconnect_timeout=60) as c:
            await c.ping()
    with pytest.raises(turnd.NotAuthenticated) as werr:
        await asyncio.wait_for(worker.serve(), 20)
    assert time.monotonic() - started < 10
    for refused in (err.value, werr.value):
        assert refused.code == "not_authenticated" and not refused.retryable
        assert server.url in str(refused) and str(refused).count("token not accepted") == 1
    async with Client(server.url, token="client-secret-1") as c:
        await c.ping()
    worker.token = "worker-secret-1"
    await serving(worker)
    try:
        async with Client(server.url, token="client-secret-1") as c:
            assert (await c.run("auth", "echo", 5, timeout=10)).output == 5
    finally:
        await worker.__aexit__(None, None, None)


async def test_watch_a_turn(server: TurndServer, client: Client, sid: str) -> None:
    release = asyncio.Event()
    worker = Worker(server.url, "w-watch")

    @worker.function("slow")
    async def slow(ctx: TurnContext, input: Any) -> Any:
        await release.wait()
        return "ok"

    await serving(worker)
    try:
        turn = (await client.submit(sid, "slow")).turn
        seen: list[str] = []
        async with client.watch(turn_id=turn.turn_id) as events:
            release.set()
            async for event in events:
                seen.append(event.kind)
                if event.kind == "completed":
                    break
    finally:
        await worker.__aexit__(None, None, None)
    assert seen == ["admitted", "dispatched", "result", "completed"]


async def test_values_the_daemon_cannot_take_fail_the_step(
    server: TurndServer, client: Client, sid: str
) -> None:
    worker = Worker(server.url, "w-values")

    @worker.function("huge")
    async def huge(ctx: TurnContext, input: Any) -> Any:
        return "x" * 1_100_000  # over the daemon's 1 MiB max_frame_bytes

    @worker.function("nan")
    def nan(ctx: TurnContext, input: Any) -> Any:
        return {"score": float("nan")}

    @worker.function("opaque")
    async def opaque(ctx: TurnContext, input: Any) -> Any:
        return object()

    await serving(worker)
    try:
        too_big = await client.run(sid, "huge", None, timeout=10)
        not_json = await client.run(sid, "nan", None, timeout=10)
        not_json_either = await client.run(sid, "opaque", None, timeout=10)
        after = await client.run(sid, "nan", None, timeout=10)  # still connected, still serving
    finally:
        await worker.__aexit__(None, None, None)
    assert too_big.status == "failed" and too_big.error is not None
    assert too_big.error.code == "too_large" and "max_frame_bytes" in too_big.error.message
    for turn in (not_json, not_json_either, after):
        assert turn.status == "failed" and turn.error is not None
        assert turn.error.code == "invalid_output"
    assert worker.stats.connections == 1
    with pytest.raises(ValueError):
        await client.submit(sid, "f", float("inf"))
