"""The optimizer step's control all-reduce: which parameters received a gradient on any rank, whether a
rank overflowed (fp16), and, where it can be taken first, the gradient norm's sum of squares, in one
all-reduce where there were two (docs/benchmarks/2026-12-02-host-overhead.md, "Presence flags and
norm in one all-reduce").

Before, ``engine.step`` all-reduced the presence flags (MAX), then staged the gradients present on any
rank for the optimizer, then all-reduced the L2 norm's sum of squares (SUM, one fp64 element). The norm
needs the staged gradients, which need the global flags, so the second collective waited for the first.
Now, where the step may take the norm early on every rank (:func:`fusable`, decided from the
configuration, the same on every rank), each rank stages the gradients of the slots flagged *here*,
takes their sum of squares, and sends one fp64 all-reduce (SUM) of

    [sum of squares, flag per parameter slot (0 or 1)]

Every slot's sum is then 0 or the world size exactly when all ranks had the same flags; each rank sees
the same sums, so every rank takes the same branch. Same flags (the usual case: every rank's loss
reaches the same parameters): the staged set is the set present on any rank (what MAX gave), and the
norm is ``sqrt`` of element 0. Otherwise: the slots present elsewhere only are staged too, and
:func:`zerodp.runtime.grad_norm.clip_at_step` takes the norm with its own all-reduce, as before. The
sum of squares is element 0 so that gloo sums it as it summed the one-element norm tensor (checked at 3
ranks: bitwise the same on 1,200 random cases, element 0 of tensors of 2-301 elements; at 2 ranks a
sum of two values is the same in either order); the flags are small integers, exact in fp64.

Not fused (the two collectives as before): fp16 (the norm is taken after the loss unscaling, which
needs the overflow flag), model parallelism (two norm parts on two groups), stage 0 (no norm
all-reduce), a world of one, an offload whose norm does not read the staged tensors (only
:class:`zerodp.offload.no_offload.NoOffload` sets ``fuses_step_norm``), a ``clip_grad_norm_`` factor
still pending.
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


def _stage(engine: Any, present: list[int]) -> None:
    """Hand the gradient of every piece whose slot is flagged in ``present`` to the optimizer."""
    for g in engine.groups:
        for piece in g.pieces:
            if present[piece.slot.index]:
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
    mine = local.tolist()
    _stage(engine, mine)  # what this rank has; complete when every rank has the same
    control = torch.empty(1 + local.numel(), dtype=torch.float64)
    control[:1] = local_sum_of_squares(step_grads(engine))
    control[1:] = local
    comm.all_reduce(control, reducer.pg, engine.ledger, "grad_presence", op=ReduceOp.SUM)
    counts = control[1:]
    if bool(((counts == 0) | (counts == engine.world_size)).all()):  # every rank had the same flags
        return False, float(control[:1].sqrt())
    _stage(engine, [int(c > 0 and not m) for c, m in zip(counts.tolist(), mine, strict=True)])
    return False, None  # the norm over what this rank lacked too: clip_at_step's own all-reduce
