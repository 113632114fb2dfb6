"""Ask the agent worker a question and follow the turn's events as they happen.

    python examples/python/caller.py --url ws://127.0.0.1:7420/v1 \
        'What is [6*7] and how long is "the quick brown fox"?'
"""

from __future__ import annotations

import argparse
import asyncio
import uuid

import turnd


async def ask(
    url: str | list[str], session_id: str, question: str, token: str | None
) -> turnd.Turn:
    async with turnd.Client(url, token=token) as client:
        submitted = await client.submit(
            session_id,
            "agent.step",
            {"question": question},
            # Same key, same turn: safe to run this script again after a crash.
            idempotency_key=f"ask-{uuid.uuid5(uuid.NAMESPACE_URL, question)}",
        )
        turn_id = submitted.turn_id
        print(f"turn {turn_id} (deduplicated: {submitted.deduplicated})")
        async with client.watch(turn_id=turn_id) as events:
            async for event in events:
                print(f"  #{event.seq} {event.kind} {event.detail}")
                if event.kind in ("completed", "failed", "cancelled"):
                    break
        return await client.get(turn_id)


def url_list(value: str) -> list[str]:
    """``--url``: one URL, or a cluster's nodes' URLs separated by commas."""
    return [u.strip() for u in value.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("question")
    parser.add_argument(
        "--url",
        type=url_list,
        default=url_list("ws://127.0.0.1:7420/v1"),
        help="one URL, or a cluster's nodes' URLs separated by commas",
    )
    parser.add_argument("--session", default="conversation-1")
    parser.add_argument("--token", default=None)
    args = parser.parse_args()
    turn = asyncio.run(ask(args.url, args.session, args.question, args.token))
    print(turn.status, turn.output if turn.status == "completed" else turn.error)


if __name__ == "__main__":
    main()
