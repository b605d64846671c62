"""A checkpoint saved with one optimizer loaded into an engine with another (fresh-user report F1):
refused with a CheckpointError naming both optimizers and the way out, nothing changed; with
``load_optimizer_states=False`` the weights load and the next step equals plain PyTorch. Worlds 1 and
2, stages 0-3 (tests/optimizer_ckpt_worker.py, one torchrun launch per world size)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from distributed import run_worker
from optimizer_ckpt_worker import PAIRS

WORKER = Path(__file__).with_name("optimizer_ckpt_worker.py")
_cache: dict[int, list[dict]] = {}


def launch(world_size: int) -> list[dict]:
    if world_size not in _cache:
        with tempfile.TemporaryDirectory() as d:
            _cache[world_size] = run_worker(world_size, "0,1,2,3", worker=WORKER, extra_args=["--ckpt", d])
    return _cache[world_size]


@pytest.mark.parametrize("saved,mine", PAIRS)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("world_size", [1, 2])
def test_other_optimizer_refused_then_loaded_without_states(world_size: int, stage: int, saved: str, mine: str) -> None:
    saved_cls, mine_cls = saved.split("+")[0], mine.split("+")[0]
    for r, res in enumerate(launch(world_size)):
        res = res[f"stage{stage}:{saved}->{mine}"]
        assert res["ok"], f"rank {r} raised:\n{res.get('error')}"
        msg = res["message"]
        assert f"saved with optimizer {saved_cls} and this engine's optimizer is {mine_cls}" in msg, msg
        assert "load_optimizer_states=False" in msg, msg
        assert res["untouched"], f"rank {r}: the refused load changed parameters or optimizer state"
        assert res["weights_equal"], f"rank {r}: load_optimizer_states=False did not load the saved weights"
        assert res["ref_err"] <= 1e-6, f"rank {r}: the step after the load differs from PyTorch ({res['ref_err']})"
