"""The device tests run on: ``ZERODP_TEST_DEVICE`` (``cpu``, the default, or ``cuda``).

With ``cuda`` each rank trains on ``cuda:LOCAL_RANK`` (process group ``cpu:gloo,cuda:nccl`` from
:func:`zerodp.init_distributed`) and the plain-PyTorch reference runs on the same device; a test
needing more ranks than there are GPUs skips with the reason (:func:`skip_beyond_devices`). Tests
that only make sense on a GPU carry the ``cuda`` marker (registered in pyproject.toml), skipped with
a reason where CUDA is absent (tests/conftest.py). ``ZERODP_TEST_WORLD_SIZES`` (e.g. ``1`` or ``1,2``;
unset: all) skips the tests of other world sizes, so that tools/gpu_check.sh runs one world size per
time-boxed part. Nothing here has run on a GPU yet (docs/gpu.md).
"""

from __future__ import annotations

import os

import pytest
import torch

CHOICES = ("cpu", "cuda")


def device_type() -> str:
    """``ZERODP_TEST_DEVICE``: "cpu" (default) or "cuda".

    Raises:
        ValueError: another value (names the variable and what is allowed).
    """
    value = os.environ.get("ZERODP_TEST_DEVICE", "cpu").strip().lower() or "cpu"
    if value not in CHOICES:
        raise ValueError(f"ZERODP_TEST_DEVICE must be one of {', '.join(CHOICES)}; got {value!r}")
    return value


def rank_device() -> torch.device:
    """This rank's device: the CPU, or ``cuda:LOCAL_RANK`` (call inside a worker)."""
    if device_type() == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def engine_config() -> dict:
    """The config key that puts the engine on the test device (``device`` "cpu" or "cuda")."""
    return {"device": device_type()}


def too_many_ranks(world_size: int) -> str | None:
    """Why ``world_size`` ranks cannot run on the test device, or are not asked for by
    ``ZERODP_TEST_WORLD_SIZES`` (None when they can and are).

    Raises:
        ValueError: ``ZERODP_TEST_WORLD_SIZES`` is not a comma-separated list of whole numbers.
    """
    sizes = os.environ.get("ZERODP_TEST_WORLD_SIZES", "").replace(" ", "")
    if sizes:
        if not all(s.isdigit() for s in sizes.split(",")):
            raise ValueError(f"ZERODP_TEST_WORLD_SIZES must be whole numbers separated by commas; got {sizes!r}")
        if world_size not in {int(s) for s in sizes.split(",")}:
            return f"world size {world_size} is not in ZERODP_TEST_WORLD_SIZES={sizes}"
    if device_type() == "cpu":
        return None
    if not torch.cuda.is_available():
        return "ZERODP_TEST_DEVICE=cuda, but torch.cuda.is_available() is False"
    count = torch.cuda.device_count()
    if world_size > count:
        return f"{world_size} ranks need {world_size} GPUs (one per rank); this machine has {count}"
    return None


def skip_beyond_devices(world_size: int) -> None:
    """Skip the calling test, with the reason, when ``world_size`` ranks cannot run on the test device."""
    reason = too_many_ranks(world_size)
    if reason is not None:
        pytest.skip(reason)
