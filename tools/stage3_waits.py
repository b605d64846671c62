"""Where the stage-3 training thread blocks, per step, on the bench's small GPT (2 ranks): seconds spent
waiting for gradient reduce-scatters (``GradientReducer._drain``) and for parameter all-gathers
(``ShardedUnit.finish_gather``), the collectives issued (``all_gather`` / ``reduce_scatter``: single
ones; ``coalesced groups``: groups; ``... collectives``: zerodp's own counts, a group once), process CPU
time (all threads), the training thread's own CPU time, minor page faults (memory first touched, e.g. freshly mmapped
blocks) and wall time per step; rank 0 prints the mean over 6 steps after 2 warm-up steps.
Blocked time and CPU time depend far less on the machine's load than step time (docs/benchmarks/2026-12-01-bench.md).

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 tools/stage3_waits.py [stage]
"""

import collections
import resource
import sys
import time

import torch.distributed as dist

import zerodp
from stage3_harness import count_collectives, counts, small_gpt_engine
from zerodp.runtime import reducer
from zerodp.stage3 import units

stage = int(sys.argv[1]) if len(sys.argv) > 1 else 3
blocked: collections.Counter = collections.Counter()


def timed(name, fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            blocked[name] += time.perf_counter() - t0

    return wrapper


reducer.GradientReducer._drain = timed("reduce waits s", reducer.GradientReducer._drain)
units.ShardedUnit.finish_gather = timed("gather waits s", units.ShardedUnit.finish_gather)
count_collectives()
eng, r, step = small_gpt_engine(stage)
for _ in range(2):
    step()
N = 6
dist.barrier()
blocked.clear()
counts.clear()
sharding = getattr(eng, "sharding", None)
red0 = getattr(eng.reducer, "reduce_collectives", 0)
gat0 = sharding.coordinator.gather_collectives if sharding is not None else 0
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
c0, m0, t0 = time.process_time(), time.thread_time(), time.perf_counter()
for _ in range(N):
    step()
cpu, main, wall = time.process_time() - c0, time.thread_time() - m0, time.perf_counter() - t0
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
if r == 0:
    out = {k: round(v / N, 4) for k, v in sorted(blocked.items())}
    out.update({k: v / N for k, v in sorted(counts.items())})
    out["reduce-scatter collectives"] = (getattr(eng.reducer, "reduce_collectives", 0) - red0) / N
    if sharding is not None:
        out["all-gather collectives"] = (sharding.coordinator.gather_collectives - gat0) / N
    out.update(
        {
            "cpu s/step": round(cpu / N, 4),
            "main-thread cpu s/step": round(main / N, 4),
            "minor faults/step": round(faults / N),
            "wall s/step": round(wall / N, 4),
        }
    )
    print(f"stage {stage}:", out)
zerodp.shutdown_distributed()
