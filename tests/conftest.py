"""Test-session hooks: the ``cuda`` marker (pyproject.toml) skips with a reason where CUDA is absent; the host
offload pipeline runs on the CPU too (``ZERODP_HOST_OFFLOAD_ON_CPU``); every temporary file of the session
(its own and its launched processes', through ``TMPDIR``) lives in one directory removed at its end."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest
import torch

# on this CPU-only suite, offload_optimizer.device "cpu" still runs the host pipeline (zerodp.offload.build:
# by default it is off when training runs on the CPU); tests of the default delete this variable
os.environ.setdefault("ZERODP_HOST_OFFLOAD_ON_CPU", "1")
# every worker process the tests start (torchrun, the fork launcher's zygote and its ranks, CLI runs)
# dumps each thread's Python stack on a fatal signal (SIGSEGV, SIGABRT from a glibc heap check), so a
# crash names the code that was running
os.environ.setdefault("PYTHONFAULTHANDLER", "1")


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("cuda") is not None and not torch.cuda.is_available():
        pytest.skip("marked cuda: needs a CUDA device (torch.cuda.is_available() is False here)")


@pytest.fixture(scope="session", autouse=True)
def session_tmpdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``TMPDIR`` (and :mod:`tempfile`'s default) for the session: one fresh directory, removed at its end.

    Workers' and tests' ``tempfile.mkdtemp()`` scratch (checkpoint and NVMe directories, DS-Chat's output
    directory) and torchrun's own directories otherwise stayed in /tmp after every run. pytest's
    ``tmp_path`` keeps its own base directory (fixed before the switch).
    """
    tmp_path_factory.getbasetemp()
    scratch = tempfile.mkdtemp(prefix="zerodp-tests-")
    saved = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"], tempfile.tempdir = scratch, scratch
    try:
        yield scratch
    finally:
        if saved[0] is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved[0]
        tempfile.tempdir = saved[1]
        shutil.rmtree(scratch, ignore_errors=True)
