"""DeepSpeed config dicts as DeepSpeed and the HF Trainer write them, turned into zerodp configs.

:func:`resolve_deepspeed_config` runs before :func:`zerodp.load_config` and owns ``"auto"`` values:

- ``"auto"`` values (every HF Trainer config has them). Each is resolved from what ``initialize``
  knows, or refused naming the key and what must fill it:

  ======================================================  ===============================================
  key                                                     ``"auto"`` becomes
  ======================================================  ===============================================
  ``train_batch_size``, ``train_micro_batch_size_per_gpu``  derived from the other two (as DeepSpeed
  ``gradient_accumulation_steps``                           derives a missing one); all three ``auto``:
                                                            refused
  ``zero_optimization.reduce_bucket_size``                 ``hidden_size ** 2`` (as the HF Trainer)
  ``zero_optimization.stage3_prefetch_bucket_size``        ``int(0.9 * hidden_size ** 2)``
  ``zero_optimization.stage3_param_persistence_threshold`` ``10 * hidden_size``
  ``scheduler.params.warmup_max_lr``                       the optimizer's lr
  ``scheduler.params.warmup_min_lr``                       0
  ``fp16.enabled``, ``bf16.enabled``                       whether the model's floating parameters are
                                                            already of that dtype
  anything else                                             refused
  ======================================================  ===============================================

  ``hidden_size`` is ``model.config.hidden_size`` (or ``max(model.config.hidden_sizes)``), as the HF
  Trainer reads it; a model without such a config gets a refusal naming the keys.

DeepSpeed's optimizer spellings (``Adam`` with ``adam_w_mode``, ``torch_adam``, weight_decay default 0)
are read by the config itself (:func:`zerodp.config_optimizer.deepspeed_adam_section`), the same for
``zerodp.initialize``; a client ``torch.optim.Adam`` is written as ``adam_w_mode: false`` and stays Adam.

Errors: :class:`zerodp.ConfigError` naming the key path.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from zerodp.config import ConfigError, read_config_mapping

AUTO = "auto"
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
#: zero_optimization key -> (HF Trainer formula as text, function of hidden_size)
HIDDEN_SIZE_KEYS = {
    "reduce_bucket_size": ("hidden_size * hidden_size", lambda h: h * h),
    "stage3_prefetch_bucket_size": ("0.9 * hidden_size * hidden_size", lambda h: int(0.9 * h * h)),
    "stage3_param_persistence_threshold": ("10 * hidden_size", lambda h: 10 * h),
}


def drop_auto(node: Any) -> Any:
    """``node`` without its ``"auto"`` values (recursively), as DeepSpeed's config models read them
    when no trainer has filled them: the key takes its default. Used by ``zero.Init``, which has no
    model or optimizer to resolve them from and reads only the stage, the precision and the
    stage-3/offload keys."""
    if isinstance(node, dict):
        return {k: drop_auto(v) for k, v in node.items() if not (isinstance(v, str) and v == AUTO)}
    return node


def read_config(config: Any) -> dict[str, Any]:
    """A config dict from a dict or a JSON file path (None: empty).

    Raises:
        ConfigError: unreadable file, invalid JSON, or neither a dict nor a path.
    """
    return copy.deepcopy(dict(read_config_mapping(config)))


def hidden_size_of(model: nn.Module | None) -> int | None:
    """``model.config.hidden_size`` or ``max(model.config.hidden_sizes)`` (HF models); else None."""
    mc = getattr(model, "config", None)
    h = getattr(mc, "hidden_size", None)
    if isinstance(h, int):
        return h
    hs = getattr(mc, "hidden_sizes", None)
    if isinstance(hs, (list, tuple)) and hs and all(isinstance(x, int) for x in hs):
        return max(hs)
    return None


def _floating_dtype(model: nn.Module | None) -> torch.dtype | None:
    if model is None:
        return None
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return None


def resolve_deepspeed_config(
    raw: Mapping[str, Any], model: nn.Module | None = None, optimizer_lr: float | None = None
) -> dict[str, Any]:
    """Resolve ``"auto"`` values and DeepSpeed optimizer spellings in ``raw`` (not modified).

    Args:
        raw: a DeepSpeed config dict.
        model: the model being trained (for ``hidden_size`` and the dtype); None inside ``zero.Init``.
        optimizer_lr: the client optimizer's lr, when one was passed to ``initialize``.

    Returns:
        A config dict for :func:`zerodp.load_config` without any ``"auto"``.

    Raises:
        ConfigError: an ``"auto"`` that cannot be resolved (names the key and what must fill it).
    """
    cfg = copy.deepcopy(dict(raw))
    _resolve_batch(cfg)
    _resolve_hidden_size_keys(cfg, model)
    for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        section = cfg.get(name)
        if isinstance(section, dict) and section.get("enabled") == AUTO:
            section["enabled"] = _floating_dtype(model) == dtype
    _resolve_scheduler(cfg, optimizer_lr)
    left = [p for p in _auto_paths(cfg) if p != "device"]  # zerodp's own key: "auto" is its default
    if left:
        raise ConfigError(
            "invalid zerodp config:\n  "
            + "\n  ".join(
                f"'{p}' is \"auto\", which zerodp cannot resolve (the HF Trainer fills it from its "
                "TrainingArguments); give a value"
                for p in left
            )
        )
    return cfg


def _auto_paths(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in _auto_paths(v, f"{prefix}{k}.")]
    return [prefix[:-1]] if node == AUTO else []


def _resolve_batch(cfg: dict[str, Any]) -> None:
    autos = [k for k in BATCH_KEYS if cfg.get(k) == AUTO]
    if len(autos) == len(BATCH_KEYS):
        raise ConfigError(
            "invalid zerodp config:\n  'train_batch_size', 'train_micro_batch_size_per_gpu' and "
            "'gradient_accumulation_steps' are all \"auto\": zerodp has no trainer arguments to fill them "
            "from; set train_micro_batch_size_per_gpu (and gradient_accumulation_steps) to numbers"
        )
    for k in autos:
        del cfg[k]  # derived from the others by ZeroDPConfig.for_world_size, as DeepSpeed does


def _resolve_hidden_size_keys(cfg: dict[str, Any], model: nn.Module | None) -> None:
    zo = cfg.get("zero_optimization")
    if not isinstance(zo, dict):
        return
    autos = [k for k in HIDDEN_SIZE_KEYS if zo.get(k) == AUTO]
    if not autos:
        return
    h = hidden_size_of(model)
    if h is None:
        where = (
            "zerodp.deepspeed.zero.Init (no model yet)"
            if model is None
            else f"the model ({type(model).__name__}) has no config.hidden_size or config.hidden_sizes"
        )
        raise ConfigError(
            "invalid zerodp config:\n  "
            + "\n  ".join(
                f"'zero_optimization.{k}' is \"auto\" (= {HIDDEN_SIZE_KEYS[k][0]}, as the HF Trainer fills "
                f"it) but {where}; give a number"
                for k in autos
            )
        )
    for k in autos:
        zo[k] = HIDDEN_SIZE_KEYS[k][1](h)


def _resolve_scheduler(cfg: dict[str, Any], optimizer_lr: float | None) -> None:
    sched = cfg.get("scheduler")
    params = sched.get("params") if isinstance(sched, dict) else None
    if not isinstance(params, dict):
        return
    if params.get("warmup_min_lr") == AUTO:
        params["warmup_min_lr"] = 0.0
    if params.get("warmup_max_lr") == AUTO:
        lr = optimizer_lr
        opt = cfg.get("optimizer")
        if lr is None and isinstance(opt, dict):
            given = (opt.get("params") or {}).get("lr")
            lr = given if isinstance(given, (int, float)) and not isinstance(given, bool) else None
        if lr is None:
            raise ConfigError(
                "invalid zerodp config:\n  'scheduler.params.warmup_max_lr' is \"auto\" (= the "
                "optimizer's lr) but no optimizer lr is given; set optimizer.params.lr"
            )
        params["warmup_max_lr"] = float(lr)


#: fill_auto keyword (the HF TrainingArguments name) -> the config key paths it fills, as the HF
#: Trainer's DeepSpeed integration does.
TRAINER_FILLS: dict[str, tuple[str, ...]] = {
    "per_device_train_batch_size": ("train_micro_batch_size_per_gpu",),
    "gradient_accumulation_steps": ("gradient_accumulation_steps",),
    "max_grad_norm": ("gradient_clipping",),
    "learning_rate": ("optimizer.params.lr", "scheduler.params.warmup_max_lr"),
    "adam_betas": ("optimizer.params.betas",),
    "adam_epsilon": ("optimizer.params.eps",),
    "weight_decay": ("optimizer.params.weight_decay",),
    "warmup_steps": ("scheduler.params.warmup_num_steps",),
    "max_steps": ("scheduler.params.total_num_steps",),
    "fp16": ("fp16.enabled",),
    "bf16": ("bf16.enabled",),
}


def fill_auto(config: Any, **values: Any) -> dict[str, Any]:
    """Replace ``"auto"`` with the caller's training arguments, as the HF Trainer does before it calls
    ``deepspeed.initialize`` (keywords: the TrainingArguments names in :data:`TRAINER_FILLS`, e.g.
    ``learning_rate=3e-4, per_device_train_batch_size=8``). Keys left ``"auto"`` are resolved or refused
    later by :func:`resolve_deepspeed_config`; ``train_batch_size`` is derived from the other two.

    Raises:
        TypeError: an unknown keyword (names the allowed ones).
    """
    unknown = sorted(set(values) - set(TRAINER_FILLS))
    if unknown:
        raise TypeError(f"fill_auto() got unknown argument(s) {unknown}; allowed: {', '.join(TRAINER_FILLS)}")
    cfg = read_config(config)
    for name, value in values.items():
        for path in TRAINER_FILLS[name]:
            node: Any = cfg
            *parents, leaf = path.split(".")
            for part in parents:
                node = node.get(part) if isinstance(node, dict) else None
            if isinstance(node, dict) and node.get(leaf) == AUTO:
                node[leaf] = list(value) if isinstance(value, tuple) else value
    return cfg
