"""zerodp.runtime.zero_pages: a gradient buffer zeroed by giving its pages back to the kernel reads
exactly zeros afterwards (as ``torch.zeros`` / ``zero_()``) and no longer counts in the resident set
(read from ``/proc/self/smaps``, the kernel's count for the mapping, not the buffer's bookkeeping)."""

from __future__ import annotations

import pytest
import torch

from zerodp.runtime.zero_pages import HUGE_PAGE, ZeroPageBuffer, huge_pages_available

MiB = 1 << 20


def mapping_rss(addr: int) -> int:
    """Resident bytes of the mapping of this process that contains address ``addr``."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping contains {addr:#x}")


@pytest.mark.skipif(not huge_pages_available(), reason="needs Linux with transparent huge pages")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zeroed_pages_read_zero_and_leave_the_resident_set(dtype: torch.dtype) -> None:
    numel = (8 * MiB) // torch.empty((), dtype=dtype).element_size() + 3  # not a whole number of pages
    buf = ZeroPageBuffer.like(torch.empty(numel, dtype=dtype))
    t = buf.tensor
    assert buf.mapping is not None and t.shape == (numel,) and t.dtype == dtype
    assert t.data_ptr() % HUGE_PAGE == 0
    assert torch.equal(t, torch.zeros(numel, dtype=dtype))
    values = torch.randn(numel).to(dtype)
    t.add_(values)  # the way gradients accumulate into the buffer's views
    assert torch.equal(t, values)
    assert mapping_rss(t.data_ptr()) >= 8 * MiB
    view = t[5:1005]  # a view taken before zeroing (param.grad) sees the zeros too
    buf.zero_()
    assert mapping_rss(t.data_ptr()) < MiB
    assert torch.equal(t, torch.zeros(numel, dtype=dtype)) and not view.any()
    t[-1] = 1.0  # still writable after the pages were dropped
    assert t[-1].item() == 1.0 and t[:-1].count_nonzero().item() == 0


@pytest.mark.skipif(not huge_pages_available(), reason="needs Linux with transparent huge pages")
def test_tail_under_a_huge_page_is_zeroed_in_place() -> None:
    # the whole huge page is given back; the 1 MiB tail is zeroed with zero_() and stays resident
    # (releasing its base pages made backward fault them in again at every step)
    numel = (2 * MiB + MiB) // 4
    buf = ZeroPageBuffer.like(torch.empty(numel))
    t = buf.tensor
    assert buf.mapping is not None and buf.tail is not None and buf.tail.numel() == MiB // 4
    t.add_(torch.randn(numel))
    assert mapping_rss(t.data_ptr()) >= 2 * MiB and mapping_rss(t[-1].data_ptr()) >= MiB
    buf.zero_()
    assert mapping_rss(t.data_ptr()) < MiB  # the huge page's mapping
    assert mapping_rss(t[-1].data_ptr()) >= MiB  # the tail's (madvise split the mapping in two)
    assert not t.any()


def test_buffer_under_a_huge_page_is_plain() -> None:
    buf = ZeroPageBuffer.like(torch.empty(HUGE_PAGE // 4 - 1), lazy=True)
    assert buf.mapping is None and buf.tensor.numel() == HUGE_PAGE // 4 - 1 and not buf.tensor.any()
    buf.tensor.fill_(1.0)
    buf.zero_()
    assert not buf.tensor.any()


def test_plain_buffer_when_not_lazy() -> None:
    buf = ZeroPageBuffer.like(torch.ones(10, dtype=torch.float64), lazy=False)
    assert buf.mapping is None and torch.equal(buf.tensor, torch.zeros(10, dtype=torch.float64))
    buf.tensor.fill_(2.0)
    buf.zero_()
    assert torch.equal(buf.tensor, torch.zeros(10, dtype=torch.float64))
    assert ZeroPageBuffer.like(torch.empty(0)).tensor.numel() == 0
