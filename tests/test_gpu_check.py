"""tools/gpu_check.sh on the CPU: its argument handling and the gpu_check.json it writes (``--dry-run``:
no part runs), and its training comparison helper (tools/gpu_train_compare.py) on the CPU. The
script's GPU parts have not run here (docs/gpu.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "gpu_check.sh"
PARTS = ["install", "versions", "cuda_marked_tests", "stage_tests_ws1", "stage_tests_ws2", "train_compare", "bench"]


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env=env)


def test_dry_run_writes_the_json(tmp_path):
    proc = run("--dry-run", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[-1] == "gpu check: 0/0 pass"
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["dry_run"] is True and report["budget_s"] == 480
    assert list(report["parts"]) == PARTS
    for name in PARTS[:-1]:
        part = report["parts"][name]
        assert part["status"] == "dry" and part["rc"] == 0, part
        assert "time box" in part["note"]
        assert (tmp_path / f"{name}.log").read_text().startswith(f"[dry] {name}")
    assert report["parts"]["bench"]["status"] == "not_supported"
    assert report["passed"] == 0 and report["counted"] == 0
    assert set(report["figures"]) == {"versions", "train_compare", "cuda_marked_tests", "stage_tests_ws1",
                                      "stage_tests_ws2"}


def test_out_from_the_environment_and_budget(tmp_path):
    import os

    proc = run("--dry-run", "--budget-s=300", env={**os.environ, "OUT": str(tmp_path / "o")})
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "o" / "gpu_check.json").read_text())["budget_s"] == 300


@pytest.mark.parametrize("args,message", [
    (("--bogus",), "unknown argument '--bogus'; allowed: --dry-run"),
    (("--dry-run", "--budget-s", "8min"), "--budget-s must be a whole number of seconds, got '8min'"),
])
def test_bad_arguments_are_refused(tmp_path, args, message):
    proc = run(*args, "--out", str(tmp_path))
    assert proc.returncode == 2 and message in proc.stderr
    assert not (tmp_path / "gpu_check.json").exists()


def test_report_counts_failures_and_spent_budget(tmp_path):
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import gpu_check_report
    finally:
        sys.path.pop(0)
    (tmp_path / "parts").mkdir()
    statuses = {"install": "pass", "versions": "fail", "cuda_marked_tests": "pass", "stage_tests_ws1": "pass",
                "stage_tests_ws2": "skipped", "train_compare": "budget_spent"}  # bench: never recorded
    for name, status in statuses.items():
        (tmp_path / "parts" / f"{name}.json").write_text(json.dumps(
            {"name": name, "status": status, "rc": 0, "seconds": 1.0, "note": ""}))
    (tmp_path / "cuda_marked.xml").write_text(  # every test skipped: pytest's 0 is no pass
        '<testsuites><testsuite tests="2" failures="0" errors="0" skipped="2"/></testsuites>')
    (tmp_path / "stages_ws1.xml").write_text(
        '<testsuites><testsuite tests="5" failures="1" errors="0" skipped="2"/></testsuites>')
    report = gpu_check_report.build(tmp_path, False, 480, 10.0)
    assert (report["passed"], report["counted"]) == (2, 6)  # skipped for lack of GPUs is not counted
    assert report["parts"]["cuda_marked_tests"]["status"] == "fail"
    assert report["parts"]["bench"]["status"] == "fail"  # nothing recorded: a failure, named
    assert report["figures"]["stage_tests_ws1"] == {"tests": 5, "failures": 1, "errors": 0, "skipped": 2,
                                                    "passed": 2}


def test_train_compare_helper_on_cpu(tmp_path):
    """The helper's lines on the CPU, a small GPT, 3 steps: zerodp stages 0-3 equal plain PyTorch."""
    out = tmp_path / "compare.json"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_train_compare.py"), "--device", "cpu",
                           "--steps", "3", "--n-layer", "1", "--d-model", "32", "--seq-len", "16",
                           "--micro-batch", "2", "--rtol", "1e-5", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(out.read_text())
    assert res["pass"] and res["device"] == "cpu" and sorted(res["stages"]) == ["0", "1", "2", "3"]
    for stage, entry in res["stages"].items():
        assert entry["engine_device"] == "cpu" and entry["max_rel_loss_diff"] <= 1e-5, (stage, entry)
        assert entry["first_last"][0] != entry["first_last"][1]  # it trained
