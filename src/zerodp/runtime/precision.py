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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from zerodp.runtime.accounting import FP32_ADAM, MIXED_PRECISION_ADAM, BytesPerElement
from zerodp.config import ConfigError, ZeroDPConfig
from zerodp.stage3.sharded_param import is_sharded


@dataclass(frozen=True)
class PrecisionPolicy:
    """Which dtype the module computes in and whether fp32 master weights are kept."""

    param_dtype: torch.dtype
    loss_scaling: bool  # fp16 only

    @property
    def has_master(self) -> bool:
        return self.param_dtype != torch.float32

    @property
    def bytes_per_element(self) -> BytesPerElement:
        return MIXED_PRECISION_ADAM if self.has_master else FP32_ADAM

    @staticmethod
    def from_config(cfg: ZeroDPConfig) -> "PrecisionPolicy":
        if cfg.bf16.enabled:
            return PrecisionPolicy(torch.bfloat16, loss_scaling=False)
        if cfg.fp16.enabled:
            return PrecisionPolicy(torch.float16, loss_scaling=True)
        return PrecisionPolicy(torch.float32, loss_scaling=False)


def cast_module(module: nn.Module, dtype: torch.dtype) -> None:
    """Cast ``module``'s floating parameters (in place: ``p.data``, same objects) and buffers to ``dtype``,
    as ``module.to(dtype)`` does, except that parameters partitioned by :class:`zerodp.zero.Init` (no
    values here; Init already partitioned them in the config's dtype) are left as they are.

    Raises:
        ConfigError: a partitioned parameter is in another floating dtype than ``dtype`` (``Init`` was
            given a config with another precision than the engine's).
    """
    for m in module.modules():
        for name, p in m._parameters.items():
            if p is None or not p.is_floating_point() or p.dtype == dtype:
                continue
            if is_sharded(p):
                raise ConfigError(f"parameter '{name}' of {type(m).__name__} was partitioned by zero.Init in "
                                  f"{p.dtype}, but the engine trains in {dtype}: give Init and initialize the same "
                                  "bf16/fp16 settings")
            with torch.no_grad():
                p.data = p.data.to(dtype)
            if p.grad is not None:
                p.grad = p.grad.to(dtype)
        for name, b in m._buffers.items():
            if b is not None and b.is_floating_point() and b.dtype != dtype:
                m._buffers[name] = b.to(dtype)


class LossScaler:
    """fp16 loss scale, static (``loss_scale > 0``) or dynamic. See the module docstring."""

    def __init__(self, loss_scale: float = 0.0, initial_scale_power: int = 16, loss_scale_window: int = 1000,
                 hysteresis: int = 2, min_loss_scale: float = 1.0) -> None:
        self.dynamic = loss_scale == 0.0
        self.scale: float = float(2 ** initial_scale_power) if self.dynamic else float(loss_scale)
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
    def from_config(cfg: ZeroDPConfig) -> Optional["LossScaler"]:
        if not cfg.fp16.enabled:
            return None
        f = cfg.fp16
        return LossScaler(f.loss_scale, f.initial_scale_power, f.loss_scale_window, f.hysteresis, f.min_loss_scale)
