"""Per-rank worker for tests/test_checkpoint_optimizer.py: a checkpoint saved with one optimizer loaded
into an engine with another (fresh-user report F1), at each stage of ``--stages``.

For each (saved, engine) optimizer pair of :data:`PAIRS`: engine A (saved optimizer) trains 2 steps and
saves; engine B (the other optimizer) must have ``load_checkpoint`` refused with a CheckpointError naming
both optimizers and ``load_optimizer_states=False``, its parameters and optimizer state untouched; then
``load_checkpoint(..., load_optimizer_states=False)`` loads A's weights and B trains one step, which must
equal plain PyTorch: A's weights, a fresh optimizer of B's type, the same global batch.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
import zerodp  # noqa: E402
from distributed import run_scenarios, worker_args  # noqa: E402
from zerodp.checkpoint import CheckpointError  # noqa: E402

MICRO = 2
OPTIMIZERS = {
    "SGD": ({"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}, lambda ps: torch.optim.SGD(ps, 0.1, 0.9)),
    "AdamW": ({"type": "AdamW", "params": {"lr": 0.01}}, lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.0)),
    "AdamW+amsgrad": (
        {"type": "AdamW", "params": {"lr": 0.01, "amsgrad": True}},
        lambda ps: torch.optim.AdamW(ps, lr=0.01, amsgrad=True, weight_decay=0.0),
    ),
}
#: (saved with, loaded into): both directions across classes, and the same class with other state keys
PAIRS = (("SGD", "AdamW"), ("AdamW", "SGD"), ("AdamW", "AdamW+amsgrad"))


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    n = MICRO * dist.get_world_size()
    return torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g)


def engine(opt: str, stage: int) -> zerodp.Engine:
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": OPTIMIZERS[opt][0],
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 16},
    }
    return zerodp.initialize(model(), cfg)


def train(e: zerodp.Engine, steps: range) -> None:
    lo = dist.get_rank() * MICRO
    for step in steps:
        x, y = batch(step)
        e.backward(((e(x[lo : lo + MICRO]) - y[lo : lo + MICRO]) ** 2).mean())
        e.step()


def reference_step(weights: dict[str, torch.Tensor], opt: str, step: int) -> dict[str, torch.Tensor]:
    """Plain PyTorch: ``weights``, a fresh ``opt`` optimizer, one step on the global batch ``step``."""
    m = model()
    m.load_state_dict(weights)
    o = OPTIMIZERS[opt][1](list(m.parameters()))
    x, y = batch(step)
    ((m(x) - y) ** 2).mean().backward()
    o.step()
    return {k: v.detach() for k, v in m.state_dict().items()}


def pair_job(stage: int, saved: str, mine: str, ckpt_root: str) -> dict:
    d = Path(ckpt_root) / f"stage{stage}-{saved}-{mine}"
    a = engine(saved, stage)
    train(a, range(2))
    a.save_checkpoint(d)
    a_weights = a.module_state_dict()
    a.close()
    b = engine(mine, stage)
    before = b.module_state_dict()
    message = ""
    try:
        b.load_checkpoint(d)
    except CheckpointError as err:
        message = str(err)
    after = b.module_state_dict()
    untouched = all(torch.equal(before[k], after[k]) for k in before) and not b.optimizer.state
    b.load_checkpoint(d, load_optimizer_states=False)
    loaded = b.module_state_dict()
    weights_equal = all(torch.equal(loaded[k], a_weights[k]) for k in a_weights)
    train(b, range(2, 3))
    got, want = b.module_state_dict(), reference_step(a_weights, mine, 2)
    err = max((got[k] - want[k]).abs().max().item() for k in want)
    b.close()
    return {"message": message, "untouched": untouched, "weights_equal": weights_equal, "ref_err": err}


def main() -> None:
    args = worker_args("--ckpt")
    jobs = [
        (f"stage{s}:{saved}->{mine}", (lambda s=s, a=saved, b=mine: pair_job(s, a, b, args.ckpt)))
        for s in map(int, args.stages.split(","))
        for saved, mine in PAIRS
    ]
    run_scenarios(args.out, jobs)


if __name__ == "__main__":
    main()
