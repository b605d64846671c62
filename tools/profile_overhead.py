"""cProfile (rank 0) of the overhead benchmark's training step (``zerodp.app.overhead_bench``: 64 x
Linear(64, 64), batch 4 per rank) for one system, after warm-up steps, timed by the training thread's
CPU time (``time.thread_time``, as the benchmark; waits excluded); sorted by SORT (tottime).
Shows where the host time of a stage's step goes next to DDP's.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        tools/profile_overhead.py zerodp_s0 [SORT] [STEPS] [LINES]

Rank 0 also writes the raw profile to /tmp/profile_overhead_<system>.prof (``pstats``).
"""

import cProfile
import pstats
import sys
import time

import torch
import torch.distributed as dist

import zerodp
from zerodp.app.overhead_bench import _build

zerodp.init_distributed()
rank = dist.get_rank()
name = sys.argv[1]
sort = sys.argv[2] if len(sys.argv) > 2 else "tottime"
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 50
lines = int(sys.argv[4]) if len(sys.argv) > 4 else 40
gen = torch.Generator().manual_seed(1000 + rank)
xs = [torch.randn(4, 64, generator=gen) for _ in range(steps + 3)]
step = _build(name, 64, 64)
for x in xs[:3]:
    step(x)
dist.barrier()
c0 = time.thread_time()
for x in xs[3:]:
    step(x)
c1 = time.thread_time()
dist.barrier()
pr = cProfile.Profile(time.thread_time)  # CPU time of this thread, as the benchmark measures
pr.enable()
for x in xs[3:]:
    step(x)
pr.disable()
if rank == 0:
    print(f"{name}: unprofiled cpu {1e6 * (c1 - c0) / (steps * 64):.1f} us per module per step")
    pr.dump_stats(f"/tmp/profile_overhead_{name}.prof")
    st = pstats.Stats(pr)
    st.sort_stats(sort)
    st.print_stats(lines)
zerodp.shutdown_distributed()
