"""ZeRO over a data-parallel sub-group composed with tensor parallelism, on 4 ranks = 2 TP x 2 DP.

Run by tests/test_tensor_parallel.py under torchrun. Ranks r = 2 * dp_rank + mp_rank: tensor-parallel
groups {0, 1}, {2, 3}; data-parallel groups {0, 2}, {1, 3}. A toy Megatron-style MLP (column-parallel
fc1, row-parallel fc2 with a replicated bias) is trained through ``zerodp.initialize(..., mpu=...)``
and compared with the single-process full MLP on the same global batch, clipping included (the
gradient norm must sum the tensor-parallel shards over the model-parallel group and count the
replicated bias once). Results go to ``OUT/rank{r}.json``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import zerodp
from distributed import run_scenarios

D_IN, HIDDEN, D_OUT, ROWS, STEPS, CLIP = 6, 8, 5, 4, 3, 0.05


class MPU:
    """DeepSpeed's model-parallel unit protocol over explicit groups."""

    def __init__(self, dp: dist.ProcessGroup, mp: dist.ProcessGroup) -> None:
        self.dp, self.mp = dp, mp

    def get_data_parallel_group(self) -> dist.ProcessGroup:
        return self.dp

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank(self.dp)

    def get_data_parallel_world_size(self) -> int:
        return dist.get_world_size(self.dp)

    def get_model_parallel_group(self) -> dist.ProcessGroup:
        return self.mp

    def get_model_parallel_rank(self) -> int:
        return dist.get_rank(self.mp)

    def get_model_parallel_world_size(self) -> int:
        return dist.get_world_size(self.mp)


class _ReduceFromTP(torch.autograd.Function):
    """Forward: sum over the tensor-parallel group; backward: identity (Megatron's g)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return g, None


class _CopyToTP(torch.autograd.Function):
    """Forward: identity; backward: sum the input gradient over the tensor-parallel group (Megatron's f)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        g = g.clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class TPMLP(nn.Module):
    """fc1 column-parallel (rows of W1 and b1 split), fc2 row-parallel (columns of W2 split, bias
    replicated, added after the all-reduce)."""

    def __init__(self, full: nn.Sequential, mp_rank: int, mp_size: int, group: dist.ProcessGroup) -> None:
        super().__init__()
        h = HIDDEN // mp_size
        sl = slice(mp_rank * h, (mp_rank + 1) * h)
        self.group = group
        self.w1 = nn.Parameter(full[0].weight.detach()[sl].clone())
        self.b1 = nn.Parameter(full[0].bias.detach()[sl].clone())
        self.w2 = nn.Parameter(full[2].weight.detach()[:, sl].clone())
        self.b2 = nn.Parameter(full[2].bias.detach().clone())
        for p in (self.w1, self.b1, self.w2):
            p.tensor_model_parallel = True  # Megatron's marker

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _CopyToTP.apply(x, self.group)
        h = torch.tanh(x @ self.w1.t() + self.b1)
        return _ReduceFromTP.apply(h @ self.w2.t(), self.group) + self.b2


def full_mlp(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, D_OUT))


def batch(step: int, dp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(ROWS * dp_size, D_IN, generator=g), torch.randn(ROWS * dp_size, D_OUT, generator=g)


def config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": ROWS,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.1}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 16},
    }


def slices(full: nn.Sequential, mp_rank: int, mp_size: int) -> dict[str, torch.Tensor]:
    h = HIDDEN // mp_size
    sl = slice(mp_rank * h, (mp_rank + 1) * h)
    return {
        "w1": full[0].weight.detach()[sl],
        "b1": full[0].bias.detach()[sl],
        "w2": full[2].weight.detach()[:, sl],
        "b2": full[2].bias.detach(),
    }


def run_stage(stage: int, mpu: MPU, ckpt_dir: Path) -> dict:
    mp_rank, mp_size = mpu.get_model_parallel_rank(), mpu.get_model_parallel_world_size()
    dp_rank, dp_size = mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()
    full = full_mlp(seed=7)
    engine = zerodp.initialize(TPMLP(full, mp_rank, mp_size, mpu.mp), config(stage), mpu=mpu)
    ref = full_mlp(seed=7)
    opt = torch.optim.AdamW(ref.parameters(), lr=0.02, weight_decay=0.1)
    norms, ref_norms = [], []
    for step in range(STEPS):
        x, y = batch(step, dp_size)
        rows = slice(dp_rank * ROWS, (dp_rank + 1) * ROWS)
        engine.backward(nn.functional.mse_loss(engine(x[rows]), y[rows]))
        engine.step()
        norms.append(engine.get_global_grad_norm())
        opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)))
        opt.step()
    got = engine.module_state_dict()
    want = slices(ref, mp_rank, mp_size)
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    max_err = max(float((got[k] - want[k]).abs().max()) for k in want)
    # a checkpoint per model-parallel rank, loaded into a differently initialised engine
    save = ckpt_dir / f"stage{stage}"
    engine.save_checkpoint(save)
    dist.barrier()  # the other model-parallel rank's data-parallel group saves its own directory
    fresh = zerodp.initialize(TPMLP(full_mlp(seed=99), mp_rank, mp_size, mpu.mp), config(stage), mpu=mpu)
    fresh.load_checkpoint(save)
    reloaded = fresh.module_state_dict()
    return {
        "max_err": max_err,
        "norms": norms,
        "ref_norms": ref_norms,
        "dp_world_size": engine.world_size,
        "numel": engine.numel,
        "reload_equal": all(torch.equal(reloaded[k], got[k]) for k in got),
        "ckpt_dirs": sorted(p.name for p in save.iterdir()),
        "report_world_size": engine.memory_report().world_size,
        "report_numel": engine.memory_report().numel,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--stages", default="1,2,3")
    ap.add_argument("--scenarios", default="all")
    ap.add_argument("--ckpt-dir", required=True)
    args = ap.parse_args()
    zerodp.init_distributed(timeout_s=120)
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 4, "this worker needs 4 ranks (2 tensor-parallel x 2 data-parallel)"
    mp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    mpu = MPU(dp_groups[rank % 2], mp_groups[rank // 2])
    run_scenarios(
        args.out,
        [
            (f"stage{stage}", lambda s=stage: run_stage(s, mpu, Path(args.ckpt_dir)))
            for stage in (int(s) for s in args.stages.split(","))
        ],
    )


if __name__ == "__main__":
    main()
