"""Turns of agents through the real daemon: progress streamed to a turn's stream and
to watches, suspend for input and resume, and what a second message does
(``on_busy``)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest

import turnd
from turnd import (
    Client,
    Event,
    Previous,
    Progress,
    ProgressDropped,
    Resumed,
    Suspend,
    TurnContext,
    Worker,
)
from turnd.testing import TurndServer

from .conftest import kinds
from .proxy import FrameProxy, is_push
from .test_basic import serving


async def until_wait_state(client: Client, turn_id: str, state: str) -> turnd.Turn:
    for _ in range(500):
        turn = await client.get(turn_id)
        if turn.wait is not None and turn.wait.state == state:
            return turn
        await asyncio.sleep(0.02)
    raise AssertionError(f"{turn_id} never reached {state}: {turn}")


async def test_a_stream_yields_progress_in_order_and_ends_with_the_turn(
    server: TurndServer, client: Client, sid: str
) -> None:
    go, finish = asyncio.Event(), asyncio.Event()
    seqs: list[int] = []
    worker = Worker(server.url, "w-stream")

    @worker.function("model")
    async def model(ctx: TurnContext, input: Any) -> Any:
        await go.wait()
        for token in ["Hel", "lo", ",", " world"]:
            await ctx.progress({"token": token})
        await finish.wait()
        seqs.append(ctx.progress_seq)
        return "Hello, world"

    await serving(worker)
    items: list[Any] = []
    session_items: list[Any] = []
    try:
        turn_id = (await client.submit(sid, "model")).turn_id
        async with client.watch(sid, after=0) as plain:
            async for item in client.stream(turn_id):
                items.append(item)
                if isinstance(item, Event) and item.kind == "dispatched":
                    go.set()
                if isinstance(item, Progress) and item.seq == 4:
                    # The last frame is readable while the step runs, then gone.
                    live = await client.get(turn_id)
                    assert live.progress is not None
                    assert (live.progress.seq, live.progress.data) == (4, {"token": " world"})
                    assert live.progress.invocation_id == item.invocation_id
                    finish.set()
            async for event in plain:
                session_items.append(event)
                if event.kind == "completed":
                    break
        done = await client.get(turn_id)
    finally:
        await worker.__aexit__(None, None, None)
    progress = [i for i in items if isinstance(i, Progress)]
    assert [p.data["token"] for p in progress] == ["Hel", "lo", ",", " world"]
    assert [p.seq for p in progress] == [1, 2, 3, 4]
    assert {(p.turn_id, p.step, p.attempt) for p in progress} == {(turn_id, 0, 1)}
    assert not [i for i in items if isinstance(i, ProgressDropped)]
    # The stream ended right after the terminal event.
    assert isinstance(items[-1], Event) and items[-1].kind == "completed"
    assert done.status == "completed" and done.output == "Hello, world"
    assert done.progress is None
    assert seqs == [4] and worker.stats.progress_sent == 4
    # A watch that did not ask for progress gets events only.
    assert all(isinstance(i, Event) for i in session_items)


async def test_a_stream_of_a_finished_turn_ends_after_its_events(
    server: TurndServer, client: Client, sid: str
) -> None:
    worker = Worker(server.url, "w-finished")

    @worker.function("echo")
    async def echo(ctx: TurnContext, input: Any) -> Any:
        return input

    await serving(worker)
    try:
        turn = await client.run(sid, "echo", 7, timeout=10)
    finally:
        await worker.__aexit__(None, None, None)
    seen = [item.kind async for item in client.stream(turn.turn_id)]
    assert seen == ["admitted", "dispatched", "result", "completed"]


async def test_progress_lost_on_the_way_is_marked_and_a_stream_resumes_after_a_cut(
    server: TurndServer, sid: str
) -> None:
    step = asyncio.Queue[int]()
    worker = Worker(server.url, "w-gaps")

    @worker.function("model")
    async def model(ctx: TurnContext, input: Any) -> Any:
        while (n := await step.get()) > 0:
            await ctx.progress(n)
        return "done"

    await serving(worker)

    async def sent(n: int) -> None:
        for _ in range(500):
            if worker.stats.progress_sent >= n:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"the daemon took {worker.stats.progress_sent} frames, not {n}")

    items: list[Any] = []
    tasks: list[asyncio.Task[None]] = []
    try:
        async with FrameProxy(server.url) as proxy, Client(proxy.url) as c:
            # Frame 2 never reaches the watcher: the daemon did not drop it, so only
            # the SDK can tell. Frame 4 arrives as the daemon's own marker for it, as
            # for a watcher that read too slowly: the SDK must not count it again.
            proxy.drop("down", lambda f: is_push("progress")(f) and f.get("seq") == 2)
            proxy.rewrite(
                "down",
                lambda f: is_push("progress")(f) and f.get("seq") == 4,
                lambda f: {
                    "push": "progress_dropped",
                    **{k: f[k] for k in ("watch_id", "turn_id", "invocation_id")},
                    "count": 1,
                },
            )
            turn_id = (await c.submit(sid, "model", idempotency_key="k")).turn_id
            stream = c.stream(turn_id)
            async for item in stream:
                items.append(item)
                if isinstance(item, Event) and item.kind == "dispatched":
                    for n in (1, 2, 3, 4, 5):
                        step.put_nowait(n)
                if isinstance(item, Progress) and item.seq == 5:
                    proxy.refusing = True
                    await proxy.cut(clean=False)
                    for n in (6, 7):  # sent while the watcher is away
                        step.put_nowait(n)

                    async def come_back() -> None:
                        await sent(7)
                        proxy.refusing = False
                        while stream.starts < 2:  # the stream reopens as it is read
                            await asyncio.sleep(0.01)
                        for n in (8, 9, 0):
                            step.put_nowait(n)

                    tasks.append(asyncio.create_task(come_back()))
            assert stream.starts == 2 and c.connections == 2
            await tasks[0]
    finally:
        await worker.__aexit__(None, None, None)
    frames = [i for i in items if not isinstance(i, Event)]
    progress = [i.seq for i in frames if isinstance(i, Progress)]
    dropped = [i.count for i in frames if isinstance(i, ProgressDropped)]
    invocation_id = frames[0].invocation_id
    assert frames[:5] == [
        Progress(turn_id, invocation_id, 0, 1, 1, 1),
        ProgressDropped(turn_id, invocation_id, 1),  # 2, made by the SDK
        Progress(turn_id, invocation_id, 0, 1, 3, 3),
        ProgressDropped(turn_id, invocation_id, 1),  # 4, the daemon's
        Progress(turn_id, invocation_id, 0, 1, 5, 5),
    ]
    assert isinstance(frames[5], ProgressDropped)  # 6 and 7, sent while away
    assert progress[-1] == 9
    # Every frame is either seen or counted as lost, whatever the daemon dropped
    # itself while the reopened watch replayed.
    assert len(progress) + sum(dropped) == 9
    events = [i for i in items if isinstance(i, Event)]
    assert kinds(events) == ["admitted", "dispatched", "result", "completed"]


async def test_progress_of_an_interrupted_invocation_is_refused_and_reaches_no_one(
    server: TurndServer, client: Client, sid: str
) -> None:
    started, interrupted = asyncio.Event(), asyncio.Event()
    seen_previous: list[Previous | None] = []
    stale: list[bool] = []
    worker = Worker(server.url, "w-interrupt", cancel_grace=None)

    @worker.function("chat", concurrency=2)
    async def chat(ctx: TurnContext, input: Any) -> Any:
        if ctx.step == 0 and input == "first":
            return turnd.Continue({"said": "first", "draft": "Once upon"})
        if ctx.step == 1:
            started.set()
            await ctx.cancelled.wait()  # the cancel of the interrupt
            await interrupted.wait()
            await ctx.progress("from the interrupted turn")
            # The refusal comes back on its own: wait for it, within a bound.
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 10
            while not ctx.stale and loop.time() < deadline:
                await asyncio.sleep(0.01)
            stale.append(ctx.stale)
            return "too late"
        seen_previous.append(ctx.previous)
        return {"reply": input}

    await serving(worker)
    try:
        first = (await client.submit(sid, "chat", "first")).turn_id
        await asyncio.wait_for(started.wait(), 10)
        async with client.watch(sid, progress=True) as items:
            second = await client.submit(sid, "chat", "second", on_busy="interrupt")
            interrupted.set()
            done = await client.wait(second.turn_id, 10)
            got: list[Any] = []
            async for item in items:
                got.append(item)
                if isinstance(item, Event) and item.kind == "completed":
                    break
        stopped = await client.get(first)
    finally:
        await worker.__aexit__(None, None, None)
    assert done.status == "completed" and done.output == {"reply": "second"}
    assert seen_previous == [Previous(first, "cancelled", {"said": "first", "draft": "Once upon"})]
    assert stopped.status == "cancelled" and stopped.stop is not None
    assert stopped.stop.reason == "interrupted" and not stopped.superseded
    assert not [i for i in got if not isinstance(i, Event)]
    assert worker.stats.progress_refused == 1 and worker.stats.progress_sent == 0
    assert stale == [True]


async def test_rollback_marks_the_stopped_turn_superseded_and_reject_stores_nothing(
    server: TurndServer, client: Client, sid: str
) -> None:
    first = await client.submit(sid, "nobody", "first")
    with pytest.raises(turnd.Busy) as busy:
        await client.submit(sid, "nobody", "again", on_busy="reject", idempotency_key="r")
    assert busy.value.code == "busy" and not busy.value.retryable
    assert [t.turn_id for t in (await client.list(sid)).turns] == [first.turn_id]
    second = await client.submit(sid, "nobody", "second", on_busy="rollback")
    assert not second.deduplicated
    stopped = await client.get(first.turn_id)
    assert stopped.status == "cancelled" and stopped.superseded
    # The key of the rejected submit was not kept: a later submit with it is admitted.
    again = await client.submit(sid, "nobody", "third", idempotency_key="r")
    assert not again.deduplicated
    listed = {t.turn_id: t.superseded for t in (await client.list(sid)).turns}
    assert listed == {first.turn_id: True, second.turn_id: False, again.turn_id: False}
    await client.stop_session(sid)


async def test_suspend_frees_the_worker_and_resume_runs_the_next_step(
    server: TurndServer, client: Client, sid: str
) -> None:
    steps: list[tuple[int, Any]] = []
    worker = Worker(server.url, "w-approve")

    @worker.function("deploy", concurrency=1)
    async def deploy(ctx: TurnContext, input: Any) -> Any:
        answer = Resumed.parse(input)
        steps.append((ctx.step, answer))
        if answer is None:
            return Suspend(
                {"waiting": "approval", "plan": input}, prompt="deploy?", timeout_ms=60_000
            )
        return {"deployed": answer.input["ok"], "plan": answer.state["plan"]}

    await serving(worker)
    try:
        turn_id = (await client.submit(sid, "deploy", "v2")).turn_id
        waiting = await until_wait_state(client, turn_id, "awaiting_input")
        # The worker's one slot is free: another session's turn runs meanwhile.
        other = (await client.submit(f"{sid}-b", "deploy", "v3")).turn_id
        await until_wait_state(client, other, "awaiting_input")
        assert waiting.status == "running" and waiting.input_request is not None
        assert waiting.input_request.prompt == "deploy?"
        assert waiting.input_request.on_timeout == "fail"
        assert waiting.input_request.deadline_ms == waiting.wait.deadline_ms  # type: ignore[union-attr]
        lock = (await client.inspect(sid)).lock
        assert lock is not None and lock.wait is not None and lock.wait.state == "awaiting_input"
        resumed = await client.resume(turn_id, {"ok": True}, idempotency_key="yes")
        again = await client.resume(turn_id, {"ok": True}, idempotency_key="yes")
        with pytest.raises(turnd.Conflict):
            await client.resume(turn_id, {"ok": False})
        done = await client.wait(turn_id, 10)
        assert (await client.stop(other)).status == "cancelled"  # at once, no worker asked
    finally:
        await worker.__aexit__(None, None, None)
    assert not resumed.deduplicated and again.deduplicated and again.turn_id == turn_id
    assert done.status == "completed" and done.output == {"deployed": True, "plan": "v2"}
    assert done.input_request is None
    assert steps[0] == (0, None) and steps[-1][0] == 1
    assert steps[-1][1] == Resumed({"waiting": "approval", "plan": "v2"}, {"ok": True})
    events = kinds(await client.all_events(sid))
    assert events.count("suspended") == 1 and events.count("resumed") == 1


async def test_the_input_deadline_fails_or_continues(
    server: TurndServer, client: Client, sid: str
) -> None:
    got: list[Resumed | None] = []
    worker = Worker(server.url, "w-deadline")

    @worker.function("ask")
    async def ask(ctx: TurnContext, input: Any) -> Any:
        if ctx.step == 0:
            return Suspend({"asked": True}, prompt="?", timeout_ms=200, on_timeout=input)
        got.append(Resumed.parse(input))
        return "went on"

    await serving(worker)
    try:
        failed = await client.run(sid, "ask", "fail", timeout=10)
        went_on = await client.run(sid, "ask", "continue", timeout=10)
    finally:
        await worker.__aexit__(None, None, None)
    assert failed.status == "failed" and failed.error is not None
    assert failed.error.cause == "input_timeout"
    assert went_on.status == "completed" and got == [Resumed({"asked": True}, None)]


async def test_resume_of_a_turn_not_awaiting_input_changes_nothing(
    client: Client, sid: str
) -> None:
    queued = await client.submit(sid, "nobody", 1)
    events = await client.all_events(sid)
    with pytest.raises(turnd.Conflict) as conflict:
        await client.resume(queued.turn_id, "yes")
    assert not conflict.value.retryable
    with pytest.raises(turnd.NotFound):
        await client.resume("t_00000000000000000000000000", "yes")
    after = await client.get(queued.turn_id)
    # The wait's reason says how long ago it began: everything else is as it was.
    assert after.status == "queued" and replace(after, wait=None) == replace(queued.turn, wait=None)
    assert await client.all_events(sid) == events
    await client.stop_session(sid)


def test_suspend_resumed_and_previous_without_a_daemon() -> None:
    assert Suspend().outcome() == {"suspend": {"state": None}}
    full = Suspend([1], prompt={"q": "ok?"}, timeout_ms=5, on_timeout="continue").outcome()
    assert full == {
        "suspend": {"state": [1], "prompt": {"q": "ok?"}, "timeout_ms": 5, "on_timeout": "continue"}
    }
    for bad in ({"timeout_ms": 0}, {"timeout_ms": -1}, {"on_timeout": "retry"}):
        with pytest.raises(ValueError):
            Suspend(None, **bad)
    assert Resumed.parse({"state": 1, "input": None}) == Resumed(1, None)
    assert Resumed.parse({"state": 1, "input": 2, "more": 3}) is None
    assert Resumed.parse([1, 2]) is None
    assert Previous.from_wire({"turn_id": "t_1", "status": "cancelled", "state": 3}) == Previous(
        "t_1", "cancelled", 3
    )
    assert Previous.from_wire(None) is None
