"""Sharded checkpoints: exact resume, resharding across world sizes and stages, consolidation, crash
safety, and refusal of checkpoints that do not fit.

Multi-rank tests: three torchrun launches of tests/ckpt_worker.py share one checkpoint directory, in
this order: world 4 saves at stage 2; world 2 runs exact resume at stages 0-3 in fp32 (stage 3 with tied
weights, a frozen parameter and a buffer) and in bf16 (tied, with a config LR schedule; its checkpoint
also consolidated), and in fp16 at stage 2 (a skipped step before the save, dynamic loss scale, a torch
StepLR), saves at stages 1 and 3, loads world 4's checkpoint at stages 0 and 3, consolidates a
tied-weight model at stages 2 and 3, has loads refused at stage 3 and simulates a crash; world 3 loads
world 2's stage-1 checkpoint at stage 2 and its stage-3 checkpoint at stage 1. Single-rank tests run in
this process (a 1-rank gloo group) or in a subprocess that is killed mid-save.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn

import zerodp
from ckpt_worker import TiedLM, Zoo, zoo_groups
from devices import skip_beyond_devices
from distributed import run_worker
from zerodp.checkpoint import CheckpointError, consolidate, load_full_state_dict

WORKER = Path(__file__).with_name("ckpt_worker.py")
#: stages of the mid-run freeze round trip, and the offloaded ones (offload_optimizer needs stage >= 1;
#: "offload": device cpu, "nvme": device nvme)
FREEZE_CASES = [(s, "") for s in (0, 1, 2, 3)] + [(s, "offload") for s in (1, 2, 3)] + [(s, "nvme") for s in (2, 3)]
#: (world size, scenarios), run in this order: later launches load earlier launches' checkpoints. World
#: size 2's also runs the mid-run freeze round trips (test_checkpoint_saved_while_frozen_midrun).
LAUNCHES = (
    (4, "reshard_save@2"),
    (
        2,
        "exact_resume@0,exact_resume@1,exact_resume@2,exact_resume@3:tied,exact_resume@0:bf16+tied,"
        "exact_resume@1:bf16+tied,exact_resume@2:bf16+tied,exact_resume@3:bf16+tied,exact_resume@2:fp16,"
        "reshard_save@1,reshard_save@3,reshard_load@0:w4-s2,reshard_load@3:w4-s2,consolidate_tied@2,"
        "consolidate_tied@3,refuse_mismatch@3,crash_safety@1,"
        + ",".join(f"freeze_midrun@{s}" + (f":{a}" if a else "") for s, a in FREEZE_CASES),
    ),
    (3, "reshard_load@2:w2-s1,reshard_load@1:w2-s3"),
)


# ---- multi-rank ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[dict]]:
    ckpt_dir = tmp_path_factory.mktemp("ckpt")
    out: dict[int, list[dict]] = {}
    for world_size, scenarios in LAUNCHES:
        out[world_size] = run_worker(
            world_size, "0", scenarios, worker=WORKER, extra_args=["--ckpt-dir", str(ckpt_dir)]
        )
    return out


def per_rank(launches: dict[int, list[dict]], world_size: int, key: str) -> list[dict]:
    out = [r[key] for r in launches[world_size]]
    for r, res in enumerate(out):
        assert res["ok"], f"rank {r} raised:\n{res.get('error')}"
    return out


def exact_resume_key(stage: int, precision: str = "fp32") -> str:
    if precision == "bf16":
        return f"exact_resume/stage{stage}:bf16+tied"
    if precision == "fp16":
        return f"exact_resume/stage{stage}:fp16"
    return "exact_resume/stage3:tied" if stage == 3 else f"exact_resume/stage{stage}"


EXACT_RESUME_CASES = [(s, "fp32") for s in (0, 1, 2, 3)] + [(s, "bf16") for s in (0, 1, 2, 3)] + [(2, "fp16")]


@pytest.mark.parametrize("stage,precision", EXACT_RESUME_CASES)
def test_exact_resume(request: pytest.FixtureRequest, stage: int, precision: str) -> None:
    skip_beyond_devices(2)  # its engines follow ZERODP_TEST_DEVICE (tests/devices.py): skip before launching
    launches = request.getfixturevalue("launches")
    check_exact_resume(per_rank(launches, 2, exact_resume_key(stage, precision)), stage, precision)


#: the exact resume on ``ZERODP_TEST_DEVICE`` (tests/devices.py) at world size 1, so that one GPU runs it
#: (tools/gpu_check.sh); on the CPU it is the same check at one rank
DEVICE_EXACT_RESUME_CASES = [(s, "fp32") for s in (0, 1, 2, 3)] + [(1, "bf16"), (3, "bf16"), (2, "fp16")]


@pytest.fixture(scope="module")
def device_launch(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    specs = [
        "exact_resume@" + exact_resume_key(stage, precision).split("/stage")[1]
        for stage, precision in DEVICE_EXACT_RESUME_CASES
    ]
    return run_worker(
        1, "0", ",".join(specs), worker=WORKER, extra_args=["--ckpt-dir", str(tmp_path_factory.mktemp("ckpt1"))]
    )


@pytest.mark.parametrize("stage,precision", DEVICE_EXACT_RESUME_CASES)
def test_exact_resume_on_the_test_device(request: pytest.FixtureRequest, stage: int, precision: str) -> None:
    skip_beyond_devices(1)
    results = [r[exact_resume_key(stage, precision)] for r in request.getfixturevalue("device_launch")]
    for r, res in enumerate(results):
        assert res["ok"], f"rank {r} raised:\n{res.get('error')}"
    check_exact_resume(results, stage, precision)


def check_exact_resume(results: list[dict], stage: int, precision: str) -> None:
    """A fresh engine loading the checkpoint saved after step 3 repeats steps 4-6 bit-identically."""
    for r, res in enumerate(results):
        assert res["path"] == res["saved_at"] and res["latest"] == "global_step3"
        assert res["client_state"] == {"step": 3, "data": [1, 2.5, "x"]}
        assert res["steps_after_load"] == [3, 6]  # global_steps, micro_steps (accumulation 2)
        assert res["rng_restored"], f"rank {r}: torch CPU RNG state not restored"
        assert res["lrs_equal"], f"rank {r}: scheduler-changed lr not restored"
        assert res["losses_equal"], f"rank {r}: losses after resume are not bit-identical"
        assert res["params_equal"] and res["model_params_equal"], f"rank {r}: parameters not bit-identical"
        assert res["pieces_equal"], f"rank {r}: optimizer pieces (module dtype and fp32 masters) differ"
        assert res["states_equal"], f"rank {r}: optimizer state not bit-identical"
        assert res["param_dtypes"] == [
            {"fp32": "torch.float32", "bf16": "torch.bfloat16", "fp16": "torch.float16"}[precision]
        ]
        assert res["pieces_with_state"] > 0
        # module_state_dict(): full fp32 values keyed and shaped as the plain model's state_dict (stage 3:
        # gathered to read, then released: only the persistent unit stays gathered)
        assert res["state_dict_like_plain"]
        assert res["gathered_after_state_dict"]["live"] == res["gathered_after_state_dict"]["persistent"]
        assert res["gathered_end"]["live"] == res["gathered_end"]["persistent"]
        if stage == 3:
            assert res["gathered_end"]["persistent"] > 0  # 'scale' and 'never_used'
    # 'never_used' never gets a gradient: its piece(s) have no optimizer state after loading either
    assert sum(res["pieces_without_state"] for res in results) >= 1
    if precision != "fp32":
        check_mixed_precision_resume(results, precision)


def check_mixed_precision_resume(results: list[dict], precision: str) -> None:
    module_dtype = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}[precision]
    for r, res in enumerate(results):
        # meta.json records the precision (pieces are fp32 values, the module's dtype per tensor)
        assert res["meta"]["precision"] == precision and res["meta"]["dtype"] == "float32"
        assert res["meta_param_dtypes"] == [module_dtype.removeprefix("torch.")]
        assert res["module_dtypes"] == [module_dtype]
        # module_state_dict() at the save: trained parameters are the fp32 masters (which are not all
        # representable in the module dtype, so reading the module's values would differ); frozen
        # parameters and buffers keep the module dtype
        assert res["masters_differ_from_module"], "vacuous: every master is representable in the module dtype"
        assert res["state_dict_is_masters"], f"rank {r}: module_state_dict() is not the fp32 masters"
        assert res["state_dict_rest_dtypes"] == ([module_dtype] if precision == "bf16" else [])  # tied: frozen, buffer
        # consolidate(): full fp32 state dict equal to the masters and to module_state_dict()
        assert res["consolidated_keys_equal"] and res["consolidated_dtypes"] == ["torch.float32"]
        assert res["consolidated_is_masters"] and res["consolidated_equals_state_dict"]
        # load: masters get the saved fp32 values, the module's pieces are them rounded
        assert res["params_cast_from_masters"] and res["loaded_state_dict_equal"]
        assert res["after_load"] == res["at_save"], f"rank {r}: scheduler/loss scaler/skipped steps not restored"
        assert res["scheduler_equal"] and res["scaler_equal"], f"rank {r}: states diverged after resume"
        if precision == "bf16":
            assert res["meta_scheduler_type"] == "WarmupCosineLR" and res["meta_scheduler_epoch"] == 3
            assert res["meta"]["loss_scaler"] is None and res["at_save"]["skipped"] == 0
        else:
            # step 1 overflowed on the last rank and was skipped everywhere; with hysteresis 2 the scale
            # stayed, one hysteresis step was used, and one clean step followed
            assert res["at_save"]["skipped"] == 1 and res["meta"]["skipped_steps"] == 1
            assert res["at_save"]["scaler"] == {"scale": 256.0, "hysteresis_left": 1, "clean_steps": 1}
            assert res["meta"]["loss_scaler"] == {"dynamic": True, **res["at_save"]["scaler"]}
            assert res["meta_scheduler_type"] == "StepLR" and res["meta_scheduler_epoch"] == 2
            assert res["skipped_end"] == [1, 1]


@pytest.mark.parametrize(
    "save_world,save_stage,load_world,load_stage", [(2, 1, 3, 2), (4, 2, 2, 0), (2, 3, 3, 1), (4, 2, 2, 3)]
)
def test_reshard(launches: dict, save_world: int, save_stage: int, load_world: int, load_stage: int) -> None:
    for r, res in enumerate(per_rank(launches, save_world, f"reshard_save/stage{save_stage}")):
        assert res["loss_err"] <= 1.0 and res["param_err"] <= 1.0, f"saving rank {r} diverged from reference"
    key = f"reshard_load/stage{load_stage}:w{save_world}-s{save_stage}"
    for r, res in enumerate(per_rank(launches, load_world, key)):
        assert res["client_state"] == {"world": save_world, "stage": save_stage}
        assert res["gathered_after_load"]["live"] == res["gathered_after_load"]["persistent"]
        assert res["exact"], f"rank {r}: loaded parameters differ from the checkpoint's values"
        assert res["loaded_steps"] == 3
        assert res["load_param_err"] <= 1.0, f"rank {r}: loaded parameters differ from reference"
        assert res["state_presence_ok"] and res["step_ok"], f"rank {r}: optimizer state presence/step wrong"
        assert res["state_err"] <= 1.0, f"rank {r}: exp_avg/exp_avg_sq differ from reference"
        assert res["lrs_equal"], f"rank {r}: lr not restored"
        # err <= 1: within 1e-6 + 1e-5 |torch| of plain torch after the same 6 steps
        assert res["loss_err"] <= 1.0, f"rank {r}: losses after resharding differ (err {res['loss_err']})"
        assert res["param_err"] <= 1.0, f"rank {r}: parameters after resharding differ (err {res['param_err']})"


@pytest.mark.parametrize("stage", (2, 3))
def test_consolidate_tied_weights(launches: dict, stage: int) -> None:
    for r, res in enumerate(per_rank(launches, 2, f"consolidate_tied/stage{stage}")):
        assert res["keys"] == res["want_keys"], "consolidated keys differ from model.state_dict()"
        assert "cache" not in res["keys"]  # non-persistent buffer
        assert res["ref_err"] <= 1.0 and res["output_err"] <= 1.0, f"rank {r}: differs from reference"
        assert res["moved"] > 1e-3, "training did not change the parameters: the comparison is vacuous"
        assert res["equals_module_state_dict"] and res["module_state_dict_keys_in_order"]
        assert res["pt_equal"] and res["pt_keys_in_order"]
        assert res["tied_equal"] and res["buffer_equal"] and res["frozen_equal"]
        assert res["gathered_after_state_dict"]["live"] == res["gathered_after_state_dict"]["persistent"] == 0


def test_refused_load_leaves_stage3_engine_unchanged(launches: dict) -> None:
    for r, res in enumerate(per_rank(launches, 2, "refuse_mismatch/stage3")):
        shape, truncated = res["shape"], res["truncated"]
        assert shape["error"] is not None and "does not fit this model" in shape["error"]
        assert "parameter 'fc1.weight' has shape [7, 13] in the checkpoint but [8, 13] in the model" in shape["error"]
        assert truncated["error"] is not None and "rank1.safetensors is truncated or corrupt" in truncated["error"]
        for case in (shape, truncated):
            assert case["trained_steps"] == 2
            assert case["unchanged"], f"rank {r}: a refused load changed the engine"
            assert case["gathered"]["live"] == case["gathered"]["persistent"]


def test_crash_between_rank_writes(launches: dict) -> None:
    results = per_rank(launches, 2, "crash_safety/stage1")
    assert results[1]["crash_error"].startswith("RuntimeError: simulated crash")
    assert "failed on another rank" in results[0]["crash_error"]  # no rank hangs or publishes
    for res in results:
        assert res["latest_after_crash"] == "global_step2"
        assert res["listing_after_crash"] == [".tmp-global_step4", "global_step2", "latest"]
        assert res["loaded"] == "global_step2" and res["previous_loads"]
        assert res["latest_after_retry"] == "global_step4"
        assert res["latest_final"] == "global_step2" and res["overwrite_loads"]
        assert res["listing_final"] == ["global_step2", "global_step4", "latest"]


@pytest.mark.parametrize("stage,arg", FREEZE_CASES)
def test_checkpoint_saved_while_frozen_midrun(launches: dict[int, list[dict]], stage: int, arg: str) -> None:
    """A parameter trained at initialize and frozen (requires_grad_(False)) when the checkpoint is
    saved is recorded as trained with its optimizer state, loads into an engine where it trains, and
    the run continues bit for bit as without the save/load (and as plain PyTorch does)."""
    key = f"freeze_midrun/stage{stage}" + (f":{arg}" if arg else "")
    results = per_rank(launches, 2, key)
    for r, res in enumerate(results):
        frozen = {"fc1.bias", "fc2.weight", "scale"}
        assert res["records"] == {n: [True, n not in frozen] for n in res["records"]}, res["records"]
        assert res["loaded_equal"], f"rank {r}: loaded values differ from the checkpoint's"
        assert res["losses_equal"], f"rank {r}: losses after the load are not bit-identical"
        assert res["params_equal"], f"rank {r}: parameters after the load are not bit-identical"
        assert res["pieces_equal"], f"rank {r}: fp32 pieces after the load are not bit-identical"
        assert res["states_equal"], f"rank {r}: optimizer state after the load is not bit-identical"
        assert res["ref_err"] <= 1, f"rank {r}: mid-run freezing differs from plain PyTorch ({res['ref_err']})"
    assert sum(res["pieces_with_state"] for res in results) > 0


# ---- single rank, in this process ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def process_group() -> Iterator[None]:
    """A 1-rank gloo group in the pytest process, torn down (and its env vars removed) afterwards."""
    if dist.is_initialized():
        yield
        return
    env = dict(os.environ)
    zerodp.init_distributed()
    yield
    dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(env)


def zoo_engine(stage: int = 1, model: nn.Module | None = None, accum: int = 1, **extra: object) -> zerodp.Engine:
    """``extra``: config keys (``bf16``, ``fp16``, ``scheduler``) or ``lr_scheduler`` for initialize()."""
    model = Zoo() if model is None else model
    groups = zoo_groups(model) if type(model) is Zoo else None
    lr_scheduler = extra.pop("lr_scheduler", None)
    cfg = {
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "gradient_accumulation_steps": accum,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 40},
        **extra,
    }
    return zerodp.initialize(model, cfg, model_parameters=groups, lr_scheduler=lr_scheduler)


def train(engine: zerodp.Engine, steps: int = 1) -> None:
    for i in range(steps):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(3, 13, generator=g).to(engine.precision.param_dtype)
        engine.backward(engine(x).float().pow(2).mean())
        engine.step()


@pytest.fixture(scope="module")
def saved(process_group: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A pristine 1-rank stage-1 checkpoint directory (copy it before corrupting it)."""
    torch.manual_seed(0)
    engine = zoo_engine()
    train(engine, 2)
    d = tmp_path_factory.mktemp("saved")
    engine.save_checkpoint(d)
    return d


@pytest.fixture
def ckpt(saved: Path, tmp_path: Path) -> Path:
    d = tmp_path / "ckpt"
    shutil.copytree(saved, d)
    return d


def snapshot(engine: zerodp.Engine) -> tuple:
    state = [(k, {n: v.clone() for n, v in st.items()}) for k, st in engine.optimizer.state.items()]
    return (
        engine.module_state_dict(),
        state,
        engine.global_steps,
        engine.micro_steps,
        [dict((k, v) for k, v in g.items() if k != "params") for g in engine.optimizer.param_groups],
    )


def assert_unchanged(engine: zerodp.Engine, before: tuple) -> None:
    after = snapshot(engine)
    assert list(before[0]) == list(after[0])
    assert all(torch.equal(before[0][k], after[0][k]) for k in before[0]), "parameters changed by a refused load"
    assert [id(k) for k, _ in before[1]] == [id(k) for k, _ in after[1]], "optimizer state changed"
    assert all(torch.equal(a[n], b[n]) for (_, a), (_, b) in zip(before[1], after[1], strict=True) for n in a)
    assert before[2:] == after[2:], "steps or hyperparameters changed by a refused load"


def refused(engine: zerodp.Engine, d: Path, match: str, **kwargs: str) -> str:
    before = snapshot(engine)
    with pytest.raises(CheckpointError, match=match) as info:
        engine.load_checkpoint(d, **kwargs)
    assert_unchanged(engine, before)
    return str(info.value)


class Renamed(Zoo):
    """``fc2`` is called ``fc3``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc3 = self.fc2
        del self.fc2

    def forward(self, x: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        return self.fc3(h + torch.tanh(self.branch(h))) * self.scale


def test_refuses_missing_and_extra_names(process_group: None, ckpt: Path) -> None:
    engine = zoo_engine(model=Renamed())
    train(engine)
    msg = refused(engine, ckpt, "does not fit this model")
    assert "checkpoint has parameter 'fc2.weight' that the model lacks" in msg
    assert "model has parameter 'fc3.weight' missing from checkpoint" in msg
    assert "fc2.bias" in msg and "fc3.bias" in msg


def test_refuses_shape_mismatch(process_group: None, ckpt: Path) -> None:
    engine = zoo_engine(model=Zoo(hidden=8))
    msg = refused(engine, ckpt, "shape")
    assert "parameter 'fc1.weight' has shape [7, 13] in the checkpoint but [8, 13] in the model" in msg


def test_refuses_requires_grad_mismatch(process_group: None, ckpt: Path, tmp_path: Path) -> None:
    """Frozen at initialize on one side only: refused both ways, naming the parameter and the way out.
    A checkpoint saved while the parameter was frozen mid-run counts as trained."""

    def bias_frozen() -> zerodp.Engine:
        model = Zoo()
        model.fc1.bias.requires_grad_(False)
        return zoo_engine(model=model)

    engine = bias_frozen()
    msg = refused(
        engine,
        ckpt,
        "parameter 'fc1.bias' is trained in the checkpoint but was frozen "
        r"\(requires_grad=False\) at zerodp.initialize of this engine",
    )
    assert "load_full_state_dict" in msg
    engine.save_checkpoint(tmp_path)  # fc1.bias frozen at initialize
    refused(
        zoo_engine(),
        tmp_path,
        "parameter 'fc1.bias' was frozen \\(requires_grad=False\\) at "
        "zerodp.initialize of the engine that saved the checkpoint .* but trains in this engine",
    )
    midrun = zoo_engine()
    train(midrun)
    midrun.module.fc1.bias.requires_grad_(False)
    midrun.save_checkpoint(tmp_path / "midrun")
    refused(
        bias_frozen(),
        tmp_path / "midrun",
        r"'fc1.bias' is trained in the checkpoint \(frozen mid-run when saved\) but was frozen",
    )


def test_refuses_different_tying(process_group: None, ckpt: Path, tmp_path: Path) -> None:
    torch.manual_seed(0)
    tied = zoo_engine(model=TiedLM())
    tied.save_checkpoint(tmp_path / "tied")
    untied = TiedLM()
    untied.head.weight = nn.Parameter(untied.emb.weight.detach().clone())
    refused(
        zoo_engine(model=untied),
        tmp_path / "tied",
        r"tied names differ: checkpoint ties \['emb.weight', "
        r"'head.weight'\], model ties \['emb.weight'\]",
    )


def corrupt_meta(d: Path, edit: Callable[[dict], None]) -> None:
    meta_file = d / "global_step2" / "meta.json"
    meta = json.loads(meta_file.read_text())
    edit(meta)
    meta_file.write_text(json.dumps(meta))


@pytest.mark.parametrize(
    "case,match",
    [
        ("garbage", r"meta.json is corrupt \(not readable JSON\)"),
        ("missing_key", r"meta.json is corrupt: meta.json: missing key 'ranks'"),
        ("version", r"format version 99 is not supported"),
        ("wrong_type", r"'global_steps' should be int, got str"),
        ("gap", r"the saved pieces of parameter 'fc1.weight' do not cover its elements"),
        (
            "old_midrun_freeze",
            r"meta.json: rank0.safetensors holds optimizer pieces of parameter 'fc1.bias', which "
            r"meta.json records as not trained with requires_grad=False: this checkpoint was saved "
            r"by an older zerodp while 'fc1.bias' was frozen mid-run",
        ),
        ("deleted", r"global_step2 does not exist or has no meta.json"),
    ],
)
def test_refuses_corrupt_meta(process_group: None, ckpt: Path, case: str, match: str) -> None:
    meta_file = ckpt / "global_step2" / "meta.json"
    if case == "garbage":
        meta_file.write_text('{"format": "zerodp-checkpoint", "vers')
    elif case == "missing_key":
        corrupt_meta(ckpt, lambda m: m.pop("ranks"))
    elif case == "version":
        corrupt_meta(ckpt, lambda m: m.update(version=99))
    elif case == "wrong_type":
        corrupt_meta(ckpt, lambda m: m.update(global_steps="2"))
    elif case == "gap":

        def drop(m: dict) -> None:
            m["ranks"][0]["pieces"] = [p for p in m["ranks"][0]["pieces"] if p["name"] != "fc1.weight"]

        corrupt_meta(ckpt, drop)
    elif case == "old_midrun_freeze":  # what zerodp wrote before it recorded mid-run freezing as trained
        corrupt_meta(
            ckpt,
            lambda m: [r.update(trained=False, requires_grad=False) for r in m["params"] if r["name"] == "fc1.bias"],
        )
    else:
        meta_file.unlink()
    engine = zoo_engine()
    train(engine)
    refused(engine, ckpt, match)


@pytest.mark.parametrize("case", ["truncated", "missing", "extra_file_truncated"])
def test_refuses_broken_rank_file(process_group: None, ckpt: Path, case: str) -> None:
    name = "model_extra.safetensors" if case == "extra_file_truncated" else "rank0.safetensors"
    f = ckpt / "global_step2" / name
    if case == "missing":
        f.unlink()
        match = r"checkpoint file .*rank0.safetensors is missing"
    else:
        data = f.read_bytes()
        f.write_bytes(data[: len(data) - 16])
        match = rf"checkpoint file .*{name} is truncated or corrupt"
    engine = zoo_engine()
    train(engine)
    refused(engine, ckpt, match)
    with pytest.raises(CheckpointError, match=match):
        consolidate(ckpt, ckpt / "out.safetensors")


def test_refuses_missing_checkpoint(process_group: None, tmp_path: Path, ckpt: Path) -> None:
    engine = zoo_engine()
    refused(engine, tmp_path / "nothing-here", "checkpoint directory .* does not exist")
    (tmp_path / "empty").mkdir()
    refused(engine, tmp_path / "empty", "no checkpoint in")
    refused(engine, ckpt, "does not exist", tag="global_step7")
    (ckpt / "latest").write_text("../escape")
    refused(engine, ckpt, "is corrupt: invalid checkpoint tag")


def test_killed_while_replacing_a_tag(process_group: None, ckpt: Path) -> None:
    """Killed between moving the old ``global_step2`` aside and renaming the new one into place."""
    engine = zoo_engine()
    os.replace(ckpt / "global_step2", ckpt / ".old-global_step2-1234abcd")
    path, _ = engine.load_checkpoint(ckpt)
    assert path.name == ".old-global_step2-1234abcd" and engine.global_steps == 2
    shutil.copytree(path, ckpt / ".tmp-global_step2")  # the new one, complete: preferred
    assert engine.load_checkpoint(ckpt)[0].name == ".tmp-global_step2"
    (ckpt / ".tmp-global_step2" / "meta.json").unlink()  # incomplete: the old one again
    assert engine.load_checkpoint(ckpt)[0].name == ".old-global_step2-1234abcd"


class Mixed(nn.Module):
    """A float64 parameter beside float32 ones: one param group spans two flat groups."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(13, 2)
        self.w64 = nn.Parameter(torch.randn(13, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).sum(-1) + (x.double() @ self.w64).float()


def test_mixed_dtypes_and_group_order(process_group: None, tmp_path: Path) -> None:
    def make(seed: int) -> zerodp.Engine:
        torch.manual_seed(seed)
        m = Mixed()
        groups = [{"params": [m.lin.weight, m.w64], "lr": 0.02}, {"params": [m.lin.bias], "weight_decay": 0.0}]
        return zerodp.initialize(
            m, {"optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": 2}}, model_parameters=groups
        )

    engine = make(0)
    assert len(engine.groups) == 3 and len(engine.optimizer.param_groups) == 2
    train(engine, 2)
    engine.optimizer.param_groups[1]["lr"] = 0.0033
    engine.save_checkpoint(tmp_path)
    fresh = make(1)
    fresh.load_checkpoint(tmp_path)
    assert [g["lr"] for g in fresh.optimizer.param_groups] == [0.02, 0.0033]
    train(engine, 1)
    train(fresh, 1)
    a, b = engine.module_state_dict(), fresh.module_state_dict()
    assert a["w64"].dtype == torch.float64 and all(torch.equal(a[k], b[k]) for k in a)


def test_micro_steps_realigned_to_new_accumulation(process_group: None, tmp_path: Path) -> None:
    engine = zoo_engine()
    train(engine, 3)
    engine.save_checkpoint(tmp_path)
    accumulating = zoo_engine(accum=2)
    accumulating.load_checkpoint(tmp_path)
    assert (accumulating.global_steps, accumulating.micro_steps) == (3, 6)  # saved micro_steps 3
    assert not accumulating.is_gradient_accumulation_boundary()


def test_save_refusals_leave_nothing(process_group: None, tmp_path: Path) -> None:
    engine = zoo_engine()
    train(engine)
    with pytest.raises(CheckpointError, match="client_state must be JSON-serialisable"):
        engine.save_checkpoint(tmp_path, client_state={"tensor": torch.zeros(1)})
    with pytest.raises(CheckpointError, match="invalid checkpoint tag"):
        engine.save_checkpoint(tmp_path, tag="a/b")
    accumulating = zoo_engine(accum=2)
    accumulating.backward(accumulating(torch.randn(2, 13)).sum())
    accumulating.step()
    with pytest.raises(CheckpointError, match="inside a gradient accumulation window"):
        accumulating.save_checkpoint(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_single_rank_roundtrip_and_consolidate_without_process_group(
    process_group: None, saved: Path, subprocesses: dict[str, subprocess.CompletedProcess]
) -> None:
    torch.manual_seed(3)
    engine = zoo_engine(stage=2)
    path, client_state = engine.load_checkpoint(saved)
    assert path == saved / "global_step2" and client_state is None and engine.global_steps == 2
    expected = engine.module_state_dict()
    assert list(expected) == list(Zoo().state_dict())
    # consolidated in a fresh interpreter with no process group at all
    proc = subprocesses["consolidate"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = load_file(str(saved.parent / "consolidated" / "model.safetensors"))
    assert sorted(got) == sorted(expected) and all(torch.equal(got[k], expected[k]) for k in got)
    with pytest.raises(CheckpointError, match="use a .safetensors or .pt"):
        consolidate(saved, saved.parent / "consolidated" / "model.bin")


def test_param_groups_matched_by_name(process_group: None, tmp_path: Path) -> None:
    torch.manual_seed(0)
    engine = zoo_engine()  # groups: {fc1.weight, branch.weight, fc2.weight} wd 0.1; the rest wd 0.0
    train(engine)
    engine.optimizer.param_groups[0]["lr"] = 0.0042  # as a scheduler would
    engine.save_checkpoint(tmp_path)
    # one group holding parameters that were saved with different hyperparameters: refused
    model = Zoo()
    merged = zerodp.initialize(model, {"optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": 2}})
    refused(
        merged,
        tmp_path,
        r"optimizer param group 0: its parameters .* were in saved param groups 0 and 1 "
        "with different hyperparameters",
    )
    # the first saved group split in two, in another order: each gets the saved hyperparameters
    m = Zoo()
    split = [
        {"params": [m.fc1.bias, m.fc2.bias, m.scale, m.never_used], "weight_decay": 0.5},
        {"params": [m.fc2.weight], "weight_decay": 0.5},
        {"params": [m.fc1.weight, m.branch.weight], "weight_decay": 0.5, "lr": 1.0},
    ]
    regrouped = zerodp.initialize(
        m, {"optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": 1}}, model_parameters=split
    )
    regrouped.load_checkpoint(tmp_path)
    got = [(g["lr"], g["weight_decay"]) for g in regrouped.optimizer.param_groups]
    assert got == [(0.01, 0.0), (0.0042, 0.1), (0.0042, 0.1)]


KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    import torch, zerodp
    from safetensors.torch import save_file
    from zerodp.checkpoint import save as checkpoint_save
    d, point = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    engine = zerodp.initialize(torch.nn.Linear(4, 3), {"zero_optimization": {"stage": 2}})
    def train():
        engine.backward(engine(torch.randn(2, 4)).pow(2).mean())
        engine.step()
    train()
    engine.save_checkpoint(d)
    save_file(engine.module_state_dict(), os.path.join(d, "expected.safetensors"))
    train()
    name = {"rank_file": "_write_rank_file", "latest": "_write_latest"}[point]
    original = getattr(checkpoint_save, name)
    def killed(*args, **kwargs):
        if point == "rank_file":
            original(*args, **kwargs)  # the rank file is complete ...
        else:
            save_dir, tag = args  # ... or latest.tmp is written but not yet renamed ...
            with open(os.path.join(save_dir, "latest.tmp"), "w") as f:
                f.write(tag)
        os.kill(os.getpid(), signal.SIGKILL)  # ... and the process dies
    setattr(checkpoint_save, name, killed)
    engine.save_checkpoint(d)
""")


@pytest.fixture(scope="module")
def subprocesses(saved: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, subprocess.CompletedProcess]:
    """Run, concurrently: KILL_SCRIPT at each kill point (in ``<tmp>/<point>``), and consolidate() of
    ``saved`` into ``saved.parent/consolidated`` in an interpreter without a process group."""
    env = {
        k: v
        for k, v in os.environ.items()  # not this process's 1-rank group
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    out = saved.parent / "consolidated" / "model.safetensors"
    consolidate_code = (
        f"from zerodp.checkpoint import consolidate; import torch.distributed as d; "
        f"consolidate({str(saved)!r}, {str(out)!r}); assert not d.is_initialized()"
    )
    commands = {"consolidate": [sys.executable, "-c", consolidate_code]}
    for point in KILL_POINTS:
        commands[point] = [sys.executable, "-c", KILL_SCRIPT, str(tmp_path_factory.mktemp(point)), point]
    procs = {
        k: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for k, cmd in commands.items()
    }
    done = {}
    for k, p in procs.items():
        stdout, stderr = p.communicate(timeout=120)
        done[k] = subprocess.CompletedProcess(commands[k], p.returncode, stdout, stderr)
    done["dirs"] = {point: Path(commands[point][3]) for point in KILL_POINTS}  # type: ignore[assignment]
    return done


KILL_POINTS = ("rank_file", "latest")


@pytest.mark.parametrize("point", KILL_POINTS)
def test_killed_mid_save(process_group: None, subprocesses: dict, point: str) -> None:
    """A process SIGKILLed after writing its rank file (before the rename), or after the rename but
    before ``latest`` was replaced: ``latest`` still names the previous checkpoint, which loads."""
    proc, d = subprocesses[point], subprocesses["dirs"][point]
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert (d / "latest").read_text() == "global_step1"
    listing = sorted(p.name for p in d.iterdir())
    if point == "rank_file":
        assert listing == [".tmp-global_step2", "expected.safetensors", "global_step1", "latest"]
    else:  # the new checkpoint is complete, but latest was not switched to it
        assert listing == ["expected.safetensors", "global_step1", "global_step2", "latest", "latest.tmp"]
        assert load_full_state_dict(d, tag="global_step2").keys() == {"weight", "bias"}
    torch.manual_seed(9)
    engine = zerodp.initialize(torch.nn.Linear(4, 3), {"zero_optimization": {"stage": 1}})
    path, _ = engine.load_checkpoint(d)
    assert path.name == "global_step1" and engine.global_steps == 1
    expected = load_file(str(d / "expected.safetensors"))
    got = engine.module_state_dict()
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_stage3_parameter_left_out_of_model_parameters(process_group: None, tmp_path: Path) -> None:
    """At stage 3 a parameter that requires grad but is not given to the optimizer still lives in a unit
    (with no optimizer piece): it is saved like a frozen one, and loads at stages 3 and 1."""

    def make(stage: int, seed: int) -> tuple[Zoo, zerodp.Engine]:
        torch.manual_seed(seed)
        m = Zoo()
        params = [p for n, p in m.named_parameters() if n != "fc2.bias"]
        cfg = {
            "optimizer": {"type": "AdamW"},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 4},
        }
        return m, zerodp.initialize(m, cfg, model_parameters=params)

    model, engine = make(3, 0)
    train(engine, 2)
    engine.save_checkpoint(tmp_path)
    meta = json.loads((tmp_path / "global_step2" / "meta.json").read_text())
    assert [r["trained"] for r in meta["params"] if r["name"] == "fc2.bias"] == [False]
    expected = engine.module_state_dict()
    for stage in (3, 1):
        _, fresh = make(stage, 1)
        fresh.load_checkpoint(tmp_path)
        got = fresh.module_state_dict()
        assert list(got) == list(expected) and all(torch.equal(got[k], expected[k]) for k in got)


def test_stage3_load_drops_units_gathered_ahead(process_group: None, tmp_path: Path) -> None:
    """A training forward without backward leaves units prefetched for the backward: loading releases
    them (nothing stays gathered but the persistent unit) and the next forward uses the loaded values."""

    def make(seed: int) -> zerodp.Engine:
        torch.manual_seed(seed)
        m = Zoo()
        cfg = {
            "optimizer": {"type": "AdamW"},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 4},
        }
        return zerodp.initialize(m, cfg, model_parameters=zoo_groups(m))

    engine = make(0)
    train(engine, 2)  # the first iteration records the trace; from the second on, units are prefetched
    engine.save_checkpoint(tmp_path)
    train(engine, 1)
    x = torch.randn(3, 13)
    engine(x)  # forward with grad, no backward
    c = engine.sharding.coordinator
    persistent = sum(u.numel for u in engine.sharding.units if u.persistent)
    assert c.live_elements() > persistent  # gathered ahead of the backward that never comes
    engine.load_checkpoint(tmp_path)
    assert c.live_elements() == persistent
    fresh = make(1)
    fresh.load_checkpoint(tmp_path)
    with torch.no_grad():
        assert torch.equal(engine(x), fresh(x))


# ---- precision, loss scaler, LR scheduler (single rank) ------------------------------------------------
BF16 = {"bf16": {"enabled": True}}
FP16 = {"fp16": {"enabled": True, "initial_scale_power": 4, "loss_scale_window": 2}}


def masters_and_params(engine: zerodp.Engine) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, optimizer tensor (fp32 master or the fp32 parameter view), module-dtype piece)."""
    return [(p.slot.name, p.opt_tensor, p.tensor) for g in engine.groups for p in g.pieces]


def assert_loaded_exactly(engine: zerodp.Engine, values: dict[str, torch.Tensor]) -> None:
    """The optimizer's fp32 tensors hold ``values`` exactly; the module's pieces are them cast."""
    for g in engine.groups:
        for p in g.pieces:
            want = values[p.slot.name].reshape(-1)[p.lo - p.slot.offset : p.hi - p.slot.offset]
            assert p.opt_tensor.dtype == torch.float32 and torch.equal(p.opt_tensor, want), p.slot.name
            assert torch.equal(p.tensor, want.to(p.tensor.dtype)), p.slot.name
    got = engine.module_state_dict()
    for k, v in values.items():
        assert got[k].dtype == torch.float32 and torch.equal(got[k], v), k


def test_loads_across_precisions(process_group: None, saved: Path, tmp_path: Path) -> None:
    """fp32 -> bf16 -> fp32 and fp16 -> bf16: trained values arrive exactly (fp32 masters), the module
    dtype follows the engine; a non-fp16 engine has no loss scaler to restore."""
    fp32_values = load_full_state_dict(saved)
    bf16 = zoo_engine(stage=2, **BF16)
    bf16.load_checkpoint(saved)
    assert_loaded_exactly(bf16, fp32_values)
    assert bf16.module.fc1.weight.dtype == torch.bfloat16
    train(bf16, 2)
    bf16.save_checkpoint(tmp_path / "bf16")
    meta = json.loads((tmp_path / "bf16" / "global_step4" / "meta.json").read_text())
    assert meta["precision"] == "bf16" and meta["dtype"] == "float32" and meta["loss_scaler"] is None
    expected = bf16.module_state_dict()
    fp32 = zoo_engine(stage=0)
    fp32.load_checkpoint(tmp_path / "bf16")
    assert_loaded_exactly(fp32, expected)
    assert fp32.module.fc1.weight.dtype == torch.float32

    fp16 = zoo_engine(stage=1, **FP16)
    train(fp16, 3)
    assert fp16.loss_scale == 32.0  # doubled once after 2 clean steps: the saved scale is not the initial one
    fp16.save_checkpoint(tmp_path / "fp16")
    meta = json.loads((tmp_path / "fp16" / "global_step3" / "meta.json").read_text())
    assert meta["loss_scaler"] == {"dynamic": True, "scale": 32.0, "hysteresis_left": 2, "clean_steps": 1}
    other = zoo_engine(stage=1, **BF16)
    other.load_checkpoint(tmp_path / "fp16")
    assert_loaded_exactly(other, fp16.module_state_dict())
    again = zoo_engine(stage=2, **FP16)
    again.load_checkpoint(tmp_path / "fp16")
    assert again.loss_scaler.state_dict() == fp16.loss_scaler.state_dict()
    static = zoo_engine(stage=2, fp16={"enabled": True, "loss_scale": 128.0})
    static.load_checkpoint(tmp_path / "fp16")
    assert static.loss_scale == 128.0  # a static scale stays as configured


def test_refuses_values_that_overflow_the_engine_dtype(process_group: None, tmp_path: Path) -> None:
    """An fp32 weight above fp16's largest finite value (65504) would become inf in an fp16 module: the
    load is refused (and changes nothing); a bf16 engine takes it."""
    torch.manual_seed(0)
    engine = zoo_engine()
    train(engine)
    with torch.no_grad():
        engine.module.fc2.bias[1] = 1e5
    engine.save_checkpoint(tmp_path)
    fp16 = zoo_engine(stage=2, **FP16)
    train(fp16)
    msg = refused(fp16, tmp_path, "was saved with fp32 and this engine uses fp16")
    assert "['fc2.bias'] exceed the largest finite float16 (65504)" in msg
    bf16 = zoo_engine(stage=2, **BF16)
    bf16.load_checkpoint(tmp_path)
    assert bf16.module_state_dict()["fc2.bias"][1].item() == 1e5


def step_lr(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def test_lr_scheduler_state(process_group: None, tmp_path: Path) -> None:
    """A torch scheduler's state is saved (JSON) and restored into one of the same class; a scheduler of
    another class starts afresh (the param groups' lr is restored either way)."""
    torch.manual_seed(0)
    engine = zoo_engine(lr_scheduler=step_lr)
    train(engine, 3)
    engine.save_checkpoint(tmp_path)
    meta = json.loads((tmp_path / "global_step3" / "meta.json").read_text())
    assert meta["lr_scheduler"]["type"] == "StepLR" and meta["lr_scheduler"]["state"]["last_epoch"] == 3
    assert meta["precision"] == "fp32" and meta["skipped_steps"] == 0 and meta["loss_scaler"] is None
    same = zoo_engine(lr_scheduler=step_lr)
    same.load_checkpoint(tmp_path)
    assert same.lr_scheduler.state_dict() == engine.lr_scheduler.state_dict()
    train(engine, 2)
    train(same, 2)
    assert same.get_lr() == engine.get_lr() and same.lr_scheduler.last_epoch == 5
    cosine = {"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "warmup_num_steps": 2}}
    other = zoo_engine(scheduler=cosine)
    other.load_checkpoint(tmp_path)
    assert other.lr_scheduler.last_epoch == 0  # as constructed
    assert other.get_lr() == [g["hyperparameters"]["lr"] for g in meta["groups"]] == [0.005, 0.005]  # StepLR's


def test_loads_checkpoint_without_precision_keys(process_group: None, saved: Path, tmp_path: Path) -> None:
    """meta.json written before precision/skipped_steps/loss_scaler/lr_scheduler existed still loads;
    an unknown precision is refused as corrupt."""
    for case in ("old", "bad"):
        d = tmp_path / case
        shutil.copytree(saved, d)
        meta_file = d / "global_step2" / "meta.json"
        meta = json.loads(meta_file.read_text())
        for k in ("precision", "skipped_steps", "loss_scaler", "lr_scheduler"):
            meta.pop(k)
        if case == "bad":
            meta["precision"] = "fp8"
        meta_file.write_text(json.dumps(meta))
    engine = zoo_engine(stage=2, **BF16)
    engine.load_checkpoint(tmp_path / "old")
    assert_loaded_exactly(engine, load_full_state_dict(saved))
    refused(engine, tmp_path / "bad", r"'precision' is 'fp8'; expected one of \['fp32', 'bf16', 'fp16'\]")
