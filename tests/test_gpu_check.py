"""tools/gpu_check.sh on the CPU: its argument handling and the gpu_check.json it writes (``--dry-run``:
no part runs), its training comparison helper (tools/gpu_train_compare.py) and its ZeRO-Offload
headline (tools/gpu_offload_headline.py, ``--device cpu --tiny``: the same lines with the host as the
device, the memory cap and the out-of-memory run skipped with the reason) on the CPU. The script's GPU
parts have not run here (docs/gpu.md)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "gpu_check.sh"
PARTS = [
    "install",
    "versions",
    "cuda_marked_tests",
    "device_tests_ws1",
    "device_tests_ws2",
    "train_compare",
    "bench_ws1",
    "bench_ws2",
    "offload_headline",
    "cli_commands",
]


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)


def test_dry_run_writes_the_json(tmp_path):
    proc = run("--dry-run", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[-1] == "gpu check: 0/0 pass"
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["dry_run"] is True and report["budget_s"] == 560
    assert list(report["parts"]) == PARTS
    for name in PARTS:
        part = report["parts"][name]
        assert part["status"] == "dry" and part["rc"] == 0, part
        assert "time box" in part["note"]
        assert (tmp_path / f"{name}.log").read_text().startswith(f"[dry] {name}")
    for n in (1, 2):  # zerodp bench on CUDA at n ranks, its JSON kept in OUT/bench_wsN, then checked
        log = (tmp_path / f"bench_ws{n}.log").read_text()
        assert "zerodp.app.cli bench --device cuda --nproc " + str(n) in log, log
        assert f"--out '{tmp_path}/bench_ws{n}'" in log
        assert f"gpu_bench_check.py '{tmp_path}/bench_ws{n}/bench.json'" in log
        assert report["figures"][f"bench_ws{n}"] is None  # nothing ran
    assert report["passed"] == 0 and report["counted"] == 0
    assert set(report["figures"]) == {
        "versions",
        "train_compare",
        "cuda_marked_tests",
        "device_tests_ws1",
        "device_tests_ws2",
        "bench_ws1",
        "bench_ws2",
        "offload_headline",
        "cli_commands",
    }
    cli_log = (tmp_path / "cli_commands.log").read_text()
    assert "bash tools/gpu_cli_check.sh --python '" in cli_log and f"--out '{tmp_path}/cli'" in cli_log, cli_log
    log = (tmp_path / "offload_headline.log").read_text()
    assert "gpu_offload_headline.py --device cuda --budget-gib 8 --time-s 90" in log, log
    assert f"--out '{tmp_path}/offload_headline.json'" in log
    assert report["figures"]["offload_headline"] is None


def test_time_boxes_fit_the_budget(tmp_path):
    """On one GPU with ``--python`` (this workplace's GPU machines), the parts' time boxes sum to at most
    540 s, inside the 560 s the whole script must take; every box fits the budget alone (the install
    and the 2-GPU parts may be cut by the budget, recorded as budget_spent)."""
    assert run("--dry-run", "--out", str(tmp_path)).returncode == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    boxes = {n: int(re.search(r"time box (\d+)s", p["note"]).group(1)) for n, p in report["parts"].items()}
    assert set(boxes) == set(PARTS) and max(boxes.values()) <= 560, boxes
    one_gpu = {n: b for n, b in boxes.items() if n not in ("install", "device_tests_ws2", "bench_ws2")}
    assert sum(one_gpu.values()) + 15 <= 540, one_gpu  # 15 s: the install part's box with --python
    assert report["budget_s"] == 560


def test_spent_budget_starts_no_part(tmp_path):
    """--budget-s below a part's 10 s minimum: no part starts; each is recorded as budget_spent (the
    2-rank parts as skipped for lack of GPUs, this machine having none) and counted as not passed."""
    proc = run("--python", sys.executable, "--budget-s", "5", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    statuses = {n: p["status"] for n, p in report["parts"].items()}
    two_gpu = {"device_tests_ws2", "bench_ws2"}
    assert {statuses[n] for n in two_gpu} == {"skipped"}, statuses
    assert all(statuses[n] == "budget_spent" for n in PARTS if n not in two_gpu), statuses
    assert proc.stdout.strip().splitlines()[-1] == f"gpu check: 0/{len(PARTS) - 2} pass"
    assert not (tmp_path / "device_ws1.xml").exists()  # nothing ran


def test_device_tests_are_every_device_following_test(tmp_path):
    """The script's test subset keeps up with the tests: every tests/test_*.py that follows
    ZERODP_TEST_DEVICE (calls skip_beyond_devices or too_many_ranks) is in its device parts."""
    assert run("--dry-run", "--out", str(tmp_path)).returncode == 0
    command = (tmp_path / "device_tests_ws1.log").read_text()
    assert "ZERODP_TEST_DEVICE=cuda ZERODP_TEST_WORLD_SIZES=1 " in command
    assert "ZERODP_TEST_WORLD_SIZES=2 " in (tmp_path / "device_tests_ws2.log").read_text()
    following = sorted(
        p.name
        for p in (ROOT / "tests").glob("test_*.py")
        if re.search(r"\b(skip_beyond_devices|too_many_ranks)\(", p.read_text())
    )
    assert len(following) >= 4, following
    for name in following:
        assert f"tests/{name}" in command, (name, command)


def test_dry_run_bench_command_parses(tmp_path):
    """The bench part's command line, run here: every flag is accepted and only --device cuda is
    refused (this machine has no CUDA), before anything runs."""
    import shlex

    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the command would run")
    assert run("--dry-run", "--out", str(tmp_path)).returncode == 0
    line = next(ln for ln in (tmp_path / "bench_ws1.log").read_text().splitlines() if "zerodp.app.cli bench" in ln)
    cmd = shlex.split(line)
    cmd[0] = sys.executable
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "--device cuda needs a CUDA device" in proc.stderr, proc.stderr
    assert not (tmp_path / "bench_ws1" / "bench.json").exists()


def test_out_from_the_environment_and_budget(tmp_path):
    import os

    proc = run("--dry-run", "--budget-s=300", env={**os.environ, "OUT": str(tmp_path / "o")})
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "o" / "gpu_check.json").read_text())["budget_s"] == 300


@pytest.mark.parametrize(
    "args,message",
    [
        (("--bogus",), "unknown argument '--bogus'; allowed: --dry-run"),
        (("--dry-run", "--budget-s", "8min"), "--budget-s must be a whole number of seconds, got '8min'"),
    ],
)
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
    statuses = {
        "install": "pass",
        "versions": "fail",
        "cuda_marked_tests": "pass",
        "device_tests_ws1": "pass",
        "device_tests_ws2": "skipped",
        "train_compare": "budget_spent",
        "bench_ws1": "pass",
        "offload_headline": "pass",
    }  # bench_ws2: never recorded
    for name, status in statuses.items():
        (tmp_path / "parts" / f"{name}.json").write_text(
            json.dumps({"name": name, "status": status, "rc": 0, "seconds": 1.0, "note": ""})
        )
    (tmp_path / "cuda_marked.xml").write_text(  # every test skipped: pytest's 0 is no pass
        '<testsuites><testsuite tests="2" failures="0" errors="0" skipped="2"/></testsuites>'
    )
    (tmp_path / "device_ws1.xml").write_text(
        '<testsuites><testsuite tests="5" failures="1" errors="0" skipped="2"/></testsuites>'
    )
    report = gpu_check_report.build(tmp_path, False, 480, 10.0)
    (tmp_path / "bench_ws1").mkdir()
    (tmp_path / "bench_ws1" / "bench.json").write_text(json.dumps(_bench_record()))
    report = gpu_check_report.build(tmp_path, False, 480, 10.0)
    assert (report["passed"], report["counted"]) == (3, 9)  # skipped for lack of GPUs is not counted
    assert report["parts"]["cli_commands"]["status"] == "fail" and report["figures"]["cli_commands"] is None
    (tmp_path / "cli").mkdir()
    (tmp_path / "cli" / "summary.tsv").write_text(
        "train_default\t0\t20\tdone\nexample_own\t1\t13\tRuntimeError: x\ty\n"
    )
    rows = gpu_check_report.build(tmp_path, False, 480, 10.0)["figures"]["cli_commands"]
    assert rows == [
        {"name": "train_default", "rc": 0, "seconds": "20", "last": "done"},
        {"name": "example_own", "rc": 1, "seconds": "13", "last": "RuntimeError: x\ty"},
    ]
    assert report["parts"]["cuda_marked_tests"]["status"] == "fail"
    assert report["parts"]["bench_ws2"]["status"] == "fail"  # nothing recorded: a failure, named
    # exit 0 without its JSON saying pass: not a pass
    assert report["parts"]["offload_headline"]["status"] == "fail"
    assert "offload_headline.json is missing" in report["parts"]["offload_headline"]["note"]
    bench = report["figures"]["bench_ws1"]
    assert bench["problems"] == [] and bench["systems"]["FSDP2"]["peak_device_mib"] == [2.0, 4.0]
    assert report["figures"]["bench_ws2"] is None
    assert report["figures"]["device_tests_ws1"] == {"tests": 5, "failures": 1, "errors": 0, "skipped": 2, "passed": 2}


def test_train_compare_helper_on_cpu(tmp_path):
    """The helper's lines on the CPU, a small GPT, 3 steps: zerodp stages 0-3 equal plain PyTorch."""
    out = tmp_path / "compare.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "gpu_train_compare.py"),
            "--device",
            "cpu",
            "--steps",
            "3",
            "--n-layer",
            "1",
            "--d-model",
            "32",
            "--seq-len",
            "16",
            "--micro-batch",
            "2",
            "--rtol",
            "1e-5",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(out.read_text())
    assert res["pass"] and res["device"] == "cpu" and sorted(res["stages"]) == ["0", "1", "2", "3"]
    for stage, entry in res["stages"].items():
        assert entry["engine_device"] == "cpu" and entry["max_rel_loss_diff"] <= 1e-5, (stage, entry)
        assert entry["first_last"][0] != entry["first_last"][1]  # it trained
        # both sides' optimizer settings are recorded and agree (a default that differs, such as
        # AdamW's weight_decay, 0 in zerodp's config and 0.01 in torch's, made the GPU run differ)
        assert entry["hyperparameters"] == res["reference_hyperparameters"], entry
        assert entry["hyperparameters"]["weight_decay"] == 0.0 and entry["hyperparameters"]["betas"] == [0.9, 0.95]
        assert len(entry["losses"]) == len(res["reference_losses"]) == res["steps"]


def _bench_record(**changes) -> dict:
    """A minimal ``zerodp bench --device cuda`` record at 2 ranks (plain JSON, BenchResult's fields)."""
    rows = [
        {
            "name": n,
            "status": "ran",
            "step_time": {"median": 0.01},
            "ratio_to_ddp": 1.0,
            "max_loss_diff_vs_ddp": 0.0 if n == "DDP" else 2e-6,
            "memory": [{"rank": r, "peak_device": (r + 1) * 2 * 2**20} for r in (0, 1)],
        }
        for n in ("DDP", "FSDP2", "zerodp stage 0", "zerodp stage 1", "zerodp stage 2", "zerodp stage 3")
    ]
    rows.append({"name": "zerodp stage 2 + offload cpu", "status": "skipped", "reason": "offload is refused on a GPU"})
    return {
        "device": "cuda",
        "world_size": 2,
        "backend": "cpu:gloo,cuda:nccl",
        "preset": "tiny",
        "systems": rows,
        **changes,
    }


def test_bench_check_names_each_problem(tmp_path):
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import gpu_bench_check
    finally:
        sys.path.pop(0)
    good = tmp_path / "good.json"
    good.write_text(json.dumps(_bench_record()))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gpu_bench_check.py"), str(good)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0 and json.loads(proc.stdout)["systems"]["DDP"]["peak_device_mib"] == [2.0, 4.0]
    bad = _bench_record(device="cpu")
    bad["systems"][1] = {"name": "FSDP2", "status": "skipped", "reason": "RuntimeError: NCCL error"}
    bad["systems"][2]["memory"][1]["peak_device"] = None
    bad["systems"][3]["max_loss_diff_vs_ddp"] = 0.5
    found = gpu_bench_check.problems(gpu_bench_check.summary(bad))
    assert found == [
        "device is 'cpu', not 'cuda'",
        "FSDP2 did not run: RuntimeError: NCCL error",
        "zerodp stage 0: no peak device memory for some rank ([2.0, None])",
        "zerodp stage 1: loss differs from DDP's by 0.5 (> 0.001)",
    ]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gpu_bench_check.py"), str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1 and "FSDP2 did not run: RuntimeError: NCCL error" in proc.stderr


def _headline_tool():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import gpu_offload_headline
        import offload_headline_sizing
    finally:
        sys.path.pop(0)
    return gpu_offload_headline, offload_headline_sizing


def test_offload_headline_on_cpu(tmp_path):
    """The headline's lines on the CPU (--tiny): sizes computed from the budget, the cpu and nvme modes
    train in their child processes, the memory cap and the out-of-memory run are skipped with the
    reason, and the JSON holds every figure."""
    out = tmp_path / "headline.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "gpu_offload_headline.py"),
            "--device",
            "cpu",
            "--tiny",
            "--time-s",
            "240",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rep = json.loads(out.read_text())
    _, sizing = _headline_tool()
    assert rep["pass"] is True and rep["device"] == "cpu" and "the CPU rehearsal" in rep["note"]
    none, cpu, nvme = (rep["modes"][m] for m in ("none", "cpu", "nvme"))
    assert none["status"] == "skipped" and none["pass"] is None and "set_per_process_memory_fraction" in none["why"]
    budget = rep["budget_bytes"]
    for mode, rec in (("cpu", cpu), ("nvme", nvme)):
        size = rep["sizes"][mode]
        assert rec["status"] == "trained" and rec["pass"] is True and rec["params"] == size["params"] > 0, rec
        assert len(rec["losses"]) == 3 and rec["tokens_per_s"] > 0 and rec["peak_device_bytes"] is None
        assert rec["memory_cap"].startswith("skipped") and rec["host_VmRSS_bytes"] > 0
        # the widest model whose formula bytes fit the budget: one head wider does not
        shape = sizing.Shape(size["shape"]["n_layer"], size["shape"]["d_model"], 32, 2)
        wider = sizing.Shape(shape.n_layer, shape.d_model + sizing.HEAD_DIM, 32, 2)
        per = sizing.BYTES_PER_PARAM[mode]["device"]
        margin = sizing.DEVICE_MARGIN * budget
        assert shape.params() == size["params"]
        assert shape.params() * per + shape.activation_bytes() + margin <= budget
        assert size["limited_by"] != "device" or wider.params() * per + wider.activation_bytes() + margin > budget
    assert nvme["params"] > cpu["params"]  # 2 device bytes per parameter instead of 4
    assert 0.0 <= nvme["io_hidden_share"] <= 1.0 and nvme["swap"]["bytes_read"] > 0
    assert 0.0 <= cpu["copy_hidden_share"] <= 1.0 and cpu["copies_alone_s"] > 0  # the host pipeline ran
    # by the formula, the no-offload run of the cpu mode's model is past the budget (on a GPU: OOM)
    assert rep["sizes"]["none"]["device_bytes"] > budget
    assert not any(p.name.startswith("offload_headline_nvme_") for p in tmp_path.iterdir())  # swap dir removed


def test_offload_headline_plan_lowers_the_budget_when_time_binds():
    tool, sizing = _headline_tool()
    shape = sizing.Shape(12, 0, 256, 2)
    fast = sizing.Rates()  # nothing measured: no time cap
    budget, choices, why = tool.plan(8 * 2**30, 50.0, fast, 64 * 2**30, 10**12, shape, 3)
    assert budget == 8 * 2**30 and why is None and choices["cpu"].limited_by == "device"
    assert choices["nvme"].params > choices["cpu"].params == choices["none"].params
    assert choices["none"].device_bytes > budget  # 16 bytes per parameter: out of memory by the formula
    slow = sizing.Rates(adam_s_per_param=1e-8, init_s_per_param=1e-8)  # 100M parameters a second
    budget, choices, why = tool.plan(8 * 2**30, 50.0, slow, 64 * 2**30, 10**12, shape, 3)
    cpu = choices["cpu"]
    assert budget < 8 * 2**30 and "time" in why and cpu.caps["time"] is not None
    assert cpu.params <= cpu.caps["time"] and choices["none"].device_bytes > budget
    assert budget == sizing.budget_for(cpu.params, "cpu", cpu.shape) or cpu.limited_by == "device"
    with pytest.raises(ValueError, match="no GPT of 12 layers fits"):
        sizing.choose("cpu", 2**20, 12, 256, 2, {})


@pytest.mark.parametrize(
    "args,message",
    [
        (["--modes", "cpu,gpu"], "unknown mode(s) ['gpu']"),
        (["--steps", "1"], "--steps >= 2"),
        (["--device", "cuda"], "--device cuda, but torch.cuda.is_available() is False"),
    ],
)
def test_offload_headline_refuses_bad_arguments(tmp_path, args, message):
    import torch

    if "cuda" in args and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gpu_offload_headline.py"), *args, "--out", str(tmp_path / "h.json")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert not (tmp_path / "h.json").exists()


def test_offload_headline_judges_the_gpu_records():
    """The parent's pass/fail on CUDA records (made up here: no GPU): the no-offload run passes only by
    running out of memory (also when zerodp wraps torch's error), the offload runs by training with
    finite losses and a peak within the budget."""
    tool, _ = _headline_tool()
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import offload_headline_child as child
    finally:
        sys.path.pop(0)
    import torch

    budget = 2**30
    assert tool.judge("none", {"status": "oom", "phase": "initialize"}, "cuda", budget) == (
        True,
        "out of memory as expected (initialize)",
    )
    passed, why = tool.judge("none", {"status": "trained", "losses": [5.0]}, "cuda", budget)
    assert passed is False and "expected an out-of-memory error" in why
    good = {"status": "trained", "losses": [5.5, 5.4], "peak_device_bytes": budget - 1}
    assert tool.judge("cpu", good, "cuda", budget) == (True, "trained")
    assert tool.judge("nvme", {**good, "peak_device_bytes": budget + 1}, "cuda", budget)[0] is False
    assert tool.judge("cpu", {**good, "losses": [5.5, float("nan")]}, "cuda", budget)[0] is False
    assert tool.judge("nvme", {"status": "timeout", "note": "stopped after 20 s"}, "cuda", budget) == (
        False,
        "status 'timeout': stopped after 20 s",
    )
    try:
        try:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        except torch.cuda.OutOfMemoryError as inner:
            raise RuntimeError("zerodp: the step failed") from inner
    except RuntimeError as wrapped:
        assert child.is_oom(wrapped)
    assert not child.is_oom(RuntimeError("NCCL error")) and not child.is_oom(None)


def test_probed_budget_is_the_larger_reserved_peak_plus_a_margin():
    """When time binds the cpu model on a GPU, the budget is measured from uncapped probe runs (the
    formulas' budget ran both offload modes out of memory on the first GPU run); a failed probe is named."""
    tool, _ = _headline_tool()
    mib = 2**20
    probes = {
        "cpu": {"status": "trained", "peak_reserved_bytes": 300 * mib},
        "nvme": {"status": "trained", "peak_reserved_bytes": 250 * mib},
    }
    budget = tool.probed_budget(probes)
    assert budget == 330 * mib and budget % (2 * mib) == 0  # 300 MiB x 1.10, on a 2 MiB segment
    probes["nvme"] = {"status": "oom", "error": "OutOfMemoryError: ..."}
    with pytest.raises(RuntimeError, match="the uncapped nvme probe did not train: oom OutOfMemoryError"):
        tool.probed_budget(probes)


def test_cli_check_arguments_and_commands():
    """tools/gpu_cli_check.sh refuses an unknown argument naming what is allowed, and every example it
    runs exists (its full run takes minutes: rehearsed by hand on the CPU, run on the H200)."""
    script = ROOT / "tools" / "gpu_cli_check.sh"
    proc = subprocess.run(["bash", str(script), "--bogus"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "unknown argument '--bogus'; allowed: --python PYTHON, --out DIR" in proc.stderr
    examples = re.findall(r"(examples/\S+\.py)", script.read_text())
    assert len(examples) == 4 and all((ROOT / e).exists() for e in examples), examples
