"""Stage-3 memory measured from live storage during training (issue 9).

All scenarios run in one launch of tests/stage3_memory_worker.py on 2 gloo ranks (see its docstring for
how saved tensors are measured). Each scenario also trains against plain PyTorch on the same global
batch, so freed-then-re-gathered storage is checked to hold the right values in backward.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from distributed import run_worker

WORKER = Path(__file__).with_name("stage3_memory_worker.py")
MLP = ["mlp_fp32_prefetch", "mlp_fp32_no_prefetch", "mlp_bf16_prefetch", "mlp_bf16_no_prefetch"]
#: op kind -> whether the op saves a view or a cast of the gathered weight (so a leak is measurable)
OPS = {
    "op_linear": True,
    "op_matmul_transposed": True,
    "op_embedding": False,
    "op_conv": False,
    "op_layer_norm": True,
    "op_bf16_cast": True,
    "op_float_cast_in_bf16_model": True,
}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_worker(2, stages="3", scenarios="all", worker=WORKER)


def _ok(results: list[dict], name: str) -> list[dict]:
    rows = [r[name] for r in results]
    for row in rows:
        assert row["ok"], row.get("error")
    return rows


@pytest.mark.parametrize("name", MLP)
def test_mlp_gathered_weights_after_forward_within_max_live(results: list[dict], name: str) -> None:
    for row in _ok(results, name):
        assert row["saved_param_tensors"] >= 9  # every Linear saved its transposed weight
        limit = row["max_live_bytes"] + row["persistent_bytes"]
        # without freeing, the saved views would keep every gathered weight alive: more than the limit
        assert row["if_not_freed"] > limit
        assert row["alive_after_forward"] <= limit
        if "no_prefetch" in name:
            assert row["alive_after_forward"] <= row["persistent_bytes"]
            assert row["prefetches"] == 0
        else:
            assert row["prefetches"] > 0
        assert row["alive_after_backward"] <= row["persistent_bytes"]
        # memory_report's gathered figure is the live storage (same measurement, engine side)
        assert row["report_gathered_after_forward"] == row["alive_after_forward"]
        assert 0 < row["peak_gathered_bytes"] <= limit + row["largest_unit_bytes"]
        if "fp32" in name:
            assert row["compared"] > 0 and row["param_diff_steps"] < 1e-3


@pytest.mark.parametrize("name", list(OPS))
def test_op_saved_parameter_storage_is_freed_after_forward(results: list[dict], name: str) -> None:
    for row in _ok(results, name):
        assert row["saved_total"] > 0
        if OPS[name]:
            assert row["saved_param_tensors"] > 0 and row["if_not_freed"] > 0
        assert row["alive_after_forward"] == 0
        assert row["alive_after_backward"] == 0
        if "compared" in row:
            assert row["compared"] > 0 and row["param_diff_steps"] < 1e-3


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_load_module_state_dict_after_initialize(results: list[dict], stage: int, precision: str) -> None:
    for row in _ok(results, "load_after_initialize"):
        case = row["cases"][f"stage{stage}_{precision}"]
        assert case["compared"] == 7
        assert case["loaded_exact"]  # module_state_dict (fp32 masters / shards) returns what was loaded
        assert case["step_equal"]  # one step == an engine built from those weights, bit for bit
        assert abs(case["fc1_after"] - 0.5) < 0.01  # the loaded 0.5 was not reverted by the step
        if precision == "fp32":
            assert case["torch_diff_steps"] < 1e-3  # and == plain torch
        assert case["strict_missing"] == "raised"
        # the plain torch call works where it can, else raises naming engine.load_module_state_dict
        if stage == 3 or precision == "bf16":
            assert case["plain"] == "raised"
        else:
            assert case["plain"] == "loaded" and case["plain_step_equal"]
