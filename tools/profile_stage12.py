"""Step time and CPU time of DDP and zerodp stages 1-2 on the bench's GPT (2 ranks), interleaved
(ABAB...), and a torch.profiler self-CPU table per system; printed by rank 0. Used for
docs/benchmarks/2026-12-01-bench.md.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 \
        tools/profile_stage12.py [--preset small|medium] [--rounds 4] [--steps 4] [--profile]

Process CPU time (all threads, ``time.process_time``) is reported beside wall time because on a
shared, loaded machine it is far less sensitive to other jobs: the extra work a system does shows up
in it even when wall-clock medians are too noisy to rank the systems.
"""

import argparse
import statistics
import time

import torch.distributed as dist

import zerodp
from zerodp.app.bench import make_batches
from zerodp.app.bench_args import PRESETS
from zerodp.app.bench_systems import SYSTEMS
from zerodp.app.model import GPTConfig

ap = argparse.ArgumentParser()
ap.add_argument("--preset", default="small")
ap.add_argument("--rounds", type=int, default=4)
ap.add_argument("--steps", type=int, default=4)
ap.add_argument("--systems", default="DDP,zerodp stage 1,zerodp stage 2")
ap.add_argument("--profile", action="store_true")
a = ap.parse_args()
zerodp.init_distributed()
rank, world = dist.get_rank(), dist.get_world_size()
n_layer, n_head, d_model, seq_len, micro = PRESETS[a.preset]
cfg = GPTConfig(n_layer=n_layer, n_head=n_head, d_model=d_model, seq_len=seq_len)
names = a.systems.split(",")
batches = make_batches(cfg, micro, a.steps + 1, rank, world)
wall = {n: [] for n in names}
cpu = {n: [] for n in names}
for rnd in range(a.rounds):
    for name in names if rnd % 2 == 0 else names[::-1]:
        s = SYSTEMS[name](cfg, 1e-3, False)
        for i, (x, y) in enumerate(batches):
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            s.forward_backward(x, y)
            s.step()
            c1 = time.process_time()
            dist.barrier()
            if i > 0:  # the first step allocates optimizer state
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(c1 - c0)
        del s
if rank == 0 and a.rounds:
    base_w, base_c = statistics.median(wall["DDP"]), statistics.median(cpu["DDP"])
    print(f"{a.preset}: {a.rounds} rounds x {a.steps} steps, medians (quartiles) and ratio to DDP")
    for n in names:
        qw, qc = statistics.quantiles(wall[n], n=4), statistics.quantiles(cpu[n], n=4)
        print(
            f"{n:<18} wall {statistics.median(wall[n]):.4f} s ({qw[0]:.4f}-{qw[2]:.4f}) "
            f"{statistics.median(wall[n]) / base_w:.3f}x   cpu {statistics.median(cpu[n]):.4f} s "
            f"({qc[0]:.4f}-{qc[2]:.4f}) {statistics.median(cpu[n]) / base_c:.3f}x"
        )
if a.profile:
    from profile_ops import print_profiles  # this script's directory is on sys.path

    print_profiles(names, cfg, batches, 25, rank)
zerodp.shutdown_distributed()
