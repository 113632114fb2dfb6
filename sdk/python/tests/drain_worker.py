"""A worker process for the drain test: ``python drain_worker.py URL``."""

from __future__ import annotations

import asyncio
import logging
import sys
from typing import Any

from turnd import TurnContext, Worker

worker = Worker(sys.argv[1], "w-drain", drain_timeout=10)


@worker.function("slow", timeout_ms=5_000)
async def slow(ctx: TurnContext, input: Any) -> Any:
    print("started", ctx.invocation_id, flush=True)
    await asyncio.sleep(float(input))
    return {"slept": input}


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    worker.run()
    print("stopped", worker.stats.results_acked, flush=True)
