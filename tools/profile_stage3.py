"""Profile one zerodp stage on the bench's small GPT (2 ranks): torch.profiler self-CPU table and
cProfile of 4 steps after 2 warm-up steps, printed by rank 0. Used for docs/benchmarks/2026-12-01-bench.md.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 tools/profile_stage3.py 3
"""

import cProfile
import io
import pstats
import sys
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import zerodp
from zerodp.app.bench_systems import loss_of
from zerodp.app.model import GPT, GPTConfig

stage = int(sys.argv[1])
zerodp.init_distributed()
r = dist.get_rank()
cfg = GPTConfig(n_layer=4, n_head=4, d_model=256, seq_len=128)
torch.manual_seed(0)
m = GPT(cfg)
eng = zerodp.initialize(
    m,
    {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 1000},
    },
)
g = torch.Generator().manual_seed(r)
x = torch.randint(0, 256, (8, 129), generator=g)


def step():
    loss = loss_of(eng(x[:, :-1])[0], x[:, 1:])
    eng.backward(loss)
    eng.step()


for _ in range(2):
    step()

pr = cProfile.Profile()
dist.barrier()
t0 = time.perf_counter()
with profile(activities=[ProfilerActivity.CPU]) as prof:
    pr.enable()
    for _ in range(4):
        step()
    pr.disable()
dist.barrier()
if r == 0:
    print("stage", stage, "s/step", (time.perf_counter() - t0) / 4)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22)
    print(s.getvalue()[:6000])
zerodp.shutdown_distributed()
