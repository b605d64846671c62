"""``zerodp bench --offload`` extras (the engines themselves are built by
:func:`zerodp.app.bench_systems.offload_systems`): the NVMe swap bandwidth beside a raw sequential
direct-I/O read and write of the same size on the same disk, the CPU Adam kernels (for-loop,
foreach, fused) timed on the same elements, and the host offload's pipeline with the host playing the
device (:func:`pipeline_report`: the optimizer phase vs the CPU Adam alone vs the copies alone, and the
share hidden behind the next forward and backward with ``delayed_update``); and the swapper-only
measurement (``python -m zerodp.app.bench_offload``).

The swap bandwidth is bytes read + written by the optimizer swapper in one step divided by the time
of its swap phase (the sub-group loop: reads, updates, writes), from
:attr:`zerodp.offload.nvme.NvmeOptimizerOffload.stats`.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

import zerodp
from zerodp.offload.aio import AsyncIO, SwapFile, aligned_buffer
from zerodp.offload.config import AioConfig

#: the NVMe engines built by the bench (the last one's swap statistics are reported)
NVME_ENGINES: list[Any] = []


def raw_direct_io(
    directory: str, nbytes: int, cfg: AioConfig | None = None, repeats: int = 3, streams: int = 1
) -> tuple[float, float]:
    """Median seconds to write then read ``nbytes`` sequentially with direct I/O in ``directory``
    (the same thread pool and block size as the swapper); returns (write s, read s). ``streams``
    files are transferred at once, each by its own pool (as that many ranks swapping on one disk do);
    the time is until all are done."""
    ios = [AsyncIO(cfg or AioConfig()) for _ in range(streams)]
    bufs = [aligned_buffer(nbytes) for _ in range(streams)]
    files = [SwapFile(tempfile.mktemp(prefix="zerodp_raw_", dir=directory)) for _ in range(streams)]
    writes, reads = [], []
    try:
        for buf, f in zip(bufs, files, strict=True):
            buf.fill_(7)
            os.posix_fallocate(f.fd, 0, buf.numel())
        for _ in range(repeats):
            t0 = time.perf_counter()
            for h in [io.write(f, buf, 0) for io, f, buf in zip(ios, files, bufs, strict=True)]:
                h.wait()
            for f in files:
                os.fsync(f.fd)
            writes.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for h in [io.read(f, buf, 0) for io, f, buf in zip(ios, files, bufs, strict=True)]:
                h.wait()
            reads.append(time.perf_counter() - t0)
    finally:
        for f in files:
            f.close()
            os.remove(f.path)
        for io in ios:
            io.close()
    return statistics.median(writes), statistics.median(reads)


#: the deeper raw configuration measured beside the swapper's own ``aio`` settings (the disk's
#: figure: several threads keep more requests in flight)
DEEP_AIO = AioConfig(thread_count=4, queue_depth=8, block_size=1 << 20)


def swap_report(directory: str) -> str:
    """The last NVMe engine's swap bandwidth next to the raw direct-I/O figure on the same disk: as
    many concurrent streams as ranks (every rank swaps at the same time on the same disk), each of
    this rank's size, with the swapper's ``aio`` settings and with :data:`DEEP_AIO`; the ratio is
    against the faster of the two. Also where the swap phase's time went."""
    if not NVME_ENGINES:
        return "offload nvme: not measured"
    off = NVME_ENGINES[0].optimizer_offload
    st = off.stats
    ranks = dist.get_world_size(off.pg) if dist.is_initialized() else 1
    moved = st.bytes_read + st.bytes_written
    raws = {}
    for name, cfg in (("swapper's aio", off.aio_cfg), ("4 threads", DEEP_AIO)):
        w, r = raw_direct_io(directory, st.bytes_read, cfg, streams=ranks)
        raws[name] = (w, r, moved / (w + r))
    best = max(raws, key=lambda k: raws[k][2])
    raw = raws[best][2]
    swap = moved / st.seconds if st.seconds else float("nan")
    busy = moved / st.io_busy_seconds if st.io_busy_seconds else float("nan")
    a = off.aio_cfg
    direct = "O_DIRECT" if off.file.direct else "buffered (no O_DIRECT on this file system)"
    lines = [
        f"offload nvme ({direct}, {len(off.subgroups)} sub-groups, {len(off.buffers)} buffers, aio "
        f"{a.thread_count} thread(s) x queue depth {a.queue_depth} x {a.block_size >> 10} KiB, {ranks} "
        f"rank(s) on this disk): swap phase {moved / 1e6:.1f} MB read+written in {st.seconds * 1e3:.1f} ms "
        f"= {swap / 1e6:.0f} MB/s per rank",
        f"  of which updates {st.update_seconds * 1e3:.1f} ms, blocked on reads {st.read_wait_seconds * 1e3:.1f}"
        f" ms, on writes {st.write_wait_seconds * 1e3:.1f} ms; disk busy {st.io_busy_seconds * 1e3:.1f} ms"
        f" ({busy / 1e6:.0f} MB/s while busy)",
    ]
    for name, (w, r, together) in raws.items():
        lines.append(
            f"  raw sequential direct I/O, {ranks} stream(s) of {st.bytes_read / 1e6:.1f} MB at once "
            f"({name}): "
            f"write {st.bytes_read / w / 1e6:.0f} MB/s, read {st.bytes_read / r / 1e6:.0f} MB/s, together "
            f"{together / 1e6:.0f} MB/s per stream"
        )
    ideal = max(st.update_seconds, moved / raw)  # perfect overlap: the slower of arithmetic and raw I/O
    lines.append(
        f"  swap / raw = {swap / raw:.2f} (raw: {best}); while busy / raw = {busy / raw:.2f}; "
        f"overlap: max(updates, raw I/O time) / swap phase = {ideal / st.seconds:.2f}"
    )
    return "\n".join(lines)


def adam_kernels(numel: int, repeats: int = 5) -> str:
    """Median time of one torch AdamW step on ``numel`` fp32 CPU elements per implementation."""
    rows = []
    variants: tuple[tuple[str, dict[str, Any]], ...] = (
        ("for-loop", {"foreach": False}),
        ("foreach", {"foreach": True}),
        ("fused", {"fused": True}),
    )
    for name, kw in variants:
        try:
            rows.append(f"{name} {_adam_step_s(numel, kw, repeats) * 1e3:.1f} ms")
        except (RuntimeError, ValueError) as exc:
            rows.append(f"{name}: unavailable ({exc})")
    return f"CPU AdamW step, {numel:,} fp32 elements in 16 tensors: " + ", ".join(rows)


def pipeline_phases(numel: int, steps: int = 4) -> dict[str, float]:
    """The host offload's pipeline (``offload_optimizer.device: cpu``, stage 1, one rank, the
    :func:`swapper_only` model of ``numel`` fp32 elements) run on the CPU with the host playing the
    device (``ZERODP_HOST_OFFLOAD_ON_CPU=1``: gradients copied to the host partition by the copy
    thread, CPU Adam in chunks, masters copied back): median seconds of ``step`` (``engine.step()``) and
    of ``fwd_bwd`` (forward and backward), without and with ``delayed_update`` (``*_delayed``); ``adam``:
    torch's fused AdamW alone on ``numel`` elements; ``copies``: the pipeline's copies alone (each piece's
    gradient to its host buffer and its master back into the module, synchronous); ``hidden``: the
    share of the optimizer phase the delay takes off the main thread, ``1 - step_delayed / step``.
    Needs no process group of its own beyond a world of one (run by :func:`pipeline_report`)."""
    from zerodp.offload.build import HOST_PIPELINE_ON_CPU_ENV

    side = 1000
    layers = max(1, numel // (side * side))
    out: dict[str, float] = {"numel": float(layers * side * side)}
    previous = os.environ.get(HOST_PIPELINE_ON_CPU_ENV)
    os.environ[HOST_PIPELINE_ON_CPU_ENV] = "1"
    try:
        for delayed in (False, True):
            torch.manual_seed(0)
            model = torch.nn.Sequential(*[torch.nn.Linear(side, side, bias=False) for _ in range(layers)])
            engine = zerodp.initialize(
                model,
                {
                    "optimizer": {"type": "AdamW"},
                    "device": "cpu",
                    "zero_optimization": {
                        "stage": 1,
                        "offload_optimizer": {"device": "cpu", "delayed_update": delayed},
                    },
                },
            )
            x, steps_s, passes_s = torch.randn(4, side), [], []
            for _ in range(steps + 1):
                t0 = time.perf_counter()
                engine.backward(engine(x).square().mean() * 1e-3)
                t1 = time.perf_counter()
                engine.step()
                passes_s.append(t1 - t0)
                steps_s.append(time.perf_counter() - t1)
            suffix = "_delayed" if delayed else ""
            out["step" + suffix] = statistics.median(steps_s[1:])
            out["fwd_bwd" + suffix] = statistics.median(passes_s[1:])
            out["offload" + suffix] = float(type(engine.optimizer_offload).__name__ != "NoOffload")
            if not delayed:
                off: Any = engine.optimizer_offload  # the host offload (checked by "offload" above)
                t0 = time.perf_counter()
                for piece, host in zip(off.pieces, off.grad_buffers, strict=True):
                    host.copy_(piece.tensor)  # the gradient's way (same size and dtypes)
                    piece.tensor.copy_(piece.master_copy)  # the parameters' way back (values unchanged)
                out["copies"] = time.perf_counter() - t0
            engine.close()
    finally:
        if previous is None:
            os.environ.pop(HOST_PIPELINE_ON_CPU_ENV, None)
        else:
            os.environ[HOST_PIPELINE_ON_CPU_ENV] = previous
    out["adam"] = _adam_step_s(int(out["numel"]), {"fused": True})
    out["hidden"] = 1.0 - out["step_delayed"] / out["step"]
    return out


#: torchrun's environment of a rank, not passed to :func:`pipeline_report`'s child
_LAUNCH_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def pipeline_report(numel: int) -> str:
    """:func:`pipeline_phases` as the lines ``zerodp bench --offload`` prints. With a process group
    already up (the bench's ranks) it runs in a fresh process of its own (a world of one)."""
    if dist.is_initialized():  # torchrun's variables left out: the child is a world of its own
        env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_ENV and not k.startswith("TORCHELASTIC")}
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "zerodp.app.bench_offload",
                "--pipeline",
                "--numel",
                str(numel),
                "--nvme-path",
                tempfile.gettempdir(),
            ],
            capture_output=True,
            text=True,
            timeout=900,
            env=env,
        )
        return proc.stdout.strip() if proc.returncode == 0 else f"offload pipeline: failed ({proc.stderr[-300:]})"
    f = {
        k: (v * 1e3 if k not in ("numel", "hidden", "offload", "offload_delayed") else v)
        for k, v in pipeline_phases(numel).items()
    }
    return (
        f"offload cpu pipeline, host as the device ({int(f['numel']):,} fp32 elements, stage 1, one rank): "
        f"optimizer phase (engine.step) {f['step']:.1f} ms; CPU Adam alone (fused) {f['adam']:.1f} ms; "
        f"copies alone {f['copies']:.1f} ms\n"
        f"  delayed_update: engine.step {f['step_delayed']:.1f} ms (forward+backward {f['fwd_bwd_delayed']:.1f} ms"
        f" vs {f['fwd_bwd']:.1f} ms without); hidden behind the next forward and backward: "
        f"1 - step_delayed / step = {f['hidden']:.2f}"
    )


def _adam_step_s(numel: int, kw: dict[str, Any], repeats: int = 5) -> float:
    """Median seconds of one torch AdamW step (options ``kw``) on ``numel`` fp32 elements in 16 tensors."""
    torch.manual_seed(0)
    ps = [torch.zeros(n, requires_grad=True) for n in _split(numel)]
    for p in ps:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(ps, lr=1e-3, **kw)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def _split(numel: int, parts: int = 16) -> list[int]:
    base = numel // parts
    return [base] * (parts - 1) + [numel - base * (parts - 1)]


def swapper_only(
    numel: int,
    nvme_path: str,
    sub_group_size: int,
    steps: int = 3,
    thread_count: int = 1,
    aio: dict[str, Any] | None = None,
    buffer_count: int = 4,
    cpu_adam: str = "fused",
) -> str:
    """One rank, stage 1, a ``numel``-element stack of 1000 x 1000 linear layers with the optimizer on NVMe: the swap
    report after ``steps`` steps (``python -m zerodp.app.bench_offload``). ``aio``: more ``aio`` keys;
    ``cpu_adam``: ``offload_optimizer.cpu_adam`` (``fused`` or ``same``)."""
    side = 1000  # layers of 1e6 elements, so sub-groups of sub_group_size form
    layers = max(1, numel // (side * side))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(side, side, bias=False) for _ in range(layers)])
    engine = zerodp.initialize(
        model,
        {
            "optimizer": {"type": "AdamW"},
            "aio": {"thread_count": thread_count, **(aio or {})},
            "device": "cpu",
            "zero_optimization": {
                "stage": 1,
                "sub_group_size": sub_group_size,
                "offload_optimizer": {
                    "device": "nvme",
                    "nvme_path": nvme_path,
                    "buffer_count": buffer_count,
                    "cpu_adam": cpu_adam,
                },
            },
        },
    )
    NVME_ENGINES[:] = [engine]
    x = torch.randn(4, side)
    for _ in range(steps):
        engine.backward(engine(x).square().mean() * 1e-3)
        engine.step()
    out = (
        f"{layers * side * side:,} parameters, sub_group_size {sub_group_size:,}, buffer_count {buffer_count}, "
        f"cpu_adam {cpu_adam}, aio {engine.config.aio.model_dump()}\n"
    )
    out += swap_report(nvme_path)
    engine.close()
    return out


def host_step(numel: int, steps: int = 4) -> str:
    """Median seconds of ``engine.step()`` with ``offload_optimizer.device = "cpu"`` (one rank, stage 1,
    the :func:`swapper_only` model: the chunked CPU AdamW on the host masters and the copies back into
    the module), with ``cpu_adam`` ``same`` (the non-offloaded engine's for-loop kernel) and ``fused``."""
    side = 1000
    layers = max(1, numel // (side * side))
    rows = []
    for cpu_adam in ("same", "fused"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(side, side, bias=False) for _ in range(layers)])
        engine = zerodp.initialize(
            model,
            {
                "optimizer": {"type": "AdamW"},
                "device": "cpu",
                "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu", "cpu_adam": cpu_adam}},
            },
        )
        x = torch.randn(4, side)
        times = []
        for _ in range(steps + 1):
            engine.backward(engine(x).square().mean() * 1e-3)
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        engine.close()
        rows.append(f"{cpu_adam} {statistics.median(times[1:]) * 1e3:.1f} ms")
    return f"offload cpu engine.step(), {layers * side * side:,} fp32 elements, cpu_adam: " + ", ".join(rows)


__all__ = [
    "pipeline_phases",
    "pipeline_report",
    "swapper_only",
    "host_step",
    "raw_direct_io",
    "swap_report",
    "adam_kernels",
    "DEEP_AIO",
    "NVME_ENGINES",
]


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="NVMe optimizer swapper bandwidth vs raw direct I/O, one rank")
    ap.add_argument("--numel", type=int, default=25_000_000)
    ap.add_argument("--nvme-path", required=True)
    ap.add_argument("--sub-group-size", type=int, default=2_000_000)
    ap.add_argument("--thread-count", type=int, default=1)
    ap.add_argument("--queue-depth", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=1 << 20)
    ap.add_argument("--buffer-count", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument(
        "--cpu-adam",
        choices=("fused", "same"),
        default="fused",
        help="offload_optimizer.cpu_adam: the kernel of the swapper's step",
    )
    ap.add_argument("--no-adam", action="store_true", help="skip the CPU Adam kernel timings")
    ap.add_argument("--pipeline", action="store_true", help="only the host offload's pipeline (pipeline_report)")
    a = ap.parse_args()
    if a.pipeline:
        print(pipeline_report(a.numel))
        sys.exit(0)
    print(
        swapper_only(
            a.numel,
            a.nvme_path,
            a.sub_group_size,
            a.steps,
            a.thread_count,
            {"queue_depth": a.queue_depth, "block_size": a.block_size},
            a.buffer_count,
            a.cpu_adam,
        )
    )
    if not a.no_adam:
        print(adam_kernels(a.numel))
        print(host_step(a.numel))
