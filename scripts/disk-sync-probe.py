#!/usr/bin/env python3
"""How long `fdatasync` of small appends takes on a disk, with and without other writes.

Usage: disk-sync-probe.py DIR MB_PER_S SECONDS [direct] [unsynced]

One thread does what turnd's commit log does: writes 12,000 bytes into a file whose
blocks are already written (64 MiB of zeros, synced first), `fdatasync`s it, and
measures the sync, over and over. With `direct` it opens that file with `O_DIRECT`
instead (writes of 12,288 bytes from a page-aligned buffer, past the page cache) and
measures each write and its `fdatasync` together. With `unsynced` the background
writer never syncs: its pages wait in the page cache for the kernel's write-back,
as sled's do between the applier's syncs. Another thread, when MB_PER_S is above 0, writes
512 KiB chunks of random bytes into a second file at that rate and `fdatasync`s it
every 4 MiB, as a background writer (sled's IO threads write 512 KiB segments). Both
files are made in DIR (on the disk under test) and removed at the end.

Prints the syncs' count, p50 / p99 / p99.9 / max, and how many took over 20 and 50 ms.
"""

import mmap
import os
import sys
import threading
import time


def main() -> None:
    extra = sys.argv[4:]
    if len(sys.argv) < 4 or any(a not in ("direct", "unsynced") for a in extra):
        sys.exit(__doc__)
    where, mbps, secs = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
    direct, unsynced = "direct" in extra, "unsynced" in extra
    log_path, bg_path = os.path.join(where, "probe-log.dat"), os.path.join(where, "probe-bg.dat")

    def background() -> None:
        fd = os.open(bg_path, os.O_WRONLY | os.O_CREAT, 0o644)
        chunk = os.urandom(512 * 1024)
        off, sent, t0 = 0, 0, time.time()
        while time.time() < stop:
            os.pwrite(fd, chunk, off)
            off = (off + len(chunk)) % (256 << 20)
            sent += len(chunk)
            if not unsynced and sent % (4 << 20) == 0:
                os.fdatasync(fd)
            ahead = sent / (mbps * 1e6) - (time.time() - t0)
            if ahead > 0:
                time.sleep(ahead)
        os.close(fd)

    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT, 0o644)
    os.pwrite(fd, b"\0" * (64 << 20), 0)
    os.fsync(fd)
    if direct:
        os.close(fd)
        fd = os.open(log_path, os.O_WRONLY | os.O_DIRECT)
    stop = time.time() + secs
    bg = threading.Thread(target=background) if mbps > 0 else None
    if bg:
        bg.start()
    took, off = [], 0
    if direct:
        # O_DIRECT needs a buffer, length and offset aligned to the block size.
        record = mmap.mmap(-1, 12288)
        record.write(os.urandom(12288))
    else:
        record = os.urandom(12000)
    while time.time() < stop:
        t = time.perf_counter()
        os.pwrite(fd, record, off)
        if not direct:
            t = time.perf_counter()
        off = (off + len(record)) % (60 << 20)
        os.fdatasync(fd)
        took.append(time.perf_counter() - t)
    if bg:
        bg.join()
    os.close(fd)
    for p in (log_path, bg_path):
        if os.path.exists(p):
            os.remove(p)
    took.sort()
    n = len(took)
    if n == 0:
        sys.exit("no sync finished in the time given")

    def q(p: float) -> float:
        return took[min(n - 1, int(p * n))] * 1000

    print(
        f"{'O_DIRECT writes and ' if direct else ''}background {mbps:.0f} MB/s"
        f"{' never synced' if unsynced else ''}, {secs:.0f} s: {n} syncs ({n / secs:.0f}/s) · "
        f"p50 {q(0.5):.2f} · p99 {q(0.99):.2f} · p99.9 {q(0.999):.2f} · max {took[-1] * 1000:.1f} ms · "
        f"over 20 ms {sum(t > 0.02 for t in took)} · over 50 ms {sum(t > 0.05 for t in took)}"
    )


if __name__ == "__main__":
    main()
