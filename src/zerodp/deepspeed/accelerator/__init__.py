"""``deepspeed.accelerator``: :func:`get_accelerator` returns an object with DeepSpeed's accelerator
methods over ``torch.cuda`` (when CUDA is available) or the host (CPU).

DeepSpeed's CPU accelerator answers ``communication_backend_name()`` with ``"ccl"`` (oneCCL); zerodp's
answers ``"gloo"``, the backend it runs on CPUs. Memory statistics on CPU are those of the process
(``memory_allocated``: resident set size; ``total_memory`` / ``available_memory``: the machine's), as
DeepSpeed's CPU accelerator reports them through psutil. ``set_accelerator`` takes one of these
objects; other accelerators (XPU, HPU, NPU, MPS) are not implemented.
"""

from __future__ import annotations

import os

import torch

from zerodp.deepspeed.accelerator.devices import CPU_Accelerator, CUDA_Accelerator, DeviceAccelerator

_accelerator: DeviceAccelerator | None = None


def get_accelerator() -> DeviceAccelerator:
    """The accelerator of this process: CUDA when ``torch.cuda.is_available()`` (or
    ``DS_ACCELERATOR=cuda``), else CPU; ``DS_ACCELERATOR=cpu`` forces CPU.

    Raises:
        NotImplementedError: ``DS_ACCELERATOR`` names another accelerator, or ``cuda`` without CUDA.
    """
    global _accelerator
    if _accelerator is None:
        wanted = os.environ.get("DS_ACCELERATOR")
        if wanted not in (None, "cpu", "cuda"):
            raise NotImplementedError(f"DS_ACCELERATOR={wanted!r} is not implemented in zerodp; allowed: cpu, cuda")
        if wanted == "cuda" and not torch.cuda.is_available():
            raise NotImplementedError("DS_ACCELERATOR=cuda but torch.cuda.is_available() is False")
        use_cuda = wanted == "cuda" or (wanted is None and torch.cuda.is_available())
        _accelerator = CUDA_Accelerator() if use_cuda else CPU_Accelerator()
    return _accelerator


def set_accelerator(accel_obj: DeviceAccelerator) -> None:
    """Use ``accel_obj`` (a :class:`CPU_Accelerator` or :class:`CUDA_Accelerator`) from now on."""
    global _accelerator
    if not isinstance(accel_obj, DeviceAccelerator):
        raise TypeError(f"set_accelerator takes a zerodp accelerator (cpu or cuda), got {type(accel_obj).__name__}")
    _accelerator = accel_obj


def is_current_accelerator_supported() -> bool:
    return get_accelerator().device_name() in ("cpu", "cuda")


__all__ = [
    "get_accelerator",
    "set_accelerator",
    "is_current_accelerator_supported",
    "CPU_Accelerator",
    "CUDA_Accelerator",
]
