"""Which parameters already belong to an engine: a model (or any module sharing its parameters) can be
wrapped by :func:`zerodp.initialize` once, because the engine re-lays its parameters out into flat
buffers (or shards) and feeds their gradient hooks to its reducer."""

from __future__ import annotations

import weakref

import torch
from torch import nn


class _WrappedParams:
    """id(parameter) -> (weak reference, description of the engine that wraps it); an entry dies with
    its parameter. (Tensors cannot key a WeakKeyDictionary: their ``__eq__`` is elementwise.)"""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, str]] = {}

    def add(self, param: torch.Tensor, engine: str) -> None:
        key = id(param)
        self._entries[key] = (weakref.ref(param, lambda _r: self._entries.pop(key, None)), engine)

    def get(self, param: torch.Tensor) -> str | None:
        entry = self._entries.get(id(param))
        return entry[1] if entry is not None and entry[0]() is param else None


#: every parameter of every module an engine was built on (checked by :func:`initialize`).
WRAPPED = _WrappedParams()


def refuse_wrapped(model: nn.Module) -> None:
    """Raise if any parameter of ``model`` already belongs to an engine: its data was re-laid out into
    that engine's flat buffers (or shards) and its gradient hooks feed that engine's reducer."""
    for name, p in model.named_parameters(remove_duplicate=True):
        engine = WRAPPED.get(p)
        if engine is not None:
            raise ValueError(
                f"zerodp.initialize: the model is already wrapped by an engine ({engine}; parameter "
                f"'{name}'); keep using that engine, or build a new model (a model, or any module sharing "
                "its parameters, can be wrapped once, also after its engine was dropped: its parameters "
                "stay laid out for that engine)")
