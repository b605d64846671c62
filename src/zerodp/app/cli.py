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

This module holds the argument parser of every subcommand and the dispatch of ``train`` and ``bench``.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any, get_args

from zerodp.app import checkpoint_cmds, clean_swap, estimate_cmd, launch, run_script
from zerodp.app.train_settings import DEFAULTS
from zerodp.config import ZeroConfig
from zerodp.runtime import accounting

#: ZeRO stages the engine accepts (``zero_optimization.stage`` of :mod:`zerodp.config`).
STAGES: tuple[int, ...] = tuple(get_args(ZeroConfig.model_fields["stage"].annotation))

#: ``zerodp train`` options forwarded to torchrun rather than to the workers: dest -> torchrun flag.
LAUNCHER_FLAGS = {
    "nnodes": "--nnodes",
    "node_rank": "--node-rank",
    "master_addr": "--master-addr",
    "master_port": "--master-port",
    "rdzv_endpoint": "--rdzv-endpoint",
    "rdzv_backend": "--rdzv-backend",
    "rdzv_id": "--rdzv-id",
}

#: ``zerodp train`` options forwarded to every worker: dest -> flag (``True`` values are passed as the
#: bare flag).
WORKER_FLAGS = {
    "stage": "--stage", "config": "--config", "data": "--data", "steps": "--steps",
    "n_layer": "--n-layer", "n_head": "--n-head", "d_model": "--d-model", "seq_len": "--seq-len",
    "micro_batch": "--micro-batch", "grad_accum": "--grad-accum", "lr": "--lr", "seed": "--seed",
    "bf16": "--bf16", "fp16": "--fp16", "offload_optimizer": "--offload-optimizer",
    "offload_param": "--offload-param", "nvme_path": "--nvme-path",
    "eval_batches": "--eval-batches", "sample_tokens": "--sample-tokens", "prompt": "--prompt",
    "temperature": "--temperature", "save_dir": "--save-dir", "save_every": "--save-every",
    "resume": "--resume", "resume_tag": "--resume-tag", "debug": "--debug",
}


def int_at_least(lo: int) -> Callable[[str], int]:
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {s!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {v}")
        return v
    parse.__name__ = f"int>={lo}"
    return parse


def _float_in(lo: float, hi: float, lo_open: bool = True) -> Callable[[str], float]:
    def parse(s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
        if not (math.isfinite(v) and (v > lo if lo_open else v >= lo) and v <= hi):
            raise argparse.ArgumentTypeError(
                f"expected a number in {'(' if lo_open else '['}{lo}, {hi}], got {s}")
        return v
    parse.__name__ = "number"
    return parse


def _add_launcher_arguments(parser: argparse.ArgumentParser) -> None:
    d = DEFAULTS
    launch = parser.add_argument_group("launcher (passed to torch.distributed.run)")
    launch.add_argument("--nproc", metavar="N", type=int_at_least(1), default=d.nproc,
                        help=f"ranks (processes) per node (default {d.nproc})")
    launch.add_argument("--nnodes", metavar="N|MIN:MAX", help="number of nodes, or MIN:MAX (default 1)")
    launch.add_argument("--node-rank", metavar="R", type=int_at_least(0), help="this node's rank (static rendezvous)")
    launch.add_argument("--master-addr", metavar="HOST", help="address of the node-rank-0 host")
    launch.add_argument("--master-port", metavar="PORT", type=int_at_least(1), help="port on the master host")
    launch.add_argument("--rdzv-endpoint", metavar="HOST:PORT",
                        help="rendezvous host:port (e.g. for --rdzv-backend c10d)")
    launch.add_argument("--rdzv-backend", metavar="NAME", help="rendezvous backend, e.g. c10d or static")
    launch.add_argument("--rdzv-id", metavar="ID", help="job id shared by all nodes")


#: help texts of :func:`zerodp.app.bench.add_arguments`'s flags (which it declares without help).
BENCH_HELP = {
    "n_layer": "transformer blocks", "n_head": "attention heads", "d_model": "model width",
    "seq_len": "context length in tokens", "micro_batch": "sequences per rank per step",
    "steps": "timed steps per system and round", "warmup": "untimed steps before them",
    "rounds": "rounds; each rebuilds and runs every system in turn",
    "preset": "model size: tiny (tests), small (~3.3M parameters) or medium (~25M); size flags override it",
    "probe_steps": "untimed steps that measure losses, memory and traffic (>= 2)",
    "only": "comma-separated substrings: run only the systems whose name contains one (DDP always runs)",
    "exclude": "comma-separated substrings: report the systems whose name contains one as skipped",
    "out": "directory for bench.json and the PNG charts",
    "no_plots": "write no charts",
    "no_fresh_rss": "skip the peak-RSS measurement of each system in a process of its own (forked per system and rank)",
    "sweep_ranks": "first probe DDP and zerodp at these world sizes (e.g. 1,2,3,4) for the memory-vs-ranks chart",
    "sweep_from": "bench.json files of such probes to include (set by --sweep-ranks)",
    "offload": "run the stage-2 rows with offload_optimizer cpu and nvme (skipped without it) and print "
               "the NVMe swap bandwidth vs raw direct I/O on the same disk, and the CPU Adam kernels",
    "nvme_path": "directory for the nvme row's swap files (default: a temporary directory)",
    "sub_group_size": "sub_group_size of the nvme row (elements)",
    "device": "where every system runs: cpu, cuda (cuda:LOCAL_RANK, NCCL; refused without CUDA) or auto "
              "(cuda when available); on cuda the table adds peak GPU memory per rank",
}


class _Recorder:
    """Passed to an ``add_arguments(parser)`` function: adds each argument to ``group`` (with a help
    text from ``helps`` and its default) and records its (dest, first option string), so the parsed
    values can be forwarded to the workers."""

    def __init__(self, group: Any, add_arguments: Callable[[Any], None],
                 helps: dict[str, str] | None = None) -> None:
        self.group = group
        self.helps = helps or {}
        self.flags: dict[str, str] = {}
        add_arguments(self)

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        dest = kwargs.get("dest") or args[0].lstrip("-").replace("-", "_")
        if "help" not in kwargs:
            kwargs["help"] = self.helps.get(dest, "")
        if "default" in kwargs and "%(default)" not in kwargs["help"]:
            kwargs["help"] = f"{kwargs['help']} (default %(default)s)".strip()
        if kwargs.get("type") is int and "metavar" not in kwargs:
            kwargs["metavar"] = "N"
        action = self.group.add_argument(*args, **kwargs)
        self.flags[action.dest] = action.option_strings[0]
        return action


def build_parser() -> argparse.ArgumentParser:
    """The ``zerodp`` argument parser (subcommands ``train``, ``consolidate``, ``verify``, ``bench``,
    ``estimate``)."""
    parser = argparse.ArgumentParser(prog="zerodp", description=__doc__.split("\n\n")[0].replace("``", ""))
    sub = parser.add_subparsers(dest="command", required=True,
                                metavar="{train,consolidate,verify,bench,estimate,clean-swap,run}")

    d = DEFAULTS
    tr = sub.add_parser(
        "train", help="train the byte-level GPT with ZeRO data parallelism and report memory/traffic",
        description="Train a small GPT on stdlib prose (or --data) with N ranks; print held-out loss "
                    "before/after, per-rank memory vs the ZeRO formula, traffic vs 2 Psi and a sample.")
    _add_launcher_arguments(tr)

    eng = tr.add_argument_group("engine (or give them all in --config)")
    eng.add_argument("--stage", type=int, choices=STAGES,
                     help="ZeRO stage: " + ", ".join(f"{k} {accounting.STAGE_NAMES[k]}" for k in STAGES)
                          + f" (default {d.stage}). Set from this flag, stage 2 uses reduce_bucket_size "
                          f"{d.stage2_reduce_bucket_size:,} (a lower peak of gradient memory than DeepSpeed's 5e8) and "
                          f"stage 3 stage3_param_persistence_threshold {d.stage3_param_persistence_threshold:,} "
                          "(only biases and LayerNorms stay gathered; DeepSpeed's default 1e5 would keep "
                          "every parameter of the default model whole)")
    eng.add_argument("--config", metavar="FILE",
                     help="DeepSpeed-style ds_config.json; it must give train_micro_batch_size_per_gpu or "
                          "train_batch_size (excludes --stage/--lr/--micro-batch/--grad-accum/"
                          "--bf16/--fp16/--offload-optimizer/--offload-param/--nvme-path)")
    prec = eng.add_mutually_exclusive_group()
    prec.add_argument("--bf16", action="store_const", const=True,
                      help="bfloat16 parameters and gradients, fp32 master weights (config bf16.enabled)")
    prec.add_argument("--fp16", action="store_const", const=True,
                      help="float16 parameters and gradients with dynamic loss scaling, fp32 master "
                           "weights (config fp16.enabled)")
    eng.add_argument("--offload-optimizer", choices=("cpu", "nvme"),
                     help="ZeRO-Offload: fp32 masters, Adam moments and gradients of each rank's partition in "
                          "host memory (cpu) or swap files (nvme); stages 1-3 "
                          "(config zero_optimization.offload_optimizer.device)")
    eng.add_argument("--offload-param", choices=("cpu", "nvme"),
                     help="ZeRO-Infinity: each rank's shard of the stage-3 parameters in host memory (cpu) or a "
                          "swap file (nvme), read back when its module runs; stage 3 "
                          "(config zero_optimization.offload_param.device)")
    eng.add_argument("--nvme-path", metavar="DIR",
                     help="directory for the swap files of --offload-optimizer/--offload-param nvme "
                          "(offload_optimizer.nvme_path, offload_param.nvme_path)")
    eng.add_argument("--micro-batch", metavar="B", type=int_at_least(1),
                     help=f"sequences per rank per micro-step (default {d.micro_batch})")
    eng.add_argument("--grad-accum", metavar="K", type=int_at_least(1),
                     help=f"micro-steps per optimizer step (default {d.grad_accum})")
    eng.add_argument("--lr", metavar="LR", type=_float_in(0.0, 10.0), help=f"AdamW learning rate (default {d.lr})")

    run = tr.add_argument_group("run")
    run.add_argument("--data", metavar="FILE", help="UTF-8 text file to train on (default: stdlib prose)")
    run.add_argument("--steps", metavar="N", type=int_at_least(0), help=f"optimizer steps (default {d.steps})")
    run.add_argument("--seed", metavar="S", type=int_at_least(0), help=f"model/data/sample seed (default {d.seed})")
    run.add_argument("--eval-batches", metavar="N", type=int_at_least(1),
                     help=f"held-out batches of (micro batch x ranks) sequences (default {d.eval_batches})")
    run.add_argument("--sample-tokens", metavar="N", type=int_at_least(0),
                     help=f"bytes to generate after training (default {d.sample_tokens})")
    run.add_argument("--prompt", metavar="TEXT", help=f"generation prompt (default {d.prompt!r})")
    run.add_argument("--temperature", metavar="T", type=_float_in(0.0, 100.0, lo_open=False),
                     help=f"sampling temperature, 0 = greedy (default {d.temperature})")

    ck = tr.add_argument_group("checkpoints")
    ck.add_argument("--save-dir", metavar="DIR", help=f"checkpoint directory (default {d.save_dir}/)")
    ck.add_argument("--save-every", metavar="N", type=int_at_least(0),
                    help=f"save a checkpoint after steps N, 2N, ... and after the last step; 0 = never "
                         f"(default {d.save_every})")
    ck.add_argument("--resume", action="store_const", const=True,
                    help="load the latest checkpoint in --save-dir and train on from its step up to --steps "
                         "(same seed, model and data required; the data continues where it stopped)")
    ck.add_argument("--resume-tag", metavar="TAG",
                    help="like --resume, but load checkpoint TAG in --save-dir (e.g. global_step100) "
                         "instead of 'latest'")

    mdl = tr.add_argument_group("model")
    mdl.add_argument("--n-layer", metavar="L", type=int_at_least(1), help=f"transformer blocks (default {d.n_layer})")
    mdl.add_argument("--n-head", metavar="H", type=int_at_least(1), help=f"attention heads (default {d.n_head})")
    mdl.add_argument("--d-model", metavar="D", type=int_at_least(1), help=f"model width (default {d.d_model})")
    mdl.add_argument("--seq-len", metavar="T", type=int_at_least(1),
                     help=f"context length in bytes (default {d.seq_len})")
    tr.add_argument("--debug", action="store_const", const=True,
                    help="on a failure, print every rank's full traceback (also: environment variable "
                         "ZERODP_DEBUG=1) instead of one line per distinct error")
    from zerodp.app import infinity
    infinity.add_arguments(tr.add_argument_group("scale demo (docs/infinity.md)"))
    tr.set_defaults(handler=_cmd_train, parser=tr)

    co = sub.add_parser(
        "consolidate", help="write a checkpoint's full model weights to one .safetensors/.pt file or HF-style shards",
        description="Assemble the full state dict (fp32, keyed like model.state_dict()) of a zerodp "
                    "checkpoint saved at any stage and world size into one file that loads without "
                    "zerodp (safetensors.torch.load_file or torch.load), or stream it tensor by tensor "
                    "into a directory of HF-style safetensors shards (from_pretrained layout).")
    co.add_argument("checkpoint_dir", metavar="CHECKPOINT_DIR",
                    help="a --save-dir (its 'latest' or --tag is used) or one checkpoint directory")
    co.add_argument("out", metavar="OUT",
                    help="output file, *.safetensors or *.pt/*.pth; or a directory (an existing one, or a name "
                         "without an extension): HF-style "
                         "shards model-0000k-of-0000n.safetensors + model.safetensors.index.json, written "
                         "tensor by tensor (the whole model is never in memory)")
    co.add_argument("--tag", metavar="T", help="checkpoint within CHECKPOINT_DIR (default: 'latest')")
    co.add_argument("--max-shard-size", metavar="SIZE",
                    help="directory output only: bytes per shard at most, e.g. 5GB (default, as HF "
                         "save_pretrained), 500MB, 2GiB")
    co.set_defaults(handler=checkpoint_cmds.run_consolidate, parser=co)

    ve = sub.add_parser(
        "verify", help="check a checkpoint's files and per-tensor CRC-32 checksums without loading it",
        description="Read every file of a zerodp checkpoint, check it against meta.json and every tensor "
                    "against the CRC-32 recorded when it was saved. Exit status 0: intact; 1: not.")
    ve.add_argument("checkpoint_dir", metavar="CHECKPOINT_DIR",
                    help="a --save-dir (its 'latest' or --tag is used) or one checkpoint directory")
    ve.add_argument("--tag", metavar="T", help="checkpoint within CHECKPOINT_DIR (default: 'latest')")
    ve.set_defaults(handler=checkpoint_cmds.run_verify, parser=ve)

    from zerodp.app import bench
    be = sub.add_parser(
        "bench",
        help="zerodp stages 0-3 vs DDP, ZeroRedundancyOptimizer, FSDP2 and DeepSpeed: time, memory, traffic, losses",
        description="zerodp's stages 0-3 against torch DDP, ZeroRedundancyOptimizer, FSDP2 and DeepSpeed "
                    "(when installed) on the same model, batches and seed, in one run via "
                    "torch.distributed.run running python -m zerodp.app.bench: step-time ratios to DDP, "
                    "model-state memory by category, peak RSS, traffic per step and loss agreement; "
                    "a table, OUT/bench.json and PNG charts.")
    _add_launcher_arguments(be)
    be.set_defaults(handler=_cmd_bench, parser=be,
                    bench_flags=_Recorder(be.add_argument_group("benchmark"), bench.add_arguments, BENCH_HELP).flags)

    es = sub.add_parser(
        "estimate", help="per-rank model-state memory and traffic of ZeRO stages 0-3 (paper formulas)",
        description="Print the ZeRO paper's per-rank model-state memory and per-step traffic.")
    es.add_argument("--params", required=True, metavar="P",
                    help="parameter count (7.5e9, 7500000000), a JSON file of GPTConfig fields, or "
                         "gpt:n_layer=12,d_model=768,n_head=12,seq_len=1024")
    es.add_argument("--dp", type=int_at_least(1), required=True, metavar="N",
                    help="data-parallel degree N_d (ranks)")
    prec = es.add_mutually_exclusive_group()
    prec.add_argument("--bytes-mixed", dest="fp32", action="store_false",
                      help="mixed-precision Adam: 2+2 bytes param/grad, K = 12 (default)")
    prec.add_argument("--fp32", dest="fp32", action="store_true",
                      help="fp32 Adam: 4+4 bytes param/grad, K = 8")
    es.add_argument("--grad-accum", type=int_at_least(1), default=1, metavar="K",
                    help="gradient_accumulation_steps: with K > 1, mixed precision accumulates gradients "
                         "in fp32 (4 bytes/element) unless --grad-accum-dtype says otherwise (default 1)")
    es.add_argument("--grad-accum-dtype", choices=("fp32", "bf16", "fp16"), default=None,
                    help="data_types.grad_accum_dtype: the gradient accumulation dtype (default: fp32 "
                         "under mixed precision with --grad-accum > 1, else the parameters' dtype)")
    es.add_argument("--config", metavar="JSON",
                    help="a DeepSpeed/zerodp config: also print the host and NVMe bytes per rank of its offload "
                         "buffers as configured (sized by the engine's own code, zerodp.offload.sizing)")
    es.set_defaults(handler=estimate_cmd.run_estimate, parser=es, fp32=False)
    clean_swap.add_parser(sub)
    run_script.add_parser(sub, _add_launcher_arguments, torchrun_prefix)
    return parser


# ---- train -----------------------------------------------------------------------------------------

def _inside_torchrun() -> bool:
    return "RANK" in os.environ or "LOCAL_RANK" in os.environ


def torchrun_prefix(args: argparse.Namespace) -> list[str]:
    """``python -m torch.distributed.run --nproc-per-node N [--standalone | rendezvous flags]`` for ``args``.

    ``--standalone`` is added when the run is single-node (``--nnodes`` unset or 1) and no master or
    rendezvous flag is given.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc)]
    launcher = {dest: getattr(args, dest) for dest in LAUNCHER_FLAGS if getattr(args, dest) is not None}
    single_node = str(launcher.get("nnodes", "1")) in ("1", "1:1")
    if single_node and not set(launcher) - {"nnodes"}:
        cmd.append("--standalone")
    for dest, value in launcher.items():
        cmd += [LAUNCHER_FLAGS[dest], str(value)]
    return cmd


def _forward(args: argparse.Namespace, flags: dict[str, str]) -> list[str]:
    """``--flag=value`` for every set (not None) option in ``flags``; ``True`` gives the bare flag."""
    out = []
    for dest, flag in flags.items():
        value = getattr(args, dest)
        if value is True:
            out.append(flag)
        elif value is not None and value is not False:
            out.append(f"{flag}={value}")
    return out


def launcher_command(args: argparse.Namespace) -> list[str]:
    """The ``torch.distributed.run`` command line that runs ``zerodp train`` workers for ``args``.

    Only flags the user set are forwarded, so workers apply the same defaults.
    """
    return torchrun_prefix(args) + ["-m", "zerodp.app.cli", "train"] + _forward(args, WORKER_FLAGS)


def bench_command(args: argparse.Namespace) -> list[str]:
    """The ``torch.distributed.run`` command line that runs ``python -m zerodp.app.bench`` for ``args``."""
    return torchrun_prefix(args) + ["-m", "zerodp.app.bench"] + _forward(args, args.bench_flags)


def _launch(cmd: list[str]) -> int:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default per worker, without its banner
    return subprocess.run(cmd, env=env).returncode


def _cmd_train(args: argparse.Namespace) -> int:
    from zerodp.app import infinity, train

    if args.preset == "infinity":
        return infinity.command(args)
    if (args.dry_run or args.states_ratio is not None or args.assume_ram is not None
            or args.assume_disk_free is not None):
        args.parser.error("--dry-run, --states-ratio, --assume-ram and --assume-disk-free go with --preset infinity")

    # Fail fast, before any process starts, on settings that every worker would reject.
    try:
        settings = train.resolve_settings(args)
        if not _inside_torchrun():
            from zerodp.app import data
            text = data.load_text(settings.data, min_bytes=data.min_corpus_bytes(settings.model.seq_len))
            if settings.resume:
                train.check_resume(settings, train.corpus_fingerprint(data.encode(text)))
    except ValueError as exc:
        args.parser.error(str(exc))
    debug = launch.debug_enabled(args.debug)
    if _inside_torchrun():
        try:
            return train.run_worker(args)
        except Exception as exc:
            if debug:
                raise
            launch.report_worker_failure(exc, int(os.environ.get("RANK", "0")))
            return 1
    return launch.run_torchrun(launcher_command(args)[3:], debug)


# ---- bench -----------------------------------------------------------------------------------------

def _cmd_bench(args: argparse.Namespace) -> int:
    from zerodp.app import bench

    try:
        bench.check_arguments(args)
    except ValueError as exc:
        args.parser.error(str(exc))
    if _inside_torchrun():
        bench.run(args)
        return 0
    try:
        if args.sweep_ranks:
            full = torchrun_prefix(args)  # [python, -m, torch.distributed.run, --nproc-per-node, N, ...]
            prefix = full[:3] + full[5:]
            args.sweep_from = bench.run_sweep(args, prefix)
    except (ValueError, RuntimeError) as exc:
        print(f"zerodp bench: error: {exc}", file=sys.stderr)
        return 1
    return subprocess.run(bench_command(args), env=bench.launch_env(args.device)).returncode


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``zerodp`` command; returns the process exit code.

    Raises:
        SystemExit: (code 2) on invalid arguments, with argparse's message naming the flag.
    """
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
