"""Writes to partitioned parameters that once went wrong (found by a review): re-binding their
memory (``p.data = t``, ``p.set_(t)``, torch parametrizations) under ``zerodp.zero.Init`` and
``GatheredParameters`` (HF VisualBERT's ``special_visual_initialize`` does
``weight.data = nn.Parameter(...)``), a copy between two units beyond the open budget, conversions of a
stage-3 model that change nothing, and an Init-built model below stage 3. One rank, in process."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zerodp
from zerodp.stage3.sharded_param import PartitionedParameterError


def _cfg(bf16: bool = False) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 16},
    }
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


class Net(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 32)
        self.fc2 = nn.Linear(32, 32)  # registering it partitions fc
        if how == "data":
            self.fc.weight.data = nn.Parameter(torch.full((32, 32), 0.5))
        elif how == "orthogonal":
            torch.nn.utils.parametrizations.orthogonal(self.fc2)
        elif how == "set":
            with torch.no_grad():
                self.fc.weight.set_(torch.full((32, 32), 0.5))


def _weights(how: str, init: bool, bf16: bool = False) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    if init:
        with zerodp.zero.Init(config=_cfg(bf16)):
            m = Net(how)
    else:
        m = Net(how)
    return zerodp.initialize(m, _cfg(bf16)).module_state_dict()


@pytest.mark.parametrize("how,bf16", [("data", False), ("data", True), ("orthogonal", False)])
def test_rebinding_under_init_keeps_the_values(how: str, bf16: bool) -> None:
    plain, built = _weights(how, False, bf16), _weights(how, True, bf16)
    assert plain.keys() == built.keys()
    for k in plain:
        assert torch.equal(plain[k], built[k]), k
    if how == "data":
        assert torch.all(built["fc.weight"] == 0.5)


def test_set_after_init_partitioned_is_refused() -> None:
    with pytest.raises(PartitionedParameterError, match="'fc.weight' was re-bound with set_"):
        _weights("set", True)


def test_data_assignment_of_another_shape_under_init_is_refused() -> None:
    class Bad(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(32, 32)
            self.fc2 = nn.Linear(32, 32)
            self.fc.weight.data = torch.zeros(16, 32)

    with pytest.raises(PartitionedParameterError, match=r"shape \(16, 32\).*shape is \(32, 32\)"):
        with zerodp.zero.Init(config=_cfg()):
            Bad()


def test_gathered_parameters_keeps_a_rebinding_and_noop_conversions_pass() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 4))
    engine = zerodp.initialize(m, _cfg())
    with zerodp.zero.GatheredParameters([m[0].weight], modifier_rank=0):
        m[0].weight.data = torch.full((32, 32), 0.25)
    assert torch.all(engine.module_state_dict()["0.weight"] == 0.25)
    m.to("cpu")  # changes nothing: allowed (used to raise PartitionedParameterError)
    m.cpu()
    m.float()
    m.to(torch.float32)
    with pytest.raises(PartitionedParameterError, match="partitioned"):
        m.double()  # a real conversion of a partitioned parameter still raises
    loss = engine(torch.randn(2, 32)).sum()
    engine.backward(loss)
    engine.step()
    assert torch.isfinite(torch.stack([v.float().sum() for v in engine.module_state_dict().values()])).all()


def test_init_built_model_below_stage_3_is_refused_by_name() -> None:
    from zerodp.config import ConfigError

    with zerodp.zero.Init(config=_cfg()):
        m = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 4))
    cfg = _cfg()
    cfg["zero_optimization"]["stage"] = 2
    with pytest.raises(
        ConfigError, match=r"stage is 2, but the model was built under zerodp.zero.Init \(parameter '0.weight'"
    ):
        zerodp.initialize(m, cfg)


def test_copy_between_two_partitioned_parameters_beyond_the_open_budget() -> None:
    """A call that uses two units keeps both open, even when together they exceed
    ``stage3_max_live_parameters`` (the older one used to be flushed first, and the call raised)."""
    cfg = _cfg()
    cfg["zero_optimization"]["stage3_max_live_parameters"] = 100  # below one Linear(32, 32) unit

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(32, 32) for _ in range(4)])
            with torch.no_grad():
                self.blocks[1].weight.copy_(self.blocks[0].weight)

    out = []
    for init in (False, True):
        torch.manual_seed(0)
        if init:
            with zerodp.zero.Init(config=cfg):
                m = Tied()
        else:
            m = Tied()
        out.append(zerodp.initialize(m, cfg).module_state_dict())
    for k in out[0]:
        assert torch.equal(out[0][k], out[1][k]), k
    assert torch.equal(out[1]["blocks.0.weight"], out[1]["blocks.1.weight"])
