"""API misuse is refused with a message saying what to do instead, at every stage.

In-process (1 rank) here; the same refusals at 2 and 4 ranks run in tests/dist_worker.py's ``misuse``
scenario, within tests/test_stages.py's launches (asserted there: test_refusals_on_every_rank).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zerodp
from zerodp.runtime.reducer import DIRECT_BACKWARD_MESSAGE

STAGES = (0, 1, 2, 3)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def _config(stage: int) -> dict:
    return {
        "optimizer": {"type": "AdamW"},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 4},
    }


@pytest.mark.parametrize("stage", STAGES)
def test_initialize_twice_refused(stage: int) -> None:
    model = _model()
    engine = zerodp.initialize(model, _config(stage))
    for again in (model, nn.Sequential(model), model[0]):  # the model, a parent, a submodule
        with pytest.raises(
            ValueError, match=f"already wrapped by an engine \\(ZeRO stage {stage}; parameter '[0-9.]*weight'\\)"
        ):
            zerodp.initialize(again, _config(stage))
    # the first engine is untouched by the refused attempts: it still trains
    loss = engine(torch.ones(2, 6)).sum()
    engine.backward(loss)
    engine.step()
    assert engine.global_steps == 1


@pytest.mark.parametrize("stage", STAGES)
def test_plain_loss_backward_refused(stage: int) -> None:
    engine = zerodp.initialize(_model(), _config(stage))
    loss = engine(torch.ones(2, 6)).sum()
    with pytest.raises(RuntimeError) as exc:
        loss.backward()
    assert str(exc.value) == DIRECT_BACKWARD_MESSAGE
    assert "call engine.backward(loss) instead" in str(exc.value)
