"""Stages 2 and 3 of the gradient reducer (:mod:`zerodp.runtime.reducer`): no full gradient buffer.
Each gradient goes into its bucket's staging buffer (stage 2: autograd adds it into a view of the
buffer, [Note: gradient views] in :mod:`zerodp.runtime.grad_views`; stage 3: it is copied there and
freed); a complete bucket is reduce-scattered every micro-step (stage 3: coalesced up to
``coalesce_elements``) and the result accumulated into this rank's owned gradient partition
(:class:`PartitionedGradReducer`)."""

from __future__ import annotations

import torch

from zerodp.runtime import comm
from zerodp.runtime.coalesce import coalesced, runs_of_same_kind
from zerodp.runtime.grad_reducer import GradientReducer, StagingPool, async_work, trainable
from zerodp.runtime.grad_views import BucketViews
from zerodp.runtime.partition import Bucket, FlatGroup, ParamSlot, zero_unwritten

#: the partitioned strategy's payload: (staging buffer, separate receive buffer or None, all-to-all
#: scratch or None)
StagedPayload = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]


class PartitionedGradReducer(GradientReducer[StagedPayload]):
    """Stage 2: bucketed reduce-scatter every micro-step; only the owned gradient partition is kept.

    ``contiguous_gradients=True`` copies each gradient into its bucket's staging buffer as soon as it
    is produced and frees it (lowest memory); ``False`` keeps the parameters' own ``.grad`` tensors
    until the bucket is complete and flattens them then (one copy fewer per element, more memory).
    ``grad_views`` (stage 2, with ``contiguous_gradients``): autograd accumulates into views of the
    staging buffer instead ([Note: gradient views] in :mod:`zerodp.runtime.grad_views`).
    The calibration step launches complete buckets at once too (``repairs_late``, see
    :mod:`zerodp.runtime.grad_reducer`): only the buckets in flight are staged, never the whole gradient.
    """

    repairs_late = True

    def __init__(
        self,
        *args,
        contiguous_gradients: bool = True,
        grad_views: bool = False,
        staging_pool: StagingPool | None = None,
        coalesce_elements: int = 0,
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.contiguous = contiguous_gradients
        #: id(bucket) -> its views maker ([Note: gradient views]); empty where gradients are copied
        self._bucket_views: dict[int, BucketViews] = {}
        if contiguous_gradients and grad_views:
            self._bucket_views = {
                id(b): BucketViews(b, [s for s in b.slots if trainable(s)]) for g in self.groups for b in g.buckets
            }
        self._views: dict[int, torch.Tensor] = {}  # slot index -> view of its open bucket's staging buffer
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
        self._late_staging: dict[int, torch.Tensor] = {}  # id(bucket) -> contributions after its launch
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
        a gradient) before the collective, so the bucket is not zeroed first in full. With gradient
        views it is created zeroed (autograd adds into it)."""
        buf = self._staging.get(id(b))
        if buf is None:
            if self.staging_pool is not None:
                buf = self.staging_pool.empty_tensor(b.numel, g.buffer.dtype, g.buffer.device)
            elif self._bucket_views:
                buf = torch.zeros(b.numel, dtype=g.buffer.dtype, device=g.buffer.device)
            else:
                buf = torch.empty(b.numel, dtype=g.buffer.dtype, device=g.buffer.device)
            self._staging[id(b)] = buf
            self._note_peak()
        return buf

    def _open_views(self, b: Bucket, g: FlatGroup) -> None:
        """Bucket ``b``'s first gradient this micro-step: its zeroed staging buffer, with ``.grad`` of each
        of its parameters that has none pointed at its view ([Note: gradient views])."""
        maker = self._bucket_views[id(b)]
        for s, view in zip(maker.slots, maker.views(self._staging_for(b, g)), strict=True):
            self._views[s.index] = view
            if s.param.grad is None:
                s.param.grad = view

    def _close_views(self, b: Bucket) -> None:
        """Bucket ``b`` is reduced: every ``.grad`` that is still a view of its buffer goes back to None."""
        views = self._views
        for s in self._bucket_views[id(b)].slots:
            view = views.pop(s.index, None)
            if view is not None and s.param.grad is view:
                s.param.grad = None

    def begin_micro_step(self, reduce: bool, defer: bool = False) -> None:
        """As the base; a bucket left open by a backward that raised is closed, its partial sums dropped."""
        super().begin_micro_step(reduce, defer)
        if self._views:
            for g in self.groups:
                for b in g.buckets:
                    if id(b) in self._bucket_views:
                        self._close_views(b)
                    self._staging.pop(id(b), None)

    def _on_grad(self, slot: ParamSlot, param: torch.nn.Parameter) -> None:
        self._present_np[slot.index] = 1
        g, b = self._slot_bucket[slot.index]
        if self._bucket_views:
            view = self._views.get(slot.index)
            if view is None:  # the bucket's first gradient this micro-step
                self._open_views(b, g)
                view = self._views[slot.index]
            grad = param.grad
            if grad is not view:  # a tensor autograd made (the first gradient, an out-of-place sum)
                assert grad is not None, "a post-accumulate-grad hook runs with the gradient accumulated"
                view.copy_(grad)
                param.grad = view
        elif self.contiguous:
            buf = self._staging_for(b, g)
            rel = slot.offset - b.start
            target = buf[rel : rel + slot.numel]
            grad = param.grad
            assert grad is not None, "a post-accumulate-grad hook runs with the gradient accumulated"
            if self._count_np[slot.index] > 1:  # [Note: repeated accumulation] (grad_reducer): add
                target.add_(slot.flat_values(grad))
            else:
                target.copy_(slot.flat_values(grad))
            param.grad = None
        self._ready(slot, g, b)

    def _on_late_grad(self, slot: ParamSlot, param: torch.nn.Parameter) -> None:
        """Calibration step: ``param``'s gradient arrived after its bucket was launched. Contiguous:
        added into the bucket's late buffer (zeros first) and freed; otherwise it stays in
        ``param.grad`` (accumulated there by autograd) until :meth:`_reduce_late` flattens it."""
        if not self.contiguous:
            return
        g, b = self._slot_bucket[slot.index]
        late = self._late_staging.get(id(b))
        if late is None:
            late = self._late_staging[id(b)] = torch.zeros(b.numel, dtype=g.buffer.dtype, device=g.buffer.device)
        rel = slot.offset - b.start
        assert param.grad is not None, "a post-accumulate-grad hook runs with the gradient accumulated"
        late[rel : rel + slot.numel].add_(slot.flat_values(param.grad))
        param.grad = None

    def _reduce_late(self, buckets: list[tuple[FlatGroup, Bucket]]) -> None:
        """Reduce-scatter each bucket's late contributions (zeros on a rank that has none) and add the
        result to the owned partition, as a later micro-step's reduction is added."""
        for g, b in buckets:
            late = self._late_staging.pop(id(b), None)
            self._staging[id(b)] = (
                late if late is not None else torch.zeros(b.numel, dtype=g.buffer.dtype, device=g.buffer.device)
            )
            self._launch(g, b)
        self._flush()
        self._drain(0)
        self._late_staging.clear()

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
            launches = [
                lambda buf=buf, out=out, rx=rx: comm.reduce_scatter(
                    out, buf, self.pg, self.ledger, self.collective_purpose, async_op=True, received=rx
                )
                for (_, _, buf, out, _), rx in zip(run, scratch, strict=True)
            ]
            self.stream.after_compute()  # the buckets' staging buffers are written on the compute stream
            with self.stream.issuing():
                work = (
                    comm.AllOf([async_work(launch()) for launch in launches])
                    if apart
                    else async_work(coalesced(self.pg, launches))
                )
            self.reduce_collectives += 1
            self._track(work, [(b, g, (buf, recv, rx)) for (g, b, buf, _, recv), rx in zip(run, scratch, strict=True)])

    def _receive_buffer(self, buf: torch.Tensor) -> torch.Tensor | None:
        """A buffer like ``buf`` from the staging pool for an all-to-all's received chunks (None
        without a pool: the collective allocates its own)."""
        if self.staging_pool is None:
            return None
        return self.staging_pool.empty_tensor(buf.numel(), buf.dtype, buf.device)

    def _written(self, b: Bucket, buf: torch.Tensor) -> list[bool]:
        """Per slot of ``b``: whether a gradient is in ``buf`` this micro-step (without contiguous
        gradients, each ``.grad`` is copied in now and dropped)."""
        if self.contiguous:  # _on_grad copied each gradient that arrived this micro-step
            return [self._count_np[s.index] > 0 for s in b.slots]
        written = []
        for s in b.slots:
            grad = s.param.grad if trainable(s) else None
            written.append(grad is not None)
            if grad is not None:
                rel = s.offset - b.start
                buf[rel : rel + s.numel].copy_(s.flat_values(grad))
                s.param.grad = None
        return written

    def _prepare(self, g: FlatGroup, b: Bucket) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(staging buffer divided by N, reduce-scatter output, separate receive buffer or None)."""
        buf = self._staging_for(b, g)
        if self._bucket_views:  # zeroed when made; autograd added each gradient into its view
            self._close_views(b)
        else:
            zero_unwritten(buf, b, self._written(b, buf))
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
        staging = sum(t.numel() * t.element_size() for t in [*self._staging.values(), *self._late_staging.values()])
        flight = sum(
            sum(t.numel() * t.element_size() for t in payload if t is not None)
            for _, entries in self._in_flight
            for _, _, payload in entries
        )
        return {"gradients": owned + staging, "comm_buffers": flight}


__all__ = ["PartitionedGradReducer", "StagedPayload"]
