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
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.overrides import TorchFunctionMode

from zerodp.runtime import comm
from zerodp.stage3.ownership import Owner, owner_of
from zerodp.stage3.sharded_param import METADATA, refuse_parameter_from_sharded
from zerodp.stage3.units import ShardedUnit, ShardState


class InitTouchMode(TorchFunctionMode):
    """Gathers Init-partitioned parameters on first use; flushes them by budget and on :meth:`flush_all`.

    A unit listed in :attr:`built_dtype` (its parameters were built in fp32 and partitioned in
    bf16/fp16) is opened in its built dtype: the gathered values are cast up (exactly) into a buffer of
    that dtype, which the parameters point at while the unit is open, so that edits (random draws
    included) run as they would without ``Init``; the flush casts the result down once.
    """

    def __init__(self, pg: ProcessGroup | None, budget_elements: int) -> None:
        super().__init__()
        self.pg = pg
        self.budget = budget_elements
        self.open: OrderedDict[int, tuple[ShardedUnit, Owner]] = OrderedDict()
        self.busy = False  # set while Init itself partitions or flushes
        self.gathers = 0  # units gathered because user code touched them
        #: id(unit) -> dtype its parameters were built in, where the unit is partitioned in another one
        self.built_dtype: dict[int, torch.dtype] = {}
        #: id(open unit) -> its own (partition-dtype) full buffer while ``unit.full`` is the built-dtype one
        self._narrow: dict[int, torch.Tensor] = {}

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        refuse_parameter_from_sharded(func, args)  # nn.Parameter(p): weight_norm's parametrization
        if not self.busy and func not in METADATA:  # shape, numel, ... need no values (no gather)
            needed = {id(o.unit) for o in (owner_of(a) for a in _tensors(args, kwargs)) if o is not None}
            for a in _tensors(args, kwargs):
                owner = owner_of(a)
                if owner is not None and owner.coordinator is None and owner.unit.state is ShardState.SHARDED:
                    self._open(owner, keep=needed)  # a copy between two units keeps both open
        return func(*args, **kwargs)

    def _open(self, owner: Owner, keep: frozenset | set = frozenset()) -> None:
        u = owner.unit
        self.busy = True
        try:
            u.start_gather(owner.pg, owner.ledger, "init")
            u.finish_gather()
            self.gathers += 1
            built = self.built_dtype.get(id(u))
            if built is not None:  # edit in the dtype the parameters were built in
                self._narrow[id(u)] = u.full_buffer
                u.full = u.full_buffer.to(built)
                for s in u.slots:
                    s.param.data = u._view(s)
            u.users += 1  # held open: a GatheredParameters block inside Init does not release it
            self.open[id(u)] = (u, owner)
            for key in list(self.open):  # oldest first, never a unit the running call uses
                if len(self.open) <= 1 or sum(x.numel for x, _ in self.open.values()) <= self.budget:
                    break
                if key not in keep:
                    self._flush(key)
        finally:
            self.busy = False

    def forget(self, u: ShardedUnit) -> torch.dtype | None:
        """Stop tracking ``u`` (Init replaces it); its parameters keep whatever values they hold now.
        Returns the dtype its parameters were built in, if it differs from the unit's."""
        if self.open.pop(id(u), None) is not None:
            u.users -= 1
            narrow = self._narrow.pop(id(u), None)
            del narrow  # ``u.full`` (built dtype) stays: the parameters point at it
        return self.built_dtype.pop(id(u), None)

    def _flush(self, key: int) -> None:
        u, owner = self.open[key]
        if u.state is ShardState.UNSHARDED and u.users > 1:  # held by GatheredParameters: later
            return
        del self.open[key]
        narrow = self._narrow.pop(id(u), None)
        if u.state is not ShardState.UNSHARDED:  # released by someone else
            if narrow is not None:
                u.full = narrow
            return
        u.users -= 1
        u.collect_rebound()  # p.set_(t), a parametrization's original.set_: kept, not dropped
        if narrow is not None:  # the one cast down, as without Init
            with torch.no_grad():
                narrow.copy_(u.full_buffer)
            u.full = narrow
        if dist.get_world_size(owner.pg) > 1:
            src = dist.get_global_rank(owner.pg, 0) if owner.pg is not None else 0
            comm.broadcast(u.full_buffer, src, owner.pg, owner.ledger, "init")
        u.write_back()
        u.release()

    def flush_all(self) -> None:
        self.busy = True
        try:
            for key in list(self.open):
                self._flush(key)
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
