"""Engine configuration: DeepSpeed's JSON key names, validated with pydantic.

Every field keeps DeepSpeed's spelling and, where DeepSpeed's default would silently change results
compared with plain PyTorch (e.g. gradient clipping), the plain-PyTorch default instead. Each default
lives in exactly one place: its field declaration, here or in the section modules this one composes
(:mod:`zerodp.config_batch` the batch keys, :mod:`zerodp.config_optimizer` the optimizer and
scheduler, :mod:`zerodp.offload.config` the offload sections, on the strict base of
:mod:`zerodp.config_base`); every public name of those is importable from here.

Errors: :func:`load_config` raises :class:`ConfigError` (a ``ValueError``) naming every offending key
path, what was given and what is allowed. Unknown keys are refused (``extra="forbid"``) so a typo
never falls back to a default silently, and so are non-finite numbers (``Infinity``, ``NaN``, which
Python's JSON reader accepts) in every field (``allow_inf_nan=False``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from zerodp.config_base import ConfigError, StrictModel, format_errors
from zerodp.config_batch import BatchConfig
from zerodp.config_keys import screen_keys
from zerodp.config_optimizer import (
    SCHEDULER_PARAMS,
    OptimizerConfig,
    OptimizerParams,
    SchedulerConfig,
    WarmupCosineLRParams,
    WarmupDecayLRParams,
    WarmupLRParams,
    WarmupType,
    optimizer_options,
)
from zerodp.offload.config import AioConfig, OffloadOptimizerConfig, OffloadParamConfig

__all__ = [
    "SCHEDULER_PARAMS",
    "ActivationCheckpointingConfig",
    "AioConfig",
    "BatchConfig",
    "BF16Config",
    "CollectiveGuardConfig",
    "ConfigError",
    "DataTypesConfig",
    "FP16Config",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OptimizerConfig",
    "OptimizerParams",
    "SchedulerConfig",
    "WarmupCosineLRParams",
    "WarmupDecayLRParams",
    "WarmupLRParams",
    "WarmupType",
    "ZeroConfig",
    "ZeroDPConfig",
    "load_config",
    "optimizer_options",
    "read_config_mapping",
]


class ZeroConfig(StrictModel):
    """``zero_optimization``: which model states are partitioned and how they are communicated."""

    stage: Literal[0, 1, 2, 3] = Field(
        0, description="0: data parallel; 1: + optimizer states; 2: + gradients; 3: + parameters partitioned"
    )
    reduce_bucket_size: int = Field(
        500_000_000, gt=0, description="elements per gradient reduction bucket (and partition unit)"
    )
    allgather_bucket_size: int = Field(
        500_000_000, gt=0, description="elements of updated parameters all-gathered in flight at once"
    )
    overlap_comm: bool = Field(
        True, description="launch each gradient bucket's collective asynchronously during backward"
    )
    contiguous_gradients: bool = Field(
        True,
        description="stages 2-3: each gradient goes into its bucket as produced (stage 2: autograd adds it "
        "into a view of the bucket; stage 3: copied) and autograd's tensor is freed at once",
    )

    stage3_param_persistence_threshold: int = Field(
        100_000, ge=0, description="stage 3: parameters with at most this many elements stay gathered"
    )
    stage3_max_live_parameters: int = Field(
        1_000_000_000, gt=0, description="stage 3: prefetch never makes more elements gathered at once"
    )
    stage3_prefetch_bucket_size: int = Field(
        50_000_000, ge=0, description="stage 3: elements prefetched ahead of use along the trace (0: off)"
    )
    stage3_max_reuse_distance: int = Field(
        0,
        ge=0,
        description="stage 3: a unit the trace uses again within this many elements stays gathered "
        "(0: off; DeepSpeed's default is 1e9)",
    )
    memory_efficient_linear: bool = Field(
        True,
        description="accepted, either value (DeepSpeed's stage-3 linear that does not keep the gathered "
        "weight for backward): zerodp's released units already hold no memory between a "
        "module's forward and backward; results are the same",
    )
    stage3_gather_16bit_weights_on_model_save: bool = Field(
        False, description="stage 3: engine.save_16bit_model gathers and writes the full weights (else refused)"
    )
    offload_optimizer: OffloadOptimizerConfig = Field(
        default_factory=OffloadOptimizerConfig, description="ZeRO-Offload (zerodp.offload.config)"
    )
    sub_group_size: int = Field(
        1_000_000_000, gt=0, description="offload nvme: elements of optimizer state swapped in at a time"
    )

    offload_param: OffloadParamConfig = Field(
        default_factory=OffloadParamConfig,
        description="ZeRO-Infinity parameter offload, stage 3 (zerodp.offload.config)",
    )

    @model_validator(mode="after")
    def _offload_param_needs_stage3(self) -> ZeroConfig:
        if self.offload_param.enabled and self.stage != 3:
            raise ValueError(
                f"'zero_optimization.offload_param' (device {self.offload_param.device!r}) needs "
                f"zero_optimization.stage 3 (it offloads each rank's shard of the partitioned "
                f"parameters); got stage {self.stage}. Use device 'none' or stage 3"
            )
        oo = self.offload_optimizer
        if oo.delayed_update and self.offload_param.enabled:
            raise ValueError(
                "'zero_optimization.offload_optimizer.delayed_update' with offload_param (device "
                f"{self.offload_param.device!r}) is not implemented; set offload_param.device 'none' "
                "or delayed_update false"
            )
        why = _overlap_step_refusal(self.stage, oo.device, self.offload_param.device) if oo.overlap_step else None
        if why is not None:
            raise ValueError(
                "'zero_optimization.offload_optimizer.overlap_step' needs zero_optimization.stage 3, "
                "offload_optimizer.device 'nvme' and offload_param.device 'none' or 'nvme'; got "
                f"offload_optimizer {oo.device!r}, offload_param {self.offload_param.device!r} at stage "
                f"{self.stage}: {why}. Set overlap_step false"
            )
        return self

    @field_validator(
        "reduce_bucket_size",
        "allgather_bucket_size",
        "stage3_param_persistence_threshold",
        "stage3_max_live_parameters",
        "stage3_prefetch_bucket_size",
        "stage3_max_reuse_distance",
        "sub_group_size",
        mode="before",
    )
    @classmethod
    def _int_from_float(cls, v: Any) -> Any:
        # DeepSpeed configs often write 5e8; accept integral floats, refuse 1.5.
        if isinstance(v, float) and v.is_integer():
            return int(v)
        return v


def _overlap_step_refusal(stage: int, optimizer_device: str, param_device: str) -> str | None:
    """Why ``offload_optimizer.overlap_step`` cannot run with these settings (None: it can). The step
    leaves sub-groups to the next forward only where every later read of a parameter shard passes
    through a hook that updates its sub-groups first (docs/offload.md, ``overlap_step``)."""
    if optimizer_device != "nvme":
        return (
            "only the NVMe offload's step is a sub-group loop that can stop and go on later; the cpu "
            "offload updates the whole partition inside step() (and in CPU training it is the "
            "non-offloaded engine)"
        )
    if stage != 3:
        return (
            "at stages 1-2 step() all-gathers every rank's updated partition into the full parameters "
            "before it returns, and the next forward reads those parameters directly (no per-use hook), "
            "so no update can be left to it"
        )
    if param_device == "cpu":
        return (
            "with offload_param 'cpu' a shard's host home has no use hook yet, so the next forward "
            "could read a shard before its update"
        )
    return None


class BF16Config(StrictModel):
    """``bf16``: bfloat16 parameters and gradients, fp32 master weights and optimizer states."""

    enabled: bool = False


class FP16Config(StrictModel):
    """``fp16``: float16 parameters and gradients with loss scaling; fp32 master weights."""

    enabled: bool = False
    loss_scale: float = Field(0.0, ge=0.0, description="0: dynamic loss scaling; > 0: this static scale")
    initial_scale_power: int = Field(16, ge=0, le=64, description="dynamic: the first scale is 2**this")
    loss_scale_window: int = Field(1000, gt=0, description="dynamic: clean steps before the scale doubles")
    hysteresis: int = Field(2, gt=0, description="dynamic: overflows tolerated before the scale halves")
    min_loss_scale: float = Field(1.0, gt=0.0, description="dynamic: the scale never goes below this")


class DataTypesConfig(StrictModel):
    """``data_types`` (DeepSpeed's key): the dtype gradients accumulate in across micro-steps.

    ``grad_accum_dtype`` None (the default): fp32 when training in bf16/fp16 with
    ``gradient_accumulation_steps`` > 1, else the module's dtype (one micro-step: nothing to
    accumulate). "fp32": always an fp32 accumulation buffer (4 bytes per gradient element). "bf16" /
    "fp16": accumulate in the module's dtype (2 bytes; each micro-step's gradient is rounded into the
    sum, so small micro-steps can be lost); only the training dtype is accepted (see
    :mod:`zerodp.runtime.precision`)."""

    grad_accum_dtype: Literal["fp32", "bf16", "fp16"] | None = Field(
        None, description="gradient accumulation dtype; default fp32 under bf16/fp16 with accumulation"
    )


class CollectiveGuardConfig(StrictModel):
    """``collective_guard`` (zerodp's own key): the agreement checks of
    :mod:`zerodp.runtime.collective_guard` before every collective engine call."""

    enabled: bool = Field(True, description="agree on the call before each collective engine call")
    timeout_s: float = Field(60.0, gt=0.0, le=3600.0, description="seconds a rank waits for the others in an agreement")
    check_gathers: bool = Field(True, description="stage 3: also agree before each module fetch")


class ActivationCheckpointingConfig(StrictModel):
    """DeepSpeed's ``activation_checkpointing`` section, used by :func:`zerodp.checkpointing.checkpoint`
    (ZeRO-R partitioned activation checkpointing; see :mod:`zerodp.checkpointing`)."""

    partition_activations: bool = Field(False, description="split kept inputs across the model-parallel group")
    cpu_checkpointing: bool = Field(False, description="keep the checkpointed inputs in CPU memory")
    contiguous_memory_optimization: bool = Field(
        False, description="not implemented (a CUDA fragmentation remedy); must be false"
    )
    number_checkpoints: int | None = Field(None, gt=0, description="only used with contiguous memory")
    synchronize_checkpoint_boundary: bool = Field(False, description="cuda.synchronize() around segments")
    profile: bool = Field(False, description="time checkpointed forwards and recomputations")

    @field_validator("contiguous_memory_optimization")
    @classmethod
    def _contiguous_not_implemented(cls, v: bool) -> bool:
        if v:
            raise ValueError(
                "contiguous_memory_optimization is not implemented (a CUDA memory-fragmentation remedy); leave it false"
            )
        return v


class ZeroDPConfig(BatchConfig):
    """Top-level config, DeepSpeed key names. See the README for an example file. The batch keys and
    their arithmetic come from :class:`~zerodp.config_batch.BatchConfig`."""

    optimizer: OptimizerConfig = Field(
        default_factory=lambda: OptimizerConfig(type="AdamW", params={"weight_decay": 0.01}),
        description="the torch optimizer; with no optimizer section, AdamW with torch's weight_decay 0.01",
    )
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    aio: AioConfig = Field(default_factory=AioConfig, description="NVMe offload I/O (zerodp.offload.config)")
    gradient_clipping: float = Field(
        0.0, ge=0.0, description="max global L2 gradient norm; 0 disables (PyTorch's default)"
    )
    bf16: BF16Config = Field(default_factory=BF16Config)
    fp16: FP16Config = Field(default_factory=FP16Config)
    data_types: DataTypesConfig = Field(default_factory=DataTypesConfig)
    scheduler: SchedulerConfig | None = None
    seed: int | None = Field(None, ge=0, description="torch.manual_seed applied by initialize()")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description="zerodp's own key: where the engine puts the module, its shards and batches; "
        "auto = cuda:LOCAL_RANK when CUDA is available and the group takes CUDA tensors "
        "(NCCL), else cpu (zerodp.runtime.device.resolve_device)",
    )
    steps_per_print: int | None = Field(
        10,
        gt=0,
        description="zerodp.deepspeed engines: rank 0 prints step, lr and loss scale every N steps; "
        "None (or +inf, as accelerate sets it): never",
    )
    wall_clock_breakdown: bool = Field(
        False,
        description="zerodp.deepspeed engines: rank 0 prints forward/backward/step seconds every steps_per_print steps",
    )
    zero_allow_untested_optimizer: bool = Field(
        False, description="accepted for DeepSpeed configs; every optimizer zerodp builds is element-wise"
    )
    collective_guard: CollectiveGuardConfig = Field(default_factory=CollectiveGuardConfig)
    activation_checkpointing: ActivationCheckpointingConfig | None = None

    @field_validator("steps_per_print", mode="before")
    @classmethod
    def _never_print(cls, v: Any) -> Any:
        # accelerate writes float("inf") (never print); DeepSpeed takes any number. NaN/-inf stay refused.
        if isinstance(v, float) and v == float("inf"):
            return None
        if isinstance(v, float) and v.is_integer():
            return int(v)
        return v

    @model_validator(mode="after")
    def _one_precision(self) -> ZeroDPConfig:
        if self.bf16.enabled and self.fp16.enabled:
            raise ValueError("bf16.enabled and fp16.enabled are both true; enable at most one")
        accum = self.data_types.grad_accum_dtype
        trained = "bf16" if self.bf16.enabled else "fp16" if self.fp16.enabled else "fp32"
        if accum not in (None, "fp32", trained):
            raise ValueError(
                f"data_types.grad_accum_dtype is {accum!r} but the model trains in {trained} "
                f"(bf16.enabled / fp16.enabled); allowed: 'fp32'" + (f" or {trained!r}" if trained != "fp32" else "")
            )
        return self


def read_config_mapping(config: str | os.PathLike | Mapping[str, Any] | None) -> Mapping[str, Any]:
    """The raw config: ``config`` itself, the parsed JSON file it names, or ``{}`` for None (unchecked).

    Raises:
        ConfigError: unreadable file, invalid JSON, or neither a dict nor a path.
    """
    if config is None:
        return {}
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        try:
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path!r}: {exc}") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"config file {path!r} is not valid JSON: {exc}") from None
    if not isinstance(config, Mapping):
        raise ConfigError(f"config must be a dict or a path to a JSON file, got {type(config).__name__}")
    return config


def load_config(config: str | os.PathLike | Mapping[str, Any] | ZeroDPConfig | None) -> ZeroDPConfig:
    """Parse a config dict, JSON file path or :class:`ZeroDPConfig`.

    Raises:
        ConfigError: unreadable file, invalid JSON, unknown key or out-of-range value; the message
            names each key path and what is allowed.
    """
    if isinstance(config, ZeroDPConfig):
        return config
    config = read_config_mapping(config)
    config, refused = screen_keys(config)
    if refused:
        raise ConfigError("invalid zerodp config:\n  " + "\n  ".join(refused))
    try:
        return ZeroDPConfig.model_validate(dict(config))
    except ValidationError as err:
        raise ConfigError(format_errors(err, ZeroDPConfig)) from None
