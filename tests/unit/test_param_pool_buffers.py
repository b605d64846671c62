"""The parameter swapper's buffer pool (:meth:`zerodp.offload.param_swap.ParamSwapper._buffer`) never
lets go of a buffer that a copy into a device shard may still read: the copy's ticket is waited for
before the buffer is handed out again, and before a free buffer too small for a larger shard is
dropped from the pool (found by a review of the I/O buffers' lifetimes; on the CPU tickets are None,
on a device a dropped pinned buffer could be freed under the copy)."""

from __future__ import annotations

from zerodp.offload.aio import aligned_buffer
from zerodp.offload.config import AioConfig, OffloadParamConfig
from zerodp.offload.param_swap import ParamSwapper


class _Copies:
    """Records the tickets the host waits for."""

    def __init__(self) -> None:
        self.waited: list[object] = []

    def host_wait(self, ticket: object | None) -> None:
        if ticket is not None:
            self.waited.append(ticket)


def _swapper(tmp_path, buffer_count: int) -> tuple[ParamSwapper, _Copies]:
    cfg = OffloadParamConfig(device="nvme", nvme_path=str(tmp_path), buffer_count=buffer_count, buffer_size=8192)
    sw = ParamSwapper(cfg, AioConfig(), 0, None)
    copies = _Copies()
    sw.copies = copies  # type: ignore[assignment]  # the stand-in records host waits only
    return sw, copies


def test_a_dropped_small_buffer_waits_for_the_copy_still_reading_it(tmp_path):
    sw, copies = _swapper(tmp_path, buffer_count=1)
    small = aligned_buffer(4096)
    sw.pool, sw.free, sw.largest = [small], [small], 8192
    sw._reading[id(small)] = "copy of the last chunk"
    buf = sw._buffer(8192)
    assert copies.waited == ["copy of the last chunk"] and sw._reading == {}
    assert buf.numel() >= 8192 and sw.pool == [buf]


def test_a_reused_buffer_waits_for_its_copy(tmp_path):
    sw, copies = _swapper(tmp_path, buffer_count=2)
    big = aligned_buffer(8192)
    sw.pool, sw.free, sw.largest = [big], [big], 8192
    sw._reading[id(big)] = "ticket"
    assert sw._buffer(4096) is big and copies.waited == ["ticket"]
