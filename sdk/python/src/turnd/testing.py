"""Run a real ``turnd serve`` for tests.

::

    from turnd.testing import TurndServer

    async with TurndServer(config={"turns.probe_timeout_ms": 300}) as server:
        async with turnd.Client(server.url) as client:
            ...

or, with pytest (``pytest_plugins = ["turnd.testing"]`` in ``conftest.py``), the
``turnd_server`` fixture. The binary is ``$TURND_BIN`` or ``turnd`` on ``PATH``; the
daemon listens on free loopback ports with a temporary data directory and is
stopped (and its directory removed) afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import tempfile
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

READY_TIMEOUT_S = 30.0


def find_binary() -> str:
    """``$TURND_BIN``, else ``turnd`` on ``PATH``."""
    configured = os.environ.get("TURND_BIN")
    if configured:
        if not os.access(configured, os.X_OK):
            raise FileNotFoundError(f"TURND_BIN={configured} is not an executable file")
        return configured
    found = shutil.which("turnd")
    if found is None:
        raise FileNotFoundError("no turnd binary: set TURND_BIN or put turnd on PATH")
    return found


def _env_key(key: str) -> str:
    section, sep, name = key.partition(".")
    if not sep or not section or not name:
        raise ValueError(f"config keys are SECTION.KEY, e.g. turns.probe_timeout_ms, not {key!r}")
    return f"TURND_{section.upper()}__{name.upper()}"


def _env_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)  # a quoted TOML basic string
    raise TypeError(f"config values are bool, int, float or str, not {type(value).__name__}")


class TurndServer:
    """A ``turnd serve`` process on free loopback ports with its own data directory.

    ``config`` maps ``"section.key"`` to a value and is passed as
    ``TURND_SECTION__KEY`` variables (``docs/configuration.md``).
    """

    def __init__(
        self,
        config: Mapping[str, Any] | None = None,
        *,
        binary: str | None = None,
        data_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.binary = binary or find_binary()
        self.config = dict(config or {})
        self._tmp = tempfile.mkdtemp(prefix="turnd-test-")
        self.data_dir = Path(data_dir) if data_dir is not None else Path(self._tmp) / "data"
        self.ready_file = Path(self._tmp) / "ready.json"
        self.log_path = Path(self._tmp) / "turnd.log"
        self.url = ""
        self.admin_url = ""
        self.pid: int | None = None
        self._proc: asyncio.subprocess.Process | None = None
        self._port: int | None = None

    async def __aenter__(self) -> TurndServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
        shutil.rmtree(self._tmp, ignore_errors=True)

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    async def start(self) -> None:
        """Start the daemon and wait for its ready file.

        A restart (``start`` after ``stop``) keeps the data directory and the
        WebSocket port, so connected workers and clients find it again.
        """
        if self.running:
            raise RuntimeError("turnd is already running")
        with contextlib.suppress(FileNotFoundError):
            self.ready_file.unlink()
        listen = f"127.0.0.1:{self._port or 0}"
        env = dict(os.environ)
        env.update({_env_key(k): _env_value(v) for k, v in self.config.items()})
        env.setdefault("TURND_LOG", "info")
        env["NO_COLOR"] = "1"
        log = open(self.log_path, "ab")  # noqa: ASYNC230 - quick, and handed to the child
        try:
            self._proc = await asyncio.create_subprocess_exec(
                self.binary,
                "serve",
                "--listen",
                listen,
                "--admin-listen",
                "127.0.0.1:0",
                "--data-dir",
                str(self.data_dir),
                "--ready-file",
                str(self.ready_file),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env=env,
                cwd=self._tmp,
            )
        finally:
            log.close()
        self.pid = self._proc.pid
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc.returncode is not None:
                raise RuntimeError(
                    f"turnd exited with {self._proc.returncode} before it was ready\n" + self.logs()
                )
            try:
                ready = json.loads(self.ready_file.read_text(encoding="utf-8"))
                self.url, self.admin_url = str(ready["ws"]), str(ready["admin"])
            except (FileNotFoundError, ValueError, KeyError):
                await asyncio.sleep(0.02)
                continue
            self._port = int(self.url.rsplit(":", 1)[1].split("/", 1)[0])
            return
        await self.kill()
        raise RuntimeError(f"turnd wrote no ready file within {READY_TIMEOUT_S}s\n" + self.logs())

    async def stop(self, timeout: float = 10.0) -> None:
        """Graceful stop (SIGTERM), then SIGKILL after ``timeout`` seconds."""
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), timeout)
        except asyncio.TimeoutError:
            await self.kill()

    async def kill(self) -> None:
        """Stop at once (SIGKILL), as a crash would."""
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()

    async def restart(self, *, kill: bool = False) -> None:
        """Stop (or kill) and start again on the same data directory and port."""
        if kill:
            await self.kill()
        else:
            await self.stop()
        await self.start()

    def logs(self, limit: int = 8000) -> str:
        """The last ``limit`` characters of the daemon's output."""
        try:
            text = self.log_path.read_bytes().decode("utf-8", "replace")
        except OSError:
            return ""
        return text[-limit:]


@contextlib.asynccontextmanager
async def turnd_serve(
    config: Mapping[str, Any] | None = None, *, binary: str | None = None
) -> AsyncIterator[TurndServer]:
    """``async with turnd_serve(...) as server:`` — a started :class:`TurndServer`."""
    async with TurndServer(config, binary=binary) as server:
        yield server


try:
    import pytest_asyncio as _pytest_asyncio
except ImportError:  # pragma: no cover - pytest is a dev extra
    pass
else:

    @_pytest_asyncio.fixture
    async def turnd_server() -> AsyncIterator[TurndServer]:
        """A running daemon on default settings for one test."""
        async with TurndServer() as server:
            yield server
