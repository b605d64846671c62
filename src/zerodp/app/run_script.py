"""``zerodp run [--nproc N] [launcher flags] SCRIPT [ARGS...]``: run an unchanged script that imports
``deepspeed`` (or whose libraries do: HF transformers' ``Trainer(deepspeed=...)``, accelerate) on zerodp.

Outside a torchrun-launched process it starts ``python -m torch.distributed.run --nproc-per-node N
[--standalone | rendezvous flags] -m zerodp.app.run_script SCRIPT ARGS...`` and returns its exit code;
each worker (``python -m zerodp.app.run_script``) registers :mod:`zerodp.deepspeed` as ``deepspeed``
(:func:`zerodp.deepspeed.registration.install`, which refuses where a real DeepSpeed is installed) and
runs SCRIPT as ``__main__`` with ``sys.argv = [SCRIPT, *ARGS]`` and SCRIPT's directory first on
``sys.path``, as ``python SCRIPT ARGS`` would.
"""

from __future__ import annotations

import argparse
import os
import runpy
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any


def add_parser(
    sub: Any, add_launcher_arguments: Callable[[Any], None], torchrun_prefix: Callable[[argparse.Namespace], list[str]]
) -> None:
    """Add the ``run`` subcommand to ``sub`` (argparse subparsers); ``add_launcher_arguments(parser)``
    adds ``--nproc`` and the rendezvous flags (those of ``zerodp train``), ``torchrun_prefix(args)``
    turns them into the ``python -m torch.distributed.run ...`` command (both from zerodp.app.launch)."""
    ru = sub.add_parser(
        "run",
        help="run a DeepSpeed / HF Trainer script on zerodp registered as `deepspeed`",
        description="Launch SCRIPT on N ranks (torch.distributed.run) with zerodp.deepspeed registered as the "
        "`deepspeed` module, so that the script and the libraries it uses (transformers' Trainer "
        "with deepspeed=..., accelerate) run on zerodp without DeepSpeed installed. Refuses where "
        "a real DeepSpeed is installed.",
    )
    add_launcher_arguments(ru)
    ru.add_argument("script", metavar="SCRIPT", help="the Python script to run")
    ru.add_argument("script_args", metavar="ARGS", nargs=argparse.REMAINDER, help="SCRIPT's own arguments")
    ru.set_defaults(handler=command, parser=ru, torchrun_prefix=torchrun_prefix)


def command(args: argparse.Namespace) -> int:
    """``zerodp run``: launch the workers (or, inside torchrun, be one); returns the exit code."""
    if not os.path.isfile(args.script):
        args.parser.error(f"argument SCRIPT: {args.script!r} is not a file")
    if "RANK" in os.environ or "LOCAL_RANK" in os.environ:
        return run_worker(args.script, args.script_args)
    cmd = args.torchrun_prefix(args) + ["-m", "zerodp.app.run_script", args.script, *args.script_args]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default per worker, without its banner
    return subprocess.run(cmd, env=env).returncode


def run_worker(script: str, script_args: Sequence[str]) -> int:
    """Register zerodp as ``deepspeed`` and run ``script`` as ``__main__`` in this process; 0 when it
    returns (its ``SystemExit`` and exceptions propagate)."""
    from zerodp.deepspeed.registration import install

    install()
    sys.argv = [script, *script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m zerodp.app.run_script SCRIPT [ARGS...]`` (what ``zerodp run`` starts on each rank)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print("usage: python -m zerodp.app.run_script SCRIPT [ARGS...]", file=sys.stderr)
        return 2
    return run_worker(argv[0], argv[1:])


if __name__ == "__main__":
    sys.exit(main())
