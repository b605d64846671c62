"""``zerodp.initialize``: wrap a model in a ZeRO :class:`~zerodp.engine.Engine` (DeepSpeed's
``deepspeed.initialize`` without the tuple): config parsing, the process-group topology, parameter
groups, the engine, and the optional LR scheduler and activation-checkpointing configuration."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from zerodp.config import ZeroDPConfig, load_config
from zerodp.engine import Engine
from zerodp.runtime import activation_checkpointing, comm, control
from zerodp.runtime.config_agreement import agree_on_settings, flat_settings
from zerodp.runtime.device import check_module_device, resolve_device
from zerodp.runtime.guards import check_model_at_initialize
from zerodp.runtime.optim import normalize_param_groups
from zerodp.runtime.topology import resolve_topology
from zerodp.runtime.zero_state import refuse_wrapped


def initialize(
    model: nn.Module,
    config: str | Mapping[str, Any] | ZeroDPConfig | None = None,
    model_parameters: Iterable[Any] | None = None,
    process_group: dist.ProcessGroup | None = None,
    lr_scheduler: Callable[[torch.optim.Optimizer], LRScheduler] | None = None,
    mpu: Any = None,
) -> Engine:
    """Wrap ``model`` in a ZeRO engine.

    Args:
        model: the module to train; its parameters are re-laid out into flat buffers (values kept; every
            rank starts from rank 0's). Every rank passes the same config and groups (checked).
        config: dict, path to a JSON file with DeepSpeed key names, or a parsed config.
        model_parameters: iterable of parameters or of torch-style param-group dicts (``{"params":
            [...], "weight_decay": 0.0}``); defaults to all of ``model``'s trainable parameters.
        process_group: data-parallel group (or a 1-D ``DeviceMesh``); default the whole world.
        lr_scheduler: a callable ``f(optimizer) -> torch LRScheduler`` (e.g. ``lambda opt:
            torch.optim.lr_scheduler.StepLR(opt, 10)``), built on the engine's optimizer and stepped
            after every optimizer step; mutually exclusive with the config's ``scheduler``.
        mpu: a model-parallel unit (DeepSpeed/Megatron protocol, see :mod:`zerodp.runtime.topology`):
            ZeRO then partitions over ``mpu.get_data_parallel_group()``, gradient clipping sums
            tensor-parallel parameters' norms over the model-parallel group, and each model-parallel
            rank's checkpoints go to ``save_dir/mp_rank_XX``. Mutually exclusive with ``process_group``.

    Raises:
        ConfigError: invalid config (names the key and what is allowed), or the ranks' settings differ.
        ValueError: ``model`` (or a parameter of it) is already wrapped by an engine; a parameter in
            ``model_parameters`` is not part of ``model``, appears twice, or a group has an unknown
            option; or both ``lr_scheduler`` and the config's ``scheduler``.
        TypeError: ``lr_scheduler`` is a scheduler object (it would be bound to another optimizer).
        DeviceError: the config's ``device`` cannot be used here, or the model is on another GPU than
            the engine's (see :func:`place_on_engine_device`).
    """
    cfg = load_config(config)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    refuse_wrapped(model)
    _refuse_init_built_below_stage3(model, cfg.zero_optimization.stage)
    comm.init_distributed()
    topology = resolve_topology(process_group, mpu)
    cfg = cfg.for_world_size(dist.get_world_size(topology.dp_group))
    if cfg.seed is not None:
        torch.manual_seed(cfg.seed)
    _check_lr_scheduler(lr_scheduler, cfg)
    check_model_at_initialize(model, cfg.zero_optimization.stage)
    control.prepare(topology)  # a gloo side group where a group is NCCL-only (collective: every rank)
    device = place_on_engine_device(model, cfg, topology.dp_group)
    specs = normalize_param_groups(model, model_parameters)
    agree_on_settings(flat_settings(cfg, specs), topology.dp_group)  # collective: all ranks, same settings
    engine = Engine(model, cfg, specs, topology=topology, lr_scheduler=lr_scheduler, device=device)
    if cfg.activation_checkpointing is not None:  # process-wide, as deepspeed.checkpointing.configure(mpu, config)
        activation_checkpointing.configure(mpu, deepspeed_config=cfg)
    return engine


__all__ = ["initialize"]


def place_on_engine_device(model: nn.Module, cfg: ZeroDPConfig, group: dist.ProcessGroup | None) -> torch.device:
    """Resolve the engine's device (config key ``device``, :func:`zerodp.runtime.device.resolve_device`)
    and move ``model`` there, as DeepSpeed's engine moves the module to ``cuda:LOCAL_RANK``; a model
    already there stays. Returns the device (``engine.device``).

    Raises:
        DeviceError: the device cannot be used; the model is on another GPU (names both); or the model
            was built under ``zero.Init`` on another device (its shards cannot move).
    """
    from zerodp.runtime.device import DeviceError
    from zerodp.stage3.sharded_param import is_sharded

    device = resolve_device(cfg.device, group)
    if check_module_device(model, device):
        for name, p in model.named_parameters():
            if is_sharded(p) and p.device != device:
                raise DeviceError(
                    f"parameter '{name}' was partitioned by zero.Init on {p.device}, but the "
                    f"engine's device is {device}; give Init and initialize the same config "
                    "key device"
                )
        model.to(device)
    return device


def _check_lr_scheduler(lr_scheduler: Any, cfg: ZeroDPConfig) -> None:
    """``initialize(lr_scheduler=...)`` is None or a factory ``f(optimizer) -> LRScheduler``.

    Raises:
        TypeError: a scheduler object (bound to an optimizer the engine does not use) or not callable.
        ValueError: the config has a ``scheduler`` too.
    """
    if lr_scheduler is None:
        return
    if isinstance(lr_scheduler, LRScheduler) or not callable(lr_scheduler):
        raise TypeError(
            "lr_scheduler must be a callable taking the engine's optimizer, e.g. "
            "lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=10); a scheduler "
            "object is bound to an optimizer the engine does not use"
        )
    if cfg.scheduler is not None:
        raise ValueError("pass either lr_scheduler to initialize() or 'scheduler' in the config, not both")


def _refuse_init_built_below_stage3(model: nn.Module, stage: int) -> None:
    """A model built under ``zerodp.zero.Init`` holds only shards of its large parameters; stages 0-2
    need every parameter whole on every rank.

    Raises:
        ConfigError: ``stage`` < 3 and some parameter is partitioned (names it).
    """
    from zerodp.config import ConfigError
    from zerodp.stage3.sharded_param import is_sharded

    if stage >= 3:
        return
    for name, p in model.named_parameters():
        if is_sharded(p):
            raise ConfigError(
                f"zero_optimization.stage is {stage}, but the model was built under zerodp.zero.Init "
                f"(parameter '{name}' is partitioned): a model built under Init trains at stage 3; "
                "build it without Init for stages 0-2"
            )
