"""``engine.offload_states()`` / ``engine.reload_states()`` (DeepSpeed's, used by RLHF loops to free
accelerator memory for generation between training phases) and the engine's ``tput_timer``.

:func:`offload_states` moves the engine's state tensors to the host with ``.to(device)`` and
:func:`reload_states` moves them back to where each was, values unchanged:

- ``optim_states``: the optimizer's state tensors (Adam's ``exp_avg``/``exp_avg_sq``...), replaced
  in ``optimizer.state``;
- ``hp_params``: the fp32 master copies (bf16/fp16), moved in place (``master.data``), so the
  optimizer's references stay valid.
- ``lp_params``, ``lp_grads``, ``contiguous_grad_buffer``: the module-dtype flat buffers, which the
  parameters and gradients view. Already on the host (a CPU engine), nothing moves; on an accelerator
  moving them is not implemented and is refused by name.

As in DeepSpeed, only ``device=cpu`` is accepted, and an engine with ``offload_optimizer`` /
``offload_param`` (its states already live on the host) is refused.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch

from zerodp.deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum
from zerodp.runtime.device import host_empty

ALL_STATES = tuple(OffloadStateTypeEnum)
#: states zerodp moves; the others must already be on the host
MOVED = (OffloadStateTypeEnum.optim_states, OffloadStateTypeEnum.hp_params)


def _flat_buffers(engine: Any) -> list[torch.Tensor]:
    return [g.buffer for g in engine.groups]


def offload_states(
    ds_engine: Any,
    include: Iterable[Any] | None = None,
    device: Any = OffloadDeviceEnum.cpu,
    pin_memory: bool = True,
    non_blocking: bool = False,
) -> None:
    """Move the ``include``d states (default: all) to the host; see the module docstring.

    Raises:
        NotImplementedError: ``device`` other than cpu; ``offload_optimizer``/``offload_param`` set;
            the states are offloaded already; a flat-buffer state on an accelerator.
        ValueError: an unknown state name.
    """
    engine = ds_engine.engine
    if OffloadDeviceEnum(device) is not OffloadDeviceEnum.cpu:
        raise NotImplementedError(f"offload_states(device={device!r}) is not implemented: only cpu, as DeepSpeed")
    zc = engine.config.zero_optimization
    if zc.offload_optimizer.device != "none" or zc.offload_param.device != "none":
        raise NotImplementedError(
            "offload_states with offload_optimizer/offload_param configured is not "
            "implemented (as in DeepSpeed): those states already live on the host"
        )
    if getattr(ds_engine, "_offloaded", None) is not None:
        raise NotImplementedError("offload_states called twice without reload_states in between")
    wanted = [OffloadStateTypeEnum(s) for s in (include if include is not None else ALL_STATES)]
    host = torch.device("cpu")
    stuck = [s.value for s in wanted if s not in MOVED and any(b.device != host for b in _flat_buffers(engine))]
    if stuck:
        raise NotImplementedError(
            f"offload_states(include={stuck}) is not implemented in zerodp for accelerator "
            "engines (the parameters and gradients view these flat buffers); include "
            "optim_states and hp_params"
        )
    moved: list[tuple[str, Any, Any, torch.device]] = []
    pin = bool(pin_memory)  # host_empty pins only where CUDA is present
    if OffloadStateTypeEnum.optim_states in wanted:
        for state in engine.optimizer.state.values():
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and v.device != host:
                    moved.append(("state", state, k, v.device))
                    state[k] = _to_host(v, pin, non_blocking)
    if OffloadStateTypeEnum.hp_params in wanted:
        for g in engine.groups:
            for piece in g.pieces:
                m = piece.master
                if m is not None and m.device != host:
                    moved.append(("master", m, None, m.device))
                    m.data = _to_host(m.data, pin, non_blocking)
    ds_engine._offloaded = moved


def reload_states(ds_engine: Any, non_blocking: bool = False) -> None:
    """Move what :func:`offload_states` moved back to its device (nothing if nothing was offloaded)."""
    moved = getattr(ds_engine, "_offloaded", None) or []
    for kind, holder, key, dev in moved:
        if kind == "state":
            holder[key] = holder[key].to(dev, non_blocking=non_blocking)
        else:
            holder.data = holder.data.to(dev, non_blocking=non_blocking)
    if moved and non_blocking and torch.cuda.is_available():
        torch.cuda.synchronize()
    ds_engine._offloaded = None


def _to_host(t: torch.Tensor, pin: bool, non_blocking: bool) -> torch.Tensor:
    out = host_empty(tuple(t.shape), t.dtype, pin)
    out.copy_(t, non_blocking=non_blocking)
    return out


class ThroughputTimer:
    """DeepSpeed's ``engine.tput_timer``: wall time and samples between optimizer steps.

    ``start()`` / ``stop(global_step=True)`` bracket a step (the engine calls them from forward and
    from a boundary ``step()``); :meth:`avg_samples_per_sec` is samples over the measured time.
    """

    def __init__(self, batch_size: int) -> None:
        self.batch_size = batch_size
        self.epoch_count = 0
        self.micro_step_count = 0
        self.global_step_count = 0
        self.total_elapsed_time = 0.0
        self.step_elapsed_time = 0.0
        self._started: float | None = None

    def update_epoch_count(self) -> None:
        self.epoch_count += 1
        self.micro_step_count = 0

    def start(self) -> None:
        if self._started is None:
            self._started = time.perf_counter()

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        self.micro_step_count += 1
        if global_step:
            self.global_step_count += 1
            if self._started is not None:
                self.step_elapsed_time = time.perf_counter() - self._started
                self.total_elapsed_time += self.step_elapsed_time
                self._started = None

    def avg_samples_per_sec(self) -> float:
        if self.global_step_count == 0 or self.total_elapsed_time == 0:
            return float("-inf")
        return self.batch_size * self.global_step_count / self.total_elapsed_time
