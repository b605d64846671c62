"""Flat-buffer bucket plans and owned pieces (zerodp.runtime.partition), in process, any world size.

No collective runs here: plans are pure functions of the parameter sizes, the bucket size and N.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from zerodp.runtime.partition import FlatGroup, assign_pieces, flatten_into, memory_stride, plan_buckets


def _params(sizes: list[int], requires_grad: list[bool] | None = None) -> list[tuple[str, nn.Parameter]]:
    flags = requires_grad or [True] * len(sizes)
    return [
        (f"p{i}", nn.Parameter(torch.randn(n), requires_grad=g))
        for i, (n, g) in enumerate(zip(sizes, flags, strict=True))
    ]


def _random_case(seed: int) -> tuple[list[int], int, int]:
    rng = random.Random(seed)
    sizes = [rng.choice([1, 2, 3, 5, 7, 16, 31, 64, 100]) for _ in range(rng.randint(1, 12))]
    return sizes, rng.choice([1, 4, 10, 33, 64, 1000]), rng.randint(1, 5)


CASES = [_random_case(s) for s in range(40)] + [([10, 10, 10], 20, 3), ([50], 8, 4), ([3, 3], 6, 1)]


@pytest.mark.parametrize("sizes, bucket_size, world", CASES)
def test_buckets_cover_every_element_once_within_bound(sizes: list[int], bucket_size: int, world: int) -> None:
    named = _params(sizes)
    slots, buckets, total = plan_buckets(named, first_index=5, bucket_size=bucket_size, world_size=world)

    # each parameter gets exactly one slot, with its own numel/shape and its engine-wide index
    assert sorted(s.index for s in slots) == [5 + i for i in range(len(sizes))]
    for s in slots:
        assert s.param is named[s.index - 5][1] and s.numel == sizes[s.index - 5]
    # laid out in reverse registration order (the order backward produces gradients)
    assert [s.index for s in slots] == sorted((s.index for s in slots), reverse=True)

    # buckets are back to back, each padded to a multiple of N by less than N elements
    cursor = 0
    for i, b in enumerate(buckets):
        assert b.index == i and b.start == cursor and b.world_size == world
        content = sum(s.numel for s in b.slots)
        assert b.numel % world == 0 and 0 <= b.numel - content < world
        # the bound: at most bucket_size elements, unless one parameter alone is larger
        assert content <= bucket_size or len(b.slots) == 1
        # greedy: the next bucket's first parameter did not fit in this one
        if i + 1 < len(buckets):
            assert content + buckets[i + 1].slots[0].numel > bucket_size
        cursor += b.numel
    assert total == cursor == sum(b.numel for b in buckets)

    # every flat element belongs to at most one slot; every parameter element to exactly one place
    owner = torch.full((total,), -1)
    for b in buckets:
        for s in b.slots:
            assert b.start <= s.offset and s.offset + s.numel <= b.start + b.numel
            assert (owner[s.offset : s.offset + s.numel] == -1).all()
            owner[s.offset : s.offset + s.numel] = s.index
    assert int((owner >= 0).sum()) == sum(sizes)


def test_parameter_larger_than_bucket_gets_its_own() -> None:
    _, buckets, _ = plan_buckets(_params([4, 100, 4]), 0, bucket_size=10, world_size=3)
    assert [[s.name for s in b.slots] for b in buckets] == [["p2"], ["p1"], ["p0"]]
    assert [b.numel for b in buckets] == [6, 102, 6]


@pytest.mark.parametrize("sizes, bucket_size, world", CASES)
def test_pieces_partition_each_bucket_across_ranks(sizes: list[int], bucket_size: int, world: int) -> None:
    frozen = [i % 4 != 3 for i in range(len(sizes))]  # every fourth parameter frozen
    named = _params(sizes, frozen)
    slots, buckets, total = plan_buckets(named, 0, bucket_size, world)
    buffer = flatten_into(slots, total)
    owner = torch.zeros(total, dtype=torch.int64)
    for rank in range(world):
        group = FlatGroup(0, buffer, buckets, slots)
        assign_pieces(group, rank, owns_everything=False)
        for b in buckets:
            lo_b, hi_b = b.shard_range(rank)
            assert hi_b - lo_b == b.numel // world  # equal shards: one reduce-scatter per bucket
        for p in group.pieces:
            lo_b, hi_b = p.bucket.shard_range(rank)
            assert lo_b <= p.lo < p.hi <= hi_b and p.slot in p.bucket.slots
            assert p.slot.offset <= p.lo and p.hi <= p.slot.offset + p.slot.numel
            assert p.slot.param.requires_grad
            # the optimizer tensor is a view of exactly that flat range
            assert p.tensor.data_ptr() == buffer[p.lo :].data_ptr() and p.tensor.numel() == p.hi - p.lo
            owner[p.lo : p.hi] += 1
    # across the N ranks every trainable element is owned exactly once, nothing else is
    expected = torch.zeros(total, dtype=torch.int64)
    for s in slots:
        if s.param.requires_grad:
            expected[s.offset : s.offset + s.numel] = 1
    assert torch.equal(owner, expected)


def test_stage0_owns_every_parameter_whole() -> None:
    named = _params([3, 5, 7], [True, False, True])
    slots, buckets, total = plan_buckets(named, 0, bucket_size=8, world_size=2)
    group = FlatGroup(0, flatten_into(slots, total), buckets, slots)
    assign_pieces(group, rank=1, owns_everything=True)
    assert sorted((p.slot.name, p.hi - p.lo) for p in group.pieces) == [("p0", 3), ("p2", 7)]


def test_sharded_buffer_pieces_index_the_shard() -> None:
    """Stage 3 / sharded groups: ``buffer`` is only this rank's shard, starting at ``shard_offset``."""
    named = _params([5, 6])
    slots, buckets, total = plan_buckets(named, 0, bucket_size=100, world_size=2)
    full = flatten_into(slots, total)
    rank = 1
    lo, hi = buckets[0].shard_range(rank)
    group = FlatGroup(0, full[lo:hi].clone(), buckets, slots, shard_offset=lo)
    assign_pieces(group, rank, owns_everything=False)
    for p in group.pieces:
        assert torch.equal(p.tensor, full[p.lo : p.hi])
    assert sum(p.tensor.numel() for p in group.pieces) == 11 - lo  # 12 padded, rank 1 holds [6, 12) minus 1 pad


def test_flatten_keeps_values_views_and_zero_padding() -> None:
    conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    lin = nn.Linear(5, 3)
    named = [("conv.weight", conv.weight), ("conv.bias", conv.bias), ("lin.weight", lin.weight)]
    before = [p.detach().clone() for _, p in named]
    strides = [p.stride() for _, p in named]
    slots, buckets, total = plan_buckets(named, 0, bucket_size=1000, world_size=4)
    buffer = flatten_into(slots, total)
    for (_, p), want, stride in zip(named, before, strides, strict=True):
        assert torch.equal(p.detach(), want) and p.stride() == stride  # channels_last kept
        assert buffer.data_ptr() <= p.data_ptr() < buffer.data_ptr() + total * buffer.element_size()
    used = sum(s.numel for s in slots)
    assert total - used == (-used) % 4 and not buffer[used:].any()
    # an in-place update through the flat buffer is seen by the parameter (it is a view)
    buffer.add_(1.0)
    assert torch.equal(named[0][1].detach(), before[0] + 1.0)


def test_memory_stride() -> None:
    assert memory_stride(torch.empty(3, 4)) is None
    cl = torch.empty(2, 3, 4, 5).to(memory_format=torch.channels_last)
    assert memory_stride(cl) == cl.stride()
    assert memory_stride(torch.empty(4, 6)[:, ::2]) is None  # not dense: no flat range holds it
