"""The per-module state (zerodp.runtime.zero_state), in process on a world of one: an engine's
parameters reach it through the module holding them, tied parameters through their first holder, the
engine is held weakly (collectable while the module lives), a copy or pickle of a wrapped model carries
no state, and a stage-3 owner moves with its record when an engine picks another holder than Init."""

from __future__ import annotations

import copy
import gc
import io
import weakref

import pytest
import torch
from torch import nn

import zerodp
from zerodp.runtime.zero_state import (
    ParamRecord,
    ensure_record,
    param_holders,
    param_record,
    wrapped_by,
    zero_state,
)
from zerodp.stage3.ownership import owner_of


def _model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 10},
    }


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_every_parameter_reaches_its_engine_through_its_module(world1, stage: int) -> None:
    model = _model()
    engine = zerodp.initialize(model, _config(stage))
    for m in (model[0], model[2]):
        state = zero_state(m)
        assert state is not None and len(state.records) == 2
        for p in m.parameters(recurse=False):
            rec = param_record(p)
            assert rec is state.record(p) and rec.live_engine() is engine
            assert rec.slot is not None and rec.slot().param is p
            assert wrapped_by(p) == f"ZeRO stage {stage}"
            assert (owner_of(p) is not None) == (stage == 3)  # small ones in the persistent unit
    assert zero_state(model) is None and zero_state(model[1]) is None  # no own parameters


def test_the_engine_is_held_weakly_and_copies_are_unwrapped(world1) -> None:
    model = _model()
    engine = zerodp.initialize(model, _config(2))
    ref = weakref.ref(engine)
    twin = copy.deepcopy(model)
    buf = io.BytesIO()
    torch.save(model, buf)  # the state and the parameters' links pickle as empty ones
    del engine
    gc.collect()
    assert ref() is None  # the module's state does not keep its engine alive
    rec = param_record(model[0].weight)
    assert rec is not None and rec.live_engine() is None
    assert all(param_record(p) is None and wrapped_by(p) is None for p in twin.parameters())
    assert zerodp.initialize(twin, _config(2)) is not None  # a copy can be wrapped
    loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    assert all(param_record(p) is None and wrapped_by(p) is None for p in loaded.parameters())


def test_a_tied_parameter_lives_in_its_first_holder_and_moves_with_its_record() -> None:
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    b.weight = a.weight
    root = nn.Sequential(a, b)
    holders = param_holders(root)
    assert len(holders) == 3 and holders[id(a.weight)][1] is a
    rec = ensure_record(a.weight, b)  # as zero.Init partitions the module it saw first
    rec.owner = "owner"
    moved = ensure_record(a.weight, a)  # an engine picks the first holder in module order
    assert moved is rec and param_record(a.weight) is rec and owner_of(a.weight) == "owner"
    state_b = zero_state(b)
    assert state_b is not None and state_b.record(a.weight) is None
    assert isinstance(rec, ParamRecord) and rec.param() is a.weight
