"""The examples in examples/python run against the real daemon."""

from __future__ import annotations

import asyncio
import importlib.util
import socket
import sys
from pathlib import Path
from types import ModuleType

import pytest

import turnd
from turnd import WorkerState
from turnd.testing import TurndServer

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "python"


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


async def test_agent_worker_and_caller(
    server: TurndServer, capsys: pytest.CaptureFixture[str]
) -> None:
    agent = load("agent_worker")
    caller = load("caller")
    worker = agent.worker
    worker.url = server.url
    async with worker:
        await worker.wait_state(WorkerState.CONNECTED, 10)
        question = 'What is [6*7] and [2**10], and how long is "the quick brown fox"?'
        turn = await caller.ask(server.url, "conv", question, None)
    assert turn.status == "completed"
    assert turn.output == {
        "answer": "calculate('6*7') = 42.0; calculate('2**10') = 1024.0; "
        "word_count('the quick brown fox') = 4",
        "steps": 4,
    }
    printed = capsys.readouterr().out
    assert printed.count(" dispatched ") == 5 and " completed " in printed


async def test_streaming_echo_prints_tokens_as_they_come(
    server: TurndServer, capsys: pytest.CaptureFixture[str]
) -> None:
    echo = load("streaming_echo")
    echo.worker.url = server.url
    async with echo.worker:
        await echo.worker.wait_state(WorkerState.CONNECTED, 10)
        turn = await echo.ask(server.url, "echo", "the quick brown fox")
    assert turn.status == "completed" and turn.output == {"text": "the quick brown fox"}
    assert capsys.readouterr().out == "the quick brown fox\n"
    assert echo.worker.stats.progress_sent == 4


async def test_approval_waits_for_the_answer_without_a_worker(server: TurndServer) -> None:
    approval = load("approval")
    approval.worker.url = server.url
    async with approval.worker:
        await approval.worker.wait_state(WorkerState.CONNECTED, 10)
        asked = await approval.request(server.url, "deploys", "billing")
        refused = await approval.request(server.url, "deploys-2", "search")
        assert asked.wait is not None and asked.wait.state == "awaiting_input"
        assert asked.input_request.prompt == "Deploy billing latest to production? (yes/no)"
        await approval.worker.settled(5)  # no handler holds the wait
        done = await approval.answer(server.url, asked.turn_id, True)
        no = await approval.answer(server.url, refused.turn_id, False)
    assert done.status == "completed"
    assert done.output == {
        "deployed": True,
        "plan": {"service": "billing", "version": "latest"},
        "by": "cli",
    }
    assert no.status == "completed" and no.output["deployed"] is False


async def test_chat_second_message_interrupts_the_first(
    server: TurndServer, capsys: pytest.CaptureFixture[str]
) -> None:
    chat = load("chat")
    chat.worker.url = server.url
    async with turnd.Client(server.url) as c, chat.worker:
        await chat.worker.wait_state(WorkerState.CONNECTED, 10)
        first = asyncio.create_task(chat.say(server.url, "chat", "tell me a story"))
        # Interrupt once the first answer has said its first sentence.
        while not [t for t in (await c.list("chat")).turns if t.step >= 2]:
            await asyncio.sleep(0.02)
        second = await chat.say(server.url, "chat", "a short one")
        stopped = await first
    assert stopped.status == "cancelled" and stopped.stop is not None
    assert stopped.stop.reason == "interrupted"
    assert second.status == "completed"
    assert second.output["reply"].startswith("(You cut me off after: 'You said: tell me a story.'")
    printed = capsys.readouterr().out
    assert "You said: a short one. That is worth a long answer." in printed


def dead_url() -> str:
    """A URL nobody listens on (a port bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"ws://127.0.0.1:{port}/v1"


async def test_the_caller_takes_a_cluster_list_of_urls(server: TurndServer) -> None:
    """``--url`` takes a cluster's nodes' URLs: with the first one down, the caller
    example connects to the next and its turn completes."""
    agent = load("agent_worker")
    worker = agent.worker
    worker.url = server.url
    async with worker:
        await worker.wait_state(WorkerState.CONNECTED, 10)
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(EXAMPLES / "caller.py"),
            "what is [6*7]?",
            "--url",
            f"{dead_url()},{server.url}",
            "--session",
            "listed",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, err.decode()
    assert out.decode().strip().splitlines()[-1].startswith("completed"), out.decode()
