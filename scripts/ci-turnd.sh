#!/usr/bin/env bash
# Start turnd for a test job, run COMMAND… against it, stop it.
#
#     scripts/ci-turnd.sh COMMAND [ARG…]
#
# The daemon listens on free loopback ports with a throw-away data directory. While
# COMMAND runs, TURND_URL (ws://127.0.0.1:PORT/v1) and TURND_ADMIN
# (http://127.0.0.1:PORT) are exported and the turnd binary is on PATH, so COMMAND
# can run `turnd …` client commands. The script exits with COMMAND's status; the
# daemon is stopped (SIGTERM) and its data removed however COMMAND ends. The
# daemon's configuration warnings (an unknown TURND_… variable, say) are repeated on
# stderr once it is ready; when COMMAND fails, the daemon's log is kept (at
# $TURND_CI_LOG if set, else in a new file under $TMPDIR) and its end is printed.
#
# The binary is $TURND if set, else `turnd` on PATH, else target/release/turnd or
# target/debug/turnd under the current directory. Extra `turnd serve` arguments can
# be given in TURND_SERVE_ARGS (split on spaces), settings as TURND_<SECTION>__<KEY>
# variables (for example TURND_STORAGE__SYNC=never for fast throw-away runs).
# Needs only bash and coreutils.
set -euo pipefail

if [ "$#" -eq 0 ]; then
    echo "usage: ${0##*/} COMMAND [ARG…]   (runs COMMAND with a turnd daemon at \$TURND_URL)" >&2
    exit 2
fi

turnd=${TURND:-}
if [ -z "$turnd" ]; then
    if command -v turnd >/dev/null 2>&1; then
        turnd=$(command -v turnd)
    elif [ -x target/release/turnd ]; then
        turnd=target/release/turnd
    elif [ -x target/debug/turnd ]; then
        turnd=target/debug/turnd
    else
        echo "${0##*/}: no turnd binary: set TURND=PATH, put turnd on PATH, or build it (cargo build --release -p turnd)" >&2
        exit 2
    fi
fi
if [ ! -x "$turnd" ] && ! turnd=$(command -v "$turnd" 2>/dev/null); then
    echo "${0##*/}: TURND=${TURND:-} is not an executable" >&2
    exit 2
fi
# An absolute path, and its directory on PATH for COMMAND's own `turnd` calls.
turnd=$(cd "$(dirname "$turnd")" && pwd)/$(basename "$turnd")
export TURND="$turnd"
export PATH="$(dirname "$turnd"):$PATH"

work=$(mktemp -d)
pid=

cleanup() {
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid"
        wait "$pid" || true
    fi
    rm -rf "$work"
}
trap cleanup EXIT

# shellcheck disable=SC2086 # TURND_SERVE_ARGS is split on purpose.
"$turnd" serve \
    --listen 127.0.0.1:0 --admin-listen 127.0.0.1:0 \
    --data-dir "$work/data" --ready-file "$work/ready.json" ${TURND_SERVE_ARGS:-} \
    >"$work/stdout.log" 2>"$work/turnd.log" &
pid=$!

# The ready file appears (atomically, by rename) once turnd serves.
for _ in $(seq 1 300); do
    [ -s "$work/ready.json" ] && break
    if ! kill -0 "$pid" 2>/dev/null; then
        echo "${0##*/}: turnd exited before it was ready:" >&2
        cat "$work/turnd.log" >&2
        pid=
        exit 1
    fi
    sleep 0.1
done
if [ ! -s "$work/ready.json" ]; then
    echo "${0##*/}: turnd wrote no ready file within 30 s; its log:" >&2
    cat "$work/turnd.log" >&2
    exit 1
fi

# {"ws":"ws://127.0.0.1:PORT/v1","admin":"http://127.0.0.1:PORT","pid":N}
ready=$(cat "$work/ready.json")
TURND_URL=$(sed -n 's/.*"ws":"\([^"]*\)".*/\1/p' <<<"$ready")
TURND_ADMIN=$(sed -n 's/.*"admin":"\([^"]*\)".*/\1/p' <<<"$ready")
if [ -z "$TURND_URL" ] || [ -z "$TURND_ADMIN" ]; then
    echo "${0##*/}: cannot read the addresses from the ready file: $ready" >&2
    exit 1
fi
export TURND_URL TURND_ADMIN

# What the daemon warned about at start (unknown keys, with what they most likely
# meant) would otherwise be seen only in a log that is removed with the data.
grep -E '^turnd: warning: ' "$work/turnd.log" >&2 || true

# Run COMMAND; keep its status.
status=0
"$@" || status=$?

# Graceful stop: SIGTERM, then the daemon's own exit status.
kill -TERM "$pid"
daemon=0
wait "$pid" || daemon=$?
pid=
if [ "$daemon" -ne 0 ]; then
    echo "${0##*/}: turnd exited with status $daemon on SIGTERM; its log:" >&2
    cat "$work/turnd.log" >&2
    [ "$status" -ne 0 ] || status=1
elif [ "$status" -ne 0 ]; then
    # The log goes with the data directory: keep a copy for whoever looks into the
    # failure.
    keep=${TURND_CI_LOG:-$(mktemp "${TMPDIR:-/tmp}/turnd-ci.XXXXXX.log")}
    cp "$work/turnd.log" "$keep"
    echo "${0##*/}: COMMAND exited with status $status; the daemon's log is kept at $keep; its last 40 lines:" >&2
    tail -n 40 "$keep" >&2
fi
exit "$status"
