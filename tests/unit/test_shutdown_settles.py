"""``zerodp.shutdown_distributed`` ends a process group so that gloo's worker threads never need the GIL
during interpreter finalization ([Note: gloo teardown abort] in zerodp.runtime.comm): it drops zerodp's
own references to the groups (the control-group cache) and releases the GIL for ``SETTLE_S`` after
destroying the group; ``init_distributed`` registers the same settle with atexit, once per process.
The abort itself is a rare race (7 in 217 runs before the fix); tests/test_config_agreement.py runs the
worker where it was seen."""

from __future__ import annotations

import atexit

import pytest
import torch
import torch.distributed as dist

from zerodp.runtime import comm, control


def test_shutdown_drops_group_references_and_releases_the_gil(monkeypatch: pytest.MonkeyPatch) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    monkeypatch.delenv("RANK", raising=False)
    registered: list = []
    monkeypatch.setattr(atexit, "register", registered.append)
    monkeypatch.setattr(comm, "_AT_EXIT", [])
    comm.init_distributed(backend="gloo")
    comm.init_distributed(backend="gloo")  # already initialised: nothing registered twice
    assert registered == [comm.settle_worker_threads]
    flag = torch.ones(1)
    comm.all_reduce(flag, None, comm.CommLedger(), "test")  # a control collective fills the cache
    assert control._CONTROL, "the control-group cache was not used"
    slept: list[float] = []
    monkeypatch.setattr(comm.time, "sleep", slept.append)
    order: list[str] = []
    monkeypatch.setattr(control, "forget", lambda: (order.append("forget"), control._CONTROL.clear()))
    real_destroy = dist.destroy_process_group
    monkeypatch.setattr(dist, "destroy_process_group", lambda: (order.append("destroy"), real_destroy()))
    comm.shutdown_distributed()
    assert not dist.is_initialized()
    assert order == ["destroy", "forget"]
    assert not control._CONTROL
    assert slept == [comm.SETTLE_S] and comm.SETTLE_S > 0
