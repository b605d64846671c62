"""Fixtures of the in-process unit tier (``make test-unit``): no torchrun, no subprocesses.

Collectives run on a default process group created inside the pytest process:

- :func:`world1`: gloo on a ``HashStore``, rank 0 of a world of one. Collectives are real (an
  all-reduce of one rank is the identity), so values can be compared with autograd's.
- :func:`fake_world`: torch's fake process group (``backend="fake"``, ``FakeStore``) for any rank of
  any world size. Its collectives do nothing and leave outputs unwritten: only shapes, plans and
  state transitions may be asserted under it, never values.

Each fixture destroys the default group it made when the test ends. A default group left by an
earlier in-process test of the torchrun tier (``zerodp.init_distributed()`` in a plain process) is
destroyed first; a later ``zerodp.init_distributed()`` creates a fresh one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


@contextlib.contextmanager
def default_group(backend: str, rank: int, world_size: int) -> Iterator[ProcessGroup]:
    """Make a default process group of ``backend`` ("gloo" or "fake") for the duration of the block."""
    if dist.is_initialized():
        dist.destroy_process_group()
    if backend == "fake":
        from torch.testing._internal.distributed.fake_pg import FakeStore

        store: dist.Store = FakeStore()
    else:
        store = dist.HashStore()
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.fixture
def world1() -> Iterator[ProcessGroup]:
    """A real gloo default group of one rank."""
    with default_group("gloo", 0, 1) as pg:
        yield pg


@pytest.fixture
def fake_world() -> Iterator[Callable[[int, int], ProcessGroup]]:
    """``fake_world(rank, world_size)``: a fake default group (no communication; shapes only)."""
    stack = contextlib.ExitStack()

    def make(rank: int, world_size: int) -> ProcessGroup:
        stack.close()
        return stack.enter_context(default_group("fake", rank, world_size))

    with stack:
        yield make


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
