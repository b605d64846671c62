"""Asynchronous copies between the module's tensors (on the engine's device) and host memory for
ZeRO-Offload and ZeRO-Infinity: gradients device -> host as each bucket's reduce-scatter completes,
updated parameters host -> device while the CPU optimizer updates the next chunk, parameter shards
host -> device before their all-gather.

Source: Ren et al., "ZeRO-Offload" (USENIX ATC 2021), section 4.2 (gradients are moved to the CPU
bucket by bucket as they are reduced, overlapping backward; updated fp16 parameters are copied back
while the CPU computes the rest). DeepSpeed: ``stage_1_and_2.py`` ``async_accumulate_grad_in_cpu_via_gpu``
and ``overlap_comm`` copy streams.

[Note: copy stream] One :class:`CopyStream` per user (an optimizer offload, a parameter offload), on
the engine's device, chosen once at construction; :meth:`CopyStream.copy` returns at once with a
ticket, copies run in submission order (a later copy of the same tensor overwrites an earlier one).

- Device (CUDA; any ``device.type`` other than ``"cpu"``): the copy is issued with
  ``non_blocking=True`` on a side stream (:func:`zerodp.runtime.device.new_stream`) that first waits
  for an event recorded on the compute stream at submission (so it reads what the compute stream
  produced, and writes memory the compute stream allocated, only after that); an event recorded after
  it is the ticket. :meth:`CopyStream.device_wait` makes the compute stream wait for every copy so
  far (no host sync: the next kernel that reads an updated parameter runs after its copy);
  :meth:`CopyStream.host_wait` blocks the host on one ticket (before the CPU reads a copied
  gradient, or writes a host buffer a copy still reads). No ``record_stream``: a device tensor a copy
  reads or writes is not freed before the compute stream waited for the copy (:meth:`device_wait`,
  or a host wait), as [Note: comm streams] in :mod:`zerodp.runtime.streams` requires.
- CPU engine, ``threaded`` (the optimizer offload): the copy runs on one worker thread
  (``Tensor.copy_`` releases the GIL), so it overlaps the caller's arithmetic; the ticket is its
  future, and :meth:`device_wait` is a host wait (the CPU is the device).
- CPU engine, not ``threaded`` (the parameter offload's staging): the copy runs inline.

The same calls run in every mode; on the CPU tests replace the device module
(:func:`zerodp.runtime.device.device_handle`) to check the event order. The device mode ran on one H200
at one rank (docs/gpu.md). A copy is exact (``copy_``, with the cast the synchronous copy makes), so results
do not depend on when it ran. Errors raised by a threaded copy are re-raised by the waits.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from zerodp.runtime import device as devices

#: device copies not waited for by the host, beyond which the completed ones are dropped (``Event.query``)
PRUNE_AT = 64


class CopyStream:
    """Ordered asynchronous ``dst.copy_(src)`` on ``device`` (see [Note: copy stream]).

    Attributes:
        copies: copies submitted so far (tests and reports read it).
        on_device: the stream mode (``device`` is not the CPU).
    """

    def __init__(self, device: torch.device | str = "cpu", threaded: bool = True) -> None:
        self.device = torch.device(device)
        self.on_device = devices.is_accelerator(self.device)
        self.threaded = threaded and not self.on_device
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[Any] = []  # tickets not yet waited for by the host (futures or events)
        self._last: Any | None = None  # the event of the latest device copy
        self._side: Any | None = None  # the copy stream, created on the first device copy
        self.copies = 0

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Any | None:
        """Enqueue ``dst.copy_(src)`` and return its ticket (None: done already). ``src`` must not be
        written, nor ``dst`` read, until the ticket was waited for (:meth:`host_wait`, or
        :meth:`device_wait` for a reader on the compute stream).

        Shapes: ``dst`` and ``src`` have the same number of elements (any dtypes: cast as ``copy_``)."""
        self.copies += 1
        if self.on_device:
            return self._device_copy(dst, src)
        if not self.threaded:
            dst.copy_(src)
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zerodp-offload-copy")
        future = self._pool.submit(dst.copy_, src)
        self._pending.append(future)
        return future

    def _device_copy(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        if self._side is None:
            self._side = devices.new_stream(self.device)
        produced = devices.new_event(self.device)
        produced.record(devices.current_stream(self.device))
        self._side.wait_event(produced)
        with devices.use_stream(self.device, self._side):
            dst.copy_(src, non_blocking=True)
            done = devices.new_event(self.device)
            done.record(self._side)
        if len(self._pending) >= PRUNE_AT:  # a user that never waits on the host (a device reader)
            self._pending = [e for e in self._pending if not e.query()]
        self._pending.append(done)
        self._last = done
        return done

    def pending(self) -> int:
        """Copies submitted and not yet waited for by the host."""
        return len(self._pending)

    def host_wait(self, ticket: Any | None) -> None:
        """Block the host until the copy of ``ticket`` is done (None: nothing); re-raise its error."""
        if ticket is None:
            return
        if isinstance(ticket, Future):
            ticket.result()
        else:
            devices.wait_event("offload_copy", ticket)

    def wait(self) -> None:
        """Block the host until every submitted copy is done; re-raise the first error of one."""
        pending, self._pending = self._pending, []
        for ticket in pending:
            self.host_wait(ticket)

    def device_wait(self) -> None:
        """The compute stream waits for every copy submitted so far: on a device an event wait (no
        host sync); on the CPU the host waits (:meth:`wait`), the CPU being the device."""
        if not self.on_device:
            self.wait()
        elif self._last is not None:
            devices.current_stream(self.device).wait_event(self._last)

    def close(self) -> None:
        """Finish what is in flight and stop the worker thread."""
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None


__all__ = ["CopyStream"]
