"""tests/tensor_compare.py: the GPU offload tests' comparison in units of epsilon x scale."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tensor_compare import ulps  # noqa: E402  (tests/, next to this folder)

NAN, INF = float("nan"), float("inf")


def test_units_of_epsilon_times_scale() -> None:
    x = torch.tensor([1.0, -2.0, 0.5])
    assert ulps(x, x.clone()) == 0.0
    eps = torch.finfo(torch.float32).eps
    assert abs(ulps(x, x + torch.tensor([0.0, 4 * eps, 0.0])) - 2.0) < 1e-6  # 4 eps against a scale of 2
    b = x.bfloat16()
    # bf16: a unit is 2^-7 of the largest magnitude (here 2): the limit of 2 units in tests/test_offload.py
    # lets one or two roundings through and catches a change of 0.05 (3.2 units), not one of 0.02 (1.5)
    assert ulps(b, (x + 0.05).bfloat16()) > 2.0 and ulps(b, (x + 0.02).bfloat16()) == 1.5
    assert ulps(x, torch.zeros(4)) == INF and ulps(torch.tensor([1, 2]), torch.tensor([1, 3])) == INF


def test_nan_and_inf_count_only_where_both_runs_hold_the_same() -> None:
    a = torch.tensor([1.0, NAN, INF])
    assert ulps(a, a.clone()) == 0.0
    assert ulps(torch.tensor([1.0, 2.0]), torch.tensor([1.0, NAN])) == INF  # max() alone would drop it
    assert ulps(torch.tensor([1.0, NAN]), torch.tensor([1.0, 2.0])) == INF
    assert ulps(torch.tensor([NAN, 1.0]), torch.tensor([INF, 1.0])) == INF
    assert ulps(torch.tensor([-INF, 1.0]), torch.tensor([INF, 1.0])) == INF
