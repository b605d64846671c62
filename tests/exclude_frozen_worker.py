"""Per-rank worker for tests/test_checkpoint_exclude_frozen.py (issue 26 item 5):
``save_checkpoint(..., exclude_frozen_parameters=True)`` at every stage, precision and optimizer offload.

One job per (stage, precision, offload), LoRA-like model (frozen base, trained adapter):

- engine A trains 2 steps, saves with ``exclude_frozen_parameters=True`` into ``--ckpt DIR/<job>``,
  trains 2 more steps;
- engine B is built from a model whose frozen part was loaded separately (the base's values) and whose
  trained part is re-initialised differently, loads the checkpoint and trains the same 2 steps: its
  parameters must equal A's bitwise (exact resume), and both equal plain PyTorch trained 4 steps.
- what was written: ``meta.json`` lists the frozen names in ``excluded_frozen``, ``model_extra`` holds
  none of them, the rank files only trained pieces; ``load_full_state_dict`` warns naming them.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
import zerodp  # noqa: E402
from distributed import run_scenarios, worker_args  # noqa: E402
from zerodp import checkpoint  # noqa: E402
from zerodp.checkpoint.reader import AbsentParametersWarning  # noqa: E402

MICRO = 2
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FROZEN = ["base1.weight", "base1.bias", "base2.weight"]
TRAINED = ["base2.bias", "a.weight", "b.weight"]


class Lora(nn.Module):
    """A frozen base (``base1``, ``base2.weight``) with a trained low-rank adapter ``b(a(x))`` and bias."""

    def __init__(self) -> None:
        super().__init__()
        self.base1, self.base2 = nn.Linear(6, 8), nn.Linear(8, 3)
        self.a, self.b = nn.Linear(6, 2, bias=False), nn.Linear(2, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base2(torch.tanh(self.base1(x) + self.b(self.a(x))))


def lora(trained_seed: int) -> Lora:
    """The base from seed 0 (the "separately loaded" frozen part), the trained part from ``trained_seed``."""
    torch.manual_seed(0)
    m = Lora()
    torch.manual_seed(trained_seed)
    with torch.no_grad():
        for name in TRAINED:
            m.get_parameter(name).normal_(0, 0.5)
    for name in FROZEN:
        m.get_parameter(name).requires_grad_(False)
    return m


def batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(300 + step)
    return torch.randn(rows, 6, generator=g), torch.randn(rows, 3, generator=g)


def config(stage: int, precision: str, offload: str) -> dict:
    zero: dict = {"stage": stage, "reduce_bucket_size": 16, "stage3_param_persistence_threshold": 4}
    if offload != "none":
        zero["offload_optimizer"] = {"device": offload}
    cfg: dict = {
        "train_micro_batch_size_per_gpu": MICRO,
        "zero_optimization": zero,
        "optimizer": {"type": "Adam", "params": {"lr": 0.05}},
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 6}
    return cfg


def train(engine, model_dtype: torch.dtype, steps: range) -> None:
    n, r = dist.get_world_size(), dist.get_rank()
    for step in steps:
        x, y = batch(step, MICRO * n)
        lo = r * MICRO
        out = engine(x[lo : lo + MICRO].to(model_dtype)).float()
        engine.backward(((out - y[lo : lo + MICRO]) ** 2).mean())
        engine.step()


def reference(steps: int, n: int) -> dict[str, torch.Tensor]:
    """Plain PyTorch, fp32, on the global batch: the trained parameters after ``steps`` steps."""
    m = lora(trained_seed=1)
    opt = torch.optim.Adam([p for p in m.parameters() if p.requires_grad], lr=0.05)
    for step in range(steps):
        x, y = batch(step, MICRO * n)
        opt.zero_grad()
        ((m(x) - y) ** 2).mean().backward()
        opt.step()
    return {k: v.detach() for k, v in m.state_dict().items()}


def exclude_job(stage: int, precision: str, offload: str, ckpt_root: str) -> dict:
    dtype = DTYPES[precision]
    n = dist.get_world_size()
    d = Path(ckpt_root) / f"stage{stage}-{precision}-{offload}"
    out: dict = {}
    a = zerodp.initialize(lora(trained_seed=1), config(stage, precision, offload))
    train(a, dtype, range(2))
    path = a.save_checkpoint(d, exclude_frozen_parameters=True)
    train(a, dtype, range(2, 4))
    a_final = a.module_state_dict()
    a.close()

    b_model = lora(trained_seed=2)  # frozen part as A's (loaded separately), trained part different
    b = zerodp.initialize(b_model, config(stage, precision, offload))
    b_before = b.module_state_dict()
    b.load_checkpoint(d)
    frozen_after_load = b.module_state_dict()
    train(b, dtype, range(2, 4))
    b_final = b.module_state_dict()
    b.close()

    out["resumed_bitwise"] = sorted(k for k in a_final if not torch.equal(a_final[k], b_final[k]))
    out["frozen_kept"] = all(torch.equal(frozen_after_load[k], b_before[k]) for k in FROZEN)
    ref = reference(4, n)
    out["ref_err"] = max(((b_final[k].float() - ref[k]).abs().max() / ref[k].abs().max()).item() for k in TRAINED)
    out["frozen_err"] = max(((b_final[k].float() - ref[k]).abs().max()).item() for k in FROZEN)
    if dist.get_rank() == 0:
        meta = checkpoint.read_meta(path)
        out["excluded"] = meta.excluded_frozen
        with safe_open(str(path / checkpoint.EXTRA_FILE), framework="pt") as f:
            out["extra_keys"] = sorted(f.keys())
        pieces = sorted({p.name for rr in meta.ranks for p in rr.pieces})
        out["piece_names"] = pieces
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sd = checkpoint.load_full_state_dict(d)
        out["consolidated_keys"] = sorted(sd)
        out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, AbsentParametersWarning)]
    return out


def refuse_trained_here(ckpt_root: str) -> dict:
    """A checkpoint saved without ``base2.weight``'s values, loaded into an engine that trains it."""
    d = Path(ckpt_root) / "refuse"
    a = zerodp.initialize(lora(trained_seed=1), config(1, "fp32", "none"))
    train(a, torch.float32, range(1))
    a.save_checkpoint(d, exclude_frozen_parameters=True)
    m = lora(trained_seed=1)
    m.base2.weight.requires_grad_(True)
    b = zerodp.initialize(m, config(1, "fp32", "none"))
    before = {k: v.clone() for k, v in m.state_dict().items()}
    try:
        b.load_checkpoint(d)
        return {"refused": False}
    except checkpoint.CheckpointError as e:
        unchanged = all(torch.equal(v, m.state_dict()[k]) for k, v in before.items())
        return {"refused": True, "message": str(e), "unchanged": unchanged}


def main() -> None:
    args = worker_args("--ckpt")
    jobs = []
    for stage in [int(s) for s in args.stages.split(",")]:
        for precision in DTYPES:
            for offload in ("none",) if stage == 0 else ("none", "cpu"):
                jobs.append(
                    (
                        f"exclude/stage{stage}/{precision}/{offload}",
                        lambda s=stage, p=precision, o=offload: exclude_job(s, p, o, args.ckpt),
                    )
                )
    jobs.append(("refuse", lambda: refuse_trained_here(args.ckpt)))
    run_scenarios(args.out, jobs)


if __name__ == "__main__":
    main()
