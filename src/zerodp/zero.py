"""``zerodp.zero``: stage-3 utilities with DeepSpeed's names.

- :class:`GatheredParameters`: gather partitioned parameters outside forward (to read, initialise or
  edit them); with ``modifier_rank`` set, that rank's edits are broadcast and re-partitioned on exit.
- :func:`register_external_parameter`: declare that ``module``'s forward uses a parameter owned by
  another module, so it is gathered with ``module``. (Uses inside an engine forward are also detected
  automatically, see :class:`zerodp.hooks.ExternalParameterMode`.)
- :class:`Init`: partition parameters as each submodule is constructed.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Iterable, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from . import comm
from .comm import CommLedger
from .sharded import ShardedUnit, ShardState


@dataclass(frozen=True)
class _Owner:
    unit: ShardedUnit
    pg: Optional[dist.ProcessGroup]
    ledger: CommLedger
    coordinator: object  # ParameterCoordinator; typed loosely to avoid an import cycle


class _OwnerRegistry:
    """id(partitioned parameter) -> where its shard lives; an entry dies with its parameter.
    (Tensors cannot key a WeakKeyDictionary: their ``__eq__`` is elementwise.)"""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, _Owner]] = {}

    def set(self, param: nn.Parameter, owner: _Owner) -> None:
        key = id(param)
        self._entries[key] = (weakref.ref(param, lambda _r: self._entries.pop(key, None)), owner)

    def get(self, param: torch.Tensor) -> Optional[_Owner]:
        entry = self._entries.get(id(param))
        if entry is None or entry[0]() is not param:
            return None
        return entry[1]


#: filled by each stage-3 engine (see :class:`zerodp.stage3.Stage3`).
_OWNERS = _OwnerRegistry()


def _register_owner(param: nn.Parameter, owner: _Owner) -> None:
    _OWNERS.set(param, owner)


def is_partitioned(param: nn.Parameter) -> bool:
    """True if ``param`` is managed by a stage-3 engine (its ``.data`` may be an empty placeholder)."""
    return _OWNERS.get(param) is not None


class GatheredParameters:
    """Context manager: inside it, ``params`` hold their full values on every rank.

    Args:
        params: a parameter or an iterable of parameters (of any stage; non-partitioned ones are
            already full and are only broadcast on exit when ``modifier_rank`` is set).
        modifier_rank: data-parallel rank whose in-place edits are kept: on exit its values are
            broadcast to every rank and re-partitioned. None: edits are discarded (read-only use).
        enabled: False makes this a no-op.

    Raises:
        ValueError: ``modifier_rank`` is outside ``[0, world_size)``.
    """

    def __init__(self, params: Union[nn.Parameter, Iterable[nn.Parameter]], modifier_rank: Optional[int] = None,
                 enabled: bool = True) -> None:
        self.params = [params] if isinstance(params, torch.Tensor) else list(params)
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._units: list[tuple[ShardedUnit, _Owner]] = []

    def __enter__(self) -> "GatheredParameters":
        if not self.enabled:
            return self
        if self.modifier_rank is not None and dist.is_initialized():
            n = dist.get_world_size()
            if not 0 <= self.modifier_rank < n:
                raise ValueError(f"modifier_rank must be in [0, {n}), got {self.modifier_rank}")
        seen: set[int] = set()
        for p in self.params:
            owner = _OWNERS.get(p)
            if owner is None or id(owner.unit) in seen:
                continue
            seen.add(id(owner.unit))
            u = owner.unit
            owner.coordinator.busy = True
            try:
                if u.state is ShardState.SHARDED:
                    u.start_gather(owner.pg, owner.ledger, "gathered_parameters")
                if u.state is ShardState.GATHERING:
                    u.finish_gather()
            finally:
                owner.coordinator.busy = False
            u.users += 1
            self._units.append((u, owner))
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.enabled:
            return
        modify = self.modifier_rank is not None and exc[0] is None
        if modify and dist.is_initialized() and dist.get_world_size() > 1:
            partitioned = {id(s.param) for u, _ in self._units for s in u.slots}
            for u, owner in self._units:
                src = dist.get_global_rank(owner.pg, self.modifier_rank) if owner.pg else self.modifier_rank
                comm.broadcast(u.full, src, owner.pg, owner.ledger, "gathered_parameters")
            for p in self.params:
                if id(p) not in partitioned:
                    dist.broadcast(p.data, src=self.modifier_rank)
        for u, owner in self._units:
            if modify:
                u.write_back()
            u.users -= 1
            if u.users <= 0 and not u.persistent:
                owner.coordinator.busy = True
                try:
                    u.release()
                finally:
                    owner.coordinator.busy = False
        self._units = []


def register_external_parameter(module: nn.Module, param: nn.Parameter) -> None:
    """Gather ``param`` (owned by another module) whenever ``module`` runs forward or backward.

    Raises:
        ValueError: ``param`` is not managed by a stage-3 engine.
    """
    owner = _OWNERS.get(param)
    if owner is None:
        raise ValueError("register_external_parameter: the parameter is not partitioned by a stage-3 "
                         "engine (call it after zerodp.initialize with zero_optimization.stage 3)")
    owner.coordinator.index.register_external(module, param)
