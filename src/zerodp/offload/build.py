"""Choose the optimizer offload an engine uses from its config (``zero_optimization.offload_optimizer``).

The engine talks to the result through :class:`OptimizerOffload`, a Protocol, so the engine module
does not depend on the host or NVMe implementations.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterable
from typing import Protocol

import torch
import torch.distributed as dist

from zerodp.config import ConfigError, ZeroConfig
from zerodp.offload.config import AioConfig
from zerodp.offload.delayed import DelayedHostOffload
from zerodp.offload.host import HostOptimizerOffload
from zerodp.offload.no_offload import NoOffload
from zerodp.offload.nvme import NvmeOptimizerOffload
from zerodp.offload.shard_window import ShardAccess
from zerodp.runtime import device as devices
from zerodp.runtime.grad_spill import GradSpill, SpillingGradReducer
from zerodp.runtime.partition import FlatGroup, Piece
from zerodp.runtime.topology import GradOrNorms


class OptimizerOffload(Protocol):
    """What the engine calls; see :class:`zerodp.offload.host.HostOptimizerOffload` for the order."""

    device: str
    streams_grads: bool

    @property  # read-only: an implementation's is narrower (ShardAccess | None)
    def shard_access(self) -> object | None: ...

    def attach(self, groups: list[FlatGroup]) -> None: ...
    def holds_master(self, piece: Piece) -> bool: ...
    def refresh_master(self, piece: Piece) -> None: ...
    def fold_edits(self) -> None: ...
    def skipped_step(self) -> None: ...
    def check_health(self) -> None: ...
    def begin_grads(self) -> None: ...
    def stream_grad(self, piece: Piece, grad: torch.Tensor) -> None: ...
    def stage_grad(self, piece: Piece, grad: torch.Tensor | None) -> None: ...
    def gradient_spill(self, reducer: SpillingGradReducer) -> GradSpill | None: ...
    def scale_grads(self, factor: float) -> None: ...
    def norm_grads(self, pieces: list[Piece]) -> Iterable[GradOrNorms]: ...
    def set_shard_access(self, access: ShardAccess) -> None: ...
    def step(self, optimizer: torch.optim.Optimizer) -> None: ...
    def finish_step(self) -> None: ...
    def settle(self) -> None: ...
    def when_updated(self, fn: Callable[[], None]) -> None: ...
    def resident(self, optimizer: torch.optim.Optimizer) -> contextlib.AbstractContextManager: ...
    def adjust_formula(self, formula: dict[str, float], numel_per_rank: float) -> None: ...
    def host_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]: ...
    def nvme_bytes(self) -> dict[str, int]: ...
    def formula(self, numel_per_rank: float, host: dict[str, int]) -> dict[str, dict[str, float]]: ...
    def close(self) -> None: ...


#: set to "1" (the test suite does, tests/conftest.py) to run the host-memory offload's pipeline even
#: when training runs on the CPU, where it moves nothing: its logic is the GPU path's
HOST_PIPELINE_ON_CPU_ENV = "ZERODP_HOST_OFFLOAD_ON_CPU"


def build_offload(
    zc: ZeroConfig,
    aio: AioConfig,
    stage: int,
    rank: int,
    process_group: dist.ProcessGroup | None,
    groups: list[FlatGroup],
    has_master: bool,
) -> OptimizerOffload:
    """:class:`~zerodp.offload.no_offload.NoOffload` for ``device: none`` (fp32 masters on the
    training device when ``has_master``); else the host or NVMe offload (not yet attached).

    ``delayed_update`` gives :class:`zerodp.offload.delayed.DelayedHostOffload` on any device (its
    update runs beside the next forward even when training runs on the CPU). Else ``device: cpu`` when
    every parameter of ``groups`` is on the CPU also gives NoOffload: the optimizer
    states are in host memory already, so offloading them to the host would move nothing and only
    add a second fp32 copy of the partition and of its gradient; the engine runs as without offload,
    and rank 0 warns once (unless :data:`HOST_PIPELINE_ON_CPU_ENV` is "1").
    ``zero_optimization.sub_group_size``: honoured when the user set it, else chosen by the NVMe
    offload from ``offload_optimizer.host_buffer_bytes`` (:mod:`zerodp.offload.sizing`).
    ``offload_optimizer.pin_memory`` unset is resolved here from the engine's device (the groups'):
    page-locked host buffers on CUDA, pageable on the CPU.

    Raises:
        ConfigError: offload asked for at stage 0 (DeepSpeed offloads partitioned states: stages 1-3).
    """
    cfg = zc.offload_optimizer
    if not cfg.enabled:
        return NoOffload(has_master)
    if stage == 0:
        raise ConfigError(
            "zero_optimization.offload_optimizer needs zero_optimization.stage 1, 2 or 3 "
            "(it offloads this rank's partition of the optimizer states); got stage 0"
        )
    device = devices.device_of(g.buffer for g in groups)  # the engine's device
    cfg = cfg.model_copy(update={"pin_memory": devices.resolve_pin_memory(cfg.pin_memory, device)})
    if cfg.device == "cpu" and cfg.delayed_update:  # host memory, the update one step late
        return DelayedHostOffload(bool(cfg.pin_memory), cfg.cpu_adam, device)
    if cfg.device == "cpu":
        on_cpu = not devices.is_accelerator(device)
        if on_cpu and os.environ.get(HOST_PIPELINE_ON_CPU_ENV) != "1":
            if rank == 0:
                warnings.warn(
                    "zero_optimization.offload_optimizer.device 'cpu': training runs on the CPU, so the "
                    "optimizer states are in host memory already; nothing is offloaded and no memory "
                    "is added (the engine runs as without offload). Use device 'nvme' to take them "
                    "out of RAM",
                    stacklevel=3,
                )
            return NoOffload(has_master)
        return HostOptimizerOffload(bool(cfg.pin_memory), cfg.cpu_adam, device)
    user_size = zc.sub_group_size if "sub_group_size" in zc.model_fields_set else None
    return NvmeOptimizerOffload(cfg, aio, user_size, rank, process_group, device)


__all__ = ["HOST_PIPELINE_ON_CPU_ENV", "NoOffload", "OptimizerOffload", "build_offload"]
