"""``zerodp.deepspeed.zero``: DeepSpeed's ``deepspeed.zero`` names over :mod:`zerodp.zero`.

:class:`Init` takes DeepSpeed's keywords (``config_dict_or_path``, ``remote_device``, ``pin_memory``,
``dtype``, ``enabled``, ``mpu``, ``data_parallel_group``...); a bare ``Init()`` partitions, as
DeepSpeed does (stage 3 implied). Partitioned parameters carry ``ds_shape`` and ``ds_numel``.
``remote_device="cpu"|"nvme"`` and ``pin_memory`` send each shard to host memory or the parameter
swap file as it is built (see :class:`zerodp.zero.Init`). Keywords asking for something zerodp does
not do (model parallelism, quantized weights, partitioning an already-built module) raise
``NotImplementedError`` naming the keyword.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zerodp import zero as _zero
from zerodp.config import ConfigError
from zerodp.deepspeed.config import drop_auto, read_config, resolve_deepspeed_config
from zerodp.stage3.ownership import owner_of
from zerodp.stage3.placeholder import save_as_placeholders
from zerodp.stage3.sharded_param import ZeroParamStatus
from zerodp.stage3.units import ShardedUnit
from zerodp.zero import GatheredParameters, TiledLinear, full_numel, is_partitioned, register_external_parameter


class Init(_zero.Init):
    """``deepspeed.zero.Init``: partition parameters as each submodule is built (see
    :class:`zerodp.zero.Init`), with DeepSpeed's keywords.

    Args:
        config_dict_or_path / config: the DeepSpeed config (dict or JSON path); ``"auto"`` values take
            their defaults, as in DeepSpeed's ``zero.Init`` (there is no model yet to resolve the
            hidden-size ones from; ``initialize`` resolves them). Without a config, or a config without
            ``zero_optimization.stage``, stage 3 is implied.
        enabled: False makes this a no-op.
        data_parallel_group: the process group (default: the world).
        dtype: the dtype parameters are partitioned in; must agree with the config's fp16/bf16 (None:
            taken from the config).
        remote_device: None or ``"none"`` (the config's ``offload_param.device``), ``"cpu"`` or
            ``"nvme"`` (each shard to host memory or the swap file as it is built; see
            :func:`zerodp.zero.resolve_remote_device`).
        pin_memory: True page-locks the host shards / swap buffers where CUDA is available; False
            (DeepSpeed's default) takes the config's ``offload_param.pin_memory`` (unset: true when the
            engine's device is CUDA).
        mem_efficient_linear: accepted (no effect on results).

    Raises:
        NotImplementedError: ``module``, ``mpu``, quantized weights or another unsupported keyword.
        ValueError: ``remote_device`` is not None, "none", "cpu" or "nvme".
        ConfigError: a stage other than 3, ``dtype`` disagreeing with the config, or ``remote_device``
            disagreeing with the config's ``offload_param`` (or "nvme" without its ``nvme_path``).
    """

    def __init__(
        self,
        module: nn.Module | None = None,
        data_parallel_group: Any = None,
        mem_efficient_linear: bool = True,
        remote_device: str | None = None,
        pin_memory: bool = False,
        config_dict_or_path: Any = None,
        config: Any = None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        mpu: Any = None,
        zero_param_parallel_group: Any = None,
        zero_quantized_weights: bool = False,
        zero_quantized_nontrainable_weights: bool = False,
        sequence_data_parallel_group: Any = None,
        param_swapper: Any = None,
    ) -> None:
        refused = {
            "module": module is not None,
            "mpu": mpu is not None,
            "zero_param_parallel_group": zero_param_parallel_group is not None,
            "zero_quantized_weights": bool(zero_quantized_weights),
            "zero_quantized_nontrainable_weights": bool(zero_quantized_nontrainable_weights),
            "sequence_data_parallel_group": sequence_data_parallel_group is not None,
            "param_swapper": param_swapper is not None,
        }
        bad = [k for k, v in refused.items() if v]
        if bad:
            raise NotImplementedError(
                f"zerodp.deepspeed.zero.Init({bad[0]}=...) is not implemented in zerodp "
                "(no model parallelism or quantization)"
            )
        cfg = _init_config(config_dict_or_path, config, dtype)
        super().__init__(
            config=cfg,
            enabled=enabled,
            process_group=data_parallel_group,
            remote_device=remote_device,
            pin_memory=None if pin_memory is False else pin_memory,
        )

    def _partitioned(self, unit: ShardedUnit) -> None:
        for s in unit.slots:
            set_ds_attributes(s.param, tuple(s.shape))


def _init_config(config_dict_or_path: Any, config: Any, dtype: torch.dtype | None) -> dict[str, Any]:
    """The config :class:`Init` hands to :class:`zerodp.zero.Init`: DeepSpeed's (a dict or a JSON path,
    given either way) with stage 3 implied when it names none.

    Raises:
        ValueError: both ``config_dict_or_path`` and ``config`` given.
        ConfigError: ``dtype`` disagrees with the config's fp16/bf16.
    """
    if config_dict_or_path is not None and config is not None:
        raise ValueError("zero.Init: give config_dict_or_path or config, not both")
    # "auto" values take their defaults, as DeepSpeed's zero.Init reads them (the HF Trainer fills
    # the hidden-size ones only once the model exists): Init reads only the stage, the precision,
    # the persistence threshold and offload_param; initialize() resolves the rest with the model.
    raw = drop_auto(read_config(config if config is not None else config_dict_or_path))
    if not isinstance(raw.get("zero_optimization"), dict):
        raw["zero_optimization"] = {}
    raw["zero_optimization"].setdefault("stage", 3)
    cfg = resolve_deepspeed_config(raw, model=None)
    implied = (
        torch.bfloat16
        if (cfg.get("bf16") or {}).get("enabled")
        else torch.float16
        if (cfg.get("fp16") or {}).get("enabled")
        else None
    )
    if dtype is not None and dtype != (implied or torch.float32):
        raise ConfigError(
            f"zero.Init(dtype={dtype}) disagrees with the config's precision "
            f"({implied or 'fp32'}); zerodp partitions in the config's dtype"
        )
    return cfg


def set_ds_attributes(p: nn.Parameter, shape: tuple[int, ...] | None) -> None:
    """DeepSpeed's ``ds_shape``/``ds_numel`` on a (possibly partitioned) parameter and, when a stage-3
    unit owns it, ``ds_id`` (the same on every rank, see :meth:`zerodp.stage3.units.ShardedUnit.ds_id`)
    and ``ds_status`` (:class:`ZeroParamStatus`: ``NOT_AVAILABLE`` while only the shard exists, a
    property of the sharded class; ``AVAILABLE`` while gathered), and DeepSpeed's save policy
    (:func:`zerodp.stage3.placeholder.save_as_placeholders`: ``torch.save`` of a partitioned parameter
    writes a placeholder that refuses to load, with a warning, where zerodp's own API refuses the save)."""
    if shape is not None:
        p.ds_shape = torch.Size(shape)  # type: ignore[attr-defined]  # DeepSpeed's attribute on a Parameter
    p.ds_numel = full_numel(p)  # type: ignore[attr-defined]  # idem
    owner = owner_of(p)
    if owner is not None:
        p.__dict__["ds_id"] = owner.unit.ds_id(p)
        p.__dict__["ds_status"] = ZeroParamStatus.AVAILABLE  # read while gathered (own class)
        save_as_placeholders(p)


__all__ = [
    "Init",
    "ZeroParamStatus",
    "GatheredParameters",
    "TiledLinear",
    "register_external_parameter",
    "full_numel",
    "is_partitioned",
]
