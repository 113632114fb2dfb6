"""Finding work that waits: ``sessions.list`` and ``functions.list`` through the real daemon."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import turnd
from turnd import Client, SessionRow, TurnContext, Worker, WorkerState
from turnd.testing import TurndServer


async def test_sessions_list_filters_pages_and_counts(
    server: TurndServer, client: Client, sid: str
) -> None:
    release = asyncio.Event()
    worker = Worker(server.url, "w-sessions")

    @worker.function("slow")
    async def slow(ctx: TurnContext, input: Any) -> Any:
        await release.wait()
        return input

    async with worker:
        await worker.wait_state(WorkerState.CONNECTED, 10)
        a, b, c = f"{sid}-a", f"{sid}-b", f"{sid}-c"
        await client.submit(a, "nobody")
        running = await client.submit(b, "slow", 1)
        await client.submit(b, "slow", 2)  # queued behind the first
        await client.submit(c, "nobody")
        while (await client.get(running.turn_id)).status != "running":
            await asyncio.sleep(0.01)

        page = await client.sessions()
        assert page.total == 3 and page.next is None
        assert page.counts == {"awaiting_worker": 2, "awaiting_result": 1}
        assert all(isinstance(row, SessionRow) for row in page.sessions)

        [row] = (await client.sessions(state="awaiting_result")).sessions
        assert (row.session_id, row.turn_id, row.function_id) == (b, running.turn_id, "slow")
        assert (row.step, row.attempt, row.queued, row.stuck) == (0, 1, 1, False)
        assert row.wait.state == "awaiting_result" and row.wait.worker_id == "w-sessions"
        assert row.locked_since_ms > 0 and row.raw["session_id"] == b

        nobody = await client.sessions(function_id="nobody")
        assert sorted(r.session_id for r in nobody.sessions) == [a, c]
        assert nobody.total == 2 and nobody.counts == {"awaiting_worker": 2}

        stuck = await client.sessions(stuck=True, order="id")
        assert [(r.session_id, r.stuck) for r in stuck.sessions] == [(a, True), (c, True)]

        first = await client.sessions(order="id", limit=2)
        assert [r.session_id for r in first.sessions] == [a, b] and first.total == 3
        assert first.next is not None
        rest = await client.sessions(order="id", limit=2, after=first.next)
        assert [r.session_id for r in rest.sessions] == [c] and rest.next is None

        walked = [r.session_id async for r in client.iter_sessions(order="id", page_size=1)]
        assert walked == [a, b, c]
        assert [r.session_id async for r in client.iter_sessions(state="awaiting_result")] == [b]

        with pytest.raises(turnd.BadRequest):
            await client.sessions(order="id", after="not-a-cursor")
        with pytest.raises(turnd.BadRequest):
            await client.sessions(limit=0)
        release.set()
        await client.stop_session(a)
        await client.stop_session(c)


async def test_functions_say_whether_a_worker_registered_them(
    server: TurndServer, client: Client, sid: str
) -> None:
    worker = Worker(server.url, "w-functions")

    @worker.function("served", concurrency=3)
    async def served(ctx: TurnContext, input: Any) -> Any:
        return input

    async with worker:
        await worker.wait_state(WorkerState.CONNECTED, 10)
        await client.submit(sid, "nobody")
        functions = {f.function_id: f for f in await client.functions()}
    assert functions["served"].registered and functions["served"].concurrency == 3
    assert not functions["nobody"].registered and functions["nobody"].queued == 1
