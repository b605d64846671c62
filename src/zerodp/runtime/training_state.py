"""The engine's training phase as one enum with guarded transitions (FSDP2 keeps its ``TrainingState``
the same way), instead of booleans that each caller sets.

One micro-step is ``engine(batch)`` (any phase but BACKWARD / STEP), ``engine.backward(loss)``
(-> BACKWARD -> GRADS_READY on the boundary micro-step, else ACCUMULATING) and ``engine.step()``
(-> STEP, the optimizer running at a boundary -> IDLE). ``step()`` counts the micro-steps, as
DeepSpeed's does: a second ``backward`` before ``step()`` with ``gradient_accumulation_steps`` > 1,
and a ``step()`` with no ``backward`` since the last one, are allowed (two losses of one micro-batch;
DeepSpeed accepts both) but each warns once per engine (:class:`MicroStepOrderWarning`), since a
torch-style loop doing either gets fewer optimizer steps than it expects.
"""

from __future__ import annotations

import contextlib
import enum
import warnings
from collections.abc import Iterator


class TrainingState(enum.Enum):
    #: no ``backward`` since the last ``step()`` (or since the engine was built)
    IDLE = "idle"
    #: inside ``engine.backward``
    BACKWARD = "backward"
    #: a ``backward`` off the accumulation boundary ran; its gradients accumulate until the window's
    #: end, ``step()`` counts its micro-step
    ACCUMULATING = "accumulating"
    #: the boundary micro-step's backward has reduced the gradients of the whole accumulation; they
    #: are read (``clip_grad_norm_``, ``safe_get_full_grad``) until ``step()`` consumes them
    GRADS_READY = "grads_ready"
    #: inside ``engine.step``
    STEP = "step"


S = TrainingState
#: the phases each phase may be entered from
_ALLOWED: dict[TrainingState, frozenset[TrainingState]] = {
    S.IDLE: frozenset({S.STEP}),
    S.BACKWARD: frozenset({S.IDLE, S.ACCUMULATING, S.GRADS_READY}),
    S.ACCUMULATING: frozenset({S.BACKWARD}),
    S.GRADS_READY: frozenset({S.BACKWARD}),
    S.STEP: frozenset({S.IDLE, S.ACCUMULATING, S.GRADS_READY}),
}


class MicroStepOrderWarning(UserWarning):
    """``engine.backward`` / ``engine.step`` called in an order whose micro-step count a torch-style
    loop would not expect (see the module docstring); shown once per engine and kind."""


BACKWARD_AGAIN = (
    "engine.backward was called again with no engine.step() since the last backward, with "
    "gradient_accumulation_steps={gas}: zerodp counts micro-steps in engine.step(), as DeepSpeed does, so these "
    "gradients add into one micro-step and the optimizer runs only once every {gas} engine.step() calls (a torch-style "
    "loop of {gas} backward calls and one step() updates the parameters 1/{gas} as often as it means to). Call "
    "engine.step() after every micro-batch's backward (it updates the parameters at the window's last one), or, "
    "through zerodp.deepspeed, accelerate's protocol: set_gradient_accumulation_boundary(is_boundary) before each "
    "backward and step() after the window's last. Several losses of one micro-batch back-propagated one by one are "
    "fine. Shown once per engine."
)
STEP_WITHOUT_BACKWARD = (
    "engine.step() was called with no engine.backward() since the last step: it still counts a micro-step, and at the "
    "end of the accumulation window (every gradient_accumulation_steps={gas} step() calls) it runs the optimizer on "
    "the gradients accumulated so far (none if the window had no backward: parameters unchanged) and advances "
    "global_steps and the LR scheduler all the same. Call engine.step() once after each micro-batch's "
    "engine.backward(loss). Shown once per engine."
)


class TrainingPhase:
    """Holds the current :class:`TrainingState`; every change goes through :meth:`to` or
    :meth:`during`, which refuse a transition the engine does not make (only an error inside
    :meth:`during` sets the state directly). ``gradient_accumulation_steps``: the engine's window
    (the warnings above depend on it)."""

    def __init__(self, gradient_accumulation_steps: int = 1) -> None:
        self.state = TrainingState.IDLE
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.warned: set[str] = set()  # the warnings shown (once each)

    def to(self, new: TrainingState, call: str) -> None:
        """Enter ``new`` (``call``: the engine method doing it, for the error); warn once (a
        :class:`MicroStepOrderWarning`) for a ``backward`` or ``step()`` out of the micro-step order.

        Raises:
            RuntimeError: ``new`` cannot follow the current state (e.g. ``engine.backward`` or
                ``engine.step`` called from inside another ``engine.backward`` or ``engine.step``).
        """
        if self.state not in _ALLOWED[new]:
            raise RuntimeError(
                f"{call} cannot run while the engine is in its {self.state.value!r} phase "
                f"(allowed from: {', '.join(sorted(s.value for s in _ALLOWED[new]))}); "
                "engine.backward and engine.step must not be called from inside each other "
                "(e.g. from a hook)"
            )
        if new is S.BACKWARD and self.state is not S.IDLE and self.gradient_accumulation_steps > 1:
            self._warn_once(BACKWARD_AGAIN)
        elif new is S.STEP and self.state is S.IDLE:
            self._warn_once(STEP_WITHOUT_BACKWARD)
        self.state = new

    def _warn_once(self, template: str) -> None:
        if template not in self.warned:
            self.warned.add(template)
            # 6: the caller of engine.backward / engine.step (to, during, __enter__, the engine method)
            warnings.warn(MicroStepOrderWarning(template.format(gas=self.gradient_accumulation_steps)), stacklevel=6)

    @contextlib.contextmanager
    def during(
        self, new: TrainingState, call: str, then: TrainingState, on_error: TrainingState | None = None
    ) -> Iterator[None]:
        """``new`` for the block, ``then`` after it; if the block raises, ``on_error`` (default: the
        state before the block)."""
        before = self.state
        self.to(new, call)
        try:
            yield
        except BaseException:
            self.state = before if on_error is None else on_error
            raise
        self.to(then, call)

    @property
    def grads_ready(self) -> bool:
        """The reduced gradients of a complete accumulation are held (until ``step()``)."""
        return self.state is TrainingState.GRADS_READY


__all__ = ["MicroStepOrderWarning", "TrainingPhase", "TrainingState"]
