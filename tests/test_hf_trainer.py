"""HF ``transformers.Trainer(deepspeed=...)`` on zerodp registered as ``deepspeed`` (issue 30 item 5):
a tiny GPT-2 on 2 gloo ranks, HF-docs style ZeRO-2 and ZeRO-3 configs with "auto" values, against the
same Trainer without DeepSpeed (DDP, same data and seed), then resumed from the step-3 checkpoint
(tests/hf_trainer_worker.py). Optional dependencies transformers and accelerate (the dev/hf extras)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from distributed import TIMEOUT_S, run_worker  # noqa: E402

WORKER = Path(__file__).with_name("hf_trainer_worker.py")
#: DeepSpeed run -> the DDP run with the same optimizer and schedule
PAIRS = {"zero2": "ddp-warmup", "zero3": "ddp", "zero3-pretrained": "ddp"}
STEPS = [str(s) for s in range(1, 7)]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_worker(
        2,
        "",
        "zero2,ddp-warmup,zero3,zero3-pretrained,ddp,zero2-cut",
        worker=WORKER,
        extra_args=["--ckpt-dir", str(tmp_path_factory.mktemp("hf_trainer"))],
    )


def _ok(per_rank: list[dict], run: str) -> list[dict]:
    for r, res in enumerate(per_rank):
        assert res[run]["ok"], f"rank {r}, {run}:\n{res[run].get('error')}"
    return [res[run] for res in per_rank]


@pytest.mark.parametrize("run", list(PAIRS))
def test_trainer_on_zerodp_matches_ddp(results: list[dict], run: str) -> None:
    """Per-step logged losses (averaged over ranks by the Trainer) equal DDP's: same model, data order,
    optimizer, clipping and schedule, the engine being zerodp's DeepSpeedEngine."""
    ds, ddp = _ok(results, run), _ok(results, PAIRS[run])
    for r in range(2):
        assert ds[r]["wrapped"] == "zerodp.deepspeed.engine" and ddp[r]["wrapped"] == "torch.nn.parallel.distributed"
        assert ds[r]["world"] == ddp[r]["world"] == 2
        assert sorted(ds[r]["losses"]) == STEPS and sorted(ddp[r]["losses"]) == STEPS
        for step in STEPS:
            assert ds[r]["losses"][step] == pytest.approx(ddp[r]["losses"][step], rel=1e-5, abs=1e-6), (run, r, step)
        assert ds[r]["zerodp_warnings"] == []
    assert len(set(ds[0]["losses"].values())) > 1  # it trained: the loss moves


def test_the_comparison_tells_the_schedules_apart(results: list[dict]) -> None:
    """ZERO2's optimizer/scheduler sections (AdamW on every parameter, WarmupLR) and the Trainer's own
    (weight-decay groups, linear schedule) give different losses by step 3: the comparison above can fail."""
    a, b = _ok(results, "ddp-warmup")[0]["losses"], _ok(results, "ddp")[0]["losses"]
    assert a["3"] != pytest.approx(b["3"], rel=1e-5)


@pytest.mark.parametrize("run", list(PAIRS) + ["ddp"])
def test_trainer_resumes_exactly(results: list[dict], run: str) -> None:
    """A fresh Trainer resumed from checkpoint-3 (zerodp's checkpoint in global_step3, the HF weights
    beside it) logs the uninterrupted run's losses for steps 4-6."""
    for res in _ok(results, run):
        if run != "ddp":
            assert "global_step3" in res["ckpt_files"] and "latest" in res["ckpt_files"]
        assert "model.safetensors" in res["ckpt_files"]
        assert sorted(res["resumed"]) == ["4", "5", "6"]
        for step, loss in res["resumed"].items():
            assert loss == pytest.approx(res["losses"][step], rel=1e-6, abs=1e-7), (run, step)


def test_a_window_cut_short_is_refused_by_name(results: list[dict]) -> None:
    """An epoch whose micro-batch count gradient_accumulation_steps does not divide: accelerate ends
    its last window early; zerodp's window is fixed, so it raises, naming the micro-step, after the
    full windows trained."""
    for res in _ok(results, "zero2-cut"):
        assert res["refused"] is not None and "is_boundary=True" in res["refused"], res["refused"]
        assert "micro-step 1 of 2" in res["refused"] and res["steps_done"] == 5


def test_launcher_runs_the_unchanged_trainer_script(results: list[dict]) -> None:
    """``zerodp run --nproc 2 SCRIPT ARGS`` registers zerodp as deepspeed for a script without the
    opt-in line (the worker with ``--via-launcher``): same losses as the opt-in import."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [
            sys.executable,
            "-m",
            "zerodp.app.cli",
            "run",
            "--nproc",
            "2",
            str(WORKER),
            "--out",
            out,
            "--ckpt-dir",
            out,
            "--scenarios",
            "zero2",
            "--via-launcher",
        ]
        proc = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"},
        )
        assert proc.returncode == 0, proc.stderr[-6000:]
        import json

        launched = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]
    for r, res in enumerate(_ok(launched, "zero2")):
        assert res["losses"] == pytest.approx(_ok(results, "zero2")[r]["losses"], rel=1e-6)
        assert res["resumed"] == pytest.approx(_ok(results, "zero2")[r]["resumed"], rel=1e-6)
