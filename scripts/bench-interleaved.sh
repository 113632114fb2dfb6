#!/usr/bin/env bash
# bench-interleaved: compare builds of turnd-bench fairly on a shared machine.
#
# Single benchmark runs one after the other drift with the machine (by up to a fifth
# within minutes for the same binary here), so a before/after pair of single runs can
# show a gain that is not there. This runs each given turnd-bench binary once per
# round, round robin, for ROUNDS rounds, so that drift hits every build alike, and
# prints one line per run: round, binary, throughput, p50 and the CPU per turn from
# the run's notes.
#
# Build the binaries to compare first, each from its commit, for example:
#   git worktree add /tmp/old <commit> && (cd /tmp/old &&
#     CARGO_TARGET_DIR=/tmp/old-target cargo build --release -p turnd-bench)
#   cp /tmp/old-target/release/turnd-bench /tmp/bench-old
#
# Usage: scripts/bench-interleaved.sh ROUNDS SCENARIO BIN [BIN ...] [-- SCENARIO ARGS]
#   e.g. scripts/bench-interleaved.sh 4 sessions /tmp/bench-old target/release/turnd-bench
set -euo pipefail

if [ $# -lt 3 ]; then
    sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
rounds=$1
scenario=$2
shift 2
bins=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
    bins+=("$1")
    shift
done
[ "${1:-}" = "--" ] && shift
for b in "${bins[@]}"; do
    [ -x "$b" ] || { echo "bench-interleaved: $b is not an executable" >&2; exit 2; }
done

echo "load: $(cut -d' ' -f1-3 /proc/loadavg)"
for r in $(seq 1 "$rounds"); do
    for b in "${bins[@]}"; do
        row=$("$b" "$scenario" "$@" 2>/dev/null | grep "^| $scenario |" || true)
        if [ -z "$row" ]; then
            echo "round $r  $b  (no result row: run it alone to see why)"
            continue
        fi
        rate=$(echo "$row" | cut -d'|' -f7 | xargs)
        p50=$(echo "$row" | cut -d'|' -f8 | xargs)
        cpu=$(echo "$row" | grep -o 'CPU [0-9]* µs per turn' || echo 'CPU ? µs per turn')
        echo "round $r  $b  $rate  p50 $p50 ms  $cpu"
    done
done
echo "load: $(cut -d' ' -f1-3 /proc/loadavg)"
