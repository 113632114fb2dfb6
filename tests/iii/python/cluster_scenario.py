"""iii-sdk==0.25.0 (PyPI) on the iii endpoints of a three-node turnd cluster.

Run by ``tests/e2e/cluster_iii.rs`` (which starts the cluster) as
``python cluster_scenario.py III0 III1 III2 WS0 WS1 WS2``. A worker program keeps a
connection to every node, as a cluster's workers do; callers use any node. Prints
one JSON line of what it saw; any failed expectation exits non-zero, saying which.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from iii import InitOptions, TriggerAction, register_worker
from iii_support import RECONNECT, Client, registered, until

FIFO = {"type": "fifo", "message_group_field": "g", "max_retries": 2, "backoff_ms": 50}


def worker_on(url: str, node: int) -> Any:
    """The worker program's connection to one node: its handlers say which node's
    connection ran them (the node that leads the turn's partition)."""

    def echo(data: Any, metadata: Any = None) -> Any:
        return {"echoed": data, "via": node}

    def flaky(data: Any, metadata: Any = None) -> Any:
        # The queue's max_retries makes the second attempt run; without the queue's
        # settings (at_most_once) the first failure fails the message.
        if (metadata or {}).get("turnd", {}).get("attempt") == 1:
            raise RuntimeError("the first attempt fails")
        return {"done": data, "via": node}

    w = register_worker(url, InitOptions(worker_name=f"py-cluster-{node}", reconnection_config=RECONNECT))
    w.register_function("cl::echo", echo)
    w.register_function("cl::flaky", flaky)
    return w


def caller_on(url: str, name: str) -> Any:
    return register_worker(url, InitOptions(worker_name=name, reconnection_config=RECONNECT))


def main() -> None:
    iii, ws = sys.argv[1:4], sys.argv[4:7]
    workers = [worker_on(u, i) for i, u in enumerate(iii)]
    clients = [Client(u, role="operator") for u in ws]
    callers = [caller_on(u, f"py-caller-{i}") for i, u in enumerate(iii)]
    seen: dict[str, Any] = {}
    try:
        for c in clients:
            until("the worker registered on every node", lambda c=c: registered(c, "cl::flaky"))

        # Calls through n1: each runs where its session's partition is led.
        vias = []
        for n in range(8):
            r = callers[1].trigger({"function_id": "cl::echo", "payload": {"n": n}})
            assert r["echoed"] == {"n": n}, r
            vias.append(r["via"])
        seen["call_vias"] = vias

        # A queue defined through n1 is the same queue through n2 and n0.
        define = {"function_id": "queue::define", "payload": {"queue": "clq", "config": FIFO}}
        seen["define_n1"] = callers[1].trigger(define)
        seen["define_n2"] = callers[2].trigger(define)
        stats = callers[0].trigger(
            {"function_id": "engine::queue::topic_stats", "payload": {"queue": "clq"}}
        )
        seen["config_n0"] = stats["config"]

        # Messages enqueued through n2, one group per partition or so: each runs
        # with the queue's retries on its partition's leader.
        receipts = []
        for g in range(6):
            r = callers[2].trigger(
                {
                    "function_id": "cl::flaky",
                    "payload": {"g": f"g{g}"},
                    "action": TriggerAction.Enqueue(queue="clq"),
                }
            )
            receipts.append(r["messageReceiptId"])

        def ended() -> list[Any] | None:
            turns = [clients[0].get(t) for t in receipts]
            done = all(t["status"] in ("completed", "failed", "cancelled") for t in turns)
            return turns if done else None

        turns = until("every message ended", ended, secs=20.0)
        seen["messages"] = [
            {"status": t["status"], "via": (t.get("output") or {}).get("via")} for t in turns
        ]

        # Waiting messages of a function nobody serves, counted from every partition.
        callers[0].trigger(
            {"function_id": "queue::define", "payload": {"queue": "clwait", "config": FIFO}}
        )
        for g in range(6):
            callers[0].trigger(
                {
                    "function_id": "cl::nobody",
                    "payload": {"g": f"w{g}"},
                    "action": TriggerAction.Enqueue(queue="clwait"),
                }
            )
        waiting = callers[1].trigger(
            {"function_id": "engine::queue::topic_stats", "payload": {"queue": "clwait"}}
        )
        seen["waiting_depth_n1"] = waiting["depth"]
    finally:
        for c in clients:
            c.close()
        for w in workers + callers:
            w.shutdown()
    print(json.dumps(seen), flush=True)


if __name__ == "__main__":
    main()
