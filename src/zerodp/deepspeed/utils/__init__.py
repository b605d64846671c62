"""``deepspeed.utils``: :data:`logger` (a ``logging.Logger`` named ``"DeepSpeed"``, as DeepSpeed's),
:func:`log_dist`, and the ``safe_*`` accessors of :mod:`zerodp.zero`."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch.distributed as dist

from zerodp.zero import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_optimizer_state,
)

logger = logging.getLogger("DeepSpeed")
if not logger.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(
        logging.Formatter("[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:%(funcName)s] %(message)s")
    )
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def log_dist(message: str, ranks: Iterable[int] | None = None, level: int = logging.INFO) -> None:
    """Log ``message`` on the listed ranks (default: rank 0; ``[-1]``: every rank)."""
    ranks = list(ranks) if ranks is not None else [0]
    rank = dist.get_rank() if dist.is_initialized() else 0
    if -1 in ranks or rank in ranks:
        logger.log(level, f"[Rank {rank}] {message}")


__all__ = [
    "logger",
    "log_dist",
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_optimizer_state",
]
