"""The ``zerodp`` command line: ``zerodp train`` and ``zerodp estimate``.

``zerodp train`` outside a torchrun-launched process re-launches itself through torch's own launcher,
``python -m torch.distributed.run --nproc-per-node N [--standalone | rendezvous flags] -m zerodp.cli
train ...``, and returns its exit code; inside one (``RANK`` or ``LOCAL_RANK`` set) it runs
:func:`zerodp.train.run_worker`.

``zerodp estimate --params P --dp N`` prints the ZeRO paper's per-rank model-state memory and per-step
traffic for stages 0-3 (:func:`zerodp.accounting.estimate_table`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
from typing import Callable, Optional, Sequence, get_args

from zerodp import accounting
from zerodp.config import ZeroConfig
from zerodp.model import GPTConfig, count_parameters
from zerodp.train import DEFAULTS

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

#: ``zerodp train`` options forwarded to every worker: dest -> flag.
WORKER_FLAGS = {
    "stage": "--stage", "config": "--config", "data": "--data", "steps": "--steps",
    "n_layer": "--n-layer", "n_head": "--n-head", "d_model": "--d-model", "seq_len": "--seq-len",
    "micro_batch": "--micro-batch", "grad_accum": "--grad-accum", "lr": "--lr", "seed": "--seed",
    "eval_batches": "--eval-batches", "sample_tokens": "--sample-tokens", "prompt": "--prompt",
    "temperature": "--temperature",
}


def _int_at_least(lo: int) -> Callable[[str], int]:
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


def build_parser() -> argparse.ArgumentParser:
    """The ``zerodp`` argument parser (subcommands ``train`` and ``estimate``)."""
    parser = argparse.ArgumentParser(prog="zerodp", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="{train,estimate}")

    d = DEFAULTS
    tr = sub.add_parser(
        "train", help="train the byte-level GPT with ZeRO data parallelism and report memory/traffic",
        description="Train a small GPT on stdlib prose (or --data) with N ranks; print held-out loss "
                    "before/after, per-rank memory vs the ZeRO formula, traffic vs 2 Psi and a sample.")
    launch = tr.add_argument_group("launcher (passed to torch.distributed.run)")
    launch.add_argument("--nproc", metavar="N", type=_int_at_least(1), default=d.nproc,
                        help=f"ranks (processes) per node (default {d.nproc})")
    launch.add_argument("--nnodes", metavar="N|MIN:MAX", help="number of nodes, or MIN:MAX (default 1)")
    launch.add_argument("--node-rank", metavar="R", type=_int_at_least(0), help="this node's rank (static rendezvous)")
    launch.add_argument("--master-addr", metavar="HOST", help="address of the node-rank-0 host")
    launch.add_argument("--master-port", metavar="PORT", type=_int_at_least(1), help="port on the master host")
    launch.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="rendezvous host:port (e.g. for --rdzv-backend c10d)")
    launch.add_argument("--rdzv-backend", metavar="NAME", help="rendezvous backend, e.g. c10d or static")
    launch.add_argument("--rdzv-id", metavar="ID", help="job id shared by all nodes")

    eng = tr.add_argument_group("engine (or give them all in --config)")
    eng.add_argument("--stage", type=int, choices=STAGES,
                     help="ZeRO stage: " + ", ".join(f"{k} {accounting.STAGE_NAMES[k]}" for k in STAGES)
                          + f" (default {d.stage})")
    eng.add_argument("--config", metavar="FILE",
                     help="DeepSpeed-style ds_config.json (excludes --stage/--lr/--micro-batch/--grad-accum)")
    eng.add_argument("--micro-batch", metavar="B", type=_int_at_least(1),
                     help=f"sequences per rank per micro-step (default {d.micro_batch})")
    eng.add_argument("--grad-accum", metavar="K", type=_int_at_least(1),
                     help=f"micro-steps per optimizer step (default {d.grad_accum})")
    eng.add_argument("--lr", metavar="LR", type=_float_in(0.0, 10.0), help=f"AdamW learning rate (default {d.lr})")

    run = tr.add_argument_group("run")
    run.add_argument("--data", metavar="FILE", help="UTF-8 text file to train on (default: stdlib prose)")
    run.add_argument("--steps", metavar="N", type=_int_at_least(0), help=f"optimizer steps (default {d.steps})")
    run.add_argument("--seed", metavar="S", type=_int_at_least(0), help=f"model/data/sample seed (default {d.seed})")
    run.add_argument("--eval-batches", metavar="N", type=_int_at_least(1),
                     help=f"held-out batches of (micro batch x ranks) sequences (default {d.eval_batches})")
    run.add_argument("--sample-tokens", metavar="N", type=_int_at_least(0),
                     help=f"bytes to generate after training (default {d.sample_tokens})")
    run.add_argument("--prompt", metavar="TEXT", help=f"generation prompt (default {d.prompt!r})")
    run.add_argument("--temperature", metavar="T", type=_float_in(0.0, 100.0, lo_open=False),
                     help=f"sampling temperature, 0 = greedy (default {d.temperature})")

    mdl = tr.add_argument_group("model")
    mdl.add_argument("--n-layer", metavar="L", type=_int_at_least(1), help=f"transformer blocks (default {d.n_layer})")
    mdl.add_argument("--n-head", metavar="H", type=_int_at_least(1), help=f"attention heads (default {d.n_head})")
    mdl.add_argument("--d-model", metavar="D", type=_int_at_least(1), help=f"model width (default {d.d_model})")
    mdl.add_argument("--seq-len", metavar="T", type=_int_at_least(1), help=f"context length in bytes (default {d.seq_len})")
    tr.set_defaults(handler=_cmd_train, parser=tr)

    es = sub.add_parser(
        "estimate", help="per-rank model-state memory and traffic of ZeRO stages 0-3 (paper formulas)",
        description="Print the ZeRO paper's per-rank model-state memory and per-step traffic.")
    es.add_argument("--params", required=True, metavar="P",
                    help="parameter count (7.5e9, 7500000000), a JSON file of GPTConfig fields, or "
                         "gpt:n_layer=12,d_model=768,n_head=12,seq_len=1024")
    es.add_argument("--dp", type=_int_at_least(1), required=True, metavar="N",
                    help="data-parallel degree N_d (ranks)")
    prec = es.add_mutually_exclusive_group()
    prec.add_argument("--bytes-mixed", dest="fp32", action="store_false",
                      help="mixed-precision Adam: 2+2 bytes param/grad, K = 12 (default)")
    prec.add_argument("--fp32", dest="fp32", action="store_true",
                      help="fp32 Adam: 4+4 bytes param/grad, K = 8")
    es.set_defaults(handler=_cmd_estimate, parser=es, fp32=False)
    return parser


# ---- estimate --------------------------------------------------------------------------------------

_NUMBER = re.compile(r"^[+]?(\d[\d_]*(\.\d*)?|\.\d+)([eE][+-]?\d+)?$")


def parse_params(spec: str) -> tuple[int, Optional[GPTConfig]]:
    """Resolve ``--params`` to ``(Psi, GPTConfig or None)``.

    Accepts a positive count (``7.5e9``, ``7500000000``, ``7_500_000_000``), a path to a JSON object of
    :class:`GPTConfig` fields, or ``gpt:key=value,...`` with GPTConfig fields (omitted ones default).

    Raises:
        ValueError: none of those forms, a non-integral or non-positive count, an unreadable/invalid
            JSON file, or invalid GPTConfig fields.
    """
    s = spec.strip()
    if s.lower().startswith("gpt:"):
        fields: dict[str, object] = {}
        for item in filter(None, (p.strip() for p in s[4:].split(","))):
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"expected key=value in gpt: spec, got {item!r}")
            fields[key.strip()] = _spec_value(value.strip())
        cfg = GPTConfig.from_dict(fields)
        return count_parameters(cfg), cfg
    if _NUMBER.match(s):
        v = float(s.replace("_", ""))
        if not math.isfinite(v) or v < 1 or v != int(v):
            raise ValueError(f"parameter count must be a positive integer, got {spec!r}")
        return int(s.replace("_", "")) if s.replace("_", "").isdigit() else int(v), None
    if os.path.isfile(s) or s.lower().endswith(".json"):
        try:
            with open(s, encoding="utf-8") as f:
                obj = json.load(f)
        except OSError as exc:
            raise ValueError(f"cannot read model config {s!r}: {exc.strerror or exc}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"model config {s!r} is not valid JSON: {exc}") from None
        if not isinstance(obj, dict):
            raise ValueError(f"model config {s!r} must hold a JSON object of GPTConfig fields")
        cfg = GPTConfig.from_dict(obj)
        return count_parameters(cfg), cfg
    raise ValueError(f"expected a parameter count (e.g. 7.5e9), a JSON GPTConfig file or "
                     f"gpt:n_layer=..,d_model=..,n_head=..; got {spec!r}")


def _spec_value(v: str) -> object:
    low = v.lower()
    if low in ("true", "false"):
        return low == "true"
    try:
        return int(v)
    except ValueError:
        pass
    try:
        return float(v)
    except ValueError:
        raise ValueError(f"gpt: spec values must be numbers or true/false, got {v!r}") from None


def _cmd_estimate(args: argparse.Namespace) -> int:
    try:
        numel, cfg = parse_params(args.params)
    except ValueError as exc:
        args.parser.error(f"argument --params: {exc}")
    if cfg is not None:
        print(f"{cfg}: {numel:,} parameters")
    b = accounting.FP32_ADAM if args.fp32 else accounting.MIXED_PRECISION_ADAM
    print(accounting.estimate_table(numel, args.dp, b))
    return 0


# ---- train -----------------------------------------------------------------------------------------

def _inside_torchrun() -> bool:
    return "RANK" in os.environ or "LOCAL_RANK" in os.environ


def launcher_command(args: argparse.Namespace) -> list[str]:
    """The ``torch.distributed.run`` command line that runs ``zerodp train`` workers for ``args``.

    ``--standalone`` is added when the run is single-node (``--nnodes`` unset or 1) and no master or
    rendezvous flag is given. Only flags the user set are forwarded, so workers apply the same
    defaults.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc)]
    launcher = {dest: getattr(args, dest) for dest in LAUNCHER_FLAGS if getattr(args, dest) is not None}
    single_node = str(launcher.get("nnodes", "1")) in ("1", "1:1")
    if single_node and not set(launcher) - {"nnodes"}:
        cmd.append("--standalone")
    for dest, value in launcher.items():
        cmd += [LAUNCHER_FLAGS[dest], str(value)]
    cmd += ["-m", "zerodp.cli", "train"]
    for dest, flag in WORKER_FLAGS.items():
        value = getattr(args, dest)
        if value is not None:
            cmd += [f"{flag}={value}"]
    return cmd


def _cmd_train(args: argparse.Namespace) -> int:
    from zerodp import train

    # Fail fast, before any process starts, on settings that every worker would reject.
    try:
        settings = train.resolve_settings(args)
        if not _inside_torchrun():
            from zerodp import data
            data.load_text(settings.data, min_bytes=data.min_corpus_bytes(settings.model.seq_len))
    except ValueError as exc:
        args.parser.error(str(exc))
    if _inside_torchrun():
        return train.run_worker(args)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default per worker, without its banner
    return subprocess.run(launcher_command(args), env=env).returncode


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``zerodp`` command; returns the process exit code.

    Raises:
        SystemExit: (code 2) on invalid arguments, with argparse's message naming the flag.
    """
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
