"""The optimizer step's control all-reduce: which parameters received a gradient on any rank, whether a
rank overflowed (fp16), and, where it can be taken first, the gradient norm's sum of squares, in one
all-reduce where there were two (docs/benchmarks/2026-12-02-host-overhead.md, "Presence flags and
norm in one all-reduce").

Before, ``engine.step`` all-reduced the presence flags (MAX), then staged the present gradients for the
optimizer, then all-reduced the L2 norm's sum of squares (SUM, one fp64 element). The norm needs the
staged gradients, which need the global flags, so the second collective waited for the first. But a
rank on which *every* parameter received a gradient knows the global flags already (all set), so it
can stage its gradients and take its sum of squares first. Where the step may do so on every rank
(:func:`fusable`, decided from the configuration, the same on every rank), the step sends one fp64
all-reduce (SUM) of

    [sum of squares (0 where not taken), 1 if this rank could not take it, flag per parameter slot]

and reads from it: present = flag sum > 0 (what MAX gave; the flags are 0 or 1), and, when no rank
reports that it could not take its part, the norm, ``sqrt`` of element 0. The sum of squares is element
0 so that gloo sums it exactly as it summed the one-element norm tensor (checked at 2-3 ranks: bitwise
the same on 1,200 random cases; at 2 ranks the sum of two values is the same in either order). When
some rank could not (a parameter without a gradient on it this step), the norm is taken as before, by
:func:`zerodp.runtime.grad_norm.clip_at_step`'s own all-reduce, on every rank (the decision comes from
the reduced element 1, the same on every rank). Not fused (the two collectives as before): fp16 (the
norm is taken after the loss unscaling, which needs the overflow flag), model parallelism (two norm
parts on two groups), stage 0 (no norm all-reduce), a world of one, an offload whose gradients are
not the staged tensors (only :class:`zerodp.offload.no_offload.NoOffload` sets ``fuses_step_norm``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed import ReduceOp

from zerodp.runtime import comm
from zerodp.runtime.grad_norm import step_grads
from zerodp.runtime.topology import local_sum_of_squares


def fusable(engine: Any) -> bool:
    """Whether this step may take the norm with the presence flags (the same on every rank: it depends
    on the configuration and on ``clip_grad_norm_``, a collective call, only)."""
    return (
        engine.loss_scaler is None
        and engine.stage >= 1
        and engine.world_size > 1
        and not engine.topology.model_parallel
        and getattr(engine.optimizer_offload, "fuses_step_norm", False)
        and engine.grad_clip.pending_factor(engine.global_steps) == 1.0
    )


def _stage(engine: Any, present: list[int] | None) -> None:
    """Hand the gradient of every piece whose slot is ``present`` (all: None) to the optimizer."""
    for g in engine.groups:
        for piece in g.pieces:
            if present is None or present[piece.slot.index]:
                engine.optimizer_offload.stage_grad(piece, engine.reducer.held_grad(g, piece.lo, piece.hi))


def presence_and_stage(engine: Any, local_overflow: bool) -> tuple[bool, float | None]:
    """At the step (an :class:`zerodp.engine.Engine`): agree on the presence flags and overflow and,
    unless a rank overflowed, stage the gradients present on any rank for the optimizer.

    Returns:
        (whether any rank overflowed, the global L2 norm of the staged gradients when it was taken with
        the flags, else None: :func:`zerodp.runtime.grad_norm.clip_at_step` takes it).
    """
    reducer = engine.reducer
    if not fusable(engine):
        flags, overflow = reducer.presence(local_overflow)
        if not overflow:
            _stage(engine, flags.tolist())  # one conversion, not one tensor index per piece
        return overflow, None
    local = reducer.presence_flags()
    control = torch.empty(2 + local.numel(), dtype=torch.float64)
    ready = bool(local.all())  # every slot present here: present on every rank
    if ready:
        _stage(engine, None)
        control[:1] = local_sum_of_squares(step_grads(engine))
    else:
        control[0] = 0.0
    control[1] = 0.0 if ready else 1.0
    control[2:] = local
    comm.all_reduce(control, reducer.pg, engine.ledger, "grad_presence", op=ReduceOp.SUM)
    if not ready:
        _stage(engine, (control[2:] > 0).tolist())
    return False, (float(control[:1].sqrt()) if control[1] == 0 else None)
