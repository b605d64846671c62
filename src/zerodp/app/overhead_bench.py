"""``python -m zerodp.app.overhead_bench``: the host CPU cost of a training step per module, where
compute is negligible (on a GPU this cost decides whether the host keeps ahead of the device).

The model is ``--layers`` x ``nn.Linear(--width, --width)`` (64 x Linear(64, 64) by default) on a batch
of ``--batch`` rows, trained with AdamW on the CPU over gloo, at ``--ranks`` ranks (2). Systems, each
measured in the same run, interleaved over ``--rounds`` rounds so machine drift hits all alike:

- ``plain``: the model alone on each rank, no communication (the floor: autograd, kernels, AdamW);
- ``ddp``: ``DistributedDataParallel``;
- ``fsdp2``: ``fully_shard`` on every Linear, then on the root (torch's FSDP2; runs on gloo/CPU);
- ``zerodp_s0`` .. ``zerodp_s3``: zerodp stages 0-3 (``stage3_param_persistence_threshold: 0``, so
  every Linear is a stage-3 unit, as in FSDP2 per layer; default config otherwise).

DeepSpeed is measured when it imports (``DS_ACCELERATOR=cpu``); otherwise its row says why not.

Per system, the median over rounds of the training thread's CPU time per step (``time.thread_time``:
forward, backward, optimizer step; waits and gloo's own threads excluded) and of the wall time per
step, each divided by the number of Linear modules, in microseconds; the ratios of the CPU figure to
DDP's and to FSDP2's. Rank 0 prints one table and, with ``--json PATH``, writes the figures. Without
torchrun's environment the command launches itself under ``torch.distributed.run`` at ``--ranks``.

Raises ``SystemExit`` (argparse) for a bad argument: a count below its minimum, an unknown system.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import cast

import torch
import torch.distributed as dist
from torch import nn

from zerodp.app.arg_types import int_at_least

SYSTEMS = ("plain", "ddp", "fsdp2", "deepspeed", "zerodp_s0", "zerodp_s1", "zerodp_s2", "zerodp_s3")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m zerodp.app.overhead_bench",
        description="host CPU microseconds per module per training step, zerodp "
        "stages 0-3 next to DDP and FSDP2, on many tiny Linear layers",
    )
    p.add_argument("--layers", type=int_at_least(1), default=64, help="number of Linear modules (64)")
    p.add_argument("--width", type=int_at_least(1), default=64, help="in and out features of each Linear (64)")
    p.add_argument("--batch", type=int_at_least(1), default=4, help="rows per rank and step (4)")
    p.add_argument("--steps", type=int_at_least(1), default=20, help="timed steps per round (20)")
    p.add_argument("--warmup", type=int_at_least(1), default=3, help="untimed steps before them (3)")
    p.add_argument("--rounds", type=int_at_least(1), default=3, help="rounds; the median is reported (3)")
    p.add_argument("--ranks", type=int_at_least(1), default=2, help="ranks launched without torchrun (2)")
    p.add_argument(
        "--systems",
        nargs="+",
        choices=SYSTEMS,
        default=list(SYSTEMS),
        metavar="SYSTEM",
        help=f"systems to measure, of {', '.join(SYSTEMS)} (all)",
    )
    p.add_argument("--json", default=None, metavar="PATH", help="write the figures there (rank 0)")
    return p


def _model(layers: int, width: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


StepFn = Callable[[torch.Tensor], None]


def _build(name: str, layers: int, width: int) -> StepFn:
    """One training step of system ``name`` (raises RuntimeError with the reason when it cannot run)."""
    model = _model(layers, width)
    if name.startswith("zerodp_s"):
        import zerodp

        engine = zerodp.initialize(
            model,
            {
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                "device": "cpu",
                "zero_optimization": {"stage": int(name[-1]), "stage3_param_persistence_threshold": 0},
            },
        )

        def engine_step(x: torch.Tensor) -> None:
            engine.backward(engine(x).square().mean())
            engine.step()

        return engine_step
    if name == "deepspeed":
        try:
            import deepspeed  # noqa: F401
        except ImportError as exc:
            raise RuntimeError(f"deepspeed does not import here ({exc})") from exc
        raise RuntimeError("deepspeed imports, but this benchmark does not build it yet")
    if name == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        module: nn.Module = DistributedDataParallel(model)
    elif name == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            fully_shard(layer)
        module = cast(nn.Module, fully_shard(model))  # the same module, its class now also an FSDPModule
    else:
        module = model
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3)

    def step(x: torch.Tensor) -> None:
        module(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def measure(args: argparse.Namespace) -> dict:
    """Run every system on this rank; returns ``{system: {"cpu_us": ..., "wall_us": ...} or
    {"skipped": reason}}`` (per module per step, medians over rounds)."""
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(1000 + rank)
    xs = [torch.randn(args.batch, args.width, generator=gen) for _ in range(args.warmup + args.steps)]
    cpu: dict[str, list[float]] = {}
    wall: dict[str, list[float]] = {}
    skipped: dict[str, str] = {}
    for _ in range(args.rounds):
        for name in args.systems:
            if name in skipped:
                continue
            try:
                step = _build(name, args.layers, args.width)
            except RuntimeError as exc:
                skipped[name] = str(exc)
                continue
            for x in xs[: args.warmup]:
                step(x)
            dist.barrier()
            c0, w0 = time.thread_time(), time.perf_counter()
            for x in xs[args.warmup :]:
                step(x)
            c1, w1 = time.thread_time(), time.perf_counter()
            per = 1e6 / (args.steps * args.layers)
            cpu.setdefault(name, []).append((c1 - c0) * per)
            wall.setdefault(name, []).append((w1 - w0) * per)
            del step
            dist.barrier()
    out: dict = {}
    for name in args.systems:
        if name in skipped:
            out[name] = {"skipped": skipped[name]}
        else:
            out[name] = {"cpu_us": statistics.median(cpu[name]), "wall_us": statistics.median(wall[name])}
    return out


def with_ratios(figures: dict) -> dict:
    """Adds ``cpu_vs_ddp`` and ``cpu_vs_fsdp2`` (this system's CPU figure over theirs) where both ran."""
    for ref in ("ddp", "fsdp2"):
        base = figures.get(ref, {}).get("cpu_us")
        for row in figures.values():
            if base and "cpu_us" in row:
                row[f"cpu_vs_{ref}"] = row["cpu_us"] / base
    return figures


def table(figures: dict, args: argparse.Namespace, world: int) -> str:
    lines = [
        f"host cost per module per step: {args.layers} x Linear({args.width}, {args.width}), batch {args.batch} "
        f"per rank, {world} ranks (gloo, CPU), {args.steps} steps x {args.rounds} rounds (median)",
        f"{'system':<11} {'cpu_us':>8} {'wall_us':>8} {'cpu/ddp':>8} {'cpu/fsdp2':>9}",
    ]
    for name, row in figures.items():
        if "skipped" in row:
            lines.append(f"{name:<11} skipped: {row['skipped']}")
            continue
        r = [f"{row[k]:.2f}" if k in row else "-" for k in ("cpu_vs_ddp", "cpu_vs_fsdp2")]
        lines.append(f"{name:<11} {row['cpu_us']:8.1f} {row['wall_us']:8.1f} {r[0]:>8} {r[1]:>9}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> None:
    import zerodp

    zerodp.init_distributed()
    figures = with_ratios(measure(args))
    if dist.get_rank() == 0:
        print(table(figures, args, dist.get_world_size()), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(
                    {
                        "args": {k: v for k, v in vars(args).items()},
                        "world_size": dist.get_world_size(),
                        "torch": torch.__version__,
                        "figures": figures,
                    },
                    f,
                    indent=1,
                )
    zerodp.shutdown_distributed()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if "RANK" not in os.environ:  # launch the ranks
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={args.ranks}",
            "-m",
            "zerodp.app.overhead_bench",
            *(sys.argv[1:] if argv is None else argv),
        ]
        return subprocess.call(cmd)
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
