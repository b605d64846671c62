"""The NVMe optimizer step's sub-group loop as a resumable pipeline (:class:`SubGroupPipeline`).

One step of :class:`zerodp.offload.nvme.NvmeOptimizerOffload` reads each sub-group's masters and
Adam moments (12 bytes per element), updates them, casts the masters into the module's parameter
shards and writes the sub-group back. Sub-group k is updated while the reads of the next
``buffer_count - 2`` are in flight and the write of k-1 drains (``aio.overlap_events``; without it,
one transfer at a time). The loop is an object rather than a ``for`` statement so that it can stop
after any sub-group and go on later:

- run to the end inside ``step()`` (the default): the step returns with every parameter updated;
- ``offload_optimizer.overlap_step`` (stage 3, ``offload_param`` on NVMe or none): ``step()`` updates the
  sub-groups that hold the always-gathered (persistent) parameters, queues the reads of the next
  ones and returns. The rest is done during the next forward: before any parameter shard is used (an
  all-gather, ``GatheredParameters``, a checkpoint), :meth:`SubGroupPipeline.ready_for` updates
  every sub-group up to the last one holding that shard's pieces, and at each such point
  :meth:`SubGroupPipeline.pump` also updates the sub-groups whose reads have already landed (never
  waiting). Every other access to optimizer state, and the next backward, first :meth:`finish`
  the loop. The optimizer's hyperparameters are those of the step that started the loop (a
  scheduler stepped since is set aside while a sub-group is updated), so the values are exactly
  those of the loop run to the end inside ``step()``; only the time at which each sub-group's
  update happens moves, from the step into the next forward, where its 12 bytes per element of
  swap traffic overlap computation.

ZeRO-Infinity (Rajbhandari et al., SC21) section 6.2 (overlap-centric design); DeepSpeed's pipelined
optimizer swapper (``offload_optimizer.pipeline_read`` / ``pipeline_write``) overlaps the swap with
the update inside the step only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from zerodp.offload.aio import AsyncIO, IOHandle
from zerodp.offload.config import AioConfig
from zerodp.offload.shard_window import ShardAccess, ShardWindow, unique_groups
from zerodp.offload.subgroups import SubGroup
from zerodp.runtime.partition import FlatGroup


class SwapOwner(Protocol):
    """What the loop uses of :class:`zerodp.offload.nvme.NvmeOptimizerOffload`."""

    buffers: list[torch.Tensor]
    aio_cfg: AioConfig
    shard_access: ShardAccess | None

    @property
    def swap_io(self) -> AsyncIO: ...

    def read_region(self, buf: torch.Tensor, offset: int) -> IOHandle: ...
    def write_region(self, buf: torch.Tensor, offset: int) -> IOHandle: ...

    def group_of(self, i: int) -> FlatGroup: ...


@dataclass
class SwapStats:
    """Seconds and bytes of one step's sub-group loop (``seconds``: from its start to its end, which
    with ``overlap_step`` includes forward computation it overlapped)."""

    bytes_read: int = 0
    bytes_written: int = 0
    seconds: float = 0.0
    update_seconds: float = 0.0  # binding, the optimizer's arithmetic and the cast back
    read_wait_seconds: float = 0.0  # blocked until a sub-group's read finished
    write_wait_seconds: float = 0.0  # blocked on writes (a buffer to reuse, the last ones)
    io_busy_seconds: float = 0.0  # wall time with any request in flight (AsyncIO.busy_seconds)
    updated_in_step: int = 0  # sub-groups updated before step() returned
    subgroups: int = 0  # sub-groups updated by the loop in all


@dataclass
class _Hyper:
    """The optimizer's hyperparameters when the loop started (everything in a param group but
    ``params``), put in place around each update and taken out after."""

    values: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer) -> _Hyper:
        return cls([{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups])

    def swap(self, optimizer: torch.optim.Optimizer) -> _Hyper:
        """Put these values in place; return the ones they replaced."""
        old = _Hyper.of(optimizer)
        for g, v in zip(optimizer.param_groups, self.values, strict=True):
            g.update(v)
        return old


class SubGroupPipeline:
    """The sub-group loop of one step (module docstring). ``todo``: the sub-groups with a gradient,
    in update order; ``update(sg, buf)`` updates one in its buffer (``buf``: uint8, ``sg.nbytes``);
    ``blank``: ids of the flat groups whose shards it overwrites whole (pinned without a read);
    ``on_read(sg, slot)``: called right after sub-group ``sg``'s region read is issued into buffer
    ``slot`` (the offload queues its gradient read there, behind it in the same pool)."""

    def __init__(
        self,
        offload: SwapOwner,
        optimizer: torch.optim.Optimizer,
        todo: list[SubGroup],
        update: Callable[[SubGroup, torch.Tensor], None],
        on_done: Callable[[], None],
        blank: frozenset[int] = frozenset(),
        on_read: Callable[[SubGroup, int], None] | None = None,
    ) -> None:
        self.off = offload
        self.on_read = on_read
        self.optimizer = optimizer
        self.todo = todo
        self.update = update
        self.on_done = on_done
        self.nbuf = len(offload.buffers)
        self.overlap = offload.aio_cfg.overlap_events
        # reads in flight beyond the sub-group being updated (one buffer drains the previous write)
        self.ahead = max(1, self.nbuf - 2) if self.overlap else 0
        self.reads: dict[int, IOHandle] = {}
        self.writes: dict[int, IOHandle] = {}  # buffer slot -> pending write
        self.next = 0  # the next sub-group to update
        self.issued = 0  # reads issued for todo[:issued]
        self.done = False
        self._busy = False  # inside an update (re-entrancy: the update pins shards itself)
        self.hyper = _Hyper.of(optimizer)
        self.stats = SwapStats(subgroups=len(todo))
        self._t0 = time.perf_counter()
        io = offload.swap_io
        self._r0, self._w0, self._b0 = io.bytes_read, io.bytes_written, io.busy_seconds
        # the last sub-group (position in todo) holding a piece of each flat group
        self.last_of: dict[int, int] = {}
        need: list[list[FlatGroup]] = []
        for k, sg in enumerate(todo):
            groups = unique_groups(offload.group_of(i) for i in sg.pieces)
            need.append(groups)
            for g in groups:
                self.last_of[id(g)] = k
        # every piece of an updated sub-group is compared with its master (edits), so all its shards
        self.shards = ShardWindow(offload.shard_access, need, blank)
        self._issue_reads(block=True)

    # ---- progress ------------------------------------------------------------------------------
    def pending(self, group: FlatGroup) -> bool:
        """True while a sub-group holding a piece of ``group`` is not updated yet."""
        return not self.done and self.last_of.get(id(group), -1) >= self.next

    def ready_for(self, group: FlatGroup) -> None:
        """Update every sub-group up to the last one holding a piece of ``group`` (waiting for their
        reads), then whatever else is ready. A no-op inside an update of this loop."""
        if self.done or self._busy:
            return
        self.advance(self.last_of.get(id(group), -1))
        self.pump()

    def pump(self) -> None:
        """Update the sub-groups whose reads have landed and issue reads into drained buffers;
        never waits for a transfer."""
        if self.done or self._busy:
            return
        self._issue_reads(block=False)
        while self.next < len(self.todo) and self.reads[self.next].done():
            self._update_next()
            self._issue_reads(block=False)
        if self.next == len(self.todo):
            self.finish()

    def advance(self, last: int) -> None:
        """Update sub-groups ``next .. last`` (positions in ``todo``), waiting for their reads."""
        while self.next <= min(last, len(self.todo) - 1):
            self._issue_reads(block=True)
            self._update_next()

    def finish(self) -> None:
        """Update every remaining sub-group, wait for the last writes, then run ``on_done``."""
        if self.done:
            return
        self.advance(len(self.todo) - 1)
        self.done = True
        try:
            self.shards.close()
        finally:
            for h in self.writes.values():
                self._wait(h, "write")
            self.writes.clear()
        io = self.off.swap_io
        s = self.stats
        s.bytes_read, s.bytes_written = io.bytes_read - self._r0, io.bytes_written - self._w0
        s.seconds = time.perf_counter() - self._t0
        s.io_busy_seconds = io.busy_seconds - self._b0
        self.on_done()

    def abandon(self) -> None:
        """Stop without updating the rest (the job is closing): wait for the transfers in flight."""
        self.done = True
        for h in list(self.reads.values()) + list(self.writes.values()):
            h.wait()
        self.reads.clear()
        self.writes.clear()
        self.shards.close(complete=False)

    # ---- one sub-group -------------------------------------------------------------------------
    def _issue_reads(self, block: bool) -> None:
        """Issue reads for ``todo[next .. next + ahead]`` whose buffers are free; with ``block``, wait
        for the writes that hold them (``next``'s own read is always issued)."""
        limit = min(len(self.todo), self.next + self.ahead + 1)
        while self.issued < limit:
            slot = self.issued % self.nbuf
            w = self.writes.get(slot)
            if w is not None:
                if not block and not w.done() and self.issued > self.next:
                    return
                self._wait(self.writes.pop(slot), "write")
            sg = self.todo[self.issued]
            self.reads[self.issued] = self.off.read_region(self.off.buffers[slot][: sg.nbytes], sg.offset)
            if self.on_read is not None:
                self.on_read(sg, slot)
            self.issued += 1

    def _update_next(self) -> None:
        k = self.next
        sg = self.todo[k]
        self._wait(self.reads.pop(k), "read")
        self._busy = True
        try:
            self.shards.enter(k)
            buf = self.off.buffers[k % self.nbuf][: sg.nbytes]
            t1 = time.perf_counter()
            old = self.hyper.swap(self.optimizer)
            try:
                self.update(sg, buf)
            finally:
                old.swap(self.optimizer)
            self.stats.update_seconds += time.perf_counter() - t1
            self.shards.leave(k)
        finally:
            self._busy = False
        self.writes[k % self.nbuf] = self.off.write_region(buf, sg.offset)
        if not self.overlap:
            self._wait(self.writes.pop(k % self.nbuf), "write")
        self.next = k + 1

    def _wait(self, h: IOHandle, kind: str) -> None:
        t = time.perf_counter()
        h.wait()
        dt = time.perf_counter() - t
        if kind == "read":
            self.stats.read_wait_seconds += dt
        else:
            self.stats.write_wait_seconds += dt


__all__ = ["SwapStats", "SubGroupPipeline"]
