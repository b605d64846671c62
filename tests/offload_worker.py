"""Per-rank worker for tests/test_offload.py, launched by torchrun (see tests/distributed.py).

For each stage and scenario it trains the same model three times on the same batches: without
offload, with ``offload_optimizer.device = "cpu"`` and with ``"nvme"`` (a tiny ``sub_group_size`` so
several sub-groups pipeline through the buffer pool), and records whether the parameters are bitwise
equal, plus the distance of the non-offloaded run from plain PyTorch on the whole global batch (fp32).
Checkpoints cross between offloaded and non-offloaded engines. Results: ``OUT/rank{r}.json``. The
engines, batches and the reference run on the test device (``ZERODP_TEST_DEVICE``, tests/devices.py).
"""

from __future__ import annotations

import argparse
import json
import os
import traceback

import torch
import torch.distributed as dist
from torch import nn

import zerodp
import zerodp.offload.host
import zerodp.offload.nvme
from devices import engine_config, rank_device
from tensor_compare import ulps

# several step chunks even on this tiny model, so the chunked CPU step with overlapped parameter
# copies is what the equality checks compare
zerodp.offload.host.MIN_CHUNK_NUMEL = 16

STEPS = 4
ROWS = 12  # global batch rows per micro-step (divisible by 1, 2, 3)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(9, 17)
        self.b = nn.Linear(17, 13)
        self.c = nn.Linear(13, 3)
        self.s = nn.Parameter(torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x))))) * self.s


def batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randn(ROWS, 9, generator=g).to(rank_device()), torch.randn(ROWS, 3, generator=g).to(rank_device())


def local(t: torch.Tensor) -> torch.Tensor:
    n = ROWS // dist.get_world_size()
    return t[dist.get_rank() * n : (dist.get_rank() + 1) * n]


def config(stage: int, scenario: str, device: str, nvme: str) -> dict:
    cfg: dict = {
        "train_micro_batch_size_per_gpu": ROWS // dist.get_world_size(),
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 40, "stage3_param_persistence_threshold": 4},
        **engine_config(),
    }
    if device != "none":
        # cpu_adam "same": the non-offloaded engine's Adam kernel, so "equal" below means bitwise
        # (the default fused kernel is compared within 1e-6 relative in tests/test_cpu_adam.py)
        cfg["zero_optimization"]["offload_optimizer"] = {
            "device": device,
            "nvme_path": nvme,
            "buffer_count": 3,
            "cpu_adam": "same",
        }
        cfg["zero_optimization"]["sub_group_size"] = 60  # several sub-groups per rank
        cfg["aio"] = {"block_size": 4096, "queue_depth": 2, "thread_count": 2}
    if scenario in ("bf16", "bf16_accum", "edit_bf16"):
        cfg["bf16"] = {"enabled": True}
    if scenario in ("accum_clip", "bf16_accum", "fp16_accum_clip"):
        cfg["gradient_accumulation_steps"] = 2
        cfg["gradient_clipping"] = 0.05
    if scenario == "fp16_overflow":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 18, "hysteresis": 1}
    if scenario == "fp16_accum_clip":  # loss scaling (no overflow at 2**8) and clipping, deferred together
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    if scenario == "adam_no_overlap":
        cfg["optimizer"] = {"type": "Adam", "params": {"lr": 0.01, "weight_decay": 0.01, "adam_w_mode": False}}  # L2
        if device != "none":
            cfg["aio"]["overlap_events"] = False
            cfg["aio"]["single_submit"] = True
    return cfg


def edit(model: nn.Module, stage: int) -> None:
    """In-place edits between steps: through the parameter (its version counter moves) and through
    ``.data`` (it does not); at stage 3 only persistent (always gathered) parameters are edited."""
    with torch.no_grad():
        model.c.bias.mul_(0.5)
        model.s.data.add_(0.25)
        if stage < 3:
            model.a.weight.mul_(0.5)


def edit_and_freeze(model: nn.Module, stage: int) -> list[nn.Parameter]:
    """In-place edits of parameters that then get no gradient for one step (frozen for it): through
    ``.data`` (no version counter moves) and, at stages 1-2, through the parameter; at stage 3 only
    persistent parameters are edited. Returns the frozen parameters."""
    frozen = [model.c.bias, model.s] + ([model.a.weight, model.a.bias] if stage < 3 else [])
    with torch.no_grad():
        model.c.bias.data.mul_(0.5)
        model.s.data.add_(0.25)
        if stage < 3:
            model.a.weight.data.mul_(0.5)
            model.a.bias.mul_(0.5)
    for p in frozen:
        p.requires_grad_(False)
    return frozen


def train_edit_frozen(engine, stage: int, ckpt: str) -> dict:
    """Step 0; edit and freeze; step 1 (the edited parameters have no gradient); right after it: the
    module state dict and ``safe_get_full_fp32_param`` of the edited parameters; unfreeze; a checkpoint
    (returned: the state dict a non-offloaded engine loads from it); steps 2-3."""
    from zerodp.accessors import safe_get_full_fp32_param

    train(engine, range(1), 1)
    frozen = edit_and_freeze(engine.module, stage)
    train(engine, range(1, 2), 1)
    out = {"after": params(engine), "accessor": [safe_get_full_fp32_param(p) for p in frozen]}
    for p in frozen:  # before the save: a checkpoint records a frozen parameter as not trained
        p.requires_grad_(True)
    engine.save_checkpoint(ckpt)
    train(engine, range(2, STEPS), 1)
    loaded = build(stage, "edit_frozen", "none", "")
    loaded.load_checkpoint(ckpt)
    out["loaded"] = params(loaded)
    loaded.close()
    return out


def train(engine, steps: range, gas: int, edits: bool = False) -> None:
    for step in steps:
        for micro in range(gas):
            x, y = batch(step, micro)
            dtype = engine.groups[0].buffer.dtype
            loss = nn.functional.mse_loss(engine(local(x).to(dtype)).float(), local(y))
            engine.backward(loss)
            engine.step()
        if edits and step % 2 == 0:
            edit(engine.module, engine.stage)


def build(stage: int, scenario: str, device: str, nvme: str):
    torch.manual_seed(0)
    return zerodp.initialize(Net(), config(stage, scenario, device, nvme))


def params(engine) -> dict[str, torch.Tensor]:
    return engine.module_state_dict()


def reference(scenario: str, stage: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Net().to(rank_device())
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    frozen: list[nn.Parameter] = []
    for step in range(STEPS):
        x, y = batch(step, 0)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if scenario == "edit" and step % 2 == 0:
            edit(model, stage)
        for p in frozen:
            p.requires_grad_(True)
        frozen = edit_and_freeze(model, stage) if scenario == "edit_frozen" and step == 0 else []
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def run_scenario(stage: int, scenario: str, nvme: str, ckpt: str) -> dict:
    gas = 2 if "accum" in scenario else 1
    runs = {}
    reports = {}
    frozen = {}
    for device in ("none", "cpu", "nvme"):
        engine = build(stage, scenario, device, nvme)
        if scenario == "edit_frozen":
            frozen[device] = train_edit_frozen(engine, stage, os.path.join(ckpt, f"s{stage}frozen{device}"))
        else:
            train(engine, range(STEPS), gas, edits=scenario.startswith("edit"))
        runs[device] = params(engine)
        if device != "none":
            rep = engine.offload_report()
            reports[device] = {
                "host": rep.host,
                "nvme": rep.nvme,
                "formula": rep.formula,
                "memory": engine.memory_report().measured,
                "skipped": engine.skipped_steps,
                "norm": engine.get_global_grad_norm(),
                "max_grad_buffer": max(t.numel() for t in engine.optimizer_offload.grad_buffers),
                "owned": sum(p.hi - p.lo for g in engine.groups for p in g.pieces),
            }
            if device == "nvme":
                stats = engine.optimizer_offload.stats
                reports[device]["swap"] = [stats.bytes_read, stats.bytes_written]
                reports[device]["subgroups"] = len(engine.optimizer_offload.subgroups)
        engine.close()
    out = {
        "steps": STEPS,
        "equal": {d: _equal(runs["none"], runs[d]) for d in ("cpu", "nvme")},
        "ulps": {d: _ulps(runs["none"], runs[d]) for d in ("cpu", "nvme")},
        "reports": reports,
    }
    if frozen:  # right after the step without gradient: the edited masters, as without offload
        out["frozen"] = {
            what: {d: _equal(frozen["none"][what], frozen[d][what]) for d in ("cpu", "nvme")}
            for what in ("after", "accessor", "loaded")
        }
        out["frozen_ulps"] = {
            what: {d: _ulps(frozen["none"][what], frozen[d][what]) for d in ("cpu", "nvme")}
            for what in ("after", "accessor", "loaded")
        }
    if scenario in ("fp32", "edit", "edit_frozen"):
        ref = reference(scenario, stage)
        out["ref_maxdiff"] = max((runs["none"][k].to(ref[k].device) - ref[k]).abs().max().item() for k in ref)
    if scenario == "bf16":
        out["ckpt"] = checkpoints(stage, scenario, nvme, ckpt)
    return out


def _pairs(a, b) -> list:
    return [(a[k], b[k]) for k in a] if isinstance(a, dict) else list(zip(a, b, strict=False))


def _equal(a, b) -> bool:
    """Bitwise equality of two state dicts or two lists of tensors."""
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in _pairs(a, b))


def _ulps(a, b) -> float:
    """See :func:`tensor_compare.ulps` (dicts or lists of tensors, in this file's pairing)."""
    pairs = _pairs(a, b)
    if len(a) != len(b):
        return float("inf")
    return max((ulps(x, y) for x, y in pairs), default=0.0)


def deleted_swap_file(nvme: str) -> dict:
    """Rank 0 deletes its swap file mid-run: every rank raises at the next step, nothing changed."""
    engine = build(1, "fp32", "nvme", nvme)
    train(engine, range(1), 1)
    before = params(engine)
    if dist.get_rank() == 0:
        os.remove(engine.optimizer_offload.file.path)
    out = {"raised_on": [], "message": ""}
    try:
        train(engine, range(1, 2), 1)
        out["raised_on"].append(False)
    except zerodp.offload.nvme.OffloadError as exc:
        out["raised_on"].append(True)
        out["message"] = str(exc)
    engine.reducer.zero_grads()
    out["unchanged"] = all(
        torch.equal(before[k], p.to(before[k].device))
        for k, p in {n: t for n, t in engine.module.state_dict().items()}.items()
        if engine.stage < 3
    )
    engine.close()
    return out


def checkpoints(stage: int, scenario: str, nvme: str, ckpt: str) -> dict:
    """Save after 2 steps from one placement, load into another, train 2 more: equal to a straight run."""
    straight = build(stage, scenario, "none", nvme)
    train(straight, range(STEPS), 1)
    want = params(straight)
    result = {}
    for src, dst in (("nvme", "none"), ("none", "nvme"), ("cpu", "nvme")):
        a = build(stage, scenario, src, nvme)
        train(a, range(2), 1)
        d = os.path.join(ckpt, f"s{stage}{scenario}{src}{dst}")
        a.save_checkpoint(d)
        a.close()
        b = build(stage, scenario, dst, nvme)
        b.load_checkpoint(d)
        train(b, range(2, STEPS), 1)
        got = params(b)
        b.close()
        result[f"{src}->{dst}"] = all(torch.equal(want[k], got[k]) for k in want)
        result[f"{src}->{dst} ulps"] = _ulps(want, got)
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--stages", default="1,2,3")
    ap.add_argument("--scenarios", default="fp32,bf16,accum_clip,bf16_accum,fp16_overflow,adam_no_overlap")
    ap.add_argument("--nvme", required=True)
    ap.add_argument("--ckpt", required=True)
    args = ap.parse_args()
    zerodp.init_distributed()
    results: dict = {}
    for stage in [int(s) for s in args.stages.split(",")]:
        for sc in args.scenarios.split(","):
            try:
                results[f"{stage}/{sc}"] = run_scenario(stage, sc, args.nvme, args.ckpt)
            except Exception:  # recorded, asserted on by the test
                results[f"{stage}/{sc}"] = {"error": traceback.format_exc()}
    results["errors"] = deleted_swap_file(args.nvme)
    with open(os.path.join(args.out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(results, f, default=str)
    zerodp.shutdown_distributed() if hasattr(zerodp, "shutdown_distributed") else None


if __name__ == "__main__":
    main()
