"""The ``zerodp bench`` subcommand: its parser (the benchmark's flags, :mod:`zerodp.app.bench_args`,
with their help texts; the launcher's) and its dispatch (:func:`command`). Outside torchrun it runs the
``--sweep-ranks`` probes (:mod:`zerodp.app.bench_sweep`), then ``python -m zerodp.app.bench`` under
``torch.distributed.run``; inside, this rank's part (:func:`zerodp.app.bench.run`).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from zerodp.app.launch import add_launcher_arguments, forward_flags, inside_torchrun, torchrun_prefix

#: help texts of :func:`zerodp.app.bench_args.add_arguments`'s flags (which it declares without help).
BENCH_HELP = {
    "n_layer": "transformer blocks",
    "n_head": "attention heads",
    "d_model": "model width",
    "seq_len": "context length in tokens",
    "micro_batch": "sequences per rank per step",
    "steps": "timed steps per system and round",
    "warmup": "untimed steps before them",
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

    def __init__(self, group: Any, add_arguments: Callable[[Any], None], helps: dict[str, str] | None = None) -> None:
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


def add_parser(sub: Any) -> None:
    """Add the ``bench`` subcommand to ``sub`` (argparse subparsers)."""
    from zerodp.app import bench_args

    be = sub.add_parser(
        "bench",
        help="zerodp stages 0-3 vs DDP, ZeroRedundancyOptimizer, FSDP2 and DeepSpeed: time, memory, traffic, losses",
        description="zerodp's stages 0-3 against torch DDP, ZeroRedundancyOptimizer, FSDP2 and DeepSpeed "
        "(when installed) on the same model, batches and seed, in one run via "
        "torch.distributed.run running python -m zerodp.app.bench: step-time ratios to DDP, "
        "model-state memory by category, peak RSS, traffic per step and loss agreement; "
        "a table, OUT/bench.json and PNG charts.",
    )
    add_launcher_arguments(be)
    flags = _Recorder(be.add_argument_group("benchmark"), bench_args.add_arguments, BENCH_HELP).flags
    be.set_defaults(handler=command, parser=be, bench_flags=flags)


def bench_command(args: argparse.Namespace) -> list[str]:
    """The ``torch.distributed.run`` command line that runs ``python -m zerodp.app.bench`` for ``args``."""
    return torchrun_prefix(args) + ["-m", "zerodp.app.bench"] + forward_flags(args, args.bench_flags)


def command(args: argparse.Namespace) -> int:
    """``zerodp bench``: refuse bad arguments (status 2), then run this rank's part inside torchrun, or
    the ``--sweep-ranks`` probes and the torchrun job outside it; returns the exit status."""
    from zerodp.app import bench, bench_args, bench_sweep

    try:
        bench_args.check_arguments(args)
    except ValueError as exc:
        args.parser.error(str(exc))
    if inside_torchrun():
        bench.run(args)
        return 0
    try:
        if args.sweep_ranks:
            full = torchrun_prefix(args)  # [python, -m, torch.distributed.run, --nproc-per-node, N, ...]
            prefix = full[:3] + full[5:]
            args.sweep_from = bench_sweep.run_sweep(args, prefix)
    except (ValueError, RuntimeError) as exc:
        print(f"zerodp bench: error: {exc}", file=sys.stderr)
        return 1
    return subprocess.run(bench_command(args), env=bench_sweep.launch_env(args.device)).returncode


__all__ = ["BENCH_HELP", "add_parser", "bench_command", "command"]
