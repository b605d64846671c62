"""The memory behind a stage-3 unit's buffers (see [Note: units] in :mod:`zerodp.stage3.units`): a
buffer's storage object lives as long as the unit, emptied to 0 bytes on release and given memory
again on gather, from a slab of the :class:`~zerodp.stage3.pool.GatherPool` or a fresh allocation;
an all-gather writes through an alias that does not own the memory (nor count as a reference to it).
``waiter``/``stream``: the side stream that writes the memory first (see [Note: gather pool] and
[Note: comm streams] in :mod:`zerodp.runtime.streams`).
"""

from __future__ import annotations

import contextlib

import torch

from zerodp.runtime.streams import SideStream
from zerodp.stage3.pool import GatherPool


def unowned_alias(t: torch.Tensor) -> torch.Tensor:
    """A 1-D tensor over ``t``'s memory whose storage does not own it (nor count as a reference to
    ``t``'s storage); valid while ``t``'s storage holds that memory."""
    storage = torch._C._construct_storage_from_data_pointer(t.data_ptr(), t.device, t.numel() * t.element_size())
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, 0, (t.numel(),), (1,))


def row_major_strides(shape: torch.Size) -> tuple[int, ...]:
    """The strides of a contiguous (row-major) tensor of ``shape`` (a size-0 dimension counts as 1)."""
    out, acc = [], 1
    for size in reversed(shape):
        out.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(out))


def free_storage(t: torch.Tensor | None, pool: GatherPool | None = None) -> None:
    """Empty ``t``'s storage (0 bytes): its slab goes back to ``pool``, or its memory is freed."""
    if t is None or (pool is not None and pool.take_back(t)):
        return
    if t.untyped_storage().nbytes() > 0:
        t.untyped_storage().resize_(0)


def allocate_storage(t: torch.Tensor, pool: GatherPool | None = None, waiter: SideStream | None = None) -> None:
    """Give ``t``'s (same) storage object memory again: a slab of ``pool``, or a fresh allocation.
    ``waiter``: the side stream that writes it first (see [Note: gather pool])."""
    nbytes = int(t.storage_offset() + t.numel()) * t.element_size()
    if pool is not None and t.untyped_storage().nbytes() == 0:
        pool.lend(t, waiter)
    elif t.untyped_storage().nbytes() < nbytes:
        t.untyped_storage().resize_(nbytes)
        if waiter is not None:
            waiter.after_compute()


def empty_buffer(
    numel: int, dtype: torch.dtype, device: torch.device, pool: GatherPool | None, waiter: SideStream | None = None
) -> torch.Tensor:
    """A new 1-D buffer of ``numel`` elements: a slab of ``pool``, or a fresh allocation."""
    if pool is not None:
        return pool.empty_tensor(numel, dtype, device, waiter)
    out = torch.empty(numel, dtype=dtype, device=device)
    if waiter is not None:
        waiter.after_compute()
    return out


def issuing_on(stream: SideStream | None) -> contextlib.AbstractContextManager:
    """``stream.issuing()``, or nothing (the current stream) without one."""
    return stream.issuing() if stream is not None else contextlib.nullcontext()


__all__ = ["allocate_storage", "empty_buffer", "free_storage", "issuing_on", "row_major_strides", "unowned_alias"]
