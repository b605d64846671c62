"""``zerodp bench --offload`` extras (the engines themselves are built by
:func:`zerodp.app.bench_systems.offload_systems`): the NVMe swap bandwidth beside a raw sequential
direct-I/O read and write of the same size on the same disk, and the CPU Adam kernels (for-loop,
foreach, fused) timed on the same elements; and the swapper-only measurement
(``python -m zerodp.app.bench_offload``).

The swap bandwidth is bytes read + written by the optimizer swapper in one step divided by the time
of its swap phase (the sub-group loop: reads, updates, writes), from
:attr:`zerodp.offload.nvme.NvmeOptimizerOffload.stats`.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from typing import Any, Optional

import torch

import zerodp
from zerodp.offload.aio import AsyncIO, SwapFile, aligned_buffer
from zerodp.offload.config import AioConfig

#: the NVMe engines built by the bench (the last one's swap statistics are reported)
NVME_ENGINES: list[Any] = []


def raw_direct_io(directory: str, nbytes: int, cfg: Optional[AioConfig] = None, repeats: int = 3) -> tuple[float, float]:
    """Median seconds to write then read ``nbytes`` sequentially with direct I/O in ``directory``
    (the same thread pool and block size as the swapper); returns (write s, read s)."""
    io = AsyncIO(cfg or AioConfig())
    buf = aligned_buffer(nbytes)
    buf.fill_(7)
    path = tempfile.mktemp(prefix="zerodp_raw_", dir=directory)
    f = SwapFile(path)
    writes, reads = [], []
    try:
        os.posix_fallocate(f.fd, 0, buf.numel())
        for _ in range(repeats):
            t0 = time.perf_counter()
            io.write(f, buf, 0).wait()
            os.fsync(f.fd)
            writes.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            io.read(f, buf, 0).wait()
            reads.append(time.perf_counter() - t0)
    finally:
        f.close()
        os.remove(path)
        io.close()
    return statistics.median(writes), statistics.median(reads)


def swap_report(directory: str) -> str:
    """The last NVMe engine's swap bandwidth next to the raw direct-I/O figure on the same disk."""
    if not NVME_ENGINES:
        return "offload nvme: not measured"
    off = NVME_ENGINES[0].offload
    st = off.stats
    moved = st.bytes_read + st.bytes_written
    w, r = raw_direct_io(directory, st.bytes_read, off.aio_cfg)
    raw = moved / (w + r)
    swap = moved / st.seconds if st.seconds else float("nan")
    direct = "O_DIRECT" if off.file.direct else "buffered (no O_DIRECT on this file system)"
    return (f"offload nvme ({direct}, {len(off.subgroups)} sub-groups, {len(off.buffers)} buffers): swap phase "
            f"{moved / 1e6:.1f} MB read+written in {st.seconds * 1e3:.1f} ms (of which updates "
            f"{st.update_seconds * 1e3:.1f} ms) = {swap / 1e6:.0f} MB/s; raw "
            f"sequential direct I/O of the same size: write {st.bytes_read / w / 1e6:.0f} MB/s, read "
            f"{st.bytes_read / r / 1e6:.0f} MB/s, together {raw / 1e6:.0f} MB/s; swap / raw = {swap / raw:.2f}")


def adam_kernels(numel: int, repeats: int = 5) -> str:
    """Median time of one torch AdamW step on ``numel`` fp32 CPU elements per implementation."""
    rows = []
    for name, kw in (("for-loop", {"foreach": False}), ("foreach", {"foreach": True}), ("fused", {"fused": True})):
        torch.manual_seed(0)
        ps = [torch.zeros(n, requires_grad=True) for n in _split(numel)]
        for p in ps:
            p.grad = torch.randn_like(p)
        try:
            opt = torch.optim.AdamW(ps, lr=1e-3, **kw)
        except (RuntimeError, ValueError) as exc:
            rows.append(f"{name}: unavailable ({exc})")
            continue
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
        rows.append(f"{name} {statistics.median(times[1:]) * 1e3:.1f} ms")
    return f"CPU AdamW step, {numel:,} fp32 elements in 16 tensors: " + ", ".join(rows)


def _split(numel: int, parts: int = 16) -> list[int]:
    base = numel // parts
    return [base] * (parts - 1) + [numel - base * (parts - 1)]


def swapper_only(numel: int, nvme_path: str, sub_group_size: int, steps: int = 3,
                 thread_count: int = 1) -> str:
    """One rank, stage 1, a ``numel``-element stack of 1000 x 1000 linear layers with the optimizer on NVMe: the swap
    report after ``steps`` steps (``python -m zerodp.app.bench_offload``)."""
    side = 1000  # layers of 1e6 elements, so sub-groups of sub_group_size form
    layers = max(1, numel // (side * side))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(side, side, bias=False) for _ in range(layers)])
    engine = zerodp.initialize(model, {
        "optimizer": {"type": "AdamW"}, "aio": {"thread_count": thread_count},
        "zero_optimization": {"stage": 1, "sub_group_size": sub_group_size,
                              "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path}}})
    NVME_ENGINES[:] = [engine]
    x = torch.randn(4, side)
    for _ in range(steps):
        engine.backward(engine(x).square().mean() * 1e-3)
        engine.step()
    out = f"{layers * side * side:,} parameters, sub_group_size {sub_group_size:,}, aio.thread_count {thread_count}\n"
    out += swap_report(nvme_path)
    engine.close()
    return out


__all__ = ["swapper_only", "raw_direct_io", "swap_report", "adam_kernels", "NVME_ENGINES"]


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="NVMe optimizer swapper bandwidth vs raw direct I/O, one rank")
    ap.add_argument("--numel", type=int, default=25_000_000)
    ap.add_argument("--nvme-path", required=True)
    ap.add_argument("--sub-group-size", type=int, default=2_000_000)
    ap.add_argument("--thread-count", type=int, default=1)
    a = ap.parse_args()
    print(swapper_only(a.numel, a.nvme_path, a.sub_group_size, thread_count=a.thread_count))
    print(adam_kernels(a.numel))
