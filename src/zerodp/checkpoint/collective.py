"""Failure agreement for collective checkpoint operations: every rank runs a step, then all learn
whether any rank failed, so no rank hangs in a later collective while another has given up."""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable, Mapping
from typing import Any

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
    error: BaseException | None = None
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


def check_same_on_ranks(engine: Engine, what: str, values: Mapping[str, Any]) -> None:
    """Raise :class:`CheckpointError` on every rank if the ranks passed different ``values`` (e.g.
    ``save_dir`` and ``tag``, compared as strings; give paths as ``Path`` to have them normalised), naming
    each argument that differs and every rank's value. One all-gather of one int64 per value; the values
    themselves are exchanged (``all_gather_object``) only when they differ."""
    if engine.world_size == 1:
        return
    texts = {k: _text(v) for k, v in values.items()}
    mine = torch.tensor(
        [zlib.crc32(t.encode()) for t in texts.values()], dtype=torch.int64, device=_comm_device(engine)
    )
    table = torch.empty(engine.world_size * len(texts), dtype=torch.int64, device=mine.device)
    comm.all_gather_single(table, mine, group=engine.process_group)
    rows = table.view(engine.world_size, len(texts))
    if bool((rows == rows[0]).all()):
        return
    every: list[Any] = [None] * engine.world_size
    dist.all_gather_object(every, texts, group=engine.process_group)
    lines = []
    for k in texts:
        seen = [r[k] for r in every]
        if len(set(seen)) > 1:
            lines.append(f"{k}: " + ", ".join(f"rank {i} {v!r}" for i, v in enumerate(seen)))
    raise CheckpointError(
        f"{what}: the ranks passed different arguments; every rank must pass the same "
        f"ones (e.g. a directory named from each rank's own clock differs per rank: "
        f"name it on rank 0 and broadcast it). " + "; ".join(lines)
    )


def _text(v: Any) -> str:
    if isinstance(v, os.PathLike):
        return os.path.normpath(os.fspath(v))
    return "None" if v is None else str(v)


def _comm_device(engine: Engine) -> torch.device:
    if dist.get_backend(engine.process_group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
