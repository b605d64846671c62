"""glibc's ``mallinfo2`` for the RSS tools (tools/rss_breakdown.py, tools/infinity_rss_probe.py).

``malloc_in_use()``: bytes currently allocated through malloc in this process, all arenas
(``uordblks + hblkhd``: heap chunks in use plus mmapped chunks), freed memory excluded.
"""

from __future__ import annotations

import ctypes


class MallInfo2(ctypes.Structure):
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


libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2


def mallinfo() -> MallInfo2:
    """The allocator's counters now (glibc >= 2.33)."""
    return libc.mallinfo2()


def malloc_in_use() -> int:
    """Bytes allocated through malloc and not freed (heap and mmapped chunks), in bytes."""
    m = mallinfo()
    return int(m.uordblks + m.hblkhd)
