"""Tensors that alias a gathered stage-3 parameter's storage and outlive the unit's release.

[Note: escaping views] Releasing a unit empties the storage of its full buffer and cast buffers (see
:mod:`zerodp.stage3.units`); a torch kernel reading a view of an emptied storage reads a null pointer
and kills the process (SIGSEGV: ``return self.weights[:n]`` in a forward, added to an embedding by the
parent). Every tensor that shares such a storage is one of:

- a parameter (its ``.data``) or the buffer itself: counted in the unit's baseline (the storage's use
  count measured when the unit became UNSHARDED, :func:`storage_refs`);
- a view saved by autograd (``weight.t()`` in ``linear``): while a stage-3 forward runs (the engine's
  forward; or a module called on its own while no other ``saved_tensors_hooks`` are active: the
  outermost module's pre-forward pushes them, its post-forward pops them), :class:`SavedAliasHooks`
  saves it as a :class:`_SavedAlias` (buffer key, offset, size, stride), which holds no reference to
  the storage; unpacked in backward as a view of the unit's buffer, which the module's pre-backward
  fetch has re-gathered (a still-released one raises :class:`PartitionedParameterError` instead of
  reading freed memory). Such views are not passed to ``saved_tensors_hooks`` enclosing the engine's
  forward (``save_on_cpu`` and the like): they hold no memory between forward and backward anyway.
  Other saved tensors are;
- a view returned from the module's forward: :func:`aliasing_copies` replaces it with a copy
  (``clone``, differentiable) before the unit is released, so the caller holds its own memory;
- anything else (a view stored on the module, captured in a closure, kept in a list, saved by a
  user's own ``saved_tensors_hooks`` that keeps the tensor): at release the storage's use count exceeds
  the baseline, and :meth:`~zerodp.stage3.units.ShardedUnit.release` *keeps* that storage (with its
  values) for those views and gives the unit a new, empty storage, with a warning naming the module
  and its parameters. The kept views then hold the values the parameters had at the release: they no
  longer follow the parameters (an optimizer step does not update them), and their memory is held
  until they are dropped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from zerodp.runtime.tensor_walk import tensors_in
from zerodp.stage3.sharded_param import PartitionedParameterError

_use_count = torch._C._storage_Use_Count
_top_hooks = torch._C._autograd._top_saved_tensors_default_hooks
_push_hooks = torch._C._autograd._push_saved_tensors_default_hooks
_pop_hooks = torch._C._autograd._pop_saved_tensors_default_hooks


def storage_key(t: torch.Tensor) -> int | None:
    """The identity of ``t``'s storage (its ``StorageImpl`` address), or None for a tensor without one
    (wrapper subclasses, sparse tensors)."""
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def storage_refs(t: torch.Tensor) -> int:
    """References to ``t``'s storage (tensors viewing it, the storage's Python object): its use count."""
    return _use_count(t.untyped_storage()._cdata)


class AliasTable:
    """Storage key -> (unit, buffer key) for every full buffer and cast buffer of the stage-3 units; a
    buffer key is None for the full buffer and ``(slot position, dtype)`` for a cast buffer. Kept up to
    date by the units (:meth:`add`, :meth:`drop`) when they create or replace a buffer."""

    def __init__(self) -> None:
        self.by_storage: dict[int, tuple[Any, Any]] = {}

    def add(self, t: torch.Tensor, unit: Any, key: Any) -> None:
        self.by_storage[t.untyped_storage()._cdata] = (unit, key)

    def drop(self, t: torch.Tensor) -> None:
        self.by_storage.pop(t.untyped_storage()._cdata, None)


@dataclasses.dataclass(eq=False)
class _SavedAlias:
    """A view of a unit's buffer saved by autograd, without a reference to the buffer's storage."""

    unit: Any
    key: Any  # None: the full buffer; (slot position, dtype): that cast buffer
    dtype: torch.dtype
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]

    def unpack(self) -> torch.Tensor:
        u = self.unit
        buf = u.full if self.key is None else u.casts.get(self.key)
        storage = buf.untyped_storage() if buf is not None else None
        last = self.offset + sum((n - 1) * s for n, s in zip(self.size, self.stride, strict=True))
        need = (last + 1) * self.dtype.itemsize
        if storage is None or (storage.nbytes() < need and all(self.size)):
            raise PartitionedParameterError(
                f"a view of a parameter of module '{u.name or '<root>'}' ({u.param_names()}) saved by autograd "
                "in forward is needed by backward while the parameter is released (ZeRO stage 3): the "
                "module's backward did not gather it first. Compute the view inside the module that owns "
                "the parameter, or register it with zerodp.zero.register_external_parameter(module, param)"
            )
        with torch.no_grad():
            return torch.empty(0, dtype=self.dtype, device=buf.device).set_(
                storage, self.offset, self.size, self.stride
            )


@dataclasses.dataclass(eq=False)
class _OuterPacked:
    """A tensor packed by the ``saved_tensors_hooks`` that were active when ours were pushed."""

    packed: Any


class SavedAliasHooks:
    """``saved_tensors_hooks`` for stage-3 forwards: views of a unit's buffer are saved as
    :class:`_SavedAlias`; other tensors go to the hooks that were active before (or are saved as they
    are). One instance per push (:func:`push_saved_alias_hooks`)."""

    def __init__(self, table: AliasTable, outer: tuple[Callable, Callable] | None) -> None:
        self.table = table
        self.outer = outer

    def pack(self, t: torch.Tensor) -> Any:
        by_storage = self.table.by_storage
        if by_storage:
            key = storage_key(t)
            hit = by_storage.get(key) if key is not None else None
            if hit is not None:
                return _SavedAlias(hit[0], hit[1], t.dtype, int(t.storage_offset()), tuple(t.shape), t.stride())
        if self.outer is not None:
            return _OuterPacked(self.outer[0](t))
        return t

    def unpack(self, packed: Any) -> torch.Tensor:
        if type(packed) is _SavedAlias:
            return packed.unpack()
        if type(packed) is _OuterPacked:
            assert self.outer is not None  # packed by self.outer
            return self.outer[1](packed.packed)
        return packed


def no_saved_tensors_hooks() -> bool:
    """True when no ``saved_tensors_hooks`` are active (ours or anyone's)."""
    return _top_hooks(False) is None


def push_saved_alias_hooks(table: AliasTable) -> None:
    """Push a :class:`SavedAliasHooks` (delegating to the current hooks); undo with :func:`pop_saved_alias_hooks`."""
    hooks = SavedAliasHooks(table, _top_hooks(False))
    _push_hooks(hooks.pack, hooks.unpack)


def pop_saved_alias_hooks() -> None:
    _pop_hooks()


class saved_alias_hooks:
    """Context manager form of :func:`push_saved_alias_hooks` (the engine's stage-3 forward)."""

    def __init__(self, table: AliasTable) -> None:
        self.table = table

    def __enter__(self) -> None:
        push_saved_alias_hooks(self.table)

    def __exit__(self, *exc: object) -> None:
        pop_saved_alias_hooks()


def aliasing_copies(output: Any, units: list, table: AliasTable) -> tuple[dict[int, torch.Tensor], dict[int, int]]:
    """Copies of the tensors in ``output`` that view a buffer of one of ``units`` (a parameter itself
    excepted), taken while the units are still gathered: ``{id(tensor): copy}`` (``clone``, so the
    gradient still flows to the parameter), and per storage key how many distinct tensors of ``output``
    view it (the hook's caller holds them until the hook returns: the release allows for them)."""
    mapping: dict[int, torch.Tensor] = {}
    counts: dict[int, int] = {}
    if not table.by_storage:
        return mapping, counts
    for t in tensors_in(output, lambda t: True):
        if id(t) in mapping or isinstance(t, torch.nn.Parameter):
            continue
        key = storage_key(t)
        hit = table.by_storage.get(key) if key is not None else None
        if key is None or hit is None or not any(hit[0] is u for u in units):
            continue
        mapping[id(t)] = t.clone()
        counts[key] = counts.get(key, 0) + 1
    return mapping, counts
