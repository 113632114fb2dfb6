"""iii-sdk==0.25.0 (PyPI) workers and callers on turnd's iii endpoint, unchanged.

Run with the project's venv: ``target/venv/bin/python -m pytest -q tests/iii/python``
(``TURND_BIN`` names the daemon, default ``target/debug/turnd``).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from iii import InitOptions, TriggerAction, register_worker

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests" / "python"))
from turnd_client import Client

sys.path.insert(0, str(Path(__file__).resolve().parent))
from iii_support import RECONNECT, registered, until  # noqa: E402

BIN = os.environ.get("TURND_BIN", str(ROOT / "target" / "debug" / "turnd"))
AT_ONCE_S = 10.0
# The heartbeat is the daemon's default: a connection silent for three of them is
# ended, so a short one would end healthy connections whenever this process (whose
# iii-sdk workers answer the pings) stalls on a loaded machine. No test here waits for
# silence to be noticed, nor for the reconnect grace to pass: a worker whose socket
# closed reattaches within it even after a stall of a few seconds.
FAST = {
    "TURND_SERVER__HEARTBEAT_MS": "5000",
    "TURND_STORAGE__SYNC": "never",
    "TURND_TURNS__PROBE_TIMEOUT_MS": "300",
    "TURND_TURNS__RECONNECT_GRACE_MS": "10000",
    "TURND_TURNS__CANCEL_GRACE_MS": "600",
}


class Turnd:
    def __init__(self, toml: str = "") -> None:
        self.work = tempfile.TemporaryDirectory(prefix="turnd-iii-py-")
        cfg = Path(self.work.name) / "turnd.toml"
        cfg.write_text(toml)
        ready = Path(self.work.name) / "ready.json"
        self.stderr_path = Path(self.work.name) / "stderr"
        env = dict(os.environ, RUST_LOG="info", TURND_III__LISTEN="127.0.0.1:0", **FAST)
        self.proc = subprocess.Popen(
            [
                BIN,
                "serve",
                "--config",
                str(cfg),
                "--listen",
                "127.0.0.1:0",
                "--admin-listen",
                "127.0.0.1:0",
                "--data-dir",
                str(Path(self.work.name) / "data"),
                "--ready-file",
                str(ready),
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=self.stderr_path.open("w"),
        )
        deadline = time.time() + 15
        while not ready.exists() or not ready.read_text():
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"turnd not ready: {self.stderr()}")
            time.sleep(0.02)
        r = json.loads(ready.read_text())
        self.ws, self.iii = r["ws"], r["iii"]

    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.work.cleanup()


@pytest.fixture(scope="module")
def env() -> Iterator[dict[str, Any]]:
    # call_grace_ms: a call that waited for a reattaching worker would wait this long
    # (capped at call_dispatch_timeout_ms, 30 s), so a call answered within AT_ONCE_S
    # (far above a stall of a loaded machine) did not wait for it.
    d = Turnd("[iii]\nconcurrency = 4\ncall_grace_ms = 60000\n")
    seen: list[dict[str, Any]] = []
    lock = threading.Lock()
    # A py::slow call given {"gate": name} runs until the test sets gates[name] (at
    # most 20 s), instead of sleeping: it ends after what the test did meanwhile.
    gates: dict[str, threading.Event] = {}

    def echo(data: Any, metadata: Any = None) -> Any:
        return {"echoed": data, "metadata": metadata}

    def fail(data: Any) -> Any:
        raise RuntimeError("boom")

    def slow(data: Any, metadata: Any = None) -> Any:
        with lock:
            seen.append({"at": "start", **(metadata or {}).get("turnd", {})})
        if "gate" in data:
            gates[data["gate"]].wait(20)
        else:
            time.sleep(data["ms"] / 1000)
        with lock:
            seen.append({"at": "end", **(metadata or {}).get("turnd", {})})
        return {"slept": data["ms"]}

    worker = register_worker(
        d.iii, InitOptions(worker_name="py-worker", reconnection_config=RECONNECT)
    )
    worker.register_function("py::echo", echo)
    worker.register_function("py::fail", fail)
    worker.register_function("py::slow", slow)
    caller = register_worker(
        d.iii, InitOptions(worker_name="py-caller", reconnection_config=RECONNECT)
    )
    c = Client(d.ws, role="operator")
    until("the worker registered", lambda: registered(c, "py::slow"))
    try:
        yield {
            "turnd": d,
            "worker": worker,
            "caller": caller,
            "c": c,
            "seen": seen,
            "gates": gates,
        }
    finally:
        for g in gates.values():
            g.set()
        c.close()
        worker.shutdown()
        caller.shutdown()
        d.stop()


def test_sync_call_carries_turnd_ids_and_completes_the_turn(
    env: dict[str, Any],
) -> None:
    r = env["caller"].trigger({"function_id": "py::echo", "payload": {"n": 1}})
    assert r["echoed"] == {"n": 1}
    ids = r["metadata"]["turnd"]
    assert ids["session_id"].startswith("call/")
    t = env["c"].get(ids["turn_id"])
    assert t["status"] == "completed"
    assert t["output"] == r


def test_failing_handler_raises_invocation_failed(env: dict[str, Any]) -> None:
    with pytest.raises(Exception) as e:
        env["caller"].trigger({"function_id": "py::fail", "payload": {}})
    assert getattr(e.value, "code", None) == "invocation_failed"
    assert "boom" in str(e.value)


def test_void_runs_and_answers_nothing(env: dict[str, Any]) -> None:
    n = len(env["seen"])
    assert (
        env["caller"].trigger(
            {
                "function_id": "py::slow",
                "payload": {"ms": 10},
                "action": TriggerAction.Void(),
            }
        )
        is None
    )
    until("the void call ran", lambda: len(env["seen"]) >= n + 2)


def test_caller_timeout_leaves_the_turn_to_complete(env: dict[str, Any]) -> None:
    n = len(env["seen"])
    # The handler ends only after the caller gave up.
    env["gates"]["timeout"] = gate = threading.Event()
    with pytest.raises(Exception) as e:
        env["caller"].trigger(
            {
                "function_id": "py::slow",
                "payload": {"ms": 600, "gate": "timeout"},
                "timeout_ms": 150,
            }
        )
    assert getattr(e.value, "code", None) == "TIMEOUT"
    gate.set()
    start = until(
        "the handler started", lambda: len(env["seen"]) > n and env["seen"][n]
    )
    t = env["c"].wait(start["turn_id"])
    assert t["status"] == "completed"
    assert t["output"] == {"slept": 600}


def test_a_call_nobody_serves_is_function_not_found_at_once(
    env: dict[str, Any],
) -> None:
    for fn, says in [
        ("py::nobody", "Function py::nobody not found"),
        ("state::set", "state functions"),
        ("publish", "pub/sub"),
    ]:
        t0 = time.monotonic()
        with pytest.raises(Exception) as e:
            env["caller"].trigger(
                {"function_id": fn, "payload": {"stale": True}, "timeout_ms": 20_000}
            )
        assert time.monotonic() - t0 < AT_ONCE_S, fn
        assert getattr(e.value, "code", None) == "function_not_found", e.value
        assert says in str(e.value)
    rows = env["c"].request("sessions.list", {})["sessions"]
    assert rows == [], rows


def test_a_self_call_goes_through_turnd(env: dict[str, Any]) -> None:
    r = env["worker"].trigger({"function_id": "py::echo", "payload": {"self": True}})
    assert r["echoed"] == {"self": True}
    assert env["c"].get(r["metadata"]["turnd"]["turn_id"])["status"] == "completed"


def test_worker_socket_closed_mid_handler_reattaches_and_the_result_is_applied(
    env: dict[str, Any],
) -> None:
    worker, seen = env["worker"], env["seen"]
    n = len(seen)
    out: dict[str, Any] = {}
    # The handler ends only after its socket was closed.
    env["gates"]["closed"] = gate = threading.Event()

    def call() -> None:
        out["r"] = env["caller"].trigger(
            {"function_id": "py::slow", "payload": {"ms": 700, "gate": "closed"}}
        )

    th = threading.Thread(target=call)
    th.start()
    start = until("the handler started", lambda: len(seen) > n and seen[n])
    # Close the SDK's socket from under it, as a dropped connection would.
    asyncio.run_coroutine_threadsafe(worker._ws.close(), worker._loop).result(5)
    gate.set()
    th.join(30)
    assert out["r"] == {"slept": 700}
    assert [e["at"] for e in seen[n:] if e["turn_id"] == start["turn_id"]] == [
        "start",
        "end",
    ]
    kinds = [e["kind"] for e in env["c"].all_events(start["session_id"])]
    assert "redispatched" not in kinds and "outcome_unknown" not in kinds, kinds


REFUSED_WORKER = """
import sys
from iii import InitOptions, register_worker
from iii_helpers.observability import ReconnectionConfig
give_up = ReconnectionConfig(initial_delay_ms=50, max_retries=2, jitter_factor=0.0)
register_worker(sys.argv[1], InitOptions(worker_name="py-bad", reconnection_config=give_up))
"""


def test_iii_token_is_required_and_accepted() -> None:
    token = "py-iii-token-1"
    d = Turnd(
        "[auth]\ntokens = [\n"
        f'  {{ role = "worker", token = "{token}" }},\n'
        f'  {{ role = "client", token = "{token}" }},\n'
        '  { role = "operator", token = "py-operator-1" },\n]\n'
    )
    old = os.environ.get("III_TOKEN")
    try:
        # A worker with a wrong token, in a process of its own: the SDK keeps its
        # non-daemon event-loop thread (and its retries) after a refusal, so the
        # child is killed once turnd has refused it.
        refused = subprocess.Popen(
            [sys.executable, "-c", REFUSED_WORKER, d.iii],
            env={**os.environ, "III_TOKEN": "wrong-token-here"},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            # A Python process that imports iii-sdk first: slow on a loaded machine.
            until(
                "the refusal in turnd's log",
                lambda: d.stderr().count("iii connection refused") >= 3,
                secs=60.0,
            )
        finally:
            refused.kill()
            refused.wait()
        os.environ["III_TOKEN"] = token
        w = register_worker(
            d.iii, InitOptions(worker_name="py-good", reconnection_config=RECONNECT)
        )
        w.register_function("py::tok", lambda data: {"ok": data})
        c = Client(d.ws, role="operator", token="py-operator-1")
        until("the worker registered", lambda: registered(c, "py::tok"))
        assert w.trigger({"function_id": "py::tok", "payload": 1}) == {"ok": 1}
        c.close()
        w.shutdown()
    finally:
        if old is None:
            os.environ.pop("III_TOKEN", None)
        else:
            os.environ["III_TOKEN"] = old
        d.stop()
