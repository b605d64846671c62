"""Worker of tests/test_estimate_traffic.py: the engine's measured traffic per optimizer step
(``engine.comm_report()``) of a tiny fp32 model at each stage, with K = 1 and K = 2 micro-steps per
optimizer step, to compare with ``zerodp estimate``'s formula."""

from __future__ import annotations

import argparse
import json
import os

import torch
from torch import nn

import zerodp

STEPS = 2


def measure(stage: int, grad_accum: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8, bias=False), nn.Tanh(), nn.Linear(8, 2, bias=False))
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": grad_accum,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    engine = zerodp.initialize(model, cfg)
    engine.reset_comm_report()
    for _ in range(STEPS * grad_accum):
        engine.backward(engine(torch.randn(2, 4)).pow(2).mean())
        engine.step()
    report = engine.comm_report()
    return {
        "psi": sum(p.numel() for p in model.parameters()),
        "steps": report.steps,
        "elements_per_step": report.elements_per_step,
        "expected": report.expected_elements_per_step,
        "table": report.format(),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--stages", default="0,1,2,3")
    ap.add_argument("--scenarios", default="1,2")  # gradient_accumulation_steps values
    args = ap.parse_args()
    zerodp.init_distributed(timeout_s=120)
    results = {
        f"stage{s}/K{k}": measure(int(s), int(k)) for s in args.stages.split(",") for k in args.scenarios.split(",")
    }
    with open(os.path.join(args.out, f"rank{torch.distributed.get_rank()}.json"), "w") as f:
        json.dump(results, f)
    zerodp.shutdown_distributed()


if __name__ == "__main__":
    main()
