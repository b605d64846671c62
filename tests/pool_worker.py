"""Per-rank worker for tests/test_gather_pool.py (launched by torchrun, see tests/distributed.py).

Stage-3 gathers borrow slabs of a bounded pool (zerodp.stage3.pool). A view that autograd saved in
forward (``weight.t()`` in linear) must read its own unit's values in backward even when the memory
the unit had in forward now belongs to another buffer. The worker makes that happen on purpose: after
forward it borrows every idle slab of the pool (the ones the units had in forward) and fills them with
1e6, so the units are gathered into other memory for backward; a saved view that still pointed at the
forward-time memory would read 1e6 and the gradients would be far off. Each rank trains against plain
PyTorch on the same global batch and records, per gather, the unit and the address of its memory.
"""

from __future__ import annotations

import torch
from torch import nn

import zerodp
from dist_worker import rank, world
from distributed import run_selected, worker_args
from zerodp.stage3.units import ShardedUnit

D = 32
GARBAGE = 1e6


class Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D, D)
        self.b = nn.Linear(D, D)
        self.c = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def record_gathers(events: list[tuple[str, str, int]], phase: list[str]) -> None:
    original = ShardedUnit.finish_gather

    def finish_gather(self: ShardedUnit) -> None:
        original(self)
        events.append((phase[0], self.name, self.full.untyped_storage().data_ptr()))

    ShardedUnit.finish_gather = finish_gather  # type: ignore[method-assign]


def _engine_and_reference(cls: type, zero: dict) -> tuple:
    """(stage-3 engine, plain-torch reference model, its Adam) over two copies of ``cls()`` with the
    same weights; ``zero`` adds zero_optimization keys."""
    torch.manual_seed(0)
    ref = cls()
    model = cls()
    model.load_state_dict(ref.state_dict())
    engine = zerodp.initialize(
        model,
        {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero},
        },
    )
    return engine, ref, torch.optim.Adam(ref.parameters(), lr=0.01)


def _reference_step(ref: nn.Module, ref_opt: torch.optim.Optimizer, x: torch.Tensor, n: int) -> None:
    """One plain-torch step on the global batch ``x`` (``n`` ranks' micro-batches of 2, loss averaged)."""
    ref_opt.zero_grad()
    for rr in range(n):
        (ref(x[2 * rr : 2 * rr + 2]).pow(2).mean() / n).backward()
    ref_opt.step()


def saved_view_follows_its_unit(prefetch: bool) -> dict:
    events: list[tuple[str, str, int]] = []
    phase = ["build"]
    record_gathers(events, phase)
    engine, ref, ref_opt = _engine_and_reference(
        Two,
        {"stage3_max_live_parameters": 3 * (D * D + D), "stage3_prefetch_bucket_size": (D * D + D) if prefetch else 0},
    )
    pool = engine.sharding.pool
    r, n = rank(), world()
    out: dict = {"moved": 0, "held_forward_memory": 0}
    for it in range(4):  # the last iteration lets the pool work undisturbed
        steady = it == 3
        before = pool.allocations
        torch.manual_seed(100 + it)
        x = torch.randn(2 * n, D)
        _reference_step(ref, ref_opt, x, n)
        events.clear()
        phase[0] = "forward"
        loss = engine(x[2 * r : 2 * r + 2].requires_grad_()).pow(2).mean()
        forward_ptr = {name: ptr for ph, name, ptr in events if ph == "forward"}
        # another buffer takes the idle slabs (the units' forward memory) and overwrites it
        squatters = []
        while pool._free and not steady:
            t = pool.empty_tensor(pool._free[-1].nbytes() // 4, torch.float32, torch.device("cpu"))
            squatters.append(t.fill_(GARBAGE))
        squatted = {t.untyped_storage().data_ptr() for t in squatters}
        phase[0] = "backward"
        engine.backward(loss)
        for t in squatters:
            pool.take_back(t)
        pool.clear()
        phase[0] = "step"
        engine.step()
        if steady:
            out["steady_new_slabs"] = pool.allocations - before
            out["steady_uses"] = sum(ph in ("forward", "backward") for ph, _, _ in events) + 3  # + staging
            out["idle_after_backward"] = pool.free_bytes()
            continue
        for ph, name, ptr in events:
            if ph == "backward" and name in forward_ptr:
                out["moved"] += int(ptr != forward_ptr[name])
        out["held_forward_memory"] += sum(ptr in squatted for ptr in forward_ptr.values())
        out["gathers"] = out.get("gathers", 0) + sum(ph in ("forward", "backward") for ph, _, _ in events)
    sd = engine.module_state_dict()
    out["param_diff_steps"] = max((sd[k] - v).abs().max().item() for k, v in ref.state_dict().items()) / 0.01
    out["compared"] = len(sd)
    out.update(
        pool_allocations=pool.allocations,
        pool_peak_bytes=pool.peak_bytes,
        pool_limit_bytes=pool.limit_bytes,
        unit_bytes=max(u.numel for u in engine.sharding.units) * 4,
    )
    return out


class Deep(nn.Module):
    """Eight D x D linear layers: eight stage-3 units of equal size."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(D, D) for _ in range(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def coalesced_overlap() -> dict:
    """Default buckets (reduce_bucket_size 5e8, stage3_prefetch_bucket_size 5e7, both above the model):
    collectives per step after the recording step, how many reduce-scatters started before backward
    returned, and the parameters against plain torch after 4 steps."""
    from zerodp.runtime.reducer import GradientReducer

    engine, ref, ref_opt = _engine_and_reference(Deep, {})
    red, coord = engine.reducer, engine.sharding.coordinator
    at_return = []
    original_end = GradientReducer.end_micro_step

    def end_micro_step(self: GradientReducer) -> None:
        at_return.append(self.reduce_collectives)  # collectives launched while autograd ran
        original_end(self)

    GradientReducer.end_micro_step = end_micro_step  # type: ignore[method-assign]
    r, n = rank(), world()
    out: dict = {}
    try:
        for it in range(4):
            torch.manual_seed(100 + it)
            x = torch.randn(2 * n, D)
            _reference_step(ref, ref_opt, x, n)
            if it == 1:
                reduces, gathers, units = red.reduce_collectives, coord.gather_collectives, engine.ledger.records()
            before = red.reduce_collectives
            engine.backward(engine(x[2 * r : 2 * r + 2]).pow(2).mean())
            engine.step()
            out["launched_during_backward"] = at_return[-1] - before
    finally:
        GradientReducer.end_micro_step = original_end  # type: ignore[method-assign]
    gathered = {(rec.op, rec.purpose): rec.count for rec in engine.ledger.records()}
    gathered_before = {(rec.op, rec.purpose): rec.count for rec in units}
    steps = 3  # iterations 1-3, after the recording one
    out["reduce_collectives_per_step"] = (red.reduce_collectives - reduces) / steps
    out["gather_collectives_per_step"] = (coord.gather_collectives - gathers) / steps
    out["units_gathered_per_step"] = (
        gathered[("all_gather", "parameters")] - gathered_before.get(("all_gather", "parameters"), 0)
    ) / steps
    out["units"] = len([u for u in engine.sharding.units if not u.persistent])
    sd = engine.module_state_dict()
    out["max_abs_diff"] = max((sd[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    return out


SCENARIOS = {
    "prefetch": lambda: saved_view_follows_its_unit(True),
    "no_prefetch": lambda: saved_view_follows_its_unit(False),
    "coalesced_overlap": coalesced_overlap,
}


if __name__ == "__main__":
    run_selected(worker_args(), SCENARIOS)
