"""Guards against silently wrong training: what a user does between steps is either applied or refused.

The engine calls :meth:`TrainingGuards.before_forward`, :meth:`TrainingGuards.before_backward` and
:meth:`TrainingGuards.before_update` (at each gradient accumulation boundary, before the optimizer);
:func:`check_model_at_initialize` runs once in :func:`zerodp.initialize`. What each one covers:

- Unfreezing after ``initialize`` (``requires_grad_(True)`` on a parameter that was frozen, or a
  parameter added to the module afterwards): refused at the next training forward or ``backward``,
  before any gradient is produced. Such a parameter has no partition, no gradient reduction and no optimizer state.
- In-place edits of the module's parameters outside the optimizer (EMA, re-tying, re-initialising a
  head): with fp32 master weights (bf16/fp16, or any precision with ``offload_optimizer``), a
  module-dtype value that no longer equals its master's cast is copied into the master before the
  update, so the edit is kept (stages 0-3; offloaded masters through the offload's ``fold_edits``). At
  stage 3 the persistent (always gathered) parameters' edits are written back into this rank's shard.
  An in-place edit (also through ``p.data``), re-binding or any compute on a *partitioned* parameter
  while its unit is released is refused when attempted, by its type
  (:class:`~zerodp.stage3.sharded_param.ShardedParameter`); such edits must be made inside
  ``zerodp.zero.GatheredParameters(params, modifier_rank=0)``. A version-counter check at the next
  forward/backward/step remains as a second line.
- Re-binding ``p.data = new_tensor`` (same shape and dtype) between steps: adopted (copied into the
  flat buffer, or the stage-3 persistent buffer, and ``p`` pointed back at it).
- ``engine.optimizer.add_param_group`` after ``initialize``: refused (the new parameters would have no
  partition and no gradient reduction).
- Sparse gradients (``nn.Embedding(..., sparse=True)``): refused at ``initialize``, naming the
  parameter; a sparse gradient produced anyway is refused in the gradient hook.
- ``torch.compile`` at stage 3 (a compiled module or submodule, or ``module.compile()``): refused,
  naming the module; stages 0-2 compose with ``torch.compile``.
- ``channels_last`` (or any dense non-row-major) parameter layout: kept (see [Note: layout] in
  :mod:`zerodp.runtime.partition`); a parameter that is not dense (a strided view) becomes contiguous
  and a ``UserWarning`` names it (values are exact).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import nn

from zerodp.runtime.device import synchronize
from zerodp.runtime.partition import FlatGroup, memory_stride
from zerodp.runtime.refusal import RefusedError

#: attribute set on a parameter by :func:`acknowledge_edit`: the version counter of its last legitimate
#: in-place edit (made inside ``GatheredParameters``).
ACK_ATTR = "_zerodp_acknowledged_version"


def acknowledge_edit(param: torch.Tensor) -> None:
    """Mark ``param``'s current in-place edits as made while gathered (not a lost edit)."""
    setattr(param, ACK_ATTR, param._version)


class GuardedUnit(Protocol):
    """A stage-3 unit as the guards see it (implemented by :class:`zerodp.stage3.units.ShardedUnit`; a
    Protocol, so this runtime module does not import :mod:`zerodp.stage3`, which ranks above it)."""

    group: FlatGroup  # its ``slots`` are the unit's parameters
    persistent: bool  # always gathered (small parameters), else gathered around each use
    rank: int
    full: torch.Tensor | None  # 1-D, the gathered (padded) parameters; None or 0 bytes while sharded

    @property
    def shard(self) -> torch.Tensor: ...

    @property
    def sharded(self) -> bool:
        """True while only this rank's shard is here (not gathered, nor being gathered)."""

    def write_back(self) -> None:
        """Copy this rank's slice of ``full`` into the shard."""


class GuardedUnits(Protocol):
    """The engine's stage-3 units (implemented by :class:`zerodp.stage3.sharding.Stage3`)."""

    @property
    def units(self) -> Sequence[GuardedUnit]: ...


class GuardedEngine(Protocol):
    """What the guards read from the engine (a Protocol, so this module does not import it)."""

    module: nn.Module
    groups: list[FlatGroup]
    optimizer: torch.optim.Optimizer
    optimizer_offload: Any  # zerodp.offload.build.OptimizerOffload (a higher rank): fold_edits()

    @property  # read-only members: the engine's are narrower (a Literal stage, Stage3)
    def stage(self) -> int: ...
    @property
    def sharding(self) -> GuardedUnits | None: ...  # stage 3 only


def _names(module: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in module.named_parameters(remove_duplicate=True)}


def _has_unknown_trainable(module: nn.Module, known: set[int]) -> bool:
    """Whether ``module.named_parameters()`` holds a parameter that requires grad and whose id is not in
    ``known``, read from each module's ``_parameters`` without building the names (this runs at every
    training forward and backward). Where a module overrides how torch lists them (``named_parameters``
    or ``_named_members`` on ``module``, ``named_modules`` on any), ``named_parameters()`` itself is read."""
    base = nn.Module
    root = type(module)
    if root.named_parameters is not base.named_parameters or root._named_members is not base._named_members:
        return any(id(p) not in known and p.requires_grad for _, p in module.named_parameters())
    stack, seen = [module], set()
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        if type(m).named_modules is not base.named_modules:
            return any(id(p) not in known and p.requires_grad for _, p in module.named_parameters())
        seen.add(id(m))
        for p in m._parameters.values():
            if p is not None and id(p) not in known and p.requires_grad:
                return True
        stack.extend(c for c in m._modules.values() if c is not None)
    return False


def check_model_at_initialize(model: nn.Module, stage: int) -> None:
    """Refuse, before anything is changed, what the engine cannot train correctly.

    Raises:
        RefusedError: a trainable parameter would get sparse gradients (``sparse=True`` embedding),
            or (stage 3) a submodule is compiled with ``torch.compile``.
    """
    for mname, m in model.named_modules():
        if getattr(m, "sparse", False) is True and isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
            if m.weight.requires_grad:
                raise RefusedError(
                    f"'{mname or type(m).__name__}.weight' produces sparse gradients ({type(m).__name__}"
                    "(..., sparse=True)); zerodp reduces and partitions dense gradients only. Build the "
                    "embedding with sparse=False (the default) before zerodp.initialize"
                )
        if stage == 3 and _is_compiled(m):
            raise RefusedError(
                f"module '{mname or type(m).__name__}' is compiled with torch.compile; ZeRO stage 3 swaps "
                "parameter storage around each module's forward, which compiled graphs do not see. "
                "Pass the uncompiled module to zerodp.initialize at stage 3, or use stage 0-2 (which "
                "compose with torch.compile)"
            )
    names = _names(model)
    for p in model.parameters():
        if p.dim() > 1 and not p.is_contiguous() and memory_stride(p) is None:
            warnings.warn(
                f"parameter '{names.get(id(p), '?')}' is not dense (overlapping or with gaps, e.g. a "
                "strided view); zerodp lays each parameter out densely in a flat buffer, so after "
                "initialize it is contiguous: values are unchanged",
                UserWarning,
                stacklevel=3,
            )


def _is_compiled(m: nn.Module) -> bool:
    compiled_cls = getattr(getattr(torch, "_dynamo", None), "eval_frame", None)
    optimized = getattr(compiled_cls, "OptimizedModule", None)
    if optimized is not None and isinstance(m, optimized):
        return True
    return getattr(m, "_compiled_call_impl", None) is not None


def refuse_add_param_group(optimizer: torch.optim.Optimizer) -> None:
    """Make ``optimizer.add_param_group`` raise (see the module docstring)."""

    def add_param_group(param_group: dict) -> None:
        raise RefusedError(
            "engine.optimizer.add_param_group() after zerodp.initialize is not supported: the new "
            "parameters would get no partition and no gradient reduction (each rank would update them "
            "with its own gradient). Pass every param group to zerodp.initialize(model_parameters=[...]) "
            "instead (a group may start with lr=0 and be enabled later via its 'lr')"
        )

    optimizer.add_param_group = add_param_group  # type: ignore[method-assign]


class TrainingGuards:
    """Per-engine state of the checks above (what was trainable at initialize, version baselines)."""

    def __init__(self, engine: GuardedEngine) -> None:
        self.engine = engine
        trained = {id(s.param) for g in engine.groups for s in g.slots if s.group_index >= 0 and s.param.requires_grad}
        self.known = {id(p) for p in engine.module.parameters()}
        self.untrained = [p for p in engine.module.parameters() if id(p) not in trained]
        self.was_frozen = {id(p) for p in self.untrained if not p.requires_grad}
        units = engine.sharding.units if engine.stage == 3 and engine.sharding is not None else []
        self._partitioned: list[tuple[str, nn.Parameter, GuardedUnit]] = [
            (s.name, s.param, u) for u in units if not u.persistent for s in u.group.slots
        ]
        #: id(group) -> the persistent (always gathered) stage-3 unit whose group it is
        self._persistent: dict[int, GuardedUnit] = {id(u.group): u for u in units if u.persistent}
        self.record_versions()

    # ---- stage-3 edits of partitioned parameters ----------------------------------------------------
    def record_versions(self) -> None:
        """Take the current version counters of the partitioned parameters as the baseline."""
        self._versions = [p._version for _, p, _ in self._partitioned]

    def _check_partitioned_edits(self) -> None:
        for (name, p, unit), v in zip(self._partitioned, self._versions, strict=True):
            if p._version != v and unit.sharded and getattr(p, ACK_ATTR, None) != p._version:
                raise RefusedError(
                    f"parameter '{name}' was modified in place while partitioned (ZeRO stage 3: outside a "
                    "forward this rank holds only a shard, so the edit would be lost). Make the edit "
                    f"inside `with zerodp.zero.GatheredParameters([param], modifier_rank=0):`"
                )
        self.record_versions()

    # ---- unfreezing ---------------------------------------------------------------------------------
    def _check_unfrozen(self) -> None:
        names = None
        for p in self.untrained:
            if p.requires_grad and id(p) in self.was_frozen:
                names = names or _names(self.engine.module)
                raise RefusedError(
                    f"parameter '{names.get(id(p), '?')}' was frozen at zerodp.initialize and has been "
                    "unfrozen (requires_grad_(True)) since; zerodp gives it no partition, gradient "
                    "reduction or optimizer state, so it would silently not train. Keep it frozen, or "
                    "leave it trainable at initialize and freeze it until needed (freezing mid-run is "
                    "supported), or build a new engine with zerodp.initialize"
                )
        if not _has_unknown_trainable(self.engine.module, self.known):
            return
        for n, p in self.engine.module.named_parameters():  # the first one, by name
            if id(p) not in self.known and p.requires_grad:
                raise RefusedError(
                    f"parameter '{n}' was added to the module after zerodp.initialize; it has no "
                    "partition, gradient reduction or optimizer state. Add it before initialize"
                )

    # ---- hooks called by the engine -----------------------------------------------------------------
    def before_forward(self) -> None:
        if torch.is_grad_enabled() and self.engine.module.training:
            self._check_unfrozen()
        self._adopt_rebound()
        if self._partitioned:
            self._check_partitioned_edits()

    def _adopt_rebound(self) -> None:
        """``p.data = new_tensor`` detaches ``p`` from the flat buffer (stages 0-2) or from a stage-3
        persistent unit's gathered buffer, so updates would no longer reach it: copy the new value
        into the buffer and point ``p`` back at it (a later master compare adopts the value)."""
        for g in self.engine.groups:
            if self.engine.stage == 3:
                unit = self._persistent.get(id(g))
                if unit is None or unit.full is None:
                    continue
                base, shift = unit.full, 0
            else:
                base, shift = g.buffer, g.shard_offset
            # where each slot's view starts, as an integer (no tensor view per slot: this runs every forward)
            ptr0 = base.data_ptr()
            step = base.stride(0) * base.element_size() if base.dim() == 1 else 0
            for s in g.slots:
                if step and s.numel and s.param.data_ptr() == ptr0 + (s.offset - shift) * step:
                    continue  # still its view
                view = base[s.offset - shift : s.offset - shift + s.numel]
                if s.param.data_ptr() == view.data_ptr():
                    continue
                if tuple(s.param.shape) != tuple(s.shape) or s.param.dtype != base.dtype:
                    raise RefusedError(
                        f"parameter '{s.name}' was re-bound (p.data = ...) to a {s.param.dtype} tensor of shape "
                        f"{tuple(s.param.shape)}; zerodp keeps {base.dtype} {tuple(s.shape)}. Assign a tensor of "
                        "the same shape and dtype, or copy into it in place"
                    )
                view.copy_(s.flat_values(s.param.detach()))
                s.param.data = s.view(view)

    def before_backward(self) -> None:
        self._check_unfrozen()
        if self._partitioned:
            self._check_partitioned_edits()

    def before_update(self) -> None:
        """At a gradient accumulation boundary, before the optimizer: adopt in-place edits."""
        if self._partitioned:
            self._check_partitioned_edits()
        for g in self.engine.groups:
            unit = self._persistent.get(id(g))
            if unit is not None and unit.full is not None:
                lo = unit.rank * unit.shard.numel()
                same = torch.eq(unit.full[lo : lo + unit.shard.numel()], unit.shard).all()
                if not bool(synchronize("persistent_unit_edits", same)):
                    unit.write_back()  # an edit of an always-gathered stage-3 parameter
        # edited elements reach the fp32 masters (on the device, the host or in the swap file)
        self.engine.optimizer_offload.fold_edits()

    def after_update(self) -> None:
        if self._partitioned:
            self.record_versions()
