"""``param.grad`` placeholders that raise on use, set from ``engine.backward`` until ``engine.step``.

At stages 1-3 the engine keeps each rank's partition of the averaged gradient in its own buffers
(:mod:`zerodp.runtime.reducer`), so ``param.grad`` of the module's parameters would be None after
``engine.backward``. Code that reads ``param.grad`` then gets a silently wrong answer:
``torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm)`` skips None gradients, returns 0.0
and clips nothing (pytorch/pytorch#170862 is the FSDP form; DeepSpeed behaves the same). A
placeholder makes every such use fail loudly instead.

:class:`HiddenGradient` has the parameter's shape, dtype and device (so ``param.grad = placeholder``
is accepted, and ``.shape``/``.dtype``/``.device`` read normally) and no storage (it costs no
memory). Every tensor operation on it (``torch.linalg.vector_norm``, ``torch._foreach_norm``,
``mul_``, ``zero_``, ``clone``, printing its values) raises RuntimeError naming the parameter, why
its gradient is not there, and what to use instead: ``"gradient_clipping"`` in the config,
``engine.clip_grad_norm_(max_norm, norm_type)``, ``engine.get_global_grad_norm()``,
``zerodp.zero.safe_get_full_grad(param)``. ``module.zero_grad()`` (``set_to_none=True``) still works.

Which parameters get one (trained parameters only; frozen ones keep ``grad`` None, as in torch):

- stages 1-3, at every world size: always (one behaviour at world size 1 and N).
- stage 0: everywhere when gradients accumulate in an fp32 buffer under bf16/fp16 (the module's
  16-bit ``.grad`` cannot hold it); otherwise where ``param.grad`` is None (on a micro-step that does not reduce, world
  size > 1, the local sum is hidden), and everywhere under fp16 loss scaling (the gradient buffer holds the
  *scaled* gradient until ``engine.step`` unscales it). Otherwise ``param.grad`` views the averaged
  gradient that the step uses, and ``torch.nn.utils.clip_grad_norm_`` on it works as in DDP.

:meth:`GradPlaceholders.remove` puts back exactly what each placeholder displaced (None, or the
stage-0/1 view of the flat gradient buffer) before the next backward and at ``engine.step``; a
``param.grad`` that the user replaced in between is left alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from zerodp.runtime.partition import ParamSlot

#: what every message ends with: the ways to reach the gradients that do work
ALTERNATIVES = (
    'To clip gradients, set "gradient_clipping" in the config or call engine.clip_grad_norm_(max_norm, '
    "norm_type=2.0) after engine.backward on the last micro-step of an accumulation (it returns the global "
    "norm as torch.nn.utils.clip_grad_norm_ does, which cannot see the engine's gradients); "
    "engine.get_global_grad_norm() is the norm at the last step; zerodp.zero.safe_get_full_grad(param), "
    "called on every rank, gives one parameter's full averaged gradient"
)


class HiddenGradient(torch.Tensor):
    """Stands in ``param.grad`` while the engine holds the gradient: ``param``'s shape, dtype and device,
    no storage; any operation raises RuntimeError with :attr:`message`."""

    message: str

    @staticmethod
    def __new__(cls, param: torch.Tensor, message: str) -> HiddenGradient:
        t = torch.Tensor._make_wrapper_subclass(
            cls, param.shape, dtype=param.dtype, device=param.device, requires_grad=False
        )
        t.message = message
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]  # torch's documented idiom

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]  # torch's stub is an instance method
        hidden = next((a for a in (*args, *(kwargs or {}).values()) if isinstance(a, HiddenGradient)), None)
        what = hidden.message if hidden is not None else ALTERNATIVES
        raise RuntimeError(f"{func} on a parameter's .grad: {what}")

    def __repr__(self) -> str:  # type: ignore[override]  # no values to print; a debugger listing locals must not raise
        return f"HiddenGradient(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"


def is_hidden_gradient(t: torch.Tensor | None) -> bool:
    """True for a :class:`HiddenGradient` placeholder."""
    return isinstance(t, HiddenGradient)


class GradPlaceholders:
    """Sets and removes the placeholders of one engine's trained parameters (``slots``).

    Args:
        slots: the engine's parameter slots (``reducer.slots``); frozen ones are skipped.
        stage: ZeRO stage (see the module docstring for which parameters get one).
        loss_scaled: fp16 loss scaling is on (the gradient buffers hold scaled values).
        folded: stage 0 accumulates into an fp32 buffer (``reducer.folds``): the module's 16-bit
            ``param.grad`` is dropped after each backward, so none can show the averaged gradient.
    """

    def __init__(self, slots: Sequence[ParamSlot], stage: int, loss_scaled: bool, folded: bool = False) -> None:
        self.slots = [s for s in slots if s.group_index >= 0 and s.param.requires_grad]
        self.stage = stage
        self.loss_scaled = loss_scaled
        self.folded = folded
        #: slot index -> (placeholder, the parameter's (shape, dtype, device) it was made for): reused while equal
        self._cache: dict[int, tuple[HiddenGradient, tuple]] = {}
        self._displaced: dict[int, tuple[HiddenGradient, torch.Tensor | None]] = {}
        self._had_grad: list[bool] = []  # per slot: param.grad was set when the last backward returned

    def _reason(self) -> str:
        if self.stage >= 1:
            return (
                f"ZeRO stage {self.stage} keeps each rank's partition of the averaged gradient in the "
                "engine, so param.grad holds no value between engine.backward and engine.step"
            )
        if self.loss_scaled:
            return (
                "under fp16 loss scaling the engine's gradient is multiplied by the loss scale until "
                "engine.step() unscales it, so param.grad holds no value between engine.backward and "
                "engine.step"
            )
        if self.folded:
            return (
                "the engine accumulates gradients in an fp32 buffer (data_types.grad_accum_dtype) and "
                "the module's 16-bit param.grad cannot hold it, so param.grad holds no value between "
                "engine.backward and engine.step"
            )
        return (
            "gradients are averaged across ranks only by the engine.backward of the last micro-step of "
            "an accumulation, so param.grad holds no value after the others"
        )

    def _hides(self, current: torch.Tensor | None, reduced: bool) -> bool:
        if self.stage >= 1 or self.loss_scaled or self.folded:
            return True
        # stage 0: a view of the averaged gradient, which the step reads, stays; None after a reduced
        # backward means no gradient (the user set it to None and the parameter got none), as in torch
        return current is None and not reduced

    def install(self, reduced: bool) -> None:
        """After ``engine.backward`` (``reduced``: it was the accumulation boundary's): set a placeholder
        wherever ``param.grad`` is not the averaged, unscaled gradient."""
        cache, displaced = self._cache, self._displaced
        for s in self.slots:
            p = s.param
            current = p.grad
            if isinstance(current, HiddenGradient) or not self._hides(current, reduced):
                continue
            kind = (p.shape, p.dtype, p.device)
            entry = cache.get(s.index)
            if entry is None or entry[1] != kind:  # first use, or p.data re-bound to another shape or dtype
                entry = cache[s.index] = (HiddenGradient(p, f"'{s.name}': {self._reason()}. {ALTERNATIVES}"), kind)
            p.grad = entry[0]
            displaced[s.index] = (entry[0], current)
        self._had_grad = [s.param.grad is not None for s in self.slots]

    def check_not_cleared(self) -> None:
        """At ``engine.step``: refuse when ``param.grad`` of a trained parameter was set to None since
        the last ``engine.backward`` (``module.zero_grad()``, ``optimizer.zero_grad()``, ``p.grad =
        None``). In torch that discards the gradient; the engine keeps it in its own buffers, so the
        step would apply it anyway (silently).

        Raises:
            RuntimeError: naming the first such parameter, how many there are, and what to do instead.
        """
        cleared = [s.name for s, had in zip(self.slots, self._had_grad, strict=False) if had and s.param.grad is None]
        if cleared:
            more = f" (and {len(cleared) - 1} more)" if len(cleared) > 1 else ""
            raise RuntimeError(
                f"engine.step(): param.grad of '{cleared[0]}'{more} was set to None after engine.backward "
                "(module.zero_grad(), optimizer.zero_grad() or p.grad = None). zerodp keeps the gradients in "
                "its own buffers, so this would not discard them and the step would apply them anyway. Zero "
                "gradients after engine.step() (the engine does it itself), or call engine.zero_grad() of "
                "zerodp.deepspeed's engine to discard this accumulation's gradients"
            )

    def forget_backward(self) -> None:
        """The engine's gradients were discarded (``engine.zero_grad``): nothing to check at the step."""
        self._had_grad = []

    def remove(self) -> None:
        """Before a backward and at ``engine.step``: put back what each placeholder displaced (where
        ``param.grad`` still holds that placeholder)."""
        if not self._displaced:
            return
        for s in self.slots:
            entry = self._displaced.get(s.index)
            if entry is not None and s.param.grad is entry[0]:
                s.param.grad = entry[1]
        self._displaced.clear()
        self._had_grad = []
