"""Where ``zerodp train --preset infinity``'s peak RSS goes, on a GPT of any shape (a shallow wide one
reproduces a deep model's per-layer sizes in minutes): the preset's engine config, knobs and plan
rows for ``--layers`` x ``--d-model`` (knobs as :func:`zerodp.app.infinity.knobs_for` picks them for
``--knobs-params`` parameters, default the model's own count), one rank, the preset's malloc settings.

A sampler thread reads ``VmRSS`` (``/proc/self/statm``) every ``--every-ms`` and keeps, per tag, the
largest value seen; the tag is set by forward pre-hooks and backward pre-hooks of every module with
parameters (``fwd blocks.0.mlp.fc``), and by the loop's phases (``step``, ``settle``). At each phase
boundary the worker also prints ``VmRSS``, ``VmHWM`` and glibc's in-use bytes (``mallinfo2``).

    PYTHONPATH=src python -u tools/infinity_rss_probe.py --layers 4 --d-model 2816 --nvme-path DIR
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import subprocess
import sys
import threading
import time

PAGE = os.sysconf("SC_PAGE_SIZE")


class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]


libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2


def rss() -> int:
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * PAGE


def status(key: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def mb(n: float) -> str:
    return f"{n / 1e6:8.0f}"


class Sampler:
    def __init__(self, every_s: float) -> None:
        self.tag = "start"
        self.peak: dict[str, int] = {}
        self.every = every_s
        self.stop = False
        self.series: list[tuple[float, int, str]] = []  # (seconds, VmRSS, tag) where VmRSS moved by 16 MB
        self.t0 = time.perf_counter()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stop:
            r, t = rss(), self.tag
            if r > self.peak.get(t, 0):
                self.peak[t] = r
            if not self.series or abs(r - self.series[-1][1]) >= 16 * 2**20 or t != self.series[-1][2]:
                self.series.append((time.perf_counter() - self.t0, r, t))
            time.sleep(self.every)


def point(name: str) -> str:
    m = libc.mallinfo2()
    return (f"  {name:<28} VmRSS {mb(rss())} MB  VmHWM {mb(status('VmHWM'))} MB  malloc in use "
            f"{mb(m.uordblks + m.hblkhd)} MB (mmapped {mb(m.hblkhd)}, heap {mb(m.arena)}, free in heap {mb(m.fordblks)})")


def census(label: str) -> None:
    """Live tensors reachable from Python (gc), unique storages of >= 1 MB, grouped by storage size."""
    import gc

    import torch

    seen: dict[int, tuple[int, str]] = {}
    for o in gc.get_objects():
        try:
            if isinstance(o, torch.Tensor) and o.device.type == "cpu":
                st = o.untyped_storage()
                if st.nbytes() >= 2**20:
                    seen.setdefault(st.data_ptr(), (st.nbytes(), f"{o.dtype} {tuple(o.shape)}"))
        except Exception:  # noqa: BLE001 (sparse, meta, ...)
            continue
    groups: dict[int, list[str]] = {}
    for nbytes, what in seen.values():
        groups.setdefault(nbytes, []).append(what)
    total = sum(n for n, _ in seen.values())
    print(f"  census {label}: {len(seen)} storages >= 1 MiB, {total / 1e6:.0f} MB", flush=True)
    for nbytes, whats in sorted(groups.items(), key=lambda kv: -kv[0] * len(kv[1]))[:14]:
        print(f"    {len(whats):4d} x {nbytes / 1e6:9.2f} MB = {len(whats) * nbytes / 1e6:8.0f} MB  e.g. {whats[0]}")


def classes(engine) -> str:
    """Host bytes of the engine's known holders (live storages), and what malloc holds beyond them."""
    from zerodp.offload.param_swap import Residency

    def nb(ts) -> int:
        return sum(t.untyped_storage().nbytes() for t in ts)

    off = engine.optimizer_offload
    sw = engine.param_offload.swapper
    pool = engine.sharding.pool
    spill = getattr(off, "spill", None)
    parts = {
        "optbuf": nb(off.buffers),
        "gradswap": (spill.host_bytes() if spill is not None else 0) + nb([off.grad_scratch]),
        "ppool": nb(sw.pool),
        "shards pinned": sum(x.storage_bytes() for x in sw.shards if x.pins > 0),
        "shards unpinned": sum(x.storage_bytes() for x in sw.shards if x.pins == 0 and x.state is not Residency.SWAPPED),
        "gather lent": pool.lent_bytes(),
        "gather free": pool.free_bytes(),
    }
    m = libc.mallinfo2()
    inuse = m.uordblks + m.hblkhd
    return (" ".join(f"{k} {v / 1e6:.0f}" for k, v in parts.items())
            + f" | malloc {inuse / 1e6:.0f} - known = {(inuse - sum(parts.values())) / 1e6:.0f} | rss {rss() / 1e6:.0f}")


def worker(plan: dict, nvme: str, every_s: float) -> None:
    import torch
    import torch.distributed as dist

    import zerodp
    from zerodp.app import data
    from zerodp.app.infinity_run import engine_config
    from zerodp.app.model import GPT, GPTConfig

    sampler = Sampler(every_s)
    zerodp.init_distributed()
    world = dist.get_world_size()
    mcfg = GPTConfig.from_dict(plan["model"])
    cfg = engine_config(plan, nvme, world)
    torch.manual_seed(0)
    sampler.tag = "build"
    with zerodp.zero.Init(config=cfg):
        model = GPT(mcfg)
    print(point("after zero.Init"), flush=True)
    engine = zerodp.initialize(model, cfg)
    print(point("after initialize"), flush=True)
    for name, mod in model.named_modules():
        if any(True for _ in mod.parameters(recurse=False)):
            mod.register_forward_pre_hook(lambda m, a, n=name: setattr(sampler, "tag", f"{phase[0]} fwd {n}"))
            mod.register_full_backward_pre_hook(lambda m, g, n=name: setattr(sampler, "tag", f"{phase[0]} bwd {n}"))
            if os.environ.get("PROBE_CLASSES"):
                mod.register_forward_pre_hook(lambda m, a, n=name: print(f"    {phase[0]} fwd {n:<22}", classes(engine)))
                mod.register_full_backward_pre_hook(lambda m, g, n=name: print(f"    {phase[0]} bwd {n:<22}",
                                                                                classes(engine)))
    text = data.load_text(None, min_bytes=data.min_corpus_bytes(mcfg.seq_len))
    train_tokens, _ = data.split(data.encode(text))
    batches = data.GlobalBatches(train_tokens, mcfg.seq_len, plan["micro_batch"], world, seed=0)
    engine.train()
    phase = ["s0"]
    for step in range(plan["steps"]):
        phase[0] = f"s{step + 1}"
        x, y = data.rank_slice(batches.batch(step), dist.get_rank(), world)
        sampler.tag = f"{phase[0]} forward"
        saved: dict[int, tuple[int, str, str]] = {}  # storage address -> (bytes, tag, shape/dtype) (PROBE_SAVED)

        def pack(t: torch.Tensor) -> torch.Tensor:
            st = t.untyped_storage()
            saved.setdefault(st.data_ptr(), (st.nbytes(), sampler.tag, f"{tuple(t.shape)} {t.dtype}"))
            return t

        hooks = (torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if os.environ.get("PROBE_SAVED")
                 else contextlib.nullcontext())
        with hooks:
            _, loss = engine(x, y)
        if saved:
            by: dict[str, int] = {}
            for nbytes, tag, what in saved.values():
                key = tag.split()[-1].split(".")[-1] + " " + what.split(")")[0].count(",").__str__() + "d " + what.split()[-1]
                by[key] = by.get(key, 0) + nbytes
            print(f"  saved for backward: {len(saved)} storages, {sum(v[0] for v in saved.values()) / 1e6:.0f} MB "
                  "(storage bytes at pack time); by module kind, rank, dtype:", flush=True)
            for key, v in sorted(by.items(), key=lambda kv: -kv[1])[:15]:
                print(f"    {v / 1e6:9.1f} MB  {key}")
            big = sorted(saved.values(), key=lambda v: -v[0])[:10]
            print("  largest:", "; ".join(f"{v[0] / 1e6:.1f} MB {v[1]} {v[2]}" for v in big), flush=True)
        print(point(f"step {step + 1} after forward"), flush=True)
        if os.environ.get("PROBE_CENSUS"):
            census(f"step {step + 1} after forward")
        sampler.tag = f"{phase[0]} backward"
        engine.backward(loss)
        print(point(f"step {step + 1} after backward"), flush=True)
        sampler.tag = f"{phase[0]} step"
        engine.step()
        print(point(f"step {step + 1} after step"), flush=True)
        if step + 1 == plan["steps"]:
            sampler.tag = f"{phase[0]} settle"
            engine.optimizer_offload.settle()
            print(point(f"step {step + 1} after settle"), flush=True)
        print(f"  loss {loss.item():.4f}", flush=True)
    sampler.stop = True
    sampler.thread.join()
    top = sorted(sampler.peak.items(), key=lambda kv: -kv[1])
    print("largest VmRSS seen per tag (MB):", flush=True)
    for tag, v in top[:25]:
        print(f"  {mb(v)}  {tag}")
    per_phase: dict[str, int] = {}
    for tag, v in sampler.peak.items():
        key = " ".join(tag.split()[:2])
        per_phase[key] = max(per_phase.get(key, 0), v)
    print("per step and phase (MB):", " | ".join(f"{k} {v / 1e6:.0f}" for k, v in per_phase.items()))
    print(f"VmHWM {status('VmHWM') / 1e6:.0f} MB", flush=True)
    if os.environ.get("PROBE_SERIES"):
        with open(os.environ["PROBE_SERIES"], "w", encoding="ascii") as f:
            f.writelines(f"{t:9.3f} {r / 1e6:8.0f} {tag}\n" for t, r, tag in sampler.series)
    engine.close()
    zerodp.shutdown_distributed()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--d-model", type=int, required=True)
    ap.add_argument("--nvme-path", required=True)
    ap.add_argument("--knobs-params", type=int, default=None)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--every-ms", type=float, default=5.0)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(json.loads(args.worker), args.nvme_path, args.every_ms / 1e3)
        return
    from dataclasses import asdict

    from zerodp.app.infinity import MALLOC_ENV, default_lr, knobs_for, ram_accounting
    from zerodp.app.model import GPTConfig, count_parameters
    from zerodp.runtime.accounting import human_bytes

    d = args.d_model
    model = GPTConfig(n_layer=args.layers, n_head=d // 128, d_model=d, seq_len=128)
    p = count_parameters(model)
    largest = 4 * d * d + 4 * d
    k = knobs_for(args.knobs_params or p, largest, 1)
    ram, phases = ram_accounting(p, model, args.micro_batch, largest, 1, k)
    print(f"GPT {args.layers} x {d}: {p:,} parameters; knobs {k}")
    for name, v in ram.items():
        print(f"  {name:<58}{human_bytes(v):>12}")
    for ph, rows in phases.items():
        for name, v in rows.items():
            print(f"    {ph + ': ' + name:<56}{human_bytes(v):>12}")
    plan = {"model": asdict(model), "micro_batch": args.micro_batch, "grad_accum": 1, "steps": args.steps,
            "lr": default_lr(d, args.layers), "knobs": asdict(k), "probe_bytes": k.probe_bytes}
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"), **MALLOC_ENV)
    cmd = [sys.executable, "-u", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           __file__, "--layers", str(args.layers), "--d-model", str(d), "--nvme-path", args.nvme_path,
           "--every-ms", str(args.every_ms), "--worker", json.dumps(plan)]
    sys.exit(subprocess.run(cmd, env=env).returncode)


if __name__ == "__main__":
    main()
