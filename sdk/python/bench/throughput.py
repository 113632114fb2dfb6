"""Throughput of one Python worker process: one-step echo turns over many sessions.

Starts ``turnd serve`` (``--turnd`` or ``$TURND_BIN``) on free ports with a fresh
data directory, one worker *process* (``--role worker``) serving ``echo`` with
``--concurrency`` slots on one connection, and, in this process, ``--sessions``
sessions that each submit ``--turns`` turns one after another (the next once the
previous is terminal, as a conversation does), all sessions at once over
``--callers`` client connections. Prints turns/s, latency and the worker's CPU.

    python sdk/python/bench/throughput.py --turnd target/release/turnd
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import sys
import time
from typing import Any

from turnd import Client, TurnContext, Worker, WorkerState
from turnd.testing import TurndServer


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


async def run_worker(url: str, concurrency: int) -> None:
    worker = Worker(url, "bench-python")

    @worker.function("echo", concurrency=concurrency)
    async def echo(ctx: TurnContext, input: Any) -> Any:
        return input

    async with worker:
        await worker.wait_state(WorkerState.CONNECTED, 30)
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"stats": worker.stats.__dict__, "cpu_s": usage.ru_utime + usage.ru_stime}))


async def run_bench(args: argparse.Namespace) -> None:
    config: dict[str, Any] = {}
    if args.sync_never:
        config["storage.sync"] = "never"
    async with TurndServer(config, binary=args.turnd) as server:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            __file__,
            "--role",
            "worker",
            "--url",
            server.url,
            "--concurrency",
            str(args.concurrency),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        assert proc.stdout is not None and proc.stdin is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        if line.strip() != b"ready":
            raise RuntimeError(f"worker did not start: {line!r}")
        clients = [Client(server.url) for _ in range(args.callers)]
        for c in clients:
            await c.connect()
        latencies: list[float] = []

        async def session(i: int) -> None:
            c = clients[i % len(clients)]
            for n in range(args.turns):
                t0 = time.perf_counter()
                turn = await c.run(f"bench-{i}", "echo", {"i": i, "n": n}, timeout=60)
                if turn.status != "completed":
                    raise RuntimeError(f"turn {turn.turn_id} ended {turn.status}")
                latencies.append(time.perf_counter() - t0)

        cpu0 = cpu_seconds(proc.pid)
        caller_cpu0 = cpu_seconds(os.getpid())
        daemon_cpu0 = cpu_seconds(server.pid) if server.pid else 0.0
        t0 = time.perf_counter()
        await asyncio.gather(*(session(i) for i in range(args.sessions)))
        elapsed = time.perf_counter() - t0
        worker_cpu = cpu_seconds(proc.pid) - cpu0
        caller_cpu = cpu_seconds(os.getpid()) - caller_cpu0
        daemon_cpu = (cpu_seconds(server.pid) if server.pid else 0.0) - daemon_cpu0
        proc.stdin.close()
        tail = (await proc.stdout.read()).decode().strip().splitlines()
        await proc.wait()
        for c in clients:
            await c.close()
    total = args.sessions * args.turns
    lat = sorted(latencies)
    result = {
        "turns": total,
        "sessions": args.sessions,
        "turns_per_session": args.turns,
        "concurrency": args.concurrency,
        "callers": args.callers,
        "seconds": round(elapsed, 3),
        "turns_per_s": round(total / elapsed, 1),
        "latency_ms_p50": round(statistics.median(lat) * 1000, 2),
        "latency_ms_p99": round(lat[int(len(lat) * 0.99) - 1] * 1000, 2),
        "worker_cpu_s": round(worker_cpu, 2),
        "worker_cpu_us_per_turn": round(worker_cpu / total * 1e6),
        "daemon_cpu_s": round(daemon_cpu, 2),
        "caller_cpu_s": round(caller_cpu, 2),
        "load_average": os.getloadavg(),
        "worker": json.loads(tail[-1]) if tail else None,
    }
    print(json.dumps(result, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=["bench", "worker"], default="bench")
    parser.add_argument("--url", default="")
    parser.add_argument("--turnd", default=None, help="turnd binary (default $TURND_BIN)")
    parser.add_argument("--sessions", type=int, default=100)
    parser.add_argument("--turns", type=int, default=20, help="turns per session")
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--callers", type=int, default=4)
    parser.add_argument("--sync-never", action="store_true", help='storage.sync = "never"')
    args = parser.parse_args()
    if args.role == "worker":
        asyncio.run(run_worker(args.url, args.concurrency))
    else:
        asyncio.run(run_bench(args))


if __name__ == "__main__":
    main()
