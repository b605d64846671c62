"""The optimizer update without offload (``offload_optimizer.device: none``), behind the same
:class:`~zerodp.offload.build.OptimizerOffload` protocol as the host and NVMe offloads, so the engine
drives one strategy chosen at construction and never asks whether an offload exists.

The optimizer updates this rank's pieces where they are: under fp32 the pieces themselves (views of
the flat buffers), under bf16/fp16 fp32 master copies made by :meth:`NoOffload.attach`, cast back
into the pieces by :meth:`NoOffload.finish_step`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch

from zerodp.offload.shard_window import ShardAccess
from zerodp.runtime.device import host_flags
from zerodp.runtime.grad_spill import GradSpill, SpillingGradReducer
from zerodp.runtime.partition import FlatGroup, Piece


class NoOffload:
    """Optimizer states, masters and gradients stay on the training device; see
    :class:`zerodp.offload.host.HostOptimizerOffload` for the order in which the engine calls these."""

    device = "none"
    #: the reduced gradients stay in the reducer's buffers until the step (nothing streams at backward,
    #: so a ``clip_grad_norm_`` factor scales them at once)
    streams_grads = False
    #: the staged gradients are what the step's norm reads, so the step may take the norm with the
    #: presence flags (:mod:`zerodp.runtime.step_control`)
    fuses_step_norm = True
    #: the engine keeps every shard resident for the whole step
    shard_access: object | None = None

    def __init__(self, has_master: bool) -> None:
        """``has_master``: bf16/fp16 training keeps an fp32 master copy of every owned piece."""
        self.has_master = has_master
        self.pieces: list[Piece] = []

    # ---- construction --------------------------------------------------------------------------
    def attach(self, groups: list[FlatGroup]) -> None:
        """Remember the owned pieces; under bf16/fp16 give each an fp32 master (a copy of its value)."""
        for g in groups:
            for piece in g.pieces:
                self.pieces.append(piece)
                if self.has_master:
                    piece.master = piece.tensor.detach().float().clone()

    def set_shard_access(self, access: ShardAccess) -> None:
        """Nothing to do: the engine keeps the shards resident for the whole step."""

    def holds_master(self, piece: Piece) -> bool:
        """``piece`` has an fp32 master that a ``GatheredParameters(modifier_rank=...)`` edit must reach."""
        return piece.master is not None

    def refresh_master(self, piece: Piece) -> None:
        """The module's value of ``piece`` was edited (GatheredParameters): copy it into the master."""
        piece.master_copy.copy_(piece.tensor)

    def fold_edits(self) -> None:
        """Before the update: copy every element of a piece that no longer equals its master's cast
        (an in-place edit since the last step) into the fp32 master, keeping the fp32 value of the
        other elements. One host sync per device (:func:`zerodp.runtime.device.host_flags`)."""
        pieces = [p for p in self.pieces if p.master is not None]
        flags = [(p.tensor != p.master_copy.to(p.tensor.dtype)).any() for p in pieces]
        for piece, edited_any in zip(pieces, host_flags("master_edits", flags), strict=True):
            if edited_any:  # keep the fp32 value of every element that was not edited
                edited = piece.tensor != piece.master_copy.to(piece.tensor.dtype)
                piece.master_copy[edited] = piece.tensor[edited].to(piece.master_copy.dtype)

    def skipped_step(self) -> None:
        """The update was skipped (fp16 overflow): nothing was staged."""

    # ---- one step ------------------------------------------------------------------------------
    def check_health(self) -> None:
        """Nothing can fail between steps."""

    def begin_grads(self) -> None:
        """Before a boundary backward: forget the gradients of any earlier step (a piece without a
        gradient this step is then skipped by the optimizer)."""
        for piece in self.pieces:
            piece.opt_tensor.grad = None

    def stream_grad(self, piece: Piece, grad: torch.Tensor) -> None:
        """Never called (:attr:`streams_grads` is False): the step reads the reducer's buffers."""

    def stage_grad(self, piece: Piece, grad: torch.Tensor | None) -> None:
        """``piece`` has a gradient this step: hand it to the optimizer (cast to the master's fp32)."""
        assert grad is not None  # None only from a gradient spill, which only the NVMe offload makes
        target = piece.opt_tensor
        target.grad = grad if grad.dtype == target.dtype else grad.to(target.dtype)

    def gradient_spill(self, reducer: SpillingGradReducer) -> GradSpill | None:
        """No gradient swap file: the reduced gradients stay in the reducer (see the NVMe offload's)."""
        return None

    def scale_grads(self, factor: float) -> None:
        """Multiply the staged gradients by ``factor`` in place (loss unscaling, clipping)."""
        for piece in self.pieces:
            if piece.opt_tensor.grad is not None:
                piece.opt_tensor.grad.mul_(factor)

    def norm_grads(self, pieces: list[Piece]) -> Iterable[torch.Tensor]:
        """The staged gradients of those of ``pieces`` that have one, in order."""
        return [p.opt_tensor.grad for p in pieces if p.opt_tensor.grad is not None]

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def finish_step(self) -> None:
        """Forget the gradients; cast every updated master back into its piece (the module dtype)."""
        for piece in self.pieces:
            piece.opt_tensor.grad = None
            if piece.master is not None:
                piece.tensor.copy_(piece.master)

    def settle(self) -> None:
        """Nothing to finish: :meth:`step` updates everything before it returns."""

    def when_updated(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` now."""
        fn()

    # ---- checkpoints and reports ---------------------------------------------------------------
    @contextlib.contextmanager
    def resident(self, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        """Masters and optimizer states are ordinary tensors already."""
        yield

    def adjust_formula(self, formula: dict[str, float], numel_per_rank: float) -> None:
        """The paper's model-state formula holds as it is."""

    def host_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        return {}

    def nvme_bytes(self) -> dict[str, int]:
        return {}

    def formula(self, numel_per_rank: float, host: dict[str, int]) -> dict[str, dict[str, float]]:
        return {}

    def close(self) -> None:
        """Nothing to release."""


__all__ = ["NoOffload"]
