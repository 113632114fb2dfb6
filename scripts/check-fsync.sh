#!/usr/bin/env bash
# check-fsync: prove from the system calls that turnd fsyncs before it acknowledges.
#
# Runs the real `turnd serve` under strace, drives a small known load through it with
# `turnd-bench drive` (submits, a deduplicated resubmit, one- and two-step turns whose
# results a worker reports, turn stops, a session stop), stops it with SIGTERM, and
# has scripts/check_fsync.py verify from the trace that every acknowledgement of
# turn.submit / turn.stop / session.stop / invocation.result was written to its socket
# only after an fdatasync/fsync of the commit log segment holding the acknowledged
# change that began after the change was written to that file.
#
# Then a control run with storage.sync = "never" must FAIL the same check: a check
# that cannot fail proves nothing.
#
# Usage: scripts/check-fsync.sh            (release build)
#        PROFILE=debug scripts/check-fsync.sh
#        KEEP=1 scripts/check-fsync.sh     (keep the traces; their paths are printed)
set -euo pipefail

cd "$(dirname "$0")/.."
PROFILE="${PROFILE:-release}"
# The checker reads the commit log's LZ4-compressed records with the `lz4` module:
# `make check-fsync` passes the project's virtual environment (target/venv).
CHECK_PY="${CHECK_PY:-python3}"
CARGO="${CARGO:-cargo}"

if ! command -v strace >/dev/null 2>&1; then
    echo "check-fsync: strace not found; installing it with apt-get"
    SUDO=""
    if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
    $SUDO apt-get install -y strace >/dev/null || {
        $SUDO apt-get update >/dev/null && $SUDO apt-get install -y strace >/dev/null
    }
fi

if [ "$PROFILE" = release ]; then
    $CARGO build --release -p turnd -p turnd-bench
    BIN=target/release
else
    $CARGO build -p turnd -p turnd-bench
    BIN=target/debug
fi

WORK="$(mktemp -d -t turnd-fsync.XXXXXX)"
cleanup() {
    if [ -n "${KEEP:-}" ]; then
        echo "check-fsync: traces kept in $WORK"
    else
        rm -rf "$WORK"
    fi
}
trap cleanup EXIT

# One traced daemon life with storage.sync = $1; the checker's exit status.
run() {
    local sync="$1" dir="$WORK/$1"
    mkdir -p "$dir"
    TURND_STORAGE__SYNC="$sync" TURND_LOG=warn \
        strace -f -qq -yy -xx -s 1048576 -o "$dir/trace" \
        -e trace=read,recvfrom,readv,write,writev,sendto,sendmsg,pwrite64,pwritev,fsync,fdatasync,sync_file_range \
        "$BIN/turnd" serve --listen 127.0.0.1:0 --admin-listen 127.0.0.1:0 \
        --data-dir "$dir/data" --ready-file "$dir/ready.json" \
        >"$dir/daemon.log" 2>&1 &
    local strace_pid=$!
    for _ in $(seq 1 300); do
        [ -s "$dir/ready.json" ] && break
        sleep 0.1
    done
    if [ ! -s "$dir/ready.json" ]; then
        echo "check-fsync: turnd did not become ready; its log:" >&2
        cat "$dir/daemon.log" >&2
        kill "$strace_pid" 2>/dev/null || true
        return 3
    fi
    local url pid
    url="$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["ws"])' "$dir/ready.json")"
    pid="$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["pid"])' "$dir/ready.json")"
    "$BIN/turnd-bench" drive --url "$url" --sessions 3 --turns 4 --steps 2
    kill -TERM "$pid"
    wait "$strace_pid"
    "$CHECK_PY" scripts/check_fsync.py "$dir/trace"
}

echo "== storage.sync = always (the default): every acknowledgement must follow an fsync"
run always

echo
echo "== control: storage.sync = never must be caught by the same check"
set +e
run never
status=$?
set -e
if [ "$status" -eq 1 ]; then
    echo "check-fsync: the control run was flagged, as it must be"
    echo "check-fsync: PASS"
else
    echo "check-fsync: the control run (no fsync) was NOT flagged (status $status): the check is broken" >&2
    exit 1
fi
