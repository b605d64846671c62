"""Gathering partitioned parameters outside forward: :class:`GatheredParameters` (DeepSpeed's
``deepspeed.zero.GatheredParameters``), re-exported by :mod:`zerodp.zero`.

Inside the context every listed parameter holds its full value on every rank (its unit is gathered);
with ``modifier_rank`` set, that rank's in-place edits are broadcast, written back into every rank's
shard and the fp32 masters refreshed on exit.
"""

from __future__ import annotations

from typing import Iterable, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from zerodp.runtime import comm
from zerodp.runtime.guards import acknowledge_edit
from zerodp.stage3.ownership import MASTER_REFRESH, OWNERS, Owner, coordinator_busy
from zerodp.stage3.units import ShardedUnit, ShardState


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
        self._units: list[tuple[ShardedUnit, Owner]] = []

    def __enter__(self) -> "GatheredParameters":
        if not self.enabled:
            return self
        if self.modifier_rank is not None and dist.is_initialized():
            n = dist.get_world_size()
            if not 0 <= self.modifier_rank < n:
                raise ValueError(f"modifier_rank must be in [0, {n}), got {self.modifier_rank}")
        seen: set[int] = set()
        for p in self.params:
            owner = OWNERS.get(p)
            if owner is None or id(owner.unit) in seen:
                continue
            seen.add(id(owner.unit))
            u = owner.unit
            with coordinator_busy(owner):
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
        if modify:  # p.data = t inside the block: kept like an in-place edit
            for u, _ in self._units:
                u.collect_rebound()
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
                refresh = MASTER_REFRESH.get(p)
                if refresh is not None:
                    refresh()
        for p in self.params:
            acknowledge_edit(p)
        for u, owner in self._units:
            u.users -= 1
            if u.users <= 0 and not u.persistent:
                with coordinator_busy(owner):
                    u.release()
        self._units = []
