"""``python -m zerodp.app.overhead_bench`` (host CPU cost per module per training step): argument
handling, and one tiny run's table and JSON (2 ranks, 2 Linear layers; the figures themselves are
measurements, only their presence and consistency are checked)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from zerodp.app import overhead_bench


def test_defaults_are_the_issue_s_model():
    args = overhead_bench.build_parser().parse_args([])
    assert (args.layers, args.width, args.ranks) == (64, 64, 2)
    assert args.systems == list(overhead_bench.SYSTEMS)


@pytest.mark.parametrize("argv", [["--layers", "0"], ["--steps", "x"], ["--systems", "megatron"], ["--ranks", "0"]])
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        overhead_bench.build_parser().parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert argv[0] in err and ("expected an integer" in err or "invalid choice" in err)


def test_ratios_and_table():
    figures = overhead_bench.with_ratios(
        {
            "ddp": {"cpu_us": 10.0, "wall_us": 20.0},
            "fsdp2": {"cpu_us": 40.0, "wall_us": 50.0},
            "zerodp_s3": {"cpu_us": 30.0, "wall_us": 35.0},
            "deepspeed": {"skipped": "not installed"},
        }
    )
    assert figures["zerodp_s3"]["cpu_vs_ddp"] == 3.0 and figures["zerodp_s3"]["cpu_vs_fsdp2"] == 0.75
    args = overhead_bench.build_parser().parse_args(["--layers", "2", "--width", "4"])
    text = overhead_bench.table(figures, args, 2)
    assert "2 x Linear(4, 4)" in text and "deepspeed   skipped: not installed" in text
    assert "zerodp_s3       30.0     35.0     3.00      0.75" in text


def test_tiny_run_prints_the_table_and_writes_json(tmp_path):
    out = tmp_path / "o.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "zerodp.app.overhead_bench",
            "--layers",
            "2",
            "--width",
            "4",
            "--steps",
            "1",
            "--warmup",
            "1",
            "--rounds",
            "1",
            "--json",
            str(out),
            "--systems",
            "plain",
            "ddp",
            "fsdp2",
            "deepspeed",
            "zerodp_s0",
            "zerodp_s3",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "host cost per module per step: 2 x Linear(4, 4)" in proc.stdout
    res = json.loads(out.read_text())
    assert res["world_size"] == 2
    figures = res["figures"]
    assert list(figures) == ["plain", "ddp", "fsdp2", "deepspeed", "zerodp_s0", "zerodp_s3"]
    for name in ("plain", "ddp", "fsdp2", "zerodp_s0", "zerodp_s3"):
        row = figures[name]
        assert row["cpu_us"] > 0 and row["wall_us"] > 0, row
        assert row["cpu_vs_ddp"] == pytest.approx(row["cpu_us"] / figures["ddp"]["cpu_us"])
        assert row["cpu_vs_fsdp2"] == pytest.approx(row["cpu_us"] / figures["fsdp2"]["cpu_us"])
    assert "skipped" in figures["deepspeed"] or "cpu_us" in figures["deepspeed"]
