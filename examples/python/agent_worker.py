"""An agent-style worker: a turn plans, calls tools step by step, then answers.

Each tool call is its own step (``Continue``), so the daemon records progress after
every step: if this process dies mid-turn, the turn resumes from the last finished
step on another worker instead of starting over. The "model" here is a tiny
rule-based planner so the example runs anywhere; put an LLM call in ``plan()``.

    python examples/python/agent_worker.py --url ws://127.0.0.1:7420/v1
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import logging
import operator
import re
from typing import Any

from turnd import Continue, Fail, TurnContext, Worker

_OPS: dict[type, Any] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
}


def calculate(expression: str) -> float:
    """Evaluate + - * / ** on numbers, nothing else."""

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return float(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return float(_OPS[type(node.op)](ev(node.left), ev(node.right)))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return float(_OPS[type(node.op)](ev(node.operand)))
        raise Fail("bad_expression", f"cannot evaluate {ast.dump(node)}")

    return ev(ast.parse(expression, mode="eval").body)


def word_count(text: str) -> int:
    return len(text.split())


TOOLS = {"calculate": calculate, "word_count": word_count}


def plan(question: str) -> list[dict[str, str]]:
    """Decide which tool calls answer the question (an LLM would go here)."""
    calls = [{"tool": "calculate", "arg": m.strip()} for m in re.findall(r"\[([^\]]+)\]", question)]
    quoted = re.findall(r'"([^"]+)"', question)
    calls += [{"tool": "word_count", "arg": q} for q in quoted]
    return calls


worker = Worker("ws://127.0.0.1:7420/v1", worker_id="agent-1")


@worker.function("agent.step", concurrency=8, timeout_ms=60_000, delivery="at_least_once")
async def step(ctx: TurnContext, state: dict[str, Any]) -> dict[str, Any] | Continue:
    """Step 0 plans; each later step runs one tool call; the last step answers."""
    if ctx.step == 0:
        calls = plan(str(state["question"]))
        ctx.log.info("planned %d tool calls", len(calls))
        return Continue({"question": state["question"], "todo": calls, "done": []})
    if ctx.cancelled.is_set():
        raise asyncio.CancelledError
    todo: list[dict[str, str]] = state["todo"]
    if todo:
        call, rest = todo[0], todo[1:]
        result = TOOLS[call["tool"]](call["arg"])
        await asyncio.sleep(0.05)  # a real tool would do I/O here
        done = [*state["done"], {**call, "result": result}]
        return Continue({**state, "todo": rest, "done": done})
    lines = [f"{c['tool']}({c['arg']!r}) = {c['result']}" for c in state["done"]]
    return {"answer": "; ".join(lines) or "nothing to do", "steps": ctx.step}


def url_list(value: str) -> list[str]:
    """``--url``: one URL, or a cluster's nodes' URLs separated by commas."""
    return [u.strip() for u in value.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--url",
        type=url_list,
        default=url_list("ws://127.0.0.1:7420/v1"),
        help="one URL, or a cluster's nodes' URLs separated by commas",
    )
    parser.add_argument("--worker-id", default="agent-1")
    parser.add_argument("--token", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    worker.url, worker.worker_id, worker.name, worker.token = (
        args.url,
        args.worker_id,
        args.worker_id,
        args.token,
    )
    worker.run()  # until SIGTERM / Ctrl-C, then drains


if __name__ == "__main__":
    main()
