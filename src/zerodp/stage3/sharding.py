"""Stage 3 (P_os+g+p): the parameters themselves are partitioned (paper section 5.3).

:class:`Stage3` builds one :class:`~zerodp.stage3.units.ShardedUnit` per submodule (see the note there),
wires the coordinator and the module hooks, and runs the engine's forward inside the external-parameter
detection mode. Gradients are reduce-scattered unit by unit by the stage-2 reducer (each unit is one
bucket), so the owned gradient partition and the optimizer pieces are views of the shards only.
Per step and rank: all-gather in forward (Psi) + all-gather in backward (Psi) + reduce-scatter (Psi).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zerodp.config import ZeroConfig
from zerodp.runtime import comm
from zerodp.runtime.comm import CommLedger
from zerodp.runtime.optim import ParamGroupSpec
from zerodp.runtime.partition import FlatGroup
from zerodp.runtime.streams import SideStream
from zerodp.runtime.zero_state import param_holders
from zerodp.stage3.aliases import saved_alias_hooks
from zerodp.stage3.allocator import pin_mmap_threshold
from zerodp.stage3.coordinator import ParameterCoordinator
from zerodp.stage3.hooks import ExternalParameterMode, ModuleStack, register_stage3_hooks
from zerodp.stage3.ownership import (
    Owner,
    full_numel,
    materialize,
    pre_sharded_unit,
    set_owner,
    take_pending_external,
)
from zerodp.stage3.pool import GatherPool
from zerodp.stage3.unit_index import UnitIndex
from zerodp.stage3.units import ShardedUnit, shard_unit


class Stage3:
    """Owns the units, the coordinator and the hooks of one engine."""

    def __init__(
        self,
        module: nn.Module,
        specs: list[ParamGroupSpec],
        rank: int,
        world_size: int,
        pg: dist.ProcessGroup | None,
        ledger: CommLedger,
        zc: ZeroConfig,
        fetch_check: Any = None,
        read_ahead: Any = None,
    ) -> None:
        """``fetch_check``: the collective guard's gather agreement, called by the coordinator before
        each fetch (:meth:`zerodp.runtime.collective_guard.CollectiveGuard.gather_check`); None: none.
        ``read_ahead``: the parameter offload's (:meth:`zerodp.offload.param_offload.ParamOffload.read_ahead`),
        called by the coordinator after each fetch; None: no parameter offload."""
        self.rank, self.world_size, self.pg, self.ledger = rank, world_size, pg, ledger
        spec_of = {id(p): gi for gi, spec in enumerate(specs) for _, p in spec.params}
        src = dist.get_global_rank(pg, 0) if pg is not None else 0

        def sync(full: torch.Tensor) -> None:
            if world_size > 1:
                comm.broadcast(full, src, pg, ledger, "init")

        self.index = UnitIndex()
        self._build_units(module, zc.stage3_param_persistence_threshold, spec_of, sync)

        pin_mmap_threshold()  # see [Note: mmap threshold]
        #: elements of complete units' gradients held for one coalesced reduce-scatter (the reducer's
        #: ``coalesce_elements``), see :func:`reduce_flush_elements`
        self.reduce_flush_elements = reduce_flush_elements(self.index.units, zc.reduce_bucket_size)
        self._build_gather_memory(zc.stage3_max_live_parameters)
        positions = {id(m): i for i, m in enumerate(module.modules())}
        self.coordinator = ParameterCoordinator(
            self.index,
            positions,
            pg,
            ledger,
            zc.stage3_prefetch_bucket_size,
            zc.stage3_max_live_parameters,
            zc.stage3_max_reuse_distance,
            fetch_check,
            read_ahead,
        )
        self.coordinator.stream = self.gather_stream
        self._set_owners(module)
        self.stack = ModuleStack()
        self.handles = register_stage3_hooks(module, self.coordinator, self.stack)
        self._mode = ExternalParameterMode(self.coordinator, self.stack)

    def _build_gather_memory(self, max_live_parameters: int) -> None:
        """The all-gather stream and the bounded pool every non-persistent unit gathers into."""
        device = self.index.units[0].shard.device if self.index.units else torch.device("cpu")
        #: all-gathers are issued here, ordered against the compute stream by events (see [Note: comm
        #: streams] in zerodp.runtime.streams; no-ops on the CPU)
        self.gather_stream = SideStream(device, "all_gather")
        self.pool = GatherPool(
            _pool_limit(self.index.units, max_live_parameters, self.reduce_flush_elements),
            release_event=self.gather_stream.compute_event,
        )
        for u in self.index.units:
            if not u.persistent:
                u.pool = self.pool
                u.stream = self.gather_stream

    def _set_owners(self, module: nn.Module) -> None:
        """Each parameter's owner (its unit and the coordinator, :mod:`zerodp.stage3.ownership`) lives in
        the state of the module holding it (the first one, as for tied parameters), so a submodule kept
        alone after the engine and the root are dropped still gathers."""
        holders = param_holders(module)
        for u in self.index.units:
            for s in u.slots:
                holder = holders[id(s.param)][1] if id(s.param) in holders else module
                set_owner(s.param, Owner(u, self.pg, self.ledger, self.coordinator), holder)

    def _build_units(self, module: nn.Module, threshold: int, spec_of: dict, sync) -> None:
        """One unit per module holding parameters above ``threshold`` elements (each parameter in the
        first module that holds it), one ``<persistent>`` unit of the rest, indexed in module order."""
        assigned: set[int] = set()
        persistent: list[tuple[str, nn.Parameter]] = []
        next_index = 0
        for mname, m in module.named_modules():
            named = []
            for pname, p in m.named_parameters(recurse=False):
                if id(p) not in assigned:
                    assigned.add(id(p))
                    named.append((f"{mname}.{pname}" if mname else pname, p))
            persistent += [(n, p) for n, p in named if full_numel(p) <= threshold]
            big = [(n, p) for n, p in named if full_numel(p) > threshold]
            if big:
                next_index = self._add_unit(mname, big, next_index, spec_of, sync, persistent=False)
        if persistent:
            self._add_unit("<persistent>", persistent, next_index, spec_of, sync, persistent=True)
        for i, u in enumerate(self.index.units):
            u.group.index = i
        for m in module.modules():
            self.index.add_module(m)
        for m, p in take_pending_external(module):  # register_external_parameter before initialize
            self.index.register_external(m, p)

    def _add_unit(self, name: str, named: list, first: int, spec_of: dict, sync, persistent: bool) -> int:
        groups = [spec_of.get(id(p), -1) for _, p in named]
        u = None if persistent else pre_sharded_unit([p for _, p in named])
        if u is not None:  # built by zero.Init with this exact layout: adopt it as is
            u.name = name
            for i, (s, (pname, _), gi) in enumerate(zip(u.slots, named, groups, strict=True)):
                s.name, s.index, s.group_index = pname, first + i, gi
        else:
            materialize([p for _, p in named])
            u = shard_unit(name, named, first, groups, self.rank, self.world_size, persistent=persistent, sync=sync)
        self.index.units.append(u)
        if not u.persistent:
            u.attach_aliases(self.index.aliases)
        for s in u.slots:
            self.index.by_param[id(s.param)] = u
        return first + len(named)

    @property
    def groups(self) -> list[FlatGroup]:
        return [u.group for u in self.index.units]

    @property
    def units(self) -> list[ShardedUnit]:
        return self.index.units

    def forward(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        training = module.training and torch.is_grad_enabled()
        if training:
            self.coordinator.begin_iteration()
        self.stack.stack.clear()
        with self._mode, saved_alias_hooks(self.index.aliases):
            out = module(*args, **kwargs)
        if not training:
            self.coordinator.release_idle()
        return out

    def end_backward(self) -> None:
        self.coordinator.end_iteration()
        # every unit is released and the gradient staging returned: free the idle slabs, so that
        # between iterations (optimizer step included) the pool holds no memory
        self.pool.clear()

    def after_step(self) -> None:
        """Re-gather the persistent unit (the only one kept gathered) from the updated shards."""
        for u in self.units:
            if u.persistent:
                comm.all_gather(u.full_buffer, u.shard, self.pg, self.ledger, "parameters")

    def held_bytes(self) -> dict[str, int]:
        """Bytes of the shards, of the gathered buffers (live storages) and of the pool's idle slabs."""
        shards = sum(u.shard.numel() * u.shard.element_size() for u in self.units)
        gathered = sum(u.gathered_bytes() for u in self.units)  # live storage, not bookkeeping
        return {"shards": shards, "gathered": gathered, "pool_idle": self.pool.free_bytes()}


#: collectives of the reducer (coalesced groups) that may be in flight while the next ones fill
_STAGING_IN_FLIGHT = 2

#: stage 3 splits one backward's gradient reduce-scatters into about this many coalesced groups
REDUCE_GROUPS_PER_BACKWARD = 4


def reduce_flush_elements(units: list[ShardedUnit], reduce_bucket_size: int) -> int:
    """Elements of complete units' gradients the stage-3 reducer holds before it launches them as one
    coalesced, asynchronous reduce-scatter: ``min(reduce_bucket_size, max(largest unit, sharded
    elements / REDUCE_GROUPS_PER_BACKWARD))``.

    ``reduce_bucket_size`` alone (DeepSpeed's default 5e8, larger than most models) would hold every
    gradient until backward returns, so no reduce-scatter would overlap backward and the training
    thread would block on all of them at the end. A quarter of the model per group starts the first
    collective after about a quarter of backward and leaves only the last group (about a quarter of the
    gradients) to wait for, for four fixed collective costs per step instead of one per unit;
    ``reduce_bucket_size`` still caps a group's staging memory. Elements, per rank (full units)."""
    big = [u.numel for u in units if not u.persistent]
    if not big:
        return reduce_bucket_size
    share = -(-sum(big) // REDUCE_GROUPS_PER_BACKWARD)
    return max(1, min(reduce_bucket_size, max(max(big), share)))


def _pool_limit(units: list[ShardedUnit], max_live_parameters: int, reduce_flush: int) -> int:
    """Bytes the gather pool may hold: the coordinator's live window (``stage3_max_live_parameters``)
    plus the largest unit (the module running), and the gradient staging buffers: units held back up
    to ``reduce_flush`` elements (:func:`reduce_flush_elements`) for one coalesced reduce-scatter, plus
    those in flight and their receive buffers, in the widest element size. Slabs returned beyond this are
    freed (see [Note: gather pool])."""
    big = [u for u in units if not u.persistent]
    if not big:
        return 0
    largest = max(u.numel for u in big)
    width = max(u.shard.element_size() for u in big)
    total = sum(u.numel for u in big)
    window = min(max_live_parameters, total)
    staging = min((1 + _STAGING_IN_FLIGHT) * (reduce_flush + largest), total)  # each unit staged once
    # receive buffers of the buckets in flight (host tensors on gloo: an all-to-all, see zerodp.runtime.comm)
    receive = min(_STAGING_IN_FLIGHT * (reduce_flush + largest), total)
    return (window + largest + staging + receive) * width
