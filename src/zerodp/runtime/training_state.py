"""The engine's training phase as one enum with guarded transitions (FSDP2 keeps its ``TrainingState``
the same way), instead of booleans that each caller sets.

One micro-step is ``engine(batch)`` (any phase but BACKWARD / STEP), ``engine.backward(loss)``
(IDLE or GRADS_READY -> BACKWARD -> GRADS_READY on the boundary micro-step, else IDLE) and
``engine.step()`` (-> STEP while the optimizer runs at a boundary -> IDLE).
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator


class TrainingState(enum.Enum):
    #: no reduced gradients of a complete accumulation are held (before the boundary backward, or
    #: after ``step()``); gradients of earlier micro-steps may be accumulating
    IDLE = "idle"
    #: inside ``engine.backward``
    BACKWARD = "backward"
    #: the boundary micro-step's backward has reduced the gradients of the whole accumulation; they
    #: are read (``clip_grad_norm_``, ``safe_get_full_grad``) until ``step()`` consumes them
    GRADS_READY = "grads_ready"
    #: inside ``engine.step`` at a gradient accumulation boundary (the optimizer runs)
    STEP = "step"


#: the phases each phase may be entered from
_ALLOWED: dict[TrainingState, frozenset[TrainingState]] = {
    TrainingState.IDLE: frozenset({TrainingState.BACKWARD, TrainingState.STEP}),
    TrainingState.BACKWARD: frozenset({TrainingState.IDLE, TrainingState.GRADS_READY}),
    TrainingState.GRADS_READY: frozenset({TrainingState.BACKWARD}),
    TrainingState.STEP: frozenset({TrainingState.IDLE, TrainingState.GRADS_READY}),
}


class TrainingPhase:
    """Holds the current :class:`TrainingState`; every change goes through :meth:`to` or
    :meth:`during`, which refuse a transition the engine does not make (only an error inside
    :meth:`during` sets the state directly)."""

    def __init__(self) -> None:
        self.state = TrainingState.IDLE

    def to(self, new: TrainingState, call: str) -> None:
        """Enter ``new`` (``call``: the engine method doing it, for the error).

        Raises:
            RuntimeError: ``new`` cannot follow the current state (e.g. ``engine.backward`` or
                ``engine.step`` called from inside another ``engine.backward`` or ``engine.step``).
        """
        if self.state not in _ALLOWED[new]:
            raise RuntimeError(f"{call} cannot run while the engine is in its {self.state.value!r} phase "
                               f"(allowed from: {', '.join(sorted(s.value for s in _ALLOWED[new]))}); "
                               "engine.backward and engine.step must not be called from inside each other "
                               "(e.g. from a hook)")
        self.state = new

    @contextlib.contextmanager
    def during(self, new: TrainingState, call: str, then: TrainingState,
               on_error: TrainingState | None = None) -> Iterator[None]:
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


__all__ = ["TrainingPhase", "TrainingState"]
