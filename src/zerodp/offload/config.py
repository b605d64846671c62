"""Config schema of ZeRO-Offload: ``zero_optimization.offload_optimizer`` and the top-level ``aio``
section, DeepSpeed's key names (DeepSpeed ``runtime/zero/offload_config.py`` and
``runtime/swap_tensor/aio_config.py``).

The models are strict (pydantic ``strict=True``: no ``"yes"`` for a bool, no string for a number)
and refuse unknown keys, like the rest of :mod:`zerodp.config`, which embeds them. A value DeepSpeed
accepts but zerodp does not implement (``ratio`` below 1) is refused with the key named.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

OffloadDevice = Literal["none", "cpu", "nvme"]

#: allowed values of ``offload_optimizer.cpu_adam`` (the kernels: :mod:`zerodp.offload.cpu_adam`)
CpuAdam = Literal["fused", "same"]


class _StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _finite(cls, v: Any) -> Any:
        """Infinity/NaN are refused in every field, with the same words as :mod:`zerodp.config`."""
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError("Input should be a finite number")
        return v


class _OffloadTarget(_StrictModel):
    """What both offload sections share: the device and, for ``nvme``, the swap directory."""

    device: OffloadDevice = Field("none", description="none | cpu | nvme")
    nvme_path: str | None = Field(None, description="directory for swap files (device nvme)")
    remove_stale_swap: bool = Field(
        False,
        description="zerodp's own key: remove swap directories under "
        "nvme_path left by jobs whose processes are gone "
        "(else they are named in a warning; see "
        "zerodp.offload.swap_dir)",
    )

    @model_validator(mode="after")
    def _nvme_needs_path(self) -> _OffloadTarget:
        if self.device == "nvme" and not self.nvme_path:
            raise ValueError("device 'nvme' needs nvme_path (a directory on the NVMe disk)")
        return self

    @property
    def enabled(self) -> bool:
        return self.device != "none"


class OffloadOptimizerConfig(_OffloadTarget):
    """``zero_optimization.offload_optimizer``: where each rank's fp32 master partition, Adam moments
    and gradient partition live (ZeRO-Offload, Ren et al. 2021; NVMe: ZeRO-Infinity section 5).

    - ``cpu``: host memory; the Adam step runs on the CPU. ``pin_memory`` unset (None) is resolved when
      the engine is built (:func:`zerodp.runtime.device.resolve_pin_memory`): page-locked when the
      engine's device is CUDA, as DeepSpeed's docs recommend, pageable on the CPU.
    - ``nvme``: swap files under ``nvme_path/zerodp_<job>/rank<r>/``, read and written with
      asynchronous direct I/O through ``buffer_count`` aligned buffers, sub-group by sub-group.

    ``cpu_adam`` (zerodp's own key) chooses the Adam/AdamW kernel of the CPU step
    (:mod:`zerodp.offload.cpu_adam`): ``"fused"`` (default) or ``"same"``. ``delayed_update`` (zerodp's
    own key, ``cpu`` only) applies each step's update one step late (:mod:`zerodp.offload.delayed`).
    """

    pin_memory: bool | None = Field(
        None, description="page-lock the host buffers; unset: true when the engine's device is CUDA, false on the CPU"
    )
    buffer_count: int = Field(4, ge=3, description="nvme: aligned sub-group buffers (>= 3: read, update, write)")
    fast_init: bool = Field(False, description="nvme: sparse swap files instead of preallocating them")
    ratio: float = Field(1.0, gt=0.0, le=1.0, description="fraction offloaded; only 1.0 is implemented")
    cpu_adam: CpuAdam = Field(
        "fused",
        description="zerodp's own key: the CPU Adam/AdamW kernel of the "
        "offloaded step, 'fused' (torch's fused CPU kernel) or "
        "'same' (the non-offloaded engine's, bitwise equal); "
        "see zerodp.offload.cpu_adam",
    )
    overlap_step: bool = Field(
        False,
        description="nvme, stage 3 with offload_param nvme or none (zerodp's own key): "
        "step() returns once the persistent parameters are "
        "updated; the other sub-groups are updated during the "
        "next forward, each before its parameters' first use "
        "(same values; see zerodp.offload.step_pipeline)",
    )
    delayed_update: bool = Field(
        False,
        description="cpu (zerodp's own key): step t's CPU update runs during step "
        "t+1's forward and backward and reaches the module at step "
        "t+1, so every forward sees the parameters one update behind "
        "(ZeRO-Offload section 4.3; see zerodp.offload.delayed)",
    )
    host_buffer_bytes: int = Field(
        256 * 2**20,
        ge=0,
        description="nvme (zerodp's own key): host bytes of the "
        "swapper's buffers when sub_group_size is not "
        "set (see zerodp.offload.sizing)",
    )

    @model_validator(mode="after")
    def _delayed_needs_cpu(self) -> OffloadOptimizerConfig:
        if self.delayed_update and self.device != "cpu":
            raise ValueError(
                f"delayed_update needs offload_optimizer.device 'cpu' (the update runs on the host "
                f"while the next forward runs); got device {self.device!r}. Set device 'cpu' or "
                "delayed_update false"
            )
        return self

    @field_validator("host_buffer_bytes", mode="before")
    @classmethod
    def _budget_from_float(cls, v: Any) -> Any:
        """Accept integral floats (``2.5e8``), refuse ``1.5``."""
        if isinstance(v, float) and math.isfinite(v) and v.is_integer():
            return int(v)
        return v

    @field_validator("ratio")
    @classmethod
    def _whole_ratio(cls, v: float) -> float:
        if v != 1.0:
            raise ValueError("partial offload (ratio below 1.0) is not implemented; use 1.0")
        return v


class AioConfig(_StrictModel):
    """``aio``: the asynchronous I/O engine of the NVMe swapper (:mod:`zerodp.offload.aio`).

    ``block_size`` bytes per request; ``queue_depth`` requests in flight per thread;
    ``thread_count`` worker threads issuing ``os.preadv``/``os.pwritev``; ``single_submit`` true
    submits one request at a time (queue depth 1); ``overlap_events`` false turns off the swapper's
    read-ahead / write-behind (each sub-group is read, updated and written in turn).
    """

    block_size: int = Field(1_048_576, gt=0, description="bytes per I/O request (multiple of 4096)")
    queue_depth: int = Field(8, gt=0, description="requests in flight per thread")
    thread_count: int = Field(
        1, gt=0, description="I/O worker threads per pool (optimizer.swp and gradients.swp share one)"
    )
    single_submit: bool = Field(False, description="submit requests one at a time")
    overlap_events: bool = Field(True, description="overlap reads/writes with the sub-group updates")

    @field_validator("block_size")
    @classmethod
    def _aligned(cls, v: int) -> int:
        if v % 4096:
            raise ValueError(f"block_size must be a multiple of 4096 bytes (direct I/O alignment), got {v}")
        return v


class OffloadParamConfig(_OffloadTarget):
    """``zero_optimization.offload_param``: where each rank's shard of every stage-3 parameter unit lives
    between uses (ZeRO-Infinity, Rajbhandari et al. SC21, sections 5.1-5.2 and 6; stage 3 only).

    - ``cpu``: host memory (page-locked with ``pin_memory``, unset: when the engine's device is CUDA).
    - ``nvme``: one swap file per rank under ``nvme_path/zerodp_<job>/rank<r>/params.swp``; a shard is
      read (asynchronous direct I/O, through ``buffer_count`` buffers of ``buffer_size`` bytes) when its
      module is about to run, then the ranks all-gather; read-ahead along the stage-3 trace keeps at
      most ``max_in_cpu`` bytes of shards read ahead of use, ``prefetch_depth`` modules ahead of those
      already being all-gathered.
    """

    pin_memory: bool | None = Field(
        None,
        description="page-lock the host shards and buffers; unset: true when the "
        "engine's device is CUDA, false on the CPU",
    )
    buffer_count: int = Field(5, ge=1, description="nvme: aligned I/O buffers in the pool")
    buffer_size: int = Field(100_000_000, ge=4096, description="nvme: bytes per I/O buffer (rounded down to 4096)")
    max_in_cpu: int = Field(1_000_000_000, ge=0, description="nvme: bytes of shards read ahead of use, at most")
    prefetch_depth: int = Field(
        3,
        ge=0,
        description="nvme (zerodp's own key): modules ahead (beyond those "
        "being all-gathered) whose shards are read while "
        "earlier ones run (0: off)",
    )

    @field_validator("buffer_size", "max_in_cpu", mode="before")
    @classmethod
    def _int_from_float(cls, v: Any) -> Any:
        """DeepSpeed configs write ``1e8``: accept integral floats, refuse ``1.5``."""
        if isinstance(v, float) and math.isfinite(v) and v.is_integer():
            return int(v)
        return v
