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
