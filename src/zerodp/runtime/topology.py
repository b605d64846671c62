"""The data-parallel group ZeRO partitions over, and the model-parallel group it composes with.

ZeRO partitions model states over the data-parallel (DP) group only (paper Section 7, "ZeRO and
model parallelism": 16-way model parallel x 64-way data parallel in the seed's example); with tensor
parallelism each model-parallel (MP) rank holds different parameter shards under the same names, so
it is a separate ZeRO instance over its own DP group. :func:`resolve_topology` takes what the user
passes to :func:`zerodp.initialize`:

- ``process_group``: a ``torch.distributed`` group, or a 1-D ``DeviceMesh`` (its group) - the DP group;
- ``mpu``: DeepSpeed's / Megatron's model-parallel unit protocol: ``get_data_parallel_group()``,
  ``get_model_parallel_group()``, ``get_model_parallel_rank()``, ``get_model_parallel_world_size()``
  (``get_tensor_model_parallel_*`` spellings are accepted too).

Tensor-parallel parameters are recognised by Megatron's attribute ``tensor_model_parallel = True`` (or
DeepSpeed's older ``model_parallel = True``): their squared gradient norms are summed over the MP
group for gradient clipping; every other parameter is replicated across MP ranks and counted once.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from zerodp.runtime.device import synchronize

#: parameter attributes that mark a tensor-parallel (MP-partitioned) parameter (Megatron, DeepSpeed).
MODEL_PARALLEL_ATTRS = ("tensor_model_parallel", "model_parallel")


@dataclass(frozen=True)
class Topology:
    """Where this rank sits. ``dp_group`` None means the whole world; ``mp_group`` None: no model
    parallelism (``mp_world_size`` 1)."""

    dp_group: dist.ProcessGroup | None
    mp_group: dist.ProcessGroup | None = None
    mp_rank: int = 0
    mp_world_size: int = 1

    @property
    def model_parallel(self) -> bool:
        """More than one model-parallel rank."""
        return self.mp_world_size > 1


def is_model_parallel_parameter(p: torch.Tensor) -> bool:
    """Whether ``p`` is partitioned across the model-parallel group (see :data:`MODEL_PARALLEL_ATTRS`)."""
    return bool(getattr(p, "tensor_model_parallel", False)) or bool(getattr(p, "model_parallel", False))


def _call(mpu: Any, *names: str) -> Any:
    for n in names:
        fn = getattr(mpu, n, None)
        if callable(fn):
            return fn()
    raise TypeError(
        f"mpu must implement {names[0]}() (DeepSpeed's model-parallel unit protocol); "
        f"{type(mpu).__name__} has none of {list(names)}"
    )


def resolve_topology(process_group: Any = None, mpu: Any = None) -> Topology:
    """The :class:`Topology` for :func:`zerodp.initialize`'s ``process_group`` and ``mpu``.

    Raises:
        ValueError: both ``process_group`` and ``mpu`` given (the DP group comes from one of them),
            or the mpu's groups do not contain this rank.
        TypeError: ``mpu`` lacks a method of the protocol, or ``process_group`` is a DeviceMesh with
            more than one dimension (pass ``mesh["dp"]``).
    """
    if process_group is not None and mpu is not None:
        raise ValueError(
            "pass either process_group or mpu to zerodp.initialize, not both: with an mpu the "
            "data-parallel group is mpu.get_data_parallel_group()"
        )
    if mpu is None:
        return Topology(dp_group=_as_group(process_group))
    dp = _call(mpu, "get_data_parallel_group")
    mp = _call(mpu, "get_model_parallel_group", "get_tensor_model_parallel_group")
    mp_rank = int(_call(mpu, "get_model_parallel_rank", "get_tensor_model_parallel_rank"))
    mp_world = int(_call(mpu, "get_model_parallel_world_size", "get_tensor_model_parallel_world_size"))
    if mp is not None and (dist.get_rank(mp) != mp_rank or dist.get_world_size(mp) != mp_world):
        raise ValueError(
            f"mpu is inconsistent: get_model_parallel_rank()={mp_rank} and world size {mp_world}, "
            f"but this rank is {dist.get_rank(mp)} of {dist.get_world_size(mp)} in its group"
        )
    if dist.get_rank(dp) < 0:
        raise ValueError("mpu.get_data_parallel_group() does not contain this rank")
    return Topology(dp_group=dp, mp_group=mp, mp_rank=mp_rank, mp_world_size=mp_world)


def _as_group(process_group: Any) -> dist.ProcessGroup | None:
    get_group = getattr(process_group, "get_group", None)
    if process_group is None or isinstance(process_group, dist.ProcessGroup) or not callable(get_group):
        return process_group
    if getattr(process_group, "ndim", 1) != 1:
        raise TypeError(
            f"process_group is a {process_group.ndim}-D DeviceMesh; pass its data-parallel dimension, e.g. mesh['dp']"
        )
    return get_group()


#: elements per fp32 partial norm in :func:`_sum_of_squares` (see there)
NORM_CHUNK = 1 << 16


def _chunk_norms(g: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """L2 norms (1-D, ``acc``) of ``g``'s elements in chunks of :data:`NORM_CHUNK`, in order."""
    flat = g.detach().reshape(-1)
    whole = flat.numel() // NORM_CHUNK * NORM_CHUNK
    parts = [torch.linalg.vector_norm(flat[:whole].view(-1, NORM_CHUNK), 2.0, dim=1, dtype=acc)] if whole else []
    if whole < flat.numel() or not parts:
        parts.append(torch.linalg.vector_norm(flat[whole:], 2.0, dtype=acc).reshape(1))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


@dataclass(frozen=True)
class ChunkNorms:
    """One gradient's fp32 chunk norms (:func:`_chunk_norms`: 1-D fp32, one per :data:`NORM_CHUNK`
    elements, in order), taken before the norm pass by whoever held the gradient last (the NVMe
    offload, as it wrote it: :mod:`zerodp.offload.grad_swap`); :func:`_sum_of_squares` uses them in
    the gradient's place, so the sum is bitwise the one the gradient would give."""

    norms: torch.Tensor


#: what the norm functions below read per gradient: the gradient, or its :class:`ChunkNorms`
GradOrNorms = torch.Tensor | ChunkNorms


def chunk_norms_fp32(g: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """``_chunk_norms(g as fp32, fp32)`` without an fp32 copy of all of ``g``: a 1-D bf16/fp16 ``g`` is
    made fp32 in ``scratch`` (1-D fp32, a multiple of :data:`NORM_CHUNK` elements) one block at a
    time; an fp32 ``g`` is normed in place. Every chunk norm is one row of ``vector_norm(dim=1)`` over
    the same elements, so the blocks change no bit (tests/unit/test_grad_norm_early.py).

    Raises:
        ValueError: ``scratch`` is not a multiple of :data:`NORM_CHUNK` fp32 elements."""
    if g.dtype == torch.float32:
        return _chunk_norms(g, torch.float32)
    block = scratch.numel()
    if scratch.dtype != torch.float32 or block == 0 or block % NORM_CHUNK:
        raise ValueError(f"chunk_norms_fp32: scratch must hold a multiple of {NORM_CHUNK} fp32 elements")
    flat = g.detach().reshape(-1)
    if flat.numel() == 0:
        return _chunk_norms(flat.float(), torch.float32)
    parts = []
    for lo in range(0, flat.numel(), block):
        part = flat[lo : lo + block]
        out = scratch[: part.numel()]
        out.copy_(part)
        parts.append(_chunk_norms(out, torch.float32))
    return torch.cat(parts) if len(parts) != 1 else parts[0]


def _sum_of_squares(grads: Iterable[GradOrNorms]) -> torch.Tensor:
    """Sum of the squared elements of ``grads``: a 0-d fp64 tensor on the CPU. The L2 norm of each
    chunk of :data:`NORM_CHUNK` elements of each gradient is taken in fp32 (fp64 for fp64 gradients)
    and the squares of those norms are summed in fp64. One fp32 norm per whole tensor (as
    ``torch.nn.utils.clip_grad_norm_`` takes) loses precision as the tensor grows; chunks keep the
    relative error near fp32's rounding at a cost close to it and far below an fp64 sum's (errors and
    timings with their command: docs/benchmarks/2026-12-01-bench.md, "Gradient norm"). One
    device-to-host copy per device, not one per gradient.

    When ``grads`` is a list (every gradient already materialised), consecutive CPU gradients of one
    dtype with fewer than :data:`NORM_CHUNK` elements are normed by one ``torch._foreach_norm`` call,
    which on the CPU runs ``linalg_vector_norm`` on each (the same call as :func:`_chunk_norms`: the
    same bits) without a Python round trip per tensor (docs/benchmarks/2026-12-02-host-overhead.md)."""
    norms: dict[torch.device, list[torch.Tensor]] = {}
    run: list[torch.Tensor] = []  # consecutive small CPU gradients of one dtype, flattened, not yet normed
    batch = isinstance(grads, list)  # a generator may reuse one buffer for each gradient it yields

    def flush() -> None:
        if run:
            acc = torch.promote_types(run[0].dtype, torch.float32)
            norms.setdefault(run[0].device, []).append(torch.stack(torch._foreach_norm(run, 2.0, dtype=acc)))
            run.clear()

    with torch.no_grad():  # values only (for the run, instead of a detach per gradient)
        for g in grads:  # read once, in order: an offload may materialise them one at a time
            if isinstance(g, ChunkNorms):  # normed already, as _chunk_norms below would
                flush()
                norms.setdefault(g.norms.device, []).append(g.norms)
                continue
            small = batch and g.device.type == "cpu" and 0 < g.numel() < NORM_CHUNK
            if not small or (run and g.dtype != run[0].dtype):
                flush()
            if small:
                run.append(g if g.dim() == 1 else g.reshape(-1))  # the flat view _chunk_norms would take
                continue
            acc = torch.promote_types(g.dtype, torch.float32)  # fp32, or fp64 for fp64 gradients
            norms.setdefault(g.device, []).append(_chunk_norms(g, acc))
        flush()
    total = torch.zeros((), dtype=torch.float64)
    for per_device in norms.values():
        total += synchronize("grad_norm", torch.cat(per_device).double().pow(2).sum())  # one per device
    return total


def local_sum_of_squares(grads_by_kind: tuple[Iterable[GradOrNorms], Iterable[GradOrNorms]]) -> torch.Tensor:
    """This rank's part of the squared L2 norm without model parallelism: the sums of squares of both
    kinds of :func:`global_grad_norm`'s ``grads_by_kind``, added, as a 1-element fp64 CPU tensor."""
    parts = [_sum_of_squares(grads) for grads in grads_by_kind]
    return (parts[0] + parts[1]).reshape(1)


def global_grad_norm(
    grads_by_kind: tuple[Iterable[GradOrNorms], Iterable[GradOrNorms]],
    topology: Topology,
    reduce_dp: bool,
    all_reduce: Any,
) -> float:
    """L2 norm of the full gradient of the whole (model-parallel) model.

    Args:
        grads_by_kind: (gradients of MP-partitioned parameters, of replicated parameters) this rank
            owns (disjoint pieces across DP ranks when ``reduce_dp``, else full); each is read once, in
            order, before the next is taken (an offload may materialise them one at a time).
        reduce_dp: sum over the DP group (stages 1-3: each rank owns a disjoint part).
        all_reduce: ``f(tensor, group)`` summing in place (the engine's ledger-recording all-reduce).

    Returns:
        sqrt(sum over MP ranks of the partitioned parts + the replicated part counted once), in fp64.
    """
    if not topology.model_parallel:  # one element, as without tensor parallelism
        sq = local_sum_of_squares(grads_by_kind)
        if reduce_dp:
            all_reduce(sq, topology.dp_group)
        return float(sq.sqrt())
    sq = torch.stack([_sum_of_squares(grads) for grads in grads_by_kind])
    if reduce_dp:
        all_reduce(sq, topology.dp_group)
    mp_part = sq[:1].clone()
    all_reduce(mp_part, topology.mp_group)
    return float((mp_part[0] + sq[1]).sqrt())
