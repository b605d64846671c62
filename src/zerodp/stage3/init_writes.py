"""Writes to parameters that :class:`zerodp.zero.Init` has already partitioned (gather on touch).

Models commonly initialise weights after their submodules were built and assigned: HF's ``post_init()``
(``self.apply(self._init_weights)``), nanoGPT's ``self.apply(_init_weights)`` at the end of
``__init__``, ``nn.init.*`` on a child's weight. Under ``Init`` those children are already partitioned,
so the writes would fall on empty placeholders and be lost. :class:`InitTouchMode` (a
``TorchFunctionMode`` active only inside ``with Init(...)``) sees every torch call on such a parameter
(``.data``, ``normal_``, ``__getitem__``, ``fill_``, ...) and gathers the parameter's unit before the
call runs, so the call sees and edits the full tensor exactly as without ``Init`` (same shapes, same
random draws from this rank's generator). A gathered unit stays *open* until more than
``stage3_max_live_parameters`` elements are open or ``Init`` exits; it is then *flushed*: rank 0's
full values are broadcast (every rank ends with rank 0's values, as :func:`zerodp.initialize` does
for unpartitioned models), this rank's shard is re-written from them and the full buffer is freed.

A tensor obtained from such a parameter (``w = child.weight.data``) must not be used after its unit
was flushed (after ``Init`` exits): its memory is gone.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.overrides import TorchFunctionMode

from zerodp.runtime import comm
from zerodp.stage3.ownership import OWNERS, Owner
from zerodp.stage3.sharded_param import METADATA
from zerodp.stage3.units import ShardedUnit, ShardState


class InitTouchMode(TorchFunctionMode):
    """Gathers Init-partitioned parameters on first use; flushes them by budget and on :meth:`flush_all`."""

    def __init__(self, pg: Optional[ProcessGroup], budget_elements: int) -> None:
        super().__init__()
        self.pg = pg
        self.budget = budget_elements
        self.open: OrderedDict[int, tuple[ShardedUnit, Owner]] = OrderedDict()
        self.busy = False  # set while Init itself partitions or flushes
        self.gathers = 0  # units gathered because user code touched them

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        if not self.busy and func not in METADATA:  # shape, numel, ... need no values (no gather)
            for a in _tensors(args, kwargs):
                owner = OWNERS.get(a)
                if owner is not None and owner.coordinator is None and owner.unit.state is ShardState.SHARDED:
                    self._open(owner)
        return func(*args, **kwargs)

    def _open(self, owner: Owner) -> None:
        u = owner.unit
        self.busy = True
        try:
            u.start_gather(owner.pg, owner.ledger, "init")
            u.finish_gather()
            self.gathers += 1
            self.open[id(u)] = (u, owner)
            while len(self.open) > 1 and sum(x.numel for x, _ in self.open.values()) > self.budget:
                self._flush(next(iter(self.open)))
        finally:
            self.busy = False

    def _flush(self, key: int) -> None:
        u, owner = self.open.pop(key)
        if u.state is not ShardState.UNSHARDED or u.users > 0:  # released or held by GatheredParameters
            return
        if dist.get_world_size(owner.pg) > 1:
            src = dist.get_global_rank(owner.pg, 0) if owner.pg is not None else 0
            comm.broadcast(u.full, src, owner.pg, owner.ledger, "init")
        u.write_back()
        u.release()

    def flush_all(self) -> None:
        self.busy = True
        try:
            while self.open:
                self._flush(next(iter(self.open)))
        finally:
            self.busy = False


def _tensors(args: tuple, kwargs: dict):
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            for x in a:
                if isinstance(x, torch.Tensor):
                    yield x
