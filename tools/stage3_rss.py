"""Peak RSS per rank of the issue-9 MLP (8 x (Linear(H, H), ReLU) + Linear(H, 1)) at a ZeRO stage.

Usage (launches its own ranks with torch.distributed.run, gloo, CPU):

    python tools/stage3_rss.py --world 2 --stages ddp,0,3 [--hidden 2048] [--steps 3] [--bf16] [--init] [--append]

(``ddp``: torch DistributedDataParallel with torch's Adam, the reference.)

For each stage, a fresh set of processes builds the model (under ``zerodp.zero.Init`` with ``--init``),
trains ``--steps`` Adam steps on random batches of 8 rows per rank and prints, per rank: peak RSS
(``getrusage(RUSAGE_SELF).ru_maxrss``) after building, after ``initialize`` and after training, the
RSS at the end (``/proc/self/statm``), and the gathered parameter bytes alive after the last forward
(``memory_report()``, read from live storage). Figures are in MB (1e6 bytes); ``build_s`` is the
wall time of building the model (under ``Init`` with ``--init``), in seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def worker(args: argparse.Namespace) -> None:
    import torch
    from torch import nn

    import zerodp

    zerodp.init_distributed()
    h = args.hidden
    cfg = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
        "bf16": {"enabled": args.bf16},
        "zero_optimization": {
            "stage": args.stage,
            "stage3_max_live_parameters": int(5e6),
            "stage3_prefetch_bucket_size": int(5e6),
            "reduce_bucket_size": args.reduce_bucket_size,
        },
    }

    def build() -> nn.Module:
        if args.append:  # each layer attached to its parent as soon as it is built
            model = nn.Sequential()
            for _ in range(8):
                model.append(nn.Linear(h, h))
                model.append(nn.ReLU())
            return model.append(nn.Linear(h, 1))
        layers: list[nn.Module] = []  # every layer built before the parent exists
        for _ in range(8):
            layers += [nn.Linear(h, h), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(h, 1))

    torch.manual_seed(0)
    if args.stage < 0:  # torch DDP + torch Adam, the reference
        ddp_worker(args, build)
        return
    t0 = time.perf_counter()
    if args.init and args.stage == 3:
        with zerodp.zero.Init(config=cfg):
            model = build()
    else:
        model = build()
    build_s = time.perf_counter() - t0
    built = peak_mb()
    engine = zerodp.initialize(model, cfg)
    initialized = peak_mb()
    gathered_after_forward = 0
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    for _ in range(args.steps):
        loss = engine(torch.randn(8, h, dtype=dtype)).float().pow(2).mean()
        if engine.sharding is not None:
            gathered_after_forward = engine.sharding.held_bytes()["gathered"]
        engine.backward(loss)
        engine.step()
    row = {
        "stage": args.stage,
        "rank": engine.rank,
        "build_s": round(build_s, 3),
        "peak_built_mb": round(built, 1),
        "peak_initialized_mb": round(initialized, 1),
        "peak_trained_mb": round(peak_mb(), 1),
        "rss_end_mb": round(rss_mb(), 1),
        "gathered_after_forward_mb": round(gathered_after_forward / 1e6, 2),
    }
    with open(os.path.join(args.out, f"rank{engine.rank}.json"), "w") as f:
        json.dump(row, f)
    zerodp.shutdown_distributed()


def ddp_worker(args: argparse.Namespace, build) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import zerodp

    model = build()
    built = peak_mb()
    ddp = DistributedDataParallel(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-4)
    initialized = peak_mb()
    for _ in range(args.steps):
        ddp(torch.randn(8, args.hidden)).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    row = {
        "stage": "ddp",
        "rank": dist.get_rank(),
        "peak_built_mb": round(built, 1),
        "peak_initialized_mb": round(initialized, 1),
        "peak_trained_mb": round(peak_mb(), 1),
        "rss_end_mb": round(rss_mb(), 1),
        "gathered_after_forward_mb": 0.0,
    }
    with open(os.path.join(args.out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(row, f)
    zerodp.shutdown_distributed()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--stages", default="0,3")
    ap.add_argument("--stage", type=int, default=None, help=argparse.SUPPRESS)  # set in the ranks
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--init", action="store_true", help="build under zerodp.zero.Init at stage 3")
    ap.add_argument(
        "--reduce-bucket-size",
        type=int,
        default=int(5e6),
        help="zero_optimization.reduce_bucket_size (elements; DeepSpeed's default is 5e8)",
    )
    ap.add_argument(
        "--append",
        action="store_true",
        help="build with Sequential().append(layer) (each layer attached as built) instead of Sequential(*layers)",
    )
    args = ap.parse_args()
    if args.stage is not None:
        worker(args)
        return
    for stage in [-1 if s == "ddp" else int(s) for s in args.stages.split(",")]:
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={args.world}",
                __file__,
                "--stage",
                str(stage),
                "--out",
                tmp,
                "--hidden",
                str(args.hidden),
                "--steps",
                str(args.steps),
            ]
            cmd += ["--bf16"] * args.bf16 + ["--init"] * args.init + ["--append"] * args.append
            cmd += ["--reduce-bucket-size", str(args.reduce_bucket_size)]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
            out = subprocess.run(cmd, capture_output=True, text=True, env=env)
            rows = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank*.json"))]
        if out.returncode != 0 or len(rows) != args.world:
            sys.exit(f"stage {stage} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
        for row in sorted(rows, key=lambda r: r["rank"]):
            print(json.dumps(row))


if __name__ == "__main__":
    main()
