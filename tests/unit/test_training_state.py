"""The engine's training phase (zerodp.runtime.training_state): the transitions one micro-step makes
are allowed, a call from inside backward or step is refused with a message naming the phase, and an
error inside a phase restores the phase the caller can continue from."""

from __future__ import annotations

import pytest

from zerodp.runtime.training_state import TrainingPhase, TrainingState

S = TrainingState


def test_micro_steps_walk_the_phases():
    phase = TrainingPhase()
    assert phase.state is S.IDLE and not phase.grads_ready
    with phase.during(S.BACKWARD, "engine.backward", then=S.IDLE):  # a micro-step inside the accumulation
        assert phase.state is S.BACKWARD
    assert phase.state is S.IDLE
    with phase.during(S.BACKWARD, "engine.backward", then=S.GRADS_READY):  # the boundary micro-step
        pass
    assert phase.grads_ready
    with phase.during(S.BACKWARD, "engine.backward", then=S.GRADS_READY):  # a second backward adds up
        pass
    with phase.during(S.STEP, "engine.step", then=S.IDLE):
        assert not phase.grads_ready
    assert phase.state is S.IDLE


@pytest.mark.parametrize("inside, call, new", [(S.BACKWARD, "engine.step", S.STEP),
                                               (S.BACKWARD, "engine.backward", S.BACKWARD),
                                               (S.STEP, "engine.backward", S.BACKWARD),
                                               (S.STEP, "engine.step", S.STEP)])
def test_nested_calls_are_refused(inside, call, new):
    phase = TrainingPhase()
    with phase.during(inside, "outer", then=S.IDLE):
        with pytest.raises(RuntimeError, match=f"{call} cannot run while the engine is in its '{inside.value}'"):
            phase.to(new, call)
        assert phase.state is inside  # the refused call changed nothing


def test_error_inside_a_phase_restores_or_sets_the_state():
    phase = TrainingPhase()
    with phase.during(S.BACKWARD, "engine.backward", then=S.GRADS_READY):
        pass
    with pytest.raises(ValueError):
        with phase.during(S.BACKWARD, "engine.backward", then=S.IDLE):
            raise ValueError("boom")
    assert phase.state is S.GRADS_READY  # the gradients reduced before are still there
    with pytest.raises(ValueError):
        with phase.during(S.STEP, "engine.step", then=S.IDLE, on_error=S.IDLE):
            raise ValueError("boom")
    assert phase.state is S.IDLE


def test_grads_ready_only_follows_a_backward():
    phase = TrainingPhase()
    with pytest.raises(RuntimeError, match="allowed from: backward"):
        phase.to(S.GRADS_READY, "test")


@pytest.mark.parametrize("stage", [0, 2])
def test_engine_step_from_a_backward_hook_is_refused(world1, stage):
    """An ``engine.step()`` from inside ``engine.backward`` (a tensor hook) raises naming the phase; the
    engine then trains on: the phase is the one before the failed backward."""
    import torch
    from torch import nn

    import zerodp

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    engine = zerodp.initialize(model, {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
                                       "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    out = engine(torch.randn(2, 4)).square().mean()
    out.register_hook(lambda g: engine.step())
    with pytest.raises(RuntimeError, match="engine.step cannot run while the engine is in its 'backward' phase"):
        engine.backward(out)
    assert engine.phase.state is S.IDLE and engine.global_steps == 0
    engine.backward(engine(torch.randn(2, 4)).square().mean())
    assert engine.grads_ready
    before = model.weight.detach().clone()
    engine.step()
    assert engine.global_steps == 1 and not engine.grads_ready and not torch.equal(before, model.weight)
