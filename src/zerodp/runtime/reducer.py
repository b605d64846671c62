"""Gradient reduction during backward, one strategy per stage (chosen once, not checked per hook).

Each trainable parameter gets one post-accumulate-grad hook. When every parameter of a bucket has its
gradient for the current micro-step, the bucket's collective is launched (asynchronously when
``overlap_comm``), so communication overlaps the rest of backward. Buckets whose parameters got no
gradient are launched when backward returns (their missing gradients are zeros).

- :class:`AllReduceReducer` (stage 0): gradients live in a full flat gradient buffer that ``param.grad``
  views; each bucket is all-reduced in place at the gradient accumulation boundary.
  Under bf16/fp16 with fp32 ``accumulate_dtype`` (:mod:`zerodp.runtime.precision`) the buffer is fp32:
  each arriving ``param.grad`` is added into it and set to None; it is reduced in fp32.
- :class:`FullGradReduceScatter` (stage 1): the same full gradient buffer, but each bucket is
  reduce-scattered at the boundary; the owned shard is written back into the buffer's owned range.
- :class:`PartitionedGradReducer` (stage 2): there is no full gradient buffer. Each gradient is added
  into its bucket's staging buffer by autograd, through a ``param.grad`` view of it that exists only
  until the bucket is reduced (:mod:`zerodp.runtime.grad_views`); a complete bucket is reduce-scattered every
  micro-step and the result accumulated into the owned gradient partition (fp32 when params are).
  Gradient memory peaks at the staging buffers in flight plus the owned partition.

All strategies pre-divide by the world size, so the owned gradient is the data-parallel mean.
Every rank also records which parameters received a gradient (on any micro-step since the last
boundary); :meth:`GradientReducer.presence` all-reduces those flags so every rank skips exactly the
parameters that no rank produced a gradient for, as torch's optimizer does for ``grad is None``.

The shared base and its [Note: repeated accumulation] are in :mod:`zerodp.runtime.grad_reducer`; this
module gathers the strategies under one name and chooses one (:func:`build_reducer`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed import ProcessGroup

from zerodp.config import ZeroConfig
from zerodp.runtime.comm import CommLedger
from zerodp.runtime.full_grad_reducers import AllReduceReducer, FullGradReduceScatter
from zerodp.runtime.grad_reducer import (
    DIRECT_BACKWARD_MESSAGE,
    DROPPED_ENGINE_MESSAGE,
    MAX_BUCKETS_IN_FLIGHT,
    GradientReducer,
    StagingPool,
)
from zerodp.runtime.grad_spill import SpillFactory, partitioned_reducer
from zerodp.runtime.partition import Bucket, FlatGroup
from zerodp.runtime.partitioned_reducer import PartitionedGradReducer


def build_reducer(
    stage: int,
    groups: list[FlatGroup],
    rank: int,
    world_size: int,
    pg: ProcessGroup | None,
    ledger: CommLedger,
    zc: ZeroConfig,
    accumulate_dtype: torch.dtype | None,
    on_reduced: Callable[[FlatGroup, Bucket], None] | None,
    *,
    launch_check: Callable[[list[tuple[int, int]]], None] | None = None,
    spill: SpillFactory | None,
    staging_pool: StagingPool | None,
    coalesce_elements: int,
) -> GradientReducer:
    """The reducer of ``stage``, chosen once at engine construction (not yet attached): stage 0
    :class:`AllReduceReducer`, 1 :class:`FullGradReduceScatter`, 2-3 the partitioned reducer
    (:func:`zerodp.runtime.grad_spill.partitioned_reducer`), which alone takes ``spill`` (gradients
    written out per unit), ``staging_pool`` and ``coalesce_elements`` (stage 3's coalesced
    reduce-scatters); at stage 2 autograd accumulates into views of the staging buffers
    ([Note: gradient views] in :mod:`zerodp.runtime.grad_views`). ``on_reduced(group, bucket)``: called
    once each bucket is reduced. ``launch_check(buckets)``: called before each collective is launched
    (the backward agreement's tag; None: no check)."""
    args = (groups, rank, world_size, pg, ledger, zc.overlap_comm, accumulate_dtype, on_reduced)
    if stage == 0:
        return AllReduceReducer(*args, launch_check=launch_check)
    if stage == 1:
        return FullGradReduceScatter(*args, launch_check=launch_check)
    return partitioned_reducer(
        *args,
        launch_check=launch_check,
        contiguous_gradients=zc.contiguous_gradients,
        grad_views=stage == 2,
        spill=spill,
        staging_pool=staging_pool,
        coalesce_elements=coalesce_elements,
    )


__all__ = [
    "DIRECT_BACKWARD_MESSAGE",
    "DROPPED_ENGINE_MESSAGE",
    "MAX_BUCKETS_IN_FLIGHT",
    "AllReduceReducer",
    "FullGradReduceScatter",
    "GradientReducer",
    "PartitionedGradReducer",
    "StagingPool",
    "build_reducer",
]
