"""The gradient swap file (``gradients.swp``, CPU training at stages 2-3 without loss scaling) has an
I/O pool of its own: a sub-group's gradient read is not queued behind the optimizer swapper's reads
ahead and writes (each up to a whole sub-group region), which made every update wait for them."""

from __future__ import annotations

import threading
from concurrent.futures import wait

import pytest
import torch
from test_offload_device import _model
from test_offload_nvme_device import _nvme_config

import zerodp


@pytest.mark.parametrize("stage", [2, 3])
def test_gradient_reads_complete_while_the_optimizer_pool_is_busy(world1, tmp_path, stage):
    engine = zerodp.initialize(_model(None), _nvme_config(stage, str(tmp_path)))
    off = engine.optimizer_offload
    x = torch.randn(4, 12, generator=torch.Generator().manual_seed(0)).bfloat16()
    engine.backward(engine(x).float().square().mean())
    spill = off.spill
    assert spill is not None and spill.on_disk, "the reduced gradients went to gradients.swp"
    index = min(spill.on_disk)
    release = threading.Event()
    blockers = [off.swap_io.pool.submit(release.wait) for _ in range(off.aio_cfg.thread_count)]
    try:
        handle, views = spill.read_ranges([(index, 0, spill.extents[index].numel)], None)
        done, _ = wait(handle.futures, timeout=10)
        assert len(done) == len(handle.futures), "a gradient read waited for the optimizer's I/O threads"
        handle.wait()
        first = views[0].clone()
    finally:
        release.set()
        wait(blockers)
    assert torch.equal(first, spill.get(index)), "the read returned the gradient written to the file"
    engine.step()
    engine.close()


def test_the_norm_pass_reads_one_piece_ahead_and_gives_the_same_gradients(world1, tmp_path):
    """``step()``'s gradient-norm pass over ``gradients.swp`` (issue 31: it read one piece at a time,
    one call in flight): piece k+1's read is issued before piece k is handed out, and the fp32
    gradients it hands out are those read one at a time (``grad_of``)."""
    engine = zerodp.initialize(_model(None), _nvme_config(3, str(tmp_path)))
    off = engine.optimizer_offload
    x = torch.randn(4, 12, generator=torch.Generator().manual_seed(0)).bfloat16()
    engine.backward(engine(x).float().square().mean())
    spill = off.spill
    assert spill is not None and spill.on_disk
    spill.span_norms.clear()  # as when they were not taken at the put (a clip_grad_norm_ factor, fp16)
    issued: list = []
    read_ranges, norm_grads = spill.read_ranges, off.norm_grads
    passes: list = []

    def counted(spans, slot):
        issued.append(spans)
        return read_ranges(spans, slot)

    def checked(pieces):  # inside step(): the pieces are staged
        one_by_one = [g.clone() for g in (off.grad_of(p) for p in pieces) if g is not None]
        issued.clear()
        got, ahead = [], []
        for k, g in enumerate(norm_grads(pieces)):
            ahead.append(len(issued) - (k + 1))
            got.append(g.clone())
        passes.append((one_by_one, got, ahead, len(issued)))
        return iter(got)

    spill.read_ranges, off.norm_grads = counted, checked
    engine.step()
    spill.read_ranges, off.norm_grads = read_ranges, norm_grads
    one_by_one, got, ahead, reads = max(passes, key=lambda p: len(p[0]))
    assert len(one_by_one) >= 3 and reads == len(one_by_one) == len(got)
    assert all(torch.equal(a, b) for a, b in zip(one_by_one, got, strict=True))
    assert ahead == [1] * (len(got) - 1) + [0], ahead
    engine.close()
