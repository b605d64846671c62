"""The infinity preset's RAM plan (zerodp.app.infinity_ram) follows the engine it plans for: the stage-3
units it counts are those a real engine builds from the same GPT, and its reduce flush is the
engine's; its coalesced groups follow the reducer's rule. A world of one on gloo."""

from __future__ import annotations

import pytest

import zerodp
from zerodp.app.infinity_ram import knobs_for, largest_reduce_group, reduce_flush, unit_sizes
from zerodp.app.model import GPT, GPTConfig
from zerodp.stage3.sharding import reduce_flush_elements


@pytest.mark.parametrize("threshold", [0, 3000])
def test_units_and_flush_are_the_engines(world1, threshold: int) -> None:
    cfg = GPTConfig(n_layer=2, n_head=2, d_model=64, seq_len=16)
    engine = zerodp.initialize(
        GPT(cfg),
        {
            "train_micro_batch_size_per_gpu": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": threshold},
        },
    )
    built = engine.sharding.index.units
    planned = unit_sizes(cfg, threshold)
    assert sorted(u.numel for u in built if not u.persistent) == sorted(planned)
    for bucket in (1, 5000, 20000, 10**9):
        assert reduce_flush(planned, bucket) == reduce_flush_elements(built, bucket)


def test_largest_group_adds_units_until_the_flush() -> None:
    assert largest_reduce_group([4, 4, 1, 3, 4], 4) == 4  # 4 | 4 | 1 + 3 | 4
    assert largest_reduce_group([2, 5, 1], 3) == 7  # 2 + 5 | 1: the first crosses the flush by a whole unit
    assert largest_reduce_group([1, 2, 5, 1], 3) == 5  # 1 + 2 | 5 | 1 (flushed when backward returns)
    assert largest_reduce_group([1, 1], 10) == 2


@pytest.mark.parametrize("params", [4_787_155_968, 800_000_000])
def test_swap_buffers_are_a_job_budget_divided_among_the_ranks(params: int) -> None:
    """Issue 31 item 4 (the same with ``--nproc 2``): the optimizer's sub-group buffers and the
    parameter read-ahead of all ranks together do not grow with the number of ranks; each rank still
    has at least 4 sub-groups, at least one page of read-ahead and a live window of two layers."""
    k1, k2, k4 = (knobs_for(params, 35_000_000, n) for n in (1, 2, 4))
    for n, k in ((2, k2), (4, k4)):
        assert n * k.optimizer_buffers * k.sub_group_size <= k1.optimizer_buffers * k1.sub_group_size
        assert n * k.max_in_cpu <= k1.max_in_cpu
        assert n * k.max_live_parameters <= k1.max_live_parameters or k.max_live_parameters == 2 * 35_000_000
        assert k.max_in_cpu >= 4096 and params / n / k.sub_group_size >= 4
    if params > 4e9:  # one rank keeps the sizes the 3x runs measured
        assert (k1.sub_group_size, k1.max_in_cpu) == (12_500_000, 1_000_000_000)
