"""Stage 2's gradient views ([Note: gradient views] in zerodp.runtime.grad_views), in process.

``param.grad`` is a view of its bucket's staging buffer while the bucket is filled (autograd adds into
it), and None again once the bucket is reduced; a ``.grad`` set before backward is added, as autograd
adds into it; a backward that raised leaves no partial sum behind. Values are compared with autograd's
on a world of one (gloo); the views are checked against each slot's range, shape and strides.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from zerodp.runtime.comm import CommLedger
from zerodp.runtime.grad_views import BucketViews
from zerodp.runtime.partition import FlatGroup, ParamSlot, assign_pieces, flatten_into, plan_buckets
from zerodp.runtime.partitioned_reducer import PartitionedGradReducer


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 5)
        self.b = nn.Linear(5, 4)
        self.c = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x))))).square().sum()


def _build(model: nn.Module, bucket_size: int = 60) -> tuple[FlatGroup, PartitionedGradReducer]:
    named = list(model.named_parameters())
    slots, buckets, total = plan_buckets(named, 0, bucket_size, 1)
    group = FlatGroup(0, flatten_into(slots, total), buckets, slots)
    assign_pieces(group, 0, owns_everything=False)
    reducer = PartitionedGradReducer([group], 0, 1, None, CommLedger(), True, grad_views=True)
    reducer.attach()
    return group, reducer


def _assert_matches(group: FlatGroup, reducer: PartitionedGradReducer, ref: nn.Module) -> None:
    grads = {n: p.grad for n, p in ref.named_parameters()}
    for piece in group.pieces:
        want = grads[piece.slot.name].reshape(-1)[piece.lo - piece.slot.offset : piece.hi - piece.slot.offset]
        assert torch.equal(reducer.piece_grad(group, piece.lo, piece.hi), want), piece.slot.name


def test_grad_is_a_bucket_view_until_the_bucket_is_reduced(world1) -> None:
    model = Net()
    group, reducer = _build(model)
    assert len(group.buckets) >= 2
    seen: list[tuple[str, int | None]] = []  # (parameter, data_ptr of .grad's storage) in later hooks
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(
            lambda p, name=name: seen.append((name, None if p.grad is None else p.grad.untyped_storage().data_ptr()))
        )
    for launched_in_hooks in (len(group.buckets),) * 2:  # the first (calibration) micro-step launches in hooks too
        seen.clear()
        reducer.begin_micro_step(reduce=True)
        model(torch.randn(2, 6)).backward()
        reducer.end_micro_step()
        assert len(seen) == len(group.slots)
        # a view of a staging buffer (never the parameters' flat buffer), or None in the hook after the
        # one whose gradient completed its bucket and launched it
        assert all(ptr != group.buffer.untyped_storage().data_ptr() for _, ptr in seen if ptr is not None)
        assert sum(ptr is None for _, ptr in seen) == launched_in_hooks
        assert all(p.grad is None for p in model.parameters())
        assert reducer._staging == {} and reducer._views == {}


def test_grad_set_before_backward_is_added(world1) -> None:
    """A ``.grad`` the user set is accumulated into by autograd and then taken, as without views."""
    model = Net()
    ref = copy.deepcopy(model)
    group, reducer = _build(model, bucket_size=10_000)  # one bucket: b.weight is not its first gradient
    x = torch.randn(2, 6)
    for m in (model, ref):
        m.b.weight.grad = torch.full_like(m.b.weight, 0.5)
    reducer.begin_micro_step(reduce=True)
    model(x).backward()
    reducer.end_micro_step()
    ref(x).backward()
    _assert_matches(group, reducer, ref)
    assert model.b.weight.grad is None


def test_backward_that_raised_leaves_no_partial_sum(world1) -> None:
    model = Net()
    ref = copy.deepcopy(model)
    group, reducer = _build(model, bucket_size=10_000)
    fail = [True]

    def raise_once(p: torch.Tensor) -> None:
        if fail[0]:
            fail[0] = False
            raise RuntimeError("user hook failed")

    model.b.weight.register_post_accumulate_grad_hook(raise_once)  # bucket opened, not complete (a.* still due)
    reducer.begin_micro_step(reduce=True)
    with pytest.raises(RuntimeError, match="user hook failed"):
        model(torch.randn(2, 6)).backward()
    assert any(p.grad is not None for p in model.parameters())  # views left by the failed backward
    reducer.zero_grads()
    reducer.begin_micro_step(reduce=True)
    assert all(p.grad is None for p in model.parameters()) and reducer._staging == {}
    x = torch.randn(2, 6)
    model(x).backward()
    reducer.end_micro_step()
    ref(x).backward()
    _assert_matches(group, reducer, ref)


class Mixed(nn.Module):
    """A channels_last weight, an empty parameter and a frozen one between trained ones."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 2).to(memory_format=torch.channels_last)
        self.empty = nn.Parameter(torch.zeros(0, 3))
        self.frozen = nn.Parameter(torch.ones(5), requires_grad=False)
        self.last = nn.Parameter(torch.ones(2, 3))


def _bucket_of(model: nn.Module) -> tuple[list[ParamSlot], BucketViews]:
    slots, buckets, _ = plan_buckets(list(model.named_parameters()), 0, 10_000, 2)
    assert len(buckets) == 1
    trained = [s for s in slots if s.param.requires_grad]
    return trained, BucketViews(buckets[0], trained)


@pytest.mark.parametrize("make", [Net, Mixed])
def test_views_cover_each_slot_in_its_shape_and_strides(make) -> None:
    model = make()
    trained, maker = _bucket_of(model)
    assert (maker._templates is None) == (make is Mixed)  # Mixed: one view per slot
    buf = torch.arange(maker.bucket.numel, dtype=torch.float32)
    views = maker.views(buf)
    assert len(views) == len(trained)
    for s, v in zip(trained, views, strict=True):
        assert v.shape == s.param.shape and v.stride() == s.param.stride(), s.name
        rel = s.offset - maker.bucket.start
        assert v.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
        assert torch.equal(s.flat_values(v), buf[rel : rel + s.numel]), s.name
