"""Host syncs per training step (see [Note: host syncs] in zerodp.runtime.device), counted on the CPU.

Every place a training step waits for the device to read a value goes through
``zerodp.runtime.device.synchronize(reason, ...)``, which counts it per reason in ``HOST_SYNCS`` on every
device (on the CPU the copy is free, the count is the same). This test pins the exact count per reason
at stages 0-3 under fp32, bf16 and fp16, so a new host sync in the step (or a per-piece one instead of
one per device) fails here; docs/gpu.md lists each reason.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zerodp
from zerodp.runtime import device

PRECISIONS = {
    "fp32": {},
    "bf16": {"bf16": {"enabled": True}},
    "fp16": {"fp16": {"enabled": True, "initial_scale_power": 8}},
}


def expected(stage: int, precision: str) -> dict[str, int]:
    """One step's host syncs: the global gradient norm (recorded every step, clipping or not); under
    bf16/fp16 the master-edit check (one per device, all pieces at once); under fp16 the overflow check
    (one per device); at stage 3 the edit check of the persistent unit (the biases here)."""
    out = {"grad_norm": 1}
    if precision != "fp32":
        out["master_edits"] = 1
    if precision == "fp16":
        out["fp16_overflow"] = 1
    if stage == 3:
        out["persistent_unit_edits"] = 1
    return out


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_host_syncs_per_training_step(world1, stage, precision):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    config = {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 16, "reduce_bucket_size": 300},
        **PRECISIONS[precision],
    }
    engine = zerodp.initialize(model, config)
    pieces = sum(len(g.pieces) for g in engine.groups)
    assert pieces >= 2  # a per-piece sync would show as more than one
    dtype = next(model.parameters()).dtype
    steps = []
    for step in range(3):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step)).to(engine.device, dtype)
        device.reset_host_syncs()
        engine.backward(engine(x).float().pow(2).mean())
        engine.step()
        steps.append(dict(device.HOST_SYNCS))
    assert engine.skipped_steps == 0
    assert str(engine.device) == "cpu"
    assert steps == [expected(stage, precision)] * 3, steps


def test_parameters_finite_is_one_host_sync(world1):
    engine = zerodp.initialize(
        nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)),
        {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_optimization": {"stage": 1}},
    )
    device.reset_host_syncs()
    assert engine.parameters_finite()
    with torch.no_grad():
        engine.module[0].weight[0, 0] = float("nan")
    assert not engine.parameters_finite()
    assert dict(device.HOST_SYNCS) == {"parameters_finite": 2}


def test_host_flags_one_sync_per_device():
    device.reset_host_syncs()
    flags = [torch.tensor(True), torch.tensor(False), torch.tensor(True)]
    assert device.host_flags("r", flags) == [True, False, True]
    assert device.all_finite([torch.ones(3), torch.tensor([1.0, float("inf")])], "f") is False
    assert device.all_finite([], "g") is True
    assert dict(device.HOST_SYNCS) == {"r": 1, "f": 1}
