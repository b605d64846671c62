"""``deepspeed.moe.utils``: what scripts without MoE layers call (DeepSpeedExamples' cifar imports
:func:`split_params_into_different_moe_groups_for_optimizer` at the top)."""

from __future__ import annotations

from typing import Any

import torch


def is_moe_param(param: torch.Tensor) -> bool:
    """DeepSpeed marks expert parameters with ``allreduce = False``; zerodp builds none."""
    return hasattr(param, "allreduce") and not param.allreduce


def has_moe_layers(model: torch.nn.Module) -> tuple[bool, int]:
    """``(False, 0)``: zerodp has no MoE layers (a module marked as one is refused)."""
    _refuse_moe(model.parameters())
    return False, 0


def split_params_into_different_moe_groups_for_optimizer(param_groups: Any, max_group_size: Any = 178956971) -> Any:
    """The param groups unchanged when no parameter is an expert's (always, in zerodp).

    Args:
        param_groups: a param-group dict, or a list/tuple of them (as DeepSpeed takes).

    Raises:
        NotImplementedError: a parameter carries DeepSpeed's expert marking (``allreduce=False``):
            MoE is not implemented in zerodp.
    """
    groups = [param_groups] if isinstance(param_groups, dict) else list(param_groups)
    _refuse_moe(p for g in groups for p in (g["params"] if isinstance(g, dict) else [g]))
    return param_groups if isinstance(param_groups, (dict, tuple)) else groups


def _refuse_moe(params: Any) -> None:
    for p in params:
        if isinstance(p, torch.Tensor) and is_moe_param(p):
            raise NotImplementedError(
                "a parameter is marked as a mixture-of-experts expert parameter "
                "(allreduce=False): MoE is not implemented in zerodp"
            )


__all__ = ["is_moe_param", "has_moe_layers", "split_params_into_different_moe_groups_for_optimizer"]
