"""The NVMe optimizer offload with the engine on a device, run on the CPU through the device code path
(see tests/unit/test_offload_device.py for how: the device decision and ``torch.cuda.is_available``
patched, pinned requests recorded, the device's module a recording stand-in with vector clocks). No GPU
here; none of this has run on one.

Checked: ``offload_optimizer.device: nvme`` with the parameters on a device asks for the same
device-generic machinery as ``device: cpu`` (zerodp.offload.stream's copy stream in device mode,
page-locked gradient, staging and swap buffers), trains bitwise like the non-offloaded engine (bf16,
``cpu_adam: same``, an edit through ``.data``), finds edits with one fingerprint host sync per step
(no element-wise compare of unedited spans), does not block the host on the parameter copies, and the
next forward runs after the compute stream waited for them; with ``offload_param`` on NVMe too
(ZeRO-Infinity, stage 3) the result is still the non-offloaded engine's.
"""

from __future__ import annotations

import pytest
import torch
from test_offload_device import _check_order, _config, _model, _train, _weights
from test_stream_order import FakeDeviceModule

import zerodp
from zerodp.offload import edits, nvme_device
from zerodp.runtime import device


@pytest.fixture
def on_device(monkeypatch):
    """The device branches on (test_offload_device.py's fixture): accelerator engine, CUDA present;
    returns the list of pinned sizes requested."""
    pinned: list[int] = []

    def page_locked(shape, dtype):
        pinned.append(int(torch.Size(shape).numel()))
        return torch.empty(shape, dtype=dtype)

    monkeypatch.setattr(device, "is_accelerator", lambda d: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(device, "_page_locked_empty", page_locked)
    return pinned


def _nvme_config(stage: int, path: str, param_nvme: bool = False) -> dict:
    cfg = _config(stage, True, False)
    zc = cfg["zero_optimization"]
    zc["offload_optimizer"] = {"device": "nvme", "nvme_path": path, "cpu_adam": "same", "buffer_count": 3}
    zc["sub_group_size"] = 100  # several sub-groups, pieces cut across them
    if param_nvme:
        zc["offload_param"] = {"device": "nvme", "nvme_path": path, "buffer_size": 4096, "buffer_count": 2}
    return cfg


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_nvme_optimizer_offload_on_a_device_uses_the_copy_stream(world1, on_device, monkeypatch, tmp_path, stage):
    reference = zerodp.initialize(_model(None), _config(stage, False, False))
    ref_losses = _train(reference, None)
    fake = FakeDeviceModule()
    monkeypatch.setattr(device, "device_handle", lambda d: fake)
    folded: list[int] = []
    real_fold = edits.fold_edit

    def counting_fold(t, m):
        folded.append(t.numel())
        return real_fold(t, m)

    monkeypatch.setattr("zerodp.offload.nvme.fold_edit", counting_fold)
    monkeypatch.setattr("zerodp.offload.swap_masters.fold_edit", counting_fold)
    on_device.clear()
    engine = zerodp.initialize(_model(fake), _nvme_config(stage, str(tmp_path)))
    off = engine.optimizer_offload
    assert off.device == "nvme" and off.on_device and off.copies.on_device and off.pin
    assert not off.deferred and off.span_prints is not None and len(off.subgroups) > 1
    # page-locked: each piece's fp32 host gradient, the staging slots (bf16) and the swap buffers, nothing else
    sizes = [p.hi - p.lo for p in off.pieces]
    assert len(off.writer.slots) == nvme_device.STAGING_SLOTS
    slots = [s.numel() for s in off.writer.slots]
    swaps = [b.untyped_storage().nbytes() for b in off.buffers]  # aligned views of larger allocations
    assert sorted(on_device) == sorted(sizes + slots + swaps), (on_device, sizes, slots, swaps)
    fake.log.clear()
    device.reset_host_syncs()
    losses = _train(engine, fake)
    assert losses == ref_losses
    for a, b in zip(_weights(reference), _weights(engine), strict=True):
        assert torch.equal(a, b)
    if stage < 3:  # the .data edit: only the spans of the edited piece are compared, at one step
        assert 0 < len(folded) <= 3 and sum(folded) <= 12 * 12, folded
    else:
        assert folded == [], folded
    assert device.HOST_SYNCS["offload_edits"] == 3  # one fingerprint check per step, every span at once
    # the gradients crossed on the copy stream, the updated masters too (one copy per updated span)
    spans = sum(len(sg.spans) for sg in off.subgroups)
    assert off.copies.copies >= 3 * (len(off.pieces) + spans)
    _check_order(fake, off.copies._side.name)
    assert off.host_bytes(engine.optimizer)["swap_buffers"] >= off.writer.nbytes() > 0
    engine.close()


def test_module_writer_waits_for_a_slot_before_rewriting_it(monkeypatch):
    """The host waits for a staging slot's last copy only when the slot comes round again (sub-group
    k+2), never for the copies of the sub-group just written; on the CPU engine the write is a cast."""
    monkeypatch.setattr(device, "is_accelerator", lambda d: True)
    fake = FakeDeviceModule()
    monkeypatch.setattr(device, "device_handle", lambda d: fake)
    from zerodp.offload.stream import CopyStream

    copies = CopyStream("cpu")
    waited: list[object] = []
    real = copies.host_wait
    monkeypatch.setattr(copies, "host_wait", lambda t: waited.append(t) or real(t))
    writer = nvme_device.ModuleWriter(copies, pin=False)
    writer.plan([[6 * 2, 3 * 2], [10 * 2]])
    assert len(writer.slots) == 2 and writer.slots[0].numel() == 32  # 16-byte aligned spans
    dst = torch.zeros(10, dtype=torch.bfloat16)
    tickets = []
    for k in range(3):
        writer.begin()
        writer.write(dst[:6], torch.full((6,), float(k)))
        writer.write(dst[6:9], torch.full((3,), k + 0.5))
        tickets.append(copies._last)
        writer.end()
        assert torch.equal(dst[:9].float(), torch.tensor([k] * 6 + [k + 0.5] * 3))
    assert [t for t in waited if t is not None] == [tickets[0]]  # slot 0 reused by the third sub-group
    monkeypatch.setattr(device, "is_accelerator", lambda d: False)
    cpu = nvme_device.ModuleWriter(CopyStream("cpu", threaded=False), pin=False)
    cpu.plan([[8]])
    cpu.begin()
    cpu.write(dst[:2], torch.tensor([1.5, 2.5]))
    cpu.end()
    assert cpu.slots == [] and dst[:2].tolist() == [1.5, 2.5]


def test_param_and_optimizer_nvme_on_a_device_equal_stage3(world1, on_device, tmp_path):
    """ZeRO-Infinity on a device: parameters and optimizer states on NVMe, stage 3, the device path;
    the swapped shards' spans are not fingerprinted (not resident when the step starts) and are
    compared in the sub-group's buffer."""
    reference = zerodp.initialize(_model(None), _config(3, False, False))
    ref_losses = _train(reference, None)
    engine = zerodp.initialize(_model(None), _nvme_config(3, str(tmp_path), param_nvme=True))
    off = engine.optimizer_offload
    assert off.on_device and off.shard_access is not None and engine.param_offload.swapper.copies.on_device
    losses = _train(engine, None)
    assert losses == ref_losses
    for a, b in zip(_weights(reference), _weights(engine), strict=True):
        assert torch.equal(a, b)
    swapped = [i for i in range(len(off.pieces)) if not off._watched(i)]
    assert swapped and all(k[0] not in swapped for k in off.span_prints.prints)
    engine.close()
