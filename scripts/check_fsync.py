#!/usr/bin/env python3
"""Check, from an strace of the daemon, that every durable acknowledgement was
preceded by an fsync-class call on sled's log file covering the acknowledged change.

Input: a trace written by

    strace -f -qq -yy -xx -s 1048576 -e trace=read,recvfrom,readv,write,writev,sendto,sendmsg,pwrite64,pwritev,fsync,fdatasync,sync_file_range -o TRACE turnd serve ...

(`-yy` names every fd: files by path, sockets as `TCP:[local->peer]`; `-xx` prints
every buffer byte as \\xNN; the large `-s` keeps whole buffers).

How it works:

1. Every line becomes a syscall event with a start and an end position in the trace
   (an `<unfinished ...>` line and its `<... resumed>` line are joined). strace
   prints a thread's syscall exit before that thread runs on, so a sync that returned
   before another thread's socket write began appears earlier in the file: positions
   order the events causally.
2. The bytes read from and written to each TCP connection are reassembled into
   WebSocket frames (after the HTTP upgrade). Client frames are masked; the mask key
   is in the frame, so requests decode. Each request keeps the position of the read
   that completed it, each response the position of the write that began it.
3. Requests `turn.submit`, `turn.stop`, `session.stop` and `invocation.result`
   answered `ok` are acknowledgements that must be durable — except answers that
   changed nothing: a deduplicated submit, a result answered `duplicate` or
   `unknown`, a session stop with no turn to stop.
4. For each one, the key of the change (the new turn's id, the stopped turn's id,
   the session id, the invocation id) must appear in a write to a commit log segment
   (`<data dir>/log/<lsn>.seg`) that began after the request was read (in a
   record's payload, decompressed when the daemon wrote it LZ4-compressed), and an
   `fdatasync`/`fsync` of that same segment file must have begun after that write
   returned and returned before the response was written to the socket.

Exit status 0 when every acknowledgement passes, 1 otherwise (each failure listed),
2 when the trace holds no acknowledgement at all.
"""

import argparse
import json
import os
import re
import sys
from collections import defaultdict

try:
    import lz4.block
except ImportError:
    sys.exit("check_fsync: the lz4 module is missing: run it with target/venv/bin/python (make venv), as make check-fsync does")

LINE = re.compile(r"^(\d+)\s+(.*)$")
CALL = re.compile(r"^([a-z_0-9]+)\((.*)$")
RESUMED = re.compile(r"^<\.\.\. ([a-z_0-9]+) resumed>(.*)$")
RET = re.compile(r"\)\s+=\s+(-?\d+)")
FD_SOCK = re.compile(r"^(\d+)<(TCP|TCPv6|UDP|UDPv6|UNIX|UNIX-STREAM):\[([^\]]*)\]>")
FD_PATH = re.compile(r"^(\d+)<((?:\\x[0-9a-f]{2})*)>")
STRING = re.compile(r'"((?:\\x[0-9a-f]{2})*)"(\.\.\.)?')

READS = {"read", "recvfrom", "readv"}
WRITES = {"write", "writev", "sendto", "sendmsg", "pwrite64", "pwritev"}
SYNCS = {"fsync", "fdatasync"}

DURABLE_OPS = {"turn.submit", "turn.stop", "session.stop", "invocation.result"}


def unhex(s):
    return bytes.fromhex(s.replace("\\x", ""))


# A commit log record: `len: u32 LE | crc32: u32 LE | lsn: u64 LE | payload`; a
# payload starting with these two bytes is LZ4 block data with its size prepended.
RECORD_HEADER = 16
PACKED = b"\xff4"


def record_payloads(data):
    """The payloads of the commit log records a segment write holds, decompressed,
    and the written bytes themselves (a write that does not start at a record reads
    as its bytes only)."""
    out = [data]
    i = 0
    while i + RECORD_HEADER <= len(data):
        n = int.from_bytes(data[i : i + 4], "little")
        payload = data[i + RECORD_HEADER : i + RECORD_HEADER + n]
        if n == 0 or len(payload) < n:
            break
        if payload.startswith(PACKED):
            try:
                out.append(lz4.block.decompress(payload[len(PACKED) :]))
            except lz4.block.LZ4BlockError:
                break
        i += RECORD_HEADER + n
    return b"".join(out)


class Event:
    __slots__ = ("pid", "name", "text", "start", "end", "ret")

    def __init__(self, pid, name, text, start):
        self.pid, self.name, self.text, self.start = pid, name, text, start
        self.end, self.ret = start, None

    def target(self):
        """('sock', conn) or ('file', path) or (None, None)."""
        m = FD_SOCK.match(self.text)
        if m:
            return "sock", m.group(3)
        m = FD_PATH.match(self.text)
        if m:
            try:
                return "file", unhex(m.group(2)).decode("utf-8", "replace")
            except ValueError:
                return None, None
        return None, None

    def buffers(self):
        """The bytes the call moved (only the first `ret` for a partial transfer)."""
        out = b""
        truncated = False
        for m in STRING.finditer(self.text):
            out += unhex(m.group(1))
            truncated |= m.group(2) is not None
        if self.ret is not None and self.ret >= 0:
            out = out[: self.ret]
        return out, truncated


def parse_trace(path):
    events = []
    open_calls = {}
    with open(path, "r", errors="replace") as f:
        for pos, raw in enumerate(f):
            m = LINE.match(raw.rstrip("\n"))
            if not m:
                continue
            pid, rest = int(m.group(1)), m.group(2)
            r = RESUMED.match(rest)
            if r:
                ev = open_calls.pop((pid, r.group(1)), None)
                if ev is None:
                    continue
                ev.text += r.group(2)
                ev.end = pos
            else:
                c = CALL.match(rest)
                if not c:
                    continue
                ev = Event(pid, c.group(1), c.group(2), pos)
                if rest.endswith("<unfinished ...>"):
                    ev.text = ev.text[: -len("<unfinished ...>")]
                    open_calls[(pid, ev.name)] = ev
                    events.append(ev)
                    continue
            rm = RET.search(ev.text)
            ev.ret = int(rm.group(1)) if rm else None
            if not r:
                events.append(ev)
    return events


class Stream:
    """One direction of one connection: bytes in order, with the trace position of
    the call that delivered each chunk."""

    def __init__(self, masked):
        self.masked = masked
        self.buf = bytearray()
        self.chunks = []  # (offset of first byte, start, end)
        self.http_done = False
        self.frames = []  # (payload text, first-byte call start, last-byte call end)

    def add(self, data, start, end):
        self.chunks.append((len(self.buf), start, end))
        self.buf += data

    def _pos(self, offset):
        best = None
        for off, start, end in self.chunks:
            if off <= offset:
                best = (start, end)
            else:
                break
        return best

    def parse(self):
        data = bytes(self.buf)
        i = 0
        if not self.http_done:
            j = data.find(b"\r\n\r\n")
            if j < 0:
                return
            i = j + 4
            self.http_done = True
        while i + 2 <= len(data):
            b0, b1 = data[i], data[i + 1]
            opcode = b0 & 0x0F
            masked = bool(b1 & 0x80)
            n = b1 & 0x7F
            h = 2
            if n == 126:
                if i + 4 > len(data):
                    break
                n = int.from_bytes(data[i + 2 : i + 4], "big")
                h = 4
            elif n == 127:
                if i + 10 > len(data):
                    break
                n = int.from_bytes(data[i + 2 : i + 10], "big")
                h = 10
            key = b""
            if masked:
                key = data[i + h : i + h + 4]
                h += 4
            if i + h + n > len(data):
                break
            payload = data[i + h : i + h + n]
            if masked:
                payload = bytes(c ^ key[k % 4] for k, c in enumerate(payload))
            first = self._pos(i)
            last = self._pos(i + h + n - 1)
            if opcode == 1 and first and last:
                self.frames.append((payload.decode("utf-8", "replace"), first[0], last[1]))
            i += h + n


def is_log_segment(path):
    """A commit log segment: `<data dir>/log/<20-digit lsn>.seg`."""
    return os.path.basename(os.path.dirname(path)) == "log" and re.fullmatch(
        r"\d{20}\.seg", os.path.basename(path)
    ) is not None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()

    events = parse_trace(args.trace)
    streams = defaultdict(lambda: {"in": Stream(True), "out": Stream(False)})
    db_writes = []  # (start, end, data)
    db_syncs = []  # (start, end, name)
    truncated = 0
    for ev in events:
        kind, what = ev.target()
        if kind == "sock" and ev.name in READS | WRITES and (ev.ret or 0) > 0:
            data, cut = ev.buffers()
            truncated += cut
            direction = "in" if ev.name in READS else "out"
            streams[what][direction].add(data, ev.start, ev.end)
        elif kind == "file" and is_log_segment(what):
            if ev.name in WRITES:
                data, cut = ev.buffers()
                truncated += cut
                db_writes.append((ev.start, ev.end, record_payloads(data), what))
            elif ev.name in SYNCS and ev.ret == 0:
                db_syncs.append((ev.start, ev.end, ev.name, what))
    if truncated:
        print(f"warning: {truncated} buffers were truncated by strace (-s too small)")

    acks = []
    for conn, s in streams.items():
        s["in"].parse()
        s["out"].parse()
        requests = {}
        for text, _first, last in s["in"].frames:
            try:
                req = json.loads(text)
            except ValueError:
                continue
            if isinstance(req, dict) and isinstance(req.get("id"), int):
                requests[req["id"]] = (req, last)
        for text, first, _last in s["out"].frames:
            try:
                resp = json.loads(text)
            except ValueError:
                continue
            if not isinstance(resp, dict) or "push" in resp or "ok" not in resp:
                continue
            got = requests.get(resp.get("id"))
            if not got:
                continue
            req, read_at = got
            op = req.get("op")
            if op in DURABLE_OPS:
                acks.append((conn, op, req, resp["ok"], read_at, first))

    counts = defaultdict(int)
    exempt = defaultdict(int)
    failures = []
    gaps = []
    for conn, op, req, ok, read_at, sent_at in acks:
        a = req.get("args") or {}
        key = None
        if op == "turn.submit":
            if ok.get("deduplicated"):
                exempt["turn.submit (deduplicated)"] += 1
                continue
            key = (ok.get("turn") or {}).get("turn_id")
        elif op == "turn.stop":
            key = a.get("turn_id")
        elif op == "session.stop":
            if not ok.get("turns"):
                exempt["session.stop (nothing to stop)"] += 1
                continue
            key = a.get("session_id")
        elif op == "invocation.result":
            if ok.get("accepted") in ("duplicate", "unknown"):
                exempt[f"invocation.result ({ok.get('accepted')})"] += 1
                continue
            key = a.get("invocation_id")
        counts[op] += 1
        what = f"{op} id={req.get('id')} key={key} on {conn}"
        if not key:
            failures.append(f"{what}: no key to look for")
            continue
        kb = key.encode()
        write = next((w for w in db_writes if w[0] > read_at and kb in w[2]), None)
        if write is None or write[0] > sent_at:
            failures.append(f"{what}: acknowledged (trace line {sent_at + 1}) before any write of {key} to the commit log")
            continue
        sync = next(
            (s for s in db_syncs if s[0] > write[1] and s[1] < sent_at and s[3] == write[3]),
            None,
        )
        if sync is None:
            failures.append(
                f"{what}: written to {write[3]} at trace line {write[0] + 1} but acknowledged at line {sent_at + 1} with no fsync/fdatasync of that file in between"
            )
            continue
        gaps.append(sent_at - sync[1])
        if args.verbose:
            print(f"ok  {what}: request line {read_at + 1}, write line {write[0] + 1}, {sync[2]} lines {sync[0] + 1}-{sync[1] + 1}, ack line {sent_at + 1}")

    total = sum(counts.values())
    print(
        "acknowledgements checked: "
        + (", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none")
        + f"; exempt (nothing written): {dict(exempt) or 'none'}"
    )
    segments = sorted({w[3] for w in db_writes})
    print(f"commit log: {len(segments)} segment files, {len(db_writes)} writes, {len(db_syncs)} fsync-class calls ({', '.join(sorted({s[2] for s in db_syncs})) or 'none'})")
    if total == 0:
        print("FAIL: no acknowledgement found in the trace")
        return 2
    if failures:
        for f in failures:
            print("FAIL: " + f)
        print(f"FAIL: {len(failures)} of {total} acknowledgements were not preceded by an fsync of their write")
        return 1
    print(f"PASS: all {total} acknowledgements were written to the socket after an fsync-class call on the commit log segment holding their data that began after it was written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
