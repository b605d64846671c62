"""The stage-2/3 reducer whose reduced gradient partition leaves host memory as it is made
(:class:`SpillingGradReducer`; ``offload_optimizer.device = "nvme"``, see
:mod:`zerodp.offload.grad_swap` for the store).

:class:`zerodp.runtime.partitioned_reducer.PartitionedGradReducer` keeps this rank's owned gradient partition in
memory from construction on (2 bytes per owned element in bf16, 4 in fp32): with the optimizer
states on NVMe it is the one host term that grows with the model. Here a group's partition (one
stage-3 unit's shard of gradients) exists in memory only from the first reduction of one of its
buckets in a micro-step until all its buckets are reduced (and passed to ``on_reduced``); it is
then handed to the :class:`GradSpill` and dropped (its memory freed once its write lands, at the
latest when backward returns). At stage 3 a group is one unit, so the gradient memory is bounded by
a few units; at stage 2 a group is a whole parameter group, so during backward the partition is
still whole, and only between backward and the next one it is not in memory. A later micro-step of
the same accumulation reads it back to add to it. :meth:`SpillingGradReducer.piece_grad` of a spilled
group reads a copy (the accessors, ``clip_grad_norm_``); :meth:`SpillingGradReducer.held_grad` says
None, so the engine's step lets the optimizer offload read the gradients sub-group by sub-group itself.
ZeRO-Infinity (Rajbhandari et al., SC21) section 5; DeepSpeed stage 3 with ``offload_optimizer: nvme``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from zerodp.runtime.partition import Bucket, FlatGroup
from zerodp.runtime.partitioned_reducer import PartitionedGradReducer


class GradSpill(Protocol):
    """Where spilled partitions live, keyed by group index (:class:`zerodp.offload.grad_swap.GradSwap`)."""

    on_disk: set[int]

    def empty(self, index: int) -> torch.Tensor: ...
    def put(self, index: int, owned: torch.Tensor) -> None: ...
    def get(self, index: int) -> torch.Tensor: ...
    def read_elements(self, index: int, lo: int, hi: int) -> torch.Tensor: ...
    def forget(self) -> None: ...
    def drain(self) -> None: ...


#: makes the spill for a reducer (its ``owned_sizes`` and :meth:`SpillingGradReducer.owned_offset`), or None
SpillFactory = Callable[["SpillingGradReducer"], GradSpill | None]


class SpillingGradReducer(PartitionedGradReducer):
    """:class:`PartitionedGradReducer` with its owned partition in ``spill`` between uses (module docstring)."""

    def __init__(self, *args, spill: SpillFactory, **kwargs) -> None:
        self._make_spill = spill
        self.spill: GradSpill | None = None
        self._reduced_in_group: dict[int, int] = {}  # group index -> buckets reduced this micro-step
        super().__init__(*args, **kwargs)

    def _allocate_owned(self) -> None:
        self.spill = self._make_spill(self)
        if self.spill is None:  # the offload cannot take them (gradients not in host memory)
            super()._allocate_owned()

    def owned_offset(self, g: FlatGroup, lo: int, hi: int) -> int:
        """Element offset of flat range [lo, hi) of ``g`` in its owned partition.

        Raises:
            KeyError: this rank does not own the range.
        """
        for b in g.buckets:
            b_lo, b_hi = b.shard_range(self.rank)
            if b_lo <= lo and hi <= b_hi:
                return self._owned_offsets[(g.index, b.index)] + (lo - b_lo)
        raise KeyError(f"flat range [{lo}, {hi}) of group {g.index} is not owned by rank {self.rank}")

    def _owned_of(self, g: FlatGroup, first: bool) -> torch.Tensor | None:
        t = self.owned.get(g.index)
        if t is None and self.spill is not None and (first or g.index in self.spill.on_disk):
            t = self.spill.get(g.index) if g.index in self.spill.on_disk else self.spill.empty(g.index)
            self.owned[g.index] = t
        return t

    def begin_micro_step(self, reduce: bool, defer: bool = False) -> None:
        super().begin_micro_step(reduce, defer)
        self._reduced_in_group = {}

    def end_micro_step(self) -> None:
        """As the base, then wait for the last writes: no partition stays in memory past backward."""
        super().end_micro_step()
        if self.spill is not None:
            self.spill.drain()

    def _reduce_late(self, buckets: list[tuple[FlatGroup, Bucket]]) -> None:
        """As the base (the partitions it adds to are read back from the spill), then put them back."""
        super()._reduce_late(buckets)
        if self.spill is not None:
            for index in list(self.owned):
                self.spill.put(index, self.owned.pop(index))

    def _after_reduced(self, g: FlatGroup) -> None:
        if self.spill is None:
            return
        n = self._reduced_in_group.get(g.index, 0) + 1
        self._reduced_in_group[g.index] = n
        if n == len(g.buckets):  # the whole partition is reduced this micro-step: to the spill
            self.spill.put(g.index, self.owned.pop(g.index))

    def piece_grad(self, g: FlatGroup, lo: int, hi: int) -> torch.Tensor:
        """As the base; a spilled group's elements are read back into a new tensor (changing it
        changes nothing), a group without a reduction since the step gives zeros."""
        if self.spill is None or g.index in self.owned:
            return super().piece_grad(g, lo, hi)
        off = self.owned_offset(g, lo, hi)
        if g.index in self.spill.on_disk:
            return self.spill.read_elements(g.index, off, off + (hi - lo))
        return torch.zeros(hi - lo, dtype=self.accumulate_dtype or g.buffer.dtype, device=g.buffer.device)

    def held_grad(self, g: FlatGroup, lo: int, hi: int) -> torch.Tensor | None:
        if self.spill is not None and g.index not in self.owned:
            return None
        return super().held_grad(g, lo, hi)

    def zero_grads(self) -> None:
        if self.spill is not None:
            self.owned.clear()
            self.spill.forget()
        super().zero_grads()


def partitioned_reducer(*args, spill: SpillFactory | None = None, **kwargs) -> PartitionedGradReducer:
    """The stage-2/3 reducer: :class:`SpillingGradReducer` with ``spill``, else the plain one."""
    if spill is None:
        return PartitionedGradReducer(*args, **kwargs)
    return SpillingGradReducer(*args, spill=spill, **kwargs)


__all__ = ["GradSpill", "SpillFactory", "SpillingGradReducer", "partitioned_reducer"]
