"""The ZeRO paper's model-state and traffic formulas (zerodp.runtime.accounting), section 5 and 7."""

from __future__ import annotations

import pytest

from zerodp.runtime.accounting import (
    FP32_ADAM,
    MIXED_PRECISION_ADAM,
    BytesPerElement,
    comm_elements_per_step,
    estimate_table,
    human_bytes,
    model_state_bytes,
)
from zerodp.runtime.comm import CommLedger


@pytest.mark.parametrize("n", [1, 2, 8, 64])
def test_mixed_precision_adam_is_2_2_12_psi(n: int) -> None:
    psi = 1_000_000
    total = {s: sum(model_state_bytes(s, psi, n, MIXED_PRECISION_ADAM).values()) for s in range(4)}
    assert total[0] == pytest.approx((2 + 2 + 12) * psi)
    assert total[1] == pytest.approx(2 * psi + 2 * psi + 12 * psi / n)
    assert total[2] == pytest.approx(2 * psi + (2 + 12) * psi / n)
    assert total[3] == pytest.approx((2 + 2 + 12) * psi / n)
    assert MIXED_PRECISION_ADAM.k == 12 and FP32_ADAM.k == 8


def test_paper_figure1_example() -> None:
    """Psi = 7.5 B, N_d = 64: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB per device (paper figure 1)."""
    got = [human_bytes(sum(model_state_bytes(s, 7_500_000_000, 64, MIXED_PRECISION_ADAM).values())) for s in range(4)]
    assert got == ["120.0 GB", "31.4 GB", "16.6 GB", "1.9 GB"]


def test_categories_partition_by_stage() -> None:
    b = BytesPerElement(param=2, grad=4, optimizer=8, master=4)  # fp32 gradient accumulation
    psi, n = 1000, 4
    s1 = model_state_bytes(1, psi, n, b)
    assert s1 == {
        "parameters": 2000,
        "gradients": 4000,
        "optimizer_states": 2000,
        "master_weights": 1000,
        "comm_buffers": 0.0,
    }
    s2 = model_state_bytes(2, psi, n, b)
    assert s2["gradients"] == 1000 and s2["parameters"] == 2000
    assert model_state_bytes(3, psi, n, b)["parameters"] == 500
    assert sum(model_state_bytes(0, psi, 1, b).values()) == 18 * psi  # 18 Psi with an fp32 gradient buffer


def test_traffic_is_2_psi_or_3_psi_and_ledger_counts_all_reduce_twice() -> None:
    assert [comm_elements_per_step(s, 10) for s in range(4)] == [20, 20, 20, 30]
    # K = 3 micro-steps per optimizer step: stages 0-1 reduce once, stages 2-3 every micro-step
    assert [comm_elements_per_step(s, 10, 3) for s in range(4)] == [20, 20, 40, 90]
    with pytest.raises(ValueError, match="grad_accum must be >= 1, got 0"):
        comm_elements_per_step(2, 10, 0)
    ledger = CommLedger()
    ledger.record("all_reduce", 10, 4, "gradients")
    ledger.record("reduce_scatter", 10, 2, "gradients")
    ledger.record("all_gather", 10, 2, "parameters")
    assert ledger.traffic_elements() == 40 and ledger.traffic_elements("gradients") == 30
    assert [(r.op, r.count, r.bytes) for r in ledger.records()] == [
        ("all_gather", 1, 20),
        ("all_reduce", 1, 40),
        ("reduce_scatter", 1, 20),
    ]


def test_refusals_name_what_is_allowed() -> None:
    with pytest.raises(ValueError, match=r"stage must be one of \(0, 1, 2, 3\), got 4"):
        model_state_bytes(4, 10, 1, FP32_ADAM)
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        model_state_bytes(1, 10, 0, FP32_ADAM)
    with pytest.raises(ValueError, match="stage must be one of"):
        comm_elements_per_step(-1, 10)


def test_estimate_table_rows() -> None:
    table = estimate_table(7_500_000_000, 64).splitlines()
    assert "K = 12" in table[0] and len(table) == 6
    assert "120.0 GB" in table[2] and "2 Psi" in table[2]
    assert "1.9 GB" in table[5] and "3 Psi" in table[5]
