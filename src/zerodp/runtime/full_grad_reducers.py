"""Stages 0 and 1 of the gradient reducer (:mod:`zerodp.runtime.reducer`): ``param.grad`` views a full
flat gradient buffer per group (:class:`AllReduceReducer`: all-reduced in place at the boundary;
:class:`FullGradReduceScatter`: reduce-scattered at the boundary, the owned shard written back)."""

from __future__ import annotations

import torch

from zerodp.runtime import comm
from zerodp.runtime.grad_reducer import GradientReducer, PayloadT, async_work
from zerodp.runtime.partition import Bucket, FlatGroup, ParamSlot
from zerodp.runtime.zero_pages import ZeroPageBuffer


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
        self._track(async_work(work), [(b, g, None)])

    def held_bytes(self) -> dict[str, int]:
        return {"gradients": sum(t.numel() * t.element_size() for t in self.grad_buffers.values()), "comm_buffers": 0}


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
        self._track(async_work(work), [(b, g, recv)])

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
        return {
            "gradients": sum(t.numel() * t.element_size() for t in self.grad_buffers.values()),
            "comm_buffers": recv,
        }


__all__ = ["AllReduceReducer", "FullGradReduceScatter"]
