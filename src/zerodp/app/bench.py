"""``zerodp bench``: zerodp's stages side by side with torch DDP, torch ZeroRedundancyOptimizer, FSDP2
and DeepSpeed, in one run, on the same GPT, batches and seed.

Unless ``--no-fresh-rss``, each rank first forks one child per system that trains it alone for
``max(--probe-steps, 3)`` steps and reports its peak RSS (:mod:`zerodp.app.bench_rss`). Then each rank
runs every system of :data:`zerodp.app.bench_systems.SYSTEMS` in two phases:

1. probe (``--probe-steps`` steps, untimed): per-step losses (compared with DDP's), model-state bytes
   by category measured from live storage after the last backward, peak RSS sampled while the system
   is built and trained, and collective traffic per step counted at ``torch.distributed``'s calls
   (:mod:`zerodp.app.bench_measure`);
2. timing: ``--rounds`` rounds, each rebuilding and running every system in turn (ABAB...), with
   ``--warmup`` untimed then ``--steps`` timed steps (barrier before and after each step). A system's
   ratio to DDP is the median over rounds of its median step time over DDP's in the same round.

A system that cannot run here is reported as skipped with the reason. Rank 0 prints a table, writes
``OUT/bench.json`` (:class:`zerodp.app.bench_report.BenchResult`) and, with matplotlib, PNG charts.
``--offload`` adds the rows ``zerodp stage 2 + offload cpu|nvme`` and the swap bandwidth and CPU AdamW
kernels (:mod:`zerodp.app.bench_offload`). ``--sweep-ranks 1,2,3,4`` (launcher side,
:mod:`zerodp.app.bench_sweep`) first probes DDP and zerodp at each world size. The flags and their
checks are :mod:`zerodp.app.bench_args`. ``--device cpu|cuda|auto`` (default cpu) says where every system, its
batches and its timing run, with peak device memory per rank on CUDA (:mod:`zerodp.app.bench_device`).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import zerodp
from zerodp.app import bench_device, bench_offload, bench_rss
from zerodp.app.bench_args import add_arguments, check_arguments, resolve_model, selected_systems
from zerodp.app.bench_device import FRESH_RSS_ON_GPU
from zerodp.app.bench_measure import (
    CATEGORIES,
    RssSampler,
    TrafficCounter,
    live_storage_bytes,
    live_storages,
    release_free_memory,
)
from zerodp.app.bench_report import (
    BenchResult,
    FreshRank,
    RankMemory,
    StepTimes,
    SweepPoint,
    SystemResult,
    Traffic,
    format_table,
    plot_all,
)
from zerodp.app.bench_systems import SYSTEMS, Builder, Skipped, System, offload_systems
from zerodp.app.model import GPTConfig, count_parameters
from zerodp.runtime.accounting import FP32_ADAM, comm_elements_per_step, model_state_bytes

LR = 1e-3
#: fewest training steps of a fresh-process RSS measurement (see _fresh_rss)
FRESH_RSS_STEPS = 3


def make_batches(cfg: GPTConfig, micro: int, n: int, rank: int, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        x = torch.randint(0, cfg.vocab_size, (micro * world, cfg.seq_len + 1), generator=g)
        x = x[rank * micro : (rank + 1) * micro]
        out.append((x[:, :-1].contiguous(), x[:, 1:].contiguous()))
    return out


def _agree_skip(reason: str | None) -> str | None:
    """Every rank's skip reason; a system skipped on any rank is skipped on all."""
    reasons: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(reasons, reason)
    return next((r for r in reasons if r), None)


def _build(
    build: Builder, cfg: GPTConfig, probe: bool, device: torch.device = bench_device.CPU
) -> tuple[System | None, str | None]:
    system, reason = None, None
    try:
        system = build(cfg, LR, probe, device=device)
    except Skipped as exc:
        reason = str(exc)
    except Exception as exc:  # a peer that fails to build here is reported, not fatal
        reason = f"{type(exc).__name__}: {exc}"
    reason = _agree_skip(reason)
    return (None if reason else system), reason


def _probe(build: Builder, cfg: GPTConfig, batches: list, baseline: frozenset, device: torch.device) -> dict[str, Any]:
    """Probe phase of one system on this rank (see module docstring)."""
    release_free_memory()
    bench_device.reset_peak_memory(device)
    with RssSampler() as rss:
        system, reason = _build(build, cfg, True, device)
        if system is None:
            return {"reason": reason}
        losses, measured = [], {}
        with TrafficCounter(system.traffic_targets) as traffic:
            for i, (x, y) in enumerate(batches):
                loss = system.forward_backward(x, y)
                if i == len(batches) - 1:
                    rss.sample()
                    measured = live_storage_bytes(system.sources(), baseline)
                system.step()
                losses.append(loss.item())
        dist.barrier()
    out = {
        "family": system.family,
        "stage": system.stage,
        "offload": system.offload,
        "losses": losses,
        "measured": {c: measured[c] for c in CATEGORIES},
        "unattributed": measured["unattributed"],
        "peak_rss": rss.peak,
        "rss_before": rss.start,
        "traffic_elements": traffic.elements,
        "by_op": {k: list(v) for k, v in traffic.by_op.items()},
        "traffic_countable": system.traffic_countable,
        "peak_device": bench_device.peak_memory(device),
    }
    del system
    return out


def _time(build: Builder, cfg: GPTConfig, batches: list, warmup: int, device: torch.device) -> list[float]:
    release_free_memory()
    system, _ = _build(build, cfg, False, device)
    assert system is not None  # it built in the probe phase
    times = []
    for i, (x, y) in enumerate(batches):
        bench_device.synchronize(device)  # the clock starts and stops with the device idle
        dist.barrier()
        t0 = time.perf_counter()
        system.forward_backward(x, y)
        system.step()
        bench_device.synchronize(device)
        dist.barrier()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    del system
    return times


def _quartiles(ts: list[float]) -> StepTimes:
    q = statistics.quantiles(ts, n=4) if len(ts) > 1 else [ts[0]] * 3
    return StepTimes(n=len(ts), median=statistics.median(ts), q1=q[0], q3=q[2], min=min(ts), max=max(ts))


def _deepspeed_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("deepspeed")
    except Exception:
        return None


def run(args: argparse.Namespace) -> BenchResult | None:
    """Run the benchmark on this rank (inside torchrun); returns the result on rank 0, else None.

    Raises:
        ValueError: see :func:`check_arguments`.
    """
    check_arguments(args)
    cfg, micro = resolve_model(args)
    nvme_dir = args.nvme_path or tempfile.mkdtemp(prefix="zerodp_bench_")
    systems: dict[str, Builder] = dict(SYSTEMS)
    if args.offload:  # same names, same order: the skipped placeholders become real builders
        systems.update(offload_systems(nvme_dir, args.sub_group_size))
    names, excluded = selected_systems(args, list(systems))
    is_excluded = lambda name: name != "DDP" and any(e in name for e in excluded)  # noqa: E731
    load_start = list(os.getloadavg())
    fresh = _fresh_rss(args, cfg, micro, systems, [n for n in names if not is_excluded(n)])
    zerodp.init_distributed()  # after the fresh-process children: they fork from a process without one
    device = bench_device.resolve(args.device)  # cuda:LOCAL_RANK, made current, or the CPU
    rank, world = dist.get_rank(), dist.get_world_size()
    psi = count_parameters(cfg)
    probe_batches = bench_device.to_device(make_batches(cfg, micro, args.probe_steps, rank, world), device)
    timed_batches = bench_device.to_device(make_batches(cfg, micro, args.warmup + args.steps, rank, world), device)
    baseline = frozenset(live_storages())

    # discarded: one-time costs (lazy init, gloo, allocator)
    _probe(systems["DDP"], cfg, probe_batches, baseline, device)
    release_free_memory()  # would otherwise land on whichever system runs first
    probes = {
        name: (
            {"reason": f"excluded by --exclude {args.exclude}"}
            if is_excluded(name)
            else _probe(systems[name], cfg, probe_batches, baseline, device)
        )
        for name in names
    }
    ran = [n for n in names if "reason" not in probes[n]]
    times: dict[str, list[list[float]]] = {n: [] for n in ran}
    for _ in range(args.rounds):  # interleaved: drift and load hit every system alike
        for name in ran:
            times[name].append(_time(systems[name], cfg, timed_batches, args.warmup, device))
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, {n: p for n, p in probes.items() if "reason" not in p})
    fresh_all: list[Any] = [None] * world
    dist.all_gather_object(fresh_all, fresh)
    result = None
    if rank == 0:
        result = _assemble(args, cfg, micro, psi, world, names, probes, gathered, times, load_start)
        result.device = device.type
        _add_fresh_rss(result, fresh_all, args)
        _write(args, result)
        if args.offload:
            print(bench_offload.swap_report(nvme_dir))
            print(bench_offload.adam_kernels(psi // world), bench_offload.pipeline_report(psi // world), sep="\n")
    for engine in bench_offload.NVME_ENGINES:
        engine.close()
    bench_offload.NVME_ENGINES.clear()
    if not args.nvme_path and rank == 0:
        shutil.rmtree(nvme_dir, ignore_errors=True)
    zerodp.shutdown_distributed()
    return result


def _fresh_rss(
    args: argparse.Namespace, cfg: GPTConfig, micro: int, systems: dict[str, Builder], names: list[str]
) -> dict[str, dict[str, Any]]:
    """Peak RSS of each of ``names`` in a process of its own on this rank (:mod:`zerodp.app.bench_rss`),
    ``{name: {"rank", "rss_start", "peak_rss"} | {"reason"} | {"error"}}``; empty with
    ``--no-fresh-rss`` or where it cannot run (the reason is reported per system)."""
    if args.no_fresh_rss:
        return {}
    why = FRESH_RSS_ON_GPU if bench_device.device_type(args.device) != "cpu" else bench_rss.unavailable_reason()
    if why:
        return {n: {"error": f"fresh-process RSS not measured: {why}"} for n in names}
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # at least FRESH_RSS_STEPS: DDP's peak is not reached in 2 steps (medium preset: 908 MiB after 2
    # steps, 1027 MiB after 3; docs/benchmarks/2026-12-01-bench.md)
    steps = max(args.probe_steps, FRESH_RSS_STEPS)
    batches = lambda: make_batches(cfg, micro, steps, rank, world)  # noqa: E731
    return {
        name: bench_rss.measure(k, functools.partial(_build, systems[name], cfg, probe=False), batches)
        for k, name in enumerate(names)
    }


def _add_fresh_rss(result: BenchResult, fresh_all: list[dict[str, dict[str, Any]]], args: argparse.Namespace) -> None:
    """Fill each ran system's ``fresh_rss`` (per rank) and its ratio to DDP's (highest ranks)."""
    for s in result.systems:
        if s.status != "ran":
            continue
        per_rank = [f.get(s.name) for f in fresh_all]
        if args.no_fresh_rss:
            s.fresh_rss_note = "not measured (--no-fresh-rss)"
        elif any(p is None or "peak_rss" not in p for p in per_rank):
            bad = next((p for p in per_rank if p is not None and "peak_rss" not in p), None)
            s.fresh_rss_note = (bad or {}).get("error") or (bad or {}).get("reason") or "not measured"
        else:
            measured = [p for p in per_rank if p is not None]  # every rank's: the branch above takes a None
            s.fresh_rss = [
                FreshRank(rank=p["rank"], rss_start=p["rss_start"], peak_rss=p["peak_rss"]) for p in measured
            ]
    ddp = next((s for s in result.systems if s.name == "DDP" and s.fresh_rss), None)
    if ddp is not None:
        base = max(m.peak_rss for m in ddp.fresh_rss)
        for s in result.systems:
            if s.fresh_rss:
                s.fresh_rss_vs_ddp = max(m.peak_rss for m in s.fresh_rss) / base


def _assemble(
    args: argparse.Namespace,
    cfg: GPTConfig,
    micro: int,
    psi: int,
    world: int,
    names: list[str],
    probes: dict,
    gathered: list,
    times: dict,
    load_start: list[float],
) -> BenchResult:
    systems = []
    ddp_losses = probes["DDP"].get("losses", [])
    for name in names:
        p = probes[name]
        if "reason" in p:
            fam = "deepspeed" if name.startswith("DeepSpeed") else "zerodp" if name.startswith("zerodp") else "torch"
            systems.append(SystemResult(name=name, family=fam, status="skipped", reason=p["reason"]))
            continue
        formula = None
        if p["stage"] is not None and p["offload"] is None:  # offload moves state off the paper's table
            formula = {c: v for c, v in model_state_bytes(p["stage"], psi, world, FP32_ADAM).items() if c in CATEGORIES}
            formula["buffers"] = float(p["measured"]["buffers"])  # not model state in the paper
        ratios, all_times = [], [t for rnd in times[name] for t in rnd]
        for rnd, base in zip(times[name], times.get("DDP", []), strict=False):
            ratios.append(statistics.median(rnd) / statistics.median(base))
        steps = len(p["losses"])
        counted = p["traffic_countable"] and (p["traffic_elements"] > 0 or world == 1)
        diffs = [abs(a - b) for a, b in zip(p["losses"], ddp_losses, strict=False)]
        systems.append(
            SystemResult(
                name=name,
                family=p["family"],
                stage=p["stage"],
                status="ran",
                step_time=_quartiles(all_times) if all_times else None,
                ratio_to_ddp=statistics.median(ratios) if ratios else None,
                ratio_per_round=ratios,
                losses=p["losses"],
                max_loss_diff_vs_ddp=max(diffs) if diffs else None,
                formula=formula,
                memory=[
                    RankMemory(
                        rank=r,
                        measured=g[name]["measured"],
                        unattributed=g[name]["unattributed"],
                        peak_rss=g[name]["peak_rss"],
                        rss_before=g[name]["rss_before"],
                        peak_device=g[name]["peak_device"],
                    )
                    for r, g in enumerate(gathered)
                ],
                traffic=None
                if not counted
                else Traffic(
                    elements_per_step=p["traffic_elements"] / steps,
                    psi_per_step=p["traffic_elements"] / steps / psi,
                    formula_psi=(
                        comm_elements_per_step(p["stage"], psi) // psi if p["stage"] is not None and world > 1 else None
                    ),
                    by_op=p["by_op"],
                ),
            )
        )
    sweep = []
    for path in filter(None, (args.sweep_from or "").split(",")):
        other = BenchResult.model_validate_json(Path(path).read_text())
        sweep += [
            SweepPoint(
                system=s.name,
                world_size=other.world_size,
                measured_total=sum(s.memory[0].measured.values()),
                formula_total=sum(s.formula.values()) if s.formula else None,
            )
            for s in other.systems
            if s.status == "ran" and s.memory
        ]
    return BenchResult(
        command=" ".join(["zerodp bench", *sys.argv[1:]]),
        date_utc=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        preset=args.preset,
        model={k: v for k, v in vars(cfg).items()},
        psi=psi,
        world_size=world,
        backend=str(dist.get_backend()),
        micro_batch=micro,
        steps=args.steps,
        warmup=args.warmup,
        rounds=args.rounds,
        probe_steps=args.probe_steps,
        torch_version=torch.__version__,
        deepspeed_version=_deepspeed_version(),
        cpu_count=os.cpu_count() or 1,
        load_average_start=load_start,
        load_average_end=list(os.getloadavg()),
        systems=systems,
        sweep=sweep,
    )


def _write(args: argparse.Namespace, result: BenchResult) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(result.model_dump_json(indent=1))
    print(format_table(result))
    print(f"wrote {out / 'bench.json'}")
    if args.no_plots:
        return
    try:
        paths = plot_all(result, out)
        print("wrote " + ", ".join(str(p) for p in paths))
    except ImportError:
        print("charts not written: matplotlib is missing (pip install -e '.[bench]')")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    add_arguments(ap)
    parsed = ap.parse_args()
    try:
        check_arguments(parsed)
    except ValueError as exc:  # every rank refuses the same arguments: one line each, no traceback
        ap.exit(2, f"zerodp.app.bench: error: {exc}\n")
    run(parsed)
