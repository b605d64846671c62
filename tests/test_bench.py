"""``zerodp bench`` on the tiny preset: the JSON record, the table and the three charts.

No timing assertions: the step times are only checked to exist. What is compared: every system of
``SYSTEMS`` has a row (ran, or skipped with a reason); every system that ran reproduces DDP's losses;
zerodp's measured model state matches the ZeRO paper's formula; zerodp's counted traffic is 2 Psi per
step at stages 0-2.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from zerodp.app import bench_args, bench_cmd, bench_sweep, cli
from zerodp.app.bench_report import BenchResult
from zerodp.app.bench_systems import SYSTEMS

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> tuple[BenchResult, Path, str]:
    pytest.importorskip("matplotlib")
    out = tmp_path_factory.mktemp("bench")
    # every system, DeepSpeed's rows too where it is installed (pip install -e '.[bench]'); the
    # fresh-process RSS is tested on its own below (one forked process per system and rank is slow)
    cmd = [
        sys.executable,
        "-m",
        "zerodp.app.cli",
        "bench",
        "--nproc",
        "2",
        "--preset",
        "tiny",
        "--steps",
        "1",
        "--warmup",
        "0",
        "--rounds",
        "1",
        "--probe-steps",
        "2",
        "--no-fresh-rss",
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return BenchResult.model_validate_json((out / "bench.json").read_text()), out, proc.stdout


def test_every_system_ran_or_was_skipped_with_a_reason(tiny_run) -> None:
    res, _, stdout = tiny_run
    assert [s.name for s in res.systems] == list(SYSTEMS)
    ran = {s.name: s for s in res.systems if s.status == "ran"}
    assert {"DDP", "zerodp stage 0", "zerodp stage 1", "zerodp stage 2", "zerodp stage 3"} <= set(ran)
    for s in res.systems:
        assert s.name in stdout
        if s.status == "skipped":
            assert s.reason and s.step_time is None
        else:
            assert s.reason is None and s.step_time is not None and s.step_time.n == 1
            assert s.ratio_to_ddp is not None and len(s.ratio_per_round) == 1
            assert [m.rank for m in s.memory] == [0, 1] and all(m.peak_rss > 0 for m in s.memory)
    assert ran["DDP"].ratio_to_ddp == 1.0
    assert res.psi > 0 and res.world_size == 2 and res.preset == "tiny"


def _deepspeed_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


def test_deepspeed_rows_run_when_installed_else_say_why(tiny_run) -> None:
    res, _, _ = tiny_run
    rows = [s for s in res.systems if s.family == "deepspeed"]
    assert [s.name for s in rows] == [
        "DeepSpeed stage 1",
        "DeepSpeed stage 2",
        "DeepSpeed stage 3",
        "DeepSpeed stage 3 + CPU offload",
    ]
    if _deepspeed_importable():
        assert res.deepspeed_version is not None
        for s in rows:
            assert s.status == "ran", (s.name, s.reason)
            assert s.max_loss_diff_vs_ddp is not None and s.max_loss_diff_vs_ddp < 1e-5, s.name
            assert s.stage == int(s.name.split()[2]) and s.memory and s.memory[0].measured["optimizer_states"] > 0
            # stage 3 gathers below torch.distributed's Python functions: not measured, never a fraction
            assert (s.traffic is None) == (s.stage == 3), (s.name, s.traffic)
    else:
        for s in rows:
            assert s.status == "skipped" and "DeepSpeed not installed" in s.reason and "[bench]" in s.reason


def test_peak_rss_in_a_process_of_its_own(tmp_path) -> None:
    """``zerodp bench`` forks one process per system and rank and reports its VmHWM beside DDP's."""
    out = tmp_path / "fresh"
    cmd = [
        sys.executable,
        "-m",
        "zerodp.app.cli",
        "bench",
        "--nproc",
        "2",
        "--preset",
        "tiny",
        "--only",
        "zerodp stage 2",
        "--rounds",
        "0",
        "--probe-steps",
        "2",
        "--no-plots",
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = BenchResult.model_validate_json((out / "bench.json").read_text())
    ran = {s.name: s for s in res.systems if s.status == "ran"}
    assert set(ran) == {"DDP", "zerodp stage 2"}
    for s in ran.values():
        assert [m.rank for m in s.fresh_rss] == [0, 1], s.fresh_rss_note
        for m in s.fresh_rss:  # the child starts as a copy of a rank that imported torch, then trains
            assert 50 * 2**20 < m.rss_start < m.peak_rss < 4 * 2**30
        assert s.fresh_rss_vs_ddp == pytest.approx(
            max(m.peak_rss for m in s.fresh_rss) / max(m.peak_rss for m in ran["DDP"].fresh_rss)
        )
    assert ran["DDP"].fresh_rss_vs_ddp == 1.0
    assert f"{ran['zerodp stage 2'].fresh_rss_vs_ddp:.2f}x" in proc.stdout


def test_losses_agree_with_ddp(tiny_run) -> None:
    res, _, _ = tiny_run
    ddp = next(s for s in res.systems if s.name == "DDP")
    assert len(ddp.losses) == 2
    compared = 0
    for s in res.systems:
        if s.status == "ran":
            assert s.max_loss_diff_vs_ddp is not None and s.max_loss_diff_vs_ddp < 1e-5, s.name
            compared += 1
    assert compared >= 5


def test_zerodp_memory_and_traffic_match_the_paper(tiny_run) -> None:
    res, _, _ = tiny_run
    for stage in (0, 1, 2, 3):
        s = next(x for x in res.systems if x.name == f"zerodp stage {stage}")
        m = s.memory[0].measured
        for cat in ("parameters", "gradients", "optimizer_states"):
            # measured from live storage; padding and (stage 3) persistent small parameters add a little
            assert s.formula[cat] <= m[cat] * 1.001 + 8 and m[cat] <= s.formula[cat] * 1.08, (stage, cat, m, s.formula)
        assert m["master_weights"] == 0  # fp32: the optimizer updates the parameters' own storage
        assert s.traffic is not None and s.traffic.formula_psi == (3 if stage == 3 else 2)
        if stage < 3:
            assert s.traffic.psi_per_step == pytest.approx(2.0, rel=1e-3)
        else:  # the tied embedding is gathered by two modules (see docs/benchmarks/2026-12-01-bench.md)
            assert 3.0 <= s.traffic.psi_per_step < 3.5
    totals = [
        sum(next(x for x in res.systems if x.name == f"zerodp stage {st}").memory[0].measured.values())
        for st in (0, 1, 2, 3)
    ]
    assert totals == sorted(totals, reverse=True) and totals[3] < totals[0] / 1.5


def test_three_charts_written(tiny_run) -> None:
    _, out, _ = tiny_run
    for name in ("memory_by_category.png", "step_time_ratio.png", "memory_vs_ranks.png"):
        data = (out / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 5000, name


def test_sweep_commands_and_bad_values() -> None:
    args = cli.build_parser().parse_args(["bench", "--preset", "tiny", "--sweep-ranks", "1,3", "--out", "o"])
    cmds, files = bench_sweep.sweep_commands(args, [sys.executable, "-m", "torch.distributed.run", "--standalone"])
    assert [c[c.index("--nproc-per-node") + 1] for c in cmds] == ["1", "3"]
    assert files == [str(Path("o") / "sweep_1" / "bench.json"), str(Path("o") / "sweep_3" / "bench.json")]
    assert all("--rounds=0" in c and "--preset=tiny" in c for c in cmds)
    args.sweep_ranks = "1,x"
    with pytest.raises(ValueError, match="--sweep-ranks"):
        bench_sweep.sweep_commands(args, [])
    with pytest.raises(SystemExit):
        cli.main(["bench", "--preset", "huge"])
    ns = argparse.Namespace(preset="small", n_layer=None, n_head=None, d_model=128, seq_len=None, micro_batch=None)
    cfg, micro = bench_args.resolve_model(ns)
    assert (cfg.n_layer, cfg.d_model, micro) == (4, 128, 8)


def test_offload_rows_are_registered_and_flags_forwarded() -> None:
    from zerodp.app.bench_systems import Skipped, offload_systems

    real = offload_systems("/tmp/nvme", 4096)
    assert list(real) == ["zerodp stage 2 + offload cpu", "zerodp stage 2 + offload nvme"]
    for name in real:  # same names and order as the placeholders, which refuse without --offload
        assert name in SYSTEMS and SYSTEMS[name] is not real[name]
        with pytest.raises(Skipped, match="--offload"):
            SYSTEMS[name](None, 1e-3, False)
    args = cli.build_parser().parse_args(["bench", "--offload", "--nvme-path", "/tmp/n", "--sub-group-size", "5"])
    cmd = bench_cmd.bench_command(args)
    assert "--offload" in cmd and "--sub-group-size" in " ".join(cmd) and "/tmp/n" in " ".join(cmd)


def _bench_args(tmp_path: Path, *flags: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(["bench", "--preset", "tiny", "--out", str(tmp_path / "out"), *flags])


@pytest.mark.parametrize(
    "flags,message",
    [
        (("--rounds", "-1"), "--rounds must be an integer >= 0, got -1"),
        (("--steps", "0"), "--steps must be an integer >= 1, got 0"),
        (("--warmup", "-3"), "--warmup must be an integer >= 0, got -3"),
        (("--micro-batch", "0"), "--micro-batch must be an integer >= 1"),
        (("--probe-steps", "1"), "--probe-steps must be >= 2"),
        (("--sub-group-size", "0"), "--sub-group-size must be an integer >= 1"),
        (("--n-head", "3"), "n_head"),
        (("--only", "stage 2,nosuch"), "--only: 'nosuch' is part of no system's name; the systems are 'DDP'"),
        (("--exclude", "FSDP3"), "--exclude: 'FSDP3' is part of no system's name"),
        (("--sweep-ranks", ","), "--sweep-ranks takes integers >= 1"),
        (("--sweep-ranks", "1,x"), "--sweep-ranks takes integers >= 1 separated by commas, got '1,x'"),
        (("--sweep-ranks", "0,2"), "--sweep-ranks takes integers >= 1"),
        (("--nvme-path", "/tmp/x"), "--nvme-path '/tmp/x' is used only by the --offload rows"),
    ],
)
def test_bad_arguments_are_refused_before_anything_runs(tmp_path, flags, message) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        bench_args.check_arguments(_bench_args(tmp_path, *flags))
    assert not (tmp_path / "out" / "bench.json").exists()


def test_out_must_be_a_writable_directory(tmp_path) -> None:
    (tmp_path / "file").write_text("x")
    args = cli.build_parser().parse_args(["bench", "--preset", "tiny", "--out", str(tmp_path / "file" / "sub")])
    with pytest.raises(ValueError, match="--out .* cannot be created as a directory"):
        bench_args.check_arguments(args)
    args = _bench_args(tmp_path, "--only", "stage 3", "--exclude", "DeepSpeed", "--rounds", "0")
    bench_args.check_arguments(args)  # valid: nothing raised, the directory exists
    assert (tmp_path / "out").is_dir()


def test_launcher_refuses_bad_arguments_with_one_line(tmp_path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "zerodp.app.cli",
            "bench",
            "--preset",
            "tiny",
            "--rounds",
            "-1",
            "--out",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "--rounds must be an integer >= 0, got -1" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "o" / "bench.json").exists()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "zerodp.app.cli",
            "bench",
            "--preset",
            "tiny",
            "--sweep-ranks",
            "1,x",
            "--out",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "--sweep-ranks takes integers >= 1" in proc.stderr


def test_sweep_ranks_inside_torchrun_needs_the_launcher(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(ValueError, match="zerodp bench launcher"):
        bench_args.check_arguments(_bench_args(tmp_path, "--sweep-ranks", "1,3"))
    bench_args.check_arguments(_bench_args(tmp_path, "--sweep-ranks", "1,3", "--sweep-from", "a.json"))


def test_untimed_rows_show_no_ratio(tiny_run) -> None:
    from zerodp.app.bench_report import format_table

    res, _, _ = tiny_run
    untimed = res.model_copy(
        update={
            "rounds": 0,
            "systems": [
                s.model_copy(update={"step_time": None, "ratio_to_ddp": None, "ratio_per_round": []})
                for s in res.systems
            ],
        }
    )
    rows = [line for line in format_table(untimed).splitlines() if line[:34].strip() == "zerodp stage 2"]
    assert len(rows) == 1 and "0.00x" not in rows[0] and "0.0000" not in rows[0]
    assert rows[0].split()[3:6] == ["-", "-", "-"]  # median, IQR, vs DDP


def test_only_and_exclude_select_by_name_parts(tmp_path) -> None:
    args = _bench_args(tmp_path, "--only", "zerodp stage 2,", "--exclude", " FSDP2 ,")
    names, excluded = bench_args.selected_systems(args, list(SYSTEMS))
    # an empty entry selects nothing (it used to select every system); DDP is always first
    assert names == ["DDP", "zerodp stage 2", "zerodp stage 2 + offload cpu", "zerodp stage 2 + offload nvme"]
    assert excluded == ["FSDP2"]
    names, excluded = bench_args.selected_systems(_bench_args(tmp_path), list(SYSTEMS))
    assert names == list(SYSTEMS) and excluded == []
