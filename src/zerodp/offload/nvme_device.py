"""The device branch of the NVMe optimizer offload (:mod:`zerodp.offload.nvme`) with the engine on a GPU:
the updated masters of each sub-group go back into the module through the copy stream, and in-place
edits of the module's parameters are found by fingerprints instead of a copy of every piece to the host.

- :class:`ModuleWriter`: on a device each fp32 master span is cast on the host into a page-locked
  staging slot of the module's dtype (a ``non_blocking`` copy cannot cast) and copied host -> device on
  the offload's :class:`zerodp.offload.stream.CopyStream`; :data:`STAGING_SLOTS` slots rotate per
  sub-group, so the CPU casts sub-group k+1 while k's copies run; the host waits for a slot's last
  copy only before it rewrites that slot (reason ``offload_copy``). After each sub-group the compute
  stream waits for the copies (an event wait, no host sync), so every later reader of the parameters
  (the parameter swapper's write home, the all-gather, the next forward) runs after them. On the CPU
  engine the cast is a plain ``copy_`` at once, as before.
- :class:`SpanPrints`: the fingerprint (:func:`zerodp.offload.edits.fingerprint`) of each sub-group
  span ``(piece position, lo)`` taken on the device when the engine last wrote it; at the step one
  host sync (reason ``offload_edits``) says which spans changed, and only those are copied to the host
  and compared with their masters. Spans whose shard is not resident when the step starts (a
  ``offload_param`` NVMe shard, :attr:`NvmeOptimizerOffload.shard_access`) are not watched: they are
  compared in the sub-group's buffer as on the CPU (a device -> host copy of the span).

Run on one H200 at one rank (docs/gpu.md: the offload tests, the offload headline); tested on the CPU
with the device decision patched (tests/unit/test_offload_device.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from zerodp.offload import swap_masters
from zerodp.offload.edits import fingerprint
from zerodp.offload.stream import CopyStream
from zerodp.offload.subgroups import SubGroup
from zerodp.offload.swap_masters import SwappedStates
from zerodp.runtime.device import host_empty, host_flags

#: staging slots of the module dtype the sub-groups' casts rotate through (one cast while one copies)
STAGING_SLOTS = 2
#: byte alignment of each span inside a staging slot (any dtype's element size divides it)
_ALIGN = 16

#: a span of a sub-group: (piece position, first element), the key of its fingerprint
SpanKey = tuple[int, int]


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


class ModuleWriter:
    """Updated fp32 masters into the module's pieces, one sub-group at a time (module docstring).

    Call :meth:`plan` once with each sub-group's span sizes in bytes (module dtype), then per sub-group
    :meth:`begin`, :meth:`write` for each span, :meth:`end`.
    """

    def __init__(self, copies: CopyStream, pin: bool) -> None:
        self.copies = copies
        self.on_device = copies.on_device
        self.pin = pin
        self.slots: list[torch.Tensor] = []  # uint8 host buffers, page-locked with ``pin``
        self._tickets: list[object | None] = []  # per slot: its last copy
        self._turn = -1  # the slot of the sub-group being written
        self._used = 0  # bytes of that slot taken

    def plan(self, span_bytes: Iterable[list[int]]) -> None:
        """Allocate the staging slots (device only) for sub-groups whose spans take ``span_bytes``."""
        if not self.on_device:
            return
        largest = max((sum(_aligned(n) for n in spans) for spans in span_bytes), default=0)
        self.slots = [host_empty(largest, torch.uint8, self.pin) for _ in range(STAGING_SLOTS)]
        self._tickets = [None] * STAGING_SLOTS

    def begin(self) -> None:
        """Start a sub-group: take the next slot once the host has waited for its last copy."""
        if not self.on_device:
            return
        self._turn = (self._turn + 1) % len(self.slots)
        ticket, self._tickets[self._turn] = self._tickets[self._turn], None
        self.copies.host_wait(ticket)
        self._used = 0

    def write(self, dst: torch.Tensor, master: torch.Tensor) -> None:
        """``dst`` (the module's span, any dtype and device) takes ``master`` (fp32 host, same numel)."""
        if not self.on_device:
            dst.copy_(master)
            return
        nbytes = master.numel() * dst.element_size()
        stage = self.slots[self._turn][self._used : self._used + nbytes].view(dst.dtype)
        self._used += _aligned(nbytes)
        stage.copy_(master)  # the cast, on the host, into pinned memory
        self._tickets[self._turn] = self.copies.copy(dst, stage)

    def end(self) -> None:
        """The compute stream waits for this sub-group's copies (device: an event wait, no host sync)."""
        if self.on_device:
            self.copies.device_wait()

    def nbytes(self) -> int:
        """Host bytes of the staging slots."""
        return sum(s.numel() for s in self.slots)


class SpanPrints:
    """Fingerprints of the watched spans on the device (module docstring). ``tensor_of(i)``: the module's
    tensor of piece position ``i`` (1-D); ``watched(i)``: whether that piece's shard is resident
    whenever the step starts. Spans are ``(i, lo, hi)``, keyed by ``(i, lo)``."""

    def __init__(self, tensor_of: Callable[[int], torch.Tensor], watched: Callable[[int], bool]) -> None:
        self.tensor_of = tensor_of
        self.watched = watched
        self.prints: dict[SpanKey, torch.Tensor] = {}
        self.checked = 0  # spans fingerprinted at a step (tests read it)

    def take(self, spans: Iterable[tuple[int, int, int]]) -> None:
        """Record the fingerprint of each watched span (the engine just wrote it, or its master was
        made equal to it); the shards of the spans must be resident."""
        for i, lo, hi in spans:
            if self.watched(i):
                self.prints[(i, lo)] = fingerprint(self.tensor_of(i)[lo:hi])

    def drop(self, i: int) -> None:
        """Forget piece ``i``'s prints (its master was rewritten from the module: compared next step)."""
        self.prints = {k: v for k, v in self.prints.items() if k[0] != i}

    def edited(self, spans: Iterable[tuple[int, int, int]]) -> set[SpanKey]:
        """The keys of ``spans`` to compare with their masters: watched spans whose fingerprint changed
        or was never taken (one host sync for all; none when no span is watched) and every unwatched one."""
        out: set[SpanKey] = set()
        keys: list[SpanKey] = []
        flags: list[torch.Tensor] = []
        for i, lo, hi in spans:
            old = self.prints.get((i, lo))
            if not self.watched(i) or old is None:
                out.add((i, lo))
                continue
            keys.append((i, lo))
            flags.append(fingerprint(self.tensor_of(i)[lo:hi]) != old)
        self.checked += len(keys)
        if flags:
            out.update(k for k, f in zip(keys, host_flags("offload_edits", flags), strict=True) if f)
        return out


def edited_spans(prints: SpanPrints | None, subgroups: list[SubGroup]) -> set[SpanKey] | None:
    """The spans of ``subgroups`` to compare with their masters at this step (:meth:`SpanPrints.edited`,
    one host sync); None without prints (the CPU engine): every span."""
    if prints is None:
        return None
    return prints.edited(s for sg in subgroups for s in sg.spans)


def fold_idle(
    states: SwappedStates, prints: SpanPrints | None, subgroups: list[SubGroup], edited: set[SpanKey] | None
) -> None:
    """Fold the edits of ``edited`` (None: every span) into the masters of ``subgroups`` (sub-groups the
    step does not update, :func:`zerodp.offload.swap_masters.fold_masters`), then, on a device, record
    the prints of the spans compared (their masters now equal the module's values)."""
    swap_masters.fold_masters(states, subgroups, edited)
    if prints is not None and edited:
        prints.take(s for sg in subgroups for s in sg.spans if (s[0], s[1]) in edited)


__all__ = ["ModuleWriter", "STAGING_SLOTS", "SpanKey", "SpanPrints", "edited_spans", "fold_idle"]
