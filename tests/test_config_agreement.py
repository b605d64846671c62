"""Ranks given different settings are refused at initialize, on every rank, naming the key and each rank's
value (a learning rate per rank trained silently wrong; a stage per rank aborted inside gloo without a
Python message); keys meant to differ per rank (nvme_path) are accepted."""

from __future__ import annotations

from pathlib import Path

import pytest

from distributed import run_worker
from zerodp.runtime.config_agreement import differences

WORKER = Path(__file__).with_name("config_agreement_worker.py")


@pytest.fixture(scope="module")
def launch() -> dict[str, list[str]]:
    """One 2-rank launch runs every case (tests/config_agreement_worker.py); {case: per-rank result}."""
    ranks = run_worker(2, worker=WORKER)
    return {case: [r[case].get("result", r[case].get("error")) for r in ranks] for case in ranks[0]}


def run(launch: dict[str, list[str]], case: str) -> list[str]:
    assert case in launch, f"case {case!r} did not run"
    return launch[case]


@pytest.mark.parametrize(
    "case,key,values",
    [
        ("lr", "optimizer.params.lr", ("rank 0 0.1", "rank 1 0.01")),
        ("stage", "zero_optimization.stage", ("rank 0 2", "rank 1 3")),
    ],
)
def test_different_settings_are_refused_on_every_rank(
    launch: dict[str, list[str]], case: str, key: str, values: tuple[str, str]
) -> None:
    for message in run(launch, case):
        assert "different settings" in message and key in message, message
        for v in values:
            assert v in message, message


@pytest.mark.parametrize("case", ["same", "nvme_path"])
def test_same_settings_and_per_rank_keys_pass(launch: dict[str, list[str]], case: str) -> None:
    assert run(launch, case) == ["ok", "ok"]


def test_differences_lists_each_key_once_and_bounds_the_list() -> None:
    a = {f"k{i}": "1" for i in range(12)}
    b = {f"k{i}": "2" for i in range(12)}
    lines = differences([a, b], limit=3)
    assert lines[:3] == ["k0: rank 0 1, rank 1 2", "k1: rank 0 1, rank 1 2", "k10: rank 0 1, rank 1 2"]
    assert lines[3] == "... and 9 more"
    assert differences([a, dict(a)]) == []
