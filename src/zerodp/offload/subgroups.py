"""Sub-groups of the NVMe optimizer swapper (:mod:`zerodp.offload.nvme`): consecutive spans of this
rank's pieces swapped together, each one contiguous region of the swap file (DeepSpeed's
``zero_optimization.sub_group_size``; ZeRO-Infinity, Rajbhandari et al. SC21, section 5.2).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

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

    def views(self, seg: torch.Tensor) -> Iterator[tuple[int, int, int, torch.Tensor]]:
        """(piece position, lo, hi, the span's fp32 view) inside one fp32 segment of this sub-group's buffer."""
        at = 0
        for i, lo, hi in self.spans:
            yield i, lo, hi, seg[at : at + hi - lo]
            at += hi - lo

    def buffer_segments(self, buf: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """(masters or None, exp_avg, exp_avg_sq): the fp32 segments of ``buf`` (uint8, :attr:`nbytes`);
        masters None when the module's tensors are the masters (2 segments)."""
        f32 = buf.view(torch.float32)
        per = self.seg // 4
        segs = [f32[j * per : (j + 1) * per] for j in range(self.segments)]
        if self.segments == 2:
            return None, segs[0], segs[1]
        return segs[0], segs[1], segs[2]


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
