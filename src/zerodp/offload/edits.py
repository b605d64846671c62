"""In-place edits of the module's parameters between optimizer steps, found and folded into the fp32
masters of an offloaded partition (the rule of :meth:`zerodp.runtime.guards.TrainingGuards.before_update`:
an element whose module value no longer equals its master's cast was edited, e.g. ``w.mul_(0.5)`` under
``no_grad`` or through ``w.data``, and its value goes into the master).

[Note: edit fingerprints] On a device, comparing a piece with its host master needs the piece on the
host: a device -> host copy of the whole owned partition every step. Version counters cannot replace it:
an edit through ``w.data`` moves none (``.data`` has its own counter), nor does one of the flat buffer
the parameter views. Instead :class:`EditWatch` keeps, per piece, a 0-d int64 *fingerprint* computed on
the device when the engine last wrote the piece (after the step's host -> device copies); before the
next update the fingerprints are computed again on the device, compared there, and the flags read with
one host sync per device (:func:`zerodp.runtime.device.host_flags`, reason ``offload_edits``). Only a
piece whose fingerprint changed is copied to the host and compared element by element
(:func:`fold_edit`). The fingerprint is ``sum_i bits_i * (2 i K + 1) mod 2**64`` over the piece's
elements as integers (``K`` odd): every weight is odd, so any edit of one element changes it, a swap of
two elements changes it (for pieces under 2**32 elements), and other edits leave it unchanged with
probability about 2**-64. Integer sums wrap the same way in any order, so the value does not depend on
the reduction order; a spurious change only costs one element-wise compare.

On the CPU (the engine's device is the host) pieces and masters are compared in place, as before.
"""

from __future__ import annotations

import torch

from zerodp.runtime.device import host_flags

#: elements of a device parameter copied into host memory at a time by :func:`fold_edit` (bounds its
#: host scratch: 8 MiB in bf16)
FOLD_CHUNK_NUMEL = 1 << 22
#: elements fingerprinted per pass (bounds the device scratch: three int64 tensors, 24 MiB)
FINGERPRINT_CHUNK_NUMEL = 1 << 20
#: twice an odd 64-bit constant (the golden ratio's), as a signed int64: weights ``i * _STEP + 1`` are odd
_STEP = (2 * 0x9E3779B97F4A7C15) % (1 << 64)
_STEP -= (1 << 64) if _STEP >= (1 << 63) else 0

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """The fingerprint of ``t`` (1-D, contiguous, any dtype) on ``t``'s device: a 0-d int64 (see
    [Note: edit fingerprints]); no host sync."""
    bits = t.detach().reshape(-1).view(_BITS[t.element_size()])
    total = torch.zeros((), dtype=torch.int64, device=t.device)
    n = bits.numel()
    for lo in range(0, n, FINGERPRINT_CHUNK_NUMEL):
        hi = min(n, lo + FINGERPRINT_CHUNK_NUMEL)
        weights = torch.arange(lo, hi, dtype=torch.int64, device=t.device).mul_(_STEP).add_(1)
        total += weights.mul_(bits[lo:hi].to(torch.int64)).sum()
    return total


class EditWatch:
    """The fingerprints of an offload's pieces on the device (see [Note: edit fingerprints])."""

    def __init__(self) -> None:
        self.prints: list[torch.Tensor | None] = []
        self.taken = 0  # fingerprints computed so far (tests read it)

    def take(self, tensors: list[torch.Tensor]) -> None:
        """Record the fingerprint of every tensor (the engine has just written them)."""
        self.prints = [self._print(t) for t in tensors]

    def retake(self, i: int, t: torch.Tensor) -> None:
        """Record tensor ``i``'s fingerprint again (its master now matches it)."""
        self.prints[i] = self._print(t)

    def _print(self, t: torch.Tensor) -> torch.Tensor:
        self.taken += 1
        return fingerprint(t)

    def changed(self, tensors: list[torch.Tensor]) -> list[bool]:
        """Per tensor: its fingerprint differs from the recorded one (or none was recorded); one host
        sync per device."""
        if len(self.prints) != len(tensors):
            return [True] * len(tensors)
        flags = [
            fingerprint(t) != p if p is not None else torch.ones((), dtype=torch.bool, device=t.device)
            for t, p in zip(tensors, self.prints, strict=True)
        ]
        self.taken += len(tensors)
        return host_flags("offload_edits", flags)


def fold_edit(tensor: torch.Tensor, master: torch.Tensor) -> bool:
    """Copy the elements of ``tensor`` (module dtype) that differ from ``master``'s cast into
    ``master`` (fp32), in place; True if any did.

    Shapes: both 1-D with the same number of elements. ``tensor`` may live on another device than
    ``master`` (a CUDA parameter piece, a host master): it is then copied into a host scratch of at most
    :data:`FOLD_CHUNK_NUMEL` elements at a time (``copy_``, exact) and compared there, since comparisons
    and indexing need both operands on one device. Same device (CPU-only machine): compared in place.
    """
    if tensor.device == master.device:
        return _fold_edit_here(tensor, master)
    n = tensor.numel()
    scratch = torch.empty(min(n, FOLD_CHUNK_NUMEL), dtype=tensor.dtype, device=master.device)
    changed = False
    for lo in range(0, n, FOLD_CHUNK_NUMEL):
        hi = min(n, lo + FOLD_CHUNK_NUMEL)
        local = scratch[: hi - lo]
        local.copy_(tensor[lo:hi])  # waits for the device (a blocking device -> host copy)
        changed |= _fold_edit_here(local, master[lo:hi])
    return changed


def _fold_edit_here(tensor: torch.Tensor, master: torch.Tensor) -> bool:
    """:func:`fold_edit` for ``tensor`` and ``master`` on the same device."""
    cast = master.to(tensor.dtype)
    if torch.equal(tensor, cast):  # the common case: one pass, no allocation in fp32
        return False
    edited = tensor != cast
    if not bool(edited.any()):
        return False
    master[edited] = tensor[edited].to(master.dtype)
    return True


__all__ = ["EditWatch", "FINGERPRINT_CHUNK_NUMEL", "FOLD_CHUNK_NUMEL", "fingerprint", "fold_edit"]
