"""ZeRO-Offload and ZeRO-Infinity with the engine on a device, run on the CPU through the device code path.

No GPU here. :func:`zerodp.runtime.device.is_accelerator` is patched to say the engine's device is an
accelerator (the tensors stay on the CPU), ``torch.cuda.is_available`` to say CUDA is present (so pinned
buffers are requested; ``zerodp.runtime.device._page_locked_empty`` records each request and allocates
pageable memory), and, where the order of copies against the compute stream is checked, the device's
module is the recording stand-in of tests/unit/test_stream_order.py (streams with vector clocks). The
offloads then take their device branches: copies on the copy stream ordered by events, pinned host
buffers, shard homes in host memory, edits found by fingerprints. Checked here:

- training equals the non-offloaded engine (bitwise, ``cpu_adam: same``) at stages 1-3 under bf16, with
  an in-place edit through ``w.data`` between steps (which moves no version counter);
- the pinned buffers requested are exactly the host partition (masters, gradients, bf16 staging) or the
  shards' host homes;
- each forward runs after the compute stream waited for the last host -> device copy of the updated
  parameters (optimizer offload) or of its unit's shard (parameter offload); the host waits for a
  gradient's device -> host copy before the CPU Adam reads it; ``step()`` does not block the host on
  the parameter copies;
- no per-step copy of the partition to the host: without edits no piece is compared element by element.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_stream_order import FakeDeviceModule, Layer
from torch import nn

import zerodp
from zerodp.offload import edits
from zerodp.offload.param_home import HostShard
from zerodp.runtime import device


@pytest.fixture
def on_device(monkeypatch):
    """The device branches on: accelerator engine, CUDA present; returns the list of pinned sizes."""
    pinned: list[int] = []

    def page_locked(shape, dtype):
        pinned.append(int(torch.Size(shape).numel()))
        return torch.empty(shape, dtype=dtype)

    monkeypatch.setattr(device, "is_accelerator", lambda d: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(device, "_page_locked_empty", page_locked)
    return pinned


def _model(fake: FakeDeviceModule | None) -> nn.Sequential:
    torch.manual_seed(0)
    layers = []
    for i in range(3):
        layer = Layer(12, 12)
        layer.tag, layer.fake = f"{i}", fake or FakeDeviceModule()
        layers.append(layer)
    return nn.Sequential(layers[0], nn.Tanh(), layers[1], nn.Tanh(), layers[2])


def _config(stage: int, optimizer_offload: bool, param_offload: bool) -> dict:
    zc: dict = {"stage": stage, "reduce_bucket_size": 200, "stage3_param_persistence_threshold": 0}
    if optimizer_offload:
        zc["offload_optimizer"] = {"device": "cpu", "cpu_adam": "same"}
    if param_offload:
        zc["offload_param"] = {"device": "cpu"}
    return {
        "device": "cpu",
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "bf16": {"enabled": True},
        "zero_optimization": zc,
    }


def _train(engine: zerodp.Engine, fake: FakeDeviceModule | None, steps: int = 3) -> list[float]:
    losses = []
    for step in range(steps):
        x = torch.randn(4, 12, generator=torch.Generator().manual_seed(step)).bfloat16()
        loss = engine(x).float().square().mean()
        engine.backward(loss)
        if fake is not None:
            fake.compute_op("step_begin")
        engine.step()
        if fake is not None:
            fake.compute_op("step_end")
        losses.append(loss.item())
        if step == 0:  # an edit through .data between steps (no version counter moves)
            with torch.no_grad():
                engine.module[2].weight.data[0].mul_(0.5) if engine.stage < 3 else None
    return losses


def _weights(engine: zerodp.Engine) -> list[torch.Tensor]:
    from zerodp.accessors import safe_get_full_fp32_param

    return [safe_get_full_fp32_param(p).clone() for p in engine.module.parameters()]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_optimizer_offload_on_a_device_equals_non_offloaded(world1, on_device, monkeypatch, stage):
    reference = zerodp.initialize(_model(None), _config(stage, False, False))
    ref_losses = _train(reference, None)
    fake = FakeDeviceModule()
    monkeypatch.setattr(device, "device_handle", lambda d: fake)
    folded = []
    real_fold = edits.fold_edit
    monkeypatch.setattr("zerodp.offload.host.fold_edit", lambda t, m: folded.append(t.numel()) or real_fold(t, m))
    on_device.clear()
    engine = zerodp.initialize(_model(fake), _config(stage, True, False))
    off = engine.optimizer_offload
    assert off.on_device and off.copies.on_device and off.pin
    # pinned: every piece's fp32 master and gradient, and its bf16 staging buffer
    sizes = sorted(p.hi - p.lo for p in off.pieces)
    assert sorted(on_device) == sorted(sizes * 3), (on_device, sizes)
    fake.log.clear()
    device.reset_host_syncs()
    losses = _train(engine, fake)
    assert losses == ref_losses
    for a, b in zip(_weights(reference), _weights(engine), strict=True):
        assert torch.equal(a, b)
    if stage < 3:  # the .data edit was folded: only the edited piece(s), once
        assert 0 < len(folded) <= 2 and sum(folded) <= 12 * 12, folded
    else:
        assert folded == []  # no edit, no element-wise compare, no copy of the partition to the host
    assert device.HOST_SYNCS["offload_edits"] == 3  # one fingerprint check per step, all pieces at once
    assert device.HOST_SYNCS["offload_copy"] >= 3 * len(off.pieces)  # each gradient waited for by the host
    _check_order(fake, off.copies._side.name)


def _check_order(fake: FakeDeviceModule, copy_stream: str) -> None:
    """After each step, the next forward's compute clock covers every copy-stream event recorded
    during that step (the updated parameters' host -> device copies), and ``step()`` itself did not
    make the host wait for them (no wait on the copy stream's events between the step's last copy and
    its end other than the compute stream's)."""
    recorded = 0
    checked = 0
    pending_since_step = None
    for e in fake.log:
        if e[0] == "record" and e[1] == copy_stream:
            recorded = e[2].clock[copy_stream]
        elif e[:2] == ("op", "step_end"):
            pending_since_step = recorded
        elif e[:2] == ("op", "forward") and pending_since_step is not None:
            assert e[3].get(copy_stream, 0) >= pending_since_step, (e, pending_since_step)
            pending_since_step = None
            checked += 1
    assert checked == 2  # the forwards of steps 2 and 3


@pytest.mark.parametrize("optimizer_offload", [False, True])
def test_param_offload_on_a_device_equals_stage3(world1, on_device, monkeypatch, optimizer_offload):
    reference = zerodp.initialize(_model(None), _config(3, optimizer_offload, False))
    ref_losses = _train(reference, None)
    fake = FakeDeviceModule()
    monkeypatch.setattr(device, "device_handle", lambda d: fake)
    on_device.clear()
    engine = zerodp.initialize(_model(fake), _config(3, optimizer_offload, True))
    po = engine.param_offload
    homes = [u.home for u in po.units]
    assert len(homes) == 3 and all(isinstance(h, HostShard) for h in homes)
    assert po.host_shards.pin and po.host_shards.copies.on_device
    shard_sizes = sorted(h.shard.numel() for h in homes)
    assert sorted(on_device)[: len(shard_sizes)] == shard_sizes or set(shard_sizes) <= set(on_device), on_device
    fake.log.clear()
    losses = _train(engine, fake)
    assert losses == ref_losses
    for a, b in zip(_weights(reference), _weights(engine), strict=True):
        assert torch.equal(a, b)
    assert all(h.storage_bytes() == 0 for h in homes)  # between uses only the host copy remains
    counters = po.host_shards.counters
    assert counters.to_device >= 3 * 3 * 2 and counters.to_host == 3 * 3  # fwd+bwd per unit; written after each step
    # each layer's forward runs after the compute stream waited for its shard's host -> device copy
    side = po.host_shards.copies._side.name
    last_copy = 0
    forwards = 0
    for e in fake.log:
        if e[0] == "record" and e[1] == side:
            last_copy = e[2].clock[side]
        elif e[:2] == ("op", "forward"):
            assert e[3].get(side, 0) >= last_copy, e
            forwards += 1
    assert forwards == 9 and last_copy > 0
    assert "offload_param.device = cpu" in po.format(0, 3) and "host->device" in po.format(0, 3)


def test_param_offload_nvme_on_a_device_equals_stage3(world1, on_device, tmp_path):
    reference = zerodp.initialize(_model(None), _config(3, False, False))
    ref_losses = _train(reference, None)
    cfg = _config(3, False, True)
    cfg["zero_optimization"]["offload_param"] = {
        "device": "nvme",
        "nvme_path": str(tmp_path),
        "buffer_size": 4096,
        "buffer_count": 2,
    }
    on_device.clear()
    engine = zerodp.initialize(_model(None), cfg)
    swapper = engine.param_offload.swapper
    assert swapper.cfg.pin_memory is True and swapper.copies.on_device
    losses = _train(engine, None)
    assert losses == ref_losses
    for a, b in zip(_weights(reference), _weights(engine), strict=True):
        assert torch.equal(a, b)
    assert len(on_device) == len(swapper.pool) > 0  # the I/O buffers are page-locked
    assert swapper.copies.copies >= swapper.counters.chunk_reads > 0  # every read chunk crossed on the copy stream
    engine.close()


def test_fingerprint_sees_every_one_element_edit_and_swaps():
    t = torch.randn(300).bfloat16()
    base = edits.fingerprint(t)
    assert torch.equal(base, edits.fingerprint(t.clone()))
    for i in range(0, 300, 7):
        e = t.clone()
        e[i] = -e[i] if e[i] != 0 else 1.0
        assert not torch.equal(base, edits.fingerprint(e)), i
    swapped = t.clone()
    swapped[[3, 250]] = t[[250, 3]]
    assert t[3] == t[250] or not torch.equal(base, edits.fingerprint(swapped))
    f32 = torch.randn(5000)
    moved = copy.deepcopy(f32)
    moved[4999] = torch.nextafter(moved[4999], torch.tensor(1e9))  # one ulp
    assert not torch.equal(edits.fingerprint(f32), edits.fingerprint(moved))


def test_pin_memory_unset_is_resolved_from_the_engine_device():
    assert device.resolve_pin_memory(None, torch.device("cuda", 0)) is True
    assert device.resolve_pin_memory(None, torch.device("cpu")) is False
    assert device.resolve_pin_memory(False, torch.device("cuda", 0)) is False
    assert device.resolve_pin_memory(True, torch.device("cpu")) is True
    cfg = zerodp.load_config({"zero_optimization": {"stage": 3}})
    assert cfg.zero_optimization.offload_optimizer.pin_memory is None
    assert cfg.zero_optimization.offload_param.pin_memory is None
    # no CUDA (this machine): a pinned request gives pageable memory, silently
    assert not device.host_empty(8, torch.float32, pin=True).is_pinned()


@pytest.mark.parametrize("stage", [1, 3])
def test_delayed_update_on_a_device_equals_the_cpu_path(world1, monkeypatch, stage):
    """``delayed_update`` through the device branches (launch value from the masters' cast, edits found
    by fingerprints, copies on the copy stream) gives the CPU path's stale trajectory bitwise, an edit
    through ``.data`` included; test_delayed_update.py checks the CPU path against plain PyTorch."""

    def run(device_path: bool) -> tuple[list[float], list[torch.Tensor], dict]:
        with pytest.MonkeyPatch.context() as mp:
            if device_path:
                mp.setattr(device, "is_accelerator", lambda d: True)
            cfg = _config(stage, True, False)
            cfg["zero_optimization"]["offload_optimizer"]["delayed_update"] = True
            engine = zerodp.initialize(_model(None), cfg)
            assert engine.optimizer_offload.on_device is device_path
            device.reset_host_syncs()
            losses = _train(engine, None, steps=4)
            syncs = dict(device.HOST_SYNCS)
            weights = _weights(engine)
            engine.close()
        return losses, weights, syncs

    cpu_losses, cpu_weights, _ = run(False)
    dev_losses, dev_weights, syncs = run(True)
    assert dev_losses == cpu_losses and len(set(cpu_losses)) == 4
    for a, b in zip(cpu_weights, dev_weights, strict=True):
        assert torch.equal(a, b)
    assert syncs["offload_edits"] == 4  # one fingerprint check per boundary
