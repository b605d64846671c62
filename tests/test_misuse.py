"""API misuse is refused with a message saying what to do instead, at every stage.

In-process (1 rank) here; the same refusals at 2-4 ranks run in tests/dist_worker.py's ``misuse``
scenario (asserted in tests/test_stages.py).
"""

from __future__ import annotations

import re

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


@pytest.fixture(scope="module")
def misuse_launches() -> dict[int, list[dict]]:
    """tests/dist_worker.py's ``misuse`` scenario at every stage, on 2 and 4 ranks."""
    from distributed import run_worker

    return {ws: run_worker(ws, ",".join(map(str, STAGES)), "misuse") for ws in (2, 4)}


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("world_size", (2, 4))
def test_refusals_on_every_rank(misuse_launches: dict[int, list[dict]], world_size: int, stage: int) -> None:
    from test_stages import per_rank

    res = per_rank(misuse_launches, world_size, stage, "misuse")
    assert len(res) == world_size
    for r in res:
        assert re.search(f"already wrapped by an engine \\(ZeRO stage {stage}; parameter", r["rewrap"]), r
        assert r["direct_backward"] == DIRECT_BACKWARD_MESSAGE, r
