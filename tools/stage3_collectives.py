"""Collectives per training step at stage 3 on the bench's small GPT (2 ranks), counted by patching
``torch.distributed``'s all-gather / reduce-scatter entry points and its coalescing manager: a coalesced
group counts once, as the backend sees it. Printed by rank 0 for 2 steps after 2 warm-up steps.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 tools/stage3_collectives.py
"""
import collections
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

import zerodp
from zerodp.app.bench_systems import loss_of
from zerodp.app.model import GPT, GPTConfig
from zerodp.runtime import comm

counts: collections.Counter = collections.Counter()
in_group = [False]


def counted(name, fn):
    def wrapper(*args, **kwargs):
        if not in_group[0]:
            counts[name] += 1
        return fn(*args, **kwargs)
    return wrapper


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
                                   "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1000}})
x = torch.randint(0, 256, (8, 129), generator=torch.Generator().manual_seed(r))


def step():
    loss = loss_of(eng(x[:, :-1])[0], x[:, 1:])
    eng.backward(loss)
    eng.step()


for _ in range(2):
    step()
counts.clear()
for _ in range(2):
    step()
if r == 0:
    print({k: v / 2 for k, v in sorted(counts.items())}, "per step (single collectives outside groups; groups)")
zerodp.shutdown_distributed()
