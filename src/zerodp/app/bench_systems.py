"""The systems ``zerodp bench`` compares, each built on the same GPT, seed and AdamW settings.

A :class:`System` splits one training step into ``forward_backward(x, y) -> loss`` and ``step()`` so
that the harness can measure memory between them (gradients are held then, optimizer states exist
from the second step on), and names the tensors it holds by category (:meth:`System.sources`) for
:func:`zerodp.app.bench_measure.live_storage_bytes`. A builder that cannot run here raises
:class:`Skipped` with the reason (DeepSpeed not installed, an op it cannot build on CPU, ...).

Systems (``SYSTEMS``): torch DDP; torch ``ZeroRedundancyOptimizer`` (+ DDP for gradients); FSDP2
(``fully_shard`` per block and on the root); DeepSpeed stages 1-3 and 3 with the optimizer offloaded
to CPU (optional extra, ``DS_ACCELERATOR=cpu`` on a machine without GPUs); zerodp stages 0-3; zerodp
stage 2 with ``offload_optimizer`` cpu and nvme (:mod:`zerodp.offload`; reported as skipped unless
``--offload`` is given, see :func:`offload_systems`, and on a GPU).

Every builder takes ``device`` (``--device``, :mod:`zerodp.app.bench_device`; default the CPU) and
builds its model there: ``module.to(device)`` for DDP (``device_ids=[index]`` on CUDA), the
ZeroRedundancyOptimizer and FSDP2 (whose mesh is ``init_device_mesh(device.type, (world,))``, not
torch's default, which would pick CUDA whenever it exists), the config key ``device`` for zerodp, and
DeepSpeed's accelerator, which must be of the same type (else the row is skipped with both named).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import zerodp
from zerodp.app.bench_measure import counting_allreduce_hook
from zerodp.app.model import GPT, GPTConfig

Tensors = Iterable[torch.Tensor | None]


class Skipped(Exception):
    """The system cannot run in this environment; the message says why."""


def loss_of(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy; ``logits`` [B, T, V] float, ``y`` [B, T] int64."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _opt_state(opt: Any) -> Tensors:
    opt = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer keeps its shard's optimizer in .optim
    for st in getattr(opt, "state", {}).values():
        for t in st.values():
            if isinstance(t, torch.Tensor):
                yield t


def _grads(params: Iterable[Any]) -> Tensors:
    for p in params:
        yield getattr(p, "grad", None)


@dataclass
class System:
    """One trainable system. ``stage`` is the ZeRO stage it corresponds to (for the paper's formula;
    None when it has none), ``family`` one of ``torch``, ``zerodp``, ``deepspeed``."""

    name: str
    family: str
    stage: int | None
    module: nn.Module
    forward_backward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    step: Callable[[], None]
    sources: Callable[[], dict[str, Tensors]]
    traffic_targets: list[tuple[Any, str]] = field(default_factory=list)
    offload: str | None = None  # offload_optimizer.device ("cpu", "nvme") or None
    #: False: its collectives are issued below ``torch.distributed``'s Python functions (DeepSpeed
    #: stage 3's parameter gathers), so the counted traffic would be a fraction: reported as not measured
    traffic_countable: bool = True


#: (model config, learning rate, probe?, device=CPU) -> System
Builder = Callable[..., System]

CPU = torch.device("cpu")


def _torch_sources(
    module: nn.Module, opt: Any, opt_params: Callable[[], list[Any]]
) -> Callable[[], dict[str, Tensors]]:
    def sources() -> dict[str, Tensors]:
        params = list(module.parameters())
        own = {id(p) for p in params}
        masters = [p for p in opt_params() if id(p) not in own]
        return {
            "parameters": params,
            "gradients": list(_grads(params)) + list(_grads(masters)),
            "optimizer_states": list(_opt_state(opt)),
            "master_weights": masters,
            "buffers": list(module.buffers()),
        }

    return sources


def _plain(name: str, stage: int | None, module: nn.Module, model: nn.Module, opt: Any) -> System:
    def fb(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_of(model(x)[0], y)
        loss.backward()
        return loss

    def step() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    params = lambda: [p for g in opt.param_groups for p in g["params"]]  # noqa: E731
    return System(name, "torch", stage, module, fb, step, _torch_sources(module, opt, params))


def _seeded_gpt(cfg: GPTConfig, device: torch.device) -> GPT:
    """The GPT every system starts from: seed 0, built on the CPU (same values everywhere), then moved
    to ``device``."""
    torch.manual_seed(0)
    return GPT(cfg).to(device)


def _ddp_model(cfg: GPTConfig, probe: bool, device: torch.device) -> tuple[GPT, torch.nn.Module]:
    """The seeded GPT on ``device`` and its DDP wrapper (with the traffic-counting comm hook in a probe)."""
    from torch.nn.parallel import DistributedDataParallel

    module = _seeded_gpt(cfg, device)
    ddp = DistributedDataParallel(module, device_ids=[device.index] if device.type == "cuda" else None)
    if probe:
        ddp.register_comm_hook(None, counting_allreduce_hook)
    return module, ddp


def build_ddp(cfg: GPTConfig, lr: float, probe: bool, device: torch.device = CPU) -> System:
    module, ddp = _ddp_model(cfg, probe, device)
    return _plain("DDP", 0, module, ddp, torch.optim.AdamW(ddp.parameters(), lr=lr))


def build_torch_zero(cfg: GPTConfig, lr: float, probe: bool, device: torch.device = CPU) -> System:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    module, ddp = _ddp_model(cfg, probe, device)
    opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=lr)
    return _plain("torch ZeroRedundancyOptimizer", 1, module, ddp, opt)


def build_fsdp2(cfg: GPTConfig, lr: float, probe: bool, device: torch.device = CPU) -> System:
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
    except ImportError as exc:
        raise Skipped(f"torch.distributed.fsdp.fully_shard unavailable: {exc}") from None

    module = _seeded_gpt(cfg, device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))  # the default picks CUDA if present
    for block in module.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(module, mesh=mesh)
    return _plain("FSDP2", 3, module, module, torch.optim.AdamW(module.parameters(), lr=lr))


def _engine_system(
    name: str,
    family: str,
    stage: int | None,
    module: nn.Module,
    engine: Any,
    sources: Callable[[], dict[str, Tensors]],
    targets: list[tuple[Any, str]],
) -> System:
    def fb(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_of(engine(x)[0], y)
        engine.backward(loss)
        return loss

    return System(name, family, stage, module, fb, engine.step, sources, targets)


def zerodp_builder(stage: int, offload: dict[str, Any] | None = None, sub_group_size: int | None = None) -> Builder:
    """Builder of zerodp at ``stage`` (fp32 AdamW, DeepSpeed's defaults otherwise, persistence
    threshold 1000 elements at stage 3 so LayerNorms and biases stay gathered); with ``offload``
    (the ``zero_optimization.offload_optimizer`` section) and ``sub_group_size``, ZeRO-Offload.
    An NVMe engine is kept in :data:`zerodp.app.bench_offload.NVME_ENGINES` (the previous one is
    closed) so that its swap statistics can be reported after the run."""

    def build(cfg: GPTConfig, lr: float, probe: bool, device: torch.device = CPU) -> System:
        from zerodp.app import bench_offload
        from zerodp.runtime import comm

        if offload is not None and device.type != "cpu":
            from zerodp.app.bench_device import OFFLOAD_ON_GPU

            raise Skipped(OFFLOAD_ON_GPU)
        module = _seeded_gpt(cfg, device)
        zc: dict[str, Any] = {"stage": stage, "stage3_param_persistence_threshold": 1000}
        if offload is not None:
            zc["offload_optimizer"] = dict(offload)
        if sub_group_size is not None:
            zc["sub_group_size"] = sub_group_size
        engine = zerodp.initialize(
            module,
            {"optimizer": {"type": "AdamW", "params": {"lr": lr}}, "zero_optimization": zc, "device": device.type},
        )  # --device (cpu or cuda)
        where = offload["device"] if offload is not None else None
        if where == "nvme":
            for old in bench_offload.NVME_ENGINES:
                old.close()
            bench_offload.NVME_ENGINES[:] = [engine]

        def sources() -> dict[str, Tensors]:
            params = list(module.parameters())
            red = engine.reducer
            grads = list(_grads(params))
            for attr in ("grad_buffers", "owned", "_staging"):
                grads += list(getattr(red, attr, {}).values())
            if engine.optimizer_offload.streams_grads:  # host fp32 gradient partition
                grads += list(engine.optimizer_offload.grad_buffers)  # type: ignore[attr-defined]  # host/NVMe offload
                grads += [getattr(engine.optimizer_offload, "grad_scratch", None)]
                grads = [t for t in grads if t is not None]
            shards = [g.buffer for g in engine.groups]
            gathered = []
            if engine.sharding is not None:
                gathered = [u.full for u in engine.sharding.units if u.full is not None]
            return {
                "parameters": shards + gathered + params,
                "gradients": grads,
                "optimizer_states": list(_opt_state(engine.optimizer)),
                "master_weights": [pc.master for g in engine.groups for pc in g.pieces],
                "buffers": list(module.buffers()),
            }

        targets = [(comm, "_all_gather_single"), (comm, "_torch_reduce_scatter_single")]
        name = f"zerodp stage {stage}" + (f" + offload {where}" if where else "")
        system = _engine_system(name, "zerodp", stage, module, engine, sources, targets)
        system.offload = where
        return system

    return build


OFFLOAD_DEVICES = ("cpu", "nvme")


def _offload_not_requested(cfg: GPTConfig, lr: float, probe: bool, device: torch.device = CPU) -> System:
    if device.type != "cpu":
        from zerodp.app.bench_device import OFFLOAD_ON_GPU

        raise Skipped(OFFLOAD_ON_GPU)
    raise Skipped("run with --offload (and --nvme-path DIR for the swap files) to measure ZeRO-Offload")


def offload_systems(nvme_path: str, sub_group_size: int) -> dict[str, Builder]:
    """The real builders of the ``zerodp stage 2 + offload cpu|nvme`` rows of :data:`SYSTEMS`
    (``--offload``): stage 2 with ``offload_optimizer.device`` cpu, and nvme with its swap files in
    ``nvme_path`` and ``sub_group_size`` elements per sub-group (DeepSpeed's keys)."""
    return {
        f"zerodp stage 2 + offload {d}": zerodp_builder(
            2,
            {"device": d, **({"nvme_path": nvme_path} if d == "nvme" else {})},
            sub_group_size=sub_group_size if d == "nvme" else None,
        )
        for d in OFFLOAD_DEVICES
    }


def deepspeed_builder(stage: int, offload: bool = False) -> Builder:
    """Builder of DeepSpeed ZeRO ``stage`` (optimizer offloaded to CPU when ``offload``), fp32
    torch AdamW, no gradient clipping; raises :class:`Skipped` when DeepSpeed is not importable."""

    def build(cfg: GPTConfig, lr: float, probe: bool, device: torch.device = CPU) -> System:
        if not torch.cuda.is_available() or device.type == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed's CPU accelerator, no ops built
        try:
            import deepspeed  # optional extra: pip install -e '.[bench]'
        except ImportError as exc:
            raise Skipped(f"DeepSpeed not installed (pip install -e '.[bench]'): {exc}") from None
        _check_deepspeed_device(device)
        module = _seeded_gpt(cfg, device)  # DeepSpeed moves it to its accelerator's current device
        zc: dict[str, Any] = {"stage": stage}
        if stage == 3:
            zc["stage3_param_persistence_threshold"] = 1000
        if offload:
            zc["offload_optimizer"] = {"device": "cpu"}
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": lr, "torch_adam": True}},
            "zero_optimization": zc,
        }
        try:
            engine, *_ = deepspeed.initialize(model=module, model_parameters=module.parameters(), config=config)
        except Exception as exc:  # e.g. an op DeepSpeed would need to compile
            raise Skipped(f"deepspeed.initialize failed: {type(exc).__name__}: {exc}") from None

        def sources() -> dict[str, Tensors]:
            params = list(module.parameters())
            zopt = engine.optimizer
            inner = getattr(zopt, "optimizer", zopt)
            own = {_key(p) for p in params}
            masters = [p for g in inner.param_groups for p in g["params"] if _key(p) not in own]
            grads = list(_grads(params)) + list(_grads(masters))
            for attr in ("averaged_gradients", "fp32_partitioned_groups_flat"):
                val = getattr(zopt, attr, None)
                if isinstance(val, dict):
                    grads += [t for v in val.values() for t in (v if isinstance(v, list) else [v])]
            return {
                "parameters": params + [getattr(p, "ds_tensor", None) for p in params],
                "gradients": grads,
                "optimizer_states": list(_opt_state(inner)),
                "master_weights": masters,
                "buffers": list(module.buffers()),
            }

        name = f"DeepSpeed stage {stage}" + (" + CPU offload" if offload else "")
        system = _engine_system(name, "deepspeed", stage, module, engine, sources, [])
        system.traffic_countable = stage != 3
        return system

    return build


def _check_deepspeed_device(device: torch.device) -> None:
    """Raise :class:`Skipped` when DeepSpeed's accelerator is not of ``device``'s type (``DS_ACCELERATOR``
    is read once per process: the launcher sets it to cpu for ``--device cpu``)."""
    try:
        from deepspeed.accelerator import get_accelerator

        name = get_accelerator().device_name()
    except Exception as exc:  # an accelerator DeepSpeed cannot set up here
        raise Skipped(f"DeepSpeed's accelerator is unavailable: {type(exc).__name__}: {exc}") from None
    if name != device.type:
        raise Skipped(
            f"DeepSpeed's accelerator is {name!r} but --device resolved to {device.type!r} "
            f"(set DS_ACCELERATOR={device.type})"
        )


def _key(t: torch.Tensor) -> int:
    return id(t)


#: every system, in the order they run and are reported: name -> builder(cfg, lr, probe).
SYSTEMS: dict[str, Builder] = {
    "DDP": build_ddp,
    "torch ZeroRedundancyOptimizer": build_torch_zero,
    "FSDP2": build_fsdp2,
    **{f"zerodp stage {s}": zerodp_builder(s) for s in (0, 1, 2, 3)},
    **{f"zerodp stage 2 + offload {d}": _offload_not_requested for d in OFFLOAD_DEVICES},
    **{f"DeepSpeed stage {s}": deepspeed_builder(s) for s in (1, 2, 3)},
    "DeepSpeed stage 3 + CPU offload": deepspeed_builder(3, offload=True),
}


def world() -> tuple[int, int]:
    """(rank, world size) of the default process group."""
    return dist.get_rank(), dist.get_world_size()
