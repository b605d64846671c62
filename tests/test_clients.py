"""Patterns of public DeepSpeed clients (DeepSpeedExamples cifar/HelloDeepSpeed/offload_states,
DeepSpeed-Chat, transformers), written here, run on ``zerodp.deepspeed`` with 2 gloo ranks
(tests/clients_worker.py) or in-process."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from distributed import run_worker

WORKER = Path(__file__).with_name("clients_worker.py")


@functools.lru_cache(maxsize=None)
def scenario(name: str) -> list[dict]:
    results = run_worker(2, stages="3", scenarios=name, worker=WORKER)
    for rank, r in enumerate(results):
        assert r[name]["ok"], f"rank {rank}: {r[name].get('error')}"
    return [r[name] for r in results]


def test_gathered_parameters_any_order_per_rank() -> None:
    r0, r1 = scenario("gathered_order")
    assert r0["all_ds_ids"][0] == r0["all_ds_ids"][1] == r0["ds_ids"] == r1["ds_ids"]  # the same on every rank
    assert len(set(r0["ds_ids"])) == len(r0["ds_ids"])
    for r in (r0, r1):
        assert r["edits_ok"], "rank 0's edits did not reach every rank's parameters"
        assert r["state_dict_ok"]
        # weights (64 elements) are partitioned; biases (8, 2 <= threshold 10) are persistent (gathered)
        assert r["outside"]["layers.0.weight"] == "NOT_AVAILABLE" and r["outside"]["layers.0.bias"] == "AVAILABLE"
        assert set(r["inside"].values()) == {"AVAILABLE"}
        assert "the ranks passed different partitioned units" in r["refused"], r["refused"]


def test_ranks_passing_different_save_dirs_are_told_so() -> None:
    for r in scenario("save_dir_mismatch"):
        assert r["dir"].startswith("CheckpointError") and "the ranks passed different arguments" in r["dir"]
        assert "save_dir: rank 0 " in r["dir"] and "rank 1 " in r["dir"] and "run-1" in r["dir"], r["dir"]
        assert "tag: rank 0 'step0', rank 1 'step1'" in r["tag"], r["tag"]
        assert r["same_ok"]


TOL = {"fp32": 1e-4, "bf16": 5e-2, "fp16": 1e-2}


def test_cifar_script_with_its_own_config_trains_at_every_stage_and_precision() -> None:
    for r in scenario("cifar"):
        for dtype, tol in TOL.items():
            base = r[f"0-{dtype}"]
            # DeepSpeed's adam_w_mode defaults to true: the config's Adam with weight_decay is AdamW
            assert base["optimizer"] == "AdamW" and base["weight_decay"] == 3e-7
            assert len(base["losses"]) == 8
            for stage in (1, 2, 3):
                got = r[f"{stage}-{dtype}"]["losses"]
                assert got == pytest.approx(base["losses"], rel=tol, abs=tol), (stage, dtype, got, base["losses"])


def test_deepspeed_chat_pattern() -> None:
    for r in scenario("chat"):
        base = r["0-FusedAdam"]
        for key, res in ((k, v) for k, v in r.items() if k != "ok"):
            assert res["losses"] == pytest.approx(base["losses"], rel=5e-2, abs=5e-2), key  # bf16
            assert res["optimizer"] == "Adam" and res["decoupled"], key  # torch's Adam in AdamW mode
            assert res["model_attr"] and res["head_attr"] and res["config_is_dict"], key
            assert res["tput_steps"] == 4 and res["save_ok"] and res["consolidated"], key
            assert res["hidden_auto"] == 160, key  # "auto" = 10 * hidden_size at initialize
        assert base["losses"][-1] < base["losses"][0]


def test_offload_states_round_trip() -> None:
    for r in scenario("offload_round_trip"):
        assert r["on_host"] and r["states_equal"] and r["masters_equal"]
        assert "only cpu" in r["nvme"]
        assert r["losses_offload"] == r["losses_plain"]
