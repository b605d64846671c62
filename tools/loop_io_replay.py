"""Replay the NVMe optimizer loop's swap traffic outside the engine, to tell the disk's rate for that
pattern from the engine process's (a development tool; issue 31 item 4).

    python tools/loop_io_replay.py DIR SUBGROUPS [SUBGROUP_ELEMS] [COMPUTE_MS] [split] [optonly] [onepool]

Three files as at ZeRO-Infinity's defaults on one rank: ``optimizer.swp`` (12 bytes per element: fp32
master, exp_avg, exp_avg_sq), ``gradients.swp`` and ``params.swp`` (bf16, 2 bytes each), all written
once first (reads then read real blocks). Then one loop, as
:class:`zerodp.offload.step_pipeline.SubGroupPipeline` runs it: sub-group k's region is read 6 ahead
into 8 buffers, its gradients read one ahead, ``COMPUTE_MS`` of sleep stand in for the update (no GIL
held), then the region is written back and the bf16 cast written to ``params.swp``. Each file has its
own pool of 2 threads, 1 MiB blocks, 8 per call (the preset's ``aio``). Options: ``split``, the
optimizer file's writes through a pool of their own; ``optonly``, no gradient reads or parameter
writes; ``onepool``, every transfer through the optimizer file's pool, each sub-group's gradient read
queued right after its region's read. Prints MB/s (read + written) per 10 s and for the whole loop.
"""

from __future__ import annotations

import os
import sys
import time

from zerodp.offload.aio import AsyncIO, SwapFile, align_up, aligned_buffer
from zerodp.offload.config import AioConfig

AIO = {"block_size": 1 << 20, "queue_depth": 8, "thread_count": 2}
AHEAD, NBUF = 6, 8


def replay(
    directory: str,
    subgroups: int,
    elems: int,
    compute_s: float,
    split: bool = False,
    optonly: bool = False,
    onepool: bool = False,
) -> None:
    region, half = align_up(12 * elems), align_up(2 * elems)  # regions padded to 4096 bytes, as the swappers do
    cfg = AioConfig.model_validate(AIO)
    pools = {name: AsyncIO(cfg) for name in ("optimizer", "gradients", "params")}
    opt_writes = AsyncIO(cfg) if split else pools["optimizer"]
    if onepool:
        pools["gradients"] = pools["params"] = pools["optimizer"]
    files = {n: SwapFile(os.path.join(directory, f"replay_{n}.swp")) for n in pools}
    bufs = [aligned_buffer(region) for _ in range(NBUF)]
    gbufs = [aligned_buffer(half) for _ in range(NBUF if onepool else 2)]
    pbuf = aligned_buffer(half)
    try:
        t = time.perf_counter()
        for n, size in (("optimizer", region), ("gradients", half), ("params", half)):
            os.posix_fallocate(files[n].fd, 0, size * subgroups)
            for k in range(subgroups):
                pools[n].write(files[n], (bufs[0] if n == "optimizer" else pbuf)[:size], k * size).wait()
        print(f"files written: {subgroups * (region + 2 * half) / 1e9:.1f} GB in {time.perf_counter() - t:.1f} s")
        reads, writes, greads, pwrites = {}, {}, {}, []
        issued, moved = 0, 0
        t0 = window = time.perf_counter()
        last_moved = 0
        if not optonly and not onepool:
            greads[0] = pools["gradients"].read(files["gradients"], gbufs[0], 0)
        for k in range(subgroups):
            while issued < min(subgroups, k + AHEAD + 1):
                slot = issued % NBUF
                if slot in writes:
                    writes.pop(slot).wait()
                reads[issued] = pools["optimizer"].read(files["optimizer"], bufs[slot], issued * region)
                if onepool and not optonly:
                    greads[issued] = pools["gradients"].read(files["gradients"], gbufs[slot], issued * half)
                issued += 1
            if k + 1 < subgroups and not optonly and not onepool:
                greads[k + 1] = pools["gradients"].read(files["gradients"], gbufs[(k + 1) % 2], (k + 1) * half)
            reads.pop(k).wait()
            if not optonly:
                greads.pop(k).wait()
            time.sleep(compute_s)
            writes[k % NBUF] = opt_writes.write(files["optimizer"], bufs[k % NBUF], k * region)
            if not optonly:
                pwrites = [h for h in pwrites if not h.done()]
                pwrites.append(pools["params"].write(files["params"], pbuf, k * half))
            moved += 2 * region + (0 if optonly else 2 * half)
            now = time.perf_counter()
            if now - window >= 10:
                print(f"  {now - t0:6.0f} s: {(moved - last_moved) / (now - window) / 1e6:,.0f} MB/s", flush=True)
                window, last_moved = now, moved
        for h in list(writes.values()) + pwrites:
            h.wait()
        dt = time.perf_counter() - t0
        print(f"loop: {moved / 1e9:.1f} GB in {dt:.1f} s = {moved / dt / 1e6:,.0f} MB/s (read + written)")
    finally:
        for f in files.values():
            f.close()
            os.remove(f.path)
        for p in [*pools.values(), opt_writes]:
            p.close()


def main() -> None:
    directory, subgroups = sys.argv[1], int(sys.argv[2])
    elems = int(float(sys.argv[3])) if len(sys.argv) > 3 else 12_500_000
    compute_ms = float(sys.argv[4]) if len(sys.argv) > 4 else 50.0
    unknown = set(sys.argv[5:]) - {"split", "optonly", "onepool"}
    if unknown:
        raise SystemExit(f"unknown option(s) {sorted(unknown)}: allowed are split, optonly, onepool")
    os.makedirs(directory, exist_ok=True)
    replay(
        directory,
        subgroups,
        elems,
        compute_ms / 1e3,
        split="split" in sys.argv[5:],
        optonly="optonly" in sys.argv[5:],
        onepool="onepool" in sys.argv[5:],
    )


if __name__ == "__main__":
    main()
