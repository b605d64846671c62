"""The two accelerators :func:`zerodp.deepspeed.accelerator.get_accelerator` returns, with DeepSpeed's
method names (``deepspeed/accelerator/abstract_accelerator.py``): device naming, RNG, streams and
events, memory statistics (bytes), dtype support and the communication backend."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

import torch

DeviceIndex = int | torch.device | None


class DeviceAccelerator:
    """What both accelerators share; subclasses set ``_name`` and ``_communication_backend_name``."""

    _name = ""
    _communication_backend_name = ""

    # ---- naming and devices ------------------------------------------------------------------------
    def device_name(self, device_index: DeviceIndex = None) -> str:
        """``"cuda"`` / ``"cpu"``, or ``"cuda:1"`` given an index."""
        if device_index is None or self._name == "cpu":
            return self._name
        return f"{self._name}:{_index(device_index)}"

    def current_device(self) -> int:
        raise NotImplementedError(f"{type(self).__name__}.current_device")  # each accelerator defines it

    def is_bf16_supported(self) -> bool:
        raise NotImplementedError(f"{type(self).__name__}.is_bf16_supported")  # each accelerator defines it

    def current_device_name(self) -> str:
        return self.device_name(self.current_device()) if self._name != "cpu" else "cpu"

    def device(self, device_index: DeviceIndex = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def communication_backend_name(self) -> str:
        return self._communication_backend_name

    def is_synchronized_device(self) -> bool:
        """True when kernels run synchronously with the host (CPU)."""
        return self._name == "cpu"

    def use_host_timers(self) -> bool:
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        return self.is_synchronized_device()

    # ---- RNG ---------------------------------------------------------------------------------------
    def random(self) -> Any:
        return torch.random

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.initial_seed()

    # ---- dtypes ------------------------------------------------------------------------------------
    def is_fp16_supported(self) -> bool:
        return True

    def supported_dtypes(self) -> list[torch.dtype]:
        out = [torch.float32]
        if self.is_fp16_supported():
            out.append(torch.float16)
        if self.is_bf16_supported():
            out.append(torch.bfloat16)
        return out

    def is_triton_supported(self) -> bool:
        return False

    # ---- misc --------------------------------------------------------------------------------------
    def lazy_call(self, callback: Callable[[], Any]) -> Any:
        return callback()

    def range_push(self, msg: str) -> None:
        """A profiler range (NVTX on CUDA); nothing on CPU."""

    def range_pop(self) -> None:
        """Ends :meth:`range_push`'s range."""

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if torch.cuda.is_available() else tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned() if torch.cuda.is_available() else False

    def amp(self) -> Any:
        return torch.amp

    def export_envs(self) -> list[str]:
        return []

    def visible_devices_envs(self) -> list[str]:
        return ["CUDA_VISIBLE_DEVICES"] if self._name == "cuda" else []

    def __repr__(self) -> str:
        return f"<zerodp accelerator {self._name} ({self._communication_backend_name})>"


class CUDA_Accelerator(DeviceAccelerator):
    """``torch.cuda`` under DeepSpeed's names."""

    _name = "cuda"
    _communication_backend_name = "nccl"

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def set_device(self, device_index: DeviceIndex) -> None:
        torch.cuda.set_device(device_index)

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def synchronize(self, device_index: DeviceIndex = None) -> None:
        torch.cuda.synchronize(device_index)

    def get_rng_state(self, device_index: DeviceIndex = None) -> torch.Tensor:
        return torch.cuda.get_rng_state("cuda" if device_index is None else device_index)

    def set_rng_state(self, new_state: torch.Tensor, device_index: DeviceIndex = None) -> None:
        torch.cuda.set_rng_state(new_state, "cuda" if device_index is None else device_index)

    def manual_seed(self, seed: int) -> None:
        torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.cuda.manual_seed_all(seed)

    def default_generator(self, device_index: int) -> torch.Generator:
        return torch.cuda.default_generators[device_index]

    @property
    def Stream(self) -> type:
        return torch.cuda.Stream

    @property
    def Event(self) -> type:
        return torch.cuda.Event

    def stream(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)

    def current_stream(self, device_index: DeviceIndex = None) -> Any:
        return torch.cuda.current_stream(device_index)

    def default_stream(self, device_index: DeviceIndex = None) -> Any:
        return torch.cuda.default_stream(device_index)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def memory_allocated(self, device_index: DeviceIndex = None) -> int:
        return torch.cuda.memory_allocated(device_index)

    def max_memory_allocated(self, device_index: DeviceIndex = None) -> int:
        return torch.cuda.max_memory_allocated(device_index)

    def reset_max_memory_allocated(self, device_index: DeviceIndex = None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    def memory_reserved(self, device_index: DeviceIndex = None) -> int:
        return torch.cuda.memory_reserved(device_index)

    def max_memory_reserved(self, device_index: DeviceIndex = None) -> int:
        return torch.cuda.max_memory_reserved(device_index)

    memory_cached = memory_reserved
    max_memory_cached = max_memory_reserved

    def reset_max_memory_cached(self, device_index: DeviceIndex = None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    def reset_peak_memory_stats(self, device_index: DeviceIndex = None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    def memory_stats(self, device_index: DeviceIndex = None) -> dict[str, Any]:
        return torch.cuda.memory_stats(device_index)

    def total_memory(self, device_index: DeviceIndex = None) -> int:
        return torch.cuda.get_device_properties(_index(device_index) or 0).total_memory

    def available_memory(self, device_index: DeviceIndex = None) -> int:
        return torch.cuda.mem_get_info(device_index)[0]

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported()

    def is_fp16_supported(self) -> bool:
        return True

    def range_push(self, msg: str) -> None:
        torch.cuda.nvtx.range_push(msg)

    def range_pop(self) -> None:
        torch.cuda.nvtx.range_pop()


class CPU_Accelerator(DeviceAccelerator):
    """The host under DeepSpeed's names: one device, synchronous, memory from the process and the
    machine (bytes)."""

    _name = "cpu"
    _communication_backend_name = "gloo"

    def __init__(self) -> None:
        self._peak = 0

    def is_available(self) -> bool:
        return True

    def set_device(self, device_index: DeviceIndex) -> None:
        """One host device: nothing to select."""

    def current_device(self) -> int:
        return int(os.environ.get("LOCAL_RANK", 0))

    def device_count(self) -> int:
        """DeepSpeed's CPU accelerator counts NUMA sockets for its launcher; zerodp runs the ranks
        torchrun starts, so this is ``LOCAL_WORLD_SIZE`` (1 without torchrun)."""
        return int(os.environ.get("LOCAL_WORLD_SIZE", 1))

    def synchronize(self, device_index: DeviceIndex = None) -> None:
        """CPU kernels are synchronous: nothing to wait for."""

    def get_rng_state(self, device_index: DeviceIndex = None) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: DeviceIndex = None) -> None:
        torch.set_rng_state(new_state)

    def default_generator(self, device_index: int) -> torch.Generator:
        return torch.default_generator

    @property
    def Stream(self) -> Any:
        return _NoStream

    @property
    def Event(self) -> Any:
        return _NoEvent

    def stream(self, stream: Any) -> Any:
        return contextlib.nullcontext()

    def current_stream(self, device_index: DeviceIndex = None) -> Any:
        return _NoStream()

    default_stream = current_stream

    def empty_cache(self) -> None:
        """The host allocator returns memory itself."""

    def memory_allocated(self, device_index: DeviceIndex = None) -> int:
        rss = _rss()
        self._peak = max(self._peak, rss)
        return rss

    def max_memory_allocated(self, device_index: DeviceIndex = None) -> int:
        return max(self._peak, self.memory_allocated())

    def reset_max_memory_allocated(self, device_index: DeviceIndex = None) -> None:
        self._peak = _rss()

    memory_reserved = memory_allocated
    max_memory_reserved = max_memory_allocated
    memory_cached = memory_allocated
    max_memory_cached = max_memory_allocated
    reset_max_memory_cached = reset_max_memory_allocated
    reset_peak_memory_stats = reset_max_memory_allocated

    def memory_stats(self, device_index: DeviceIndex = None) -> dict[str, Any]:
        now = self.memory_allocated()
        return {"allocated_bytes.all.current": now, "allocated_bytes.all.peak": self._peak}

    def total_memory(self, device_index: DeviceIndex = None) -> int:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def available_memory(self, device_index: DeviceIndex = None) -> int:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")

    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        """torch runs fp16 on CPU (zerodp's fp16 tests do)."""
        return True


class _NoStream:
    """A CPU stand-in for a CUDA stream: work is already ordered."""

    def synchronize(self) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass


class _NoEvent:
    """A CPU stand-in for a CUDA event."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True


def _index(device_index: DeviceIndex) -> int | None:
    if isinstance(device_index, torch.device):
        return device_index.index
    return device_index


def _rss() -> int:
    """Resident set size of this process, bytes (Linux ``/proc``; 0 where it cannot be read)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
