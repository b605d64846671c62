"""fp16 loss scaling and the precision policy (zerodp.runtime.precision), from config values."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zerodp.config import load_config
from zerodp.runtime.accounting import FP32_ADAM, MIXED_PRECISION_ADAM
from zerodp.runtime.precision import LossScaler, PrecisionPolicy, cast_module


def _scaler(**fp16) -> LossScaler:
    scaler = LossScaler.from_config(load_config({"fp16": {"enabled": True, **fp16}}))
    assert scaler is not None
    return scaler


def test_dynamic_schedule_follows_hysteresis_and_window() -> None:
    """2**4 = 16 at first; hysteresis 2: the first overflow after a (re)start only spends the budget,
    the next ones halve; 3 clean steps in a row double and restore the budget; never below 2."""
    s = _scaler(initial_scale_power=4, loss_scale_window=3, hysteresis=2, min_loss_scale=2.0)
    X, C = True, False  # X: an overflow, C: a clean step
    events = [X, X, X, C, C, C, X, C, C, X, X, X, C, C, C]
    want = [16, 8, 4, 4, 4, 8, 8, 8, 8, 4, 2, 2, 2, 2, 4]
    got = []
    for overflow in events:
        s.update(overflow)
        got.append(s.scale)
    assert got == want


def test_clean_steps_restart_after_an_overflow() -> None:
    s = _scaler(initial_scale_power=3, loss_scale_window=2, hysteresis=1)
    for overflow in (False, True, False):  # an overflow between two clean steps: no doubling yet
        s.update(overflow)
    assert s.scale == 4.0
    s.update(False)
    assert s.scale == 8.0


def test_default_config_values() -> None:
    s = _scaler()
    assert (s.scale, s.window, s.hysteresis, s.min_scale) == (2.0**16, 1000, 2, 1.0)
    for _ in range(999):
        s.update(False)
    assert s.scale == 2.0**16
    s.update(False)
    assert s.scale == 2.0**17


def test_static_scale_never_moves_and_state_round_trips() -> None:
    s = _scaler(loss_scale=128.0)
    for overflow in (True, True, True, False):
        s.update(overflow)
    assert not s.dynamic and s.scale == 128.0
    d = _scaler(initial_scale_power=5, hysteresis=3)
    d.update(True)
    d.update(False)
    fresh = _scaler()
    fresh.load_state_dict(d.state_dict())
    assert fresh.state_dict() == {"scale": 32.0, "hysteresis_left": 2, "clean_steps": 1}
    assert LossScaler.from_config(load_config({"bf16": {"enabled": True}})) is None


@pytest.mark.parametrize(
    "config, dtype, accum, grad_bytes, base",
    [
        ({}, torch.float32, torch.float32, 4, FP32_ADAM),
        ({"bf16": {"enabled": True}}, torch.bfloat16, torch.bfloat16, 2, MIXED_PRECISION_ADAM),
        (
            {"bf16": {"enabled": True}, "gradient_accumulation_steps": 4},
            torch.bfloat16,
            torch.float32,
            4,
            MIXED_PRECISION_ADAM,
        ),
        (
            {"fp16": {"enabled": True}, "gradient_accumulation_steps": 4, "data_types": {"grad_accum_dtype": "fp16"}},
            torch.float16,
            torch.float16,
            2,
            MIXED_PRECISION_ADAM,
        ),
        (
            {"fp16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}},
            torch.float16,
            torch.float32,
            4,
            MIXED_PRECISION_ADAM,
        ),
    ],
)
def test_policy_from_config(config: dict, dtype, accum, grad_bytes: int, base) -> None:
    policy = PrecisionPolicy.from_config(load_config(config))
    assert policy.param_dtype == dtype and policy.grad_accum_dtype == accum
    assert policy.has_master == (dtype != torch.float32)
    assert policy.loss_scaling == (dtype == torch.float16)
    b = policy.bytes_per_element
    assert (b.param, b.grad, b.optimizer, b.master) == (base.param, grad_bytes, base.optimizer, base.master)


def test_cast_module_keeps_parameter_objects() -> None:
    m = nn.BatchNorm1d(4)
    w = m.weight
    cast_module(m, torch.bfloat16, partitioned=lambda p: False)
    assert m.weight is w and w.dtype == torch.bfloat16 and m.running_mean.dtype == torch.bfloat16
    assert m.num_batches_tracked.dtype == torch.int64  # integer buffers untouched
