"""The fp32 masters and Adam moments of :class:`zerodp.offload.nvme.NvmeOptimizerOffload` in its swap
file, read and written outside a step's sub-group loop: the initial write of the masters, an edited
parameter written into its master, in-place edits folded into the masters of the sub-groups a step
does not update, and every master and moment held in ordinary host tensors for a checkpoint.

Each works one sub-group at a time through the offload's buffer pool (``buffers``: uint8, at least
the largest sub-group's bytes); a sub-group's region of the file is its masters segment (absent when
the module's fp32 tensors are the masters), then ``exp_avg``, then ``exp_avg_sq``
(:class:`zerodp.offload.subgroups.SubGroup`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Protocol

import torch

from zerodp.offload.aio import IOHandle
from zerodp.offload.edits import fold_edit
from zerodp.offload.subgroups import SubGroup
from zerodp.runtime.partition import Piece


class SwappedStates(Protocol):
    """What these functions use of :class:`zerodp.offload.nvme.NvmeOptimizerOffload`."""

    pieces: list[Piece]
    subgroups: list[SubGroup]
    buffers: list[torch.Tensor]
    in_place: bool  # the module's fp32 tensors are the masters (no masters segment)
    steps: dict[tuple[int, int], torch.Tensor]  # (piece position, span lo) -> Adam's step

    def read_region(self, buf: torch.Tensor, offset: int) -> IOHandle: ...
    def write_region(self, buf: torch.Tensor, offset: int) -> IOHandle: ...
    def pinned(
        self, positions: Iterable[int], dirty: bool, keep: bool = False
    ) -> contextlib.AbstractContextManager[None]: ...


def write_masters(states: SwappedStates) -> None:
    """Write each piece's current fp32 value (its master, else its tensor) into the masters segments."""
    for sg in states.subgroups:
        buf = states.buffers[0][: sg.nbytes]
        masters = buf[: sg.seg].view(torch.float32)
        # with shard_access: only this sub-group's shards; kept within the read-ahead budget, so a
        # shard whose pieces continue in the next sub-group is not read twice
        with states.pinned(sg.pieces, dirty=False, keep=True):
            for i, lo, hi, view in sg.views(masters):
                p = states.pieces[i]
                view.copy_((p.master if p.master is not None else p.tensor)[lo:hi])
        states.write_region(buf, sg.offset).wait()


def refresh_master(states: SwappedStates, i: int) -> None:
    """Write the module's (edited) value of the piece at position ``i`` into its master."""
    piece = states.pieces[i]
    for sg in (s for s in states.subgroups if i in s.pieces):
        buf = states.buffers[0][: sg.nbytes]
        states.read_region(buf, sg.offset).wait()
        for j, lo, hi, view in sg.views(buf[: sg.seg].view(torch.float32)):
            if j == i:
                view.copy_(piece.tensor[lo:hi])
        states.write_region(buf, sg.offset).wait()


def fold_masters(states: SwappedStates, subgroups: list[SubGroup], edited: set[tuple[int, int]] | None = None) -> None:
    """Compare the module's values of ``subgroups``' pieces with their masters and fold edits in.
    Only the masters segment of a sub-group is read (4 bytes per element; ``buffer_count`` reads in
    flight) and it is written back only if an element changed. ``edited``: the spans ``(piece
    position, lo)`` that may have changed (fingerprints, on a device); a sub-group with none is not
    read. None: every span is compared."""
    if edited is not None:
        subgroups = [sg for sg in subgroups if any((i, lo) in edited for i, lo, _ in sg.spans)]
    buffers = states.buffers
    nbuf = len(buffers)
    reads: dict[int, IOHandle] = {}
    writes: dict[int, IOHandle] = {}  # buffer slot -> pending write

    def start_read(k: int) -> None:
        if k % nbuf in writes:
            writes.pop(k % nbuf).wait()
        reads[k] = states.read_region(buffers[k % nbuf][: subgroups[k].seg], subgroups[k].offset)

    for k in range(min(nbuf, len(subgroups))):
        start_read(k)
    for k, sg in enumerate(subgroups):
        reads.pop(k).wait()
        seg = buffers[k % nbuf][: sg.seg]
        with states.pinned(sg.pieces, dirty=False):  # with shard_access: this sub-group's shards only
            changed = [
                fold_edit(states.pieces[i].tensor[lo:hi], view)
                for i, lo, hi, view in sg.views(seg.view(torch.float32))
                if edited is None or (i, lo) in edited
            ]
        if any(changed):
            writes[k % nbuf] = states.write_region(seg, sg.offset)
        if k + nbuf < len(subgroups):
            start_read(k + nbuf)
    for h in writes.values():
        h.wait()


@contextlib.contextmanager
def resident(states: SwappedStates, optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Every master and moment in ordinary host tensors bound to ``optimizer`` for the block (12 bytes
    per owned element; with :attr:`SwappedStates.in_place` the master is the module's tensor itself);
    what the block left there is written back after it and the masters return to placeholders."""
    _read_all(states, optimizer)
    try:
        yield
    finally:
        _write_all(states, optimizer)


def _read_all(states: SwappedStates, optimizer: torch.optim.Optimizer) -> None:
    full: dict[int, list[torch.Tensor]] = {}
    for i, p in enumerate(states.pieces):
        n = p.hi - p.lo
        full[i] = [
            p.tensor if states.in_place else torch.empty(n, dtype=torch.float32),
            torch.empty(n, dtype=torch.float32),
            torch.empty(n, dtype=torch.float32),
        ]
    step_of: dict[int, torch.Tensor] = {}
    for sg in states.subgroups:
        buf = states.buffers[0][: sg.nbytes]
        states.read_region(buf, sg.offset).wait()
        for j, seg in enumerate(sg.buffer_segments(buf)):
            for i, lo, hi, view in sg.views(seg) if seg is not None else ():
                full[i][j][lo:hi].copy_(view)
        for i, lo, _ in sg.spans:
            if (i, lo) in states.steps:
                step_of.setdefault(i, states.steps[(i, lo)])
    for i, p in enumerate(states.pieces):
        p.master_copy.data = full[i][0]
        if i in step_of:
            optimizer.state[p.master_copy] = {
                "step": step_of[i].clone(),
                "exp_avg": full[i][1],
                "exp_avg_sq": full[i][2],
            }


def _write_all(states: SwappedStates, optimizer: torch.optim.Optimizer) -> None:
    opt_states = {}
    for i, p in enumerate(states.pieces):
        master = p.master_copy
        opt_states[i] = optimizer.state.pop(master, None)
        if states.in_place and master.data.data_ptr() != p.tensor.data_ptr():
            p.tensor.copy_(master.data)  # a load bound a tensor of its own
    for sg in states.subgroups:
        buf = states.buffers[0][: sg.nbytes]
        for j, seg in enumerate(sg.buffer_segments(buf)):
            for i, lo, hi, view in sg.views(seg) if seg is not None else ():
                st = opt_states[i]
                if j == 0:
                    view.copy_(states.pieces[i].master_copy.data[lo:hi])
                elif st:
                    view.copy_(st["exp_avg" if j == 1 else "exp_avg_sq"][lo:hi])
        for i, lo, _ in sg.spans:
            if opt_states[i]:
                states.steps[(i, lo)] = opt_states[i]["step"].clone()
            else:
                states.steps.pop((i, lo), None)
        states.write_region(buf, sg.offset).wait()
    for p in states.pieces:
        p.master_copy.data = torch.empty(0, dtype=torch.float32)


__all__ = ["SwappedStates", "fold_masters", "refresh_master", "resident", "write_masters"]
