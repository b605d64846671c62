"""zerodp's own ``Engine.save_16bit_model`` (the method the stage-3 refusal and docs/stage3.md name):
stages 0-3 on 2 gloo ranks, fp32 and bf16; the file equals plain PyTorch trained the same steps (in
bf16: their cast, within what bf16 forward passes change) and the engine's fp32 values cast exactly
(tests/save16_worker.py)."""

from __future__ import annotations

import functools
import re
import tempfile
from pathlib import Path

import pytest
import torch

import zerodp
from distributed import run_worker

WORKER = Path(__file__).with_name("save16_worker.py")
WORLD = 2


@functools.cache
def results() -> list[dict]:
    with tempfile.TemporaryDirectory() as d:
        return run_worker(WORLD, "0,1,2,3", worker=WORKER, extra_args=["--out-dir", d])


def ok(key: str) -> list[dict]:
    out = [r[key] for r in results()]
    for r, res in enumerate(out):
        assert res["ok"], f"rank {r} raised:\n{res.get('error')}"
    return out


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_save_16bit_model_equals_pytorch(stage: int, precision: str) -> None:
    ranks = ok(f"stage{stage}:{precision}")
    assert all(res["returned"] is True for res in ranks)
    if stage == 3:
        assert all(res["hint_names_method"] for res in ranks), "the stage-3 refusal no longer names the method"
    rank0 = ranks[0]
    assert rank0["keys_equal"] and rank0["buffer_equal"]
    assert rank0["dtypes"] == [str({"fp32": torch.float32, "bf16": torch.bfloat16}[precision])]
    assert rank0["masters_cast_equal"], "the file is not the engine's fp32 values cast to the module dtype"
    # fp32: the same arithmetic up to summation order; bf16: forward in bf16, then the cast (ulp 2**-8 near 1)
    assert rank0["ref_err"] <= (1e-6 if precision == "fp32" else 2e-2), rank0["ref_err"]


def test_save_16bit_model_refused_at_stage3_without_gather_key() -> None:
    for res in ok("refused"):
        assert "stage3_gather_16bit_weights_on_model_save" in res["message"], res["message"]
        assert res["nothing_written"]


def test_engine_has_every_method_the_stage3_refusal_names() -> None:
    """zerodp's own Engine has each ``engine.<method>`` the stage-3 refusal tells the user to call."""
    from zerodp.stage3.sharded_param import SAVE_HINT

    named = set(re.findall(r"engine\.(\w+)", SAVE_HINT))
    assert {"save_16bit_model", "module_state_dict", "save_checkpoint"} <= named, SAVE_HINT
    assert all(callable(getattr(zerodp.Engine, m, None)) for m in named), named
