"""Rank-divergent generation loops at stage 3: :func:`synced_generate` (HF's ``synced_gpus`` idea).

At stage 3 every forward gathers each module's parameters with collectives, so every rank must run
the same number of forwards. In a generation loop ranks finish at different steps (different
sequence lengths, or only rank 0 generating). :func:`synced_generate` keeps a finished rank running
forwards (whose results it discards) until every rank is done: one small all-reduce per step decides
whether any rank still needs the model. Works at every stage (below stage 3 forwards need no
collectives and the loop only costs that all-reduce).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from zerodp.runtime import control


class _GuardedEngine(Protocol):
    """What :func:`synced_generate` needs of a :class:`zerodp.Engine`."""

    process_group: dist.ProcessGroup | None
    world_size: int

    def collective_call(self, name: str) -> AbstractContextManager[None]: ...


def synced_generate(engine: _GuardedEngine, step_fn: Callable[[int, bool], bool], max_steps: int) -> int:
    """Call ``step_fn(i, active)`` for ``i = 0, 1, ...`` until every rank is done or ``max_steps``.

    Args:
        engine: the zerodp engine whose forward ``step_fn`` runs.
        step_fn: runs exactly one ``engine(...)`` forward (under ``torch.no_grad()``) and returns True
            once this rank's generation is finished. Called with ``active=False`` after this rank
            finished while another rank has not: it must still run one forward (e.g. on its last
            input, or a dummy input of any shape) and discard the result.
        max_steps: upper bound on calls (>= 0), the same on every rank.

    Returns:
        The number of calls made with ``active=True`` on this rank.

    Raises:
        ValueError: ``max_steps`` < 0.
        zerodp.runtime.collective_guard.CollectiveError: a rank is not in ``synced_generate`` (or
            runs different modules per step at stage 3).

    Example, generation on rank 0 only (the others only serve gathers)::

        def step(i, active):
            if rank == 0 and active:
                logits, _ = engine(idx[:, -T:]); ...append a token...; return len(idx) >= n
            engine(torch.zeros(1, 1, dtype=torch.long))  # serve the gathers, discard
            return True
        zerodp.zero.synced_generate(engine, step, max_steps=n)
    """
    if max_steps < 0:
        raise ValueError(f"synced_generate: max_steps must be >= 0, got {max_steps}")
    done = False
    active_steps = 0
    flag = torch.zeros(1, dtype=torch.int64)
    for i in range(max_steps):
        if engine.world_size > 1:
            flag.fill_(0 if done else 1)
            with engine.collective_call("synced_generate"):
                dist.all_reduce(flag, op=ReduceOp.MAX, group=control.route(flag, engine.process_group))
            if int(flag.item()) == 0:
                break
        elif done:
            break
        finished = step_fn(i, not done)
        if not done:
            active_steps += 1
            done = bool(finished)
    return active_steps
