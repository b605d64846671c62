"""The four stage-3 module hooks, registered in one place (:func:`register_stage3_hooks`).

- pre-forward: fetch the module's units; route its tensor inputs through a :class:`_BackwardHook`
  that releases them.
- post-forward: release the units; route its tensor outputs through a :class:`_BackwardHook` that
  fetches them.
- pre-backward: the outputs' hook runs when the gradient of the module's outputs arrives, before the
  module's own backward: fetch the units again (torch has no module pre-backward hook that fires at
  that moment for every output structure).
- post-backward: the inputs' hook runs once the gradients of the module's inputs are computed, i.e.
  after the module's backward: release the units. Modules whose inputs need no gradient
  are released by the coordinator at the end of backward.

Inputs and outputs may be tensors, or tuples, lists, dicts and dataclasses of them, or anything else
(left untouched; the tensors are found by :func:`zerodp.runtime.tensor_walk.tensors_in`).
Parameters of other modules used directly inside a forward are detected by
:class:`ExternalParameterMode` (a ``TorchFunctionMode`` active only inside the engine's forward) and
gathered from then on with the module that used them. The same mode routes dtype casts of a gathered
parameter (``weight.float()``, ``weight.to(torch.bfloat16)``) through :class:`_ParamCast`, whose output
lives in the unit's cast buffer: a cast saved by autograd is then freed with the unit after forward
and re-filled when the unit is gathered for backward (see :mod:`zerodp.stage3.units`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from zerodp.runtime.tensor_walk import tensors_in
from zerodp.stage3.aliases import aliasing_copies, no_saved_tensors_hooks, pop_saved_alias_hooks, push_saved_alias_hooks
from zerodp.stage3.coordinator import ParameterCoordinator
from zerodp.stage3.sharded_param import METADATA
from zerodp.stage3.units import ShardState


class _BackwardHook(torch.autograd.Function):
    """Identity on ``tensors``; its backward calls ``action(module)`` before passing gradients on."""

    @staticmethod
    def forward(ctx: Any, action: Callable[[nn.Module], None], module: nn.Module, *tensors: torch.Tensor):
        ctx.action, ctx.module = action, module
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor):
        ctx.action(ctx.module)
        return (None, None, *grads)


def _replace(obj: Any, mapping: dict[int, torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return mapping.get(id(obj), obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_replace(x, mapping) for x in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_replace(x, mapping) for x in obj)
    if isinstance(obj, dict):
        return type(obj)((k, _replace(v, mapping)) for k, v in obj.items())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: _replace(getattr(obj, f.name), mapping) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
    return obj


def _wrap(action: Callable[[nn.Module], None], module: nn.Module, obj: Any) -> Any:
    """Route every tensor in ``obj`` that requires grad through one :class:`_BackwardHook`."""
    tensors = tensors_in(obj, lambda t: t.requires_grad)
    if not tensors:
        return obj
    unique = list({id(t): t for t in tensors}.values())
    wrapped = _BackwardHook.apply(action, module, *unique)
    return _replace(obj, {id(t): w for t, w in zip(unique, wrapped, strict=True)})


class ModuleStack:
    """The modules whose forward is running, innermost last (for external-parameter detection)."""

    def __init__(self) -> None:
        self.stack: list[nn.Module] = []
        #: the outermost module whose pre-forward pushed the saved-alias hooks (a call outside the
        #: engine's forward, which pushes its own); its post-forward pops them
        self.pushed_by: nn.Module | None = None


def register_stage3_hooks(
    root: nn.Module, coordinator: ParameterCoordinator, stack: ModuleStack
) -> list[RemovableHandle]:
    """Register pre/post-forward hooks on every submodule of ``root`` (backward ones ride on them)."""
    handles: list[RemovableHandle] = []

    def needs_backward_hooks(module: nn.Module) -> bool:
        return torch.is_grad_enabled() and bool(coordinator.index.by_module.get(id(module)))

    aliases = coordinator.index.aliases

    def pre_forward(module: nn.Module, args: tuple, kwargs: dict):
        # a module called outside the engine's forward (which pushes them itself), with no hooks of
        # anyone else active (torch.utils.checkpoint's recomputation counts what its own hooks save)
        if not stack.stack and no_saved_tensors_hooks():
            push_saved_alias_hooks(aliases)
            stack.pushed_by = module
        stack.stack.append(module)
        coordinator.fetch(module)
        if needs_backward_hooks(module):
            # post-backward: runs once the gradients of the module's inputs exist
            return _wrap(coordinator.release, module, (args, kwargs))
        return None

    def post_forward(module: nn.Module, args: tuple, kwargs: dict, output: Any):
        if stack.stack and stack.stack[-1] is module:
            stack.stack.pop()
        if stack.pushed_by is module:
            stack.pushed_by = None
            pop_saved_alias_hooks()
        units = coordinator.index.by_module.get(id(module))
        copies, held = aliasing_copies(output, units, aliases) if units else ({}, {})
        if copies:  # views of the module's parameters returned: copies, taken before the release
            output = _replace(output, copies)
        coordinator.release(module, held)
        if needs_backward_hooks(module):
            # pre-backward: runs when the gradient of the module's outputs arrives
            return _wrap(coordinator.fetch, module, output)
        return output if copies else None

    for module in root.modules():
        handles.append(module.register_forward_pre_hook(pre_forward, with_kwargs=True))
        handles.append(module.register_forward_hook(post_forward, with_kwargs=True))
    return handles


class _ParamCast(torch.autograd.Function):
    """``param`` cast to ``buf``'s dtype, returned as a view of ``buf`` (a unit's cast buffer);
    backward casts the gradient back. Saves nothing."""

    @staticmethod
    def forward(ctx: Any, param: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        ctx.dtype = param.dtype
        return buf.view_as(buf)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return grad.to(ctx.dtype), None


#: the Tensor methods treated as dtype casts of a parameter
_CASTS = {
    torch.Tensor.to,
    torch.Tensor.float,
    torch.Tensor.double,
    torch.Tensor.half,
    torch.Tensor.bfloat16,
    torch.Tensor.type,
}


class ExternalParameterMode(TorchFunctionMode):
    """Detects a partitioned parameter used while SHARDED inside a module's forward (e.g. a parent
    reading ``self.child.weight``): gathers it and registers it as external to that module."""

    def __init__(self, coordinator: ParameterCoordinator, stack: ModuleStack) -> None:
        super().__init__()
        self.coordinator = coordinator
        self.stack = stack

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        c = self.coordinator
        if not c.busy and self.stack.stack and func not in METADATA:  # metadata needs no gather
            # by_param holds the ids of live partitioned parameters only, so the lookup alone tells
            # (no isinstance(a, nn.Parameter): its metaclass check runs Python code per argument)
            by_param = c.index.by_param
            for a in _flat_args(args, kwargs):
                u = by_param.get(id(a))
                if u is not None and u.state is not ShardState.UNSHARDED:
                    c.fetch_external(self.stack.stack[-1], a)
        out = func(*args, **kwargs)
        if func in _CASTS and not c.busy and args and isinstance(args[0], nn.Parameter):
            return _cast_buffer_output(c, args[0], out)
        return out


def _cast_buffer_output(c: ParameterCoordinator, param: nn.Parameter, out: Any) -> Any:
    """Replace ``out`` (``param`` cast to another dtype) with the same values in ``param``'s unit's
    cast buffer, so that the memory is freed with the unit. Anything else is returned unchanged."""
    u = c.index.by_param.get(id(param))
    if (
        u is None
        or u.persistent
        or u.state is not ShardState.UNSHARDED
        or not isinstance(out, torch.Tensor)
        or out is param
        or out.dtype == param.dtype
        or out.device != param.device
        or out.shape != param.shape
    ):
        return out
    buf = u.cast(param, out.dtype)
    c._note_live()
    if not (torch.is_grad_enabled() and param.requires_grad):
        return buf.view_as(buf).detach()
    return _ParamCast.apply(param, buf)


def _flat_args(args: tuple, kwargs: dict):
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a
    yield from kwargs.values()
