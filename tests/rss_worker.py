"""Process RSS of model states at ZeRO stages 0, 2 and 3 (tests/test_rss.py): one stage per launch,
2 ranks. Each rank records its resident set (``/proc/self/statm``) before building the model and after
two Adam steps and a third backward (gradients are held then: stages 0-1 give their gradient buffer's
pages back to the kernel at each step, see zerodp.runtime.zero_pages); the growth is what the engine
really holds (plus small activations), measured by the kernel, not by the engine. Run with ``MALLOC_MMAP_THRESHOLD_``
set so freed large blocks go back to the OS instead of staying in glibc's heap."""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch import nn

import zerodp

WIDTH, LAYERS = 1024, 8


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--stages", required=True)
    ap.add_argument("--scenarios", default="rss")
    args = ap.parse_args()
    zerodp.init_distributed(timeout_s=120)
    stage = int(args.stages)
    torch.manual_seed(0)
    x = torch.randn(8, WIDTH)
    before = rss_bytes()
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    engine = zerodp.initialize(
        model,
        {
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
            "zero_optimization": {
                "stage": stage,
                "reduce_bucket_size": 2**20,
                "stage3_param_persistence_threshold": 0,
                "stage3_max_live_parameters": 2**21,
            },
        },
    )
    for i in range(3):
        engine.backward(engine(x).pow(2).mean())
        if i == 2:
            after = rss_bytes()
        engine.step()
    psi = sum(p.numel() for p in model.parameters()) if stage < 3 else engine.numel
    out = {"growth": after - before, "psi": int(psi), "world": dist.get_world_size()}
    with open(os.path.join(args.out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump({"rss": out}, f)
    zerodp.shutdown_distributed()


if __name__ == "__main__":
    main()
