"""What checkpointing needs of an engine, as a Protocol, so ``zerodp.checkpoint`` never imports
``zerodp.engine`` (which calls into it): :class:`~zerodp.engine.Engine` satisfies it structurally."""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from zerodp.runtime.comm import CommLedger
from zerodp.runtime.partition import FlatGroup
from zerodp.runtime.precision import LossScaler, PrecisionPolicy
from zerodp.stage3.sharding import Stage3


class CheckpointableEngine(Protocol):
    """The engine state a checkpoint reads and restores.

    ``groups`` are the flat groups (one flat buffer each; at stage 3 the units' shards); ``optimizer``
    is the torch optimizer whose ``state`` is keyed by each piece's optimizer parameter; ``sharding``
    is the stage-3 runtime (None at stages 0-2).
    """

    stage: int
    rank: int
    world_size: int
    process_group: Any
    ledger: CommLedger
    module: nn.Module
    groups: list[FlatGroup]
    optimizer: torch.optim.Optimizer
    precision: PrecisionPolicy
    loss_scaler: LossScaler | None
    lr_scheduler: Any
    sharding: Stage3 | None
    reducer: Any
    global_steps: int
    micro_steps: int
    skipped_steps: int
    gradient_accumulation_steps: int
