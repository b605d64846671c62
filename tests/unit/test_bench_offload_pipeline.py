"""``zerodp bench --offload``'s pipeline lines (zerodp.app.bench_offload.pipeline_phases / pipeline_report):
the host offload's pipeline measured with the host playing the device. Checked: the offloaded engine
really runs the pipeline (not the no-offload engine a CPU run otherwise gets), with and without
``delayed_update``; every figure is measured; the hidden share is the documented ratio; the variable
that switches the pipeline on is restored; with a process group up, the report comes from a child
process. Timings themselves are not asserted (a shared CPU)."""

from __future__ import annotations

import os

from zerodp.app import bench_offload
from zerodp.offload.build import HOST_PIPELINE_ON_CPU_ENV


def test_pipeline_phases_run_the_host_pipeline(world1, monkeypatch):
    monkeypatch.delenv(HOST_PIPELINE_ON_CPU_ENV, raising=False)
    f = bench_offload.pipeline_phases(1_000_000, steps=2)
    assert f["numel"] == 1_000_000 and f["offload"] == 1.0 and f["offload_delayed"] == 1.0
    for key in ("step", "step_delayed", "fwd_bwd", "fwd_bwd_delayed", "adam", "copies"):
        assert f[key] > 0, (key, f)
    assert f["hidden"] == 1.0 - f["step_delayed"] / f["step"]
    assert HOST_PIPELINE_ON_CPU_ENV not in os.environ


def test_pipeline_report_runs_in_a_child_under_a_process_group(world1):
    text = bench_offload.pipeline_report(1_000_000)
    assert text.startswith("offload cpu pipeline, host as the device (1,000,000 fp32 elements"), text
    assert "CPU Adam alone (fused)" in text and "copies alone" in text and "1 - step_delayed / step =" in text
