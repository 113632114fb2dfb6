"""The examples in examples/python run against the real daemon."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

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
