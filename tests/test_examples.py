"""The scripts under examples/ run as written (2 gloo ranks under torchrun, few steps) and do what
they say: the loss is finite and falls, a resumed run ends on the weights of an uninterrupted one. And
every ```python / ```json block of README.md is the content of one of these files, so none can rot."""

from __future__ import annotations

import importlib.util
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def run_example(script: str, *argv: str, cwd: Path = ROOT) -> str:
    """stdout of ``torchrun --nproc-per-node 2 examples/<script> argv...`` (it must exit 0)."""
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")},
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(EXAMPLES / script),
        *argv,
    ]
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    return proc.stdout


def losses(out: str, word: str = "step") -> list[float]:
    found = [float(m) for m in re.findall(rf"^{word} \d+ .*?loss ([-\d.naninf]+)", out, re.M)]
    assert len(found) >= 2, out
    assert all(math.isfinite(v) for v in found), found
    return found


@pytest.mark.parametrize("stage", [2, 3])
def test_train_own_model(stage: int) -> None:
    out = run_example("train_own_model.py", "--stage", str(stage), "--steps", "21")
    loss = losses(out)
    assert loss[-1] < 0.5 * loss[0], loss
    assert f"rank 0/2  stage {stage}" in out  # the memory report of rank 0


def test_deepspeed_script(tmp_path: Path) -> None:
    out = run_example(
        "deepspeed/train.py",
        "--deepspeed_config",
        str(EXAMPLES / "deepspeed" / "ds_config.json"),
        "--epochs",
        "2",
        "--save-dir",
        str(tmp_path / "ckpt"),
    )
    loss = losses(out, "epoch")
    assert loss[-1] < loss[0], loss
    # 512 samples / (8 per rank x 2 ranks) = 32 micro-batches per epoch, 2 per step: 16 steps per epoch
    assert "epoch 1 step 32 " in out, out
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "global_step32"


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
def test_hf_model() -> None:
    out = run_example("hf_model.py", "--steps", "11")
    loss = losses(out)
    assert loss[-1] < loss[0], loss
    assert re.search(r"^generated \[[\d, ]+\] expected \[[\d, ]+\]$", out, re.M), out


def test_offload_nvme(tmp_path: Path) -> None:
    out = run_example("offload_nvme.py", "--nvme-path", str(tmp_path), "--steps", "6")
    loss = losses(out)
    assert loss[-1] < loss[0], loss
    assert out.count("offload_optimizer.device = nvme") == 2 and "nvme  optimizer_states" in out, out
    assert not list(tmp_path.rglob("*.swp"))  # engine.close() removed the swap files


def test_resume_equals_uninterrupted(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    whole = run_example("resume.py", "--steps", "6", "--save-at", "3", "--save-dir", ckpt)
    resumed = run_example("resume.py", "--steps", "6", "--resume", "--save-dir", ckpt)
    assert f"resumed from {ckpt}/global_step3 at step 3" in resumed, resumed
    final = [re.search(r"^step 6 loss .* weights sha256 \w+$", o, re.M) for o in (whole, resumed)]
    assert all(final) and final[0].group(0) == final[1].group(0), (whole, resumed)


def fenced_blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```$", text, re.M | re.S)


@pytest.mark.parametrize("lang, ext", [("python", "py"), ("json", "json")])
def test_readme_code_blocks_are_example_files(lang: str, ext: str) -> None:
    files = {p.relative_to(ROOT).as_posix(): p.read_text() for p in EXAMPLES.rglob(f"*.{ext}")}
    blocks = fenced_blocks((ROOT / "README.md").read_text(), lang)
    assert blocks, f"README.md has no ```{lang} block"
    for block in blocks:
        assert block in files.values(), f"this README block is no file under examples/:\n{block[:300]}"


def test_readme_commands_name_existing_examples() -> None:
    text = (ROOT / "README.md").read_text()
    named = set(re.findall(r"examples/[\w/]+\.(?:py|json)", text))
    assert named, "README.md names no example"
    missing = sorted(n for n in named if not (ROOT / n).is_file())
    assert not missing, missing
