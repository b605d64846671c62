"""``zerodp bench``'s arguments: the model presets, the flags (:func:`add_arguments`, declared
without help; ``zerodp bench --help`` adds it, :mod:`zerodp.app.cli`), and the checks that refuse,
before anything runs, what the benchmark cannot honour (:func:`check_arguments`).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from zerodp.app import bench_device
from zerodp.app.bench_systems import SYSTEMS
from zerodp.app.model import GPTConfig

#: ``--preset`` -> (n_layer, n_head, d_model, seq_len, micro_batch). small is about 3.3M parameters,
#: medium about 25.4M; tiny is for tests.
PRESETS: dict[str, tuple[int, int, int, int, int]] = {
    "tiny": (2, 2, 64, 32, 2),
    "small": (4, 4, 256, 128, 8),
    "medium": (8, 8, 512, 128, 8),
}


def resolve_model(args: argparse.Namespace) -> tuple[GPTConfig, int]:
    """The GPT config and micro-batch of ``--preset``, with any explicit size flag overriding it.

    Raises:
        ValueError: unknown preset (the message lists the allowed ones) or an invalid GPT config.
    """
    if args.preset not in PRESETS:
        raise ValueError(f"--preset must be one of {sorted(PRESETS)}, got {args.preset!r}")
    n_layer, n_head, d_model, seq_len, micro = PRESETS[args.preset]
    pick = lambda v, d: d if v is None else v  # noqa: E731
    cfg = GPTConfig(
        n_layer=pick(args.n_layer, n_layer),
        n_head=pick(args.n_head, n_head),
        d_model=pick(args.d_model, d_model),
        seq_len=pick(args.seq_len, seq_len),
    )
    return cfg, pick(args.micro_batch, micro)


def _names_matching(flag: str, value: str | None) -> list[str]:
    """The comma-separated names of ``--only`` / ``--exclude``, each of which must be part of a
    system's name (as they are matched)."""
    names = [o.strip() for o in (value or "").split(",") if o.strip()]
    for n in names:
        if not any(n in system for system in SYSTEMS):
            raise ValueError(
                f"{flag}: {n!r} is part of no system's name; the systems are "
                f"{', '.join(repr(k) for k in SYSTEMS)} (a part such as 'stage 3' or "
                f"'DeepSpeed' selects every system whose name contains it)"
            )
    return names


def selected_systems(args: argparse.Namespace, systems: list[str]) -> tuple[list[str], list[str]]:
    """The systems ``--only`` keeps (all without it; DDP always, first: every ratio and loss difference
    is taken against it) and the ``--exclude`` names. Empty entries (``"stage 2,"``) select nothing.

    Raises:
        ValueError: an ``--only`` / ``--exclude`` name that is part of no system's name.
    """
    only = _names_matching("--only", args.only)
    names = [n for n in systems if not only or any(o in n for o in only)]
    if "DDP" not in names:
        names.insert(0, "DDP")
    return names, _names_matching("--exclude", args.exclude)


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse, before anything runs, arguments the benchmark cannot honour as given.

    Raises:
        ValueError: a count out of range (``--steps`` and ``--micro-batch`` >= 1, ``--warmup`` and
            ``--rounds`` >= 0, ``--probe-steps`` >= 2, ``--sub-group-size`` >= 1), an invalid model
            size (:class:`~zerodp.app.model.GPTConfig`'s message), an ``--only`` / ``--exclude`` name
            that selects no system, ``--nvme-path`` without ``--offload``, ``--sweep-ranks`` with
            anything but integers >= 1 or inside a torchrun job
            started without the ``zerodp bench`` launcher, or an ``--out`` that cannot be a writable
            directory (it is created here), ``--device cuda`` without CUDA or with ``--offload``.
    """
    for flag, value, least in (
        ("--steps", args.steps, 1),
        ("--warmup", args.warmup, 0),
        ("--rounds", args.rounds, 0),
        ("--sub-group-size", args.sub_group_size, 1),
    ):
        if value < least:
            raise ValueError(
                f"{flag} must be an integer >= {least}, got {value}"
                + (" (0 rounds: nothing is timed, as the --sweep-ranks probes run)" if flag == "--rounds" else "")
            )
    if args.probe_steps < 2:
        raise ValueError(
            f"--probe-steps must be >= 2 (optimizer states exist from the second step), got {args.probe_steps}"
        )
    if args.micro_batch is not None and args.micro_batch < 1:
        raise ValueError(f"--micro-batch must be an integer >= 1 (sequences per rank per step), got {args.micro_batch}")
    bench_device.check_device(args.device, args.offload)
    if args.nvme_path is not None and not args.offload:
        raise ValueError(
            f"--nvme-path {args.nvme_path!r} is used only by the --offload rows; add --offload or drop --nvme-path"
        )
    resolve_model(args)  # GPTConfig refuses invalid sizes, naming the field and what is allowed
    selected_systems(args, list(SYSTEMS))
    if args.sweep_ranks and not args.sweep_from:
        tokens = [t.strip() for t in args.sweep_ranks.split(",") if t.strip()]
        if not tokens or not all(t.isdigit() and int(t) >= 1 for t in tokens):
            raise ValueError(f"--sweep-ranks takes integers >= 1 separated by commas, got {args.sweep_ranks!r}")
        if "LOCAL_RANK" in os.environ:
            raise ValueError(
                "--sweep-ranks runs one torchrun job per world size, which the zerodp bench "
                "launcher starts: run `zerodp bench ... --sweep-ranks ...` (inside a torchrun "
                "job, pass their bench.json files with --sweep-from instead)"
            )
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(
            f"--out {args.out!r} cannot be created as a directory for bench.json and the charts: {exc}"
        ) from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise ValueError(f"--out {args.out!r} is not a writable directory (bench.json and the charts go there)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="small", choices=sorted(PRESETS))
    p.add_argument("--n-layer", type=int, default=None)
    p.add_argument("--n-head", type=int, default=None)
    p.add_argument("--d-model", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--micro-batch", type=int, default=None)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--probe-steps", type=int, default=3)
    p.add_argument("--only", default=None)
    p.add_argument("--exclude", default=None)
    p.add_argument("--out", default="bench_out")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-fresh-rss", action="store_true")
    p.add_argument("--sweep-ranks", default="")
    p.add_argument("--sweep-from", default=None)
    p.add_argument("--offload", action="store_true")
    p.add_argument("--nvme-path", default=None)
    p.add_argument("--sub-group-size", type=int, default=1_000_000)
    p.add_argument("--device", default="cpu", choices=bench_device.DEVICE_CHOICES)


__all__ = ["PRESETS", "add_arguments", "check_arguments", "resolve_model", "selected_systems"]
