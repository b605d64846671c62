"""The tensors inside a module's inputs or outputs: one walk over nested Python containers.

Used where the engine must find every tensor a forward took or returned: the stage-3 module hooks
(:mod:`zerodp.stage3.hooks`, tensors that require grad) and the backward roots
(:mod:`zerodp.runtime.backward_roots`, tensors with a ``grad_fn``).

Containers entered, recursively: tuples and lists (namedtuples included), dicts (their values, in
order; Hugging Face ``ModelOutput`` is a dict subclass, so only the fields it holds), and dataclass
instances (their fields, in order; a field without a value is skipped). Anything else (numbers,
strings, ``None``, arbitrary objects) is a leaf with no tensors. A tensor appears once per place it
occurs (duplicates are kept; callers de-duplicate by ``id`` when they need to). Self-referencing
containers are not supported (unbounded recursion), as in torch's own pytree utilities.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch


def tensors_in(obj: Any, keep: Callable[[torch.Tensor], bool]) -> list[torch.Tensor]:
    """Every tensor ``t`` inside ``obj`` (see the module docstring) with ``keep(t)``, depth first, in
    container order."""
    out: list[torch.Tensor] = []
    _walk(obj, keep, out)
    return out


def _walk(obj: Any, keep: Callable[[torch.Tensor], bool], out: list[torch.Tensor]) -> None:
    if isinstance(obj, torch.Tensor):
        if keep(obj):
            out.append(obj)
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            _walk(x, keep, out)
    elif isinstance(obj, dict):
        for x in obj.values():
            _walk(x, keep, out)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _walk(getattr(obj, f.name, None), keep, out)


__all__ = ["tensors_in"]
