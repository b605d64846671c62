"""With ``offload_param`` and ``offload_optimizer`` on NVMe the step casts each updated fp32 master into
its parameter shard and writes the shard home. A shard whose file holds the last step's cast, and that
no use has changed since, has nothing for the step's in-place-edit check to find; when the step also
writes every piece of it, it is pinned without a read (issue 31: ``params.swp`` read 2 bytes per bf16
parameter more per step than forward and backward need). The weights are bitwise those of the step
that reads and checks every shard, also with an edit between steps and with a unit left without a
gradient."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_offload_nvme_device import _nvme_config
from torch import nn

import zerodp
from zerodp.offload.aio import align_up
from zerodp.offload.param_offload import ParamOffload, _zero_outside_pieces
from zerodp.offload.shard_window import ShardWindow

WIDTH = 16


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 4))


def _run(
    tmp_path,
    monkeypatch,
    trust: bool,
    edit: bool = False,
    skip: int | None = None,
    frozen: bool = False,
    steps: int = 3,
):
    """Train ``steps`` steps; returns (params.swp bytes read inside each ``step()``, parameters, shard
    bytes). ``trust`` False: every shard is read and checked (the step before this change); ``edit``:
    layer 2's weight halved under ``GatheredParameters`` after step 1; ``skip``: the step whose forward
    leaves out layer 2 (its unit gets no gradient); ``frozen``: layer 2's weight frozen (its unit's
    shard holds elements no optimizer piece covers)."""
    tmp_path.mkdir()
    cfg = _nvme_config(3, str(tmp_path), param_nvme=True)
    cfg["zero_optimization"]["offload_param"]["max_in_cpu"] = 0  # no shard stays resident between uses
    with pytest.warns(UserWarning, match="sub_group_size 100"):  # tiny sub-groups: several per piece
        model = _model()
        model[2].weight.requires_grad_(not frozen)
        engine = zerodp.initialize(model, cfg)
    if not trust:
        monkeypatch.setattr(engine.param_offload, "step_current", lambda group: False)
    sw = engine.param_offload.swapper
    assert isinstance(engine.param_offload, ParamOffload) and sw is not None
    m = engine.module
    reads = []
    for step in range(steps):
        x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(step)).bfloat16()
        h = m[1](m[0](x))
        if step != skip:
            h = m[3](m[2](h))
        engine.backward(m[4](h).float().square().mean())
        before = sw.counters.bytes_read
        engine.step()
        reads.append(sw.counters.bytes_read - before)
        if edit and step == 0:
            with zerodp.zero.GatheredParameters([m[2].weight], modifier_rank=0):
                with torch.no_grad():
                    m[2].weight.mul_(0.5)
    with zerodp.zero.GatheredParameters(list(m.parameters())):
        params = [p.detach().clone() for p in m.parameters()]
    shard_bytes = sum(align_up(s.nbytes) for s in sw.shards)  # as read: whole 4096-byte blocks
    engine.close()
    return reads, params, shard_bytes


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("edit", [False, True])
def test_a_step_reads_no_shard_the_last_step_wrote_and_matches_reading_them(world1, tmp_path, monkeypatch, edit):
    reads, params, shard_bytes = _run(tmp_path / "a", monkeypatch, trust=True, edit=edit)
    ref_reads, ref_params, _ = _run(tmp_path / "b", monkeypatch, trust=False, edit=edit)
    assert all(r >= shard_bytes for r in ref_reads), (ref_reads, shard_bytes)  # every shard, every step
    assert reads[0] >= shard_bytes  # the first step: no shard holds a step's cast yet
    if edit:  # the edited unit is read and checked once, the others not
        assert 0 < reads[1] < shard_bytes and reads[2] == 0, (reads, shard_bytes)
    else:
        assert reads[1:] == [0, 0], reads
    assert _equal(params, ref_params)


def test_the_edit_is_in_the_weights(world1, tmp_path, monkeypatch):
    """The edit survives the steps after it (the test above compares with a step that checks every
    shard; this one shows that there was an edit to find)."""
    _, params, _ = _run(tmp_path / "a", monkeypatch, trust=True, edit=True)
    _, plain, _ = _run(tmp_path / "b", monkeypatch, trust=True, edit=False)
    assert not torch.equal(params[2], plain[2])


def test_a_unit_without_a_gradient_is_read_not_blanked(world1, tmp_path, monkeypatch):
    reads, params, shard_bytes = _run(tmp_path / "a", monkeypatch, trust=True, skip=1)
    _, ref_params, _ = _run(tmp_path / "b", monkeypatch, trust=False, skip=1)
    assert 0 < reads[1] < shard_bytes, (reads, shard_bytes)  # layer 2's shard is read for its other pieces
    assert _equal(params, ref_params)


def test_a_frozen_parameter_in_a_trained_unit_keeps_its_values(world1, tmp_path, monkeypatch):
    """A unit's shard holds its frozen parameters too; no optimizer piece covers them, so the step
    that writes every piece still needs the shard's values: it reads the shard."""
    reads, params, shard_bytes = _run(tmp_path / "a", monkeypatch, trust=True, frozen=True)
    _, ref_params, _ = _run(tmp_path / "b", monkeypatch, trust=False, frozen=True)
    assert 0 < reads[2] < shard_bytes, (reads, shard_bytes)  # layer 2's shard, every step
    assert torch.equal(params[2], _model()[2].weight.detach().bfloat16()) and params[2].abs().sum() > 0
    assert _equal(params, ref_params)


def test_pinning_without_a_read_zeroes_what_no_piece_covers():
    buffer = torch.full((10,), 7.0, dtype=torch.bfloat16)
    pieces = [SimpleNamespace(tensor=buffer[5:8]), SimpleNamespace(tensor=buffer[1:3])]
    _zero_outside_pieces(SimpleNamespace(buffer=buffer, pieces=pieces))
    assert buffer.tolist() == [0, 7, 7, 0, 0, 7, 7, 7, 0, 0]


class _Access:
    """Records the window's unpins."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def prefetch(self, groups):
        self.calls.append(("prefetch", len(groups)))

    def pin(self, groups, fill=True):
        self.calls.append(("pin", len(groups), fill))

    def unpin(self, groups, dirty, keep=False, by_step=False):
        self.calls.append(("unpin", len(groups), by_step))


def test_an_abandoned_loop_does_not_count_its_shards_as_cast():
    """A shard pinned without a read whose loop stopped early may hold pieces never written: its write
    is not the cast of its masters, so the next step reads and checks it."""
    a, b = object(), object()
    access = _Access()
    window = ShardWindow(access, [[a, b], [b]], blank=frozenset({id(b)}))  # type: ignore[arg-type,list-item]
    assert access.calls == [("prefetch", 1)]  # b is not read
    window.enter(0)
    assert ("pin", 1, True) in access.calls and ("pin", 1, False) in access.calls
    window.leave(0)
    assert access.calls[-1] == ("unpin", 1, True)  # a: done and cast
    window.close(complete=False)
    assert access.calls[-1] == ("unpin", 1, False)
