"""How ``zerodp train`` runs torch's launcher and reports worker failures: one line per failure.

The launcher is torch's own (:func:`torch.distributed.run.run` with arguments parsed by
:func:`torch.distributed.run.parse_args`, i.e. ``torchrun``), run in the ``zerodp train`` process. A
worker that raises does not print its traceback: :func:`report_worker_failure` writes
``{"rank", "time", "message"}`` to ``$ZERODP_ERROR_DIR/rank{r}.json`` (a directory
:func:`run_torchrun` creates) and the worker exits with code 1. When the launcher reports the failed
workers (torch's ``ChildFailedError``), :func:`run_torchrun` prints each distinct message once, in the
order the ranks failed, naming the ranks (``zerodp train: error on ranks 0, 1: ...``), plus one line for
every rank that died without a message (a signal, an exit code), and returns 1. torch's own failure
report (its traceback and its log lines) is not printed. Ctrl-C (SIGINT) or SIGTERM prints one line
and returns :data:`INTERRUPTED_EXIT`; the workers print nothing.

With ``--debug`` or ``ZERODP_DEBUG=1`` (see :func:`debug_enabled`) nothing is summarised: workers raise
as usual (a full traceback per rank) and so does the launcher.

The torch.distributed.run command line is built here too: the launcher flags ``zerodp train``,
``bench`` and ``run`` share (:func:`add_launcher_arguments`), ``--standalone`` for a single node
(:func:`torchrun_prefix`) and the flags forwarded to the workers (:func:`forward_flags`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from zerodp.app.arg_types import int_at_least
from zerodp.app.train_settings import DEFAULTS

#: environment variable turning on full tracebacks (any value but "", "0", "false", "no").
DEBUG_ENV = "ZERODP_DEBUG"
#: environment variable naming the directory where workers leave their one-line failure message.
ERROR_DIR_ENV = "ZERODP_ERROR_DIR"
PREFIX = "zerodp train"
#: exit code of a run stopped by SIGINT (Ctrl-C) or SIGTERM, as a shell reports 128 + SIGINT
INTERRUPTED_EXIT = 130


def debug_enabled(flag: bool | None = None) -> bool:
    """True with ``--debug`` (``flag``) or ``ZERODP_DEBUG`` set to a true value."""
    return bool(flag) or os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")


def one_line(exc: BaseException) -> str:
    """``Type: message`` on one line: a multi-line message (e.g. a config error listing several keys)
    is joined with "; " (after a trailing colon, with a space)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    text = ""
    for ln in lines:
        text += ln if not text else (" " if text.endswith(":") else "; ") + ln
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def report_worker_failure(exc: BaseException, rank: int, stream: TextIO = sys.stderr) -> None:
    """Worker side: leave ``exc``'s one-line message for :func:`run_torchrun` (or, when the worker was
    started by a launcher other than ``zerodp train``, print it on ``stream``)."""
    message = one_line(exc)
    directory = os.environ.get(ERROR_DIR_ENV)
    if directory and os.path.isdir(directory):
        path = Path(directory, f"rank{rank}.json")
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"rank": rank, "time": time.time(), "message": message}))
        os.replace(tmp, path)
        return
    print(
        f"{PREFIX}: error on rank {rank}: {message} (--debug or {DEBUG_ENV}=1 for the traceback)",
        file=stream,
        flush=True,
    )


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, sorted(ranks)))}"


def summarize(messages: Sequence[dict], launcher_failures: dict[int, str]) -> list[str]:
    """The lines printed for a failed run.

    Args:
        messages: the workers' ``{"rank", "time", "message"}`` records.
        launcher_failures: global rank -> the launcher's description of a failed worker that left no
            message (exit code or signal).

    Returns:
        one line per distinct message (earliest first, with every rank that reported it), then one per
        distinct launcher description (ranks grouped), then a hint about ``--debug``.
    """
    by_message: dict[str, list[int]] = {}
    for m in sorted(messages, key=lambda m: (m["time"], m["rank"])):
        by_message.setdefault(m["message"], []).append(int(m["rank"]))
    reported = {r for ranks in by_message.values() for r in ranks}
    by_reason: dict[str, list[int]] = {}
    for rank, reason in sorted(launcher_failures.items()):
        if rank not in reported:
            by_reason.setdefault(reason, []).append(rank)
    if by_message:  # ranks stopped by the launcher after another rank's error are not failures
        by_reason = {k: v for k, v in by_reason.items() if "SIGTERM" not in k}
    lines = [f"{PREFIX}: error on {_ranks(r)}: {msg}" for msg, r in by_message.items()]
    lines += [f"{PREFIX}: {_ranks(r)} {reason}" for reason, r in by_reason.items()]
    if not lines:
        lines.append(f"{PREFIX}: the launcher reported a failure but no rank left a message")
    lines.append(f"({PREFIX} --debug or {DEBUG_ENV}=1 prints every rank's traceback)")
    return lines


def _describe(failure: object) -> str:
    code = getattr(failure, "exitcode", None)
    if isinstance(code, int) and code < 0:
        import signal

        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"


def run_torchrun(torchrun_args: Sequence[str], debug: bool, stream: TextIO = sys.stderr) -> int:
    """Run torch's launcher with ``torchrun_args`` (what follows ``python -m torch.distributed.run``)
    in this process; return 0, or 1 after printing :func:`summarize`'s lines on ``stream``.

    Raises:
        Exception: with ``debug``, whatever the launcher raises (torch's ``ChildFailedError`` names the
            failed ranks and their tracebacks are above it).
    """
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default per worker, without its banner
    args = torchrun.parse_args(list(torchrun_args))
    if debug:
        torchrun.run(args)
        return 0
    elastic = logging.getLogger("torch.distributed.elastic")
    saved = elastic.propagate, list(elastic.handlers)
    elastic.propagate, elastic.handlers = False, [logging.NullHandler()]  # its failure log lines
    directory = tempfile.mkdtemp(prefix="zerodp-errors-")
    os.environ[ERROR_DIR_ENV] = directory
    try:
        torchrun.run(args)
        return 0
    except ChildFailedError as exc:
        failures = {int(r): _describe(f) for r, f in exc.failures.items()}
        lines = summarize(_read_messages(directory), failures)
    except (KeyboardInterrupt, SignalException) as exc:  # Ctrl-C or a scheduler's SIGTERM: no traceback
        name = exc.sigval.name if isinstance(exc, SignalException) else "SIGINT"
        print(f"{PREFIX}: interrupted by {name}; the workers were stopped", file=stream, flush=True)
        return INTERRUPTED_EXIT
    except Exception as exc:  # the launcher itself failed (rendezvous, bad flag value)
        lines = [f"{PREFIX}: launcher error: {one_line(exc)}"]
    finally:
        os.environ.pop(ERROR_DIR_ENV, None)
        elastic.propagate, elastic.handlers = saved
        shutil.rmtree(directory, ignore_errors=True)
    for line in lines:
        print(line, file=stream, flush=True)
    return 1


def _read_messages(directory: str) -> list[dict]:
    out = []
    for path in Path(directory).glob("rank*.json"):
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return out


# ---- the torch.distributed.run command line -----------------------------------------------------

#: launcher options forwarded to torchrun rather than to the workers: dest -> torchrun flag.
LAUNCHER_FLAGS = {
    "nnodes": "--nnodes",
    "node_rank": "--node-rank",
    "master_addr": "--master-addr",
    "master_port": "--master-port",
    "rdzv_endpoint": "--rdzv-endpoint",
    "rdzv_backend": "--rdzv-backend",
    "rdzv_id": "--rdzv-id",
}


def add_launcher_arguments(parser: argparse.ArgumentParser, per_gpu: bool = False) -> None:
    """``--nproc`` and the rendezvous flags, in a group of their own (see :data:`LAUNCHER_FLAGS`).
    ``per_gpu``: an unset ``--nproc`` is one rank per GPU on a CUDA machine (:func:`resolve_nproc`)."""
    d = DEFAULTS
    launch = parser.add_argument_group("launcher (passed to torch.distributed.run)")
    launch.add_argument(
        "--nproc",
        metavar="N",
        type=int_at_least(1),
        default=None,
        help=(
            f"ranks (processes) per node (default: one per GPU on a CUDA machine, else {d.nproc})"
            if per_gpu
            else f"ranks (processes) per node (default {d.nproc})"
        ),
    )
    launch.add_argument("--nnodes", metavar="N|MIN:MAX", help="number of nodes, or MIN:MAX (default 1)")
    launch.add_argument("--node-rank", metavar="R", type=int_at_least(0), help="this node's rank (static rendezvous)")
    launch.add_argument("--master-addr", metavar="HOST", help="address of the node-rank-0 host")
    launch.add_argument("--master-port", metavar="PORT", type=int_at_least(1), help="port on the master host")
    launch.add_argument(
        "--rdzv-endpoint", metavar="HOST:PORT", help="rendezvous host:port (e.g. for --rdzv-backend c10d)"
    )
    launch.add_argument("--rdzv-backend", metavar="NAME", help="rendezvous backend, e.g. c10d or static")
    launch.add_argument("--rdzv-id", metavar="ID", help="job id shared by all nodes")


def resolve_nproc(args: argparse.Namespace, per_gpu: bool) -> int:
    """``--nproc`` as given; unset, the number of CUDA devices where ``per_gpu`` and there are some (as
    DeepSpeed's launcher uses every GPU of the node: the engine's ``"auto"`` device is
    ``cuda:LOCAL_RANK``, so more ranks than GPUs would be refused), else ``DEFAULTS.nproc``."""
    if args.nproc is not None:
        return int(args.nproc)
    if per_gpu:
        import torch

        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            return torch.cuda.device_count()
    return DEFAULTS.nproc


def inside_torchrun() -> bool:
    """This process is a worker started by torch.distributed.run (``RANK`` or ``LOCAL_RANK`` set)."""
    return "RANK" in os.environ or "LOCAL_RANK" in os.environ


def torchrun_prefix(args: argparse.Namespace) -> list[str]:
    """``python -m torch.distributed.run --nproc-per-node N [--standalone | rendezvous flags]`` for ``args``.

    ``--standalone`` is added when the run is single-node (``--nnodes`` unset or 1) and no master or
    rendezvous flag is given.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(resolve_nproc(args, False))]
    launcher = {dest: getattr(args, dest) for dest in LAUNCHER_FLAGS if getattr(args, dest) is not None}
    single_node = str(launcher.get("nnodes", "1")) in ("1", "1:1")
    if single_node and not set(launcher) - {"nnodes"}:
        cmd.append("--standalone")
    for dest, value in launcher.items():
        cmd += [LAUNCHER_FLAGS[dest], str(value)]
    return cmd


def forward_flags(args: argparse.Namespace, flags: dict[str, str]) -> list[str]:
    """``--flag=value`` for every set (not None) option in ``flags``; ``True`` gives the bare flag."""
    out = []
    for dest, flag in flags.items():
        value = getattr(args, dest)
        if value is True:
            out.append(flag)
        elif value is not None and value is not False:
            out.append(f"{flag}={value}")
    return out
