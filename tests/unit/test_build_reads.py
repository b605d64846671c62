"""Building a model under ``zero.Init`` with ``offload_param`` on NVMe, then ``initialize``, reads each
parameter shard from ``params.swp`` only where its values are needed (issue 31: the 3x build read the
parameter file about nine times). Writing a unit's initialised values back overwrites its whole shard,
and making the optimizer's pieces (views of the shards) needs their storage, not their values: neither
reads the file (:meth:`zerodp.offload.param_swap.ParamSwapper.acquire` with ``fill=False``)."""

from __future__ import annotations

import pytest
import torch
from test_offload_nvme_device import _nvme_config
from torch import nn

import zerodp
from zerodp.offload.param_swap import ParamSwapper

WIDTH, LAYERS = 64, 4


def _build() -> nn.Sequential:
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    with torch.no_grad():  # the model's own init after construction (as HF's post_init)
        for m in model:
            nn.init.normal_(m.weight, std=0.02)
            m.bias.fill_(0.5)
    return model


def test_init_and_initialize_read_no_shard_they_overwrite_or_only_view(world1, tmp_path):
    torch.manual_seed(0)
    plain = [p.detach().clone() for p in _build().parameters()]
    cfg = _nvme_config(3, str(tmp_path), param_nvme=True)
    torch.manual_seed(0)
    with zerodp.zero.Init(config=cfg) as zi:
        model = _build()
    sw: ParamSwapper = zi.swapper
    shard_bytes = sum(s.nbytes for s in sw.shards)
    # the init's gathers read each unit once; its write-backs read nothing (was: once more each)
    assert sw.counters.blank_acquires >= LAYERS
    assert 0 < sw.counters.bytes_read <= 1.1 * shard_bytes + 4096 * len(sw.shards), (
        sw.counters.bytes_read,
        shard_bytes,
    )
    blank, read = sw.counters.blank_acquires, sw.counters.bytes_read
    engine = zerodp.initialize(model, cfg)
    assert engine.param_offload.swapper is sw
    # the pieces are views made without a read; the fp32 masters read each shard (not twice)
    assert sw.counters.blank_acquires - blank >= len(engine.groups)
    assert sw.counters.bytes_read - read <= 2.1 * shard_bytes + 4096 * len(sw.shards)
    with zerodp.zero.GatheredParameters(list(engine.module.parameters())):
        built = [p.detach().float().clone() for p in engine.module.parameters()]
    assert all(torch.equal(a, b.bfloat16().float()) for a, b in zip(built, plain, strict=True))
    x = torch.randn(3, WIDTH, generator=torch.Generator().manual_seed(1)).bfloat16()
    engine.backward(engine(x).float().square().mean())
    engine.step()
    engine.close()


def test_a_shard_pinned_without_values_refuses_a_read_of_its_values(world1, tmp_path):
    cfg = _nvme_config(3, str(tmp_path), param_nvme=True)
    with zerodp.zero.Init(config=cfg) as zi:
        _build()
    sw: ParamSwapper = zi.swapper
    s = sw.shards[0]
    sw.acquire(s, fill=False)
    with pytest.raises(RuntimeError, match="without its values"):
        sw.acquire(s)
    sw.release(s, dirty=False, keep=True)  # not kept: its storage holds no values
    assert s.storage_bytes() == 0 and not s.blank
    sw.close()
