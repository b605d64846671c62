"""``deepspeed.ops.adam``: :class:`FusedAdam` and :class:`DeepSpeedCPUAdam` with DeepSpeed's arguments,
computed by ``torch.optim.Adam`` (``decoupled_weight_decay`` = DeepSpeed's AdamW mode, the default) with
torch's fused kernel where the device has one (CUDA and CPU in torch >= 2.4), else its foreach kernel.

They are ``torch.optim.Adam`` subclasses, so they work stand-alone and as the client ``optimizer`` of
:func:`zerodp.deepspeed.initialize`, which rebuilds a ``torch.optim.Adam`` with the same hyperparameters
over this rank's partition. Differences: ``bias_correction=False`` and
``DeepSpeedCPUAdam(fp32_optimizer_states=False)`` are refused (``NotImplementedError``); ``set_grad_none``
is accepted (torch's ``zero_grad`` sets gradients to None by default).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def _kernel(params: list[Any]) -> dict[str, bool]:
    """``fused=True`` where torch has a fused Adam for every parameter's device, else ``foreach``."""
    tensors = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
    devices = {t.device.type for t in tensors if isinstance(t, torch.Tensor)}
    dtypes_ok = all(t.is_floating_point() for t in tensors if isinstance(t, torch.Tensor))
    if devices and devices <= {"cuda", "cpu"} and dtypes_ok:
        return {"fused": True}
    return {"foreach": True}


class FusedAdam(torch.optim.Adam):
    """``deepspeed.ops.adam.FusedAdam``: Adam, AdamW (``adam_w_mode=True``, DeepSpeed's default) or L2 Adam.

    Raises:
        NotImplementedError: ``bias_correction=False``.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
    ) -> None:
        if not bias_correction:
            raise NotImplementedError(
                f"{type(self).__name__}(bias_correction=False) is not implemented in zerodp "
                "(torch's Adam always corrects the bias)"
            )
        params = list(params)
        super().__init__(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            decoupled_weight_decay=bool(adam_w_mode),
            **_kernel(params),
        )


class DeepSpeedCPUAdam(FusedAdam):
    """``deepspeed.ops.adam.DeepSpeedCPUAdam``: the same update (``adamw_mode=True`` by default).

    Raises:
        NotImplementedError: ``bias_correction=False`` or ``fp32_optimizer_states=False``.
    """

    def __init__(
        self,
        model_params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
    ) -> None:
        if not fp32_optimizer_states:
            raise NotImplementedError(
                "DeepSpeedCPUAdam(fp32_optimizer_states=False) is not implemented in zerodp (optimizer states are fp32)"
            )
        super().__init__(
            model_params,
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            adam_w_mode=adamw_mode,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
        )


__all__ = ["FusedAdam", "DeepSpeedCPUAdam"]
