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
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from zerodp.offload.config import AioConfig, OffloadParamConfig
from zerodp.offload.param_home import HostShard, HostShards
from zerodp.offload.param_swap import ParamSwapper, Residency, SwappedShard, fmt_bytes
from zerodp.runtime import device as devices
from zerodp.runtime.partition import FlatGroup
from zerodp.stage3.sharding import Stage3
from zerodp.stage3.units import ShardedUnit

#: a unit's home: where its shard lives between uses
Home = SwappedShard | HostShard


class ParamOffload:
    """One stage-3 engine's parameter offload: the homes of its units' shards, read-ahead along the
    trace, and residency for the engine calls that touch shards (step, checkpoints, accessors)."""

    def __init__(self, cfg: OffloadParamConfig, aio: AioConfig, rank: int,
                 process_group: dist.ProcessGroup | None) -> None:
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

    @contextlib.contextmanager
    def resident(self, groups: Sequence[FlatGroup] | None = None, write: bool = False) -> Iterator[None]:
        """Every offloaded shard (or those of ``groups``) holds its values for the block; with
        ``write``, changed values are written home afterwards. All reads are queued first, so they
        pipeline through the buffer pool."""
        units = self.units if groups is None else [self._by_group[id(g)] for g in groups
                                                    if id(g) in self._by_group]
        homes = [u.home for u in units if u.home is not None]
        if self.swapper is not None:
            for h in homes:
                if isinstance(h, SwappedShard) and h.state is Residency.SWAPPED:
                    h.swapper._start_read(h)
        taken = []
        try:
            for h in homes:
                h.acquire()
                taken.append(h)
            yield
        finally:
            for h in taken:
                h.release(dirty=write)

    # ---- per-group residency (the NVMe optimizer step, zerodp.offload.nvme.ShardAccess) ----------
    def _homes(self, groups: Sequence[FlatGroup]) -> list[Home]:
        units = [self._by_group.get(id(g)) for g in groups]
        return [u.home for u in units if u is not None and isinstance(u.home, (SwappedShard, HostShard))]

    def prefetch(self, groups: Sequence[FlatGroup]) -> None:
        """Queue reads of the swapped-out shards of ``groups`` (no pin; :meth:`pin` waits for them)."""
        for h in self._homes(groups):
            if isinstance(h, SwappedShard) and h.state is Residency.SWAPPED:
                h.swapper._start_read(h)

    def pin(self, groups: Sequence[FlatGroup]) -> None:
        """Acquire the shards of ``groups`` (reading them if needed; the use hook is not called: the
        optimizer step pins them to update them); pair with :meth:`unpin`."""
        for h in self._homes(groups):
            if isinstance(h, SwappedShard):
                h.swapper.acquire(h)
            else:
                h.acquire()

    def unpin(self, groups: Sequence[FlatGroup], dirty: bool, keep: bool = False) -> None:
        """Release the shards of ``groups``; the last release writes a ``dirty`` shard home and, with
        ``keep``, leaves it resident within the read-ahead budget (:meth:`ParamSwapper.release`)."""
        for h in self._homes(groups):
            if isinstance(h, SwappedShard):
                h.swapper.release(h, dirty, keep)
            else:
                h.release(dirty)

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
            return line + (f"  shards in host memory {fmt_bytes(self.host_shards.host_bytes()['host_shards'])}  "
                           f"host->device {fmt_bytes(hc.bytes_to_device / max(steps, 1))}/step  "
                           f"device->host {fmt_bytes(hc.bytes_to_host / max(steps, 1))}/step")
        if self.swapper is None:
            held = sum(u.shard.untyped_storage().nbytes() for u in self.units)
            return line + f"  shards in host memory {fmt_bytes(held)}"
        sw, c = self.swapper, self.swapper.counters
        host = sw.host_bytes()
        per = max(steps, 1)
        return (line + f"  swap file {fmt_bytes(sw.end)}  resident now {fmt_bytes(host['resident_shards'])}  "
                f"pool {fmt_bytes(host['swap_buffers'])}\n  read {fmt_bytes(c.bytes_read / per)}/step  "
                f"written {fmt_bytes(c.bytes_written / per)}/step  ({steps} steps, construction included; "
                f"shard reads: {c.reads_ahead} issued ahead of use, {c.demand_reads} on demand; "
                f"{c.waits} uses waited for a read in flight)")

    def close(self) -> None:
        if self.swapper is not None:
            self.swapper.close()
        if self.host_shards is not None:
            self.host_shards.close()


def build_param_offload(cfg: OffloadParamConfig, aio: AioConfig, rank: int, process_group: dist.ProcessGroup | None,
                        device: torch.device) -> ParamOffload | None:
    """None for ``offload_param.device: none``; else the engine's parameter offload (``pin_memory``
    resolved for the engine's ``device``), built before the stage-3 units (their coordinator gets its
    :meth:`ParamOffload.read_ahead`) and attached to them by :func:`attach_param_offload`."""
    if not cfg.enabled:
        return None
    cfg = cfg.model_copy(update={"pin_memory": devices.resolve_pin_memory(cfg.pin_memory, device)})
    return ParamOffload(cfg, aio, rank, process_group)


def attach_param_offload(offload: ParamOffload | None, sharding: Stage3 | None) -> None:
    """Send the stage-3 units' shards home (``offload``); without one, bring the shards ``zero.Init``
    sent to its swap file or host homes back into memory for good.

    Raises:
        ValueError: offload asked for without stage 3 (the config schema refuses that first).
        OffloadError: the NVMe path is unusable (on every rank).
    """
    if offload is None:
        built = {}
        for u in sharding.units if sharding is not None else ():  # built by zero.Init(remote_device=...)
            if u.home is not None:
                home, u.home = u.home, None
                built[id(_owner(home))] = _owner(home)
                _forget(home)  # read into memory for good: this engine does not offload
        for owner in built.values():
            owner.close()
        return
    if sharding is None:
        raise ValueError("zero_optimization.offload_param needs zero_optimization.stage 3")
    offload.attach(sharding.units)


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


__all__ = ["Home", "ParamOffload", "attach_param_offload", "build_param_offload"]
