"""Checks shared by the NVMe offload tests (tests/test_offload.py: optimizer states; tests/test_param_offload.py:
parameters): the swap-path errors name the config key, the path and the bytes, and a job that dies
by an exception leaves no swap file behind."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from distributed import run_python
from zerodp.offload.nvme import OffloadError


def assert_nvme_path_errors(build: Callable[[str], Any], tmp_path: Path, key: str) -> None:
    """``build(nvme_path)`` raises :class:`OffloadError` naming ``key`` (``offload_optimizer.nvme_path``)
    and the path for a missing path and for an unwritable one (a regular file when running as root,
    which ignores permission bits)."""
    with pytest.raises(OffloadError, match=f"{key} '{tmp_path}/nope' does not exist"):
        build(str(tmp_path / "nope"))
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    if os.access(ro, os.W_OK):
        (tmp_path / "file").write_text("x")
        with pytest.raises(OffloadError, match=f"{key} '{tmp_path}/file' .*not a directory"):
            build(str(tmp_path / "file"))
    else:
        with pytest.raises(OffloadError, match=f"{key} '{ro}' is not writable"):
            build(str(ro))
    if os.path.isdir("/proc"):  # a directory where no file can be created, even by root
        with pytest.raises(OffloadError, match=f"{key} '/proc' is not writable: .*Errno") as err:
            build("/proc")
        assert "bytes are free" not in str(err.value), err.value


def full_disk_error(build: Callable[[str], Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: str) -> str:
    """``build(tmp_path)`` while ``module``'s ``shutil.disk_usage`` reports 1,000 free bytes: the
    :class:`OffloadError` message, checked to name the path and the free bytes."""
    real = shutil.disk_usage
    monkeypatch.setattr(f"{module}.shutil.disk_usage", lambda p: real(p)._replace(free=1000))
    with pytest.raises(OffloadError) as err:
        build(str(tmp_path))
    msg = str(err.value)
    assert str(tmp_path) in msg and "1,000 bytes are free" in msg, msg
    return msg


def assert_swap_removed_after_exception(zero: dict, tmp_path: Path, swap_glob: str) -> None:
    """A fresh interpreter trains one step of ``nn.Linear(8, 8)`` with ``zero_optimization = zero``
    (swap files under ``tmp_path``), sees one swap file matching ``swap_glob`` and dies by an
    exception: nothing is left under ``tmp_path``."""
    script = (
        f"import pathlib, torch, zerodp\nfrom torch import nn\n"
        f"e = zerodp.initialize(nn.Linear(8, 8), {{'zero_optimization': {zero!r}}})\n"
        f"e.backward(e(torch.ones(2, 8)).sum()); e.step()\n"
        f"assert len(list(pathlib.Path({str(tmp_path)!r}).rglob({swap_glob!r}))) == 1\n"
        f"raise RuntimeError('boom')\n"
    )
    proc = run_python(script)
    assert "boom" in proc.stderr and proc.returncode != 0, proc.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []
