"""Bad configs and bad arguments are refused with messages naming the key and what is allowed."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import zerodp
from zerodp.config import ConfigError, load_config


@pytest.mark.parametrize(
    "config, fragments",
    [
        ({"zero_optimization": {"stgae": 2}}, ["unknown key 'zero_optimization.stgae'", "stage"]),
        ({"zero_optimization": {"stage": 7}}, ["zero_optimization.stage", "0, 1", "7"]),
        ({"optimizer": {"type": "Lamb"}}, ["optimizer.type", "'Lamb' is not implemented", "SGD"]),
        ({"optimizer": {"type": "Sgdd"}}, ["optimizer.type", "unknown optimizer", "AdamW, SGD"]),
        ({"optimizer": {"type": "SGD", "params": {"betas": [0.9, 0.9]}}}, ["optimizer.params.betas", "momentum"]),
        (
            {"zero_optimization": {"round_robin_gradients": True}},
            ["'zero_optimization.round_robin_gradients' is not implemented"],
        ),
        ({"optimizer": {"type": "Adam", "params": {"lr": -1}}}, ["optimizer.params.lr", "-1"]),
        ({"optimizer": {"type": "Adam", "params": {"betas": [0.9, 1.5]}}}, ["optimizer.params.betas", "[0, 1)"]),
        ({"optimizer": {"type": "Adam", "params": {"momentum": 0.9}}}, ["optimizer.params.momentum", "weight_decay"]),
        ({"train_micro_batch_size_per_gpu": 0}, ["train_micro_batch_size_per_gpu", "greater than 0"]),
        ({"gradient_accumulation_steps": "two"}, ["gradient_accumulation_steps", "two"]),
        ({"zero_optimization": {"reduce_bucket_size": 1.5}}, ["zero_optimization.reduce_bucket_size", "1.5"]),
        ({"gradient_clipping": -1.0}, ["gradient_clipping"]),
        ({"fp32_allreduce": True}, ["unknown key 'fp32_allreduce'", "train_micro_batch_size_per_gpu"]),
    ],
)
def test_bad_config_names_key_and_allowed(config: dict, fragments: list[str]) -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(config)
    for frag in fragments:
        assert frag in str(exc.value), str(exc.value)


@pytest.mark.parametrize(
    "config, message",
    [
        pytest.param(
            {"optimizer": {"type": "Adam", "params": {"betas": [0.9]}}},
            "'optimizer.params.betas': needs exactly 2 values, got 1",
            id="betas_one_value",
        ),
        pytest.param(
            {"optimizer": {"type": "Adam", "params": {"betas": [0.9, 0.9, 0.9]}}},
            "'optimizer.params.betas': needs exactly 2 values, got 3",
            id="betas_three_values",
        ),
        pytest.param(
            {"zero_optimization": {"stage": 10**20}},
            "'zero_optimization.stage': Input should be 0, 1, 2 or 3 (got 100000000000000000000)",
            id="stage_huge",
        ),
        pytest.param(
            {"zero_optimization": {"stage": -1}},
            "'zero_optimization.stage': Input should be 0, 1, 2 or 3 (got -1)",
            id="stage_negative",
        ),
    ],
)
def test_sizes_and_numbers_said_in_config_terms(config: dict, message: str) -> None:
    """What pydantic words by its internals ('betas.1: Field required', an i64 parse failure) is said
    as the number of values needed and the values allowed."""
    with pytest.raises(ConfigError) as exc:
        load_config(config)
    assert str(exc.value) == f"invalid zerodp config:\n  {message}"


def test_deepspeed_spellings_load() -> None:
    cfg = load_config(
        {
            "optimizer": {"type": "adamw", "params": {"lr": 3e-4, "betas": [0.9, 0.95]}},
            "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8},
        }
    )
    assert cfg.optimizer.type == "AdamW"
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000
    assert cfg.gradient_clipping == 0.0  # PyTorch's default: no clipping unless asked


def test_config_file(tmp_path) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    assert load_config(str(path)).zero_optimization.stage == 1
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(str(path))
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(str(tmp_path / "missing.json"))


def test_batch_size_consistency() -> None:
    cfg = load_config({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2})
    with pytest.raises(ConfigError, match="train_batch_size=10 must equal"):
        cfg.for_world_size(2)
    ok = load_config(
        {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}
    ).for_world_size(2)
    assert (ok.train_micro_batch_size_per_gpu, ok.gradient_accumulation_steps) == (2, 2)


def test_batch_sizes_derived_as_in_deepspeed() -> None:
    only = load_config({"train_batch_size": 32}).for_world_size(2)
    assert (only.train_micro_batch_size_per_gpu, only.gradient_accumulation_steps) == (16, 1)
    gas = load_config({"train_batch_size": 32, "gradient_accumulation_steps": 4}).for_world_size(2)
    assert gas.train_micro_batch_size_per_gpu == 4
    micro = load_config({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}).for_world_size(2)
    assert micro.gradient_accumulation_steps == 4
    with pytest.raises(ConfigError, match="not divisible"):
        load_config({"train_batch_size": 33}).for_world_size(2)


@pytest.mark.parametrize(
    "config, fragment",
    [
        ({"bf16": {"enabled": "yes"}}, "bf16.enabled"),
        ({"fp16": {"enabled": "off"}}, "fp16.enabled"),
        ({"optimizer": {"type": "Adam", "params": {"lr": "1e-3"}}}, "not a string"),
        ({"gradient_clipping": "1.0"}, "not a string"),
        ({"zero_optimization": {"stage": True}}, "not a boolean"),
        ({"zero_optimization": {"overlap_comm": 1}}, "expected true or false"),
    ],
)
def test_no_lax_coercion(config: dict, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        load_config(config)


def test_bad_param_groups() -> None:
    model = nn.Linear(3, 2)
    other = nn.Linear(3, 2)
    with pytest.raises(ValueError, match="not a parameter of the model"):
        zerodp.initialize(model, {}, model_parameters=other.parameters())
    with pytest.raises(ValueError, match="more than one param group"):
        zerodp.initialize(
            model, {}, model_parameters=[{"params": [model.weight]}, {"params": [model.weight, model.bias]}]
        )
    with pytest.raises(ValueError, match=r"\['momentum'\] that torch.optim.AdamW does not take; allowed: .*lr"):
        zerodp.initialize(model, {}, model_parameters=[{"params": [model.weight], "momentum": 0.9}])
    with pytest.raises(ValueError, match="unsupported option.*colour.*allowed: lr"):
        zerodp.initialize(model, {}, model_parameters=[{"params": [model.weight], "colour": 1}])
    with pytest.raises(ValueError, match="scalar tensor that requires grad"):
        engine = zerodp.initialize(model, {})
        engine.backward(torch.ones(2))


@pytest.mark.parametrize(
    "model_parameters,words",
    [
        (lambda m: m.named_parameters(), r"a tuple .*model.named_parameters\(\).*model.parameters\(\)"),
        (lambda m: [{"params": m.named_parameters()}], r"param group 0 holds a tuple .*model.parameters\(\)"),
        (lambda m: [{"params": ["weight"]}], r"param group 0 holds a str .*model.parameters\(\)"),
    ],
)
def test_param_groups_of_names_are_refused_naming_what_was_given(model_parameters, words: str) -> None:
    """(name, parameter) pairs or names instead of parameters: a ValueError naming what was given and
    what is allowed (it was an AttributeError: 'tuple' object has no attribute 'shape')."""
    model = nn.Linear(3, 2)
    with pytest.raises(ValueError, match=words):
        zerodp.initialize(model, {}, model_parameters=model_parameters(model))


def test_mixed_precision_and_scheduler_config_errors() -> None:
    with pytest.raises(ConfigError, match="bf16.enabled and fp16.enabled are both true"):
        load_config({"bf16": {"enabled": True}, "fp16": {"enabled": True}})
    with pytest.raises(ConfigError, match="unknown key 'fp16.hysterisis'.*hysteresis"):
        load_config({"fp16": {"enabled": True, "hysterisis": 2}})
    with pytest.raises(ConfigError, match="scheduler.params.total_num_steps.*Field required"):
        load_config({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 5}}})
    with pytest.raises(ConfigError, match="unknown key 'scheduler.params.warmup_steps'.*warmup_num_steps"):
        load_config({"scheduler": {"type": "WarmupLR", "params": {"warmup_steps": 5}}})
    with pytest.raises(ConfigError, match="scheduler.type.*WarmupCosineLR.*OneCycle"):
        load_config({"scheduler": {"type": "OneCycle"}})


def test_torch_scheduler_callable() -> None:
    model = nn.Linear(3, 2)
    engine = zerodp.initialize(
        model,
        {"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}},
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5),
    )
    lrs = []
    for _ in range(5):
        engine.backward(model(torch.ones(1, 3)).sum())
        engine.step()
        lrs.append(engine.get_lr()[0])
    assert lrs == pytest.approx([0.1, 0.05, 0.05, 0.025, 0.025])
    opt = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=1.0)
    with pytest.raises(TypeError, match="must be a callable taking the engine's optimizer"):
        zerodp.initialize(nn.Linear(3, 2), {}, lr_scheduler=torch.optim.lr_scheduler.StepLR(opt, 1))
    with pytest.raises(ValueError, match="either lr_scheduler"):
        zerodp.initialize(
            nn.Linear(3, 2),
            {"scheduler": {"type": "WarmupLR"}},
            lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1),
        )


def test_warmup_cosine_formula() -> None:
    import math

    from zerodp.config import WarmupCosineLRParams
    from zerodp.runtime.schedulers import WarmupCosineLR

    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], lr=0.2)
    sched = WarmupCosineLR(
        opt,
        WarmupCosineLRParams(
            total_num_steps=10, warmup_num_steps=4, warmup_min_ratio=0.1, cos_min_ratio=0.05, warmup_type="linear"
        ),
    )
    got = []
    for _ in range(11):
        got.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    want = [0.2 * (0.1 + 0.9 * t / 4) for t in range(4)]
    # DeepSpeed's real_last_step = t - W + 1: the first step after warmup already decays; floor from t = T - 1
    want += [0.2 * (0.05 + 0.95 * (1 + math.cos(math.pi * min(1.0, (t - 3) / 6))) / 2) for t in range(4, 11)]
    assert got == pytest.approx(want)
    assert got[4] == pytest.approx(0.1872724, abs=1e-7) and got[9] == got[10] == pytest.approx(0.2 * 0.05)


def test_warmup_lr_without_max_warms_up_to_the_optimizer_lr() -> None:
    """WarmupLR without warmup_max_lr ends at the optimizer's lr (DeepSpeed's WarmupLR: the first
    group's lr; a fixed 0.001 default trained at 3.3x the configured 3e-4, deepspeedai/DeepSpeed#7303);
    WarmupDecayLR keeps DeepSpeed's 0.001 default."""
    opt = {"type": "AdamW", "params": {"lr": 3e-4}}
    for kind, extra, want in (("WarmupLR", {}, 3e-4), ("WarmupDecayLR", {"total_num_steps": 100}, 0.001)):
        sched = {"type": kind, "params": {"warmup_num_steps": 2, "warmup_type": "linear", **extra}}
        engine = zerodp.initialize(nn.Linear(2, 2), {"optimizer": opt, "scheduler": sched})
        for _ in range(2):
            engine.backward(engine(torch.ones(1, 2)).sum())
            engine.step()
        assert engine.get_lr() == pytest.approx([want])


def deepspeed_lr(kind: str, params: dict, base_lr: float, t: int) -> float:
    """The lr of DeepSpeed's schedule after t steps, transcribed from deepspeed/runtime/lr_schedules.py
    (WarmupLR._get_gamma, WarmupDecayLR._get_gamma, WarmupCosineLR.get_lr_ratio): the reference."""
    import math

    w = max(2, params.get("warmup_num_steps", 1000))  # DeepSpeed: self.warmup_num_steps = max(2, ...)
    kind_of_warmup = params.get("warmup_type", "log")
    gamma = math.log(t + 1) / math.log(w) if kind_of_warmup == "log" else t / w
    if kind == "WarmupCosineLR":
        if t < w:
            lo = params.get("warmup_min_ratio", 0.0)
            return base_lr * (lo + gamma * (1.0 - lo))
        cos_min = params.get("cos_min_ratio", 0.0001)
        progress = min(1.0, (t - w + 1) / max(1, params["total_num_steps"] - w))
        return base_lr * max(0.0, cos_min + (1.0 - cos_min) * (1 + math.cos(math.pi * progress)) / 2)
    lo, hi = params.get("warmup_min_lr", 0.0), params.get("warmup_max_lr", 0.001)
    if t >= w:
        gamma = (
            1.0
            if kind == "WarmupLR"
            else max(0.0, (params["total_num_steps"] - t) / max(1.0, params["total_num_steps"] - w))
        )
    return lo + (hi - lo) * gamma


@pytest.mark.parametrize(
    "kind,params",
    [
        ("WarmupCosineLR", {"total_num_steps": 8, "warmup_num_steps": 3}),
        ("WarmupCosineLR", {"total_num_steps": 6, "warmup_num_steps": 1, "warmup_type": "linear"}),
        ("WarmupLR", {"warmup_num_steps": 1, "warmup_max_lr": 0.1}),
        ("WarmupLR", {"warmup_num_steps": 1, "warmup_max_lr": 0.1, "warmup_type": "linear"}),
        ("WarmupDecayLR", {"total_num_steps": 5, "warmup_num_steps": 1, "warmup_max_lr": 0.1}),
    ],
)
def test_config_schedules_follow_deepspeed_formulas(kind: str, params: dict) -> None:
    """A config's scheduler gives DeepSpeed's lr(t) for every t (a warmup of 1 step is 2, as in
    DeepSpeed; the cosine phase starts decaying on the first step after warmup). t counts torch-style
    (t = 0 at construction); DeepSpeed's start at last_batch_iteration -1, so DeepSpeed's step k + 1 uses
    the lr of zerodp's step k (docs/mixed-precision.md)."""
    from zerodp.config import SchedulerConfig
    from zerodp.runtime.schedulers import build_scheduler

    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.2)
    sched = build_scheduler(SchedulerConfig(type=kind, params=params), opt)
    got = []
    for _ in range(10):
        got.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert got == pytest.approx([deepspeed_lr(kind, params, 0.2, t) for t in range(10)], abs=1e-12)


def test_init_distributed_leaves_environment_alone() -> None:
    """A world of one for a plain script must not make later code think it runs under torchrun."""
    import os

    zerodp.init_distributed()
    assert "RANK" not in os.environ and "WORLD_SIZE" not in os.environ


def test_consolidate_names_a_missing_directory(tmp_path) -> None:
    from zerodp.checkpoint import CheckpointError, consolidate

    with pytest.raises(CheckpointError, match="does not exist"):
        consolidate(tmp_path / "nope", tmp_path / "out.safetensors")
    with pytest.raises(CheckpointError, match="--tag"):
        consolidate(tmp_path, tmp_path / "out.safetensors")


def test_scheduler_warmup_longer_than_total_refused() -> None:
    with pytest.raises(ConfigError, match=r"warmup_num_steps \(10\) must not exceed total_num_steps \(5\)"):
        load_config({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10, "total_num_steps": 5}}})


def _numeric_leaves(model: type, prefix: tuple = ()) -> list[tuple[tuple, object]]:
    """(key path, a valid base value) for every int/float field of ``model``, nested models included."""
    import types
    from typing import Union, get_args, get_origin

    from pydantic import BaseModel

    out = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        subs = [a for a in (ann, *get_args(ann)) if isinstance(a, type) and issubclass(a, BaseModel)]
        if subs:
            out += _numeric_leaves(subs[0], prefix + (name,))
        elif ann in (int, float) or (get_origin(ann) in (Union, types.UnionType) and {int, float} & set(get_args(ann))):
            out.append((prefix + (name,), None))
    return out


def _nest(path: tuple, value: object, base: dict) -> dict:
    cfg = json.loads(json.dumps(base))
    d = cfg
    for k in path[:-1]:
        d = d.setdefault(k, {})
    d[path[-1]] = value
    return cfg


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_numbers_refused_in_every_field(bad: float) -> None:
    from zerodp.config import SCHEDULER_PARAMS, ZeroDPConfig

    base = {"optimizer": {"type": "AdamW"}}
    cases = [(p, _nest(p, bad, base)) for p, _ in _numeric_leaves(ZeroDPConfig)]
    cases.append((("optimizer", "params", "betas"), _nest(("optimizer", "params", "betas"), [0.9, bad], base)))
    for stype, model in SCHEDULER_PARAMS.items():
        params = {"total_num_steps": 10, "warmup_num_steps": 5} if "total_num_steps" in model.model_fields else {}
        for (name,), _ in _numeric_leaves(model):
            cases.append(
                (("scheduler", "params", name), {"scheduler": {"type": stype, "params": {**params, name: bad}}})
            )
    assert len(cases) > 20  # every numeric key of the schema was tried
    if bad == float("inf"):  # DeepSpeed (and accelerate) use steps_per_print inf for "never print"
        cases = [(p, c) for p, c in cases if p != ("steps_per_print",)]
        assert load_config({"steps_per_print": bad}).steps_per_print is None
    for path, cfg in cases:
        with pytest.raises(ConfigError) as exc:
            load_config(cfg)
        msg = str(exc.value)
        assert ".".join(path) in msg and "finite number" in msg, (path, msg)


def test_infinity_in_a_json_file_refused(tmp_path) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text('{"optimizer": {"type": "AdamW", "params": {"lr": Infinity}}}')
    with pytest.raises(ConfigError, match=r"'optimizer.params.lr': Input should be a finite number \(got inf\)"):
        load_config(str(path))


@pytest.mark.parametrize(
    "opt, reference",
    [
        ({"type": "Adam", "params": {"lr": 0.1, "weight_decay": 0.5}}, (torch.optim.AdamW, {"weight_decay": 0.5})),
        ({"type": "AdamW", "params": {"lr": 0.1}}, (torch.optim.AdamW, {"weight_decay": 0.0})),
        (
            {"type": "Adam", "params": {"lr": 0.1, "weight_decay": 0.5, "adam_w_mode": False}},
            (torch.optim.Adam, {"weight_decay": 0.5}),
        ),
    ],
)
def test_optimizer_section_means_what_deepspeed_means(opt, reference) -> None:
    """One meaning of the optimizer section for zerodp.initialize and zerodp.deepspeed.initialize:
    DeepSpeed's (Adam = AdamW unless adam_w_mode is false; weight_decay default 0)."""
    import zerodp.deepspeed

    def one_step(build) -> torch.Tensor:
        torch.manual_seed(0)
        model = nn.Linear(3, 2)
        step = build(model)
        loss = model(torch.ones(1, 3)).sum()
        step(loss)
        return model.weight.detach().clone()

    def ours(model):
        engine = zerodp.initialize(model, {"train_micro_batch_size_per_gpu": 1, "optimizer": opt})
        return lambda loss: (engine.backward(loss), engine.step())

    def dropin(model):
        engine, *_ = zerodp.deepspeed.initialize(
            model=model, config={"train_micro_batch_size_per_gpu": 1, "optimizer": opt}
        )
        return lambda loss: (engine.backward(loss), engine.step())

    def torch_reference(model):
        ref = reference[0](model.parameters(), lr=0.1, **reference[1])
        return lambda loss: (loss.backward(), ref.step())

    want = one_step(torch_reference)
    torch.testing.assert_close(one_step(ours), want, rtol=0, atol=0)
    torch.testing.assert_close(one_step(dropin), want, rtol=0, atol=0)
