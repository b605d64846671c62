"""The offloaded step waits for the gradient copies of one sub-group (NVMe) or chunk (cpu) at a time,
on the device code path run on the CPU (tests/unit/test_offload_device.py explains how: the device
decision and ``torch.cuda.is_available`` patched, the device module a recording stand-in). No GPU here.

Checked, at stages 1-3 with ``offload_optimizer`` cpu and nvme, bf16 and gradient clipping (so loss
unscaling-like factors are recorded and applied lazily, [Note: lazy scaling] in zerodp.offload.host):

- no gradient copy is waited for by the host before ``offload.step`` starts (the global norm and the
  clipping factor read the reduced gradients on the device, not the host copies);
- inside the step, when the CPU Adam runs on a sub-group / chunk, the host has waited for exactly the
  copies of the pieces updated so far: sub-group 0's Adam starts before the last sub-group's wait;
- the result is bitwise the non-offloaded engine's (losses and fp32 weights).
"""

from __future__ import annotations

import pytest
import torch
from test_offload_device import _config, _model, _train, _weights
from test_offload_nvme_device import _nvme_config, on_device  # noqa: F401  (fixture)
from test_stream_order import FakeDeviceModule

import zerodp
from zerodp.offload import host
from zerodp.runtime import device

CLIP = 1e-3  # far below the gradients' norm: every step records a clipping factor


def _recording(engine: zerodp.Engine, log: list[tuple]) -> None:
    """Log ("wait", piece) for each host wait on a gradient copy, ("step",) when the offload's step
    starts and ("adam", pieces) for each optimizer call inside it (the pieces whose master has a grad)."""
    off = engine.optimizer_offload
    piece_of: dict[int, int] = {}
    real_stream, real_wait, real_step = off.stream_grad, off.copies.host_wait, off.step
    real_adam = engine.optimizer.step

    def stream_grad(piece, grad):
        real_stream(piece, grad)
        i = off._index[id(piece)]
        piece_of[id(off._grad_ticket[i])] = i

    def host_wait(ticket):
        if ticket is not None and id(ticket) in piece_of:
            log.append(("wait", piece_of.pop(id(ticket))))
        real_wait(ticket)

    def step(optimizer):
        log.append(("step",))
        real_step(optimizer)

    def adam(*args, **kwargs):
        log.append(("adam", frozenset(i for i, p in enumerate(off.pieces) if p.master_copy.grad is not None)))
        return real_adam(*args, **kwargs)

    off.stream_grad, off.copies.host_wait, off.step = stream_grad, host_wait, step
    engine.optimizer.step = adam


def _check_per_subgroup(log: list[tuple], steps: int) -> None:
    """Each step: no wait before it starts; at each Adam call the pieces waited for so far are exactly
    the pieces updated so far; more than one Adam call, and a wait after the first one."""
    starts = [k for k, e in enumerate(log) if e[0] == "step"]
    assert len(starts) == steps
    assert all(e[0] != "wait" for e in log[: starts[0]]), log[: starts[0]]
    for s, start in enumerate(starts):
        end = starts[s + 1] if s + 1 < len(starts) else len(log)
        window = log[start:end]
        adams = [k for k, e in enumerate(window) if e[0] == "adam"]
        assert len(adams) > 1, window
        waited: set[int] = set()
        updated: set[int] = set()
        for e in window:
            if e[0] == "wait":
                waited.add(e[1])
            elif e[0] == "adam":
                updated |= e[1]
                assert waited == updated, (s, sorted(waited), sorted(updated))
        first_adam = adams[0]
        assert any(e[0] == "wait" for e in window[first_adam:]), "the last sub-group's wait came after the first Adam"


@pytest.mark.usefixtures("on_device")
@pytest.mark.parametrize("offload", ["cpu", "nvme"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_step_waits_for_each_subgroups_copies_only(world1, monkeypatch, tmp_path, stage, offload):
    ref_cfg = _config(stage, False, False)
    ref_cfg["gradient_clipping"] = CLIP
    reference = zerodp.initialize(_model(None), ref_cfg)
    ref_losses = _train(reference, None)
    assert reference.get_global_grad_norm() > 10 * CLIP
    fake = FakeDeviceModule()
    monkeypatch.setattr(device, "device_handle", lambda d: fake)
    monkeypatch.setattr(host, "MIN_CHUNK_NUMEL", 1)  # the cpu step in STEP_CHUNKS chunks of this small model
    cfg = _nvme_config(stage, str(tmp_path)) if offload == "nvme" else _config(stage, True, False)
    cfg["gradient_clipping"] = CLIP
    engine = zerodp.initialize(_model(fake), cfg)
    off = engine.optimizer_offload
    assert off.on_device and off.copies.on_device and not getattr(off, "deferred", False)
    log: list[tuple] = []
    _recording(engine, log)
    losses = _train(engine, fake)
    assert losses == ref_losses
    for a, b in zip(_weights(reference), _weights(engine), strict=True):
        assert torch.equal(a, b)
    _check_per_subgroup(log, steps=3)
    engine.close()


@pytest.mark.usefixtures("on_device")
@pytest.mark.parametrize("offload", ["cpu", "nvme"])
@pytest.mark.parametrize("stage", [2, 3])
def test_fp16_unscaling_and_clipping_factors_applied_per_subgroup(world1, monkeypatch, tmp_path, stage, offload):
    """fp16: two factors per step (loss unscaling, then clipping) recorded before the update and applied
    to each host gradient after its copy: the same order of waits, bitwise the non-offloaded engine."""

    def fp16(cfg: dict) -> dict:
        del cfg["bf16"]
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
        cfg["gradient_clipping"] = CLIP
        return cfg

    def train(engine: zerodp.Engine) -> list[float]:
        losses = []
        for step in range(3):
            x = torch.randn(4, 12, generator=torch.Generator().manual_seed(step)).half()
            loss = engine(x).float().square().mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return losses

    reference = zerodp.initialize(_model(None), fp16(_config(stage, False, False)))
    ref_losses = train(reference)
    assert reference.skipped_steps == 0 and reference.get_global_grad_norm() > 10 * CLIP
    monkeypatch.setattr(device, "device_handle", lambda d: FakeDeviceModule())
    monkeypatch.setattr(host, "MIN_CHUNK_NUMEL", 1)
    cfg = _nvme_config(stage, str(tmp_path)) if offload == "nvme" else _config(stage, True, False)
    engine = zerodp.initialize(_model(None), fp16(cfg))
    log: list[tuple] = []
    _recording(engine, log)
    factors: list[int] = []
    real_step = engine.optimizer_offload.step

    def step(optimizer):
        factors.append(len(engine.optimizer_offload._host_factors))
        real_step(optimizer)

    engine.optimizer_offload.step = step
    assert train(engine) == ref_losses
    for a, b in zip(_weights(reference), _weights(engine), strict=True):
        assert torch.equal(a, b)
    assert factors == [2, 2, 2]  # unscaling and clipping, both applied lazily
    _check_per_subgroup(log, steps=3)
    engine.close()
