"""Raw direct-I/O throughput of a disk through zerodp's ``AsyncIO``: sequential write and read, and a
read and a write at once (the mix of the NVMe optimizer step), for ``aio.thread_count`` 1, 2 and 4
(1 MiB blocks, queue depth 8).

    python tools/disk_mix_probe.py DIR [BYTES]   # BYTES per half (default 2e9): 2 x BYTES each way
    python tools/disk_mix_probe.py DIR --sustained SECONDS [FILE_BYTES]

"Mixed two pools" reads the first half of the file while a second pool writes the second half; "mixed
one pool" queues both on one pool. Rates are bytes moved / wall seconds. ``--sustained`` keeps that mix
going (2 threads per pool, 256 MiB chunks walked through a FILE_BYTES file, default 16e9) for SECONDS
and prints the rate of every 10 s window: a short probe can run on a virtual disk's burst budget, a
long run of direct I/O shows the rate the disk sustains.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

from zerodp.offload.aio import AsyncIO, SwapFile, aligned_buffer
from zerodp.offload.config import AioConfig

MIB = 1 << 20


def probe(directory: str, nbytes: int, threads: int) -> dict[str, float]:
    """MB/s for one ``thread_count``: write, read, mixed with two pools, mixed on one pool."""
    cfg = AioConfig(block_size=MIB, queue_depth=8, thread_count=threads)
    a, b = AsyncIO(cfg), AsyncIO(cfg)
    buf, buf2 = aligned_buffer(nbytes), aligned_buffer(nbytes)
    buf.fill_(3)
    f = SwapFile(tempfile.mktemp(prefix="zerodp_mix_", dir=directory))
    out = {}
    try:
        os.posix_fallocate(f.fd, 0, 2 * nbytes)
        t = time.perf_counter()
        a.write(f, buf, 0).wait()
        a.write(f, buf, nbytes).wait()
        os.fsync(f.fd)
        out["write"] = time.perf_counter() - t
        t = time.perf_counter()
        a.read(f, buf, 0).wait()
        a.read(f, buf, nbytes).wait()
        out["read"] = time.perf_counter() - t
        for name, other in (("mixed two pools", b), ("mixed one pool", a)):
            t = time.perf_counter()
            handles = [a.read(f, buf, 0), other.write(f, buf2, nbytes)]
            for h in handles:
                h.wait()
            out[name] = time.perf_counter() - t
    finally:
        f.close()
        os.remove(f.path)
        a.close()
        b.close()
    return {k: 2 * nbytes / v / 1e6 for k, v in out.items()}


def sustained(directory: str, seconds: float, file_bytes: int, chunk: int = 256 * MIB) -> None:
    """Read chunk k while writing chunk k + n/2 (two pools, 2 threads each) until ``seconds`` pass; one
    line per 10 s window with its MB/s."""
    cfg = AioConfig(block_size=MIB, queue_depth=8, thread_count=2)
    a, b = AsyncIO(cfg), AsyncIO(cfg)
    rbuf, wbuf = aligned_buffer(chunk), aligned_buffer(chunk)
    wbuf.fill_(5)
    n = max(2, file_bytes // chunk)
    f = SwapFile(tempfile.mktemp(prefix="zerodp_mix_", dir=directory))
    try:
        os.posix_fallocate(f.fd, 0, n * chunk)
        for k in range(n):  # written once so that reads read real blocks
            b.write(f, wbuf, k * chunk).wait()
        start = window = time.perf_counter()
        moved, k = 0, 0
        while time.perf_counter() - start < seconds:
            handles = [a.read(f, rbuf, (k % n) * chunk), b.write(f, wbuf, ((k + n // 2) % n) * chunk)]
            for h in handles:
                h.wait()
            moved, k = moved + 2 * chunk, k + 1
            now = time.perf_counter()
            if now - window >= 10:
                print(f"  {now - start:6.0f} s: {moved / (now - window) / 1e6:,.0f} MB/s (read + written)", flush=True)
                moved, window = 0, now
    finally:
        f.close()
        os.remove(f.path)
        a.close()
        b.close()


def main() -> None:
    directory = sys.argv[1]
    if len(sys.argv) > 2 and sys.argv[2] == "--sustained":
        os.makedirs(directory, exist_ok=True)
        sustained(directory, float(sys.argv[3]), int(float(sys.argv[4]) if len(sys.argv) > 4 else 16e9))
        return
    nbytes = int(float(sys.argv[2]) if len(sys.argv) > 2 else 2e9) // MIB * MIB
    os.makedirs(directory, exist_ok=True)
    for threads in (1, 2, 4):
        rates = probe(directory, nbytes, threads)
        print(f"threads {threads}: " + ", ".join(f"{k} {v:,.0f} MB/s" for k, v in rates.items()), flush=True)


if __name__ == "__main__":
    main()
