"""Coalesced collectives: several stage-3 units' all-gathers (or gradient reduce-scatters) as one.

On gloo (and NCCL) each collective has a fixed cost (a round of messages, a hand-off to the backend's
worker thread) that dominates for the small units of small models: the bench's 3.3 M-parameter GPT
issues 39 all-gathers and 19 reduce-scatters per step at stage 3, one per unit. torch's
``_coalescing_manager`` turns the single-tensor collectives issued inside it into one call of the
backend's coalesced variant (``all_gather_single_coalesced`` / ``reduce_scatter_single_coalesced``),
which moves every tensor in one operation and returns one ``Work``. Each tensor keeps its own output,
so the values are exactly those of separate collectives (an all-gather copies; a reduce-scatter sums
the same per-rank values). Only collectives of one kind, dtype and device are coalesced together.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, Work

T = TypeVar("T")


def runs_of_same_kind(items: Iterable[T], key: Callable[[T], object]) -> list[list[T]]:
    """Split ``items`` into maximal runs of consecutive items with equal ``key``."""
    runs: list[list[T]] = []
    for it in items:
        if runs and key(runs[-1][-1]) == key(it):
            runs[-1].append(it)
        else:
            runs.append([it])
    return runs


def coalesced(pg: ProcessGroup | None, launches: Sequence[Callable[[], Work | None]]) -> Work | None:
    """Run ``launches`` (each issues exactly one async collective of the same kind, dtype and device)
    as one coalesced collective; returns its ``Work`` (or the single launch's own for one)."""
    if len(launches) == 1:
        return launches[0]()
    with dist._coalescing_manager(group=pg, async_ops=True) as cm:
        for launch in launches:
            launch()
    return cm.works[-1] if cm.works else None


def dtype_device(t: torch.Tensor) -> tuple[torch.dtype, torch.device]:
    return t.dtype, t.device
