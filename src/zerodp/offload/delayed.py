"""Delayed parameter update (``offload_optimizer.delayed_update: true``, zerodp's own key): step t's CPU
update runs while the device computes step t+1's forward and backward, and reaches the module's
parameters at step t+1.

Source: Ren et al., "ZeRO-Offload" (USENIX ATC 2021), section 4.3 (one-step delayed parameter update,
DPU). DeepSpeed has no public config key for it.

[Note: delayed update] With the delay, step t's forward and backward run on the parameters after the
update of step t-2 (the gradients of step t-1 are being applied on the host meanwhile): with
``g_t = grad(w_{t-2}')`` the parameters follow ``w_t' = Adam(w_{t-1}', g_t)`` where ``w'`` are the fp32
masters and the forward of step t+1 reads ``cast(w_{t-1}')``. The first step's update reaches the
module at the second step, so the second forward still sees the initial parameters. At each boundary
:meth:`DelayedHostOffload.fold_edits` (before anything else of the step reads parameters) waits for
the update launched at the previous boundary and copies its masters into the module's pieces; the
engine then all-gathers them (stages 1-2) or re-gathers the persistent units (stage 3) as usual, and
:meth:`DelayedHostOffload.step` launches this step's update on a worker thread and returns.

The update runs on a shallow copy of the optimizer (same ``state`` dict, param groups copied at
launch), so an LR scheduler stepping the engine's optimizer meanwhile changes only the next update,
as without the delay; the optimizer's own step hooks are not called. The gradient partition is copied
to the host at the step, not streamed during backward (the worker reads the host gradients until it
ends). torch's CPU optimizer kernels release the GIL, so on a CPU-only machine the update runs beside
the next micro-steps' forward and backward on other cores; on a GPU it would run beside the device's
work (not run yet: docs/gpu.md). There the value at launch is the masters' cast made on the host (no
device -> host copy of the partition), the edit check reads the module's pieces only where their
fingerprints moved (:mod:`zerodp.offload.edits`), and the masters reach the module through the copy
stream, the compute stream waiting for them (no host wait).

Edits of the module's parameters between steps (in place, or through ``GatheredParameters`` /
``safe_set_full_fp32_param``) are kept: an element whose module value differs both from the value the
module held when the update was launched and from the new master's cast is copied into the master
before the update is applied (the edit replaces the pending update for that element, as an edit
replaces the value without the delay). Engine calls that read the optimizer state (checkpoints,
``module_state_dict``, the accessors) wait for the update and see the masters *after* it, one update
ahead of the module: a checkpoint holds the state after step t's update, and a run resumed from it
starts with that update applied (one step earlier than the uninterrupted run, which applies it at its
next step).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from zerodp.offload.cpu_adam import CpuAdam, cpu_adam_kernel
from zerodp.offload.host import HostOptimizerOffload, storage_bytes
from zerodp.runtime.partition import Piece


class DelayedHostOffload(HostOptimizerOffload):
    """:class:`HostOptimizerOffload` whose update is applied one step late (see [Note: delayed update]).

    ``launched``: the module-dtype value of each piece when the running update was launched (host,
    one per piece; None when no update is pending). ``updates_overlapped``: updates that were still
    running when the engine returned from ``step()`` (tests and reports read it).
    """

    def __init__(self, pin_memory: bool, cpu_adam: CpuAdam = "fused", train_device: torch.device | str = "cpu") -> None:
        super().__init__(pin_memory, cpu_adam, train_device)
        self._worker: ThreadPoolExecutor | None = None
        self._job: Future | None = None
        self.launched: list[torch.Tensor] | None = None
        self.updates_launched = 0
        self.updates_overlapped = 0  # not finished when step() returned

    # ---- the pending update --------------------------------------------------------------------
    def wait_update(self) -> None:
        """Block until the update launched at the last boundary has finished (masters and optimizer
        state hold it); re-raise its error. The module's pieces are not changed."""
        job, self._job = self._job, None
        if job is not None:
            job.result()

    @property
    def pending(self) -> bool:
        """An update was launched and has not reached the module's pieces yet."""
        return self.launched is not None

    def fold_edits(self) -> None:
        """At the boundary, before the step reads any parameter: wait for the last update, keep the
        edits made since it was launched, and copy the masters into the module's pieces."""
        self.wait_update()
        if self.launched is None:
            return super().fold_edits()
        # on a device only the pieces whose fingerprint moved are copied to the host and compared
        changed = (
            self.edits.changed([p.tensor for p in self.pieces]) if self.edits is not None else [True] * len(self.pieces)
        )
        for i, (piece, before) in enumerate(zip(self.pieces, self.launched, strict=True)):
            if changed[i]:
                _keep_edits(piece.tensor, before, piece.master_copy)
            self._copy_to_module(i)
        self.copies.device_wait()  # on a device an event wait of the compute stream; on the CPU the host's
        if self.edits is not None:
            self.edits.take([p.tensor for p in self.pieces])
        self.launched = None

    def refresh_master(self, piece: Piece) -> None:
        """An edit through ``GatheredParameters``/the accessors: it replaces the pending update of
        ``piece`` (the master takes the module's value)."""
        self.wait_update()
        super().refresh_master(piece)

    # ---- one step ------------------------------------------------------------------------------
    def stream_grad(self, piece: Piece, grad: torch.Tensor) -> None:
        """Not streamed during backward: the running update reads the host gradients
        (:meth:`stage_grad` copies them at the step)."""

    def stage_grad(self, piece: Piece, grad: torch.Tensor | None) -> None:
        self.wait_update()
        super().stage_grad(piece, grad)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Launch the update with this step's host gradients on the worker thread and return."""
        self._sync_copies()
        present = [i for i, p in enumerate(self._present) if p]
        # the module's values now: on a device the masters' cast (the pieces hold it since fold_edits),
        # made on the host instead of copying the partition from the device
        self.launched = [
            p.master_copy.to(p.tensor.dtype, copy=True) if self.on_device else p.tensor.detach().to("cpu", copy=True)
            for p in self.pieces
        ]
        shadow = copy.copy(optimizer)  # same state dict; param groups copied: hyperparameters as of now
        shadow.param_groups = [dict(g) for g in optimizer.param_groups]
        optimizer._opt_called = True  # type: ignore[attr-defined]  # what optimizer.step() records for an LR scheduler's check
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zerodp-delayed-update")
        self._job = self._worker.submit(self._update, shadow, set(present))
        self.updates_launched += 1

    def _update(self, shadow: torch.optim.Optimizer, present: set[int]) -> None:
        """On the worker thread: one optimizer step over the masters with the staged gradients."""
        try:
            for i, piece in enumerate(self.pieces):
                piece.master_copy.grad = self.grad_buffers[i] if i in present else None
            with cpu_adam_kernel(shadow, self.cpu_adam):
                type(shadow).step(shadow)
        finally:
            for piece in self.pieces:
                piece.master_copy.grad = None

    def finish_step(self) -> None:
        """Return without waiting for the update; forget this step's gradient marks."""
        if self._job is not None and not self._job.done():
            self.updates_overlapped += 1
        self._present = [False] * len(self.pieces)
        self._streamed = [False] * len(self.pieces)
        self._forget_factors()  # step() applied them to the host gradients the update reads

    # ---- checkpoints, reports, close -----------------------------------------------------------
    @contextlib.contextmanager
    def resident(self, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        """Masters and optimizer states after the last launched update (waited for)."""
        self.wait_update()
        yield

    def host_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """As :meth:`HostOptimizerOffload.host_bytes`; the module-dtype copy of the partition taken at
        each launch counts as ``swap_buffers``."""
        self.wait_update()
        out = super().host_bytes(optimizer)
        out["swap_buffers"] += storage_bytes(self.launched) if self.launched else 0
        return out

    def close(self) -> None:
        """Wait for the running update, stop the worker thread and the copy thread."""
        try:
            self.wait_update()
        finally:
            if self._worker is not None:
                self._worker.shutdown(wait=True)
                self._worker = None
            super().close()


def _keep_edits(tensor: torch.Tensor, before: torch.Tensor, master: torch.Tensor) -> None:
    """Copy into ``master`` (fp32, host) the elements of ``tensor`` (the module's piece, any device)
    that differ from ``before`` (its value at the launch, host) and from ``master``'s cast: edits made
    while the update ran. 1-D, same numel."""
    now = tensor.detach().to(before.device)  # a blocking copy where the piece is on a device
    if torch.equal(now, before):  # the common case: nothing edited
        return
    edited = (now != before) & (now != master.to(now.dtype))
    master[edited] = now[edited].to(master.dtype)


__all__ = ["DelayedHostOffload"]
