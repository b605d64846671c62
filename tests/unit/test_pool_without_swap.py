"""The gather pool on a torch without ``UntypedStorage._swap_data_ptr_`` (before 2.12: the GPU machines'
images carry such a torch): each borrower's own storage is allocated and freed (``swap_storage=False``,
[Note: gather pool] in zerodp.stage3.pool), and stage 3 trains as with the swapping pool."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zerodp
from zerodp.stage3 import pool as pool_mod
from zerodp.stage3.gathered import GatheredParameters
from zerodp.stage3.pool import GatherPool

CPU = torch.device("cpu")


def test_lend_allocates_and_take_back_frees_the_borrowers_storage() -> None:
    pool = GatherPool(limit_bytes=1 << 20, swap_storage=False)
    full = torch.empty(256)
    full.untyped_storage().resize_(0)
    storage_id = full.untyped_storage()._cdata
    pool.lend(full)
    assert full.untyped_storage()._cdata == storage_id and full.untyped_storage().nbytes() == 1024
    full.copy_(torch.arange(256.0))
    view = full[:16].view(4, 4).t()  # what autograd would save
    assert pool.lent_bytes() == 1024 and pool.free_bytes() == 0
    with pytest.raises(RuntimeError, match="not empty"):
        pool.lend(full)
    assert pool.take_back(full) and full.untyped_storage().nbytes() == 0 and not pool.take_back(full)
    assert pool.held_bytes() == 0  # nothing kept: the memory went back to the allocator
    pool.lend(full)  # gathered again, into whatever memory the allocator gives
    full.copy_(torch.arange(256.0) + 1)
    assert torch.equal(view, (torch.arange(16.0) + 1).view(4, 4).t())  # the old view reads the new data
    other = pool.empty_tensor(10, torch.float32, CPU)
    assert other.untyped_storage().nbytes() == 40 and pool.allocations == 3 and pool.peak_bytes == 1064
    pool.disown(other)  # keeps its memory, no longer counted
    assert other.untyped_storage().nbytes() == 40 and pool.lent_bytes() == 1024


def test_swapping_is_refused_where_torch_cannot(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pool_mod, "SWAPS_STORAGE", False)
    with pytest.raises(RuntimeError, match=r"needs UntypedStorage._swap_data_ptr_ \(torch >= 2.12\)"):
        GatherPool(0, swap_storage=True)
    assert not GatherPool(0).swap_storage  # the default follows this torch


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)], nn.Linear(16, 2))


def _stage3_params(swap: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[list[torch.Tensor], GatherPool]:
    monkeypatch.setattr(pool_mod, "SWAPS_STORAGE", swap and pool_mod.SWAPS_STORAGE)
    config = {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": 300,  # prefetch about one layer ahead
        },
    }
    engine = zerodp.initialize(_mlp(), config)
    for step in range(4):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        engine.backward(engine(x).square().mean())
        engine.step()
    with GatheredParameters(list(engine.module.parameters())):
        params = [p.detach().clone() for p in engine.module.parameters()]
    return params, engine.sharding.pool


def test_stage3_without_swap_equals_plain_torch_and_the_swapping_pool(world1, monkeypatch) -> None:
    reference = _mlp()
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for step in range(4):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        reference(x).square().mean().backward()
        opt.step()
    plain, no_swap_pool = _stage3_params(False, monkeypatch)
    assert not no_swap_pool.swap_storage and no_swap_pool.free_bytes() == 0
    assert no_swap_pool.allocations >= 4 * 2 * 5  # every gather of every step allocated its own memory
    for got, want in zip(plain, reference.parameters(), strict=True):
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
    if pool_mod.SWAPS_STORAGE:
        swapped, _ = _stage3_params(True, monkeypatch)
        for a, b in zip(plain, swapped, strict=True):
            assert torch.equal(a, b)
