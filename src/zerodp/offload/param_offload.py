"""One stage-3 engine's parameter offload (``zero_optimization.offload_param``): where each unit's shard
lives between uses, read-ahead along the stage-3 trace, and residency for the engine calls that touch
shards (the optimizer step, checkpoints, accessors).

Source: Rajbhandari et al., "ZeRO-Infinity" (SC21), sections 5.1 and 6.2. DeepSpeed key:
``zero_optimization.offload_param``.

The homes (see [Note: residency] in :mod:`zerodp.offload.param_swap`):

- ``device: nvme``: :class:`~zerodp.offload.param_swap.SwappedShard` in this rank's parameter swap
  file, read through the direct-I/O pool into (pinned) buffers and copied into the shard's storage on
  the engine's device; read ahead ``prefetch_depth`` modules along the trace.
- ``device: cpu`` with the engine on a device (a GPU): :class:`~zerodp.offload.param_home.HostShard`
  in (pinned) host memory, copied host -> device when the unit is all-gathered.
- ``device: cpu`` on a CPU engine: no home; the shards are in host memory already, nothing changes.

``pin_memory`` unset is resolved from the engine's device (page-locked on CUDA).

Without ``offload_param`` the engine holds a :class:`NoParamOffload`: both implement
:class:`ParamOffloadStrategy`, chosen once by :func:`build_param_offload`, so the engine never asks
whether a parameter offload exists.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Protocol

import torch
import torch.distributed as dist

from zerodp.offload.config import AioConfig, OffloadParamConfig
from zerodp.offload.param_home import HostShard, HostShards, UseHook
from zerodp.offload.param_swap import ParamSwapper, Residency, SwappedShard, fmt_bytes
from zerodp.offload.shard_window import ShardAccess
from zerodp.runtime import device as devices
from zerodp.runtime.partition import FlatGroup
from zerodp.stage3.sharding import Stage3
from zerodp.stage3.units import ShardedUnit

#: a unit's home: where its shard lives between uses
Home = SwappedShard | HostShard

#: the stage-3 coordinator's read-ahead hook: called with the units of the modules still to come
ReadAhead = Callable[[Sequence[Sequence[ShardedUnit]]], None]


class ParamOffloadStrategy(ShardAccess, Protocol):
    """What the engine calls on its parameter offload (:class:`ParamOffload` or :class:`NoParamOffload`),
    besides the per-group residency of :class:`~zerodp.offload.shard_window.ShardAccess`."""

    @property  # read-only: ParamOffload's is the config's Literal
    def device(self) -> str: ...
    @property
    def swapper(self) -> ParamSwapper | None: ...

    def read_ahead_hook(self) -> ReadAhead | None: ...
    def attach_to(self, sharding: Stage3 | None) -> None: ...
    def resident(
        self, groups: Sequence[FlatGroup] | None, write: bool, settle: Callable[[], None], fill: bool = True
    ) -> AbstractContextManager[None]: ...
    def check_health(self) -> None: ...
    def format(self, rank: int, steps: int) -> str | None: ...
    def close(self) -> None: ...


class ParamOffload:
    """One stage-3 engine's parameter offload (a :class:`ParamOffloadStrategy`): the homes of its units'
    shards, read-ahead along the trace, and residency for the engine calls that touch shards (step,
    checkpoints, accessors)."""

    def __init__(
        self, cfg: OffloadParamConfig, aio: AioConfig, rank: int, process_group: dist.ProcessGroup | None
    ) -> None:
        self.cfg = cfg
        self.aio = aio
        self.rank = rank
        self.pg = process_group
        self.device = cfg.device
        self.swapper: ParamSwapper | None = None
        self.host_shards: HostShards | None = None  # device: cpu with the shards on a device
        self.units: list[ShardedUnit] = []
        self._by_group: dict[int, ShardedUnit] = {}
        self._pending: Callable[[FlatGroup], bool] = lambda group: False

    def read_ahead_hook(self) -> ReadAhead | None:
        """The stage-3 coordinator's hook (:meth:`read_ahead`), given to it at construction."""
        return self.read_ahead

    def attach_to(self, sharding: Stage3 | None) -> None:
        """Collective: send the shards of ``sharding``'s units home (:meth:`attach`).

        Raises:
            ValueError: offload asked for without stage 3 (the config schema refuses that first).
            OffloadError: the NVMe path is unusable (on every rank).
        """
        if sharding is None:
            raise ValueError("zero_optimization.offload_param needs zero_optimization.stage 3")
        self.attach(sharding.units)

    def attach(self, units: Sequence[ShardedUnit]) -> None:
        """Collective: send the shard of every non-persistent unit to its home. Units built by
        ``zero.Init`` whose shards are already in Init's swap file (or Init's host homes) stay there
        (that swapper or set becomes this engine's); a shard in a home of the other kind is brought
        back first.

        Raises:
            OffloadError: the NVMe path is unusable or the disk is full.
        """
        mine = [u for u in units if not u.persistent]
        device = devices.device_of(u.shard for u in mine)
        if self.device == "cpu" and devices.is_accelerator(device):
            built_host = [u.home.owner for u in mine if isinstance(u.home, HostShard)]
            self.host_shards = built_host[0] if built_host else HostShards(device, bool(self.cfg.pin_memory))
        if self.device == "nvme":
            built = [u.home.swapper for u in mine if isinstance(u.home, SwappedShard)]
            self.swapper = built[0] if built else ParamSwapper(self.cfg, self.aio, self.rank, self.pg)
            if not built:
                self.swapper.open()
        for u in mine:
            self.units.append(u)
            self._by_group[id(u.group)] = u
            if u.home is not None and _owner(u.home) not in (self.swapper, self.host_shards):
                old, u.home = u.home, None
                _forget(old)  # resident for good, unless moved into this engine's home below
            if self.swapper is not None and u.home is None:
                u.home = self.swapper.add(u.name, u.shard)
            elif self.host_shards is not None and u.home is None:
                u.home = self.host_shards.add(u.name, u.shard)

    def resident(
        self, groups: Sequence[FlatGroup] | None, write: bool, settle: Callable[[], None], fill: bool = True
    ) -> AbstractContextManager[None]:
        """Every offloaded shard (or those of ``groups``) holds its values for the block; with
        ``write``, changed values are written home afterwards; ``fill`` False: storage only, nothing
        read (the block reads no value, e.g. it only makes views). ``settle`` is called first (an
        optimizer step still updating shards, ``overlap_step``, ends before they move)."""
        settle()
        return self._resident(groups, write, fill)

    @contextlib.contextmanager
    def _resident(self, groups: Sequence[FlatGroup] | None, write: bool, fill: bool = True) -> Iterator[None]:
        """All reads are queued first, so they pipeline through the buffer pool."""
        units = self.units if groups is None else [self._by_group[id(g)] for g in groups if id(g) in self._by_group]
        homes = [u.home for u in units if u.home is not None]
        if self.swapper is not None and fill:
            for h in homes:
                if isinstance(h, SwappedShard) and h.state is Residency.SWAPPED:
                    h.swapper._start_read(h)
        taken = []
        try:
            for h in homes:
                h.acquire(fill)
                taken.append(h)
            yield
        finally:
            for h in taken:
                h.release(dirty=write)

    # ---- per-group residency (the NVMe optimizer step, zerodp.offload.nvme.ShardAccess) ----------
    def _home(self, group: FlatGroup) -> Home | None:
        u = self._by_group.get(id(group))
        return u.home if u is not None and isinstance(u.home, (SwappedShard, HostShard)) else None

    def _homes(self, groups: Sequence[FlatGroup]) -> list[Home]:
        return [h for h in map(self._home, groups) if h is not None]

    def prefetch(self, groups: Sequence[FlatGroup]) -> None:
        """Queue reads of the swapped-out shards of ``groups`` (no pin; :meth:`pin` waits for them)."""
        for h in self._homes(groups):
            if isinstance(h, SwappedShard) and h.state is Residency.SWAPPED:
                h.swapper._start_read(h)

    def pin(self, groups: Sequence[FlatGroup], fill: bool = True) -> None:
        """Acquire the shards of ``groups`` (reading them if needed; the use hook is not called: the
        optimizer step pins them to update them); pair with :meth:`unpin`. ``fill`` False: the caller
        writes every piece of each group, and the pieces cover every parameter element of its shard
        (:func:`~zerodp.offload.shard_window.pieces_cover_parameters`); a swapped-out shard gets its
        storage without a read and its elements outside the pieces (padding) are zeroed."""
        for g in groups:
            h = self._home(g)
            if isinstance(h, SwappedShard):
                h.swapper.acquire(h, fill)
                if h.blank:
                    _zero_outside_pieces(g)
            elif h is not None:
                h.acquire()

    def unpin(self, groups: Sequence[FlatGroup], dirty: bool, keep: bool = False, by_step: bool = False) -> None:
        """Release the shards of ``groups``; the last release writes a ``dirty`` shard home and, with
        ``keep``, leaves it resident within the read-ahead budget (:meth:`ParamSwapper.release`;
        ``by_step``: the optimizer step's release of shards it cast its masters into)."""
        for h in self._homes(groups):
            if isinstance(h, SwappedShard):
                h.swapper.release(h, dirty, keep, by_step)
            else:
                h.release(dirty)

    def step_current(self, group: FlatGroup) -> bool:
        """True if ``group``'s shard file holds what the last optimizer step cast into it and no use
        has changed it since (:attr:`SwappedShard.step_current`)."""
        h = self._home(group)
        return isinstance(h, SwappedShard) and h.step_current

    def forget_step_writes(self) -> None:
        """The masters were written outside a step (a checkpoint load, an edited parameter): no shard
        counts as the cast of its masters until the next step has checked it."""
        for s in self.swapper.shards if self.swapper is not None else ():
            s.step_current = False

    def swapped(self, group: FlatGroup) -> bool:
        """True if ``group``'s shard lives elsewhere between uses (the swap file, or host memory while
        the parameters are on a device)."""
        u = self._by_group.get(id(group))
        return u is not None and isinstance(u.home, (SwappedShard, HostShard))

    def set_use_hook(self, before_use: Callable[[FlatGroup], None], pending: Callable[[FlatGroup], bool]) -> None:
        """``before_use(group)`` runs before each use of a swapped shard (all-gather, residency for an
        engine call); shards of groups for which ``pending(group)`` is true are not read ahead (their
        values are about to change: the optimizer step's loop still has to update them,
        :mod:`zerodp.offload.step_pipeline`)."""
        if self.swapper is None:
            return
        group_of = {id(u.home): u.group for u in self.units if isinstance(u.home, SwappedShard)}
        self.swapper.before_use = lambda s: before_use(group_of[id(s)]) if id(s) in group_of else None
        self._pending = pending

    def deferrable(self, group: FlatGroup) -> bool:
        """True if every use of ``group``'s shard calls the use hook (its home is in the swap file)."""
        u = self._by_group.get(id(group))
        return u is not None and isinstance(u.home, SwappedShard)

    def read_ahead(self, upcoming: Sequence[Sequence[ShardedUnit]]) -> None:
        """The coordinator's hook: ``upcoming`` are the units of the next modules of the trace, in
        order; queue reads for the first ``prefetch_depth`` of them, within ``max_in_cpu`` (a unit
        whose update is still pending is passed over). Modules whose shards are all resident or on
        their way already (being all-gathered, read ahead at an earlier fetch) are not counted, so the
        reads run ahead of the all-gather prefetch window rather than inside it."""
        depth = 0
        for units in upcoming:
            if depth >= self.cfg.prefetch_depth:
                return
            homes = [u.home for u in units if isinstance(u.home, SwappedShard) and not self._pending(u.group)]
            if not any(h.state is Residency.SWAPPED for h in homes):
                continue
            for h in homes:
                if not h.swapper.read_ahead(h):
                    return
            depth += 1

    def check_health(self) -> None:
        if self.swapper is not None:
            self.swapper.check_health()

    def format(self, rank: int, steps: int) -> str:
        """One line for ``zerodp train``: units offloaded, host bytes of shards resident now and of the
        pool (live storages), bytes read and written per step since construction (NVMe)."""
        line = f"rank {rank}  offload_param.device = {self.device}  units {len(self.units)}"
        if self.host_shards is not None:
            hc = self.host_shards.counters
            return line + (
                f"  shards in host memory {fmt_bytes(self.host_shards.host_bytes()['host_shards'])}  "
                f"host->device {fmt_bytes(hc.bytes_to_device / max(steps, 1))}/step  "
                f"device->host {fmt_bytes(hc.bytes_to_host / max(steps, 1))}/step"
            )
        if self.swapper is None:
            held = sum(u.shard.untyped_storage().nbytes() for u in self.units)
            return line + f"  shards in host memory {fmt_bytes(held)}"
        sw, c = self.swapper, self.swapper.counters
        host = sw.host_bytes()
        per = max(steps, 1)
        return (
            line + f"  swap file {fmt_bytes(sw.end)}  resident now {fmt_bytes(host['resident_shards'])}  "
            f"pool {fmt_bytes(host['swap_buffers'])}\n  read {fmt_bytes(c.bytes_read / per)}/step  "
            f"written {fmt_bytes(c.bytes_written / per)}/step  ({steps} steps, construction included; "
            f"shard reads: {c.reads_ahead} issued ahead of use, {c.demand_reads} on demand; "
            f"{c.waits} uses waited for a read in flight)"
        )

    def close(self) -> None:
        if self.swapper is not None:
            self.swapper.close()
        if self.host_shards is not None:
            self.host_shards.close()


class NoParamOffload:
    """``offload_param.device: none``: every shard stays where it is, always resident; the engine calls
    it as it would a :class:`ParamOffload` and nothing moves."""

    device = "none"
    #: no parameter swap file (the NVMe optimizer offload pins shards per sub-group only with one)
    swapper: ParamSwapper | None = None

    def __init__(self) -> None:
        self.units: list[ShardedUnit] = []  # stage 3: the non-persistent units (attach_to)
        self._hooked: set[int] = set()  # id(group) of the units given a UseHook home (set_use_hook)

    def read_ahead_hook(self) -> ReadAhead | None:
        """None: nothing to read ahead, the coordinator skips its trace walk."""
        return None

    def attach_to(self, sharding: Stage3 | None) -> None:
        """Bring the shards ``zero.Init(remote_device=...)`` sent to its swap file or host homes back
        into memory for good, and close those homes: this engine does not offload."""
        built = {}
        self.units = [u for u in sharding.units if not u.persistent] if sharding is not None else []
        for u in sharding.units if sharding is not None else ():
            if u.home is not None:
                home, u.home = u.home, None
                built[id(_owner(home))] = _owner(home)
                _forget(home)
        for owner in built.values():
            owner.close()

    def resident(
        self, groups: Sequence[FlatGroup] | None, write: bool, settle: Callable[[], None], fill: bool = True
    ) -> AbstractContextManager[None]:
        """The shards hold their values already: a no-op, but with use hooks (``overlap_step``) an
        optimizer step still updating shards ends first (``settle``)."""
        if self._hooked:
            settle()
        return contextlib.nullcontext()

    def prefetch(self, groups: Sequence[FlatGroup]) -> None:
        """Nothing to read."""

    def pin(self, groups: Sequence[FlatGroup], fill: bool = True) -> None:
        """Nothing to read."""

    def unpin(self, groups: Sequence[FlatGroup], dirty: bool, keep: bool = False, by_step: bool = False) -> None:
        """Nothing to write."""

    def swapped(self, group: FlatGroup) -> bool:
        return False

    def step_current(self, group: FlatGroup) -> bool:
        """False: no shard lives in a file (the step checks every piece it has)."""
        return False

    def forget_step_writes(self) -> None:
        """Nothing recorded."""

    def set_use_hook(self, before_use: Callable[[FlatGroup], None], pending: Callable[[FlatGroup], bool]) -> None:
        """Give each non-persistent unit's shard a :class:`zerodp.offload.param_home.UseHook` home, so
        that every use of it (an all-gather, residency for an engine call) first calls
        ``before_use(group)``. Called by the NVMe optimizer offload only with ``overlap_step``: the
        shards stay in memory, nothing is read ahead (``pending`` is not needed)."""
        for u in self.units:
            if u.home is None:
                u.home = UseHook(before_use, u.group)
                self._hooked.add(id(u.group))

    def deferrable(self, group: FlatGroup) -> bool:
        """True if every use of ``group``'s shard calls the use hook (:meth:`set_use_hook`)."""
        return id(group) in self._hooked

    def check_health(self) -> None:
        """No swap file to lose."""

    def format(self, rank: int, steps: int) -> str | None:
        """None: no line for ``zerodp train``."""
        return None

    def close(self) -> None:
        """Nothing to release."""


def build_param_offload(
    cfg: OffloadParamConfig, aio: AioConfig, rank: int, process_group: dist.ProcessGroup | None, device: torch.device
) -> ParamOffloadStrategy:
    """:class:`NoParamOffload` for ``offload_param.device: none``; else the engine's parameter offload
    (``pin_memory`` resolved for the engine's ``device``), built before the stage-3 units (their
    coordinator gets its :meth:`~ParamOffloadStrategy.read_ahead_hook`) and attached to them by
    :meth:`~ParamOffloadStrategy.attach_to`."""
    if not cfg.enabled:
        return NoParamOffload()
    cfg = cfg.model_copy(update={"pin_memory": devices.resolve_pin_memory(cfg.pin_memory, device)})
    return ParamOffload(cfg, aio, rank, process_group)


def _zero_outside_pieces(group: FlatGroup) -> None:
    """Zero the elements of ``group``'s shard (its ``buffer``) that no piece of this rank covers (the
    padding; the pieces are disjoint ranges of it)."""
    base = int(group.buffer.storage_offset())
    cursor = 0
    for start, n in sorted((int(p.tensor.storage_offset()) - base, p.tensor.numel()) for p in group.pieces):
        if start > cursor:
            group.buffer[cursor:start].zero_()
        cursor = max(cursor, start + n)
    group.buffer[cursor:].zero_()


def _owner(home: object) -> ParamSwapper | HostShards:
    """The swapper or host set a home belongs to."""
    if isinstance(home, SwappedShard):
        return home.swapper
    assert isinstance(home, HostShard), f"unknown shard home {type(home).__name__}"
    return home.owner


def _forget(home: object) -> None:
    """Bring ``home``'s shard into memory for good and stop managing it."""
    if isinstance(home, SwappedShard):
        home.swapper.forget(home)
    else:
        assert isinstance(home, HostShard)
        home.forget()


__all__ = ["Home", "NoParamOffload", "ParamOffload", "ParamOffloadStrategy", "ReadAhead", "build_param_offload"]
