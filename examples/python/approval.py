"""An approval step: the worker plans a deployment, then suspends the turn to ask a
person before it acts; the caller answers by resuming the turn.

    python examples/python/approval.py worker &
    python examples/python/approval.py request billing      # prints the turn id and the question
    python examples/python/approval.py answer TURN_ID yes   # resumes it; prints what was done

While it waits, the turn holds its session (later messages queue behind it) but no
worker: the worker's slot is free, and the wait survives restarts of the daemon and
of the worker. ``turnd.Client.get(turn_id).input_request`` shows the question.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from typing import Any

import turnd
from turnd import Resumed, Suspend, TurnContext, Worker

worker = Worker("ws://127.0.0.1:7420/v1", worker_id="deployer-1")


@worker.function("deploy.plan", concurrency=8, timeout_ms=60_000)
async def deploy(ctx: TurnContext, input: Any) -> Suspend | dict[str, Any]:
    answer = Resumed.parse(input)
    if answer is None or answer.state.get("waiting") != "approval":
        # Step 0: plan, then ask. The state says what it waits for, so the next step
        # knows its input is the answer.
        plan = {"service": input["service"], "version": input.get("version", "latest")}
        question = f"Deploy {plan['service']} {plan['version']} to production? (yes/no)"
        return Suspend({"waiting": "approval", "plan": plan}, prompt=question, timeout_ms=3_600_000)
    plan = answer.state["plan"]
    if answer.input is None or answer.input.get("approved") is not True:
        return {"deployed": False, "plan": plan, "by": None}
    ctx.log.info("deploying %s", plan)  # the real deployment goes here
    return {"deployed": True, "plan": plan, "by": answer.input.get("by")}


async def request(
    url: str | list[str], session_id: str, service: str, token: str | None = None
) -> turnd.Turn:
    """Submit a deployment and return its turn once it waits for an answer."""
    async with turnd.Client(url, token=token) as client:
        submitted = await client.submit(session_id, "deploy.plan", {"service": service})
        async for item in client.stream(submitted.turn_id):
            if item.kind in ("suspended", "completed", "failed", "cancelled"):
                break
        return await client.get(submitted.turn_id)


async def answer(
    url: str | list[str], turn_id: str, yes: bool, token: str | None = None
) -> turnd.Turn:
    """Resume the waiting turn with the answer and wait for what it did."""
    async with turnd.Client(url, token=token) as client:
        # The key makes a repeated answer (a retry after a lost connection) harmless.
        await client.resume(
            turn_id, {"approved": yes, "by": "cli"}, idempotency_key=f"answer-{turn_id}"
        )
        return await client.wait(turn_id, timeout=60)


def url_list(value: str) -> list[str]:
    """``--url``: one URL, or a cluster's nodes' URLs separated by commas."""
    return [u.strip() for u in value.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--url",
        type=url_list,
        default=url_list("ws://127.0.0.1:7420/v1"),
        help="one URL, or a cluster's nodes' URLs separated by commas",
    )
    parser.add_argument("--token", default=None)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("worker", help="serve deploy.plan until SIGTERM / Ctrl-C")
    req = sub.add_parser("request", help="ask for a deployment")
    req.add_argument("service")
    req.add_argument("--session", default="deploys")
    ans = sub.add_parser("answer", help="approve or refuse a waiting deployment")
    ans.add_argument("turn_id")
    ans.add_argument("answer", choices=["yes", "no"])
    args = parser.parse_args()
    if args.command == "worker":
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
        worker.url, worker.token = args.url, args.token
        worker.run()
    elif args.command == "request":
        turn = asyncio.run(request(args.url, args.session, args.service, args.token))
        if turn.input_request is None:
            sys.exit(f"turn {turn.turn_id} is {turn.status}, not waiting")
        print(f"{turn.turn_id} asks: {turn.input_request.prompt}")
    else:
        turn = asyncio.run(answer(args.url, args.turn_id, args.answer == "yes", args.token))
        print(f"{turn.turn_id} {turn.status}: {turn.output}")


if __name__ == "__main__":
    main()
