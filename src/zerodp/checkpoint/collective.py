"""Failure agreement for collective checkpoint operations: every rank runs a step, then all learn
whether any rank failed, so no rank hangs in a later collective while another has given up."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from zerodp.checkpoint.format import CheckpointError
from zerodp.checkpoint.protocol import CheckpointableEngine as Engine
from zerodp.runtime import comm


def collectively(engine: Engine, what: str, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on every rank, then synchronise: if it raised on any rank, raise on every rank
    (the failing rank re-raises its own error, the others a :class:`CheckpointError`). Acts as a
    barrier, so no rank hangs in a later collective when another failed."""
    error: Optional[BaseException] = None
    result = None
    try:
        result = fn()
    except Exception as e:  # re-raised below, after every rank knows
        error = e
    failed = error is not None
    if engine.world_size > 1:
        flag = torch.tensor([int(failed)], dtype=torch.int32, device=_comm_device(engine))
        comm.all_reduce(flag, engine.process_group, engine.ledger, "checkpoint", op=ReduceOp.MAX)
        failed = bool(flag.item())
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(f"{what} failed on another rank (see that rank's error); nothing was changed here")
    return result


def _comm_device(engine: Engine) -> torch.device:
    if dist.get_backend(engine.process_group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
