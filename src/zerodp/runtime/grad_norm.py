"""Global gradient norm and clipping over the engine's reduced gradients (``engine.clip_grad_norm_``,
``"gradient_clipping"``, ``engine.get_global_grad_norm()``).

Each rank holds the averaged gradient of the elements it owns (stage 0: all of them); the norm of the
full gradient is combined from every rank's part (:func:`zerodp.runtime.topology.global_grad_norm`
for the L2 norm). Two entry points:

- :func:`clip_grad_norm` (``engine.clip_grad_norm_(max_norm, norm_type=2.0)``, FSDP's spelling):
  between the accumulation boundary's ``engine.backward`` and ``engine.step``, the ``norm_type``-norm
  of the full averaged, unscaled gradient; scales the gradients by ``max_norm / (norm + 1e-6)`` when
  that is below 1, as ``torch.nn.utils.clip_grad_norm_`` does. Without optimizer offload the engine's
  gradients are scaled at once (``param.grad`` at stage 0 views them); with offload the boundary
  backward has already started copying them to the host, so the factor is kept in :class:`ClipState`
  and applied to the host copies by the step (every reader of the engine's gradients applies it:
  a second ``clip_grad_norm_``, ``zerodp.zero.safe_get_full_grad``).
- :func:`clip_at_step` (``engine.step``): the L2 norm of the gradients the optimizer is about to use
  (after loss unscaling and any ``clip_grad_norm_``), then clipping to ``"gradient_clipping"`` when it
  is > 0. The norm is computed at every step, with or without clipping (one pass over the owned
  gradients and one all-reduce of one fp64 element, or none of its own where it travels with the
  presence flags, see :mod:`zerodp.runtime.step_control`; its cost:
  :func:`zerodp.runtime.topology._sum_of_squares`), for ``engine.get_global_grad_norm()``: the
  L2 norm of the gradient the step received, before ``"gradient_clipping"`` (as DeepSpeed's), so
  after any clipping by the user (``clip_grad_norm_``, or torch's on ``param.grad`` at stage 0, which
  the engine cannot tell apart from a smaller gradient).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from zerodp.runtime import comm
from zerodp.runtime.device import synchronize
from zerodp.runtime.topology import Topology, global_grad_norm, is_model_parallel_parameter

#: added to the norm in the clip coefficient, as torch.nn.utils.clip_grad_norm_
CLIP_EPS = 1e-6


@dataclass
class ClipState:
    """What ``clip_grad_norm_`` left for the step of the accumulation window ``window`` (the engine's
    ``global_steps`` then; a state from an earlier window is stale and ignored)."""

    window: int = -1
    pending: float = 1.0  # factor not yet applied to the offloaded gradient copies (offload only)

    def current(self, global_steps: int) -> ClipState:
        """This window's state (a fresh one if this is stale)."""
        if self.window != global_steps:
            self.window, self.pending = global_steps, 1.0
        return self

    def reset(self) -> None:
        """The step consumed it."""
        self.window, self.pending = -1, 1.0

    def pending_factor(self, global_steps: int) -> float:
        """Factor still to apply to the engine's gradients in this window (1.0 without offload)."""
        return self.pending if self.window == global_steps else 1.0


def norm_of(
    grads_by_kind: tuple[Iterable[torch.Tensor], Iterable[torch.Tensor]],
    topology: Topology,
    reduce_dp: bool,
    all_reduce: Callable[..., Any],
    norm_type: float,
) -> float:
    """``norm_type``-norm of the full gradient of the (model-parallel) model, as
    :func:`zerodp.runtime.topology.global_grad_norm` (which gives the L2 norm, used for 2.0).

    Args:
        grads_by_kind: (gradients of MP-partitioned parameters, of replicated ones) this rank owns.
        reduce_dp: combine over the DP group (stages 1-3: each rank owns a disjoint part).
        all_reduce: ``f(tensor, group, op)`` in place (the engine's ledger-recording all-reduce).
        norm_type: a positive float or ``inf``.

    Returns:
        The norm as a float (fp64 arithmetic across tensors and ranks).
    """
    if norm_type == 2.0:
        return global_grad_norm(
            grads_by_kind, topology, reduce_dp, lambda t, group: all_reduce(t, group, dist.ReduceOp.SUM)
        )
    inf = math.isinf(norm_type)
    parts = []
    for grads in grads_by_kind:
        norms: dict[torch.device, list[torch.Tensor]] = {}
        for g in grads:  # read once, in order (an offload may materialise them one at a time)
            n = torch.linalg.vector_norm(g.detach(), norm_type, dtype=torch.promote_types(g.dtype, torch.float32))
            norms.setdefault(g.device, []).append(n.double())
        acc = torch.zeros((), dtype=torch.float64)
        for per_device in norms.values():  # one host sync per device, not one per gradient
            n = synchronize("grad_norm", torch.stack(per_device))
            acc = torch.maximum(acc, n.max()) if inf else acc + (n**norm_type).sum()
        parts.append(acc)
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    both = torch.stack(parts)
    if reduce_dp:
        all_reduce(both, topology.dp_group, op)
    if topology.model_parallel:  # the partitioned part differs per MP rank; the replicated one does not
        mp = both[:1].clone()
        all_reduce(mp, topology.mp_group, op)
        both[0] = mp[0]
    total = both.max() if inf else both.sum() ** (1.0 / norm_type)
    return float(total)


def _owned_grads(engine: Any, read: Callable[[Any, Any], torch.Tensor | None]) -> tuple[list, list]:
    """(MP-partitioned, replicated) gradients ``read(group, piece)`` of this rank's pieces."""
    by_kind: tuple[list, list] = ([], [])
    for g in engine.groups:
        for p in g.pieces:
            t = read(g, p)
            if t is not None:
                by_kind[0 if is_model_parallel_parameter(p.slot.param) else 1].append(t)
    return by_kind


def step_grads(engine: Any) -> tuple[Iterable[torch.Tensor], Iterable[torch.Tensor]]:
    """(MP-partitioned, replicated) gradients staged for the optimizer on this rank's pieces."""
    return tuple(engine.optimizer_offload.norm_grads(ps) for ps in _owned_grads(engine, lambda g, p: p))


def _all_reduce(engine: Any) -> Callable[..., Any]:
    return lambda t, group, op: comm.all_reduce(t, group, engine.ledger, "grad_norm", op=op)


def _reduce_dp(engine: Any) -> bool:
    return engine.stage >= 1 and engine.world_size > 1


def check_clip_arguments(max_norm: Any, norm_type: Any) -> tuple[float, float]:
    """``(max_norm, norm_type)`` as floats.

    Raises:
        ValueError: ``max_norm`` is not a number >= 0 (``inf``: only measure), or ``norm_type`` is not
            a number > 0 or ``inf``.
    """
    try:
        max_norm, norm_type = float(max_norm), float(norm_type)
    except (TypeError, ValueError):
        raise ValueError(
            f"clip_grad_norm_: max_norm and norm_type must be numbers, got {max_norm!r}, {norm_type!r}"
        ) from None
    if not max_norm >= 0:
        raise ValueError(f"clip_grad_norm_: max_norm must be >= 0 (inf to only measure), got {max_norm}")
    if not norm_type > 0:
        raise ValueError(f"clip_grad_norm_: norm_type must be > 0 or inf (2.0: L2), got {norm_type}")
    return max_norm, norm_type


def clip_grad_norm(engine: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """``engine.clip_grad_norm_``: see the module docstring. A collective at world size > 1 (every rank
    calls it, agreed first as ``clip_grad_norm_``); ``engine`` is a :class:`zerodp.engine.Engine`.

    Returns:
        The norm before this call's clipping, a 0-d fp32 tensor on the device of the engine's flat
        buffers (``torch.nn.utils.clip_grad_norm_``'s return; ``inf``/``nan`` if a gradient is).

    Raises:
        ValueError: see :func:`check_clip_arguments`.
        RuntimeError: not between the boundary micro-step's ``engine.backward`` and ``engine.step()``.
    """
    max_norm, norm_type = check_clip_arguments(max_norm, norm_type)
    with engine.collective_call("clip_grad_norm_"):  # every rank is in this call (collective_guard)
        return _clip_grad_norm(engine, max_norm, norm_type)


def _clip_grad_norm(engine: Any, max_norm: float, norm_type: float) -> torch.Tensor:
    if not engine.grads_ready:
        raise RuntimeError(
            "engine.clip_grad_norm_ needs the reduced gradients of a complete accumulation: call it after "
            "engine.backward on the last micro-step of an accumulation (engine.is_gradient_accumulation_boundary() "
            'is True then) and before engine.step(); or set "gradient_clipping" in the config to clip at '
            "every optimizer step"
        )
    state = engine.grad_clip.current(engine.global_steps)
    grads = _owned_grads(engine, lambda g, p: engine.reducer.piece_grad(g, p.lo, p.hi))
    unscale = state.pending / engine.loss_scale  # the engine's gradients are scaled (fp16) and not yet clipped
    norm = norm_of(grads, engine.topology, _reduce_dp(engine), _all_reduce(engine), norm_type) * unscale
    coef = max_norm / (norm + CLIP_EPS)
    if not coef >= 1.0:  # nan too, as torch (a nan or inf norm makes the gradients nan or zero)
        if engine.optimizer_offload.streams_grads:  # the step's gradients are the offload's copies
            state.pending *= coef
        else:
            for t in (t for kind in grads for t in kind):
                t.mul_(coef)
    device = engine.groups[0].buffer.device if engine.groups else torch.device("cpu")
    return torch.tensor(norm, dtype=torch.float32, device=device)


def clip_at_step(
    engine: Any, max_norm: float, scale_grads: Callable[[float], None], norm: float | None = None
) -> float:
    """In ``engine.step``, after the gradients were staged for the optimizer and unscaled: apply a
    ``clip_grad_norm_`` factor still pending (offload), take the L2 norm (unless ``norm`` is given:
    taken already with the presence flags, :mod:`zerodp.runtime.step_control`), and if ``max_norm > 0``
    scale the gradients (``scale_grads(factor)``) so that it is at most ``max_norm``.

    Returns:
        The value for ``engine.get_global_grad_norm()``: the L2 norm before the ``max_norm`` clipping.
    """
    state = engine.grad_clip.current(engine.global_steps)
    if norm is None:
        if state.pending != 1.0:
            scale_grads(state.pending)
        norm = norm_of(step_grads(engine), engine.topology, _reduce_dp(engine), _all_reduce(engine), 2.0)
    state.reset()
    if max_norm > 0:
        coef = max_norm / (norm + CLIP_EPS)
        if coef < 1.0:
            scale_grads(coef)
    return norm
