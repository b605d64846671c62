"""Gradient reducers (zerodp.runtime.reducer) driven in process, as the engine drives them.

World of one on gloo: the reduced ("averaged") gradient of every owned piece must equal autograd's
gradient of the same loss, summed over the micro-steps, for the three strategies (stage 0 all-reduce,
stage 1 full-buffer reduce-scatter, stage 2 partitioned reduce-scatter), several buckets, a parameter
that gets no gradient and a frozen one. A fake process group of N ranks checks the partition sizes.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from zerodp.runtime.comm import CommLedger
from zerodp.runtime.partition import FlatGroup, assign_pieces, flatten_into, plan_buckets
from zerodp.runtime.reducer import (
    DIRECT_BACKWARD_MESSAGE,
    AllReduceReducer,
    FullGradReduceScatter,
    PartitionedGradReducer,
)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 5)
        self.b = nn.Linear(5, 4)
        self.unused = nn.Linear(3, 3)  # never in forward: no gradient
        self.frozen = nn.Linear(4, 2)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.frozen(torch.tanh(self.b(torch.tanh(self.a(x))))).square().sum()


def _build(
    model: nn.Module,
    stage: int,
    world_size: int,
    rank: int,
    bucket_size: int = 25,
    accumulate_dtype: torch.dtype | None = None,
    **kwargs,
):
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    slots, buckets, total = plan_buckets(named, 0, bucket_size, world_size)
    group = FlatGroup(0, flatten_into(slots, total), buckets, slots)
    assign_pieces(group, rank, owns_everything=stage == 0)
    cls = {0: AllReduceReducer, 1: FullGradReduceScatter, 2: PartitionedGradReducer}[stage]
    reducer = cls([group], rank, world_size, None, CommLedger(), True, accumulate_dtype, **kwargs)
    reducer.attach()
    return group, reducer


def _micro_steps(model: nn.Module, reducer, batches: list[torch.Tensor], stage: int) -> None:
    for i, x in enumerate(batches):
        boundary = i == len(batches) - 1
        reducer.begin_micro_step(reduce=boundary or stage >= 2)
        (model(x) / len(batches)).backward()
        reducer.end_micro_step()


VARIANTS = [(0, {}), (1, {}), (2, {}), (2, {"contiguous_gradients": False}), (2, {"grad_views": True})]


@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("stage, kwargs", VARIANTS)
def test_reduced_gradient_equals_autograd(world1, stage: int, kwargs: dict, steps: int) -> None:
    model = Net()
    ref = copy.deepcopy(model)
    group, reducer = _build(model, stage, 1, 0, **kwargs)
    assert len(group.buckets) >= 3  # several buckets (25 elements each at most)
    batches = [torch.randn(2, 6) for _ in range(steps)]
    _micro_steps(model, reducer, batches, stage)
    for x in batches:
        (ref(x) / steps).backward()

    present, overflow = reducer.presence()
    assert not overflow
    ref_params = dict(ref.named_parameters())
    seen = set()
    for piece in group.pieces:
        name = piece.slot.name
        got = reducer.piece_grad(group, piece.lo, piece.hi)
        if name.startswith("unused."):
            assert present[piece.slot.index] == 0 and not got.any()
            continue
        assert present[piece.slot.index] == 1
        want = ref_params[name].grad.reshape(-1)[piece.lo - piece.slot.offset : piece.hi - piece.slot.offset]
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
        seen.add(name)
    assert seen == {"a.weight", "a.bias", "b.weight", "b.bias"}
    assert not any(p.slot.name.startswith("frozen.") for p in group.pieces)

    # after zero_grads the next step starts from zero again
    reducer.zero_grads()
    assert not reducer.presence()[0].any()
    _micro_steps(model, reducer, batches[:1], stage)
    ref.zero_grad()
    ref(batches[0]).backward()
    piece = next(p for p in group.pieces if p.slot.name == "a.weight")
    torch.testing.assert_close(
        reducer.piece_grad(group, piece.lo, piece.hi),
        ref.a.weight.grad.reshape(-1)[piece.lo - piece.slot.offset : piece.hi - piece.slot.offset],
    )


@pytest.mark.parametrize("stage, kwargs", [(0, {}), (2, {}), (2, {"grad_views": True})])
def test_bf16_gradients_accumulate_in_fp32(world1, stage: int, kwargs: dict) -> None:
    """With an fp32 accumulation dtype, each bf16 micro-step gradient is added in fp32 (no bf16 sum)."""
    model = Net().to(torch.bfloat16)
    ref = copy.deepcopy(model)
    group, reducer = _build(model, stage, 1, 0, accumulate_dtype=torch.float32, **kwargs)
    batches = [torch.randn(2, 6, dtype=torch.bfloat16) for _ in range(4)]
    _micro_steps(model, reducer, batches, stage)
    want = {n: torch.zeros(p.shape) for n, p in ref.named_parameters()}
    for x in batches:
        ref.zero_grad()
        (ref(x) / 4).backward()
        for n, p in ref.named_parameters():
            if p.grad is not None:
                want[n] += p.grad.float()
    for piece in group.pieces:
        got = reducer.piece_grad(group, piece.lo, piece.hi)
        assert got.dtype == torch.float32
        w = want[piece.slot.name].reshape(-1)[piece.lo - piece.slot.offset : piece.hi - piece.slot.offset]
        assert torch.equal(got, w), piece.slot.name


def test_plain_backward_is_refused(world1) -> None:
    model = Net()
    _build(model, 2, 1, 0)
    with pytest.raises(RuntimeError, match="call engine.backward"):
        model(torch.randn(2, 6)).backward()
    assert "engine.backward(loss)" in DIRECT_BACKWARD_MESSAGE


@pytest.mark.parametrize("world_size, rank", [(2, 0), (3, 2), (4, 1)])
def test_stage2_owned_partition_is_one_shard_per_bucket(fake_world, world_size: int, rank: int) -> None:
    fake_world(rank, world_size)
    model = Net()
    group, reducer = _build(model, 2, world_size, rank)
    assert reducer.owned[0].numel() == sum(b.numel // world_size for b in group.buckets)
    _micro_steps(model, reducer, [torch.randn(2, 6)], 2)  # runs on the fake group; values not checked
    for piece in group.pieces:
        assert reducer.piece_grad(group, piece.lo, piece.hi).numel() == piece.hi - piece.lo
    b = group.buckets[0]
    not_owned = b.shard_range((rank + 1) % world_size)
    with pytest.raises(KeyError, match=f"not owned by rank {rank}"):
        reducer.piece_grad(group, *not_owned)


class Reused(nn.Module):
    """``a`` runs twice under reentrant checkpointing: one inner backward per segment, so its
    gradient is accumulated (and its hook called) twice in one backward."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = checkpoint(self.a, x, use_reentrant=True)
        h = checkpoint(self.a, torch.tanh(h), use_reentrant=True)
        return self.b(h).square().sum()


@pytest.mark.parametrize("stage, kwargs", VARIANTS)
def test_repeated_accumulation_in_one_backward_is_summed(world1, stage: int, kwargs: dict) -> None:
    model = Reused()
    ref = copy.deepcopy(model)
    group, reducer = _build(model, stage, 1, 0, bucket_size=8, **kwargs)
    x = torch.randn(3, 4, requires_grad=True)  # reentrant checkpointing needs an input that requires grad
    for _ in range(2):  # the first micro-step calibrates, the second runs with what it found
        reducer.zero_grads()
        ref.zero_grad()
        _micro_steps(model, reducer, [x], stage)
        ref(x).backward()
        for piece in group.pieces:
            want = dict(ref.named_parameters())[piece.slot.name].grad.reshape(-1)
            torch.testing.assert_close(
                reducer.piece_grad(group, piece.lo, piece.hi),
                want[piece.lo - piece.slot.offset : piece.hi - piece.slot.offset],
            )


@pytest.mark.parametrize("stage, kwargs", VARIANTS)
def test_second_backward_on_the_boundary_adds(world1, stage: int, kwargs: dict) -> None:
    """Two engine.backward calls on the boundary micro-step before step(): both gradients count."""
    model = Net()
    ref = copy.deepcopy(model)
    group, reducer = _build(model, stage, 1, 0, **kwargs)
    xs = [torch.randn(2, 6), torch.randn(2, 6)]
    for x in xs:
        _micro_steps(model, reducer, [x], stage)
        ref(x).backward()
    for piece in group.pieces:
        grad = dict(ref.named_parameters())[piece.slot.name].grad
        if grad is None:
            continue
        torch.testing.assert_close(
            reducer.piece_grad(group, piece.lo, piece.hi),
            grad.reshape(-1)[piece.lo - piece.slot.offset : piece.hi - piece.slot.offset],
        )


class Deep(nn.Module):
    """Eight layers of 16 -> 16, one bucket each (``bucket_size`` 272)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(16, 16) for _ in range(8)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x).square().sum()


@pytest.mark.parametrize("kwargs", [{}, {"contiguous_gradients": False}])
def test_first_micro_step_stages_few_buckets(world1, kwargs: dict) -> None:
    """The calibration micro-step (the first) reduces each bucket once it is complete, as later ones
    do: the gradient bytes staged, in flight or left in ``.grad`` during its backward stay within a
    few buckets, not the whole unscattered gradient (2 bytes per parameter in bf16 at ZeRO-Infinity's
    first step, docs/benchmarks/2026-12-02-infinity-2.4x.md); the gradients equal autograd's."""
    torch.manual_seed(0)
    model = Deep()
    ref = copy.deepcopy(model)
    bucket = 16 * 16 + 16
    group, reducer = _build(model, 2, 1, 0, bucket_size=bucket, **kwargs)
    assert len(group.buckets) == 8
    owned = sum(t.numel() * t.element_size() for t in reducer.owned.values())
    held = []  # after each layer's weight gradient: what the reducer and .grad hold besides the partition
    for layer in model.layers:
        layer.weight.register_post_accumulate_grad_hook(
            lambda p: held.append(
                sum(reducer.held_bytes().values())
                - owned
                + sum(q.grad.numel() * q.grad.element_size() for q in model.parameters() if q.grad is not None)
            )
        )
    x = torch.randn(3, 16)
    _micro_steps(model, reducer, [x], 2)
    assert len(held) == 8 and max(held) <= 3 * bucket * 4, (held, bucket * 4)
    ref(x).backward()
    for piece in group.pieces:
        want = dict(ref.named_parameters())[piece.slot.name].grad.reshape(-1)
        torch.testing.assert_close(
            reducer.piece_grad(group, piece.lo, piece.hi),
            want[piece.lo - piece.slot.offset : piece.hi - piece.slot.offset],
        )
