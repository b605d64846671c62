"""Worker of tests/test_delayed_update.py: ``offload_optimizer.delayed_update`` follows the one-step stale
trajectory of a plain-PyTorch reference on the same global batch (step t's forward uses the parameters
after step t-2's update: the reference applies each step's gradients after the next step's backward,
with the hyperparameters of the step that produced them).

Scenarios (each at the stages given on the command line):

- ``plain``: Adam, one micro-step per step.
- ``clip_sched_accum``: AdamW, gradient clipping active every step, a StepLR halving the LR each step,
  two micro-steps per step.
- ``edit`` (stages 1-2): an in-place edit of a weight between steps is kept (it replaces the pending
  update of that weight; its Adam moments still take the gradients).

Each reports whether the engine matches the delayed reference (rtol 1e-5, atol 1e-6, losses and final
fp32 weights), how far it is from the undelayed reference, and how many updates were launched. The
engine, the batches and the reference follow ``ZERODP_TEST_DEVICE`` (tests/devices.py); on a GPU the
engine's delayed Adam runs on the host and the reference's on the GPU (within the tolerances above).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import zerodp
from devices import engine_config, rank_device
from distributed import run_selected, worker_args

STEPS, MICRO, WIDTH, LR = 6, 2, 16, 1e-2
RTOL, ATOL = 1e-5, 1e-6


def model_fn() -> nn.Module:
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 4))


def batch(step: int, micro: int, world: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randn(MICRO * world, WIDTH, generator=g).to(rank_device())


def reference(spec: dict, delayed: bool) -> tuple[list[float], dict]:
    """Plain PyTorch on the global batch; with ``delayed`` each step's (clipped) gradients are applied
    after the next step's backward, with the LR of the step that produced them."""
    model = model_fn().to(rank_device())
    world = dist.get_world_size()
    opt_cls = torch.optim.AdamW if spec["opt"] == "AdamW" else torch.optim.Adam
    opt = opt_cls(model.parameters(), lr=LR, weight_decay=0.0)  # DeepSpeed's default decay for Adam/AdamW
    params = list(model.parameters())
    pending = None
    losses = []
    for step in range(STEPS):
        for micro in range(spec["gas"]):
            loss = model(batch(step, micro, world)).square().mean()
            (loss / spec["gas"]).backward()
            losses.append(loss.item())
        if spec["clip"]:
            torch.nn.utils.clip_grad_norm_(params, spec["clip"])
        lr_now = LR * (0.5**step if spec["sched"] else 1.0)
        grads = [p.grad.clone() for p in params]
        for p in params:
            p.grad = None
        todo = pending if delayed else (grads, lr_now)
        if todo is not None:
            edited_before = step == spec.get("edit_at", -10) + 1  # the edit was made after the last step
            kept = params[0].detach().clone() if edited_before else None
            for p, g in zip(params, todo[0], strict=True):
                p.grad = g
            for group in opt.param_groups:
                group["lr"] = todo[1]
            opt.step()
            if kept is not None and delayed:  # the edit replaces the pending update of that weight
                with torch.no_grad():
                    params[0].copy_(kept)
            for p in params:
                p.grad = None
        pending = (grads, lr_now) if delayed else None
        if step == spec.get("edit_at"):
            with torch.no_grad():
                params[0].mul_(0.5)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def engine_run(spec: dict, stage: int) -> tuple[list[float], dict, dict]:
    model = model_fn()
    zc = {"stage": stage, "offload_optimizer": {"device": "cpu", "delayed_update": True, "cpu_adam": "same"}}
    if stage == 3:
        zc["stage3_param_persistence_threshold"] = 0
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": spec["gas"],
        "optimizer": {"type": spec["opt"], "params": {"lr": LR}},
        "zero_optimization": zc,
        **engine_config(),
    }
    if spec["clip"]:
        cfg["gradient_clipping"] = spec["clip"]
    sched = (lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)) if spec["sched"] else None
    engine = zerodp.initialize(model, cfg, lr_scheduler=sched)
    r, world = dist.get_rank(), dist.get_world_size()
    losses, norms = [], []
    for step in range(STEPS):
        for micro in range(spec["gas"]):
            x = batch(step, micro, world)
            loss = engine(x[r * MICRO : (r + 1) * MICRO]).square().mean()
            engine.backward(loss)
            engine.step()
            full = loss.detach().clone()
            dist.all_reduce(full)
            losses.append(full.item() / world)
        norms.append(engine.get_global_grad_norm())
        if step == spec.get("edit_at"):
            with torch.no_grad():
                engine.module[0].weight.mul_(0.5)
    off = engine.optimizer_offload
    facts = {
        "kind": type(off).__name__,
        "launched": off.updates_launched,
        "clipped": spec["clip"] is not None and min(norms) > spec["clip"],
    }
    state = engine.module_state_dict()
    engine.close()
    return losses, state, facts


def close(a: list[float], b: list[float]) -> bool:
    return torch.allclose(torch.tensor(a), torch.tensor(b), rtol=RTOL, atol=ATOL)


def compare(spec: dict) -> dict:
    out = {}
    stale_losses, stale_state = reference(spec, delayed=True)
    fresh_losses, _ = reference(spec, delayed=False)
    for stage in STAGES:
        if spec.get("edit_at") is not None and stage == 3:
            continue  # stage 3 edits go through GatheredParameters (refresh_master), not in place
        losses, state, facts = engine_run(spec, stage)
        weights = all(torch.allclose(state[k], stale_state[k], rtol=RTOL, atol=ATOL) for k in stale_state)
        out[str(stage)] = {
            "stale": close(losses, stale_losses) and weights,
            "fresh_gap": max(abs(a - b) / abs(b) for a, b in zip(losses, fresh_losses, strict=True)),
            **facts,
        }
    return out


SPECS = {
    "plain": {"opt": "Adam", "gas": 1, "clip": None, "sched": False},
    "clip_sched_accum": {"opt": "AdamW", "gas": 2, "clip": 0.05, "sched": True},
    "edit": {"opt": "Adam", "gas": 1, "clip": None, "sched": False, "edit_at": 2},
}
STAGES: list[int] = []


def main() -> None:
    global STAGES
    args = worker_args()
    STAGES = [int(s) for s in args.stages.split(",")]
    run_selected(args, {name: (lambda spec=spec: compare(spec)) for name, spec in SPECS.items()})


if __name__ == "__main__":
    main()
