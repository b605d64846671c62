"""Minor page faults (all threads, ``getrusage``) per training step of zerodp on the bench's small GPT,
split into forward, backward and step, mean over the steps after 2 warm-up ones; rank 0 prints one line
per stage. Used for docs/benchmarks/2026-12-01-bench.md ("Stage 3 against DDP: the breakdown").

    OMP_NUM_THREADS=1 MALLOC_MMAP_THRESHOLD_=65536 python -m torch.distributed.run --standalone \
        --nproc-per-node 2 tools/faults_per_phase.py 0,3
"""

import resource
import sys

import torch
import torch.distributed as dist

import zerodp
from zerodp.app.bench import make_batches
from zerodp.app.bench_args import PRESETS
from zerodp.app.bench_systems import loss_of
from zerodp.app.model import GPT, GPTConfig

zerodp.init_distributed()
rank, world = dist.get_rank(), dist.get_world_size()
n_layer, n_head, d_model, seq_len, micro = PRESETS["small"]
cfg = GPTConfig(n_layer=n_layer, n_head=n_head, d_model=d_model, seq_len=seq_len)
batches = make_batches(cfg, micro, 8, rank, world)


def flt():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


for stage in map(int, sys.argv[1].split(",")):
    torch.manual_seed(0)
    m = GPT(cfg)
    eng = zerodp.initialize(
        m,
        {
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 1000},
        },
    )
    tot = [0, 0, 0]
    for i, (x, y) in enumerate(batches):
        f0 = flt()
        loss = loss_of(eng(x)[0], y)
        f1 = flt()
        eng.backward(loss)
        f2 = flt()
        eng.step()
        f3 = flt()
        if i >= 2:
            tot = [a + b for a, b in zip(tot, (f1 - f0, f2 - f1, f3 - f2), strict=True)]
    if rank == 0:
        print(stage, "faults/step fwd bwd step:", [t // (len(batches) - 2) for t in tot])
    eng.close()
zerodp.shutdown_distributed()
