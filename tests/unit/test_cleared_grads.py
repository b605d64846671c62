"""Two uses that used to give a silently wrong result (found by a fresh-user trial), in process on a
world of one: ``param.grad`` set to None between ``engine.backward`` and ``engine.step`` (torch would
then skip the parameter; the engine's buffers still held the gradient and the step applied it), and a
``model_parameters`` that lists no parameter (an exhausted generator: nothing trained, no message)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zerodp
import zerodp.deepspeed as deepspeed


def _config(stage: int, bf16: bool = False) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "bf16": {"enabled": bf16},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _loss(engine, dtype=torch.float32) -> torch.Tensor:
    return engine(torch.ones(2, 4, dtype=dtype)).float().pow(2).mean()


@pytest.mark.parametrize("clear", ["module.zero_grad", "p.grad = None"])
@pytest.mark.parametrize("stage,bf16", [(0, False), (0, True), (1, False), (2, False), (2, True), (3, False)])
def test_grad_set_to_none_between_backward_and_step_is_refused(world1, stage: int, bf16: bool, clear: str) -> None:
    model = _model()
    engine = zerodp.initialize(model, _config(stage, bf16))
    engine.backward(_loss(engine, torch.bfloat16 if bf16 else torch.float32))
    if clear == "module.zero_grad":
        model.zero_grad()
    else:
        next(iter(model.parameters())).grad = None
    with pytest.raises(RuntimeError, match=r"was set to None after engine\.backward.*apply them anyway"):
        engine.step()


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_zero_grad_after_step_and_the_dropin_zero_grad_are_fine(world1, stage: int) -> None:
    model = _model()
    engine = zerodp.initialize(model, _config(stage))
    for _ in range(2):
        engine.backward(_loss(engine))
        engine.step()
        model.zero_grad()  # after the step: the engine's own zeroing, nothing lost
    ds, *_ = deepspeed.initialize(model=_model(), config=_config(stage))
    ds.backward(_loss(ds))
    ds.zero_grad()  # DeepSpeed's way to discard this accumulation's gradients
    ds.step()
    twin, *_ = deepspeed.initialize(model=_model(), config=_config(stage))
    twin.backward(0 * _loss(twin))  # the same step with gradients that are zero
    twin.step()
    if stage < 3:  # stage 3: the module holds shards only outside forward
        for a, b in zip(ds.module.parameters(), twin.module.parameters(), strict=True):
            assert torch.equal(a.detach(), b.detach())


@pytest.mark.parametrize("params", ["empty list", "exhausted generator", "empty groups"])
def test_model_parameters_without_any_parameter_is_refused(world1, params: str) -> None:
    model = _model()
    if params == "empty list":
        given: object = []
    elif params == "exhausted generator":
        given = model.parameters()
        sum(p.numel() for p in given)  # the usual way to use it up
    else:
        given = [{"params": [], "weight_decay": 0.0}, {"params": []}]
    with pytest.raises(ValueError, match="model_parameters holds no parameter .*exhausted generator"):
        zerodp.initialize(model, _config(2), model_parameters=given)
    with pytest.raises(ValueError, match="model_parameters holds no parameter"):
        deepspeed.initialize(model=_model(), config=_config(2), model_parameters=[])
