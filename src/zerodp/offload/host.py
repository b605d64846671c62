"""ZeRO-Offload to CPU memory (``offload_optimizer.device = "cpu"``): this rank's fp32 master
partition, Adam moments and gradient partition live in host memory, and the Adam step runs there.

Source: Ren et al., "ZeRO-Offload: Democratizing Billion-Scale Model Training" (USENIX ATC 2021),
section 4 (the fp32 optimizer states and gradients on the CPU, parameters streamed back after the
CPU update). DeepSpeed key: ``zero_optimization.offload_optimizer``.

Every owned piece (:class:`zerodp.runtime.partition.Piece`) gets an fp32 ``master`` in host memory
(also in fp32 training, where the non-offloaded engine updates views of the parameters) and a host
gradient buffer of the same size. At the step, each reduced gradient is copied device -> host into its
buffer (``non_blocking`` from pinned memory when CUDA is present; on a CPU-only machine the same copy
runs between the module's tensors and the host partition), torch's Adam/AdamW runs on the masters,
and the updated masters are copied host -> device into the module's parameters (cast to its dtype).
The arithmetic is the non-offloaded engine's: same torch optimizer, same kernel, fp32 masters, so the
result is bitwise equal.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

from zerodp.runtime.partition import FlatGroup, Piece


def host_empty(numel: int, pin: bool, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised 1-D host tensor; page-locked when ``pin`` and CUDA is present."""
    return torch.empty(numel, dtype=dtype, device="cpu", pin_memory=pin and torch.cuda.is_available())


def storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (measured from live storage)."""
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


class HostOptimizerOffload:
    """Optimizer states, fp32 masters and gradients of this rank's pieces in host memory.

    Lifecycle, driven by the engine: :meth:`attach` once after the pieces are assigned; per step
    :meth:`check_health` (collective; nothing to check for host memory), :meth:`stage_grad` for each
    piece that has a gradient, :meth:`grads` (unscaling, clipping), :meth:`step`, :meth:`finish_step`.
    """

    device = "cpu"

    def __init__(self, pin_memory: bool) -> None:
        self.pin = pin_memory
        self.pieces: list[Piece] = []
        self.grad_buffers: list[torch.Tensor] = []  # host fp32, one per piece
        self._index: dict[int, int] = {}  # id(piece) -> position in self.pieces
        self._present: list[bool] = []

    # ---- construction --------------------------------------------------------------------------
    def attach(self, groups: list[FlatGroup]) -> None:
        """Give every owned piece a host fp32 master (a copy of its current value) and a host
        gradient buffer."""
        for g in groups:
            for piece in g.pieces:
                self._index[id(piece)] = len(self.pieces)
                self.pieces.append(piece)
                self.grad_buffers.append(host_empty(piece.hi - piece.lo, self.pin))
                self._present.append(False)
                self._make_master(piece)

    def _make_master(self, piece: Piece) -> None:
        source = piece.master if piece.master is not None else piece.tensor
        master = host_empty(piece.hi - piece.lo, self.pin)
        master.copy_(source.detach())
        piece.master = master

    def refresh_master(self, piece: Piece) -> None:
        """The module's value of ``piece`` was edited (GatheredParameters): copy it into the master."""
        piece.master.copy_(piece.tensor)

    # ---- one step ------------------------------------------------------------------------------
    def check_health(self) -> None:
        """Collective in subclasses that can fail between steps; host memory cannot."""

    def stage_grad(self, piece: Piece, grad: torch.Tensor) -> None:
        """Copy ``piece``'s reduced gradient (module dtype, any device) into its host fp32 buffer."""
        i = self._index[id(piece)]
        self.grad_buffers[i].copy_(grad, non_blocking=grad.is_cuda)
        self._present[i] = True

    def grads(self) -> list[torch.Tensor]:
        """The host gradients staged this step (for loss unscaling and clipping, in place)."""
        self._sync_copies()
        return [b for b, present in zip(self.grad_buffers, self._present) if present]

    def grad_of(self, piece: Piece) -> Optional[torch.Tensor]:
        """``piece``'s host gradient staged this step, or None if it has none."""
        i = self._index[id(piece)]
        self._sync_copies()
        return self.grad_buffers[i] if self._present[i] else None

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Run ``optimizer`` (whose parameters are the masters) on the staged host gradients."""
        self._sync_copies()
        for piece, buf, present in zip(self.pieces, self.grad_buffers, self._present):
            piece.master.grad = buf if present else None
        optimizer.step()

    def finish_step(self) -> None:
        """Copy the updated masters into the module's parameters and forget this step's gradients."""
        for i, piece in enumerate(self.pieces):
            piece.master.grad = None
            if self._present[i]:
                piece.tensor.copy_(piece.master, non_blocking=piece.tensor.is_cuda)
            self._present[i] = False

    def _sync_copies(self) -> None:
        if torch.cuda.is_available() and any(p.tensor.is_cuda for p in self.pieces):
            torch.cuda.synchronize()

    # ---- checkpoints and reports ---------------------------------------------------------------
    @contextlib.contextmanager
    def resident(self, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        """Masters and optimizer states as ordinary tensors for a checkpoint (already so here)."""
        yield

    def host_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Host bytes by category, measured from the live storages."""
        states = [t for st in optimizer.state.values() for t in st.values()
                  if isinstance(t, torch.Tensor) and t.dim() > 0]
        return {
            "master_weights": storage_bytes([p.master for p in self.pieces if p.master.numel()]),
            "optimizer_states": storage_bytes(states),
            "gradients": storage_bytes(self.grad_buffers),
            "swap_buffers": 0,
        }

    def nvme_bytes(self) -> dict[str, int]:
        return {"master_weights": 0, "optimizer_states": 0}

    def close(self) -> None:
        """Release resources (nothing to release for host memory)."""


__all__ = ["HostOptimizerOffload", "host_empty", "storage_bytes"]
