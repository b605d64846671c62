"""ZeRO-Offload to NVMe (``offload_optimizer.device = "nvme"``): this rank's fp32 masters and Adam moments
live in a swap file, updated sub-group by sub-group through a fixed pool of aligned buffers while the next
is read and the previous written (DeepSpeed's pipelined optimizer swapper; ZeRO-Infinity, SC21 5.2).

Layout: ``nvme_path/zerodp_<job>/rank<r>/optimizer.swp``. This rank's pieces are grouped in order into
sub-groups of at most ``zero_optimization.sub_group_size`` elements (a larger piece is a sub-group of
its own, as in DeepSpeed). Sub-group k is one contiguous region of the file (masters, ``exp_avg``,
``exp_avg_sq``, each padded to 4096 bytes): one direct-I/O read and one write. Host memory holds
``buffer_count`` buffers of the largest region, one ``step`` scalar per piece, and the gradients:

- CPU training, stages 2-3 without loss scaling: the reduced gradients go to ``gradients.swp`` per
  unit (:mod:`zerodp.offload.grad_swap`), read back per sub-group behind the sub-group's region.
- Otherwise on the CPU: no second copy (:mod:`zerodp.offload.deferred_grads`). The offload reads the
  reducer's partition (unchanged until the step) and records the engine's scale factors (loss
  unscaling, clipping) in order; a piece's fp32 gradient is made just in time in one scratch buffer of
  the largest sub-group by the same fp32 ``copy_`` and ``mul_`` the eager path applies, so the values
  are bitwise the same.
- Gradients on a CUDA device: streamed into an fp32 host buffer per piece during backward on the copy
  stream (:class:`zerodp.offload.host.HostOptimizerOffload`), each sub-group waiting for its own pieces'
  copies only and scaling them then ([Note: lazy scaling] in :mod:`zerodp.offload.host`); the updated masters
  go back through the copy stream and edits are found by fingerprints (:mod:`zerodp.offload.nvme_device`).

With ``offload_param`` on NVMe (stage 3) the engine does not make every parameter shard resident for
the step: the sub-group loop pins the shards of the units whose pieces are in sub-group k just
before updating it (their reads queued while k-1 updated), and unpins them dirty (written home) once
no later sub-group needs them (:class:`ShardAccess`): resident shards are those of about two sub-groups.

During a step, sub-group k's masters and moments are bound to the torch optimizer's parameters and
state (views of the buffer), the optimizer runs on that sub-group only, the masters are cast into the
module's parameters, and the buffer is written back. The kernel is torch's fused CPU Adam/AdamW
(``offload_optimizer.cpu_adam``: within about 1e-6 relative of the non-offloaded engine; ``"same"``:
bitwise). Between steps the masters are empty placeholders and the optimizer has no state in memory
(:meth:`NvmeOptimizerOffload.resident` materialises both for a checkpoint; :mod:`.swap_masters`).

Errors, raised on every rank (collective) before any training state changes: a missing or
unwritable ``nvme_path``, too little free space (bytes needed vs free), a swap file deleted or
replaced under a running job. Swap files are removed by :meth:`close`, at interpreter exit, on
SIGTERM and SIGINT (:mod:`zerodp.offload.swap_dir`) and when this object is garbage-collected.
"""

from __future__ import annotations

import contextlib
import os
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from zerodp.offload import swap_job, swap_masters
from zerodp.offload.aio import AsyncIO, IOHandle, SwapFile, aligned_buffer
from zerodp.offload.config import AioConfig, OffloadOptimizerConfig
from zerodp.offload.cpu_adam import cpu_adam_kernel
from zerodp.offload.deferred_grads import DeferredGradOffload
from zerodp.offload.grad_swap import GradSwap, StepGradReads, open_grad_swap
from zerodp.offload.host import fold_edit, storage_bytes
from zerodp.offload.nvme_device import ModuleWriter, SpanKey, SpanPrints, edited_spans, fold_idle
from zerodp.offload.report import offload_formula
from zerodp.offload.shard_window import ShardAccess, step_current_groups, unique_groups
from zerodp.offload.sizing import BufferLayout, configured_buffers, oversize_warning
from zerodp.offload.step_pipeline import SubGroupPipeline, SwapStats
from zerodp.offload.subgroups import SubGroup
from zerodp.offload.subgroups import plan_subgroups as _plan
from zerodp.offload.swap_job import OffloadError, agree_job_id, raise_if_any_rank_failed, remove_swap_dir
from zerodp.runtime.grad_spill import SpillingGradReducer
from zerodp.runtime.partition import FlatGroup, Piece


class NvmeOptimizerOffload(DeferredGradOffload):
    """Masters and Adam moments in a swap file, updated through the buffer pool (module docstring)."""

    device = "nvme"
    stages_per_piece = False  # the writer's staging slots, one sub-group at a time

    def __init__(
        self,
        cfg: OffloadOptimizerConfig,
        aio: AioConfig,
        sub_group_size: int | None,
        rank: int,
        process_group: dist.ProcessGroup | None,
        train_device: torch.device | str = "cpu",
    ) -> None:
        super().__init__(bool(cfg.pin_memory), cfg.cpu_adam, train_device)  # pin_memory resolved by build_offload
        self.edits = None  # on a device: fingerprints per sub-group span (span_prints), not per piece
        self.writer = ModuleWriter(self.copies, self.pin)  # updated masters -> module (nvme_device)
        self.span_prints = SpanPrints(lambda i: self.pieces[i].tensor, self._watched) if self.on_device else None
        self._edited: set[SpanKey] | None = None  # this step's spans to compare (None: all, on the CPU)
        self._trusted: set[int] = set()  # this step's pieces whose shards hold the last step's cast
        self.cfg = cfg
        self.aio_cfg = aio
        self.user_sub_group_size = sub_group_size  # None: chosen at attach (zerodp.offload.sizing)
        self.sub_group_size = 0
        self.in_place = False  # the module's fp32 CPU tensors are the masters (no masters segment)
        self.layout: BufferLayout | None = None
        self.rank = rank
        self.pg = process_group
        self.subgroups: list[SubGroup] = []
        self.steps: dict[tuple[int, int], torch.Tensor] = {}  # (piece position, span lo) -> Adam's step
        self.buffers: list[torch.Tensor] = []
        self.io: AsyncIO | None = None
        self.file: SwapFile | None = None
        self.dir: str | None = None
        self.stats = SwapStats()
        self._finalizer: weakref.finalize | None = None
        self.grad_scratch = torch.empty(0, dtype=torch.float32)  # fp32, largest sub-group (deferred, not fp32)
        self._group_of: list[FlatGroup] = []  # per piece: its flat group (= stage-3 unit)
        self.shard_access: ShardAccess | None = None
        #: the parameter offload whose use hook is set: its deferrable groups' updates may follow step()
        self.hooks: ShardAccess | None = None
        self.pending: SubGroupPipeline | None = None  # a step's loop still running (overlap_step)
        self._grad_reads: StepGradReads | None = None  # this step's reads of the gradient swap file
        self._files: list[SwapFile | None] = []
        self._after: list[Callable[[], None]] = []  # to run once the pending loop has finished

    # ---- construction --------------------------------------------------------------------------
    def attach(self, groups: list[FlatGroup]) -> None:
        """Plan the sub-groups, create the swap file (collective: every rank raises if one fails)
        and write the initial masters."""
        pieces = [p for g in groups for p in g.pieces]
        # pieces of groups whose uses are not hooked (the persistent unit) first: their sub-groups are
        # updated inside step() even with overlap_step, because forward reads them without asking
        swapped = [self._deferrable(g) for g in groups for _ in g.pieces]
        order = [i for i, s in enumerate(swapped) if not s] + [i for i, s in enumerate(swapped) if s]
        self.deferred = not self.on_device  # gradients in host memory already (the engine on the CPU)
        # fp32 on the CPU, shards always resident: the module's tensors serve as the masters
        self.in_place = (
            self.shard_access is None and self.deferred and all(p.tensor.dtype == torch.float32 for p in pieces)
        )
        owned = sum(p.hi - p.lo for p in pieces)
        self.sub_group_size, layout = configured_buffers(
            owned,
            self.user_sub_group_size,
            self.cfg.buffer_count,
            self.cfg.host_buffer_bytes,
            self.in_place,
            self.deferred,
        )
        self.subgroups = _plan(pieces, order, self.sub_group_size, layout.segments)
        count = max(1, min(self.cfg.buffer_count, len(self.subgroups)))  # more would never be used
        self.layout = BufferLayout(layout.segments, count, layout.scratch)
        largest = max((sg.numel for sg in self.subgroups), default=0)
        if self.user_sub_group_size is not None and self.rank == 0:
            warning = oversize_warning(self.user_sub_group_size, largest, self.layout, owned, not self.in_place)
            if warning:
                warnings.warn(warning, stacklevel=2)
        needed = sum(sg.nbytes for sg in self.subgroups)
        job = agree_job_id(self.pg)
        error = None
        try:
            self._open(job, needed)
        except (OSError, OffloadError) as exc:
            error = f"rank {self.rank}: {exc}"
        raise_if_any_rank_failed(error, self.pg)
        for g in groups:
            for piece in g.pieces:  # host gradients and placeholders; the masters go to the file below
                self._add_piece(piece)
                self._group_of.append(g)
        self._grad_refs = [None] * len(pieces)
        if self.layout.scratch:  # low-precision host gradients: made fp32 one sub-group at a time
            self.grad_scratch = torch.empty(largest, dtype=torch.float32)
        biggest = max((sg.nbytes for sg in self.subgroups), default=0)
        self.buffers = [aligned_buffer(biggest, self.pin) for _ in range(count)]
        self.writer.plan(
            [[(hi - lo) * self.pieces[i].tensor.element_size() for i, lo, hi in sg.spans] for sg in self.subgroups]
        )
        if not self.in_place:  # the masters go to the file
            swap_masters.write_masters(self)
        for p in pieces:
            p.master = torch.empty(0, dtype=torch.float32)
        if self.span_prints is not None:  # the masters equal the module's values now
            self.span_prints.take(s for sg in self.subgroups for s in sg.spans)

    @property
    def swap_io(self) -> AsyncIO:
        """The swap file's I/O threads, from :meth:`attach` until :meth:`close`."""
        assert self.io is not None, "the swap file's I/O is opened by attach() and closed by close()"
        return self.io

    @property
    def swap_file(self) -> SwapFile:
        """The optimizer swap file, from :meth:`attach` on."""
        assert self.file is not None, "the optimizer swap file is created by attach()"
        return self.file

    def read_region(self, buf: torch.Tensor, offset: int) -> IOHandle:
        """Start reading ``buf`` (uint8, aligned) from byte ``offset`` of the swap file."""
        return self.swap_io.read(self.swap_file, buf, offset)

    def write_region(self, buf: torch.Tensor, offset: int) -> IOHandle:
        """Start writing ``buf`` (uint8, aligned) at byte ``offset`` of the swap file."""
        return self.swap_io.write(self.swap_file, buf, offset)

    def _open(self, job: str, needed: int) -> None:
        base, key = self.cfg.nvme_path, "offload_optimizer.nvme_path"
        assert base is not None, "OffloadOptimizerConfig refuses device 'nvme' without nvme_path"
        args = (needed, self.cfg.fast_init, self.cfg.remove_stale_swap, key, self._files)
        self.dir, self.file = swap_job.open_rank_file(base, job, self.rank, "optimizer.swp", *args)
        self._finalizer = weakref.finalize(self, remove_swap_dir, self.dir, self._files)
        self.io = AsyncIO(self.aio_cfg)  # also gradients.swp's (gradient_spill); params.swp has its own

    def gradient_spill(self, reducer: SpillingGradReducer) -> GradSwap | None:
        """Collective: the gradient swap file for ``reducer``
        (:class:`zerodp.runtime.grad_spill.SpillingGradReducer`), or None when the gradients are not
        in host memory (:func:`zerodp.offload.grad_swap.open_grad_swap`; raises its errors)."""
        if not self.deferred or self.file is None:
            return None
        self._grad_at = [
            (g.index, reducer.owned_offset(g, p.lo, p.hi)) for p, g in zip(self.pieces, self._group_of, strict=False)
        ]
        assert self.dir is not None and self.cfg.nvme_path is not None, "the swap file exists (checked above)"
        self.spill = open_grad_swap(
            self.dir,
            self.cfg.nvme_path,
            self.cfg.fast_init,
            self.swap_io,  # one pool: each sub-group's gradient read is queued behind its region's
            self._files,
            reducer.owned_sizes,
            self._grad_at,
            [sg.spans for sg in self.subgroups],
            self.rank,
            self.pg,
            read_buffer_count=len(self.buffers),
        )
        return self.spill

    def _spilled_spans(self, index: int) -> list[tuple[int, int, int]]:
        """Spans of sub-group ``index`` whose gradient is in the gradient swap file."""
        return [
            (i, lo, hi) for i, lo, hi in self.subgroups[index].spans if self._present[i] and self._grad_refs[i] is None
        ]

    def set_shard_access(self, access: ShardAccess) -> None:
        """Pin parameter shards per sub-group during the step, if the parameters are on NVMe; with
        ``overlap_step``, a shard's first use after a step waits for its sub-groups' update (the hook)."""
        if getattr(access, "swapper", None) is not None:
            self.shard_access = access
        elif not self.cfg.overlap_step:
            return
        self.hooks = access
        access.set_use_hook(self._before_use, self._pending_group)

    def _deferrable(self, group: FlatGroup) -> bool:
        """Every use of ``group``'s shard calls :meth:`_before_use` (its update may wait for it)."""
        return self.hooks is not None and self.hooks.deferrable(group)

    def group_of(self, i: int) -> FlatGroup:
        """The flat group (stage-3 unit) of the piece at position ``i``."""
        return self._group_of[i]

    def _watched(self, i: int) -> bool:
        """Piece ``i``'s shard is resident when a step starts (no NVMe home): on a device, fingerprinted."""
        return self.shard_access is None or not self.shard_access.swapped(self._group_of[i])

    def _before_use(self, group: FlatGroup) -> None:
        if self.pending is not None:
            self.pending.ready_for(group)

    def _pending_group(self, group: FlatGroup) -> bool:
        return self.pending is not None and self.pending.pending(group)

    def settle(self) -> None:
        """Finish a step's sub-group loop still running (``overlap_step``); a no-op otherwise."""
        if self.pending is not None:
            self.pending.finish()

    def when_updated(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once every sub-group of the last step is updated: now, or when the loop ends."""
        if self.pending is None:
            fn()
        else:
            self._after.append(fn)

    @contextlib.contextmanager
    def pinned(self, positions: Iterable[int], dirty: bool, keep: bool = False) -> Iterator[None]:
        """The shards of the pieces at ``positions`` resident for the block (no-op without access)."""
        groups = unique_groups(self._group_of[i] for i in positions)
        if self.shard_access is None:
            yield
            return
        self.shard_access.pin(groups)
        try:
            yield
        finally:
            self.shard_access.unpin(groups, dirty, keep)

    def refresh_master(self, piece: Piece) -> None:
        """Write the module's (edited) value of ``piece`` into its master in the swap file (nothing to
        do when the module's tensors are the masters)."""
        self.settle()
        if self.span_prints is not None:
            self.span_prints.drop(self._index[id(piece)])
        if self.in_place:
            return
        swap_masters.refresh_master(self, self._index[id(piece)])

    def fold_edits(self) -> None:
        """Nothing before the update: in-place edits of module parameters (``w.mul_(0.5)`` under
        ``no_grad``, also through ``w.data``) are folded during :meth:`step` with the rule of
        :meth:`zerodp.runtime.guards.TrainingGuards.before_update`: in the buffer of each sub-group the
        step updates (all its pieces, :meth:`_update`, except those of shards the last step wrote and no
        use changed since: :func:`~zerodp.offload.shard_window.step_current_groups`), by
        :func:`~zerodp.offload.swap_masters.fold_masters` for the others, all after a skipped step."""

    def skipped_step(self) -> None:
        """The update was skipped (fp16 overflow): fold the edits :meth:`step` would have folded."""
        self.settle()
        if not self.in_place:
            fold_idle(self, self.span_prints, self.subgroups, edited_spans(self.span_prints, self.subgroups))

    # ---- one step ------------------------------------------------------------------------------
    def check_health(self) -> None:
        """Collective: every rank raises :class:`OffloadError` if any rank's swap file is gone."""
        error = None
        if self.file is None or self.file.deleted():
            error = (
                f"rank {self.rank}: swap file {self.file.path if self.file else self.dir} was deleted "
                "or replaced while training; the optimizer state in it is lost, the step is not taken"
            )
        raise_if_any_rank_failed(error, self.pg)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Run the sub-group loop (:class:`zerodp.offload.step_pipeline.SubGroupPipeline`): sub-group k
        is updated while the next are read and k-1 written (``aio.overlap_events``); with
        :attr:`shard_access`, the parameter shards of k+1 are read while k is updated. With
        ``offload_optimizer.overlap_step`` the loop returns once the sub-groups of the parameters
        that are not swapped are updated and goes on during the next forward (:attr:`pending`)."""
        self.settle()
        todo = [sg for sg in self.subgroups if any(self._present[i] for i in sg.pieces)]
        if self.spill is not None:
            self._grad_reads = StepGradReads(self.spill, self._grad_at, [sg.index for sg in todo], self._spilled_spans)
        self._edited = edited_spans(self.span_prints, self.subgroups)
        if not self.in_place:  # the module's tensors are the masters: nothing to fold
            idle = [sg for sg in self.subgroups if not any(self._present[i] for i in sg.pieces)]
            fold_idle(self, self.span_prints, idle, self._edited)
        self._trusted, blank = step_current_groups(self.shard_access, self._group_of, self._present, not self.in_place)
        reads = self._grad_reads  # each sub-group's gradient read is queued right behind its region's
        on_read = None if reads is None else lambda sg, slot: reads.issue(sg.index, slot)
        loop = SubGroupPipeline(
            self, optimizer, todo, lambda sg, buf: self._update(sg, buf, optimizer), self._loop_done, blank, on_read
        )
        self.stats = loop.stats
        self.pending = loop
        if not self.cfg.overlap_step or self.hooks is None:
            loop.finish()
            loop.stats.updated_in_step = len(todo)
            return
        eager = [k for k, sg in enumerate(todo) if any(not self._deferrable(self._group_of[i]) for i in sg.pieces)]
        loop.advance(max(eager, default=-1))
        loop.shards.keep = True  # from here on the next forward uses each shard right after its update
        loop.stats.updated_in_step = loop.next  # the rest: at each use in the next forward (pump there)

    def _loop_done(self) -> None:
        """The step's last sub-group is updated and written: forget its gradients, run what waited."""
        self.pending = None
        self._forget_grads()
        after, self._after = self._after, []
        for fn in after:
            fn()

    def _update(self, sg: SubGroup, buf: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        """Update sub-group ``sg`` in its buffer: each span of a piece with a gradient is bound to the
        piece's optimizer parameter (a sub-group holds at most one span of a piece) and the optimizer
        runs once; the masters are then cast into the module (unless they are the module's tensors)."""
        seg_m, seg_a, seg_v = sg.buffer_segments(buf)
        m = {i: view for i, _, _, view in sg.views(seg_a)}
        v = {i: view for i, _, _, view in sg.views(seg_v)}
        spans = {i: (lo, hi) for i, lo, hi in sg.spans}
        if seg_m is None:
            masters = {i: self.pieces[i].tensor[lo:hi] for i, (lo, hi) in spans.items()}
        else:
            masters = {i: view for i, _, _, view in sg.views(seg_m)}
            for i, (lo, hi) in spans.items():  # an in-place edit since the last step (fold_edits)
                if (self._edited is None or (i, lo) in self._edited) and i not in self._trusted:
                    fold_edit(self.pieces[i].tensor[lo:hi], masters[i])
        assert self.layout is not None, "attach() plans the buffers before any step"
        scratch = {i: view for i, _, _, view in sg.views(self.grad_scratch)} if self.layout.scratch else {}
        spilled = self._grad_reads.take(sg.index) if self._grad_reads is not None else {}  # set with a spill
        for i, (lo, hi) in spans.items():
            if not self._present[i]:
                continue
            master = self.pieces[i].master_copy
            master.data = masters[i]
            master.grad = (
                self._materialise(i, lo, hi, scratch.get(i), spilled.get(i))
                if self.deferred
                else self._host_grad(i)[lo:hi]  # the host waits for this piece's copy, if not yet done
            )
            if (i, lo) not in self.steps:  # fresh state, exactly what torch's lazy initialisation makes
                m[i].zero_()
                v[i].zero_()
                self.steps[(i, lo)] = torch.tensor(0.0, dtype=torch.float32)
            optimizer.state[master] = {"step": self.steps[(i, lo)], "exp_avg": m[i], "exp_avg_sq": v[i]}
        with cpu_adam_kernel(optimizer, self.cpu_adam):
            optimizer.step()
        self.writer.begin()
        for i, (lo, hi) in spans.items():
            if not self._present[i]:
                continue
            p = self.pieces[i]
            if seg_m is not None:  # device: staged and copied on the copy stream, not out of this buffer
                self.writer.write(p.tensor[lo:hi], masters[i])
            master = p.master_copy
            self.steps[(i, lo)] = optimizer.state.pop(master)["step"]
            master.grad = None
            master.data = torch.empty(0, dtype=torch.float32)
        self.writer.end()  # device: the compute stream waits for the copies (no host sync)
        if self.span_prints is not None:  # after them, on the compute stream
            self.span_prints.take(sg.spans)

    def finish_step(self) -> None:
        """Nothing left: the loop forgets the gradients when its last sub-group is updated
        (:meth:`_loop_done`), which with ``overlap_step`` may be after this returns."""

    def _forget_grads(self) -> None:
        self._forget_host_grads()
        self._present = [False] * len(self.pieces)
        self._streamed = [False] * len(self.pieces)
        self._forget_deferred()
        if self._grad_reads is not None:  # reads issued ahead and not used (none normally)
            self._grad_reads.close()
            self._grad_reads = None

    # ---- checkpoints and reports ---------------------------------------------------------------
    @contextlib.contextmanager
    def resident(self, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        """Read every master and moment into ordinary host tensors bound to the optimizer (12 bytes
        per owned element, for the duration of a checkpoint save or load; when the module's tensors
        are the masters, the master is the module's tensor itself), then write back what the block
        left there and return to placeholders."""
        self.settle()
        with swap_masters.resident(self, optimizer):
            yield
        if self.shard_access is not None:  # a load may have replaced the masters
            self.shard_access.forget_step_writes()

    def adjust_formula(self, formula: dict[str, float], numel_per_rank: float) -> None:
        """Masters and optimizer states live in the swap file: none in memory."""
        formula["master_weights"] = 0.0
        formula["optimizer_states"] = 0.0

    def host_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Host bytes measured from live storages; ``gradients``: the fp32 host gradient buffers, or
        (deferred) the one-sub-group scratch (the reducer's partition is counted by the engine)."""
        out = super().host_bytes(optimizer)
        out["gradients"] = storage_bytes(self.grad_buffers + [self.grad_scratch])
        out["swap_buffers"] = storage_bytes(self.buffers) + self.writer.nbytes()
        if self.spill is not None:  # its read buffers and the partitions whose writes are in flight
            out["gradients"] += self.spill.host_bytes()
        return out

    def formula(self, numel_per_rank: float, host: dict[str, int]) -> dict[str, dict[str, float]]:
        largest = float(max((sg.numel for sg in self.subgroups), default=0))
        assert self.layout is not None, "attach() plans the buffers before any report"
        scratch = (largest if self.layout.scratch else 0.0) if self.deferred else None
        out = offload_formula(
            self.device,
            numel_per_rank,
            host["swap_buffers"],
            scratch,
            masters_in_file=not self.in_place,
            grad_read_bytes=self.spill.host_bytes() if self.spill else 0,
        )
        if self.spill is not None:  # the reduced gradient partition, in the reducer's dtype
            out["nvme"]["gradients"] = max(e.dtype.itemsize for e in self.spill.extents.values()) * numel_per_rank
        return out

    def nvme_bytes(self) -> dict[str, int]:
        """Bytes of the swap file's segments (padding included), by category (no masters when the
        module's tensors are the masters)."""
        seg = sum(sg.seg for sg in self.subgroups)
        out = {"master_weights": 0 if self.in_place else seg, "optimizer_states": 2 * seg}
        if self.spill is not None:
            out["gradients"] = os.fstat(self.spill.file.fd).st_size
        return out

    def close(self) -> None:
        """Stop the I/O threads and remove this rank's swap file and directory (a step's loop still
        running is abandoned: the job is ending)."""
        if self.pending is not None:
            self.pending.abandon()
            self.pending = None
        self.copies.close()
        if self.spill is not None:
            self.spill.drain()
        if self.io is not None:
            self.io.close()
            self.io = None
        if self._finalizer is not None:
            self._finalizer()


__all__ = ["NvmeOptimizerOffload", "OffloadError", "SubGroup", "SwapStats"]
