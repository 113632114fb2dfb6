#!/usr/bin/env python3
"""Fails where the workspace's code outgrows its size rules (docs/architecture.md,
"Code size"), the part clippy does not check:

- a production source file of more than 800 lines. Production lines are a file's
  lines outside its `#[cfg(test)] mod name { ... }` blocks; a file that is itself a
  test module (declared `#[cfg(test)] mod name;` by its parent), and the files of a
  crate's `tests/`, `benches/` and `examples/`, are test code and not counted;
- an `allow(clippy::too_many_lines)` (or `expect`) in production code: only a crate
  root's `cfg_attr(test, allow(...))` and test code may carry one;
- a member crate whose manifest does not take the workspace lints
  (`[lints] workspace = true`).

Run from anywhere; reads the crates the workspace's Cargo.toml lists.
"""

import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 800
TEST_DIRS = {"tests", "benches", "examples"}
CFG_TEST = re.compile(r"^\s*#\[cfg\(test\)\]\s*$")
MOD_DECL = re.compile(r"^\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;")
MOD_BLOCK = re.compile(r"^\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+\w+\s*\{")
ALLOW = re.compile(r"\b(?:allow|expect)\s*\(")
CFG_ATTR_TEST = re.compile(r"cfg_attr\s*\(\s*test\s*,")


def members():
    manifest = tomllib.loads((ROOT / "Cargo.toml").read_text())
    return [ROOT / m for m in manifest["workspace"]["members"]]


def module_dir(path):
    """Where the files of the modules `path` declares live."""
    if path.name in ("mod.rs", "lib.rs", "main.rs"):
        return path.parent
    return path.parent / path.stem


def test_modules(path, lines):
    """The files of the modules `path` declares under `#[cfg(test)]`."""
    out = set()
    for before, line in zip(lines, lines[1:]):
        m = MOD_DECL.match(line)
        if m and CFG_TEST.match(before):
            d = module_dir(path)
            out.add(d / f"{m.group(1)}.rs")
            out.add(d / m.group(1) / "mod.rs")
    return out


def production(lines):
    """(line number, line) of `lines` outside `#[cfg(test)] mod x { ... }` blocks."""
    out = []
    i = 0
    while i < len(lines):
        if CFG_TEST.match(lines[i]) and i + 1 < len(lines) and MOD_BLOCK.match(lines[i + 1]):
            depth = 0
            j = i + 1
            while j < len(lines):
                depth += lines[j].count("{") - lines[j].count("}")
                if depth <= 0:
                    break
                j += 1
            i = j + 1
            continue
        out.append((i + 1, lines[i]))
        i += 1
    return out


def check_crate(crate, problems):
    manifest = tomllib.loads((crate / "Cargo.toml").read_text())
    if manifest.get("lints", {}).get("workspace") is not True:
        problems.append(f"{crate.relative_to(ROOT)}/Cargo.toml: no `[lints] workspace = true`")
    if crate == ROOT / "tests":
        return  # the end-to-end tests: test code throughout
    files = sorted(p for p in crate.rglob("*.rs") if "target" not in p.parts)
    texts = {p: p.read_text().split("\n") for p in files}
    tests = set()
    for p, lines in texts.items():
        tests |= test_modules(p, lines)
    for p, lines in texts.items():
        rel = p.relative_to(crate)
        if p in tests or rel.parts[0] in TEST_DIRS:
            continue
        prod = production(lines)
        name = p.relative_to(ROOT)
        if len(prod) > MAX_LINES:
            problems.append(f"{name}: {len(prod)} production lines (at most {MAX_LINES})")
        for i, (n, line) in enumerate(prod):
            if "clippy::too_many_lines" not in line:
                continue
            # The attribute may span lines: `#![cfg_attr(\n test,\n allow(\n clippy::…`.
            window = " ".join(text for _, text in prod[max(0, i - 4) : i + 1])
            if CFG_ATTR_TEST.search(window):
                continue
            if ALLOW.search(window):
                problems.append(f"{name}:{n}: allow(clippy::too_many_lines) in production code")


def main():
    problems = []
    for crate in members():
        check_crate(crate, problems)
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        print(f"check-code-size: {len(problems)} problem(s)", file=sys.stderr)
        return 1
    print(f"check-code-size: {len(members())} crates, no production file over {MAX_LINES} lines, "
          "no allow of too_many_lines outside tests, every crate on the workspace lints")
    return 0


if __name__ == "__main__":
    sys.exit(main())
