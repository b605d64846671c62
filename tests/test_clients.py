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
