"""A chat that can be interrupted: every message is a turn submitted with
``on_busy="interrupt"``, so a second message while the first is still answered stops
that turn and starts a new one, whose first step sees the stopped turn as
``ctx.previous`` (its last durable state: what it had said so far).

    python examples/python/chat.py worker &
    python examples/python/chat.py say "tell me a long story" &
    python examples/python/chat.py say "actually, a short one"

The reply is written one sentence per step (``Continue``), each streamed word by word
with ``ctx.progress``; what a step said becomes durable with its ``Continue`` state.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from typing import Any

import turnd
from turnd import Continue, Progress, TurnContext, Worker

WORD_DELAY = 0.05
"""Seconds between two streamed words."""

worker = Worker("ws://127.0.0.1:7420/v1", worker_id="chat-1")


def plan_reply(message: str) -> list[str]:
    """The sentences of the answer (a model would write them)."""
    return [
        f"You said: {message}.",
        "That is worth a long answer.",
        "Here it comes, one sentence at a time.",
        "And that is all I have to say.",
    ]


@worker.function("chat.reply", concurrency=16, timeout_ms=60_000)
async def reply(ctx: TurnContext, state: Any) -> Continue | dict[str, Any]:
    if ctx.step == 0:
        sentences = plan_reply(str(state))
        if ctx.previous is not None:
            # The turn this message interrupted: its state is its last Continue (or,
            # if it never got that far, its input: the message).
            before = ctx.previous.state
            said = before.get("said", "") if isinstance(before, dict) else ""
            sentences.insert(0, f"(You cut me off after: {said.strip()!r}.)")
        return Continue({"message": state, "todo": sentences, "said": ""})
    sentence, todo = state["todo"][0], state["todo"][1:]
    for n, word in enumerate(sentence.split(" ")):
        await asyncio.sleep(WORD_DELAY)
        await ctx.progress(word if n == 0 else f" {word}")
    said = f"{state['said']}{sentence} "
    if not todo:
        return {"reply": said.strip()}
    return Continue({**state, "todo": todo, "said": said})


async def say(
    url: str | list[str], session_id: str, message: str, token: str | None = None
) -> turnd.Turn:
    """Send a message, interrupting any answer still being written, and print the
    reply as it streams."""
    async with turnd.Client(url, token=token) as client:
        submitted = await client.submit(session_id, "chat.reply", message, on_busy="interrupt")
        async for item in client.stream(submitted.turn_id):
            if isinstance(item, Progress):
                print(item.data, end="", flush=True)
            elif isinstance(item, turnd.Event) and item.detail.get("outcome") == "continue":
                print(" ", end="", flush=True)  # a sentence ended
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
    sub.add_parser("worker", help="serve chat.reply until SIGTERM / Ctrl-C")
    saying = sub.add_parser("say", help="send a message")
    saying.add_argument("message")
    saying.add_argument("--session", default="chat-1")
    args = parser.parse_args()
    if args.command == "worker":
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
        worker.url, worker.token = args.url, args.token
        worker.run()
        return
    turn = asyncio.run(say(args.url, args.session, args.message, args.token))
    if turn.status == "cancelled" and turn.stop is not None:
        sys.exit(f"[{turn.stop.reason}]")
    print(f"[{turn.status}]")


if __name__ == "__main__":
    main()
