"""Per-rank worker for tests/test_overlap_step.py, launched by torchrun (see tests/distributed.py).

``offload_optimizer.overlap_step`` with the NVMe optimizer offload and no parameter offload (stage 3):
the same model trained three times on the same batches (plain stage 3, the NVMe offload with the
sub-group loop inside ``step()``, and with ``overlap_step``), with gradient accumulation, clipping, a
warmup scheduler, a ``GatheredParameters`` read right after a step and an eval forward right after
another. Records losses, the values read, the final parameters (bitwise comparisons are made here),
and per overlapped step whether it returned with sub-groups left to update. Results:
``OUT/rank{r}.json``.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import zerodp  # noqa: E402
from distributed import run_selected, worker_args  # noqa: E402
from param_offload_worker import Chain, same, same_run  # noqa: E402
from zerodp.offload.param_home import UseHook  # noqa: E402

MICRO = 2  # rows per rank and micro-step
ACCUM = 2
STEPS = 4
NVME = ""  # set from --nvme


def _config(mode: str, precision: str) -> dict:
    zc: dict = {"stage": 3, "stage3_param_persistence_threshold": 64, "reduce_bucket_size": 50}  # biases gathered
    if mode != "plain":
        zc["offload_optimizer"] = {
            "device": "nvme",
            "nvme_path": NVME,
            "buffer_count": 3,
            "cpu_adam": "same",  # the non-offloaded engine's kernel: bitwise comparisons
            "overlap_step": mode == "overlap",
        }
        zc["sub_group_size"] = 300  # several sub-groups per rank, layers cut across them
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": ACCUM,
        "gradient_clipping": 0.05,
        "zero_optimization": zc,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.1}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.02, "warmup_num_steps": 5, "warmup_type": "linear"},
        },
        "aio": {"block_size": 4096, "queue_depth": 2, "thread_count": 2},
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _train(mode: str, precision: str) -> tuple[tuple, list, dict]:
    n, r = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(3)
    model = Chain()
    engine = zerodp.initialize(model, _config(mode, precision))
    off = engine.optimizer_offload
    facts: dict = {}
    if mode == "overlap":
        hooked = [u for u in engine.sharding.units if isinstance(u.home, UseHook)]
        facts = {"hooks": off.hooks is engine.param_offload, "hooked_units": len(hooked), "in_place": off.in_place}
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    losses, seen, deferred = [], [], []
    for step in range(STEPS):
        for micro in range(ACCUM):
            g = torch.Generator().manual_seed(100 * step + micro)
            x = torch.randn(MICRO * n, 32, generator=g)[r * MICRO : (r + 1) * MICRO].to(dtype)
            loss = engine(x).float().square().mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        if mode == "overlap":
            deferred.append([off.pending is not None, off.stats.updated_in_step, off.stats.subgroups])
        if step == 1:
            with zerodp.zero.GatheredParameters([model.layers[3].weight]):
                seen.append(model.layers[3].weight.detach().float().clone())
        elif step == 2:
            with torch.no_grad():
                seen.append(engine(x + 1.0).float())
            if mode == "overlap":
                facts["finished_by_eval"] = off.pending is None
    state = {k: v.float() for k, v in engine.module_state_dict().items()}
    facts["deferred"] = deferred
    engine.close()
    return (losses, seen, state), deferred, facts


def no_param_offload() -> dict:
    """plain / nvme / overlap at fp32 and bf16 (see the module docstring)."""
    out: dict = {}
    for precision in ("fp32", "bf16"):
        runs = {mode: _train(mode, precision) for mode in ("plain", "nvme", "overlap")}
        out[precision] = {
            "overlap_vs_nvme": same_run(runs["overlap"][0], runs["nvme"][0]),
            "overlap_vs_plain": same_run(runs["overlap"][0], runs["plain"][0]),
            "changed": not same(runs["plain"][0][2], _initial_state(precision)),
            **runs["overlap"][2],
        }
    return out


def _initial_state(precision: str) -> dict:
    torch.manual_seed(3)
    model = Chain()
    if precision == "bf16":
        model = model.bfloat16()
    return {k: v.float() for k, v in model.state_dict().items()}


def main() -> None:
    global NVME
    args = worker_args("--nvme", "--ckpt")
    NVME = args.nvme
    run_selected(args, {"noparam": no_param_offload})


if __name__ == "__main__":
    main()
