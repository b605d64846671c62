"""Patterns of public DeepSpeed clients (DeepSpeedExamples cifar/HelloDeepSpeed/offload_states,
DeepSpeed-Chat, transformers), written here, run on ``zerodp.deepspeed`` with 2 gloo ranks
(tests/clients_worker.py) or in-process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from distributed import run_worker

WORKER = Path(__file__).with_name("clients_worker.py")


#: the worker's scenario each 2-rank test asserts on
SCENARIO_OF = {
    "test_gathered_parameters_any_order_per_rank": "gathered_order",
    "test_gathered_parameters_before_initialize_pairs_persistent_ones_by_creation": "gathered_before_initialize",
    "test_ranks_passing_different_save_dirs_are_told_so": "save_dir_mismatch",
    "test_cifar_script_with_its_own_config_trains_at_every_stage_and_precision": "cifar",
    "test_deepspeed_chat_pattern": "chat",
    "test_offload_states_round_trip": "offload_round_trip",
}


@pytest.fixture(scope="module")
def launch(request: pytest.FixtureRequest) -> list[dict]:
    """One 2-rank launch of tests/clients_worker.py running the scenarios of the selected tests (in
    :data:`SCENARIO_OF`'s order); per rank, {scenario: result}."""
    selected = {i.originalname for i in request.session.items if getattr(i, "module", None) is request.module}
    names = [name for test, name in SCENARIO_OF.items() if test in selected]
    return run_worker(2, stages="3", scenarios=",".join(names), worker=WORKER)


@pytest.fixture
def scenario(request: pytest.FixtureRequest, launch: list[dict]) -> list[dict]:
    """The per-rank results of the scenario the requesting test asserts on (a rank's error named)."""
    name = SCENARIO_OF[request.node.originalname]
    for rank, r in enumerate(launch):
        assert name in r, f"scenario {name} did not run"
        assert r[name]["ok"], f"rank {rank}, {name}: {r[name].get('error')}"
    return [r[name] for r in launch]


def test_gathered_parameters_any_order_per_rank(scenario: list[dict]) -> None:
    r0, r1 = scenario
    assert r0["all_ds_ids"][0] == r0["all_ds_ids"][1] == r0["ds_ids"] == r1["ds_ids"]  # the same on every rank
    assert len(set(r0["ds_ids"])) == len(r0["ds_ids"])
    for r in (r0, r1):
        assert r["edits_ok"], "rank 0's edits did not reach every rank's parameters"
        assert r["state_dict_ok"]
        # weights (64 elements) are partitioned; biases (8, 2 <= threshold 10) are persistent (gathered)
        assert r["outside"]["layers.0.weight"] == "NOT_AVAILABLE" and r["outside"]["layers.0.bias"] == "AVAILABLE"
        assert set(r["inside"].values()) == {"AVAILABLE"}
        assert "the ranks passed different partitioned units" in r["refused"], r["refused"]


def test_gathered_parameters_before_initialize_pairs_persistent_ones_by_creation(scenario: list[dict]) -> None:
    """DS-Chat's from_pretrained at ZeRO-3 (transformers 4.x _initialize_missing_keys): a set-ordered
    list of partitioned and persistent parameters, modifier_rank=0, before initialize."""
    for r in scenario:
        assert r["orders_differ"] and r["plain"] == [f"layers.{i}.bias" for i in range(4)] + ["head.bias"]
        assert r["got"] == r["want"], r


def test_ranks_passing_different_save_dirs_are_told_so(scenario: list[dict]) -> None:
    for r in scenario:
        assert r["dir"].startswith("CheckpointError") and "the ranks passed different arguments" in r["dir"]
        assert "save_dir: rank 0 " in r["dir"] and "rank 1 " in r["dir"] and "run-1" in r["dir"], r["dir"]
        assert "tag: rank 0 'step0', rank 1 'step1'" in r["tag"], r["tag"]
        assert r["same_ok"]


TOL = {"fp32": 1e-4, "bf16": 5e-2, "fp16": 1e-2}


def test_cifar_script_with_its_own_config_trains_at_every_stage_and_precision(scenario: list[dict]) -> None:
    for r in scenario:
        for dtype, tol in TOL.items():
            base = r[f"0-{dtype}"]
            # DeepSpeed's adam_w_mode defaults to true: the config's Adam with weight_decay is AdamW
            assert base["optimizer"] == "AdamW" and base["weight_decay"] == 3e-7
            assert len(base["losses"]) == 16  # 2 epochs x 32 samples per rank in micro-batches of 4
            for stage in (1, 2, 3):
                got = r[f"{stage}-{dtype}"]["losses"]
                assert got == pytest.approx(base["losses"], rel=tol, abs=tol), (stage, dtype, got, base["losses"])


def test_deepspeed_chat_pattern(scenario: list[dict]) -> None:
    for r in scenario:
        base = r["0-FusedAdam"]
        for key, res in ((k, v) for k, v in r.items() if k != "ok"):
            assert res["losses"] == pytest.approx(base["losses"], rel=5e-2, abs=5e-2), key  # bf16
            assert res["optimizer"] == "Adam" and res["decoupled"], key  # torch's Adam in AdamW mode
            assert res["model_attr"] and res["head_attr"] and res["config_is_dict"], key
            assert res["tput_steps"] == 4 and res["save_ok"] and res["consolidated"], key
            assert res["excluded_frozen"], key
            assert res["hidden_auto"] == 160, key  # "auto" = 10 * hidden_size at initialize
        assert base["losses"][-1] < base["losses"][0]


def test_offload_states_round_trip(scenario: list[dict]) -> None:
    for r in scenario:
        assert r["on_host"] and r["states_equal"] and r["masters_equal"]
        assert "only cpu" in r["nvme"]
        assert r["losses_offload"] == r["losses_plain"]


# ---- the API surface, in-process ------------------------------------------------------------------------
def test_comm_is_deepspeeds_api_not_zerodps_internal_module() -> None:
    import torch.distributed

    from zerodp.deepspeed import comm as dist

    assert dist.__name__ == "zerodp.deepspeed.comm"
    assert dist.ReduceOp is torch.distributed.ReduceOp
    for name in (
        "init_distributed",
        "get_rank",
        "get_world_size",
        "get_local_rank",
        "barrier",
        "all_reduce",
        "all_gather_into_tensor",
        "reduce_scatter_tensor",
        "broadcast",
        "new_group",
    ):
        assert callable(getattr(dist, name)), name


def test_accelerator_cpu() -> None:
    from zerodp.deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    assert acc.device_name() == "cpu" and acc.device_name(0) == "cpu" and acc.communication_backend_name() == "gloo"
    assert acc.device_count() >= 1 and acc.is_available() and acc.is_bf16_supported() and acc.is_fp16_supported()
    acc.synchronize()
    now = acc.memory_allocated()
    assert now > 0 and acc.max_memory_allocated() >= now
    assert acc.total_memory() >= acc.available_memory() > 0
    assert torch.float32 in acc.supported_dtypes()


def test_fused_adam_is_torch_adam_with_deepspeeds_arguments() -> None:
    from zerodp.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    torch.manual_seed(0)
    w = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in w[:2]]
    opts = [
        FusedAdam([w[0]], lr=0.1, weight_decay=0.5),
        torch.optim.AdamW([ref[0]], lr=0.1, weight_decay=0.5),
        DeepSpeedCPUAdam([w[1]], lr=0.1, weight_decay=0.5, adamw_mode=False),
        torch.optim.Adam([ref[1]], lr=0.1, weight_decay=0.5),
    ]
    for _ in range(3):
        for p in (*w[:2], *ref):
            p.grad = torch.ones_like(p) * p.detach().sum().sign()
        for o in opts:
            o.step()
    assert torch.allclose(w[0], ref[0], atol=1e-6) and torch.allclose(w[1], ref[1], atol=1e-6)
    with pytest.raises(NotImplementedError, match="bias_correction=False"):
        FusedAdam([w[2]], bias_correction=False)


def test_small_modules_clients_import() -> None:
    import argparse

    import zerodp.deepspeed as deepspeed
    from zerodp.deepspeed import get_accelerator  # DS-Chat's main.py: from deepspeed import get_accelerator
    from zerodp.deepspeed.accelerator import get_accelerator as from_accelerator
    from zerodp.deepspeed.checkpoint.utils import clone_tensors_for_torch_save
    from zerodp.deepspeed.compression.helper import recursive_getattr, recursive_setattr
    from zerodp.deepspeed.moe.layer import MoE
    from zerodp.deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    from zerodp.deepspeed.runtime.lr_schedules import VALID_LR_SCHEDULES
    from zerodp.deepspeed.utils import logger

    assert get_accelerator is from_accelerator and get_accelerator().device_name() in ("cpu", "cuda")
    base = torch.arange(10.0)
    cloned = clone_tensors_for_torch_save({"a": [base[2:4]], "b": 3})
    assert cloned["b"] == 3 and torch.equal(cloned["a"][0], base[2:4])
    assert cloned["a"][0].untyped_storage().nbytes() == 8  # only its own elements
    groups = {"params": [torch.nn.Parameter(torch.ones(2))], "name": "p"}
    assert split_params_into_different_moe_groups_for_optimizer(groups) is groups
    expert = torch.nn.Parameter(torch.ones(2))
    expert.allreduce = False
    with pytest.raises(NotImplementedError, match="MoE is not implemented"):
        split_params_into_different_moe_groups_for_optimizer([{"params": [expert]}])
    with pytest.raises(NotImplementedError, match="mixture-of-experts"):
        MoE(hidden_size=4)
    m = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    recursive_setattr(m, "0.0", torch.nn.Identity())
    assert isinstance(recursive_getattr(m, "0.0"), torch.nn.Identity)
    assert "WarmupLR" in VALID_LR_SCHEDULES and logger.name == "DeepSpeed"
    args = deepspeed.add_config_arguments(argparse.ArgumentParser()).parse_args(["--deepspeed_config", "c.json"])
    assert args.deepspeed_config == "c.json" and args.deepspeed is False
    hf = deepspeed.HfDeepSpeedConfig({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}})
    assert hf.is_zero3() and not hf.is_zero2() and hf.is_offload() and hf.get_value("zero_optimization.stage") == 3
    assert hf.get_value("fp16.enabled", "x") == "x" and hf.is_false("zero_optimization.offload_param.missing") is False
