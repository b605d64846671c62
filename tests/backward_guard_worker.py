"""Per-rank worker for tests/test_backward_guard.py: losses that differ between ranks (issue 11).

Launched by torchrun through tests/distributed.py (``--scenarios`` selects, ``--stages`` is unused).
Each scenario runs on its own engine over its own process group (a scenario that raises leaves
mis-paired collectives behind on that group only) and records either the values compared with
single-process plain PyTorch on the same global batch or the exception raised (type, message, seconds).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
import zerodp  # noqa: E402
from distributed import run_scenarios  # noqa: E402

TIMEOUT_S = 20.0  # the guard's timeout here (default 60 s)
SHORT_TIMEOUT_S = 3.0  # the slow-peer scenario's
STEPS = 3


def config(stage: int, **zero: Any) -> dict:
    return {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **zero},
        "collective_guard": {"timeout_s": TIMEOUT_S},
    }


class HeadNet(nn.Module):
    """A body of two blocks and a head of the same size; the forward returns both outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for b in self.blocks:
            x = torch.tanh(b(x))
        return x, self.head(x)


class AuxNet(nn.Module):
    """Three blocks; ``aux`` and ``aux2`` run on every rank, their outputs are kept in attributes (not
    returned): a loss that adds them on some ranks only makes the backward graphs differ."""

    def __init__(self, aux_out: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.aux = nn.Linear(8, aux_out)
        self.aux2 = nn.Linear(8, 8)
        self.kept: dict[str, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.blocks[0](x))
        x = torch.tanh(self.blocks[1](x))
        self.kept = {"aux": self.aux(x), "aux2": self.aux2(x)}
        return torch.tanh(self.blocks[2](x))


def batch(step: int, r: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(1000 * step + r))


def max_err(engine: zerodp.Engine, ref: nn.Module) -> float:
    got = engine.module_state_dict()
    worst = 0.0
    for k, v in ref.state_dict().items():
        a, b = got[k].double(), v.detach().double()
        worst = max(worst, ((a - b).abs() / (1e-6 + 1e-5 * b.abs())).max().item())
    return worst


def head_loss(out: tuple[torch.Tensor, torch.Tensor], use_head: bool) -> torch.Tensor:
    body, head = out
    return head.pow(2).mean() if use_head else (body - 0.5).pow(2).mean()


def dropped_output_scenario() -> dict:
    """Stage 3, rank 1 keeps only the body's output (``engine(x)[0]``): the head's output is gone
    before backward, so rank 1 cannot serve the head's backward gathers: raise on every rank."""
    rank = dist.get_rank()
    pg = dist.new_group(backend="gloo", timeout=timedelta(seconds=TIMEOUT_S))
    torch.manual_seed(0)
    engine = zerodp.initialize(HeadNet(), config(3), process_group=pg)
    if rank == 1:
        loss = (engine(batch(0, rank))[0] - 0.5).pow(2).mean()
    else:
        loss = engine(batch(0, rank))[1].pow(2).mean()
    engine.backward(loss)
    return {}


def slow_peer_scenario() -> dict:
    """Stage 2, guard timeout 3 s: rank 1 is stuck for 5 s inside its backward (a hook on its loss),
    before its gradient reduction; rank 0 waits for that reduction at most the timeout."""
    rank = dist.get_rank()
    pg = dist.new_group(backend="gloo", timeout=timedelta(seconds=TIMEOUT_S))
    torch.manual_seed(0)
    cfg = config(2)
    cfg["collective_guard"]["timeout_s"] = SHORT_TIMEOUT_S
    engine = zerodp.initialize(HeadNet(), cfg, process_group=pg)
    out = engine(batch(0, rank))
    loss = head_loss(out, True)
    if rank == 1:
        loss.register_hook(lambda g: time.sleep(SHORT_TIMEOUT_S + 2.0))
    engine.backward(loss)
    return {}


def head_scenario(stage: int, head_ranks: set[int]) -> Callable[[], dict]:
    """Ranks in ``head_ranks`` train on the head's output, the others on the body's: works, equals
    the reference (a head no rank uses keeps its values: AdamW skips a parameter without gradient)."""

    def run() -> dict:
        rank, world = dist.get_rank(), dist.get_world_size()
        pg = dist.new_group(backend="gloo", timeout=timedelta(seconds=TIMEOUT_S))
        torch.manual_seed(0)
        ref = HeadNet()
        initial_head = ref.head.weight.detach().clone()
        engine = zerodp.initialize(copy.deepcopy(ref), config(stage), process_group=pg)
        opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
        for step in range(STEPS):
            out = engine(batch(step, rank))  # held until backward (the engine keeps weak references)
            engine.backward(head_loss(out, rank in head_ranks))
            engine.step()
            opt.zero_grad(set_to_none=True)
            total = sum(head_loss(ref(batch(step, r)), r in head_ranks) for r in range(world)) / world
            total.backward()
            opt.step()
        state = engine.module_state_dict()
        return {
            "err": max_err(engine, ref),
            "phantom": engine.output_roots.phantom_backwards,
            "head_moved": not torch.equal(state["head.weight"], initial_head),
        }

    return run


def aux_scenario(stage: int, use: dict[int, str], aux_out: int = 8, **zero: Any) -> Callable[[], dict]:
    """Rank r adds ``model.kept[use[r]]`` (if any) to its loss: the backward graphs differ in a way
    the returned outputs cannot fix, so the engine must raise on every rank (never train wrong)."""

    def run() -> dict:
        rank = dist.get_rank()
        pg = dist.new_group(backend="gloo", timeout=timedelta(seconds=TIMEOUT_S))
        torch.manual_seed(0)
        model = AuxNet(aux_out)
        engine = zerodp.initialize(model, config(stage, **zero), process_group=pg)
        for step in range(STEPS):
            loss = engine(batch(step, rank)).pow(2).mean()
            if rank in use:
                loss = loss + model.kept[use[rank]].pow(2).mean()
            engine.backward(loss)
            engine.step()
        return {}

    return run


class Extra(nn.Module):
    """Stage 0-2 divergence inside the forward: ``extra`` runs on ``extra_rank`` only (the ranks' graphs
    reach different parameters); ``swap`` on rank 1 runs ``a`` and ``b`` in the other order (same
    parameters, another gradient order)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.extra = nn.Linear(8, 8)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.extra_rank = 0
        self.swap = False

    def forward(self, x: torch.Tensor, rank: int = -1) -> torch.Tensor:
        x = torch.tanh(self.first(x))
        if rank == self.extra_rank:
            x = x + self.extra(x)
        if self.swap and rank == 1:
            return self.b(x) * 0.5 + self.a(x)
        return self.a(x) + self.b(x) * 0.5


def extra_param_scenario(stage: int, swap: bool = False) -> Callable[[], dict]:
    def run() -> dict:
        rank, world = dist.get_rank(), dist.get_world_size()
        pg = dist.new_group(backend="gloo", timeout=timedelta(seconds=TIMEOUT_S))
        torch.manual_seed(0)
        ref = Extra()
        ref.swap, ref.extra_rank = swap, (-1 if swap else 0)
        engine = zerodp.initialize(copy.deepcopy(ref), config(stage, reduce_bucket_size=8), process_group=pg)
        opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
        for step in range(STEPS):
            engine.backward(engine(batch(step, rank), rank).pow(2).mean())
            engine.step()
            opt.zero_grad(set_to_none=True)
            (sum(ref(batch(step, r), r).pow(2).mean() for r in range(world)) / world).backward()
            opt.step()
        return {"err": max_err(engine, ref)}

    return run


def tags_scenario(fetches: dict[int, list[int]], groups: dict[int, list[tuple[int, int]]]) -> Callable[[], dict]:
    """The backward agreement alone on a guard of its own group: rank r notes the backward fetches
    ``fetches[r]`` (module positions; none launches), then one reduction of the buckets ``groups[r]``
    (one coalesced collective when there are several), then finishes the backward."""

    def run() -> dict:
        from zerodp.runtime.backward_agreement import BackwardAgreement
        from zerodp.runtime.collective_guard import CollectiveGuard

        rank = dist.get_rank()
        pg = dist.new_group(backend="gloo", timeout=timedelta(seconds=TIMEOUT_S))
        guard = CollectiveGuard(pg, timeout_s=TIMEOUT_S)
        names = {BackwardAgreement.reduce_identity(0, b): f"unit {b}" for b in range(4)}
        tags = BackwardAgreement(guard, {p: f"module {p}" for p in range(8)}, names)
        tags.begin(0, 0)
        try:
            for position in fetches[rank]:
                tags.note_gather(position)
            tags.note_reduce(groups[rank])
            tags.finish()
        finally:
            tags.end()
        return {"posted": tags.posted}

    return run


def outcome(fn: Callable[[], dict]) -> Callable[[], dict]:
    def run() -> dict:
        t0 = time.monotonic()
        try:
            return {"error": None, "value": fn(), "seconds": time.monotonic() - t0}
        except Exception as exc:  # recorded for the test to assert on
            return {
                "error": type(exc).__name__,
                "message": str(exc),
                "seconds": time.monotonic() - t0,
                "traceback": traceback.format_exc()[-3000:],
            }

    return run


def scenarios(world: int) -> dict[str, Callable[[], dict]]:
    """Every scenario of one world size."""
    if world == 3:
        return {
            "aux_swap": aux_scenario(3, {0: "aux", 1: "aux2", 2: "aux"}),
            "head_ranks_0_2/stage3": head_scenario(3, {0, 2}),
        }
    out = {
        "aux_swap": aux_scenario(3, {0: "aux", 1: "aux2"}),
        "aux_hang": aux_scenario(3, {0: "aux"}, aux_out=16),
        "swap_order/stage2": extra_param_scenario(2, swap=True),
        "dropped_output": dropped_output_scenario,
        # backward fetches in another order that launch nothing: only the end tag's digest differs
        "tags_fetch_order": tags_scenario({0: [1, 2], 1: [2, 1]}, {0: [(0, 0), (0, 1)], 1: [(0, 0), (0, 1)]}),
        "tags_same": tags_scenario({0: [1, 2], 1: [1, 2]}, {0: [(0, 0), (0, 1)], 1: [(0, 0), (0, 1)]}),
        # one coalesced reduction whose second bucket differs: the group's single tag differs
        "tags_group": tags_scenario({0: [1], 1: [1]}, {0: [(0, 0), (0, 1)], 1: [(0, 0), (0, 2)]}),
        "slow_peer": slow_peer_scenario,
    }
    for stage in (0, 1, 2, 3):
        if stage < 3:  # at stage 3 a module run on one rank only is a forward divergence (test_collective_guard)
            out[f"extra_param/stage{stage}"] = extra_param_scenario(stage)
        out[f"head_rank0/stage{stage}"] = head_scenario(stage, {0})
    out["head_nowhere/stage3"] = head_scenario(3, set())
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--stages", default="")
    ap.add_argument("--scenarios", default="all")
    args = ap.parse_args()
    zerodp.init_distributed(timeout_s=120)
    table = scenarios(dist.get_world_size())
    names = list(table) if args.scenarios == "all" else args.scenarios.split(",")
    jobs = [(n, outcome(table[n])) for n in names]
    # last, a healthy engine: its guard (the latest) agrees on the shutdown
    jobs.append(("healthy", lambda: {"engine": bool(zerodp.initialize(HeadNet(), config(0)))}))
    run_scenarios(args.out, jobs)


if __name__ == "__main__":
    main()
