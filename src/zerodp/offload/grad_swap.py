"""The reduced gradient partition on NVMe (``offload_optimizer.device = "nvme"``, stages 2 and 3):
ZeRO-Infinity's gradients leave host memory as soon as they are reduced, so the host holds no
gradient partition whose size grows with the model (Rajbhandari et al., SC21, section 5; DeepSpeed's
stage 3 with ``offload_optimizer: nvme`` swaps gradients out per bucket as well).

Layout: ``nvme_path/zerodp_<job>/rank<r>/gradients.swp``; flat group (stage-3 unit) ``g``'s owned
gradient partition (the reducer's ``owned[g]``: this rank's shard of every bucket back to back, in
the reducer's accumulation dtype, 2 bytes per element in bf16, 4 in fp32) occupies one region at an
offset aligned to 4096 bytes. The reducer (:class:`zerodp.runtime.reducer.PartitionedGradReducer`)
allocates a group's partition from :meth:`GradSwap.empty` (page-aligned, so the write needs no copy)
when its first bucket is reduced, hands it to :meth:`GradSwap.put` once every bucket of the group is
reduced in the micro-step, and drops it: the write is asynchronous and at most
:data:`MAX_WRITES_IN_FLIGHT` partitions are held until their writes land. A later micro-step of the
same accumulation reads the partition back (:meth:`get`), adds, and puts it again.

The optimizer step reads the gradients of one sub-group at a time (:meth:`read_ranges`: the byte
ranges of its spans, merged when contiguous, each read as its aligned superset) into one read buffer
per sub-group buffer of the optimizer: the sub-group loop issues each sub-group's gradient read right
behind its region's read, in the same I/O pool and at the same read-ahead depth
(:class:`StepGradReads`, :class:`zerodp.offload.step_pipeline.SubGroupPipeline`). Host memory: the
partitions whose writes are in flight (a unit each) and the read buffers (a sub-group each, plus 8
KiB per merged range).

The gradient norm needs every gradient before the first update. On the accumulation boundary's
backward (:meth:`GradSwap.take_norms`, set by the offload) :meth:`GradSwap.put` takes the fp32 chunk
norms of each piece of a partition before writing it (the CPU work the norm needs anyway, in a 16 MiB
scratch), so ``step()`` reads no byte of the file for the norm; before, a pass read the whole
partition once more (2 bytes/param per step, serial between backward and the sub-group loop).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from zerodp.offload.aio import ALIGN, AsyncIO, IOHandle, SwapFile, align_up, aligned_buffer
from zerodp.runtime.topology import NORM_CHUNK, chunk_norms_fp32

#: partitions whose writes may be in flight at once (each one unit's shard; the oldest is waited for)
MAX_WRITES_IN_FLIGHT = 2
#: fp32 elements of the scratch in which :meth:`GradSwap.put` makes a bf16 span fp32 for its norm (16 MiB)
NORM_BLOCK = 64 * NORM_CHUNK


@dataclass(frozen=True)
class Extent:
    """Where group ``index``'s partition lives in the file: ``offset`` (bytes, aligned), ``numel``
    elements of ``dtype``."""

    offset: int
    numel: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def plan_extents(sizes: Iterable[tuple[int, int, torch.dtype]]) -> tuple[dict[int, Extent], int]:
    """(group index -> :class:`Extent`, file bytes) for ``(group index, numel, dtype)`` in order."""
    out: dict[int, Extent] = {}
    at = 0
    for index, numel, dtype in sizes:
        out[index] = Extent(at, numel, dtype)
        at += align_up(numel * dtype.itemsize)
    return out, at


def merged_runs(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Byte ranges ``(start, stop)`` in file order with touching ones merged (input in any order)."""
    out: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(a, b) for a, b in out]


def run_buffer_bytes(runs: list[tuple[int, int]]) -> int:
    """Bytes of a read buffer holding every run of ``runs`` as its aligned superset."""
    return sum(align_up(hi) - lo // ALIGN * ALIGN for lo, hi in runs)


def _pages(t: torch.Tensor, nbytes: int) -> torch.Tensor:
    """The whole pages under ``t`` (a tensor from :meth:`GradSwap.empty`) as one uint8 tensor."""
    raw = t.view(torch.uint8)
    if raw.data_ptr() % ALIGN or raw.untyped_storage().nbytes() < raw.storage_offset() + align_up(nbytes):
        raise ValueError("a gradient partition given to GradSwap does not come from GradSwap.empty")
    return torch.empty(0, dtype=torch.uint8).set_(
        raw.untyped_storage(), raw.storage_offset(), (align_up(nbytes),), (1,)
    )


class GradSwap:
    """One rank's gradient swap file (module docstring). ``extents``: from :func:`plan_extents`."""

    def __init__(
        self,
        io: AsyncIO,
        file: SwapFile,
        extents: dict[int, Extent],
        read_buffer_bytes: int,
        read_buffer_count: int,
    ) -> None:
        self.io = io
        self.file = file
        self.extents = extents
        self.on_disk: set[int] = set()  # groups whose partition is in the file since the last forget()
        self._writes: list[tuple[int, IOHandle, torch.Tensor]] = []  # (group, write, its memory)
        self.read_buffers = (
            [aligned_buffer(read_buffer_bytes) for _ in range(read_buffer_count)] if read_buffer_bytes else []
        )
        self.bytes_written = 0
        self.bytes_read = 0
        #: group index -> spans ``(key, lo, hi)`` (elements of its partition) whose fp32 chunk norms
        #: :meth:`put` takes while set (:meth:`take_norms`); None: it takes none
        self.norm_spans: dict[int, list[tuple[int, int, int]]] | None = None
        #: group index -> key -> the chunk norms of that span as last put (a put without norms drops them)
        self.span_norms: dict[int, dict[int, torch.Tensor]] = {}
        self._norm_scratch: torch.Tensor | None = None  # fp32, NORM_BLOCK elements, while norm_spans is set

    # ---- the reducer's side --------------------------------------------------------------------
    def empty(self, index: int) -> torch.Tensor:
        """A zeroed, page-aligned 1-D tensor for group ``index``'s partition."""
        e = self.extents[index]
        return aligned_buffer(e.nbytes)[: e.nbytes].view(e.dtype).zero_()

    def take_norms(self, spans: dict[int, list[tuple[int, int, int]]] | None) -> None:
        """From now on :meth:`put` takes the fp32 chunk norms of ``spans`` (group index -> ``(key, lo,
        hi)``) of each partition it writes, into :attr:`span_norms` (the gradient norm then reads no
        byte of the file); None: it stops, and the scratch (:data:`NORM_BLOCK` fp32) goes."""
        self.norm_spans = spans
        self._norm_scratch = torch.empty(NORM_BLOCK, dtype=torch.float32) if spans is not None else None

    def put(self, index: int, owned: torch.Tensor) -> None:
        """Write group ``index``'s complete partition (a tensor from :meth:`empty`); the caller drops
        ``owned`` after this (kept here until its write lands). While :meth:`take_norms` is set, the
        chunk norms of its spans are taken first (CPU, during backward); else any it had are dropped,
        so :attr:`span_norms` always describes what the file holds."""
        self.span_norms.pop(index, None)
        if self.norm_spans is not None and index in self.norm_spans:
            assert self._norm_scratch is not None, "take_norms allocates it with norm_spans"
            scratch = self._norm_scratch
            self.span_norms[index] = {
                k: chunk_norms_fp32(owned[lo:hi], scratch) for k, lo, hi in self.norm_spans[index]
            }
        self._wait_group(index)
        e = self.extents[index]
        whole = _pages(owned, e.nbytes)
        self._writes.append((index, self.io.write(self.file, whole, e.offset), owned))
        self.bytes_written += whole.numel()
        self.on_disk.add(index)
        for _, h, _ in self._writes:
            if h.done():
                h.wait()  # landed (a failed write raises here): its memory goes now
        self._writes = [w for w in self._writes if w[1].futures]
        while len(self._writes) > MAX_WRITES_IN_FLIGHT:
            self._writes.pop(0)[1].wait()

    def get(self, index: int) -> torch.Tensor:
        """Group ``index``'s partition read back into a tensor from :meth:`empty` (the file keeps it)."""
        self._wait_group(index)
        e = self.extents[index]
        out = self.empty(index)
        whole = _pages(out, e.nbytes)
        self.io.read(self.file, whole, e.offset).wait()
        self.bytes_read += whole.numel()
        return out

    def read_elements(self, index: int, lo: int, hi: int) -> torch.Tensor:
        """Elements ``lo:hi`` of group ``index``'s partition, read into a new tensor."""
        handle, views = self.read_ranges([(index, lo, hi)], slot=None)
        handle.wait()
        return views[0]

    def forget(self) -> None:
        """The step consumed the gradients: the file's contents are stale from here on."""
        self.drain()
        self.on_disk.clear()
        self.span_norms.clear()

    def drain(self) -> None:
        for _, h, _ in self._writes:
            h.wait()
        self._writes.clear()

    def _wait_group(self, index: int) -> None:
        for k, (i, h, _) in enumerate(self._writes):
            if i == index:
                h.wait()
                del self._writes[k]
                return

    # ---- the optimizer step's side -------------------------------------------------------------
    def byte_range(self, index: int, lo: int, hi: int) -> tuple[int, int]:
        e = self.extents[index]
        if not (0 <= lo <= hi <= e.numel):
            raise IndexError(f"elements [{lo}, {hi}) outside group {index}'s gradient partition of {e.numel}")
        return e.offset + lo * e.dtype.itemsize, e.offset + hi * e.dtype.itemsize

    def read_ranges(self, spans: list[tuple[int, int, int]], slot: int | None) -> tuple[IOHandle, list[torch.Tensor]]:
        """Start reading ``spans`` (group index, lo, hi elements) into read buffer ``slot`` (None: a
        buffer of their own); returns the handle and one view per span, valid once it is waited for."""
        for index, _, _ in spans:
            if index not in self.on_disk:
                raise RuntimeError(
                    f"the gradient of group {index} was read from the gradient swap file "
                    "before it was written there this step"
                )
            self._wait_group(index)
        byte = [self.byte_range(*s) for s in spans]
        runs = merged_runs(byte)
        need = run_buffer_bytes(runs)
        if slot is None:
            buf = aligned_buffer(need)
        else:
            buf = self.read_buffers[slot]
            if need > buf.numel():
                raise ValueError(f"gradient read of {need} bytes does not fit the {buf.numel()}-byte buffer")
        handle = IOHandle()
        at = 0
        where: list[tuple[int, int]] = []  # run start in the file, its offset in buf
        for lo, hi in runs:
            start = lo // ALIGN * ALIGN
            n = align_up(hi) - start
            sub = self.io.read(self.file, buf[at : at + n], start)
            handle.futures += sub.futures
            handle.nbytes += sub.nbytes
            where.append((start, at))
            at += n
        self.bytes_read += at
        views = []
        for (index, _lo, _hi), (b0, b1) in zip(spans, byte, strict=False):
            start, at = next((s, a) for (s, a), (rlo, rhi) in zip(where, runs, strict=False) if rlo <= b0 and b1 <= rhi)
            dtype = self.extents[index].dtype
            views.append(buf[at + b0 - start : at + b1 - start].view(dtype))
        return handle, views

    def host_bytes(self) -> int:
        """Bytes of the read buffers, of the partitions whose writes are in flight and of the norm scratch."""
        held = sum(t.untyped_storage().nbytes() for _, _, t in self._writes)
        if self._norm_scratch is not None:
            held += self._norm_scratch.untyped_storage().nbytes()
        return sum(b.untyped_storage().nbytes() for b in self.read_buffers) + held


def span_bytes(swap_extents: dict[int, Extent], at: tuple[int, int], lo: int, hi: int) -> tuple[int, int]:
    """File byte range of elements ``lo:hi`` of a piece at ``at`` (group index, offset in its partition)."""
    e = swap_extents[at[0]]
    return e.offset + (at[1] + lo) * e.dtype.itemsize, e.offset + (at[1] + hi) * e.dtype.itemsize


def open_grad_swap(
    directory: str,
    nvme_path: str,
    fast_init: bool,
    io: AsyncIO,
    files: list,
    sizes: list[tuple[int, int, torch.dtype]],
    at: list[tuple[int, int]],
    subgroup_spans: list[list[tuple[int, int, int]]],
    rank: int,
    pg: dist.ProcessGroup | None,
    read_buffer_count: int,
) -> GradSwap:
    """Collective: create ``directory/gradients.swp`` for partitions of ``sizes`` (group index,
    elements, dtype) and the :class:`GradSwap` reading it through ``read_buffer_count`` buffers of the
    largest sub-group's ranges (``subgroup_spans``: per sub-group, (piece position, lo, hi); ``at``: per piece,
    (group index, offset in its partition)). The file is appended to ``files`` (removed with them).

    Raises:
        OffloadError: on every rank, when a rank's disk cannot hold the file (bytes needed and free).
    """
    import os
    import shutil

    from zerodp.offload.swap_job import OffloadError, raise_if_any_rank_failed

    extents, nbytes = plan_extents(sizes)
    read = max(
        (
            run_buffer_bytes(merged_runs([span_bytes(extents, at[i], lo, hi) for i, lo, hi in spans]))
            for spans in subgroup_spans
        ),
        default=0,
    )
    error, file = None, None
    try:
        free = shutil.disk_usage(nvme_path).free
        if nbytes > free:
            raise OffloadError(
                f"offload_optimizer.nvme_path {nvme_path!r}: the gradient swap file needs "
                f"{nbytes:,} bytes, {free:,} bytes are free"
            )
        file = SwapFile(os.path.join(directory, "gradients.swp"))
        files.append(file)
        if fast_init or not nbytes:
            os.ftruncate(file.fd, nbytes)
        else:
            os.posix_fallocate(file.fd, 0, nbytes)
    except (OSError, OffloadError) as exc:
        error = f"rank {rank}: {exc}"
    raise_if_any_rank_failed(error, pg)
    assert file is not None  # opened unless a rank failed, and then every rank raised just above
    return GradSwap(io, file, extents, read, read_buffer_count)


class StepGradReads:
    """One step's gradient reads. ``order``: sub-group indices in update order; ``spans_of(index)``:
    (piece position, lo, hi) to read for it. The sub-group loop calls :meth:`issue` for each
    sub-group as it issues the read of its region (read buffer ``slot`` = the region's buffer slot,
    so a read buffer is reused only after its sub-group was updated); :meth:`take` waits for it. With
    ``own_buffers`` (reads larger than a sub-group: the gradient-norm pass, a whole piece each),
    :meth:`take` issues the next sub-group's read, one ahead, into a buffer of its own."""

    def __init__(
        self,
        swap: GradSwap,
        at: list[tuple[int, int]],
        order: list[int],
        spans_of: Callable[[int], list[tuple[int, int, int]]],
        own_buffers: bool = False,
    ) -> None:
        self.swap, self.at, self.order, self.spans_of = swap, at, order, spans_of
        self.own_buffers = own_buffers
        self.reads: dict[int, tuple[IOHandle, list[int], list[torch.Tensor]]] = {}

    def issue(self, index: int, slot: int | None) -> None:
        """Start reading sub-group ``index``'s gradients into read buffer ``slot`` (None: a buffer of
        its own), unless already started."""
        if index in self.reads:
            return
        spans = self.spans_of(index)
        handle, views = self.swap.read_ranges(
            [(self.at[i][0], self.at[i][1] + lo, self.at[i][1] + hi) for i, lo, hi in spans],
            None if self.own_buffers else slot,
        )
        self.reads[index] = (handle, [i for i, _, _ in spans], views)

    def take(self, index: int) -> dict[int, torch.Tensor]:
        """Piece position -> its span's gradient in sub-group ``index``, valid until its read buffer is
        reused (a sub-group not issued ahead is read now, into a buffer of its own)."""
        self.issue(index, None)
        handle, pieces, views = self.reads.pop(index)
        handle.wait()
        pos = self.order.index(index) if self.own_buffers and index in self.order else -1
        if 0 <= pos < len(self.order) - 1:
            self.issue(self.order[pos + 1], None)
        return dict(zip(pieces, views, strict=False))

    def close(self) -> None:
        for h, _, _ in self.reads.values():
            h.wait()
        self.reads.clear()


__all__ = [
    "Extent",
    "GradSwap",
    "MAX_WRITES_IN_FLIGHT",
    "StepGradReads",
    "merged_runs",
    "open_grad_swap",
    "plan_extents",
    "run_buffer_bytes",
    "span_bytes",
]
