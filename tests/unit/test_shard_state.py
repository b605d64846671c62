"""Stage-3 unit state machine (zerodp.stage3.units): SHARDED -> GATHERING -> UNSHARDED -> SHARDED.

World of one on gloo for values (the all-gather of one rank is a copy); torch's fake process group
for larger worlds, where only states, shapes and storage sizes are asserted.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zerodp.runtime.comm import CommLedger
from zerodp.stage3.pool import SWAPS_STORAGE, GatherPool
from zerodp.stage3.sharded_param import PartitionedParameterError, is_sharded
from zerodp.stage3.units import ShardState, shard_unit


def _unit(world_size: int = 1, rank: int = 0, persistent: bool = False, pool: GatherPool | None = None):
    lin = nn.Linear(5, 3)  # 15 + 3 = 18 elements
    named = list(lin.named_parameters())
    values = [p.detach().clone() for _, p in named]
    unit = shard_unit("lin", named, 0, [0, 0], rank, world_size, persistent=persistent)
    unit.pool = pool
    return lin, values, unit


def _storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def test_gather_release_cycle_restores_values(world1) -> None:
    lin, values, unit = _unit()
    ledger = CommLedger()
    assert unit.state is ShardState.SHARDED and _storage_bytes(unit.full) == 0
    assert all(is_sharded(p) for p in lin.parameters()) and unit.gathered_bytes() == 0
    assert lin.weight.shape == (3, 5)  # full metadata while sharded

    unit.start_gather(None, ledger, "params")
    assert unit.state is ShardState.GATHERING
    unit.finish_gather()
    assert unit.state is ShardState.UNSHARDED and not any(is_sharded(p) for p in lin.parameters())
    assert torch.equal(lin.weight.detach(), values[0]) and torch.equal(lin.bias.detach(), values[1])
    assert unit.gathered_bytes() == 18 * 4
    assert [(r.op, r.elements) for r in ledger.records()] == [("all_gather", 18)]

    unit.release()
    assert unit.state is ShardState.SHARDED and _storage_bytes(unit.full) == 0 and unit.users == 0
    assert is_sharded(lin.weight)


def test_illegal_transitions_are_refused(world1) -> None:
    lin, _, unit = _unit()
    ledger = CommLedger()
    with pytest.raises(AssertionError, match="unit 'lin' finished while ShardState.SHARDED"):
        unit.finish_gather()
    with pytest.raises(RuntimeError, match="unit 'lin': cast of a parameter while the unit is sharded"):
        unit.cast(lin.weight, torch.bfloat16)
    unit.release()  # releasing a released unit does nothing
    assert unit.state is ShardState.SHARDED

    unit.start_gather(None, ledger, "params")
    with pytest.raises(AssertionError, match="unit 'lin' gathered while ShardState.GATHERING"):
        unit.start_gather(None, ledger, "params")
    unit.finish_gather()
    with pytest.raises(AssertionError, match="unit 'lin' gathered while ShardState.UNSHARDED"):
        unit.start_gather(None, ledger, "params")
    with pytest.raises(AssertionError, match="unit 'lin' finished while ShardState.UNSHARDED"):
        unit.finish_gather()
    with pytest.raises(RuntimeError, match="does not own the parameter"):
        unit.cast(nn.Parameter(torch.zeros(3)), torch.bfloat16)
    unit.release()


def test_release_while_gathering_finishes_first(world1) -> None:
    lin, values, unit = _unit()
    unit.start_gather(None, CommLedger(), "params")
    unit.release()
    assert unit.state is ShardState.SHARDED and unit.work is None
    unit.start_gather(None, CommLedger(), "params")
    unit.finish_gather()
    assert torch.equal(lin.weight.detach(), values[0])


def test_sharded_parameter_refuses_compute_naming_it(world1) -> None:
    lin, _, _ = _unit()
    with pytest.raises(PartitionedParameterError, match="parameter 'lin.weight' is partitioned"):
        lin(torch.randn(2, 5))
    with pytest.raises(PartitionedParameterError, match="lin.bias"):
        lin.bias.data.mul_(2)


def test_cast_buffers_follow_gather_and_release(world1) -> None:
    lin, values, unit = _unit()
    unit.start_gather(None, CommLedger(), "params")
    unit.finish_gather()
    half = unit.cast(lin.weight, torch.bfloat16)
    assert half.dtype == torch.bfloat16 and torch.equal(half, values[0].to(torch.bfloat16))
    assert unit.gathered_bytes() == 18 * 4 + 15 * 2
    unit.release()
    assert _storage_bytes(half) == 0 and unit.gathered_bytes() == 0
    unit.start_gather(None, CommLedger(), "params")
    unit.finish_gather()  # the same cast buffer is re-filled on gather
    assert torch.equal(half, values[0].to(torch.bfloat16))
    unit.release()


def test_persistent_unit_stays_gathered(world1) -> None:
    lin, values, unit = _unit(persistent=True)
    assert unit.state is ShardState.UNSHARDED and torch.equal(lin.weight.detach(), values[0])


def test_rebound_parameter_is_kept_or_refused(world1) -> None:
    lin, _, unit = _unit()
    unit.start_gather(None, CommLedger(), "params")
    unit.finish_gather()
    lin.weight.data = torch.full((3, 5), 7.0)  # re-bound to other memory while gathered
    unit.collect_rebound()
    assert (unit.full[:15] == 7.0).all() and lin.weight.data_ptr() == unit.full.data_ptr()
    unit.write_back()
    assert (unit.shard[:15] == 7.0).all()
    lin.bias.data = torch.zeros(4)
    with pytest.raises(PartitionedParameterError, match=r"'lin.bias'.*shape \(4,\).*its shape is \(3,\)"):
        unit.collect_rebound()
    lin.bias.data = torch.zeros(3)
    unit.collect_rebound()
    unit.release()


@pytest.mark.parametrize("world_size, rank", [(2, 1), (3, 2), (4, 0), (7, 6)])
def test_shards_of_larger_worlds(fake_world, world_size: int, rank: int) -> None:
    """18 elements on N ranks: padded to a multiple of N, rank r keeps elements [r s, (r+1) s)."""
    fake_world(rank, world_size)
    torch.manual_seed(1)
    lin, values, unit = _unit(world_size, rank)
    flat = torch.cat([v.reshape(-1) for v in values] + [torch.zeros(unit.numel - 18)])
    s = unit.numel // world_size
    assert unit.numel % world_size == 0 and 0 <= unit.numel - 18 < world_size
    assert unit.shard.numel() == s and torch.equal(unit.shard, flat[rank * s : (rank + 1) * s])
    assert unit.group.shard_offset == rank * s
    unit.start_gather(None, CommLedger(), "params")  # no data moves on the fake group
    unit.finish_gather()
    assert unit.state is ShardState.UNSHARDED and _storage_bytes(unit.full) == unit.numel * 4
    assert lin.weight.shape == (3, 5) and lin.weight.data_ptr() == unit.full.data_ptr()
    unit.release()
    assert _storage_bytes(unit.full) == 0


@pytest.mark.skipif(
    not SWAPS_STORAGE, reason=f"torch {torch.__version__} cannot swap storages: the pool keeps no slabs"
)
def test_pool_lends_while_gathered_and_takes_back_on_release(world1) -> None:
    pool = GatherPool(limit_bytes=1 << 20)
    lin, values, unit = _unit(pool=pool)
    for _ in range(3):
        unit.start_gather(None, CommLedger(), "params")
        unit.finish_gather()
        assert pool.lent_bytes() == 18 * 4 and pool.free_bytes() == 0
        assert torch.equal(lin.weight.detach(), values[0])
        unit.release()
        assert pool.lent_bytes() == 0 and pool.free_bytes() == 18 * 4
    assert pool.allocations == 1  # the slab is reused by every later gather


def test_released_unit_repr_does_not_touch_freed_storage(world1) -> None:
    """A released unit's buffers hold 0 bytes; torch's tensor repr of them would read freed memory
    (a segfault, e.g. in pytest's report of a failed assertion that mentions the unit)."""
    lin, _, unit = _unit()
    unit.start_gather(None, CommLedger(), "params")
    unit.finish_gather()
    unit.cast(lin.weight, torch.bfloat16)
    unit.release()
    text = repr(unit)
    assert "ShardedUnit(name='lin'" in text and "state=<ShardState.SHARDED" in text
