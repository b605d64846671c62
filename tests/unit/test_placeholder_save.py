"""Pickling a partitioned parameter under zerodp's DeepSpeed drop-in (zerodp.stage3.placeholder), in
process on a world of one: one PartitionedSaveWarning per torch.save, placeholders that refuse to load,
every other use of the values still refused. (tests/test_chat_save.py runs DS-Chat's save sequence on
real ranks; zerodp's own API refuses the save: tests/test_escaping_views.py.)"""

from __future__ import annotations

import copy
import io
import pickle
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn

from zerodp.stage3.placeholder import PartitionedSaveWarning
from zerodp.stage3.sharded_param import PartitionedParameterError

CFG = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}


@pytest.fixture
def module(world1) -> nn.Module:
    import zerodp.deepspeed as deepspeed

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=CFG)
    return engine.module


def caught(fn: Callable[[], object]) -> list[str]:
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in got if issubclass(w.category, PartitionedSaveWarning)]


def test_one_warning_per_torch_save(module: nn.Module) -> None:
    sd = module.state_dict()
    first = caught(lambda: torch.save(sd, io.BytesIO()))
    assert len(first) == 1 and "torch.save wrote 4 partitioned parameters (the first: '0.weight')" in first[0]
    again = caught(lambda: torch.save(sd, io.BytesIO()))  # the same dict saved again: warned again
    assert len(again) == 1
    both = caught(lambda: torch.save({"model": sd, "params": module.state_dict(keep_vars=True)}, io.BytesIO()))
    assert len(both) == 1 and "wrote 8 partitioned parameters" in both[0], both
    # outside torch.save the saved object is not known: one warning per placeholder
    assert len(caught(lambda: pickle.dumps(sd))) == 4


def test_interrupted_save_leaves_nothing_silent(module: nn.Module) -> None:
    """A save that fails between two placeholders; the one it counted but never wrote, saved next,
    warns again (the warning belongs to the failed save)."""
    sd = module.state_dict()
    broken = {"0.weight": sd["0.weight"], "z": lambda: 0, "2.weight": sd["2.weight"]}
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        caught(lambda: torch.save(broken, io.BytesIO()))
    assert len(caught(lambda: torch.save({"2.weight": sd["2.weight"]}, io.BytesIO()))) == 1


def test_placeholder_refuses_to_load_every_way(module: nn.Module) -> None:
    buf = io.BytesIO()
    caught(lambda: torch.save(module.state_dict(keep_vars=True), buf))
    with pytest.raises(
        pickle.UnpicklingError, match=r"zerodp\.stage3\.placeholder\.partitioned_parameter_placeholder:0:weight"
    ):
        torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    with pytest.raises(
        PartitionedParameterError,
        match=r"parameter '0.weight' \(shape \(4, 4\), torch.float32\) in this file is a placeholder",
    ):
        torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    from zerodp.stage3 import placeholder

    allowed = [
        placeholder.loader(f"{placeholder.LOADER_PREFIX}{n.replace('.', ':')}")
        for n in ("0.weight", "0.bias", "2.weight", "2.bias")
    ]
    with torch.serialization.safe_globals(allowed), pytest.raises(PartitionedParameterError, match="save_16bit_model"):
        torch.load(io.BytesIO(buf.getvalue()), weights_only=True)


def test_other_uses_still_refused(module: nn.Module) -> None:
    from safetensors.torch import save_file

    sd = module.state_dict()
    with pytest.raises(PartitionedParameterError, match="'0.weight'.*zerodp consolidate"):
        save_file(sd, "/dev/null")
    with pytest.raises(PartitionedParameterError, match="copy.deepcopy"):
        copy.deepcopy(sd)
    with pytest.raises(PartitionedParameterError, match="'0.weight'"):
        sd["0.weight"].clone()
