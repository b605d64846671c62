"""The collective guard's wait for a data collective (zerodp.runtime.comm.wait_polling): it never calls
``Work.wait`` with a timeout (on NCCL a timed-out wait aborts the communicator), polls
``is_completed()`` for host collectives with the agreement checks in between, and leaves device
collectives to stream ordering. Fake ``Work`` objects; the distributed cases (mismatch, lost rank,
timeout) are tests/test_collective_guard.py and tests/test_backward_guard.py."""

from __future__ import annotations

import time
from typing import NoReturn

import pytest
import torch

from zerodp.runtime import comm


class FakeWork:
    """Completes after ``polls`` calls of is_completed(); ``wait`` refuses a timeout."""

    def __init__(self, polls: int, error: Exception | None = None) -> None:
        self.polls, self.error = polls, error
        self.asked, self.waited = 0, 0

    def is_completed(self) -> bool:
        self.asked += 1
        return self.asked > self.polls

    def wait(self, timeout=None) -> bool:
        assert timeout is None, "a timed wait: on NCCL it would abort the communicator"
        self.waited += 1
        if self.error is not None:
            raise self.error
        return True


class Failed(Exception):
    pass


def fail(exc: BaseException) -> NoReturn:
    raise Failed(exc)


def test_host_wait_polls_and_checks_between(monkeypatch):
    monkeypatch.setattr(comm, "POLL_S", 0.0)  # check the agreements after every poll
    checks = []
    work = FakeWork(polls=5)
    comm.wait_polling(work, 10.0, "backward", fail, lambda: checks.append(1))
    assert work.asked == 6 and work.waited == 1
    assert len(checks) == 5


def test_host_wait_times_out_within_timeout(monkeypatch):
    work = FakeWork(polls=10**9)
    t0 = time.monotonic()
    with pytest.raises(Failed, match="forward collective timed out after 0.2 s"):
        comm.wait_polling(work, 0.2, "forward", fail, lambda: None)
    assert 0.2 <= time.monotonic() - t0 < 2.0
    assert work.waited == 0


def test_host_wait_failure_goes_to_on_failure():
    work = FakeWork(polls=0, error=RuntimeError("Connection closed by peer"))
    with pytest.raises(Failed, match="Connection closed by peer"):
        comm.wait_polling(work, 5.0, "backward", fail, lambda: None)


def test_device_wait_does_not_block_the_host():
    checks = []
    work = FakeWork(polls=10**9)  # never completes: a host wait would hang until the timeout
    t0 = time.monotonic()
    comm.wait_polling(work, 30.0, "backward", fail, lambda: checks.append(1), on_device=True)
    assert time.monotonic() - t0 < 1.0
    assert work.asked == 0 and work.waited == 1 and checks == [1]


def test_watched_work_knows_where_its_tensors_are():
    seen = []
    ledger = comm.CommLedger(watch=lambda work, on_device: seen.append(on_device))
    comm._watched(FakeWork(0), True, ledger, torch.zeros(1)).wait()
    comm._watched(FakeWork(0), True, ledger, torch.zeros(1, device="meta")).wait()
    comm.watch(FakeWork(0), ledger, torch.device("meta")).wait()
    comm.watch(FakeWork(0), ledger).wait()
    assert seen == [False, True, True, False]
    unwatched = FakeWork(0)
    assert comm.watch(unwatched, comm.CommLedger()) is unwatched  # another engine's ledger: plain waits
