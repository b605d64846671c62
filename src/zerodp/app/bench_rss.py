"""Peak RSS of each ``zerodp bench`` system measured in a process of its own.

Within one process the systems run one after another, so the resident set one system leaves behind
(allocator caches, lazily loaded code, gloo buffers) inflates the next one's peak. Here each rank
forks one child process per system, before the parent has initialised ``torch.distributed`` or run a
single kernel: every child starts from the same state (``torch`` and zerodp imported, nothing else),
joins a process group of its own (a :class:`torch.distributed.PrefixStore` on torchrun's agent store,
one prefix per system), builds the system, trains ``--probe-steps`` steps on the bench's batches
(the real configuration: no counting hooks, no storage scans), and reports the kernel's high-water
mark of its resident set (``VmHWM`` in ``/proc/self/status``: exact, not sampled) before exiting.

The ratio of a system's peak to DDP's (highest rank of each) is what the issue's target
"zerodp peak RSS per rank <= DDP's" is checked against (``fresh_rss_vs_ddp`` in
:class:`zerodp.app.bench_report.SystemResult`).
"""

from __future__ import annotations

import json
import os
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from zerodp.app.bench_measure import current_rss

#: (name, build) -> (system or None, skip reason); ``build`` runs inside the child's process group.
BuildFn = Callable[[], tuple[Any | None, str | None]]


def peak_rss() -> int:
    """This process's resident-set high-water mark in bytes (``VmHWM``, kept by the kernel).

    Raises:
        RuntimeError: ``/proc/self/status`` has no ``VmHWM`` line (not Linux).
    """
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmHWM line; fresh-process RSS needs Linux")


def unavailable_reason() -> str | None:
    """Why the fresh-process measurement cannot run here, or None."""
    if not hasattr(os, "fork") or not os.path.exists("/proc/self/status"):
        return "needs Linux (fork and /proc/self/status)"
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_PORT" not in os.environ:
        return "needs torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE=True, MASTER_ADDR/MASTER_PORT)"
    return None


def _child(index: int, train: Callable[[], str | None], wfd: int) -> None:
    """Body of the forked child: own process group, train, report, exit (never returns)."""
    out: dict[str, Any]
    try:
        import torch.distributed as dist

        start = current_rss()
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            world,
            is_master=False,
            timeout=timedelta(seconds=600),
        )
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore(f"zerodp_bench_rss/{index}", store),
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=600),
        )
        reason = train()
        dist.barrier()
        out = {"reason": reason} if reason else {"rank": rank, "rss_start": start, "peak_rss": peak_rss()}
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as exc:  # reported by the parent; the child must never return into it
        out = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-2000:]}
    try:
        os.write(wfd, json.dumps(out).encode())
    finally:
        os._exit(0)


def _read_all(fd: int) -> bytes:
    chunks: list[bytes] = []
    while True:
        b = os.read(fd, 65536)
        if not b:
            return b"".join(chunks)
        chunks.append(b)


def measure(index: int, build: BuildFn, make_batches: Callable[[], list]) -> dict[str, Any]:
    """Fork one child that builds the system with ``build`` and trains it on ``make_batches()``;
    returns ``{"rank", "rss_start", "peak_rss"}`` (bytes), or ``{"reason": ...}`` when the system is
    skipped (same reason on every rank), or ``{"error": ...}`` when the child failed. Must be called in
    the same order with the same ``index`` on every rank, before the parent joins a process group.
    """

    def train() -> str | None:
        batches = make_batches()
        system, reason = build()
        if system is None:
            return reason or "not built"
        for x, y in batches:
            system.forward_backward(x, y)
            system.step()
        return None

    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child, which exits in _child
        os.close(rfd)
        _child(index, train, wfd)
    os.close(wfd)
    try:
        data = _read_all(rfd)
    finally:
        os.close(rfd)
        _, status = os.waitpid(pid, 0)
    if not data:
        return {"error": f"child process for system {index} exited without a report (wait status {status})"}
    return json.loads(data)
