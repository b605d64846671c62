"""Where ``zerodp bench`` runs its systems: ``--device cpu|cuda|auto``.

``cpu`` (the default) pins every system, its batches and its timing to the CPU, whatever the machine
has. ``cuda`` puts each rank on ``cuda:LOCAL_RANK`` (:func:`zerodp.runtime.device.resolve_device`, which
calls ``torch.cuda.set_device``; the process group is :func:`zerodp.init_distributed`'s
``"cpu:gloo,cuda:nccl"``), and is refused before anything runs on a machine without CUDA. ``auto`` is
``cuda`` when ``torch.cuda.is_available()``, else ``cpu``.

On a device other than the CPU: timings synchronize the device before reading the clock
(:func:`synchronize`, the device module's ``synchronize``), each system's peak device memory per rank
is ``torch.cuda.max_memory_allocated`` (bytes) after its probe, the counter being reset before it is
built (:func:`reset_peak_memory`, :func:`peak_memory`); the offload rows are skipped (they time the host
pipeline with the host as the device; offload from a GPU: tools/gpu_offload_headline.py) and so is the
fresh-process RSS (a forked child cannot use CUDA).

It ran on one H200 at one rank (docs/benchmarks/2026-12-04-first-gpu-run.md); its CUDA branches are
tested on the CPU with ``torch.cuda`` patched.
"""

from __future__ import annotations

import torch

from zerodp.runtime.device import device_handle, resolve_device

CPU = torch.device("cpu")

#: the values of ``--device`` (the first is the default)
DEVICE_CHOICES = ("cpu", "cuda", "auto")

#: the reason the offload rows give on a GPU
OFFLOAD_ON_GPU = (
    "the bench's offload rows are refused on a GPU (they time the host pipeline with the host as the "
    "device): run with --device cpu, or tools/gpu_offload_headline.py for offload from a GPU (docs/gpu.md)"
)

#: the reason the fresh-process RSS is not measured on a GPU
FRESH_RSS_ON_GPU = "measured with --device cpu only (a forked child process cannot use CUDA)"


def device_type(choice: str) -> str:
    """The device type ``--device choice`` resolves to on this machine: "cuda" or "cpu" (known before
    the process group exists: :func:`zerodp.init_distributed` takes NCCL exactly when CUDA is available).

    Raises:
        ValueError: ``choice`` is none of :data:`DEVICE_CHOICES`, or it is "cuda" and
            ``torch.cuda.is_available()`` is False.
    """
    if choice not in DEVICE_CHOICES:
        raise ValueError(f"--device must be one of {', '.join(DEVICE_CHOICES)}, got {choice!r}")
    cuda = torch.cuda.is_available()
    if choice == "cuda" and not cuda:
        raise ValueError(
            f"--device cuda needs a CUDA device, but torch.cuda.is_available() is False here "
            f"(torch {torch.__version__}); use --device cpu, or auto"
        )
    return "cuda" if choice == "cuda" or (choice == "auto" and cuda) else "cpu"


def check_device(choice: str, offload: bool) -> None:
    """Refuse, before anything runs, a ``--device`` the machine cannot honour, and ``--offload`` with
    ``--device cuda`` (the bench's offload rows run with the host as the device).

    Raises:
        ValueError: see :func:`device_type`; ``--offload`` with ``--device cuda``.
    """
    device_type(choice)
    if offload and choice == "cuda":
        raise ValueError(f"--offload cannot run with --device cuda: {OFFLOAD_ON_GPU}")


def resolve(choice: str) -> torch.device:
    """This rank's device for ``--device choice``, after :func:`zerodp.init_distributed`:
    ``cuda:LOCAL_RANK`` (made current) or the CPU.

    Raises:
        zerodp.runtime.device.DeviceError: "cuda" where the default group takes no CUDA tensors.
    """
    return resolve_device(device_type(choice))


def synchronize(device: torch.device) -> None:
    """Wait for all work issued on ``device`` (no-op on the CPU), before the clock is read."""
    device_handle(device).synchronize(device)


def reset_peak_memory(device: torch.device) -> None:
    """Restart ``device``'s peak-memory counter (``torch.cuda.reset_peak_memory_stats``); no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> int | None:
    """Bytes of ``device`` memory allocated at the peak since :func:`reset_peak_memory`
    (``torch.cuda.max_memory_allocated``); None on the CPU (its memory is the RSS columns')."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.max_memory_allocated(device))


def to_device(
    batches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``batches`` (token ids, int64 [micro, seq_len]) on ``device`` (the same tensors on the CPU)."""
    return [(x.to(device), y.to(device)) for x, y in batches]
