"""Worker for tests/test_engine_lifetime.py (2 ranks): engines are dropped and only rank 0 collects
them before ``zerodp.shutdown_distributed()``; both ranks must still shut down together (the shutdown
agreement may not depend on gc), and each rank reports whether its engines were collected by then."""

import gc
import json
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import zerodp
from distributed import worker_args

a = worker_args()
rank = dist.get_rank()
gc.disable()  # collections only where this worker asks for them
refs = []
for stage in (0, 2, 3):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    engine = zerodp.initialize(
        model,
        {
            "optimizer": {"type": "AdamW"},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 10},
        },
    )
    loss = engine(torch.ones(2, 32)).square().mean()
    engine.backward(loss)
    engine.step()
    refs.append(weakref.ref(engine))
    del engine, model, loss
if rank == 0:
    gc.collect()
alive = sum(r() is not None for r in refs)
Path(a.out, f"rank{rank}.json").write_text(json.dumps({"engines_alive": alive}))
zerodp.shutdown_distributed()  # rank 0 has collected two engines, rank 1 none
gc.enable()
gc.collect()
