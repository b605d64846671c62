"""Test-session hooks: the ``cuda`` marker (pyproject.toml) skips with a reason where CUDA is absent."""

from __future__ import annotations

import pytest
import torch


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("cuda") is not None and not torch.cuda.is_available():
        pytest.skip("marked cuda: needs a CUDA device (torch.cuda.is_available() is False here)")
