"""Peak live heap bytes of a block of code, read from the C allocator (glibc ``mallinfo2``).

torch's CPU tensors, safetensors' buffers and large Python objects are all allocated with ``malloc``;
``mallinfo2().uordblks + hblkhd`` is the number of bytes currently allocated (heap and mmapped chunks),
freed memory excluded, so it measures live storage rather than anything an engine reports about itself.
:class:`HeapPeak` samples it on every Python and C function call and return inside the block
(``sys.setprofile``), which sees every tensor allocated by an operator, and reports the highest value
above the value on entry.
"""

from __future__ import annotations

import ctypes
import gc
import sys
from typing import Any


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_size_t)
        for n in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


_LIBC: Any | None = None


def available() -> bool:
    """Whether glibc's ``mallinfo2`` can be called (glibc >= 2.33)."""
    global _LIBC
    if _LIBC is None:
        try:
            libc = ctypes.CDLL("libc.so.6")
            libc.mallinfo2.restype = _MallInfo2
            _LIBC = libc
        except (OSError, AttributeError):
            return False
    return True


def heap_bytes() -> int:
    """Bytes currently allocated through malloc in this process."""
    m = _LIBC.mallinfo2()
    return int(m.uordblks + m.hblkhd)


class HeapPeak:
    """``with HeapPeak() as hp: ...``; then ``hp.peak`` is the highest live heap above the entry value."""

    def __init__(self) -> None:
        if not available():
            raise RuntimeError("glibc mallinfo2 is not available here")
        self.base = 0
        self.peak = 0
        self.samples = 0

    def _sample(self, frame: Any, event: str, arg: Any) -> None:
        self.samples += 1
        used = heap_bytes() - self.base
        if used > self.peak:
            self.peak = used

    def __enter__(self) -> HeapPeak:
        gc.collect()  # garbage of earlier code freed inside the block would lower the heap below the base
        self.base = heap_bytes()
        sys.setprofile(self._sample)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)
        self._sample(None, "exit", None)
