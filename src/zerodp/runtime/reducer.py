"""Gradient reduction during backward, one strategy per stage (chosen once, not checked per hook).

Each trainable parameter gets one post-accumulate-grad hook. When every parameter of a bucket has its
gradient for the current micro-step, the bucket's collective is launched (asynchronously when
``overlap_comm``), so communication overlaps the rest of backward. Buckets whose parameters got no
gradient are launched when backward returns (their missing gradients are zeros).

- :class:`AllReduceReducer` (stage 0): gradients live in a full flat gradient buffer that ``param.grad``
  views; each bucket is all-reduced in place at the gradient accumulation boundary.
  Under bf16/fp16 with fp32 ``accumulate_dtype`` (:mod:`zerodp.runtime.precision`) the buffer is fp32:
  each arriving ``param.grad`` is added into it and set to None; it is reduced in fp32.
- :class:`FullGradReduceScatter` (stage 1): the same full gradient buffer, but each bucket is
  reduce-scattered at the boundary; the owned shard is written back into the buffer's owned range.
- :class:`PartitionedGradReducer` (stage 2): there is no full gradient buffer. Each gradient is copied
  into its bucket's staging buffer and freed at once; a complete bucket is reduce-scattered every
  micro-step and the result accumulated into the owned gradient partition (fp32 when params are).
  Gradient memory peaks at the staging buffers in flight plus the owned partition.

All strategies pre-divide by the world size, so the owned gradient is the data-parallel mean.
Every rank also records which parameters received a gradient (on any micro-step since the last
boundary); :meth:`GradientReducer.presence` all-reduces those flags so every rank skips exactly the
parameters that no rank produced a gradient for, as torch's optimizer does for ``grad is None``.

[Note: repeated accumulation] A parameter's gradient may be accumulated more than once in one backward
(``torch.utils.checkpoint(..., use_reentrant=True)`` around two uses of one module runs one inner
backward per segment; so does ``torch.autograd.backward`` on several roots sharing a leaf). Its bucket
must then be reduced once, after the last contribution. The first micro-step is a calibration step:
every bucket is launched when backward returns, and each rank counts the hook calls per parameter;
one all-reduce (MAX) tells every rank whether any parameter was accumulated more than once; if so,
buckets are always launched when backward returns, otherwise as soon as they are complete (a later
repeated accumulation into an already-reduced bucket raises instead of being lost).
"""

from __future__ import annotations

import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

import torch
from torch.distributed import ProcessGroup, ReduceOp, Work
from torch.utils.hooks import RemovableHandle

from zerodp.runtime import comm
from zerodp.runtime.coalesce import coalesced, runs_of_same_kind
from zerodp.runtime.comm import CommLedger
from zerodp.runtime.partition import Bucket, FlatGroup, ParamSlot, zero_unwritten
from zerodp.runtime.streams import SideStream
from zerodp.runtime.zero_pages import ZeroPageBuffer

#: collectives (one bucket, or one coalesced group of stage-3 buckets) that may be in flight at once
#: while backward goes on (launching another first waits for the oldest): bounds staging memory.
MAX_BUCKETS_IN_FLIGHT = 2

#: raised (RuntimeError) when a gradient arrives outside ``engine.backward(loss)``.
DIRECT_BACKWARD_MESSAGE = (
    "loss.backward() was called on a model wrapped by a zerodp engine; call engine.backward(loss) "
    "instead (it divides the loss by gradient_accumulation_steps, applies the fp16 loss scale and "
    "reduces the gradients across ranks during backward), then engine.step()")
DROPPED_ENGINE_MESSAGE = (
    "loss.backward() was called on a model whose zerodp engine was dropped; its parameters are still laid "
    "out for that engine (a model is wrapped once): keep the engine and call engine.backward(loss), or "
    "build a new model")


class StagingPool(Protocol):
    """Lends memory for gradient staging buffers (stage 3: :class:`zerodp.stage3.pool.GatherPool`)."""

    def empty_tensor(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor: ...

    def take_back(self, t: torch.Tensor) -> bool: ...


def _trainable(s: ParamSlot) -> bool:
    return s.group_index >= 0 and s.param.requires_grad


def _async_work(work: Work | None) -> Work:
    """The ``Work`` of a collective issued with ``async_op=True``."""
    assert work is not None, "a collective issued with async_op=True returns its Work"
    return work


#: what a strategy keeps with each bucket in flight until its collective completes (``_complete``)
PayloadT = TypeVar("PayloadT")
#: the partitioned strategy's payload: (staging buffer, separate receive buffer or None, all-to-all
#: scratch or None)
StagedPayload = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]


class GradientReducer(Generic[PayloadT]):
    """Base: bookkeeping shared by the three strategies. See the module docstring."""

    collective_purpose = "gradients"
    folds = False  # param.grad is added into a buffer of another dtype (stages 0-1, see _FullGradBuffer)

    def __init__(
        self, groups: list[FlatGroup], rank: int, world_size: int, group: ProcessGroup | None,
        ledger: CommLedger, overlap_comm: bool, accumulate_dtype: torch.dtype | None = None,
        on_reduced: Callable[[FlatGroup, Bucket], None] | None = None) -> None:
        self.groups = groups
        #: dtype gradients accumulate in across micro-steps (None: each group's parameter dtype)
        self.accumulate_dtype = accumulate_dtype
        self.rank = rank
        self.world_size = world_size
        self.pg = group
        self.ledger = ledger
        self.overlap = overlap_comm
        # parameters that get hooks and gradients: trainable and in one of the user's param groups
        self.slots: list[ParamSlot] = [s for g in groups for s in g.slots if _trainable(s)]
        n_slots = max((s.index for g in groups for s in g.slots), default=-1) + 1
        self._present = torch.zeros(n_slots, dtype=torch.int32)
        # numpy views sharing the flags' memory: the per-gradient hooks index them ~50x cheaper than
        # the tensors (one torch op per index costs microseconds; see docs/benchmarks/2026-12-01-bench.md)
        self._present_np = self._present.numpy()
        self._slot_bucket: dict[int, tuple[FlatGroup, Bucket]] = {
            s.index: (g, b) for g in groups for b in g.buckets for s in b.slots
        }
        self._pending: dict[int, int] = {}  # id(bucket) -> params still to arrive this micro-step
        self._launched: set[int] = set()  # id(bucket) reduced this micro-step
        self._count = torch.zeros(n_slots, dtype=torch.int32)  # hook calls per parameter this micro-step
        self._count_np = self._count.numpy()
        self._deferred = True  # launch every bucket when backward returns (see the note)
        self._calibrated = False
        self._reducing = False
        self._in_backward = False  # between begin_micro_step and end_micro_step
        # one entry per collective: its Work and the (bucket, group, payload) of every bucket it reduces
        self._in_flight: deque[tuple[Work | comm.AllOf, list[tuple[Bucket, FlatGroup, PayloadT]]]] = deque()
        self.wait_seconds = 0.0  # time the training thread blocked in this reducer's waits (perf_counter)
        #: collectives are issued here once the compute stream's gradient-ready event is passed, and the
        #: compute stream waits for each one's completion event before using or reusing its buffers
        #: (see [Note: comm streams] in zerodp.runtime.streams; no-ops on the CPU)
        self.stream = SideStream(groups[0].buffer.device if groups else torch.device("cpu"), "reduce")
        self.peak_grad_bytes = 0
        self._handles: list[RemovableHandle] = []
        #: called as ``on_reduced(group, bucket)`` right after a bucket's collective completed and its
        #: result was stored (piece_grad of its owned range is then final for this micro-step): the
        #: engine's gradient streaming to an optimizer offload; None: nothing to call
        self.on_reduced = on_reduced
        #: called with the (group index, bucket index) list of the buckets one collective reduces (one
        #: bucket, or a coalesced stage-3 group) just before it is launched (the backward agreement's
        #: tag, :mod:`zerodp.runtime.backward_agreement`); None: no check
        self.launch_check: Callable[[list[tuple[int, int]]], None] | None = None
        self.defer_once = False  # this micro-step only: launch every bucket when backward returns

    # ---- hook wiring -------------------------------------------------------------------------------
    def attach(self) -> None:
        """Register one post-accumulate-grad hook per trainable parameter (the only hooks we add)."""
        for position, s in enumerate(self.slots):
            self._handles.append(s.param.register_post_accumulate_grad_hook(self._make_hook(position)))

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _make_hook(self, position: int):
        # The hook lives on the parameter; a strong reference from it to the reducer or to the slot
        # (both reach the parameter) would make a cycle through the parameter's hook dict that Python's
        # gc does not collect: every engine (parameters, flat buffers, optimizer states) would stay alive
        # after the user dropped it. Hence only a weak reference and the slot's position in ``slots``.
        reducer = weakref.ref(self)

        def hook(param: torch.nn.Parameter) -> None:
            owner = reducer()
            if owner is None:  # refused as when alive: whether gc collected it differs between ranks
                raise RuntimeError(DROPPED_ENGINE_MESSAGE)
            owner._hook(owner.slots[position], param)

        return hook

    def _hook(self, slot: ParamSlot, param: torch.nn.Parameter) -> None:
        if not self._in_backward:  # a plain loss.backward(): nothing would be reduced or scaled
            raise RuntimeError(DIRECT_BACKWARD_MESSAGE)
        if param.grad is not None and param.grad.layout != torch.strided:
            raise RuntimeError(f"parameter '{slot.name}' received a {param.grad.layout} gradient; zerodp "
                               "reduces dense gradients only (use sparse=False in nn.Embedding)")
        self._count_np[slot.index] += 1
        if self._count_np[slot.index] > 1:
            _, b = self._slot_bucket[slot.index]
            if id(b) in self._launched:
                raise RuntimeError(
                    f"parameter '{slot.name}' received another gradient contribution in this backward "
                    "after its bucket was reduced (the first micro-step had none: reentrant "
                    "checkpointing or a repeated backward through a shared parameter started later). "
                    "Use the same structure from the first micro-step, or use_reentrant=False")
        self._on_grad(slot, param)

    # ---- micro-step protocol -----------------------------------------------------------------------
    def begin_micro_step(self, reduce: bool, defer: bool = False) -> None:
        """Called before backward. ``reduce``: launch collectives during this backward; ``defer``: only
        when it returns, every bucket in one order (the ranks' backward graphs reach different parameters)."""
        self._reducing = reduce
        self.defer_once = defer
        self._in_backward = True
        self._pending = {id(b): sum(map(_trainable, b.slots)) for g in self.groups for b in g.buckets}
        self._launched = set()
        self._count.zero_()

    def end_micro_step(self) -> None:
        """Called after backward returns: launch buckets still waiting, then wait for all collectives."""
        if self._reducing:
            for g in self.groups:
                for b in g.buckets:
                    if id(b) not in self._launched:  # deferred, or some parameters got no gradient (0)
                        self._pending[id(b)] = 0
                        self._launched.add(id(b))
                        self._launch(g, b)
        self._flush()
        self._drain(0)
        self._reducing = False
        self.defer_once = False
        if not self._calibrated:
            repeated = torch.tensor([int(bool((self._count > 1).any()))], dtype=torch.int32)
            if self.world_size > 1:
                comm.all_reduce(repeated, self.pg, self.ledger, "grad_reuse_check", op=ReduceOp.MAX)
            self._deferred = bool(repeated.item())
            self._calibrated = True
        self._in_backward = False

    def presence(self, overflow: bool = False) -> tuple[torch.Tensor, bool]:
        """One small all-reduce (MAX) of the per-parameter "received a gradient" flags and of this
        rank's overflow flag. Returns (int32[num_params] flags, whether any rank overflowed)."""
        flags = torch.cat([self._present, torch.tensor([int(overflow)], dtype=torch.int32)])
        if self.world_size > 1:
            comm.all_reduce(flags, self.pg, self.ledger, "grad_presence", op=ReduceOp.MAX)
        return flags[:-1], bool(flags[-1])

    def presence_flags(self) -> torch.Tensor:
        """This rank's int32 "received a gradient since the last boundary" flag per parameter slot."""
        return self._present

    def restrict_presence(self, before: torch.Tensor, reached: set[int]) -> None:
        """Keep the flags set since ``before`` (a copy of :meth:`presence_flags`) only for parameters
        whose ``id`` is in ``reached`` (see :mod:`zerodp.runtime.backward_roots`)."""
        for s in self.slots:
            if not before[s.index] and id(s.param) not in reached:
                self._present[s.index] = 0

    def zero_grads(self) -> None:
        """After the optimizer step: forget gradients and presence flags."""
        self._present.zero_()

    # ---- to be provided by each strategy -----------------------------------------------------------
    def _on_grad(self, slot: ParamSlot, param: torch.nn.Parameter) -> None:
        raise NotImplementedError

    def _launch(self, g: FlatGroup, b: Bucket) -> None:
        raise NotImplementedError

    def _complete(self, g: FlatGroup, b: Bucket, payload: PayloadT) -> None:
        """Runs after bucket ``b``'s collective finished."""

    def _flush(self) -> None:
        """Launch collectives held back for coalescing (end of backward)."""

    def owned_grad(self, g: FlatGroup) -> torch.Tensor:
        """1-D tensor indexed like ``g.buffer`` restricted to what this rank owns (see piece_grad)."""
        raise NotImplementedError

    def piece_grad(self, g: FlatGroup, lo: int, hi: int) -> torch.Tensor:
        """The averaged gradient of flat range [lo, hi) of ``g`` (which this rank owns)."""
        raise NotImplementedError

    def held_grad(self, g: FlatGroup, lo: int, hi: int) -> torch.Tensor | None:
        return self.piece_grad(g, lo, hi)  # None where a spill holds it (zerodp.runtime.grad_spill)

    def held_bytes(self) -> dict[str, int]:
        """Bytes currently held: {'gradients': ..., 'comm_buffers': ...}."""
        raise NotImplementedError

    # ---- shared helpers ----------------------------------------------------------------------------
    def _ready(self, slot: ParamSlot, g: FlatGroup, b: Bucket) -> None:
        if self._count_np[slot.index] > 1:
            return  # a repeated contribution to a bucket not yet launched: already counted
        self._pending[id(b)] -= 1
        if self._pending[id(b)] == 0 and not (self._deferred or self.defer_once):
            self._launched.add(id(b))
            self._launch(g, b)

    def _check_launch(self, buckets: list[tuple[FlatGroup, Bucket]]) -> None:
        """One collective reducing ``buckets`` is about to be launched (see ``launch_check``)."""
        if self.launch_check is not None:
            self.launch_check([(g.index, b.index) for g, b in buckets])

    def _track(self, work: Work | comm.AllOf, entries: list[tuple[Bucket, FlatGroup, PayloadT]]) -> None:
        """Hold ``work`` (one collective reducing the buckets of ``entries``) until it is drained."""
        self._in_flight.append((work, entries))
        self._note_peak()
        self._drain(MAX_BUCKETS_IN_FLIGHT if self.overlap else 0)

    def _drain(self, keep: int) -> None:
        while len(self._in_flight) > keep:
            work, entries = self._in_flight.popleft()
            t0 = time.perf_counter()
            self.stream.done(work)  # the buckets' buffers are read or reused only after this
            self.wait_seconds += time.perf_counter() - t0
            for b, g, payload in entries:
                self._complete(g, b, payload)
                if self.on_reduced is not None:
                    self.on_reduced(g, b)
                self._after_reduced(g)

    def _after_reduced(self, g: FlatGroup) -> None:
        """After each bucket of ``g`` was reduced and passed to ``on_reduced`` (a spill's hook)."""

    def _note_peak(self) -> None:
        self.peak_grad_bytes = max(self.peak_grad_bytes, sum(self.held_bytes().values()))


class _FullGradBuffer(GradientReducer[PayloadT]):
    """Stages 0 and 1: ``param.grad`` views a full flat gradient buffer per group, or is added into it
    and dropped when the buffer is fp32 and the parameters are not (:attr:`folds`)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # zeroed by giving their pages back to the kernel, so they hold memory only once backward
        # writes into them, as DDP's gradients do (zerodp.runtime.zero_pages)
        self._zero_pages = {g.index: ZeroPageBuffer.like(g.buffer, dtype=self.accumulate_dtype) for g in self.groups}
        self.grad_buffers: dict[int, torch.Tensor] = {i: z.tensor for i, z in self._zero_pages.items()}
        self.folds = any(self.grad_buffers[g.index].dtype != g.buffer.dtype for g in self.groups)
        self._views: dict[int, torch.Tensor] = {}
        for g in self.groups:
            for s in g.slots:
                view = s.view(self.grad_buffers[g.index][s.offset : s.offset + s.numel])
                self._views[s.index] = view
                if not self.folds:
                    s.param.grad = view

    def _on_grad(self, slot: ParamSlot, param: torch.nn.Parameter) -> None:
        view = self._views[slot.index]
        if self.folds:  # all this backward's contributions so far (and any .grad the user left): add, drop
            if param.grad is not None:
                view.add_(param.grad)
                param.grad = None
        elif param.grad is not view:
            # Someone replaced .grad (e.g. module.zero_grad(set_to_none=True)): fold it back in.
            if param.grad is not None and param.grad.data_ptr() != view.data_ptr():
                view.add_(param.grad)
            param.grad = view
        self._present_np[slot.index] = 1
        if self._reducing:
            g, b = self._slot_bucket[slot.index]
            self._ready(slot, g, b)

    def zero_grads(self) -> None:
        super().zero_grads()
        for buf in self._zero_pages.values():
            buf.zero_()
        for s in self.slots:  # restore views if the user set grads to None
            s.param.grad = None if self.folds else self._views[s.index]

    #: after its collective, the buffer holds the averaged gradient everywhere (all-reduce), not only
    #: in the owned ranges (reduce-scatter)
    full_after_reduce = False

    def end_micro_step(self) -> None:
        reduced = self._reducing
        super().end_micro_step()
        if self.world_size > 1 and not (reduced and self.full_after_reduce) and not self.folds:
            # the buffer holds this rank's local sum (or, after a reduce-scatter, the average only in
            # the owned ranges): a ``param.grad`` that looks valid but is not the averaged gradient
            # must not be visible (zerodp.zero.safe_get_full_grad gives it). The next backward folds
            # its gradients back into the buffer (see _on_grad); zero_grads() restores the views.
            for s in self.slots:
                s.param.grad = None

    def piece_grad(self, g: FlatGroup, lo: int, hi: int) -> torch.Tensor:
        return self.grad_buffers[g.index][lo:hi]

    def _bucket_grad(self, g: FlatGroup, b: Bucket) -> torch.Tensor:
        return self.grad_buffers[g.index][b.start : b.start + b.numel]


class AllReduceReducer(_FullGradBuffer[None]):
    """Stage 0: plain data parallelism, in-place all-reduce per bucket at the boundary."""

    full_after_reduce = True

    def _launch(self, g: FlatGroup, b: Bucket) -> None:
        self._check_launch([(g, b)])
        grad = self._bucket_grad(g, b)
        grad.div_(self.world_size)
        self.stream.after_compute()  # the bucket's gradients are complete on the compute stream
        with self.stream.issuing():
            work = comm.all_reduce(grad, self.pg, self.ledger, self.collective_purpose, async_op=True)
        self._track(_async_work(work), [(b, g, None)])

    def held_bytes(self) -> dict[str, int]:
        return {"gradients": sum(t.numel() * t.element_size() for t in self.grad_buffers.values()),
                "comm_buffers": 0}


class FullGradReduceScatter(_FullGradBuffer[torch.Tensor]):
    """Stage 1: full gradients kept between micro-steps; reduce-scatter per bucket at the boundary.

    A second ``engine.backward`` on the boundary micro-step (before ``step()``) reduces again: the
    buffer's non-owned ranges still hold this rank's already-reduced local gradient, so the owned
    averages are set aside, the buffer is zeroed, and each new owned average is added to them.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._reduced = False  # a reduce-scatter happened since zero_grads()
        self._carry: dict[int, torch.Tensor] = {}  # id(bucket) -> owned average set aside

    def begin_micro_step(self, reduce: bool, defer: bool = False) -> None:
        super().begin_micro_step(reduce, defer)
        if reduce and self._reduced:
            for g in self.groups:
                for b in g.buckets:
                    lo, hi = b.shard_range(self.rank)
                    self._carry[id(b)] = self.grad_buffers[g.index][lo:hi].clone()
                self.grad_buffers[g.index].zero_()

    def _launch(self, g: FlatGroup, b: Bucket) -> None:
        self._check_launch([(g, b)])
        grad = self._bucket_grad(g, b)
        grad.div_(self.world_size)
        recv = torch.empty(b.shard_numel, dtype=grad.dtype, device=grad.device)
        self.stream.after_compute()  # the bucket's gradients are complete on the compute stream
        with self.stream.issuing():
            work = comm.reduce_scatter(recv, grad, self.pg, self.ledger, self.collective_purpose, async_op=True)
        self._track(_async_work(work), [(b, g, recv)])

    def _complete(self, g: FlatGroup, b: Bucket, payload: torch.Tensor) -> None:
        lo, hi = b.shard_range(self.rank)
        owned = self.grad_buffers[g.index][lo:hi]
        owned.copy_(payload)
        carry = self._carry.pop(id(b), None)
        if carry is not None:
            owned.add_(carry)
        self._reduced = True

    def zero_grads(self) -> None:
        super().zero_grads()
        self._reduced = False
        self._carry.clear()

    def held_bytes(self) -> dict[str, int]:
        recv = sum(p.numel() * p.element_size() for _, entries in self._in_flight for _, _, p in entries)
        return {"gradients": sum(t.numel() * t.element_size() for t in self.grad_buffers.values()),
                "comm_buffers": recv}


class PartitionedGradReducer(GradientReducer[StagedPayload]):
    """Stage 2: bucketed reduce-scatter every micro-step; only the owned gradient partition is kept.

    ``contiguous_gradients=True`` copies each gradient into its bucket's staging buffer as soon as it
    is produced and frees it (lowest memory); ``False`` keeps the parameters' own ``.grad`` tensors
    until the bucket is complete and flattens them then (one copy fewer per element, more memory).
    """

    def __init__(self, *args, contiguous_gradients: bool = True,
                 staging_pool: StagingPool | None = None, coalesce_elements: int = 0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.contiguous = contiguous_gradients
        # stage 3 (one bucket per unit): complete buckets are held until they reach this many elements,
        # then reduce-scattered in one coalesced collective (0: each at once); see zerodp.runtime.coalesce
        self.coalesce_elements = coalesce_elements
        self._held: list[tuple[FlatGroup, Bucket]] = []
        self._held_numel = 0
        self.reduce_collectives = 0  # collectives launched (coalesced ones count once)
        self.staging_pool = staging_pool  # stage 3: staging memory lent by the gather pool
        # owned gradient partition per group: shard of every bucket back to back, 1-D
        self._owned_offsets: dict[tuple[int, int], int] = {}
        self.owned: dict[int, torch.Tensor] = {}
        #: (group index, elements, dtype) of each group's owned partition (accumulate_dtype: fp32 in mixed precision,
        #: see precision.py)
        self.owned_sizes: list[tuple[int, int, torch.dtype]] = []
        for g in self.groups:
            off = 0
            for b in g.buckets:
                self._owned_offsets[(g.index, b.index)] = off
                off += b.shard_numel
            self.owned_sizes.append((g.index, off, self.accumulate_dtype or g.buffer.dtype))
        self._allocate_owned()
        self._staging: dict[int, torch.Tensor] = {}  # id(bucket) -> staging buffer being filled
        self._owned_written: set[int] = set()  # id(bucket) whose owned slice holds data since zeroing

    def _allocate_owned(self) -> None:
        """Every group's owned partition, zeroed, held from now on (:mod:`zerodp.runtime.grad_spill`: not)."""
        for (index, numel, dtype), g in zip(self.owned_sizes, self.groups, strict=False):
            self.owned[index] = torch.zeros(numel, dtype=dtype, device=g.buffer.device)

    def _owned_of(self, g: FlatGroup, first: bool) -> torch.Tensor | None:
        """``g``'s owned partition (``first``: first reduction since zero_grads; else a spill may give None)."""
        return self.owned[g.index]

    def _staging_for(self, b: Bucket, g: FlatGroup) -> torch.Tensor:
        """The bucket's staging buffer, created uninitialised: every gradient is copied over its
        slot's range, and :meth:`_prepare` zeroes what no gradient wrote (padding, parameters without
        a gradient) before the collective, so the bucket is not zeroed first in full."""
        buf = self._staging.get(id(b))
        if buf is None:
            if self.staging_pool is not None:
                buf = self.staging_pool.empty_tensor(b.numel, g.buffer.dtype, g.buffer.device)
            else:
                buf = torch.empty(b.numel, dtype=g.buffer.dtype, device=g.buffer.device)
            self._staging[id(b)] = buf
            self._note_peak()
        return buf

    def _on_grad(self, slot: ParamSlot, param: torch.nn.Parameter) -> None:
        self._present_np[slot.index] = 1
        g, b = self._slot_bucket[slot.index]
        if self.contiguous:
            buf = self._staging_for(b, g)
            rel = slot.offset - b.start
            target = buf[rel : rel + slot.numel]
            grad = param.grad
            assert grad is not None, "a post-accumulate-grad hook runs with the gradient accumulated"
            if self._count_np[slot.index] > 1:  # repeated accumulation (see the note): add, not overwrite
                target.add_(slot.flat_values(grad))
            else:
                target.copy_(slot.flat_values(grad))
            param.grad = None
        self._ready(slot, g, b)

    def _launch(self, g: FlatGroup, b: Bucket) -> None:
        if self.coalesce_elements <= 0:
            self._launch_now([(g, b)])
            return
        self._held.append((g, b))
        self._held_numel += b.numel
        if self._held_numel >= self.coalesce_elements:
            self._flush()

    def _flush(self) -> None:
        held, self._held, self._held_numel = self._held, [], 0
        if held:
            self._launch_now(held)

    def _launch_now(self, buckets: list[tuple[FlatGroup, Bucket]]) -> None:
        """Reduce-scatter the staging buffers of ``buckets``; consecutive ones of one dtype and device
        go in one coalesced collective."""
        prepared = [(g, b, *self._prepare(g, b)) for g, b in buckets]
        for run in runs_of_same_kind(prepared, lambda x: (x[2].dtype, x[2].device, x[3].dtype)):
            self._check_launch([(g, b) for g, b, _, _, _ in run])
            # on gloo, all-to-alls: not coalescable, cheaper apart, receiving into staging-pool buffers
            apart = comm.sums_by_all_to_all(run[0][2], self.pg)
            scratch = [self._receive_buffer(buf) if apart else None for _, _, buf, _, _ in run]
            launches = [lambda buf=buf, out=out, rx=rx: comm.reduce_scatter(
                            out, buf, self.pg, self.ledger, self.collective_purpose, async_op=True, received=rx)
                        for (_, _, buf, out, _), rx in zip(run, scratch, strict=True)]
            self.stream.after_compute()  # the buckets' staging buffers are written on the compute stream
            with self.stream.issuing():
                work = comm.AllOf([_async_work(launch()) for launch in launches]) if apart \
                    else _async_work(coalesced(self.pg, launches))
            self.reduce_collectives += 1
            self._track(work, [(b, g, (buf, recv, rx)) for (g, b, buf, _, recv), rx in zip(run, scratch, strict=True)])

    def _receive_buffer(self, buf: torch.Tensor) -> torch.Tensor | None:
        """A buffer like ``buf`` from the staging pool for an all-to-all's received chunks (None
        without a pool: the collective allocates its own)."""
        if self.staging_pool is None:
            return None
        return self.staging_pool.empty_tensor(buf.numel(), buf.dtype, buf.device)

    def _prepare(self, g: FlatGroup, b: Bucket) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(staging buffer divided by N, reduce-scatter output, separate receive buffer or None)."""
        buf = self._staging_for(b, g)
        if self.contiguous:  # _on_grad copied each gradient that arrived this micro-step
            written = [self._count_np[s.index] > 0 for s in b.slots]
        else:
            written = []
            for s in b.slots:
                grad = s.param.grad if _trainable(s) else None
                written.append(grad is not None)
                if grad is not None:
                    rel = s.offset - b.start
                    buf[rel : rel + s.numel].copy_(s.flat_values(grad))
                    s.param.grad = None
        zero_unwritten(buf, b, written)
        del self._staging[id(b)]
        buf.div_(self.world_size)
        off = self._owned_offsets[(g.index, b.index)]
        first = id(b) not in self._owned_written
        self._owned_written.add(id(b))
        whole = self._owned_of(g, first)
        if first:  # the first reduction since zero_grads(): straight into the partition if dtypes agree
            assert whole is not None, "the first reduction since zero_grads() makes the partition"
            if whole.dtype == buf.dtype:
                return buf, whole[off : off + b.shard_numel], None
        recv = torch.empty(b.shard_numel, dtype=buf.dtype, device=buf.device)
        return buf, recv, recv

    def _complete(self, g: FlatGroup, b: Bucket, payload: StagedPayload) -> None:
        buf, recv, received = payload  # the staging buffer is dropped with the payload here
        if self.staging_pool is not None:
            self.staging_pool.take_back(buf)
            if received is not None:
                self.staging_pool.take_back(received)
        if recv is not None:  # accumulate (later micro-steps, or an fp32 partition of bf16 grads)
            off = self._owned_offsets[(g.index, b.index)]
            whole = self._owned_of(g, False)
            assert whole is not None, "a partition accumulated into was made by an earlier reduction"
            whole[off : off + b.shard_numel].add_(recv)

    def piece_grad(self, g: FlatGroup, lo: int, hi: int) -> torch.Tensor:
        for b in g.buckets:
            b_lo, b_hi = b.shard_range(self.rank)
            if b_lo <= lo and hi <= b_hi:
                off = self._owned_offsets[(g.index, b.index)] + (lo - b_lo)
                return self.owned[g.index][off : off + (hi - lo)]
        raise KeyError(f"flat range [{lo}, {hi}) of group {g.index} is not owned by rank {self.rank}")

    def zero_grads(self) -> None:
        super().zero_grads()
        for t in self.owned.values():
            t.zero_()
        self._owned_written.clear()

    def held_bytes(self) -> dict[str, int]:
        owned = sum(t.numel() * t.element_size() for t in self.owned.values())
        staging = sum(t.numel() * t.element_size() for t in self._staging.values())
        flight = sum(sum(t.numel() * t.element_size() for t in payload if t is not None)
                     for _, entries in self._in_flight for _, _, payload in entries)
        return {"gradients": owned + staging, "comm_buffers": flight}
