"""``zerodp.zero``: stage-3 utilities with DeepSpeed's names.

- :class:`GatheredParameters`: gather partitioned parameters outside forward (to read, initialise or
  edit them); with ``modifier_rank`` set, that rank's edits are broadcast and re-partitioned on exit.
- :func:`register_external_parameter`: declare that ``module``'s forward uses a parameter owned by
  another module, so it is gathered with ``module``. (Uses inside an engine forward are also detected
  automatically, see :class:`zerodp.hooks.ExternalParameterMode`.)
- :class:`Init`: partition parameters as each submodule is constructed.
"""

from __future__ import annotations

import contextlib
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

    def drop(self, param: torch.Tensor) -> None:
        self._entries.pop(id(param), None)

    def get(self, param: torch.Tensor) -> Optional[_Owner]:
        entry = self._entries.get(id(param))
        if entry is None or entry[0]() is not param:
            return None
        return entry[1]


#: filled by each stage-3 engine (see :class:`zerodp.stage3.Stage3`).
_OWNERS = _OwnerRegistry()
#: parameter -> callable refreshing the fp32 master copies of its pieces after an edit (mixed precision)
_MASTER_REFRESH = _OwnerRegistry()


def register_master_refresh(param: nn.Parameter, refresh) -> None:
    _MASTER_REFRESH.set(param, refresh)


def _register_owner(param: nn.Parameter, owner: _Owner) -> None:
    _OWNERS.set(param, owner)


def full_numel(param: nn.Parameter) -> int:
    """Elements of ``param``'s full value (``param.numel()`` is 0 while it is partitioned)."""
    owner = _OWNERS.get(param)
    if owner is None:
        return param.numel()
    return next(s.numel for s in owner.unit.slots if s.param is param)


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
            with _busy(owner):
                if u.state is ShardState.SHARDED:
                    u.start_gather(owner.pg, owner.ledger, "gathered_parameters")
                if u.state is ShardState.GATHERING:
                    u.finish_gather()
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
        if modify:
            for u, _ in self._units:
                u.write_back()
            for p in self.params:
                refresh = _MASTER_REFRESH.get(p)
                if refresh is not None:
                    refresh()
        for u, owner in self._units:
            u.users -= 1
            if u.users <= 0 and not u.persistent:
                with _busy(owner):
                    u.release()
        self._units = []


@contextlib.contextmanager
def _busy(owner: _Owner):
    """Tell the owning engine's coordinator that parameter data is being swapped on purpose."""
    c = owner.coordinator
    if c is None:
        yield
        return
    c.busy = True
    try:
        yield
    finally:
        c.busy = False


def register_external_parameter(module: nn.Module, param: nn.Parameter) -> None:
    """Gather ``param`` (owned by another module) whenever ``module`` runs forward or backward.

    Raises:
        ValueError: ``param`` is not managed by a stage-3 engine.
    """
    owner = _OWNERS.get(param)
    if owner is None:
        raise ValueError("register_external_parameter: the parameter is not partitioned by a stage-3 "
                         "engine (call it after zerodp.initialize with zero_optimization.stage 3)")
    if owner.coordinator is None:
        raise ValueError("register_external_parameter: call it after zerodp.initialize (the parameter "
                         "is partitioned by zerodp.zero.Init but no engine owns it yet)")
    owner.coordinator.index.register_external(module, param)


class Init:
    """Partition parameters while the model is being built, so it never exists in full on one rank.

    Under ``with zerodp.zero.Init(config=ds_config):``, each submodule's own parameters (those not
    smaller than ``stage3_param_persistence_threshold``) are broadcast from rank 0 and partitioned as
    soon as the submodule is assigned to its parent (its ``__init__`` has finished by then): every rank
    keeps only its shard and the parameter's ``.data`` becomes an empty placeholder, while its
    ``shape`` is kept by the shard's layout. Parameters of the root module itself, and small ones, are
    partitioned later by :func:`zerodp.initialize`. The only hook used is torch's own module
    registration hook, installed on ``__enter__`` and removed on ``__exit__`` (nothing is patched).

    Code that changes a submodule's weights after it was assigned (e.g. ``self.apply(init_fn)`` at the
    end of the root ``__init__``) must gather them first, one module at a time:
    ``with GatheredParameters(list(m.parameters(recurse=False)), modifier_rank=0): init_fn(m)``.

    Args:
        config: the engine config (dict, JSON path or parsed); must be stage 3 when ``enabled``.
        enabled: False makes this a no-op (same code for every stage).
        process_group: data-parallel group (default: the whole world, initialised from torchrun's
            environment if needed).

    Raises:
        ConfigError: invalid config, or a stage other than 3 with ``enabled=True``.
    """

    def __init__(self, config: object = None, enabled: bool = True,
                 process_group: Optional[dist.ProcessGroup] = None) -> None:
        from .config import ConfigError, load_config

        self.config = load_config(config)  # type: ignore[arg-type]
        self.enabled = enabled
        if enabled and self.config.zero_optimization.stage != 3:
            raise ConfigError("zerodp.zero.Init partitions parameters at construction, which needs "
                              f"zero_optimization.stage 3 (got stage {self.config.zero_optimization.stage}); "
                              "pass enabled=False for other stages")
        self.pg = process_group
        self.ledger = CommLedger()
        self.units: list[ShardedUnit] = []
        self._handle = None

    def __enter__(self) -> "Init":
        if not self.enabled:
            return self
        from torch.nn.modules.module import register_module_module_registration_hook

        comm.init_distributed()
        self._handle = register_module_module_registration_hook(self._on_register)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _on_register(self, parent: nn.Module, name: str, child: Optional[nn.Module]) -> None:
        if child is None:
            return
        from .sharded import shard_unit

        threshold = self.config.zero_optimization.stage3_param_persistence_threshold
        named = [(n, p) for n, p in child.named_parameters(recurse=False)
                 if p.numel() > threshold and _OWNERS.get(p) is None]
        if not named:
            return
        rank = dist.get_rank(self.pg)
        world = dist.get_world_size(self.pg)
        src = dist.get_global_rank(self.pg, 0) if self.pg is not None else 0

        def sync(full: torch.Tensor) -> None:
            if world > 1:
                comm.broadcast(full, src, self.pg, self.ledger, "init")

        dtype = (torch.bfloat16 if self.config.bf16.enabled
                 else torch.float16 if self.config.fp16.enabled else None)
        if dtype is not None:
            for _, p in named:
                if p.is_floating_point():
                    p.data = p.data.to(dtype)
        unit = shard_unit(name, named, 0, [-1] * len(named), rank, world, sync=sync)
        self.units.append(unit)
        for s in unit.slots:
            _OWNERS.set(s.param, _Owner(unit, self.pg, self.ledger, None))


def _pre_sharded_unit(params: list[nn.Parameter]) -> Optional[ShardedUnit]:
    """The unit built by :class:`Init` holding exactly ``params`` in this order, if there is one."""
    owners = [_OWNERS.get(p) for p in params]
    if not owners or any(o is None for o in owners):
        return None
    unit = owners[0].unit
    if any(o.unit is not unit for o in owners) or [s.param for s in unit.slots] != list(params):
        return None
    return unit


def _materialize(params: list[nn.Parameter]) -> None:
    """Give Init-partitioned ``params`` their full values again (each as its own tensor) and forget
    their Init units; used when the engine lays them out differently than Init did."""
    for p in params:
        owner = _OWNERS.get(p)
        if owner is None or owner.coordinator is not None:
            continue
        u = owner.unit
        if u.state is ShardState.SHARDED:
            u.start_gather(owner.pg, owner.ledger, "init")
        if u.state is ShardState.GATHERING:
            u.finish_gather()
        for s in u.slots:
            s.param.data = s.param.data.clone()
            _OWNERS.drop(s.param)
        u.full = None
        u.state = ShardState.SHARDED
