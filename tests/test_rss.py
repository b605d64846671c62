"""Model-state memory measured as process RSS, where model states dominate (tests/rss_worker.py):
8 x Linear(1024, 1024), fp32 Adam, 2 ranks. Per rank, stage 0 holds 16 bytes per parameter (134 MB),
stage 2 4 + 12/2 = 10 (84 MB), stage 3 16/2 = 8 (67 MB) plus a gathered window; the kernel's resident
set must show those differences (with generous margins for allocator noise)."""

from __future__ import annotations

from pathlib import Path

import pytest

from distributed import run_worker

WORKER = Path(__file__).with_name("rss_worker.py")
MB = 1e6


@pytest.fixture(scope="module")
def growth(monkeypatch_module: pytest.MonkeyPatch) -> dict[int, list[float]]:
    monkeypatch_module.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # freed blocks return to the OS
    out = {}
    for stage in (0, 2, 3):
        res = run_worker(2, str(stage), "rss", worker=WORKER, torchrun=True)  # RSS of a fresh interpreter
        out[stage] = [r["rss"]["growth"] for r in res]
        out[f"psi{stage}"] = res[0]["rss"]["psi"]
    return out


@pytest.fixture(scope="module")
def monkeypatch_module() -> pytest.MonkeyPatch:
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_rss_follows_the_zero_stages(growth: dict) -> None:
    psi = growth["psi0"]
    assert psi == 8 * (1024 * 1024 + 1024)
    stage0, stage2, stage3 = (max(growth[s]) for s in (0, 2, 3))
    # stage 0 really holds its 16 Psi (parameters, gradients, two Adam moments), within 10 %
    assert stage0 >= 0.9 * 16 * psi, (stage0 / MB, 16 * psi / MB)
    # stage 2 saves 6 Psi of the 16 (half the gradients and moments) per rank: at least half of that shows
    assert stage0 - stage2 >= 0.5 * 6 * psi, (stage0 / MB, stage2 / MB)
    # stage 3 also partitions the parameters (2 Psi saved over stage 2), gathered window aside
    assert stage2 - stage3 >= 0.5 * 2 * psi - 2**21 * 4, (stage2 / MB, stage3 / MB)
