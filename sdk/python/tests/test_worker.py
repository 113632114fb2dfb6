"""Worker life cycle: drain on SIGTERM, superseded, a stop while away."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

import turnd
from turnd import Client, TurnContext, Worker, WorkerState, WorkerSuperseded
from turnd.testing import TurndServer

from .proxy import FrameProxy


async def test_sigterm_drains_running_work(server: TurndServer, client: Client, sid: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(Path(__file__).with_name("drain_worker.py")),
        server.url,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    assert proc.stdout is not None
    try:
        turn = (await client.submit(sid, "slow", 0.5)).turn
        line = await asyncio.wait_for(proc.stdout.readline(), 10)
        assert line.startswith(b"started ")
        proc.send_signal(signal.SIGTERM)
        # Submitted after the signal: the draining worker must not take it.
        later = (await client.submit(f"{sid}-later", "slow", 0)).turn
        done = await client.wait(turn.turn_id, 5)
        assert done.status == "completed" and done.output == {"slept": 0.5}
        assert await asyncio.wait_for(proc.wait(), 5) == 0
        out = (await proc.stdout.read()).decode()
        assert out.strip() == "stopped 1"
        waiting = await client.get(later.turn_id)
        assert waiting.status == "queued" and waiting.wait is not None
        assert waiting.wait.state == "awaiting_worker"
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    await client.stop_session(f"{sid}-later")


async def test_superseded_worker_stops(server: TurndServer) -> None:
    states: list[WorkerState] = []
    first = Worker(server.url, "w-twin", on_state=states.append)
    second = Worker(server.url, "w-twin")
    for w in (first, second):

        @w.function("f")
        async def f(ctx: TurnContext, input: Any) -> Any:
            return input

    serving = asyncio.ensure_future(first.serve())
    await first.wait_state(WorkerState.CONNECTED, 10)
    async with second:
        await second.wait_state(WorkerState.CONNECTED, 10)
        with pytest.raises(WorkerSuperseded):
            await asyncio.wait_for(serving, 5)
    assert states[-1] == WorkerState.STOPPED
    assert states[:2] == [WorkerState.CONNECTING, WorkerState.CONNECTED]


async def test_stop_while_worker_is_away_cancels_the_handler(
    server: TurndServer, client: Client, sid: str
) -> None:
    async with FrameProxy(server.url) as proxy:
        worker = Worker(proxy.url, "w-away", reconnect_delay=0.05, cancel_grace=None)
        started: list[str] = []
        noticed = asyncio.Event()

        @worker.function("work", timeout_ms=5_000)
        async def work(ctx: TurnContext, input: Any) -> Any:
            started.append(ctx.invocation_id)
            await ctx.cancelled.wait()
            noticed.set()
            raise asyncio.CancelledError

        async with worker:
            await worker.wait_state(WorkerState.CONNECTED, 10)
            turn = (await client.submit(sid, "work")).turn
            while not started:
                await asyncio.sleep(0.01)
            proxy.refusing = True
            await proxy.cut(clean=False)
            await worker.wait_state(WorkerState.DISCONNECTED, 5)
            # The daemon sees the worker gone; a stop now cancels the turn at once.
            while (await client.get(turn.turn_id)).wait.state != "awaiting_reconnect":  # type: ignore[union-attr]
                await asyncio.sleep(0.02)
            stopped = await client.stop(turn.turn_id, "gave up")
            assert stopped.status == "cancelled"
            proxy.refusing = False
            await asyncio.wait_for(noticed.wait(), 5)
            assert worker.reconciled is not None and worker.reconciled.unknown == started
            await worker.settled(5)
    events = await client.all_events(sid)
    late = [e for e in events if e.kind == "late_result"]
    assert [e.detail["outcome"] for e in late] == ["cancelled"]
    assert (await client.get(turn.turn_id)).status == "cancelled"


async def test_refused_registration_stops_the_worker(server: TurndServer) -> None:
    worker = Worker(server.url, "w-bad-id")

    @worker.function("bad\x01id")  # control characters are not allowed in ids
    async def f(ctx: TurnContext, input: Any) -> Any:
        return input

    with pytest.raises(turnd.BadRequest):
        await asyncio.wait_for(worker.serve(), 5)
    assert worker.state == WorkerState.STOPPED
    with pytest.raises(ValueError):
        worker.function("f", timeout_ms=0)


async def test_heartbeat_not_found_cancels_the_handler(
    server: TurndServer, client: Client, sid: str
) -> None:
    # The daemon gave the invocation up while the worker was away, and the cancel it
    # sends at the reconnect is lost: the next heartbeat learns it instead.
    async with FrameProxy(server.url) as proxy:
        worker = Worker(proxy.url, "w-hb-gone", reconnect_delay=0.05, cancel_grace=None)
        started: list[str] = []
        noticed = asyncio.Event()

        @worker.function("work", timeout_ms=300)
        async def work(ctx: TurnContext, input: Any) -> Any:
            started.append(ctx.invocation_id)
            await ctx.cancelled.wait()
            noticed.set()
            raise asyncio.CancelledError

        async with worker:
            await worker.wait_state(WorkerState.CONNECTED, 10)
            turn = (await client.submit(sid, "work")).turn
            while not started:
                await asyncio.sleep(0.01)
            proxy.refusing = True
            await proxy.cut(clean=False)
            while (await client.get(turn.turn_id)).wait.state != "awaiting_reconnect":  # type: ignore[union-attr]
                await asyncio.sleep(0.02)
            await client.stop(turn.turn_id, "gave up")
            proxy.drop("down", lambda f: f.get("push") == "cancel")
            proxy.refusing = False
            await asyncio.wait_for(noticed.wait(), 5)
            await worker.settled(5)
    assert len(proxy.dropped) == 1
    heartbeats = [
        f
        for d, f in proxy.seen
        if d == "down" and (f.get("error") or {}).get("code") == "not_found"
    ]
    assert heartbeats, "the handler learnt of the loss from a not_found heartbeat"
