"""``zerodp estimate``'s traffic per optimizer step, per rank, against what the engine measures
(``engine.comm_report()``) at stages 0-3 with 1 and 2 micro-steps per optimizer step."""

from __future__ import annotations

from pathlib import Path

import pytest

from distributed import run_worker
from zerodp.app import cli
from zerodp.runtime.accounting import comm_elements_per_step, human_bytes

WORKER = Path(__file__).with_name("estimate_traffic_worker.py")


@pytest.fixture(scope="module")
def measured() -> list[dict]:
    return run_worker(2, "0,1,2,3", "1,2", worker=WORKER)


@pytest.mark.parametrize("grad_accum", [1, 2])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_estimate_traffic_matches_the_engine(measured: list[dict], capsys, stage: int, grad_accum: int) -> None:
    for res in measured:
        m = res[f"stage{stage}/K{grad_accum}"]
        psi = m["psi"]
        assert m["steps"] == 2, m
        # the engine sends what the formula says (Psi divides evenly over 2 ranks: no padding)
        assert m["elements_per_step"] == comm_elements_per_step(stage, psi, grad_accum), m["table"]
        assert m["expected"] == m["elements_per_step"], m["table"]
    psi_per_step = measured[0][f"stage{stage}/K{grad_accum}"]["elements_per_step"] / psi
    assert cli.main(["estimate", "--params", str(psi), "--dp", "2", "--fp32", "--grad-accum", str(grad_accum)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "traffic per optimizer step, per rank" in out[1], out
    bytes_per_step = psi_per_step * psi * 4  # fp32
    assert out[2 + stage].endswith(f"{psi_per_step:g} Psi = {human_bytes(bytes_per_step)}"), out[2 + stage]
