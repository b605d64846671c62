"""Per-rank test worker, launched by torchrun (see tests/distributed.py).

Runs every requested scenario at every requested stage in one process group, so torch is imported once
per world size. Each scenario trains a model with zerodp and, in the same process, the same model with
plain PyTorch on the same global batch (the reference), and records how far apart they are. Results go
to ``OUT_DIR/rank{r}.json``; the pytest side asserts on them.

Tolerance metric ("err"): max over elements of |a - b| / (ATOL + RTOL |b|); <= 1 means equal within
1e-5 relative (fp32).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import traceback
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

import zerodp

RTOL, ATOL = 1e-5, 1e-6
SCENARIOS: dict[str, Callable[[int], dict]] = {}


def scenario(fn: Callable[[int], dict]) -> Callable[[int], dict]:
    SCENARIOS[fn.__name__] = fn
    return fn


def err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    if a.shape != b.shape:
        return float("inf")
    if a.numel() == 0:
        return 0.0
    return ((a - b).abs() / (ATOL + RTOL * b.abs())).max().item()


def rank() -> int:
    return dist.get_rank()


def world() -> int:
    return dist.get_world_size()


# ---- models ------------------------------------------------------------------------------------------
class Zoo(nn.Module):
    """Odd-sized layers, a scalar parameter (smaller than any world size > 1), an optional branch."""

    def __init__(self, d_in: int = 13, hidden: int = 7, d_out: int = 5) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, d_out)
        self.scale = nn.Parameter(torch.tensor([0.75]))
        self.branch = nn.Linear(hidden, hidden, bias=False)
        self.never_used = nn.Parameter(torch.randn(3))

    def forward(self, x: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        if use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.fc2(h) * self.scale


class TiedLM(nn.Module):
    """Embedding and output head share one weight."""

    def __init__(self, vocab: int = 11, d: int = 6) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mix = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mix(self.emb(idx))))


# ---- training loop shared by scenarios ---------------------------------------------------------------
def make_batch(step: int, global_rows: int, kind: str):
    g = torch.Generator().manual_seed(1000 + step)
    if kind == "tied":
        x = torch.randint(0, 11, (global_rows, 4), generator=g)
        y = torch.randint(0, 11, (global_rows, 4), generator=g)
    else:
        x = torch.randn(global_rows, 13, generator=g)
        y = torch.randn(global_rows, 5, generator=g)
    return x, y


def loss_fn(model_out: torch.Tensor, y: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "tied":
        return nn.functional.cross_entropy(model_out.reshape(-1, 11), y.reshape(-1))
    return ((model_out - y) ** 2).mean()


def compare_training(
    stage: int, *, kind: str = "zoo", opt: str = "Adam", opt_params: Optional[dict] = None,
    zero: Optional[dict] = None, steps: int = 5, micro: int = 3, accum: int = 1, clip: float = 0.0,
    groups: Optional[Callable[[nn.Module], list]] = None, torch_groups: Optional[Callable[[nn.Module], list]] = None,
    freeze: Optional[Callable[[nn.Module], None]] = None, branch_every: int = 1,
) -> dict:
    """Train with zerodp and with plain torch on the same global batches; return error metrics."""
    torch.manual_seed(1234)
    model = Zoo() if kind == "zoo" else TiedLM()
    if freeze is not None:
        freeze(model)
    ref = copy.deepcopy(model)
    initial = [p.detach().clone() for p in model.parameters()]
    opt_params = {"lr": 0.02, **(opt_params or {})}
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "optimizer": {"type": opt, "params": opt_params},
        "zero_optimization": {"stage": stage, **(zero or {})},
        "gradient_clipping": clip,
    }
    engine = zerodp.initialize(model, config, model_parameters=groups(model) if groups else None)
    torch_cls = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW}[opt]
    ref_params = torch_groups(ref) if torch_groups else [p for p in ref.parameters() if p.requires_grad]
    ref_opt = torch_cls(ref_params, **opt_params)

    r, n = rank(), world()
    loss_errs, norm_errs = [], []
    for step in range(steps):
        use_branch = step % branch_every == 0
        x, y = make_batch(step, micro * n * accum, kind)
        # reference: one step on the whole global batch
        ref_opt.zero_grad()
        ref_out = ref(x) if kind == "tied" else ref(x, use_branch)
        ref_loss = loss_fn(ref_out, y, kind)
        ref_loss.backward()
        if clip > 0:
            ref_norm = torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.grad is not None], clip)
        ref_opt.step()
        # engine: micro-batch j of rank r is rows [(j*n + r)*micro, ...)
        total = torch.zeros(1, dtype=torch.float64)
        for j in range(accum):
            lo = (j * n + r) * micro
            xs, ys = x[lo : lo + micro], y[lo : lo + micro]
            out = engine(xs) if kind == "tied" else engine(xs, use_branch)
            loss = loss_fn(out, ys, kind)
            engine.backward(loss)
            engine.step()
            total += loss.detach().double()
        dist.all_reduce(total)
        loss_errs.append(err((total / (n * accum)).reshape(()), ref_loss.detach()))
        if clip > 0:
            norm_errs.append(err(torch.tensor(engine.get_global_grad_norm()), ref_norm))
    param_err = max(err(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    moved = max((a.detach() - b).abs().max().item() for a, b in zip(model.parameters(), initial))
    out = {"loss_err": max(loss_errs), "param_err": param_err, "steps": engine.global_steps,
           "moved": moved}
    if norm_errs:
        out["norm_err"] = max(norm_errs)
    return out


# ---- scenarios -------------------------------------------------------------------------------------
@scenario
def adam_buckets(stage: int) -> dict:
    """Adam with L2 decay, tiny buckets: parameters straddle shard and bucket boundaries."""
    return compare_training(stage, opt="Adam", opt_params={"weight_decay": 0.01},
                            zero={"reduce_bucket_size": 40, "allgather_bucket_size": 30})


@scenario
def adamw_one_bucket(stage: int) -> dict:
    return compare_training(stage, opt="AdamW", opt_params={"weight_decay": 0.1, "betas": [0.8, 0.95]})


@scenario
def frozen(stage: int) -> dict:
    def freeze(m: nn.Module) -> None:
        m.fc1.weight.requires_grad_(False)
        m.fc1.bias.requires_grad_(False)

    return compare_training(stage, freeze=freeze, zero={"reduce_bucket_size": 50})


@scenario
def no_grad_some_steps(stage: int) -> dict:
    """``branch`` gets no gradient on odd steps; ``never_used`` never does (torch skips both)."""
    return compare_training(stage, opt="AdamW", opt_params={"weight_decay": 0.1}, branch_every=2,
                            zero={"reduce_bucket_size": 60}, steps=6)


@scenario
def param_groups(stage: int) -> dict:
    """Biases and the scalar without weight decay, a different lr for fc2."""

    def split(m: nn.Module) -> list:
        return [
            {"params": [m.fc1.weight, m.branch.weight], "weight_decay": 0.2},
            {"params": [m.fc2.weight], "weight_decay": 0.2, "lr": 0.005},
            {"params": [m.fc1.bias, m.fc2.bias, m.scale, m.never_used], "weight_decay": 0.0},
        ]

    return compare_training(stage, opt="AdamW", groups=split, torch_groups=split,
                            zero={"reduce_bucket_size": 30})


@scenario
def grad_accumulation(stage: int) -> dict:
    return compare_training(stage, accum=3, micro=2, zero={"reduce_bucket_size": 45}, steps=4)


@scenario
def clipping(stage: int) -> dict:
    return compare_training(stage, clip=0.05, zero={"reduce_bucket_size": 45})


@scenario
def no_overlap_noncontiguous(stage: int) -> dict:
    return compare_training(stage, zero={"overlap_comm": False, "contiguous_gradients": False,
                                         "reduce_bucket_size": 35})


@scenario
def tied_weights(stage: int) -> dict:
    return compare_training(stage, kind="tied", opt="AdamW", zero={"reduce_bucket_size": 50})


@scenario
def reports(stage: int) -> dict:
    """memory_report()/comm_report() against the tensors held and the paper's formulas."""
    torch.manual_seed(0)
    model = Zoo()
    engine = zerodp.initialize(model, {"zero_optimization": {"stage": stage, "reduce_bucket_size": 40},
                                       "optimizer": {"type": "Adam"}})
    n = world()
    steps = 3
    engine.reset_comm_report()
    for step in range(steps):
        x, y = make_batch(step, 2, "zoo")
        engine.backward(loss_fn(engine(x), y, "zoo"))
        engine.step()
    mem = engine.memory_report()
    com = engine.comm_report()
    psi = sum(p.numel() for p in model.parameters())
    padded = sum(g.padded_numel for g in engine.groups)
    owned = sum(b.shard_numel for g in engine.groups for b in g.buckets)
    n_pieces = sum(len(g.pieces) for g in engine.groups)
    return {
        "numel": mem.numel, "psi": psi, "padded": padded, "owned": owned, "n_pieces": n_pieces,
        "measured": mem.measured, "formula": mem.formula, "peak": mem.peak,
        "elements_per_step": com.elements_per_step, "expected_per_step": com.expected_elements_per_step,
        "ops": {f"{r.op}/{r.purpose}": [r.count, r.elements, r.bytes] for r in com.records},
        "steps": com.steps, "n_buckets": sum(len(g.buckets) for g in engine.groups), "world": n,
        "n_states": len(engine.optimizer.state),
        "optimizer_state_elements": sum(t.numel() for st in engine.optimizer.state.values()
                                        for k, t in st.items() if k != "step"),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--stages", default="0,1,2")
    ap.add_argument("--scenarios", default="all")
    args = ap.parse_args()
    zerodp.init_distributed(timeout_s=120)
    names = list(SCENARIOS) if args.scenarios == "all" else args.scenarios.split(",")
    results: dict[str, dict] = {}
    for stage in [int(s) for s in args.stages.split(",")]:
        for name in names:
            key = f"{name}/stage{stage}"
            try:
                results[key] = {"ok": True, **SCENARIOS[name](stage)}
            except Exception:  # recorded and asserted on by pytest
                results[key] = {"ok": False, "error": traceback.format_exc()}
            dist.barrier()
    with open(os.path.join(args.out, f"rank{rank()}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
