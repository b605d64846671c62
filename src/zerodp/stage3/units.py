"""Stage-3 sharded units: one module's parameters, partitioned, gathered only while needed.

[Note: units] Each submodule's directly-owned parameters (``recurse=False``; a tied parameter belongs to
the first module that owns it) form one *unit*: a flat layout padded to a multiple of the world size
N, of which rank r keeps only shard r (1-D, ``numel / N`` elements). Gathering a unit is one coalesced
all-gather into the unit's full flat buffer, whose views are the parameters' ``.data``; releasing
it frees the buffer's memory by resizing its storage to 0 bytes (FSDP2's approach): the parameters keep
their full shape, dtype and numel, hold no storage, and refuse compute until re-gathered (they are
:class:`~zerodp.stage3.sharded_param.ShardedParameter` while SHARDED, see the note there). The buffer *object* and its
storage object live on: views that autograd saved during forward (``weight.t()`` in ``linear``, a transposed
weight in ``matmul``) point at that storage, hold no memory while the unit is released, and become
valid again when the unit is re-gathered (into the same storage, re-allocated) before the module's
backward. Casts of a gathered parameter made inside the engine's forward (``weight.float()``,
``weight.to(torch.bfloat16)``) are kept in per-unit *cast buffers* that follow the same rule (see
:meth:`ShardedUnit.cast`). In an engine, the memory a gather puts into those fixed storage objects is
a slab lent by the bounded :class:`~zerodp.stage3.pool.GatherPool` and handed back on release, so
gathers reuse memory instead of allocating (see [Note: gather pool]).
Parameters with at most ``stage3_param_persistence_threshold`` elements go to one *persistent* unit
that stays gathered and is re-gathered after each optimizer step.

With parameter offload (``zero_optimization.offload_param``) the shard itself lives elsewhere between
uses: :attr:`ShardedUnit.home` (a :class:`ShardHome`, see :mod:`zerodp.offload.param_swap`) is asked
for it around every use: an all-gather (from :meth:`ShardedUnit.start_gather` until
:meth:`ShardedUnit.finish_gather`), :meth:`ShardedUnit.write_back`, and any block under
:meth:`ShardedUnit.resident`.

State machine (FSDP2's ShardedState / DeepSpeed's ZeroParamStatus): SHARDED -> GATHERING (collective in
flight) -> UNSHARDED -> SHARDED, transitions only in :meth:`ShardedUnit.launch_gather` (also through
:meth:`ShardedUnit.start_gather`),
:meth:`ShardedUnit.finish_gather` and :meth:`ShardedUnit.release`.
"""

from __future__ import annotations

import contextlib
import enum
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn
from torch.distributed import ProcessGroup, Work

from zerodp.runtime import comm
from zerodp.runtime.comm import CommLedger
from zerodp.runtime.partition import Bucket, FlatGroup, ParamSlot, memory_stride
from zerodp.runtime.streams import SideStream
from zerodp.stage3.aliases import AliasTable, storage_key, storage_refs
from zerodp.stage3.pool import GatherPool
from zerodp.stage3.sharded_param import PartitionedParameterError, mark_sharded, mark_unsharded
from zerodp.stage3.unit_storage import (
    allocate_storage,
    empty_buffer,
    free_storage,
    issuing_on,
    row_major_strides,
    unowned_alias,
)


class ShardState(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"
    UNSHARDED = "unsharded"


class ShardHome(Protocol):
    """Where a unit's shard lives between uses (``offload_param``); the shard tensor keeps its identity
    (optimizer pieces are views of it), only its storage comes and goes."""

    def acquire(self, fill: bool = True) -> None:
        """Make the shard's storage hold its values until the matching :meth:`release`; ``fill``
        False: the storage only (the block overwrites all of it or reads none of it: no read)."""

    def release(self, dirty: bool) -> None:
        """End one use; ``dirty``: the values were changed and must reach the home."""


#: the next DeepSpeed-style ``ds_id``: each unit numbers its parameters from here when it is built.
#: Units are built in the same order on every rank (each build broadcasts the unit's values), so a
#: parameter's id is the same on every rank and orders gathers rank-independently.
_next_ds_id = [0]


def _reserve_ds_ids(count: int) -> int:
    first = _next_ds_id[0]
    _next_ds_id[0] += count
    return first


@dataclass(eq=False)
class ShardedUnit:
    """One module's partitioned parameters. ``group`` is the optimizer/reducer view: its ``buffer`` is
    this rank's shard and its single bucket spans the unit."""

    name: str  # qualified name of the owning module ("" for the root, "<persistent>")
    group: FlatGroup
    rank: int
    world_size: int
    persistent: bool = False
    state: ShardState = ShardState.SHARDED
    # 1-D, padded numel; its storage has 0 bytes while SHARDED (so not in repr: torch's tensor repr of a
    # 0-byte storage reads freed memory, e.g. in pytest's report of a failed assertion on a unit)
    full: torch.Tensor | None = field(default=None, repr=False)
    work: Work | None = None
    # (slot position, dtype) -> cast of that parameter; storage re-filled on gather, emptied on release
    casts: dict[tuple[int, torch.dtype], torch.Tensor] = field(default_factory=dict, repr=False)
    users: int = 0  # modules currently holding it gathered (forward or backward)
    prefetched: bool = False  # gathered ahead of use by the coordinator
    #: lends the memory of ``full`` and of the cast buffers while gathered (see [Note: gather pool] in
    #: :mod:`zerodp.stage3.pool`); None: each gather allocates and each release frees
    pool: GatherPool | None = None
    home: ShardHome | None = None  # offload_param: where the shard lives between uses; None: here
    #: the stage-3 alias table this unit's buffers are registered in (see [Note: escaping views] in
    #: :mod:`zerodp.stage3.aliases`); None: not registered (views saved by autograd keep the storage)
    aliases: AliasTable | None = None
    #: buffer key (None: full, (slot position, dtype): a cast buffer) -> its storage's use count when the
    #: unit became UNSHARDED; a release finding more keeps that storage for the extra views
    refs: dict = field(default_factory=dict)
    warned_escape: bool = False
    #: ``ds_id`` of the first slot's parameter (slot i has ``ds_id_base + i``); see :func:`_reserve_ds_ids`
    ds_id_base: int = -1
    #: the all-gather stream (see [Note: comm streams] in :mod:`zerodp.runtime.streams`); None: the
    #: collective is issued on, and waited for by, the stream current then
    stream: SideStream | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.ds_id_base < 0:
            self.ds_id_base = _reserve_ds_ids(len(self.group.slots))

    def ds_id(self, param: torch.Tensor) -> int:
        """DeepSpeed's ``param.ds_id``: the same number on every rank (see :func:`_reserve_ds_ids`)."""
        for i, s in enumerate(self.slots):
            if s.param is param:
                return self.ds_id_base + i
        raise KeyError("parameter is not in this unit")

    @property
    def sharded(self) -> bool:
        """True while only this rank's shard is here (state SHARDED: not gathered, nor gathering)."""
        return self.state is ShardState.SHARDED

    @property
    def numel(self) -> int:
        return self.group.buckets[0].numel

    @property
    def shard(self) -> torch.Tensor:
        return self.group.buffer

    @property
    def slots(self) -> list[ParamSlot]:
        return self.group.slots

    def start_gather(self, pg: ProcessGroup | None, ledger: CommLedger, purpose: str) -> None:
        """SHARDED -> GATHERING: re-allocate the full buffer's storage and launch the all-gather of
        every rank's shard into it (on :attr:`stream` when set, after it waited for the compute
        stream: a use on demand, where the shard may just have been written)."""
        self.prepare_gather()
        if self.stream is not None:
            self.stream.after_compute()
        with issuing_on(self.stream):
            self.launch_gather(pg, ledger, purpose)

    def prepare_gather(self) -> None:
        """Give the full buffer's storage memory again (on the compute stream; a pooled slab makes
        :attr:`stream` wait for its release, see [Note: gather pool]) and bring the shard home."""
        assert self.state is ShardState.SHARDED, f"unit '{self.name}' gathered while {self.state}"
        if self.full is None:
            self.full = empty_buffer(self.numel, self.shard.dtype, self.shard.device, self.pool, self.stream)
            self.refs[None] = storage_refs(self.full) + len(self.slots)  # finish_gather points them at it
            if self.aliases is not None:
                self.aliases.add(self.full, self, None)
        else:
            allocate_storage(self.full, self.pool, self.stream)
        if self.home is not None:
            self.home.acquire()  # released in finish_gather, once the collective has read the shard
            if self.stream is not None:
                self.stream.stale = True  # the shard may just have been read back on the compute stream

    def launch_gather(self, pg: ProcessGroup | None, ledger: CommLedger, purpose: str) -> None:
        """Issue the all-gather of a prepared unit (on the stream current now) -> GATHERING."""
        # into a non-owning alias of the full buffer's memory: the Work (kept by gloo's thread for a while
        # after wait() returns) then holds no reference to the buffer's storage, whose use count tells
        # escaping views (see [Note: escaping views]); the unit waits for the Work before any release
        self.work = comm.all_gather(unowned_alias(self.full_buffer), self.shard, pg, ledger, purpose, async_op=True)
        self.state = ShardState.GATHERING

    def finish_gather(self) -> None:
        """GATHERING -> UNSHARDED: the compute stream waits for the all-gather (see [Note: comm
        streams]), then each parameter's ``.data`` points at its full view and the cast buffers are
        re-filled."""
        assert self.state is ShardState.GATHERING and self.work, f"unit '{self.name}' finished while {self.state}"
        if self.stream is not None:
            self.stream.done(self.work)
        else:
            self.work.wait()
        self.work = None
        if self.home is not None:
            self.home.release(dirty=False)
        for s in self.slots:
            mark_unsharded(s.param)
            s.param.data = self._view(s)
        for (i, _dtype), buf in self.casts.items():
            allocate_storage(buf, self.pool)
            with torch.no_grad():
                buf.copy_(self._view(self.slots[i]))
        self.state = ShardState.UNSHARDED

    def attach_aliases(self, table: AliasTable) -> None:
        """Register this unit's buffers in ``table`` (views of them saved by autograd hold no storage)."""
        self.aliases = table
        if self.full is not None:
            table.add(self.full, self, None)
            if None not in self.refs:
                self.note_refs()
        for key, buf in self.casts.items():
            table.add(buf, self, key)

    def note_refs(self) -> None:
        """Record the use count of each buffer's storage: the buffer, its Python storage object and (for
        ``full``) the parameters, whose ``.data`` view it. Measured only when nothing else can hold it
        (never while an all-gather's Work, which references its output, may be alive), so that no view
        escaping later can hide behind a transient reference."""
        if self.full is not None:
            self.refs[None] = storage_refs(self.full)
        for key, buf in self.casts.items():
            self.refs[key] = storage_refs(buf)

    def release(self, allow: dict[int, int] | None = None) -> None:
        """UNSHARDED -> SHARDED: the memory of the full buffer and of the cast buffers is freed (their
        storages are resized to 0 bytes); the parameters stay views of the full buffer (full shape, no
        storage) and become :class:`~zerodp.stage3.sharded_param.ShardedParameter`.

        A buffer whose storage is still viewed by tensors other than the parameters (see [Note: escaping
        views] in :mod:`zerodp.stage3.aliases`) is not freed: it is left to those tensors, and the unit
        gets a new, empty buffer (with a warning, once per unit). ``allow``: storage key -> views the
        caller still holds that are about to be dropped (a module's outputs, replaced by copies)."""
        if self.state is ShardState.GATHERING:
            self.finish_gather()
        if self.state is ShardState.SHARDED:
            return
        for s in self.slots:  # views made while the storage is allocated (a re-binding is dropped)
            s.param.data = self._view(s)
        if self.refs:
            self._leave_escaped_views(allow or {})
        for s in self.slots:
            mark_sharded(s.param, self._param_name(s))
        free_storage(self.full, self.pool)
        for buf in self.casts.values():
            free_storage(buf, self.pool)
        self.users = 0
        self.prefetched = False
        self.state = ShardState.SHARDED

    def _leave_escaped_views(self, allow: dict[int, int]) -> None:
        """Give each buffer whose storage has more references than :attr:`refs` (+ ``allow``) a new
        empty storage, leaving the old one, memory and values, to the tensors that view it."""

        def escaped(key: object, buf: torch.Tensor) -> bool:
            sk = storage_key(buf)
            return storage_refs(buf) > self.refs.get(key, 1 << 62) + (allow.get(sk, 0) if sk is not None else 0)

        kept = []
        if self.full is not None and escaped(None, self.full):
            self.full = self._replace_buffer(self.full, None)
            for s in self.slots:
                s.param.data = self._view(s)
            kept.append("the parameters")
        for key, buf in list(self.casts.items()):
            if escaped(key, buf):
                self.casts[key] = self._replace_buffer(buf, key)
                kept.append(f"the {key[1]} cast of '{self._param_name(self.slots[key[0]])}'")
        if kept and not self.warned_escape:
            self.warned_escape = True
            warnings.warn(
                f"ZeRO stage 3: a tensor viewing {', '.join(kept)} of module '{self.name or '<root>'}' "
                f"({self.param_names()}) outlived the release of its gathered values (a view stored on "
                "the module or elsewhere, captured in a closure, or kept by a user's saved_tensors_hooks). "
                "Its memory is kept for it, so it stays valid, but it holds the values of that moment and "
                "no longer follows the parameter (an optimizer step does not update it). Store a copy "
                "(.clone()) instead, or keep the parameter gathered (stage3_param_persistence_threshold). "
                "Reported once per module.",
                RuntimeWarning,
                stacklevel=2,
            )

    def _replace_buffer(self, old: torch.Tensor, key: object) -> torch.Tensor:
        """A new buffer like ``old`` (same shape and strides), empty; ``old`` keeps its memory."""
        if self.pool is not None:
            self.pool.disown(old)
        if self.aliases is not None:
            self.aliases.drop(old)
        extent = old.untyped_storage().nbytes() // old.element_size()
        new = empty_buffer(extent, old.dtype, old.device, self.pool).as_strided(
            old.shape, old.stride(), old.storage_offset()
        )
        if self.aliases is not None:
            self.aliases.add(new, self, key)
        self.refs[key] = storage_refs(new) + (len(self.slots) if key is None else 0)  # re-pointed next
        return new

    def param_names(self, limit: int = 4) -> str:
        """The unit's parameter names, quoted (the first ``limit``), for messages."""
        names = [f"'{self._param_name(s)}'" for s in self.slots]
        return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")

    def cast(self, param: nn.Parameter, dtype: torch.dtype) -> torch.Tensor:
        """The cast buffer holding ``param`` (gathered, of this unit) in ``dtype``, re-filled now.

        Raises:
            RuntimeError: the unit is not gathered, or ``param`` is not one of its parameters.
        """
        if self.state is not ShardState.UNSHARDED:
            raise RuntimeError(f"unit '{self.name}': cast of a parameter while the unit is {self.state.value}")
        pos = next((i for i, s in enumerate(self.slots) if s.param is param), None)
        if pos is None:
            raise RuntimeError(f"unit '{self.name}' does not own the parameter being cast")
        buf = self.casts.get((pos, dtype))
        if buf is None:
            s = self.slots[pos]
            buf = empty_buffer(s.numel, dtype, self.shard.device, self.pool).as_strided(
                s.shape, s.stride or row_major_strides(s.shape)
            )
            self.casts[(pos, dtype)] = buf
            if self.aliases is not None:
                self.aliases.add(buf, self, (pos, dtype))
            self.refs[(pos, dtype)] = storage_refs(buf)
        with torch.no_grad():
            buf.copy_(self._view(self.slots[pos]))
        return buf

    def gathered_bytes(self) -> int:
        """Bytes this unit holds beyond its shard, read from the live storages (full + casts)."""
        total = self.full.untyped_storage().nbytes() if self.full is not None else 0
        return total + sum(b.untyped_storage().nbytes() for b in self.casts.values())

    def _param_name(self, s: ParamSlot) -> str:
        return s.name if not self.name or s.name.startswith(self.name + ".") else f"{self.name}.{s.name}"

    @property
    def full_buffer(self) -> torch.Tensor:
        """``full`` where the state guarantees one (GATHERING, UNSHARDED); else RuntimeError (a bug)."""
        if self.full is None:
            raise RuntimeError(f"unit '{self.name}' holds no full buffer ({self.state})")
        return self.full

    def _view(self, s: ParamSlot) -> torch.Tensor:
        return s.view(self.full_buffer[s.offset : s.offset + s.numel])

    def collect_rebound(self) -> None:
        """UNSHARDED, before the full values are kept (``GatheredParameters(modifier_rank=...)`` exit,
        ``zero.Init`` flush): a parameter re-bound to other memory while gathered (``p.data = t``,
        ``p.set_(t)``, a torch parametrization's ``original.set_``) has its values copied into the full
        buffer and is pointed back at it, so the edit is kept like an in-place one instead of being
        dropped when the unit is released.

        Raises:
            PartitionedParameterError: a re-bound parameter whose shape is not the parameter's.
        """
        for s in self.slots:
            view = self._view(s)
            p = s.param
            if p.data_ptr() == view.data_ptr() and p.shape == view.shape and p.stride() == view.stride():
                continue
            if tuple(p.shape) != tuple(view.shape):
                raise PartitionedParameterError(
                    f"parameter '{self._param_name(s)}' (ZeRO stage 3) was re-bound to a tensor of shape "
                    f"{tuple(p.shape)} while gathered; its shape is {tuple(view.shape)}: a partitioned "
                    "parameter keeps its shape (assign a new nn.Parameter to the module attribute instead)"
                )
            with torch.no_grad():
                view.copy_(p.detach())
            p.data = view

    def write_back(self) -> None:
        """Copy this rank's slice of the (possibly edited) full parameters into its shard (all of it:
        an offloaded shard is not read back first)."""
        assert self.full is not None
        lo = self.rank * self.shard.numel()
        with self.resident(write=True, fill=False):
            self.shard.copy_(self.full[lo : lo + self.shard.numel()])
        if self.stream is not None:
            self.stream.stale = True  # a prefetch must not read the shard before this copy

    @contextlib.contextmanager
    def resident(self, write: bool = False, fill: bool = True) -> Iterator[torch.Tensor]:
        """The shard, holding its values for the duration of the block (read back from its
        :attr:`home` if offloaded, unless ``fill`` is False: the block overwrites it all; with
        ``write``, written home afterwards). A no-op without a home."""
        if self.home is None:
            yield self.shard
            return
        self.home.acquire(fill)
        try:
            yield self.shard
        finally:
            self.home.release(dirty=write)


def shard_unit(
    name: str,
    named: list[tuple[str, nn.Parameter]],
    first_index: int,
    group_indices: list[int],
    rank: int,
    world_size: int,
    persistent: bool = False,
    sync: Callable[[torch.Tensor], None] | None = None,
    pin_memory: bool = False,
) -> ShardedUnit:
    """Lay out ``named`` (full, identical on every rank) as one unit and keep only shard ``rank``.
    ``pin_memory``: allocate the shard page-locked (host parameters only; the caller checks CUDA).

    The parameters' ``.data`` become views of the unit's full buffer, released (no storage) unless the
    unit is persistent (kept gathered). Element i of the unit lives on rank ``i // (numel / world_size)``.
    """
    slots: list[ParamSlot] = []
    cursor = 0
    for i, ((pname, p), gi) in enumerate(zip(named, group_indices, strict=True)):
        slots.append(ParamSlot(pname, p, first_index + i, cursor, p.numel(), p.shape, gi, memory_stride(p)))
        cursor += p.numel()
    padded = max(-(-cursor // world_size) * world_size, world_size)
    bucket = Bucket(0, 0, padded, slots, world_size)
    full = torch.empty(padded, dtype=named[0][1].dtype, device=named[0][1].device)
    full[cursor:].zero_()
    for s in slots:  # each parameter's own storage is dropped as soon as its values are copied
        full[s.offset : s.offset + s.numel].copy_(s.flat_values(s.param.detach()))
        s.param.data = s.view(full[s.offset : s.offset + s.numel])
    if sync is not None:
        sync(full)  # e.g. broadcast from rank 0 so every rank shards the same values
    shard_numel = padded // world_size
    shard = torch.empty(shard_numel, dtype=full.dtype, device=full.device, pin_memory=pin_memory)
    shard.copy_(full[rank * shard_numel : (rank + 1) * shard_numel])
    group = FlatGroup(0, shard, [bucket], slots, shard_offset=rank * shard_numel)
    unit = ShardedUnit(name, group, rank, world_size, persistent=persistent)
    unit.full = full
    unit.state = ShardState.UNSHARDED
    del full
    unit.note_refs()
    if not persistent:
        unit.release()
    return unit
