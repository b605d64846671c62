"""Issue 26 item 2: gradient clipping called by the user between ``engine.backward`` and ``engine.step``.

``torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm)`` used to return 0.0 and clip nothing at
stages 1-3 (``param.grad`` was None: the gradients live in the engine's partitions). Now ``param.grad``
is a placeholder that raises on use wherever it is not the gradient (zerodp.runtime.grad_placeholder),
``engine.clip_grad_norm_(max_norm, norm_type)`` clips the engine's gradients and returns the global
norm, and ``engine.get_global_grad_norm()`` is the step's norm without ``gradient_clipping``.

One torchrun launch per world size (1 and 3) runs tests/clip_worker.py at every stage, precision (fp32,
bf16, fp16) and optimizer offload (none, cpu, nvme); every value is compared with plain PyTorch on the
same global batch, computed in the worker.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from devices import skip_beyond_devices
from distributed import run_worker

WORKER = Path(__file__).with_name("clip_worker.py")
STAGES = (0, 1, 2, 3)
PRECISIONS = ("fp32", "bf16", "fp16")
#: relative error allowed: fp32 against fp32; bf16/fp16 forward and gradients against the same dtype's
#: plain PyTorch (the engine reduces and accumulates them in another order)
TOL = {"fp32": 1e-5, "bf16": 3e-2, "fp16": 5e-3}
_cache: dict[int, list[dict]] = {}


def per_rank(world_size: int, key: str) -> list[dict]:
    skip_beyond_devices(world_size)  # ZERODP_TEST_DEVICE (tests/devices.py): engine and reference run there
    if world_size not in _cache:
        with tempfile.TemporaryDirectory() as nvme:
            _cache[world_size] = run_worker(world_size, worker=WORKER, extra_args=["--nvme", nvme])
    out = [r[key] for r in _cache[world_size]]
    for r, res in enumerate(out):
        assert res["ok"], f"rank {r} raised:\n{res.get('error')}"
    return out


def cases() -> list:
    return [
        pytest.param(w, s, p, o, id=f"w{w}-stage{s}-{p}-{o}")
        for w in (1, 3)  # 3: several ranks and uneven shards; 2 adds no path (see tests/test_stages.py)
        for s in STAGES
        for p in PRECISIONS
        for o in (("none",) if s == 0 else ("none", "cpu", "nvme"))
    ]


@pytest.mark.parametrize("world_size,stage,precision,offload", cases())
def test_user_clipping(world_size: int, stage: int, precision: str, offload: str) -> None:
    tol = TOL[precision]
    for res in per_rank(world_size, f"clip/stage{stage}/{precision}/{offload}"):
        # stage 0 fp32: param.grad views the averaged gradient the step uses, as with DDP; bf16 with GAS 2
        # accumulates in an fp32 buffer that the 16-bit param.grad cannot view, fp16 holds scaled values
        if stage == 0 and precision == "fp32":
            assert res["torch_clip"] == "worked"
        else:  # loud, naming what to use instead
            for word in ("gradient_clipping", "engine.clip_grad_norm_", "'0.weight'"):
                assert word in res["torch_clip"], res["torch_clip"]
        # the norms returned equal torch.nn.utils.clip_grad_norm_'s on the whole model's gradient
        assert res["norm_err"] <= tol, res
        assert res["inf_norm_err"] <= tol, res
        assert res["second_norm_err"] <= tol, res  # sees the first call's clipping
        assert res["full_grad_err"] <= tol, res  # safe_get_full_grad: the clipped gradient
        # get_global_grad_norm: the L2 norm the step received, also in step 2, without any clipping
        assert res["global_norm_err"] <= tol, res
        # every update as torch's: the clipping reached the optimizer (without it: 5x too large)
        assert res["update_err"] <= 10 * tol, res
        assert "engine.backward on the last micro-step" in res["not_ready"]
        assert res["hidden_after_step"] == 0
