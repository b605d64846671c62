"""``deepspeed.checkpoint.utils``: :func:`clone_tensors_for_torch_save`."""

from __future__ import annotations

from typing import Any

import torch

_CPU = torch.device("cpu")  # the default of DeepSpeed's signature, made once (a default argument is evaluated once)


def clone_tensors_for_torch_save(item: Any, device: torch.device = _CPU) -> Any:
    """A copy of ``item`` (tensors, and lists/tuples/dicts of them, nested) whose tensors are clones on
    ``device``, so ``torch.save`` writes only their own elements (not a larger storage they view).
    Other values are returned as they are."""
    if torch.is_tensor(item):
        return item.detach().clone().to(device)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item


__all__ = ["clone_tensors_for_torch_save"]
