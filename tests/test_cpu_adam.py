"""The offloaded CPU step's Adam/AdamW kernel (``offload_optimizer.cpu_adam``, zerodp.offload.cpu_adam).

Single process, in-process engines. The default (``"fused"``) runs torch's fused CPU kernel
(``torch._fused_adam_`` / ``torch._fused_adamw_``, counted by a wrapper) and equals the non-offloaded
engine within 1e-6 relative after several steps, stages 1-3, fp32 and bf16, cpu and nvme; checkpoints
cross between fused-offloaded and non-offloaded engines and the runs go on equal within that
tolerance. Other optimizers, a user's explicit ``foreach``/``fused`` and ``"same"`` keep their kernel
(``"same"`` is compared bitwise in tests/test_offload.py and tests/test_param_offload.py). Unknown
values are refused naming the key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import zerodp
from zerodp.accessors import safe_get_full_fp32_param

STEPS = 4
REL = 1e-6


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 3))


def _engine(
    stage: int, device: str | None, nvme: Path, bf16: bool = False, optimizer: dict | None = None, **offload: Any
) -> zerodp.Engine:
    torch.manual_seed(0)
    zc: dict = {"stage": stage, "reduce_bucket_size": 200, "stage3_param_persistence_threshold": 4}
    if device:
        zc["offload_optimizer"] = {"device": device, "nvme_path": str(nvme), **offload}
        zc["sub_group_size"] = 300  # several NVMe sub-groups
    cfg: dict = {
        "optimizer": optimizer or {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1}},
        "zero_optimization": zc,
    }
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return zerodp.initialize(_model(), cfg)


def _train(e: zerodp.Engine, steps: range, bf16: bool = False) -> None:
    for s in steps:
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(s))
        out = e(x.bfloat16() if bf16 else x)
        e.backward(out.float().square().mean())
        e.step()


def _masters(e: zerodp.Engine) -> list[torch.Tensor]:
    return [safe_get_full_fp32_param(p).clone() for p in e.module.parameters()]


def _assert_close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    """Every tensor within 1e-6 relative (of its largest magnitude) of the reference."""
    assert len(got) == len(want) > 0
    for a, b in zip(got, want, strict=True):
        err = (a.double() - b.double()).abs().max().item()
        assert err <= REL * b.abs().max().item(), (err, b.abs().max().item())


@pytest.fixture
def fused_calls(monkeypatch) -> list[str]:
    """Names of torch's fused Adam/AdamW kernels called (a wrapper around each)."""
    calls: list[str] = []
    for name in ("_fused_adam_", "_fused_adamw_"):
        real = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, _r=real, _n=name, **k: (calls.append(_n), _r(*a, **k))[1])
    return calls


@pytest.mark.parametrize("device", ["cpu", "nvme"])
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fused_offload_equals_non_offloaded(stage, bf16, device, tmp_path, fused_calls):
    plain = _engine(stage, None, tmp_path, bf16)
    _train(plain, range(STEPS), bf16)
    assert fused_calls == []  # the non-offloaded engine keeps torch's default kernel
    off = _engine(stage, device, tmp_path, bf16)
    _train(off, range(STEPS), bf16)
    assert len(fused_calls) >= STEPS and set(fused_calls) == {"_fused_adamw_"}, fused_calls
    assert all(g["fused"] is None for g in off.optimizer.param_groups)  # set for the step only
    _assert_close(_masters(off), _masters(plain))
    off.close()


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_checkpoints_cross_fused_and_non_offloaded(device, tmp_path, fused_calls):
    """Offloaded (fused) -> non-offloaded and back: each run resumes and equals the uninterrupted
    non-offloaded run within 1e-6 relative; the saved param groups carry no ``fused`` flag."""
    ref = _engine(2, None, tmp_path)
    _train(ref, range(2 * STEPS))
    for first, second in ((device, None), (None, device)):
        a = _engine(2, first, tmp_path)
        _train(a, range(STEPS))
        ckpt = tmp_path / f"ckpt-{first}-{second}"
        a.save_checkpoint(ckpt)
        b = _engine(2, second, tmp_path)
        b.load_checkpoint(ckpt)
        assert all(g["fused"] is None for g in b.optimizer.param_groups)
        before = len(fused_calls)
        _train(b, range(STEPS, 2 * STEPS))
        assert (len(fused_calls) > before) == (second is not None)
        _assert_close(_masters(b), _masters(ref))
        for e in (a, b):
            e.close()


@pytest.mark.parametrize(
    "optimizer",
    [
        {"type": "SGD", "params": {"lr": 0.01, "momentum": 0.9}},
        {"type": "Adam", "params": {"lr": 0.01, "foreach": False}},
        {"type": "AdamW", "params": {"lr": 0.01, "foreach": True}},
        "same",
    ],
    ids=["sgd", "adam_foreach_false", "adamw_foreach_true", "same"],
)
def test_other_kernels_kept(optimizer, tmp_path, fused_calls):
    """SGD, a user's explicit ``foreach`` and ``cpu_adam: "same"``: no fused Adam kernel runs, and the
    offloaded run equals the non-offloaded one bitwise."""
    extra = {"cpu_adam": "same"} if optimizer == "same" else {}
    opt = None if optimizer == "same" else optimizer
    plain, off = _engine(2, None, tmp_path, optimizer=opt), _engine(2, "cpu", tmp_path, optimizer=opt, **extra)
    for e in (plain, off):
        _train(e, range(STEPS))
    assert fused_calls == []
    for a, b in zip(_masters(off), _masters(plain), strict=True):
        assert torch.equal(a, b)
    off.close()


def test_cpu_adam_config_refused():
    with pytest.raises(zerodp.ConfigError, match=r"'zero_optimization\.offload_optimizer\.cpu_adam'") as err:
        zerodp.load_config({"zero_optimization": {"offload_optimizer": {"device": "cpu", "cpu_adam": "fast"}}})
    assert "'fused'" in str(err.value) and "'same'" in str(err.value), str(err.value)
    cfg = zerodp.load_config({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}})
    assert cfg.zero_optimization.offload_optimizer.cpu_adam == "fused"
