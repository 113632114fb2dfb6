"""Every loss rule of docs/semantics.md, through the real daemon.

Frames are dropped and connections cut by a WebSocket proxy (``proxy.py``) between
the SDK and the daemon; the daemon runs with short timers (``conftest.FAST``).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from turnd import Client, ConnectionLost, Event, TurnContext, Worker, WorkerState
from turnd.testing import TurndServer

from .conftest import ServerFactory, kinds
from .proxy import FrameProxy, is_op, is_push


async def serving(worker: Worker) -> Worker:
    await worker.__aenter__()
    await worker.wait_state(WorkerState.CONNECTED, 10)
    return worker


async def stopped(worker: Worker) -> None:
    await worker.__aexit__(None, None, None)


def of_kind(events: list[Event], kind: str) -> list[Event]:
    return [e for e in events if e.kind == kind]


# The attempt timeout of ``think_long``'s handler, which runs twice as long. Its
# heartbeats go every second: the deadline passes only if a stall of the worker or of
# the daemon outlasts two of them, not for the short stalls of a loaded machine.
THINK_TIMEOUT_MS = 3000
THINK_S = 6.0


async def think_long(url: str, name: str, client: Client, sid: str) -> Worker:
    """Run one turn of a handler that takes twice its 3 s attempt timeout, with the
    worker's own heartbeats; check it completed on its first attempt and was never
    probed nor dispatched twice (the deadline kept moving)."""
    worker = Worker(url, name)

    @worker.function("think", timeout_ms=THINK_TIMEOUT_MS)
    async def think(ctx: TurnContext, input: Any) -> Any:
        await asyncio.sleep(THINK_S)
        return {"attempt": ctx.attempt}

    await serving(worker)
    try:
        turn = await client.run(sid, "think", None, timeout=30)
    finally:
        await stopped(worker)
    assert turn.status == "completed" and turn.output == {"attempt": 1}
    events = await client.all_events(sid)
    assert kinds(events) == ["admitted", "dispatched", "result", "completed"]
    return worker


async def test_heartbeats_keep_a_long_handler_alive(
    server: TurndServer, client: Client, sid: str
) -> None:
    worker = await think_long(server.url, "w-long", client, sid)
    assert worker.stats.heartbeats_sent >= 3


async def test_heartbeats_keep_their_schedule_while_answers_are_slow(
    server: TurndServer, client: Client, sid: str
) -> None:
    # Every heartbeat's answer comes 2.5 s late, as from a daemon whose disk is slow
    # to make the new deadline durable. Beats sent only after the last answer would
    # reach the daemon 3.5 s apart, past the 3 s attempt timeout.
    async with FrameProxy(server.url) as proxy:

        def heartbeat_answer(frame: dict[str, Any]) -> bool:
            ids = {
                f.get("id")
                for d, f in proxy.seen
                if d == "up" and f.get("op") == "invocation.heartbeat"
            }
            return "ok" in frame and frame.get("id") in ids

        proxy.delay("down", heartbeat_answer, 2.5, times=1000)
        await think_long(proxy.url, "w-slow-answers", client, sid)
    sent = [f for d, f in proxy.seen if d == "up" and f.get("op") == "invocation.heartbeat"]
    # Beats spaced by their answers would be 3.5 s apart: two in 6 s (at 1 s and
    # 4.5 s); on schedule they are five or six (one a second).
    assert len(sent) >= 4


async def test_lost_result_is_resent_and_applied(
    server: TurndServer, client: Client, sid: str
) -> None:
    async with FrameProxy(server.url) as proxy:
        proxy.drop("up", is_op("invocation.result"))
        worker = Worker(proxy.url, "w-lost-result", result_ack_timeout=0.3)

        @worker.function("echo", timeout_ms=10_000)
        async def echo(ctx: TurnContext, input: Any) -> Any:
            return {"echo": input}

        await serving(worker)
        try:
            turn = await client.run(sid, "echo", 7, timeout=10)
            await worker.settled(5)
        finally:
            await stopped(worker)
    assert len(proxy.dropped) == 1
    assert turn.status == "completed" and turn.output == {"echo": 7}
    assert worker.stats.results_resent >= 1 and worker.stats.results_acked == 1
    events = await client.all_events(sid)
    assert kinds(events) == ["admitted", "dispatched", "result", "completed"]


async def test_probe_finds_a_finished_result_and_gets_it_at_once(
    server: TurndServer, client: Client, sid: str
) -> None:
    # The resend timer is far away: only the probe can bring the result back in time.
    async with FrameProxy(server.url) as proxy:
        proxy.drop("up", is_op("invocation.result"))
        worker = Worker(proxy.url, "w-probe", result_ack_timeout=30, auto_heartbeat=False)

        @worker.function("echo", timeout_ms=300)
        async def echo(ctx: TurnContext, input: Any) -> Any:
            return "done"

        await serving(worker)
        try:
            turn = await client.run(sid, "echo", None, timeout=5)
        finally:
            await stopped(worker)
    assert turn.status == "completed" and turn.output == "done"
    assert worker.stats.probes_answered >= 1 and worker.stats.results_resent >= 1
    statuses = [f for d, f in proxy.seen if d == "up" and f.get("op") == "invocation.status"]
    assert statuses and statuses[0]["args"]["state"] == "finished"
    assert "probe_sent" in kinds(await client.all_events(sid))


async def test_lost_dispatch_is_redispatched(server: TurndServer, client: Client, sid: str) -> None:
    async with FrameProxy(server.url) as proxy:
        proxy.drop("down", is_push("invoke"))
        worker = Worker(proxy.url, "w-lost-invoke")
        invocations: list[str] = []

        @worker.function("echo", timeout_ms=300)
        async def echo(ctx: TurnContext, input: Any) -> Any:
            invocations.append(ctx.invocation_id)
            return "ran"

        await serving(worker)
        try:
            turn = await client.run(sid, "echo", None, timeout=5)
        finally:
            await stopped(worker)
    assert turn.status == "completed" and turn.output == "ran"
    assert len(proxy.dropped) == 1 and len(invocations) == 1
    lost_id = proxy.dropped[0][1]["invocation_id"]
    assert invocations[0] != lost_id
    statuses = [f for d, f in proxy.seen if d == "up" and f.get("op") == "invocation.status"]
    assert [s["args"] for s in statuses] == [{"invocation_id": lost_id, "state": "unknown"}]
    events = await client.all_events(sid)
    redispatched = of_kind(events, "redispatched")
    assert len(redispatched) == 1
    assert redispatched[0].detail["previous_invocation_id"] == lost_id


async def test_reconnect_keeps_an_inflight_invocation(
    server: TurndServer, client: Client, sid: str
) -> None:
    release = asyncio.Event()
    async with FrameProxy(server.url) as proxy:
        worker = Worker(proxy.url, "w-inflight", reconnect_delay=0.05)
        started: list[str] = []

        @worker.function("work", timeout_ms=5_000)
        async def work(ctx: TurnContext, input: Any) -> Any:
            started.append(ctx.invocation_id)
            await release.wait()
            return "kept"

        await serving(worker)
        try:
            turn = (await client.submit(sid, "work")).turn
            while not started:
                await asyncio.sleep(0.01)
            await proxy.cut(clean=False)  # the TCP stream dies, no close frame
            await worker.wait_state(WorkerState.DISCONNECTED, 5)
            await worker.wait_state(WorkerState.CONNECTED, 5)
            assert worker.reconciled is not None
            assert worker.reconciled.kept == started
            release.set()
            done = await client.wait(turn.turn_id, 5)
        finally:
            await stopped(worker)
    assert done.status == "completed" and done.output == "kept"
    assert len(started) == 1 and worker.stats.connections == 2
    hellos = [f for d, f in proxy.seen if d == "up" and f.get("op") == "hello"]
    assert hellos[1]["args"]["inflight"] == started
    assert hellos[1]["args"]["instance_id"] == hellos[0]["args"]["instance_id"]
    assert "redispatched" not in kinds(await client.all_events(sid))


async def test_reconnect_delivers_a_result_finished_while_away(
    server: TurndServer, client: Client, sid: str
) -> None:
    release = asyncio.Event()
    finished = asyncio.Event()
    async with FrameProxy(server.url) as proxy:
        worker = Worker(proxy.url, "w-finished", reconnect_delay=0.05, result_ack_timeout=30)
        started: list[str] = []

        @worker.function("work", timeout_ms=5_000)
        async def work(ctx: TurnContext, input: Any) -> Any:
            started.append(ctx.invocation_id)
            await release.wait()
            finished.set()
            return "while away"

        await serving(worker)
        try:
            turn = (await client.submit(sid, "work")).turn
            while not started:
                await asyncio.sleep(0.01)
            proxy.refusing = True
            await proxy.cut(clean=True)  # a clean close is a disconnect too
            await worker.wait_state(WorkerState.DISCONNECTED, 5)
            release.set()
            await finished.wait()
            await asyncio.sleep(0.05)
            proxy.refusing = False
            done = await client.wait(turn.turn_id, 5)
        finally:
            await stopped(worker)
    assert done.status == "completed" and done.output == "while away"
    hellos = [f for d, f in proxy.seen if d == "up" and f.get("op") == "hello"]
    assert hellos[-1]["args"]["finished"] == started
    assert hellos[-1]["args"]["inflight"] == []
    assert worker.reconciled is not None and worker.reconciled.kept == started


async def test_daemon_restart_mid_turn(make_server: ServerFactory, sid: str) -> None:
    server = await make_server()
    release = asyncio.Event()
    worker = Worker(server.url, "w-restart", reconnect_delay=0.05, reconnect_max_delay=0.2)
    started: list[str] = []

    @worker.function("work", timeout_ms=5_000)
    async def work(ctx: TurnContext, input: Any) -> Any:
        started.append(ctx.invocation_id)
        await release.wait()
        return {"survived": True}

    await serving(worker)
    try:
        async with Client(server.url) as client:
            turn = (await client.submit(sid, "work")).turn
            while not started:
                await asyncio.sleep(0.01)
            await server.restart(kill=True)  # a crash: no graceful shutdown
            await worker.wait_state(WorkerState.CONNECTED, 10)
            assert worker.reconciled is not None and worker.reconciled.kept == started
            release.set()
            done = await client.wait(turn.turn_id, 10)  # the client reconnects too
            assert client.connections == 2
            events = await client.all_events(sid)
    finally:
        await stopped(worker)
    assert done.status == "completed" and done.output == {"survived": True}
    assert len(started) == 1
    assert kinds(events) == ["admitted", "dispatched", "result", "completed"]


async def test_cancel_is_honoured(server: TurndServer, client: Client, sid: str) -> None:
    worker = Worker(server.url, "w-cancel", cancel_grace=None)
    started = asyncio.Event()
    noticed: list[bool] = []

    @worker.function("wait_for_cancel")
    async def wait_for_cancel(ctx: TurnContext, input: Any) -> Any:
        started.set()
        await ctx.cancelled.wait()
        noticed.append(True)
        raise asyncio.CancelledError

    await serving(worker)
    try:
        turn = (await client.submit(sid, "wait_for_cancel")).turn
        await started.wait()
        stopping = await client.stop(turn.turn_id, "user pressed stop")
        assert stopping.status == "running" and stopping.wait is not None
        assert stopping.wait.state == "cancelling"
        done = await client.wait(turn.turn_id, 5)
    finally:
        await stopped(worker)
    assert noticed == [True]
    assert done.status == "cancelled" and done.stop is not None
    assert done.stop.reason == "user pressed stop"
    result = of_kind(await client.all_events(sid), "result")
    assert [e.detail["outcome"] for e in result] == ["cancelled"]


async def test_handler_ignoring_cancel_is_cancelled_after_grace(
    server: TurndServer, client: Client, sid: str
) -> None:
    worker = Worker(server.url, "w-stubborn", cancel_grace=0.2)
    started = asyncio.Event()

    @worker.function("stubborn")
    async def stubborn(ctx: TurnContext, input: Any) -> Any:
        started.set()
        await asyncio.sleep(30)  # never looks at ctx.cancelled
        return "too late"

    await serving(worker)
    try:
        turn = (await client.submit(sid, "stubborn")).turn
        await started.wait()
        await client.stop(turn.turn_id)
        done = await client.wait(turn.turn_id, 5)
    finally:
        await stopped(worker)
    assert done.status == "cancelled"
    result = of_kind(await client.all_events(sid), "result")
    assert [e.detail["outcome"] for e in result] == ["cancelled"]


async def test_watch_resumes_without_gap_or_repeat(
    server: TurndServer, client: Client, sid: str
) -> None:
    worker = Worker(server.url, "w-watched")

    @worker.function("step")
    async def step(ctx: TurnContext, input: int) -> Any:
        return input

    await serving(worker)
    try:
        async with FrameProxy(server.url) as proxy:
            async with Client(proxy.url) as watcher:
                got: list[Event] = []
                async with watcher.watch(sid, after=0) as events:

                    async def until_completed(turn_id: str) -> None:
                        async for event in events:
                            got.append(event)
                            if event.kind == "completed" and event.turn_id == turn_id:
                                return

                    first = await client.run(sid, "step", 1, timeout=5)
                    await asyncio.wait_for(until_completed(first.turn_id), 5)
                    await proxy.cut(clean=False)
                    # Events written while the watcher is away must arrive after it.
                    second = await client.run(sid, "step", 2, timeout=5)
                    await asyncio.wait_for(until_completed(second.turn_id), 5)
                    assert events.starts == 2
                assert watcher.connections == 2
    finally:
        await stopped(worker)
    assert first.status == second.status == "completed"
    stored = await client.all_events(sid)
    assert [e.seq for e in got] == [e.seq for e in stored] == list(range(1, len(stored) + 1))
    assert got == stored


async def test_submit_without_key_is_not_repeated_but_with_key_is(
    server: TurndServer, sid: str
) -> None:
    async with FrameProxy(server.url) as proxy:
        # The first submit's answer is lost together with its connection.
        async with Client(proxy.url) as c:
            proxy.drop("down", lambda f: "turn" in (f.get("ok") or {}))
            submit = asyncio.ensure_future(c.submit(sid, "f", 1, idempotency_key="once"))
            while not proxy.dropped:
                await asyncio.sleep(0.01)
            await proxy.cut(clean=False)
            submitted = await submit
            assert submitted.deduplicated  # repeated on a new connection, same turn
            assert c.connections == 2
        async with Client(proxy.url) as c:
            proxy.drop("down", lambda f: "turn" in (f.get("ok") or {}))
            submit = asyncio.ensure_future(c.submit(sid, "f", 2))
            while len(proxy.dropped) < 2:
                await asyncio.sleep(0.01)
            await proxy.cut(clean=False)
            # Without a key a repeat could admit a second turn: the caller decides.
            with pytest.raises(ConnectionLost) as lost:
                await submit
            assert lost.value.retryable
    async with Client(server.url) as c:
        page = await c.list(sid)
        assert [t.input for t in page.turns] == [2, 1]  # each admitted once
        assert page.turns[1].turn_id == submitted.turn_id
        await c.stop_session(sid)


async def test_a_close_other_than_1001_does_not_repeat_a_submit_without_key(
    server: TurndServer, sid: str
) -> None:
    # Only a 1001 says the daemon read no request it did not answer; after a 1011
    # (outcome unknown) the unanswered submit may have been admitted.
    async with FrameProxy(server.url) as proxy, Client(proxy.url) as c:
        proxy.drop("down", lambda f: "turn" in (f.get("ok") or {}))
        submit = asyncio.ensure_future(c.submit(sid, "f", 1))
        while not proxy.dropped:
            await asyncio.sleep(0.01)
        await proxy.cut(code=1011)
        with pytest.raises(ConnectionLost) as lost:
            await submit
        assert lost.value.close_code == 1011
        assert c.connections == 1
    async with Client(server.url) as c:
        assert [t.input for t in (await c.list(sid)).turns] == [1]  # admitted once
        await c.stop_session(sid)


async def test_probe_right_after_reconnect_is_answered(
    server: TurndServer, client: Client, sid: str
) -> None:
    # The attempt deadline passes while the worker is away, so the daemon probes in
    # the same breath as it answers hello: the answer must not wait for registration.
    async with FrameProxy(server.url) as proxy:
        worker = Worker(proxy.url, "w-late-probe", reconnect_delay=0.05, auto_heartbeat=False)
        started: list[str] = []

        @worker.function("work", timeout_ms=300)
        async def work(ctx: TurnContext, input: Any) -> Any:
            started.append(ctx.invocation_id)
            await ctx.cancelled.wait()
            return "finished when asked"

        await serving(worker)
        try:
            turn = (await client.submit(sid, "work")).turn
            while not started:
                await asyncio.sleep(0.01)
            proxy.refusing = True
            await proxy.cut(clean=False)
            await asyncio.sleep(0.6)  # past the 300 ms deadline, within the grace
            # The probe overtakes the answer to the registration on the new connection.
            proxy.delay("down", lambda f: "workers" in (f.get("ok") or {}), 0.5)
            proxy.refusing = False
            done = await client.wait(turn.turn_id, 5)
        finally:
            await stopped(worker)
    statuses = [f for d, f in proxy.seen if d == "up" and f.get("op") == "invocation.status"]
    assert [s["args"]["state"] for s in statuses] == ["running"]
    assert done.status == "completed" and done.output == "finished when asked"
    assert "probe_sent" in kinds(await client.all_events(sid))


async def test_restarted_worker_is_a_new_instance(
    server: TurndServer, client: Client, sid: str
) -> None:
    started = asyncio.Event()

    def make(name: str) -> Worker:
        worker = Worker(server.url, "w-reborn")

        @worker.function("work", delivery="at_least_once", max_attempts=3)
        async def work(ctx: TurnContext, input: Any) -> Any:
            started.set()
            if name == "old":
                await asyncio.sleep(30)  # dies with its process
            return {"by": name, "attempt": ctx.attempt}

        return worker

    old = await serving(make("old"))
    turn = (await client.submit(sid, "work")).turn
    await started.wait()
    first = (await client.get(turn.turn_id)).wait
    await stopped(old)  # the process is gone; its instance id with it
    new = await serving(make("new"))
    try:
        done = await client.wait(turn.turn_id, 5)
    finally:
        await stopped(new)
    assert new.instance_id != old.instance_id
    assert first is not None and new.reconciled is not None
    assert new.reconciled.unknown == [first.invocation_id]
    assert done.status == "completed" and done.output == {"by": "new", "attempt": 2}
