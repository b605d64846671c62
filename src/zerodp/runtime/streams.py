"""Side streams for collectives (stage 3's all-gathers, stages 0-3's gradient reductions), ordered
against the compute stream by events, as FSDP2 orders its all-gather and reduce-scatter streams
(torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py) and DeepSpeed its all-gather and
reduce-and-partition streams (``overlap_comm``).

[Note: comm streams] A collective issued while a :class:`SideStream` is current (:meth:`issuing`) is
ordered after that stream's work: on NCCL, the communicator's internal stream waits for it, so the
collective does not wait for the compute kernels issued before it unless told to. The rules:

- before a side stream reads or writes memory the compute stream produced or used, it waits for an
  event recorded on the compute stream (:meth:`SideStream.after_compute`, or a pooled buffer's
  release event, see [Note: gather pool] in :mod:`zerodp.stage3.pool`);
- the compute stream uses what a collective wrote only after waiting for an event recorded on the
  side stream once the collective's ``Work`` was waited for on it (:meth:`SideStream.done`: on NCCL
  ``work.wait()`` is a stream wait, so the host does not block; on gloo it is the host wait it
  always was);
- memory is allocated and freed on the compute stream only (never inside :meth:`issuing`), and only
  after the compute stream waited for every side-stream use, so the CUDA caching allocator's
  per-stream reuse needs no ``record_stream``.

Streams and events come from the device's module (:func:`zerodp.runtime.device.device_handle`): on
the CPU, ``torch.cpu``'s are no-ops and the same lines run (tests inject a recording stand-in to check
the order). Run on one H200 at one rank (docs/gpu.md); NCCL between GPUs has not run.
"""

from __future__ import annotations

from typing import Any

import torch

from zerodp.runtime import device as devices


class SideStream:
    """One stream for collectives on ``device`` (``name``: "all_gather" or "reduce", for messages and
    tests), with the events that order it against the compute stream (see [Note: comm streams]).

    Attributes:
        stale: the values the compute stream wrote may not have been waited for yet (a shard was
            written back): the next launch that relies on earlier waits calls :meth:`after_compute`.
    """

    def __init__(self, device: torch.device, name: str) -> None:
        self.device = device
        self.name = name
        self.stream = devices.new_stream(device)
        self.stale = True

    def compute(self) -> Any:
        """The compute stream: the stream current now (the user's, or the device's default)."""
        return devices.current_stream(self.device)

    def compute_event(self) -> Any:
        """An event recorded now on the compute stream (marks what it has issued so far)."""
        event = devices.new_event(self.device)
        event.record(self.compute())
        return event

    def after_compute(self) -> None:
        """This stream waits for everything issued to the compute stream so far (no host sync)."""
        self.stream.wait_event(self.compute_event())
        self.stale = False

    def wait_for(self, event: Any | None) -> None:
        """This stream waits for ``event`` (e.g. a pooled buffer's release event); None: nothing."""
        if event is not None:
            self.stream.wait_event(event)

    def issuing(self) -> Any:
        """Context manager: work issued inside it (collectives only: nothing allocated) goes to this
        stream."""
        return devices.use_stream(self.device, self.stream)

    def done(self, work: Any | None) -> None:
        """The compute stream waits for ``work`` (a collective issued on this stream): ``work.wait()``
        on this stream, an event recorded after it, the compute stream waits for that event."""
        with self.issuing():
            if work is not None:
                work.wait()
            event = devices.new_event(self.device)
            event.record(self.stream)
        self.compute().wait_event(event)
