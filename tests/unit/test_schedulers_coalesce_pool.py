"""Warmup schedules (zerodp.runtime.schedulers), coalesced collectives (zerodp.runtime.coalesce) and
the bounded gather pool's slab policy (zerodp.stage3.pool), in process."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from zerodp.config import load_config
from zerodp.runtime.coalesce import coalesced, dtype_device, runs_of_same_kind
from zerodp.runtime.schedulers import build_scheduler, warmup_gamma
from zerodp.stage3.pool import SWAPS_STORAGE, GatherPool

CPU = torch.device("cpu")
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch >= 2.13 name


@pytest.fixture(autouse=True)
def _no_step_order_warning():
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
        yield


def _lrs(scheduler_cfg: dict, steps: int, lr: float = 0.5) -> list[float]:
    cfg = load_config({"scheduler": scheduler_cfg}).scheduler
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = build_scheduler(cfg, opt)
    out = []
    for _ in range(steps):  # no optimizer.step(): its first call imports torch._dynamo (seconds)
        out.append(opt.param_groups[0]["lr"])
        sched.step()
    return out


def test_warmup_lr_log() -> None:
    got = _lrs({"type": "WarmupLR", "params": {"warmup_min_lr": 0.01, "warmup_max_lr": 0.1, "warmup_num_steps": 5}}, 8)
    want = [0.01 + 0.09 * math.log(t + 1) / math.log(5) for t in range(5)] + [0.1] * 3
    assert got == pytest.approx(want)


def test_warmup_decay_lr_linear() -> None:
    got = _lrs(
        {
            "type": "WarmupDecayLR",
            "params": {"warmup_max_lr": 0.2, "warmup_num_steps": 4, "total_num_steps": 10, "warmup_type": "linear"},
        },
        12,
    )
    want = [0.2 * t / 4 for t in range(4)] + [0.2 * max(0.0, (10 - t) / 6) for t in range(4, 12)]
    assert got == pytest.approx(want)
    assert got[-1] == 0.0  # decayed to warmup_min_lr and stays there


def test_warmup_gamma_edges() -> None:
    assert warmup_gamma(0, 2, "log") == 0.0 and warmup_gamma(1, 2, "log") == 1.0  # the shortest warmup
    assert warmup_gamma(3, 3, "linear") == 1.0 and warmup_gamma(1, 4, "linear") == 0.25


def test_runs_of_same_kind() -> None:
    tensors = [torch.zeros(1), torch.zeros(2), torch.zeros(1, dtype=torch.bfloat16), torch.zeros(3)]
    runs = runs_of_same_kind(tensors, dtype_device)
    assert [len(r) for r in runs] == [2, 1, 1]
    assert runs_of_same_kind([], dtype_device) == []
    assert runs_of_same_kind([1, 1, 2, 1], lambda x: x) == [[1, 1], [2], [1]]


def test_coalesced_all_gathers_fill_every_output(world1) -> None:
    inputs = [torch.randn(n) for n in (3, 5, 2)]
    outputs = [torch.full((n,), float("nan")) for n in (3, 5, 2)]
    launches = [lambda i=i, o=o: _ALL_GATHER(o, i, async_op=True) for i, o in zip(inputs, outputs, strict=True)]
    work = coalesced(None, launches)
    assert work is not None
    work.wait()
    for i, o in zip(inputs, outputs, strict=True):
        assert torch.equal(i, o)
    single = torch.zeros(3)
    coalesced(None, [lambda: _ALL_GATHER(single, inputs[0], async_op=True)]).wait()
    assert torch.equal(single, inputs[0])


@pytest.mark.skipif(
    not SWAPS_STORAGE, reason=f"torch {torch.__version__} cannot swap storages: the pool keeps no slabs"
)
def test_pool_best_fit_serves_half_to_full_slab() -> None:
    pool = GatherPool(limit_bytes=1 << 20)
    big = pool.empty_tensor(250, torch.float32, CPU)  # 1000 bytes
    pool.take_back(big)
    tiny = pool.empty_tensor(100, torch.float32, CPU)  # 400 bytes < 1000 / 2: a new slab
    assert pool.allocations == 2 and tiny.untyped_storage().nbytes() == 400
    half = pool.empty_tensor(125, torch.float32, CPU)  # 500 bytes: the 1000-byte slab serves it
    assert pool.allocations == 2 and half.untyped_storage().nbytes() == 1000
    assert pool.lent_bytes() == 1400 and pool.free_bytes() == 0 and pool.peak_bytes == 1400
    pool.take_back(half)
    pool.take_back(tiny)
    assert pool.free_bytes() == 1400
    pool.clear()
    assert pool.held_bytes() == 0
    fresh = pool.empty_tensor(125, torch.float32, CPU)
    assert pool.allocations == 3 and fresh.untyped_storage().nbytes() == 500


@pytest.mark.skipif(
    not SWAPS_STORAGE, reason=f"torch {torch.__version__} cannot swap storages: the pool keeps no slabs"
)
def test_pool_limit_and_refusals() -> None:
    with pytest.raises(ValueError, match="limit_bytes must be >= 0, got -1"):
        GatherPool(-1)
    pool = GatherPool(limit_bytes=0)  # keeps nothing: every returned slab is freed
    t = pool.empty_tensor(10, torch.float32, CPU)
    assert pool.take_back(t) and pool.free_bytes() == 0 and t.untyped_storage().nbytes() == 0
    with pytest.raises(RuntimeError, match="not empty"):
        pool.lend(torch.zeros(4))
    assert not pool.take_back(torch.zeros(4))  # not a borrower of this pool
