"""Parameter shards kept in (pinned) host memory while the parameters live on a device:
``offload_param.device: cpu`` with the engine on a GPU (ZeRO-Infinity's CPU tier), and
``zero.Init(remote_device="cpu")`` there.

Source: Rajbhandari et al., "ZeRO-Infinity" (SC21), section 5.1 (bandwidth-centric partitioning: each
rank moves only its own shard to the device, then the ranks all-gather on the device) and section 6.2
(overlap: the shard's host -> device copy is issued when the unit's all-gather is, i.e. within the
stage-3 prefetch window). DeepSpeed key: ``zero_optimization.offload_param`` (``device: cpu``,
``pin_memory``).

A :class:`HostShard` implements :class:`zerodp.stage3.units.ShardHome` as the NVMe swapper's shards do
(see [Note: residency] in :mod:`zerodp.offload.param_swap`): the unit's shard tensor keeps its identity
and its device (optimizer pieces and the reducer view it); between uses its storage has 0 bytes and the
values are in :attr:`HostShard.host`, a host tensor allocated page-locked when ``pin_memory``
(:func:`zerodp.runtime.device.host_empty`). The first :meth:`HostShard.acquire` re-allocates the
device storage (on the compute stream), copies host -> device on the set's copy stream (which first
waits for an event of the compute stream) and makes the compute stream wait for that copy (an event
wait, no host sync), so the all-gather (issued on the all-gather stream after it waited for the compute
stream, see [Note: comm streams]) reads the copied values. The last :meth:`HostShard.release` copies a
changed shard device -> host on the copy stream, makes the compute stream wait for it, and frees the
device storage: after use only the host copy remains, and device memory holds the gathered window alone.

On a CPU engine parameter offload to ``cpu`` needs no home (the shards are in host memory already); the
same class runs there in tests, with a CPU copy stream or a stand-in device module. It has not run on a
GPU (docs/gpu.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from zerodp.offload.stream import CopyStream
from zerodp.runtime.device import host_empty
from zerodp.runtime.partition import FlatGroup


@dataclass
class HostShardCounters:
    """Copies since the set was made (tests and the ``zerodp train`` report read them)."""

    to_device: int = 0  # host -> device copies of shards (one per first acquire)
    to_host: int = 0  # device -> host copies of changed shards (one per last dirty release)
    bytes_to_device: int = 0
    bytes_to_host: int = 0


class HostShards:
    """The host homes of one engine's (or one ``zero.Init``'s) shards, and their copy stream."""

    def __init__(self, device: torch.device, pin_memory: bool) -> None:
        self.device = device
        self.pin = pin_memory
        self.copies = CopyStream(device, threaded=False)
        self.shards: list[HostShard] = []
        self.counters = HostShardCounters()

    def add(self, name: str, shard: torch.Tensor) -> HostShard:
        """Give ``shard`` (1-D, owning exactly its storage) a host home holding its current values and
        free its storage.

        Raises:
            ValueError: the shard does not own exactly its storage (it could not be freed alone).
        """
        if (
            shard.storage_offset() != 0
            or not shard.is_contiguous()
            or shard.untyped_storage().nbytes() != shard.numel() * shard.element_size()
        ):
            raise ValueError(f"unit '{name}': an offloaded shard must own exactly its storage")
        home = HostShard(self, name, shard, host_empty(shard.numel(), shard.dtype, self.pin))
        home.host.copy_(shard.detach())  # once, at construction (blocking)
        self.shards.append(home)
        shard.untyped_storage().resize_(0)
        return home

    def host_bytes(self) -> dict[str, int]:
        """Host bytes of the shards' homes and device bytes of the shards resident now (live storages)."""
        return {
            "host_shards": sum(h.host.untyped_storage().nbytes() for h in self.shards),
            "resident_shards": sum(h.shard.untyped_storage().nbytes() for h in self.shards),
        }

    def close(self) -> None:
        """Finish the copies in flight."""
        self.copies.close()


@dataclass(eq=False)
class HostShard:
    """One unit's shard: values in :attr:`host`, device storage only while pinned (module docstring)."""

    owner: HostShards
    name: str
    shard: torch.Tensor  # 1-D on the device; storage 0 bytes while not pinned
    host: torch.Tensor = field(repr=False)  # 1-D, same dtype and numel, host (page-locked when pinned)
    pins: int = 0
    dirty: bool = False

    @property
    def nbytes(self) -> int:
        return self.shard.numel() * self.shard.element_size()

    def acquire(self, fill: bool = True) -> None:
        """Pin: the first pin re-allocates the device storage and copies the values in (copy stream;
        the compute stream waits for it); ``fill`` False: no copy (the block overwrites it all)."""
        if self.pins == 0:
            self.shard.untyped_storage().resize_(self.nbytes)
        if self.pins == 0 and fill:
            self.owner.copies.copy(self.shard, self.host)
            self.owner.copies.device_wait()
            self.owner.counters.to_device += 1
            self.owner.counters.bytes_to_device += self.nbytes
        self.pins += 1

    def release(self, dirty: bool) -> None:
        """Unpin; at the last unpin copy a changed shard home (copy stream; the compute stream waits
        for it) and free the device storage."""
        assert self.pins > 0, f"unit '{self.name}': shard released more often than acquired"
        self.pins -= 1
        self.dirty = self.dirty or dirty
        if self.pins > 0:
            return
        if self.dirty:
            self.owner.copies.copy(self.host, self.shard)
            self.owner.copies.device_wait()  # before the free below: the copy still reads the storage
            self.owner.counters.to_host += 1
            self.owner.counters.bytes_to_host += self.nbytes
            self.dirty = False
        self.shard.untyped_storage().resize_(0)

    def forget(self) -> None:
        """Bring the shard onto the device for good and leave the set (parameter offload is off)."""
        self.acquire()
        self.owner.shards.remove(self)

    def storage_bytes(self) -> int:
        """Bytes of the shard's live device storage (0 between uses)."""
        return self.shard.untyped_storage().nbytes()


@dataclass(eq=False)
class UseHook:
    """The home of a shard that is not offloaded (it stays in memory) but whose every use must first
    call ``before_use(group)``: ``offload_optimizer.overlap_step`` without a parameter offload
    (:meth:`zerodp.offload.param_offload.NoParamOffload.set_use_hook`). Stage 3 reads a non-persistent
    unit's shard only through its home (:meth:`zerodp.stage3.units.ShardedUnit.prepare_gather` for an
    all-gather, :meth:`~zerodp.stage3.units.ShardedUnit.resident` for the engine's calls), so each
    read first updates the optimizer step's sub-groups that hold the shard's pieces."""

    before_use: Callable[[FlatGroup], None]
    group: FlatGroup

    def acquire(self, fill: bool = True) -> None:
        """The use hook; the shard is in memory either way."""
        self.before_use(self.group)

    def release(self, dirty: bool) -> None:
        """Nothing to write: the shard never left memory."""


__all__ = ["HostShard", "HostShardCounters", "HostShards", "UseHook"]
