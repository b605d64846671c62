"""The ``zerodp`` command line: ``zerodp train``, ``consolidate``, ``verify``, ``bench``, ``estimate``,
``clean-swap`` and ``run`` (a script run with zerodp registered as ``deepspeed``).

``zerodp train`` outside a torchrun-launched process re-launches itself through torch's own launcher,
``torch.distributed.run --nproc-per-node N [--standalone | rendezvous flags] -m zerodp.app.cli train
...`` (run in this process by :func:`zerodp.app.launch.run_torchrun`, which turns failed workers into
one line each); inside one (``RANK`` or ``LOCAL_RANK`` set) it runs :func:`zerodp.app.train.run_worker`.
``zerodp bench`` is launched as ``python -m torch.distributed.run ... -m zerodp.app.bench``.

``zerodp consolidate CHECKPOINT_DIR OUT`` writes a checkpoint's full state dict to one file
(:func:`zerodp.checkpoint.consolidate`) or, when OUT is a directory, streams it into HF-style shards
(:func:`zerodp.checkpoint.sharded_export.export_sharded_safetensors`). ``zerodp verify CHECKPOINT_DIR``
checks a checkpoint's files and per-tensor checksums without loading it into a job (:mod:`zerodp.checkpoint.integrity`).
Both run in :mod:`zerodp.app.checkpoint_cmds`.

``zerodp estimate --params P --dp N`` prints the ZeRO paper's per-rank model-state memory and per-step
traffic for stages 0-3 (:mod:`zerodp.app.estimate_cmd`).

This module holds the argument parser of every subcommand and the dispatch of ``train``; ``bench``'s
parser and dispatch are in :mod:`zerodp.app.bench_cmd`, the torchrun command line in :mod:`zerodp.app.launch`.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any, get_args

from zerodp.app import bench_cmd, checkpoint_cmds, clean_swap, estimate_cmd, launch, run_script
from zerodp.app.arg_types import float_in, int_at_least
from zerodp.app.launch import (
    add_launcher_arguments,
    forward_flags,
    inside_torchrun,
    resolve_nproc,
    torchrun_prefix,
)
from zerodp.app.train_settings import DEFAULTS
from zerodp.config import ZeroConfig
from zerodp.runtime import accounting

#: ZeRO stages the engine accepts (``zero_optimization.stage`` of :mod:`zerodp.config`).
STAGES: tuple[int, ...] = tuple(get_args(ZeroConfig.model_fields["stage"].annotation))

#: ``zerodp train`` options forwarded to every worker: dest -> flag (``True`` values are passed as the
#: bare flag).
WORKER_FLAGS = {
    "stage": "--stage",
    "config": "--config",
    "data": "--data",
    "steps": "--steps",
    "n_layer": "--n-layer",
    "n_head": "--n-head",
    "d_model": "--d-model",
    "seq_len": "--seq-len",
    "micro_batch": "--micro-batch",
    "grad_accum": "--grad-accum",
    "lr": "--lr",
    "seed": "--seed",
    "bf16": "--bf16",
    "fp16": "--fp16",
    "offload_optimizer": "--offload-optimizer",
    "offload_param": "--offload-param",
    "nvme_path": "--nvme-path",
    "eval_batches": "--eval-batches",
    "sample_tokens": "--sample-tokens",
    "prompt": "--prompt",
    "temperature": "--temperature",
    "save_dir": "--save-dir",
    "save_every": "--save-every",
    "resume": "--resume",
    "resume_tag": "--resume-tag",
    "debug": "--debug",
}


def build_parser() -> argparse.ArgumentParser:
    """The ``zerodp`` argument parser (subcommands ``train``, ``consolidate``, ``verify``, ``bench``,
    ``estimate``)."""
    parser = argparse.ArgumentParser(prog="zerodp", description=__doc__.split("\n\n")[0].replace("``", ""))
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="{train,consolidate,verify,bench,estimate,clean-swap,run}"
    )

    d = DEFAULTS
    tr = sub.add_parser(
        "train",
        help="train the byte-level GPT with ZeRO data parallelism and report memory/traffic",
        description="Train a small GPT on stdlib prose (or --data) with N ranks; print held-out loss "
        "before/after, per-rank memory vs the ZeRO formula, traffic vs 2 Psi and a sample.",
    )
    add_launcher_arguments(tr, per_gpu=True)

    eng = tr.add_argument_group("engine (or give them all in --config)")
    eng.add_argument(
        "--stage",
        type=int,
        choices=STAGES,
        help="ZeRO stage: "
        + ", ".join(f"{k} {accounting.STAGE_NAMES[k]}" for k in STAGES)
        + f" (default {d.stage}). Set from this flag, stage 2 uses reduce_bucket_size "
        f"{d.stage2_reduce_bucket_size:,} (a lower peak of gradient memory than DeepSpeed's 5e8) and "
        f"stage 3 stage3_param_persistence_threshold {d.stage3_param_persistence_threshold:,} "
        "(only biases and LayerNorms stay gathered; DeepSpeed's default 1e5 would keep "
        "every parameter of the default model whole)",
    )
    eng.add_argument(
        "--config",
        metavar="FILE",
        help="DeepSpeed-style ds_config.json; it must give train_micro_batch_size_per_gpu or "
        "train_batch_size (excludes --stage/--lr/--micro-batch/--grad-accum/"
        "--bf16/--fp16/--offload-optimizer/--offload-param/--nvme-path)",
    )
    prec = eng.add_mutually_exclusive_group()
    prec.add_argument(
        "--bf16",
        action="store_const",
        const=True,
        help="bfloat16 parameters and gradients, fp32 master weights (config bf16.enabled)",
    )
    prec.add_argument(
        "--fp16",
        action="store_const",
        const=True,
        help="float16 parameters and gradients with dynamic loss scaling, fp32 master weights (config fp16.enabled)",
    )
    eng.add_argument(
        "--offload-optimizer",
        choices=("cpu", "nvme"),
        help="ZeRO-Offload: fp32 masters, Adam moments and gradients of each rank's partition in "
        "host memory (cpu) or swap files (nvme); stages 1-3 "
        "(config zero_optimization.offload_optimizer.device)",
    )
    eng.add_argument(
        "--offload-param",
        choices=("cpu", "nvme"),
        help="ZeRO-Infinity: each rank's shard of the stage-3 parameters in host memory (cpu) or a "
        "swap file (nvme), read back when its module runs; stage 3 "
        "(config zero_optimization.offload_param.device)",
    )
    eng.add_argument(
        "--nvme-path",
        metavar="DIR",
        help="directory for the swap files of --offload-optimizer/--offload-param nvme "
        "(offload_optimizer.nvme_path, offload_param.nvme_path)",
    )
    eng.add_argument(
        "--micro-batch",
        metavar="B",
        type=int_at_least(1),
        help=f"sequences per rank per micro-step (default {d.micro_batch})",
    )
    eng.add_argument(
        "--grad-accum",
        metavar="K",
        type=int_at_least(1),
        help=f"micro-steps per optimizer step (default {d.grad_accum})",
    )
    eng.add_argument("--lr", metavar="LR", type=float_in(0.0, 10.0), help=f"AdamW learning rate (default {d.lr})")

    run = tr.add_argument_group("run")
    run.add_argument("--data", metavar="FILE", help="UTF-8 text file to train on (default: stdlib prose)")
    run.add_argument("--steps", metavar="N", type=int_at_least(0), help=f"optimizer steps (default {d.steps})")
    run.add_argument("--seed", metavar="S", type=int_at_least(0), help=f"model/data/sample seed (default {d.seed})")
    run.add_argument(
        "--eval-batches",
        metavar="N",
        type=int_at_least(1),
        help=f"held-out batches of (micro batch x ranks) sequences (default {d.eval_batches})",
    )
    run.add_argument(
        "--sample-tokens",
        metavar="N",
        type=int_at_least(0),
        help=f"bytes to generate after training (default {d.sample_tokens})",
    )
    run.add_argument("--prompt", metavar="TEXT", help=f"generation prompt (default {d.prompt!r})")
    run.add_argument(
        "--temperature",
        metavar="T",
        type=float_in(0.0, 100.0, lo_open=False),
        help=f"sampling temperature, 0 = greedy (default {d.temperature})",
    )

    ck = tr.add_argument_group("checkpoints")
    ck.add_argument("--save-dir", metavar="DIR", help=f"checkpoint directory (default {d.save_dir}/)")
    ck.add_argument(
        "--save-every",
        metavar="N",
        type=int_at_least(0),
        help=f"save a checkpoint after steps N, 2N, ... and after the last step; 0 = never (default {d.save_every})",
    )
    ck.add_argument(
        "--resume",
        action="store_const",
        const=True,
        help="load the latest checkpoint in --save-dir and train on from its step up to --steps "
        "(same seed, model and data required; the data continues where it stopped)",
    )
    ck.add_argument(
        "--resume-tag",
        metavar="TAG",
        help="like --resume, but load checkpoint TAG in --save-dir (e.g. global_step100) instead of 'latest'",
    )

    mdl = tr.add_argument_group("model")
    mdl.add_argument("--n-layer", metavar="L", type=int_at_least(1), help=f"transformer blocks (default {d.n_layer})")
    mdl.add_argument("--n-head", metavar="H", type=int_at_least(1), help=f"attention heads (default {d.n_head})")
    mdl.add_argument("--d-model", metavar="D", type=int_at_least(1), help=f"model width (default {d.d_model})")
    mdl.add_argument(
        "--seq-len", metavar="T", type=int_at_least(1), help=f"context length in bytes (default {d.seq_len})"
    )
    tr.add_argument(
        "--debug",
        action="store_const",
        const=True,
        help="on a failure, print every rank's full traceback (also: environment variable "
        "ZERODP_DEBUG=1) instead of one line per distinct error",
    )
    from zerodp.app import infinity

    infinity.add_arguments(tr.add_argument_group("scale demo (docs/infinity.md)"))
    tr.set_defaults(handler=_cmd_train, parser=tr)

    co = sub.add_parser(
        "consolidate",
        help="write a checkpoint's full model weights to one .safetensors/.pt file or HF-style shards",
        description="Assemble the full state dict (fp32, keyed like model.state_dict()) of a zerodp "
        "checkpoint saved at any stage and world size into one file that loads without "
        "zerodp (safetensors.torch.load_file or torch.load), or stream it tensor by tensor "
        "into a directory of HF-style safetensors shards (from_pretrained layout).",
    )
    co.add_argument(
        "checkpoint_dir",
        metavar="CHECKPOINT_DIR",
        help="a --save-dir (its 'latest' or --tag is used) or one checkpoint directory",
    )
    co.add_argument(
        "out",
        metavar="OUT",
        help="output file, *.safetensors or *.pt/*.pth; or a directory (an existing one, or a name "
        "without an extension): HF-style "
        "shards model-0000k-of-0000n.safetensors + model.safetensors.index.json, written "
        "tensor by tensor (the whole model is never in memory)",
    )
    co.add_argument("--tag", metavar="T", help="checkpoint within CHECKPOINT_DIR (default: 'latest')")
    co.add_argument(
        "--max-shard-size",
        metavar="SIZE",
        help="directory output only: bytes per shard at most, e.g. 5GB (default, as HF save_pretrained), 500MB, 2GiB",
    )
    co.set_defaults(handler=checkpoint_cmds.run_consolidate, parser=co)

    ve = sub.add_parser(
        "verify",
        help="check a checkpoint's files and per-tensor CRC-32 checksums without loading it",
        description="Read every file of a zerodp checkpoint, check it against meta.json and every tensor "
        "against the CRC-32 recorded when it was saved. Exit status 0: intact; 1: not.",
    )
    ve.add_argument(
        "checkpoint_dir",
        metavar="CHECKPOINT_DIR",
        help="a --save-dir (its 'latest' or --tag is used) or one checkpoint directory",
    )
    ve.add_argument("--tag", metavar="T", help="checkpoint within CHECKPOINT_DIR (default: 'latest')")
    ve.set_defaults(handler=checkpoint_cmds.run_verify, parser=ve)

    bench_cmd.add_parser(sub)

    es = sub.add_parser(
        "estimate",
        help="per-rank model-state memory and traffic of ZeRO stages 0-3 (paper formulas)",
        description="Print the ZeRO paper's per-rank model-state memory and per-step traffic.",
    )
    es.add_argument(
        "--params",
        required=True,
        metavar="P",
        help="parameter count (7.5e9, 7500000000), a JSON file of GPTConfig fields, or "
        "gpt:n_layer=12,d_model=768,n_head=12,seq_len=1024",
    )
    es.add_argument("--dp", type=int_at_least(1), required=True, metavar="N", help="data-parallel degree N_d (ranks)")
    prec = es.add_mutually_exclusive_group()
    prec.add_argument(
        "--bytes-mixed",
        dest="fp32",
        action="store_false",
        help="mixed-precision Adam: 2+2 bytes param/grad, K = 12 (default)",
    )
    prec.add_argument("--fp32", dest="fp32", action="store_true", help="fp32 Adam: 4+4 bytes param/grad, K = 8")
    es.add_argument(
        "--grad-accum",
        type=int_at_least(1),
        default=1,
        metavar="K",
        help="gradient_accumulation_steps: with K > 1, mixed precision accumulates gradients "
        "in fp32 (4 bytes/element) unless --grad-accum-dtype says otherwise; stages 2-3 "
        "communicate every micro-step, counted in the traffic per optimizer step (default 1)",
    )
    es.add_argument(
        "--grad-accum-dtype",
        choices=("fp32", "bf16", "fp16"),
        default=None,
        help="data_types.grad_accum_dtype: the gradient accumulation dtype (default: fp32 "
        "under mixed precision with --grad-accum > 1, else the parameters' dtype)",
    )
    es.add_argument(
        "--config",
        metavar="JSON",
        help="a DeepSpeed/zerodp config: also print the host and NVMe bytes per rank of its offload "
        "buffers as configured (sized by the engine's own code, zerodp.offload.sizing)",
    )
    es.set_defaults(handler=estimate_cmd.run_estimate, parser=es, fp32=False)
    clean_swap.add_parser(sub)
    run_script.add_parser(sub, add_launcher_arguments, torchrun_prefix)
    return parser


# ---- train -----------------------------------------------------------------------------------------


def launcher_command(args: argparse.Namespace) -> list[str]:
    """The ``torch.distributed.run`` command line that runs ``zerodp train`` workers for ``args``.

    Only flags the user set are forwarded, so workers apply the same defaults.
    """
    return torchrun_prefix(args) + ["-m", "zerodp.app.cli", "train"] + forward_flags(args, WORKER_FLAGS)


def train_nproc(args: argparse.Namespace, settings: Any) -> int:
    """``zerodp train``'s ranks per node: ``--nproc``; unset, one per GPU on a CUDA machine unless the
    engine's ``device`` is ``"cpu"`` (``--config``), else 2 (:func:`zerodp.app.launch.resolve_nproc`)."""
    return resolve_nproc(args, per_gpu=settings.engine_config.device != "cpu")


def _cmd_train(args: argparse.Namespace) -> int:
    from zerodp.app import infinity, train

    if args.preset == "infinity":  # runs on the CPU: --nproc defaults to 2
        args.nproc = resolve_nproc(args, per_gpu=False)
        return infinity.command(args)
    if (
        args.dry_run
        or args.states_ratio is not None
        or args.assume_ram is not None
        or args.assume_disk_free is not None
    ):
        args.parser.error("--dry-run, --states-ratio, --assume-ram and --assume-disk-free go with --preset infinity")

    # Fail fast, before any process starts, on settings that every worker would reject.
    try:
        settings = train.resolve_settings(args)
        args.nproc = train_nproc(args, settings)
        if not inside_torchrun():
            from zerodp.app import data

            need = data.min_corpus_bytes(settings.model.seq_len)
            try:
                text = data.load_text(settings.data, min_bytes=need)
            except ValueError as exc:
                if "at least" not in str(exc):
                    raise
                raise ValueError(
                    f"{exc} for --seq-len {settings.model.seq_len} (the held-out tenth must hold one window of "
                    "seq_len + 1 bytes): use a smaller --seq-len or a longer --data file"
                ) from None
            if settings.resume:
                train.check_resume(settings, train.corpus_fingerprint(data.encode(text)))
    except ValueError as exc:
        args.parser.error(str(exc))
    debug = launch.debug_enabled(args.debug)
    if inside_torchrun():
        try:
            return train.run_worker(args)
        except KeyboardInterrupt:  # Ctrl-C reaches every rank: the launcher prints the one line
            if debug:
                raise
            return launch.INTERRUPTED_EXIT
        except Exception as exc:
            if debug:
                raise
            launch.report_worker_failure(exc, int(os.environ.get("RANK", "0")))
            return 1
    return launch.run_torchrun(launcher_command(args)[3:], debug)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``zerodp`` command; returns the process exit code.

    Raises:
        SystemExit: (code 2) on invalid arguments, with argparse's message naming the flag.
    """
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
