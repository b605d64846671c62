"""``zerodp bench --device``: argument handling (cuda refused on this CPU-only machine) and, with
``torch.cuda`` patched (nothing is allocated on a GPU: ``.to`` and the wrappers are recorded), that
every system builder gets the CUDA device, that the timing synchronizes the device around the clock,
and that the peak device memory reaches the JSON and the table. No GPU has run this (docs/bench.md)."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest
import torch
import torch.distributed as dist

import zerodp
from zerodp.app import bench, bench_args, bench_device, bench_sweep, bench_systems, cli
from zerodp.app.bench_report import BenchResult, format_table
from zerodp.app.bench_systems import SYSTEMS, Skipped, System, offload_systems
from zerodp.app.model import GPT, GPTConfig
from zerodp.runtime import device as rt_device

CUDA1 = torch.device("cuda", 1)
CFG = GPTConfig(n_layer=1, n_head=2, d_model=16, seq_len=8)


def _args(tmp_path, *flags):
    return cli.build_parser().parse_args(["bench", "--preset", "tiny", "--out", str(tmp_path / "o"), *flags])


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda reports 2 devices; set_device, synchronize and the memory counters are recorded."""
    calls: list[tuple] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: calls.append(("set_device", i)))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: calls.append(("synchronize", d)))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d=None: calls.append(("reset_peak", d)))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d=None: 3 * 2**20)
    return calls


def test_default_is_cpu_and_cuda_is_refused_without_cuda(tmp_path, monkeypatch):
    assert _args(tmp_path).device == "cpu" and bench_device.device_type("cpu") == "cpu"
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal is for machines without it")
    assert bench_device.device_type("auto") == "cpu"
    msg = r"--device cuda needs a CUDA device, but torch.cuda.is_available\(\) is False"
    with pytest.raises(ValueError, match=msg):
        bench_args.check_arguments(_args(tmp_path, "--device", "cuda"))
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    assert bench_sweep.launch_env("auto")["DS_ACCELERATOR"] == "cpu"


def test_launcher_refuses_cuda_with_one_line_exit_2(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "zerodp.app.cli",
            "bench",
            "--preset",
            "tiny",
            "--device",
            "cuda",
            "--out",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "--device cuda needs a CUDA device" in errors[0]
    assert "Traceback" not in proc.stderr and not (tmp_path / "o" / "bench.json").exists()
    proc = subprocess.run(
        [sys.executable, "-m", "zerodp.app.cli", "bench", "--device", "tpu"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "invalid choice: 'tpu'" in proc.stderr


def test_cuda_choices_with_cuda_patched(tmp_path, fake_cuda, monkeypatch):
    assert bench_device.device_type("auto") == "cuda" and bench_device.device_type("cuda") == "cuda"
    assert bench_device.device_type("cpu") == "cpu"
    bench_args.check_arguments(_args(tmp_path, "--device", "cuda"))  # accepted
    with pytest.raises(
        ValueError, match="--offload cannot run with --device cuda: the bench's offload rows are refused on a GPU"
    ):
        bench_args.check_arguments(_args(tmp_path, "--device", "cuda", "--offload"))
    bench_args.check_arguments(_args(tmp_path, "--device", "cpu", "--offload"))  # the CPU keeps offload
    # cuda:LOCAL_RANK, made current, when the group takes CUDA tensors
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(rt_device, "group_takes", lambda kind, group=None: kind == "cuda")
    assert bench_device.resolve("auto") == CUDA1 and ("set_device", 1) in fake_cuda
    assert bench_device.resolve("cpu") == torch.device("cpu")
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    assert "DS_ACCELERATOR" not in bench_sweep.launch_env("cuda")  # DeepSpeed picks CUDA itself
    assert "DS_ACCELERATOR" not in bench_sweep.launch_env("auto")
    assert bench_sweep.launch_env("cpu")["DS_ACCELERATOR"] == "cpu"  # --device cpu on a GPU machine


def test_sync_and_peak_memory_go_to_the_device(fake_cuda):
    bench_device.synchronize(CUDA1)
    bench_device.reset_peak_memory(CUDA1)
    assert bench_device.peak_memory(CUDA1) == 3 * 2**20
    assert fake_cuda == [("synchronize", CUDA1), ("reset_peak", CUDA1)]
    cpu = torch.device("cpu")
    bench_device.synchronize(cpu)
    bench_device.reset_peak_memory(cpu)
    assert bench_device.peak_memory(cpu) is None and len(fake_cuda) == 2


@pytest.fixture
def recorded_to(monkeypatch):
    """GPT.to records its device and stays on the CPU (nothing allocated on a GPU)."""
    moved: list[torch.device] = []

    def to(self, device, *a, **k):
        moved.append(torch.device(device))
        return self

    monkeypatch.setattr(GPT, "to", to)
    return moved


class _Stop(Exception):
    pass


def test_torch_builders_get_the_cuda_device(fake_cuda, recorded_to, monkeypatch):
    import torch.distributed.device_mesh as dm
    import torch.distributed.fsdp as fsdp
    import torch.nn.parallel as par

    seen: dict[str, object] = {}

    def fake_ddp(module, device_ids=None):
        seen["ddp_device_ids"] = device_ids
        raise _Stop

    monkeypatch.setattr(par, "DistributedDataParallel", fake_ddp)
    with pytest.raises(_Stop):
        SYSTEMS["DDP"](CFG, 1e-3, False, device=CUDA1)
    with pytest.raises(_Stop):
        SYSTEMS["torch ZeroRedundancyOptimizer"](CFG, 1e-3, False, device=CUDA1)
    assert seen["ddp_device_ids"] == [1]
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dm, "init_device_mesh", lambda kind, shape: seen.setdefault("mesh", (kind, shape)))
    shards: list = []
    monkeypatch.setattr(fsdp, "fully_shard", lambda m, mesh=None: shards.append(mesh))
    SYSTEMS["FSDP2"](CFG, 1e-3, False, device=CUDA1)
    assert seen["mesh"] == ("cuda", (2,)) and len(shards) == CFG.n_layer + 1
    assert all(m == ("cuda", (2,)) for m in shards)
    assert recorded_to == [CUDA1] * 3


def test_zerodp_builders_get_the_cuda_device_and_offload_is_skipped(fake_cuda, recorded_to, monkeypatch):
    configs: list[dict] = []

    def fake_initialize(module, config):
        configs.append(config)
        raise _Stop

    monkeypatch.setattr(zerodp, "initialize", fake_initialize)
    for stage in (0, 1, 2, 3):
        with pytest.raises(_Stop):
            SYSTEMS[f"zerodp stage {stage}"](CFG, 1e-3, False, device=CUDA1)
    assert [c["device"] for c in configs] == ["cuda"] * 4 and recorded_to == [CUDA1] * 4
    for _name, build in [
        *offload_systems("/tmp/nvme", 4096).items(),
        *((n, SYSTEMS[n]) for n in SYSTEMS if "offload" in n and n.startswith("zerodp")),
    ]:
        with pytest.raises(Skipped, match="offload rows are refused on a GPU.*--device cpu"):
            build(CFG, 1e-3, False, device=CUDA1)
    assert len(configs) == 4  # the offload rows built nothing


def test_deepspeed_accelerator_must_match_the_device(monkeypatch):
    fake_ds = types.ModuleType("deepspeed")
    fake_acc = types.ModuleType("deepspeed.accelerator")
    fake_acc.get_accelerator = lambda: types.SimpleNamespace(device_name=lambda: "cpu")
    fake_ds.accelerator = fake_acc
    monkeypatch.setitem(sys.modules, "deepspeed", fake_ds)
    monkeypatch.setitem(sys.modules, "deepspeed.accelerator", fake_acc)
    with pytest.raises(Skipped, match="accelerator is 'cpu' but --device resolved to 'cuda'"):
        SYSTEMS["DeepSpeed stage 2"](CFG, 1e-3, False, device=CUDA1)
    bench_systems._check_deepspeed_device(torch.device("cpu"))  # matching: no refusal


def _fake_builder(log: list):
    def build(cfg, lr, probe, device=bench_device.CPU):
        log.append(("build", device))
        p = torch.nn.Parameter(torch.ones(2))

        def fb(x, y):
            log.append("fb")
            return (p * 2).sum()

        srcs = lambda: {c: [] for c in bench.CATEGORIES}  # noqa: E731
        return System("fake", "torch", 0, torch.nn.Linear(1, 1), fb, lambda: log.append("step"), srcs)

    return build


def test_timing_and_probe_use_the_device(fake_cuda, monkeypatch):
    log: list = []
    monkeypatch.setattr(bench, "_agree_skip", lambda reason: reason)
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: None)
    monkeypatch.setattr(bench_device, "synchronize", lambda d: log.append(("sync", d)))
    batches = [(torch.zeros(1), torch.zeros(1))] * 2
    times = bench._time(_fake_builder(log), CFG, batches, 1, CUDA1)
    assert len(times) == 1
    assert log == [
        ("build", CUDA1),
        ("sync", CUDA1),
        "fb",
        "step",
        ("sync", CUDA1),
        ("sync", CUDA1),
        "fb",
        "step",
        ("sync", CUDA1),
    ]
    log.clear()
    fake_cuda.clear()
    out = bench._probe(_fake_builder(log), CFG, batches, frozenset(), CUDA1)
    assert out["peak_device"] == 3 * 2**20 and fake_cuda[0] == ("reset_peak", CUDA1)
    assert log[0] == ("build", CUDA1)
    assert bench._probe(_fake_builder(log), CFG, batches, frozenset(), torch.device("cpu"))["peak_device"] is None


def _result(device: str, peak) -> BenchResult:
    row = {
        "name": "DDP",
        "family": "torch",
        "stage": 0,
        "status": "ran",
        "losses": [1.0],
        "memory": [
            {
                "rank": r,
                "measured": {},
                "unattributed": 0,
                "peak_rss": 2**20,
                "rss_before": 0,
                "peak_device": None if peak is None else peak * (r + 1),
            }
            for r in (0, 1)
        ],
    }
    return BenchResult.model_validate(
        {
            "command": "zerodp bench",
            "date_utc": "x",
            "preset": "tiny",
            "model": {},
            "psi": 10,
            "world_size": 2,
            "backend": "gloo",
            "device": device,
            "micro_batch": 1,
            "steps": 1,
            "warmup": 0,
            "rounds": 0,
            "probe_steps": 2,
            "torch_version": "t",
            "cpu_count": 1,
            "load_average_start": [0.0],
            "load_average_end": [0.0],
            "systems": [row],
        }
    )


def test_table_and_json_carry_peak_device_memory():
    table = format_table(_result("cuda", 5 * 2**20)).splitlines()
    assert "GPU MiB" in table[1] and "cuda" in table[0]
    assert table[2].split()[-1] == "10"  # the highest rank's peak, MiB
    res = BenchResult.model_validate_json(_result("cuda", 5 * 2**20).model_dump_json())
    assert [m.peak_device for m in res.systems[0].memory] == [5 * 2**20, 10 * 2**20]
    cpu_table = format_table(_result("cpu", None))
    assert "GPU MiB" not in cpu_table
    assert BenchResult.model_validate_json(_result("cpu", None).model_dump_json()).device == "cpu"


def test_sweep_forwards_the_device(tmp_path):
    args = _args(tmp_path, "--sweep-ranks", "1", "--device", "auto")
    cmds, _ = bench_sweep.sweep_commands(args, [])
    assert "--device=auto" in cmds[0]
