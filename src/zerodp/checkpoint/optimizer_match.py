"""Whether a checkpoint's optimizer state fits the engine's optimizer: the state keys saved for each
trained parameter (``exp_avg``, ``exp_avg_sq``, ``step`` for Adam/AdamW; ``momentum_buffer`` for SGD;
``sum`` for Adagrad) must be the keys the engine's optimizer keeps for that parameter's param group.
Loaded otherwise, torch raises a bare ``KeyError`` at the next step or silently ignores the foreign
state (see :func:`check_optimizer_state`)."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from zerodp.checkpoint.engine_state import optimizer_group_names
from zerodp.checkpoint.format import IMPLEMENTATION_OPTIONS, CheckpointError
from zerodp.checkpoint.protocol import CheckpointableEngine as Engine
from zerodp.checkpoint.reader import CheckpointReader


def check_optimizer_state(reader: CheckpointReader, engine: Engine) -> None:
    """Compare the optimizer-state keys saved for each trained parameter with the keys the engine's
    optimizer keeps in that parameter's param group (its current state, or else what one step of a
    probe optimizer of the same class and options creates). Parameters saved without state (never
    stepped) fit any optimizer. Same class and unknown keys (a probe could not run): accepted.

    Raises:
        CheckpointError: naming the saved optimizer class (``meta.json``'s ``optimizer``), the engine's,
            the first parameter whose keys differ and both key sets, and the ways out
            (``load_optimizer_states=False``, or an engine with the saved optimizer).
    """
    saved, mine = reader.meta.optimizer, type(engine.optimizer).__name__
    for i, (pg, names) in enumerate(zip(engine.optimizer.param_groups, optimizer_group_names(engine), strict=True)):
        expected = expected_state_keys(engine.optimizer, pg)
        for name in names:
            keys = set(reader.state_kinds(name)) if reader.record(name).trained else set()
            if not keys:
                continue
            if expected is None and saved == mine:
                break
            if keys != expected:
                kept = "state whose keys could not be determined" if expected is None else sorted(expected)
                raise CheckpointError(
                    f"checkpoint {reader.path} was saved with optimizer {saved} and this engine's optimizer is "
                    f"{mine}: the saved state of parameter {name!r} holds {sorted(keys)}, {mine} (param group {i}) "
                    f"keeps {kept}; configure the engine with the {saved} optimizer (and its options) to resume, "
                    "or load only the module weights, buffers, scheduler and counters with "
                    "load_checkpoint(..., load_optimizer_states=False) (the optimizer state then stays as it is)"
                )


def expected_state_keys(optimizer: torch.optim.Optimizer, pg: dict[str, Any]) -> set[str] | None:
    """The state keys ``optimizer`` keeps for a parameter of param group ``pg``: those of a parameter
    of the group that has state, else those one step of a probe (``type(optimizer)`` over a 1-element
    fp32 parameter with ``pg``'s options but the implementation switches, zero gradient) creates; None
    when the probe cannot be built or stepped (a class with required constructor arguments, a closure)."""
    for p in pg["params"]:
        st = optimizer.state.get(p)
        if st:
            return set(st)
    probe_param = torch.nn.Parameter(torch.zeros(1))
    options = {k: v for k, v in pg.items() if k != "params" and k not in IMPLEMENTATION_OPTIONS}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            probe = type(optimizer)([{"params": [probe_param], **options}])  # type: ignore[call-arg]
            probe_param.grad = torch.zeros_like(probe_param)
            probe.step()
    except Exception:  # noqa: BLE001 - any failure means the keys are unknown, not an error of the load
        return None
    return set(probe.state.get(probe_param, {}))


__all__ = ["check_optimizer_state", "expected_state_keys"]
