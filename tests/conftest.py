"""Test-session hooks: the ``cuda`` marker (pyproject.toml) skips with a reason where CUDA is absent; the host
offload pipeline runs on the CPU too (``ZERODP_HOST_OFFLOAD_ON_CPU``)."""

from __future__ import annotations

import os

import pytest
import torch

# on this CPU-only suite, offload_optimizer.device "cpu" still runs the host pipeline (zerodp.offload.build:
# by default it is off when training runs on the CPU); tests of the default delete this variable
os.environ.setdefault("ZERODP_HOST_OFFLOAD_ON_CPU", "1")


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("cuda") is not None and not torch.cuda.is_available():
        pytest.skip("marked cuda: needs a CUDA device (torch.cuda.is_available() is False here)")
