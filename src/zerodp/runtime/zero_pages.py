"""Flat gradient buffers whose zeros hold no memory until a gradient is written (stages 0-1).

Stages 0 and 1 keep one full flat gradient buffer per group (``param.grad`` views it, see
:mod:`zerodp.runtime.reducer`) and zero it after every optimizer step. A buffer zeroed with
``Tensor.zero_()`` stays resident from then on, through the next forward, where the activations set
the process's peak resident set. DDP frees its ``.grad`` tensors after the step
(``zero_grad(set_to_none=True)``) and allocates them again during backward, when activations are
already being freed; its bucket buffers are the only gradient-sized memory it holds during forward.
So zerodp stage 0 (parameters + gradient buffer + Adam states) held exactly what DDP (parameters +
bucket buffers + Adam states) held at the peak, and never less (docs/benchmarks/2026-12-01-bench.md, "Where stage 0's
extra peak RSS came from").

:class:`ZeroPageBuffer` allocates the buffer as a private anonymous mapping (Linux ``mmap``) and
zeroes it with ``madvise(MADV_DONTNEED)``: the kernel drops the pages, and the next access to each
page reads zeros, so the values are exactly those of ``zero_()`` (bitwise) while the buffer holds
memory only where backward has written a gradient. With 4 KiB pages the page faults that follow cost
several times a ``zero_()`` (docs/benchmarks/2026-12-01-bench.md, "Where stage 0's extra peak RSS
came from"), so the buffer starts on a 2 MiB boundary and its whole 2 MiB pages are marked
``MADV_HUGEPAGE`` and released; the partial last one (the tail, under 2 MiB) is not marked, so that it
holds no more than base pages would, and is zeroed with ``zero_()`` (it stays resident): releasing its
4 KiB pages made backward fault each one in again at every step, on the training thread
(docs/benchmarks/2026-12-02-host-overhead.md). A buffer under 2 MiB, or where transparent huge pages
are off (or not Linux, or not on the CPU), is a plain ``torch.zeros`` tensor zeroed with ``zero_()``.
"""

from __future__ import annotations

import mmap
import sys
from dataclasses import dataclass

import torch

#: transparent huge page size on x86-64 and aarch64 (4 KiB base pages), bytes
HUGE_PAGE = 2 << 20
_THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def huge_pages_available() -> bool:
    """True on Linux when transparent huge pages may back a ``MADV_HUGEPAGE`` mapping (the kernel's
    setting is ``[always]`` or ``[madvise]``, read from ``/sys/kernel/mm/transparent_hugepage/enabled``)."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open(_THP_SETTING) as f:
            setting = f.read()
    except OSError:
        return False
    return "[always]" in setting or "[madvise]" in setting


@dataclass(eq=False)
class ZeroPageBuffer:
    """A zero-initialised 1-D tensor (``tensor``) that :meth:`zero_` can release to the kernel.

    ``mapping`` is the private anonymous mapping ``tensor`` lives in, or None for a plain
    ``torch.zeros`` tensor (then :meth:`zero_` is ``tensor.zero_()``); ``released`` is the byte range
    ``(offset, length)`` of the mapping that :meth:`zero_` gives back (the whole huge pages), and
    ``tail`` the rest of ``tensor`` (zeroed in place).
    """

    tensor: torch.Tensor
    mapping: mmap.mmap | None = None
    released: tuple[int, int] = (0, 0)
    tail: torch.Tensor | None = None

    @classmethod
    def like(cls, t: torch.Tensor, lazy: bool | None = None, dtype: torch.dtype | None = None) -> ZeroPageBuffer:
        """A zeroed 1-D buffer of ``t.numel()`` elements of ``dtype`` (default ``t``'s) on ``t``'s device.
        ``lazy`` (default: :func:`huge_pages_available`, and ``t`` on the CPU and at least one huge page
        of bytes) selects the mapping."""
        numel, dtype = t.numel(), dtype or t.dtype
        if lazy is None:
            lazy = huge_pages_available()
        nbytes = numel * dtype.itemsize
        if not lazy or t.device.type != "cpu" or nbytes < HUGE_PAGE:
            return cls(torch.zeros(numel, dtype=dtype, device=t.device))
        # one huge page of slack, so that the tensor can start on a 2 MiB boundary
        mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        start = torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()
        pad = (-start) % HUGE_PAGE  # a multiple of the base page: the mapping starts on one
        whole = nbytes // HUGE_PAGE * HUGE_PAGE  # > 0: huge pages where the buffer fills them
        mapping.madvise(mmap.MADV_HUGEPAGE, pad, whole)
        mapping.madvise(mmap.MADV_NOHUGEPAGE, pad + whole, len(mapping) - pad - whole)  # the tail: base pages
        tensor = torch.frombuffer(mapping, dtype=dtype, count=numel, offset=pad)
        return cls(tensor, mapping, (pad, whole), tensor[whole // dtype.itemsize :])

    def zero_(self) -> None:
        """Set every element to zero; a mapped buffer gives its whole huge pages back (RSS falls by what
        was written there) and zeroes its tail in place."""
        if self.mapping is None:
            self.tensor.zero_()
            return
        self.mapping.madvise(mmap.MADV_DONTNEED, *self.released)
        if self.tail is not None:
            self.tail.zero_()
