"""zerodp.deepspeed as a DeepSpeed drop-in: a DeepSpeed-style script (tests/ds_script_worker.py) runs at
stages 0-3 on 2 gloo ranks and equals single-process PyTorch; the documented DeepSpeed and HF ZeRO-2/3
configs load; every refusal names what is refused."""

from __future__ import annotations

import argparse
import functools
import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn

import zerodp
import zerodp.checkpointing
import zerodp.deepspeed as deepspeed
from distributed import run_worker
from zerodp.deepspeed.config import fill_auto, resolve_deepspeed_config

WORKER = Path(__file__).with_name("ds_script_worker.py")


@functools.cache
def results() -> list[dict]:
    return run_worker(2, worker=WORKER)


@pytest.mark.parametrize("variant", ["config", "client"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_deepspeed_script_matches_reference(stage: int, variant: str) -> None:
    for rank, res in enumerate(results()):
        r = res[f"stage{stage}_{variant}"]
        assert "error" not in r, r.get("error")
        assert r["compared"] == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
        assert r["err"] <= 1.0, f"rank {rank}: final parameters differ from plain PyTorch (err {r['err']})"
        assert (r["train_batch_size"], r["micro"], r["accum"], r["stage"]) == (8, 2, 2, stage)
        assert (r["bf16"], r["fp16"], r["device"], r["local_rank"]) == (False, False, "cpu", rank)
        assert r["optimizer_is_engines"] and r["scheduler_is_engines"] and r["loader_batches"] == 8
        assert (r["global_steps"], r["global_samples"], r["applied"]) == (4, 32, [True] * 4)
        assert r["mom"] == ([[0.9, 0.99]] if variant == "config" else [0.9])
        assert r["ds_numel"] == ([30, 5, 15, 3] if stage == 3 else None)
        # checkpoints: int tag, pickled client_state, exact resume, DeepSpeed's load options
        assert r["client_state_ok"] and r["steps_after_load"] == 2 and r["resume_err"] == 0.0
        assert r["module_only_keeps_steps"] and r["module_only_keeps_optimizer"]
        assert r["no_opt_keeps_optimizer"] and r["no_opt_loads_steps"]
        assert r["latest"] == "2" and r["save16_keys"]


def test_stage3_max_reuse_distance_keeps_a_reused_unit_gathered() -> None:
    for res in results():
        off, on = res["reuse0"], res["reuse100"]
        assert "error" not in off and "error" not in on, (off.get("error"), on.get("error"))
        assert off["compared"] == on["compared"] == 6
        assert off["err"] <= 1.0 and on["err"] <= 1.0, (off["err"], on["err"])
        # per step after recording: 4 units gathered in forward (shared twice) and 4 in backward; with
        # reuse, shared's second forward use and second backward use are served without a gather
        assert off["reuse_hits"] == 0 and on["reuse_hits"] > 0
        assert on["gathers"] < off["gathers"], (on["gathers"], off["gathers"])


class HFLike(nn.Module):
    """A model with an HF-style ``config.hidden_size``."""

    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.config = type("Cfg", (), {"hidden_size": hidden})()
        self.fc = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


# DeepSpeed's ZeRO tutorial examples (deepspeed.ai/tutorials/zero) and the HF Trainer's documented
# ZeRO-2/ZeRO-3 configs, key for key. The offload_optimizer/offload_param/sub_group_size keys of those
# examples belong to zerodp.offload and are left out here.
DS_ZERO2 = {
    "zero_optimization": {
        "stage": 2,
        "allgather_partitions": True,
        "allgather_bucket_size": 5e8,
        "overlap_comm": False,
        "reduce_scatter": True,
        "reduce_bucket_size": 5e8,
        "contiguous_gradients": True,
    }
}
DS_ZERO3 = {
    "zero_optimization": {
        "stage": 3,
        "contiguous_gradients": True,
        "stage3_max_live_parameters": 1e9,
        "stage3_prefetch_bucket_size": 1e7,
        "stage3_param_persistence_threshold": 1e5,
        "reduce_bucket_size": 1e7,
    }
}
HF_COMMON = {
    "fp16": {
        "enabled": "auto",
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"},
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}
HF_ZERO2 = {
    **HF_COMMON,
    "zero_optimization": {
        "stage": 2,
        "allgather_partitions": True,
        "allgather_bucket_size": 2e8,
        "overlap_comm": True,
        "reduce_scatter": True,
        "reduce_bucket_size": 2e8,
        "contiguous_gradients": True,
    },
}
HF_ZERO3 = {
    **HF_COMMON,
    "zero_optimization": {
        "stage": 3,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
}
TRAINING_ARGS = dict(
    per_device_train_batch_size=4,
    gradient_accumulation_steps=2,
    max_grad_norm=1.0,
    learning_rate=3e-4,
    adam_betas=(0.9, 0.999),
    adam_epsilon=1e-8,
    weight_decay=0.0,
    warmup_steps=10,
)


@pytest.mark.parametrize("config", [DS_ZERO2, DS_ZERO3], ids=["deepspeed-zero2", "deepspeed-zero3"])
def test_deepspeed_tutorial_configs_load(config: dict) -> None:
    cfg = zerodp.load_config(resolve_deepspeed_config(config, nn.Linear(2, 2)))
    assert cfg.zero_optimization.stage == config["zero_optimization"]["stage"]
    assert cfg.zero_optimization.reduce_bucket_size == int(config["zero_optimization"]["reduce_bucket_size"])


@pytest.mark.parametrize("config", [HF_ZERO2, HF_ZERO3], ids=["hf-zero2", "hf-zero3"])
def test_hf_configs_load_once_trainer_arguments_fill_auto(config: dict) -> None:
    raw = resolve_deepspeed_config(fill_auto(config, **TRAINING_ARGS), HFLike(hidden=8))
    cfg = zerodp.load_config(raw).for_world_size(2)
    assert (cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (4, 2)
    assert cfg.optimizer.params.lr == 3e-4 and cfg.gradient_clipping == 1.0
    assert cfg.scheduler.parsed_params().warmup_max_lr == 3e-4 and not cfg.fp16.enabled and not cfg.bf16.enabled
    zc = cfg.zero_optimization
    if zc.stage == 3:  # "auto" from hidden_size, as the HF Trainer fills it
        assert (zc.reduce_bucket_size, zc.stage3_prefetch_bucket_size, zc.stage3_param_persistence_threshold) == (
            64,
            57,
            80,
        )
        assert zc.stage3_gather_16bit_weights_on_model_save


def test_hf_config_without_trainer_arguments_is_refused_naming_each_auto() -> None:
    with pytest.raises(zerodp.ConfigError) as err:
        resolve_deepspeed_config(fill_auto(HF_ZERO2, per_device_train_batch_size=2, learning_rate=1e-3), HFLike())
    msg = str(err.value)
    for key in (
        "optimizer.params.betas",
        "optimizer.params.eps",
        "optimizer.params.weight_decay",
        "scheduler.params.warmup_num_steps",
        "gradient_clipping",
    ):
        assert f"'{key}' is \"auto\"" in msg, msg
    assert "'optimizer.params.lr'" not in msg


@pytest.mark.parametrize(
    "raw, model, fragments",
    [
        (
            {k: "auto" for k in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")},
            HFLike(),
            ['are all "auto"', "set train_micro_batch_size_per_gpu"],
        ),
        (
            {"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}},
            nn.Linear(2, 2),
            ["'zero_optimization.reduce_bucket_size' is \"auto\"", "hidden_size * hidden_size", "Linear"],
        ),
        (
            {"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}}},
            nn.Linear(2, 2),
            ["'scheduler.params.warmup_max_lr'", "set optimizer.params.lr"],
        ),
    ],
)
def test_unresolvable_auto_is_refused(raw: dict, model: nn.Module, fragments: list[str]) -> None:
    with pytest.raises(zerodp.ConfigError) as err:
        resolve_deepspeed_config(raw, model)
    for frag in fragments:
        assert frag in str(err.value), str(err.value)


def test_deepspeed_adam_spellings() -> None:
    def section(opt: dict) -> dict:  # what load_config (shared by zerodp.initialize and the drop-in) reads
        return zerodp.load_config({"optimizer": opt}).optimizer.model_dump(exclude_none=True)

    wmode = section({"type": "Adam", "params": {"adam_w_mode": True, "torch_adam": True}})
    assert wmode == {"type": "AdamW", "params": {"weight_decay": 0.0}}  # DeepSpeed's default decay
    l2 = section({"type": "Adam", "params": {"adam_w_mode": False, "weight_decay": 0.1}})
    assert l2 == {"type": "Adam", "params": {"weight_decay": 0.1, "adam_w_mode": False}}
    assert section(l2) == l2  # validating the result again keeps its meaning
    # DeepSpeed's adam_w_mode defaults to true: a config 'Adam' with weight decay is AdamW (cifar10_deepspeed.py)
    default = section({"type": "Adam", "params": {"lr": 0.001, "weight_decay": 3e-7}})
    assert default == {"type": "AdamW", "params": {"lr": 0.001, "weight_decay": 3e-7}}
    with pytest.raises(zerodp.ConfigError, match="optimizer.params.adam_w_mode must be true or false"):
        section({"type": "Adam", "params": {"adam_w_mode": "yes"}})
    fp = resolve_deepspeed_config({"bf16": {"enabled": "auto"}}, nn.Linear(2, 2).to(torch.bfloat16))
    assert fp["bf16"]["enabled"] is True


def test_single_process_engine_api_and_refusals(tmp_path) -> None:
    model = nn.Linear(3, 2)
    engine, optimizer, loader, sched = deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config={
            "train_micro_batch_size_per_gpu": 2,
            "zero_optimization": {"stage": 2},
            "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.5}},
        },
    )
    assert loader is None and sched is None and isinstance(optimizer, torch.optim.SGD)
    with pytest.raises(AssertionError, match="no_sync context manager is incompatible") as refused:
        with engine.no_sync():
            pass
    for words in ("stage 2", "reduce-scatter", "gradient_accumulation_steps", "Stages 0-1 accept no_sync"):
        assert words in str(refused.value)
    loss = engine(torch.randn(2, 3)).sum()
    with pytest.raises(NotImplementedError, match="retain_graph"):
        engine.backward(loss, retain_graph=True)
    with pytest.raises(NotImplementedError, match="lr_kwargs"):
        engine.step(lr_kwargs={"x": 1})
    engine.set_lr(0.25)
    assert engine.get_lr() == [0.25] and engine.get_mom() == [0.5]
    with pytest.warns(UserWarning, match="no 'latest' file"):
        assert engine.load_checkpoint(tmp_path) == (None, None)
    with pytest.raises(NotImplementedError, match="load_module_strict"):
        engine.load_checkpoint(tmp_path, load_module_strict=False)
    sd = {k: torch.full_like(v, 0.5) for k, v in model.state_dict().items()}
    engine.load_state_dict(sd)
    assert all(torch.equal(v, sd[k]) for k, v in engine.state_dict().items())
    with pytest.raises(KeyError, match="missing keys \\['bias'\\]"):
        engine.load_state_dict({"weight": sd["weight"]})
    assert engine.memory_report().stage == 2  # zerodp's own API through the wrapper


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"mesh_param": (2, 1)}, "mesh_param"),
        ({"optimizer": "client", "config": {"optimizer": {"type": "SGD"}}}, "one of them"),
        pytest.param(
            {"config": {}, "config_params": {}},
            r"more than one config \(config, config_params\)",
            id="config_and_config_params",
        ),
        pytest.param(
            {"args": "file", "config": {"train_batch_size": 4}},
            r"more than one config \(config, args.deepspeed_config='ds.json'\).*drop --deepspeed_config",
            id="args_and_config",
        ),
        pytest.param(
            {"args": "none"},
            r"no config: pass config=.*config_params=.*args.deepspeed_config",
            id="args_without_config",
        ),
        pytest.param({}, r"no config: pass config=.*config_params=.*args.deepspeed_config", id="no_config"),
    ],
)
def test_initialize_refusals(kwargs: dict, match: str) -> None:
    """Each refusal names what is wrong; a config from both ``args.deepspeed_config`` (a launcher's
    ``--deepspeed_config``) and ``config=`` is refused as DeepSpeed does, not one of them dropped."""
    if "args" in kwargs:
        kwargs["args"] = argparse.Namespace(deepspeed_config="ds.json" if kwargs["args"] == "file" else None)
    model = nn.Linear(3, 2)
    if kwargs.get("optimizer") == "client":
        kwargs["optimizer"] = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises((NotImplementedError, zerodp.ConfigError), match=match):
        deepspeed.initialize(model=model, **kwargs)


@pytest.mark.parametrize("config", [{}, {"zero_optimization": {"stage": 2}}, {"gradient_accumulation_steps": 4}])
def test_config_without_batch_size_refused(config) -> None:
    """As DeepSpeed: train_batch_size or train_micro_batch_size_per_gpu must be given (the loader's
    micro-batch would otherwise silently be 1)."""
    with pytest.raises(zerodp.ConfigError) as err:
        deepspeed.initialize(model=nn.Linear(3, 2), config=config)
    assert "gives no batch size" in str(err.value)
    assert "'train_micro_batch_size_per_gpu'" in str(err.value) and "'train_batch_size'" in str(err.value)
    engine, *_ = deepspeed.initialize(model=nn.Linear(3, 2), config={"train_batch_size": 4, **(config or {})})
    assert engine.train_batch_size() == 4  # with either key given the same config is accepted


def test_client_optimizer_refusals() -> None:
    model = nn.Linear(3, 2)
    stepped = torch.optim.Adam(model.parameters())
    model(torch.randn(1, 3)).sum().backward()
    stepped.step()
    with pytest.raises(NotImplementedError, match="already stepped"):
        deepspeed.initialize(model=model, optimizer=stepped, config={"train_batch_size": 1})
    lbfgs = torch.optim.LBFGS(model.parameters())
    with pytest.raises(NotImplementedError, match="LBFGS is not implemented"):
        deepspeed.initialize(model=model, optimizer=lbfgs, config={"train_batch_size": 1})


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"remote_device": "disk"}, "allowed values"),
        ({"mpu": object()}, "mpu"),
        ({"module": nn.Linear(2, 2)}, "module"),
        ({"dtype": torch.bfloat16}, "disagrees"),
        ({"config_dict_or_path": {"zero_optimization": {"stage": 2}}}, "stage 3"),
    ],
)
def test_zero_init_refusals(kwargs: dict, match: str) -> None:
    with pytest.raises((NotImplementedError, ValueError), match=match):  # ConfigError is a ValueError
        deepspeed.zero.Init(**kwargs)


def test_bare_zero_init_partitions_with_ds_attributes() -> None:
    with deepspeed.zero.Init():
        model = nn.Sequential(nn.Linear(400, 300))
    p = model[0].weight
    assert zerodp.zero.is_partitioned(p) and p.ds_numel == 120_000 and tuple(p.ds_shape) == (300, 400)


def test_zero_init_takes_defaults_for_auto_as_deepspeed() -> None:
    """transformers' from_pretrained passes zero.Init the HF ZeRO-3 config before the Trainer filled its
    hidden-size "auto" values: DeepSpeed reads them as defaults (persistence 1e5); so does zerodp."""
    cfg = fill_auto(HF_ZERO3, **TRAINING_ARGS)
    assert cfg["zero_optimization"]["stage3_param_persistence_threshold"] == "auto"
    with deepspeed.zero.Init(config_dict_or_path=cfg) as init:
        model = nn.Sequential(nn.Linear(400, 300), nn.Linear(300, 2))
    assert init.config.zero_optimization.stage3_param_persistence_threshold == 100_000
    assert zerodp.zero.is_partitioned(model[0].weight) and not zerodp.zero.is_partitioned(model[1].weight)
    with deepspeed.zero.Init(config_dict_or_path=HF_ZERO3):  # nothing filled at all: still defaults
        nn.Linear(2, 2)


def test_checkpointing_module_is_zerodps() -> None:
    assert deepspeed.checkpointing.checkpoint is zerodp.checkpointing.checkpoint
    lin = nn.Linear(3, 3)
    x = torch.randn(2, 3, requires_grad=True)
    deepspeed.checkpointing.checkpoint(lin, x).sum().backward()
    assert x.grad is not None


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed")
def test_real_deepspeed_accepts_the_same_tutorial_config() -> None:
    """Interop: the tutorial configs zerodp loads are valid for DeepSpeed's own config parser."""
    import inspect

    from deepspeed.runtime.config import DeepSpeedConfig  # type: ignore

    # the DeepSpeed version this test was written against took world_size=; 0.19.8 has no such
    # parameter (it reads the world size from torch.distributed, 1 without a process group)
    kw = {"world_size": 1} if "world_size" in inspect.signature(DeepSpeedConfig.__init__).parameters else {}
    for cfg in (DS_ZERO2, DS_ZERO3):
        ds = DeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, **cfg}, **kw)
        assert ds.zero_optimization_stage == cfg["zero_optimization"]["stage"]


def test_steps_per_print_and_wall_clock_breakdown_print(capsys) -> None:
    engine, *_ = deepspeed.initialize(
        model=nn.Linear(3, 2),
        config={
            "train_micro_batch_size_per_gpu": 1,
            "steps_per_print": 2,
            "wall_clock_breakdown": True,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        },
    )
    for _ in range(4):
        engine.backward(engine(torch.randn(1, 3)).sum())
        engine.step()
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("[zerodp]")]
    steps = [ln.split(",")[0] for ln in lines if ln.startswith("[zerodp] step=")]
    assert steps == ["[zerodp] step=2", "[zerodp] step=4"]
    assert sum("forward=" in ln and "backward=" in ln for ln in lines) == 2


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop])
def test_client_optimizer_with_param_groups_matches_torch(cls: type) -> None:
    torch.manual_seed(0)
    model, ref = nn.Linear(4, 3), nn.Linear(4, 3)
    ref.load_state_dict(model.state_dict())

    def groups(m: nn.Module) -> list[dict]:
        return [{"params": [m.weight], "weight_decay": 0.1}, {"params": [m.bias], "weight_decay": 0.0, "lr": 0.05}]

    engine, optimizer, _, _ = deepspeed.initialize(
        model=model,
        optimizer=cls(groups(model), lr=0.01),
        config={"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}},
    )
    assert type(optimizer) is cls and [g["lr"] for g in optimizer.param_groups] == [0.01, 0.05]
    opt = cls(groups(ref), lr=0.01)
    for _ in range(3):
        x = torch.randn(2, 4)
        engine.backward(engine(x).pow(2).mean())
        engine.step()
        ref(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    got = engine.state_dict()
    compared = 0
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6)
        compared += 1
    assert compared == 2
