"""The Python the docs show is the Python users get: every ```python block of the
READMEs and docs/sdk-python.md passes ``mypy --strict``; the README's example, the
guide's worker and caller, and the guide's test run against the real daemon and print
what the docs say; and ``TurndServer``'s coroutines warn when not awaited.
"""

from __future__ import annotations

import asyncio
import gc
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from turnd.testing import TurndServer

ROOT = Path(__file__).resolve().parents[3]
DOCS = [ROOT / "README.md", ROOT / "docs" / "sdk-python.md", ROOT / "sdk" / "python" / "README.md"]
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```$", re.DOTALL | re.MULTILINE)
DEFAULT_URL = "ws://127.0.0.1:7420/v1"


def python_blocks(doc: Path) -> list[str]:
    return PYTHON_BLOCK.findall(doc.read_text(encoding="utf-8"))


def test_doc_examples_pass_mypy_strict(tmp_path: Path) -> None:
    files = []
    for doc in DOCS:
        blocks = python_blocks(doc)
        assert blocks, f"{doc} shows no ```python block: nothing to check"
        for n, code in enumerate(blocks, 1):
            name = re.sub(r"\W", "_", str(doc.relative_to(ROOT)))
            path = tmp_path / f"{name}_{n}.py"
            path.write_text(code, encoding="utf-8")
            files.append(str(path))
    cache = ROOT / "sdk" / "python" / ".mypy_cache"  # kept between runs, git ignores it
    mypy = [sys.executable, "-m", "mypy", "--strict", "--python-version", "3.10"]
    checked = subprocess.run(
        [*mypy, "--cache-dir", str(cache), *files],
        capture_output=True,
        text=True,
        cwd=tmp_path,  # no project config: the flags are what the docs promise
        timeout=300,
        check=False,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


def script(tmp_path: Path, name: str, code: str, server: TurndServer) -> Path:
    """``code`` as a file, talking to ``server`` instead of the default address."""
    assert DEFAULT_URL in code
    path = tmp_path / name
    path.write_text(code.replace(DEFAULT_URL, server.url), encoding="utf-8")
    return path


async def run_script(path: Path) -> str:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(path), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, err.decode()
    return out.decode().strip()


async def test_readme_example_runs(server: TurndServer, tmp_path: Path) -> None:
    [example] = python_blocks(ROOT / "README.md")
    assert await run_script(script(tmp_path, "echo.py", example, server)) == "{'hello': 'world'}"


async def test_guide_worker_and_caller_run(server: TurndServer, tmp_path: Path) -> None:
    worker_code, caller_code = python_blocks(ROOT / "docs" / "sdk-python.md")[:2]
    worker = await asyncio.create_subprocess_exec(
        sys.executable, str(script(tmp_path, "worker.py", worker_code, server))
    )
    try:
        printed = await run_script(script(tmp_path, "caller.py", caller_code, server))
    finally:
        worker.terminate()  # the first SIGTERM drains, then the worker exits
        await asyncio.wait_for(worker.wait(), 30)
    assert printed == "completed {'reply': 'done'}"
    assert worker.returncode == 0


async def test_guide_testing_example_passes() -> None:
    [example] = [b for b in python_blocks(ROOT / "docs" / "sdk-python.md") if "TurndServer" in b]
    namespace: dict[str, Any] = {}
    exec(compile(example, "sdk-python.md", "exec"), namespace)
    tests = [f for name, f in namespace.items() if name.startswith("test_")]
    assert tests
    for test in tests:
        await test()


async def test_server_coroutines_warn_when_not_awaited(server: TurndServer) -> None:
    for name in ("stop", "kill", "restart"):
        with pytest.warns(RuntimeWarning, match=f"'TurndServer.{name}' was never awaited"):
            getattr(server, name)()
            gc.collect()
    assert server.running  # nothing happened
    await server.restart()
    assert server.running
