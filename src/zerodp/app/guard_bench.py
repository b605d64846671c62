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
from zerodp.app.bench import make_batches
from zerodp.app.bench_args import add_arguments, resolve_model
from zerodp.app.bench_systems import loss_of
from zerodp.app.model import GPT

VARIANTS: dict[str, dict] = {
    "off": {"enabled": False},
    "calls": {"enabled": True, "check_gathers": False},
    "default": {"enabled": True, "check_gathers": True},
}


def run(args: argparse.Namespace) -> None:
    zerodp.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg, micro = resolve_model(args)
    batches = make_batches(cfg, micro, args.warmup + args.steps, rank, world)
    times: dict[tuple[int, str], list[float]] = {}
    agreements: dict[tuple[int, str], float] = {}
    in_guard: dict[tuple[int, str], list[float]] = {}
    walks: dict[tuple[int, str], list[float]] = {}  # backward-graph reading (plan), every variant
    tags: dict[tuple[int, str], float] = {}  # asynchronous backward tags per step
    for _ in range(args.rounds):
        for stage in args.stages:
            for name, guard in VARIANTS.items():
                torch.manual_seed(0)
                engine = zerodp.initialize(
                    GPT(cfg),
                    {
                        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 1000},
                        "collective_guard": guard,
                        "device": "cpu",
                    },
                )  # a CPU measurement

                def step(x: torch.Tensor, y: torch.Tensor, engine: zerodp.Engine = engine) -> None:
                    engine.backward(loss_of(engine(x)[0], y))
                    engine.step()

                for i, (x, y) in enumerate(batches):
                    if i == args.warmup:
                        before = engine.collective_guard.agreements
                        tags_before = engine.backward_tags.tags_total if engine.backward_tags else 0
                    g0 = engine.collective_guard.seconds
                    w0 = engine.output_roots.seconds
                    dist.barrier()
                    t0 = time.perf_counter()
                    step(x, y)
                    dist.barrier()
                    if i >= args.warmup:
                        times.setdefault((stage, name), []).append(time.perf_counter() - t0)
                        in_guard.setdefault((stage, name), []).append(engine.collective_guard.seconds - g0)
                        walks.setdefault((stage, name), []).append(engine.output_roots.seconds - w0)
                agreements[(stage, name)] = (engine.collective_guard.agreements - before) / args.steps
                tags_total = engine.backward_tags.tags_total if engine.backward_tags else 0
                tags[(stage, name)] = (tags_total - tags_before) / args.steps
    latency = _agreement_latency(args.latency_reps)
    post = _tag_post_cost(args.latency_reps)
    if rank == 0:
        params = sum(p.numel() for p in GPT(cfg).parameters())
        print(
            f"GPT {params:,} parameters, {world} ranks ({dist.get_backend()}), micro-batch "
            f"{micro} x {cfg.seq_len} tokens, median of {args.steps * args.rounds} steps"
        )
        print(
            f"{'stage':<7}{'guard':<10}{'step (s)':>10}{'spread':>16}{'vs off':>9}{'agreements/step':>17}"
            f"{'tags/step':>11}{'in guard (ms/step)':>20}{'share of step':>15}{'graph walk (ms)':>17}"
        )
        for stage in args.stages:
            base = statistics.median(times[(stage, "off")])
            for name in VARIANTS:
                ts = times[(stage, name)]
                med = statistics.median(ts)
                g = statistics.median(in_guard[(stage, name)])
                w = statistics.median(walks[(stage, name)])
                print(
                    f"{stage:<7}{name:<10}{med:>10.4f}{f'{min(ts):.3f}-{max(ts):.3f}':>16}{med / base:>8.3f}x"
                    f"{agreements[(stage, name)]:>17.1f}{tags[(stage, name)]:>11.1f}"
                    f"{g * 1e3:>20.3f}{g / base:>14.2%}{w * 1e3:>17.3f}"
                )
        print(f"agreement latency: {latency * 1e6:.1f} us (median of 5 x {args.latency_reps}, ranks in step)")
        print(f"asynchronous tag: {post * 1e6:.1f} us to post (median of 5 x {args.latency_reps})")
        for stage in args.stages:
            base = statistics.median(times[(stage, "off")])
            n = agreements[(stage, "default")]
            t = tags[(stage, "default")]
            w = statistics.median(walks[(stage, "default")])
            own = n * latency + t * post + w
            print(
                f"stage {stage}: {n:.0f} agreements x {latency * 1e6:.1f} us + {t:.0f} tags x {post * 1e6:.1f} us"
                f" + graph walk {w * 1e3:.3f} ms = {own * 1e3:.3f} ms = {own / base:.2%} of the {base:.4f} s step"
            )
    zerodp.shutdown_distributed()


def _tag_post_cost(reps: int) -> float:
    """Seconds to post one asynchronous backward tag (the main thread's share; the exchange itself
    runs on gloo's thread and is waited for once per backward)."""
    from zerodp.runtime.backward_agreement import BackwardAgreement
    from zerodp.runtime.collective_guard import CollectiveGuard

    guard = CollectiveGuard(None, timeout_s=60.0)
    tags = BackwardAgreement(guard, {}, {})
    samples = []
    for _ in range(5):
        dist.barrier()
        tags.begin(0, 0)
        t0 = time.perf_counter()
        for _ in range(reps):
            tags.note_reduce([(0, 0)])
        samples.append((time.perf_counter() - t0) / reps)
        tags.finish()
        tags.end()
    return statistics.median(samples)


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
