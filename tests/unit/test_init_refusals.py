"""Constructs ``zerodp.zero.Init`` cannot build raise zerodp's error naming zero.Init, the construct and
what to do (a world of one: the refusals need no peer)."""

from __future__ import annotations

import copy

import pytest
from torch import nn

import zerodp
from zerodp.stage3.sharded_param import PartitionedParameterError

CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "device": "cpu",
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 10},
}


def test_deepcopy_of_a_partitioned_layer_under_init_names_init_and_the_way_out(world1) -> None:
    # TransformerEncoder deep-copies the layer it is given, which Init has already partitioned
    with pytest.raises(PartitionedParameterError) as err, zerodp.zero.Init(config=CONFIG):
        nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 2)
    msg = str(err.value)
    for frag in (
        "copy.deepcopy",
        "under zerodp.zero.Init",
        "nn.TransformerEncoder",
        "outside `with zerodp.zero.Init",
        "nn.ModuleList",
    ):
        assert frag in msg, msg
    assert "GatheredParameters" not in msg, msg  # not the advice for reading a parameter
    # the general kind: deepcopy of any module built (and partitioned) under Init
    with pytest.raises(PartitionedParameterError, match="under zerodp.zero.Init"), zerodp.zero.Init(config=CONFIG):
        layer = nn.Linear(16, 16)
        nn.Linear(4, 4)  # the next module's parameter ends the first's construction: it is partitioned
        copy.deepcopy(layer)


def test_weight_norm_under_init_names_init_and_the_way_out(world1) -> None:
    with pytest.raises(PartitionedParameterError) as err, zerodp.zero.Init(config=CONFIG):
        nn.utils.parametrizations.weight_norm(nn.Linear(16, 16))
    msg = str(err.value)
    for frag in (
        "nn.Parameter(...)",
        "'Linear.weight'",
        "under zerodp.zero.Init",
        "weight_norm",
        "outside `with zerodp.zero.Init",
    ):
        assert frag in msg, msg


def test_single_original_parametrizations_still_build_under_init(world1) -> None:
    with zerodp.zero.Init(config=CONFIG):
        model = nn.Sequential(
            nn.utils.parametrizations.orthogonal(nn.Linear(16, 16)),
            nn.utils.parametrizations.spectral_norm(nn.Linear(16, 16)),
        )
    assert [tuple(p.shape) for p in model.parameters()] == [(16,), (16, 16), (16,), (16, 16)]
