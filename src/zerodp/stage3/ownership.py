"""Which stage-3 unit owns each partitioned parameter (a registry keyed by parameter identity).

Filled by :class:`zerodp.zero.Init` (units without a coordinator yet) and by each stage-3 engine
(:class:`zerodp.stage3.sharding.Stage3`); read by :mod:`zerodp.zero`'s user-facing utilities and by the
engine when it adopts units built by ``Init``. Also holds, per parameter, the callable that refreshes
the fp32 master copies of its optimizer pieces after an edit under ``GatheredParameters``.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from zerodp.runtime.comm import CommLedger
from zerodp.stage3.coordinator import ParameterCoordinator
from zerodp.stage3.units import ShardedUnit, ShardState


@dataclass(frozen=True)
class Owner:
    unit: ShardedUnit
    pg: dist.ProcessGroup | None
    ledger: CommLedger
    coordinator: ParameterCoordinator | None  # None while only zero.Init has partitioned it


V = TypeVar("V")


class OwnerRegistry(Generic[V]):
    """id(partitioned parameter) -> a value about it (its :class:`Owner`, or a callable); an entry dies
    with its parameter. (Tensors cannot key a WeakKeyDictionary: their ``__eq__`` is elementwise.)

    The registry holds weak references only; each value is kept alive by a *holder* given to
    :meth:`set` (the module, or the engine the value belongs to). A value reaches its parameter (an
    Owner's unit holds the parameter's slot), so a strong reference from this process-wide registry
    would keep every parameter, shard and engine alive for the life of the process."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, weakref.ref, weakref.ref]] = {}

    def set(self, param: nn.Parameter, value: V, holder: object) -> None:
        """Register ``value`` for ``param``; ``holder`` (an object with a ``__dict__``) keeps it alive."""
        key = id(param)
        holder.__dict__.setdefault(_HELD, {})[(id(self), key)] = value
        self._entries[key] = (weakref.ref(param, lambda _r: self._entries.pop(key, None)), weakref.ref(value),
                              weakref.ref(holder))

    def drop(self, param: torch.Tensor) -> None:
        entry = self._entries.pop(id(param), None)
        holder = entry[2]() if entry is not None else None
        if holder is not None:
            holder.__dict__.get(_HELD, {}).pop((id(self), id(param)), None)

    def get(self, param: torch.Tensor) -> V | None:
        entry = self._entries.get(id(param))
        if entry is None or entry[0]() is not param:
            return None
        return entry[1]()  # None once its holder is gone


#: attribute of a holder (see :class:`OwnerRegistry`) keeping the registered values alive
_HELD = "_zerodp_registered"


#: filled by each stage-3 engine (see :class:`zerodp.stage3.sharding.Stage3`).
OWNERS: OwnerRegistry[Owner] = OwnerRegistry()
#: parameter -> callable refreshing the fp32 master copies of its pieces after an edit (mixed precision)
MASTER_REFRESH: OwnerRegistry[Callable[[], object]] = OwnerRegistry()


#: (module, parameter) pairs declared by register_external_parameter before a stage-3 engine owned them
_PENDING_EXTERNAL: list[tuple[weakref.ref, weakref.ref]] = []


def add_pending_external(module: nn.Module, param: nn.Parameter) -> None:
    """Remember an external-parameter declaration until an engine adopts ``module``."""
    _PENDING_EXTERNAL[:] = [(m, p) for m, p in _PENDING_EXTERNAL if m() is not None and p() is not None]
    _PENDING_EXTERNAL.append((weakref.ref(module), weakref.ref(param)))


def take_pending_external(root: nn.Module) -> list[tuple[nn.Module, nn.Parameter]]:
    """The pending declarations whose module is inside ``root`` (removed from the pending list)."""
    inside = {id(m) for m in root.modules()}
    taken, kept = [], []
    for mref, pref in _PENDING_EXTERNAL:
        m, p = mref(), pref()
        if m is None or p is None:
            continue
        if id(m) in inside:
            taken.append((m, p))
        else:
            kept.append((mref, pref))
    _PENDING_EXTERNAL[:] = kept
    return taken


def register_master_refresh(param: nn.Parameter, refresh: Callable[[], object], engine: object) -> None:
    """``refresh`` lives as long as ``engine`` (whose fp32 masters it refreshes)."""
    MASTER_REFRESH.set(param, refresh, engine)


def register_owner(param: nn.Parameter, owner: Owner, module: nn.Module) -> None:
    """``owner`` lives as long as ``module`` (the module holding ``param``, or one containing it)."""
    OWNERS.set(param, owner, module)


def full_numel(param: nn.Parameter) -> int:
    """Elements of ``param``'s full value; equal to ``param.numel()`` (a partitioned parameter keeps
    its full shape, see :mod:`zerodp.stage3.sharded_param`), kept for code written against the earlier
    empty placeholders."""
    owner = OWNERS.get(param)
    if owner is None:
        return param.numel()
    return next(s.numel for s in owner.unit.slots if s.param is param)


def is_partitioned(param: nn.Parameter) -> bool:
    """True if ``param`` is managed by a stage-3 engine or ``zero.Init`` (outside a gather it holds no
    values, see :mod:`zerodp.stage3.sharded_param`)."""
    return OWNERS.get(param) is not None


@contextlib.contextmanager
def coordinator_busy(owner: Owner) -> Iterator[None]:
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


def pre_sharded_unit(params: list[nn.Parameter]) -> ShardedUnit | None:
    """The unit built by :class:`Init` holding exactly ``params`` in this order, if there is one."""
    owners = [o for o in (OWNERS.get(p) for p in params) if o is not None]
    if not owners or len(owners) != len(params):
        return None
    unit = owners[0].unit
    if any(o.unit is not unit for o in owners) or [s.param for s in unit.slots] != list(params):
        return None
    return unit


def materialize(params: list[nn.Parameter]) -> None:
    """Give Init-partitioned ``params`` their full values again (each as its own tensor) and forget
    their Init units; used when the engine lays them out differently than Init did."""
    for p in params:
        owner = OWNERS.get(p)
        if owner is None or owner.coordinator is not None:
            continue
        u = owner.unit
        if u.state is ShardState.SHARDED:
            u.start_gather(owner.pg, owner.ledger, "init")
        if u.state is ShardState.GATHERING:
            u.finish_gather()
        for s in u.slots:
            s.param.data = s.param.data.clone()
            OWNERS.drop(s.param)
        u.full = None
        u.state = ShardState.SHARDED
