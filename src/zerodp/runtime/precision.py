"""Mixed precision: the parameter dtype policy and fp16 loss scaling.

With bf16 or fp16, the module's parameters and gradients are held in that dtype (2 bytes per element)
and each rank keeps an fp32 *master* copy of only the elements it owns (its optimizer pieces); the
optimizer updates the master copy and the result is cast back (Micikevicius et al., "Mixed Precision
Training", ICLR 2018; ZeRO paper section 3.1: 2 Psi + 2 Psi + 12 Psi = 16 Psi).

fp16 gradients under- and overflow, so the loss is multiplied by a *loss scale* before backward and the
gradients divided by it before the update. Dynamic loss scaling (DeepSpeed's semantics): an inf/nan in
any rank's gradients skips the whole step on every rank; after ``hysteresis`` such overflows the scale
is halved (never below ``min_loss_scale``); after ``loss_scale_window`` consecutive clean steps it is
doubled and the hysteresis budget restored.

Gradient accumulation (DeepSpeed's ``data_types.grad_accum_dtype``): adding each micro-step's bf16/fp16
gradient into a bf16/fp16 sum rounds at every micro-step, and a micro-step much smaller than the sum
is lost entirely (deepspeedai/DeepSpeed#1800: bf16, 8 micro-steps of 1.0 then seven of 2^-9 move the
master by 0.125 instead of 0.12671). So by default, with ``gradient_accumulation_steps`` > 1 under
bf16/fp16, every stage accumulates in an fp32 buffer (stages 0-1: the full gradient, reduced in fp32
at the boundary; stages 2-3: the owned partition, each micro-step's reduce-scatter result added in
fp32): 4 bytes per gradient element instead of 2 (:attr:`PrecisionPolicy.bytes_per_element`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn

from zerodp.config import ConfigError, ZeroDPConfig
from zerodp.runtime.accounting import FP32_ADAM, MIXED_PRECISION_ADAM, BytesPerElement


@dataclass(frozen=True)
class PrecisionPolicy:
    """Which dtype the module computes in, whether fp32 master weights are kept, and the dtype
    gradients accumulate in across micro-steps (``grad_accum_dtype``, see the module docstring)."""

    param_dtype: torch.dtype
    loss_scaling: bool  # fp16 only
    grad_accum_dtype: torch.dtype = torch.float32

    @property
    def has_master(self) -> bool:
        return self.param_dtype != torch.float32

    @property
    def bytes_per_element(self) -> BytesPerElement:
        """Paper bytes per element, gradients at the accumulation dtype's size (4 with an fp32 buffer)."""
        b = MIXED_PRECISION_ADAM if self.has_master else FP32_ADAM
        return replace(b, grad=self.grad_accum_dtype.itemsize)

    @staticmethod
    def from_config(cfg: ZeroDPConfig) -> PrecisionPolicy:
        dtype = torch.bfloat16 if cfg.bf16.enabled else torch.float16 if cfg.fp16.enabled else torch.float32
        return PrecisionPolicy(
            dtype,
            loss_scaling=cfg.fp16.enabled,
            grad_accum_dtype=grad_accum_dtype(dtype, cfg.gradient_accumulation_steps, cfg.data_types.grad_accum_dtype),
        )


_ACCUM_NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def grad_accum_dtype(param_dtype: torch.dtype, accumulation_steps: int, configured: str | None) -> torch.dtype:
    """The dtype gradients accumulate in: ``configured`` ("fp32", "bf16", "fp16": DeepSpeed's
    ``data_types.grad_accum_dtype``, already checked against the precision by the config) if given;
    else fp32 when ``param_dtype`` is 16-bit and ``accumulation_steps`` > 1, else ``param_dtype``."""
    if configured is not None:
        return _ACCUM_NAMES[configured]
    return torch.float32 if accumulation_steps > 1 else param_dtype


def cast_module(module: nn.Module, dtype: torch.dtype, *, partitioned: Callable[[torch.Tensor], bool]) -> None:
    """Cast ``module``'s floating parameters (in place: ``p.data``, same objects) and buffers to ``dtype``,
    as ``module.to(dtype)`` does, except that parameters partitioned by :class:`zerodp.zero.Init` (no
    values here; Init already partitioned them in the config's dtype) are left as they are.
    ``partitioned`` tells those apart (the engine passes :func:`zerodp.stage3.sharded_param.is_sharded`;
    a parameter, so this runtime module does not import :mod:`zerodp.stage3`, which ranks above it).

    Raises:
        ConfigError: a partitioned parameter is in another floating dtype than ``dtype`` (``Init`` was
            given a config with another precision than the engine's).
    """
    for m in module.modules():
        for name, p in m._parameters.items():
            if p is None or not p.is_floating_point() or p.dtype == dtype:
                continue
            if partitioned(p):
                raise ConfigError(
                    f"parameter '{name}' of {type(m).__name__} was partitioned by zero.Init in "
                    f"{p.dtype}, but the engine trains in {dtype}: give Init and initialize the same "
                    "bf16/fp16 settings"
                )
            with torch.no_grad():
                p.data = p.data.to(dtype)
            if p.grad is not None:
                p.grad = p.grad.to(dtype)
        for name, b in m._buffers.items():
            if b is not None and b.is_floating_point() and b.dtype != dtype:
                m._buffers[name] = b.to(dtype)


class LossScaler:
    """fp16 loss scale, static (``loss_scale > 0``) or dynamic. See the module docstring."""

    def __init__(
        self,
        loss_scale: float = 0.0,
        initial_scale_power: int = 16,
        loss_scale_window: int = 1000,
        hysteresis: int = 2,
        min_loss_scale: float = 1.0,
    ) -> None:
        self.dynamic = loss_scale == 0.0
        self.scale: float = float(2**initial_scale_power) if self.dynamic else float(loss_scale)
        self.window = loss_scale_window
        self.hysteresis = hysteresis
        self.min_scale = min_loss_scale
        self.hysteresis_left = hysteresis
        self.clean_steps = 0

    def update(self, overflow: bool) -> None:
        """Record one optimizer step's outcome (``overflow``: it was skipped)."""
        if not self.dynamic:
            return
        if overflow:
            self.clean_steps = 0
            if self.hysteresis_left <= 1:
                self.scale = max(self.scale / 2.0, self.min_scale)
            else:
                self.hysteresis_left -= 1
            return
        self.clean_steps += 1
        if self.clean_steps >= self.window:
            self.scale *= 2.0
            self.clean_steps = 0
            self.hysteresis_left = self.hysteresis

    def state_dict(self) -> dict:
        return {"scale": self.scale, "hysteresis_left": self.hysteresis_left, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.hysteresis_left = int(state["hysteresis_left"])
        self.clean_steps = int(state["clean_steps"])

    @staticmethod
    def from_config(cfg: ZeroDPConfig) -> LossScaler | None:
        if not cfg.fp16.enabled:
            return None
        f = cfg.fp16
        return LossScaler(f.loss_scale, f.initial_scale_power, f.loss_scale_window, f.hysteresis, f.min_loss_scale)
