"""``python -m zerodp.app.guard_bench``: the per-step cost of the collective guard, in one run.

Every stage trains the same GPT on the same batches three times over, interleaved over rounds so
machine drift hits all alike: guard off, guard on entry points only (``check_gathers: false``), and
the default (entry points + a stage-3 agreement per module fetch). The table gives the median step
time (forward + backward + optimizer step, seconds), its ratio to the guard-off run of the same stage,
the number of agreements per step and the time spent in them per step (measured by the guard
around its own all-gathers, waiting for slower peers included, so an upper bound on its cost) as a
share of the guard-off median step. Last, the latency of one agreement with the ranks already in step
(``--latency-reps`` back-to-back agreements after a barrier, median of 5 repetitions) and what that
latency times the agreements per step is as a share of each stage's guard-off step: the guard's own
cost, without the waiting for a slower peer that the real collective would do anyway. Run it under torchrun:

    torchrun --standalone --nproc-per-node=2 -m zerodp.app.guard_bench
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import zerodp
from zerodp.app.bench import _batches, _engine_step, add_arguments
from zerodp.app.model import GPT, GPTConfig

VARIANTS: dict[str, dict] = {
    "off": {"enabled": False},
    "calls": {"enabled": True, "check_gathers": False},
    "default": {"enabled": True, "check_gathers": True},
}


def run(args: argparse.Namespace) -> None:
    zerodp.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(n_layer=args.n_layer, n_head=args.n_head, d_model=args.d_model, seq_len=args.seq_len)
    batches = _batches(cfg, args.micro_batch, args.warmup + args.steps, rank, world)
    times: dict[tuple[int, str], list[float]] = {}
    agreements: dict[tuple[int, str], float] = {}
    in_guard: dict[tuple[int, str], list[float]] = {}
    for _ in range(args.rounds):
        for stage in args.stages:
            for name, guard in VARIANTS.items():
                torch.manual_seed(0)
                engine = zerodp.initialize(GPT(cfg), {
                    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                    "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 1000},
                    "collective_guard": guard})
                step = _engine_step(engine)
                for i, (x, y) in enumerate(batches):
                    if i == args.warmup:
                        before = engine.guard.agreements
                    g0 = engine.guard.seconds
                    dist.barrier()
                    t0 = time.perf_counter()
                    step(x, y)
                    dist.barrier()
                    if i >= args.warmup:
                        times.setdefault((stage, name), []).append(time.perf_counter() - t0)
                        in_guard.setdefault((stage, name), []).append(engine.guard.seconds - g0)
                agreements[(stage, name)] = (engine.guard.agreements - before) / args.steps
    latency = _agreement_latency(args.latency_reps)
    if rank == 0:
        params = sum(p.numel() for p in GPT(cfg).parameters())
        print(f"GPT {params:,} parameters, {world} ranks ({dist.get_backend()}), micro-batch "
              f"{args.micro_batch} x {cfg.seq_len} tokens, median of {args.steps * args.rounds} steps")
        print(f"{'stage':<7}{'guard':<10}{'step (s)':>10}{'vs off':>9}{'agreements/step':>17}"
              f"{'in guard (ms/step)':>20}{'share of step':>15}")
        for stage in args.stages:
            base = statistics.median(times[(stage, "off")])
            for name in VARIANTS:
                med = statistics.median(times[(stage, name)])
                g = statistics.median(in_guard[(stage, name)])
                print(f"{stage:<7}{name:<10}{med:>10.4f}{med / base:>8.3f}x{agreements[(stage, name)]:>17.1f}"
                      f"{g * 1e3:>20.3f}{g / base:>14.2%}")
        print(f"agreement latency: {latency * 1e6:.1f} us (median of 5 x {args.latency_reps}, ranks in step)")
        for stage in args.stages:
            base = statistics.median(times[(stage, "off")])
            n = agreements[(stage, "default")]
            print(f"stage {stage}: {n:.0f} agreements/step x {latency * 1e6:.1f} us = "
                  f"{n * latency * 1e3:.3f} ms = {n * latency / base:.2%} of the {base:.4f} s step")
    zerodp.shutdown_distributed()


def _agreement_latency(reps: int) -> float:
    """Seconds per agreement with every rank already in step (the guard's own cost)."""
    from zerodp.runtime.collective_guard import CallSite, CollectiveGuard

    guard = CollectiveGuard(None, timeout_s=60.0)
    site = CallSite("step", "", 0, 0)
    samples = []
    for _ in range(5):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            guard.agree(site)
        samples.append((time.perf_counter() - t0) / reps)
    return statistics.median(samples)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    ap.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--latency-reps", type=int, default=200)
    run(ap.parse_args())
