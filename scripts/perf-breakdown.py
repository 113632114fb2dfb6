#!/usr/bin/env python3
"""Where a `turnd-bench sessions` run's CPU goes, from a perf profile with call stacks.

Usage:
    perf record -e cpu-clock -F 1000 --call-graph dwarf,16384 -o perf.data \\
        target/release/turnd-bench sessions
    perf script -i perf.data -F comm,ip,sym > perf.txt
    scripts/perf-breakdown.py perf.txt [CPU_MICROS_PER_TURN]

Each sample goes to the first part below whose thread name matches and one of whose
frames contains the pattern; a sample matching none of a thread's parts goes to that
thread's "other". With the run's CPU per turn (the `sessions` line prints it), the
shares are also given in microseconds per turn.
"""

import collections
import sys

# (thread name prefix, part, frame substring); first match wins.
PARTS = [
    ("tokio-rt-worker", "engine: records' JSON (Tx::batch)", "machine::tx::Tx::batch"),
    ("tokio-rt-worker", "engine: store commit: LZ4 of the log record", "lz4_flex::block::compress"),
    ("tokio-rt-worker", "engine: store commit (log record, overlay writes)", "LoggedKv as turnd_store::kv::Kv>::commit"),
    ("tokio-rt-worker", "engine: wait index and timers (after_change)", "Engine>::after_change"),
    ("tokio-rt-worker", "engine: applying the change in memory (Tx::apply)", "machine::tx::Tx::apply"),
    ("tokio-rt-worker", "engine: the rest of a commit", "Engine>::commit::{{closure}}"),
    ("tokio-rt-worker", "daemon: the rest of its request tasks", "turnd_server::router::run"),
    ("tokio-rt-worker", "daemon: connection reading and writing", "turnd_server::ws::"),
    ("tokio-rt-worker", "bench's SDK callers and workers", "turnd_client::"),
    ("tokio-rt-worker", "bench's own tasks", "turnd_bench::"),
    ("turnd-store-app", "applier: sled's apply_batch", "sled::tree::Tree::apply_batch"),
    ("turnd-store-app", "applier: LZ4 of values (pack)", "turnd_store::logged::codec::pack"),
    ("turnd-store-app", "applier: value file appends", "turnd_store::sled::values::ValueFile::append"),
    ("turnd-log-write", "log writer: write and fdatasync", "as turnd_store::log::CommitLog>::append"),
    ("turnd-log-write", "log writer: overlay insert", "Overlay::put_group"),
    ("sled-io", "sled's IO threads", ""),
]


def samples(path):
    comm, frames = None, []
    with open(path, errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            if not line.startswith((" ", "\t")):
                if comm is not None:
                    yield comm, frames
                comm, frames = line.split()[0], []
            else:
                parts = line.strip().split(None, 1)
                frames.append(parts[1] if len(parts) > 1 else parts[0])
    if comm is not None:
        yield comm, frames


def main() -> None:
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    per_turn = float(sys.argv[2]) if len(sys.argv) == 3 else None
    counts = collections.Counter()
    total = 0
    for comm, frames in samples(sys.argv[1]):
        total += 1
        for thread, part, pattern in PARTS:
            if comm.startswith(thread) and any(pattern in f for f in frames):
                counts[part] += 1
                break
        else:
            known = next((t for t, _, _ in PARTS if comm.startswith(t)), None)
            counts[f"{known}: other" if known else "other threads"] += 1
    print(f"{total} samples")
    for part, n in sorted(counts.items(), key=lambda kv: -kv[1]):
        share = n / total
        micros = f" · {share * per_turn:5.1f} µs per turn" if per_turn else ""
        print(f"{100 * share:5.1f} %{micros} · {part}")


if __name__ == "__main__":
    main()
