"""The ``optimizer`` and ``scheduler`` sections of the config (DeepSpeed's key names).

``optimizer.type`` names a torch optimizer (DeepSpeed's names, see :mod:`zerodp.config_keys`) and its
``params`` must be keywords of that optimizer; ``scheduler`` is one of DeepSpeed's warmup schedules
with its own parameter schema. Errors are ``ValueError``s that :func:`zerodp.config.load_config` reports
as :class:`~zerodp.config_base.ConfigError` naming the key path.
"""

from __future__ import annotations

import builtins
import inspect
from typing import TYPE_CHECKING, Any, Literal

from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from zerodp.config_base import StrictModel, format_errors
from zerodp.config_keys import OPTIMIZERS, REFUSED_OPTIMIZERS, canonical_optimizer

if TYPE_CHECKING:
    import torch


class OptimizerParams(StrictModel):
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
        None, ge=0.0, description="L2 (Adam) or decoupled (AdamW) decay; an Adam/AdamW section without it gets 0"
    )
    adam_w_mode: bool | None = Field(
        None, description="DeepSpeed's key: for type Adam, true (default) = AdamW, false = torch's L2 Adam"
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
        out = {k: v for k, v in self.model_dump().items() if v is not None and k != "adam_w_mode"}
        return {k: tuple(v) if isinstance(v, list) else v for k, v in out.items()}


class OptimizerConfig(StrictModel):
    """``optimizer``: ``type`` names a torch optimizer (DeepSpeed's names, case-insensitive; see
    :data:`zerodp.config_keys.OPTIMIZERS`), ``params`` its keyword arguments.

    ``Adam`` and ``AdamW`` mean what they mean in DeepSpeed, for ``zerodp.initialize`` and
    ``zerodp.deepspeed.initialize`` alike (:func:`deepspeed_adam_section`): ``Adam`` is AdamW
    (decoupled weight decay) unless ``params.adam_w_mode`` is false (torch's L2 ``Adam``), and an
    Adam/AdamW without ``weight_decay`` gets 0 (DeepSpeed's default; torch's AdamW default is 0.01).
    """

    type: str
    params: OptimizerParams = Field(default_factory=OptimizerParams)

    @model_validator(mode="before")
    @classmethod
    def _deepspeed_meaning(cls, data: Any) -> Any:
        return deepspeed_adam_section(data)

    @field_validator("type")
    @classmethod
    def _canonical_type(cls, v: str) -> str:
        name = canonical_optimizer(v)
        if name is None:
            raise ValueError(f"unknown optimizer; allowed: {', '.join(OPTIMIZERS)}")
        if name in REFUSED_OPTIMIZERS:
            raise ValueError(
                f"optimizer '{name}' is not implemented: {REFUSED_OPTIMIZERS[name]}; allowed: {', '.join(OPTIMIZERS)}"
            )
        return name

    @model_validator(mode="after")
    def _params_fit_type(self) -> OptimizerConfig:
        allowed = optimizer_options(self.type)
        unknown = sorted(set(self.params.torch_kwargs()) - set(allowed))
        if unknown:
            raise ValueError(
                f"optimizer.params.{unknown[0]} is not an option of torch.optim.{self.type}; "
                f"allowed keys here: {', '.join(allowed)}"
            )
        return self

    def torch_class(self) -> builtins.type[torch.optim.Optimizer]:  # builtins: ``type`` is a field here
        return OPTIMIZERS[self.type]


def deepspeed_adam_section(section: Any) -> Any:
    """The ``optimizer`` section with DeepSpeed's meaning of ``Adam``/``AdamW`` written out (a copy).

    DeepSpeed (``ADAM_W_MODE_DEFAULT = True``, weight_decay default 0): ``Adam`` with ``adam_w_mode``
    true or absent, and ``AdamW`` (any ``adam_w_mode``), become ``AdamW`` with ``weight_decay`` 0 unless
    given; ``Adam`` with ``adam_w_mode: false`` stays torch's L2 ``Adam`` and keeps the key, so the
    result reads the same when validated again. ``torch_adam`` is dropped (zerodp runs torch's code).
    Anything else is returned unchanged. Raises ValueError: ``adam_w_mode`` is not true or false.
    """
    if not isinstance(section, dict) or not isinstance(section.get("type"), str):
        return section
    params = section.get("params")
    params = params.model_dump(exclude_none=True) if isinstance(params, OptimizerParams) else params
    if params is None:
        params = {}
    if not isinstance(params, dict):
        return section
    params = {k: v for k, v in params.items() if k != "torch_adam"}
    kind = canonical_optimizer(section["type"])
    if kind not in ("Adam", "AdamW"):
        return {**section, "params": params}
    w_mode = params.pop("adam_w_mode", True)
    if not isinstance(w_mode, bool):
        raise ValueError(f"optimizer.params.adam_w_mode must be true or false (got {w_mode!r})")
    if kind == "Adam" and not w_mode:
        return {**section, "type": "Adam", "params": {**params, "adam_w_mode": False}}
    return {**section, "type": "AdamW", "params": {"weight_decay": 0.0, **params}}


def optimizer_options(name: str) -> list[str]:
    """Keyword options of ``torch.optim.<name>`` (besides ``params``), in signature order."""
    sig = inspect.signature(OPTIMIZERS[name].__init__)
    return [p for p in sig.parameters if p not in ("self", "params")]


WarmupType = Literal["log", "linear"]


def _warmup_within_total(params: Any) -> Any:
    """Shared check of the decaying schedules: the warmup fits in the total number of steps."""
    if params.warmup_num_steps > params.total_num_steps:
        raise ValueError(
            f"warmup_num_steps ({params.warmup_num_steps}) must not exceed total_num_steps ({params.total_num_steps})"
        )
    return params


class WarmupLRParams(StrictModel):
    """lr(t) = min + (max - min) * gamma(t); gamma = log(t+1)/log(W) or t/W while t < W, then 1."""

    warmup_min_lr: float = Field(0.0, ge=0.0)
    warmup_max_lr: float | None = Field(
        None,
        ge=0.0,
        description="None: the first param group's lr, as DeepSpeed's WarmupLR (deepspeedai/DeepSpeed#7303: "
        "a fixed 0.001 default overrode the optimizer's lr)",
    )
    warmup_num_steps: int = Field(1000, gt=0)
    warmup_type: WarmupType = "log"


class WarmupDecayLRParams(WarmupLRParams):
    """As WarmupLR, then linear decay: gamma(t) = max(0, (T - t) / (T - W)) for t >= W."""

    warmup_max_lr: float = Field(0.001, ge=0.0, description="DeepSpeed's WarmupDecayLR default")
    total_num_steps: int = Field(..., gt=0)

    _warmup_within_total = model_validator(mode="after")(lambda self: _warmup_within_total(self))


class WarmupCosineLRParams(StrictModel):
    """Ratios of the optimizer's lr: warm up from warmup_min_ratio to 1 over W steps, then cosine
    from 1 down to cos_min_ratio at T."""

    total_num_steps: int = Field(..., gt=0)
    warmup_min_ratio: float = Field(0.0, ge=0.0, le=1.0)
    warmup_num_steps: int = Field(1000, gt=0)
    cos_min_ratio: float = Field(0.0001, ge=0.0, le=1.0)
    warmup_type: WarmupType = "log"

    _warmup_within_total = model_validator(mode="after")(lambda self: _warmup_within_total(self))


SCHEDULER_PARAMS: dict[str, type[StrictModel]] = {
    "WarmupLR": WarmupLRParams,
    "WarmupDecayLR": WarmupDecayLRParams,
    "WarmupCosineLR": WarmupCosineLRParams,
}


class SchedulerConfig(StrictModel):
    """``scheduler``: one of DeepSpeed's warmup schedules, stepped after every optimizer step."""

    type: Literal["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
    params: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _params_match_type(self) -> SchedulerConfig:
        try:
            SCHEDULER_PARAMS[self.type].model_validate(self.params)
        except ValidationError as err:
            raise ValueError(format_errors(err, SCHEDULER_PARAMS[self.type], prefix="scheduler.params")) from None
        return self

    def parsed_params(self) -> StrictModel:
        return SCHEDULER_PARAMS[self.type].model_validate(self.params)
