"""A streaming echo "model": the worker answers token by token with ``ctx.progress``,
the caller prints each token as it comes, then the whole answer.

    python examples/python/streaming_echo.py worker &
    python examples/python/streaming_echo.py ask "the quick brown fox"

Progress is not durable: a caller that connects late reads the last token with
``client.get(turn_id).progress``, and the answer is the turn's ``output``. Put a
real model's token stream in ``generate()``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import AsyncIterator
from typing import Any

import turnd
from turnd import Progress, ProgressDropped, TurnContext, Worker

worker = Worker("ws://127.0.0.1:7420/v1", worker_id="echo-model-1")


async def generate(prompt: str, delay: float) -> AsyncIterator[str]:
    """The "model": echoes the prompt word by word."""
    await asyncio.sleep(delay * 4)  # time to the first token
    for n, word in enumerate(prompt.split()):
        await asyncio.sleep(delay)
        yield word if n == 0 else f" {word}"


@worker.function("echo.model", concurrency=16, timeout_ms=60_000)
async def model(ctx: TurnContext, input: dict[str, Any]) -> dict[str, Any]:
    text = ""
    async for token in generate(str(input["prompt"]), float(input.get("delay", 0.05))):
        await ctx.progress({"token": token})  # returns at once; never raises for the daemon
        text += token
    return {"text": text}


async def ask(
    url: str | list[str], session_id: str, prompt: str, token: str | None = None
) -> turnd.Turn:
    """Submit a prompt and print the answer's tokens as the worker streams them."""
    async with turnd.Client(url, token=token) as client:
        submitted = await client.submit(session_id, "echo.model", {"prompt": prompt})
        async for item in client.stream(submitted.turn_id):  # ends when the turn does
            if isinstance(item, Progress):
                print(item.data["token"], end="", flush=True)
            elif isinstance(item, ProgressDropped):
                print(f"[{item.count} tokens lost]", end="", flush=True)
        print()
        return await client.get(submitted.turn_id)


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
    sub.add_parser("worker", help="serve echo.model until SIGTERM / Ctrl-C")
    asking = sub.add_parser("ask", help="stream the answer to a prompt")
    asking.add_argument("prompt")
    asking.add_argument("--session", default="echo-1")
    args = parser.parse_args()
    if args.command == "worker":
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
        worker.url, worker.token = args.url, args.token
        worker.run()
        return
    turn = asyncio.run(ask(args.url, args.session, args.prompt, args.token))
    if turn.status != "completed":
        sys.exit(f"turn {turn.status}: {turn.error}")
    print(f"answer: {turn.output['text']}")


if __name__ == "__main__":
    main()
