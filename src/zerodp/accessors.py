"""Full gradients, fp32 parameters and optimizer states of one parameter, at every stage (DeepSpeed's
``deepspeed.utils.safe_get_full_grad`` family, re-exported by :mod:`zerodp.zero` with the same names).

Each function takes a parameter of a module passed to :func:`zerodp.initialize` and is a *collective*
at stages 1-3 and world size > 1 (every rank of the engine's process group must call it, in the same
order): a rank holds only the pieces of the parameter it owns, so the full value is summed from every
rank's pieces (each element is owned by exactly one rank; one all-reduce of ``numel + 1`` fp32
elements, recorded in the comm report as purpose ``accessors``). Values are fp32 tensors of the
parameter's full shape on the device of the engine's flat buffers (as DeepSpeed's; offloaded host
masters and states are copied there), fresh copies (changing them changes nothing); the setters write into the
engine's own state (fp32 masters, module-dtype values, optimizer state).

Gradients are available between the ``engine.backward`` of the last micro-step of an accumulation
(``engine.is_gradient_accumulation_boundary()``) and ``engine.step()``: the data-parallel mean, divided
by ``gradient_accumulation_steps`` as ``engine.backward`` does, unscaled (fp16), before the step's
``gradient_clipping`` and after any ``engine.clip_grad_norm_``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
from torch import nn

from zerodp.runtime import comm
from zerodp.runtime.comm import CommLedger
from zerodp.runtime.partition import FlatGroup, ParamSlot, Piece
from zerodp.runtime.zero_state import param_record, wrapped_by
from zerodp.stage3.sharded_param import is_sharded

#: optimizer-state keys that hold one value per parameter element (torch Adam/AdamW).
ELEMENTWISE_STATE = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


class AccessedEngine(Protocol):
    """What the accessors read from the engine (a Protocol: no import of the engine module)."""

    module: nn.Module
    world_size: int
    process_group: dist.ProcessGroup | None
    ledger: CommLedger
    groups: list[FlatGroup]
    optimizer: torch.optim.Optimizer
    global_steps: int

    @property  # read-only members: the engine's may be narrower (Literal stages, concrete classes)
    def stage(self) -> int: ...
    @property
    def grads_ready(self) -> bool: ...
    @property
    def reducer(self) -> object: ...
    @property
    def loss_scaler(self) -> object: ...

    optimizer_offload: Any  # zerodp.offload.build.OptimizerOffload (NoOffload without offload)
    grad_clip: Any  # zerodp.runtime.grad_norm.ClipState

    @property
    def loss_scale(self) -> float: ...

    def shards_resident(self, groups: list[FlatGroup] | None = None, write: bool = False) -> Any: ...


def _locate(param: nn.Parameter) -> tuple[AccessedEngine, FlatGroup | None, ParamSlot | None]:
    """``param``'s engine, flat group and slot, from the state of the module holding it
    (:mod:`zerodp.runtime.zero_state`, filled by :func:`zerodp.runtime.zero_state.attach_engine`)."""
    rec = param_record(param)
    engine = rec.live_engine() if rec is not None else None
    if rec is None or engine is None:
        dropped = wrapped_by(param)
        if dropped is not None:
            raise ValueError(
                f"this parameter (shape {tuple(param.shape)}) belonged to an engine that no longer "
                f"exists ({dropped}; dropped and garbage-collected): its optimizer "
                "states went with it; keep a reference to the engine while you use these accessors"
            )
        raise ValueError(
            f"this parameter (shape {tuple(param.shape)}) does not belong to a module passed to zerodp.initialize"
        )
    if rec.group is None or rec.slot is None:
        return cast(AccessedEngine, engine), None, None
    g, s = rec.group(), rec.slot()
    if g is None or s is None:  # the engine no longer holds the group it registered: never guess
        raise RuntimeError(
            f"this parameter (shape {tuple(param.shape)}) was registered with a flat group its engine no longer holds"
        )
    return cast(AccessedEngine, engine), g, s


@contextlib.contextmanager
def _resident(engine: AccessedEngine, g: FlatGroup, write: bool = False) -> Iterator[None]:
    """For one call: this rank's shard of ``g`` (``offload_param``) and the offloaded masters and
    optimizer states (``offload_optimizer`` nvme: the whole swap file is read into host memory and
    written back, 12 bytes per owned element; a no-op for cpu) as ordinary tensors."""
    with engine.optimizer_offload.resident(engine.optimizer), engine.shards_resident([g], write=write):
        yield


def _pieces(g: FlatGroup, s: ParamSlot) -> list[Piece]:
    return [pc for pc in g.pieces if pc.slot is s]


def _assemble(
    engine: AccessedEngine, s: ParamSlot, fill: Callable[[torch.Tensor], bool], device: torch.device
) -> torch.Tensor | None:
    """Sum every rank's contribution (``fill(full)`` writes this rank's elements, returns whether it
    had any) into a full fp32 tensor on ``device`` (the flat group's: NCCL reduces only device
    tensors); None if no rank had any. ``fill`` writes with ``copy_``, which takes host (offloaded)
    values too."""
    buf = torch.zeros(s.numel + 1, dtype=torch.float32, device=device)
    buf[-1] = float(fill(buf[:-1]))
    if engine.world_size > 1:
        if engine.stage == 0:  # every rank holds everything: agree on presence only
            flag = buf[-1:].clone()
            comm.all_reduce(flag, engine.process_group, engine.ledger, "accessors")
            buf[-1] = flag[0]
        else:
            comm.all_reduce(buf, engine.process_group, engine.ledger, "accessors")
    if buf[-1].item() == 0:
        return None
    return s.view(buf[:-1]).clone()


def _copy_pieces(
    s: ParamSlot, pieces: list[Piece], full: torch.Tensor, value: Callable[[Piece], torch.Tensor | None]
) -> bool:
    any_ = False
    for pc in pieces:
        v = value(pc)
        if v is not None:
            full[pc.lo - s.offset : pc.hi - s.offset].copy_(v.detach())  # any device; cast to fp32
            any_ = True
    return any_


def safe_get_full_grad(param: nn.Parameter) -> torch.Tensor | None:
    """Collective: the full averaged gradient of ``param`` (fp32, ``param``'s shape), or None if no rank
    produced one (unused or frozen parameter).

    Raises:
        ValueError: ``param`` is not part of an engine's module.
        RuntimeError: called outside the window between the boundary micro-step's ``engine.backward``
            and ``engine.step()`` (the gradient is then not reduced, or already consumed).
    """
    engine, g, s = _locate(param)
    if not engine.grads_ready:
        raise RuntimeError(
            "safe_get_full_grad: gradients are reduced only by engine.backward on the last "
            "micro-step of an accumulation and consumed by engine.step(); call it between the "
            "two (engine.is_gradient_accumulation_boundary() is True then)"
        )
    if g is None or s is None:
        return None
    reducer = engine.reducer
    present = bool(reducer._present[s.index])  # type: ignore[attr-defined]

    def fill(full: torch.Tensor) -> bool:
        _copy_pieces(s, _pieces(g, s), full, lambda pc: reducer.piece_grad(g, pc.lo, pc.hi))  # type: ignore[attr-defined]
        return present

    out = _assemble(engine, s, fill, g.buffer.device)
    if out is not None and engine.loss_scaler is not None:
        out.div_(engine.loss_scale)
    pending = engine.grad_clip.pending_factor(engine.global_steps)  # offload: clip_grad_norm_ not yet applied
    if out is not None and pending != 1.0:
        out.mul_(pending)
    return out


def _shard_range(g: FlatGroup, s: ParamSlot) -> tuple[int, int] | None:
    """Stage 3: [lo, hi) of slot ``s`` (flat coordinates) held in this rank's shard ``g.buffer``."""
    lo, hi = max(g.shard_offset, s.offset), min(g.shard_offset + g.buffer.numel(), s.offset + s.numel)
    return (lo, hi) if lo < hi else None


def safe_get_full_fp32_param(param: nn.Parameter) -> torch.Tensor:
    """Collective: the full fp32 value of ``param`` (its fp32 master under bf16/fp16).

    Raises:
        ValueError: ``param`` is not part of an engine's module.
    """
    engine, g, s = _locate(param)
    if g is None or s is None:  # replicated (frozen at stages 0-2): the module holds it in full
        return param.detach().float().clone()

    def fill(full: torch.Tensor) -> bool:
        if engine.stage == 3:
            r = _shard_range(g, s)
            if r is not None:
                full[r[0] - s.offset : r[1] - s.offset].copy_(g.buffer[r[0] - g.shard_offset : r[1] - g.shard_offset])
        elif engine.stage >= 1:  # the owned ranges only (pieces), so that the sum counts each element once
            _copy_pieces(s, _pieces(g, s), full, lambda pc: pc.tensor)
        else:
            full.copy_(s.flat_values(param.detach()).float())
        _copy_pieces(s, _pieces(g, s), full, lambda pc: pc.master)
        return True

    with _resident(engine, g):  # offload_param: this rank's shard, read back for the call; NVMe masters
        out = _assemble(engine, s, fill, g.buffer.device)
    assert out is not None
    return out


def _check_state_key(engine: AccessedEngine, key: str) -> None:
    if key not in ELEMENTWISE_STATE:
        raise ValueError(f"optimizer state key {key!r} is not per-element; allowed: {', '.join(ELEMENTWISE_STATE)}")


def safe_get_full_optimizer_state(param: nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    """Collective: the full optimizer state ``optim_state_key`` (``exp_avg``, ``exp_avg_sq``) of
    ``param`` (fp32, ``param``'s shape); None before the first optimizer step or for untrained parameters.

    Raises:
        ValueError: ``param`` is not part of an engine's module, or an unknown key.
    """
    engine, g, s = _locate(param)
    _check_state_key(engine, optim_state_key)
    if g is None or s is None:
        return None
    state = engine.optimizer.state

    def fill(full: torch.Tensor) -> bool:
        return _copy_pieces(s, _pieces(g, s), full, lambda pc: state.get(pc.opt_tensor, {}).get(optim_state_key))

    with _resident(engine, g):
        return _assemble(engine, s, fill, g.buffer.device)


def _check_value(s: ParamSlot, value: torch.Tensor, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(s.shape):
        raise ValueError(
            f"{what}: value must be a tensor of the parameter's full shape {tuple(s.shape)}, "
            f"got {getattr(value, 'shape', type(value).__name__)}"
        )
    return s.flat_values(value.detach().float())


def safe_set_full_fp32_param(param: nn.Parameter, value: torch.Tensor) -> None:
    """Set ``param``'s full value (``value``: its full shape, identical on every rank): the fp32
    masters, the module-dtype values and this rank's shard. Call it on every rank.

    Raises:
        ValueError: ``param`` is not part of an engine's module, or ``value`` has another shape.
    """
    engine, g, s = _locate(param)
    if g is None or s is None:
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(f"safe_set_full_fp32_param: value must have shape {tuple(param.shape)}")
        param.data.copy_(value.detach().to(param.dtype))
        return
    flat = _check_value(s, value, "safe_set_full_fp32_param")
    with _resident(engine, g, write=True):
        _set_fp32(engine, g, s, param, flat)


def _set_fp32(engine: AccessedEngine, g: FlatGroup, s: ParamSlot, param: nn.Parameter, flat: torch.Tensor) -> None:
    for pc in _pieces(g, s):
        part = flat[pc.lo - s.offset : pc.hi - s.offset]
        if pc.master is not None:
            pc.master.copy_(part)
        pc.tensor.copy_(part.to(pc.tensor.dtype))
    if engine.stage == 3:
        r = _shard_range(g, s)
        if r is not None:
            g.buffer[r[0] - g.shard_offset : r[1] - g.shard_offset].copy_(flat[r[0] - s.offset : r[1] - s.offset])
        if not is_sharded(param):  # gathered right now (persistent or inside a forward)
            param.data.copy_(s.view(flat).to(param.dtype))
    else:
        param.data.copy_(s.view(flat).to(param.dtype))


def safe_set_full_optimizer_state(param: nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    """Set ``param``'s optimizer state ``optim_state_key`` from its full value (identical on every
    rank); only this rank's owned elements are written. Call it on every rank.

    Raises:
        ValueError: not an engine's parameter, an unknown key, a wrong shape, or no state yet (before
            the first optimizer step, or an untrained parameter).
    """
    engine, g, s = _locate(param)
    _check_state_key(engine, optim_state_key)
    if g is None or s is None or engine.global_steps == 0:
        raise ValueError(
            "safe_set_full_optimizer_state: the parameter has no optimizer state yet (it is "
            "created by the first optimizer step; untrained parameters have none)"
        )
    flat = _check_value(s, value, "safe_set_full_optimizer_state")
    with _resident(engine, g):
        for pc in _pieces(g, s):
            st = engine.optimizer.state.get(pc.opt_tensor, {})
            if optim_state_key in st:
                st[optim_state_key].copy_(flat[pc.lo - s.offset : pc.hi - s.offset])
