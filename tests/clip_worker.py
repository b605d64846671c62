"""Per-rank worker for tests/test_clip_grad.py (issue 26 item 2): gradient clipping called by the user
between ``engine.backward`` and ``engine.step``, at every stage, precision and optimizer offload,
compared with single-process plain PyTorch (fp32 masters updated by SGD, as the engine's) on the same
global batch. Launched by torchrun through tests/distributed.py (``--nvme DIR`` for the NVMe offload).

One job per (stage, precision, offload): 3 optimizer steps of 2 micro-steps each (``gas`` 2):

- step 0: ``torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm)`` as a user writes it; it
  must raise naming ``gradient_clipping`` and ``engine.clip_grad_norm_`` where ``param.grad`` is not
  the gradient (stages 1-3; fp16), and work (norm and clipping as torch's) at stage 0 otherwise; where
  it raised, ``engine.clip_grad_norm_(max_norm)`` clips instead.
- step 1: ``engine.clip_grad_norm_(max_inf, inf)`` then ``engine.clip_grad_norm_(max_norm)`` (the
  second sees the first's clipping) and ``safe_get_full_grad`` (the clipped gradient).
- step 2: no clipping at all: ``get_global_grad_norm()`` is still the step's norm (at every step, the
  norm of the gradient the step received, after the user's clipping).

``max_norm`` is a fifth of the gradient's norm, so an update made without the clipping is 5x too large.
Engine, batches and reference run on the test device (``ZERODP_TEST_DEVICE``, tests/devices.py).
"""

from __future__ import annotations

import copy
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
import zerodp  # noqa: E402
import zerodp.zero  # noqa: E402
from devices import engine_config, rank_device  # noqa: E402
from distributed import run_scenarios, worker_args  # noqa: E402
from zerodp.runtime.grad_placeholder import is_hidden_gradient  # noqa: E402

MICRO, GAS, LR = 2, 2, 0.5
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


class Reference:
    """Plain PyTorch: the module in ``dtype``, fp32 master copies updated by torch SGD, the fp16 loss
    scale applied to the loss and divided out of the gradients (as the engine documents)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        self.model = model.to(dtype)
        self.params = list(self.model.parameters())
        self.masters = [p.detach().float().clone() for p in self.params]
        self.opt = torch.optim.SGD(self.masters, lr=LR)

    def backward(self, loss: torch.Tensor, scale: float) -> None:
        for p in self.params:
            p.grad = None
        (loss * scale).backward()
        for m, p in zip(self.masters, self.params, strict=True):
            m.grad = p.grad.float() / scale

    def norm(self, norm_type: float = 2.0) -> float:
        return torch.nn.utils.get_total_norm([m.grad for m in self.masters], norm_type).item()

    def clip(self, max_norm: float, norm_type: float = 2.0) -> float:
        return torch.nn.utils.clip_grad_norm_(self.masters, max_norm, norm_type).item()

    def step(self) -> None:
        self.opt.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters, strict=True):
                p.copy_(m)


def batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(900 + step)
    return torch.randn(rows, 5, generator=g).to(rank_device()), torch.randn(rows, 3, generator=g).to(rank_device())


def config(stage: int, precision: str, offload: str, nvme: str) -> dict:
    zero: dict = {"stage": stage, "reduce_bucket_size": 16, "stage3_param_persistence_threshold": 4}
    if offload != "none":
        zero["offload_optimizer"] = {"device": offload, "nvme_path": nvme, "buffer_count": 3}
        zero["sub_group_size"] = 20  # several sub-groups per rank
    cfg: dict = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "zero_optimization": zero,
        **engine_config(),
    }
    if offload == "nvme":
        cfg["aio"] = {"block_size": 4096, "queue_depth": 2, "thread_count": 2}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 6}  # no overflow on these gradients
    return cfg


def clip_job(stage: int, precision: str, offload: str, nvme: str) -> dict:
    dtype = DTYPES[precision]
    torch.manual_seed(5)
    base = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).to(rank_device())
    ref = Reference(copy.deepcopy(base), dtype)
    model = copy.deepcopy(base)
    engine = zerodp.initialize(model, config(stage, precision, offload, nvme))
    n, r = dist.get_world_size(), dist.get_rank()
    out: dict = {
        "norm_err": 0.0,
        "inf_norm_err": 0.0,
        "second_norm_err": 0.0,
        "global_norm_err": 0.0,
        "full_grad_err": 0.0,
        "not_ready": "",
        "hidden_after_step": 0,
    }

    def loss_of(m, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((m(x.to(dtype)).float() - y) ** 2).mean()

    for step in range(3):
        x, y = batch(step, MICRO * n * GAS)
        ref.backward(loss_of(ref.model, x, y), engine.loss_scale)
        ref_norm = ref.norm()
        max_norm = ref_norm / 5
        for j in range(GAS):
            lo = (j * n + r) * MICRO
            engine.backward(loss_of(engine, x[lo : lo + MICRO], y[lo : lo + MICRO]))
            if j + 1 < GAS and step == 0:  # not reduced yet: refused
                try:
                    engine.clip_grad_norm_(1.0)
                except RuntimeError as e:
                    out["not_ready"] = str(e)
            if j + 1 < GAS:
                engine.step()  # after every micro-batch, as in DeepSpeed
        if step == 0:
            try:
                got = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item()
                out["torch_clip"] = "worked"
            except RuntimeError as e:
                out["torch_clip"] = str(e)
                got = engine.clip_grad_norm_(max_norm).item()
            out["norm_err"] = rel(got, ref.clip(max_norm))
        elif step == 1:
            max_inf = ref.norm(math.inf) / 3
            inf_norm = engine.clip_grad_norm_(max_inf, norm_type=math.inf).item()
            out["inf_norm_err"] = rel(inf_norm, ref.clip(max_inf, math.inf))
            second = engine.clip_grad_norm_(max_norm).item()  # the inf-norm clipping is already applied
            out["second_norm_err"] = rel(second, ref.clip(max_norm))
            for p, m in zip(model.parameters(), ref.masters, strict=True):
                full = zerodp.zero.safe_get_full_grad(p).to(m.device)
                out["full_grad_err"] = max(
                    out["full_grad_err"], ((full - m.grad).abs().max() / m.grad.abs().max()).item()
                )
        stepped_norm = ref.norm()  # what the step receives: after the user's clipping
        engine.step()
        ref.step()
        out["global_norm_err"] = max(out["global_norm_err"], rel(engine.get_global_grad_norm(), stepped_norm))
        out["hidden_after_step"] += sum(is_hidden_gradient(p.grad) for p in model.parameters())
    # parameters: the update of every element against the reference's (a missing clipping: 5x too large)
    worst = 0.0
    for p, m, b in zip(model.parameters(), ref.masters, base.parameters(), strict=True):
        full = zerodp.zero.safe_get_full_fp32_param(p).to(m.device)
        worst = max(worst, ((full - m).abs().max() / (m - b.detach()).abs().max()).item())
    out["update_err"] = worst
    engine.close()
    return out


def main() -> None:
    args = worker_args("--nvme")
    jobs = []
    for stage in [int(s) for s in args.stages.split(",")]:
        for precision in DTYPES:
            for offload in ("none",) if stage == 0 else ("none", "cpu", "nvme"):
                jobs.append(
                    (
                        f"clip/stage{stage}/{precision}/{offload}",
                        lambda s=stage, p=precision, o=offload: clip_job(s, p, o, args.nvme),
                    )
                )
    run_scenarios(args.out, jobs)


if __name__ == "__main__":
    main()
