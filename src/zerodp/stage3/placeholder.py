"""DeepSpeed's way of pickling a partitioned parameter, for :mod:`zerodp.deepspeed`: a placeholder that
refuses to load, and one warning per save.

DeepSpeed's partitioned parameters hold ``torch.empty(0)``, so ``torch.save(module.state_dict())`` at
ZeRO-3 succeeds and writes empty tensors (DeepSpeed-Chat's ``save_hf_format`` does, on rank 0, before
its gathering ``save_zero_three_model`` overwrites the same file). zerodp's own API refuses that save
(:class:`zerodp.stage3.sharded_param.RefuseSave`); parameters partitioned through ``zerodp.deepspeed``
(``initialize`` or ``zero.Init``) get :data:`PLACEHOLDER_SAVE` once, by :func:`save_as_placeholders`,
under which pickling a sharded parameter or its state-dict value:

- writes, instead of values, a call of a function of this module named
  ``partitioned_parameter_placeholder:<the parameter's name, '.' written ':'>`` with (name, shape,
  dtype) as its arguments;
- emits one :class:`PartitionedSaveWarning` per ``torch.save`` (counting the placeholders in the saved
  object, naming the first; outside ``torch.save``, e.g. ``pickle.dumps``, one per placeholder) saying
  the file holds placeholders, not weights, and how to save weights;
- makes loading fail loudly: ``torch.load(weights_only=True)`` (torch's default) refuses the unknown
  global, whose name says zerodp, placeholder and the parameter; with ``weights_only=False`` (or the
  global allowlisted) the function runs and raises :class:`PartitionedParameterError` naming the
  parameter and the ways to save weights (:data:`~zerodp.stage3.sharded_param.SAVE_HINT`).

Every other use of the values (``safetensors.save_file``, ``copy.deepcopy``, numpy, kernels) still
raises :class:`PartitionedParameterError`: a safetensors file cannot hold a value that refuses to load.
"""

from __future__ import annotations

import sys
import warnings
import weakref
from collections.abc import Callable, Mapping
from types import FrameType
from typing import Any, NoReturn

import torch
from torch import nn

from zerodp.stage3.sharded_param import (
    SAVE_ATTR,
    SAVE_HINT,
    PartitionedParameterError,
    SavePolicy,
    ShardedData,
    ShardedParameter,
)

#: what the loader functions' names start with (the rest is the parameter's name, '.' written ':')
LOADER_PREFIX = "partitioned_parameter_placeholder:"
_LOADERS: dict[str, Callable[..., NoReturn]] = {}
#: frames of these modules are not the user's (the warning points at the line that saved)
_SAVING_MODULES = ("zerodp.stage3.", "torch.serialization", "pickle", "copyreg")


class PartitionedSaveWarning(UserWarning):
    """A save (``torch.save``, pickle) wrote placeholders, not weights, for partitioned parameters
    (zerodp's DeepSpeed drop-in, at ZeRO stage 3)."""


def _load_placeholder(name: str, shape: tuple[int, ...], dtype: str) -> NoReturn:
    raise PartitionedParameterError(
        f"parameter '{name}' (shape {tuple(shape)}, {dtype}) in this file is a placeholder, not weights: "
        "it was pickled (torch.save of a state_dict) while partitioned at ZeRO stage 3 under zerodp's "
        "DeepSpeed drop-in, where DeepSpeed writes an empty tensor; the file holds no values for it" + SAVE_HINT
    )


def loader(attr: str) -> Callable[..., NoReturn]:
    """The loader function named ``attr`` (one object per name: pickle checks that the global it writes
    resolves to the same object)."""
    if attr not in _LOADERS:

        def load(name: str, shape: tuple[int, ...], dtype: str) -> NoReturn:
            _load_placeholder(name, shape, dtype)

        load.__name__ = load.__qualname__ = attr
        load.__module__ = __name__
        _LOADERS[attr] = load
    return _LOADERS[attr]


def __getattr__(attr: str) -> Callable[..., NoReturn]:
    """Resolve a loader's name as an attribute of this module (what unpickling a placeholder does)."""
    if attr.startswith(LOADER_PREFIX):
        return loader(attr)
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")


def _placeholders_in(obj: Any, out: list[torch.Tensor], seen: set[int], depth: int = 0) -> None:
    """Append to ``out`` the sharded tensors under :data:`PLACEHOLDER_SAVE` in ``obj`` (mappings,
    lists, tuples, sets; 8 levels), each once, in iteration order."""
    if id(obj) in seen or depth > 8:
        return
    seen.add(id(obj))
    if isinstance(obj, (ShardedData, ShardedParameter)):
        if isinstance(getattr(obj, SAVE_ATTR, None), PlaceholderSave):
            out.append(obj)
    elif isinstance(obj, Mapping):
        for v in obj.values():
            _placeholders_in(v, out, seen, depth + 1)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for v in obj:
            _placeholders_in(v, out, seen, depth + 1)


def _save_in_progress() -> tuple[Any, Any, int]:
    """``(obj, pickler)`` of the ``torch.save`` running (None, None outside ``torch.save``), and the
    ``stacklevel`` of the first frame outside zerodp.stage3 / torch.serialization / pickle for
    ``warnings.warn`` called from the caller of this function."""
    frame: FrameType | None = sys._getframe(2)
    level, saved, pickler = 2, None, None
    while frame is not None and frame.f_globals.get("__name__", "").startswith(_SAVING_MODULES):
        if pickler is None and frame.f_globals.get("__name__") == "torch.serialization":
            saved, pickler = frame.f_locals.get("obj"), frame.f_locals.get("pickler")
        frame, level = frame.f_back, level + 1
    return saved, pickler, level


class _Announced:
    """The save whose warning was given last: its pickler (weakly: each ``torch.save`` makes its own,
    dropped when the save ends) and the placeholders that warning counted (by id, weakly)."""

    pickler: weakref.ref | None = None
    counted: dict[int, weakref.ref] = {}

    @classmethod
    def covers(cls, tensor: torch.Tensor, pickler: Any) -> bool:
        ref = cls.counted.get(id(tensor))
        return (
            pickler is not None
            and cls.pickler is not None
            and cls.pickler() is pickler
            and ref is not None
            and ref() is tensor
        )

    @classmethod
    def record(cls, pickler: Any, counted: list[torch.Tensor]) -> None:
        try:
            cls.pickler = weakref.ref(pickler) if pickler is not None else None
        except TypeError:  # a pickler that cannot be referenced weakly: no grouping
            cls.pickler = None
        cls.counted = {id(t): weakref.ref(t) for t in counted}


def _announce(tensor: torch.Tensor, name: str) -> None:
    """Warn once per ``torch.save``: unless the warning of the save in progress counted ``tensor``."""
    saved, pickler, level = _save_in_progress()
    if _Announced.covers(tensor, pickler):
        return
    found: list[torch.Tensor] = []
    if saved is not None:
        _placeholders_in(saved, found, set())
    if not any(t is tensor for t in found):
        found.insert(0, tensor)
    _Announced.record(pickler, found)
    count = len(found)
    warnings.warn(
        f"{'torch.save' if saved is not None else 'pickling'} wrote {count} partitioned parameter"
        f"{'s' if count > 1 else ''} (the first: '{name}') as placeholders, not weights: at ZeRO stage 3 "
        "each rank holds only a shard of it, and zerodp's DeepSpeed drop-in writes a placeholder, as "
        "DeepSpeed writes an empty tensor. Loading the file raises PartitionedParameterError for "
        f"{'them' if count > 1 else 'it'} (torch.load(weights_only=True) refuses the global "
        f"zerodp.stage3.placeholder.{LOADER_PREFIX}...)" + SAVE_HINT,
        PartitionedSaveWarning,
        stacklevel=level,
    )


class PlaceholderSave(SavePolicy):
    """DeepSpeed's save policy (see the module docstring): pickling writes a placeholder that refuses
    to load and warns once per save."""

    def reduce(self, tensor: torch.Tensor, name: str, what: str) -> Any:
        _announce(tensor, name)
        with torch._C.DisableTorchFunctionSubclass():
            shape, dtype = tuple(tensor.shape), str(tensor.dtype)
        return loader(LOADER_PREFIX + name.replace(".", ":")), (name, shape, dtype)


PLACEHOLDER_SAVE = PlaceholderSave()


def save_as_placeholders(param: nn.Parameter) -> None:
    """Give ``param`` DeepSpeed's save policy (called by ``zerodp.deepspeed`` as it partitions it)."""
    param.__dict__[SAVE_ATTR] = PLACEHOLDER_SAVE
