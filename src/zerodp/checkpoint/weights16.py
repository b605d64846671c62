"""The full module weights in the module's own dtype (DeepSpeed's "16-bit" save): the state dict of
:func:`zerodp.checkpoint.layout.module_state_dict` with each parameter cast to its module dtype (bf16 or
fp16 under mixed precision; fp32 otherwise), and ``save_16bit_model`` writing it with ``torch.save``
on rank 0. Both engines (:class:`zerodp.Engine`, the ``zerodp.deepspeed`` drop-in) use these."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from zerodp.checkpoint.protocol import CheckpointableEngine as Engine


def module_dtype_state_dict(
    engine: Engine, full: dict[str, torch.Tensor], exclude_frozen_parameters: bool = False
) -> dict[str, torch.Tensor]:
    """``full`` (fp32 trained parameters, keyed like ``module.state_dict()``) with each parameter cast
    to its dtype in ``engine.module`` and buffers as they are; ``exclude_frozen_parameters``: without
    the parameters whose ``requires_grad`` is False now (every tied name), as DeepSpeed."""
    named = list(engine.module.named_parameters(remove_duplicate=False))
    dtypes = {n: p.dtype for n, p in named}
    frozen = {n for n, p in named if not p.requires_grad} if exclude_frozen_parameters else set()
    return {k: v.to(dtypes[k]) if k in dtypes else v for k, v in full.items() if k not in frozen}


def save_16bit_model(
    engine: Any, save_dir: Any, save_filename: str = "pytorch_model.bin", exclude_frozen_parameters: bool = False
) -> bool:
    """Collective: write the full weights in the module's dtype (:func:`module_dtype_state_dict`) to
    ``save_dir/save_filename`` with ``torch.save`` on rank 0; every rank returns True once the file
    exists (DeepSpeed's ``save_16bit_model``). At stage 3 the weights are gathered unit by unit
    (``engine.module_state_dict()``), never the whole model on one rank more than once.

    Raises:
        ValueError: stage 3 without ``zero_optimization.stage3_gather_16bit_weights_on_model_save``
            (DeepSpeed then writes nothing and returns False; zerodp refuses loudly), before any
            collective, on every rank.
    """
    zc = engine.config.zero_optimization
    if engine.stage == 3 and not zc.stage3_gather_16bit_weights_on_model_save:
        raise ValueError(
            "save_16bit_model at stage 3 needs zero_optimization."
            "stage3_gather_16bit_weights_on_model_save: true in the config (or save the fp32 "
            "values of engine.module_state_dict(), or a checkpoint with engine.save_checkpoint)"
        )
    sd = module_dtype_state_dict(engine, engine.module_state_dict(), exclude_frozen_parameters)
    if engine.rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        torch.save(sd, os.path.join(save_dir, save_filename))
    if dist.get_world_size(engine.process_group) > 1:
        dist.barrier(engine.process_group)  # the file exists on return, on every rank
    return True


__all__ = ["module_dtype_state_dict", "save_16bit_model"]
