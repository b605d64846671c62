"""``zerodp.checkpointing``: activation checkpointing (recomputation in backward, ZeRO-R's partitioned
and CPU-kept checkpoints) under the name DeepSpeed gives it, ``deepspeed.checkpointing``. The
implementation is :mod:`zerodp.runtime.activation_checkpointing`; this module re-exports its public
names. (Saving and loading training state is :mod:`zerodp.checkpoint`.)"""

from __future__ import annotations

from zerodp.runtime.activation_checkpointing import (
    CheckpointingOptions,
    checkpoint,
    configure,
    is_configured,
    reset,
    timings,
)

__all__ = ["configure", "checkpoint", "is_configured", "reset", "timings", "CheckpointingOptions"]
