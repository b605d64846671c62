"""``zerodp.deepspeed.checkpointing``: DeepSpeed's activation-checkpointing names over
``torch.utils.checkpoint``.

:func:`checkpoint` recomputes ``function(*args)`` in backward (torch's non-reentrant checkpoint, so
stage-3 gathering hooks run again during recomputation). :func:`configure` accepts DeepSpeed's call
when it asks for nothing beyond that; partitioned/CPU activations, contiguous buffers, profiling and
model-parallel RNG tracking raise ``NotImplementedError`` naming the keyword.
"""

from __future__ import annotations

from typing import Any, Callable

from torch.utils import checkpoint as _torch_checkpoint

_configured = False


def checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)``, its activations recomputed during backward instead of stored."""
    return _torch_checkpoint.checkpoint(function, *args, use_reentrant=False)


def configure(mpu_: Any = None, deepspeed_config: Any = None, partition_activations: Any = None,
              contiguous_checkpointing: Any = None, num_checkpoints: Any = None, checkpoint_in_cpu: Any = None,
              synchronize: Any = None, profile: Any = None) -> None:
    """Accept DeepSpeed's ``checkpointing.configure`` when it enables nothing zerodp lacks.

    Raises:
        NotImplementedError: ``mpu_``, ``partition_activations``, ``contiguous_checkpointing``,
            ``checkpoint_in_cpu``, ``synchronize`` or ``profile`` set (names the first).
    """
    global _configured
    asked = {"mpu_": mpu_ is not None, "partition_activations": bool(partition_activations),
             "contiguous_checkpointing": bool(contiguous_checkpointing),
             "checkpoint_in_cpu": bool(checkpoint_in_cpu), "synchronize": bool(synchronize),
             "profile": bool(profile)}
    bad = [k for k, v in asked.items() if v]
    if bad:
        raise NotImplementedError(f"checkpointing.configure({bad[0]}=...) is not implemented in zerodp; "
                                  "checkpoint() recomputes with torch.utils.checkpoint")
    _configured = True


def is_configured() -> bool:
    return _configured


def reset() -> None:
    """Nothing is cached between iterations."""
