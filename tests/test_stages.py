"""Stages 0-3 at world sizes 1-4 (4: the scenarios of :data:`AT_FOUR`) against a single-process plain-PyTorch
reference (fp32).

One torchrun launch per world size runs every scenario at every stage (tests/dist_worker.py); each
test below asserts on one (world size, stage, scenario) result on every rank.

The device comes from ``ZERODP_TEST_DEVICE`` (tests/devices.py; the reference runs on the same
device). With ``cuda``, only :data:`ON_CUDA` scenarios run (the others skip naming the reason), and
world sizes above the number of GPUs skip.
"""

from __future__ import annotations

import re

import pytest

from devices import device_type, too_many_ranks
from distributed import run_worker, selected_runs
from zerodp.runtime.reducer import DIRECT_BACKWARD_MESSAGE

WORLD_SIZES = (1, 2, 3, 4)
STAGES = (0, 1, 2, 3)
TRAINING = (
    "adam_buckets",
    "adamw_one_bucket",
    "frozen",
    "no_grad_some_steps",
    "param_groups",
    "grad_accumulation",
    "clipping",
    "no_overlap_noncontiguous",
    "tied_weights",
    # written for stage 3 (parameters partitioned); the same answers are expected at 0-2
    "gpt_tied",
    "block_called_twice",
    "parent_reads_child_weight",
    "registered_external",
    "structured_outputs",
    "gathered_edit_modifier_rank0",
    "eval_generation_between_steps",
)

#: scenarios written device-generic (tests/dist_worker.py compare_training: model, batches and the
#: reference on the test device); the rest build or read tensors on the CPU themselves
ON_CUDA = (
    "adam_buckets",
    "adamw_one_bucket",
    "frozen",
    "param_groups",
    "grad_accumulation",
    "clipping",
    "no_overlap_noncontiguous",
    "tied_weights",
    "gpt_tied",
    "bf16_twenty_steps",
    "fp16_overflow_skips_everywhere",
)

#: the scenarios world size 4 runs. No code path is particular to 4 ranks: several ranks with even shards
#: are world size 2's, uneven shards (padding) 3's, and the other scenarios vary how the model's forward
#: reads its parameters, which the world size does not change. 4 keeps the basic training, clipping's global
#: norm, tied weights, the memory and communication reports' formulas (padding over 4 ranks), building under
#: Init, and one rank's fp16 overflow skipping the step on all four.
AT_FOUR = ("adam_buckets", "clipping", "tied_weights", "reports", "built_under_init", "fp16_overflow_skips_everywhere")


def worlds_for(name: str) -> tuple[int, ...]:
    """The world sizes that run scenario ``name`` (4 only for :data:`AT_FOUR`)."""
    return WORLD_SIZES if name in AT_FOUR else tuple(w for w in WORLD_SIZES if w != 4)


#: scenario each test function asserts on (test_matches_reference: its ``name`` parameter)
SCENARIO_OF = {
    "test_memory_report_matches_formula": "reports",
    "test_comm_report_is_two_psi": "reports",
    "test_stage3_memory_is_sixteen_psi_over_n": "reports@3",
    "test_stage3_comm_is_three_psi": "reports@3",
    "test_stage3_built_under_init_holds_only_its_partition": "built_under_init@3",
    "test_bf16_matches_mixed_precision_reference": "bf16_twenty_steps",
    "test_fp16_overflow_on_one_rank_skips_on_all": "fp16_overflow_skips_everywhere",
    "test_warmup_decay_lr_follows_formula": "warmup_decay_lr",
    "test_refusals_on_every_rank": "misuse",
}


@pytest.fixture(scope="module")
def launches(request: pytest.FixtureRequest) -> dict[int, list[dict]]:
    """One torchrun launch per world size, running only the stages and scenarios the selected tests use."""
    runs = selected_runs(request.session.items, request.module, SCENARIO_OF)
    out = {}
    for ws, (stages, names) in runs.items():
        if device_type() == "cuda":
            names = ",".join(n for n in names.split(",") if n in ON_CUDA)
        if too_many_ranks(ws) is None and names:
            out[ws] = run_worker(ws, stages, names)
    return out


def skip_off_device(world_size: int, name: str) -> None:
    """Skip, naming the reason, what the test device cannot run (see the module docstring)."""
    reason = too_many_ranks(world_size)
    if reason is not None:
        pytest.skip(reason)
    if device_type() == "cuda" and name not in ON_CUDA:
        pytest.skip(f"scenario {name} is not written device-generic yet (ZERODP_TEST_DEVICE=cuda)")


def per_rank(launches: dict[int, list[dict]], world_size: int, stage: int, name: str) -> list[dict]:
    skip_off_device(world_size, name)
    out = [r[f"{name}/stage{stage}"] for r in launches[world_size]]
    for r, res in enumerate(out):
        assert res["ok"], f"rank {r} raised:\n{res.get('error')}"
    return out


@pytest.mark.parametrize(
    "world_size,stage,name", [(w, s, n) for w in WORLD_SIZES for s in STAGES for n in TRAINING if w in worlds_for(n)]
)
def test_matches_reference(launches: dict, world_size: int, stage: int, name: str) -> None:
    for r, res in enumerate(per_rank(launches, world_size, stage, name)):
        # err <= 1: |zerodp - torch| <= 1e-6 + 1e-5 |torch| on every loss and every parameter element
        assert res["loss_err"] <= 1.0, f"rank {r}: loss differs from reference (err {res['loss_err']})"
        assert res["param_err"] <= 1.0, f"rank {r}: parameters differ from reference (err {res['param_err']})"
        assert res["moved"] > 1e-3, "training did not change the parameters: the comparison is vacuous"
        assert res["steps"] > 0
        assert res["compared_params"] > 0
        if name == "clipping":
            # relative error of the global norm against clip_grad_norm_ on the whole model
            assert res["norm_err"] <= 1e-6, f"global grad norm differs from clip_grad_norm_ ({res['norm_err']})"
        if name == "gathered_edit_modifier_rank0":
            assert res["edit_err"] <= 1.0, "rank 0's edit was not the one kept on every rank"
        if name == "eval_generation_between_steps":
            # 5 new tokens compared after each of the 3 steps
            assert sum(v for k, v in res.items() if k.startswith("generated_tokens_")) == 15
            assert sum(k.startswith("same_tokens_") for k in res) == 3
            for k, v in res.items():
                if k.startswith("same_tokens_"):
                    assert v, f"{k}: greedy generation differs from the reference model's"
                if k.startswith("gathered_after_eval_"):
                    assert v == 0, f"{k}: {v} elements still gathered after the eval loop"
        if stage == 3:
            # nothing stays gathered after training except the persistent (small) parameters
            assert res["live_after"] == res["persistent_elements"]
            # the recorded trace was used: all-gathers were issued ahead of use and then consumed
            assert res["prefetches"] > 0, "prefetch never issued a collective ahead of use"
            assert res["prefetch_hits"] > 0, "no fetch was served by a prefetch"
            assert res["recordings"] >= 1
            if name == "no_grad_some_steps":
                # the module order changes every step: the trace is invalidated and re-recorded
                assert res["recordings"] >= 2


@pytest.mark.parametrize("stage", (0, 1, 2))
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_memory_report_matches_formula(launches: dict, world_size: int, stage: int) -> None:
    for res in per_rank(launches, world_size, stage, "reports"):
        n, psi, k = res["world"], res["psi"], res["n_params"]
        m, f = res["measured"], res["formula"]
        assert res["numel"] == psi
        # padding: each bucket is padded to a multiple of N, and there is at most one bucket per parameter
        pad = (n - 1) * k
        # the report's "measured" bytes are the live storage (distinct untyped storages, measured in the
        # worker from the module's parameters, their .grad and the optimizer's state tensors)
        assert m["parameters"] == res["live_param_bytes"]
        assert m["optimizer_states"] == res["live_state_bytes"]
        assert m["master_weights"] == 0 and m["comm_buffers"] == 0  # fp32; nothing in flight after step()
        # the paper's formula (4 Psi + 4 Psi + 8 Psi, the partitioned ones over N) predicts live storage
        # up to the padding: parameters replicated at stages 0-2
        assert 0 <= res["live_param_bytes"] - f["parameters"] <= 4 * pad
        if stage < 2:  # .grad views one full flat gradient storage
            assert m["gradients"] == res["live_grad_bytes"]
            assert 0 <= res["live_grad_bytes"] - f["gradients"] <= 4 * pad
        else:  # no .grad is kept; the owned partition is 1/N of the padded buckets
            assert res["live_grad_bytes"] == 0
            assert abs(m["gradients"] - f["gradients"]) <= 4 * k
        # Adam: exp_avg + exp_avg_sq on the owned elements (all at stage 0), plus a 4-byte step
        # count per state; never_used has no state; a rank owns up to k padding elements at 1-2
        states = res["live_state_bytes"] - 4 * res["n_states"]
        lack = 8 * res["no_state_elements"]
        assert f["optimizer_states"] - lack - (0 if stage == 0 else 8 * k) <= states
        assert states <= f["optimizer_states"] + (0 if stage == 0 else 8 * k)
        assert res["peak"]["gradients+buffers"] >= m["gradients"]


@pytest.mark.parametrize("stage", (0, 1, 2))
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_comm_report_is_two_psi(launches: dict, world_size: int, stage: int) -> None:
    for res in per_rank(launches, world_size, stage, "reports"):
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
        if stage >= 1 and n > 1:  # every rank has the same gradients: the norm rides on the flags
            assert "all_reduce/grad_norm" not in ops, ops
            assert ops["all_reduce/grad_presence"][1] == steps * (res["n_slots"] + 1)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_stage3_memory_is_sixteen_psi_over_n(launches: dict, world_size: int) -> None:
    for res in per_rank(launches, world_size, 3, "reports"):
        n, psi, m, f = res["world"], res["psi"], res["measured"], res["formula"]
        persistent = res["persistent"]
        # formula: 4 + 4 + 8 bytes per element, each divided by N
        assert f["parameters"] == pytest.approx(4 * psi / n)
        assert f["gradients"] == pytest.approx(4 * psi / n)
        assert f["optimizer_states"] == pytest.approx(8 * psi / n)
        # measured: the shards, plus the persistent unit kept gathered, nothing else
        assert m["parameters"] == 4 * res["shards"] + 4 * persistent
        assert m["gradients"] == 4 * res["shards"]
        assert m["optimizer_states"] - 4 * res["n_states"] == 8 * (res["optimizer_state_elements"] // 2)
        assert res["optimizer_state_elements"] // 2 <= res["shards"]
        # shards are 1/N of the padded units: at most N-1 padding elements per unit
        assert res["shards"] * n - res["padded"] >= 0
        assert res["shards"] * n == res["padded"]
        # gathered parameters never exceeded what was needed at once (bounded by the model size)
        assert 0 < res["peak_gathered"] <= 4 * res["padded"]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_stage3_comm_is_three_psi(launches: dict, world_size: int) -> None:
    for res in per_rank(launches, world_size, 3, "reports"):
        psi, padded, steps, p = res["psi"], res["padded"], res["steps"], res["persistent"]
        sharded = padded - p
        assert res["expected_per_step"] == 3 * psi
        # all-gather in forward + all-gather in backward + reduce-scatter, per sharded unit;
        # the persistent unit: reduce-scatter + one all-gather after the step
        assert res["elements_per_step"] == 3 * sharded + 2 * p
        assert res["ops"]["reduce_scatter/gradients"][1] == steps * padded
        assert res["ops"]["all_gather/parameters"][1] == steps * (2 * sharded + p)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_stage3_built_under_init_holds_only_its_partition(launches: dict, world_size: int) -> None:
    for res in per_rank(launches, world_size, 3, "built_under_init"):
        assert res["loss_err"] <= 1.0 and res["param_err"] <= 1.0, res
        assert res["moved"] > 1e-3
        # right after construction under Init only the small (persistent-size) parameters are held:
        # 64-element biases x4 + 5 (out.bias) + 5 (scale)
        assert res["held_after_init"] == 4 * 64 + 5 + 5
        assert res["held_after_init"] < res["full_elements"] / 10
        # after training: the partition plus the persistent parameters, nothing gathered
        assert res["params_measured"] == 4 * (res["shard_elements"] + res["persistent_elements"])
        # the gathered peak never exceeded the configured live bound (elements x 4 bytes)
        assert 0 < res["peak_gathered_bytes"] <= 4 * res["max_live"]
        if world_size > 1:
            assert res["shard_elements"] <= res["full_elements"] / world_size + 8 * world_size


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("world_size", worlds_for("bf16_twenty_steps"))
def test_bf16_matches_mixed_precision_reference(launches: dict, world_size: int, stage: int) -> None:
    for res in per_rank(launches, world_size, stage, "bf16_twenty_steps"):
        assert res["param_dtypes"] == ["torch.bfloat16"]
        assert res["steps"] == 20 and res["skipped"] == 0
        if world_size == 1:  # same arithmetic, same order: bit-identical to the reference
            assert res["param_rel_err"] == 0.0 and res["loss_rel_err"] == 0.0
        # bf16 has 8 significant bits (relative spacing 2^-8 = 0.4%). Across ranks the gradient sums
        # round differently; after 20 Adam steps each parameter tensor stays within ~4 bf16 ulps
        # (norm-wise) of the single-process reference (measured: <= 0.8%).
        assert res["param_norm_err"] <= 0.016, res["param_norm_err"]
        assert res["loss_rel_err"] <= 0.005, res["loss_rel_err"]
        assert res["moved"] > 0.05
        # fp32 master copy of exactly the owned elements: 4 bytes each
        assert res["master_bytes"] == 4 * res["owned_elements"]
        # gradients in bf16 (2 bytes): full at stages 0-1, the owned partition at 2-3 (no
        # accumulation here, so no fp32 partition is needed)
        assert res["grad_bytes"] == 2 * res["grad_elements"]


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_fp16_overflow_on_one_rank_skips_on_all(launches: dict, world_size: int, stage: int) -> None:
    for res in per_rank(launches, world_size, stage, "fp16_overflow_skips_everywhere"):
        assert res["param_dtypes"] == ["torch.float16"]
        assert res["ref_skipped"], "the reference did not overflow: the scenario tests nothing"
        assert res["skipped"] == 1
        assert res["bit_identical_after_skip"], "parameters changed on a skipped step"
        assert res["opt_state_identical"], "optimizer states changed on a skipped step"
        # keyed by (parameter name, state key): every owned piece's two Adam states were compared
        assert res["opt_state_compared"] == res["opt_state_expected"] > 0
        assert res["scale_before"] == 256.0 and res["scale_after"] == 128.0
        if world_size == 1:
            assert res["param_rel_err"] == 0.0
        assert res["param_norm_err"] <= 0.004, res["param_norm_err"]  # fp16: 2^-11 spacing
        assert res["loss_rel_err"] <= 0.001


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("world_size", worlds_for("warmup_decay_lr"))
def test_warmup_decay_lr_follows_formula(launches: dict, world_size: int, stage: int) -> None:
    for res in per_rank(launches, world_size, stage, "warmup_decay_lr"):
        assert res["lr_err"] <= 1e-12
        assert res["loss_err"] <= 1.0 and res["param_err"] <= 1.0


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("world_size", (2, 4))
def test_refusals_on_every_rank(launches: dict, world_size: int, stage: int) -> None:
    """tests/test_misuse.py's refusals (a second initialize, loss.backward()) on every rank alike, without a
    hang."""
    res = per_rank(launches, world_size, stage, "misuse")
    assert len(res) == world_size
    for r in res:
        assert re.search(f"already wrapped by an engine \\(ZeRO stage {stage}; parameter", r["rewrap"]), r
        assert r["direct_backward"] == DIRECT_BACKWARD_MESSAGE, r
