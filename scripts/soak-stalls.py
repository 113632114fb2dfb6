#!/usr/bin/env python3
"""Set a soak's longest intervals with no completion beside the commit log's slow syncs.

Usage: soak-stalls.py SOAK_OUTPUT...

Each file is the output of `turnd-bench soak ... --env TURND_LOG=info,turnd_store::logged=debug`
with the daemon's stderr in it (`> FILE 2>&1`): the daemon logs every group commit whose
write and `fdatasync` of the commit log took 10 ms or more, with its end time and
`took_ms`, and the soak prints its five longest intervals with no completion with the
Unix time each began. For every such interval of 20 ms or more this prints the syncs
that overlap it and how much of it they cover.
"""

import datetime
import re
import sys


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for path in sys.argv[1:]:
        with open(path, errors="replace") as f:
            text = f.read()
        syncs = []
        for m in re.finditer(
            r"^(\S+Z)\s+(?:DEBUG|WARN)\s+turnd_store::logged: .*?took_ms=(\d+)", text, re.MULTILINE
        ):
            end = datetime.datetime.fromisoformat(m.group(1)).timestamp()
            took = int(m.group(2))
            syncs.append((end - took / 1000, end, took))
        gaps = [
            (float(at), int(ms)) for ms, at in re.findall(r"(\d+) ms at [\d.]+ s \(unix ([\d.]+)[;)]", text)
        ]
        print(f"{path}: {len(syncs)} syncs of 10 ms or more: {[s[2] for s in syncs]}")
        for start, ms in gaps:
            if ms < 20:
                continue
            end = start + ms / 1000
            over = [s for s in syncs if s[0] < end and s[1] > start]
            covered = sum(min(e, end) - max(b, start) for b, e, _ in over) * 1000
            print(
                f"  gap {ms} ms at {start:.3f}: syncs overlapping {[s[2] for s in over]}, covering {covered:.0f} ms of it"
            )


if __name__ == "__main__":
    main()
