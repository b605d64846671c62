"""Choose the optimizer offload an engine uses from its config (``zero_optimization.offload_optimizer``).

The engine talks to the result through :class:`OptimizerOffload`, a Protocol, so the engine module
does not depend on the host or NVMe implementations.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Iterator, Optional, Protocol

import torch
import torch.distributed as dist

from zerodp.config import ConfigError
from zerodp.offload.config import AioConfig, OffloadOptimizerConfig
from zerodp.offload.host import HostOptimizerOffload
from zerodp.offload.nvme import NvmeOptimizerOffload
from zerodp.runtime.partition import FlatGroup, Piece


class OptimizerOffload(Protocol):
    """What the engine calls; see :class:`zerodp.offload.host.HostOptimizerOffload` for the order."""

    device: str
    shard_access: Optional[object]

    def attach(self, groups: list[FlatGroup]) -> None: ...
    def refresh_master(self, piece: Piece) -> None: ...
    def fold_edits(self) -> None: ...
    def skipped_step(self) -> None: ...
    def check_health(self) -> None: ...
    def begin_grads(self) -> None: ...
    def stream_grad(self, piece: Piece, grad: torch.Tensor) -> None: ...
    def stage_grad(self, piece: Piece, grad: torch.Tensor) -> None: ...
    def scale_grads(self, factor: float) -> None: ...
    def norm_grads(self, pieces: list[Piece]) -> Iterable[torch.Tensor]: ...
    def set_shard_access(self, access: object) -> None: ...
    def step(self, optimizer: torch.optim.Optimizer) -> None: ...
    def finish_step(self) -> None: ...
    def settle(self) -> None: ...
    def when_updated(self, fn: Callable[[], None]) -> None: ...
    def resident(self, optimizer: torch.optim.Optimizer) -> contextlib.AbstractContextManager: ...
    def host_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]: ...
    def nvme_bytes(self) -> dict[str, int]: ...
    def formula(self, numel_per_rank: float, host: dict[str, int]) -> dict[str, dict[str, float]]: ...
    def close(self) -> None: ...


def build_offload(cfg: OffloadOptimizerConfig, aio: AioConfig, sub_group_size: int, stage: int, rank: int,
                  process_group: Optional[dist.ProcessGroup]) -> Optional[OptimizerOffload]:
    """None for ``device: none``; else the host or NVMe offload (not yet attached).

    Raises:
        ConfigError: offload asked for at stage 0 (DeepSpeed offloads partitioned states: stages 1-3).
    """
    if not cfg.enabled:
        return None
    if stage == 0:
        raise ConfigError("zero_optimization.offload_optimizer needs zero_optimization.stage 1, 2 or 3 "
                         "(it offloads this rank's partition of the optimizer states); got stage 0")
    if cfg.device == "cpu":
        return HostOptimizerOffload(cfg.pin_memory, cfg.cpu_adam)
    return NvmeOptimizerOffload(cfg, aio, sub_group_size, rank, process_group)


@contextlib.contextmanager
def no_offload() -> Iterator[None]:
    yield


__all__ = ["OptimizerOffload", "build_offload", "no_offload"]
