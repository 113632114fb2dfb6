#!/usr/bin/env python3
"""Instructions per turn of a `turnd-bench sessions` run under callgrind.

Usage:
    scripts/callgrind-per-turn.py CALLGRIND_OUT SESSIONS_OUTPUT [TOP]

CALLGRIND_OUT is the file `valgrind --tool=callgrind --callgrind-out-file=...`
wrote; SESSIONS_OUTPUT what the bench printed (its `sessions: N completed` line
gives the turns). Prints the whole process's instructions per turn (the daemon,
the bench's worker and its callers) and the TOP (15) functions by their own
instructions, as `make bench-callgrind` does.

Under valgrind the threads run one at a time, and threads that wait on sled's
lazy initialisation spin in `sled::lazy::Lazy::deref` for as long as another
thread holds the CPU: billions of instructions that never run natively. Those
are left out of every count here (and printed apart). Valgrind counts a `rep
movsb` by its bytes, so copies (`memcpy`, `memset`) weigh more here than in time.
"""

import collections
import re
import subprocess
import sys

SPIN = "sled::lazy::Lazy"
ROW = re.compile(r"^\s*([\d,]+)\s+\(\s*[\d.]+%\)\s+(.*)$")
# "file:function [object]": the function is what follows the file's name.
FILE_FN = re.compile(r"^(?:.*?\.(?:rs|c|h|S|cc|cpp)|\?\?\?|[^:]*):(.*?)(?:\s+\[[^\]]*\])?$")


def function_rows(out_file):
    """(instructions, function) of each file:function row of the self-cost table."""
    text = subprocess.run(
        ["callgrind_annotate", "--threshold=100", "--inclusive=no", out_file],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    total = None
    rows = []
    in_table = False
    for line in text.splitlines():
        m = ROW.match(line)
        if m and "PROGRAM TOTALS" in line:
            total = int(m.group(1).replace(",", ""))
            continue
        if line.strip().startswith("Ir") and "file:function" in line:
            in_table = True
            continue
        if in_table:
            if not m:
                if rows and not line.strip():
                    break
                continue
            name = FILE_FN.match(m.group(2).strip())
            rows.append((int(m.group(1).replace(",", "")), name.group(1) if name else m.group(2)))
    if total is None:
        sys.exit(f"{out_file}: no PROGRAM TOTALS in callgrind_annotate's output")
    return total, rows


def turns_of(sessions_output):
    with open(sessions_output, encoding="utf-8", errors="replace") as f:
        for line in f:
            m = re.match(r"sessions: (\d+) completed, (\d+) failed", line)
            if m:
                if int(m.group(2)):
                    sys.exit(f"{sessions_output}: {m.group(2)} turns failed; the count is not of the load asked for")
                return int(m.group(1))
    sys.exit(f"{sessions_output}: no `sessions: N completed` line")


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    total, rows = function_rows(sys.argv[1])
    turns = turns_of(sys.argv[2])
    top = int(sys.argv[3]) if len(sys.argv) > 3 else 15
    spin = sum(n for n, f in rows if SPIN in f)
    counted = total - spin
    print(
        f"{counted / turns / 1000:.1f} k instructions per turn, whole process "
        f"({counted:,} over {turns} turns; {spin:,} of sled's lazy-initialisation spin left out)"
    )
    by_fn = collections.Counter()
    for n, f in rows:
        if SPIN not in f:
            by_fn[f] += n
    for f, n in by_fn.most_common(top):
        print(f"  {100 * n / counted:5.1f} %  {n / turns / 1000:7.1f} k/turn  {f[:110]}")


if __name__ == "__main__":
    main()
