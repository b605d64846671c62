"""Every data-parallel rank trains with the same config and optimizer options, checked once at
``initialize``: ranks whose configs differ would otherwise train silently wrong (each rank updates its
own partition with its own learning rate) or abort inside gloo without a Python message (different
ZeRO stages issue collectives of different sizes).

One ``all_gather_object`` of a flat ``{dotted key: value}`` view of the parsed config (after
``for_world_size``) and of each param group's options and parameter names; keys that may differ per
rank by design (:data:`PER_RANK_KEYS`) are left out.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from zerodp.config import ConfigError, ZeroDPConfig
from zerodp.runtime import control
from zerodp.runtime.optim import ParamGroupSpec

#: keys whose value may differ between ranks: a swap directory per rank or node, a seed per rank
PER_RANK_KEYS = ("zero_optimization.offload_optimizer.nvme_path", "zero_optimization.offload_param.nvme_path", "seed")


def flat_settings(cfg: ZeroDPConfig, specs: Sequence[ParamGroupSpec]) -> dict[str, str]:
    """``{dotted key: JSON value}`` of ``cfg`` and of each param group of ``specs``
    (``param_groups[i].<option>``, ``param_groups[i].params``: names), without :data:`PER_RANK_KEYS`."""
    out: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif prefix not in PER_RANK_KEYS:
            out[prefix] = json.dumps(value, sort_keys=True, default=repr)

    walk("", cfg.model_dump(mode="json"))
    for i, spec in enumerate(specs):
        walk(f"param_groups[{i}]", dict(spec.options))
        out[f"param_groups[{i}].params"] = json.dumps([name for name, _ in spec.params])
    out["param_groups"] = str(len(specs))
    return out


def differences(per_rank: Sequence[dict[str, str]], limit: int = 8) -> list[str]:
    """One line per key whose value is not the same on every rank: ``key: rank 0 <v>, rank 1 <w>``."""
    keys = sorted(set().union(*per_rank))
    lines = []
    for key in keys:
        values = [d.get(key, "<absent>") for d in per_rank]
        if len(set(values)) > 1:
            lines.append(f"{key}: " + ", ".join(f"rank {r} {v}" for r, v in enumerate(values)))
    return lines[:limit] + ([f"... and {len(lines) - limit} more"] if len(lines) > limit else [])


def agree_on_settings(settings: dict[str, str], group: dist.ProcessGroup | None) -> None:
    """Collective over ``group``: raise :class:`ConfigError` on every rank when ranks differ.

    Raises:
        ConfigError: names each differing key with every rank's value.
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, settings, group=control.control_group(group))
    lines = differences(gathered)
    if lines:
        raise ConfigError(
            "the data-parallel ranks were given different settings (every rank must pass the "
            "same config and param groups to initialize):\n  " + "\n  ".join(lines)
        )


__all__ = ["PER_RANK_KEYS", "agree_on_settings", "differences", "flat_settings"]
