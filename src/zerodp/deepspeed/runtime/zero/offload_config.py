"""``deepspeed.runtime.zero.offload_config``: the enums of ``engine.offload_states()`` (see
:mod:`zerodp.deepspeed.offload_states`) and of the ``offload_*`` config sections."""

from __future__ import annotations

import enum


class OffloadDeviceEnum(str, enum.Enum):
    """Where offloaded state lives."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, enum.Enum):
    """Which engine state ``offload_states(include=...)`` moves."""

    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


__all__ = ["OffloadDeviceEnum", "OffloadStateTypeEnum"]
