"""Activation checkpointing (zerodp.checkpointing) under ZeRO stages 0-3 on 2 ranks, against the
single-process model without checkpointing on the same global batch. Run by
tests/test_activation_checkpointing.py under torchrun; results go to ``OUT/rank{r}.json``.

Scenarios: ``blocks`` (two checkpointed blocks), ``frozen`` (a checkpointed segment whose input comes
from a frozen layer and does not require grad: its parameters must still get gradients), ``reuse`` (one
weight used in two checkpointed segments), ``partition`` (partition_activations + cpu_checkpointing
across a 2-rank model-parallel group, each rank a data-parallel group of one).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import zerodp
from distributed import run_scenarios
from zerodp import checkpointing
from zerodp.runtime import activation_checkpointing

D, ROWS, STEPS = 8, 4, 3


class Net(nn.Module):
    def __init__(self, scenario: str, use_ckpt: bool) -> None:
        super().__init__()
        self.scenario, self.use_ckpt = scenario, use_ckpt
        self.inp = nn.Linear(D, D)
        self.blk = nn.Linear(D, D)
        self.blk2 = nn.Linear(D, D)
        self.head = nn.Linear(D, 2)
        if scenario == "frozen":
            self.inp.requires_grad_(False)

    def seg(self, fn: Callable[..., torch.Tensor], *args: torch.Tensor) -> torch.Tensor:
        return checkpointing.checkpoint(fn, *args) if self.use_ckpt else fn(*args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        if self.scenario == "reuse":
            h = self.seg(lambda t: torch.tanh(self.blk(t)), h)
            h = self.seg(lambda t: torch.tanh(self.blk(t)) * 0.5 + t, h)
        else:
            h = self.seg(lambda t: torch.tanh(self.blk(t)), h)
            h = self.seg(lambda t, u: torch.tanh(self.blk2(t)) + u, h, h * 0.5)
        return self.head(h)


def batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + step)
    return torch.randn(rows, D, generator=g), torch.randn(rows, 2, generator=g)


def cfg(stage: int, extra: dict | None = None) -> dict:
    return {
        "train_micro_batch_size_per_gpu": ROWS,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.1}},
        "gradient_clipping": 0.05,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 32},
        **(extra or {}),
    }


def run(stage: int, scenario: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    mpu = None
    extra: dict[str, Any] = {}
    if scenario == "partition":
        # every rank its own data-parallel group; the model-parallel group is the world
        dp_groups = [dist.new_group([r]) for r in range(world)]
        mpu = type(
            "MPU",
            (),
            {
                "get_data_parallel_group": lambda self: dp_groups[rank],
                "get_model_parallel_group": lambda self: dist.group.WORLD,
                "get_model_parallel_rank": lambda self: rank,
                "get_model_parallel_world_size": lambda self: world,
            },
        )()
        extra = {"activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True}}
    torch.manual_seed(3)
    model = Net(scenario, use_ckpt=True)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    engine = zerodp.initialize(model, cfg(stage, extra), mpu=mpu)
    torch.manual_seed(3)
    ref = Net(scenario, use_ckpt=False)
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=0.02, weight_decay=0.1)
    dp_size = 1 if mpu is not None else world
    dp_rank = 0 if mpu is not None else rank
    kept: list[dict] = []
    for step in range(STEPS):
        x, y = batch(step, ROWS * dp_size)
        rows = slice(dp_rank * ROWS, (dp_rank + 1) * ROWS)
        out = engine(x[rows])
        if step == 0:
            kept = kept_inputs(out)
        engine.backward(nn.functional.mse_loss(out, y[rows]))
        engine.step()
        opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.requires_grad], 0.05)
        opt.step()
    got = engine.module_state_dict()
    want = ref.state_dict()
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    moved = [k for k in want if not torch.equal(got[k], initial[k])]
    checkpointing.reset()
    return {
        "max_err": max(float((got[k] - want[k]).abs().max()) for k in want),
        "kept": kept,
        "compared": len(want),
        "trained_names": sorted(moved),
    }


def kept_by_graph(out: torch.Tensor) -> list[activation_checkpointing._Kept]:
    """Walk the live autograd graph from ``out`` and return what every checkpoint node keeps for backward."""
    seen, stack, found = set(), [out.grad_fn], []
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        found += [k for k in getattr(fn, "kept", None) or [] if isinstance(k, activation_checkpointing._Kept)]
        stack.extend(f for f, _ in fn.next_functions)
    return found


def kept_inputs(out: torch.Tensor) -> list[dict]:
    """The storage each checkpoint keeps (device, bytes, elements of the original input)."""
    return [
        {
            "device": str(k.data.device),
            "nbytes": k.data.untyped_storage().nbytes(),
            "numel": k.shape.numel(),
            "partitioned": k.partitioned,
        }
        for k in kept_by_graph(out)
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--stages", default="0,1,2,3")
    ap.add_argument("--scenarios", default="blocks,frozen,reuse,partition")
    args = ap.parse_args()
    zerodp.init_distributed(timeout_s=120)
    run_scenarios(
        args.out,
        [
            (f"{scenario}@{stage}", lambda st=stage, sc=scenario: run(st, sc))
            for stage in (int(s) for s in args.stages.split(","))
            for scenario in args.scenarios.split(",")
        ],
    )


if __name__ == "__main__":
    main()
