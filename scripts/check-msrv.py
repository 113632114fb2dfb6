#!/usr/bin/env python3
"""Fails when the workspace's `rust-version` (Cargo.toml) is older than a crate that
Cargo.lock pins needs, or when the README states another minimum.

Every crate in the resolved graph for the host declares the oldest compiler it
builds with (`rust-version`); the workspace's minimum is the newest of those. Cargo
refuses to build with an older compiler than the workspace states, and clippy's
`incompatible_msrv` lint (run by `make lint`) flags standard library APIs newer than
it. To build with the stated minimum itself: `rustup toolchain install X.Y` and
`cargo +X.Y build --workspace --locked`.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

try:
    import tomllib  # Python 3.11+
except ImportError:  # Python 3.10 and older (Ubuntu 22.04): read the one key by hand
    tomllib = None


def version(s):
    parts = [int(p) for p in s.split(".")]
    return tuple((parts + [0, 0])[:3])


def show(v):
    return ".".join(str(p) for p in v[:2]) + ("" if v[2] == 0 else f".{v[2]}")


def workspace_rust_version(text):
    """`[workspace.package] rust-version` of a Cargo.toml, or None."""
    if tomllib is not None:
        manifest = tomllib.loads(text)
        return manifest.get("workspace", {}).get("package", {}).get("rust-version")
    section = None
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        m = re.match(r"^\[([^\]]+)\]$", line)
        if m:
            section = m.group(1).strip()
            continue
        m = re.match(r'^rust-version\s*=\s*"([^"]+)"$', line)
        if m and section == "workspace.package":
            return m.group(1)
    return None


def main():
    root = Path(__file__).resolve().parent.parent
    host = None
    for line in subprocess.run(
        ["rustc", "-vV"], check=True, capture_output=True, text=True
    ).stdout.splitlines():
        if line.startswith("host: "):
            host = line.split(": ", 1)[1]
    meta = json.loads(
        subprocess.run(
            ["cargo", "metadata", "--format-version", "1", "--locked",
             "--filter-platform", host],
            check=True, capture_output=True, text=True, cwd=root,
        ).stdout
    )
    resolved = {n["id"] for n in meta["resolve"]["nodes"]}
    members = set(meta["workspace_members"])
    stated_s = workspace_rust_version((root / "Cargo.toml").read_text())
    if not stated_s:
        print("check-msrv: Cargo.toml has no [workspace.package] rust-version",
              file=sys.stderr)
        return 1
    stated = version(stated_s)
    needs = []
    fail = False
    unstated = []
    for p in meta["packages"]:
        rv = p.get("rust_version")
        if p["id"] in members:
            if not rv:
                unstated.append(p["name"])
            elif version(rv) != stated:
                print(f'check-msrv: {p["name"]} states rust-version {rv}, the '
                      f"workspace {stated_s}; use rust-version.workspace = true",
                      file=sys.stderr)
                fail = True
        elif rv and p["id"] in resolved:
            needs.append((version(rv), f'{p["name"]} {p["version"]}'))
    if unstated:
        # Cargo checks the compiler only for packages that state it.
        print("check-msrv: warning: no rust-version (add rust-version.workspace = true): "
              + ", ".join(sorted(unstated)), file=sys.stderr)
    needs.sort(reverse=True)
    newest, who = needs[0]
    if newest > stated:
        too_new = [w for v, w in needs if v > stated]
        also = f" (also: {', '.join(too_new[1:6])})" if too_new[1:] else ""
        print(f"check-msrv: Cargo.toml states rust-version {show(stated)} but "
              f"{who} needs {show(newest)}{also}; "
              f"raise rust-version to {show(newest)} and say so in README.md",
              file=sys.stderr)
        fail = True
    readme = (root / "README.md").read_text()
    m = re.search(r"Rust toolchain \((\d+\.\d+(?:\.\d+)?) or newer\)", readme)
    if not m:
        print("check-msrv: README.md does not state the minimum Rust version as "
              "'Rust toolchain (X.Y or newer)'", file=sys.stderr)
        fail = True
    elif version(m.group(1)) != stated:
        print(f"check-msrv: README.md says Rust {m.group(1)}, Cargo.toml says "
              f"{show(stated)}", file=sys.stderr)
        fail = True
    if fail:
        return 1
    print(f"check-msrv: rust-version {show(stated)} (the newest need: {who}, "
          f"{show(newest)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
