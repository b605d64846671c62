"""Sub-groups of the NVMe optimizer swapper (:mod:`zerodp.offload.nvme`): consecutive spans of this
rank's pieces swapped together, each one contiguous region of the swap file (DeepSpeed's
``zero_optimization.sub_group_size``; ZeRO-Infinity, Rajbhandari et al. SC21, section 5.2).
"""

from __future__ import annotations

from dataclasses import dataclass

from zerodp.offload.aio import align_up
from zerodp.offload.sizing import SPLIT_ALIGN
from zerodp.runtime.partition import Piece


@dataclass
class SubGroup:
    """Consecutive spans of pieces swapped together; ``offset`` in the file; ``seg`` bytes per segment;
    ``segments``: 3 (fp32 masters, ``exp_avg``, ``exp_avg_sq``) or 2 (the moments only, when the
    module's fp32 tensors are the masters)."""

    index: int
    spans: list[tuple[int, int, int]]  # (position in NvmeOptimizerOffload.pieces, lo, hi): elements of the piece
    numel: int
    offset: int
    seg: int
    segments: int = 3

    @property
    def pieces(self) -> list[int]:
        """Positions of the pieces with a span here, in order, each once."""
        return list(dict.fromkeys(i for i, _, _ in self.spans))

    @property
    def nbytes(self) -> int:
        return self.segments * self.seg


def plan_subgroups(pieces: list[Piece], order: list[int], size: int, segments: int = 3) -> list[SubGroup]:
    """Sub-groups of consecutive spans of the pieces at ``order`` (positions in ``pieces``), each of at
    most ``size`` elements; a piece that does not fit in what is left of a sub-group is cut at a
    multiple of :data:`zerodp.offload.sizing.SPLIT_ALIGN` elements from its start (a piece smaller
    than that, or a ``size`` below it, is not cut: such a sub-group may exceed ``size``). Each
    sub-group is one contiguous region of the swap file (``segments`` segments)."""
    groups: list[SubGroup] = []
    current: list[tuple[int, int, int]] = []
    numel = 0
    offset = 0

    def close() -> None:
        nonlocal offset, current, numel
        if current:
            seg = align_up(4 * numel)
            groups.append(SubGroup(len(groups), current, numel, offset, seg, segments))
            offset += segments * seg
        current, numel = [], 0

    for i in order:
        n = pieces[i].hi - pieces[i].lo
        lo = 0
        while lo < n:
            room = size - numel
            if n - lo <= room:
                take = n - lo
            else:
                take = room // SPLIT_ALIGN * SPLIT_ALIGN
                if take == 0 and current:
                    close()
                    continue
                if take == 0:  # an empty sub-group: at least one aligned span (or the rest of the piece)
                    take = min(n - lo, max(SPLIT_ALIGN, size // SPLIT_ALIGN * SPLIT_ALIGN))
            current.append((i, lo, lo + take))
            numel += take
            lo += take
            if numel >= size:
                close()
    close()
    return groups


__all__ = ["SubGroup", "plan_subgroups"]
