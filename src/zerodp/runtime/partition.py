"""Flat-buffer layout and partitioning of trainable parameters (stages 0-2).

[Note: layout] The trainable parameters of one optimizer param group (and one dtype/device) are packed
into a single 1-D *flat buffer*; each parameter's ``.data`` becomes a view into it. A parameter with a dense
non-row-major memory format (``channels_last``) keeps it: its elements are stored in its own memory order and its view
has its strides (:meth:`ParamSlot.view`); every conversion between a slot's flat range and a full-shape tensor
goes through :meth:`ParamSlot.view` / :meth:`ParamSlot.flat_values`, so gradients, accessors and
checkpoints use the same order. The flat buffer is
cut into *buckets* of at most ``reduce_bucket_size`` elements along parameter boundaries (a parameter
larger than that gets a bucket of its own), in reverse registration order so that backward fills the
buckets roughly one after another. Each bucket is padded to a multiple of the data-parallel world size
N and split into N equal *shards*: data-parallel rank r owns shard r of every bucket. Because every
bucket splits evenly, one reduce-scatter per bucket delivers each rank exactly the gradient
of the elements it owns, and one in-place all-gather per bucket rebuilds the updated
parameters. With a single bucket this is ZeRO's "flat buffer padded to a multiple of N, rank r owns
partition r".

The optimizer sees one 1-D view per (parameter, owned range) *piece*, so torch's Adam keeps per-parameter
state (including the step count) exactly as it would for the unpartitioned model, and a parameter that
received no gradient is skipped exactly as torch skips a parameter whose ``.grad`` is None.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zerodp.runtime import comm


@dataclass(eq=False)
class ParamSlot:
    """Where one trainable parameter lives in its group's flat buffer."""

    name: str  # fully qualified name in the module (first name, for tied parameters)
    param: nn.Parameter
    index: int  # position among all parameters of the engine (grad-presence flag)
    offset: int  # first element in the flat buffer
    numel: int
    shape: torch.Size
    group_index: int = 0  # which user param group (optimizer options) it belongs to
    stride: tuple[int, ...] | None = None  # the parameter's strides if dense but not row-major, else None

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` (1-D, ``numel`` contiguous elements in this slot's order) as a tensor of the
        parameter's shape and memory format."""
        if self.stride is None:
            return flat.view(self.shape)
        return flat.as_strided(self.shape, self.stride, flat.storage_offset())

    def flat_values(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (the parameter's shape, any layout) as ``numel`` elements in this slot's order (1-D)."""
        if self.stride is None:
            return t.reshape(-1)
        out = torch.empty(self.numel, dtype=t.dtype, device=t.device)
        self.view(out).copy_(t)
        return out


def memory_stride(p: torch.Tensor) -> tuple[int, ...] | None:
    """``p``'s strides if it is dense and non-overlapping but not row-major (e.g. ``channels_last``), so
    that a view with these strides over ``numel`` contiguous elements holds it; else None."""
    if p.dim() < 2 or p.is_contiguous():
        return None
    expected = 1
    for st, size in sorted((st, size) for st, size in zip(p.stride(), p.shape, strict=True) if size != 1):
        if st != expected:
            return None
        expected *= size
    return tuple(p.stride())


@dataclass(eq=False)
class Bucket:
    """A contiguous, padded range of a flat buffer: the unit of reduction and of ownership."""

    index: int  # position within its group
    start: int  # first element in the flat buffer
    numel: int  # padded length, a multiple of world_size
    slots: list[ParamSlot]
    world_size: int

    @property
    def shard_numel(self) -> int:
        return self.numel // self.world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        """[lo, hi) in flat-buffer coordinates owned by ``rank``."""
        lo = self.start + rank * self.shard_numel
        return lo, lo + self.shard_numel


@dataclass(eq=False)
class Piece:
    """The part of one parameter inside this rank's shard of one bucket: one optimizer tensor."""

    slot: ParamSlot
    bucket: Bucket
    lo: int  # flat-buffer coordinates, [lo, hi)
    hi: int
    tensor: torch.Tensor  # 1-D view of the flat buffer (or shard), (hi - lo) elements, module dtype
    master: torch.Tensor | None = None  # fp32 copy of ``tensor`` in mixed precision, else None

    @property
    def opt_tensor(self) -> torch.Tensor:
        """What the optimizer updates: the fp32 master copy if there is one, else the view itself."""
        return self.master if self.master is not None else self.tensor

    @property
    def master_copy(self) -> torch.Tensor:
        """The fp32 master, where the caller's setting guarantees one (offload, mixed precision).

        Raises:
            RuntimeError: the piece has no master (a bug in the caller, never bad user input)."""
        if self.master is None:
            raise RuntimeError(f"piece [{self.lo}, {self.hi}) of '{self.slot.name}' has no fp32 master")
        return self.master


@dataclass(eq=False)
class FlatGroup:
    """One optimizer param group's trainable parameters of one dtype and device, flattened."""

    index: int
    buffer: torch.Tensor  # 1-D; all buckets back to back (padding zeroed), or only this rank's shard
    buckets: list[Bucket]
    slots: list[ParamSlot]
    pieces: list[Piece] = field(default_factory=list)  # this rank's pieces, filled by assign_pieces
    shard_offset: int = 0  # flat coordinate of buffer[0]: 0, or rank x shard size when sharded

    @property
    def padded_numel(self) -> int:
        return sum(b.numel for b in self.buckets)


def plan_buckets(
    named: list[tuple[str, nn.Parameter]],
    first_index: int,
    bucket_size: int,
    world_size: int,
    group_index: int = 0,
) -> tuple[list[ParamSlot], list[Bucket], int]:
    """Assign flat-buffer offsets and buckets to ``named`` (in registration order).

    Returns (slots, buckets, padded total elements). Parameters are laid out in reverse order, the
    order in which backward usually produces their gradients.
    """
    slots: list[ParamSlot] = []
    buckets: list[Bucket] = []
    current: list[tuple[str, nn.Parameter, int]] = []
    cursor = 0

    def close() -> None:
        nonlocal cursor, current
        if not current:
            return
        start = cursor
        bucket_slots = []
        for name, p, idx in current:
            slot = ParamSlot(name, p, idx, cursor, p.numel(), p.shape, group_index, memory_stride(p))
            bucket_slots.append(slot)
            cursor += p.numel()
        padded = -(-(cursor - start) // world_size) * world_size
        cursor = start + padded
        buckets.append(Bucket(len(buckets), start, padded, bucket_slots, world_size))
        slots.extend(bucket_slots)
        current = []

    filled = 0
    for i, (name, p) in reversed(list(enumerate(named))):
        if current and filled + p.numel() > bucket_size:
            close()
            filled = 0
        current.append((name, p, first_index + i))
        filled += p.numel()
    close()
    return slots, buckets, cursor


def flatten_into(group_slots: list[ParamSlot], padded_numel: int) -> torch.Tensor:
    """Copy each slot's parameter into a new zeroed flat buffer and make ``param.data`` a view of it."""
    first = group_slots[0].param
    buffer = torch.zeros(padded_numel, dtype=first.dtype, device=first.device)
    for s in group_slots:
        view = buffer[s.offset : s.offset + s.numel]
        view.copy_(s.flat_values(s.param.detach()))
        s.param.data = s.view(view)
    return buffer


def build_flat_groups(
    named_groups: Sequence[Sequence[tuple[str, nn.Parameter]]], bucket_size: int, world_size: int
) -> list[FlatGroup]:
    """The flat groups of stages 0-2: one per optimizer param group (``named_groups``, each a list of
    ``(name, parameter)``) and dtype/device, bucketed by :func:`plan_buckets`, parameters moved into
    their buffer by :func:`flatten_into`; slot indices run over all groups."""
    groups: list[FlatGroup] = []
    index = 0
    for gi, named_params in enumerate(named_groups):
        by_kind: dict[tuple[torch.dtype, torch.device], list[tuple[str, nn.Parameter]]] = {}
        for name, p in named_params:
            by_kind.setdefault((p.dtype, p.device), []).append((name, p))
        for named in by_kind.values():
            slots, buckets, padded = plan_buckets(named, index, bucket_size, world_size, gi)
            index += len(named)
            buffer = flatten_into(slots, padded)
            groups.append(FlatGroup(len(groups), buffer, buckets, slots))
    return groups


def assign_pieces(group: FlatGroup, rank: int, owns_everything: bool) -> None:
    """Fill ``group.pieces`` with this rank's optimizer tensors: the owned range of each parameter.

    ``owns_everything`` (stage 0) makes every parameter one whole piece.
    """
    group.pieces = []
    base = group.shard_offset
    for b in group.buckets:
        lo_b, hi_b = (b.start, b.start + b.numel) if owns_everything else b.shard_range(rank)
        for s in b.slots:
            lo, hi = max(lo_b, s.offset), min(hi_b, s.offset + s.numel)
            if lo < hi and s.group_index >= 0 and s.param.requires_grad:
                group.pieces.append(Piece(s, b, lo, hi, group.buffer[lo - base : hi - base]))


def pieces_by_bucket(groups: Sequence[FlatGroup]) -> dict[int, list[Piece]]:
    """``id(bucket)`` -> this rank's pieces in it (after :func:`assign_pieces`)."""
    out: dict[int, list[Piece]] = {}
    for g in groups:
        for piece in g.pieces:
            out.setdefault(id(piece.bucket), []).append(piece)
    return out


def pieces_by_param(
    groups: Sequence[FlatGroup], keep: Callable[[Piece], bool]
) -> dict[int, tuple[FlatGroup, list[Piece]]]:
    """``id(param)`` -> its flat group and this rank's pieces of it that ``keep`` selects (parameters
    with no such piece are left out)."""
    out: dict[int, tuple[FlatGroup, list[Piece]]] = {}
    for g in groups:
        for piece in g.pieces:
            if keep(piece):
                out.setdefault(id(piece.slot.param), (g, []))[1].append(piece)
    return out


def zero_unwritten(buf: torch.Tensor, b: Bucket, written: list[bool]) -> None:
    """Zero the elements of ``buf`` (bucket ``b``'s staging buffer, 1-D, ``b.numel``) outside the
    ranges of the slots marked in ``written`` (one flag per ``b.slots`` entry): padding, gaps and
    parameters that got no gradient, which the collective must see as zeros. Adjacent ranges are
    zeroed together (one ``zero_`` for the padding of a bucket whose parameters all got a gradient)."""
    ranges: list[list[int]] = []

    def add(lo: int, hi: int) -> None:
        if lo >= hi:
            return
        if ranges and ranges[-1][1] == lo:
            ranges[-1][1] = hi
        else:
            ranges.append([lo, hi])

    pos = 0
    for s, w in sorted(zip(b.slots, written, strict=True), key=lambda x: x[0].offset):
        rel = s.offset - b.start
        add(pos, rel)
        if not w:
            add(rel, rel + s.numel)
        pos = max(pos, rel + s.numel)
    add(pos, b.numel)
    for lo, hi in ranges:
        buf[lo:hi].zero_()


def all_gather_updated_shards(
    groups: Sequence[FlatGroup], rank: int, process_group: dist.ProcessGroup | None, ledger: comm.CommLedger, limit: int
) -> None:
    """Stages 1-2 after the optimizer step: rebuild the full parameters from every rank's updated
    shard, in place in each flat buffer, bucket by bucket, with at most ``limit`` elements
    (``allgather_bucket_size``) in flight (recorded as ``parameters``)."""
    in_flight: deque[tuple[int, Any]] = deque()
    for g in groups:
        for b in g.buckets:
            lo, hi = b.shard_range(rank)
            out = g.buffer[b.start : b.start + b.numel]
            work = comm.all_gather(out, g.buffer[lo:hi], process_group, ledger, "parameters", async_op=True)
            in_flight.append((b.numel, work))
            while sum(n for n, _ in in_flight) > limit and len(in_flight) > 1:
                in_flight.popleft()[1].wait()
    for _, work in in_flight:
        work.wait()
