"""Where the host CPU time of the overhead benchmark's step goes, without a profiler's distortion:
selected engine methods are wrapped with a ``time.thread_time`` accumulator (inclusive times: nested
entries are counted in their callers too), the rest runs as is. Model and steps as
``zerodp.app.overhead_bench`` (64 x Linear(64, 64), batch 4 per rank, AdamW); printed by rank 0 in
microseconds per step (divide by 64 for the benchmark's per-module figure), with the thread's system
time and minor page faults per step (``getrusage(RUSAGE_THREAD)``, Linux).

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        tools/overhead_breakdown.py [--systems ddp zerodp_s0 zerodp_s1 zerodp_s2] [--steps 200]
"""

import argparse
import functools
import resource
import time
from collections import defaultdict

import torch
import torch.distributed as dist

import zerodp
from zerodp.app.overhead_bench import _build
from zerodp.engine import Engine
from zerodp.offload.no_offload import NoOffload
from zerodp.runtime import grad_norm, grad_reducer
from zerodp.runtime.backward_roots import OutputRoots
from zerodp.runtime.collective_guard import CollectiveGuard
from zerodp.runtime.full_grad_reducers import AllReduceReducer, FullGradReduceScatter, _FullGradBuffer
from zerodp.runtime.grad_placeholder import GradPlaceholders
from zerodp.runtime.guards import TrainingGuards
from zerodp.runtime.partitioned_reducer import PartitionedGradReducer

TOTALS: dict[str, float] = defaultdict(float)
CALLS: dict[str, int] = defaultdict(int)

TARGETS = [
    (Engine, ["__call__", "backward", "step", "_optimizer_step", "_all_gather_params"]),
    (TrainingGuards, ["before_forward", "before_backward", "before_update", "after_update"]),
    (OutputRoots, ["record", "plan", "backward"]),
    (CollectiveGuard, ["agree"]),
    (grad_reducer.GradientReducer, ["begin_micro_step", "end_micro_step", "presence", "_hook"]),
    (_FullGradBuffer, ["zero_grads", "end_micro_step"]),
    (AllReduceReducer, ["_launch"]),
    (FullGradReduceScatter, ["_launch", "begin_micro_step"]),
    (PartitionedGradReducer, ["_launch", "zero_grads"]),
    (GradPlaceholders, ["install", "remove", "check_not_cleared"]),
    (NoOffload, ["begin_grads", "stage_grad", "step", "finish_step", "fold_edits"]),
    (grad_norm, ["clip_at_step"]),
    (torch.optim.AdamW, ["step"]),
]


def _wrap(owner, attr):
    fn = owner.__dict__.get(attr)
    if fn is None:
        return
    key = f"{getattr(owner, '__name__', owner)}.{attr}"

    @functools.wraps(fn)
    def timed(*a, **k):
        t0 = time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            TOTALS[key] += time.thread_time() - t0
            CALLS[key] += 1

    setattr(owner, attr, timed)


ap = argparse.ArgumentParser()
ap.add_argument("--systems", nargs="+", default=["ddp", "zerodp_s0", "zerodp_s1", "zerodp_s2"])
ap.add_argument("--steps", type=int, default=200)
a = ap.parse_args()
for owner, attrs in TARGETS:
    for attr in attrs:
        _wrap(owner, attr)
zerodp.init_distributed()
rank = dist.get_rank()
gen = torch.Generator().manual_seed(1000 + rank)
xs = [torch.randn(4, 64, generator=gen) for _ in range(a.steps + 3)]
for name in a.systems:
    step = _build(name, 64, 64)
    for x in xs[:3]:
        step(x)
    dist.barrier()
    TOTALS.clear()
    CALLS.clear()
    r0, c0 = resource.getrusage(resource.RUSAGE_THREAD), time.thread_time()
    for x in xs[3:]:
        step(x)
    r1, total = resource.getrusage(resource.RUSAGE_THREAD), time.thread_time() - c0
    dist.barrier()
    if rank == 0:
        print(
            f"{name}: {1e6 * total / a.steps:.0f} us per step ({1e6 * total / a.steps / 64:.1f} per module; "
            f"system {1e6 * (r1.ru_stime - r0.ru_stime) / a.steps:.0f} us, "
            f"{(r1.ru_minflt - r0.ru_minflt) / a.steps:.1f} page faults per step)"
        )
        for key, t in sorted(TOTALS.items(), key=lambda kv: -kv[1]):
            print(f"  {key:<42} {1e6 * t / a.steps:8.0f} us/step  {CALLS[key] / a.steps:6.1f} calls/step")
    del step
zerodp.shutdown_distributed()
