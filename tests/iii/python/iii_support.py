"""What the iii-sdk Python tests share: bounded waits, whether a node serves a
function, the SDK's reconnect settings for tests."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from iii_helpers.observability import ReconnectionConfig

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests" / "python"))
from turnd_client import Client  # noqa: E402

RECONNECT = ReconnectionConfig(initial_delay_ms=100, max_delay_ms=400, jitter_factor=0.0)


def until(what: str, f: Callable[[], Any], secs: float = 20.0) -> Any:
    """Poll ``f`` until it returns something truthy (generous: only a failing test
    waits it out)."""
    deadline = time.time() + secs
    while True:
        v = f()
        if v:
            return v
        if time.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def registered(c: Client, fn: str) -> bool:
    return any(
        f["function_id"] == fn and f["workers"] > 0
        for f in c.request("functions.list")["functions"]
    )
