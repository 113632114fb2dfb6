"""A worker given several URLs, as for a cluster's nodes, through two real daemons.

Two independent ``turnd serve`` processes stand for two nodes: each dispatches only
its own turns, and neither knows the other's invocations, so every request of an
invocation must reach the daemon that dispatched it (a cluster node would forward
it; these do not).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from turnd import Client, ShuttingDown, TurnContext, Worker, WorkerState

from .conftest import ServerFactory, kinds
from .proxy import FrameProxy


async def test_a_worker_serves_the_turns_of_both_daemons(
    make_server: ServerFactory, sid: str
) -> None:
    a, b = await make_server(), await make_server()
    worker = Worker([a.url, b.url], "w-both")
    served: list[str] = []

    @worker.function("echo")
    async def echo(ctx: TurnContext, input: Any) -> Any:
        served.append(input)
        return {"echo": input}

    async with worker, Client(a.url) as on_a, Client(b.url) as on_b:
        await worker.wait_state(WorkerState.CONNECTED, 10)
        done_a = await on_a.run(sid, "echo", "a", timeout=10)
        done_b = await on_b.run(sid, "echo", "b", timeout=10)
        seen = [await on_a.workers(), await on_b.workers()]
    assert done_a.status == "completed" and done_a.output == {"echo": "a"}
    assert done_b.status == "completed" and done_b.output == {"echo": "b"}
    assert sorted(served) == ["a", "b"]
    # One worker, one instance, attached to each daemon.
    for workers in seen:
        assert [(w.worker_id, w.instance_id) for w in workers] == [("w-both", worker.instance_id)]
    assert worker.stats.connections == 2


async def test_connected_waits_for_every_url(make_server: ServerFactory, sid: str) -> None:
    a, b = await make_server(), await make_server()
    async with FrameProxy(b.url) as to_b:
        to_b.refusing = True
        worker = Worker([a.url, to_b.url], "w-wait", reconnect_delay=0.05, reconnect_max_delay=0.1)

        @worker.function("echo")
        async def echo(ctx: TurnContext, input: Any) -> Any:
            return input

        async with worker, Client(a.url) as on_a:
            # The reachable daemon is served meanwhile, but the worker is not connected.
            done = await on_a.run(sid, "echo", 1, timeout=10)
            assert done.status == "completed"
            assert worker.state != WorkerState.CONNECTED
            to_b.refusing = False
            await worker.wait_state(WorkerState.CONNECTED, 10)
            assert worker.stats.connections == 2


async def test_a_result_waits_for_the_daemon_that_dispatched_it(
    make_server: ServerFactory, sid: str
) -> None:
    a, b = await make_server(), await make_server()
    release = asyncio.Event()
    started: list[str] = []
    cancelled: list[str] = []
    async with FrameProxy(a.url) as to_a:
        worker = Worker([to_a.url, b.url], "w-home", reconnect_delay=0.05, reconnect_max_delay=0.1)

        # A short timeout: heartbeats go out every 0.2 s, to b while a is cut off.
        @worker.function("work", timeout_ms=600)
        async def work(ctx: TurnContext, input: Any) -> Any:
            started.append(ctx.invocation_id)
            await release.wait()
            if ctx.cancelled.is_set():
                cancelled.append(ctx.invocation_id)
            return {"done": input}

        async with worker, Client(a.url) as on_a:
            await worker.wait_state(WorkerState.CONNECTED, 10)
            turn = (await on_a.submit(sid, "work", 5)).turn
            while not started:
                await asyncio.sleep(0.01)
            to_a.refusing = True
            await to_a.cut(clean=False)
            await worker.wait_state(WorkerState.DISCONNECTED, 5)
            await asyncio.sleep(0.5)  # heartbeats meanwhile reach b only
            release.set()
            # The result goes out on b, the one connection up: b never stored the
            # invocation, so the worker keeps the result for a.
            while worker.stats.results_sent == 0:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)
            assert worker.pending == ([], started)
            to_a.refusing = False
            done = await on_a.wait(turn.turn_id, 10)
            await worker.settled(5)
            events = await on_a.all_events(sid)
    assert done.status == "completed" and done.output == {"done": 5}
    assert len(started) == 1 and cancelled == []
    assert kinds(events) == ["admitted", "dispatched", "result", "completed"]
    hellos = [f for d, f in to_a.seen if d == "up" and f.get("op") == "hello"]
    assert hellos[-1]["args"]["finished"] == started


async def test_a_probe_after_a_restart_is_answered_from_every_connection(
    make_server: ServerFactory, sid: str
) -> None:
    a, b = await make_server(), await make_server()
    worker = Worker(
        [a.url, b.url],
        "w-probe",
        reconnect_delay=0.05,
        reconnect_max_delay=0.1,
        auto_heartbeat=False,  # the deadline passes while b is down: a probe at once
        cancel_grace=None,
    )
    started: list[str] = []

    @worker.function("work", timeout_ms=300)
    async def work(ctx: TurnContext, input: Any) -> Any:
        started.append(ctx.invocation_id)
        await ctx.cancelled.wait()  # the cancel that follows the answer "running"
        return {"ran": True}

    async with worker:
        await worker.wait_state(WorkerState.CONNECTED, 10)
        async with Client(b.url) as on_b:
            turn = (await on_b.submit(sid, "work")).turn
            while not started:
                await asyncio.sleep(0.01)
            await b.kill()
            await asyncio.sleep(0.5)  # past the attempt's deadline
            await b.start()
            done = await on_b.wait(turn.turn_id, 10)
            events = await on_b.all_events(sid)
    assert done.status == "completed" and done.output == {"ran": True}
    assert len(started) == 1
    assert kinds(events) == [
        "admitted",
        "dispatched",
        "probe_sent",
        "cancel_sent",
        "result",
        "completed",
    ]
    assert worker.stats.probes_answered == 1


async def test_a_client_takes_the_first_url_that_answers_and_moves_on(
    make_server: ServerFactory,
) -> None:
    a, b = await make_server(), await make_server()
    async with FrameProxy(a.url) as to_a, FrameProxy(b.url) as to_b:
        to_a.refusing = True
        async with Client([to_a.url, to_b.url], reconnect_timeout=3) as c:
            assert c.url == to_b.url
            to_a.refusing = False
            to_b.refusing = True
            await to_b.cut(clean=False)
            await c.stats()  # reconnects, on the next URL
            assert c.url == to_a.url
            assert c.connections == 2 and to_a.connections == 1


async def turns_held(url: str) -> int:
    """Turns the daemon at ``url`` holds, in any state."""
    async with Client(url) as c:
        return sum((await c.stats())["turns"].values())


async def test_submits_a_stopping_daemon_never_read_are_sent_again_and_run_once(
    make_server: ServerFactory,
) -> None:
    """A daemon that shuts down answers every request it read and closes with 1001:
    a request it never read changed nothing, so the client sends it again to the next
    URL, whatever its op. Clients submitting turns without idempotency keys, many in
    flight on each connection, across a SIGTERM of A: no submit fails unanswered, and
    A (restarted) and B together hold exactly the turns acknowledged."""
    clients, in_flight = 4, 8
    a, b = await make_server(), await make_server()
    acked = on_b = 0
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 20

    async def submitter(c: Client, name: str) -> None:
        nonlocal acked, on_b
        k = 0
        # Until 200 submits went to B after A stopped (bounded in time).
        while on_b < 200:
            assert loop.time() < deadline, "A's stop did not move the clients to B in 20 s"
            # A session per submit: no per-session queue limit is met.
            try:
                await c.submit(f"{name}-{k}", "nobody", 1)
                acked += 1
                if c.url == b.url:
                    on_b += 1
            except ShuttingDown:
                pass  # an answer: nothing was created; a new submit follows
            k += 1

    async def client(t: int) -> None:
        async with Client([a.url, b.url], reconnect_timeout=10) as c:
            await asyncio.gather(*(submitter(c, f"s{t}-{i}") for i in range(in_flight)))

    tasks = asyncio.gather(*(client(t) for t in range(clients)))
    # Let the clients run on A (B is their second URL) until it acknowledged a hundred
    # submits, then stop it while they send.
    wait_until = loop.time() + 10
    try:
        while acked < 100 and not tasks.done():
            assert loop.time() < wait_until, f"only {acked} submits acknowledged by A in 10 s"
            await asyncio.sleep(0.01)
    except BaseException:
        # No client outlives the test: its submitters would go on against the daemons.
        tasks.cancel()
        with contextlib.suppress(BaseException):
            await tasks
        raise
    deadline = loop.time() + 20  # for the submitters, from A's stop on
    await a.stop()
    await tasks
    await a.start()  # on its data directory
    held_a, held_b = await turns_held(a.url), await turns_held(b.url)
    print(f"acknowledged {acked}: A holds {held_a}, B holds {held_b}")
    assert held_a > 0 and held_b > 0, "both daemons took submits"
    assert held_a + held_b == acked, f"acknowledged {acked}: A holds {held_a}, B {held_b}"
