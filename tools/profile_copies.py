"""Where ``aten::copy_`` calls come from on the bench's small GPT (2 ranks): torch.profiler with stacks
and shapes over 4 steps after 2 warm-up steps; rank 0 prints, per origin (the innermost frame of
zerodp or of the model/bench code, else the innermost Python frame; ``<no python frame>`` for copies on
a backend's or autograd's own threads), calls per step, bytes per step and self CPU ms per step.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 tools/profile_copies.py 3
"""

import collections
import sys

import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import zerodp
from stage3_harness import small_gpt_engine

stage = int(sys.argv[1]) if len(sys.argv) > 1 else 3
N = 4
eng, r, step = small_gpt_engine(stage)
for _ in range(2):
    step()
dist.barrier()
with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_stack=True) as prof:
    for _ in range(N):
        step()
dist.barrier()
_SIZES = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2, "double": 8, "int": 4, "long int": 8}


def origin(e) -> str:
    """The innermost enclosing Python frame of zerodp (or of the harness), else the innermost enclosing
    Python frame, with the nearest enclosing op that is not an ``aten::`` one (a collective, an
    autograd node); copies without any (a backend's worker thread) are named by their thread."""
    op, frames = None, []
    parent = e.cpu_parent
    while parent is not None:
        name = parent.name
        if op is None and not name.startswith("aten::") and ".py(" not in name and "built-in" not in name:
            op = name
        if ".py(" in name:
            frames.append(name)
        parent = parent.cpu_parent
    mine = [f for f in frames if "zerodp" in f or "stage3_harness" in f]
    where = mine[0] if mine else (frames[0] if frames else f"<thread {e.thread}>")
    where = where.split("/src/")[-1].split("site-packages/")[-1]
    return f"{where} [{op or '-'}]"


if r == 0:
    calls: collections.Counter = collections.Counter()
    nbytes: collections.Counter = collections.Counter()
    cpu: collections.Counter = collections.Counter()
    for e in prof.events():
        if e.name != "aten::copy_":
            continue
        key = origin(e)
        numel = 1
        for d in e.input_shapes[0] if e.input_shapes else []:
            numel *= d
        dtype = e.input_dtypes[0] if e.input_dtypes else "float"
        calls[key] += 1
        nbytes[key] += numel * _SIZES.get(dtype, 4)
        cpu[key] += e.self_cpu_time_total
    print(
        f"stage {stage}: aten::copy_ {sum(calls.values()) / N:.0f} calls, "
        f"{sum(nbytes.values()) / N / 2**20:.1f} MiB, "
        f"{sum(cpu.values()) / N / 1e3:.1f} ms self CPU per step"
    )
    for key, c in calls.most_common():
        print(f"  {c / N:7.1f} calls {nbytes[key] / N / 2**20:8.2f} MiB {cpu[key] / N / 1e3:7.2f} ms  {key}")
zerodp.shutdown_distributed()
