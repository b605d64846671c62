"""The gradient swap file shares the optimizer swap file's direct-I/O pool (issue 31 item 4): the
sub-group loop queues each sub-group's gradient read (``gradients.swp``) right behind its region's
read (``optimizer.swp``), at the loop's read-ahead depth, into a read buffer per region buffer.
``params.swp`` keeps a pool of its own (the next forward's reads must not queue behind the loop's
read-ahead)."""

from __future__ import annotations

import os

import pytest
import torch
from test_offload_device import _model
from test_offload_nvme_device import _nvme_config

import zerodp


@pytest.mark.parametrize("param_nvme", [False, True])
@pytest.mark.parametrize("stage", [2, 3])
def test_each_gradient_read_is_queued_behind_its_regions_read_in_one_pool(world1, tmp_path, stage, param_nvme):
    if param_nvme and stage != 3:
        pytest.skip("offload_param needs stage 3")
    engine = zerodp.initialize(_model(None), _nvme_config(stage, str(tmp_path), param_nvme))
    off = engine.optimizer_offload
    io = off.swap_io
    assert off.spill is not None and off.spill.io is io, "gradients.swp goes through the optimizer's pool"
    swapper = engine.param_offload.swapper if param_nvme else None
    if swapper is not None:
        assert swapper.swap_io is not io, "params.swp keeps a pool of its own"
    calls: list[tuple[str, int, int]] = []
    read = io.read

    def recorded(f, buf, offset):
        calls.append((os.path.basename(f.path), offset, buf.numel()))
        return read(f, buf, offset)

    io.read = recorded
    x = torch.randn(4, 12, generator=torch.Generator().manual_seed(0)).bfloat16()
    engine.backward(engine(x).float().square().mean())
    assert off.spill.on_disk, "the reduced gradients went to gradients.swp"
    calls.clear()
    engine.step()
    io.read = read
    regions = [k for k, c in enumerate(calls) if c[0] == "optimizer.swp"]
    grads = [k for k, c in enumerate(calls) if c[0] == "gradients.swp"]
    assert len(regions) >= 3 and grads, calls
    # every gradient read follows a region read directly (a sub-group's spans may merge into several runs)
    for k in grads:
        assert calls[k - 1][0] in ("optimizer.swp", "gradients.swp"), calls
    first_grad_after = [next((g for g in grads if g > r), None) for r in regions]
    assert all(g is not None and g == r + 1 for r, g in zip(regions, first_grad_after, strict=True)), calls
    assert len(off.spill.read_buffers) == len(off.buffers) >= 3, "a gradient read buffer per region buffer"
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
