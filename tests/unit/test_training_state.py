"""The engine's training phase (zerodp.runtime.training_state): the transitions one micro-step makes
are allowed, a call from inside backward or step is refused with a message naming the phase, an
error inside a phase restores the phase the caller can continue from, and a backward or step out of
the micro-step order (a torch-style accumulation loop) warns once."""

from __future__ import annotations

import pytest

from zerodp.runtime.training_state import MicroStepOrderWarning, TrainingPhase, TrainingState

S = TrainingState


def test_micro_steps_walk_the_phases():
    phase = TrainingPhase()
    assert phase.state is S.IDLE and not phase.grads_ready
    with phase.during(S.BACKWARD, "engine.backward", then=S.ACCUMULATING):  # a micro-step inside the window
        assert phase.state is S.BACKWARD
    assert phase.state is S.ACCUMULATING
    with phase.during(S.STEP, "engine.step", then=S.IDLE):  # counts the micro-step
        pass
    with phase.during(S.BACKWARD, "engine.backward", then=S.GRADS_READY):  # the boundary micro-step
        pass
    assert phase.grads_ready
    with phase.during(S.BACKWARD, "engine.backward", then=S.GRADS_READY):  # a second backward adds up
        pass
    with phase.during(S.STEP, "engine.step", then=S.IDLE):
        assert not phase.grads_ready
    assert phase.state is S.IDLE


@pytest.mark.parametrize(
    "inside, call, new",
    [
        (S.BACKWARD, "engine.step", S.STEP),
        (S.BACKWARD, "engine.backward", S.BACKWARD),
        (S.STEP, "engine.backward", S.BACKWARD),
        (S.STEP, "engine.step", S.STEP),
    ],
)
def test_nested_calls_are_refused(inside, call, new):
    phase = TrainingPhase()
    phase.state = S.GRADS_READY  # a backward ran: step() does not warn
    with phase.during(inside, "outer", then=S.GRADS_READY if inside is S.BACKWARD else S.IDLE):
        with pytest.raises(RuntimeError, match=f"{call} cannot run while the engine is in its '{inside.value}'"):
            phase.to(new, call)
        assert phase.state is inside  # the refused call changed nothing


def test_error_inside_a_phase_restores_or_sets_the_state():
    phase = TrainingPhase()
    with phase.during(S.BACKWARD, "engine.backward", then=S.GRADS_READY):
        pass
    with pytest.raises(ValueError):
        with phase.during(S.BACKWARD, "engine.backward", then=S.ACCUMULATING):
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


def _micro_step(phase: TrainingPhase, backwards: int, boundary: bool) -> None:
    for _ in range(backwards):
        with phase.during(S.BACKWARD, "engine.backward", then=S.GRADS_READY if boundary else S.ACCUMULATING):
            pass
    with phase.during(S.STEP, "engine.step", then=S.IDLE):
        pass


def test_a_second_backward_before_step_warns_once_when_accumulating(recwarn):
    phase = TrainingPhase(gradient_accumulation_steps=3)
    _micro_step(phase, 1, boundary=False)  # DeepSpeed's order: one backward, one step
    assert not recwarn.list
    _micro_step(phase, 3, boundary=False)  # torch's order: three backward calls, one step
    _micro_step(phase, 2, boundary=True)
    (w,) = recwarn.list  # once per engine
    assert w.category is MicroStepOrderWarning
    for part in (
        "gradient_accumulation_steps=3",
        "once every 3 engine.step() calls",
        "set_gradient_accumulation_boundary",
    ):
        assert part in str(w.message), str(w.message)


def test_two_backward_calls_per_step_without_accumulation_do_not_warn(recwarn):
    phase = TrainingPhase(gradient_accumulation_steps=1)
    for _ in range(2):
        _micro_step(phase, 2, boundary=True)  # two losses per step: every step() updates, as in torch
    assert not recwarn.list


def test_step_without_backward_warns_once(recwarn):
    phase = TrainingPhase(gradient_accumulation_steps=2)
    _micro_step(phase, 0, boundary=False)
    _micro_step(phase, 1, boundary=False)
    _micro_step(phase, 0, boundary=True)
    (w,) = recwarn.list
    assert w.category is MicroStepOrderWarning
    assert "engine.step() was called with no engine.backward() since the last step" in str(w.message)
    assert "global_steps and the LR scheduler" in str(w.message)


def _engine(gas: int):
    import torch
    from torch import nn

    import zerodp

    model = nn.Linear(4, 2)
    return zerodp.initialize(
        model,
        {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": gas,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        },
    ), torch.randn(2, 4)


def test_torch_style_accumulation_on_the_engine_warns_at_the_caller(world1):
    """gas 2, backward twice then step once (torch's order): no optimizer step yet, and one warning
    pointing at the line that called engine.backward."""
    engine, x = _engine(2)
    with pytest.warns(MicroStepOrderWarning, match="gradient_accumulation_steps=2") as caught:
        for _ in range(2):
            engine.backward(engine(x).square().mean())
        engine.step()
    assert len(caught) == 1 and caught[0].filename == __file__
    assert engine.global_steps == 0 and engine.micro_steps == 1


def test_step_before_backward_on_the_engine_warns_and_counts(world1, recwarn):
    engine, x = _engine(1)
    before = engine.module.weight.detach().clone()
    engine.step()
    (w,) = recwarn.list
    assert w.category is MicroStepOrderWarning and "no engine.backward() since the last step" in str(w.message)
    assert engine.global_steps == 1 and engine.module.weight.equal(before)  # counted, nothing updated


def test_accelerate_protocol_through_the_deepspeed_engine_does_not_warn(world1, recwarn):
    """accelerate's DeepSpeedEngineWrapper: set_gradient_accumulation_boundary before each backward,
    step() only after the window's last; zerodp ends the other micro-steps itself."""
    import torch
    from torch import nn

    import zerodp.deepspeed

    model = nn.Linear(4, 2)
    engine, *_ = zerodp.deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config={
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 2,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        },
    )
    x = torch.randn(2, 4)
    for micro in range(6):
        boundary = micro % 2 == 1
        engine.set_gradient_accumulation_boundary(is_boundary=boundary)
        engine.backward(engine(x).square().mean())
        if boundary:
            engine.step()
    assert engine.global_steps == 3 and not [w for w in recwarn.list if w.category is MicroStepOrderWarning]


@pytest.mark.parametrize("stage", [0, 2])
def test_engine_step_from_a_backward_hook_is_refused(world1, stage):
    """An ``engine.step()`` from inside ``engine.backward`` (a tensor hook) raises naming the phase; the
    engine then trains on: the phase is the one before the failed backward."""
    import torch
    from torch import nn

    import zerodp

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    engine = zerodp.initialize(
        model,
        {
            "train_micro_batch_size_per_gpu": 2,
            "zero_optimization": {"stage": stage},
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        },
    )
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
