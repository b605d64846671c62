"""Per-rank RSS with and without ZeRO-Offload (tests/test_offload_rss.py): 2 ranks, an MLP of
``LAYERS`` x Linear(WIDTH, WIDTH), AdamW, DeepSpeed's keys at their defaults (``sub_group_size`` not
set). For each configuration, in turn in this process: RSS (``VmRSS`` of ``/proc/self/status``, after
``gc.collect`` and glibc's ``malloc_trim``) before the model is built and after ``STEPS`` steps and one more
backward (gradients held); the growth is what the configuration holds, measured by the kernel. Beside it, the engine's
own figure: ``memory_report().total`` plus the offloads' host buffers (:func:`zerodp.offload.report.host_total`).
Run with ``MALLOC_MMAP_THRESHOLD_`` set so freed large blocks go back to the OS between configurations.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import tempfile

import torch
import torch.distributed as dist
from torch import nn

import zerodp
from zerodp.offload.report import host_total

WIDTH, LAYERS, STEPS = 512, 32, 2
_libc = ctypes.CDLL("libc.so.6")


def rss_bytes() -> int:
    gc.collect()
    _libc.malloc_trim(0)
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def config(stage: int, dtype: str, offload: str, nvme: str) -> dict:
    zc: dict = {"stage": stage}
    if offload in ("nvme", "nvme+param"):
        zc["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme}
    if offload == "nvme+param":
        zc["offload_param"] = {"device": "nvme", "nvme_path": nvme}
    if offload == "cpu":
        zc["offload_optimizer"] = {"device": "cpu"}
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": zc,
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def measure(stage: int, dtype: str, offload: str, nvme: str) -> dict:
    torch.manual_seed(0)
    x = torch.randn(4, WIDTH)
    before = rss_bytes()
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    numel = sum(p.numel() for p in model.parameters())
    engine = zerodp.initialize(model, config(stage, dtype, offload, nvme))
    for i in range(STEPS + 1):
        engine.backward(engine(x.to(torch.bfloat16) if dtype == "bf16" else x).float().pow(2).mean())
        if i == STEPS:  # gradients held (stages 0-1 give their pages back at each step)
            after = rss_bytes()
        engine.step()
    off = engine.offload_report()
    swapper = getattr(engine.param_offload, "swapper", None)  # nvme: the parameter swapper
    param_host = swapper.host_bytes() if swapper is not None else None
    out = {
        "growth": after - before,
        "numel": numel,
        "offloaded": off is not None,
        "figure": host_total(engine.memory_report(), off, param_host),
    }
    if off is not None:
        out["swap_buffers"] = off.host["swap_buffers"]
    engine.close()
    del engine, model
    rss_bytes()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--stages", required=True)
    ap.add_argument("--scenarios", required=True)  # comma-separated dtype/offload, e.g. fp32/none,fp32/nvme
    args = ap.parse_args()
    zerodp.init_distributed(timeout_s=120)
    results = {}
    with tempfile.TemporaryDirectory() as nvme:
        measure(2, "fp32", "none", nvme)  # warm-up: lazily loaded code and gloo's buffers
        for stage in (int(s) for s in args.stages.split(",")):
            for scenario in args.scenarios.split(","):
                dtype, offload = scenario.split("/")
                if offload == "nvme+param" and stage != 3:
                    continue
                results[f"{stage}/{scenario}"] = measure(stage, dtype, offload, nvme)
    with open(os.path.join(args.out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(results, f)
    zerodp.shutdown_distributed()


if __name__ == "__main__":
    main()
