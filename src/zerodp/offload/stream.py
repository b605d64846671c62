"""Asynchronous copies between the module's tensors and the host partition of ZeRO-Offload: gradients
device -> host as each bucket's reduce-scatter completes during backward, updated parameters
host -> device while the CPU optimizer updates the next chunk.

Source: Ren et al., "ZeRO-Offload" (USENIX ATC 2021), section 4.2 (gradients are moved to the CPU
bucket by bucket as they are reduced, overlapping backward; updated fp16 parameters are copied back
while the CPU computes the rest). DeepSpeed: ``stage_1_and_2.py`` ``async_accumulate_grad_in_cpu_via_gpu``
and ``overlap_comm`` copy streams.

One :class:`CopyStream` per offload. :meth:`CopyStream.copy` returns at once; copies run in
submission order (so a later copy of the same piece overwrites an earlier one), and
:meth:`CopyStream.wait` blocks until every copy submitted so far has finished.

- On CUDA (either side on a CUDA device): the copy is enqueued with ``non_blocking=True`` on a side
  stream that first waits for the producing (current) stream; an event recorded after it is what
  :meth:`wait` synchronises on. The source is marked used by the side stream (``record_stream``) so
  the caching allocator does not hand its memory out while the copy runs.
- On a CPU-only machine (both sides in host memory): the copy runs on one worker thread
  (``Tensor.copy_`` releases the GIL), so it overlaps the caller's backward or optimizer arithmetic;
  its future is the "event". The same code path runs as on CUDA: submit per bucket, wait at the step.

A copy is exact (``copy_``, with the same dtype cast the synchronous copy makes), so results do not
depend on whether or when it ran asynchronously. Errors raised by a copy are re-raised by :meth:`wait`.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch


class CopyStream:
    """Ordered asynchronous ``dst.copy_(src)`` (see the module docstring)."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._futures: list[Future] = []
        self._events: list[Any] = []
        self._side: Any | None = None  # torch.cuda.Stream, created on the first CUDA copy
        self.copies = 0  # submitted so far (tests and reports read it)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Enqueue ``dst.copy_(src)``; ``src`` must not be written until :meth:`wait` returns.

        Shapes: ``dst`` and ``src`` have the same number of elements (any dtypes: cast as ``copy_``)."""
        self.copies += 1
        if dst.is_cuda or src.is_cuda:
            if self._side is None:
                self._side = torch.cuda.Stream(device=dst.device if dst.is_cuda else src.device)
            self._side.wait_stream(torch.cuda.current_stream(self._side.device))
            with torch.cuda.stream(self._side):
                dst.copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._side)
            for t in (dst, src):
                if t.is_cuda:
                    t.record_stream(self._side)
            self._events.append(event)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zerodp-offload-copy")
        self._futures.append(self._pool.submit(dst.copy_, src))

    def pending(self) -> int:
        """Copies submitted and not yet waited for."""
        return len(self._futures) + len(self._events)

    def wait(self) -> None:
        """Block until every submitted copy is done; re-raise the first error of one."""
        futures, self._futures = self._futures, []
        events, self._events = self._events, []
        for e in events:
            e.synchronize()
        for f in futures:
            f.result()

    def close(self) -> None:
        """Finish what is in flight and stop the worker thread."""
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None


__all__ = ["CopyStream"]
