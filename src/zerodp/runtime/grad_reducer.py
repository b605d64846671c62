"""The gradient reducers' shared base (:class:`GradientReducer`): one post-accumulate-grad hook per
trainable parameter, bucket readiness, the collectives in flight, the per-parameter presence flags,
and the calibration of repeated accumulation. The stage strategies are in
:mod:`zerodp.runtime.full_grad_reducers` (stages 0-1) and :mod:`zerodp.runtime.partitioned_reducer`
(stages 2-3); :mod:`zerodp.runtime.reducer` gives the overview.

[Note: repeated accumulation] A parameter's gradient may be accumulated more than once in one backward
(``torch.utils.checkpoint(..., use_reentrant=True)`` around two uses of one module runs one inner
backward per segment; so does ``torch.autograd.backward`` on several roots sharing a leaf). Its bucket
must then be reduced once, after the last contribution. The first micro-step is a calibration step:
each rank counts the hook calls per parameter; one all-reduce (MAX) tells every rank whether any
parameter was accumulated more than once; if so, buckets are from then on launched when backward
returns, otherwise as soon as they are complete (a later repeated accumulation into an already-reduced
bucket raises instead of being lost). During the calibration step itself the stage-2/3 strategy
(``repairs_late``) launches each bucket as soon as it is complete: a contribution arriving after its
bucket was launched is staged apart (``_on_late_grad``), the ranks agree on the buckets that got one
(in the same all-reduce), and those buckets are reduced once more when backward returns, each rank
sending its late part or zeros, the result added to the partition. Launching every bucket only when
backward returns would hold the staging buffers of every bucket at once: a full unscattered gradient
(2 bytes per parameter in bf16) in the first step, the peak of ZeRO-Infinity's 3.8B run
(docs/benchmarks/2026-12-02-infinity-2.4x.md). The stage-0/1 strategies hold a full gradient buffer
anyway and still launch every bucket when the calibration step's backward returns.
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
from zerodp.runtime.comm import CommLedger
from zerodp.runtime.partition import Bucket, FlatGroup, ParamSlot
from zerodp.runtime.streams import SideStream

#: collectives (one bucket, or one coalesced group of stage-3 buckets) that may be in flight at once
#: while backward goes on (launching another first waits for the oldest): bounds staging memory.
MAX_BUCKETS_IN_FLIGHT = 2

#: raised (RuntimeError) when a gradient arrives outside ``engine.backward(loss)``.
DIRECT_BACKWARD_MESSAGE = (
    "loss.backward() was called on a model wrapped by a zerodp engine; call engine.backward(loss) "
    "instead (it divides the loss by gradient_accumulation_steps, applies the fp16 loss scale and "
    "reduces the gradients across ranks during backward), then engine.step()"
)
DROPPED_ENGINE_MESSAGE = (
    "loss.backward() was called on a model whose zerodp engine was dropped; its parameters are still laid "
    "out for that engine (a model is wrapped once): keep the engine and call engine.backward(loss), or "
    "build a new model"
)


class StagingPool(Protocol):
    """Lends memory for gradient staging buffers (stage 3: :class:`zerodp.stage3.pool.GatherPool`)."""

    def empty_tensor(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor: ...

    def take_back(self, t: torch.Tensor) -> bool: ...


def trainable(s: ParamSlot) -> bool:
    """``s`` gets a hook and a gradient: in one of the user's param groups and ``requires_grad``."""
    return s.group_index >= 0 and s.param.requires_grad


def async_work(work: Work | None) -> Work:
    """The ``Work`` of a collective issued with ``async_op=True``."""
    assert work is not None, "a collective issued with async_op=True returns its Work"
    return work


#: what a strategy keeps with each bucket in flight until its collective completes (``_complete``)
PayloadT = TypeVar("PayloadT")


class GradientReducer(Generic[PayloadT]):
    """Base: bookkeeping shared by the three strategies. See the module docstring."""

    collective_purpose = "gradients"
    folds = False  # param.grad is added into a buffer of another dtype (stages 0-1, see _FullGradBuffer)
    #: the calibration step launches complete buckets at once and repairs late contributions (module docstring)
    repairs_late = False

    def __init__(
        self,
        groups: list[FlatGroup],
        rank: int,
        world_size: int,
        group: ProcessGroup | None,
        ledger: CommLedger,
        overlap_comm: bool,
        accumulate_dtype: torch.dtype | None = None,
        on_reduced: Callable[[FlatGroup, Bucket], None] | None = None,
        launch_check: Callable[[list[tuple[int, int]]], None] | None = None,
    ) -> None:
        self.groups = groups
        #: dtype gradients accumulate in across micro-steps (None: each group's parameter dtype)
        self.accumulate_dtype = accumulate_dtype
        self.rank = rank
        self.world_size = world_size
        self.pg = group
        self.ledger = ledger
        self.overlap = overlap_comm
        # parameters that get hooks and gradients: trainable and in one of the user's param groups
        self.slots: list[ParamSlot] = [s for g in groups for s in g.slots if trainable(s)]
        n_slots = max((s.index for g in groups for s in g.slots), default=-1) + 1
        self._present = torch.zeros(n_slots, dtype=torch.int32)
        # numpy views sharing the flags' memory: the per-gradient hooks index them far more cheaply than
        # the tensors, a torch op per index (docs/benchmarks/2026-12-01-bench.md)
        self._present_np = self._present.numpy()
        self._slot_bucket: dict[int, tuple[FlatGroup, Bucket]] = {
            s.index: (g, b) for g in groups for b in g.buckets for s in b.slots
        }
        self._pending: dict[int, int] = {}  # id(bucket) -> params still to arrive this micro-step
        self._launched: set[int] = set()  # id(bucket) reduced this micro-step
        self._count = torch.zeros(n_slots, dtype=torch.int32)  # hook calls per parameter this micro-step
        self._count_np = self._count.numpy()
        self._deferred = not self.repairs_late  # launch every bucket when backward returns (see the note above)
        self._calibrated = False
        #: calibration step: id(bucket) -> (group, bucket) of launched buckets that got a later contribution
        self._late: dict[int, tuple[FlatGroup, Bucket]] = {}
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
        self.launch_check = launch_check
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
            raise RuntimeError(
                f"parameter '{slot.name}' received a {param.grad.layout} gradient; zerodp "
                "reduces dense gradients only (use sparse=False in nn.Embedding)"
            )
        self._count_np[slot.index] += 1
        if self._count_np[slot.index] > 1:
            _, b = self._slot_bucket[slot.index]
            if id(b) in self._launched and self.repairs_late and not self._calibrated:
                self._late[id(b)] = self._slot_bucket[slot.index]
                self._on_late_grad(slot, param)
                return
            if id(b) in self._launched:
                raise RuntimeError(
                    f"parameter '{slot.name}' received another gradient contribution in this backward "
                    "after its bucket was reduced (the first micro-step had none: reentrant "
                    "checkpointing or a repeated backward through a shared parameter started later). "
                    "Use the same structure from the first micro-step, or use_reentrant=False"
                )
        self._on_grad(slot, param)

    # ---- micro-step protocol -----------------------------------------------------------------------
    def begin_micro_step(self, reduce: bool, defer: bool = False) -> None:
        """Called before backward. ``reduce``: launch collectives during this backward; ``defer``: only
        when it returns, every bucket in one order (the ranks' backward graphs reach different parameters)."""
        self._reducing = reduce
        self.defer_once = defer
        self._in_backward = True
        self._pending = {id(b): sum(map(trainable, b.slots)) for g in self.groups for b in g.buckets}
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
        if not self._calibrated:
            self._calibrate()
        self._reducing = False
        self.defer_once = False
        self._in_backward = False

    def _calibrate(self) -> None:
        """End of the calibration step (see the note above): one all-reduce (MAX) of "some parameter
        was accumulated more than once" and, with ``repairs_late``, of one flag per bucket "a
        contribution arrived after its launch"; the flagged buckets are reduced again."""
        buckets = [(g, b) for g in self.groups for b in g.buckets] if self.repairs_late else []
        flags = torch.zeros(1 + len(buckets), dtype=torch.int32)
        flags[0] = int(bool((self._count > 1).any()))
        for k, (_, b) in enumerate(buckets):
            flags[1 + k] = int(id(b) in self._late)
        if self.world_size > 1:
            comm.all_reduce(flags, self.pg, self.ledger, "grad_reuse_check", op=ReduceOp.MAX)
        self._deferred = bool(flags[0].item())
        self._calibrated = True
        late = [gb for gb, flag in zip(buckets, flags[1:].tolist(), strict=True) if flag]
        self._late.clear()
        if late:
            self._reduce_late(late)

    def _on_late_grad(self, slot: ParamSlot, param: torch.nn.Parameter) -> None:
        """Stage a contribution that arrived after its bucket was launched (``repairs_late`` strategies)."""
        raise NotImplementedError

    def _reduce_late(self, buckets: list[tuple[FlatGroup, Bucket]]) -> None:
        """Reduce the late contributions of ``buckets`` (the same list on every rank) into the partition."""
        raise NotImplementedError

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


__all__ = [
    "DIRECT_BACKWARD_MESSAGE",
    "DROPPED_ENGINE_MESSAGE",
    "MAX_BUCKETS_IN_FLIGHT",
    "GradientReducer",
    "PayloadT",
    "StagingPool",
    "async_work",
    "trainable",
]
