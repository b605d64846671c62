"""Activation checkpointing with ZeRO-R's partitioned and CPU-offloaded checkpoints
(``deepspeed.checkpointing`` semantics; ZeRO paper Section 6.1, "Partitioned Activation Checkpointing").
Public as :mod:`zerodp.checkpointing` (DeepSpeed's spelling), which re-exports this module's names;
saving and loading training state is another thing, :mod:`zerodp.checkpoint`.

:func:`checkpoint` runs ``function(*args)`` without keeping its intermediate activations and recomputes
them in backward, keeping only the inputs (the *activation checkpoint*). How those inputs are kept is
set by :func:`configure` or by the config's ``activation_checkpointing`` section (applied by
:func:`zerodp.initialize`):

- ``partition_activations``: each floating input tensor is flattened and split across the
  model-parallel group (``mpu.get_model_parallel_group()``); a rank keeps ``ceil(numel / mp)`` elements
  and the full tensor is rebuilt with one all-gather just before the recomputation. Tensor-parallel
  ranks hold identical activations, so this divides checkpoint memory by the model-parallel degree.
  Without an ``mpu`` (or with one model-parallel rank) there is nothing to split.
- ``cpu_checkpointing``: the kept inputs (partitions, when partitioning) are copied to CPU memory and
  moved back to their device for the recomputation.
- ``synchronize_checkpoint_boundary``: ``torch.cuda.synchronize()`` before and after each checkpointed
  forward and recomputation (CUDA only; nothing is asynchronous on the CPU).
- ``profile``: wall time of every checkpointed forward and recomputation, in :func:`timings`.
- ``contiguous_memory_optimization`` / ``number_checkpoints``: refused when enabled (a CUDA
  fragmentation remedy that zerodp does not implement).

The function is reentrant like DeepSpeed's: the recomputation runs its own backward inside the outer
one, with the forward's CPU (and CUDA) RNG states restored so dropout masks repeat. A dummy input that
requires grad makes the segment's output require grad even when none of its inputs does, so
parameters used inside a segment fed only by data or frozen layers still get their gradients
(DeepSpeed PR 8130's case). ZeRO stage-3 hooks gather the segment's parameters again for the
recomputation.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from zerodp.config import load_config


@dataclass
class CheckpointingOptions:
    """How :func:`checkpoint` keeps its inputs. See the module docstring for each field."""

    partition_activations: bool = False
    cpu_checkpointing: bool = False
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False
    mp_group: dist.ProcessGroup | None = None  # None: no model parallelism
    timings: dict[str, list[float]] = field(default_factory=lambda: {"forward": [], "recompute": []})

    @property
    def mp_world_size(self) -> int:
        return dist.get_world_size(self.mp_group) if self.mp_group is not None else 1


_options: CheckpointingOptions | None = None


def configure(
    mpu_: Any = None,
    deepspeed_config: Any = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
) -> None:
    """Set how :func:`checkpoint` keeps activations (``deepspeed.checkpointing.configure``'s signature).

    Args:
        mpu_: a model-parallel unit (``get_model_parallel_group()``); needed to partition activations.
        deepspeed_config: a config dict / JSON path / :class:`~zerodp.config.ZeroDPConfig` whose
            ``activation_checkpointing`` section gives the defaults; the keyword arguments override it.
        partition_activations, checkpoint_in_cpu, synchronize, profile: the section's
            ``partition_activations``, ``cpu_checkpointing``, ``synchronize_checkpoint_boundary``, ``profile``.
        contiguous_checkpointing, num_checkpoints: ``contiguous_memory_optimization`` and
            ``number_checkpoints``.

    Raises:
        NotImplementedError: ``contiguous_checkpointing`` enabled.
        TypeError: ``mpu_`` lacks ``get_model_parallel_group()`` while partitioning is requested.
    """
    global _options
    section = load_config(deepspeed_config).activation_checkpointing if deepspeed_config is not None else None
    base = section.model_dump() if section is not None else {}

    def pick(value: Any | None, key: str, default: Any) -> Any:
        return value if value is not None else base.get(key, default)

    if pick(contiguous_checkpointing, "contiguous_memory_optimization", False):
        raise NotImplementedError(
            "activation_checkpointing.contiguous_memory_optimization is not implemented "
            "(a CUDA memory-fragmentation remedy); leave it false"
        )
    del num_checkpoints  # only meaningful with contiguous_memory_optimization
    partition = bool(pick(partition_activations, "partition_activations", False))
    mp_group = None
    if mpu_ is not None:
        get = getattr(mpu_, "get_model_parallel_group", None) or getattr(mpu_, "get_tensor_model_parallel_group", None)
        if get is None:
            raise TypeError(f"mpu_ must implement get_model_parallel_group(); {type(mpu_).__name__} does not")
        mp_group = get()
    _options = CheckpointingOptions(
        partition_activations=partition,
        cpu_checkpointing=bool(pick(checkpoint_in_cpu, "cpu_checkpointing", False)),
        synchronize_checkpoint_boundary=bool(pick(synchronize, "synchronize_checkpoint_boundary", False)),
        profile=bool(pick(profile, "profile", False)),
        mp_group=mp_group,
    )


def is_configured() -> bool:
    """Whether :func:`configure` (or :func:`zerodp.initialize` with the config section) has run."""
    return _options is not None


def reset() -> None:
    """Forget the configuration (back to plain recomputation, inputs kept as they are)."""
    global _options
    _options = None


def timings() -> dict[str, list[float]]:
    """With ``profile``: seconds of every checkpointed forward and recomputation so far."""
    return _options.timings if _options is not None else {"forward": [], "recompute": []}


@dataclass
class _Kept:
    """One input of a segment as kept between forward and backward."""

    data: torch.Tensor  # the tensor, its partition, or a CPU copy of either
    shape: torch.Size
    device: torch.device
    requires_grad: bool
    partitioned: bool


def _keep(t: torch.Tensor, opts: CheckpointingOptions) -> _Kept:
    data, partitioned = t.detach(), False
    if opts.partition_activations and opts.mp_world_size > 1 and t.is_floating_point() and t.numel() > 0:
        n, mp = t.numel(), opts.mp_world_size
        chunk = math.ceil(n / mp)
        flat = data.reshape(-1)
        padded = torch.zeros(chunk * mp, dtype=t.dtype, device=t.device)
        padded[:n] = flat
        r = dist.get_rank(opts.mp_group)
        data, partitioned = padded[r * chunk : (r + 1) * chunk].clone(), True
    if opts.cpu_checkpointing and data.device.type != "cpu":
        data = data.to("cpu", non_blocking=False)
    return _Kept(data, t.shape, t.device, t.requires_grad, partitioned)


def _restore(k: _Kept, opts: CheckpointingOptions) -> torch.Tensor:
    data = k.data.to(k.device)
    if k.partitioned:
        parts = [torch.empty_like(data) for _ in range(opts.mp_world_size)]
        dist.all_gather(parts, data, group=opts.mp_group)
        data = torch.cat(parts)[: k.shape.numel()].view(k.shape)
    out = data.detach()
    out.requires_grad_(k.requires_grad)
    return out


def _sync(opts: CheckpointingOptions) -> None:
    if opts.synchronize_checkpoint_boundary and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class _CheckpointFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, run_function: Callable[..., Any], opts: CheckpointingOptions, dummy: torch.Tensor, *args: Any
    ) -> Any:
        ctx.run_function, ctx.opts = run_function, opts
        ctx.cpu_rng = torch.get_rng_state()
        ctx.cuda_rng = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        _sync(opts)
        t0 = time.perf_counter()
        with torch.no_grad():
            outputs = run_function(*args)
        _sync(opts)
        if opts.profile:
            opts.timings["forward"].append(time.perf_counter() - t0)
        ctx.kept = [_keep(a, opts) if isinstance(a, torch.Tensor) else a for a in args]
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        opts: CheckpointingOptions = ctx.opts
        inputs = [_restore(k, opts) if isinstance(k, _Kept) else k for k in ctx.kept]
        ctx.kept = None  # the checkpoint is used once
        cpu_rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state() if ctx.cuda_rng is not None else None
        torch.set_rng_state(ctx.cpu_rng)
        if ctx.cuda_rng is not None:
            torch.cuda.set_rng_state(ctx.cuda_rng)
        _sync(opts)
        t0 = time.perf_counter()
        try:
            with torch.enable_grad():
                outputs = ctx.run_function(*inputs)
        finally:
            torch.set_rng_state(cpu_rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state(cuda_rng)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [
            (o, g)
            for o, g in zip(outputs, grads, strict=True)
            if isinstance(o, torch.Tensor) and o.requires_grad and g is not None
        ]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        _sync(opts)
        if opts.profile:
            opts.timings["recompute"].append(time.perf_counter() - t0)
        return (None, None, None) + tuple(
            i.grad if isinstance(i, torch.Tensor) and i.requires_grad else None for i in inputs
        )


def checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)`` whose activations are recomputed in backward instead of kept
    (``deepspeed.checkpointing.checkpoint``).

    Args:
        function: the segment, e.g. a transformer block; must be deterministic given the RNG state
            and must not change its inputs in place.
        args: its positional inputs; tensors are kept as configured (see :func:`configure`), other
            values as they are.

    Returns:
        What ``function`` returns (a tensor or a tuple of tensors and other values).
    """
    opts = _options if _options is not None else CheckpointingOptions()
    dummy = torch.empty(0, requires_grad=True)
    return _CheckpointFunction.apply(function, opts, dummy, *args)


__all__ = ["configure", "checkpoint", "is_configured", "reset", "timings", "CheckpointingOptions"]
