"""glibc's mmap threshold, pinned at stage 3 so that large transient blocks go back to the system.

[Note: mmap threshold] glibc serves blocks of at least ``M_MMAP_THRESHOLD`` bytes (128 KiB at start)
with ``mmap`` and returns them on ``free``; but the first time such a block is freed, it raises the
threshold to that block's size (up to 32 MiB), after which blocks of that size come from the heap and
stay cached there when freed. Stage 3 on gloo frees many unit-sized blocks each step that no pool can
hold: gloo's all-gather allocates a flat copy of its output per call (its reduce-scatter clones its
input, which the reducer avoids on gloo, see [Note: gloo reduce-scatter] in zerodp.runtime.reducer),
autograd allocates each weight's gradient before the reducer copies it into a (pooled) staging buffer.
With the dynamic threshold these end up as a fragmented heap, and a rank's resident set grows above
stage 0's although it holds less (see docs/benchmarks/2026-12-01-stage3-memory.md). Pinning the threshold (which also
turns its dynamic adjustment off, as setting ``MALLOC_MMAP_THRESHOLD_`` does) keeps such blocks out of the
heap. Smaller blocks (activations of typical layers) are unaffected.

glibc's own adjustment also keeps its trim threshold at twice the mmap threshold; a threshold set
with ``mallopt`` turns that off and leaves the trim threshold at its 128 KiB default, so each free
that leaves more than 128 KiB unused at the top of the heap shrinks it and the next allocation faults
those pages in again (the gather pool's slabs freed after each backward, gloo's per-call copies below
the mmap threshold). Pinning therefore also sets ``M_TRIM_THRESHOLD`` to twice the pinned value, as the
dynamic rule would (unless the user set ``MALLOC_TRIM_THRESHOLD_``), which cuts the page faults per
step (docs/benchmarks/2026-12-01-bench.md, "Stage-3 copies").

This is process-wide and cannot be undone by zerodp; it is applied once, when a stage-3 engine (or
``zero.Init``) is built, only on glibc, and never when the user set ``MALLOC_MMAP_THRESHOLD_`` (their
value wins). ``ZERODP_STAGE3_MMAP_THRESHOLD`` (bytes) overrides the value; ``0`` leaves glibc alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

#: the value pinned at stage 3 (bytes): blocks of 4 MiB or more are mmapped and returned on free
STAGE3_MMAP_THRESHOLD = 4 * 1024 * 1024

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter numbers
_M_TRIM_THRESHOLD = -1
_pinned: int | None = None


def pin_mmap_threshold(nbytes: int = STAGE3_MMAP_THRESHOLD) -> int | None:
    """Set glibc's ``M_MMAP_THRESHOLD`` to ``nbytes`` (once per process). Returns the value in force
    after the call as far as zerodp knows (None: not glibc, turned off with
    ``ZERODP_STAGE3_MMAP_THRESHOLD=0``, or left to ``MALLOC_MMAP_THRESHOLD_``).

    Raises:
        ValueError: ``nbytes`` (or ``ZERODP_STAGE3_MMAP_THRESHOLD``) is not a byte count in (0, 32 MiB]
            (glibc's maximum on 64-bit).
    """
    global _pinned
    override = os.environ.get("ZERODP_STAGE3_MMAP_THRESHOLD")
    if override is not None:
        try:
            nbytes = int(override)
        except ValueError:
            raise ValueError(f"ZERODP_STAGE3_MMAP_THRESHOLD must be a byte count (0: off), got {override!r}") from None
        if nbytes == 0:
            return None
    if not 0 < nbytes <= 32 * 1024 * 1024:
        raise ValueError(f"mmap threshold must be in (0, 32 MiB], got {nbytes} bytes")
    if _pinned is not None or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return _pinned
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to pin
        return None
    if mallopt(_M_MMAP_THRESHOLD, int(nbytes)) == 1:
        _pinned = int(nbytes)
        if "MALLOC_TRIM_THRESHOLD_" not in os.environ:
            mallopt(_M_TRIM_THRESHOLD, 2 * int(nbytes))  # what glibc's dynamic rule would keep
    return _pinned
