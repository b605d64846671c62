"""Where the stage-3 training thread blocks, per step, on the bench's small GPT (2 ranks): seconds spent
waiting for gradient reduce-scatters (``GradientReducer._drain``) and for parameter all-gathers
(``ShardedUnit.finish_gather``), the collectives issued (``all_gather`` / ``reduce_scatter``: single
ones; ``coalesced groups``: groups; ``... collectives``: zerodp's own counts, a group once), process CPU
time (all threads) and wall time per step; rank 0 prints the mean over 6 steps after 2 warm-up steps.
Blocked time and CPU time depend far less on the machine's load than step time (docs/bench.md).

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 tools/stage3_waits.py [stage]
"""
import collections
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

import zerodp
from zerodp.app.bench_systems import loss_of
from zerodp.app.model import GPT, GPTConfig
from zerodp.runtime import comm, reducer
from zerodp.stage3 import units

stage = int(sys.argv[1]) if len(sys.argv) > 1 else 3
blocked: collections.Counter = collections.Counter()
counts: collections.Counter = collections.Counter()
in_group = [False]


def timed(name, fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            blocked[name] += time.perf_counter() - t0
    return wrapper


def counted(name, fn):
    def wrapper(*args, **kwargs):
        if not in_group[0]:
            counts[name] += 1
        return fn(*args, **kwargs)
    return wrapper


reducer.GradientReducer._drain = timed("reduce waits s", reducer.GradientReducer._drain)
units.ShardedUnit.finish_gather = timed("gather waits s", units.ShardedUnit.finish_gather)
comm._all_gather_single = counted("all_gather", comm._all_gather_single)
comm._reduce_scatter_single = counted("reduce_scatter", comm._reduce_scatter_single)
original_cm = c10d._coalescing_manager


class _Group:
    def __init__(self, *args, **kwargs):
        self.cm = original_cm(*args, **kwargs)

    def __enter__(self):
        in_group[0] = True
        return self.cm.__enter__()

    def __exit__(self, *exc):
        in_group[0] = False
        counts["coalesced groups"] += 1
        return self.cm.__exit__(*exc)


dist._coalescing_manager = _Group
zerodp.init_distributed()
r = dist.get_rank()
cfg = GPTConfig(n_layer=4, n_head=4, d_model=256, seq_len=128)
torch.manual_seed(0)
eng = zerodp.initialize(GPT(cfg), {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                                   "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 1000}})
x = torch.randint(0, 256, (8, 129), generator=torch.Generator().manual_seed(r))


def step():
    loss = loss_of(eng(x[:, :-1])[0], x[:, 1:])
    eng.backward(loss)
    eng.step()


for _ in range(2):
    step()
N = 6
dist.barrier()
blocked.clear()
counts.clear()
sharding = getattr(eng, "sharding", None)
red0 = getattr(eng.reducer, "reduce_collectives", 0)
gat0 = sharding.coordinator.gather_collectives if sharding is not None else 0
c0, t0 = time.process_time(), time.perf_counter()
for _ in range(N):
    step()
cpu, wall = time.process_time() - c0, time.perf_counter() - t0
if r == 0:
    out = {k: round(v / N, 4) for k, v in sorted(blocked.items())}
    out.update({k: v / N for k, v in sorted(counts.items())})
    out["reduce-scatter collectives"] = (getattr(eng.reducer, "reduce_collectives", 0) - red0) / N
    if sharding is not None:
        out["all-gather collectives"] = (sharding.coordinator.gather_collectives - gat0) / N
    out.update({"cpu s/step": round(cpu / N, 4), "wall s/step": round(wall / N, 4)})
    print(f"stage {stage}:", out)
zerodp.shutdown_distributed()
