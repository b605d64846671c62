"""The gradients of an NVMe optimizer offload (:mod:`zerodp.offload.nvme`) when they are in host memory
already (every piece on the CPU): ``deferred`` mode, no host copy.

The offload keeps a reference to the reducer's gradient partition (unchanged until the step), or
reads a piece from the gradient swap file (:attr:`DeferredGradOffload.spill`,
:mod:`zerodp.offload.grad_swap`), and records the engine's scale factors (loss unscaling, clipping) in
order. A piece's fp32 gradient is made just in time (:meth:`DeferredGradOffload._materialise`) by the
same fp32 ``copy_`` and in-place ``mul_`` the eager path applies, so the values are bitwise the same.
Without ``deferred`` (gradients on a device) every call is the host offload's
(:class:`zerodp.offload.host.HostOptimizerOffload`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from zerodp.offload.cpu_adam import CpuAdam
from zerodp.offload.grad_swap import GradSwap, StepGradReads
from zerodp.offload.host import HostOptimizerOffload
from zerodp.runtime.partition import Piece
from zerodp.runtime.topology import ChunkNorms


class DeferredGradOffload(HostOptimizerOffload):
    """The host offload's gradient calls, deferred when the gradients are in host memory (module docstring)."""

    def __init__(self, pin_memory: bool, cpu_adam: CpuAdam = "fused", train_device: torch.device | str = "cpu") -> None:
        super().__init__(pin_memory, cpu_adam, train_device)
        self.deferred = False  # gradients read from the reducer's host partition (set at attach: engine on the CPU)
        self._norm_scratch: torch.Tensor | None = None  # fp32, largest piece, during a step's norm only
        self._grad_refs: list[torch.Tensor | None] = []  # per piece: the reducer's partition view
        self._factors: list[float] = []  # scale factors applied this step, in order (deferred)
        self.spill: GradSwap | None = None  # the reduced gradients on NVMe (gradient_spill)
        self._grad_at: list[tuple[int, int]] = []  # per piece: (group index, offset in its owned partition)

    def _grad_buffer(self, piece: Piece) -> torch.Tensor:
        if not self.deferred:
            return super()._grad_buffer(piece)
        return torch.empty(0, dtype=torch.float32)  # no host copy: see grad_scratch

    def stream_grad(self, piece: Piece, grad: torch.Tensor) -> None:
        if not self.deferred:
            return super().stream_grad(piece, grad)
        i = self._index[id(piece)]
        if self.spill is None:  # with a spill the reducer's partition goes to the file: no reference
            self._grad_refs[i] = grad
        self._streamed[i] = True

    def stage_grad(self, piece: Piece, grad: torch.Tensor | None) -> None:
        """Deferred: ``grad`` the reducer's partition view (unchanged until the step), or None: in :attr:`spill`."""
        if not self.deferred:
            return super().stage_grad(piece, grad)
        i = self._index[id(piece)]
        self._grad_refs[i] = grad
        self._present[i] = True

    def scale_grads(self, factor: float) -> None:
        """Deferred: record ``factor``, applied at materialisation (:meth:`_materialise`)."""
        if not self.deferred:
            return super().scale_grads(factor)
        self._factors.append(factor)

    def grads(self) -> list[torch.Tensor]:
        if self.deferred:
            raise RuntimeError("NvmeOptimizerOffload: gradients are made one piece at a time (norm_grads)")
        return super().grads()

    def grad_of(self, piece: Piece) -> torch.Tensor | None:
        """Deferred: ``piece``'s fp32 gradient: the reducer's partition itself when it is fp32 and no
        factor is recorded yet, else made in a norm scratch of the largest piece (allocated for the
        step, freed after it), valid until the next call."""
        if not self.deferred:
            return super().grad_of(piece)
        i = self._index[id(piece)]
        if not self._present[i]:
            return None
        ref = self._grad_refs[i]
        if ref is None:  # in the gradient swap file: this piece read into a buffer of its own
            assert self.spill is not None, "a staged gradient without a partition view is in the swap file"
            group, at = self._grad_at[i]
            return self._fp32_of(i, self.spill.read_elements(group, at, at + piece.hi - piece.lo), fresh=True)
        return self._fp32_of(i, ref, fresh=False)

    def norm_grads(self, pieces: list[Piece]) -> Iterable[torch.Tensor | ChunkNorms]:
        """Deferred: a generator; each piece's fp32 gradient overwrites the previous one's. A piece in
        the gradient swap file whose chunk norms were taken as it was written (:meth:`begin_grads`)
        gives those (:class:`zerodp.runtime.topology.ChunkNorms`) when no scale factor is recorded
        (fp16's loss unscaling or a ``clip_grad_norm_`` factor would change them); the others are read
        one ahead (:class:`zerodp.offload.grad_swap.StepGradReads`): piece k+1's read is in flight
        while piece k is made fp32 and summed (two pieces' read buffers at a time, freed as the pass
        goes)."""
        if not self.deferred:
            return super().norm_grads(pieces)
        return self._norm_pass([self._index[id(p)] for p in pieces])

    def begin_grads(self) -> None:
        """As the host offload's; with a gradient swap file, its :meth:`GradSwap.put` takes each piece's
        chunk norms during this (boundary) backward, until the step forgets the gradients."""
        super().begin_grads()
        if self.deferred and self.spill is not None:
            spans: dict[int, list[tuple[int, int, int]]] = {}
            for i, (group, at) in enumerate(self._grad_at):
                spans.setdefault(group, []).append((i, at, at + self.pieces[i].hi - self.pieces[i].lo))
            self.spill.take_norms(spans)

    def _norm_pass(self, todo: list[int]) -> Iterator[torch.Tensor | ChunkNorms]:
        todo = [i for i in todo if self._present[i]]
        early: dict[int, torch.Tensor] = {}  # pieces normed as they were written (no factor to apply)
        if self.spill is not None and not self._factors:
            for i in todo:
                norms = self.spill.span_norms.get(self._grad_at[i][0], {}).get(i)
                if norms is not None and self._grad_refs[i] is None:
                    early[i] = norms
        spilled = [i for i in todo if self._grad_refs[i] is None and i not in early]
        reads = None
        if spilled:
            assert self.spill is not None, "a staged gradient without a partition view is in the swap file"
            reads = StepGradReads(self.spill, self._grad_at, spilled, self._whole_piece, own_buffers=True)
        try:
            for i in todo:
                ref = self._grad_refs[i]
                if i in early:
                    yield ChunkNorms(early[i])
                elif ref is None:
                    assert reads is not None
                    yield self._fp32_of(i, reads.take(i)[i], fresh=True)
                else:
                    yield self._fp32_of(i, ref, fresh=False)
        finally:  # a pass stopped early (an error in the consumer): no read left writing into memory
            if reads is not None:
                reads.close()

    def _whole_piece(self, i: int) -> list[tuple[int, int, int]]:
        """Piece ``i``'s span for :class:`StepGradReads`: all its elements."""
        return [(i, 0, self.pieces[i].hi - self.pieces[i].lo)]

    def _fp32_of(self, i: int, ref: torch.Tensor, fresh: bool) -> torch.Tensor:
        """Piece ``i``'s fp32 gradient from ``ref`` (its elements; ``fresh``: a buffer read for this
        call, which may be scaled in place)."""
        n = self.pieces[i].hi - self.pieces[i].lo
        if ref.dtype == torch.float32 and (fresh or not self._factors):
            return self._materialise(i, 0, n, None, ref) if fresh else ref
        if self._norm_scratch is None:
            self._norm_scratch = torch.empty(max(p.hi - p.lo for p in self.pieces), dtype=torch.float32)
        return self._materialise(i, 0, n, self._norm_scratch[:n], ref)

    def _materialise(
        self, i: int, lo: int, hi: int, out: torch.Tensor | None, ref: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Elements ``lo:hi`` of piece ``i``'s fp32 gradient in ``out``: the eager path's copy, then its
        in-place scalings. ``out`` None (the reducer's partition is fp32, as the eager path's gradient
        is then): scaled in place there, as the eager path scales it. ``ref``: those elements read
        from the gradient swap file (default: the reducer's partition)."""
        if ref is None:
            partition = self._grad_refs[i]
            assert partition is not None, "without a read from the swap file the reducer's partition is staged"
            ref = partition[lo:hi]
        if out is None:
            out = ref
        else:
            out.copy_(ref)
        for f in self._factors:
            out.mul_(f)
        return out

    def _forget_deferred(self) -> None:
        """After a step: no partition references, no factors, no norm scratch."""
        self._grad_refs = [None] * len(self.pieces)
        self._factors = []
        self._norm_scratch = None
        if self.spill is not None:
            self.spill.take_norms(None)


__all__ = ["DeferredGradOffload"]
