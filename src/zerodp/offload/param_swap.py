"""ZeRO-Infinity parameter offload (``zero_optimization.offload_param``, stage 3): where each rank's shard
of every non-persistent stage-3 unit lives between uses, and the residency protocol around every use.

Source: Rajbhandari et al., "ZeRO-Infinity" (SC21), section 5.1 (bandwidth-centric partitioning: each
rank reads only its own shard, then the ranks all-gather) and section 6.2 (overlap-centric design: the
trace drives reads several modules ahead). DeepSpeed key: ``zero_optimization.offload_param``.

[Note: residency] A unit's shard (``ShardedUnit.shard``, the flat group's ``buffer``) keeps its tensor
identity for the life of the engine: optimizer pieces and the reducer hold views of it. Only its
*storage* comes and goes. Per shard (:class:`SwappedShard`, the unit's ``home``):

- ``SWAPPED``: storage resized to 0 bytes; the values are in the swap file only (the file is current).
- ``READING``: storage re-allocated; chunk reads from the file are queued or in flight.
- ``RESIDENT``: storage holds the values. ``pins`` counts the uses in progress (an all-gather, a
  write-back, an engine call under :meth:`ParamOffload.resident`).

:meth:`SwappedShard.acquire` pins it (reading it first if needed, waiting for a read in flight);
:meth:`SwappedShard.release` unpins it, and the last release writes it home if a user changed it
(``dirty``), then frees the storage. Any code touching a shard goes through
:meth:`zerodp.stage3.units.ShardedUnit.resident` (or the all-gather, which acquires by itself); a
swapped-out shard that is touched anyway raises (its storage has no data), it never reads stale values.

I/O goes through :mod:`zerodp.offload.aio` (direct I/O thread pool) and a pool of ``buffer_count``
aligned buffers of ``buffer_size`` bytes (rounded down to 4096): a shard is read chunk by chunk into
pool buffers and each chunk copied into the shard's storage; a dirty shard is copied chunk by chunk into
pool buffers and written. A write of a shard always completes before a later read of it is issued.

Read-ahead (:meth:`ParamOffload.read_ahead`, called by the stage-3 coordinator after each fetch once
the trace is recorded): reads for the next ``prefetch_depth`` modules of the trace are queued while
the current module runs and the next one is all-gathered; shards read ahead of use and not yet used
hold at most ``max_in_cpu`` bytes, and the reads in flight at most the pool
(``buffer_count * buffer_size`` bytes).

A shard on a device (the engine on a GPU): pool buffers are page-locked (``pin_memory``, unset: on
CUDA), each read chunk is copied buffer -> shard on a copy stream (:class:`zerodp.offload.stream.CopyStream`;
the buffer is reused only after that copy is done), and :meth:`ParamSwapper.acquire` makes the compute
stream wait for the copies (no host sync); a write copies the shard into a buffer with a blocking
device -> host copy (the I/O thread reads the buffer at once). On the CPU the copies run inline, as before.
``device: cpu`` homes are :mod:`zerodp.offload.param_home`'s; the engine's offload is
:mod:`zerodp.offload.param_offload`.
"""

from __future__ import annotations

import contextlib
import enum
import shutil
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from zerodp.offload.aio import ALIGN, AsyncIO, IOHandle, SwapFile, align_up, aligned_buffer
from zerodp.offload.config import AioConfig, OffloadParamConfig
from zerodp.offload.stream import CopyStream
from zerodp.offload.swap_job import (
    OffloadError,
    agree_job_id,
    open_rank_file,
    raise_if_any_rank_failed,
    remove_swap_dir,
)


class Residency(enum.Enum):
    SWAPPED = "swapped"
    READING = "reading"
    RESIDENT = "resident"


@dataclass(eq=False)
class _Op:
    """One chunk transfer between a pool buffer and a shard's region of the swap file."""

    shard: SwappedShard
    start: int  # byte offset inside the shard
    nbytes: int  # valid bytes (the transfer is rounded up to ALIGN)
    write: bool
    buf: torch.Tensor | None = None
    handle: IOHandle | None = None

    def landed(self) -> bool:
        """True once the submitted transfer has finished."""
        assert self.handle is not None, "an op is in flight only once submitted"
        return self.handle.done()


@dataclass(eq=False)
class SwappedShard:
    """One unit's shard in the swap file (implements :class:`zerodp.stage3.units.ShardHome`)."""

    swapper: ParamSwapper
    name: str
    shard: torch.Tensor  # 1-D, contiguous, storage offset 0, storage exactly its bytes
    offset: int  # byte offset of its region in the swap file (a multiple of ALIGN)
    nbytes: int
    state: Residency = Residency.RESIDENT
    pins: int = 0
    dirty: bool = False  # changed by a user since it was last written home
    blank: bool = False  # resident without its values (acquired with fill=False), until written or evicted
    #: the file holds what the optimizer step last cast into the shard, and no other use has changed
    #: it since (``release(..., by_step=True)``): the step's in-place-edit check has nothing to find
    step_current: bool = False
    changed: bool = False  # released dirty by a use other than the step since the last write home
    ops: list[_Op] = field(default_factory=list)  # reads or writes queued or in flight

    def acquire(self, fill: bool = True) -> None:
        """Pin for a use: first the use hook (:meth:`ParamOffload.set_use_hook`), then
        :meth:`ParamSwapper.acquire` (``fill`` False: no read, see there)."""
        if self.swapper.before_use is not None:
            self.swapper.before_use(self)
        self.swapper.acquire(self, fill)

    def release(self, dirty: bool) -> None:
        self.swapper.release(self, dirty)

    def storage_bytes(self) -> int:
        """Bytes of the shard's live storage (0 while swapped out)."""
        return self.shard.untyped_storage().nbytes()


@dataclass
class SwapCounters:
    """Bytes and chunk transfers since the swapper was opened (``reads_ahead``: shards read ahead)."""

    bytes_read: int = 0
    bytes_written: int = 0
    chunk_reads: int = 0
    chunk_writes: int = 0
    reads_ahead: int = 0
    demand_reads: int = 0  # acquisitions of a swapped-out shard (not read ahead): read, then waited for
    waits: int = 0  # acquisitions of a shard read ahead whose read was still in flight
    blank_acquires: int = 0  # acquisitions of a swapped-out shard without a read (fill=False)


class ParamSwapper:
    """This rank's parameter swap file, its buffer pool and the residency of its shards."""

    def __init__(
        self, cfg: OffloadParamConfig, aio: AioConfig, rank: int, process_group: dist.ProcessGroup | None
    ) -> None:
        self.cfg = cfg
        self.aio_cfg = aio
        self.rank = rank
        self.pg = process_group
        self.chunk = max(ALIGN, cfg.buffer_size // ALIGN * ALIGN)
        self.shards: list[SwappedShard] = []
        self.file: SwapFile | None = None
        self.io: AsyncIO | None = None
        self.dir: str | None = None
        self.end = 0  # bytes of the file assigned to shards
        self.largest = 0  # bytes of the largest shard (pool buffers need not be larger)
        self.pool: list[torch.Tensor] = []  # every buffer ever allocated (at most buffer_count)
        self.free: list[torch.Tensor] = []
        #: chunk copies pool buffer -> shard (on the shards' device: the copy stream; CPU: inline), and
        #: id(buffer) -> the ticket of the copy still reading it (waited for before the buffer is reused)
        self.copies: CopyStream | None = None
        self._reading: dict[int, object] = {}
        self.queue: deque[_Op] = deque()  # reads waiting for a buffer
        self.inflight: deque[_Op] = deque()
        self.counters = SwapCounters()
        #: when a list: ("read", shard name) as each shard's first chunk read is submitted,
        #: ("evict", shard name) as its storage is freed (tests record the order of events here)
        self.events: list[tuple[str, str]] | None = None
        self._finalizer: weakref.finalize | None = None
        #: called with a shard before each use (:meth:`SwappedShard.acquire`), not before the optimizer
        #: step's own pins (:meth:`ParamOffload.pin`)
        self.before_use: Callable[[SwappedShard], None] | None = None

    # ---- the swap file -------------------------------------------------------------------------
    def open(self) -> None:
        """Collective: create ``nvme_path/zerodp_<job>/rank<r>/params.swp``; every rank raises
        :class:`~zerodp.offload.nvme.OffloadError` (naming the path) if any rank cannot."""
        job = agree_job_id(self.pg)
        error = None
        try:
            self._open(job)
        except (OSError, OffloadError) as exc:
            error = f"rank {self.rank}: {exc}"
        raise_if_any_rank_failed(error, self.pg)

    def _open(self, job: str) -> None:
        base = self.cfg.nvme_path
        assert base is not None
        files: list[SwapFile | None] = []
        # 0 bytes: the file grows as shards are added (add() checks the free space for each)
        args = (0, False, self.cfg.remove_stale_swap, "offload_param.nvme_path", files)
        self.dir, self.file = open_rank_file(base, job, self.rank, "params.swp", *args)
        self._finalizer = weakref.finalize(self, remove_swap_dir, self.dir, files)
        self.io = AsyncIO(self.aio_cfg)

    @property
    def swap_io(self) -> AsyncIO:
        """The swap file's I/O threads, from :meth:`open` until :meth:`close`."""
        assert self.io is not None, "the swap file's I/O is opened by open() and closed by close()"
        return self.io

    @property
    def swap_file(self) -> SwapFile:
        """The parameter swap file, from :meth:`open` on."""
        assert self.file is not None, "the parameter swap file is created by open()"
        return self.file

    def add(self, name: str, shard: torch.Tensor) -> SwappedShard:
        """Give ``shard`` a region of the swap file, write its values there and free its storage.

        Raises:
            OffloadError: the disk is full (the message names the path, bytes needed and free).
        """
        if (
            shard.storage_offset() != 0
            or not shard.is_contiguous()
            or shard.untyped_storage().nbytes() != shard.numel() * shard.element_size()
        ):
            raise ValueError(f"unit '{name}': a swappable shard must own exactly its storage")
        nbytes = shard.numel() * shard.element_size()
        if self.copies is None:
            self.copies = CopyStream(shard.device, threaded=False)
        s = SwappedShard(self, name, shard, self.end, nbytes)
        self.largest = max(self.largest, nbytes)
        self.end += align_up(nbytes)
        assert self.dir is not None, "open() makes the swap directory before any shard is added"
        free = shutil.disk_usage(self.dir).free
        if align_up(nbytes) > free:
            raise OffloadError(
                f"offload_param.nvme_path {self.cfg.nvme_path!r}: unit '{name}' needs "
                f"{align_up(nbytes):,} bytes in {self.swap_file.path}, {free:,} bytes are free"
            )
        self.shards.append(s)
        s.pins = 1
        self.release(s, dirty=True)
        return s

    def forget(self, s: SwappedShard) -> None:
        """Bring ``s`` into memory for good and stop managing it (its region is abandoned)."""
        self.acquire(s)
        self.shards.remove(s)

    # ---- residency -----------------------------------------------------------------------------
    def acquire(self, s: SwappedShard, fill: bool = True) -> None:
        """Pin ``s``; read it first if swapped out, wait for its read if one is queued or in flight.
        ``fill`` False (the caller overwrites all of it, or reads none of it): a swapped-out shard gets
        its storage without a read (``blank_acquires``), once any write of it still in flight has
        landed (the next write of it must not overtake that one)."""
        if s.blank and fill:
            raise RuntimeError(
                f"unit '{s.name}': its shard is pinned without its values (fill=False) and was acquired "
                "for its values meanwhile"
            )
        if s.state is Residency.SWAPPED and not fill:
            self._allocate(s)
            s.state = Residency.RESIDENT
            s.blank = True
            self.counters.blank_acquires += 1
        if s.state is Residency.SWAPPED:
            self.counters.demand_reads += 1
            self._start_read(s)
        elif s.state is Residency.READING:
            self.counters.waits += 1
        if s.state is Residency.READING:
            while s.ops:
                self._pump()
                if s.ops:
                    self._complete(self.inflight.popleft())
        if self.copies is not None:  # the compute stream waits for the chunk copies (no host sync)
            self.copies.device_wait()
        s.pins += 1

    def release(self, s: SwappedShard, dirty: bool, keep: bool = False, by_step: bool = False) -> None:
        """Unpin ``s``; at the last unpin write it home if ``dirty``, then free its storage, unless
        ``keep`` and the read-ahead budget (``max_in_cpu`` bytes of resident shards not in use) has
        room: then it stays resident as if read ahead (its next use needs no read). ``by_step``: the
        optimizer step's release of a shard it updated (:attr:`SwappedShard.step_current` after the
        write, unless another use released it dirty meanwhile)."""
        assert s.pins > 0, f"unit '{s.name}': shard released more often than acquired"
        s.pins -= 1
        s.dirty = s.dirty or dirty
        s.changed = s.changed or (dirty and not by_step)
        if s.pins > 0:
            return
        if s.dirty:
            self._write(s)
            s.step_current = not s.changed
            s.dirty = s.blank = s.changed = False
        if keep and not s.blank and self._unused_bytes() <= self.cfg.max_in_cpu:
            return
        s.blank = False
        s.shard.untyped_storage().resize_(0)
        s.state = Residency.SWAPPED
        if self.events is not None:
            self.events.append(("evict", s.name))

    def read_ahead(self, s: SwappedShard) -> bool:
        """Queue a read of ``s`` if it is swapped out and the read-ahead budget (``max_in_cpu`` bytes of
        shards read but not in use) allows. True if ``s`` is now resident or on its way."""
        if s.state is not Residency.SWAPPED:
            return True
        if self._unused_bytes() + s.nbytes > self.cfg.max_in_cpu:
            return False
        self.counters.reads_ahead += 1
        self._start_read(s)
        return True

    def _unused_bytes(self) -> int:
        """Bytes of shards resident (or being read) and not in use: read ahead, or kept."""
        return sum(x.nbytes for x in self.shards if x.pins == 0 and x.state is not Residency.SWAPPED)

    def _allocate(self, s: SwappedShard) -> None:
        """Give swapped-out ``s`` its storage, once any write of it still in flight has landed (a
        later read, or a later write of new values, must not overtake it)."""
        while s.ops:
            self._complete(s.ops[0], remove_inflight=True)
        s.shard.untyped_storage().resize_(s.nbytes)

    def _start_read(self, s: SwappedShard) -> None:
        self._allocate(s)
        s.state = Residency.READING
        for start in range(0, s.nbytes, self.chunk):
            op = _Op(s, start, min(self.chunk, s.nbytes - start), write=False)
            s.ops.append(op)
            self.queue.append(op)
        if not s.ops:
            s.state = Residency.RESIDENT
        self._pump()

    def _write(self, s: SwappedShard) -> None:
        data = _bytes(s.shard)
        for start in range(0, s.nbytes, self.chunk):
            n = min(self.chunk, s.nbytes - start)
            buf = self._buffer(n)
            op = _Op(s, start, n, write=True, buf=buf)
            buf[:n].copy_(data[start : start + n])
            op.handle = self.swap_io.write(self.swap_file, buf[: align_up(n)], s.offset + start)
            self.counters.bytes_written += align_up(n)
            self.counters.chunk_writes += 1
            s.ops.append(op)
            self.inflight.append(op)

    # ---- the buffer pool -----------------------------------------------------------------------
    def _buffer(self, nbytes: int) -> torch.Tensor:
        """A free pool buffer of at least ``nbytes``, waiting for the oldest transfer if every buffer is
        busy. Buffers are ``min(buffer_size, largest shard)`` bytes (aligned), allocated on first need;
        a free buffer too small for a later, larger shard is replaced."""
        self._reap()
        while True:
            fit = next((i for i, b in enumerate(self.free) if b.numel() >= nbytes), None)
            if fit is not None:
                buf = self.free.pop(fit)
                self._copied_out(buf)
                return buf
            if self.free and len(self.pool) >= self.cfg.buffer_count:
                small = self.free.pop()
                self._copied_out(small)  # not freed under the copy
                self.pool = [b for b in self.pool if b is not small]
            if len(self.pool) < self.cfg.buffer_count:
                pin = bool(self.cfg.pin_memory)  # resolved by build_param_offload
                buf = aligned_buffer(max(nbytes, min(self.chunk, align_up(self.largest))), pin)
                self.pool.append(buf)
                return buf
            self._complete(self.inflight.popleft())

    def _copied_out(self, buf: torch.Tensor) -> None:
        """Wait for the copy into a device shard that may still read free pool buffer ``buf`` (its
        ticket; none on the CPU), before ``buf`` is reused or dropped."""
        if self.copies is not None:
            self.copies.host_wait(self._reading.pop(id(buf), None))

    def _pump(self) -> None:
        """Submit queued chunk reads while pool buffers are free (never waits)."""
        self._reap()
        while self.queue and (self.free or len(self.pool) < self.cfg.buffer_count):
            op = self.queue.popleft()
            op.buf = buf = self._buffer(align_up(op.nbytes))
            if op.start == 0 and self.events is not None:
                self.events.append(("read", op.shard.name))
            op.handle = self.swap_io.read(self.swap_file, buf[: align_up(op.nbytes)], op.shard.offset + op.start)
            self.counters.bytes_read += align_up(op.nbytes)
            self.counters.chunk_reads += 1
            self.inflight.append(op)

    def _reap(self) -> None:
        """Complete every transfer that has finished."""
        for op in [op for op in self.inflight if op.landed()]:
            self._complete(op, remove_inflight=True)

    def _complete(self, op: _Op, remove_inflight: bool = False) -> None:
        """Wait for ``op`` (raising its I/O error, which names the file), copy a read chunk into its
        shard, and return the buffer to the pool."""
        if op.handle is None:  # still queued: submit it first
            self._pump()
            while op.handle is None:
                self._complete(self.inflight.popleft())
        if remove_inflight and op in self.inflight:
            self.inflight.remove(op)
        if op.buf is None:  # completed through another path already
            return
        op.handle.wait()
        s = op.shard
        if not op.write:
            assert self.copies is not None  # made by add()
            ticket = self.copies.copy(_bytes(s.shard)[op.start : op.start + op.nbytes], op.buf[: op.nbytes])
            if ticket is not None:
                self._reading[id(op.buf)] = ticket
        self.free.append(op.buf)
        op.buf = None
        s.ops.remove(op)
        if not op.write and not any(not o.write for o in s.ops):
            s.state = Residency.RESIDENT

    # ---- health and cleanup --------------------------------------------------------------------
    def check_health(self) -> None:
        """Collective: every rank raises :class:`OffloadError` if any rank's swap file is gone."""
        error = None
        if self.file is None or self.file.deleted():
            error = (
                f"rank {self.rank}: parameter swap file {self.file.path if self.file else self.dir} was "
                "deleted or replaced while training; the parameters in it are lost"
            )
        raise_if_any_rank_failed(error, self.pg)

    def close(self) -> None:
        """Finish the transfers in flight, stop the I/O threads, remove the swap file and directory."""
        with contextlib.suppress(OSError):
            while self.inflight:
                self._complete(self.inflight.popleft())
        if self.io is not None:
            self.io.close()
            self.io = None
        if self.copies is not None:
            self.copies.close()
        if self._finalizer is not None:
            self._finalizer()

    def host_bytes(self) -> dict[str, int]:
        """Host bytes measured from live storages: resident shards and the buffer pool."""
        return {
            "resident_shards": sum(s.storage_bytes() for s in self.shards),
            "swap_buffers": sum(b.untyped_storage().nbytes() for b in self.pool),
        }


def fmt_bytes(n: float) -> str:
    """``n`` bytes for a report line (B, KB, MB, GB; powers of 1000)."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} GB"


def _bytes(shard: torch.Tensor) -> torch.Tensor:
    return shard.view(torch.uint8)


__all__ = ["ParamSwapper", "Residency", "SwappedShard", "SwapCounters", "fmt_bytes"]
