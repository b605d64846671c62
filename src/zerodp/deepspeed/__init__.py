"""``zerodp.deepspeed``: DeepSpeed's Python API over zerodp, so a DeepSpeed training script runs with
``import zerodp.deepspeed as deepspeed`` as its only change.

- :func:`initialize` returns DeepSpeed's 4-tuple ``(engine, optimizer, training_dataloader,
  lr_scheduler)``; the engine is a :class:`DeepSpeedEngine` (DeepSpeed's method names).
- :func:`init_distributed`, :mod:`zerodp.deepspeed.zero` (``Init``, ``GatheredParameters``,
  ``register_external_parameter``), :mod:`zerodp.deepspeed.checkpointing`.
- Configs are DeepSpeed's, ``"auto"`` included (:mod:`zerodp.deepspeed.config`).
- The modules clients import: ``accelerator`` (``get_accelerator()``), ``comm`` (DeepSpeed's
  functions over ``torch.distributed``), ``ops.adam`` (``FusedAdam``, ``DeepSpeedCPUAdam``),
  ``runtime.zero.partition_parameters`` (``ZeroParamStatus``), ``runtime.zero.offload_config``,
  ``runtime.lr_schedules``, ``utils`` (``logger``), ``checkpoint.utils``, ``moe.utils`` (MoE itself is
  refused), ``compression.helper``; :func:`add_config_arguments` and :class:`HfDeepSpeedConfig`.

The real ``deepspeed`` package is never imported. ``zerodp.initialize`` keeps its own form.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from zerodp.config import ConfigError, OptimizerConfig, load_config, optimizer_options
from zerodp.config_keys import OPTIMIZERS

# what DeepSpeed's own __init__ imports, so that attribute paths such as
# ``deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES`` (accelerate) resolve without an import
# (``comm`` too, imported by registration.install: it imports this package back, lazily)
from zerodp.deepspeed import accelerator, checkpointing, ops, runtime, utils, zero  # noqa: F401
from zerodp.deepspeed.accelerator import get_accelerator  # DeepSpeed's __init__ has it (DS-Chat imports it)
from zerodp.deepspeed.config import read_config, resolve_deepspeed_config
from zerodp.deepspeed.engine import DeepSpeedEngine
from zerodp.deepspeed.hf_config import HfDeepSpeedConfig
from zerodp.deepspeed.ops.adam import FusedAdam
from zerodp.deepspeed.registration import version as _registration_version
from zerodp.deepspeed.runtime import lr_schedules as _lr_schedules  # noqa: F401
from zerodp.deepspeed.runtime.zero import partition_parameters as _partition_parameters  # noqa: F401
from zerodp.engine import Engine
from zerodp.entry import initialize as _zerodp_initialize
from zerodp.runtime import comm as _runtime_comm  # not zerodp.deepspeed.comm (DeepSpeed's API)

#: what ``importlib.metadata.version("deepspeed")`` reports once the shim is installed, e.g.
#: "0.19.8+zerodp.0.2.0": the DeepSpeed API followed, then zerodp's own version as PEP 440's local label
#: (a script's ``version.parse(deepspeed.__version__) >= version.parse("0.9")`` holds, as with DeepSpeed)
__version__ = _registration_version()


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = 29500,
    verbose: bool = True,
    timeout: Any = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: Any = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Initialise the default process group from torchrun's environment (:func:`zerodp.init_distributed`).

    Raises:
        NotImplementedError: ``init_method``, ``rank`` or ``world_size`` given (use torchrun's env).
    """
    if init_method is not None or rank != -1 or world_size != -1:
        raise NotImplementedError(
            "init_distributed(init_method/rank/world_size) is not implemented in zerodp; "
            "launch with torchrun (RANK, WORLD_SIZE, MASTER_ADDR in the environment)"
        )
    timeout_s = timeout.total_seconds() if hasattr(timeout, "total_seconds") else timeout
    _runtime_comm.init_distributed(backend=dist_backend, timeout_s=timeout_s)


def initialize(
    args: Any = None,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | Callable[..., torch.optim.Optimizer] | None = None,
    model_parameters: Iterable[Any] | None = None,
    training_data: Dataset | None = None,
    lr_scheduler: LRScheduler | Callable[[torch.optim.Optimizer], Any] | None = None,
    distributed_port: int = 29500,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Callable | None = None,
    config: Any = None,
    mesh_param: Any = None,
    config_params: Any = None,
) -> tuple[DeepSpeedEngine, torch.optim.Optimizer, DataLoader | None, Any]:
    """``deepspeed.initialize``: wrap ``model`` in a ZeRO engine.

    Args:
        args: an argparse namespace; its ``deepspeed_config`` is the config when ``config`` is None.
        model: the module to train.
        optimizer: a torch optimizer over ``model``'s parameters (not yet stepped), or a callable
            ``f(params) -> optimizer``; its class (one of :data:`zerodp.config_keys.OPTIMIZERS`),
            defaults and param groups are rebuilt over this rank's partition. Exclusive with the
            config's ``optimizer``.
        model_parameters: parameters or param-group dicts (when ``optimizer`` is not an object).
        training_data: a torch Dataset, read by the returned DataLoader (see :func:`_training_loader`).
        lr_scheduler: a callable ``f(optimizer) -> scheduler``, or a scheduler object bound to the
            client ``optimizer`` (rebound to the engine's optimizer with its state).
        collate_fn: for the DataLoader.
        mpu: a model-parallel unit, passed to :func:`zerodp.initialize`.
        config / config_params: the DeepSpeed config (dict or JSON path), ``"auto"`` allowed.

    Returns:
        ``(engine, engine.optimizer, dataloader or None, engine.lr_scheduler)``.

    Raises:
        ConfigError: invalid config, an unresolvable ``"auto"``, a config that gives no batch size
            (neither ``train_micro_batch_size_per_gpu`` nor ``train_batch_size``, as DeepSpeed), or
            both ``config`` and ``config_params``.
        NotImplementedError: ``mesh_param``, an optimizer class zerodp does not build, a client
            optimizer that has state, or a scheduler bound to another optimizer.
    """
    if mesh_param is not None:
        raise NotImplementedError("initialize(mesh_param=) is not implemented in zerodp; pass mpu=")
    if model is None:
        raise ValueError("deepspeed.initialize needs model=")
    raw = read_config(_config_source(args, config, config_params))
    _runtime_comm.init_distributed()
    client_opt, model_parameters = _adopt_client_optimizer(raw, optimizer, model, model_parameters)
    raw_resolved = _resolve_auto(raw, model, client_opt)
    cfg = load_config(raw_resolved).require_batch_size("the config given to initialize()")  # as DeepSpeed
    shapes = {id(p): tuple(p.shape) for p in model.parameters()}  # before stage 3 partitions them
    scheduler_fn = _scheduler_factory(lr_scheduler, client_opt)
    engine = _zerodp_initialize(model, cfg, model_parameters=model_parameters, lr_scheduler=scheduler_fn, mpu=mpu)
    _set_ds_attributes(engine.stage, model, shapes)
    ds_engine = DeepSpeedEngine(engine, _training_loader(engine, training_data, collate_fn), ds_config=raw_resolved)
    return ds_engine, engine.optimizer, ds_engine.training_dataloader, engine.lr_scheduler


def _config_source(args: Any, config: Any, config_params: Any) -> Any:
    """What names the DeepSpeed config: ``config``, ``config_params`` or ``args.deepspeed_config`` (or
    DeepSpeed's former ``args.deepscale_config``), exactly one of them.

    Raises:
        ConfigError: none of them given, or more than one (as DeepSpeed, which asserts when both the
            arguments and the call give a config): names each source given.
    """
    from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    given = {"config": config, "config_params": config_params, "args.deepspeed_config": from_args}
    named = [k for k, v in given.items() if v is not None]
    if not named:
        raise ConfigError(
            "initialize() was given no config: pass config= (a dict or a JSON file path), "
            "config_params=, or args with args.deepspeed_config (--deepspeed_config FILE)"
        )
    if len(named) > 1:
        shown = ", ".join(f"{k}={given[k]!r}" if isinstance(given[k], (str, os.PathLike)) else k for k in named)
        raise ConfigError(
            f"initialize() was given more than one config ({shown}); give one of them "
            "(e.g. drop --deepspeed_config from the command line, or the config= argument)"
        )
    return given[named[0]]


def _adopt_client_optimizer(
    raw: dict[str, Any], optimizer: Any, model: nn.Module, model_parameters: Any
) -> tuple[torch.optim.Optimizer | None, Any]:
    """Turn a client optimizer (an object, or a callable ``f(params)`` built here over ``model_parameters``
    or the model's parameters) into the config's ``optimizer`` section, written into ``raw``.

    Returns:
        ``(the client optimizer or None, the param groups the engine rebuilds it over)``; with no
        client optimizer, ``(None, model_parameters)`` and ``raw`` unchanged.

    Raises:
        ConfigError: the config also has an ``optimizer`` section.
        NotImplementedError: see :func:`_from_client_optimizer`.
    """
    if optimizer is None:
        return None, model_parameters
    if raw.get("optimizer") is not None:
        raise ConfigError(
            "initialize() got a client optimizer and the config has an 'optimizer' section; give one of them"
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        params = list(model_parameters) if model_parameters is not None else list(model.parameters())
        optimizer = optimizer(params)
    raw["optimizer"], groups = _from_client_optimizer(optimizer)
    return optimizer, groups


def _resolve_auto(raw: dict[str, Any], model: nn.Module, client_opt: torch.optim.Optimizer | None) -> dict[str, Any]:
    """``raw`` with its ``"auto"`` values resolved (:func:`zerodp.deepspeed.config.resolve_deepspeed_config`),
    the client optimizer's lr standing for ``"auto"`` learning rates."""
    lr = client_opt.defaults.get("lr") if client_opt is not None else None
    return resolve_deepspeed_config(raw, model, optimizer_lr=float(lr) if lr is not None else None)


def _set_ds_attributes(stage: int, model: nn.Module, shapes: dict[int, tuple[int, ...]]) -> None:
    """At ``stage`` 3 (nothing otherwise): DeepSpeed's ``ds_*`` attributes on every parameter of ``model``;
    ``shapes`` (by ``id``) are the full shapes from before partitioning, for parameters that have no
    ``ds_shape`` yet."""
    if stage != 3:
        return
    for p in model.parameters():
        zero.set_ds_attributes(p, None if hasattr(p, "ds_shape") else shapes[id(p)])


def _training_loader(engine: Engine, training_data: Dataset | None, collate_fn: Callable | None) -> DataLoader | None:
    """DeepSpeed's training loader: ``training_data`` in micro-batches of the config's
    ``train_micro_batch_size_per_gpu`` samples, each rank reading its share through a DistributedSampler
    over the engine's data-parallel group (shuffled, seed 0); None without ``training_data``."""
    if training_data is None:
        return None
    group = engine.process_group
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    sampler: DistributedSampler = DistributedSampler(training_data, num_replicas=world, rank=rank)
    micro_batch = engine.config.train_micro_batch_size_per_gpu
    return DataLoader(training_data, batch_size=micro_batch, sampler=sampler, collate_fn=collate_fn)


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's command-line arguments: ``--deepspeed`` (flag), ``--deepspeed_config PATH`` (read by
    :func:`initialize` from ``args``), ``--deepscale`` / ``--deepscale_config`` (DeepSpeed's former
    names) and ``--deepspeed_mpi``; returns ``parser``."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument(
        "--deepspeed",
        default=False,
        action="store_true",
        help="Enable DeepSpeed (helper flag for user code, no impact on DeepSpeed backend)",
    )
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    group.add_argument("--deepspeed_mpi", default=False, action="store_true", help=argparse.SUPPRESS)
    return parser


_IMPLEMENTATION_KEYS = ("foreach", "fused", "capturable", "differentiable")


def _from_client_optimizer(opt: torch.optim.Optimizer) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The config ``optimizer`` section and param groups that rebuild ``opt`` over the engine's pieces."""
    name = "Adam" if isinstance(opt, FusedAdam) else type(opt).__name__  # DeepSpeed's names, torch's Adam
    if OPTIMIZERS.get(name) is not type(opt) and not isinstance(opt, FusedAdam):
        raise NotImplementedError(
            f"client optimizer {type(opt).__module__}.{name} is not implemented in zerodp; "
            f"give one of torch.optim.{', torch.optim.'.join(OPTIMIZERS)}"
        )
    if opt.state:
        raise NotImplementedError(
            "a client optimizer that has already stepped (it has state) is not "
            "implemented: pass it before its first step"
        )
    # only what the class's constructor takes (AdamW's defaults also hold decoupled_weight_decay=True)
    accepted = set(optimizer_options(name)) - set(_IMPLEMENTATION_KEYS)
    defaults = {k: _plain(v) for k, v in opt.defaults.items() if v is not None and k in accepted}
    groups = []
    for g in opt.param_groups:
        options = {k: _plain(v) for k, v in g.items() if k in accepted and _plain(v) != defaults.get(k)}
        groups.append({"params": g["params"], **options})
    if name == "Adam":  # torch's Adam (decay as its decoupled_weight_decay says), not DeepSpeed's config Adam
        defaults["adam_w_mode"] = False
    section = OptimizerConfig(type=name, params=defaults).model_dump(exclude_none=True)
    return section, groups


def _plain(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.item()
    return v


def _scheduler_factory(sched: Any, client_opt: torch.optim.Optimizer | None) -> Callable | None:
    """A callable ``f(engine optimizer) -> scheduler`` for :func:`zerodp.initialize`."""
    if sched is None:
        return None
    if not isinstance(sched, LRScheduler):
        if not callable(sched):
            raise TypeError(f"lr_scheduler must be a torch LRScheduler or a callable, got {type(sched).__name__}")
        return sched
    if client_opt is None or sched.optimizer is not client_opt:
        raise NotImplementedError(
            "an lr_scheduler object bound to an optimizer other than the client optimizer "
            "passed to initialize() is not implemented; pass a callable f(optimizer)"
        )

    def rebind(opt: torch.optim.Optimizer) -> LRScheduler:
        for g, cg in zip(opt.param_groups, client_opt.param_groups, strict=True):
            g["lr"] = cg["lr"]
            if "initial_lr" in cg:
                g["initial_lr"] = cg["initial_lr"]
        state = sched.state_dict()
        params = inspect.signature(type(sched).__init__).parameters
        if any(p.kind is p.VAR_POSITIONAL for p in params.values()):
            raise NotImplementedError(f"rebinding {type(sched).__name__} is not implemented; pass a callable")
        new = type(sched).__new__(type(sched))
        new.__dict__.update({k: v for k, v in sched.__dict__.items() if k != "optimizer"})
        new.optimizer = opt
        new.load_state_dict(state)
        _track_step_called(opt)
        return new

    return rebind


def _track_step_called(opt: torch.optim.Optimizer) -> None:
    """What torch's LRScheduler.__init__ does to the optimizer it is built on: mark ``opt.step`` so
    that ``scheduler.step()`` can tell it ran (else torch warns of a wrong call order)."""
    if hasattr(opt.step, "_wrapped_by_lr_sched"):
        return
    step = opt.step

    @functools.wraps(step)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        opt._opt_called = True  # type: ignore[attr-defined]
        return step(*args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    opt.step = wrapper  # type: ignore[method-assign]


__all__ = [
    "initialize",
    "init_distributed",
    "add_config_arguments",
    "zero",
    "checkpointing",
    "DeepSpeedEngine",
    "HfDeepSpeedConfig",
    "ConfigError",
    "get_accelerator",
]
