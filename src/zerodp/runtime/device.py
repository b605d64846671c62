"""The engine's device, its streams and events, and the one function every host sync goes through.

[Note: device] :func:`resolve_device` turns the config key ``device`` (zerodp's own: ``"auto"``,
``"cpu"``, ``"cuda"``) into a ``torch.device``, as DeepSpeed's engine does with its accelerator:
``"auto"`` is ``cuda:LOCAL_RANK`` when CUDA is available and the data-parallel group's backend takes
CUDA tensors (NCCL, e.g. :func:`zerodp.init_distributed`'s ``"cpu:gloo,cuda:nccl"``), the CPU
otherwise; ``"cuda"`` refuses a machine or a group that cannot; ``"cpu"`` is the CPU whatever the
machine has. Everything else asks the device's module (:func:`device_handle`, FSDP2's "device handle":
``torch.get_device_module(device)``), so the same lines run on the CPU, where ``torch.cpu``'s
``Stream``, ``Event``, ``current_stream`` and ``stream`` context are no-ops, and on a GPU.

[Note: host syncs] Every place the runtime waits for the device to read a value on the host (a flag,
a norm, a loss scale decision) calls :func:`synchronize` with a reason; :data:`HOST_SYNCS` counts them
per reason on every device (on the CPU the copy is free, but the count is the same), so a test on the
CPU sees how many host syncs a training step makes.

Its CUDA branches ran on one H200 at one rank (docs/gpu.md) and are covered on the CPU by tests with
``torch.cuda`` patched.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable
from typing import Any, overload

import torch
import torch.distributed as dist

#: the values of the config key ``device``
DEVICE_CHOICES = ("auto", "cpu", "cuda")

#: host syncs made through :func:`synchronize` since the last reset, per reason (tests read it)
HOST_SYNCS: Counter = Counter()


class DeviceError(ValueError):
    """The requested device cannot be used (no CUDA, a group without a CUDA backend, a module on
    another GPU); the message names both sides."""


def group_device_backends(group: dist.ProcessGroup | None = None) -> dict[str, str]:
    """Device type -> backend name of ``group`` (default: the world), e.g. ``{"cpu": "gloo", "cuda":
    "nccl"}`` for ``"cpu:gloo,cuda:nccl"``, ``{"cuda": "nccl"}`` for ``"nccl"`` (torch's
    ``get_backend_config``; a plain backend name takes the devices torch says it supports)."""
    try:
        config = str(dist.get_backend_config(group))
    except (AttributeError, RuntimeError, ValueError):
        config = str(dist.get_backend(group))
    out: dict[str, str] = {}
    for pair in config.lower().split(","):
        if ":" in pair:
            device, backend = pair.split(":", 1)
            out[device.strip()] = backend.strip()
        else:
            for device in dist.Backend.backend_capability.get(pair.strip(), ["cpu", "cuda"]):
                out[device] = pair.strip()
    return out


def group_takes(device_type: str, group: dist.ProcessGroup | None = None) -> bool:
    """Whether ``group``'s backend takes tensors of ``device_type`` ("cpu", "cuda")."""
    return device_type in group_device_backends(group)


def _local_cuda_index() -> int:
    """``LOCAL_RANK`` (torchrun) when set, else the current CUDA device; ``torch.cuda.set_device`` to
    it when it is not current (as DeepSpeed's engine does).

    Raises:
        DeviceError: ``LOCAL_RANK`` is not below ``torch.cuda.device_count()``.
    """
    count = torch.cuda.device_count()
    local = os.environ.get("LOCAL_RANK")
    index = int(local) if local is not None else torch.cuda.current_device()
    if index >= count:
        raise DeviceError(
            f"LOCAL_RANK is {index}, but this machine has {count} CUDA device(s): launch at most "
            f"{count} rank(s) per node, or set the config key device to 'cpu'"
        )
    if torch.cuda.current_device() != index:
        torch.cuda.set_device(index)
    return index


def resolve_device(choice: str = "auto", group: dist.ProcessGroup | None = None) -> torch.device:
    """The engine's device for the config key ``device`` (see [Note: device]).

    Args:
        choice: "auto", "cpu" or "cuda".
        group: the data-parallel group (None: the world); must be initialised.

    Returns:
        ``torch.device("cuda", LOCAL_RANK)`` or ``torch.device("cpu")``.

    Raises:
        DeviceError: ``choice`` is "cuda" and CUDA is not available or ``group``'s backend takes no
            CUDA tensors (names the backend); ``LOCAL_RANK`` names no device here.
        ValueError: ``choice`` is none of :data:`DEVICE_CHOICES`.
    """
    if choice not in DEVICE_CHOICES:
        raise ValueError(f"device must be one of {', '.join(DEVICE_CHOICES)}; got {choice!r}")
    if choice == "cpu":
        return torch.device("cpu")
    cuda = torch.cuda.is_available()
    takes_cuda = cuda and group_takes("cuda", group)
    if choice == "cuda" and not takes_cuda:
        why = (
            "torch.cuda.is_available() is False"
            if not cuda
            else f"the data-parallel group's backend ({dist.get_backend(group)}) takes no CUDA tensors"
        )
        raise DeviceError(
            f"config key device is 'cuda', but {why}; initialise with NCCL "
            "(zerodp.init_distributed() does on a CUDA machine) or set device to 'cpu' or 'auto'"
        )
    if not takes_cuda:
        return torch.device("cpu")
    return torch.device("cuda", _local_cuda_index())


def check_module_device(module: torch.nn.Module, device: torch.device) -> bool:
    """Whether ``module`` must be moved to ``device``: False when every parameter and buffer is there
    already (or it has none), True when they are all on the CPU or the meta device.

    Raises:
        DeviceError: some tensor is on another accelerator device than ``device`` (a model on
            ``cuda:1`` for an engine on ``cuda:0``), naming both devices and the tensor.
    """
    move = False
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        d = t.device
        if d == device:
            continue
        if d.type in ("cpu", "meta"):
            move = True
            continue
        raise DeviceError(
            f"the model's tensor '{name}' is on {d}, but this rank's engine device is {device} "
            "(cuda:LOCAL_RANK); build the model on the CPU or on that device, or set the config "
            "key device"
        )
    return move


def place_module(module: torch.nn.Module, device: torch.device) -> None:
    """Move ``module`` to ``device`` (``module.to(device)``) unless it is there already.

    Raises:
        DeviceError: see :func:`check_module_device`.
    """
    if check_module_device(module, device):
        module.to(device)


def device_handle(device: torch.device) -> Any:
    """``torch.get_device_module(device)``: ``torch.cuda`` or ``torch.cpu`` (whose streams and events
    are no-ops), the module streams, events and ``synchronize`` are taken from."""
    return torch.get_device_module(device)


def current_stream(device: torch.device) -> Any:
    """The stream work on ``device`` is issued to now (a no-op stream on the CPU)."""
    return device_handle(device).current_stream()


def new_stream(device: torch.device) -> Any:
    """A new stream on ``device`` (a no-op one on the CPU)."""
    return device_handle(device).Stream()


def new_event(device: torch.device) -> Any:
    """A new event on ``device`` (a no-op one, always complete, on the CPU)."""
    return device_handle(device).Event()


def wait_stream(waiter: Any, producer: Any) -> None:
    """Make ``waiter`` (a stream) wait for the work issued to ``producer`` so far; no host sync."""
    waiter.wait_stream(producer)


def use_stream(device: torch.device, stream: Any) -> Any:
    """Context manager: issue work on ``device`` to ``stream`` inside it."""
    return device_handle(device).stream(stream)


@overload
def synchronize(reason: str, value: torch.Tensor) -> torch.Tensor: ...
@overload
def synchronize(reason: str, value: None = None, device: torch.device | None = None) -> None: ...


def synchronize(
    reason: str, value: torch.Tensor | None = None, device: torch.device | None = None
) -> torch.Tensor | None:
    """The one host sync of the runtime (see [Note: host syncs]), counted in :data:`HOST_SYNCS`.

    Args:
        reason: what the host waits for (a short fixed string: the key of the count).
        value: a tensor whose value the host needs: returned on the CPU (the tensor itself when it is
            there already); the copy waits for the device.
        device: with no ``value``, wait for all work on ``device`` (its module's ``synchronize``).

    Returns:
        ``value`` on the CPU, or None.
    """
    HOST_SYNCS[reason] += 1
    if value is not None:
        return value if value.device.type == "cpu" else value.cpu()
    if device is not None:
        device_handle(device).synchronize(device)
    return None


def wait_event(reason: str, event: Any) -> None:
    """Block the host until ``event`` (a device event) has completed, counted in :data:`HOST_SYNCS`
    under ``reason`` (e.g. the CPU about to read a gradient copied from the device)."""
    HOST_SYNCS[reason] += 1
    event.synchronize()


def host_flags(reason: str, flags: list[torch.Tensor]) -> list[bool]:
    """The values of ``flags`` (0-d bool tensors, e.g. ``t.isfinite().all()`` per tensor) on the host,
    in order, with one :func:`synchronize` per device they are on (not one per flag)."""
    by_device: dict[torch.device, list[int]] = {}
    for i, f in enumerate(flags):
        by_device.setdefault(f.device, []).append(i)
    out = [False] * len(flags)
    for positions in by_device.values():
        values = synchronize(reason, torch.stack([flags[i].reshape(()) for i in positions])).tolist()
        for i, v in zip(positions, values, strict=True):
            out[i] = bool(v)
    return out


def all_finite(tensors: Iterable[torch.Tensor], reason: str) -> bool:
    """Whether every element of every tensor is finite (no inf/nan), with one :func:`synchronize` per
    device (the fp16 overflow check, ``engine.parameters_finite``). True for no tensors."""
    return all(host_flags(reason, [torch.isfinite(t).all() for t in tensors]))


def device_of(tensors: Iterable[torch.Tensor]) -> torch.device:
    """The device of the first of ``tensors`` (the engine's device, read from its flat groups or
    shards: a shard whose storage is offloaded keeps its device); the CPU for none."""
    for t in tensors:
        return t.device
    return torch.device("cpu")


def is_accelerator(device: torch.device) -> bool:
    """Whether ``device`` is not the host: the offloads then copy between it and host memory (copy
    stream, pinned buffers, host homes of shards). The one place that decision is read from (tests on a
    CPU-only machine make it True to run the device code path with CPU tensors and no-op streams)."""
    return device.type != "cpu"


def pinning_available() -> bool:
    """Whether page-locked host memory can be allocated: a CUDA runtime is present (torch pins through
    it; on a CPU-only build ``pin_memory=True`` raises)."""
    return torch.cuda.is_available()


def resolve_pin_memory(value: bool | None, device: torch.device) -> bool:
    """The ``pin_memory`` of an offload section (``offload_optimizer``, ``offload_param``) or of
    ``zero.Init``: None (unset) is True when the engine's ``device`` is an accelerator (CUDA), as
    DeepSpeed's docs recommend pinned host buffers there, and False on the CPU; a bool is kept."""
    return is_accelerator(device) if value is None else bool(value)


def _page_locked_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(..., pin_memory=True)`` (tests on a CPU-only machine replace it to record requests)."""
    return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=True)


def host_empty(shape: int | tuple[int, ...], dtype: torch.dtype = torch.float32, pin: bool = False) -> torch.Tensor:
    """An uninitialised host tensor, page-locked when ``pin`` and :func:`pinning_available` (else
    pageable, silently: pinning only speeds up copies to and from a device). Every pinned host buffer of
    the offloads, ``zero.Init`` and the swap pools is allocated here."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    if pin and pinning_available():
        return _page_locked_empty(shape, dtype)
    return torch.empty(shape, dtype=dtype, device="cpu")


def host_syncs() -> int:
    """Host syncs made through :func:`synchronize` since the last :func:`reset_host_syncs`."""
    return sum(HOST_SYNCS.values())


def reset_host_syncs() -> None:
    HOST_SYNCS.clear()
