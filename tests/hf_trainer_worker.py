"""A tiny GPT-2 trained by HF ``transformers.Trainer`` on 2 gloo ranks: with ``deepspeed=`` an HF-docs
style ZeRO-2 and ZeRO-3 config ("auto" values) on zerodp registered as ``deepspeed``
(``import zerodp.deepspeed.as_deepspeed``, the first import), and the same Trainer without DeepSpeed
(DDP). Each run trains 6 steps saving at step 3; a fresh Trainer then resumes from step 3's checkpoint.
With ``--via-launcher`` the
opt-in line is skipped: the worker runs under ``zerodp run``. Run by tests/test_hf_trainer.py; writes ``rank{r}.json``:
{run: {"ok", "losses", "resumed", ...}}."""

import sys

if "--via-launcher" not in sys.argv:  # else `zerodp run` has registered zerodp as deepspeed already
    import zerodp.deepspeed.as_deepspeed  # noqa: F401  (the opt-in line; before transformers/accelerate)

import argparse  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from accelerate import PartialState  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from zerodp.runtime.training_state import MicroStepOrderWarning  # noqa: E402

VOCAB, SEQ, SAMPLES = 64, 16, 48
STEPS, SAVE_AT, MICRO, GAS, LR, WARMUP = 6, 3, 2, 2, 1e-2, 2

#: HF docs' ZeRO-2 config (https://huggingface.co/docs/transformers/deepspeed), "auto" values kept,
#: offload_optimizer dropped; DeepSpeed's AdamW and WarmupLR sections.
ZERO2 = {
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
    "zero_optimization": {
        "stage": 2,
        "allgather_partitions": True,
        "allgather_bucket_size": 2e8,
        "overlap_comm": True,
        "reduce_scatter": True,
        "reduce_bucket_size": "auto",
        "contiguous_gradients": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}

#: HF docs' ZeRO-3 config, "auto" values kept, offloads dropped; no optimizer/scheduler sections, so
#: the Trainer's own AdamW (weight-decay groups) and linear schedule are used.
ZERO3 = {
    "fp16": {"enabled": "auto"},
    "bf16": {"enabled": "auto"},
    "zero_optimization": {
        "stage": 3,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}


#: ZERO3 with a persistence threshold small enough that zero.Init partitions this tiny model's
#: matrices at construction ("auto" is only resolved, to 10 * hidden size, once training starts)
ZERO3_SMALL_PERSISTENCE = copy.deepcopy(ZERO3)
ZERO3_SMALL_PERSISTENCE["zero_optimization"]["stage3_param_persistence_threshold"] = 100

#: run name -> (DeepSpeed config or None for DDP, whether the optimizers are ZERO2's in torch)
RUNS = {
    "zero2": (ZERO2, False),
    "ddp-warmup": (None, True),
    "zero3": (ZERO3, False),
    "zero3-pretrained": (ZERO3_SMALL_PERSISTENCE, False),
    "ddp": (None, False),
    "zero2-cut": ("cut", False),
}


class Tokens(torch.utils.data.Dataset):
    """Random token rows (seed 0), labels = inputs (the model shifts them)."""

    def __init__(self, samples: int = SAMPLES) -> None:
        self.ids = torch.randint(0, VOCAB, (samples, SEQ), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def build_model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(
        GPT2Config(
            n_layer=2,
            n_embd=32,
            n_head=2,
            vocab_size=VOCAB,
            n_positions=32,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    )


def training_args(out: str, ds_config: dict | None, weight_decay: float) -> TrainingArguments:
    """One Trainer's arguments. DeepSpeed on a machine without an accelerator: accelerate (1.x) gives
    DeepSpeed ranks a process-group backend only for a device (its CPU path disables DeepSpeed), so the
    state is made here with gloo and passed in (``use_configured_state``)."""
    extra: dict[str, Any] = {}
    # a fresh accelerate state per Trainer: accelerate's Accelerator leaves ACCELERATE_USE_DEEPSPEED=true
    # in the environment, which would turn the next (DDP) Trainer of this process into a DeepSpeed one
    os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)
    AcceleratorState._reset_state(reset_partial_state=True)
    if ds_config is None:
        extra["use_cpu"] = not torch.cuda.is_available()
    elif not torch.cuda.is_available():
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"  # as TrainingArguments does around PartialState
        PartialState(backend="gloo")
        del os.environ["ACCELERATE_USE_DEEPSPEED"]
        extra["accelerator_config"] = {"use_configured_state": True}
    return TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=GAS,
        max_steps=STEPS,
        learning_rate=LR,
        weight_decay=weight_decay,
        adam_epsilon=1e-3,
        max_grad_norm=0.5,
        warmup_steps=WARMUP,
        lr_scheduler_type="linear",
        logging_steps=1,
        save_strategy="steps",
        save_steps=SAVE_AT,
        report_to=[],
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
        deepspeed=ds_config,
        **extra,
    )


def warmup_lr_optimizers(model: torch.nn.Module, weight_decay: float) -> tuple:
    """What ZERO2's optimizer/scheduler sections resolve to, in torch: AdamW over every parameter and
    DeepSpeed's WarmupLR (log warmup from 0 to LR over WARMUP steps, then LR)."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-3, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: math.log(t + 1) / math.log(WARMUP) if t < WARMUP else 1.0)
    return opt, sched


class LossLog(TrainerCallback):
    """The losses this Trainer logs ({step: loss}); not those a resumed run inherits in its state."""

    def __init__(self) -> None:
        self.losses: dict[str, float] = {}

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        if logs and "loss" in logs:
            self.losses[str(state.global_step)] = logs["loss"]


def make_model(name: str, out: str) -> GPT2LMHeadModel:
    """``build_model()``; for ``zero3-pretrained``, the same weights through ``from_pretrained`` after
    the TrainingArguments exist, as HF's docs do: transformers then builds it under ``zero.Init``
    (partitioned at construction) and loads the weights with ``GatheredParameters``."""
    if not name.endswith("-pretrained"):
        return build_model()
    d = os.path.join(out, "pretrained")
    if dist.get_rank() == 0 and not os.path.isdir(d):
        build_model().save_pretrained(d)
    dist.barrier()
    model = GPT2LMHeadModel.from_pretrained(d)
    if not hasattr(model.transformer.wte.weight, "ds_id"):
        raise AssertionError("from_pretrained did not build the model under zero.Init")
    return model


def run(out: str, name: str, ds_config: dict | None, warmup_lr: bool) -> dict:
    """Train STEPS steps (checkpoint at SAVE_AT), then resume a fresh Trainer from that checkpoint."""
    weight_decay = 0.1
    d = os.path.join(out, name)
    res: dict[str, Any] = {}
    for key in ("losses", "resumed"):
        targs = training_args(d, ds_config, weight_decay)
        model = make_model(name, out)
        opts = warmup_lr_optimizers(model, weight_decay) if warmup_lr else (None, None)
        log = LossLog()
        trainer = Trainer(model=model, args=targs, train_dataset=Tokens(), optimizers=opts, callbacks=[log])
        trainer.train(resume_from_checkpoint=os.path.join(d, f"checkpoint-{SAVE_AT}") if key == "resumed" else None)
        res[key] = log.losses
        if key == "losses":
            res.update(
                world=targs.world_size,
                wrapped=type(trainer.model_wrapped).__module__,
                ckpt_files=sorted(os.listdir(os.path.join(d, f"checkpoint-{SAVE_AT}"))),
            )
        dist.barrier()
    return res


def cut_window(out: str) -> dict:
    """44 samples: 11 micro-batches per rank and epoch, so accelerate ends the epoch's last
    accumulation window after 1 of GAS micro-batches; zerodp refuses that window by name."""
    targs = training_args(os.path.join(out, "cut"), copy.deepcopy(ZERO2), 0.1)
    trainer = Trainer(model=build_model(), args=targs, train_dataset=Tokens(44))
    try:
        trainer.train()
    except NotImplementedError as e:
        return {"refused": str(e), "steps_done": trainer.state.global_step}
    return {"refused": None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ckpt-dir", required=True)
    ap.add_argument("--stages", default="")  # tests/distributed.py's run_worker passes it; unused
    ap.add_argument("--scenarios", default=",".join(RUNS))
    ap.add_argument("--via-launcher", action="store_true")
    args = ap.parse_args()
    from zerodp.deepspeed.registration import is_installed

    if not is_installed():
        raise AssertionError("zerodp is not registered as deepspeed")
    dist.init_process_group("gloo")
    results: dict[str, dict] = {}
    for name in args.scenarios.split(","):
        cfg, warmup_lr = RUNS[name]
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", RuntimeWarning)
                warnings.simplefilter("always", MicroStepOrderWarning)  # accelerate's protocol orders them right
                res = (
                    cut_window(args.ckpt_dir)
                    if cfg == "cut"
                    else run(args.ckpt_dir, name, copy.deepcopy(cfg), warmup_lr)
                )
            # zerodp's own warnings (e.g. a view of gathered stage-3 values outliving its release)
            res["zerodp_warnings"] = [str(w.message)[:300] for w in caught if "zerodp" in w.filename]
            results[name] = {"ok": True, **res}
        except Exception:  # recorded and asserted on by pytest
            results[name] = {"ok": False, "error": traceback.format_exc()}
        dist.barrier()
    with open(os.path.join(args.out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
