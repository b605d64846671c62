"""A training script written for DeepSpeed's API, run against ``zerodp.deepspeed`` (launched by torchrun
from tests/test_deepspeed_dropin.py).

:func:`ds_train` is DeepSpeed code: it only ever touches the module passed as ``deepspeed`` (the test
passes ``zerodp.deepspeed``; with DeepSpeed installed the same function would run on it). Each rank
compares the result with single-process plain PyTorch on the same global batches (the reference,
computed in the same process) and writes ``OUT/rank{r}.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import traceback
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DistributedSampler, TensorDataset

import zerodp.deepspeed as deepspeed  # the only line that differs from a DeepSpeed script

RTOL, ATOL = 1e-5, 1e-6
MICRO, ACCUM, STEPS = 2, 2, 4
N_SAMPLES = MICRO * ACCUM * 2 * STEPS  # world size 2: one epoch is STEPS optimizer steps


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 5)
        self.fc2 = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(N_SAMPLES, 6, generator=g), torch.randn(N_SAMPLES, 3, generator=g))


def ds_config(stage: int) -> dict[str, Any]:
    """As the HF Trainer and DeepSpeed's docs write them: "auto" batch size, Adam in AdamW mode."""
    return {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": ACCUM,
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": 0.01,
                "betas": [0.9, 0.99],
                "eps": 1e-8,
                "weight_decay": 0.1,
                "adam_w_mode": True,
                "torch_adam": True,
            },
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": "auto",
                "warmup_max_lr": "auto",
                "warmup_num_steps": 3,
                "warmup_type": "linear",
            },
        },
        "zero_optimization": {
            "stage": stage,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "stage3_param_persistence_threshold": 4,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "steps_per_print": 2,
        "wall_clock_breakdown": True,
        "zero_allow_untested_optimizer": True,
    }


def ds_train(deepspeed: Any, stage: int, ckpt_dir: str, client_optimizer: bool) -> dict[str, Any]:
    """DeepSpeed-style training: zero.Init, initialize (4-tuple), the loop, checkpoints, 16-bit save."""
    config = ds_config(stage)
    torch.manual_seed(0)
    with deepspeed.zero.Init(
        config_dict_or_path=config,
        enabled=stage == 3,
        remote_device=None,
        pin_memory=False,
        dtype=torch.float32,
        mem_efficient_linear=True,
    ):
        model = Net()
    kwargs: dict[str, Any] = {}
    if client_optimizer:
        config = {k: v for k, v in config.items() if k not in ("optimizer", "scheduler")}
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        kwargs = {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))}
    args = argparse.Namespace(local_rank=int(os.environ.get("LOCAL_RANK", 0)), deepspeed_config=None)
    engine, optimizer, loader, scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=dataset(), config=config, **kwargs
    )
    out: dict[str, Any] = {
        "train_batch_size": engine.train_batch_size(),
        "micro": engine.train_micro_batch_size_per_gpu(),
        "accum": engine.gradient_accumulation_steps(),
        "stage": engine.zero_optimization_stage(),
        "bf16": engine.bfloat16_enabled(),
        "fp16": engine.fp16_enabled(),
        "local_rank": engine.local_rank,
        "device": str(engine.device),
        "optimizer_is_engines": optimizer is engine.optimizer,
        "scheduler_is_engines": scheduler is engine.lr_scheduler,
        "loader_batches": len(loader),
        "ds_numel": [int(p.ds_numel) for p in model.parameters()] if stage == 3 else None,
    }
    engine.train()
    losses, applied = [], []
    for i, (x, y) in enumerate(loader):
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if (i + 1) % ACCUM == 0:
            applied.append(engine.was_step_applied())
        if engine.global_steps == 2 and (i + 1) % ACCUM == 0:
            engine.save_checkpoint(
                ckpt_dir, tag=2, client_state={"rng": torch.get_rng_state(), "step": 2, "pair": (1, 2)}
            )
    out.update(
        global_steps=engine.global_steps,
        global_samples=engine.global_samples,
        applied=applied,
        lr=engine.get_lr(),
        mom=[list(m) if isinstance(m, tuple) else m for m in engine.get_mom()],
    )
    final = {k: v.clone() for k, v in engine.state_dict().items()}

    # resume from step 2 and re-run the last two steps: bit-identical
    path, client = engine.load_checkpoint(ckpt_dir, tag=2)
    out["client_state_ok"] = (
        isinstance(client["rng"], torch.Tensor) and client["pair"] == (1, 2) and os.path.basename(str(path)) == "2"
    )
    out["steps_after_load"] = engine.global_steps
    loader.sampler.set_epoch(0)
    for i, (x, y) in enumerate(loader):
        if i < 2 * ACCUM:
            continue
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
    resumed = engine.state_dict()
    out["resume_err"] = max(err(resumed[k], final[k]) for k in final)

    # load_module_only / load_optimizer_states=False keep what was there
    state_before = {k: v.clone() for k, v in _opt_tensors(optimizer).items()}
    steps_before = engine.global_steps
    engine.load_checkpoint(ckpt_dir, tag="2", load_module_only=True)
    out["module_only_keeps_steps"] = engine.global_steps == steps_before
    out["module_only_keeps_optimizer"] = all(
        torch.equal(v, _opt_tensors(optimizer)[k]) for k, v in state_before.items()
    )
    engine.load_checkpoint(ckpt_dir, tag=2, load_optimizer_states=False, load_lr_scheduler_states=False)
    out["no_opt_keeps_optimizer"] = all(torch.equal(v, _opt_tensors(optimizer)[k]) for k, v in state_before.items())
    out["no_opt_loads_steps"] = engine.global_steps == 2
    # save_latest=False leaves "latest" pointing at tag 2
    engine.save_checkpoint(ckpt_dir, tag="other", save_latest=False)
    with open(os.path.join(ckpt_dir, "latest")) as f:
        out["latest"] = f.read().strip()
    engine.save_16bit_model(ckpt_dir, "model16.bin")
    saved = torch.load(os.path.join(ckpt_dir, "model16.bin"))
    out["save16_keys"] = sorted(saved) == sorted(dict(Net().named_parameters()))
    return out, final


class Shared(nn.Module):
    """``shared`` runs twice per forward with ``mid`` (42 elements) in between."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(6, 6)
        self.mid = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.shared(x))
        return self.head(torch.tanh(self.shared(torch.tanh(self.mid(h)))))


def reuse_run(deepspeed: Any, distance: int) -> dict[str, Any]:
    """Stage 3 with ``stage3_max_reuse_distance``: all-gathers after the first (recording) step."""
    torch.manual_seed(0)
    model = Shared()
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 4,
            "stage3_prefetch_bucket_size": 0,
            "stage3_max_reuse_distance": distance,
        },
    }
    engine, _, loader, _ = deepspeed.initialize(model=model, training_data=dataset(), config=config)
    for i, (x, y) in enumerate(loader):
        if i == 1:
            engine.reset_comm_report()
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
    gathers = sum(r.count for r in engine.comm_report().records if r.op == "all_gather" and r.purpose == "parameters")
    final = {k: v.clone() for k, v in engine.state_dict().items()}
    torch.manual_seed(0)
    ref = Shared()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    data, world = dataset(), dist.get_world_size()
    order = [list(DistributedSampler(data, num_replicas=world, rank=r)) for r in range(world)]
    for step in range(len(loader)):
        for r in range(world):
            x, y = data[order[r][step * MICRO : (step + 1) * MICRO]]
            (nn.functional.mse_loss(ref(x), y) / world).backward()
        opt.step()
        opt.zero_grad()
    return {
        "gathers": gathers,
        "reuse_hits": engine.sharding.coordinator.reuse_hits,
        "err": max(err(final[k], v) for k, v in ref.state_dict().items()),
        "compared": len(final),
    }


def _opt_tensors(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    return {
        f"{i}.{k}": v
        for i, st in enumerate(opt.state.values())
        for k, v in st.items()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    }


def err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    if a.shape != b.shape:
        return float("inf")
    return ((a - b).abs() / (ATOL + RTOL * b.abs())).max().item() if a.numel() else 0.0


def reference(world: int, client_optimizer: bool) -> dict[str, torch.Tensor]:
    """Single-process plain PyTorch: the same global batches (DistributedSampler's order per rank)."""
    torch.manual_seed(0)
    model = Net()
    if client_optimizer:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / 3))  # WarmupLR, linear, 0 -> lr
    data = dataset()
    order = [list(DistributedSampler(data, num_replicas=world, rank=r)) for r in range(world)]
    for step in range(STEPS):
        for r in range(world):
            for m in range(ACCUM):
                idx = order[r][(step * ACCUM + m) * MICRO : (step * ACCUM + m + 1) * MICRO]
                x, y = data[idx]
                (nn.functional.mse_loss(model(x), y) / (world * ACCUM)).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--stages", default="0,1,2,3")
    ap.add_argument("--scenarios", default="all")
    a = ap.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results: dict[str, Any] = {}
    for stage in [int(s) for s in a.stages.split(",")]:
        for client in (False, True):
            name = f"stage{stage}_{'client' if client else 'config'}"
            try:
                d = tempfile.mkdtemp(prefix="zerodp-ds-") if rank == 0 else None
                box = [d]
                dist.broadcast_object_list(box, src=0)
                out, final = ds_train(deepspeed, stage, box[0], client)
                ref = reference(world, client)
                out["compared"] = sorted(ref)
                out["err"] = max(err(final[k], ref[k]) for k in ref)
                results[name] = out
            except Exception:
                results[name] = {"error": traceback.format_exc()}
            dist.barrier()
    if "3" in a.stages.split(","):
        for distance in (0, 100):
            try:
                results[f"reuse{distance}"] = reuse_run(deepspeed, distance)
            except Exception:
                results[f"reuse{distance}"] = {"error": traceback.format_exc()}
    with open(os.path.join(a.out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    import zerodp

    zerodp.shutdown_distributed()


if __name__ == "__main__":
    main()
