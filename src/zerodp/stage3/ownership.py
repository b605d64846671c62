"""Which stage-3 unit owns each partitioned parameter: its :class:`Owner`, kept in the state of the
module holding the parameter (:mod:`zerodp.runtime.zero_state`).

Set by :class:`zerodp.zero.Init` (units without a coordinator yet) and by each stage-3 engine
(:class:`zerodp.stage3.sharding.Stage3`); read by :mod:`zerodp.zero`'s user-facing utilities and by the
engine when it adopts units built by ``Init``.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch.distributed as dist
from torch import nn

from zerodp.runtime.comm import CommLedger
from zerodp.runtime.zero_state import ensure_record, module_state, param_record, zero_state
from zerodp.stage3.coordinator import ParameterCoordinator
from zerodp.stage3.units import ShardedUnit, ShardState


@dataclass(frozen=True)
class Owner:
    unit: ShardedUnit
    pg: dist.ProcessGroup | None
    ledger: CommLedger
    coordinator: ParameterCoordinator | None  # None while only zero.Init has partitioned it


def owner_of(param: object) -> Owner | None:
    """The stage-3 owner of ``param`` (kept in the state of the module holding it, see
    :mod:`zerodp.runtime.zero_state`); None if no engine or ``zero.Init`` partitioned it."""
    rec = param_record(param)
    return rec.owner if rec is not None else None


def set_owner(param: nn.Parameter, owner: Owner, module: nn.Module) -> None:
    """``owner`` lives as long as ``module`` (the module holding ``param``)."""
    ensure_record(param, module).owner = owner


def forget_owner(param: nn.Parameter) -> None:
    rec = param_record(param)
    if rec is not None:
        rec.owner = None


def add_pending_external(module: nn.Module, param: nn.Parameter) -> None:
    """Remember an external-parameter declaration (in ``module``'s state) until an engine adopts ``module``."""
    module_state(module).pending_external.append(weakref.ref(param))


def take_pending_external(root: nn.Module) -> list[tuple[nn.Module, nn.Parameter]]:
    """The pending declarations of the modules inside ``root`` (removed from their states)."""
    taken = []
    for m in root.modules():
        state = zero_state(m)
        if state is not None:
            taken += [(m, p) for p in (r() for r in state.pending_external) if p is not None]
            state.pending_external.clear()
    return taken


def full_numel(param: nn.Parameter) -> int:
    """Elements of ``param``'s full value; equal to ``param.numel()`` (a partitioned parameter keeps
    its full shape, see :mod:`zerodp.stage3.sharded_param`), kept for code written against the earlier
    empty placeholders."""
    owner = owner_of(param)
    if owner is None:
        return param.numel()
    return next(s.numel for s in owner.unit.slots if s.param is param)


def is_partitioned(param: nn.Parameter) -> bool:
    """True if ``param`` is managed by a stage-3 engine or ``zero.Init`` (outside a gather it holds no
    values, see :mod:`zerodp.stage3.sharded_param`)."""
    return owner_of(param) is not None


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
    owners = [o for o in (owner_of(p) for p in params) if o is not None]
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
        owner = owner_of(p)
        if owner is None or owner.coordinator is not None:
            continue
        u = owner.unit
        if u.state is ShardState.SHARDED:
            u.start_gather(owner.pg, owner.ledger, "init")
        if u.state is ShardState.GATHERING:
            u.finish_gather()
        for s in u.slots:
            s.param.data = s.param.data.clone()
            forget_owner(s.param)
        u.full = None
        u.state = ShardState.SHARDED
