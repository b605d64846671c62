"""The settings of ``zerodp train``: the flag defaults (:data:`DEFAULTS`), the engine config made from
the flags or read from ``--config`` (:func:`engine_config_from_flags`), and one :class:`RunSettings`
per run (:func:`resolve_settings`), which every rank and the launcher resolve the same way."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from zerodp.app.model import GPTConfig
from zerodp.config import ZeroDPConfig, load_config


@dataclass(frozen=True)
class TrainDefaults:
    """Defaults of ``zerodp train`` flags (the single place they are set; the CLI shows them).

    Sized so that 2 ranks at ZeRO stage 2 on a 2-core CPU finish in about two minutes.

    Two engine settings are chosen for this small model (842,496 parameters) rather than DeepSpeed's
    defaults, so that the memory table shows what the stage partitions:

    - ``stage2_reduce_bucket_size`` (stage 2 only): gradient buckets of 200,000 elements instead of
      5e8 (one bucket of the whole model), so backward holds less gradient memory at once (peak
      gradients+buffers 4.07 MB instead of 5.05 MB on 2 ranks, measured over 40 steps);
    - ``stage3_param_persistence_threshold`` (stage 3 only): parameters of at most 1,024 elements
      (biases, LayerNorm weights) stay gathered; DeepSpeed's 1e5 would keep every parameter of the
      default model whole, i.e. nothing would be partitioned; and ``stage3_prefetch_bucket_size``
      50,000 / ``stage3_max_live_parameters`` 150,000 elements, so at most a few blocks are gathered
      at once instead of the whole model (DeepSpeed's 5e7 / 1e9 exceed this model's size).
    """

    nproc: int = 2
    stage: int = 2
    steps: int = 500
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    seq_len: int = 128
    micro_batch: int = 16
    grad_accum: int = 1
    lr: float = 2e-3
    seed: int = 0
    eval_batches: int = 8
    sample_tokens: int = 200
    prompt: str = "The "
    temperature: float = 0.8
    gradient_clipping: float = 1.0
    stage2_reduce_bucket_size: int = 200_000
    stage3_param_persistence_threshold: int = 1024
    stage3_prefetch_bucket_size: int = 50_000
    stage3_max_live_parameters: int = 150_000
    save_dir: str = "checkpoints"
    save_every: int = 0


DEFAULTS = TrainDefaults()


@dataclass(frozen=True)
class RunSettings:
    """Fully resolved settings of one run (flags, config file and defaults merged)."""

    engine_config: ZeroDPConfig
    model: GPTConfig
    data: str | None
    steps: int
    seed: int
    eval_batches: int
    sample_tokens: int
    prompt: str
    temperature: float
    save_dir: str = DEFAULTS.save_dir
    save_every: int = DEFAULTS.save_every
    resume: bool = False
    resume_tag: str | None = None  # --resume-tag: this checkpoint instead of 'latest' (implies resume)

    @property
    def precision(self) -> str:
        """``fp32``, ``bf16`` or ``fp16`` (the module's parameter dtype)."""
        e = self.engine_config
        return "bf16" if e.bf16.enabled else "fp16" if e.fp16.enabled else "fp32"


#: engine flags that ``--config`` excludes (the file sets them).
ENGINE_FLAGS = (
    "stage",
    "lr",
    "micro_batch",
    "grad_accum",
    "bf16",
    "fp16",
    "offload_optimizer",
    "offload_param",
    "nvme_path",
)


def _pick(args: argparse.Namespace, name: str) -> Any:
    value = getattr(args, name, None)
    return getattr(DEFAULTS, name) if value is None else value


def engine_config_from_flags(args: argparse.Namespace) -> dict[str, Any]:
    """DeepSpeed-style config dict built from ``--stage --lr --micro-batch --grad-accum --seed --bf16
    --fp16`` (stage 2 adds ``reduce_bucket_size``, stage 3 ``stage3_param_persistence_threshold``, from
    :data:`DEFAULTS`)."""
    stage = _pick(args, "stage")
    zero: dict[str, Any] = {"stage": stage}
    if stage == 2:
        zero["reduce_bucket_size"] = DEFAULTS.stage2_reduce_bucket_size
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = DEFAULTS.stage3_param_persistence_threshold
        zero["stage3_prefetch_bucket_size"] = DEFAULTS.stage3_prefetch_bucket_size
        zero["stage3_max_live_parameters"] = DEFAULTS.stage3_max_live_parameters
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": _pick(args, "micro_batch"),
        "gradient_accumulation_steps": _pick(args, "grad_accum"),
        "optimizer": {"type": "AdamW", "params": {"lr": _pick(args, "lr"), "betas": [0.9, 0.95], "weight_decay": 0.0}},
        "zero_optimization": zero,
        "gradient_clipping": DEFAULTS.gradient_clipping,
        "seed": _pick(args, "seed"),
    }
    for precision in ("bf16", "fp16"):
        if getattr(args, precision, None):
            config[precision] = {"enabled": True}
    device = getattr(args, "offload_optimizer", None)
    nvme_path = getattr(args, "nvme_path", None)
    param_device = getattr(args, "offload_param", None)
    if nvme_path is not None and "nvme" not in (device, param_device):
        raise ValueError("--nvme-path needs --offload-optimizer nvme or --offload-param nvme")
    if device is not None:
        zero["offload_optimizer"] = {"device": device, **({"nvme_path": nvme_path} if nvme_path else {})}
    if param_device is not None:
        zero["offload_param"] = {"device": param_device, **({"nvme_path": nvme_path} if nvme_path else {})}
    return config


def resolve_settings(args: argparse.Namespace) -> RunSettings:
    """Merge flags (``None`` = not given), the ``--config`` file and :data:`DEFAULTS`.

    With ``--config``, the engine settings (stage, optimizer, batch sizes, precision) come from the
    file and ``--stage/--lr/--micro-batch/--grad-accum/--bf16/--fp16/--offload-optimizer/--offload-param/
    --nvme-path`` must not be given; ``--seed``
    defaults to the file's ``seed`` if it has one.

    Raises:
        ValueError: ``--config`` combined with an engine flag, ``--bf16`` with ``--fp16``, or an
            invalid model shape.
        zerodp.ConfigError: invalid config file, or one that gives no batch size (neither
            ``train_micro_batch_size_per_gpu`` nor ``train_batch_size``: no flag default replaces it).
    """
    if getattr(args, "bf16", None) and getattr(args, "fp16", None):
        raise ValueError("--bf16 and --fp16 exclude each other")
    config_path = getattr(args, "config", None)
    if config_path is not None:
        clash = [f"--{n.replace('_', '-')}" for n in ENGINE_FLAGS if getattr(args, n, None) not in (None, False)]
        if clash:
            raise ValueError(
                f"--config sets the engine; do not combine it with {', '.join(clash)} "
                f"(put those values in the config file instead)"
            )
        engine_config = load_config(config_path).require_batch_size(f"--config {config_path}")
        seed = (
            args.seed
            if getattr(args, "seed", None) is not None
            else (engine_config.seed if engine_config.seed is not None else DEFAULTS.seed)
        )
    else:
        engine_config = load_config(engine_config_from_flags(args))
        seed = _pick(args, "seed")
    prompt = _pick(args, "prompt")
    if not prompt:
        raise ValueError("--prompt must not be empty")
    model = GPTConfig(
        n_layer=_pick(args, "n_layer"),
        n_head=_pick(args, "n_head"),
        d_model=_pick(args, "d_model"),
        seq_len=_pick(args, "seq_len"),
    )
    return RunSettings(
        engine_config=engine_config,
        model=model,
        data=getattr(args, "data", None),
        steps=_pick(args, "steps"),
        seed=seed,
        eval_batches=_pick(args, "eval_batches"),
        sample_tokens=_pick(args, "sample_tokens"),
        prompt=prompt,
        temperature=_pick(args, "temperature"),
        save_dir=_pick(args, "save_dir"),
        save_every=_pick(args, "save_every"),
        resume=bool(getattr(args, "resume", False)) or getattr(args, "resume_tag", None) is not None,
        resume_tag=getattr(args, "resume_tag", None),
    )


__all__ = ["DEFAULTS", "ENGINE_FLAGS", "RunSettings", "TrainDefaults", "engine_config_from_flags", "resolve_settings"]
