"""Engine configuration: DeepSpeed's JSON key names, validated with pydantic.

Every field keeps DeepSpeed's spelling and, where DeepSpeed's default would silently change results
compared with plain PyTorch (e.g. gradient clipping), the plain-PyTorch default instead. Each default
lives in exactly one place: the field declaration below.

Errors: :func:`load_config` raises :class:`ConfigError` (a ``ValueError``) naming every offending key
path, what was given and what is allowed. Unknown keys are refused (``extra="forbid"``) so a typo
never falls back to a default silently, and so are non-finite numbers (``Infinity``, ``NaN``, which
Python's JSON reader accepts) in every field (``allow_inf_nan=False``).
"""

from __future__ import annotations

import builtins
import inspect
import json
import os
import types
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from zerodp.config_keys import OPTIMIZERS, REFUSED_OPTIMIZERS, canonical_optimizer, screen_keys
from zerodp.offload.config import AioConfig, OffloadOptimizerConfig, OffloadParamConfig

if TYPE_CHECKING:
    import torch


class ConfigError(ValueError):
    """A zerodp config (dict or JSON file) has an unknown key or a value outside what is allowed."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_lax_coercion(cls, v: Any, info: ValidationInfo) -> Any:
        """Refuse what pydantic's lax mode would silently convert: "yes"/"off" for a bool, a string
        for a number, true/false for a number or a stage."""
        assert info.field_name is not None  # a field validator ("*"): always called for one field
        kinds = _scalar_kinds(cls.model_fields[info.field_name].annotation)
        if not kinds:
            return v
        if isinstance(v, bool) and bool not in kinds:
            raise ValueError(f"expected {' or '.join(sorted(k.__name__ for k in kinds))}, not a boolean")
        if isinstance(v, str) and str not in kinds:
            raise ValueError(f"expected {' or '.join(sorted(k.__name__ for k in kinds))}, not a string")
        if bool in kinds and not isinstance(v, bool) and v is not None:
            raise ValueError("expected true or false")
        return v


def _scalar_kinds(annotation: Any) -> set[type]:
    """The scalar types (bool, int, float, str) an annotation admits; empty for containers/models."""
    origin = get_origin(annotation)
    if origin is Literal:
        return {type(a) for a in get_args(annotation)}
    if origin is Union or origin is types.UnionType:  # Optional[X] and X | None
        kinds: set[type] = set()
        for a in get_args(annotation):
            if a is type(None):
                continue
            sub = _scalar_kinds(a)
            if not sub:
                return set()
            kinds |= sub
        return kinds
    if annotation in (bool, int, float, str):
        return {annotation, float} if annotation is int else {annotation}
    return set()


class OptimizerParams(_Strict):
    """``optimizer.params``: keyword arguments of the torch optimizer; omitted keys take torch's defaults.

    ``lr``, ``betas``, ``eps`` and ``weight_decay`` are checked here; any other key (``momentum``,
    ``amsgrad``, ...) must be a keyword of the chosen torch optimizer (checked by
    :class:`OptimizerConfig`) and is passed through unchanged.
    """

    model_config = ConfigDict(extra="allow", validate_assignment=True, frozen=True)

    lr: float | None = Field(None, ge=0.0, description="learning rate; None = torch's default")
    betas: tuple[float, float] | None = Field(None, description="(beta1, beta2), each in [0, 1)")
    eps: float | None = Field(None, gt=0.0, description="denominator epsilon")
    weight_decay: float | None = Field(
        None, ge=0.0, description="L2 (Adam) or decoupled (AdamW) decay; None = torch's default"
    )

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, v: tuple[float, float] | None) -> tuple[float, float] | None:
        for b in v or ():
            if not 0.0 <= b < 1.0:
                raise ValueError(f"each beta must be in [0, 1), got {v}")
        return v

    def torch_kwargs(self) -> dict[str, Any]:
        """The keyword arguments given (None = omitted), extras included."""
        out = {k: v for k, v in self.model_dump().items() if v is not None}
        return {k: tuple(v) if isinstance(v, list) else v for k, v in out.items()}


class OptimizerConfig(_Strict):
    """``optimizer``: ``type`` names a torch optimizer (DeepSpeed's names, case-insensitive; see
    :data:`zerodp.config_keys.OPTIMIZERS`), ``params`` its keyword arguments.

    Unlike DeepSpeed, ``Adam`` means torch's L2-regularised Adam, not AdamW: the result equals what
    ``torch.optim.Adam`` computes on the whole model. (``zerodp.deepspeed.initialize`` maps
    DeepSpeed's ``adam_w_mode`` to ``AdamW``.)
    """

    type: str
    params: OptimizerParams = Field(default_factory=OptimizerParams)

    @field_validator("type")
    @classmethod
    def _canonical_type(cls, v: str) -> str:
        name = canonical_optimizer(v)
        if name is None:
            raise ValueError(f"unknown optimizer; allowed: {', '.join(OPTIMIZERS)}")
        if name in REFUSED_OPTIMIZERS:
            raise ValueError(f"optimizer '{name}' is not implemented: {REFUSED_OPTIMIZERS[name]}; "
                             f"allowed: {', '.join(OPTIMIZERS)}")
        return name

    @model_validator(mode="after")
    def _params_fit_type(self) -> OptimizerConfig:
        allowed = optimizer_options(self.type)
        unknown = sorted(set(self.params.torch_kwargs()) - set(allowed))
        if unknown:
            raise ValueError(f"optimizer.params.{unknown[0]} is not an option of torch.optim.{self.type}; "
                             f"allowed keys here: {', '.join(allowed)}")
        return self

    def torch_class(self) -> builtins.type[torch.optim.Optimizer]:  # builtins: ``type`` is a field here
        return OPTIMIZERS[self.type]


def optimizer_options(name: str) -> list[str]:
    """Keyword options of ``torch.optim.<name>`` (besides ``params``), in signature order."""
    sig = inspect.signature(OPTIMIZERS[name].__init__)
    return [p for p in sig.parameters if p not in ("self", "params")]


class ZeroConfig(_Strict):
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
        True, description="stages 2-3: copy each gradient into its bucket as produced and free it at once"
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
        0, ge=0, description="stage 3: a unit the trace uses again within this many elements stays gathered "
                             "(0: off; DeepSpeed's default is 1e9)"
    )
    memory_efficient_linear: bool = Field(
        True, description="accepted, either value (DeepSpeed's stage-3 linear that does not keep the gathered "
                          "weight for backward): zerodp's released units already hold no memory between a "
                          "module's forward and backward; results are the same")
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
            raise ValueError(f"'zero_optimization.offload_param' (device {self.offload_param.device!r}) needs "
                             f"zero_optimization.stage 3 (it offloads each rank's shard of the partitioned "
                             f"parameters); got stage {self.stage}. Use device 'none' or stage 3")
        oo = self.offload_optimizer
        if oo.delayed_update and self.offload_param.enabled:
            raise ValueError("'zero_optimization.offload_optimizer.delayed_update' with offload_param (device "
                             f"{self.offload_param.device!r}) is not implemented; set offload_param.device 'none' "
                             "or delayed_update false")
        if oo.overlap_step and not (oo.device == "nvme" and self.offload_param.device == "nvme"):
            raise ValueError("'zero_optimization.offload_optimizer.overlap_step' needs offload_optimizer.device "
                             "'nvme' and offload_param.device 'nvme' at stage 3 (the next forward waits for a "
                             "parameter's update when it reads its shard from NVMe); got offload_optimizer "
                             f"{oo.device!r}, offload_param {self.offload_param.device!r}. Set overlap_step false")
        return self

    @field_validator("reduce_bucket_size", "allgather_bucket_size", "stage3_param_persistence_threshold",
                     "stage3_max_live_parameters", "stage3_prefetch_bucket_size", "stage3_max_reuse_distance",
                     "sub_group_size", mode="before")
    @classmethod
    def _int_from_float(cls, v: Any) -> Any:
        # DeepSpeed configs often write 5e8; accept integral floats, refuse 1.5.
        if isinstance(v, float) and v.is_integer():
            return int(v)
        return v


class BF16Config(_Strict):
    """``bf16``: bfloat16 parameters and gradients, fp32 master weights and optimizer states."""

    enabled: bool = False


class FP16Config(_Strict):
    """``fp16``: float16 parameters and gradients with loss scaling; fp32 master weights."""

    enabled: bool = False
    loss_scale: float = Field(0.0, ge=0.0, description="0: dynamic loss scaling; > 0: this static scale")
    initial_scale_power: int = Field(16, ge=0, le=64, description="dynamic: the first scale is 2**this")
    loss_scale_window: int = Field(1000, gt=0, description="dynamic: clean steps before the scale doubles")
    hysteresis: int = Field(2, gt=0, description="dynamic: overflows tolerated before the scale halves")
    min_loss_scale: float = Field(1.0, gt=0.0, description="dynamic: the scale never goes below this")


class DataTypesConfig(_Strict):
    """``data_types`` (DeepSpeed's key): the dtype gradients accumulate in across micro-steps.

    ``grad_accum_dtype`` None (the default): fp32 when training in bf16/fp16 with
    ``gradient_accumulation_steps`` > 1, else the module's dtype (one micro-step: nothing to
    accumulate). "fp32": always an fp32 accumulation buffer (4 bytes per gradient element). "bf16" /
    "fp16": accumulate in the module's dtype (2 bytes; each micro-step's gradient is rounded into the
    sum, so small micro-steps can be lost); only the training dtype is accepted (see
    :mod:`zerodp.runtime.precision`)."""

    grad_accum_dtype: Literal["fp32", "bf16", "fp16"] | None = Field(
        None, description="gradient accumulation dtype; default fp32 under bf16/fp16 with accumulation")


class CollectiveGuardConfig(_Strict):
    """``collective_guard`` (zerodp's own key): the agreement checks of
    :mod:`zerodp.runtime.collective_guard` before every collective engine call."""

    enabled: bool = Field(True, description="agree on the call before each collective engine call")
    timeout_s: float = Field(60.0, gt=0.0, le=3600.0,
                             description="seconds a rank waits for the others in an agreement")
    check_gathers: bool = Field(True, description="stage 3: also agree before each module fetch")


WarmupType = Literal["log", "linear"]


def _warmup_within_total(params: Any) -> Any:
    """Shared check of the decaying schedules: the warmup fits in the total number of steps."""
    if params.warmup_num_steps > params.total_num_steps:
        raise ValueError(f"warmup_num_steps ({params.warmup_num_steps}) must not exceed total_num_steps "
                         f"({params.total_num_steps})")
    return params


class WarmupLRParams(_Strict):
    """lr(t) = min + (max - min) * gamma(t); gamma = log(t+1)/log(W) or t/W while t < W, then 1."""

    warmup_min_lr: float = Field(0.0, ge=0.0)
    warmup_max_lr: float = Field(0.001, ge=0.0)
    warmup_num_steps: int = Field(1000, gt=0)
    warmup_type: WarmupType = "log"


class WarmupDecayLRParams(WarmupLRParams):
    """As WarmupLR, then linear decay: gamma(t) = max(0, (T - t) / (T - W)) for t >= W."""

    total_num_steps: int = Field(..., gt=0)

    _warmup_within_total = model_validator(mode="after")(lambda self: _warmup_within_total(self))


class WarmupCosineLRParams(_Strict):
    """Ratios of the optimizer's lr: warm up from warmup_min_ratio to 1 over W steps, then cosine
    from 1 down to cos_min_ratio at T."""

    total_num_steps: int = Field(..., gt=0)
    warmup_min_ratio: float = Field(0.0, ge=0.0, le=1.0)
    warmup_num_steps: int = Field(1000, gt=0)
    cos_min_ratio: float = Field(0.0001, ge=0.0, le=1.0)
    warmup_type: WarmupType = "log"

    _warmup_within_total = model_validator(mode="after")(lambda self: _warmup_within_total(self))


SCHEDULER_PARAMS: dict[str, type[_Strict]] = {
    "WarmupLR": WarmupLRParams, "WarmupDecayLR": WarmupDecayLRParams, "WarmupCosineLR": WarmupCosineLRParams,
}


class SchedulerConfig(_Strict):
    """``scheduler``: one of DeepSpeed's warmup schedules, stepped after every optimizer step."""

    type: Literal["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
    params: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _params_match_type(self) -> SchedulerConfig:
        try:
            SCHEDULER_PARAMS[self.type].model_validate(self.params)
        except ValidationError as err:
            raise ValueError(_format_errors(err, SCHEDULER_PARAMS[self.type], prefix="scheduler.params")) from None
        return self

    def parsed_params(self) -> _Strict:
        return SCHEDULER_PARAMS[self.type].model_validate(self.params)


class ActivationCheckpointingConfig(_Strict):
    """DeepSpeed's ``activation_checkpointing`` section, used by :func:`zerodp.checkpointing.checkpoint`
    (ZeRO-R partitioned activation checkpointing; see :mod:`zerodp.checkpointing`)."""

    partition_activations: bool = Field(False, description="split kept inputs across the model-parallel group")
    cpu_checkpointing: bool = Field(False, description="keep the checkpointed inputs in CPU memory")
    contiguous_memory_optimization: bool = Field(
        False, description="not implemented (a CUDA fragmentation remedy); must be false")
    number_checkpoints: int | None = Field(None, gt=0, description="only used with contiguous memory")
    synchronize_checkpoint_boundary: bool = Field(False, description="cuda.synchronize() around segments")
    profile: bool = Field(False, description="time checkpointed forwards and recomputations")

    @field_validator("contiguous_memory_optimization")
    @classmethod
    def _contiguous_not_implemented(cls, v: bool) -> bool:
        if v:
            raise ValueError("contiguous_memory_optimization is not implemented (a CUDA memory-fragmentation "
                             "remedy); leave it false")
        return v


class ZeroDPConfig(_Strict):
    """Top-level config, DeepSpeed key names. See the README for an example file."""

    train_batch_size: int | None = Field(
        None, gt=0, description="global batch = micro batch x accumulation steps x world size"
    )
    train_micro_batch_size_per_gpu: int = Field(1, gt=0, description="samples per rank per micro-step")
    gradient_accumulation_steps: int = Field(1, gt=0, description="micro-steps per optimizer step")
    optimizer: OptimizerConfig = Field(
        default_factory=lambda: OptimizerConfig(type="AdamW"), description="the torch optimizer"
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
        "auto", description="zerodp's own key: where the engine puts the module, its shards and batches; "
                            "auto = cuda:LOCAL_RANK when CUDA is available and the group takes CUDA tensors "
                            "(NCCL), else cpu (zerodp.runtime.device.resolve_device)")
    steps_per_print: int | None = Field(
        10, gt=0, description="zerodp.deepspeed engines: rank 0 prints step, lr and loss scale every N steps; "
                              "None (or +inf, as accelerate sets it): never")
    wall_clock_breakdown: bool = Field(
        False, description="zerodp.deepspeed engines: rank 0 prints forward/backward/step seconds every "
                           "steps_per_print steps")
    zero_allow_untested_optimizer: bool = Field(
        False, description="accepted for DeepSpeed configs; every optimizer zerodp builds is element-wise")
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
            raise ValueError(f"data_types.grad_accum_dtype is {accum!r} but the model trains in {trained} "
                             f"(bf16.enabled / fp16.enabled); allowed: 'fp32'"
                             + (f" or {trained!r}" if trained != "fp32" else ""))
        return self

    def for_world_size(self, world_size: int) -> ZeroDPConfig:
        """Resolve the batch keys as DeepSpeed does: train_batch_size = micro x accumulation x world.

        Given ``train_batch_size`` and one of the other two, the missing one is derived; given only
        ``train_batch_size``, accumulation is 1 and the micro batch is ``train_batch_size / world``.

        Raises:
            ConfigError: the three disagree, or the derived value is not a whole number.
        """
        tbs = self.train_batch_size
        if tbs is None:
            return self
        given = self.model_fields_set
        micro, gas = self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps
        update: dict[str, int] = {}
        if "train_micro_batch_size_per_gpu" not in given:
            if tbs % (gas * world_size):
                raise ConfigError(f"train_batch_size={tbs} is not divisible by gradient_accumulation_steps "
                                  f"({gas}) x world size ({world_size}); set train_micro_batch_size_per_gpu")
            update["train_micro_batch_size_per_gpu"] = micro = tbs // (gas * world_size)
        elif "gradient_accumulation_steps" not in given:
            if tbs % (micro * world_size):
                raise ConfigError(f"train_batch_size={tbs} is not divisible by train_micro_batch_size_per_gpu "
                                  f"({micro}) x world size ({world_size})")
            update["gradient_accumulation_steps"] = gas = tbs // (micro * world_size)
        implied = micro * gas * world_size
        if implied != tbs:
            raise ConfigError(
                f"train_batch_size={tbs} must equal train_micro_batch_size_per_gpu ({micro}) x "
                f"gradient_accumulation_steps ({gas}) x world size ({world_size}) = {implied}")
        return self.model_copy(update=update) if update else self

    def require_batch_size(self, source: str) -> ZeroDPConfig:
        """Refuse a config that gives no batch size, as DeepSpeed does: it needs ``train_batch_size``
        or ``train_micro_batch_size_per_gpu`` (``gradient_accumulation_steps`` alone is not enough).

        Used where the config decides how many samples a rank trains on (``zerodp train --config``,
        ``zerodp.deepspeed.initialize``); plain :func:`zerodp.initialize` trains on what the script
        feeds it and does not call this.

        Args:
            source: what gave the config (a file path, ``"initialize()"``), named in the message.

        Returns:
            ``self``.

        Raises:
            ConfigError: neither key is set.
        """
        if {"train_batch_size", "train_micro_batch_size_per_gpu"} & self.model_fields_set:
            return self
        raise ConfigError(
            f"invalid zerodp config: {source} gives no batch size; set 'train_micro_batch_size_per_gpu' "
            "(samples per rank per micro-step) or 'train_batch_size' (micro batch x "
            "gradient_accumulation_steps x world size), as DeepSpeed requires")


def _format_errors(err: ValidationError, model: type[BaseModel], prefix: str = "") -> str:
    lines = []
    for e in err.errors():
        path = ".".join([prefix] * bool(prefix) + [str(p) for p in e["loc"]]) or "<root>"
        if e["type"] == "extra_forbidden":
            allowed = _allowed_keys(model, e["loc"][:-1])
            if prefix:
                return f"unknown key '{path}'; allowed keys here: {', '.join(allowed)}"
            lines.append(f"unknown key '{path}'; allowed keys here: {', '.join(allowed)}")
        else:
            given = e.get("input")
            msg = e["msg"].removeprefix("Value error, ")
            if msg.startswith("invalid zerodp config:\n"):  # nested (scheduler.params): already formatted
                lines.extend(line.strip() for line in msg.splitlines()[1:])
            elif isinstance(given, (dict, list)):
                lines.append(f"'{path}': {msg}")
            else:
                lines.append(f"'{path}': {msg} (got {given!r})")
    return "invalid zerodp config:\n  " + "\n  ".join(lines)


def _allowed_keys(model: type[BaseModel], loc: tuple) -> list[str]:
    current: Any = model
    for part in loc:
        field = (current.model_fields.get(part)
                 if isinstance(current, type) and issubclass(current, BaseModel) else None)
        if field is None:
            return []
        ann = field.annotation
        current = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
        if current is None:
            return []
    return sorted(current.model_fields)


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
        raise ConfigError(_format_errors(err, ZeroDPConfig)) from None
