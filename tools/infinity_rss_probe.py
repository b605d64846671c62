"""Where ``zerodp train --preset infinity``'s peak RSS goes, on a GPT of any shape (a shallow wide one
reproduces a deep model's per-layer sizes in minutes): the preset's engine config, knobs and plan
rows for ``--layers`` x ``--d-model`` (knobs as :func:`zerodp.app.infinity.knobs_for` picks them for
``--knobs-params`` parameters, default the model's own count), ``--nproc`` ranks, the preset's malloc
settings. Measured, never the engine's tallies: a sampler thread reads ``VmRSS`` (``/proc/self/statm``)
every ``--every-ms`` and keeps, per tag, the largest value seen; forward and backward pre-hooks of
every module with parameters set the tag (``s2 bwd blocks.0.mlp.fc``: step 2, the backward of that
module), the loop sets ``s2 forward`` / ``s2 backward`` / ``s2 step`` / ``s3 settle`` around the calls.
Rank 0 prints ``VmRSS``, ``VmHWM`` and glibc's in-use bytes (``mallinfo2``) after each phase; every
rank its ``VmHWM`` at the end.

Switches (environment):

- ``PROBE_CLASSES=1``: at every module hook, the bytes of the engine's known host holders, read from
  their live storages (optimizer sub-group buffers, gradient swap read buffers + writes in flight + fp32
  scratch, parameter swap pool, parameter shards pinned (in use or being gathered) and unpinned (read
  ahead or kept), gather pool lent and free, the reducer's partitions in memory, tensors saved for
  backward), malloc's in-use bytes minus them, and ``VmRSS`` minus malloc's; and the same at the
  largest ``VmRSS`` the sampler saw in each phase and module kind (``bwd qkv``: any block's qkv backward).
- ``PROBE_SERIES=path``: the sampled series (seconds, ``VmRSS`` MB, tag) where ``VmRSS`` moved by 16 MB.
- ``PROBE_CENSUS_AT="s2 bwd blocks.5.attn.qkv"``: at that hook, live tensors reachable from Python
  (``gc``), grouped by storage size.

    PYTHONPATH=src PROBE_CLASSES=1 python -u tools/infinity_rss_probe.py --layers 12 --d-model 2816 \\
        --knobs-params 3808882176 --nvme-path DIR     # the 3.8B run's knobs, 12 of its 40 layers
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mallinfo import mallinfo, malloc_in_use  # noqa: E402  (tools/, next to this file)

PAGE = os.sysconf("SC_PAGE_SIZE")


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


#: storage address -> (bytes, weak reference to a tensor on it) of tensors saved for backward (PROBE_CLASSES)
LIVE_SAVED: dict = {}


def keep_saved(t):
    """saved_tensors_hooks pack hook: note ``t``'s storage (parameters excluded: the gather pool has them)."""
    import torch

    st = t.untyped_storage()
    if st.nbytes() and st.data_ptr() not in LIVE_SAVED and not isinstance(t, torch.nn.Parameter):
        LIVE_SAVED[st.data_ptr()] = (st.nbytes(), weakref.ref(t))
    return t


def classes(engine) -> str:
    """Host bytes of the engine's known holders (live storages), and what malloc holds beyond them."""
    from zerodp.offload.param_swap import Residency

    def nb(ts) -> int:
        return sum(t.untyped_storage().nbytes() for t in ts)

    off, sw, pool = engine.optimizer_offload, engine.param_offload.swapper, engine.sharding.pool
    spill = getattr(off, "spill", None)
    parts = {
        "optbuf": nb(off.buffers),
        "gradswap": (spill.host_bytes() if spill is not None else 0) + nb([off.grad_scratch]),
        "ppool": nb(sw.pool),
        "shards pinned": sum(x.storage_bytes() for x in sw.shards if x.pins > 0),
        "shards unpinned": sum(
            x.storage_bytes() for x in sw.shards if x.pins == 0 and x.state is not Residency.SWAPPED
        ),
        "gather lent": pool.lent_bytes(),
        "gather free": pool.free_bytes(),
        "owned": nb(engine.reducer.owned.values()),
        "saved": sum(n for n, ref in LIVE_SAVED.values() if ref() is not None),
    }
    inuse, now = malloc_in_use(), rss()
    known = sum(parts.values())
    return (
        " ".join(f"{k} {v / 1e6:.0f}" for k, v in parts.items())
        + f" | malloc {inuse / 1e6:.0f} - known = {(inuse - known) / 1e6:.0f} | rss {now / 1e6:.0f}"
        + f" - malloc = {(now - inuse) / 1e6:.0f} (RssFile {status('RssFile') / 1e6:.0f}, "
        + f"RssAnon {status('RssAnon') / 1e6:.0f})"
    )


def census(label: str) -> None:
    """Live tensors reachable from Python (gc), unique storages of >= 1 MiB, grouped by storage size."""
    import torch

    seen: dict[int, tuple[int, str]] = {}
    for o in gc.get_objects():
        with contextlib.suppress(Exception):  # sparse, meta, ...
            if isinstance(o, torch.Tensor) and o.device.type == "cpu":
                st = o.untyped_storage()
                if st.nbytes() >= 2**20:
                    seen.setdefault(st.data_ptr(), (st.nbytes(), f"{o.dtype} {tuple(o.shape)}"))
    groups: dict[int, list[str]] = {}
    for nbytes, what in seen.values():
        groups.setdefault(nbytes, []).append(what)
    print(f"  census {label}: {len(seen)} storages >= 1 MiB, {sum(n for n, _ in seen.values()) / 1e6:.0f} MB")
    for nbytes, whats in sorted(groups.items(), key=lambda kv: -kv[0] * len(kv[1]))[:14]:
        print(f"    {len(whats):4d} x {nbytes / 1e6:9.2f} MB = {len(whats) * nbytes / 1e6:8.0f} MB  e.g. {whats[0]}")


class Sampler:
    """``VmRSS`` every ``every_s`` seconds: the largest per tag, the series, and (``engine`` set) the
    holders' bytes at the largest value seen."""

    def __init__(self, every_s: float) -> None:
        self.tag = "start"
        self.step = "s0"
        self.peak: dict[str, int] = {}
        self.every = every_s
        self.stop = False
        self.engine = None
        self.best_by_kind: dict[str, tuple[int, str]] = {}  # "bwd qkv" -> (largest VmRSS, holders then)
        self.series: list[tuple[float, int, str]] = []  # (seconds, VmRSS, tag) where VmRSS moved by 16 MB
        self.t0 = time.perf_counter()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stop:
            r, t = rss(), self.tag
            if r > self.peak.get(t, 0):
                self.peak[t] = r
            kind = " ".join(t.split()[1:2] + [t.split()[-1].split(".")[-1]])  # "bwd qkv", "forward forward"
            if self.engine is not None and r > self.best_by_kind.get(kind, (0, ""))[0] + 4 * 2**20:
                try:
                    self.best_by_kind[kind] = (r, f"{t}: {classes(self.engine)}")
                except Exception as exc:  # noqa: BLE001 (the training thread changed a structure under us)
                    self.best_by_kind[kind] = (r, f"{t}: (classes failed: {exc})")
            if not self.series or abs(r - self.series[-1][1]) >= 16 * 2**20 or t != self.series[-1][2]:
                self.series.append((time.perf_counter() - self.t0, r, t))
            time.sleep(self.every)

    def hooks(self, model, engine, loud: bool) -> None:
        """Tag (and with PROBE_CLASSES print) at each module's forward and backward."""

        def on(kind: str, name: str) -> None:
            self.tag = f"{self.step} {kind} {name}"
            if loud and os.environ.get("PROBE_CLASSES"):
                print(f"    {self.tag:<34}", classes(engine))
            if loud and self.tag == os.environ.get("PROBE_CENSUS_AT"):
                census(self.tag)

        for name, mod in model.named_modules():
            if any(True for _ in mod.parameters(recurse=False)):
                mod.register_forward_pre_hook(lambda m, a, n=name: on("fwd", n))
                mod.register_full_backward_pre_hook(lambda m, g, n=name: on("bwd", n))

    def report(self) -> None:
        self.stop = True
        self.thread.join()
        print("largest VmRSS seen per tag (MB):")
        for tag, v in sorted(self.peak.items(), key=lambda kv: -kv[1])[:25]:
            print(f"  {mb(v)}  {tag}")
        per_phase: dict[str, int] = {}
        for tag, v in self.peak.items():
            key = " ".join(tag.split()[:2])
            per_phase[key] = max(per_phase.get(key, 0), v)
        print("per step and phase (MB):", " | ".join(f"{k} {v / 1e6:.0f}" for k, v in per_phase.items()))
        if self.best_by_kind:
            print("holders at the largest VmRSS sampled per phase and module kind (MB):")
            for kind, (r, info) in sorted(self.best_by_kind.items(), key=lambda kv: -kv[1][0]):
                print(f"  {r / 1e6:6.0f} {kind:<18} {info}")
        if os.environ.get("PROBE_SERIES"):
            with open(os.environ["PROBE_SERIES"], "w", encoding="ascii") as f:
                f.writelines(f"{t:9.3f} {r / 1e6:8.0f} {tag}\n" for t, r, tag in self.series)


def point(name: str) -> str:
    m = mallinfo()
    return (
        f"  {name:<28} VmRSS {mb(rss())} MB  VmHWM {mb(status('VmHWM'))} MB  malloc in use "
        f"{mb(m.uordblks + m.hblkhd)} MB (mmapped {mb(m.hblkhd)}, heap {mb(m.arena)}, free in heap {mb(m.fordblks)})"
    )


def train(engine, plan: dict, sampler: Sampler, loud: bool) -> None:
    """The preset's loop (one micro-batch per step), tagged and reported per phase."""
    import torch
    import torch.distributed as dist

    from zerodp.app import data

    seq_len, world = plan["model"]["seq_len"], dist.get_world_size()
    text = data.load_text(None, min_bytes=data.min_corpus_bytes(seq_len))
    batches = data.GlobalBatches(data.split(data.encode(text))[0], seq_len, plan["micro_batch"], world, seed=0)
    engine.train()
    for step in range(plan["steps"]):
        sampler.step = f"s{step + 1}"
        x, y = data.rank_slice(batches.batch(step), dist.get_rank(), world)
        sampler.tag = f"{sampler.step} forward"
        LIVE_SAVED.clear()
        saving = os.environ.get("PROBE_CLASSES")
        with torch.autograd.graph.saved_tensors_hooks(keep_saved, lambda t: t) if saving else contextlib.nullcontext():
            _, loss = engine(x, y)
        calls = [("backward", lambda loss=loss: engine.backward(loss)), ("step", engine.step)]
        if step + 1 == plan["steps"]:
            calls.append(("settle", engine.optimizer_offload.settle))
        for name, call in [("forward", lambda: None), *calls]:
            sampler.tag = f"{sampler.step} {name}"
            call()
            if loud:
                print(point(f"step {step + 1} after {name}"), flush=True)
        if loud:
            print(f"  loss {loss.item():.4f}", flush=True)


def worker(plan: dict, nvme: str, every_s: float) -> None:
    import torch
    import torch.distributed as dist

    import zerodp
    from zerodp.app.infinity_run import engine_config
    from zerodp.app.model import GPT, GPTConfig

    sampler = Sampler(every_s)
    zerodp.init_distributed()
    loud = dist.get_rank() == 0
    cfg = engine_config(plan, nvme, dist.get_world_size())
    torch.manual_seed(0)
    sampler.tag = "build"
    with zerodp.zero.Init(config=cfg):
        model = GPT(GPTConfig.from_dict(plan["model"]))
    if loud:
        print(point("after zero.Init"), flush=True)
    engine = zerodp.initialize(model, cfg)
    if loud:
        print(point("after initialize"), flush=True)
    if os.environ.get("PROBE_CLASSES"):
        sampler.engine = engine
    sampler.hooks(model, engine, loud)
    train(engine, plan, sampler, loud)
    if loud:
        sampler.report()
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, status("VmHWM"))
    if loud:
        print("VmHWM per rank (MB):", " ".join(f"{h / 1e6:.0f}" for h in every), flush=True)
    engine.close()
    zerodp.shutdown_distributed()


def print_plan(args: argparse.Namespace) -> dict:
    """The preset's knobs and RAM rows for this shape; returns the worker's plan (as ``_plan_json``)."""
    from zerodp.app.infinity import default_lr, knobs_for
    from zerodp.app.infinity_ram import ram_accounting
    from zerodp.app.model import GPTConfig, count_parameters
    from zerodp.runtime.accounting import human_bytes

    d = args.d_model
    model = GPTConfig(n_layer=args.layers, n_head=d // 128, d_model=d, seq_len=128)
    p = count_parameters(model)
    largest = 4 * d * d + 4 * d
    k = knobs_for(args.knobs_params or p, largest, args.nproc)
    ram, phases = ram_accounting(p, model, args.micro_batch, largest, args.nproc, k)
    print(f"GPT {args.layers} x {d}: {p:,} parameters; {args.nproc} rank(s); knobs {k}")
    print(f"RAM rows {human_bytes(sum(v for n, v in ram.items() if not n.startswith('slack')))} (all ranks):")
    for name, v in ram.items():
        print(f"  {name:<70}{human_bytes(v):>12}")
    for ph, rows in phases.items():
        for name, v in rows.items():
            print(f"    {ph + ': ' + name:<68}{human_bytes(v):>12}")
    return {
        "model": asdict(model),
        "micro_batch": args.micro_batch,
        "grad_accum": 1,
        "steps": args.steps,
        "lr": default_lr(d, args.layers),
        "knobs": asdict(k),
        "probe_bytes": k.probe_bytes,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--d-model", type=int, required=True)
    ap.add_argument("--nvme-path", required=True)
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--knobs-params", type=int, default=None)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--every-ms", type=float, default=5.0)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(json.loads(args.worker), args.nvme_path, args.every_ms / 1e3)
        return
    from zerodp.app.infinity import MALLOC_ENV

    plan = print_plan(args)
    sys.stdout.flush()
    threads = os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
    env = dict(os.environ, OMP_NUM_THREADS=threads, **MALLOC_ENV)
    cmd = [
        sys.executable,
        "-u",
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(args.nproc),
        __file__,
        "--layers",
        str(args.layers),
        "--d-model",
        str(args.d_model),
        "--nvme-path",
        args.nvme_path,
        "--every-ms",
        str(args.every_ms),
        "--worker",
        json.dumps(plan),
    ]
    sys.exit(subprocess.run(cmd, env=env).returncode)


if __name__ == "__main__":
    main()
