"""Parameter shards resident during the NVMe optimizer step (stage 3, ``offload_param`` and
``offload_optimizer`` both on NVMe).

The step updates this rank's pieces sub-group by sub-group (:mod:`zerodp.offload.nvme`); a piece is a
view of its stage-3 unit's shard, which lives in the parameter swap file between uses
(:mod:`zerodp.offload.param_swap`). Instead of making every shard resident for the whole step,
:class:`ShardWindow` pins the shards of the units whose pieces are in sub-group k just before k is
updated (their reads were queued while k-1 was updated), queues the reads of k+1's, and unpins,
dirty (written home), those k+1 does not need. A unit may span sub-groups (it stays pinned across
them). Resident shard bytes during the step are therefore those of two consecutive sub-groups (at
most ``2 x sub_group_size`` elements plus the units cut by the boundaries), plus read-ahead.

A shard whose file holds what the last step cast into it, unchanged since
(:attr:`zerodp.offload.param_swap.SwappedShard.step_current`), has nothing for the step's
in-place-edit check to find; when the step also writes every piece of it (each has a gradient),
its old values are not needed at all and it is pinned without a read (``blank``,
:func:`step_current_groups`): 2 bytes per bf16 parameter of ``params.swp`` reads fewer per step.
ZeRO-Infinity (Rajbhandari et al., SC21) section 5: parameters and optimizer states stream through
bounded buffers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from zerodp.runtime.partition import FlatGroup


class ShardAccess(Protocol):
    """The parameter offload's per-group residency (:class:`zerodp.offload.param_offload.ParamOffload`)."""

    def prefetch(self, groups: Sequence[FlatGroup]) -> None: ...
    def pin(self, groups: Sequence[FlatGroup], fill: bool = True) -> None: ...
    def unpin(self, groups: Sequence[FlatGroup], dirty: bool, keep: bool = False, by_step: bool = False) -> None: ...
    def swapped(self, group: FlatGroup) -> bool: ...
    def step_current(self, group: FlatGroup) -> bool: ...
    def forget_step_writes(self) -> None: ...
    def set_use_hook(self, before_use: Callable[[FlatGroup], None], pending: Callable[[FlatGroup], bool]) -> None: ...
    def deferrable(self, group: FlatGroup) -> bool: ...


class ShardWindow:
    """Parameter shards resident during the sub-group loop: ``need[k]`` are the flat groups whose
    shards sub-group k writes. :meth:`enter` pins k's (reads queued at k-1) and queues k+1's reads;
    :meth:`leave` unpins, dirty, those k+1 does not need. ``blank``: ids of the groups the loop
    overwrites whole, pinned without a read (:func:`step_current_groups`). No-op without an access."""

    def __init__(
        self, access: ShardAccess | None, need: list[list[FlatGroup]], blank: frozenset[int] = frozenset()
    ) -> None:
        self.access = access
        self.need = need
        self.blank = blank
        self.held: list[FlatGroup] = []
        #: leave updated shards resident within the read-ahead budget (their use is imminent: the
        #: loop runs during the forward that reads them, ``overlap_step``)
        self.keep = False
        if need:
            self._prefetch(need[0])

    def _prefetch(self, groups: list[FlatGroup]) -> None:
        if self.access is not None:
            self.access.prefetch([g for g in groups if id(g) not in self.blank])

    def enter(self, k: int) -> None:
        """Before updating sub-group k: its shards pinned (resident), k+1's reads queued."""
        if self.access is None:
            return
        new = [g for g in self.need[k] if not any(g is h for h in self.held)]
        self.access.pin([g for g in new if id(g) not in self.blank])
        self.access.pin([g for g in new if id(g) in self.blank], fill=False)
        self.held += new
        if k + 1 < len(self.need):
            self._prefetch(self.need[k + 1])

    def leave(self, k: int) -> None:
        """After updating sub-group k: unpin (dirty) the shards sub-group k+1 does not need."""
        if self.access is None:
            return
        keep = self.need[k + 1] if k + 1 < len(self.need) else []
        drop = [g for g in self.held if not any(g is x for x in keep)]
        self.held = [g for g in self.held if any(g is x for x in keep)]
        self.access.unpin(drop, dirty=True, keep=self.keep, by_step=True)

    def close(self, complete: bool = True) -> None:
        """Unpin what is still held (dirty: it may have been updated). ``complete`` False: the loop was
        abandoned because the job is closing (:meth:`SubGroupPipeline.abandon`); a shard pinned
        without a read may then hold pieces never written, and its write does not count as the cast
        of its masters. Nothing reads such a shard again: the swap files are removed next."""
        if self.access is not None and self.held:
            held, self.held = self.held, []
            self.access.unpin(held, dirty=True, keep=self.keep, by_step=complete)


def step_current_groups(
    access: ShardAccess | None, group_of: list[FlatGroup], present: list[bool], masters_apart: bool
) -> tuple[set[int], frozenset[int]]:
    """For a step's loop: the piece positions whose shard needs no in-place-edit check (its file
    holds what the last step cast into it, unchanged since: :meth:`ShardAccess.step_current`), and the
    ids of the groups among them the loop overwrites whole (every piece has a gradient: ``present``,
    per piece position; the pieces cover every parameter element of the shard), to pin without a
    read. ``masters_apart`` False (the module's fp32 tensors are the masters): none, the update
    reads the shard itself."""
    if access is None or not masters_apart:
        return set(), frozenset()
    groups = {id(g): g for g in group_of}
    current = {k for k, g in groups.items() if access.step_current(g)}
    trusted = {i for i, g in enumerate(group_of) if id(g) in current}
    partial = {id(group_of[i]) for i in trusted if not present[i]}
    partial |= {k for k in current if not pieces_cover_parameters(groups[k])}
    return trusted, frozenset(current - partial)


def pieces_cover_parameters(group: FlatGroup) -> bool:
    """True if this rank's pieces of ``group`` cover every element of its shard (``buffer``, flat
    coordinates from ``shard_offset``) that holds a parameter: no frozen parameter, and none outside
    the optimizer's param groups, has elements there (only padding is left uncovered)."""
    lo, hi = group.shard_offset, group.shard_offset + group.buffer.numel()
    held = sum(max(0, min(hi, s.offset + s.numel) - max(lo, s.offset)) for s in group.slots)
    return held == sum(p.hi - p.lo for p in group.pieces)


def unique_groups(groups: Iterable[FlatGroup]) -> list[FlatGroup]:
    """``groups`` without repeats (by identity), in first-seen order."""
    out: list[FlatGroup] = []
    for g in groups:
        if not any(g is h for h in out):
            out.append(g)
    return out


__all__ = ["ShardAccess", "ShardWindow", "pieces_cover_parameters", "step_current_groups", "unique_groups"]
