"""Config refusals name the key path and what is allowed (zerodp.config, zerodp.offload.config).

Complements tests/test_config.py (optimizer, batch and scheduler keys, non-finite numbers) with the
precision, offload, aio, guard and activation-checkpointing sections.
"""

from __future__ import annotations

import pytest

from zerodp.config import ConfigError, ZeroDPConfig, load_config

NVME = {"device": "nvme", "nvme_path": "/tmp/x"}


@pytest.mark.parametrize(
    "config, fragments",
    [
        ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, ["bf16.enabled and fp16.enabled", "at most one"]),
        (
            {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp16"}},
            ["data_types.grad_accum_dtype is 'fp16'", "trains in bf16", "allowed: 'fp32' or 'bf16'"],
        ),
        ({"data_types": {"grad_accum_dtype": "bf16"}}, ["trains in fp32", "allowed: 'fp32'"]),
        ({"data_types": {"grad_accum_dtype": "fp8"}}, ["'data_types.grad_accum_dtype'", "'fp32', 'bf16' or 'fp16'"]),
        (
            {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
            ["'zero_optimization.offload_param' (device 'cpu') needs zero_optimization.stage 3", "got stage 2"],
        ),
        (
            {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "overlap_step": True}}},
            ["offload_optimizer.overlap_step", "'nvme'", "got offload_optimizer 'cpu', offload_param 'none'"],
        ),
        (
            {"zero_optimization": {"offload_optimizer": {"device": "nvme"}}},
            ["'zero_optimization.offload_optimizer'", "needs nvme_path"],
        ),
        (
            {"zero_optimization": {"offload_optimizer": {"device": "cpu", "ratio": 0.5}}},
            ["'zero_optimization.offload_optimizer.ratio'", "use 1.0", "0.5"],
        ),
        (
            {"zero_optimization": {"offload_optimizer": {"device": "gpu"}}},
            ["'zero_optimization.offload_optimizer.device'", "'none', 'cpu' or 'nvme'", "'gpu'"],
        ),
        (
            {"zero_optimization": {"offload_optimizer": {"device": "cpu", "pin_memory": "yes"}}},
            ["'zero_optimization.offload_optimizer.pin_memory'", "boolean", "'yes'"],
        ),
        (
            {"zero_optimization": {"offload_optimizer": {**NVME, "buffer_count": 2}}},
            ["'zero_optimization.offload_optimizer.buffer_count'", "greater than or equal to 3"],
        ),
        (
            {"zero_optimization": {"stage": 3, "offload_param": {**NVME, "buffer_size": 1.5}}},
            ["'zero_optimization.offload_param.buffer_size'", "integer", "1.5"],
        ),
        ({"aio": {"block_size": 1000}}, ["'aio.block_size'", "multiple of 4096"]),
        ({"aio": {"queue_dpeth": 8}}, ["unknown key 'aio.queue_dpeth'", "queue_depth"]),
        ({"fp16": {"enabled": True, "hysteresis": 0}}, ["'fp16.hysteresis'", "greater than 0", "(got 0)"]),
        ({"fp16": {"enabled": True, "initial_scale_power": 65}}, ["'fp16.initial_scale_power'", "64"]),
        ({"fp16": {"enabled": True, "min_loss_scale": 0}}, ["'fp16.min_loss_scale'", "greater than 0"]),
        ({"fp16": {"enabled": "true"}}, ["'fp16.enabled'", "expected bool, not a string"]),
        ({"collective_guard": {"timeout_s": 7200}}, ["'collective_guard.timeout_s'", "3600"]),
        (
            {"activation_checkpointing": {"contiguous_memory_optimization": True}},
            ["'activation_checkpointing.contiguous_memory_optimization'", "not implemented", "leave it false"],
        ),
        (
            {"scheduler": {"type": "WarmupLR", "params": {"warmup_max": 0.1}}},
            ["unknown key 'scheduler.params.warmup_max'", "warmup_max_lr"],
        ),
        ({"scheduler": {"type": "OneCycle"}}, ["'scheduler.type'", "'WarmupLR', 'WarmupDecayLR' or 'WarmupCosineLR'"]),
        ({"zero_optimization": {"stage": True}}, ["'zero_optimization.stage'", "not a boolean"]),
        ({"seed": -1}, ["'seed'", "greater than or equal to 0"]),
    ],
)
def test_refusal_names_key_and_allowed(config: dict, fragments: list[str]) -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(config)
    for frag in fragments:
        assert frag in str(exc.value), str(exc.value)


def test_every_offending_key_is_named_at_once() -> None:
    with pytest.raises(ConfigError) as exc:
        load_config({"fp16": {"hysteresis": 0}, "aio": {"thread_count": 0}, "gradient_clipping": -1})
    msg = str(exc.value)
    assert all(k in msg for k in ("'fp16.hysteresis'", "'aio.thread_count'", "'gradient_clipping'")), msg


def test_defaults_and_integral_floats() -> None:
    cfg = load_config(
        {"zero_optimization": {"reduce_bucket_size": 5e8, "stage": 3, "offload_param": {**NVME, "max_in_cpu": 1e9}}}
    )
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000
    assert isinstance(cfg.zero_optimization.offload_param.max_in_cpu, int)
    default = load_config({})
    assert default == ZeroDPConfig() and load_config(default) is default
    assert default.gradient_clipping == 0.0 and default.zero_optimization.stage == 0
    assert not default.zero_optimization.offload_optimizer.enabled
    with pytest.raises(Exception, match="frozen"):
        default.seed = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    "given, world, want",
    [
        ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 4, (4, 2)),
        ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2}, 4, (2, 4)),
        ({"train_batch_size": 8}, 8, (1, 1)),
    ],
)
def test_batch_keys_resolve_per_world_size(given: dict, world: int, want: tuple) -> None:
    cfg = load_config(given).for_world_size(world)
    assert (cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == want


def test_batch_refusals_name_the_keys() -> None:
    with pytest.raises(ConfigError, match=r"train_batch_size=30 is not divisible by gradient_accumulation_steps \(2\)"):
        load_config({"train_batch_size": 30, "gradient_accumulation_steps": 2}).for_world_size(4)
    with pytest.raises(ConfigError, match=r"= 16"):
        load_config(
            {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}
        ).for_world_size(4)
    with pytest.raises(ConfigError, match="'train_micro_batch_size_per_gpu'.*'train_batch_size'"):
        load_config({"gradient_accumulation_steps": 2}).require_batch_size("cfg.json")
