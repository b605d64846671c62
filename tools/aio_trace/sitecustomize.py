"""Trace zerodp's swap I/O in every process of a run (a development tool, not part of the library).

    PYTHONPATH=tools/aio_trace ZERODP_AIO_TRACE=/tmp/tr/aio zerodp train --preset infinity ...
    python tools/aio_trace_report.py /tmp/tr/aio

Python imports this file at start-up when its folder is on PYTHONPATH. Once zerodp's offload modules are
imported it wraps, in this process only: each direct-I/O system call (``aio._transfer``: start, end,
bytes, read or write, file name) and, in the NVMe optimizer's sub-group loop, each update
(``SubGroupPipeline._update_next``), each wait for a swap transfer (``_wait``), the parameter-shard
pins (``ShardWindow.enter``/``leave``), the gradient reads (``StepGradReads.take``) and the Adam call.
At exit the events go to ``$ZERODP_AIO_TRACE.<pid>.json``.
"""

import atexit
import builtins
import json
import os
import sys
import threading
import time

_OUT = os.environ.get("ZERODP_AIO_TRACE")
EVENTS: list = []


def _timed(cls, name, tag):
    real = getattr(cls, name)

    def wrapper(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return real(self, *args, **kwargs)
        finally:
            EVENTS.append((tag, 0, t0, time.perf_counter(), 0, 0, ""))

    setattr(cls, name, wrapper)


def _patch():
    import torch

    from zerodp.offload import aio, grad_swap, nvme, shard_window, step_pipeline

    transfer = aio._transfer

    def traced_transfer(f, views, offset, write):
        t0 = time.perf_counter()
        transfer(f, views, offset, write)
        n = sum(len(v) for v in views)
        EVENTS.append(("io", threading.get_ident(), t0, time.perf_counter(), n, int(write), os.path.basename(f.path)))

    aio._transfer = traced_transfer
    _timed(step_pipeline.SubGroupPipeline, "_update_next", "upd")
    wait = step_pipeline.SubGroupPipeline._wait

    def traced_wait(self, h, kind):
        t0 = time.perf_counter()
        wait(self, h, kind)
        EVENTS.append(("wait", 0, t0, time.perf_counter(), 0, int(kind == "write"), ""))

    step_pipeline.SubGroupPipeline._wait = traced_wait
    _timed(shard_window.ShardWindow, "enter", "shard_enter")
    _timed(shard_window.ShardWindow, "leave", "shard_leave")
    _timed(grad_swap.StepGradReads, "take", "grad_take")
    _timed(nvme.NvmeOptimizerOffload, "_update", "update")
    _timed(torch.optim.AdamW, "step", "adam")


if _OUT:
    _real_import = builtins.__import__
    _done = [False]
    _NEEDED = {
        "zerodp.offload.aio": "_transfer",
        "zerodp.offload.step_pipeline": "SubGroupPipeline",
        "zerodp.offload.nvme": "NvmeOptimizerOffload",
    }

    def _import(name, *args, **kwargs):
        module = _real_import(name, *args, **kwargs)
        if not _done[0] and all(hasattr(sys.modules.get(m), a) for m, a in _NEEDED.items()):
            _done[0] = True
            _patch()
        return module

    builtins.__import__ = _import

    @atexit.register
    def _dump():
        if EVENTS:
            with open(f"{_OUT}.{os.getpid()}.json", "w") as fh:
                json.dump({"events": EVENTS}, fh)
