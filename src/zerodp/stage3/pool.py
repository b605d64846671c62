"""A bounded pool of memory for stage-3 gathered parameters and gradient staging buffers.

[Note: gather pool] Without a pool, every gather allocates its unit's full buffer and every release
frees it (the storage is resized to 0 bytes, FSDP2's approach). The memory really is freed, but
glibc's allocator keeps the freed multi-megabyte blocks for reuse (after the first large ``free`` it
raises its mmap threshold, so later large blocks come from the heap, which fragments and is not
returned to the system): per-rank RSS then grows above stage 0's although less is alive.

The pool owns a few *slabs* (``torch.UntypedStorage``) that are allocated once and reused. A borrower
is a tensor whose own storage object is empty (0 bytes); :meth:`GatherPool.lend` swaps a slab's memory
into that storage object (``UntypedStorage._swap_data_ptr_``, the slab object then holds the 0 bytes)
and :meth:`GatherPool.take_back` swaps it back. The borrower's *storage object never changes*: views
of it saved by autograd during forward (``weight.t()`` in ``linear``) read whatever memory the storage
holds when they are used, i.e. their own unit's data once it is gathered again before backward, even
if that happens in another slab and the slab used in forward now holds another unit. While the unit
is released its storage holds 0 bytes, exactly as without a pool.

Bounds: a slab of ``b`` bytes serves requests of ``b / 2`` to ``b`` bytes (best fit, else a new slab of
the requested size is allocated). Slabs returned while the pool holds more than ``limit_bytes`` in
total are freed instead of kept, so the pool never retains more than ``limit_bytes`` plus what is lent
out at that moment; what is lent at once is bounded by the coordinator (``stage3_max_live_parameters``,
plus the units of the module running) and the reducer (buckets in flight). The engine frees the
idle slabs at the end of each backward (:meth:`GatherPool.clear`), so the pool's memory is reused
within an iteration (forward gathers, backward gathers, gradient staging) and not held between
iterations.

Streams (see [Note: comm streams] in :mod:`zerodp.runtime.streams`): a slab is taken back on the
compute stream, which may still have kernels queued that read it; :meth:`GatherPool.take_back` then
records a *release event* on the compute stream (:attr:`GatherPool.release_event`), kept with the
free slab. A slab lent to a side stream (``waiter``: the all-gather stream) is not written before
that event: the waiter waits for it; a slab newly allocated for a waiter makes it wait for the compute
stream (the caching allocator may hand out memory whose last compute-stream reader is still queued).
A slab lent for use on the compute stream itself (gradient staging, cast buffers) needs no wait.
Slabs are allocated and freed on the compute stream (never while a side stream is current), after
the compute stream waited for every side-stream use of them.

Torch before 2.12 has no ``_swap_data_ptr_`` (:data:`SWAPS_STORAGE`): there the pool keeps no slabs,
:meth:`GatherPool.lend` allocates the borrower's own storage (``resize_(need)``, the caching allocator
reuses device memory) and :meth:`GatherPool.take_back` frees it (``resize_(0)``), FSDP2's way. The
storage object still never changes, so autograd's saved views behave as above; a side-stream writer
of a new allocation waits for the compute stream (less prefetch overlap, the same order). The choice
is made once, at construction (``swap_storage``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

#: True where this torch can move memory between storage objects (``UntypedStorage._swap_data_ptr_``,
#: torch >= 2.12); elsewhere the pool allocates and frees each borrower's storage (see the note above).
SWAPS_STORAGE: bool = hasattr(torch.UntypedStorage, "_swap_data_ptr_")


class Waiter(Protocol):
    """A side stream that will write a lent slab (:class:`zerodp.runtime.streams.SideStream`)."""

    def wait_for(self, event: Any | None) -> None: ...

    def after_compute(self) -> None: ...


class GatherPool:
    """Slabs of memory lent to empty storages of stage-3 buffers (see the note above).

    Args:
        limit_bytes: slabs are freed instead of kept when the pool (lent + free) would exceed this.
        release_event: returns an event recorded now on the compute stream (see the note above);
            None: no events (no side streams).
        swap_storage: lend slabs by swapping their memory into the borrower's storage (default:
            :data:`SWAPS_STORAGE`); False: allocate and free each borrower's storage, keeping no slabs.
    """

    #: the ``_lent`` entry of a borrower when the pool does not swap (one empty storage, shared)
    _NO_SLAB = torch.UntypedStorage(0)

    def __init__(
        self,
        limit_bytes: int,
        release_event: Callable[[], Any] | None = None,
        swap_storage: bool | None = None,
    ) -> None:
        if limit_bytes < 0:
            raise ValueError(f"GatherPool limit_bytes must be >= 0, got {limit_bytes}")
        self.swap_storage = SWAPS_STORAGE if swap_storage is None else swap_storage
        if self.swap_storage and not SWAPS_STORAGE:
            raise RuntimeError(
                f"GatherPool(swap_storage=True) needs UntypedStorage._swap_data_ptr_ (torch >= 2.12); "
                f"torch {torch.__version__} has none"
            )
        self.limit_bytes = limit_bytes
        self.release_event = release_event
        self._free: list[torch.UntypedStorage] = []  # slabs holding memory, not lent
        self._released: dict[int, Any] = {}  # id(free slab) -> its release event
        self._lent: dict[int, torch.UntypedStorage] = {}  # borrower storage's _cdata -> slab (now empty)
        self._lent_sizes: dict[int, int] = {}  # borrower storage's _cdata -> slab bytes
        self.allocations = 0  # slabs allocated since construction
        self.peak_bytes = 0  # largest lent + free bytes seen

    # ---- lending -----------------------------------------------------------------------------------
    def lend(self, t: torch.Tensor, waiter: Waiter | None = None) -> None:
        """Give ``t``'s storage (0 bytes now) the memory of a slab big enough for ``t``; ``waiter``: the
        side stream that writes it first (waits for the slab's release event, see the note above).

        Raises:
            RuntimeError: ``t``'s storage is not empty or already holds a slab.
        """
        self._lend_to(t.untyped_storage(), int(t.storage_offset() + t.numel()) * t.element_size(), t.device, waiter)

    def _lend_to(
        self, storage: torch.UntypedStorage, need: int, device: torch.device, waiter: Waiter | None = None
    ) -> None:
        key = storage._cdata
        if key in self._lent or storage.nbytes() != 0:
            raise RuntimeError(
                f"GatherPool.lend: the tensor's storage is not empty ({storage.nbytes()} bytes); release it first"
            )
        if not self.swap_storage:
            storage.resize_(need)
            self.allocations += 1
            if waiter is not None:
                waiter.after_compute()
            self._lent[key] = self._NO_SLAB  # nothing to hand back: the memory is the storage's own
            self._lent_sizes[key] = need
            self.peak_bytes = max(self.peak_bytes, self.held_bytes())
            return
        slab = self._take_free(need, device)
        if slab is None:
            slab = torch.UntypedStorage(need, device=device)
            self.allocations += 1
            if waiter is not None:
                waiter.after_compute()
        elif waiter is not None:
            waiter.wait_for(self._released.pop(id(slab), None))
        else:
            self._released.pop(id(slab), None)
        size = slab.nbytes()
        storage._swap_data_ptr_(slab)  # type: ignore[attr-defined]  # torch-internal, not in the stubs
        self._lent[key] = slab
        self._lent_sizes[key] = size
        self.peak_bytes = max(self.peak_bytes, self.held_bytes())

    def take_back(self, t: torch.Tensor) -> bool:
        """Take the slab lent to ``t``'s storage back (the storage holds 0 bytes again). Returns False
        (and does nothing) if ``t``'s storage holds no slab of this pool."""
        storage = t.untyped_storage()
        slab = self._lent.pop(storage._cdata, None)
        if slab is None:
            return False
        self._lent_sizes.pop(storage._cdata)
        if not self.swap_storage:
            storage.resize_(0)  # freed on the compute stream, as a slab past the limit is below
            return True
        storage._swap_data_ptr_(slab)  # type: ignore[attr-defined]  # torch-internal, not in the stubs
        if self.held_bytes() + slab.nbytes() <= self.limit_bytes:
            self._free.append(slab)
            if self.release_event is not None:
                self._released[id(slab)] = self.release_event()
        # else: dropping the last reference frees the slab's memory
        return True

    def disown(self, t: torch.Tensor) -> None:
        """Forget the slab lent to ``t``'s storage without taking it back: the storage keeps the memory
        (freed when its last tensor is), and the pool no longer counts it. A no-op if none is lent."""
        key = t.untyped_storage()._cdata
        if self._lent.pop(key, None) is not None:
            self._lent_sizes.pop(key)

    def empty_tensor(
        self, numel: int, dtype: torch.dtype, device: torch.device, waiter: Waiter | None = None
    ) -> torch.Tensor:
        """A 1-D tensor of ``numel`` elements whose memory is lent from the pool (contents undefined);
        hand it back with :meth:`take_back`. ``waiter``: as in :meth:`lend`."""
        storage = torch.UntypedStorage(0, device=device)
        self._lend_to(storage, numel * torch.empty(0, dtype=dtype).element_size(), device, waiter)
        return torch.empty(0, dtype=dtype, device=device).set_(storage, 0, (numel,), (1,))

    def _take_free(self, need: int, device: torch.device) -> torch.UntypedStorage | None:
        best = None
        for i, slab in enumerate(self._free):
            size = slab.nbytes()
            if (
                slab.device == device
                and need <= size <= 2 * max(need, 1)
                and (best is None or size < self._free[best].nbytes())
            ):
                best = i
        return self._free.pop(best) if best is not None else None

    # ---- accounting (read from the slabs' live storages) -------------------------------------------
    def free_bytes(self) -> int:
        return sum(s.nbytes() for s in self._free)

    def lent_bytes(self) -> int:
        return sum(self._lent_sizes.values())

    def held_bytes(self) -> int:
        return self.free_bytes() + self.lent_bytes()

    def clear(self) -> None:
        """Free every slab not lent out."""
        self._free.clear()
        self._released.clear()
