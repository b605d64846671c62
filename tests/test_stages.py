"""Stages 0-2 at world sizes 1-4 against a single-process plain-PyTorch reference (fp32).

One torchrun launch per world size runs every scenario at every stage (tests/dist_worker.py); each
test below asserts on one (world size, stage, scenario) result on every rank.
"""

from __future__ import annotations

import pytest

from distributed import run_worker

WORLD_SIZES = (1, 2, 3, 4)
STAGES = (0, 1, 2)
TRAINING = ("adam_buckets", "adamw_one_bucket", "frozen", "no_grad_some_steps", "param_groups",
            "grad_accumulation", "clipping", "no_overlap_noncontiguous", "tied_weights")

_cache: dict[int, list[dict]] = {}


def results(world_size: int) -> list[dict]:
    if world_size not in _cache:
        _cache[world_size] = run_worker(world_size)
    return _cache[world_size]


def per_rank(world_size: int, stage: int, name: str) -> list[dict]:
    out = [r[f"{name}/stage{stage}"] for r in results(world_size)]
    for r, res in enumerate(out):
        assert res["ok"], f"rank {r} raised:\n{res.get('error')}"
    return out


@pytest.mark.parametrize("name", TRAINING)
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_matches_reference(world_size: int, stage: int, name: str) -> None:
    for r, res in enumerate(per_rank(world_size, stage, name)):
        # err <= 1: |zerodp - torch| <= 1e-6 + 1e-5 |torch| on every loss and every parameter element
        assert res["loss_err"] <= 1.0, f"rank {r}: loss differs from reference (err {res['loss_err']})"
        assert res["param_err"] <= 1.0, f"rank {r}: parameters differ from reference (err {res['param_err']})"
        assert res["moved"] > 1e-3, "training did not change the parameters: the comparison is vacuous"
        assert res["steps"] > 0
        if name == "clipping":
            assert res["norm_err"] <= 1.0, "global grad norm differs from clip_grad_norm_"


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_memory_report_matches_formula(world_size: int, stage: int) -> None:
    for res in per_rank(world_size, stage, "reports"):
        n, psi, padded, owned = res["world"], res["psi"], res["padded"], res["owned"]
        m, f = res["measured"], res["formula"]
        assert res["numel"] == psi
        # measured from the tensors held: fp32 parameters 4 B/elem, replicated at stages 0-2
        assert m["parameters"] == 4 * padded
        assert f["parameters"] == 4 * psi
        # gradients: full at stages 0-1, the owned partition only at stage 2
        assert m["gradients"] == (4 * owned if stage == 2 else 4 * padded)
        assert f["gradients"] == pytest.approx(4 * psi / (n if stage == 2 else 1))
        # Adam: exp_avg + exp_avg_sq (8 B/elem) on the owned elements (all at stage 0)
        owned_real = res["optimizer_state_elements"] // 2
        assert owned_real <= (padded if stage == 0 else owned)
        assert f["optimizer_states"] == pytest.approx(8 * psi / (1 if stage == 0 else n))
        # the padding is the only difference from the formula
        assert m["optimizer_states"] - 4 * res["n_states"] == 8 * owned_real  # + one fp32 step count per tensor
        assert abs(m["parameters"] + m["gradients"] - f["parameters"] - f["gradients"]) <= 8 * (padded - psi)
        assert m["master_weights"] == 0 and m["comm_buffers"] == 0  # nothing in flight after step()
        assert res["peak"]["gradients+buffers"] >= m["gradients"]


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_comm_report_is_two_psi(world_size: int, stage: int) -> None:
    for res in per_rank(world_size, stage, "reports"):
        psi, padded, steps, n = res["psi"], res["padded"], res["steps"], res["world"]
        assert steps == 3
        assert res["expected_per_step"] == 2 * psi
        # 2 Psi per rank per step, exactly, up to the padding to multiples of N
        assert res["elements_per_step"] == 2 * padded
        assert padded - psi < n * res["n_buckets"]
        ops = res["ops"]
        if stage == 0:
            assert ops["all_reduce/gradients"][1] == steps * padded  # counted twice: 2 Psi
            assert "reduce_scatter/gradients" not in ops
        else:
            assert ops["reduce_scatter/gradients"][1] == steps * padded
            assert ops["all_gather/parameters"][1] == steps * padded
            assert ops["reduce_scatter/gradients"][0] == steps * res["n_buckets"]
        assert ops.get("all_reduce/grad_presence", [0])[0] == (steps if n > 1 else 0)
