"""Backward tags posted in one stage-3 training step of the bench's small GPT (2 ranks), by kind (counted by
wrapping ``BackwardAgreement._post``; the 4th step). Used for docs/benchmarks/2026-12-01-bench.md and
docs/benchmarks/2026-12-01-collective-guard.md ("Fewer backward tags").

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 tools/backward_tag_count.py
"""

import collections

import torch.distributed as dist

import zerodp
from zerodp.app.bench import make_batches
from zerodp.app.bench_args import PRESETS
from zerodp.app.bench_systems import SYSTEMS
from zerodp.app.model import GPTConfig
from zerodp.runtime import backward_agreement as ba

zerodp.init_distributed()
rank, world = dist.get_rank(), dist.get_world_size()
n_layer, n_head, d_model, seq_len, micro = PRESETS["small"]
cfg = GPTConfig(n_layer=n_layer, n_head=n_head, d_model=d_model, seq_len=seq_len)
batches = make_batches(cfg, micro, 5, rank, world)
seen = collections.Counter()
on = [False]
orig = ba.BackwardAgreement._post


def post(self, kind, ident):
    if on[0]:
        seen[ba.KINDS[kind]] += 1
    return orig(self, kind, ident)


ba.BackwardAgreement._post = post
s = SYSTEMS["zerodp stage 3"](cfg, 1e-3, False)
for i, (x, y) in enumerate(batches):
    on[0] = i == 3
    s.forward_backward(x, y)
    s.step()
if rank == 0:
    print(dict(seen))
zerodp.shutdown_distributed()
