"""``deepspeed.runtime.zero.partition_parameters``: :class:`ZeroParamStatus` (what ``param.ds_status``
reads on a partitioned parameter), ``Init`` and ``GatheredParameters`` (those of
:mod:`zerodp.deepspeed.zero`), and the two names transformers swaps around ``zero.Init``
(``prevent_arange_dtype_change``): :func:`zero_wrapper_for_fp_tensor_constructor` and
``_orig_torch_arange``."""

from collections.abc import Callable
from typing import Any

import torch

from zerodp.deepspeed.zero import GatheredParameters, Init, ZeroParamStatus, register_external_parameter

#: torch.arange as imported (DeepSpeed keeps the original constructors under ``_orig_torch_*``).
_orig_torch_arange = torch.arange


def zero_wrapper_for_fp_tensor_constructor(
    fn: Callable, target_fp_dtype: torch.dtype | None = None, target_device: Any = None
) -> Callable:
    """DeepSpeed's ``zero.Init`` wraps torch's tensor constructors with this (allocate on the device,
    cast floating dtypes to the config's). zerodp's ``Init`` patches no constructor (it partitions from
    torch's registration hooks, :class:`zerodp.zero.Init`), so nothing here calls it; it exists for
    clients that swap it (transformers' ``prevent_arange_dtype_change``). Returns ``fn`` unchanged."""
    return fn


__all__ = [
    "GatheredParameters",
    "Init",
    "ZeroParamStatus",
    "register_external_parameter",
    "zero_wrapper_for_fp_tensor_constructor",
]
